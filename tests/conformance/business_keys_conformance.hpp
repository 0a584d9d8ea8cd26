// SPDX-License-Identifier: MIT
// One typed suite for the business-key helpers (UniqueInsert, StockTable) on every database
// with a SqlDriver: duplicates are values that leave the transaction usable, concurrent claims
// of one key make one row and answer one id, concurrent buyers never take stock below zero.
//
// A Traits type provides:
//   using Tx = ...;                                        // a transaction type with a SqlDriver
//   static const char* env_var();                          // null: no server needed
//   static void exec(const std::string& sql);              // setup outside the helpers
//   static long long scalar(const std::string& sql);       // first column of the first row
//   template <class Fn> static void in_tx(Fn&& fn);        // fn(Tx&) in a new transaction,
//                                                          // committed; callable from many
//                                                          // threads at once
//   static std::string coupon_ddl(const std::string& t);   // CREATE TABLE t (id <auto id>,
//                                                          //   user_id, coupon_id, channel,
//                                                          //   unique (user_id, coupon_id))
//   static std::string stock_ddl(const std::string& t);    // CREATE TABLE t (sku key, qty int)
// and the adapter's test file does:
//   using Types = ::testing::Types<MyTraits>;
//   namespace idem::test { INSTANTIATE_TYPED_TEST_SUITE_P(Name, BusinessKeysConformance, Types); }
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "idem/stock.hpp"
#include "idem/unique_insert.hpp"
#include "support/test_env.hpp"

namespace idem::test {

template <class Traits>
class BusinessKeysConformance : public ::testing::Test {
 protected:
  using TxType = typename Traits::Tx;

  void SetUp() override {
    std::string value;
    if (Traits::env_var() != nullptr) IDEM_REQUIRE_ENV(value, Traits::env_var());
    coupons_ = unique_name("idem_test_uc");
    stock_ = unique_name("idem_test_stock");
    Traits::exec(Traits::coupon_ddl(coupons_));
    // No CHECK (qty >= 0) on purpose: a wrong deduction would show as a negative quantity.
    Traits::exec(Traits::stock_ddl(stock_));
    created_ = true;
  }
  void TearDown() override {
    if (!created_) return;
    Traits::exec("DROP TABLE IF EXISTS " + coupons_);
    Traits::exec("DROP TABLE IF EXISTS " + stock_);
  }

  std::string coupons_, stock_;
  bool created_ = false;
};

TYPED_TEST_SUITE_P(BusinessKeysConformance);

TYPED_TEST_P(BusinessKeysConformance, DuplicateIsAValueAndKeepsTheTransactionUsable) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  UniqueInsert claim{this->coupons_, {"user_id", "coupon_id"}, {"channel"}};
  InsertResult first, dup, other;
  TypeParam::in_tx([&](Tx& tx) {
    first = claim.insert(tx, 7, "C42", "app");
    dup = claim.insert(tx, 7, "C42", "web");
    other = claim.insert(tx, 8, "C42", "app");  // the transaction goes on after the duplicate
  });
  EXPECT_EQ(InsertStatus::kInserted, first.status);
  EXPECT_EQ(InsertStatus::kAlreadyExists, dup.status);
  EXPECT_EQ(first.id, dup.id);
  EXPECT_EQ(InsertStatus::kInserted, other.status);
  EXPECT_NE(first.id, other.id);
  EXPECT_EQ(2, TypeParam::scalar("SELECT count(*) FROM " + this->coupons_));
  EXPECT_EQ(first.id, TypeParam::scalar("SELECT id FROM " + this->coupons_ +
                                        " WHERE user_id = 7 AND channel = 'app'"));
  // A later transaction's duplicate names the committed row.
  InsertResult later;
  TypeParam::in_tx([&](Tx& tx) { later = claim.insert(tx, 7, "C42", "retry"); });
  EXPECT_EQ(InsertStatus::kAlreadyExists, later.status);
  EXPECT_EQ(first.id, later.id);
  EXPECT_EQ(2u, claim.stats().inserted);
  EXPECT_EQ(2u, claim.stats().already_exists);
}

TYPED_TEST_P(BusinessKeysConformance, CouponClaimFrom32ThreadsMakesOneRowAndOneId) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  UniqueInsert claim{this->coupons_, {"user_id", "coupon_id"}, {"channel"}};
  constexpr int kThreads = 32;
  std::atomic<bool> go{false};
  std::mutex mu;
  std::vector<InsertResult> results;
  std::vector<std::string> errors;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      while (!go.load()) std::this_thread::yield();
      try {
        InsertResult r;
        TypeParam::in_tx([&](Tx& tx) {
          r = claim.insert(tx, 1001, "SPRING", "conn-" + std::to_string(i));
          // Keep the transaction open a moment: concurrent claims queue behind the
          // uncommitted row and must answer its id once it commits.
          if (r.inserted()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        });
        std::lock_guard<std::mutex> lock(mu);
        results.push_back(r);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back(e.what());
      }
    });
  }
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
  EXPECT_EQ(1, TypeParam::scalar("SELECT count(*) FROM " + this->coupons_));
  EXPECT_EQ(*ids.begin(), TypeParam::scalar("SELECT id FROM " + this->coupons_));
}

