// SPDX-License-Identifier: MIT
// examples/ai_chat in a real browser: Debian's headless Chromium driven by puppeteer-core.
// Two ai_chat processes share one SQLite file; the page streams from both (each reconnect goes
// to the other process, mid-stream), with every fault switch on. What a person sees is checked:
// the page's text equals the generator's answer byte for byte (multi-byte characters split
// across chunks included), the duplicate counter equals the replays the servers injected, and a
// screenshot of the final page is kept (IDEM_BROWSER_ARTIFACTS, the build folder).
//
// A third test runs 5 chats the same way on PostgreSQL (two processes on one schema).
//
// Environment: AI_CHAT_BIN (the server), IDEM_BROWSER_ARTIFACTS (screenshot and databases),
// IDEM_CHROMIUM (default /usr/bin/chromium), IDEM_TEST_POSTGRES_DSN (the PostgreSQL test). Without Chromium or puppeteer-core the tests skip,
// except under IDEM_REQUIRE_SERVERS=1 (scripts/test.sh), where they fail.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const required = process.env.IDEM_REQUIRE_SERVERS === '1';
const chromium = process.env.IDEM_CHROMIUM || '/usr/bin/chromium';
const serverBin = process.env.AI_CHAT_BIN;
const artifacts = process.env.IDEM_BROWSER_ARTIFACTS || tmpdir();

let puppeteer = null;
let missing = null;
if (!serverBin || !existsSync(serverBin)) missing = `AI_CHAT_BIN (${serverBin}) is not a file`;
else if (!existsSync(chromium)) missing = `${chromium} is missing (scripts/bootstrap.sh installs chromium)`;
else {
  try {
    puppeteer = (await import('puppeteer-core')).default;
  } catch (e) {
    missing = `puppeteer-core is not installed in tests/browser (npm ci): ${e.message}`;
  }
}
if (missing && required) throw new Error(`${missing} (required under scripts/test.sh)`);
const skip = missing ? `skipped: ${missing}` : false;

const children = new Set();
const workDir = mkdtempSync(join(tmpdir(), 'idem-ai-chat-'));
let browser = null;

// Starts an ai_chat process on a free port on `backend` (['--db', path] or ['--postgres', dsn,
// '--pg-schema', name]); resolves with its base URL.
function startServer(backend, args = []) {
  const child = spawn(serverBin, ['--port', '0', ...backend, ...args],
    { stdio: ['ignore', 'pipe', 'pipe'] });
  children.add(child);
  child.on('exit', () => children.delete(child));
  let err = '';
  child.stderr.on('data', (d) => { err += d; });
  return new Promise((resolve, reject) => {
    let out = '';
    const timer = setTimeout(() => reject(new Error(`ai_chat did not start: ${err}`)), 10000);
    child.stdout.on('data', (d) => {
      out += d;
      const m = /listening on (http:\/\/[0-9.]+:[0-9]+)/.exec(out);
      if (m) {
        clearTimeout(timer);
        resolve({ child, url: m[1] });
      }
    });
    child.on('exit', (code) => reject(new Error(`ai_chat exited (${code}): ${err}`)));
  });
}

function stopServer(s) {
  if (s.child.exitCode === null && s.child.signalCode === null) s.child.kill('SIGTERM');
}

async function json(url) {
  const res = await fetch(url);
  assert.equal(res.status, 200, url);
  return res.json();
}

async function originalBytes(base, requestId) {
  const res = await fetch(`${base}/chats/${requestId}/original`);
  assert.equal(res.status, 200);
  return Buffer.from(await res.arrayBuffer());
}

// The chunks of a finished chat as a fault-free stream serves them: contiguous, no overlap.
async function storedChunks(base, requestId) {
  const res = await fetch(`${base}/chats/${requestId}/events`);
  const body = await res.text();
  const chunks = [];
  for (const block of body.split('\n\n')) {
    const id = /^id: (.*)$/m.exec(block);
    const data = /^data: (.*)$/m.exec(block);
    if (id && /^event: chunk$/m.test(block)) {
      chunks.push({ offset: Number(id[1].slice(requestId.length + 1)),
                    bytes: Buffer.from(data[1], 'base64') });
    }
  }
  return chunks;
}

