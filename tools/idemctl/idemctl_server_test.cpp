// SPDX-License-Identifier: MIT
// idemctl, run as a binary against the real servers (IDEM_TEST_POSTGRES_DSN,
// IDEM_TEST_REDIS_URL): show from PostgreSQL and Redis side by side, stats and purge on
// PostgreSQL, and exit status 3 with a clear message when a server is unreachable.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "idem/guard.hpp"
#include "idem/postgres/postgres_store.hpp"
#include "idem/redis/redis_store.hpp"
#include "idemctl_test_support.hpp"
#include "support/test_env.hpp"

namespace {

using idemctl_test::contains;
using idemctl_test::idemctl;
using idemctl_test::quote;
using idemctl_test::Run;

std::size_t occurrences(const std::string& s, const std::string& needle) {
  std::size_t n = 0;
  for (auto at = s.find(needle); at != std::string::npos; at = s.find(needle, at + 1)) ++n;
  return n;
}

// A private record table in PostgreSQL and a private key prefix in Redis, filled through the
// guard: order.create|abc (completed, 1234 bytes, in both stores), payment|p1 (completed),
// payment|running (in progress), and three rows aged ten days in SQL: old_0, old_1 (completed,
// retention over) and old_stuck (in progress, lease over).
class IdemctlServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(dsn_, "IDEM_TEST_POSTGRES_DSN");
    IDEM_REQUIRE_ENV(redis_url_, "IDEM_TEST_REDIS_URL");
    idem::postgres::PostgresStoreOptions o;
    o.conninfo = dsn_;
    o.table = idem::test::unique_name("ctl_idem");
    store_ = std::make_unique<idem::postgres::PostgresStore>(o);
    idem::redis::RedisStoreOptions ro{redis_url_};
    prefix_ = idem::test::unique_name("ctl") + ":";
    ro.key_prefix = prefix_;
    fast_ = std::make_unique<idem::redis::RedisStore>(ro);
    idem::IdempotencyGuard guard{*fast_, *store_};
    auto r = guard.run(idem::Key::make("order.create", "abc"), "fp1",
                       [](pqxx::work&) { return std::string(1234, 'x'); });
    ASSERT_TRUE(r.ok());
    for (const char* id : {"old_0", "old_1"}) {
      (void)guard.run(idem::Key::make("order.create", id), "fp",
                      [](pqxx::work&) { return std::string("old"); });
    }
    (void)guard.run(idem::Key::make("payment", "p1"), "",
                    [](pqxx::work&) { return std::string("paid"); });
    (void)store_->begin(idem::Key::make("payment", "running"), "", idem::OwnerToken::generate(),
                        std::chrono::seconds(60));
    (void)store_->begin(idem::Key::make("order.create", "old_stuck"), "fp",
                        idem::OwnerToken::generate(), std::chrono::seconds(30));
    store_->with_transaction([&](pqxx::work& tx) {
      const std::string t = store_->qualified_table();
      tx.exec("UPDATE " + t +
              " SET created_at = now() - interval '10 days', updated_at = now() - interval "
              "'10 days', expires_at = now() - interval '9 days'"
              " WHERE idem_key IN ('old_0', 'old_1')");
      tx.exec("UPDATE " + t +
              " SET created_at = now() - interval '10 days', updated_at = now() - interval "
              "'10 days', lease_until = now() - interval '10 days' WHERE idem_key = 'old_stuck'");
    });
    db_ = " --db " + quote(dsn_) + " --table " + o.table + " ";
  }
  void TearDown() override {
    if (!store_) return;
    store_->with_transaction(
        [&](pqxx::work& tx) { tx.exec("DROP TABLE IF EXISTS " + store_->qualified_table()); });
  }

  std::string dsn_, redis_url_, prefix_, db_;
  std::unique_ptr<idem::postgres::PostgresStore> store_;
  std::unique_ptr<idem::redis::RedisStore> fast_;
};

