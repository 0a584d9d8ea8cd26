// SPDX-License-Identifier: MIT
// The browser half of idem::stream: the same watermark + bounded out-of-order window as the C++
// idem::stream::Window, a Reassembler of bytes, and a resumable server-sent-events reader that
// reconnects (to the next server of a list) with Last-Event-ID and renders each byte once.
//
// Plain ES module, no build step, no dependency: runs in a browser and in node (>= 18).
// The rules of Window and Reassembler are checked against the C++ classes by one table of cases
// (tests/stream/window_cases.json), run by the C++ tests and by `node --test`.
//
//   import { ChatStream } from './chat_stream.js';
//   const stream = new ChatStream({ requestId: 'chat_10001', servers: ['', 'http://b:8081'],
//                                   onText: (t) => answer.append(t) });
//   const result = await stream.run();      // { length, counters }
//
// Offsets are byte offsets of the UTF-8 answer. Chunk bodies travel base64-encoded (an SSE
// `data:` line is text, and a chunk may end inside a multi-byte character); the bytes that become
// contiguous go through one streaming TextDecoder, so a character split across chunks is shown
// once it is complete, never as a replacement character.

/** Base of the stream errors (a cap too small for the transport, a broken offset contract). */
export class StreamError extends Error {
  constructor(message) {
    super(message);
    this.name = 'StreamError';
  }
}

/** A cap of the window was reached; the window is unchanged (the chunk was not admitted). */
export class WindowFull extends StreamError {
  constructor(message) {
    super(message);
    this.name = 'WindowFull';
  }
}

/** A chunk would leave more than one unseen piece (boundaries changed between deliveries). */
export class ChunkOverlap extends StreamError {
  constructor(message) {
    super(message);
    this.name = 'ChunkOverlap';
  }
}

/** The server refused the stream (unknown chat, bad Last-Event-ID): retrying will not help. */
export class StreamRefused extends StreamError {
  constructor(message, status) {
    super(message);
    this.name = 'StreamRefused';
    this.status = status;
  }
}

function checkedEnd(offset, length) {
  if (!Number.isSafeInteger(offset) || offset < 0 || !Number.isSafeInteger(length) || length < 0) {
    throw new StreamError(`chat_stream: bad chunk [${offset}, +${length})`);
  }
  const end = offset + length;
  if (!Number.isSafeInteger(end)) {
    throw new StreamError(`chat_stream: chunk [${offset}, +${length}) overflows safe integers`);
  }
  return end;
}

const kNothing = Object.freeze({ begin: 0, end: 0, whole: false, fresh: false });

/**
 * Consumer window: a watermark (everything below it was seen) plus a sorted array of
 * out-of-order intervals above it, merged as they touch. Same rules as idem::stream::Window.
 */
export class Window {
  /**
   * @param {{maxPending?: number, maxAhead?: number}} options caps (positive)
   * @param {number} start the offset the stream starts at
   */
  constructor(options = {}, start = 0) {
    this.options = { maxPending: options.maxPending ?? 64, maxAhead: options.maxAhead ?? 2 ** 24 };
    if (!(this.options.maxPending > 0) || !(this.options.maxAhead > 0)) {
      throw new StreamError('chat_stream.Window: maxPending and maxAhead must be positive');
    }
    checkedEnd(start, 0);
    this.watermark = start;
    this.duplicates = 0;
    this._b = []; // interval starts, ascending
    this._e = []; // interval ends
  }

  /** Out-of-order intervals held. */
  get pending() {
    return this._b.length;
  }

  /**
   * Admits the chunk [offset, offset + length).
   * @returns {{begin: number, end: number, whole: boolean, fresh: boolean}} the new part
   * @throws {WindowFull} past a cap; {ChunkOverlap}; the window is then unchanged
   */
  admit(offset, length) {
    const end = checkedEnd(offset, length);
    if (length === 0) return kNothing;  // nothing to see, wherever it lies; not a duplicate
    if (end <= this.watermark) {
      ++this.duplicates;
      return kNothing;
    }
    if (this._b.length === 0 && offset <= this.watermark) {
      const a = { begin: this.watermark, end, whole: offset === this.watermark, fresh: true };
      this.watermark = end;
      return a;
    }
    return this._admitSlow(offset, end);
  }

