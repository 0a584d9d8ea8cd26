// SPDX-License-Identifier: MIT
// idem::redis: the Redis fast store (hiredis underneath, never in this header).
//
// File: redis/redis_store.hpp
//
// `RedisStore` is the claim at the entrance, the protocol's second layer (docs/design.md): one
// Redis round trip per claim, over a bounded, thread-safe connection pool.
//
// * Key layout: `<key_prefix>{<scope>|<id>}`, e.g. `idem:{payment|order_20001}`. The braces are
//   a Redis Cluster hash tag (one record, one slot); the '|' comes from idem::Key::str(), which
//   keeps "a:b"+"c" and "a"+"b:c" apart (scopes may contain ':', never '|').
// * One record is one Redis string: a short header (status, created_at, fingerprint, owner)
//   followed by the response bytes. While in progress, the key's PX TTL *is* the lease; once
//   completed, its TTL is the retention.
// * claim is one atomic round trip: `SET <key> <in-progress record> NX PX <lease> GET` claims an
//   absent key or returns the existing record unchanged, which the client decodes: busy / done
//   / mismatch, the fingerprint check winning over busy and done. (On Redis < 7.0, or with
//   `claim_script`, the same is one EVALSHA of a Lua script.) complete and release are Lua
//   scripts (EVALSHA; on NOSCRIPT, one EVAL, which reloads them) that act only while the owner
//   token matches (false: the lease was lost). fill is one SET; lookup one script.
// * Failures are idem exceptions: refused, reset, EOF and pool exhaustion are
//   StorageUnavailable; a timeout is StorageTimeout; a timeout or a lost connection after a
//   complete, fail, release, extend or fill went out is OutcomeUnknown (the write may have
//   applied); -LOADING, -BUSY, -MASTERDOWN, -READONLY are
//   StorageUnavailable; -OOM is StorageError; a value under an idem key that idem did not write is
//   CorruptRecord.
// * `rediss://`: TLS (certificate chain and host name verified, SNI, CA file, client
//   certificate: RedisStoreOptions::tls), done by idem over OpenSSL next to hiredis 0.14,
//   which has none; a certificate or handshake failure is a StorageError of the connect.
// * When the server is down, calls fail fast (a connect is tried at most once per
//   `reconnect_backoff`), and the pool reconnects by itself once the server is back.
//
// * Scale-out: `redis-sentinel://h:p[,h:p...]/<service>` asks the sentinels for the service's
//   master (SENTINEL get-master-addr-by-name, then ROLE on it) and asks again after a failover
//   (connection errors, READONLY, and every `sentinel_check_interval`).
//   `redis-cluster://h:p[,h:p...]` reads the slot map (CLUSTER SLOTS) from any seed, sends each
//   command to the master owning its key's hash slot (the `{...}` tag), keeps one pool per node,
//   follows MOVED (and re-reads the map) and ASK (ASKING, then the command on that node), and
//   treats CLUSTERDOWN / TRYAGAIN as StorageUnavailable. Every record is one key, so the same
//   commands and scripts run in all three layouts. See docs/scale-out.md.
//
// Because a lease is a TTL, an expired lease leaves no trace: a claim after it answers kClaimed
// with `took_over == false` (the durable store, which keeps expired leases, reports takeovers).
//
// @code
//   idem::redis::RedisStore fast{"redis://127.0.0.1:6379"};
//   idem::sqlite::SqliteStore durable{"payments.db"};
//   idem::IdempotencyGuard guard{fast, durable};
// @endcode
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/export.hpp"
#include "idem/log.hpp"
#include "idem/redis/tls_options.hpp"
#include "idem/store.hpp"

