// SPDX-License-Identifier: MIT
// Server-issued form tokens end to end (examples/order_http's GET/POST /checkout) through the
// real cpp-httplib server on loopback and a real httplib::Client: the first submit of an issued
// token creates the order, resubmits replay it (concurrent ones get 409, then the replay), a
// made-up key, another user's token and an expired token get 403 unknown_token, and the
// order_http binary serves the same flow.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "idem/memory_store.hpp"
#include "order_http_support.hpp"
#include "support/test_env.hpp"

namespace {

using order_http_test::Answer;
using order_http_test::Child;
using order_http_test::kBody;
using order_http_test::order_no_of;

struct Form {
  int status = 0;
  std::string token, key, cache_control;
};

Form get_form(int port, const std::string& principal = "alice") {
  httplib::Client client("127.0.0.1", port);
  auto res = client.Get("/checkout", {{"Authorization", "Bearer " + principal}});
  Form f;
  if (!res) return f;
  f.status = res->status;
  f.cache_control = res->get_header_value("Cache-Control");
  auto j = nlohmann::json::parse(res->body, nullptr, false);
  if (!j.is_discarded() && j.contains("form_token")) {
    f.token = j["form_token"].get<std::string>();
    f.key = j["idempotency_key"].get<std::string>();
  }
  return f;
}

Answer submit(int port, const std::string& key_field, const std::string& principal = "alice",
              const std::string& body = kBody) {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(30, 0);
  httplib::Headers headers{{"Authorization", "Bearer " + principal}};
  if (!key_field.empty()) headers.emplace("Idempotency-Key", key_field);
  auto res = client.Post("/checkout", headers, body, "application/json");
  Answer a;
  if (!res) {
    a.body = "client error: " + httplib::to_string(res.error());
    return a;
  }
  a.status = res->status;
  a.body = res->body;
  a.replayed = res->get_header_value("Idempotent-Replayed");
  a.retry_after = res->get_header_value("Retry-After");
  a.content_type = res->get_header_value("Content-Type");
  return a;
}

bool has_code(const Answer& a, const std::string& code) {
  return a.body.find("\"code\":\"" + code + "\"") != std::string::npos;
}

// The order server on SQLite with a manual clock for the tokens.
struct Service {
  idem::test::TempDir dir;
  idem::ManualClock clock;
  prometheus::Registry registry;
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable{dir.file("checkout.sqlite")};
  order_http::SqliteOrders orders{durable.database()};
  idem::IdempotencyGuard<idem::sqlite::SqliteStore> guard{fast, durable};
  std::unique_ptr<order_http::OrderServer<idem::sqlite::SqliteStore, order_http::SqliteOrders>>
      server;

