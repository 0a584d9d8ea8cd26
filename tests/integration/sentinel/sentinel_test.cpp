// SPDX-License-Identifier: MIT
// RedisStore through the sentinels of scripts/servers.sh: the FastStore conformance suite, and
// records written on the master the sentinels name.
#include <gtest/gtest.h>

#include <string>

#include "conformance/fast_store_conformance.hpp"
#include "idem/redis/redis_store.hpp"
#include "sentinel_admin.hpp"
#include "support/test_env.hpp"

namespace {

using idem::Key;
using idem::OwnerToken;
using idem::redis::RedisStore;
using idem::redis::RedisStoreOptions;

std::unique_ptr<idem::FastStore> make_sentinel(const std::string& url) {
  return std::make_unique<RedisStore>(RedisStoreOptions{url});
}

}  // namespace

IDEM_FAST_STORE_CONFORMANCE(RedisSentinel,
                            (FastStoreFactory{"redis_sentinel", "IDEM_TEST_REDIS_SENTINEL_URL",
                                              make_sentinel, false}))

namespace {

TEST(SentinelTest, RecordsLiveOnTheMasterTheSentinelsName) {
  std::string url;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_SENTINEL_URL");
  idem::test::SentinelAdmin admin(url);
  int master = 0;
  ASSERT_TRUE(admin.wait_healthy(std::chrono::seconds(30), &master));
  RedisStore store(url);
  EXPECT_EQ("redis-sentinel", store.name());
  const Key k = Key::make("sentinel.test", idem::test::unique_name("k"));
  const auto owner = OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            store.claim(k, "fp", owner, std::chrono::seconds(30)).status);
  ASSERT_TRUE(store.complete(k, owner, "r", std::chrono::seconds(60)));
  auto on_master = idem::test::node_cmd(admin.host(), master, {"EXISTS", store.redis_key(k)});
  ASSERT_TRUE(on_master);
  EXPECT_EQ(1, on_master->integer);
  EXPECT_EQ(1u, store.route_stats().nodes);
  EXPECT_GE(store.route_stats().refreshes, 1u);
  EXPECT_EQ(0u, store.route_stats().master_changes);
}

// A service the sentinels do not monitor: StorageUnavailable (the guard then uses the durable
// store), never a connection to some other server.
TEST(SentinelTest, UnknownServiceIsUnavailable) {
  std::string url;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_SENTINEL_URL");
  const std::string wrong = url.substr(0, url.rfind('/')) + "/no-such-service";
  RedisStore store(wrong);
  EXPECT_THROW(store.lookup(Key::make("sentinel.test", "k")), idem::StorageUnavailable);
  EXPECT_EQ(0u, store.route_stats().nodes);
  EXPECT_GE(store.route_stats().refresh_failures, 1u);
}

}  // namespace
