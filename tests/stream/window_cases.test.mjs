// SPDX-License-Identifier: MIT
// The browser module's stream rules (examples/ai_chat/web/chat_stream.js) under node's test
// runner: the shared case table (window_cases.json, also run against the C++ Window and
// Reassembler by tests/unit/stream_cases_test.cpp), a random model check, the SSE parser and
// the chunk ids.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { dirname, join } from 'node:path';

import {
  ChunkOverlap, Reassembler, SseParser, StreamError, Window, WindowFull, base64ToBytes, chunkId,
  parseChunkId,
} from '../../examples/ai_chat/web/chat_stream.js';

const here = dirname(fileURLToPath(import.meta.url));
const table = JSON.parse(readFileSync(join(here, 'window_cases.json'), 'utf8'));

function optionsOf(c) {
  const o = c.options || {};
  return { maxPending: o.max_pending, maxAhead: o.max_ahead, maxBufferedBytes: o.max_buffered_bytes };
}

function thrownBy(fn) {
  try {
    fn();
  } catch (e) {
    if (e instanceof WindowFull) return 'WindowFull';
    if (e instanceof ChunkOverlap) return 'ChunkOverlap';
    if (e instanceof StreamError) return 'invalid_argument';
    throw e;
  }
  return 'nothing';
}

const hex = (bytes) => Buffer.from(bytes).toString('hex');
const bytesOf = (step, textField, hexField) =>
  step[hexField] !== undefined ? new Uint8Array(Buffer.from(step[hexField], 'hex'))
    : new TextEncoder().encode(step[textField]);

test('the case table has cases of both kinds', () => {
  assert.ok(table.window.length >= 10);
  assert.ok(table.reassembler.length >= 4);
});

for (const c of table.window) {
  test(`window: ${c.name}`, () => {
    const start = c.start ?? 0;
    if (c.construct_throws) {
      assert.equal(thrownBy(() => new Window(optionsOf(c), start)), c.construct_throws);
      return;
    }
    const w = new Window(optionsOf(c), start);
    c.steps.forEach((step, n) => {
      const where = `step ${n}: ${JSON.stringify(step)}`;
      if (step.admit) {
        let got;
        const err = thrownBy(() => {
          got = step.admit.length === 1 ? { fresh: w.admitOne(step.admit[0]) }
            : w.admit(step.admit[0], step.admit[1]);
        });
        if (step.throws) {
          assert.equal(err, step.throws, where);
          return;
        }
        assert.equal(err, 'nothing', where);
        assert.equal(got.fresh, step.fresh, where);
        if (step.admit.length === 2) {
          assert.equal(got.begin, step.begin ?? 0, where);
          assert.equal(got.end, step.end ?? 0, where);
          assert.equal(got.whole, step.whole ?? false, where);
        }
      } else if (step.seen) {
        assert.equal(w.seen(step.seen[0], step.seen[1]), step.expect, where);
      } else {
        const s = step.state;
        if ('watermark' in s) assert.equal(w.watermark, s.watermark, where);
        if ('pending' in s) assert.equal(w.pending, s.pending, where);
        if ('duplicates' in s) assert.equal(w.duplicates, s.duplicates, where);
      }
    });
  });
}

for (const c of table.reassembler) {
  test(`reassembler: ${c.name}`, () => {
    const start = c.start ?? 0;
    if (c.construct_throws) {
      assert.equal(thrownBy(() => new Reassembler(optionsOf(c), start)), c.construct_throws);
      return;
    }
    const r = new Reassembler(optionsOf(c), start);
    c.steps.forEach((step, n) => {
      const where = `step ${n}: ${JSON.stringify(step)}`;
      if (step.push !== undefined) {
        let out;
        const err = thrownBy(() => { out = r.push(step.push, bytesOf(step, 'body', 'hex')); });
        if (step.throws) {
          assert.equal(err, step.throws, where);
          return;
        }
        assert.equal(err, 'nothing', where);
        assert.equal(hex(out), hex(bytesOf(step, 'out', 'out_hex')), where);
      } else {
        const s = step.state;
        if ('delivered_end' in s) assert.equal(r.deliveredEnd, s.delivered_end, where);
        if ('buffered_bytes' in s) assert.equal(r.bufferedBytes, s.buffered_bytes, where);
        if ('duplicates' in s) assert.equal(r.duplicates, s.duplicates, where);
        if ('pending' in s) assert.equal(r.window.pending, s.pending, where);
        if ('last_chunk_offset' in s) assert.equal(r.lastChunkOffset, s.last_chunk_offset, where);
      }
    });
  });
}

