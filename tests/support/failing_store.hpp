// SPDX-License-Identifier: MIT
// A FastStore wrapper that can be switched to fail every call (a Redis outage in a unit test), to
// stall (claims applied, their answers lost), or to refuse lease extensions.
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "idem/store.hpp"

namespace idem::test {

class SwitchableFastStore final : public FastStore {
 public:
  explicit SwitchableFastStore(FastStore& inner) : inner_(inner) {}
  std::atomic<bool> failing{false};
  /// extend() answers false (the claim is gone, as after a takeover elsewhere).
  std::atomic<bool> refuse_extend{false};
  std::atomic<int> calls{0};
  /// complete() and complete_claimed() refuse a longer response for good (a UsageError, as a
  /// store whose value limit it passes).
  std::size_t max_response = static_cast<std::size_t>(-1);
  /// The next this many complete() / complete_claimed() calls fail with StorageUnavailable
  /// (a failover under the completion), without reaching the inner store.
  std::atomic<int> fail_complete{0};

  /// A stalled server (a Redis paused mid-run): a claim is applied but its answer is lost
  /// (StorageTimeout), as a paused Redis applies the claims it received once it runs again;
  /// every other call times out without reaching the inner store.
  std::atomic<bool> stalled{false};
  /// With `stalled`: the claims are applied when apply_stalled() is called, not at once (the
  /// paused server works through its input when it runs again, whenever that is).
  std::atomic<bool> defer_stalled{false};

  /// Applies the claims a deferred stall kept, in the order they came.
  void apply_stalled() {
    std::vector<Deferred> todo;
    {
      std::lock_guard<std::mutex> lock(deferred_mutex_);
      todo.swap(deferred_);
    }
    for (const auto& d : todo) (void)inner_.claim(d.key, d.fingerprint, d.owner, d.lease);
  }

  ClaimResult claim(const Key& k, std::string_view fp, const OwnerToken& o,
                    std::chrono::milliseconds lease) override {
    if (stalled.load()) {
      ++calls;
      if (defer_stalled.load()) {
        defer(k, fp, o, lease);
      } else {
        (void)inner_.claim(k, fp, o, lease);
      }
      throw StorageTimeout("test: claim timed out (the stalled server applies it later)");
    }
    hit();
    return inner_.claim(k, fp, o, lease);
  }
  std::vector<ClaimResult> claim_batch(const std::vector<ClaimRequest>& requests,
                                       std::chrono::milliseconds lease) override {
    if (stalled.load()) {
      ++calls;
      if (defer_stalled.load()) {
        for (const auto& r : requests) defer(*r.key, r.fingerprint, *r.owner, lease);
      } else {
        (void)inner_.claim_batch(requests, lease);
      }
      throw StorageTimeout("test: claims timed out (the stalled server applies them later)");
    }
    hit();
    return inner_.claim_batch(requests, lease);
  }
  bool complete(const Key& k, const OwnerToken& o, std::string_view r,
                std::chrono::seconds ret) override {
    hit();
    refuse_long(r);
    return inner_.complete(k, o, r, ret);
  }
  bool complete_claimed(const Key& k, const OwnerToken& o, const ClaimTicket& t,
                        std::string_view r, std::chrono::seconds ret) override {
    hit();
    refuse_long(r);
    return inner_.complete_claimed(k, o, t, r, ret);
  }
  bool fail(const Key& k, const OwnerToken& o, std::string_view reason,
            std::chrono::seconds ret) override {
    hit();
    return inner_.fail(k, o, reason, ret);
  }
  bool release(const Key& k, const OwnerToken& o) override {
    hit();
    return inner_.release(k, o);
  }
  bool extend(const Key& k, const OwnerToken& o, std::chrono::milliseconds lease) override {
    hit();
    return !refuse_extend.load() && inner_.extend(k, o, lease);
  }
  void fill(const Key& k, std::string_view fp, std::string_view r,
            std::chrono::seconds ret) override {
    hit();
    inner_.fill(k, fp, r, ret);
  }
  void refill(const Key& k, std::string_view fp, std::string_view r, std::chrono::seconds ret,
              const RecordOrigin& origin) override {
    hit();
    inner_.refill(k, fp, r, ret, origin);
  }
  std::optional<Record> lookup(const Key& k) override {
    hit();
    return inner_.lookup(k);
  }
  std::string_view name() const noexcept override { return "switchable"; }

 private:
  struct Deferred {
    Key key;
    std::string fingerprint;
    OwnerToken owner;
    std::chrono::milliseconds lease;
  };
  void defer(const Key& k, std::string_view fp, const OwnerToken& o,
             std::chrono::milliseconds lease) {
    std::lock_guard<std::mutex> lock(deferred_mutex_);
    deferred_.push_back(Deferred{k, std::string(fp), o, lease});
  }
  std::mutex deferred_mutex_;
  std::vector<Deferred> deferred_;

  void hit() {
    ++calls;
    if (failing.load()) throw StorageUnavailable("test: fast store switched off");
    if (stalled.load()) throw StorageTimeout("test: the stalled server did not answer");
  }
  void refuse_long(std::string_view r) {
    if (fail_complete.load() > 0) {
      --fail_complete;
      throw StorageUnavailable("test: CLUSTERDOWN under the completion");
    }
    if (r.size() > max_response) {
      throw UsageError("test: a response of " + std::to_string(r.size()) +
                       " bytes is larger than the store takes");
    }
  }
  FastStore& inner_;
};

}  // namespace idem::test