namespace idem::redis {

/// The local tier of a RedisStore (RedisStoreOptions::local_tier): completed records kept in
/// the process, in front of Redis, so that a duplicate of a hot key is answered with no round
/// trip. Only completed records are kept (in-progress and failed ones are always asked of
/// Redis); the fingerprint is compared on every hit (a mismatch goes to Redis); an entry never
/// outlives the record's expiry in Redis. Coherence: Redis client-side caching in broadcast
/// mode (`CLIENT TRACKING ON BCAST PREFIX <key_prefix>` on one invalidation connection per
/// serving node: the server, the Sentinel master, each Cluster master; subscribed to
/// `__redis__:invalidate`): every write under the prefix by any client drops the key from every
/// process's tier. When such a connection breaks the whole tier is dropped, and a record is
/// kept only while the node serving its key is tracked. See docs/redis.md ("Local tier").
struct LocalTierOptions {
  /// Keep completed records in the process. false (the default): every call asks Redis.
  bool enabled = false;
  /// Most records kept; the least recently used goes first. 0 means 10000.
  std::size_t max_entries = 10000;
  /// Most bytes kept, counted as key + fingerprint + owner + response + 128 per entry; the
  /// least recently used goes first, and a record larger than this is never kept. 0 means
  /// 16 MiB.
  std::size_t max_bytes = std::size_t{16} << 20;
  /// When the server refuses tracking (an ACL without CLIENT, a server older than Redis 6.0),
  /// entries are kept at most this long (and never beyond the record's expiry), so a delete
  /// elsewhere is seen within it; logged once through `log`. 0 means do not keep entries then.
  std::chrono::milliseconds ttl_when_untracked{1000};
  /// Receives one warn line when tracking is unavailable and the TTL bound is in force (and one
  /// info line when tracking is established after that). Empty: silent.
  LogSink log;
};

/// Options of a RedisStore. `RedisStoreOptions{"redis://host:6379"}` sets the URI only.
struct RedisStoreOptions {
  /// Server address: `redis://[[user]:password@]host[:port][/db]` (port 6379 and db 0 by
  /// default), `rediss://...` (the same over TLS: see `tls`), `tcp://host[:port][/db]`, or
  /// `unix:///path/to/redis.sock[?db=N]`. Percent-escapes are decoded in user and password.
  /// Scale-out: `redis-sentinel://[[user]:password@]h:p[,h:p...]/<service>[/db]` (credentials and
  /// db are the master's; sentinels are asked without them) and
  /// `redis-cluster://[[user]:password@]h:p[,h:p...]` (seed nodes; any one reachable suffices).
  /// The pool settings below apply per node.
  std::string uri = "redis://127.0.0.1:6379";
  /// Most connections open at once (each serves one call at a time). 0 means 8; at most
  /// 10,000. The waits below are at most a day each (a UsageError otherwise).
  std::size_t pool_size = 8;
  /// Longest wait for a TCP or Unix connect (and AUTH/SELECT). 0 means 500 ms.
  std::chrono::milliseconds connect_timeout{500};
  /// Longest wait for one command's reply; the connection is then dropped. 0 means 1000 ms
  /// (a command never waits forever).
  std::chrono::milliseconds command_timeout{1000};
  /// Longest wait for a free connection when all `pool_size` are busy, then
  /// StorageUnavailable. 0 means do not wait.
  std::chrono::milliseconds pool_wait_timeout{100};
  /// Prepended to every key (then `{<scope>|<id>}`). Empty means no prefix.
  std::string key_prefix = "idem:";
  /// After a failed connect, further calls fail at once (StorageUnavailable, with the last
  /// error) for this long before a new connect is tried. 0 means try a connect on every call.
  std::chrono::milliseconds reconnect_backoff{100};
  /// Claim with an EVALSHA Lua script instead of `SET ... NX PX ... GET`. false (the default)
  /// uses the single native command, and switches to the script by itself on servers older
  /// than Redis 7.0 (which reject NX with GET). Both are one atomic round trip. When true (or
  /// on such servers) complete also takes its general script instead of the one-write one.
  bool claim_script = false;
  /// Sentinel and Cluster: least time between two re-discoveries (master, slot map) triggered
  /// by failures or MOVED. 0 means 100 ms.
  std::chrono::milliseconds topology_refresh_interval{100};
  /// Sentinel: the master is re-checked this often even when nothing failed. 0 means only after
  /// failures.
  std::chrono::milliseconds sentinel_check_interval{1000};
  /// Fraction of the lease, counted on the client's monotonic clock from just before the claim
  /// was sent, within which the completion of that claim (complete_claimed with its ticket,
  /// as the guard completes; any thread) is one native
  /// `SET key <completed record> XX PX <retention>` instead of the owner-checked script: the
  /// key cannot have changed owner before its lease ran out on the server, and that lease
  /// started after the claim was sent (docs/redis.md states the argument and its residual
  /// risk, a client pause longer than the margin). Past it, complete takes the script. 0 means
  /// always the script. Must be in [0, 0.9].
  double native_complete_fraction = 0.5;
  /// Auto-pipelining: single calls (claim, complete, fail, release, extend, fill, lookup) of
  /// concurrent threads share one connection per server (per node in a cluster): a call queues
  /// its command; when no batch is on the wire it writes every queued command in one write and
  /// reads the replies in order, each handed to its caller as it arrives. A lone caller is never
  /// delayed (no timer: it sends at once from its own stack), and pays two mutex operations
  /// more than without (~1.5% of a one-thread replay against a server on the same CPU). A broken
  /// connection fails every call on the wire with the error the call would get alone; each
  /// call keeps its own deadline (command_timeout once written). claim_batch, complete_batch
  /// and ASK redirects take pooled connections of their own (the shared one is
  /// pooled too: taken while batches follow each other, given back when no call is queued).
  /// Off by default: a lone caller measured ~1.5% slower with it. Turn it on when many threads
  /// call at once (a thread pool under load: 1.6x the replays of 64 raw connections, 1.35x at 8
  /// threads). See docs/redis.md ("Auto-pipelining") for the figures.
  bool auto_pipeline = false;
  /// `rediss://` only: the CA file, expected server name and client certificate. The server's
  /// certificate and name are always verified (docs/redis.md, "TLS"). Sentinel and Cluster
  /// URIs take no TLS.
  TlsOptions tls{};
  /// Completed records kept in the process in front of Redis (off by default; see
  /// LocalTierOptions and docs/redis.md, "Local tier").
  LocalTierOptions local_tier{};
};

/// Routing counters of a RedisStore (Sentinel and Cluster; zero for one server).
struct RedisRouteStats {
  /// MOVED replies followed (the slot map was then re-read).
  std::uint64_t moved = 0;
  /// ASK replies followed (ASKING, then the command on the importing node).
  std::uint64_t ask = 0;
  /// Successful re-discoveries (CLUSTER SLOTS read, or Sentinel master confirmed).
  std::uint64_t refreshes = 0;
  /// Re-discoveries that reached no node / sentinel able to answer.
  std::uint64_t refresh_failures = 0;
  /// Sentinel: times the master address changed (failovers seen).
  std::uint64_t master_changes = 0;
  /// Data nodes known (pools created).
  std::size_t nodes = 0;
};

/// Counters of how a RedisStore completed records (for metrics and tests).
struct RedisCommandStats {
  /// complete calls (single or batched) sent as one native SET ... XX within the lease margin.
  std::uint64_t native_completes = 0;
  /// complete calls sent as an owner-checked Lua script (EVALSHA).
  std::uint64_t script_completes = 0;
  /// claim_batch calls sent as one pipeline.
  std::uint64_t pipelined_claim_batches = 0;
  /// complete_batch calls that sent a pipeline.
  std::uint64_t pipelined_complete_batches = 0;
};

/// Counters of a RedisStore's pool (for metrics and tests).
struct RedisPoolStats {
  /// Connections established since construction.
  std::uint64_t connects = 0;
  /// Connect attempts that failed.
  std::uint64_t connect_failures = 0;
  /// Connections dropped because they broke (I/O error, timeout, protocol error) or were
  /// found closed by the server while idle.
  std::uint64_t dropped = 0;
  /// Calls refused without trying because a connect failed less than reconnect_backoff ago.
  std::uint64_t fast_failures = 0;
  /// Calls that waited for a free connection and gave up (pool exhausted).
  std::uint64_t exhausted = 0;
  /// Scripts (re)loaded after a NOSCRIPT answer.
  std::uint64_t script_loads = 0;
  /// Connections open now (idle or lent).
  std::size_t open = 0;
  /// Connections idle in the pool now.
  std::size_t idle = 0;
  /// Auto-pipelining (RedisStoreOptions::auto_pipeline): batches written on the shared
  /// connection (pipelined_commands / pipelined_flushes is the mean batch size).
  std::uint64_t pipelined_flushes = 0;
  /// Auto-pipelining: commands those batches carried.
  std::uint64_t pipelined_commands = 0;
};

/// Counters of a RedisStore's local tier (RedisStoreOptions::local_tier; zero when disabled).
struct RedisLocalTierStats {
  /// Claims and lookups answered from the tier (no round trip).
  std::uint64_t hits = 0;
  /// Claims and lookups the tier could not answer (absent, expired, or another fingerprint),
  /// sent to Redis.
  std::uint64_t misses = 0;
  /// Of the misses: entries found with another fingerprint (Redis answers the mismatch).
  std::uint64_t fingerprint_misses = 0;
  /// Completed records put in the tier (after a claim answered done, or a lookup).
  std::uint64_t fills = 0;
  /// Fills skipped because the key was invalidated (or the tier dropped) while its read was on
  /// the wire, or because tracking was down.
  std::uint64_t fills_skipped = 0;
  /// Keys named by invalidation messages (every write under the key prefix, by any client).
  std::uint64_t invalidations = 0;
  /// Entries removed to stay within max_entries / max_bytes.
  std::uint64_t evictions = 0;
  /// Times the whole tier was dropped: the invalidation connection broke or was replaced (server
  /// restart, CLIENT KILL, Sentinel failover), or Redis sent a flush-all (FLUSHDB / FLUSHALL).
  std::uint64_t drops = 0;
  /// Times tracking was established on a new invalidation connection.
  std::uint64_t tracking_starts = 0;
  /// Entries kept now.
  std::size_t entries = 0;
  /// Bytes kept now (as counted by max_bytes).
  std::size_t bytes = 0;
  /// Tracking is established now (invalidations arrive; entries live until the record's expiry).
  bool tracking = false;
  /// Tracking was refused by the server: entries live at most ttl_when_untracked.
  bool untracked = false;
};

/// The Redis FastStore (see the file comment). Thread-safe; share one per process and server.
class IDEM_EXPORT RedisStore final : public FastStore {
 public:
  /// Validates the options; connects lazily (a service starts even while Redis is down).
  /// @throws idem::UsageError for a malformed URI or a bad option.
  explicit RedisStore(RedisStoreOptions options);
  /// Same as `RedisStore(RedisStoreOptions{std::string(uri)})`. @throws idem::UsageError.
  explicit RedisStore(std::string_view uri);
  /// Closes every connection (lent connections must have been returned: no call may run).
  ~RedisStore() override;
  RedisStore(const RedisStore&) = delete;
  RedisStore& operator=(const RedisStore&) = delete;