TEST_F(IdemctlServerTest, ShowPrintsPostgresAndRedisSideBySide) {
  auto r = idemctl(db_ + "--fast " + quote(redis_url_) + " --fast-prefix " + quote(prefix_) +
                   " show order.create abc");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "key order.create|abc")) << r.out;
  EXPECT_TRUE(contains(r.out, "postgres:")) << r.out;
  EXPECT_TRUE(contains(r.out, "redis:" + redis_url_)) << r.out;
  EXPECT_TRUE(contains(r.out, " redis:" + redis_url_)) << r.out;  // titles kept apart
  EXPECT_EQ(2u, occurrences(r.out, "completed")) << r.out;        // one per store
  EXPECT_EQ(2u, occurrences(r.out, "1234 bytes")) << r.out;       // both hold the response
  EXPECT_EQ(2u, occurrences(r.out, "fp1")) << r.out;
  EXPECT_TRUE(contains(r.out, "attempts     1")) << r.out;

  // Only in PostgreSQL (two-phase begin never touched Redis): the Redis column says absent.
  auto running = idemctl(db_ + "--fast " + quote(redis_url_) + " --fast-prefix " + quote(prefix_) +
                         " show payment running");
  EXPECT_EQ(0, running.status) << running.out;
  EXPECT_TRUE(contains(running.out, "in_progress")) << running.out;
  EXPECT_TRUE(contains(running.out, "(absent)")) << running.out;

  auto absent = idemctl(db_ + "show order.create nothing");
  EXPECT_EQ(1, absent.status) << absent.out;
  EXPECT_TRUE(contains(absent.out, "(absent)"));
}

TEST_F(IdemctlServerTest, StatsCountsByStatusOnPostgres) {
  auto r = idemctl(db_ + "stats");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "in_progress  2  (1 with an expired lease)")) << r.out;
  EXPECT_TRUE(contains(r.out, "completed    4\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "failed       0\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "total        6  (2 past retention")) << r.out;
}

// --schema reads a table outside `public` and the headers name it; a table whose version row
// is newer than this idemctl is refused, its records left untouched.
TEST_F(IdemctlServerTest, SchemaNamesTheTableAndNewerTablesAreRefused) {
  const std::string schema = idem::test::unique_name("ctl_schema");
  idem::postgres::PostgresStoreOptions o;
  o.conninfo = dsn_;
  o.schema = schema;
  o.table = "api_idempotency";
  {
    idem::postgres::PostgresStore store(o);
    idem::IdempotencyGuard guard{store};
    (void)guard.run(idem::Key::make("payment", "in_schema"), "",
                    [](pqxx::work&) { return std::string("ok"); });
  }
  const std::string db = " --db " + quote(dsn_) + " --schema " + schema + " ";
  auto r = idemctl(db + "stats");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "table " + schema + ".api_idempotency")) << r.out;
  EXPECT_TRUE(contains(r.out, "completed    1\n")) << r.out;
  EXPECT_EQ(2, idemctl(" --db /nonexistent/records.sqlite --schema s stats").status);  // not PG
  store_->with_transaction([&](pqxx::work& tx) {
    tx.exec("UPDATE " + schema + ".idem_schema_version SET version = 3");
  });
  auto newer = idemctl(db + "purge --older-than 1s");
  EXPECT_EQ(3, newer.status) << newer.out;
  EXPECT_TRUE(contains(newer.out, "newer than this idem")) << newer.out;
  store_->with_transaction([&](pqxx::work& tx) {
    EXPECT_EQ(1, tx.exec("SELECT count(*) FROM " + schema + ".api_idempotency")[0][0].as<int>());
    tx.exec("DROP SCHEMA " + schema + " CASCADE");
  });
}

TEST_F(IdemctlServerTest, PurgeOlderThanDeletesOnlyOldFinishedRecords) {
  auto dry = idemctl(db_ + "purge --older-than 7d --dry-run");
  EXPECT_EQ(0, dry.status) << dry.out;
  EXPECT_TRUE(contains(dry.out, "would purge 2 ")) << dry.out;
  EXPECT_TRUE(contains(idemctl(db_ + "stats").out, "completed    4\n"));

  auto r = idemctl(db_ + "purge --older-than 7d");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "purged 2 ")) << r.out;
  EXPECT_FALSE(store_->lookup(idem::Key::make("order.create", "old_0")));
  EXPECT_FALSE(store_->lookup(idem::Key::make("order.create", "old_1")));
  EXPECT_TRUE(store_->lookup(idem::Key::make("order.create", "old_stuck")));  // in progress
  EXPECT_TRUE(store_->lookup(idem::Key::make("order.create", "abc")));
  EXPECT_TRUE(store_->lookup(idem::Key::make("payment", "p1")));
  EXPECT_TRUE(contains(idemctl(db_ + "purge --older-than 30d").out, "purged 0 "));
}

