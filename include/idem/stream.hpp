// SPDX-License-Identifier: MIT
// De-duplication of streamed output (AI chat tokens): chunks keyed by request id + offset.
//
// File: stream.hpp
//
// A streamed answer is a byte (or token) sequence cut into chunks. A chunk is named by the
// request it belongs to and the offset of its first byte: `chat_10001_0`, `chat_10001_10`
// (`chunk_id`). The chunk covers [offset, offset + body.size()). Three pieces cooperate:
//
//   * `ProducerDedup` (server side, one per request): the generator may be retried and replay a
//     range it already produced, possibly cut at other boundaries. `admit` lets through only the
//     not-yet-emitted suffix, so an offset is never emitted twice and emitted chunks never
//     overlap. A chunk that starts beyond what was emitted (a hole) is a producer bug and
//     throws `StreamGap`.
//   * `Window` (client side, one per stream): the transport may replay and reorder chunks.
//     `admit` answers which part of a chunk is new. Memory is bounded: a contiguous watermark
//     (everything below it was seen) plus a small sorted set of out-of-order intervals, merged
//     as they touch. Past the cap (`WindowOptions::max_pending` intervals, or data more than
//     `max_ahead` beyond the watermark) it throws `WindowFull` and keeps its state, so a caller
//     can resynchronise (e.g. resume from the durable table) instead of growing without bound.
//   * `Reassembler` (client side): a Window plus the bytes of out-of-order chunks (capped by
//     `max_buffered_bytes`); `push` returns the bytes that became contiguous, in order, once.
//
// The durable part, a table with `unique (request_id, chunk_offset)` written with
// `INSERT ... ON CONFLICT DO NOTHING`, is `idem::sqlite::ChunkStore`
// (idem/sqlite/stream_store.hpp).
//
// Everything here is single-threaded per object (one stream is one ordered flow); use one
// object per stream. Header-only, no dependencies beyond the standard library and idem's errors.
//
// @code
//   idem::stream::ProducerDedup producer{"chat_10001"};
//   for (auto& [offset, text] : generator_output_with_retries) {
//     if (auto chunk = producer.admit(offset, text)) send(producer.request_id(), *chunk);
//   }
//
//   idem::stream::Reassembler client;
//   for (auto& msg : transport) screen << client.push(msg.offset, msg.body);
// @endcode
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/errors.hpp"
#include "idem/key.hpp"

namespace idem::stream {

namespace detail {
// An offset difference within a body held in memory, as an index into it (the body's size
// bounds it). A cast from uint64_t where size_t is that very type is one GCC's
// -Wuseless-cast reports in users' builds; where size_t is narrower (32-bit) it is needed.
template <class U>
std::size_t as_index(U n) noexcept {
  if constexpr (std::is_same_v<U, std::size_t>) {
    return n;
  } else {
    return static_cast<std::size_t>(n);
  }
}
}  // namespace detail

/// Base of the stream errors. They are usage errors (errc::kInvalidArgument): a cap too small
/// for the transport's reordering, or a producer that breaks the offset contract.
class StreamError : public UsageError {
 public:
  /// UsageError's constructors (errc::kInvalidArgument with a message).
  using UsageError::UsageError;
};

/// The consumer window's cap was reached (too many out-of-order intervals, too much data ahead
/// of the watermark, or too many buffered bytes). The window is unchanged: the chunk was not
/// admitted. Resynchronise (resume from the durable table) or raise the cap.
class WindowFull : public StreamError {
 public:
  using StreamError::StreamError;
};

/// A chunk overlaps already-seen data in a way that leaves more than one new piece (chunk
/// boundaries changed between deliveries of out-of-order data). Emitted chunks from a
/// ProducerDedup never do this.
class ChunkOverlap : public StreamError {
 public:
  using StreamError::StreamError;
};

/// Where a stream stands in a durable chunk table: what every adapter's ChunkStore::resume
/// answers (idem::sqlite, idem::postgres, idem::mysql), built from the stored chunks in
/// offset order with add().
struct StreamResume {
  /// One past the last byte of the contiguous prefix stored from offset 0: continue here.
  std::uint64_t next_offset = 0;
  /// The contiguous prefix itself (bytes [0, next_offset)).
  std::string text;
  /// Rows stored for the request (including any after the first hole).
  std::uint64_t chunks = 0;
  /// True when chunks are stored beyond a hole (a writer skipped an offset).
  bool has_gap = false;

