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
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>

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
  /// How often the invalidation thread asks `server` whether the server changed (Sentinel
  /// failover); 0: never (one server).
  std::chrono::milliseconds recheck{0};
};

/// Completed records by Redis key, bounded in entries and bytes (least recently used first),
/// each until min(its expiry in Redis, as read with PTTL, and, untracked, ttl_when_untracked).
/// A thread of its own holds the invalidation connection (`CLIENT TRACKING ON REDIRECT <own
/// id> BCAST PREFIX <prefix>`, then `SUBSCRIBE __redis__:invalidate`): each message removes
/// its keys, a flush-all message (nil) removes everything, and a broken connection drops the
/// tier and stops fills until tracking is back. A fill carries the Ticket taken before its read
/// was sent: an invalidation of that key's stripe (or a drop) since then makes it a no-op, so
/// a fill never brings back a record deleted while its read was on the wire.
class LocalTier {
 public:
  /// `server` names the pool of the server whose writes the tier must hear (the one server, or
  /// the Sentinel master now); it may throw (no master known), and is called from the tier's
  /// thread only.
  LocalTier(LocalTierSettings settings, std::function<Pool&()> server);
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

  /// Keeps a completed record read from Redis with `pttl_ms` to live, the read sent at
  /// `sent_at` (steady) / `sent_at_system`. A no-op when `t` is stale, tracking is down, or the
  /// record does not fit.
  void fill(std::string_view redis_key, const Ticket& t, std::string_view fingerprint,
            std::string_view owner, std::string_view response, long long created_ms,
            long long pttl_ms, std::chrono::steady_clock::time_point sent_at,
            TimePoint sent_at_system);

  /// Removes `redis_key` (a write of this process) and invalidates its stripe.
  void forget(std::string_view redis_key);

  /// Whether a fill could be kept now (tracking established, or untracked with a TTL).
  bool filling() const noexcept;

  RedisLocalTierStats stats() const;

 private:
  enum class State { kDown, kTracking, kUntracked };
  struct Entry {
    std::string key, fingerprint, owner, response;
    long long created_ms = 0;
    std::chrono::steady_clock::time_point expires{};
    TimePoint expires_system{};
    std::size_t bytes = 0;
  };
  using List = std::list<Entry>;
  static constexpr std::size_t kStripes = 256;

  static std::size_t stripe_of(std::string_view redis_key) noexcept;
  List::iterator find_fresh(std::string_view redis_key);  // mutex_ held; end() when none
  void erase(List::iterator it);                          // mutex_ held
  void invalidate(std::string_view redis_key);
  void drop_all(State next);
  void set_state(State next);
  void run();
  // One connection's life: true when it ended because the tier is stopping.
  bool serve(Pool& server);
  bool sleep_for(std::chrono::milliseconds d);  // true when stopping
  void log(LogLevel level, const std::string& line) const;

  const LocalTierSettings settings_;
  const std::function<Pool&()> server_;

  mutable std::mutex mutex_;  // guards the entries, bytes_, and the stripes' changes
  List lru_;                  // most recently used first
  std::unordered_map<std::string_view, List::iterator> index_;  // views lru_'s keys
  std::size_t bytes_ = 0;
  std::array<std::atomic<std::uint64_t>, kStripes> stripes_{};
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<State> state_{State::kDown};
  bool untracked_logged_ = false;  // tier thread only

  std::atomic<std::uint64_t> hits_{0}, misses_{0}, fingerprint_misses_{0}, fills_{0},
      fills_skipped_{0}, invalidations_{0}, evictions_{0}, drops_{0}, tracking_starts_{0};

  int wake_fd_ = -1;  // eventfd: the destructor wakes the thread
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: started once everything above exists
};

}  // namespace idem::redis::detail
