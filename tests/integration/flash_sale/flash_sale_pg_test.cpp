// SPDX-License-Identifier: MIT
// The flash sale on PostgreSQL at a small size (IDEM_TEST_POSTGRES_DSN), with Redis in front
// (IDEM_TEST_REDIS_URL) losing this run's keys mid-sale, and with the in-process fast store:
// every invariant checked from the database. Each run uses a private schema and key prefix.
#include <gtest/gtest.h>

#include <pqxx/pqxx>

#include <sstream>
#include <string>

#include "postgres_backend.hpp"  // examples/flash_sale
#include "support/test_env.hpp"

namespace {

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
  cfg.db = "postgres";
  return cfg;
}

void drop_schema(const std::string& dsn, const std::string& schema) {
  pqxx::connection c{dsn};
  pqxx::work tx{c};
  tx.exec("DROP SCHEMA IF EXISTS " + schema + " CASCADE");
  tx.commit();
}

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

TEST(FlashSalePostgres, SmallSaleWithRedisKeepsEveryInvariant) {
  std::string dsn, redis;
  IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
  IDEM_REQUIRE_ENV(redis, "IDEM_TEST_REDIS_URL");
  flash_sale::PostgresSaleOptions o;
  o.dsn = dsn;
  o.schema = idem::test::unique_name("flash");
  o.redis_url = redis;
  o.redis_prefix = idem::test::unique_name("flash") + ":";
  o.flushall = false;  // a shared server: lose only this run's keys
  auto r = flash_sale::run_postgres_sale(small_sale(), o);
  EXPECT_EQ("postgres + redis", r.backend);
  expect_small_sale_invariants(r);
  drop_schema(dsn, o.schema);
  flash_sale::clear_redis(redis, o.redis_prefix, false);
}

TEST(FlashSalePostgres, SmallSaleWithTheInProcessFastStoreKeepsEveryInvariant) {
  std::string dsn;
  IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
  flash_sale::PostgresSaleOptions o;
  o.dsn = dsn;
  o.schema = idem::test::unique_name("flash");
  auto r = flash_sale::run_postgres_sale(small_sale(), o);
  EXPECT_EQ("postgres + memory", r.backend);
  expect_small_sale_invariants(r);
  drop_schema(dsn, o.schema);
}

}  // namespace
