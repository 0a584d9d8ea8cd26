// SPDX-License-Identifier: MIT
// Types of chat_stream.js: the browser half of idem::stream (Window, Reassembler) and a
// resumable server-sent-events reader (ChatStream).

/** Base of the stream errors. */
export class StreamError extends Error {}
/** A cap of the window was reached; the window is unchanged. */
export class WindowFull extends StreamError {}
/** A chunk would leave more than one unseen piece. */
export class ChunkOverlap extends StreamError {}
/** The server refused the stream (unknown chat, bad Last-Event-ID). */
export class StreamRefused extends StreamError {
  /** The HTTP status (0 for an `event: error`). */
  readonly status: number;
}

/** Caps of a Window (the C++ WindowOptions). */
export interface WindowOptions {
  /** Most out-of-order intervals held (default 64). */
  maxPending?: number;
  /** Furthest a chunk may end beyond the watermark (default 2^24). */
  maxAhead?: number;
}

/** What the window made of a chunk: [begin, end) is new; a duplicate has begin = end = 0. */
export interface Admission {
  readonly begin: number;
  readonly end: number;
  /** The whole chunk was new. */
  readonly whole: boolean;
  /** Some of the chunk was new. */
  readonly fresh: boolean;
}

/** Watermark + bounded out-of-order intervals: same rules as idem::stream::Window. */
export class Window {
  constructor(options?: WindowOptions, start?: number);
  readonly options: Required<WindowOptions>;
  /** Every offset below it was seen. */
  readonly watermark: number;
  /** Chunks dropped as entirely seen. */
  readonly duplicates: number;
  /** Out-of-order intervals held. */
  readonly pending: number;
  /** @throws WindowFull, ChunkOverlap (unchanged), StreamError for a bad offset */
  admit(offset: number, length: number): Admission;
  /** Unit offsets: true when `offset` was not seen. */
  admitOne(offset: number): boolean;
  /** True if every byte of [offset, offset + length) was seen. */
  seen(offset: number, length?: number): boolean;
}

/** Reassembler caps. */
export interface ReassemblerOptions extends WindowOptions {
  /** Most bytes of out-of-order chunks buffered (default 2^22). */
  maxBufferedBytes?: number;
}

/** A Window plus the bytes of out-of-order chunks: same rules as idem::stream::Reassembler. */
export class Reassembler {
  constructor(options?: ReassemblerOptions, start?: number);
  readonly window: Window;
  /** One past the last byte handed out. */
  readonly deliveredEnd: number;
  /** Bytes held out of order. */
  readonly bufferedBytes: number;
  /** Chunks dropped as duplicates. */
  readonly duplicates: number;
  /** Offset of the chunk that ends at deliveredEnd (null before the first delivery). */
  readonly lastChunkOffset: number | null;
  /** @returns the bytes that became contiguous. @throws WindowFull, ChunkOverlap (unchanged) */
  push(offset: number, bytes: Uint8Array): Uint8Array;
}

/** One server-sent event. */
export interface SseEvent {
  readonly id: string | null;
  readonly event: string;
  readonly data: string;
}

/** Incremental event-stream parser (WHATWG rules). */
export class SseParser {
  /** @returns the events completed by `text`. */
  push(text: string): SseEvent[];
}

/** Standard base64 to bytes. */
export function base64ToBytes(text: string): Uint8Array;
/** `<requestId>_<offset>`. */
export function chunkId(requestId: string, offset: number): string;
/** The offset of a chunk id of `requestId`, or null. */
export function parseChunkId(requestId: string, id: string | null): number | null;

/** The counters a ChatStream keeps (what the page shows). */
export interface ChatCounters {
  /** Chunk events received. */
  chunks: number;
  /** Chunk events dropped as already seen. */
  duplicates: number;
  /** Chunk events held until the hole before them filled. */
  outOfOrder: number;
  /** Connections after the first. */
  reconnects: number;
  /** Windows reset after a cap. */
  resyncs: number;
  /** Bytes shown. */
  bytes: number;
  /** The server of the current connection. */
  server: string;
}

export interface ChatStreamOptions {
  /** The chat's request id (`chat_10001`). */
  requestId: string;
  /** Base URLs, tried in turn on each reconnect ('' = the page's origin). */
  servers?: string[];
  /** Extra query string of the events URL, without '?'. */
  query?: string;
  /** Called with each newly shown piece of text (complete characters only). */
  onText?: (text: string) => void;
  /** Called with the counters after each event and reconnect. */
  onUpdate?: (counters: ChatCounters) => void;
  /** The fetch to use (default globalThis.fetch). */
  fetch?: typeof fetch;
  /** First delay before a reconnect without progress, doubling (default 50 ms, at most 2 s). */
  retryDelayMs?: number;
  /** Reconnects in a row without progress before run() rejects (default 20). */
  maxRetries?: number;
  /** Window and buffer caps. */
  windowOptions?: ReassemblerOptions;
}

/** A resumable chat stream over fetch: Last-Event-ID names the chunk ending at the watermark. */
export class ChatStream {
  constructor(options: ChatStreamOptions);
  readonly requestId: string;
  readonly counters: ChatCounters;
  /** The answer's length once the server sent `done`. */
  readonly length: number | null;
  readonly reassembler: Reassembler;
  /** The Last-Event-ID the next connection sends (null: from the start). */
  lastEventId(): string | null;
  /** Stops; run() rejects with an AbortError. */
  abort(): void;
  /** Streams until the whole answer was shown. @throws StreamRefused, StreamError */
  run(): Promise<{ length: number; counters: ChatCounters }>;
}
