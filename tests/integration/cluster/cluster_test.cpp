// SPDX-License-Identifier: MIT
// RedisStore on the real 3-master cluster of scripts/servers.sh: the FastStore conformance
// suite, slots computed like the server does, and guarded calls spread over every master with
// exactly one effect per key.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "cluster_admin.hpp"
#include "conformance/fast_store_conformance.hpp"
#include "idem/guard.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "router.hpp"
#include "support/test_env.hpp"

namespace {

using idem::Key;
using idem::redis::RedisStore;
using idem::redis::RedisStoreOptions;

std::unique_ptr<idem::FastStore> make_cluster(const std::string& url) {
  return std::make_unique<RedisStore>(RedisStoreOptions{url});
}

std::unique_ptr<idem::FastStore> make_cluster_script_claim(const std::string& url) {
  RedisStoreOptions o{url};
  o.claim_script = true;
  return std::make_unique<RedisStore>(o);
}

}  // namespace

IDEM_FAST_STORE_CONFORMANCE(
    RedisCluster,
    (FastStoreFactory{"redis_cluster", "IDEM_TEST_REDIS_CLUSTER_URL", make_cluster, false}),
    (FastStoreFactory{"redis_cluster_script_claim", "IDEM_TEST_REDIS_CLUSTER_URL",
                      make_cluster_script_claim, false}))

namespace {

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override { IDEM_REQUIRE_ENV(url_, "IDEM_TEST_REDIS_CLUSTER_URL"); }
  std::string url_;
};

// Our CRC16 and hash-tag rule give the slot the server computes (CLUSTER KEYSLOT), for idem's
// keys and for awkward ones.
TEST_F(ClusterTest, SlotsAgreeWithTheServer) {
  idem::test::ClusterAdmin admin(url_);
  RedisStore store(url_);
  std::vector<std::string> keys = {
      "", "{", "}", "{}", "a{}b", "{{x}}", "foo{bar}{zap}", "\xff\x00\x80", "idem:{payment|x}"};
  for (int i = 0; i < 300; ++i) {
    keys.push_back(store.redis_key(
        Key::make("scope" + std::to_string(i % 7), "order_" + std::to_string(i * 7919))));
  }
  for (const std::string& k : keys) {
    auto r = admin.cmd(admin.ports().front(), {"CLUSTER", "KEYSLOT", k});
    ASSERT_TRUE(r && r->type == REDIS_REPLY_INTEGER) << k;
    EXPECT_EQ(r->integer, idem::redis::detail::key_slot(k)) << k;
  }
}

// 600 keys, each called by 4 threads at once through the guard (SQLite behind): every key runs
// its handler once, and the records land on all three masters.
TEST_F(ClusterTest, GuardedCallsSpreadOverAllThreeMastersExactlyOnce) {
  idem::test::ClusterAdmin admin(url_);
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable(dir.file("spread.db"));
  durable.database().write(
      [](idem::sqlite::Transaction& tx) { tx.exec("CREATE TABLE effect (k TEXT NOT NULL)"); });
  RedisStore fast(url_);
  idem::IdempotencyGuard guard{fast, durable};
  const std::string scope = idem::test::unique_name("cluster.spread");
  constexpr int kKeys = 600;
  constexpr int kThreads = 4;
  std::atomic<int> wrong{0}, errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kKeys; ++i) {
        Key k = Key::make(scope, "k" + std::to_string(i));
        try {
          auto r = guard.run(k, "fp", [&](idem::sqlite::Transaction& tx) {
            tx.exec("INSERT INTO effect (k) VALUES (?)", k.id());
            return "resp_" + k.id();
          });
          if (r.ok() && *r.value != "resp_" + k.id()) ++wrong;
          if (!r.ok() && r.outcome != idem::Outcome::kInProgress) ++wrong;
        } catch (const std::exception&) {
          ++errors;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(0, errors.load());
  EXPECT_EQ(0, wrong.load());
  auto rows = durable.database().read(
      [&](idem::sqlite::Session& s) { return s.query_int64("SELECT COUNT(*) FROM effect"); });
  EXPECT_EQ(kKeys, rows.value_or(-1));
  auto distinct = durable.database().read([&](idem::sqlite::Session& s) {
    return s.query_int64("SELECT COUNT(DISTINCT k) FROM effect");
  });
  EXPECT_EQ(kKeys, distinct.value_or(-1));
  EXPECT_EQ(0u, guard.stats().snapshot().degraded);  // the fast path served every call

  const auto masters = admin.masters();
  ASSERT_EQ(3u, masters.size());
  long long total = 0;
  for (int port : masters) {
    const long long n = admin.count_keys(port, "idem:{" + scope + "|*");
    std::printf("master %d holds %lld of %d records\n", port, n, kKeys);
    EXPECT_GT(n, 0) << "no record on master " << port;
    total += n;
  }
  EXPECT_EQ(kKeys, total);
  EXPECT_GE(fast.route_stats().nodes, 3u);
  EXPECT_GE(fast.route_stats().refreshes, 1u);
  EXPECT_EQ("redis-cluster", fast.name());
}

// Auto-pipelining per node: 64 threads of single calls on keys spread over the three masters.
// Each node's calls share its connection in batches; every reply reaches its own caller (each
// record names its key) and the first claim of each key is the only one granted.
TEST_F(ClusterTest, ConcurrentPipelinedCallsPerNodeReachTheirOwnCallers) {
  RedisStoreOptions o{url_};
  o.command_timeout = std::chrono::milliseconds(5000);
  RedisStore store(o);
  const std::string scope = idem::test::unique_name("cluster.pipeline");
  constexpr int kThreads = 64;
  constexpr int kOps = 40;
  std::atomic<int> wrong{0}, errors{0}, granted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kOps; ++i) {
        // Key i is claimed by every thread: one grant each, the rest see it busy or done.
        const Key shared = Key::make(scope, "shared" + std::to_string(i));
        const std::string id = std::to_string(t) + "_" + std::to_string(i);
        const Key own = Key::make(scope, "own" + id);
        try {
          const auto owner = idem::OwnerToken::generate();
          auto c = store.claim(shared, "fp", owner, std::chrono::milliseconds(60000));
          if (c.status == idem::ClaimStatus::kClaimed) {
            ++granted;
            if (!store.complete(shared, owner, "first", std::chrono::seconds(60))) ++wrong;
          } else if (c.status == idem::ClaimStatus::kDone && c.response != "first") {
            ++wrong;
          }
          store.fill(own, "fp_" + id, "resp_" + id, std::chrono::seconds(60));
          auto r = store.claim(own, "fp_" + id, idem::OwnerToken::generate(),
                               std::chrono::milliseconds(1000));
          if (r.status != idem::ClaimStatus::kDone || r.response != "resp_" + id) ++wrong;
          auto rec = store.lookup(own);
          if (!rec || rec->response != "resp_" + id) ++wrong;
        } catch (const std::exception&) {
          ++errors;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  const auto ps = store.pool_stats();
  std::printf("%llu commands in %llu batches over %zu nodes\n",
              static_cast<unsigned long long>(ps.pipelined_commands),
              static_cast<unsigned long long>(ps.pipelined_flushes), store.route_stats().nodes);
  EXPECT_EQ(0, errors.load());
  EXPECT_EQ(0, wrong.load());
  EXPECT_EQ(kOps, granted.load());
  EXPECT_GT(ps.pipelined_commands, ps.pipelined_flushes);
  EXPECT_GE(store.route_stats().nodes, 3u);
}

}  // namespace
