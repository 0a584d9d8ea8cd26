// SPDX-License-Identifier: MIT
// UniqueInsert on SQLite: a duplicate of the business unique key is a success naming the
// existing row, never an error, never an aborted transaction.
#include "idem/unique_insert.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "idem/guard.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sql_driver.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/test_env.hpp"

namespace {

using idem::InsertStatus;
using idem::UniqueInsert;
using idem::sqlite::Database;
using idem::sqlite::Session;
using idem::sqlite::Transaction;

class UniqueInsertTest : public ::testing::Test {
 protected:
  void SetUp() override {
    db_ = std::make_shared<Database>(dir_.file("coupons.sqlite"));
    db_->write([](Transaction& tx) {
      tx.exec_script(
          "CREATE TABLE user_coupon ("
          " id INTEGER PRIMARY KEY AUTOINCREMENT,"
          " user_id INTEGER NOT NULL,"
          " coupon_id TEXT NOT NULL,"
          " channel TEXT NOT NULL CHECK (channel <> 'forbidden'),"
          " UNIQUE (user_id, coupon_id));"
          "CREATE TABLE audit (id INTEGER PRIMARY KEY, note TEXT NOT NULL);");
    });
  }

  std::int64_t count(const std::string& sql) {
    return db_->read([&](Session& s) { return s.query_int64(sql).value_or(-1); });
  }

  idem::test::TempDir dir_;
  std::shared_ptr<Database> db_;
};

TEST_F(UniqueInsertTest, FirstInsertsThenRepeatsAnswerTheSameId) {
  UniqueInsert claim{"user_coupon", {"user_id", "coupon_id"}, {"channel"}};
  auto first = db_->write([&](Transaction& tx) { return claim.insert(tx, 7, "C42", "app"); });
  EXPECT_EQ(InsertStatus::kInserted, first.status);
  EXPECT_TRUE(first.inserted());
  EXPECT_GT(first.id, 0);

  auto again = db_->write([&](Transaction& tx) { return claim.insert(tx, 7, "C42", "web"); });
  EXPECT_EQ(InsertStatus::kAlreadyExists, again.status);
  EXPECT_FALSE(again.inserted());
  EXPECT_EQ(first.id, again.id);

  // Another key is another row.
  auto other = db_->write([&](Transaction& tx) { return claim.insert(tx, 8, "C42", "app"); });
  EXPECT_EQ(InsertStatus::kInserted, other.status);
  EXPECT_NE(first.id, other.id);

  EXPECT_EQ(2, count("SELECT count(*) FROM user_coupon"));
  // The duplicate did not overwrite the first row's values.
  EXPECT_EQ("app", db_->read([&](Session& s) {
    return s.query_text("SELECT channel FROM user_coupon WHERE id = ?", first.id).value_or("");
  }));
  EXPECT_EQ(2u, claim.stats().inserted);
  EXPECT_EQ(1u, claim.stats().already_exists);
}

TEST_F(UniqueInsertTest, DuplicateKeepsTheCallersTransactionUsable) {
  UniqueInsert claim{"user_coupon", {"user_id", "coupon_id"}, {"channel"}};
  db_->write([&](Transaction& tx) { (void)claim.insert(tx, 1, "C1", "app"); });
  db_->write([&](Transaction& tx) {
    tx.exec("INSERT INTO audit (note) VALUES ('before')");
    auto dup = claim.insert(tx, 1, "C1", "app");
    EXPECT_EQ(InsertStatus::kAlreadyExists, dup.status);
    // The same transaction goes on: more writes, a fresh insert, then commit.
    tx.exec("INSERT INTO audit (note) VALUES ('after')");
    auto fresh = claim.insert(tx, 2, "C1", "app");
    EXPECT_EQ(InsertStatus::kInserted, fresh.status);
  });
  EXPECT_EQ(2, count("SELECT count(*) FROM audit"));
  EXPECT_EQ(2, count("SELECT count(*) FROM user_coupon"));
}

TEST_F(UniqueInsertTest, CouponClaimFrom32ThreadsMakesOneRowAnd32SuccessesWithOneId) {
  UniqueInsert claim{"user_coupon", {"user_id", "coupon_id"}, {"channel"}};
  constexpr int kThreads = 32;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::mutex mu;
  std::vector<idem::InsertResult> results;
  std::vector<std::string> errors;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      ready.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      try {
        auto r = db_->write([&](Transaction& tx) {
          return claim.insert(tx, 1001, "SPRING", "thread-" + std::to_string(i));
        });
        std::lock_guard<std::mutex> lock(mu);
        results.push_back(r);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back(e.what());
      }
    });
  }
  while (ready.load() < kThreads) std::this_thread::yield();
  go.store(true);
  for (auto& t : threads) t.join();

  EXPECT_TRUE(errors.empty()) << errors.front();
  ASSERT_EQ(static_cast<std::size_t>(kThreads), results.size());
  int inserted = 0;
  std::set<std::int64_t> ids;
  for (const auto& r : results) {
    inserted += r.inserted() ? 1 : 0;
    ids.insert(r.id);
  }
  EXPECT_EQ(1, inserted);
  EXPECT_EQ(1u, ids.size());
  EXPECT_EQ(1, count("SELECT count(*) FROM user_coupon WHERE user_id = 1001"));
  EXPECT_EQ(*ids.begin(), count("SELECT id FROM user_coupon WHERE user_id = 1001"));
  EXPECT_EQ(1u, claim.stats().inserted);
  EXPECT_EQ(static_cast<std::uint64_t>(kThreads - 1), claim.stats().already_exists);
}