TEST_F(IdemctlServerTest, PurgeExpiredDeletesRecordsPastRetention) {
  auto r = idemctl(db_ + "purge --expired");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "purged 2 records past retention")) << r.out;
  EXPECT_FALSE(store_->lookup(idem::Key::make("order.create", "old_0")));
  EXPECT_TRUE(store_->lookup(idem::Key::make("order.create", "old_stuck")));
  EXPECT_TRUE(store_->lookup(idem::Key::make("order.create", "abc")));
}

TEST_F(IdemctlServerTest, ResponseFromPostgresOrRedisEscapedOrRaw) {
  const std::string odd("{\"a\":1}\n\0\x01\xff", 11);
  (void)idem::IdempotencyGuard{*fast_, *store_}.run(idem::Key::make("order.create", "odd"), "",
                                                    [&](pqxx::work&) { return odd; });
  auto escaped = idemctl(db_ + "response order.create odd");
  EXPECT_EQ(0, escaped.status) << escaped.out;
  EXPECT_EQ("{\"a\":1}\\n\\x00\\x01\\xFF\n", escaped.out);
  EXPECT_EQ(odd, idemctl(db_ + "response order.create odd --raw", false).out);

  // Only in Redis (a fast-store-only service): read with --fast, with or without --db.
  const std::string fast = " --fast " + quote(redis_url_) + " --fast-prefix " + quote(prefix_);
  fast_->fill(idem::Key::make("cart", "c1"), "", std::string("\x1b[0m", 4), std::chrono::hours(1));
  auto from_redis = idemctl(db_ + fast + " response cart c1");
  EXPECT_EQ(0, from_redis.status) << from_redis.out;
  EXPECT_EQ("\\x1B[0m\n", from_redis.out);
  EXPECT_EQ(std::string("\x1b[0m", 4), idemctl(fast + " response cart c1 --raw", false).out);

  auto absent = idemctl(db_ + fast + " response cart nothing");
  EXPECT_EQ(1, absent.status) << absent.out;
  EXPECT_TRUE(contains(absent.out, "no record of cart|nothing in postgres:")) << absent.out;
  EXPECT_TRUE(contains(absent.out, ", redis:" + redis_url_)) << absent.out;
  auto running = idemctl(db_ + "response payment running");
  EXPECT_EQ(4, running.status) << running.out;
  EXPECT_TRUE(contains(running.out, "no response is stored yet")) << running.out;
}

// A claim held in both stores by one attempt (crashed after its fast claim and durable begin).
TEST_F(IdemctlServerTest, ReleaseRemovesAStuckClaimFromPostgresAndRedis) {
  const auto key = idem::Key::make("order.create", "stuck");
  const auto owner = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            fast_->claim(key, "fp", owner, std::chrono::minutes(5)).status);
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            store_->begin(key, "fp", owner, std::chrono::minutes(5)).status);
  const std::string fast = " --fast " + quote(redis_url_) + " --fast-prefix " + quote(prefix_);

  auto ask = idemctl(db_ + fast + " release order.create stuck");
  EXPECT_EQ(4, ask.status) << ask.out;
  EXPECT_EQ(2u, occurrences(ask.out, "owner " + owner.str() + ", lease until ")) << ask.out;

  auto dry = idemctl(db_ + fast + " release order.create stuck --owner " + owner.str());
  EXPECT_EQ(5, dry.status) << dry.out;
  EXPECT_TRUE(contains(dry.out,
                       "would release order.create|stuck (owner " + owner.str() + ") in postgres:"))
      << dry.out;
  EXPECT_TRUE(contains(dry.out, ") in redis:" + redis_url_)) << dry.out;
  EXPECT_EQ(2u, occurrences(dry.out, "warning: the lease in ")) << dry.out;  // live leases
  EXPECT_TRUE(store_->lookup(key));
  EXPECT_TRUE(fast_->lookup(key));

  auto done = idemctl(db_ + fast + " release order.create stuck --owner " + owner.str() + " --yes");
  EXPECT_EQ(0, done.status) << done.out;
  EXPECT_EQ(2u, occurrences(done.out, "released order.create|stuck")) << done.out;
  EXPECT_FALSE(store_->lookup(key));
  EXPECT_FALSE(fast_->lookup(key));

  // The old attempt's own calls are fenced afterwards, and the next attempt runs once.
  EXPECT_FALSE(store_->complete(key, owner, "late", std::chrono::hours(1)));
  EXPECT_FALSE(fast_->complete(key, owner, "late", std::chrono::hours(1)));
  int runs = 0;
  auto again = idem::IdempotencyGuard{*fast_, *store_}.run(key, "fp", [&](pqxx::work&) {
    ++runs;
    return std::string("second");
  });
  EXPECT_TRUE(again.ok());
  EXPECT_EQ(1, runs);
}

