// SPDX-License-Identifier: MIT
// Helpers of the local tier tests (RedisStoreOptions::local_tier), with no test framework in
// them: the helper process of local_tier_test.cpp uses them too.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "idem/redis/redis_store.hpp"

namespace idem::test {

/// Polls `done()` every 2 ms until it holds (true) or `limit` passed (false).
template <class F>
bool eventually(F&& done, std::chrono::milliseconds limit = std::chrono::milliseconds(10000)) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

/// A first execution of `key`: claimed, then completed with `response`. False if either failed.
inline bool complete_first(idem::redis::RedisStore& store, const Key& key, const std::string& fp,
                           const std::string& response,
                           std::chrono::seconds retention = std::chrono::seconds(300)) {
  const OwnerToken owner = OwnerToken::generate();
  return store.claim(key, fp, owner, std::chrono::milliseconds(5000)).status ==
             ClaimStatus::kClaimed &&
         store.complete(key, owner, response, retention);
}

/// Claims `key` (completed) until a claim is answered from the tier: the first fills it once
/// tracking is on. `writes`: how many invalidations this store must have heard first (the
/// writes under the test's own prefix so far, e.g. 2 per first execution), so that a late one
/// does not remove the entry afterwards. False if that never came, or a claim was not answered
/// done.
inline bool warm(idem::redis::RedisStore& store, const Key& key, const std::string& fp,
                 std::uint64_t writes = 0) {
  if (!eventually([&] { return store.local_tier_stats().invalidations >= writes; })) return false;
  bool all_done = true;
  const bool hit = eventually([&] {
    const auto before = store.local_tier_stats().hits;
    const auto r = store.claim(key, fp, OwnerToken::generate(), std::chrono::milliseconds(5000));
    all_done = all_done && r.status == ClaimStatus::kDone;
    return store.local_tier_stats().hits > before;
  });
  return hit && all_done;
}

}  // namespace idem::test