  /// Adds the next stored chunk (rows in offset order): a chunk that overlaps the prefix (one
  /// stored at other boundaries) contributes its unseen suffix; one beyond the prefix marks the
  /// first hole, after which only `chunks` counts.
  void add(std::uint64_t offset, std::string_view body) {
    ++chunks;
    if (has_gap) return;
    const std::uint64_t end = offset + body.size();
    if (offset > next_offset) {
      has_gap = true;
    } else if (end > next_offset) {
      text.append(body.substr(detail::as_index(next_offset - offset)));
      next_offset = end;
    }
  }
};

/// The producer emitted a chunk that starts beyond the end of what it emitted so far.
class StreamGap : public StreamError {
 public:
  using StreamError::StreamError;
};

/// The chunk name `<request_id>_<offset>`, e.g. `chat_10001_10`.
/// @throws idem::InvalidKey if `request_id` breaks an id rule (1..128 printable ASCII bytes).
inline std::string chunk_id(std::string_view request_id, std::uint64_t offset) {
  Key::validate_id(request_id);
  std::string id;
  id.reserve(request_id.size() + 21);
  id.append(request_id).append(1, '_').append(std::to_string(offset));
  return id;
}

/// A chunk: `body` covers [offset, offset + body.size()). Views the caller's bytes.
struct Chunk {
  /// Offset of the first byte.
  std::uint64_t offset = 0;
  /// The bytes (a view: valid as long as the bytes it was cut from).
  std::string_view body;
  /// One past the last byte.
  std::uint64_t end() const noexcept { return offset + body.size(); }
};

namespace detail {
inline std::uint64_t checked_end(std::uint64_t offset, std::uint64_t length) {
  if (length > std::numeric_limits<std::uint64_t>::max() - offset) {
    throw StreamError("idem::stream: chunk [" + std::to_string(offset) + ", +" +
                      std::to_string(length) + ") overflows 64-bit offsets");
  }
  return offset + length;
}

/// What every durable ChunkStore refuses before it stores a chunk: an empty body (stored, it
/// took the offset of the chunk that carries those bytes, which was then answered as a repeat
/// and never stored: the stream stopped there) and a chunk whose end does not fit a BIGINT.
/// @throws idem::UsageError naming `store`.
inline void check_stored_chunk(std::string_view store, std::uint64_t offset, std::size_t size) {
  const auto max = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  if (size == 0) {
    throw UsageError(std::string(store) + ": an empty chunk at offset " + std::to_string(offset) +
                     " (nothing to store: a chunk carries at least one byte)");
  }
  if (offset > max || size > max - offset) {
    throw UsageError(std::string(store) + ": chunk [" + std::to_string(offset) + ", +" +
                     std::to_string(size) + ") ends beyond a BIGINT offset");
  }
}
}  // namespace detail

/// Producer side: lets through each offset of one request once, also across retried ranges.
///
/// @code
///   idem::stream::ProducerDedup p{"chat_10001"};
///   p.admit(0, "Hello, ");      // chunk [0, 7)
///   p.admit(0, "Hello, wor");   // retry: only "wor" at offset 7
///   p.admit(7, "wor");          // nothing (already emitted)
/// @endcode
class ProducerDedup {
 public:
  /// @param request_id  the stream's id (validated as a key id).
  /// @param resume_from the end of what was already emitted (e.g. ChunkStore::resume after a
  ///                    restart); 0 for a new stream.
  /// @throws idem::InvalidKey for a bad request id.
  explicit ProducerDedup(std::string request_id, std::uint64_t resume_from = 0)
      : request_id_(std::move(request_id)), emitted_end_(resume_from) {
    Key::validate_id(request_id_);
  }