async function openPage(query) {
  const page = await browser.newPage();
  await page.setViewport({ width: 1100, height: 900 });
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  await page.goto(query, { waitUntil: 'load' });
  await page.waitForSelector('#send:not([disabled])');
  return { page, errors };
}

// Types a prompt, clicks Send, waits for the answer; returns what the page shows.
async function chat(page, prompt, onStreaming) {
  await page.$eval('#prompt', (el, v) => { el.value = v; }, prompt);
  const before = await page.$eval('#chats', (el) => el.textContent);
  await page.click('#send');
  if (onStreaming) await onStreaming();
  await page.waitForFunction(
    (n) => document.getElementById('chats').textContent !== n ||
      document.getElementById('status').className === 'error',
    { timeout: 60000, polling: 50 }, before);
  return page.evaluate(() => {
    const text = (id) => document.getElementById(id).textContent;
    return {
      status: text('status'), requestId: text('request-id'), answer: text('answer'),
      chunks: Number(text('chunks')), duplicates: Number(text('duplicates')),
      outOfOrder: Number(text('out-of-order')), reconnects: Number(text('reconnects')),
      bytes: Number(text('bytes')),
    };
  });
}

before(async () => {
  if (skip) return;
  const profile = mkdtempSync(join(workDir, 'chromium-'));
  browser = await puppeteer.launch({
    executablePath: chromium,
    headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync',
      `--user-data-dir=${profile}`],
  });
});

after(async () => {
  if (browser) await browser.close();
  for (const c of children) c.kill('SIGKILL');
  rmSync(workDir, { recursive: true, force: true });
});

// Runs `n` chats through the page (faults as its URL says) and checks each: the text byte for
// byte, duplicates = the replays both servers injected, out of order = the swaps, reconnects =
// the streams ended early (dropped as asked, or broken), one generation. @returns the servers'
// counters summed over the chats.
async function faultyChats(page, a, b, n) {
  const total = { split: 0, liveRemote: 0, freshA: 0, freshB: 0, retries: 0, skipped: 0,
    reordered: 0, replayed: 0, broken: 0 };
  for (let i = 0; i < n; ++i) {
    const shown = await chat(page, `question ${i}: what does exactly once mean? ✓`);
    assert.equal(shown.status, 'done', `chat ${i}: ${shown.status}`);
    const id = shown.requestId;
    const original = await originalBytes(a.url, id);
    assert.ok(original.length > 1400, `chat ${i}: answer of ${original.length} bytes`);
    // Byte for byte: the page's text, encoded as UTF-8, is the generator's answer.
    assert.equal(Buffer.from(shown.answer, 'utf8').toString('hex'), original.toString('hex'),
      `chat ${id}: the page shows other text`);
    assert.ok(!shown.answer.includes('\uFFFD'), `chat ${id}: a replacement character`);
    assert.equal(shown.bytes, original.length);
    // Each reconnect follows a stream that ended early: dropped as the URL asked, or broken (a
    // write that timed out on the loaded machine, a connection the page left after a resync).
    // The server counts a broken stream when it notices, which can be after the page is done.
    let sa, sb;
    for (const deadline = Date.now() + 5000; ;) {
      sa = await json(`${a.url}/chats/${id}/stats`);
      sb = await json(`${b.url}/chats/${id}/stats`);
      const ended = sa.dropped + sb.dropped + sa.broken + sb.broken;
      if (ended >= shown.reconnects || Date.now() > deadline) break;
      await new Promise((r) => setTimeout(r, 50));
    }
    // Every chunk the servers replayed was dropped, and nothing else was.
    assert.equal(shown.duplicates, sa.replayed + sb.replayed, `chat ${id}: duplicates`);
    assert.equal(shown.chunks, sa.fresh_events + sb.fresh_events + sa.replayed + sb.replayed,
      `chat ${id}: chunk events received vs sent`);
    assert.equal(shown.outOfOrder, sa.reordered + sb.reordered, `chat ${id}: reordered`);
    assert.equal(shown.reconnects, sa.dropped + sb.dropped + sa.broken + sb.broken,
      `chat ${id}: reconnects (dropped ${sa.dropped}+${sb.dropped}, broken ${sa.broken}+${sb.broken})`);
    assert.equal(sa.connections + sb.connections, shown.reconnects + 1, `chat ${id}: connections`);
    assert.ok(sa.dropped + sb.dropped >= 2, `chat ${id}: ${sa.dropped + sb.dropped} dropped`);
    assert.equal(sa.generations + sb.generations, 1, `chat ${id}: generations`);
    const state = await json(`${b.url}/chats/${id}`);
    assert.equal(state.status, 'done');
    assert.equal(state.generations, 1);
    total.split += sa.split_characters + sb.split_characters;
    total.liveRemote += sa.live_remote + sb.live_remote;
    total.freshA += sa.fresh_events;
    total.freshB += sb.fresh_events;
    total.retries += sa.generator_retries + sb.generator_retries;
    total.skipped += sa.producer_dropped_bytes + sb.producer_dropped_bytes;
    total.reordered += sa.reordered + sb.reordered;
    total.replayed += sa.replayed + sb.replayed;
    total.broken += sa.broken + sb.broken;
  }
  return total;
}

