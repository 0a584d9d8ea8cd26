// SPDX-License-Identifier: MIT
// The flash sale on MariaDB at a small size, with Redis in front losing this run's keys
// mid-sale, and with the in-process fast store: every invariant checked from the database.
// Each run uses a private database and key prefix.
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "mysql_backend.hpp"  // examples/flash_sale
#include "mysql_test_support.hpp"

namespace {

namespace my = idem::test::my;

std::string describe(const flash_sale::Report& r) {
  std::ostringstream out;
  flash_sale::print_report(r, out);
  return out.str();
}

flash_sale::Config small_sale() {
  flash_sale::Config cfg;
  cfg.users = 300;
  cfg.stock = 30;
  cfg.threads = 8;
  cfg.seed = 42;
  cfg.db = "mysql";
  return cfg;
}

// A private database in the server of IDEM_TEST_MYSQL_URI, dropped at the end.
struct SaleDatabase {
  std::string name = idem::test::unique_name("flash");
  std::string uri() const {
    auto o = my::connection(name);
    return "mysql://" + o.user + ":" + o.password + "@" + o.host + ":" + std::to_string(o.port) +
           "/" + name;
  }
  ~SaleDatabase() {
    try {
      my::RawConnection(my::connection(), false).query("DROP DATABASE IF EXISTS " + name);
    } catch (...) {
    }
  }
};

void expect_small_sale_invariants(const flash_sale::Report& r) {
  ASSERT_TRUE(r.ok()) << describe(r);
  EXPECT_EQ(30, r.db.order_rows);
  EXPECT_EQ(0, r.db.stock_left.value_or(-1));
  EXPECT_EQ(30u, r.db.orders.size());
  EXPECT_EQ(30, r.users_ordered);
  EXPECT_EQ(270, r.users_sold_out);
  EXPECT_EQ(0, r.db.records_in_progress);
  EXPECT_GT(r.clicks, 300u);
  EXPECT_GT(r.guard.fast_hits, 0u);
  EXPECT_EQ(15, r.fast_lost_at_user);  // the fast store lost its records mid-sale
  EXPECT_EQ(static_cast<std::int64_t>(r.guard.executed), r.db.records_completed);
}

TEST(FlashSaleMysql, SmallSaleWithRedisKeepsEveryInvariant) {
  IDEM_REQUIRE_MYSQL();
  std::string redis;
  IDEM_REQUIRE_ENV(redis, "IDEM_TEST_REDIS_URL");
  SaleDatabase db;
  flash_sale::MysqlSaleOptions o;
  o.uri = db.uri();
  o.redis_url = redis;
  o.redis_prefix = idem::test::unique_name("flash") + ":";
  o.flushall = false;  // a shared server: lose only this run's keys
  auto r = flash_sale::run_mysql_sale(small_sale(), o);
  EXPECT_EQ("mysql + redis", r.backend);
  expect_small_sale_invariants(r);
  flash_sale::clear_redis(redis, o.redis_prefix, false);
}

TEST(FlashSaleMysql, SmallSaleWithTheInProcessFastStoreKeepsEveryInvariant) {
  IDEM_REQUIRE_MYSQL();
  SaleDatabase db;
  flash_sale::MysqlSaleOptions o;
  o.uri = db.uri();
  auto r = flash_sale::run_mysql_sale(small_sale(), o);
  EXPECT_EQ("mysql + memory", r.backend);
  expect_small_sale_invariants(r);
}

}  // namespace