  /// Admits a produced range. @return the not-yet-emitted suffix (a view into `body`), or
  /// nullopt when everything in it was emitted before (or `body` is empty).
  /// @throws StreamGap if `offset` is beyond the end of what was emitted.
  std::optional<Chunk> admit(std::uint64_t offset, std::string_view body) {
    const std::uint64_t end = detail::checked_end(offset, body.size());
    if (offset > emitted_end_) {
      throw StreamGap("idem::stream: request '" + request_id_ + "' emitted up to offset " +
                      std::to_string(emitted_end_) + " but the producer sent a chunk at " +
                      std::to_string(offset) + " (a hole)");
    }
    if (end <= emitted_end_) {
      if (!body.empty()) {
        ++duplicate_chunks_;
        duplicate_bytes_ += body.size();
      }
      return std::nullopt;
    }
    const auto skip = detail::as_index(emitted_end_ - offset);
    if (skip > 0) {
      ++trimmed_chunks_;
      duplicate_bytes_ += skip;
    }
    Chunk c{emitted_end_, body.substr(skip)};
    emitted_end_ = end;
    return c;
  }

  /// The stream's request id.
  const std::string& request_id() const noexcept { return request_id_; }
  /// One past the last emitted offset (the next offset to emit).
  std::uint64_t emitted_end() const noexcept { return emitted_end_; }
  /// Chunks dropped entirely (all their bytes were emitted before).
  std::uint64_t duplicate_chunks() const noexcept { return duplicate_chunks_; }
  /// Chunks whose already-emitted prefix was cut off.
  std::uint64_t trimmed_chunks() const noexcept { return trimmed_chunks_; }
  /// Bytes not emitted because they were emitted before.
  std::uint64_t duplicate_bytes() const noexcept { return duplicate_bytes_; }

 private:
  std::string request_id_;
  std::uint64_t emitted_end_;
  std::uint64_t duplicate_chunks_ = 0;
  std::uint64_t trimmed_chunks_ = 0;
  std::uint64_t duplicate_bytes_ = 0;
};

/// Caps of a consumer Window (and Reassembler).
struct WindowOptions {
  /// Most out-of-order intervals kept (touching intervals merge into one). Must be positive.
  std::size_t max_pending = 64;
  /// Furthest a chunk's end may lie beyond the watermark. Must be positive.
  std::uint64_t max_ahead = std::uint64_t{1} << 24;
  /// Reassembler only: most bytes of out-of-order chunks buffered. Must be positive.
  std::size_t max_buffered_bytes = std::size_t{1} << 22;
};

/// What the window made of a chunk: [begin, end) is the part not seen before (empty when the
/// chunk was a duplicate). At most one piece: see ChunkOverlap.
struct Admission {
  /// First new offset.
  std::uint64_t begin = 0;
  /// One past the last new offset.
  std::uint64_t end = 0;
  /// True when some of the chunk was new.
  bool fresh() const noexcept { return begin < end; }
  /// True when the chunk was new from its first byte to its last.
  bool whole = false;
};

/// Consumer side: drops what was seen, in bounded memory (see the file comment).
///
/// @code
///   idem::stream::Window w;
///   w.admit(0, 10).fresh();    // true: [0, 10) is new
///   w.admit(0, 10).fresh();    // false: a replay
///   w.admit(20, 5).fresh();    // true, out of order (kept in the pending set)
///   w.admit(10, 10);           // fills the hole: watermark 25, nothing pending
///   w.admit(7);                // unit offsets (tokens): admit(7, 1) -> false
/// @endcode
class Window {
 public:
  /// @throws idem::UsageError if a cap is zero.
  explicit Window(WindowOptions options = {}, std::uint64_t start = 0)
      : options_(options), watermark_(start) {
    if (options_.max_pending == 0 || options_.max_ahead == 0) {
      throw UsageError("idem::stream::Window: max_pending and max_ahead must be positive");
    }
    pending_.reserve(std::min<std::size_t>(options_.max_pending, 64));
  }

