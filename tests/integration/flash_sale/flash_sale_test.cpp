// SPDX-License-Identifier: MIT
// The flash-sale example's core at small sizes: every invariant checked from the database.
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "sqlite_backend.hpp"  // examples/flash_sale
#include "support/test_env.hpp"

namespace {

flash_sale::Config small_sale(const idem::test::TempDir& dir) {
  flash_sale::Config cfg;
  cfg.users = 300;
  cfg.stock = 30;
  cfg.threads = 8;
  cfg.db = dir.file("flash.sqlite");
  cfg.seed = 42;
  return cfg;
}

std::string describe(const flash_sale::Report& r) {
  std::ostringstream out;
  flash_sale::print_report(r, out);
  return out.str();
}

TEST(FlashSale, SmallSaleKeepsEveryInvariant) {
  idem::test::TempDir dir;
  auto cfg = small_sale(dir);
  auto r = flash_sale::run_sqlite_sale(cfg);
  ASSERT_TRUE(r.ok()) << describe(r);
  EXPECT_EQ(30, r.db.order_rows);
  EXPECT_EQ(0, r.db.stock_left.value_or(-1));
  EXPECT_EQ(30u, r.db.orders.size());
  EXPECT_EQ(30, r.users_ordered);
  EXPECT_EQ(270, r.users_sold_out);
  EXPECT_EQ(0, r.db.records_in_progress);
  // The scenario did happen: repeated clicks, and client timeouts (a slow attempt sleeps
  // longer than the client waits) retried while the first attempt was still running.
  EXPECT_GT(r.clicks, 300u);
  EXPECT_GT(r.timeouts, 0u);
  EXPECT_GT(r.guard.fast_hits, 0u);
  // Mid-sale, with half the units sold, the fast store lost every record (failover).
  EXPECT_EQ(15, r.fast_lost_at_user);
  // Exactly one handler run per key that executed: executed records == completed records.
  EXPECT_EQ(static_cast<std::int64_t>(r.guard.executed), r.db.records_completed);
}

TEST(FlashSale, MoreStockThanUsersSellsOnePerUser) {
  idem::test::TempDir dir;
  auto cfg = small_sale(dir);
  cfg.users = 60;
  cfg.stock = 100;
  cfg.reload_percent = 50;  // many second keys for one user: the unique key answers them
  cfg.fast_loss_at_user = -1;
  auto r = flash_sale::run_sqlite_sale(cfg);
  ASSERT_TRUE(r.ok()) << describe(r);
  EXPECT_EQ(60, r.db.order_rows);
  EXPECT_EQ(40, r.db.stock_left.value_or(-1));
  EXPECT_EQ(0, r.users_sold_out);
  EXPECT_EQ(-1, r.fast_lost_at_user);
}

TEST(FlashSale, NoStockSellsNothingAndSaysSoldOutToEveryone) {
  idem::test::TempDir dir;
  auto cfg = small_sale(dir);
  cfg.users = 80;
  cfg.stock = 0;
  auto r = flash_sale::run_sqlite_sale(cfg);
  ASSERT_TRUE(r.ok()) << describe(r);
  EXPECT_EQ(0, r.db.order_rows);
  EXPECT_EQ(0, r.db.stock_left.value_or(-1));
  EXPECT_EQ(80, r.users_sold_out);
}

TEST(FlashSale, ASecondSaleOnTheSameDatabaseStartsClean) {
  idem::test::TempDir dir;
  auto cfg = small_sale(dir);
  cfg.users = 100;
  cfg.stock = 10;
  auto first = flash_sale::run_sqlite_sale(cfg);
  ASSERT_TRUE(first.ok()) << describe(first);
  cfg.seed = 43;
  auto second = flash_sale::run_sqlite_sale(cfg);
  ASSERT_TRUE(second.ok()) << describe(second);
  EXPECT_EQ(10, second.db.order_rows);
}

// The checks can fail: each violated invariant turns its check red.
flash_sale::Report healthy_report() {
  flash_sale::Report r;
  r.config.users = 3;
  r.config.stock = 2;
  r.db.orders = {{0, {11}}, {1, {12}}};
  r.db.order_rows = 2;
  r.db.stock_left = 0;
  r.users.resize(3);
  r.users[0].finals = {"order:11", "order:11"};
  r.users[1].finals = {"order:12"};
  r.users[2].finals = {"sold_out", "sold_out", "sold_out"};
  return r;
}

bool check_failed(const flash_sale::Report& r, const std::string& name_part) {
  for (const auto& c : r.checks) {
    if (c.name.find(name_part) != std::string::npos) return !c.ok;
  }
  ADD_FAILURE() << "no check named like '" << name_part << "'";
  return false;
}

TEST(FlashSaleChecks, HealthyStatePasses) {
  auto r = healthy_report();
  flash_sale::evaluate(r);
  EXPECT_TRUE(r.ok()) << describe(r);
  EXPECT_EQ(2, r.users_ordered);
  EXPECT_EQ(1, r.users_sold_out);
}

TEST(FlashSaleChecks, EachViolationFailsItsCheck) {
  {
    auto r = healthy_report();
    r.db.orders[2] = {13};  // oversold: a third order
    r.db.order_rows = 3;
    flash_sale::evaluate(r);
    EXPECT_TRUE(check_failed(r, "orders"));
    EXPECT_FALSE(r.ok());
  }
  {
    auto r = healthy_report();
    r.db.stock_left = -1;  // stock went negative
    flash_sale::evaluate(r);
    EXPECT_TRUE(check_failed(r, "stock exactly 0"));
  }
  {
    auto r = healthy_report();
    r.db.orders[0] = {11, 14};  // one user, two orders
    r.db.order_rows = 3;
    flash_sale::evaluate(r);
    EXPECT_TRUE(check_failed(r, "two orders"));
  }
  {
    auto r = healthy_report();
    r.users[0].finals = {"order:11", "sold_out"};  // two answers to one user
    flash_sale::evaluate(r);
    EXPECT_TRUE(check_failed(r, "same answer"));
  }
  {
    auto r = healthy_report();
    r.users[2].finals = {"order:99"};  // told of an order the database does not have
    flash_sale::evaluate(r);
    EXPECT_TRUE(check_failed(r, "same answer"));
  }
  {
    auto r = healthy_report();
    r.users[1].errors = {"storage_error: UNIQUE constraint failed: order already exists"};
    flash_sale::evaluate(r);
    EXPECT_TRUE(check_failed(r, "no user saw an error"));
  }
  {
    auto r = healthy_report();
    r.users[2].gave_up = true;
    flash_sale::evaluate(r);
    EXPECT_TRUE(check_failed(r, "final answer"));
  }
  {
    auto r = healthy_report();
    r.db.records_in_progress = 1;
    flash_sale::evaluate(r);
    EXPECT_TRUE(check_failed(r, "in progress"));
  }
}

}  // namespace
