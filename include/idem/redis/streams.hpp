// SPDX-License-Identifier: MIT
// idem::mq::RedisStreams: a small Redis Streams consumer-group client for MQ consumer loops.
//
// File: redis/streams.hpp (part of the Redis adapter, idem::redis; idem/mq/redis_streams.hpp
// includes it)
//
// The broker side of an idempotent consumer loop (see idem/consumer.hpp and docs/mq.md):
//
//   XADD        publish (`add`, `add_many` pipelined)
//   XGROUP      create the consumer group (`create_group`)
//   XREADGROUP  read new entries for this consumer (`read_group`); they enter its pending list
//   XACK        acknowledge a batch in one round trip (`ack`)
//   XAUTOCLAIM  take over entries another consumer left pending longer than a minimum idle time
//               (it died, or answered retry_later), with exact delivery counts (`auto_claim`)
//   XPENDING    pending summary per consumer (`pending`)
//
// It runs on the Redis adapter's connection pool (idem::redis: same URI forms, timeouts,
// reconnect backoff and error mapping as RedisStore), so it is thread-safe: one object serves a
// process. A connection that fails is dropped and replaced on a later call. Failures throw idem
// exceptions: StorageUnavailable (refused, reset, LOADING, pool exhausted), StorageTimeout (no
// answer within command_timeout), OutcomeUnknown (an XADD whose answer was lost: the entry may
// exist; publishing again is safe because consumers de-duplicate by message id), and
// StorageError (a Redis error reply such as NOGROUP). hiredis stays out of this header.
//
// @code
//   idem::mq::RedisStreams redis{"redis://127.0.0.1:6379"};   // or RedisStreamsOptions{...}
//   redis.create_group("orders", "billing");
//   for (;;) {
//     auto batch = redis.read_group("orders", "billing", "worker-1", 64, std::chrono::seconds(1));
//     std::vector<std::string> done;
//     for (auto& e : batch) if (handle(e)) done.push_back(e.id);
//     redis.ack("orders", "billing", done);
//   }
// @endcode
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/export.hpp"
#include "idem/redis/tls_options.hpp"

namespace idem::mq {

/// Field/value pairs of a stream entry, in order.
using Fields = std::vector<std::pair<std::string, std::string>>;

/// One stream entry as read by a consumer.
struct StreamEntry {
  /// The broker's entry id ("1700000000000-0"); ack this.
  std::string id;
  /// The entry's fields, in order.
  Fields fields;
  /// How many times the group delivered it, this delivery included (1: first delivery).
  std::uint32_t delivery_count = 1;

  /// The value of field `name`, or nullptr.
  const std::string* find(std::string_view name) const noexcept {
    for (const auto& [k, v] : fields) {
      if (k == name) return &v;
    }
    return nullptr;
  }
};

/// Options of a RedisStreams connection.
struct RedisStreamsOptions {
  /// `redis://[[user]:password@]host[:port][/db]`, `rediss://...` (TLS), `tcp://host[:port][/db]`
  /// or `unix:///path/to/redis.sock[?db=N]` (as RedisStoreOptions::uri).
  std::string uri = "redis://127.0.0.1:6379";
  /// Most connections open at once (a blocking read holds one for its block time). Positive.
  std::size_t pool_size = 4;
  /// Connect timeout. Must be positive.
  std::chrono::milliseconds connect_timeout{1000};
  /// How long a command may take (a blocking read adds its block time). Must be positive.
  std::chrono::milliseconds command_timeout{1000};
  /// Longest wait for a free connection when all are busy (then StorageUnavailable).
  std::chrono::milliseconds pool_wait_timeout{1000};
  /// `rediss://` only: as RedisStoreOptions::tls.
  redis::TlsOptions tls{};
};

/// The answer of XAUTOCLAIM.
struct AutoClaimResult {
  /// Where the next scan starts ("0-0" when the pending list was scanned to its end).
  std::string next_start = "0-0";
  /// Entries now owned by this consumer, with their delivery counts (>= 2).
  std::vector<StreamEntry> entries;
  /// Pending ids whose entries were deleted from the stream (Redis >= 7); removed from the
  /// pending list by Redis itself.
  std::vector<std::string> deleted;
};

/// The answer of XPENDING (summary form).
struct PendingSummary {
  /// Entries delivered to the group and not acked.
  std::uint64_t count = 0;
  /// Pending entries per consumer name.
  std::vector<std::pair<std::string, std::uint64_t>> consumers;