test('20 chats with every fault on, two processes on one database: each byte shown once',
  { skip, timeout: 180000 }, async () => {
    const db = ['--db', join(workDir, 'chat.sqlite')];
    const args = ['--token-delay-us', '1000'];
    const a = await startServer(db, args);
    const b = await startServer(db, args);
    try {
      const query = new URLSearchParams({ servers: `${a.url},${b.url}`, length: '1500',
        retries: '1', drop_every: '20', replay: '3', reorder: '7' });
      const { page, errors } = await openPage(`${a.url}/?${query}`);
      const total = await faultyChats(page, a, b, 20);
      // The faults really happened, in both processes, while the answers were being generated.
      assert.ok(total.split > 100, `chunks ending inside a character: ${total.split}`);
      assert.ok(total.liveRemote > 100, `events from the non-generating process mid-stream: ${total.liveRemote}`);
      assert.ok(total.freshA > 1000 && total.freshB > 1000, JSON.stringify(total));
      assert.ok(total.retries > 20 && total.skipped > 100, `generator retries ${JSON.stringify(total)}`);
      assert.ok(total.reordered > 100 && total.replayed > 100, JSON.stringify(total));
      assert.equal(await page.$eval('#chats', (el) => el.textContent), '20');
      assert.deepEqual(errors, []);
      mkdirSync(artifacts, { recursive: true });
      await page.screenshot({ path: join(artifacts, 'ai_chat_browser.png'), fullPage: true });
      await page.close();
      console.log(`20 chats: ${JSON.stringify(total)}; screenshot ${join(artifacts, 'ai_chat_browser.png')}`);
    } finally {
      stopServer(a);
      stopServer(b);
    }
  });