  /// Admits the chunk [offset, offset + length).
  /// @return the new part (see Admission); a replayed chunk has none and counts as duplicate.
  /// @throws WindowFull past a cap (the window is unchanged); ChunkOverlap (unchanged).
  Admission admit(std::uint64_t offset, std::uint64_t length) {
    const std::uint64_t end = detail::checked_end(offset, length);
    if (length == 0) return {};  // nothing to see, wherever it lies; not a duplicate
    if (end <= watermark_) {     // all seen
      ++duplicates_;
      return {};
    }
    if (pending_.empty() && offset <= watermark_) {  // the hot path: in order (or overlapping)
      Admission a{watermark_, end, offset == watermark_};
      watermark_ = end;
      return a;
    }
    return admit_slow(offset, end);
  }

  /// Unit offsets (one token per offset): true when `offset` was not seen before.
  bool admit(std::uint64_t offset) { return admit(offset, 1).fresh(); }

  /// True if every byte of [offset, offset + length) was seen (an empty range: always).
  bool seen(std::uint64_t offset, std::uint64_t length = 1) const {
    const std::uint64_t end = detail::checked_end(offset, length);
    if (length == 0 || end <= watermark_) return true;
    std::uint64_t b = std::max(offset, watermark_);
    auto it = first_ending_after(b);
    return it != pending_.end() && it->first <= b && it->second >= end;
  }

  /// Everything below the watermark was seen; it is the next in-order offset.
  std::uint64_t watermark() const noexcept { return watermark_; }
  /// Out-of-order intervals held (each [begin, end) with begin > watermark).
  std::size_t pending() const noexcept { return pending_.size(); }
  /// Chunks dropped as entirely seen before.
  std::uint64_t duplicates() const noexcept { return duplicates_; }
  /// The caps in force.
  const WindowOptions& options() const noexcept { return options_; }

 private:
  using Interval = std::pair<std::uint64_t, std::uint64_t>;  // [first, second)
  using Iter = std::vector<Interval>::iterator;
  using CIter = std::vector<Interval>::const_iterator;

  CIter first_ending_after(std::uint64_t b) const {
    return std::upper_bound(pending_.begin(), pending_.end(), b,
                            [](std::uint64_t v, const Interval& iv) { return v < iv.second; });
  }

  Admission admit_slow(std::uint64_t offset, std::uint64_t end) {
    const std::uint64_t b = std::max(offset, watermark_);
    auto cit = first_ending_after(b);  // first interval that ends after b
    auto it = pending_.begin() + (cit - pending_.cbegin());
    // The unseen part of [b, end): the gaps the pending intervals from `it` leave in it. One
    // gap is the new part (`it` then moves to the interval after it, the insertion point);
    // none is a duplicate; two or more are refused (ChunkOverlap).
    std::uint64_t nb = 0, ne = 0;
    bool found = false;
    for (std::uint64_t at = b; at < end;) {
      std::uint64_t gap_end = end;  // the gap [at, gap_end), if any
      if (it != pending_.end() && it->first <= at) {
        at = it->second;  // covered up to the interval's end
        ++it;
        continue;
      }
      if (it != pending_.end() && it->first < end) gap_end = it->first;
      if (found) {
        throw ChunkOverlap("idem::stream::Window: chunk [" + std::to_string(offset) + ", " +
                           std::to_string(end) + ") spans more than one unseen piece");
      }
      found = true;
      nb = at;
      ne = gap_end;
      at = gap_end;
    }
    if (!found) {
      ++duplicates_;
      return {};
    }
    it = pending_.begin() + (first_ending_after(nb) - pending_.cbegin());  // after the gap
    Admission a{nb, ne, nb == offset && ne == end};
    if (nb == watermark_) {
      watermark_ = ne;
      // Pull in the intervals that now touch the watermark.
      auto first = pending_.begin();
      auto last = first;
      while (last != pending_.end() && last->first <= watermark_) {
        watermark_ = std::max(watermark_, last->second);
        ++last;
      }
      pending_.erase(first, last);
      return a;
    }
    if (ne - watermark_ > options_.max_ahead) {
      throw WindowFull("idem::stream::Window: chunk ends " + std::to_string(ne - watermark_) +
                       " past the watermark " + std::to_string(watermark_) +
                       ", beyond max_ahead " + std::to_string(options_.max_ahead));
    }
    insert_pending(it, nb, ne);
    return a;
  }

