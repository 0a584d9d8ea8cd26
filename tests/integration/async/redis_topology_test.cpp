// SPDX-License-Identifier: MIT
// AsyncRedisStore against the real Redis Cluster (3 masters + 3 replicas) or Sentinel setup
// (1 master, 1 replica, 3 sentinels) of scripts/servers.sh: the FastStore conformance suite
// through the asynchronous calls, records shared with the synchronous RedisStore of the same
// layout, where they live, and AsyncGuard's outcome suite with SQLite behind it. Built twice:
// IDEM_ASYNC_TOPOLOGY_CLUSTER (IDEM_TEST_REDIS_CLUSTER_URL) and IDEM_ASYNC_TOPOLOGY_SENTINEL
// (IDEM_TEST_REDIS_SENTINEL_URL).
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "async_guard_suite.hpp"
#include "blocking_adapters.hpp"
#include "cluster_admin.hpp"
#include "conformance/fast_store_conformance.hpp"
#include "idem/async/pooled_durable.hpp"
#include "idem/async/redis_store.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "router.hpp"
#if defined(IDEM_ASYNC_TOPOLOGY_SENTINEL)
#include "sentinel_admin.hpp"
#endif

namespace {

using idem::async::AsyncRedisStore;
using idem::async::AsyncRedisStoreOptions;
using idem::test::BlockingFastStore;

#if defined(IDEM_ASYNC_TOPOLOGY_CLUSTER)
constexpr const char* kUrlVar = "IDEM_TEST_REDIS_CLUSTER_URL";
constexpr std::string_view kName = "redis-cluster";
#else
constexpr const char* kUrlVar = "IDEM_TEST_REDIS_SENTINEL_URL";
constexpr std::string_view kName = "redis-sentinel";
#endif

std::unique_ptr<idem::FastStore> make_async(const std::string& url) {
  return std::make_unique<BlockingFastStore>(
      [&](idem::async::Executor ex) { return std::make_unique<AsyncRedisStore>(ex, url); });
}

std::unique_ptr<idem::FastStore> make_async_script_claim(const std::string& url) {
  return std::make_unique<BlockingFastStore>([&](idem::async::Executor ex) {
    AsyncRedisStoreOptions o;
    o.uri = url;
    o.claim_script = true;
    return std::make_unique<AsyncRedisStore>(ex, o);
  });
}

// Deletes a Redis key on whichever data node holds it (the others answer MOVED or nothing).
void delete_everywhere(const std::string& url, const std::string& redis_key) {
#if defined(IDEM_ASYNC_TOPOLOGY_SENTINEL)
  idem::test::SentinelAdmin admin(url);
  const int master = admin.master_port(0);
  idem::test::node_cmd(admin.host(), master, {"DEL", redis_key});
#else
  auto t = idem::redis::detail::parse_topology(url);
  for (const auto& ep : t.endpoints) idem::test::node_cmd(ep.host, ep.port, {"DEL", redis_key});
#endif
}

}  // namespace

#if defined(IDEM_ASYNC_TOPOLOGY_CLUSTER)
IDEM_FAST_STORE_CONFORMANCE(AsyncRedisCluster,
                            (FastStoreFactory{"async_redis_cluster", kUrlVar, make_async, false}),
                            (FastStoreFactory{"async_redis_cluster_script_claim", kUrlVar,
                                              make_async_script_claim, false}))
#else
IDEM_FAST_STORE_CONFORMANCE(AsyncRedisSentinel,
                            (FastStoreFactory{"async_redis_sentinel", kUrlVar, make_async, false}),
                            (FastStoreFactory{"async_redis_sentinel_script_claim", kUrlVar,
                                              make_async_script_claim, false}))
#endif

