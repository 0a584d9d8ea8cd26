// SPDX-License-Identifier: MIT
// examples/order_http end to end with a real HTTP client (httplib::Client): a duplicate storm
// creates one order; in-flight duplicates get 409; replays carry the same order number; a
// changed body gets 422; no key gets 400; /metrics scraped during and after the storm matches
// what the test sent.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "idem/memory_store.hpp"
#include "idem/prometheus/prometheus_observer.hpp"
#include "order_http_support.hpp"
#include "support/prometheus_text.hpp"
#include "support/test_env.hpp"

namespace {

using namespace order_http_test;

TEST(OrderHttp, DuplicateStormCreatesOneOrderAndMetricsMatch) {
  idem::test::TempDir dir;
  prometheus::Registry registry;
  idem::GuardOptions guard_options;
  guard_options.observer = std::make_shared<idem::PrometheusObserver>(registry);
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable{dir.file("orders.sqlite")};
  order_http::SqliteOrders orders{durable.database()};
  idem::IdempotencyGuard guard{fast, durable, guard_options};
  duplicate_storm(guard, orders, registry);
}

TEST(OrderHttpBinary, QuickStartFlowAndArguments) {
  idem::test::TempDir dir;
  Child server({"--port", "0", "--db", dir.file("quick.sqlite")});
  std::string first = server.line();  // "order_http listening on http://127.0.0.1:<port> (db ...)"
  auto at = first.find("http://127.0.0.1:");
  ASSERT_NE(std::string::npos, at) << first;
  int port = std::atoi(first.c_str() + at + std::string("http://127.0.0.1:").size());
  ASSERT_GT(port, 0);

  auto a = post(port, kBody, {"\"abc\""}, "quickstart");
  EXPECT_EQ(201, a.status) << a.body;
  auto b = post(port, kBody, {"\"abc\""}, "quickstart");
  EXPECT_EQ(201, b.status);
  EXPECT_EQ("true", b.replayed);
  EXPECT_EQ(a.body, b.body);
  EXPECT_EQ(1, metric(scrape(port), "idem_calls_total", {{"outcome", "replayed"}}));
  // What cpp-httplib refuses before the endpoint sees the request (a header line over its
  // limit) is answered problem+json too (problem_error_handler), not a bare 400.
  httplib::Client client("127.0.0.1", port);
  auto long_key =
      client.Post("/orders", {{"Idempotency-Key", "\"" + std::string(9000, 'k') + "\""}}, kBody,
                  "application/json");
  ASSERT_TRUE(long_key);
  EXPECT_TRUE(long_key->status == 400 || long_key->status == 431) << long_key->status;
  EXPECT_EQ("application/problem+json", long_key->get_header_value("Content-Type"));
  EXPECT_NE(std::string::npos, long_key->body.find("\"status\"")) << long_key->body;

  kill(server.pid, SIGTERM);
  EXPECT_EQ(0, server.wait());  // stops cleanly on SIGTERM

#ifdef ORDER_HTTP_WITH_POSTGRES
  // Nothing listens on port 1: the store cannot connect and the binary says so, exit 1.
  Child postgres({"--postgres", "host=127.0.0.1 port=1 connect_timeout=2"});
  EXPECT_EQ(1, postgres.wait());
#else
  Child postgres({"--postgres", "host=127.0.0.1"});
  EXPECT_EQ(2, postgres.wait());  // no PostgreSQL backend in this build: a clear refusal
#endif
#ifndef ORDER_HTTP_WITH_REDIS
  Child redis({"--redis", "redis://127.0.0.1:1"});
  EXPECT_EQ(2, redis.wait());  // no Redis fast store in this build
#endif
  Child bad_port({"--port", "http"});
  EXPECT_EQ(2, bad_port.wait());
  Child unknown({"--frobnicate"});
  EXPECT_EQ(2, unknown.wait());
}

}  // namespace
