// SPDX-License-Identifier: MIT
// StockTable on SQLite: the conditional UPDATE never goes below zero under races, and inside a
// guarded transaction a repeated order deducts once and a sold-out answer is replayed.
#include "idem/stock.hpp"

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

using idem::DeductStatus;
using idem::StockTable;
using idem::sqlite::Database;
using idem::sqlite::Session;
using idem::sqlite::Transaction;

class StockTest : public ::testing::Test {
 protected:
  void SetUp() override {
    db_ = std::make_shared<Database>(dir_.file("stock.sqlite"));
    // No CHECK (qty >= 0) on purpose: a wrong deduction would show as a negative quantity
    // instead of being stopped by the database.
    db_->write([](Transaction& tx) {
      tx.exec_script(
          "CREATE TABLE stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL);"
          "CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, buyer TEXT NOT NULL,"
          " sku TEXT NOT NULL);");
    });
  }

  void set_stock(const std::string& sku, std::int64_t qty) {
    db_->write([&](Transaction& tx) {
      tx.exec("INSERT INTO stock (sku, qty) VALUES (?1, ?2) "
              "ON CONFLICT (sku) DO UPDATE SET qty = excluded.qty",
              sku, qty);
    });
  }

  std::int64_t qty(const std::string& sku) {
    return db_->read([&](Session& s) {
      return s.query_int64("SELECT qty FROM stock WHERE sku = ?", sku).value_or(-999);
    });
  }

  std::int64_t orders() {
    return db_->read(
        [&](Session& s) { return s.query_int64("SELECT count(*) FROM orders").value_or(-1); });
  }

  idem::test::TempDir dir_;
  std::shared_ptr<Database> db_;
  StockTable stock_{"stock", "sku", "qty"};
};

TEST_F(StockTest, DeductsOnlyWhatIsThere) {
  set_stock("SKU-1", 5);
  auto a = db_->write([&](Transaction& tx) { return stock_.deduct(tx, "SKU-1", 3); });
  EXPECT_EQ(DeductStatus::kDeducted, a.status);
  EXPECT_TRUE(a.ok());
  EXPECT_EQ(2, a.remaining);

  auto b = db_->write([&](Transaction& tx) { return stock_.deduct(tx, "SKU-1", 3); });
  EXPECT_EQ(DeductStatus::kInsufficient, b.status);
  EXPECT_FALSE(b.ok());
  EXPECT_EQ(2, b.remaining);
  EXPECT_EQ(2, qty("SKU-1"));

  auto c = db_->write([&](Transaction& tx) { return stock_.deduct(tx, "SKU-1", 2); });
  EXPECT_EQ(DeductStatus::kDeducted, c.status);
  EXPECT_EQ(0, c.remaining);

  auto d = db_->write([&](Transaction& tx) { return stock_.deduct(tx, "SKU-1", 1); });
  EXPECT_EQ(DeductStatus::kInsufficient, d.status);
  EXPECT_EQ(0, d.remaining);

  auto e = db_->write([&](Transaction& tx) { return stock_.deduct(tx, "NO-SUCH", 1); });
  EXPECT_EQ(DeductStatus::kUnknownItem, e.status);
  EXPECT_EQ(0, qty("SKU-1"));

  auto q = db_->write([&](Transaction& tx) { return stock_.quantity(tx, "SKU-1"); });
  EXPECT_EQ(0, q.value_or(-1));
}

TEST_F(StockTest, RefusesNonPositiveQuantities) {
  set_stock("SKU-1", 5);
  EXPECT_THROW(db_->write([&](Transaction& tx) { (void)stock_.deduct(tx, "SKU-1", 0); }),
               idem::UsageError);
  EXPECT_THROW(db_->write([&](Transaction& tx) { (void)stock_.deduct(tx, "SKU-1", -4); }),
               idem::UsageError);
  EXPECT_EQ(5, qty("SKU-1"));
}

TEST(StockTable, ValidatesIdentifiersAndBuildsBothDialects) {
  EXPECT_THROW(StockTable("stock;--", "sku", "qty"), idem::UsageError);
  EXPECT_THROW(StockTable("stock", "sku", "qty qty"), idem::UsageError);
  EXPECT_THROW(StockTable("stock", "qty", "qty"), idem::UsageError);
  StockTable t{"stock", "sku", "qty"};
  EXPECT_EQ("UPDATE stock SET qty = qty - ?2 WHERE sku = ?1 AND qty >= ?2 RETURNING qty",
            t.deduct_sql(idem::SqlDialect::kSqlite));
  EXPECT_EQ("UPDATE stock SET qty = qty - $2 WHERE sku = $1 AND qty >= $2 RETURNING qty",
            t.deduct_sql(idem::SqlDialect::kPostgres));
}

// Many threads, more buyers than stock: exactly N deductions, never below zero.
TEST_F(StockTest, RaceOfMoreBuyersThanStockDeductsExactlyTheStock) {
  constexpr int kThreads = 16;
  constexpr int kBuyersPerThread = 40;  // 640 buyers
  constexpr std::int64_t kStock = 100;
  set_stock("HOT", kStock);
  std::atomic<int> deducted{0}, refused{0}, errors{0};
  std::atomic<std::int64_t> lowest{kStock};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kBuyersPerThread; ++i) {
        try {
          db_->write([&](Transaction& tx) {
            auto d = stock_.deduct(tx, "HOT", 1);
            if (d.ok()) {
              tx.exec("INSERT INTO orders (buyer, sku) VALUES (?, 'HOT')",
                      std::to_string(t) + "-" + std::to_string(i));
              deducted.fetch_add(1);
            } else {
              refused.fetch_add(1);
            }
            std::int64_t seen = lowest.load();
            while (d.remaining < seen && !lowest.compare_exchange_weak(seen, d.remaining)) {
            }
          });
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
  EXPECT_EQ(0, qty("HOT"));
  EXPECT_EQ(0, lowest.load());
  EXPECT_EQ(kStock, orders());
}

// Buyers of several units at once: only whole requests are served; the rest is left.
TEST_F(StockTest, RaceOfMultiUnitBuyersNeverOversells) {
  constexpr int kThreads = 12;
  set_stock("BUNDLE", 10);  // three buyers of 3 succeed, 1 unit is left
  std::atomic<int> deducted{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      while (!go.load()) std::this_thread::yield();
      auto d = db_->write([&](Transaction& tx) { return stock_.deduct(tx, "BUNDLE", 3); });
      if (d.ok()) deducted.fetch_add(1);
    });
  }
  go.store(true);
  for (auto& th : threads) th.join();
  EXPECT_EQ(3, deducted.load());
  EXPECT_EQ(1, qty("BUNDLE"));
}

