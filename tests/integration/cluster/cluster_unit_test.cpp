// SPDX-License-Identifier: MIT
// No server: the Redis Cluster hash slot (CRC16/XMODEM and hash tags), MOVED/ASK parsing, and
// the redis-cluster:// and redis-sentinel:// URIs.
#include <gtest/gtest.h>

#include <string>

#include "errors.hpp"
#include "idem/errors.hpp"
#include "idem/redis/redis_store.hpp"
#include "router.hpp"

namespace {

using idem::redis::detail::crc16;
using idem::redis::detail::key_slot;
using idem::redis::detail::parse_redirect;
using idem::redis::detail::parse_topology;
using idem::redis::detail::Topology;

TEST(ClusterSlotTest, Crc16XmodemVectors) {
  EXPECT_EQ(0x31C3, crc16("123456789"));  // the spec's check value
  EXPECT_EQ(0x0000, crc16(""));
  EXPECT_EQ(0x58E5, crc16("A"));  // a single byte through the table
}

TEST(ClusterSlotTest, KeySlotFollowsTheHashTagRules) {
  EXPECT_EQ(12182, key_slot("foo"));
  EXPECT_EQ(5061, key_slot("bar"));
  // Only the part inside the first {...} is hashed, when it is not empty.
  EXPECT_EQ(key_slot("user1000"), key_slot("{user1000}.following"));
  EXPECT_EQ(key_slot("user1000"), key_slot("{user1000}.followers"));
  EXPECT_EQ(key_slot("bar"), key_slot("foo{bar}{zap}"));
  EXPECT_EQ(crc16("foo{}{bar}") % 16384, key_slot("foo{}{bar}"));  // empty tag: whole key
  EXPECT_EQ(key_slot("{bar"), key_slot("foo{{bar}}zap"));          // from the first '{'
  EXPECT_EQ(crc16("foo{bar") % 16384, key_slot("foo{bar"));        // unclosed: whole key
  // idem's layout: the prefix is outside the tag, so it never moves a record.
  EXPECT_EQ(key_slot("payment|o1"), key_slot("idem:{payment|o1}"));
  EXPECT_EQ(key_slot("payment|o1"), key_slot("other:{payment|o1}"));
}

TEST(ClusterRedirectTest, ParsesMovedAndAsk) {
  auto m = parse_redirect("MOVED 3999 127.0.0.1:6381");
  ASSERT_TRUE(m.has_value());
  EXPECT_FALSE(m->ask);
  EXPECT_EQ(3999, m->slot);
  EXPECT_EQ("127.0.0.1", m->host);
  EXPECT_EQ(6381, m->port);
  auto a = parse_redirect("ASK 16383 [::1]:7000");
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->ask);
  EXPECT_EQ(16383, a->slot);
  EXPECT_EQ("::1", a->host);
  EXPECT_EQ(7000, a->port);
  auto unknown_host = parse_redirect("MOVED 1 :7002");
  ASSERT_TRUE(unknown_host.has_value());
  EXPECT_EQ("", unknown_host->host);
  EXPECT_EQ(7002, unknown_host->port);
  EXPECT_FALSE(parse_redirect("ERR unknown command").has_value());
  EXPECT_FALSE(parse_redirect("MOVED 16384 h:1").has_value());
  EXPECT_FALSE(parse_redirect("MOVED x h:1").has_value());
  EXPECT_FALSE(parse_redirect("ASK 1 h").has_value());
  EXPECT_FALSE(parse_redirect("MOVED 1 h:0").has_value());
  EXPECT_FALSE(parse_redirect("CLUSTERDOWN The cluster is down").has_value());
}

