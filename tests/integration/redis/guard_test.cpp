// SPDX-License-Identifier: MIT
// The guard over the real Redis store: many threads on one key (with SQLite behind, and Redis
// alone), a lease that expires under a slow handler, and consume_batch's pipelines.
#include "idem/guard.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "idem/consumer.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "raw_redis.hpp"
#include "support/reassigning_handler.hpp"
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

// Redis lost a completed record (a flush, an eviction, a failover): sixteen threads replay it
// at once from SQLite, which writes it back; every answer, from either store, reports when the
// first attempt began (an hour ago by the clock of the store that ran it), and it ran once.
TEST_F(RedisGuardTest, ARecordRedisLostIsWrittenBackWithWhenItsFirstAttemptBegan) {
  idem::test::TempDir dir;
  idem::ManualClock hour_ago(idem::system_now() - 1h);
  idem::sqlite::SqliteStoreOptions earlier;
  earlier.clock = hour_ago.as_clock();
  auto db = std::make_shared<idem::sqlite::Database>(dir.file("first-seen.db"));
  idem::sqlite::SqliteStore then(db, earlier);
  idem::sqlite::SqliteStore now(db);
  RedisStore fast(RedisStoreOptions{url_});
  std::atomic<int> runs{0};
  auto handler = [&](idem::sqlite::Transaction&) {
    ++runs;
    return std::string("pay_once");
  };
  auto k = key();
  {
    idem::IdempotencyGuard first{fast, then};
    ASSERT_EQ(Outcome::kExecuted, first.run(k, "fp", handler).outcome);
  }
  const auto created = idem::to_millis(now.lookup(k).value().created_at);
  ASSERT_LT(created, idem::to_millis(idem::system_now() - 30min));
  idem::test::RawRedis(url_).cmd({"DEL", fast.redis_key(k)});

  idem::IdempotencyGuard guard{fast, now};
  constexpr int kThreads = 16;
  std::atomic<int> replayed{0}, wrong_time{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      while (!go.load()) std::this_thread::yield();
      // A thread that meets another's claim of the write-back waits for its answer.
      idem::CallOptions wait;
      wait.wait_for_result = 5s;
      auto r = guard.run(k, "fp", wait, handler);
      if (r.outcome == Outcome::kReplayed && *r.value == "pay_once") ++replayed;
      if (idem::to_millis(r.first_seen) != created) ++wrong_time;
    });
  }
  go = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(1, runs.load());
  EXPECT_EQ(kThreads, replayed.load());
  EXPECT_EQ(0, wrong_time.load());
  auto again = guard.run(k, "fp", handler);
  EXPECT_EQ(idem::Source::kFastStore, again.source);
  EXPECT_EQ(created, idem::to_millis(again.first_seen)) << "the written-back record's";
  EXPECT_EQ(created, idem::to_millis(fast.lookup(k).value().created_at));
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

// The handler reassigns the Key and fingerprint it was passed: Redis in front of SQLite
// (transactional and two-phase) and Redis alone complete the key they claimed, one effect,
// nothing under the other key, and the replay comes from Redis.
TEST_F(RedisGuardTest, HandlerReassigningItsKeyAndFingerprintCompletesTheAcquiredKey) {
  using Tx = idem::sqlite::Transaction;
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable(dir.file("guard.db"));
  durable.database().write([](Tx& tx) { tx.exec("CREATE TABLE effect (k TEXT NOT NULL)"); });
  RedisStore fast(RedisStoreOptions{url_});
  auto count = [&](const Key& k) {
    return durable.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM effect WHERE k = ?", k.id()).value_or(-1);
    });
  };
  for (int shape = 0; shape < 3; ++shape) {
    SCOPED_TRACE(shape == 0   ? "redis + sqlite, transactional"
                 : shape == 1 ? "redis + sqlite, two-phase"
                              : "redis only");
    auto acquired = key();
    auto other = Key::make("redis.guard", acquired.id() + "_other");
    const std::string fp = idem::test::heap_fingerprint(acquired.id());
    int runs = 0, external = 0;
    idem::GuardResult<std::string> r;
    if (shape == 0) {
      idem::IdempotencyGuard guard{fast, durable};
      r = idem::test::run_reassigning<Tx>(guard, acquired, other, fp, runs, [&](Tx& tx) {
        tx.exec("INSERT INTO effect (k) VALUES (?)", acquired.id());
      });
      idem::test::expect_replay<Tx>(guard, acquired, fp, runs);
      EXPECT_EQ(1, count(acquired));
      EXPECT_EQ(0u, guard.stats().snapshot().leases_lost);
    } else if (shape == 1) {
      idem::IdempotencyGuard guard{fast, durable};
      r = idem::test::run_reassigning<void>(guard, acquired, other, fp, runs, [&] { ++external; });
      idem::test::expect_replay<void>(guard, acquired, fp, runs);
      EXPECT_EQ(1, external);
      EXPECT_EQ(0u, guard.stats().snapshot().leases_lost);
    } else {
      idem::IdempotencyGuard guard{fast};
      r = idem::test::run_reassigning<void>(guard, acquired, other, fp, runs, [&] { ++external; });
      idem::test::expect_replay<void>(guard, acquired, fp, runs);
      EXPECT_EQ(1, external);
      EXPECT_EQ(0u, guard.stats().snapshot().leases_lost);
    }
    EXPECT_EQ(Outcome::kExecuted, r.outcome);
    EXPECT_EQ(1, runs);
    EXPECT_EQ(0, count(other));
    idem::test::expect_acquired_key_completed(fast, acquired, other, fp);
    if (shape < 2) idem::test::expect_acquired_key_completed(durable, acquired, other, fp);
  }
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