// The order handler of the docs: deduct, record the order, or answer "sold_out".
struct Shop {
  StockTable& stock;
  std::string place(Transaction& tx, const std::string& buyer, const std::string& sku) {
    auto d = stock.deduct(tx, sku, 1);
    if (!d.ok()) return "sold_out";
    auto id = tx.query_int64("INSERT INTO orders (buyer, sku) VALUES (?, ?) RETURNING id",
                             buyer, sku);
    return "order:" + std::to_string(id.value_or(-1));
  }
};

// A double click: the same key from many threads at once deducts once; all answers agree.
TEST_F(StockTest, DoubleClickedOrderDeductsOnce) {
  set_stock("SKU-2", 10);
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable{db_};
  idem::IdempotencyGuard guard{fast, durable};
  Shop shop{stock_};
  auto key = idem::Key::make("order.create", "user-1-checkout-1");
  constexpr int kThreads = 16;
  std::mutex mu;
  std::set<std::string> answers;
  std::atomic<int> executed{0}, in_progress{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      while (!go.load()) std::this_thread::yield();
      // A client retries "in progress" until it gets the answer.
      for (;;) {
        auto r = guard.run(key, "", [&](Transaction& tx) { return shop.place(tx, "u1", "SKU-2"); });
        if (r.outcome == idem::Outcome::kInProgress) {
          in_progress.fetch_add(1);
          std::this_thread::yield();
          continue;
        }
        ASSERT_TRUE(r.ok());
        if (r.outcome == idem::Outcome::kExecuted) executed.fetch_add(1);
        std::lock_guard<std::mutex> lock(mu);
        answers.insert(*r.value);
        break;
      }
    });
  }
  go.store(true);
  for (auto& th : threads) th.join();
  EXPECT_EQ(1, executed.load());
  ASSERT_EQ(1u, answers.size());
  EXPECT_EQ(0u, answers.begin()->rfind("order:", 0));
  EXPECT_EQ(9, qty("SKU-2"));
  EXPECT_EQ(1, orders());
}

// A retry after a lost response (the client timed out; the first attempt committed): replayed,
// not deducted again, even with the fast store gone (a fresh MemoryStore forgets everything).
TEST_F(StockTest, RetryAfterLostResponseReplaysFromTheDurableRecord) {
  set_stock("SKU-3", 4);
  idem::sqlite::SqliteStore durable{db_};
  Shop shop{stock_};
  auto key = idem::Key::make("order.create", "user-2-checkout-1");
  auto handler = [&](Transaction& tx) { return shop.place(tx, "u2", "SKU-3"); };
  std::string first;
  {
    idem::MemoryStore fast;
    idem::IdempotencyGuard guard{fast, durable};
    auto r = guard.run(key, "", handler);
    ASSERT_EQ(idem::Outcome::kExecuted, r.outcome);
    first = *r.value;
  }
  idem::MemoryStore restarted;
  idem::IdempotencyGuard guard{restarted, durable};
  auto again = guard.run(key, "", handler);
  EXPECT_EQ(idem::Outcome::kReplayed, again.outcome);
  EXPECT_EQ(idem::Source::kDurableStore, again.source);
  EXPECT_EQ(first, *again.value);
  EXPECT_EQ(3, qty("SKU-3"));
  EXPECT_EQ(1, orders());
}

// Sold out is a response: stored, replayed to the same key even after a restock; a new key
// buys the restocked unit.
TEST_F(StockTest, SoldOutIsAStoredReplayedResponse) {
  set_stock("SKU-4", 0);
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable{db_};
  idem::IdempotencyGuard guard{fast, durable};
  Shop shop{stock_};
  auto handler = [&](Transaction& tx) { return shop.place(tx, "u3", "SKU-4"); };
  auto key = idem::Key::make("order.create", "user-3-checkout-1");

  auto first = guard.run(key, "", handler);
  EXPECT_EQ(idem::Outcome::kExecuted, first.outcome);
  EXPECT_EQ("sold_out", *first.value);
  auto record = durable.lookup(key);
  ASSERT_TRUE(record.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, record->status);
  EXPECT_EQ("sold_out", record->response);

  set_stock("SKU-4", 5);
  auto retry = guard.run(key, "", handler);
  EXPECT_EQ(idem::Outcome::kReplayed, retry.outcome);
  EXPECT_EQ("sold_out", *retry.value);
  EXPECT_EQ(5, qty("SKU-4"));
  EXPECT_EQ(0, orders());

  auto fresh = guard.run(idem::Key::make("order.create", "user-3-checkout-2"), "", handler);
  EXPECT_EQ(idem::Outcome::kExecuted, fresh.outcome);
  EXPECT_EQ(0u, fresh.value->rfind("order:", 0));
  EXPECT_EQ(4, qty("SKU-4"));
}

}  // namespace
