// SPDX-License-Identifier: MIT
// The page of examples/ai_chat: POST /chats (Idempotency-Key, retried on another server when
// one fails), then a ChatStream that shows each byte of the answer once and the counters.
// Query parameters prefill the form: servers (comma-separated base URLs), length, retries,
// drop_every, abort, replay, reorder.
import { ChatStream } from './chat_stream.js';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
for (const name of ['length', 'drop_every', 'replay', 'reorder']) {
  if (params.has(name)) $(name).value = params.get(name);
}
if (params.has('retries')) $('retries').checked = params.get('retries') !== '0';
if (params.has('abort')) $('abort').checked = params.get('abort') === '1';
if (params.has('servers')) $('servers').value = params.get('servers');

const servers = () => {
  const list = $('servers').value.split(',').map((s) => s.trim().replace(/\/$/, ''));
  const chosen = list.filter((s) => s !== '');
  return chosen.length > 0 ? chosen : [''];
};

const newKey = () => (crypto.randomUUID ? crypto.randomUUID()
  : `${Date.now()}-${Math.random().toString(36).slice(2)}`);

// POST /chats with one Idempotency-Key, on the next server after a failure: one chat whatever
// the number of attempts.
async function createChat(list, body) {
  const key = `"${newKey()}"`;
  let last = '';
  for (let attempt = 0; attempt < 3 * list.length; ++attempt) {
    const base = list[attempt % list.length];
    try {
      const res = await fetch(`${base}/chats`, {
        method: 'POST',
        headers: { 'Content-Type': 'application/json', 'Idempotency-Key': key },
        body: JSON.stringify(body),
      });
      if (res.status === 201) return (await res.json()).request_id;
      last = `${res.status} ${await res.text()}`;
      if (res.status < 500 && res.status !== 409) break;  // a client error: do not retry
      await new Promise((r) => setTimeout(r, 100 * (attempt + 1)));
    } catch (e) {
      last = String(e);
    }
  }
  throw new Error(`POST /chats failed: ${last}`);
}

function show(c) {
  $('chunks').textContent = c.chunks;
  $('duplicates').textContent = c.duplicates;
  $('out-of-order').textContent = c.outOfOrder;
  $('reconnects').textContent = c.reconnects;
  $('bytes').textContent = c.bytes;
  $('server').textContent = c.server || location.origin;
}

let chats = 0;
let running = false;

async function send() {
  if (running) return;
  running = true;
  $('send').disabled = true;
  const status = $('status');
  status.className = '';
  status.textContent = 'starting';
  const answer = $('answer');
  answer.textContent = '';
  $('request-id').textContent = '–';
  try {
    const list = servers();
    const requestId = await createChat(list, {
      prompt: $('prompt').value,
      length: Number($('length').value),
      retries: $('retries').checked,
    });
    $('request-id').textContent = requestId;
    status.textContent = 'streaming';
    const query = new URLSearchParams();
    for (const name of ['drop_every', 'replay', 'reorder']) query.set(name, $(name).value || '0');
    if ($('abort').checked) query.set('abort', '1');
    // One text node that only grows: nothing shown is ever rewritten.
    const text = document.createTextNode('');
    answer.append(text);
    const stream = new ChatStream({
      requestId, servers: list, query: query.toString(),
      onText: (t) => text.appendData(t), onUpdate: show,
    });
    const result = await stream.run();
    show(result.counters);
    $('chats').textContent = ++chats;
    status.textContent = 'done';
    status.className = 'done';
  } catch (e) {
    status.textContent = `error: ${e.message}`;
    status.className = 'error';
  } finally {
    running = false;
    $('send').disabled = false;
  }
}

$('form').addEventListener('submit', (e) => {
  e.preventDefault();
  send();
});