TEST_F(UniqueInsertTest, OtherConstraintsStillFail) {
  UniqueInsert claim{"user_coupon", {"user_id", "coupon_id"}, {"channel"}};
  // A CHECK violation is not "already exists": the statement fails as usual.
  EXPECT_THROW(db_->write([&](Transaction& tx) { (void)claim.insert(tx, 1, "C", "forbidden"); }),
               idem::StorageError);
  // So does a NOT NULL value column.
  EXPECT_THROW(db_->write([&](Transaction& tx) { (void)claim.insert(tx, 1, "C", nullptr); }),
               idem::StorageError);
  EXPECT_EQ(0, count("SELECT count(*) FROM user_coupon"));
}

TEST_F(UniqueInsertTest, KeyThatIsNotAUniqueIndexIsRefusedByTheDatabase) {
  UniqueInsert wrong{"user_coupon", {"user_id"}, {"coupon_id", "channel"}};
  EXPECT_THROW(db_->write([&](Transaction& tx) { (void)wrong.insert(tx, 1, "C", "app"); }),
               idem::StorageError);
}

TEST_F(UniqueInsertTest, RejectsNullKeysAndWrongArity) {
  UniqueInsert claim{"user_coupon", {"user_id", "coupon_id"}, {"channel"}};
  std::optional<int> no_user;
  EXPECT_THROW(db_->write([&](Transaction& tx) { (void)claim.insert(tx, no_user, "C", "a"); }),
               idem::UsageError);
  EXPECT_THROW(db_->write([&](Transaction& tx) { (void)claim.insert(tx, 1, nullptr, "a"); }),
               idem::UsageError);
  const char* no_coupon = nullptr;  // a null C string is NULL to every adapter (SQLite crashed)
  EXPECT_THROW(db_->write([&](Transaction& tx) { (void)claim.insert(tx, 1, no_coupon, "a"); }),
               idem::UsageError);
  EXPECT_THROW(db_->write([&](Transaction& tx) { (void)claim.insert(tx, 1, "C"); }),
               idem::UsageError);
  EXPECT_THROW(db_->write([&](Transaction& tx) { (void)claim.insert(tx, 1, "C", "a", "b"); }),
               idem::UsageError);
  std::optional<int> user = 5;
  auto r = db_->write([&](Transaction& tx) { return claim.insert(tx, user, "C", "a"); });
  EXPECT_TRUE(r.inserted());
  EXPECT_EQ(1, count("SELECT count(*) FROM user_coupon"));
}

TEST(UniqueInsert, ValidatesIdentifiers) {
  EXPECT_THROW(UniqueInsert("user_coupon; DROP TABLE x", {"a"}), idem::UsageError);
  EXPECT_THROW(UniqueInsert("t", {"a b"}), idem::UsageError);
  EXPECT_THROW(UniqueInsert("t", {"a"}, {"1v"}), idem::UsageError);
  EXPECT_THROW(UniqueInsert("t", {}), idem::UsageError);
  EXPECT_THROW(UniqueInsert("t", {"a"}, {"a"}), idem::UsageError);
  EXPECT_THROW(UniqueInsert("t", {"a"}, {"A"}), idem::UsageError);  // one column to SQL
  idem::UniqueInsertOptions o;
  o.id_column = "id)--";
  EXPECT_THROW(UniqueInsert("t", {"a"}, {}, o), idem::UsageError);
}