  /// One round trip (plus redirects in a cluster): claimed / busy / done / mismatch (see
  /// FastStore::claim).
  /// @throws idem::StorageUnavailable, idem::StorageTimeout, idem::StorageError,
  ///         idem::CorruptRecord (foreign value under the key), idem::UsageError (lease <= 0).
  ClaimResult claim(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                    std::chrono::milliseconds lease) override;

  /// Completes `owner`'s in-progress record with `response`, kept for `retention`.
  /// @return false when the lease was lost. @throws as claim; idem::OutcomeUnknown when the
  ///         reply timed out or the connection was lost after the command went out (the
  ///         write may have applied).
  bool complete(const Key& key, const OwnerToken& owner, std::string_view response,
                std::chrono::seconds retention) override;

  /// As complete(), with the ticket of `owner`'s claim (ClaimResult::ticket): within the lease
  /// margin (RedisStoreOptions::native_complete_fraction) one native `SET ... XX`, past it the
  /// one-write script that expects the claim's own record. Any thread may complete.
  bool complete_claimed(const Key& key, const OwnerToken& owner, const ClaimTicket& ticket,
                        std::string_view response, std::chrono::seconds retention) override;

  /// Marks `owner`'s in-progress record failed with `reason` (status letter 'F'; an
  /// owner-checked script), kept for `retention`. @return false when the lease was lost.
  bool fail(const Key& key, const OwnerToken& owner, std::string_view reason,
            std::chrono::seconds retention) override;

