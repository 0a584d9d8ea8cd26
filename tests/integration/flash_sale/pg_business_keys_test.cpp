// SPDX-License-Identifier: MIT
// UniqueInsert and StockTable on a real PostgreSQL, through the pqxx SqlDriver: concurrent
// transactions, waits on an uncommitted duplicate, and a duplicate that does not abort the
// caller's transaction (PostgreSQL aborts a transaction on any error, so this is the real test).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "idem/postgres/sql_driver.hpp"
#include "idem/stock.hpp"
#include "idem/unique_insert.hpp"
#include "support/test_env.hpp"

namespace {

using idem::InsertStatus;

// A throwaway table pair, dropped at the end.
class PgBusinessKeys : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(dsn_, "IDEM_TEST_POSTGRES_DSN");
    coupons_ = idem::test::unique_name("idem_test_uc");
    stock_ = idem::test::unique_name("idem_test_stock");
    pqxx::connection c{dsn_};
    pqxx::work tx{c};
    tx.exec("CREATE TABLE " + coupons_ +
            " (id BIGSERIAL PRIMARY KEY, user_id BIGINT NOT NULL, coupon_id TEXT NOT NULL,"
            " channel TEXT NOT NULL, UNIQUE (user_id, coupon_id))");
    // No CHECK (qty >= 0) on purpose: a wrong deduction would show as a negative quantity.
    tx.exec("CREATE TABLE " + stock_ + " (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL)");
    tx.commit();
    created_ = true;
  }

  void TearDown() override {
    if (!created_) return;
    pqxx::connection c{dsn_};
    pqxx::work tx{c};
    tx.exec("DROP TABLE IF EXISTS " + coupons_);
    tx.exec("DROP TABLE IF EXISTS " + stock_);
    tx.commit();
  }

  std::int64_t count(const std::string& sql) {
    pqxx::connection c{dsn_};
    pqxx::work tx{c};
    return tx.exec1(sql)[0].as<std::int64_t>();
  }

  std::string dsn_, coupons_, stock_;
  bool created_ = false;
};

TEST_F(PgBusinessKeys, DuplicateKeepsTheTransactionUsable) {
  idem::UniqueInsert claim{coupons_, {"user_id", "coupon_id"}, {"channel"}};
  pqxx::connection c{dsn_};
  pqxx::work tx{c};
  auto first = claim.insert(tx, 7, "C42", "app");
  EXPECT_EQ(InsertStatus::kInserted, first.status);
  auto dup = claim.insert(tx, 7, "C42", "web");
  EXPECT_EQ(InsertStatus::kAlreadyExists, dup.status);
  EXPECT_EQ(first.id, dup.id);
  // A plain INSERT of the duplicate would have aborted the transaction; this one goes on.
  auto other = claim.insert(tx, 8, "C42", "app");
  EXPECT_EQ(InsertStatus::kInserted, other.status);
  tx.commit();
  EXPECT_EQ(2, count("SELECT count(*) FROM " + coupons_));
}

// libpq sends text parameters as C strings: a value with a NUL byte would reach the server cut
// short ("GIFT\0userB" as "GIFT", answered as "GIFT\0userA"'s row; "a\0zzz" deducting from "a").
TEST_F(PgBusinessKeys, TextWithANulByteIsRefusedNotCutShort) {
  idem::UniqueInsert claim{coupons_, {"user_id", "coupon_id"}, {"channel"}};
  idem::StockTable stock{stock_};
  pqxx::connection c{dsn_};
  pqxx::work tx{c};
  tx.exec("INSERT INTO " + stock_ + " VALUES ('a', 5)");
  EXPECT_THROW((void)claim.insert(tx, 7, std::string("GIFT\0userA", 10), "app"), idem::UsageError);
  EXPECT_THROW((void)stock.deduct(tx, std::string("a\0zzz", 5), 1), idem::UsageError);
  EXPECT_EQ(InsertStatus::kInserted, claim.insert(tx, 7, "GIFT", "app").status);
  tx.commit();
  EXPECT_EQ(5, count("SELECT qty FROM " + stock_ + " WHERE sku = 'a'"));
}