TEST(UniqueInsert, BuildsTheStatementInEachDialect) {
  UniqueInsert claim{"user_coupon", {"user_id", "coupon_id"}, {"channel"}};
  EXPECT_EQ("INSERT INTO user_coupon (user_id, coupon_id, channel) VALUES (?1, ?2, ?3) "
            "ON CONFLICT (user_id, coupon_id) DO NOTHING RETURNING id",
            claim.insert_sql(idem::SqlDialect::kSqlite));
  EXPECT_EQ("INSERT INTO user_coupon (user_id, coupon_id, channel) VALUES ($1, $2, $3) "
            "ON CONFLICT (user_id, coupon_id) DO NOTHING RETURNING id",
            claim.insert_sql(idem::SqlDialect::kPostgres));
  EXPECT_EQ("SELECT id FROM user_coupon WHERE user_id = ?1 AND coupon_id = ?2",
            claim.select_sql(idem::SqlDialect::kSqlite));
  EXPECT_EQ("SELECT id FROM user_coupon WHERE user_id = $1 AND coupon_id = $2",
            claim.select_sql(idem::SqlDialect::kPostgres));
}

struct DuplicateLog : idem::Observer {
  void on_duplicate(const idem::DuplicateEvent& e) noexcept override {
    std::lock_guard<std::mutex> lock(mu);
    keys.push_back(e.key.str());
    sources.push_back(e.source);
    outcomes.push_back(e.outcome);
  }
  std::mutex mu;
  std::vector<std::string> keys;
  std::vector<idem::DuplicateSource> sources;
  std::vector<idem::Outcome> outcomes;
};

TEST_F(UniqueInsertTest, TellsTheObserverOfEachDuplicate) {
  auto log = std::make_shared<DuplicateLog>();
  idem::UniqueInsertOptions o;
  o.observer = log;
  UniqueInsert claim{"user_coupon", {"user_id", "coupon_id"}, {"channel"}, o};
  db_->write([&](Transaction& tx) {
    (void)claim.insert(tx, 7, "C42", "app");
    (void)claim.insert(tx, 7, "C42", "app");
    (void)claim.insert(tx, 7, "C42", "app");
  });
  ASSERT_EQ(2u, log->keys.size());
  EXPECT_EQ("user_coupon|7:C42", log->keys[0]);
  EXPECT_EQ(idem::DuplicateSource::kUniqueIndex, log->sources[0]);
  EXPECT_EQ(idem::Outcome::kReplayed, log->outcomes[0]);
  // A key value that cannot form an idem key (a space) is skipped, the insert still answers.
  auto r = db_->write([&](Transaction& tx) {
    (void)claim.insert(tx, 8, "has space", "app");
    return claim.insert(tx, 8, "has space", "app");
  });
  EXPECT_EQ(InsertStatus::kAlreadyExists, r.status);
  EXPECT_EQ(2u, log->keys.size());
}

// The unique key and the idempotency record together: a second request id for the same
// business row (a second browser tab) runs the handler again, and the handler still answers
// the first row's id instead of a "duplicate key" error.
TEST_F(UniqueInsertTest, GuardedHandlerAnswersTheExistingRowForANewRequestId) {
  UniqueInsert claim{"user_coupon", {"user_id", "coupon_id"}, {"channel"}};
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable{db_};
  idem::IdempotencyGuard guard{fast, durable};
  auto handler = [&](Transaction& tx) {
    auto r = claim.insert(tx, 77, "WELCOME", "app");
    return std::string("coupon:") + std::to_string(r.id);
  };
  auto a = guard.run(idem::Key::make("coupon.claim", "req-1"), "", handler);
  auto b = guard.run(idem::Key::make("coupon.claim", "req-1"), "", handler);
  auto c = guard.run(idem::Key::make("coupon.claim", "req-2"), "", handler);
  EXPECT_EQ(idem::Outcome::kExecuted, a.outcome);
  EXPECT_EQ(idem::Outcome::kReplayed, b.outcome);
  EXPECT_EQ(idem::Outcome::kExecuted, c.outcome);
  EXPECT_EQ(*a.value, *b.value);
  EXPECT_EQ(*a.value, *c.value);
  EXPECT_EQ(1, count("SELECT count(*) FROM user_coupon WHERE user_id = 77"));
}

}  // namespace
