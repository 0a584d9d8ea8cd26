// SPDX-License-Identifier: MIT
// idem::MemoryStore: an in-process fast store, sharded, with lease and retention expiry.
//
// It is a real product store, not a test double: the fast store of a single-process service,
// the fast store in front of SQLite in the embedded default, and the store of unit tests.
// Records live as long as the process; a restart forgets them (the durable store remembers).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "idem/clock.hpp"
#include "idem/detail/record_rules.hpp"
#include "idem/errors.hpp"
#include "idem/store.hpp"

namespace idem {

/// Options of a MemoryStore.
struct MemoryStoreOptions {
  /// Number of independently locked shards (rounded up to a power of two; 0 means 64).
  std::size_t shards = 64;
  /// Time source for leases and retention (empty means the system clock).
  Clock clock;
  /// Expired records of a shard are swept after this many writes to it (0 means never: expired
  /// records are then dropped only when their key is touched, or by purge_expired()).
  std::size_t sweep_every = 1024;
  /// The most records held at once (0 means no limit). A claim of a new key when the store is
  /// full first drops the expired records of the key's shard, then, if still full, throws
  /// idem::StorageUnavailable: a guard with a durable store runs that call on the durable store
  /// alone (degraded), a guard without one answers it as a retryable failure. A `fill` (the
  /// copy of a durable record) is skipped when full. Concurrent claims may overshoot the limit
  /// by one record per thread. Bound it when keys come from clients: each record holds its
  /// key, fingerprint and response for the whole retention.
  std::size_t max_records = 0;
};

/// Thread-safe in-memory FastStore.
///
/// @code
///   idem::MemoryStore fast;
///   idem::IdempotencyGuard guard{fast};   // fast store only: best effort within one process
/// @endcode
class MemoryStore final : public FastStore {
 public:
  /// An empty store. @param options shard count and sweep settings (MemoryStoreOptions)
  explicit MemoryStore(MemoryStoreOptions options = {}) : options_(std::move(options)) {
    std::size_t n = 1;
    std::size_t want = options_.shards == 0 ? 64 : options_.shards;
    while (n < want) n <<= 1;
    shards_ = std::vector<Shard>(n);
    if (!options_.clock) options_.clock = system_now;
  }

  ClaimResult claim(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                    std::chrono::milliseconds lease) override {
    check_lease(lease);
    auto now = options_.clock();
    auto composed = key.str();
    Shard& shard = shard_for(composed);
    std::lock_guard<std::mutex> lock(shard.mutex);
    maybe_sweep(shard, now);
    auto it = shard.map.find(composed);
    ClaimResult result;
    if (it != shard.map.end()) {
      Entry& e = it->second;
      detail::ClaimDecision d = detail::decide_claim(found(e, now), fingerprint, owner.str());
      switch (d.action) {
        case detail::ClaimAction::kAnswer:
        case detail::ClaimAction::kKeep:
          return std::move(d.result);
        case detail::ClaimAction::kTakeOver:
          // The holder's lease expired: take over with a new owner (fencing token).
          e.owner = owner.str();
          e.lease_until = now + lease;
          e.updated_at = now;
          return std::move(d.result);
        case detail::ClaimAction::kReplace:
          erase(shard, it);
          break;
      }
    }
    if (full(shard, now)) {
      throw StorageUnavailable("idem::MemoryStore: full (MemoryStoreOptions::max_records = " +
                               std::to_string(options_.max_records) + " records held)");
    }
    Entry e;
    e.status = Record::Status::kInProgress;
    e.fingerprint = std::string(fingerprint);
    e.owner = owner.str();
    e.lease_until = now + lease;
    e.created_at = now;
    e.updated_at = now;
    shard.map.emplace(std::move(composed), std::move(e));
    records_.fetch_add(1, std::memory_order_relaxed);
    result.status = ClaimStatus::kClaimed;
    return result;
  }

  bool complete(const Key& key, const OwnerToken& owner, std::string_view response,
                std::chrono::seconds retention) override {
    return finish(key, owner, Record::Status::kCompleted, response, retention);
  }

  /// Marks `owner`'s in-progress record failed with `reason` (a dead-lettered message), kept
  /// for `retention`; claims then answer kDone with ClaimResult::failed.
  bool fail(const Key& key, const OwnerToken& owner, std::string_view reason,
            std::chrono::seconds retention) override {
    return finish(key, owner, Record::Status::kFailed, reason, retention);
  }