TEST_F(IdemctlServerTest, ReleaseRefusesFinishedRecordsAndOtherOwners) {
  const std::string fast = " --fast " + quote(redis_url_) + " --fast-prefix " + quote(prefix_);
  auto owner = store_->lookup(idem::Key::make("order.create", "abc"))->owner;
  auto completed = idemctl(db_ + fast + " release order.create abc --owner " + owner + " --yes");
  EXPECT_EQ(4, completed.status) << completed.out;
  EXPECT_TRUE(contains(completed.out, "refusing to release a finished record")) << completed.out;
  EXPECT_EQ(idem::Record::Status::kCompleted,
            store_->lookup(idem::Key::make("order.create", "abc"))->status);
  EXPECT_EQ(idem::Record::Status::kCompleted,
            fast_->lookup(idem::Key::make("order.create", "abc"))->status);

  // A fast claim left over a completed durable record (the attempt committed, then died before
  // completing in Redis): the claim goes, the record stays, and duplicates replay it.
  const auto late = idem::Key::make("order.create", "late");
  const auto dead = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            store_->begin(late, "", dead, std::chrono::minutes(5)).status);
  ASSERT_TRUE(store_->complete(late, dead, "paid", std::chrono::hours(1)));
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            fast_->claim(late, "", dead, std::chrono::minutes(5)).status);
  auto over = idemctl(db_ + fast + " release order.create late --owner " + dead.str() + " --yes");
  EXPECT_EQ(0, over.status) << over.out;
  EXPECT_TRUE(contains(over.out, "order.create|late completed in postgres:")) << over.out;
  EXPECT_TRUE(contains(over.out, "left as it is (release never removes a finished record)"))
      << over.out;
  EXPECT_TRUE(contains(over.out, "released order.create|late (owner " + dead.str() + ") in redis:"))
      << over.out;
  EXPECT_EQ(idem::Record::Status::kCompleted, store_->lookup(late)->status);
  int runs = 0;
  auto replay = idem::IdempotencyGuard{*fast_, *store_}.run(late, "", [&](pqxx::work&) {
    ++runs;
    return std::string("again");
  });
  ASSERT_TRUE(replay.ok());
  EXPECT_EQ(0, runs);
  EXPECT_EQ(idem::Outcome::kReplayed, replay.outcome);
  EXPECT_EQ("paid", replay.value.value_or(""));

  // Redis held by one attempt, PostgreSQL by another: only the named owner's claim goes.
  const auto key = idem::Key::make("order.create", "split");
  const auto a = idem::OwnerToken::generate(), b = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed, fast_->claim(key, "", a, std::chrono::minutes(5)).status);
  ASSERT_EQ(idem::ClaimStatus::kClaimed, store_->begin(key, "", b, std::chrono::minutes(5)).status);
  auto split = idemctl(db_ + fast + " release order.create split --owner " + a.str() + " --yes");
  EXPECT_EQ(0, split.status) << split.out;
  EXPECT_TRUE(contains(split.out, "left as it is in postgres:")) << split.out;
  EXPECT_TRUE(contains(split.out, "released order.create|split (owner " + a.str() + ") in redis:"))
      << split.out;
  EXPECT_FALSE(fast_->lookup(key));
  EXPECT_EQ(b.str(), store_->lookup(key)->owner);
  auto nobody = idemctl(db_ + " release order.create split --owner " + a.str() + " --yes");
  EXPECT_EQ(4, nobody.status) << nobody.out;
  EXPECT_TRUE(contains(nobody.out, "does not hold")) << nobody.out;
  EXPECT_TRUE(store_->lookup(key));
}