  /** Unit offsets (one token per offset): true when `offset` was not seen before. */
  admitOne(offset) {
    // The in-order and replay cases without allocating an Admission.
    if (this._b.length === 0 && Number.isSafeInteger(offset) && offset >= 0 &&
        offset <= this.watermark && offset < Number.MAX_SAFE_INTEGER) {
      if (offset < this.watermark) {
        ++this.duplicates;
        return false;
      }
      this.watermark = offset + 1;
      return true;
    }
    return this.admit(offset, 1).fresh;
  }

  /** True if every byte of [offset, offset + length) was seen. */
  seen(offset, length = 1) {
    const end = checkedEnd(offset, length);
    if (end <= this.watermark) return true;
    const b = Math.max(offset, this.watermark);
    const i = this._firstEndingAfter(b);
    return i < this._b.length && this._b[i] <= b && this._e[i] >= end;
  }

  _firstEndingAfter(v) {
    let lo = 0;
    let hi = this._e.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (v < this._e[mid]) hi = mid;
      else lo = mid + 1;
    }
    return lo;
  }

  _admitSlow(offset, end) {
    const b = Math.max(offset, this.watermark);
    let i = this._firstEndingAfter(b);
    const n = this._b.length;
    // The unseen part of [b, end): the gaps the pending intervals leave in it. One gap is the
    // new part; none is a duplicate; two or more are refused (ChunkOverlap).
    let nb = 0;
    let ne = 0;
    let found = false;
    for (let at = b; at < end;) {
      if (i < n && this._b[i] <= at) {
        at = this._e[i];  // covered up to the interval's end
        ++i;
        continue;
      }
      const gapEnd = i < n && this._b[i] < end ? this._b[i] : end;
      if (found) {
        throw new ChunkOverlap(
          `chat_stream.Window: chunk [${offset}, ${end}) spans more than one unseen piece`);
      }
      found = true;
      nb = at;
      ne = gapEnd;
      at = gapEnd;
    }
    if (!found) {
      ++this.duplicates;
      return kNothing;
    }
    i = this._firstEndingAfter(nb);  // the insertion point: the interval after the gap
    const a = { begin: nb, end: ne, whole: nb === offset && ne === end, fresh: true };
    if (nb === this.watermark) {
      this.watermark = ne;
      let last = 0;
      while (last < this._b.length && this._b[last] <= this.watermark) {
        this.watermark = Math.max(this.watermark, this._e[last]);
        ++last;
      }
      this._b.splice(0, last);
      this._e.splice(0, last);
      return a;
    }
    if (ne - this.watermark > this.options.maxAhead) {
      throw new WindowFull(
        `chat_stream.Window: chunk ends ${ne - this.watermark} past the watermark ` +
          `${this.watermark}, beyond maxAhead ${this.options.maxAhead}`);
    }
    this._insert(i, nb, ne);
    return a;
  }

  _insert(i, nb, ne) {
    const mergePrev = i > 0 && this._e[i - 1] === nb;
    const mergeNext = i < this._b.length && this._b[i] === ne;
    if (mergePrev && mergeNext) {
      this._e[i - 1] = this._e[i];
      this._b.splice(i, 1);
      this._e.splice(i, 1);
    } else if (mergePrev) {
      this._e[i - 1] = ne;
    } else if (mergeNext) {
      this._b[i] = nb;
    } else {
      if (this._b.length >= this.options.maxPending) {
        throw new WindowFull(
          `chat_stream.Window: ${this._b.length} out-of-order intervals held (maxPending); ` +
            `watermark ${this.watermark}, chunk at ${nb}`);
      }
      this._b.splice(i, 0, nb);
      this._e.splice(i, 0, ne);
    }
  }
}

/**
 * A Window plus the bytes of out-of-order chunks: hands out the stream in order, each byte once.
 * Same rules as idem::stream::Reassembler; also remembers the offset of the chunk whose bytes end
 * at deliveredEnd (the event id to resume after).
 */
