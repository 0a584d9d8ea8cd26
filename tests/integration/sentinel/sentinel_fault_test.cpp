// SPDX-License-Identifier: MIT
// A failover forced through the sentinels (SENTINEL FAILOVER) while threads make guarded calls:
// the store finds the new master and writes there; one effect per key throughout. Runs alone
// (RUN_SERIAL); the setup ends healthy with the roles swapped, which no other test depends on.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "idem/guard.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "integration/redis/local_tier_support.hpp"
#include "sentinel_admin.hpp"
#include "support/test_env.hpp"

namespace {

using idem::Key;
using idem::Outcome;
using idem::redis::RedisStore;
using idem::redis::RedisStoreOptions;
using namespace std::chrono_literals;

// SENTINEL FAILOVER through the first sentinel, asked again while it answers -INPROG (an
// earlier failover still settling), for up to 30 s. Its last answer ("OK" once accepted).
std::string force_failover(const idem::test::SentinelAdmin& admin) {
  const auto& s0 = admin.sentinels().front();
  std::string answer;
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < until) {
    answer = idem::test::reply_text(
        idem::test::node_cmd(s0.first, s0.second, {"SENTINEL", "FAILOVER", admin.service()}));
    if (answer == "OK") break;
    std::this_thread::sleep_for(200ms);
  }
  return answer;
}

TEST(SentinelFaultTest, ForcedFailoverTheStoreFollowsToTheNewMaster) {
  std::string url;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_SENTINEL_URL");
  idem::test::SentinelAdmin admin(url);
  int old_master = 0;
  ASSERT_TRUE(admin.wait_healthy(60s, &old_master)) << "sentinel setup unhealthy before the test";
  const int new_master = admin.other_node(old_master);

  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable(dir.file("sentinel.db"));
  durable.database().write(
      [](idem::sqlite::Transaction& tx) { tx.exec("CREATE TABLE effect (k TEXT NOT NULL)"); });
  RedisStoreOptions o{url};
  o.connect_timeout = 300ms;
  o.command_timeout = 300ms;
  RedisStore fast(o);
  idem::IdempotencyGuard guard{fast, durable};

  const std::string scope = idem::test::unique_name("sentinel.failover");
  std::vector<Key> keys;
  for (int i = 0; i < 300; ++i) keys.push_back(Key::make(scope, "k" + std::to_string(i)));
  std::atomic<int> calls{0}, wrong{0}, errors{0};
  std::atomic<bool> stop{false};
  std::mutex mutex;
  std::string first_error;
  auto call = [&](const Key& k) {
    try {
      auto r = guard.run(k, "fp", [&](idem::sqlite::Transaction& tx) {
        tx.exec("INSERT INTO effect (k) VALUES (?)", k.id());
        return "resp_" + k.id();
      });
      if (r.ok() && *r.value != "resp_" + k.id()) ++wrong;
      if (!r.ok() && r.outcome != Outcome::kInProgress) ++wrong;
    } catch (const std::exception& e) {
      ++errors;
      std::lock_guard<std::mutex> lock(mutex);
      if (first_error.empty()) first_error = e.what();
    }
    ++calls;
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (std::size_t i = static_cast<std::size_t>(7 * t); !stop.load(); ++i) {
        call(keys[i % keys.size()]);
        std::this_thread::sleep_for(1ms);
      }
    });
  }
  auto wait_calls = [&](int n) {
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (calls.load() < n && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(5ms);
    }
  };
  wait_calls(300);
  EXPECT_EQ(0u, guard.stats().snapshot().degraded);

  const auto forced_at = std::chrono::steady_clock::now();
  ASSERT_EQ("OK", force_failover(admin));
  bool promoted = false;
  while (!promoted && std::chrono::steady_clock::now() < forced_at + 60s) {
    promoted = admin.master_port(0) == new_master && admin.role(new_master) == "master";
    if (!promoted) std::this_thread::sleep_for(50ms);
  }
  ASSERT_TRUE(promoted) << "port " << new_master << " was not promoted";

  // Fresh keys: once the store has followed, they are claimed on the new master.
  bool on_new_master = false;
  int fresh = 0;
  while (!on_new_master && std::chrono::steady_clock::now() < forced_at + 60s) {
    Key k = Key::make(scope, "fresh" + std::to_string(fresh++));
    call(k);
    auto r = idem::test::node_cmd(admin.host(), new_master, {"EXISTS", fast.redis_key(k)});
    on_new_master = r && r->type == REDIS_REPLY_INTEGER && r->integer == 1;
    if (!on_new_master) std::this_thread::sleep_for(20ms);
  }
  const auto followed_after = std::chrono::steady_clock::now() - forced_at;
  wait_calls(calls.load() + 200);
  stop = true;
  for (auto& t : threads) t.join();
  for (const Key& k : keys) call(k);  // every key at least once
  const auto end = guard.stats().snapshot();
  const auto routes = fast.route_stats();
  std::printf(
      "failover %d -> %d: followed after %lld ms; %d calls, degraded %llu; master "
      "changes %llu, refreshes %llu\n",
      old_master, new_master,
      static_cast<long long>(
          std::chrono::duration_cast<std::chrono::milliseconds>(followed_after).count()),
      calls.load(), static_cast<unsigned long long>(end.degraded),
      static_cast<unsigned long long>(routes.master_changes),
      static_cast<unsigned long long>(routes.refreshes));
  EXPECT_TRUE(on_new_master) << "the store never wrote to the new master";
  EXPECT_GE(routes.master_changes, 1u);
  EXPECT_EQ(0, errors.load()) << first_error;
  EXPECT_EQ(0, wrong.load());
  auto rows = [&](const char* sql) {
    return durable.database()
        .read([&](idem::sqlite::Session& s) { return s.query_int64(sql); })
        .value_or(-1);
  };
  EXPECT_EQ(0, rows("SELECT COUNT(*) FROM (SELECT k FROM effect GROUP BY k HAVING COUNT(*) > 1)"));
  EXPECT_EQ(static_cast<std::int64_t>(end.executed), rows("SELECT COUNT(*) FROM effect"));
  EXPECT_EQ(300 + fresh, rows("SELECT COUNT(*) FROM effect"));
  // Healthy again: the old master follows the new one, every sentinel agrees.
  int master_now = 0;
  EXPECT_TRUE(admin.wait_healthy(60s, &master_now));
  EXPECT_EQ(new_master, master_now);
}