namespace {

class AsyncTopologyTest : public ::testing::Test {
 protected:
  void SetUp() override { IDEM_REQUIRE_ENV(url_, kUrlVar); }
  idem::Key key(const std::string& tag) {
    return idem::Key::make("async.topology", idem::test::unique_name(tag));
  }
  std::string url_;
};

// One layout, two clients: what the asynchronous store writes the synchronous one reads and
// the other way round, under the same Redis key; both name the layout alike.
TEST_F(AsyncTopologyTest, RecordsAreSharedWithTheSynchronousStore) {
  idem::redis::RedisStore sync{url_};
  BlockingFastStore async_store(
      [&](idem::async::Executor ex) { return std::make_unique<AsyncRedisStore>(ex, url_); });
  EXPECT_EQ(kName, async_store.name());
  EXPECT_EQ(sync.name(), async_store.name());
  for (int i = 0; i < 24; ++i) {  // keys on every master
    auto k = key("shared" + std::to_string(i));
    auto a = idem::OwnerToken::generate();
    ASSERT_EQ(idem::ClaimStatus::kClaimed,
              async_store.claim(k, "fp", a, std::chrono::seconds(30)).status);
    EXPECT_EQ(idem::ClaimStatus::kBusy,
              sync.claim(k, "fp", idem::OwnerToken::generate(), std::chrono::seconds(30)).status);
    ASSERT_TRUE(async_store.complete(k, a, "from async " + std::to_string(i),
                                     std::chrono::seconds(60)));
    auto r = sync.claim(k, "fp", idem::OwnerToken::generate(), std::chrono::seconds(30));
    EXPECT_EQ(idem::ClaimStatus::kDone, r.status);
    EXPECT_EQ("from async " + std::to_string(i), r.response);
    auto k2 = key("shared_sync" + std::to_string(i));
    sync.fill(k2, "fp", "from sync", std::chrono::seconds(60));
    EXPECT_EQ("from sync", async_store.lookup(k2).value().response);
    EXPECT_EQ(sync.redis_key(k),
              static_cast<AsyncRedisStore&>(async_store.async_store()).redis_key(k));
  }
  const auto routes = static_cast<AsyncRedisStore&>(async_store.async_store()).route_stats();
#if defined(IDEM_ASYNC_TOPOLOGY_CLUSTER)
  // The seeds and the masters CLUSTER SLOTS names, as the synchronous router counts them.
  EXPECT_GE(routes.nodes, 3u);
  EXPECT_EQ(sync.route_stats().nodes, routes.nodes);
#else
  EXPECT_EQ(1u, routes.nodes) << "the master the sentinels name";
#endif
  EXPECT_GE(routes.refreshes, 1u);
}

// A thousand claims in flight from one loop thread over 700 keys spread over the layout's
// masters: each answered, in order per connection, claimed once.
TEST_F(AsyncTopologyTest, AThousandClaimsInFlightFromOneLoop) {
  idem::test::LoopThread loop;
  std::optional<AsyncRedisStore> store;
  idem::async::net::post(loop.io(), [&] { store.emplace(loop.executor(), url_); });
  constexpr int kCalls = 1000, kKeys = 700;
  std::vector<idem::Key> keys;
  for (int i = 0; i < kKeys; ++i) keys.push_back(key("many" + std::to_string(i)));
  std::promise<void> all;
  std::atomic<int> answered{0}, claimed{0}, busy{0}, errors{0};
  idem::async::net::post(loop.io(), [&] {
    for (int i = 0; i < kCalls; ++i) {
      // A new owner per call: the second call of a key finds it busy.
      store->async_claim(keys[static_cast<std::size_t>(i % kKeys)], "fp",
                         idem::OwnerToken::generate(), std::chrono::seconds(30), loop.executor(),
                         [&](std::exception_ptr e, idem::ClaimResult c) {
                           if (e) ++errors;
                           if (c.status == idem::ClaimStatus::kClaimed) ++claimed;
                           if (c.status == idem::ClaimStatus::kBusy) ++busy;
                           if (++answered == kCalls) all.set_value();
                         });
    }
  });
  ASSERT_EQ(std::future_status::ready, all.get_future().wait_for(std::chrono::seconds(30)));
  EXPECT_EQ(0, errors.load());
  EXPECT_EQ(kKeys, claimed.load());
  EXPECT_EQ(kCalls - kKeys, busy.load());
  std::promise<void> gone;
  idem::async::net::post(loop.io(), [&] {
    store.reset();
    gone.set_value();
  });
  gone.get_future().wait();
}

#if defined(IDEM_ASYNC_TOPOLOGY_SENTINEL)
// Records live on the master the sentinels name; a service they do not monitor is
// StorageUnavailable, never a connection to some other server.
TEST_F(AsyncTopologyTest, RecordsLiveOnTheMasterAndAnUnknownServiceIsUnavailable) {
  idem::test::SentinelAdmin admin(url_);
  int master = 0;
  ASSERT_TRUE(admin.wait_healthy(std::chrono::seconds(30), &master));
  BlockingFastStore async_store(
      [&](idem::async::Executor ex) { return std::make_unique<AsyncRedisStore>(ex, url_); });
  auto k = key("on_master");
  auto owner = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            async_store.claim(k, "fp", owner, std::chrono::seconds(30)).status);
  auto& store = static_cast<AsyncRedisStore&>(async_store.async_store());
  auto on_master = idem::test::node_cmd(admin.host(), master, {"EXISTS", store.redis_key(k)});
  ASSERT_TRUE(on_master);
  EXPECT_EQ(1, on_master->integer);
  const std::string wrong = url_.substr(0, url_.rfind('/')) + "/no-such-service";
  BlockingFastStore unknown(
      [&](idem::async::Executor ex) { return std::make_unique<AsyncRedisStore>(ex, wrong); });
  EXPECT_THROW(unknown.lookup(k), idem::StorageUnavailable);
  EXPECT_EQ(0u, static_cast<AsyncRedisStore&>(unknown.async_store()).route_stats().nodes);
}
#endif