  // Inserts [nb, ne) before `it` (the first interval ending after nb), merging neighbours.
  void insert_pending(Iter it, std::uint64_t nb, std::uint64_t ne) {
    bool merge_prev = it != pending_.begin() && std::prev(it)->second == nb;
    bool merge_next = it != pending_.end() && it->first == ne;
    if (merge_prev && merge_next) {
      std::prev(it)->second = it->second;
      pending_.erase(it);
    } else if (merge_prev) {
      std::prev(it)->second = ne;
    } else if (merge_next) {
      it->first = nb;
    } else {
      if (pending_.size() >= options_.max_pending) {
        throw WindowFull("idem::stream::Window: " + std::to_string(pending_.size()) +
                         " out-of-order intervals held (max_pending); watermark " +
                         std::to_string(watermark_) + ", chunk at " + std::to_string(nb));
      }
      pending_.insert(it, Interval{nb, ne});
    }
  }

  WindowOptions options_;
  std::uint64_t watermark_;
  std::vector<Interval> pending_;
  std::uint64_t duplicates_ = 0;
};

/// Consumer side: a Window plus the bytes of out-of-order chunks; hands out the stream in
/// order, each byte once.
///
/// @code
///   idem::stream::Reassembler r;
///   r.push(5, "world");   // ""            (buffered: out of order)
///   r.push(0, "hello");   // "helloworld"
///   r.push(0, "hello");   // ""            (duplicate, dropped)
/// @endcode
class Reassembler {
 public:
  /// @param options the window's caps (WindowOptions)
  /// @param start the offset the stream resumes at (0 for a new stream).
  /// @throws idem::UsageError if a cap is zero.
  explicit Reassembler(WindowOptions options = {}, std::uint64_t start = 0)
      : window_(options, start), delivered_end_(start) {
    if (options.max_buffered_bytes == 0) {
      throw UsageError("idem::stream::Reassembler: max_buffered_bytes must be positive");
    }
  }

  /// Admits a chunk. @return the bytes that became contiguous (possibly empty), starting at
  /// the previous `delivered_end()`.
  /// @throws WindowFull past a cap, ChunkOverlap (nothing changed in either case).
  std::string push(std::uint64_t offset, std::string_view body) {
    // Only a chunk starting beyond the watermark can be buffered; check its cap before the
    // window changes (conservatively, with the whole body).
    if (offset > window_.watermark() &&
        buffered_bytes_ + body.size() > window_.options().max_buffered_bytes &&
        !window_.seen(offset, body.size())) {
      throw WindowFull("idem::stream::Reassembler: " + std::to_string(buffered_bytes_) +
                       " bytes buffered out of order; max_buffered_bytes " +
                       std::to_string(window_.options().max_buffered_bytes));
    }
    Admission a = window_.admit(offset, body.size());
    if (!a.fresh()) return {};
    auto piece = body.substr(detail::as_index(a.begin - offset), detail::as_index(a.end - a.begin));
    if (a.begin != delivered_end_) {
      buffered_bytes_ += piece.size();
      buffered_.emplace(a.begin, std::string(piece));
      return {};
    }
    std::string out(piece);
    delivered_end_ = a.end;
    for (auto it = buffered_.begin(); it != buffered_.end() && it->first == delivered_end_;) {
      out += it->second;
      delivered_end_ += it->second.size();
      buffered_bytes_ -= it->second.size();
      it = buffered_.erase(it);
    }
    return out;
  }

  /// One past the last byte handed out.
  std::uint64_t delivered_end() const noexcept { return delivered_end_; }
  /// Bytes held out of order.
  std::size_t buffered_bytes() const noexcept { return buffered_bytes_; }
  /// Chunks dropped as duplicates.
  std::uint64_t duplicates() const noexcept { return window_.duplicates(); }
  /// The underlying window.
  const Window& window() const noexcept { return window_; }

 private:
  Window window_;
  std::uint64_t delivered_end_;
  std::map<std::uint64_t, std::string> buffered_;
  std::size_t buffered_bytes_ = 0;
};

}  // namespace idem::stream
