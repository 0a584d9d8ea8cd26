// SPDX-License-Identifier: MIT
// The guard over the real Redis store: many threads on one key (with SQLite behind, and Redis
// alone), and a lease that expires under a slow handler.
#include "idem/guard.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/test_env.hpp"

namespace {

using idem::Key;
using idem::Outcome;
using idem::redis::RedisStore;
using idem::redis::RedisStoreOptions;
using namespace std::chrono_literals;

class RedisGuardTest : public ::testing::Test {
 protected:
  void SetUp() override { IDEM_REQUIRE_ENV(url_, "IDEM_TEST_REDIS_URL"); }
  Key key() {
    return Key::make(
        "redis.guard",
        idem::test::unique_name(::testing::UnitTest::GetInstance()->current_test_info()->name()));
  }
  std::string url_;
};

struct Tally {
  std::atomic<int> executed{0}, replayed{0}, in_progress{0}, other{0}, wrong_value{0};
  template <class R>
  void add(const R& r, const std::string& expected) {
    switch (r.outcome) {
      case Outcome::kExecuted:
        ++executed;
        break;
      case Outcome::kReplayed:
        ++replayed;
        break;
      case Outcome::kInProgress:
        ++in_progress;
        break;
      default:
        ++other;
        break;
    }
    if (r.ok() && *r.value != expected) ++wrong_value;
  }
};

TEST_F(RedisGuardTest, ThirtyTwoThreadsOneKeyWithSqliteBehindRunOnce) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable(dir.file("guard.db"));
  durable.database().write(
      [](idem::sqlite::Transaction& tx) { tx.exec("CREATE TABLE effect (k TEXT NOT NULL)"); });
  RedisStore fast(RedisStoreOptions{url_});
  idem::IdempotencyGuard guard{fast, durable};
  auto k = key();
  constexpr int kThreads = 32;
  Tally tally;
  std::atomic<int> runs{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      while (!go.load()) std::this_thread::yield();
      auto r = guard.run(k, "fp", [&](idem::sqlite::Transaction& tx) {
        ++runs;
        tx.exec("INSERT INTO effect (k) VALUES (?)", k.id());
        std::this_thread::sleep_for(20ms);  // keep the claim open while others arrive
        return std::string("pay_once");
      });
      tally.add(r, "pay_once");
    });
  }
  go = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(1, runs.load());
  EXPECT_EQ(1, tally.executed.load());
  EXPECT_EQ(kThreads - 1, tally.replayed + tally.in_progress);
  EXPECT_EQ(0, tally.other.load());
  EXPECT_EQ(0, tally.wrong_value.load());
  auto rows = durable.database().read([&](idem::sqlite::Session& s) {
    return s.query_int64("SELECT COUNT(*) FROM effect WHERE k = ?", k.id());
  });
  EXPECT_EQ(1, rows.value_or(-1));
  auto s = guard.stats().snapshot();
  EXPECT_EQ(1u, s.fast_claims);
  EXPECT_EQ(0u, s.degraded);
  // The next duplicate is answered by Redis alone.
  auto again = guard.run(k, "fp", [&](idem::sqlite::Transaction&) {
    ++runs;
    return std::string("twice");
  });
  EXPECT_EQ(Outcome::kReplayed, again.outcome);
  EXPECT_EQ(idem::Source::kFastStore, again.source);
  EXPECT_EQ("pay_once", *again.value);
  EXPECT_EQ(1, runs.load());
}

TEST_F(RedisGuardTest, ThirtyTwoThreadsOneKeyRedisOnlyRunOnce) {
  RedisStore fast(RedisStoreOptions{url_});
  idem::IdempotencyGuard guard{fast};
  auto k = key();
  constexpr int kThreads = 32;
  Tally tally;
  std::atomic<int> runs{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      while (!go.load()) std::this_thread::yield();
      // Each thread calls twice: the second call of most threads comes after completion.
      for (int n = 0; n < 2; ++n) {
        auto r = guard.run(k, "fp", [&] {
          ++runs;
          std::this_thread::sleep_for(20ms);
          return std::string("order_1");
        });
        tally.add(r, "order_1");
      }
    });
  }
  go = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(1, runs.load());
  EXPECT_EQ(1, tally.executed.load());
  EXPECT_EQ(2 * kThreads - 1, tally.replayed + tally.in_progress);
  EXPECT_GT(tally.replayed.load(), 0);
  EXPECT_EQ(0, tally.other.load());
  EXPECT_EQ(0, tally.wrong_value.load());
}

TEST_F(RedisGuardTest, ExpiredLeaseIsTakenOverAndTheStaleOwnerLosesItsCompletion) {
  RedisStore fast(RedisStoreOptions{url_});
  idem::GuardOptions options;
  options.lease = 200ms;
  idem::IdempotencyGuard guard{fast, options};
  auto k = key();
  std::atomic<bool> a_started{false}, b_done{false};
  std::atomic<int> a_lost{0};
  std::thread a([&] {
    try {
      (void)guard.run(k, "fp", [&] {
        a_started = true;
        while (!b_done.load()) std::this_thread::sleep_for(5ms);
        return std::string("from_a");
      });
    } catch (const idem::LeaseLost&) {
      ++a_lost;
    }
  });
  while (!a_started.load()) std::this_thread::sleep_for(1ms);
  // While A's lease runs, B is told "in progress".
  auto early = guard.run(k, "fp", [] { return std::string("never"); });
  EXPECT_EQ(Outcome::kInProgress, early.outcome);
  std::this_thread::sleep_for(500ms);  // A's lease (the key's PX TTL) has ended
  auto b = guard.run(k, "fp", [] { return std::string("from_b"); });
  EXPECT_EQ(Outcome::kExecuted, b.outcome);
  b_done = true;
  a.join();
  EXPECT_EQ(1, a_lost.load());
  EXPECT_EQ(1u, guard.stats().snapshot().leases_lost);
  auto after = guard.run(k, "fp", [] { return std::string("never"); });
  EXPECT_EQ(Outcome::kReplayed, after.outcome);
  EXPECT_EQ("from_b", *after.value);
}

TEST_F(RedisGuardTest, HandlerFailureReleasesTheClaimForAnImmediateRetry) {
  RedisStore fast(RedisStoreOptions{url_});
  idem::IdempotencyGuard guard{fast};
  auto k = key();
  EXPECT_THROW((void)guard.run(k, "fp", []() -> std::string { throw std::runtime_error("x"); }),
               std::runtime_error);
  EXPECT_FALSE(fast.lookup(k).has_value());
  auto r = guard.run(k, "fp", [] { return std::string("second try"); });
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
}

}  // namespace