// Past the redirect limit, MOVED / ASK are StorageUnavailable (the durable store decides);
// CLUSTERDOWN and TRYAGAIN always are.
TEST(ClusterRedirectTest, UnfollowedRedirectsAndClusterStatesAreUnavailable) {
  using idem::redis::detail::Failure;
  for (const char* reply : {"MOVED 1 127.0.0.1:7000", "ASK 1 127.0.0.1:7000",
                            "CLUSTERDOWN The cluster is down", "TRYAGAIN Multiple keys request"}) {
    try {
      idem::redis::detail::throw_error(Failure{Failure::Kind::kServer, "claim k", reply});
      ADD_FAILURE() << reply << " did not throw";
    } catch (const idem::StorageUnavailable& e) {
      EXPECT_NE(std::string::npos, std::string(e.what()).find(reply)) << e.what();
    }
  }
}

TEST(ClusterUriTest, ParsesClusterAndSentinelAddresses) {
  auto c = parse_topology("redis-cluster://:s%40cret@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002");
  EXPECT_EQ(Topology::Kind::kCluster, c.kind);
  ASSERT_EQ(3u, c.endpoints.size());
  EXPECT_EQ("10.0.0.2", c.endpoints[1].host);
  EXPECT_EQ(7001, c.endpoints[1].port);
  EXPECT_EQ("::1", c.endpoints[2].host);
  EXPECT_EQ("s@cret", c.endpoints[0].password);  // cluster nodes get the credentials
  EXPECT_EQ("s@cret", c.node_template.password);

  auto s = parse_topology("redis-sentinel://app:pw@h1:26379,h2:26380/payments-master/2");
  EXPECT_EQ(Topology::Kind::kSentinel, s.kind);
  ASSERT_EQ(2u, s.endpoints.size());
  EXPECT_EQ("", s.endpoints[0].password);  // sentinels are asked without them
  EXPECT_EQ("payments-master", s.service);
  EXPECT_EQ("app", s.node_template.user);
  EXPECT_EQ("pw", s.node_template.password);
  EXPECT_EQ(2, s.node_template.db);

  auto plain = parse_topology("redis://127.0.0.1:6380/1");
  EXPECT_EQ(Topology::Kind::kSingle, plain.kind);
  EXPECT_EQ(1, plain.endpoints.at(0).db);
}

TEST(ClusterUriTest, RejectsMalformedAddressesWithoutEchoingThePassword) {
  for (const char* bad : {"redis-cluster://", "redis-cluster://h:1,,h:2", "redis-cluster://h:1/3",
                          "redis-cluster://h:99999", "redis-sentinel://h:1",
                          "redis-sentinel://h:1/", "redis-sentinel://:topsecret@h:1/svc/x"}) {
    try {
      parse_topology(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const idem::UsageError& e) {
      EXPECT_EQ(std::string::npos, std::string(e.what()).find("topsecret")) << e.what();
    }
  }
}

TEST(ClusterUriTest, StoreNameFollowsTheScheme) {
  using idem::redis::RedisStore;
  EXPECT_EQ("redis-cluster", RedisStore("redis-cluster://127.0.0.1:1").name());
  EXPECT_EQ("redis-sentinel", RedisStore("redis-sentinel://127.0.0.1:1/svc").name());
  EXPECT_EQ("redis", RedisStore("redis://127.0.0.1:1").name());
}

// Nothing listens: the first call is StorageUnavailable (the guard then uses the durable store),
// and the next ones fail fast until topology_refresh_interval has passed.
TEST(ClusterUriTest, UnreachableSeedsAreUnavailable) {
  using idem::redis::RedisStore;
  using idem::redis::RedisStoreOptions;
  for (const char* uri : {"redis-cluster://127.0.0.1:1,127.0.0.1:2",
                          "redis-sentinel://127.0.0.1:1,127.0.0.1:2/svc"}) {
    RedisStoreOptions o{uri};
    o.topology_refresh_interval = std::chrono::hours(1);
    RedisStore store(o);
    auto k = idem::Key::make("cluster.unit", "k");
    EXPECT_THROW(store.lookup(k), idem::StorageUnavailable) << uri;
    EXPECT_THROW(store.lookup(k), idem::StorageUnavailable) << uri;
    EXPECT_EQ(0u, store.route_stats().refreshes);
    EXPECT_EQ(1u, store.route_stats().refresh_failures) << uri;  // the second did not retry
  }
}

}  // namespace