  bool release(const Key& key, const OwnerToken& owner) override {
    return with_held(key, owner, [this](Shard& shard, Map::iterator it) { erase(shard, it); });
  }

  /// Extends `owner`'s in-progress claim to `lease` from now. @return false if not held.
  bool extend(const Key& key, const OwnerToken& owner, std::chrono::milliseconds lease) override {
    check_lease(lease);
    auto now = options_.clock();
    return with_held(key, owner, [&](Shard&, Map::iterator it) {
      it->second.lease_until = now + lease;
      it->second.updated_at = now;
    });
  }

  void fill(const Key& key, std::string_view fingerprint, std::string_view response,
            std::chrono::seconds retention) override {
    refill(key, fingerprint, response, retention, RecordOrigin{});
  }

  /// As fill(), the record created at `origin.first_seen` (epoch: now, or when a record it
  /// overwrites was created) and completed by `origin.holder`.
  void refill(const Key& key, std::string_view fingerprint, std::string_view response,
              std::chrono::seconds retention, const RecordOrigin& origin) override {
    check_retention(retention);
    auto now = options_.clock();
    auto composed = key.str();
    Shard& shard = shard_for(composed);
    std::lock_guard<std::mutex> lock(shard.mutex);
    auto it = shard.map.find(composed);
    if (it == shard.map.end()) {
      if (full(shard, now)) return;  // a copy: the durable store still answers
      it = shard.map.emplace(std::move(composed), Entry{}).first;
      records_.fetch_add(1, std::memory_order_relaxed);
    }
    Entry& e = it->second;
    if (origin.first_seen != TimePoint{}) {
      e.created_at = origin.first_seen;
    } else if (e.created_at == TimePoint{}) {
      e.created_at = now;
    }
    e.status = Record::Status::kCompleted;
    e.owner = std::string(origin.holder);
    e.fingerprint = std::string(fingerprint);
    e.response = std::string(response);
    e.updated_at = now;
    e.expires_at = now + retention;
  }

  std::optional<Record> lookup(const Key& key) override {
    auto now = options_.clock();
    auto composed = key.str();
    Shard& shard = shard_for(composed);
    std::lock_guard<std::mutex> lock(shard.mutex);
    auto it = shard.map.find(composed);
    if (it == shard.map.end() || expired(it->second, now)) return std::nullopt;
    const Entry& e = it->second;
    Record r;
    r.status = e.status;
    r.fingerprint = e.fingerprint;
    r.owner = e.owner;
    r.response = e.response;
    r.lease_until = e.lease_until;
    r.created_at = e.created_at;
    r.updated_at = e.updated_at;
    r.expires_at = e.expires_at;
    return r;
  }

  std::string_view name() const noexcept override { return "memory"; }

  /// Drops every expired record now. @return how many were dropped.
  std::size_t purge_expired() {
    auto now = options_.clock();
    std::size_t dropped = 0;
    for (auto& shard : shards_) {
      std::lock_guard<std::mutex> lock(shard.mutex);
      dropped += sweep(shard, now);
    }
    return dropped;
  }

  /// Forgets every record, as a Redis FLUSHALL or a failover to an empty replica would.
  /// The durable store still decides; duplicates are then caught by its unique key.
  void clear() {
    for (auto& shard : shards_) {
      std::lock_guard<std::mutex> lock(shard.mutex);
      records_.fetch_sub(shard.map.size(), std::memory_order_relaxed);
      shard.map.clear();
    }
  }

  /// Number of records held, expired ones not yet dropped included.
  std::size_t size() const {
    std::size_t n = 0;
    for (auto& shard : shards_) {
      std::lock_guard<std::mutex> lock(shard.mutex);
      n += shard.map.size();
    }
    return n;
  }

 private:
  struct Entry {
    Record::Status status = Record::Status::kInProgress;
    std::string fingerprint;
    std::string owner;
    std::string response;
    TimePoint lease_until{};
    TimePoint created_at{};
    TimePoint updated_at{};
    TimePoint expires_at{};
  };
  using Map = std::unordered_map<std::string, Entry>;
  struct Shard {
    mutable std::mutex mutex;
    Map map;
    std::size_t writes = 0;
  };