// release racing the attempt's own complete: exactly one of them wins every round, and what
// idemctl says matches what happened to the record.
TEST_F(IdemctlServerTest, ReleaseRacingTheOwnersCompleteHasOneWinner) {
  int released = 0, completed = 0, changed_after_read = 0;
  for (int round = 0; round < 12; ++round) {
    const auto key = idem::Key::make("order.create", "race_" + std::to_string(round));
    const auto owner = idem::OwnerToken::generate();
    ASSERT_EQ(idem::ClaimStatus::kClaimed,
              store_->begin(key, "", owner, std::chrono::minutes(5)).status);
    bool complete_ok = false;
    std::thread attempt([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(round * 10));
      complete_ok = store_->complete(key, owner, "paid", std::chrono::hours(1));
    });
    auto r = idemctl(db_ + "release order.create race_" + std::to_string(round) + " --owner " +
                     owner.str() + " --yes");
    attempt.join();
    const bool said_released = contains(r.out, "released order.create|race_");
    auto record = store_->lookup(key);
    EXPECT_NE(complete_ok, said_released) << r.out;
    if (complete_ok) {
      ++completed;
      EXPECT_EQ(4, r.status) << r.out;  // refused, or "not released: the record changed"
      if (contains(r.out, "the record changed since it was read")) ++changed_after_read;
      ASSERT_TRUE(record);
      EXPECT_EQ(idem::Record::Status::kCompleted, record->status);
    } else {
      ++released;
      EXPECT_EQ(0, r.status) << r.out;
      EXPECT_FALSE(record);
    }
  }
  std::printf(
      "release won %d rounds, the owner's complete %d (%d between idemctl's read and its "
      "release)\n",
      released, completed, changed_after_read);
}

TEST_F(IdemctlServerTest, DuplicatesCountsPostgresTakeoversAndNotRedis) {
  // Two attempts take over an expired lease (database clock) of order.create|taken.
  const auto key = idem::Key::make("order.create", "taken");
  auto last = idem::OwnerToken::generate();
  for (int i = 0; i < 3; ++i) {
    last = idem::OwnerToken::generate();
    auto c = store_->begin(key, "fp", last, std::chrono::milliseconds(1));
    ASSERT_EQ(idem::ClaimStatus::kClaimed, c.status);
    EXPECT_EQ(i > 0, c.took_over);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(store_->complete(key, last, "done", std::chrono::hours(1)));
  fast_->fill(key, "fp", "done", std::chrono::hours(1));

  const std::string fast = " --fast " + quote(redis_url_) + " --fast-prefix " + quote(prefix_);
  auto one = idemctl(db_ + fast + " duplicates order.create taken");
  EXPECT_EQ(0, one.status) << one.out;
  EXPECT_TRUE(contains(one.out, "attempts     3 ")) << one.out;
  EXPECT_TRUE(contains(one.out, "takeovers    2 ")) << one.out;
  // Redis keeps no attempt count and no store counts replays: Redis' attempts and takeovers
  // and both stores' replays say so.
  EXPECT_EQ(4u, occurrences(one.out, "not recorded")) << one.out;

  auto top = idemctl(db_ + "duplicates --top 3");
  EXPECT_EQ(0, top.status) << top.out;
  EXPECT_TRUE(contains(top.out,
                       "attempts  takeovers  key\n3         2          order.create|taken\n"
                       "1 record held by more than one attempt\n"))
      << top.out;
}

TEST_F(IdemctlServerTest, UnreachableOrWrongStoresExit3WithAClearMessage) {
  auto refused = idemctl("--db 'host=127.0.0.1 port=1 user=postgres dbname=x' stats");
  EXPECT_EQ(3, refused.status) << refused.out;
  EXPECT_TRUE(contains(refused.out, "cannot open postgres:host=127.0.0.1 port=1")) << refused.out;

  // A URI with a password: the message never prints it.
  auto uri = idemctl("--db postgresql://postgres:s3cret@127.0.0.1:1/x show order.create abc");
  EXPECT_EQ(3, uri.status) << uri.out;
  EXPECT_TRUE(contains(uri.out, "postgresql://postgres:***@127.0.0.1:1/x")) << uri.out;
  EXPECT_FALSE(contains(uri.out, "s3cret")) << uri.out;

  auto no_table = idemctl("--db " + quote(dsn_) + " --table no_such_idem_table stats");
  EXPECT_EQ(3, no_table.status) << no_table.out;
  EXPECT_TRUE(contains(no_table.out, "has no table")) << no_table.out;

  auto redis_down = idemctl(db_ + "--fast redis://127.0.0.1:1 show order.create abc");
  EXPECT_EQ(3, redis_down.status) << redis_down.out;
  EXPECT_TRUE(contains(redis_down.out, "redis:redis://127.0.0.1:1")) << redis_down.out;

  auto scheme = idemctl(db_ + "--fast memcached://127.0.0.1:1 show order.create abc");
  EXPECT_EQ(3, scheme.status) << scheme.out;
  EXPECT_TRUE(contains(scheme.out, "unknown scheme")) << scheme.out;
}

}  // namespace