// IdempotentConsumer::consume_batch over RedisStore + SQLite: one pipelined claim and one
// pipelined complete per batch, every message applied once (in-batch duplicates, duplicates
// across batches, and 4 threads consuming overlapping batches).
namespace {

class RedisConsumeBatchTest : public ::testing::Test {
 protected:
  void SetUp() override { IDEM_REQUIRE_ENV(url_, "IDEM_TEST_REDIS_URL"); }
  std::string url_;
  idem::test::TempDir dir_;
};

TEST_F(RedisConsumeBatchTest, PipelinedBatchesApplyEachMessageOnce) {
  RedisStore fast{RedisStoreOptions{url_}};
  idem::sqlite::SqliteStore durable{dir_.file("mq.sqlite"),
                                    idem::sqlite::SqliteStoreOptions::mq_consume_record()};
  durable.database().write([](idem::sqlite::Transaction& tx) {
    tx.exec("CREATE TABLE effect (message_id TEXT NOT NULL)");
  });
  idem::GuardOptions go;
  go.durable_source = idem::DuplicateSource::kMqRecord;
  idem::IdempotencyGuard<idem::sqlite::SqliteStore> guard{fast, durable, go};
  const std::string group = idem::test::unique_name("batch-group");
  idem::IdempotentConsumer<idem::sqlite::SqliteStore> consumer{guard, group};
  auto run = [&](const std::vector<std::string>& ids) {
    std::vector<std::string> fps;
    for (const auto& id : ids) fps.push_back(idem::fingerprint("body of " + id));
    std::vector<idem::Delivery> batch;
    for (std::size_t i = 0; i < ids.size(); ++i) batch.push_back(idem::Delivery{ids[i], fps[i]});
    return consumer.consume_batch(batch, [&](idem::sqlite::Transaction& tx, std::size_t i) {
      tx.exec("INSERT INTO effect (message_id) VALUES (?)", ids[i]);
    });
  };
  auto effects = [&](const std::string& id) {
    return durable.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM effect WHERE message_id = ?", id).value_or(-1);
    });
  };
  using idem::Verdict;
  const auto before = fast.command_stats();
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kAck, Verdict::kAckDuplicate}),
            run({"a", "b", "a"}));
  auto mid = fast.command_stats();
  EXPECT_EQ(before.pipelined_claim_batches + 1, mid.pipelined_claim_batches);
  EXPECT_EQ(before.pipelined_complete_batches + 1, mid.pipelined_complete_batches);
  EXPECT_EQ(before.native_completes + 2, mid.native_completes);
  // b is answered by Redis (no durable work), c runs.
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAckDuplicate, Verdict::kAck}), run({"b", "c"}));
  for (const char* id : {"a", "b", "c"}) {
    EXPECT_EQ(1, effects(id)) << id;
    auto rec = fast.lookup(Key::make(group, id));
    ASSERT_TRUE(rec.has_value()) << id;
    EXPECT_EQ(idem::Record::Status::kCompleted, rec->status) << id;
  }

  constexpr int kThreads = 4, kMessages = 80;
  std::atomic<int> acks{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int from = 0; from < kMessages; from += 16) {
        std::vector<std::string> ids;
        for (int m = from; m < from + 16; ++m) {
          ids.push_back("m" + std::to_string((m + 16 * t) % kMessages));
        }
        for (Verdict v : run(ids)) acks += v == Verdict::kAck;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(kMessages, acks.load());
  for (int m = 0; m < kMessages; ++m) EXPECT_EQ(1, effects("m" + std::to_string(m))) << m;
}

}  // namespace
