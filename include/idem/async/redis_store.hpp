// SPDX-License-Identifier: MIT
// idem::async::AsyncRedisStore: the Redis fast store on an Asio loop (hiredis's asynchronous
// context, driven by idem's Asio adapter; hiredis never appears in this header).
//
// File: async/redis_store.hpp
//
// The same records, commands and scripts as idem::redis::RedisStore (a synchronous and an
// asynchronous store may share one Redis: each sees the other's records), the same typed
// errors through the same choke point, the same layouts:
//
//   * `redis://`, `tcp://`, `unix://`: one server, one connection per store. Every call is
//     pipelined on it: a thousand claims in flight cost one socket, and the loop never waits.
//   * `redis-sentinel://h:p[,h:p...]/<service>`: the master the sentinels name, confirmed with
//     ROLE, asked again after failures (connection errors, READONLY, MASTERDOWN) and every
//     `sentinel_check_interval`.
//   * `redis-cluster://h:p[,h:p...]`: the slot map from CLUSTER SLOTS, one connection per
//     node, MOVED (the map is re-read) and ASK (ASKING, then the command) followed.
//
// Every command has a reply deadline (`command_timeout`); a connection whose reply is late is
// closed, failing what was in flight on it: StorageTimeout, or OutcomeUnknown for complete,
// release and fill, whose write may have applied. A connect has its own deadline; after a
// failed connect, calls fail at once (StorageUnavailable) for `reconnect_backoff`, then one
// connect is tried again. Completions run on the executor each call names.
//
// Threading: the store's I/O runs on a strand of the executor given at construction; calls
// may come from any thread, and so may the store's destruction: its connections are closed on
// that strand (at once from the strand's own thread, else as soon as the loop runs it; an
// io_context that is never run again closes them when it is destroyed). Calls still in flight
// then complete with StorageUnavailable.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "idem/async/net.hpp"
#include "idem/async/store.hpp"
#include "idem/export.hpp"
#include "idem/redis/redis_store.hpp"

namespace idem::async {

/// Options of an AsyncRedisStore.
struct AsyncRedisStoreOptions {
  /// Server address, in the forms of idem::redis::RedisStoreOptions::uri (one server,
  /// `redis-sentinel://`, `redis-cluster://`), without TLS: a `rediss://` address is refused
  /// with idem::UsageError (this store has no TLS; use a local TLS tunnel, or RedisStore).
  std::string uri = "redis://127.0.0.1:6379";
  /// Longest wait for a connect (and AUTH / SELECT). 0 means 500 ms.
  std::chrono::milliseconds connect_timeout{500};
  /// Longest wait for a command's reply; the connection is then closed. 0 means 1000 ms.
  std::chrono::milliseconds command_timeout{1000};
  /// After a failed connect, calls fail at once for this long. 0 means a connect per call.
  std::chrono::milliseconds reconnect_backoff{100};
  /// Prepended to every key, as RedisStoreOptions::key_prefix (use the same value as the
  /// synchronous stores sharing the server). Empty means no prefix.
  std::string key_prefix = "idem:";
  /// Claim with the Lua script instead of `SET ... NX PX ... GET` (switched to by itself on
  /// servers older than Redis 7.0).
  bool claim_script = false;
  /// Sentinel and Cluster: least time between two re-discoveries. 0 means 100 ms.
  std::chrono::milliseconds topology_refresh_interval{100};
  /// Sentinel: the master is re-checked this often. 0 means only after failures.
  std::chrono::milliseconds sentinel_check_interval{1000};
};

/// Connection counters of an AsyncRedisStore (summed over its nodes).
struct AsyncRedisStats {
  std::uint64_t connects = 0;          ///< connections established
  std::uint64_t connect_failures = 0;  ///< connects that failed or timed out
  std::uint64_t dropped = 0;           ///< established connections that broke or timed out
  std::uint64_t fast_failures = 0;     ///< calls refused during the reconnect backoff
  std::uint64_t timeouts = 0;          ///< replies that did not come in time
  std::uint64_t commands = 0;          ///< commands sent
  std::uint64_t script_loads = 0;      ///< scripts sent with EVAL after NOSCRIPT
};

/// The asynchronous Redis fast store (see the file comment).
class IDEM_EXPORT AsyncRedisStore final : public AsyncFastStore {
 public:
  /// Validates the options; connects on first use. @throws idem::UsageError for a malformed
  /// URI or a bad option.
  AsyncRedisStore(Executor executor, AsyncRedisStoreOptions options);
  /// Same as `AsyncRedisStore(executor, AsyncRedisStoreOptions{uri})`.
  AsyncRedisStore(Executor executor, std::string_view uri);
  ~AsyncRedisStore() override;
  AsyncRedisStore(const AsyncRedisStore&) = delete;
  AsyncRedisStore& operator=(const AsyncRedisStore&) = delete;

  /// One round trip (plus redirects in a cluster): claimed / busy / done / mismatch.
  void async_claim(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                   std::chrono::milliseconds lease, const Executor& ex,
                   Completion<ClaimResult> done) override;
  /// Owner-checked completion (Lua): true, or false when the lease was lost.
  void async_complete(const Key& key, const OwnerToken& owner, std::string_view response,
                      std::chrono::seconds retention, const Executor& ex,
                      Completion<bool> done) override;
  /// Owner-checked failure record (the completion script writing 'F').
  void async_fail(const Key& key, const OwnerToken& owner, std::string_view reason,
                  std::chrono::seconds retention, const Executor& ex,
                  Completion<bool> done) override;
  /// Owner-checked release (Lua).
  void async_release(const Key& key, const OwnerToken& owner, const Executor& ex,
                     Completion<bool> done) override;
  /// One SET of a completed record (owner unknown).
  void async_fill(const Key& key, std::string_view fingerprint, std::string_view response,
                  std::chrono::seconds retention, const Executor& ex,
                  Completion<bool> done) override;
  /// As async_fill, the record created at `origin.first_seen` (the durable record's; epoch:
  /// now). A completed record keeps no owner.
  void async_refill(const Key& key, std::string_view fingerprint, std::string_view response,
                    std::chrono::seconds retention, const RecordOrigin& origin, const Executor& ex,
                    Completion<bool> done) override;
  /// Reads a record (as RedisStore::lookup).
  void async_lookup(const Key& key, const Executor& ex,
                    Completion<std::optional<Record>> done) override;
  /// "redis", "redis-sentinel" or "redis-cluster".
  std::string_view name() const noexcept override;

  /// The Redis key a record of `key` lives under, e.g. "idem:{payment|order_1}".
  std::string redis_key(const Key& key) const;
  /// Connection counters (read them on the store's executor, or when it is idle).
  AsyncRedisStats stats() const;
  /// Routing counters (Sentinel, Cluster).
  redis::RedisRouteStats route_stats() const;
  /// The options in force (zeros replaced).
  const AsyncRedisStoreOptions& options() const noexcept;

 private:
  class Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace idem::async