// The local tier through Sentinel: a record kept from the old master; after a forced failover
// the tier is dropped and tracking re-established on the new master, where a delete is heard.
TEST(SentinelFaultTest, LocalTierFollowsAFailoverAndHearsTheNewMaster) {
  std::string url;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_SENTINEL_URL");
  idem::test::SentinelAdmin admin(url);
  int old_master = 0;
  ASSERT_TRUE(admin.wait_healthy(60s, &old_master)) << "sentinel setup unhealthy before the test";
  const int new_master = admin.other_node(old_master);
  RedisStoreOptions o{url};
  o.connect_timeout = 300ms;
  o.command_timeout = 300ms;
  o.key_prefix = idem::test::unique_name("idemlts") + ":";
  o.local_tier.enabled = true;
  RedisStore fast(o);
  using idem::test::eventually;
  ASSERT_TRUE(eventually([&] { return fast.local_tier_stats().tracking; }, 10s));
  const Key k = Key::make("tier", "failover");
  ASSERT_TRUE(idem::test::complete_first(fast, k, "fp", "v1"));
  auto claim = [&] { return fast.claim(k, "fp", idem::OwnerToken::generate(), 5000ms); };
  ASSERT_TRUE(idem::test::warm(fast, k, "fp"));
  const auto before = fast.local_tier_stats();
  ASSERT_EQ("OK", force_failover(admin));
  ASSERT_TRUE(eventually(
      [&] { return admin.master_port(0) == new_master && admin.role(new_master) == "master"; },
      60s));
  // The store follows on its next calls; the tier's thread re-checks the master every 100 ms.
  ASSERT_TRUE(eventually(
      [&] {
        try {
          (void)fast.lookup(Key::make("tier", "probe"));
        } catch (const idem::Error&) {
        }
        auto st = fast.local_tier_stats();
        return st.drops > before.drops && st.tracking_starts > before.tracking_starts &&
               st.tracking;
      },
      60s));
  // Kept again from the new master, then deleted there: the invalidation reaches the tier.
  ASSERT_TRUE(eventually(
      [&] {
        const auto hits = fast.local_tier_stats().hits;
        try {
          claim();
        } catch (const idem::Error&) {
          return false;
        }
        return fast.local_tier_stats().hits > hits;
      },
      30s));
  auto del = idem::test::node_cmd(admin.host(), new_master, {"DEL", fast.redis_key(k)});
  ASSERT_TRUE(del && del->type == REDIS_REPLY_INTEGER && del->integer == 1);
  ASSERT_TRUE(eventually([&] { return fast.local_tier_stats().entries == 0; }, 10s));
  EXPECT_EQ(idem::ClaimStatus::kClaimed, claim().status);
  EXPECT_TRUE(admin.wait_healthy(60s, nullptr));
}

}  // namespace