export class Reassembler {
  /**
   * @param {{maxPending?: number, maxAhead?: number, maxBufferedBytes?: number}} options
   * @param {number} start the offset the stream resumes at
   */
  constructor(options = {}, start = 0) {
    this.window = new Window(options, start);
    this.maxBufferedBytes = options.maxBufferedBytes ?? 2 ** 22;
    if (!(this.maxBufferedBytes > 0)) {
      throw new StreamError('chat_stream.Reassembler: maxBufferedBytes must be positive');
    }
    this.deliveredEnd = start;
    this.bufferedBytes = 0;
    /** Offset of the chunk that ends at deliveredEnd (null before the first delivery). */
    this.lastChunkOffset = null;
    this._buffered = new Map(); // piece begin -> { chunkOffset, bytes }
  }

  /** Chunks dropped as duplicates. */
  get duplicates() {
    return this.window.duplicates;
  }

  /**
   * Admits a chunk.
   * @param {number} offset its first byte's offset
   * @param {Uint8Array} bytes its body
   * @returns {Uint8Array} the bytes that became contiguous (possibly empty)
   * @throws {WindowFull} past a cap, {ChunkOverlap}; nothing changed then
   */
  push(offset, bytes) {
    const w = this.window;
    if (offset > w.watermark && this.bufferedBytes + bytes.length > this.maxBufferedBytes &&
        !w.seen(offset, bytes.length)) {
      throw new WindowFull(
        `chat_stream.Reassembler: ${this.bufferedBytes} bytes buffered out of order; ` +
          `maxBufferedBytes ${this.maxBufferedBytes}`);
    }
    const a = w.admit(offset, bytes.length);
    if (!a.fresh) return new Uint8Array(0);
    const piece = bytes.subarray(a.begin - offset, a.end - offset);
    if (a.begin !== this.deliveredEnd) {
      this.bufferedBytes += piece.length;
      this._buffered.set(a.begin, { chunkOffset: offset, bytes: piece.slice() });
      return new Uint8Array(0);
    }
    this.deliveredEnd = a.end;
    this.lastChunkOffset = offset;
    if (this._buffered.size === 0) return piece;
    const parts = [piece];
    let total = piece.length;
    for (let next = this._buffered.get(this.deliveredEnd); next !== undefined;
      next = this._buffered.get(this.deliveredEnd)) {
      this._buffered.delete(this.deliveredEnd);
      parts.push(next.bytes);
      total += next.bytes.length;
      this.bufferedBytes -= next.bytes.length;
      this.deliveredEnd += next.bytes.length;
      this.lastChunkOffset = next.chunkOffset;
    }
    const out = new Uint8Array(total);
    let at = 0;
    for (const p of parts) {
      out.set(p, at);
      at += p.length;
    }
    return out;
  }
}

/**
 * Incremental server-sent-events parser (the WHATWG event-stream rules: `field: value` lines,
 * CR/LF/CRLF line ends, comment lines, dispatch on a blank line).
 */
export class SseParser {
  constructor() {
    this._line = '';
    this._afterCR = false;
    this._reset();
  }

  _reset() {
    this._id = null;
    this._event = '';
    this._data = [];
  }

  /**
   * Feeds decoded text.
   * @returns {{id: (string|null), event: string, data: string}[]} the events completed by it
   */
  push(text) {
    const events = [];
    let start = 0;
    for (let i = 0; i < text.length; ++i) {
      const c = text.charCodeAt(i);
      if (c !== 10 && c !== 13) continue;
      if (c === 10 && this._afterCR && i === start) {
        // The LF of a CRLF split across two pushes.
        this._afterCR = false;
        start = i + 1;
        continue;
      }
      this._line += text.slice(start, i);
      this._takeLine(events);
      this._line = '';
      this._afterCR = c === 13;
      if (c === 13 && i + 1 < text.length && text.charCodeAt(i + 1) === 10) {
        ++i;
        this._afterCR = false;
      }
      start = i + 1;
    }
    if (start < text.length) {
      this._line += text.slice(start);
      this._afterCR = false;
    }
    return events;
  }

