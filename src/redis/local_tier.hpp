// SPDX-License-Identifier: MIT
// The local tier of a RedisStore: completed records kept in the process, made coherent by Redis
// client-side caching in broadcast mode (docs/redis.md, "Local tier").
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "idem/clock.hpp"
#include "idem/log.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/store.hpp"
#include "pool.hpp"

namespace idem::redis::detail {

/// Settings of a LocalTier (zeros already replaced by defaults).
struct LocalTierSettings {
  std::size_t max_entries = 10000;
  std::size_t max_bytes = std::size_t{16} << 20;
  std::chrono::milliseconds ttl_when_untracked{1000};
  LogSink log;
  /// The store's key prefix: tracking broadcasts every write of a key starting with it.
  std::string key_prefix;
  /// Least time between two attempts to open the invalidation connection.
  std::chrono::milliseconds retry{100};
  /// How often the invalidation thread asks `servers` which nodes serve keys now (a Sentinel
  /// failover, a new Cluster slot map).
  std::chrono::milliseconds recheck{100};
};

/// Completed records by Redis key, bounded in entries and bytes (least recently used first),
/// each until min(its expiry in Redis, as read with PTTL, and, untracked, ttl_when_untracked).
/// A thread of its own holds one invalidation connection per serving node (the one server, the
/// Sentinel master, every Cluster master owning slots): `CLIENT TRACKING ON REDIRECT <own id>
/// BCAST PREFIX <prefix>`, then `SUBSCRIBE __redis__:invalidate`. Each message removes its
/// keys, a flush-all message (nil) removes everything, and a broken (or no longer serving)
/// connection drops the tier. A record is kept only when the node serving its key is tracked,
/// and a fill carries the Ticket taken before its read was sent: an invalidation of that key's
/// stripe, a drop, or a node's tracking start since then makes it a no-op, so a fill never
/// brings back a record deleted while its read was on the wire.
class LocalTier {
 public:
  /// `servers` names the pools of the nodes whose writes the tier must hear now; it may throw,
  /// and is called from the tier's thread only (every `recheck`).
  LocalTier(LocalTierSettings settings, std::function<std::vector<Pool*>()> servers);
  ~LocalTier();
  LocalTier(const LocalTier&) = delete;
  LocalTier& operator=(const LocalTier&) = delete;

  /// Taken before the read that may fill the tier is sent.
  struct Ticket {
    std::uint64_t generation = 0;
    std::uint64_t stripe = 0;
  };
  Ticket ticket(std::string_view redis_key) const noexcept;

  enum class Answer { kHit, kMiss };
  /// A claim of `redis_key` with `fingerprint` by `owner`: kHit (and `out` set, as the rulebook
  /// answers a completed record) when a fresh entry with the same fingerprint is kept.
  Answer claim(std::string_view redis_key, std::string_view fingerprint, std::string_view owner,
               ClaimResult& out);
  /// A lookup: kHit (and `out` set) when a fresh entry is kept.
  Answer lookup(std::string_view redis_key, Record& out);

  /// Keeps a completed record that `server` (the node serving the key) answered with `pttl_ms`
  /// to live, the read sent at `sent_at` (steady) / `sent_at_system`. A no-op when `t` is
  /// stale, `server` is not tracked, or the record does not fit.
  void fill(std::string_view redis_key, const Ticket& t, const Pool* server,
            std::string_view fingerprint, std::string_view owner, std::string_view response,
            long long created_ms, long long pttl_ms, std::chrono::steady_clock::time_point sent_at,
            TimePoint sent_at_system);

  /// Removes `redis_key` (a write of this process) and invalidates its stripe.
  void forget(std::string_view redis_key);

  /// Whether a record of these sizes fits max_bytes (else a fill is not worth its read).
  bool fits(std::string_view redis_key, std::string_view fingerprint, std::string_view owner,
            std::string_view response) const noexcept {
    return cost(redis_key, fingerprint, owner, response) <= settings_.max_bytes;
  }

  /// Whether some node is tracked (or untracked with a TTL): a fill may be kept.
  bool filling() const noexcept { return filling_.load(std::memory_order_relaxed); }

  RedisLocalTierStats stats() const;

 private:
  enum class NodeState { kTracking, kUntracked };
  struct Entry {
    std::string key, fingerprint, owner, response;
    long long created_ms = 0;
    std::chrono::steady_clock::time_point expires{};
    TimePoint expires_system{};
    std::size_t bytes = 0;
  };
  using List = std::list<Entry>;
  struct Conn;
  static constexpr std::size_t kStripes = 256;

  static std::size_t stripe_of(std::string_view redis_key) noexcept;
  // An entry's size as max_bytes counts it.
  static std::size_t cost(std::string_view redis_key, std::string_view fingerprint,
                          std::string_view owner, std::string_view response) noexcept {
    return redis_key.size() + fingerprint.size() + owner.size() + response.size() + kEntryOverhead;
  }
  // Counted per entry on top of its strings (list node, index slot, allocator headers).
  static constexpr std::size_t kEntryOverhead = 128;
  List::iterator find_fresh(std::string_view redis_key);  // mutex_ held; end() when none
  void erase(List::iterator it);                          // mutex_ held
  void invalidate(std::string_view redis_key);
  void drop_all();  // counted in drops
  void set_node(const Pool* server, std::optional<NodeState> state);
  void run();
  void open(Conn& conn);                // tier thread
  bool read(Conn& conn);                // false: broken
  void close(Conn& conn, bool broken);  // tier thread
  void log(LogLevel level, const std::string& line) const;

  const LocalTierSettings settings_;
  const std::function<std::vector<Pool*>()> servers_;

  mutable std::mutex mutex_;  // guards the entries, bytes_, nodes_, and the stripes' changes
  List lru_;                  // most recently used first
  std::unordered_map<std::string_view, List::iterator> index_;  // views lru_'s keys
  std::size_t bytes_ = 0;
  std::unordered_map<const Pool*, NodeState> nodes_;  // nodes with an established connection
  std::array<std::atomic<std::uint64_t>, kStripes> stripes_{};
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<bool> filling_{false}, all_tracked_{false}, any_untracked_{false};
  bool untracked_logged_ = false;  // tier thread only

  std::atomic<std::uint64_t> hits_{0}, misses_{0}, fingerprint_misses_{0}, fills_{0},
      fills_skipped_{0}, invalidations_{0}, evictions_{0}, drops_{0}, tracking_starts_{0};

  int wake_fd_ = -1;  // eventfd: the destructor wakes the thread
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: started once everything above exists
};

}  // namespace idem::redis::detail