  /// Deletes `owner`'s in-progress record. @return false when `owner` did not hold it.
  bool release(const Key& key, const OwnerToken& owner) override;

  /// Extends `owner`'s in-progress record: its TTL becomes `lease` (one owner-checked script;
  /// the record's bytes stay as they are). @return false when `owner` does not hold it.
  bool extend(const Key& key, const OwnerToken& owner, std::chrono::milliseconds lease) override;

  /// Writes a completed record unconditionally (owner unknown: stored empty).
  void fill(const Key& key, std::string_view fingerprint, std::string_view response,
            std::chrono::seconds retention) override;

  /// As fill(), the record created at `origin.first_seen` (the durable record's; epoch: now).
  /// A completed record keeps no owner.
  void refill(const Key& key, std::string_view fingerprint, std::string_view response,
              std::chrono::seconds retention, const RecordOrigin& origin) override;

  /// Claims every request in ONE round trip (a pipeline of `SET ... NX PX ... GET` on one
  /// connection); answers as claim, in order (see FastStore::claim_batch). On servers without
  /// SET NX GET (or with claim_script) it claims one by one.
  std::vector<ClaimResult> claim_batch(const std::vector<ClaimRequest>& requests,
                                       std::chrono::milliseconds lease) override;

  /// Completes every request in one round trip: requests with their claim's ticket
  /// (CompleteRequest::ticket) still within the lease margin are pipelined as native
  /// SET ... XX; the others take the owner-checked script one by one. Answers as complete, in
  /// order.
  std::vector<bool> complete_batch(const std::vector<CompleteRequest>& requests,
                                   std::chrono::seconds retention) override;

  /// Reads a record. `lease_until` (in progress) or `expires_at` (completed) come from the
  /// key's TTL; `updated_at` equals `created_at` (not stored). nullopt when absent.
  std::optional<Record> lookup(const Key& key) override;

  /// "redis", "redis-sentinel" or "redis-cluster" (from the URI's scheme).
  std::string_view name() const noexcept override;

  /// The Redis key a record of `key` lives under, e.g. "idem:{payment|order_1}".
  std::string redis_key(const Key& key) const;

  /// Pool counters (summed over every node).
  RedisPoolStats pool_stats() const;

  /// Routing counters: redirects followed, re-discoveries, failovers seen.
  RedisRouteStats route_stats() const;

  /// How completes were sent (native SET or script).
  RedisCommandStats command_stats() const;

  /// Local tier counters (RedisStoreOptions::local_tier).
  RedisLocalTierStats local_tier_stats() const;

  /// The options in force (zeros replaced by their defaults, password not hidden).
  const RedisStoreOptions& options() const noexcept;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::redis