TEST_F(PgBusinessKeys, CouponClaimFrom32ConnectionsMakesOneRowAnd32SuccessesWithOneId) {
  idem::UniqueInsert claim{coupons_, {"user_id", "coupon_id"}, {"channel"}};
  constexpr int kThreads = 32;
  std::vector<std::unique_ptr<pqxx::connection>> conns;
  for (int i = 0; i < kThreads; ++i) conns.push_back(std::make_unique<pqxx::connection>(dsn_));
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
        pqxx::work tx{*conns[static_cast<std::size_t>(i)]};
        auto r = claim.insert(tx, 1001, "SPRING", "conn-" + std::to_string(i));
        // Keep the transaction open a moment: concurrent claims queue behind the
        // uncommitted row and must answer its id once it commits.
        if (r.inserted()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        tx.commit();
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

  ASSERT_TRUE(errors.empty()) << errors.front();
  ASSERT_EQ(static_cast<std::size_t>(kThreads), results.size());
  int inserted = 0;
  std::set<std::int64_t> ids;
  for (const auto& r : results) {
    inserted += r.inserted() ? 1 : 0;
    ids.insert(r.id);
  }
  EXPECT_EQ(1, inserted);
  EXPECT_EQ(1u, ids.size());
  EXPECT_EQ(1, count("SELECT count(*) FROM " + coupons_));
  EXPECT_EQ(*ids.begin(), count("SELECT id FROM " + coupons_));
}

// A claim waiting on an uncommitted duplicate inserts when that transaction rolls back.
TEST_F(PgBusinessKeys, WaiterInsertsWhenTheFirstTransactionRollsBack) {
  idem::UniqueInsert claim{coupons_, {"user_id", "coupon_id"}, {"channel"}};
  pqxx::connection c1{dsn_}, c2{dsn_}, watcher{dsn_};
  auto first = std::make_unique<pqxx::work>(c1);
  auto a = claim.insert(*first, 5, "X", "first");
  ASSERT_TRUE(a.inserted());
  idem::InsertResult b;
  std::string error;
  std::thread second([&] {
    try {
      pqxx::work tx{c2};
      b = claim.insert(tx, 5, "X", "second");
      tx.commit();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  // Wait until the second claim blocks on the first's uncommitted row.
  for (int i = 0; i < 500; ++i) {
    pqxx::nontransaction q{watcher};
    auto n = q.exec1("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                     "AND datname = current_database() AND query LIKE '%" + coupons_ + "%'")[0]
                 .as<int>();
    if (n > 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  first->abort();
  second.join();
  ASSERT_TRUE(error.empty()) << error;
  EXPECT_EQ(InsertStatus::kInserted, b.status);
  EXPECT_EQ(1, count("SELECT count(*) FROM " + coupons_ + " WHERE channel = 'second'"));
}

TEST_F(PgBusinessKeys, StockDeductionAnswersEachCase) {
  idem::StockTable stock{stock_, "sku", "qty"};
  pqxx::connection c{dsn_};
  pqxx::work tx{c};
  tx.exec("INSERT INTO " + stock_ + " (sku, qty) VALUES ('A', 5)");
  auto d1 = stock.deduct(tx, "A", 3);
  EXPECT_EQ(idem::DeductStatus::kDeducted, d1.status);
  EXPECT_EQ(2, d1.remaining);
  auto d2 = stock.deduct(tx, "A", 3);
  EXPECT_EQ(idem::DeductStatus::kInsufficient, d2.status);
  EXPECT_EQ(2, d2.remaining);
  auto d3 = stock.deduct(tx, "NONE", 1);
  EXPECT_EQ(idem::DeductStatus::kUnknownItem, d3.status);
  EXPECT_EQ(2, stock.quantity(tx, "A").value_or(-1));
  tx.commit();
}

// Concurrent transactions on one hot row: exactly N deductions, never below zero.
TEST_F(PgBusinessKeys, StockRaceOfMoreBuyersThanStockDeductsExactlyTheStock) {
  idem::StockTable stock{stock_, "sku", "qty"};
  constexpr int kThreads = 16;
  constexpr int kBuyersPerThread = 25;  // 400 buyers
  constexpr std::int64_t kStock = 100;
  {
    pqxx::connection c{dsn_};
    pqxx::work tx{c};
    tx.exec("INSERT INTO " + stock_ + " (sku, qty) VALUES ('HOT', " + std::to_string(kStock) +
            ")");
    tx.commit();
  }
  std::atomic<int> deducted{0}, refused{0}, errors{0};
  std::atomic<std::int64_t> lowest{kStock};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      pqxx::connection c{dsn_};
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kBuyersPerThread; ++i) {
        try {
          pqxx::work tx{c};
          auto d = stock.deduct(tx, "HOT", 1);
          tx.commit();
          (d.ok() ? deducted : refused).fetch_add(1);
          std::int64_t seen = lowest.load();
          while (d.remaining < seen && !lowest.compare_exchange_weak(seen, d.remaining)) {
          }
        } catch (const std::exception&) {
          errors.fetch_add(1);
        }
      }
    });
  }
  go.store(true);
  for (auto& th : threads) th.join();
  EXPECT_EQ(0, errors.load());
  EXPECT_EQ(kStock, deducted.load());
  EXPECT_EQ(kThreads * kBuyersPerThread - kStock, refused.load());
  EXPECT_EQ(0, lowest.load());
  EXPECT_EQ(0, count("SELECT qty FROM " + stock_ + " WHERE sku = 'HOT'"));
}

}  // namespace