  /// Pending entries of `consumer` (0 when none).
  std::uint64_t of(std::string_view consumer) const noexcept {
    for (const auto& [name, n] : consumers) {
      if (name == consumer) return n;
    }
    return 0;
  }
};

/// A Redis Streams client (see the file comment). Thread-safe; movable, not copyable.
class IDEM_EXPORT RedisStreams {
 public:
  /// Parses the URI; connects on first use. @throws idem::UsageError for a bad URI or option.
  explicit RedisStreams(RedisStreamsOptions options);
  /// Same as `RedisStreams(RedisStreamsOptions{std::string(uri)})`, as
  /// `idem::redis::RedisStore{uri}`. @throws idem::UsageError for a bad URI.
  explicit RedisStreams(std::string_view uri);
  /// The URI alone (see the string_view overload). With the `const std::string&` overload it
  /// keeps `RedisStreams{{uri}}` (options from the URI) unambiguous.
  explicit RedisStreams(const char* uri) : RedisStreams(std::string_view(uri)) {}
  /// The URI alone (see the string_view overload).
  explicit RedisStreams(const std::string& uri) : RedisStreams(std::string_view(uri)) {}
  /// Closes the connections.
  ~RedisStreams();
  /// Takes over the connections (the source may only be destroyed or assigned).
  RedisStreams(RedisStreams&&) noexcept;
  /// Takes over the connections (the source may only be destroyed or assigned).
  RedisStreams& operator=(RedisStreams&&) noexcept;
  RedisStreams(const RedisStreams&) = delete;
  RedisStreams& operator=(const RedisStreams&) = delete;

  /// XGROUP CREATE stream group start MKSTREAM. @return false when the group existed.
  bool create_group(std::string_view stream, std::string_view group,
                    std::string_view start_id = "0");

  /// XADD stream * fields... @return the new entry id.
  /// @throws idem::OutcomeUnknown when the answer was lost (the entry may exist).
  std::string add(std::string_view stream, const Fields& fields);

  /// XADD of many entries in one pipelined round trip. @return their ids, in order.
  std::vector<std::string> add_many(std::string_view stream, const std::vector<Fields>& entries);

  /// XREADGROUP GROUP group consumer COUNT count [BLOCK block] STREAMS stream id.
  /// @param stream   the stream key
  /// @param group    the consumer group
  /// @param consumer this consumer's name in the group
  /// @param count    most entries returned
  /// @param id    ">" for entries never delivered to the group; "0" re-reads this consumer's
  ///              own pending entries (delivery counts are then not known: reported as 2).
  /// @param block how long to wait for new entries; nullopt does not block.
  std::vector<StreamEntry> read_group(std::string_view stream, std::string_view group,
                                      std::string_view consumer, std::size_t count,
                                      std::optional<std::chrono::milliseconds> block,
                                      std::string_view id = ">");

  /// XACK stream group ids... (one round trip). @return entries acknowledged.
  std::uint64_t ack(std::string_view stream, std::string_view group,
                    const std::vector<std::string>& ids);

  /// XAUTOCLAIM stream group consumer min_idle start COUNT count, then one XPENDING for the
  /// exact delivery counts of what was claimed.
  AutoClaimResult auto_claim(std::string_view stream, std::string_view group,
                             std::string_view consumer, std::chrono::milliseconds min_idle,
                             std::string_view start = "0-0", std::size_t count = 100);

  /// XPENDING stream group (summary).
  PendingSummary pending(std::string_view stream, std::string_view group);

  /// XLEN stream.
  std::uint64_t length(std::string_view stream);

  /// XRANGE stream - + (operators and tests; reads the whole stream).
  std::vector<StreamEntry> range(std::string_view stream);

  /// DEL key. @return keys removed.
  std::uint64_t del(std::string_view key);

  /// PING (checks that the server answers).
  void ping();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::mq