  explicit Service(order_http::ServerOptions options = {}) {
    options.clock = clock.as_clock();
    options.form_token_ttl = std::chrono::seconds(600);
    server = std::make_unique<
        order_http::OrderServer<idem::sqlite::SqliteStore, order_http::SqliteOrders>>(
        guard, orders, registry, options);
    server->start();
  }
  int port() const { return server->port(); }
};

TEST(FormTokenHttp, IssuedTokenCreatesOnceAndResubmitsReplay) {
  Service svc;
  Form form = get_form(svc.port());
  ASSERT_EQ(200, form.status);
  EXPECT_EQ("no-store", form.cache_control);
  ASSERT_EQ(0u, form.token.rfind("ft1.", 0)) << form.token;
  EXPECT_EQ("\"" + form.token + "\"", form.key);

  auto first = submit(svc.port(), form.key);
  ASSERT_EQ(201, first.status) << first.body;
  EXPECT_EQ("", first.replayed);
  const std::string order_no = order_no_of(first.body);
  ASSERT_FALSE(order_no.empty());
  for (int i = 0; i < 5; ++i) {
    auto again = submit(svc.port(), form.key);
    EXPECT_EQ(201, again.status);
    EXPECT_EQ("true", again.replayed);
    EXPECT_EQ(first.body, again.body);
  }
  EXPECT_EQ(1, svc.orders.count());
  // The same token with another body is still a 422, never a second order.
  auto changed = submit(svc.port(), form.key, "alice", R"({"sku":"A1","qty":9})");
  EXPECT_EQ(422, changed.status);
  EXPECT_TRUE(has_code(changed, "fingerprint_mismatch"));
  // A second form gets a second token and a second order.
  auto second = submit(svc.port(), get_form(svc.port()).key);
  EXPECT_EQ(201, second.status);
  EXPECT_NE(order_no, order_no_of(second.body));
  EXPECT_EQ(2, svc.orders.count());
}

TEST(FormTokenHttp, MadeUpForeignAndMissingKeysAreRefusedAndCreateNothing) {
  Service svc;
  Form alice = get_form(svc.port(), "alice");
  auto made_up = submit(svc.port(), "\"my-own-key-123\"");
  EXPECT_EQ(403, made_up.status) << made_up.body;
  EXPECT_EQ("application/problem+json", made_up.content_type);
  EXPECT_TRUE(has_code(made_up, "unknown_token"));
  EXPECT_EQ("", made_up.retry_after);
  auto forged = submit(svc.port(), "\"ft1.99999999999.00000000000000000000000000000000\"");
  EXPECT_EQ(403, forged.status);
  auto foreign = submit(svc.port(), alice.key, "mallory");  // alice's token, another session
  EXPECT_EQ(403, foreign.status);
  EXPECT_TRUE(has_code(foreign, "unknown_token"));
  auto missing = submit(svc.port(), "");
  EXPECT_EQ(400, missing.status);
  EXPECT_TRUE(has_code(missing, "missing_key"));
  auto bare = submit(svc.port(), alice.token);  // not an sf-string
  EXPECT_EQ(400, bare.status);
  EXPECT_TRUE(has_code(bare, "invalid_key"));
  EXPECT_EQ(0, svc.orders.count());
  // Nothing was stored for the refusals: alice's token still creates her order.
  EXPECT_EQ(201, submit(svc.port(), alice.key).status);
  EXPECT_EQ(1, svc.orders.count());
  // /orders keeps accepting client keys: the option is per endpoint.
  EXPECT_EQ(201, order_http_test::post(svc.port(), kBody, {"\"my-own-key-123\""}).status);
}

TEST(FormTokenHttp, ExpiredTokenIs403ButAUsedOneStillReplaysAfterItsExpiry) {
  Service svc;
  Form used = get_form(svc.port());
  Form unused = get_form(svc.port());
  auto first = submit(svc.port(), used.key);
  ASSERT_EQ(201, first.status);
  svc.clock.advance(std::chrono::seconds(601));
  auto expired = submit(svc.port(), unused.key);
  EXPECT_EQ(403, expired.status);
  EXPECT_TRUE(has_code(expired, "unknown_token"));
  EXPECT_NE(std::string::npos, expired.body.find("expired")) << expired.body;
  auto replay = submit(svc.port(), used.key);
  EXPECT_EQ(201, replay.status);
  EXPECT_EQ("true", replay.replayed);
  EXPECT_EQ(first.body, replay.body);
  EXPECT_EQ(1, svc.orders.count());
}

TEST(FormTokenHttp, TwentyConcurrentSubmitsOfOneTokenCreateOneOrder) {
  std::mutex mu;
  std::condition_variable cv;
  int answered = 0;
  std::atomic<int> hook_runs{0};
  order_http::ServerOptions options;
  options.before_commit = [&] {  // hold the first submit until the 19 others were answered
    if (hook_runs++ != 0) return;
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(20), [&] { return answered == 19; });
  };
  Service svc{options};
  Form form = get_form(svc.port());
  std::vector<Answer> answers(20);
  std::vector<std::thread> threads;
  for (int i = 0; i < 20; ++i) {
    threads.emplace_back([&, i] {
      answers[static_cast<std::size_t>(i)] = submit(svc.port(), form.key);
      std::lock_guard<std::mutex> lock(mu);
      ++answered;
      cv.notify_all();
    });
  }
  for (auto& t : threads) t.join();
  int created = 0, conflicts = 0;
  for (const auto& a : answers) {
    if (a.status == 201) {
      ++created;
    } else {
      EXPECT_EQ(409, a.status) << a.body;
      EXPECT_TRUE(has_code(a, "in_progress"));
      EXPECT_EQ("1", a.retry_after);
      ++conflicts;
    }
  }
  EXPECT_EQ(1, created);
  EXPECT_EQ(19, conflicts);
  EXPECT_EQ(1, hook_runs.load());
  auto replay = submit(svc.port(), form.key);
  EXPECT_EQ(201, replay.status);
  EXPECT_EQ("true", replay.replayed);
  EXPECT_EQ(1, svc.orders.count());
}

TEST(FormTokenHttpBinary, TheBinaryServesTheCheckoutForm) {
  idem::test::TempDir dir;
  Child server({"--port", "0", "--db", dir.file("form.sqlite")});
  std::string first = server.line();
  auto at = first.find("http://127.0.0.1:");
  ASSERT_NE(std::string::npos, at) << first;
  int port = std::atoi(first.c_str() + at + std::string("http://127.0.0.1:").size());
  ASSERT_GT(port, 0);
  Form form = get_form(port, "quick");
  ASSERT_EQ(200, form.status);
  auto a = submit(port, form.key, "quick");
  EXPECT_EQ(201, a.status) << a.body;
  auto b = submit(port, form.key, "quick");
  EXPECT_EQ(a.body, b.body);
  EXPECT_EQ("true", b.replayed);
  EXPECT_EQ(403, submit(port, "\"abc\"", "quick").status);
  kill(server.pid, SIGTERM);
  EXPECT_EQ(0, server.wait());
}

}  // namespace