TYPED_TEST_P(BusinessKeysConformance, HostileValuesAreBound) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  UniqueInsert claim{this->coupons_, {"user_id", "coupon_id"}, {"channel"}};
  const std::vector<std::string> hostile = {
      "'; DROP TABLE x; --", "o'brien", "back\\slash\\", "$1", "?", "?1", "\"q\""};
  TypeParam::in_tx([&](Tx& tx) {
    for (const auto& v : hostile) {
      EXPECT_TRUE(claim.insert(tx, 1, v, v).inserted()) << v;
      EXPECT_FALSE(claim.insert(tx, 1, v, "again").inserted()) << v;
    }
  });
  EXPECT_EQ(static_cast<long long>(hostile.size()),
            TypeParam::scalar("SELECT count(*) FROM " + this->coupons_));
  EXPECT_THROW(TypeParam::in_tx([&](Tx& tx) { (void)claim.insert(tx, 1, nullptr, "x"); }),
               UsageError);
}

TYPED_TEST_P(BusinessKeysConformance, StockDeductionAnswersEachCase) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  StockTable stock{this->stock_, "sku", "qty"};
  TypeParam::exec("INSERT INTO " + this->stock_ + " (sku, qty) VALUES ('A', 5), ('B', 1)");
  Deduction d1, d2, d3, d4;
  std::optional<std::int64_t> left;
  TypeParam::in_tx([&](Tx& tx) {
    d1 = stock.deduct(tx, "A", 3);
    d2 = stock.deduct(tx, "A", 3);
    d3 = stock.deduct(tx, "NONE", 1);
    d4 = stock.deduct(tx, "B", 1);  // down to exactly 0
    left = stock.quantity(tx, "A");
  });
  EXPECT_EQ(DeductStatus::kDeducted, d1.status);
  EXPECT_EQ(2, d1.remaining);
  EXPECT_EQ(DeductStatus::kInsufficient, d2.status);
  EXPECT_EQ(2, d2.remaining);
  EXPECT_EQ(DeductStatus::kUnknownItem, d3.status);
  EXPECT_EQ(DeductStatus::kDeducted, d4.status);
  EXPECT_EQ(0, d4.remaining);
  EXPECT_EQ(2, left.value_or(-1));
  EXPECT_EQ(0, TypeParam::scalar("SELECT qty FROM " + this->stock_ + " WHERE sku = 'B'"));
  EXPECT_THROW(TypeParam::in_tx([&](Tx& tx) { (void)stock.deduct(tx, "A", 0); }), UsageError);
}

// Concurrent transactions on one hot row: exactly the stock is deducted, never below zero.
TYPED_TEST_P(BusinessKeysConformance, StockRaceOfMoreBuyersThanStockDeductsExactlyTheStock) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  StockTable stock{this->stock_, "sku", "qty"};
  constexpr int kThreads = 16;
  constexpr int kBuyersPerThread = 25;  // 400 buyers
  constexpr std::int64_t kStock = 100;
  TypeParam::exec("INSERT INTO " + this->stock_ + " (sku, qty) VALUES ('HOT', " +
                  std::to_string(kStock) + ")");
  std::atomic<int> deducted{0}, refused{0}, errors{0};
  std::atomic<std::int64_t> lowest{kStock};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kBuyersPerThread; ++i) {
        try {
          Deduction d;
          TypeParam::in_tx([&](Tx& tx) { d = stock.deduct(tx, "HOT", 1); });
          (d.ok() ? deducted : refused).fetch_add(1);
          std::int64_t seen = lowest.load();
          while (d.remaining < seen && !lowest.compare_exchange_weak(seen, d.remaining)) {
          }
        } catch (const std::exception& e) {
          ADD_FAILURE() << e.what();
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
  EXPECT_EQ(0, TypeParam::scalar("SELECT qty FROM " + this->stock_ + " WHERE sku = 'HOT'"));
}

REGISTER_TYPED_TEST_SUITE_P(BusinessKeysConformance, DuplicateIsAValueAndKeepsTheTransactionUsable,
                            CouponClaimFrom32ThreadsMakesOneRowAndOneId, HostileValuesAreBound,
                            StockDeductionAnswersEachCase,
                            StockRaceOfMoreBuyersThanStockDeductsExactlyTheStock);

}  // namespace idem::test