// The same model check as the C++ StreamWindow.RandomReplayAndReorderMatchesASetModel.
test('window: random replays and reordering match a set model', () => {
  let seed = 42;
  const rand = () => (seed = (seed * 1103515245 + 12345) % 2147483648);
  const w = new Window({ maxPending: 1024, maxAhead: 2 ** 20 });
  const seen = new Array(4000).fill(false);
  let fresh = 0;
  for (let round = 0; round < 20000; ++round) {
    let o = w.watermark + (rand() % 24);
    o = o >= 8 ? o - 8 : o;
    if (o >= seen.length) continue;
    assert.equal(w.admitOne(o), !seen[o], `offset ${o}`);
    if (!seen[o]) ++fresh;
    seen[o] = true;
  }
  let wm = 0;
  while (wm < seen.length && seen[wm]) ++wm;
  assert.equal(w.watermark, wm);
  assert.ok(fresh > 1000);
});

test('reassembler: random chunks, replays and swaps give the text once, in order', () => {
  const text = new TextEncoder().encode('Ünïcödé 😀 中文 ß '.repeat(200));
  let seed = 7;
  const rand = () => (seed = (seed * 1103515245 + 12345) % 2147483648);
  const chunks = [];
  for (let at = 0; at < text.length;) {
    const n = Math.min(1 + (rand() % 9), text.length - at);
    chunks.push([at, text.subarray(at, at + n)]);
    at += n;
  }
  const wire = [];
  chunks.forEach((c, i) => {
    wire.push(c);
    if (i % 13 === 12) wire.push(...chunks.slice(i - 3, i + 1)); // a replayed tail
  });
  for (let i = 2; i + 1 < wire.length; i += 7) [wire[i], wire[i + 1]] = [wire[i + 1], wire[i]];
  const r = new Reassembler();
  const decoder = new TextDecoder('utf-8', { fatal: true });
  let shown = '';
  for (const [offset, body] of wire) shown += decoder.decode(r.push(offset, body), { stream: true });
  shown += decoder.decode();
  assert.equal(shown, new TextDecoder().decode(text));
  assert.equal(r.duplicates, wire.length - chunks.length);
});

test('sse parser: fields, comments, CRLF and lines split across pushes', () => {
  const p = new SseParser();
  assert.deepEqual(p.push(': keepalive\n\nid: chat_1_0\nevent: chunk\ndata: aGk=\n'), []);
  assert.deepEqual(p.push('\n'), [{ id: 'chat_1_0', event: 'chunk', data: 'aGk=' }]);
  assert.deepEqual(p.push('id: chat_1_2\r'), []);
  assert.deepEqual(p.push('\nevent: chu'), []);
  assert.deepEqual(p.push('nk\r\ndata:eQ==\r\n\r\nevent: done\rdata: {"length":3}\r\r'), [
    { id: 'chat_1_2', event: 'chunk', data: 'eQ==' },
    { id: null, event: 'done', data: '{"length":3}' },
  ]);
  assert.deepEqual(p.push('data: a\ndata: b\n\n'), [{ id: null, event: 'message', data: 'a\nb' }]);
});

test('chunk ids: <request_id>_<offset>, and only of this stream', () => {
  assert.equal(chunkId('chat_10001', 10), 'chat_10001_10');
  assert.equal(parseChunkId('chat_10001', 'chat_10001_10'), 10);
  assert.equal(parseChunkId('chat_10001', 'chat_10001_0'), 0);
  assert.equal(parseChunkId('chat_10001', 'chat_1000_10'), null);
  assert.equal(parseChunkId('chat_10001', 'chat_10001_x'), null);
  assert.equal(parseChunkId('chat_10001', null), null);
  assert.deepEqual([...base64ToBytes('8J+YgA==')], [0xf0, 0x9f, 0x98, 0x80]);
});

test('bad offsets and caps are typed errors', () => {
  const w = new Window();
  assert.throws(() => w.admit(-1, 1), StreamError);
  assert.throws(() => w.admit(2 ** 53, 1), StreamError);
  assert.throws(() => w.admit(0.5, 1), StreamError);
  assert.throws(() => new Window({ maxPending: -1 }), StreamError);
  assert.equal(w.watermark, 0);
});