// AsyncGuard's outcome suite with this layout in front of SQLite.
struct TopologySqlite {
  using Durable = idem::async::PooledDurable<idem::sqlite::SqliteStore>;
  static const char* env_var() { return kUrlVar; }
  explicit TopologySqlite(const std::string& url)
      : url_(url),
        sqlite(dir.file("async.db")),
        workers({4, 256}),
        pooled(sqlite, workers),
        redis(std::in_place, loop.executor(), url) {
    sqlite.database().write([](idem::sqlite::Transaction& tx) {
      tx.exec("CREATE TABLE idem_test_effects (key_id TEXT NOT NULL)");
    });
  }
  ~TopologySqlite() {
    std::promise<void> p;
    idem::async::net::post(loop.io(), [&] {
      redis.reset();
      p.set_value();
    });
    p.get_future().wait();
  }
  idem::async::AsyncFastStore* fast() { return &*redis; }
  Durable& durable() { return pooled; }
  idem::async::WorkerPool& pool() { return workers; }
  void insert_effect(idem::sqlite::Transaction& tx, const std::string& id) {
    tx.exec("INSERT INTO idem_test_effects (key_id) VALUES (?)", id);
  }
  long count_effects(const std::string& id) {
    return static_cast<long>(sqlite.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM idem_test_effects WHERE key_id = ?", id)
          .value_or(-1);
    }));
  }
  void forget_fast(const idem::Key& k) { delete_everywhere(url_, redis->redis_key(k)); }

  std::string url_;
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore sqlite;
  idem::async::WorkerPool workers;
  Durable pooled;
  idem::test::LoopThread loop;
  std::optional<AsyncRedisStore> redis;
};

}  // namespace

namespace idem::test {
using TopologyEnvs = ::testing::Types<TopologySqlite>;
#if defined(IDEM_ASYNC_TOPOLOGY_CLUSTER)
INSTANTIATE_TYPED_TEST_SUITE_P(Cluster, AsyncGuardSuite, TopologyEnvs);
#else
INSTANTIATE_TYPED_TEST_SUITE_P(Sentinel, AsyncGuardSuite, TopologyEnvs);
#endif
}  // namespace idem::test