  _takeLine(events) {
    const line = this._line;
    if (line === '') {
      if (this._data.length > 0 || this._event !== '') {
        events.push({ id: this._id, event: this._event || 'message', data: this._data.join('\n') });
      }
      this._reset();
      return;
    }
    if (line.charCodeAt(0) === 58) return; // ':' comment (keepalive)
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value.charCodeAt(0) === 32) value = value.slice(1);
    if (field === 'data') this._data.push(value);
    else if (field === 'event') this._event = value;
    else if (field === 'id' && !value.includes('\0')) this._id = value;
  }
}

/** Decodes standard base64 to bytes. */
export function base64ToBytes(text) {
  const bin = atob(text);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; ++i) out[i] = bin.charCodeAt(i);
  return out;
}

/** The event id of a chunk: `<requestId>_<offset>` (`chat_10001_10`). */
export function chunkId(requestId, offset) {
  return `${requestId}_${offset}`;
}

/** The offset named by a chunk event id of `requestId`, or null when it names another stream. */
export function parseChunkId(requestId, id) {
  if (typeof id !== 'string' || !id.startsWith(requestId + '_')) return null;
  const digits = id.slice(requestId.length + 1);
  if (!/^[0-9]{1,16}$/.test(digits)) return null;
  const offset = Number(digits);
  return Number.isSafeInteger(offset) ? offset : null;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * A resumable chat stream over fetch (EventSource can neither send Last-Event-ID to another host
 * nor choose which id to send). Each (re)connection asks `servers[i]` for
 * `GET /chats/{requestId}/events` with `Last-Event-ID` naming the chunk that ends at the
 * watermark; a dropped, ended or failed connection moves to the next server of the list.
 */
export class ChatStream {
  /**
   * @param {object} o
   * @param {string} o.requestId the chat's request id
   * @param {string[]} [o.servers] base URLs ('' is the page's own origin)
   * @param {string} [o.query] extra query string for the events URL (without '?')
   * @param {(text: string) => void} [o.onText] called with each newly shown piece of text
   * @param {(c: object) => void} [o.onUpdate] called with the counters after each event
   * @param {typeof fetch} [o.fetch] the fetch to use
   * @param {number} [o.retryDelayMs] first delay before a reconnect (doubles while no progress)
   * @param {number} [o.maxRetries] reconnects in a row without progress before giving up
   * @param {object} [o.windowOptions] caps: maxPending, maxAhead, maxBufferedBytes
   */
  constructor(o) {
    if (!o || typeof o.requestId !== 'string' || o.requestId === '') {
      throw new StreamError('ChatStream: requestId is required');
    }
    this.requestId = o.requestId;
    this.servers = o.servers && o.servers.length > 0 ? o.servers.slice() : [''];
    this.query = o.query || '';
    this.onText = o.onText || (() => {});
    this.onUpdate = o.onUpdate || (() => {});
    this._fetch = o.fetch || globalThis.fetch.bind(globalThis);
    this.retryDelayMs = o.retryDelayMs ?? 50;
    this.maxRetries = o.maxRetries ?? 20;
    this.windowOptions = o.windowOptions || {};
    this.reassembler = new Reassembler(this.windowOptions);
    this._decoder = new TextDecoder('utf-8');
    this._server = 0;
    this._abort = null;
    this._stopped = false;
    this.length = null;
    this.counters = {
      chunks: 0, // chunk events received
      duplicates: 0, // chunk events dropped as already seen
      outOfOrder: 0, // chunk events held until the hole before them filled
      reconnects: 0, // connections after the first
      resyncs: 0, // windows reset after a cap (WindowFull)
      bytes: 0, // bytes shown
      server: this.servers[0],
    };
  }

  /** The Last-Event-ID to send: the chunk ending at the watermark (null: from the start). */
  lastEventId() {
    const off = this.reassembler.lastChunkOffset;
    return off === null ? null : chunkId(this.requestId, off);
  }

  /** Stops the stream (run() then rejects with an AbortError). */
  abort() {
    this._stopped = true;
    if (this._abort) this._abort.abort();
  }

  /**
   * Streams until the whole answer was shown.
   * @returns {Promise<{length: number, counters: object}>}
   * @throws {StreamRefused} when a server refuses the stream; {StreamError} after maxRetries
   */
  async run() {
    let failures = 0;
    let lastError = null;
    for (let attempt = 0; ; ++attempt) {
      if (this._stopped) throw new DOMException('ChatStream aborted', 'AbortError');
      if (attempt > 0) {
        ++this.counters.reconnects;
        this._server = (this._server + 1) % this.servers.length;
        this.counters.server = this.servers[this._server];
        this.onUpdate(this.counters);
        if (failures > 0) await sleep(Math.min(this.retryDelayMs * 2 ** (failures - 1), 2000));
      }
      const before = this.reassembler.deliveredEnd;
      try {
        if (await this._connect(this.servers[this._server])) {
          return { length: this.length, counters: this.counters };
        }
        lastError = null;
      } catch (e) {
        if (e instanceof StreamRefused || this._stopped) throw e;
        lastError = e;
      }
      failures = this.reassembler.deliveredEnd > before ? 0 : failures + 1;
      if (failures > this.maxRetries) {
        throw new StreamError(`ChatStream: no progress after ${this.maxRetries} reconnects` +
          (lastError ? ` (${lastError.message})` : ''));
      }
    }
  }

  // One connection. true: the answer is complete.
  async _connect(base) {
    const headers = { Accept: 'text/event-stream' };
    const last = this.lastEventId();
    if (last !== null) headers['Last-Event-ID'] = last;
    const url = `${base}/chats/${encodeURIComponent(this.requestId)}/events` +
      (this.query ? `?${this.query}` : '');
    this._abort = new AbortController();
    const res = await this._fetch(url, { headers, cache: 'no-store', signal: this._abort.signal });
    if (res.status === 404 || res.status === 400 || res.status === 422) {
      throw new StreamRefused(`ChatStream: ${url} answered ${res.status}: ${await res.text()}`,
        res.status);
    }
    if (!res.ok || !res.body) throw new StreamError(`ChatStream: ${url} answered ${res.status}`);
    const reader = res.body.getReader();
    const text = new TextDecoder('utf-8');
    const parser = new SseParser();
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return false;
        for (const ev of parser.push(text.decode(value, { stream: true }))) {
          if (this._onEvent(ev)) return true;
        }
      }
    } finally {
      this._abort.abort();
    }
  }

  // true: complete.
  _onEvent(ev) {
    if (ev.event === 'chunk') {
      const offset = parseChunkId(this.requestId, ev.id);
      if (offset === null) throw new StreamError(`ChatStream: unexpected event id '${ev.id}'`);
      ++this.counters.chunks;
      const heldBefore = this.reassembler.bufferedBytes;
      let shown;
      try {
        shown = this.reassembler.push(offset, base64ToBytes(ev.data));
      } catch (e) {
        if (!(e instanceof WindowFull)) throw e;
        // Too far out of order: drop what is held beyond the watermark and resume from it.
        ++this.counters.resyncs;
        const r = this.reassembler;
        const fresh = new Reassembler(this.windowOptions, r.deliveredEnd);
        fresh.lastChunkOffset = r.lastChunkOffset;
        fresh.window.duplicates = r.window.duplicates;
        this.reassembler = fresh;
        throw e;
      }
      this.counters.duplicates = this.reassembler.duplicates;
      if (shown.length > 0) {
        this.counters.bytes += shown.length;
        const t = this._decoder.decode(shown, { stream: true });
        if (t) this.onText(t);
      } else if (this.reassembler.bufferedBytes > heldBefore) {
        ++this.counters.outOfOrder;
      }
      this.onUpdate(this.counters);
    } else if (ev.event === 'done') {
      this.length = JSON.parse(ev.data).length;
    } else if (ev.event === 'error') {
      throw new StreamRefused(`ChatStream: the server ended the stream: ${ev.data}`, 0);
    }
    if (this.length !== null && this.reassembler.deliveredEnd >= this.length) {
      const t = this._decoder.decode();
      if (t) this.onText(t);
      this.onUpdate(this.counters);
      return true;
    }
    return false;
  }
}
