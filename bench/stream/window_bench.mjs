// SPDX-License-Identifier: MIT
// The browser module (examples/ai_chat/web/chat_stream.js) in node: Window admissions per
// second on the workload of stream_bench.cpp (unit offsets, 10 % replays, short-range swaps)
// against a JavaScript Set of seen offsets, and whole chunk events per second (SSE parsing,
// base64, Reassembler, streaming UTF-8 decoding). Interleaved runs, medians.
import { ChatStream, Window } from '../../examples/ai_chat/web/chat_stream.js';

const n = Number(process.argv[2] || 2_000_000);
const rounds = 5;

function workload(size) {
  const out = [];
  let seed = 1;
  const rand = () => (seed = (seed * 1103515245 + 12345) % 2147483648);
  let next = 0;
  while (out.length < size) {
    out.push(next++);
    if (rand() % 10 === 0 && next > 8) out.push(next - 1 - (rand() % 8));
  }
  for (let i = 1; i + 1 < out.length; i += 37) [out[i], out[i + 1]] = [out[i + 1], out[i]];
  return out;
}

const median = (v) => [...v].sort((a, b) => a - b)[v.length >> 1];
const work = workload(n);

function windowRun() {
  const w = new Window();
  let fresh = 0;
  for (const o of work) if (w.admitOne(o)) ++fresh;
  return fresh;
}
function setRun() {
  const seen = new Set();
  let fresh = 0;
  for (const o of work) if (!seen.has(o)) { seen.add(o); ++fresh; }
  return fresh;
}

// An SSE body of 1..12-byte chunks of a multi-byte answer, with replays, as a server sends it.
const answer = Buffer.from('Ünïcödé 😀 中文 stream chunk offset ß '.repeat(4000));
let sse = '';
let events = 0;
{
  let seed = 3;
  const rand = () => (seed = (seed * 1103515245 + 12345) % 2147483648);
  const sent = [];
  for (let at = 0; at < answer.length;) {
    const len = Math.min(1 + (rand() % 12), answer.length - at);
    sent.push([at, answer.subarray(at, at + len)]);
    at += len;
  }
  sent.forEach(([at, bytes], i) => {
    const emit = ([o, b]) => {
      sse += `id: chat_1_${o}\nevent: chunk\ndata: ${b.toString('base64')}\n\n`;
      ++events;
    };
    emit([at, bytes]);
    if (i % 20 === 19) sent.slice(i - 2, i + 1).forEach(emit);
  });
  sse += `event: done\ndata: {"length":${answer.length}}\n\n`;
}
const sseBytes = new TextEncoder().encode(sse);

async function streamRun() {
  let text = '';
  const fetch = async () => new Response(new ReadableStream({
    start(c) {
      for (let at = 0; at < sseBytes.length; at += 16384) c.enqueue(sseBytes.subarray(at, at + 16384));
      c.close();
    },
  }), { status: 200 });
  const s = new ChatStream({ requestId: 'chat_1', fetch, onText: (t) => { text += t; } });
  await s.run();
  if (Buffer.from(text).compare(answer) !== 0) throw new Error('stream text differs');
  return s.counters.chunks;
}

const a = [];
const b = [];
const c = [];
let fa = 0;
let fb = 0;
for (let r = 0; r < rounds; ++r) {
  let t0 = performance.now();
  fa = windowRun();
  a.push(work.length / ((performance.now() - t0) / 1000));
  t0 = performance.now();
  fb = setRun();
  b.push(work.length / ((performance.now() - t0) / 1000));
  t0 = performance.now();
  const got = await streamRun();
  c.push(got / ((performance.now() - t0) / 1000));
}
if (fa !== fb) {
  console.log(`MISMATCH: window admitted ${fa}, Set ${fb}`);
  process.exit(1);
}
console.log(`workload: ${work.length} offsets, ${fa} distinct; ${events} chunk events of ` +
  `${answer.length} bytes; ${rounds} interleaved runs, node ${process.version}`);
console.log(`browser module Window (node): ${(median(a) / 1e6).toFixed(1)} M admissions/s (median)`);
console.log(`JavaScript Set:               ${(median(b) / 1e6).toFixed(1)} M admissions/s (median)`);
console.log(`browser module ChatStream (SSE parse + base64 + Reassembler + UTF-8): ` +
  `${(median(c) / 1e3).toFixed(0)} k chunk events/s (median)`);
console.log(`ratio js_window_vs_set = ${(median(a) / median(b)).toFixed(2)}`);