  // complete / fail: only while `owner` still holds the in-progress record (an expired lease
  // not yet taken over still belongs to its owner: nobody else can have run).
  bool finish(const Key& key, const OwnerToken& owner, Record::Status status,
              std::string_view response, std::chrono::seconds retention) {
    check_retention(retention);
    auto now = options_.clock();
    return with_held(key, owner, [&](Shard&, Map::iterator it) {
      Entry& e = it->second;
      e.status = status;
      e.response = std::string(response);
      e.updated_at = now;
      e.expires_at = now + retention;
    });
  }

  // Runs `act(shard, it)` under the shard's lock on `key`'s record if `owner`'s in-progress
  // claim still holds it (the rulebook's may_finish). @return whether it did.
  template <typename Act>
  bool with_held(const Key& key, const OwnerToken& owner, Act&& act) {
    auto composed = key.str();
    Shard& shard = shard_for(composed);
    std::lock_guard<std::mutex> lock(shard.mutex);
    auto it = shard.map.find(composed);
    if (it == shard.map.end()) return false;
    if (!detail::may_finish(it->second.status, it->second.owner, owner.str())) return false;
    act(shard, it);
    return true;
  }

  // The rulebook's view of an entry at `now`.
  static detail::FoundRecord found(const Entry& e, TimePoint now) noexcept {
    return detail::found_by_store_clock(
        e, e.status == Record::Status::kInProgress && e.lease_until > now, expired(e, now));
  }

  static void check_lease(std::chrono::milliseconds lease) {
    detail::check_term(lease, "idem::MemoryStore: the lease");
  }
  static void check_retention(std::chrono::seconds retention) {
    detail::check_term(retention, "idem::MemoryStore: the retention");
  }

  // A completed (or failed) record expires with its retention. An in-progress record whose
  // lease ended is kept (a claim takes it over, which counts as a takeover) unless it is a whole
  // retention period stale, so abandoned claims do not pile up forever.
  static bool expired(const Entry& e, TimePoint now) noexcept {
    if (e.status != Record::Status::kInProgress) return e.expires_at <= now;
    return e.lease_until + kDefaultRetention <= now;
  }

  Shard& shard_for(const std::string& composed) {
    return shards_[std::hash<std::string>{}(composed) & (shards_.size() - 1)];
  }

  void maybe_sweep(Shard& shard, TimePoint now) {
    if (options_.sweep_every == 0) return;
    if (++shard.writes % options_.sweep_every == 0) sweep(shard, now);
  }

  std::size_t sweep(Shard& shard, TimePoint now) {
    std::size_t dropped = 0;
    for (auto it = shard.map.begin(); it != shard.map.end();) {
      if (expired(it->second, now)) {
        it = shard.map.erase(it);
        ++dropped;
      } else {
        ++it;
      }
    }
    records_.fetch_sub(dropped, std::memory_order_relaxed);
    return dropped;
  }

  void erase(Shard& shard, Map::iterator it) {
    shard.map.erase(it);
    records_.fetch_sub(1, std::memory_order_relaxed);
  }

  // Whether a new record may not be added (max_records reached once `shard`'s expired records
  // are dropped). Called under the shard's lock.
  bool full(Shard& shard, TimePoint now) {
    if (options_.max_records == 0) return false;
    if (records_.load(std::memory_order_relaxed) < options_.max_records) return false;
    sweep(shard, now);
    return records_.load(std::memory_order_relaxed) >= options_.max_records;
  }

  MemoryStoreOptions options_;
  std::vector<Shard> shards_;
  // Records held, expired ones not yet dropped included. Movable (as the store is): a moved-from
  // store is not used again.
  struct Count {
    std::atomic<std::size_t> n{0};
    Count() = default;
    Count(Count&& other) noexcept : n(other.n.load(std::memory_order_relaxed)) {}
    void fetch_add(std::size_t d, std::memory_order o) noexcept { n.fetch_add(d, o); }
    void fetch_sub(std::size_t d, std::memory_order o) noexcept { n.fetch_sub(d, o); }
    std::size_t load(std::memory_order o) const noexcept { return n.load(o); }
  };
  Count records_;
};

}  // namespace idem
