// SPDX-License-Identifier: MIT
// The local tier on the real 3-master cluster: one invalidation connection per master; hot keys
// of every master replayed with no command sent; a DEL on each owning node heard; CLIENT KILL of
// one master's invalidation connection drops the tier until that node is tracked again.
#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cluster_admin.hpp"
#include "idem/redis/redis_store.hpp"
#include "local_tier_support.hpp"
#include "router.hpp"
#include "support/test_env.hpp"

namespace {

using idem::ClaimStatus;
using idem::Key;
using idem::OwnerToken;
using idem::redis::RedisStore;
using idem::redis::RedisStoreOptions;
using namespace std::chrono_literals;

using idem::test::eventually;

TEST(ClusterLocalTierTest, EveryMasterIsHeardDeletesOnEachNodeAndAKilledConnection) {
  std::string url;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_CLUSTER_URL");
  idem::test::ClusterAdmin admin(url);
  RedisStoreOptions o{url};
  o.auto_pipeline = true;  // pipelined_commands counts every command sent
  o.key_prefix = idem::test::unique_name("idemltc") + ":";
  o.local_tier.enabled = true;
  RedisStore s(o);
  // The tier's thread discovers the slot map and tracks every master.
  ASSERT_TRUE(eventually([&] { return s.local_tier_stats().tracking; }));
  EXPECT_EQ(3U, s.local_tier_stats().tracking_starts);

  std::vector<Key> keys;
  std::vector<int> owners;
  for (int i = 0; i < 30; ++i) {
    keys.push_back(Key::make("tier", "k" + std::to_string(i)));
    const int slot = idem::redis::detail::key_slot(s.redis_key(keys.back()));
    owners.push_back(admin.slot_owner(slot, admin.masters().front()));
  }
  ASSERT_EQ(3U, std::set<int>(owners.begin(), owners.end()).size()) << "keys on every master";
  auto warm = [&](const Key& k) { return idem::test::warm(s, k, "fp"); };
  for (const Key& k : keys) {
    ASSERT_TRUE(idem::test::complete_first(s, k, "fp", "r_" + k.id()));
    ASSERT_TRUE(warm(k));
  }
  // Every write's invalidation heard (2 per key), then every key kept again.
  for (const Key& k : keys) ASSERT_TRUE(idem::test::warm(s, k, "fp", 2 * keys.size()));
  const auto sent = s.pool_stats().pipelined_commands;
  for (const Key& k : keys) {
    auto r = s.claim(k, "fp", OwnerToken::generate(), 5000ms);
    ASSERT_EQ(ClaimStatus::kDone, r.status);
    ASSERT_EQ("r_" + k.id(), r.response);
  }
  EXPECT_EQ(sent, s.pool_stats().pipelined_commands) << "hot keys of every master sent nothing";

  // A delete on each key's own node reaches the tier.
  for (std::size_t i = 0; i < keys.size(); i += 3) {
    auto del = admin.cmd(owners[i], {"DEL", s.redis_key(keys[i])});
    ASSERT_TRUE(del && del->type == REDIS_REPLY_INTEGER && del->integer == 1);
  }
  ASSERT_TRUE(eventually([&] { return s.local_tier_stats().entries == keys.size() - 10; }));
  for (std::size_t i = 0; i < keys.size(); i += 3) {
    EXPECT_EQ(ClaimStatus::kClaimed, s.claim(keys[i], "fp", OwnerToken::generate(), 5000ms).status);
  }

  // One master's invalidation connection killed: the whole tier dropped, that node tracked again.
  const auto before = s.local_tier_stats();
  ASSERT_GE(admin.cmd(owners[1], {"CLIENT", "KILL", "TYPE", "pubsub"})->integer, 1);
  ASSERT_TRUE(eventually([&] { return s.local_tier_stats().drops > before.drops; }));
  EXPECT_EQ(0U, s.local_tier_stats().entries);
  ASSERT_TRUE(eventually([&] {
    auto st = s.local_tier_stats();
    return st.tracking && st.tracking_starts > before.tracking_starts;
  }));
  ASSERT_TRUE(warm(keys[1]));
  auto del = admin.cmd(owners[1], {"DEL", s.redis_key(keys[1])});
  ASSERT_TRUE(del && del->integer == 1);
  ASSERT_TRUE(eventually([&] { return s.local_tier_stats().entries == 0; }));
  EXPECT_EQ(ClaimStatus::kClaimed, s.claim(keys[1], "fp", OwnerToken::generate(), 5000ms).status);
}

}  // namespace