test('the generating process is killed mid-stream: the other takes over, each byte shown once',
  { skip, timeout: 120000 }, async () => {
    const db = ['--db', join(workDir, 'kill.sqlite')];
    const args = ['--token-delay-us', '3000', '--lease-ms', '600'];
    const a = await startServer(db, args);
    const b = await startServer(db, args);
    try {
      const query = new URLSearchParams({ servers: `${a.url},${b.url}`, length: '3000',
        retries: '1', drop_every: '15', replay: '0', reorder: '0' });
      const { page, errors } = await openPage(`${a.url}/?${query}`);
      let shownAtKill = 0;
      const t0 = Date.now();
      const shown = await chat(page, 'a long answer, please: 中文 😀', async () => {
        // The POST went to the first server, which generates: kill it once text is showing.
        await page.waitForFunction(() => Number(document.getElementById('bytes').textContent) > 400,
          { timeout: 30000, polling: 10 });
        a.child.kill('SIGKILL');
        shownAtKill = await page.$eval('#bytes', (el) => Number(el.textContent));
      });
      assert.equal(shown.status, 'done', shown.status);
      console.log(`killed at ${shownAtKill} bytes; ${shown.reconnects} reconnects, ${Date.now() - t0} ms`);
      const id = shown.requestId;
      const original = await originalBytes(b.url, id);
      assert.ok(shownAtKill < original.length, `killed at ${shownAtKill} of ${original.length}`);
      assert.equal(Buffer.from(shown.answer, 'utf8').toString('hex'), original.toString('hex'));
      // No replays injected and the kill cut a connection (events in flight were lost, and sent
      // again): nothing is a duplicate, although the new owner's model started over at other
      // chunk boundaries (its ProducerDedup starts at the stored prefix).
      assert.equal(shown.duplicates, 0);
      const state = await json(`${b.url}/chats/${id}`);
      assert.equal(state.status, 'done');
      assert.equal(state.generations, 2, 'the second process took the generation over');
      const sb = await json(`${b.url}/chats/${id}/stats`);
      assert.equal(sb.generations, 1);
      assert.ok(sb.producer_dropped_bytes >= shownAtKill, JSON.stringify(sb));
      // The table holds the answer once: contiguous chunks, no overlap, no gap.
      const chunks = await storedChunks(b.url, id);
      let end = 0;
      for (const c of chunks) {
        assert.equal(c.offset, end, `chunk at ${c.offset} after ${end}`);
        end += c.bytes.length;
      }
      assert.equal(Buffer.concat(chunks.map((c) => c.bytes)).toString('hex'),
        original.toString('hex'));
      assert.deepEqual(errors, []);
      await page.close();
    } finally {
      stopServer(a);
      stopServer(b);
    }
  });

const dsn = process.env.IDEM_TEST_POSTGRES_DSN;
if (!skip && !dsn && required) {
  throw new Error('IDEM_TEST_POSTGRES_DSN is not set (required under scripts/test.sh)');
}

test('on PostgreSQL: 5 chats with every fault on, two processes on one database',
  { skip: skip || (dsn ? false : 'skipped: IDEM_TEST_POSTGRES_DSN is not set'), timeout: 180000 },
  async () => {
    const schema = `idem_browser_${process.pid}`;
    const backend = ['--postgres', dsn, '--pg-schema', schema];
    const args = ['--token-delay-us', '1000'];
    const a = await startServer(backend, args);
    const b = await startServer(backend, args);
    try {
      const query = new URLSearchParams({ servers: `${a.url},${b.url}`, length: '1500',
        retries: '1', drop_every: '20', replay: '3', reorder: '7' });
      const { page, errors } = await openPage(`${b.url}/?${query}`);
      const total = await faultyChats(page, a, b, 5);
      assert.ok(total.split > 20 && total.replayed > 20 && total.reordered > 20,
        JSON.stringify(total));
      assert.ok(total.freshA > 100 && total.freshB > 100, JSON.stringify(total));
      assert.deepEqual(errors, []);
      await page.close();
    } finally {
      stopServer(a);
      stopServer(b);
      await Promise.all([a, b].map((s) => new Promise((r) => {
        if (s.child.exitCode !== null || s.child.signalCode !== null) r();
        else s.child.on('exit', r);
      })));
      // The schema of this run: dropped with psql (postgresql-client, see bootstrap.sh).
      const drop = spawn('psql', [dsn, '-qc', `DROP SCHEMA IF EXISTS ${schema} CASCADE`],
        { stdio: 'ignore' });
      await new Promise((r) => drop.on('exit', r));
    }
  });
