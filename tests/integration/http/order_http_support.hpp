// SPDX-License-Identifier: MIT
// Helpers of the order_http end-to-end tests: a real HTTP client (httplib::Client), the
// duplicate storm for any backend, and the binary as a child process.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "order_server.hpp"
#include "support/prometheus_text.hpp"

namespace order_http_test {

using idem::test::metric_value;

inline constexpr int kConcurrent = 20;
inline constexpr int kSequential = 20;
inline const char* const kBody = R"({"sku":"A1","qty":2})";

struct Answer {
  int status = 0;
  std::string body;
  std::string replayed;
  std::string retry_after;
  std::string content_type;
};

inline Answer post(int port, const std::string& body, const std::vector<std::string>& keys,
                   const std::string& token = "alice") {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(30, 0);
  httplib::Headers headers{{"Authorization", "Bearer " + token}};
  for (auto& k : keys) headers.emplace("Idempotency-Key", k);
  auto res = client.Post("/orders", headers, body, "application/json");
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

inline std::string order_no_of(const std::string& body) {
  auto j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.contains("order_no")) return "";
  return j["order_no"].get<std::string>();
}

inline double metric(const std::string& text, const std::string& name,
                     const std::map<std::string, std::string>& labels = {}) {
  return metric_value(text, name, labels).value_or(0.0);
}

inline std::string scrape(int port) {
  httplib::Client client("127.0.0.1", port);
  auto res = client.Get("/metrics");
  return res && res->status == 200 ? res->body : std::string();
}

// The storm, for any backend: `guard` reports to `registry`; `orders` starts empty.
template <class Durable, class Orders>
void duplicate_storm(idem::IdempotencyGuard<Durable>& guard, Orders& orders,
                     prometheus::Registry& registry) {
  // The hook holds the first request inside its transaction until every other concurrent
  // request has been answered, and scrapes /metrics meanwhile: the overlap is certain.
  std::mutex mutex;
  std::condition_variable cv;
  int answered = 0;
  std::atomic<int> hook_runs{0};
  std::string mid_storm_metrics;
  int port = 0;
  order_http::ServerOptions options;
  options.before_commit = [&] {
    if (hook_runs++ != 0) return;
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait_for(lock, std::chrono::seconds(20), [&] { return answered == kConcurrent - 1; });
    lock.unlock();
    mid_storm_metrics = scrape(port);
  };
  order_http::OrderServer server{guard, orders, registry, options};
  server.start();
  port = server.port();
  ASSERT_GT(port, 0);

  const std::string key = "\"order-7f3a\"";
  std::vector<Answer> answers(kConcurrent);
  std::vector<std::thread> threads;
  for (int i = 0; i < kConcurrent; ++i) {
    threads.emplace_back([&, i] {
      answers[static_cast<std::size_t>(i)] = post(port, kBody, {key});
      std::lock_guard<std::mutex> lock(mutex);
      ++answered;
      cv.notify_all();
    });
  }
  for (auto& t : threads) t.join();

  std::set<std::string> order_nos;
  int created = 0, conflicts = 0;
  for (auto& a : answers) {
    if (a.status == 201) {
      ++created;
      order_nos.insert(order_no_of(a.body));
    } else {
      EXPECT_EQ(409, a.status) << a.body;
      EXPECT_EQ("1", a.retry_after);
      EXPECT_EQ("application/problem+json", a.content_type);
      EXPECT_NE(std::string::npos, a.body.find("\"code\":\"in_progress\""));
      ++conflicts;
    }
  }
  ASSERT_EQ(1, created);
  EXPECT_EQ(kConcurrent - 1, conflicts);
  const std::string first_no = *order_nos.begin();
  ASSERT_FALSE(first_no.empty());
  EXPECT_EQ(1, hook_runs.load());

  // Mid-storm: the in-flight duplicates are counted, the first call has not finished yet.
  ASSERT_FALSE(mid_storm_metrics.empty());
  EXPECT_EQ(kConcurrent - 1,
            metric(mid_storm_metrics, "idem_calls_total", {{"outcome", "in_progress"}}));
  EXPECT_EQ(0, metric(mid_storm_metrics, "idem_calls_total", {{"outcome", "executed"}}));
  EXPECT_EQ(kConcurrent - 1, metric(mid_storm_metrics, "idem_fast_store_hits_total"));

  // Sequential duplicates: each replays the first response.
  for (int i = 0; i < kSequential; ++i) {
    auto a = post(port, kBody, {key});
    ASSERT_EQ(201, a.status) << a.body;
    EXPECT_EQ("true", a.replayed);
    order_nos.insert(order_no_of(a.body));
  }
  ASSERT_EQ(1u, order_nos.size());
  EXPECT_EQ(1, orders.count());

  // Changed body, same key: 422. No key: 400. Two keys: 400. None reaches the handler.
  auto changed = post(port, R"({"sku":"A1","qty":3})", {key});
  EXPECT_EQ(422, changed.status);
  EXPECT_NE(std::string::npos, changed.body.find("\"code\":\"fingerprint_mismatch\""));
  auto missing = post(port, kBody, {});
  EXPECT_EQ(400, missing.status);
  EXPECT_NE(std::string::npos, missing.body.find("\"code\":\"missing_key\""));
  auto twice = post(port, kBody, {key, key});
  EXPECT_EQ(400, twice.status);
  EXPECT_NE(std::string::npos, twice.body.find("\"code\":\"invalid_key\""));
  auto bare = post(port, kBody, {"order-7f3a"});
  EXPECT_EQ(400, bare.status);
  EXPECT_EQ(1, orders.count());

  // The order is readable by whoever placed it, and by no one else (404, as if unknown).
  httplib::Client client("127.0.0.1", port);
  auto got = client.Get(("/orders/" + first_no).c_str(), {{"Authorization", "Bearer alice"}});
  ASSERT_TRUE(got);
  EXPECT_EQ(200, got->status);
  EXPECT_EQ(first_no, order_no_of(got->body));
  auto foreign = client.Get(("/orders/" + first_no).c_str(), {{"Authorization", "Bearer bob"}});
  ASSERT_TRUE(foreign);
  EXPECT_EQ(404, foreign->status);
  EXPECT_EQ(std::string::npos, foreign->body.find(first_no));

  // Another principal with the same key string gets its own order, never alice's response.
  auto bob = post(port, kBody, {key}, "bob");
  EXPECT_EQ(201, bob.status);
  EXPECT_NE(first_no, order_no_of(bob.body));
  EXPECT_EQ("", bob.replayed);
  EXPECT_EQ(2, orders.count());

  // Final counters: exactly what was sent (400s never reach the guard).
  auto text = scrape(port);
  EXPECT_EQ(2, metric(text, "idem_calls_total", {{"outcome", "executed"}}));
  EXPECT_EQ(kConcurrent - 1, metric(text, "idem_calls_total", {{"outcome", "in_progress"}}));
  EXPECT_EQ(kSequential, metric(text, "idem_calls_total", {{"outcome", "replayed"}}));
  EXPECT_EQ(1, metric(text, "idem_calls_total", {{"outcome", "fingerprint_mismatch"}}));
  EXPECT_EQ(kConcurrent + kSequential + 2, metric(text, "idem_calls_total"));
  EXPECT_EQ(kConcurrent - 1 + kSequential + 1, metric(text, "idem_fast_store_hits_total") +
                                                   metric(text, "idem_unique_conflicts_total"));
  EXPECT_EQ(2, metric(text, "idem_fast_store_claims_total"));
  EXPECT_EQ(0, metric(text, "idem_degraded_calls_total"));
  EXPECT_EQ(kConcurrent + kSequential + 2,
            metric(text, "idem_phase_duration_seconds_count", {{"phase", "total"}}));
  server.stop();
}

// The order_http binary as a child process: its stdout, its pid.
struct Child {
  pid_t pid = -1;
  std::FILE* out = nullptr;

  explicit Child(std::vector<std::string> args) {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid = fork();
    if (pid == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      std::vector<char*> argv;
      std::string path = ORDER_HTTP_PATH;
      argv.push_back(path.data());
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(path.c_str(), argv.data());
      _exit(127);
    }
    close(fds[1]);
    out = fdopen(fds[0], "r");
  }
  std::string line() {
    char buf[512] = {};
    return out != nullptr && std::fgets(buf, sizeof buf, out) != nullptr ? buf : "";
  }
  int wait() {
    int status = 0;
    waitpid(pid, &status, 0);
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  ~Child() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    if (out != nullptr) std::fclose(out);
  }
};

}  // namespace order_http_test
