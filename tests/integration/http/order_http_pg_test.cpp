// SPDX-License-Identifier: MIT
// examples/order_http on PostgreSQL (IDEM_TEST_POSTGRES_DSN), with the in-process fast store and
// with Redis in front (IDEM_TEST_REDIS_URL): the same duplicate storm as the SQLite test (20
// concurrent + 20 sequential, 409s, 422, 400s, /metrics), counted in the database too, and the
// binary's quick start on PostgreSQL + Redis.
#include <gtest/gtest.h>

#include "idem/memory_store.hpp"
#include "idem/prometheus/prometheus_observer.hpp"
#include "idem/redis/redis_store.hpp"
#include "order_http_support.hpp"
#include "postgres_orders.hpp"
#include "support/test_env.hpp"

namespace {

using namespace order_http_test;

// The storm on PostgreSQL: the guard's record table and the orders table are private to this
// run (so an earlier run's records never answer), dropped at the end.
void postgres_storm(idem::FastStore& fast) {
  std::string dsn;
  IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
  prometheus::Registry registry;
  idem::GuardOptions guard_options;
  guard_options.observer = std::make_shared<idem::PrometheusObserver>(registry);
  idem::postgres::PostgresStoreOptions store_options;
  store_options.conninfo = dsn;
  store_options.table = idem::test::unique_name("http_idem");
  idem::postgres::PostgresStore durable{store_options};
  order_http::PostgresOrders orders{durable, idem::test::unique_name("http_orders")};
  idem::IdempotencyGuard guard{fast, durable, guard_options};
  duplicate_storm(guard, orders, registry);
  // Checked in the database too: one row for alice's key, one for bob's.
  EXPECT_EQ(2, durable.with_transaction([&](pqxx::work& tx) {
    return tx.exec1("SELECT count(*) FROM " + durable.qualified_table())[0].as<long long>();
  }));
  orders.drop();
  durable.with_transaction(
      [&](pqxx::work& tx) { tx.exec("DROP TABLE " + durable.qualified_table()); });
}

TEST(OrderHttpPostgres, DuplicateStormCreatesOneOrderAndMetricsMatch) {
  idem::MemoryStore fast;
  postgres_storm(fast);
}

TEST(OrderHttpPostgres, DuplicateStormWithRedisInFront) {
  std::string redis;
  IDEM_REQUIRE_ENV(redis, "IDEM_TEST_REDIS_URL");
  idem::redis::RedisStoreOptions redis_options{redis};
  redis_options.key_prefix = idem::test::unique_name("order_http") + ":";
  idem::redis::RedisStore fast{redis_options};
  postgres_storm(fast);
}

// The binary on PostgreSQL + Redis: the quick start's request twice (201, then the replay
// from the Redis record) under a principal unique to this run.
TEST(OrderHttpBinary, QuickStartOnPostgresAndRedis) {
  std::string dsn, redis;
  IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
  IDEM_REQUIRE_ENV(redis, "IDEM_TEST_REDIS_URL");
  Child server({"--port", "0", "--postgres", dsn, "--redis", redis});
  std::string first = server.line();  // "... (postgres, fast store redis)"
  auto at = first.find("http://127.0.0.1:");
  ASSERT_NE(std::string::npos, at) << first;
  EXPECT_NE(std::string::npos, first.find("postgres")) << first;
  EXPECT_NE(std::string::npos, first.find("redis")) << first;
  int port = std::atoi(first.c_str() + at + std::string("http://127.0.0.1:").size());
  ASSERT_GT(port, 0);
  const std::string principal = idem::test::unique_name("quick");
  auto a = post(port, kBody, {"\"abc\""}, principal);
  EXPECT_EQ(201, a.status) << a.body;
  auto b = post(port, kBody, {"\"abc\""}, principal);
  EXPECT_EQ(201, b.status);
  EXPECT_EQ("true", b.replayed);
  EXPECT_EQ(a.body, b.body);
  httplib::Client client("127.0.0.1", port);
  auto got = client.Get(("/orders/" + order_no_of(a.body)).c_str(),
                        {{"Authorization", "Bearer " + principal}});
  ASSERT_TRUE(got);
  EXPECT_EQ(200, got->status);
  EXPECT_EQ(order_no_of(a.body), order_no_of(got->body));
  kill(server.pid, SIGTERM);
  EXPECT_EQ(0, server.wait());
}

}  // namespace
