// SPDX-License-Identifier: MIT
// examples/async_http driven over loopback: Boost.Beast on ONE loop thread, POST /orders with
// Idempotency-Key through AsyncGuard (MemoryStore in front of SQLite on a worker pool). The
// HTTP rules (key syntax, scoping, fingerprint, replay header, problem+json codes) and many
// clients at once: one order per key, every request answered, the transactions never on the
// loop.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "idem/async/pooled_durable.hpp"
#include "idem/memory_store.hpp"
#include "order_server.hpp"
#include "orders.hpp"
#include "support/test_env.hpp"

namespace {

namespace net = async_http::net;
namespace bhttp = async_http::bhttp;
using async_http::tcp;
using Durable = idem::async::PooledDurable<idem::sqlite::SqliteStore>;
using Res = bhttp::response<bhttp::string_body>;
using namespace std::chrono_literals;

// A keep-alive HTTP/1.1 client (blocking, for the test's threads).
class Client {
 public:
  explicit Client(unsigned short port) : socket_(io_) {
    socket_.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  }
  Res send(bhttp::verb verb, const std::string& target,
           const std::vector<std::pair<std::string, std::string>>& headers,
           const std::string& body) {
    bhttp::request<bhttp::string_body> req{verb, target, 11};
    req.set(bhttp::field::host, "127.0.0.1");
    for (const auto& [n, v] : headers) req.insert(n, v);
    req.body() = body;
    req.keep_alive(true);
    req.prepare_payload();
    bhttp::write(socket_, req);
    Res res;
    bhttp::read(socket_, buffer_, res);
    return res;
  }
  // Sends `raw` bytes as they are and reads one response.
  Res send_raw(const std::string& raw) {
    net::write(socket_, net::buffer(raw));
    Res res;
    bhttp::read(socket_, buffer_, res);
    return res;
  }
  Res post(const std::string& key_field, const std::string& body,
           std::vector<std::pair<std::string, std::string>> extra = {}) {
    if (!key_field.empty()) extra.emplace_back("Idempotency-Key", key_field);
    return send(bhttp::verb::post, "/orders", extra, body);
  }

 private:
  net::io_context io_;
  tcp::socket socket_;
  async_http::beast::flat_buffer buffer_;
};

std::string header(const Res& r, const char* name) {
  auto it = r.find(name);
  return it == r.end() ? std::string() : std::string(it->value().data(), it->value().size());
}

// The problem+json code of an error answer.
std::string code_of(const Res& r) {
  const std::string& b = r.body();
  auto at = b.find("\"code\":\"");
  if (at == std::string::npos) return "<none>";
  at += 8;
  return b.substr(at, b.find('"', at) - at);
}

class AsyncHttpTest : public ::testing::Test {
 protected:
  AsyncHttpTest()
      : sqlite_(dir_.file("orders.db")),
        workers_({4, 4096}),
        durable_(sqlite_, workers_),
        fast_(memory_),
        guard_(io_.get_executor(), fast_, durable_, options()),
        server_(io_, guard_,
                [this](idem::sqlite::Transaction& tx, std::string_view body) {
                  if (std::this_thread::get_id() == loop_id_) on_loop_ = true;
                  return async_http::create_order(tx, body);
                },
                tcp::endpoint(net::ip::make_address("127.0.0.1"), 0)) {
    async_http::create_orders_table(sqlite_);
    server_.start();
    loop_ = std::thread([this] { io_.run(); });
    loop_id_ = loop_.get_id();
  }
  ~AsyncHttpTest() override {
    net::post(io_, [this] { server_.stop(); });
    work_.reset();
    io_.stop();
    loop_.join();
  }
  idem::async::AsyncGuardOptions options() {
    idem::async::AsyncGuardOptions o;
    o.pool = &workers_;
    return o;
  }
  long orders() {
    return static_cast<long>(sqlite_.database().read([](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM orders").value_or(-1);
    }));
  }

  idem::test::TempDir dir_;
  net::io_context io_{1};
  net::executor_work_guard<net::io_context::executor_type> work_{io_.get_executor()};
  idem::sqlite::SqliteStore sqlite_;
  idem::async::WorkerPool workers_;
  Durable durable_;
  idem::MemoryStore memory_;
  idem::async::InlineFastStore fast_;
  idem::async::AsyncGuard<Durable> guard_;
  std::atomic<std::thread::id> loop_id_{};
  std::atomic<bool> on_loop_{false};
  async_http::OrderServer<Durable> server_;
  std::thread loop_;
};

TEST_F(AsyncHttpTest, KeyRulesReplaysAndMismatch) {
  Client c(server_.port());
  auto missing = c.post("", "{\"sku\":\"A1\"}");
  EXPECT_EQ(400u, missing.result_int());
  EXPECT_EQ("missing_key", code_of(missing));
  EXPECT_EQ("application/problem+json", header(missing, "Content-Type"));
  auto bare = c.post("k1", "{\"sku\":\"A1\"}");  // not an RFC 8941 string
  EXPECT_EQ(400u, bare.result_int());
  EXPECT_EQ("invalid_key", code_of(bare));
  auto two = c.send(bhttp::verb::post, "/orders",
                    {{"Idempotency-Key", "\"a\""}, {"Idempotency-Key", "\"b\""}}, "{}");
  EXPECT_EQ(400u, two.result_int());
  EXPECT_EQ(0, orders()) << "refused requests touch nothing";

  const std::string key = "\"" + idem::test::unique_name("order") + "\"";
  auto first = c.post(key, "{\"sku\":\"A1\",\"qty\":2}");
  ASSERT_EQ(201u, first.result_int()) << first.body();
  EXPECT_EQ("", header(first, "Idempotent-Replayed"));
  EXPECT_EQ("1", header(first, "X-Order-Id"));
  auto again = c.post(key, "{\"sku\":\"A1\",\"qty\":2}");
  EXPECT_EQ(201u, again.result_int());
  EXPECT_EQ("true", header(again, "Idempotent-Replayed"));
  EXPECT_EQ(first.body(), again.body()) << "replayed byte for byte";
  EXPECT_EQ(header(first, "X-Order-Id"), header(again, "X-Order-Id"));
  auto other_body = c.post(key, "{\"sku\":\"A1\",\"qty\":3}");
  EXPECT_EQ(422u, other_body.result_int());
  EXPECT_EQ("fingerprint_mismatch", code_of(other_body));
  // The same client key from another tenant is another key.
  auto tenant = c.post(key, "{\"sku\":\"A1\",\"qty\":2}", {{"X-Tenant", "acme"}});
  EXPECT_EQ(201u, tenant.result_int());
  EXPECT_EQ("", header(tenant, "Idempotent-Replayed"));
  EXPECT_NE(first.body(), tenant.body());
  // An empty order is refused by the handler; the refusal is stored and replayed too.
  const std::string empty_key = "\"" + idem::test::unique_name("empty") + "\"";
  EXPECT_EQ(400u, c.post(empty_key, "").result_int());
  auto empty_again = c.post(empty_key, "");
  EXPECT_EQ(400u, empty_again.result_int());
  EXPECT_EQ("true", header(empty_again, "Idempotent-Replayed"));
  EXPECT_EQ(2, orders());
  auto get = c.send(bhttp::verb::get, "/orders", {}, "");
  EXPECT_EQ(405u, get.result_int());
  EXPECT_EQ("POST", header(get, "Allow"));
  EXPECT_EQ(404u, c.send(bhttp::verb::post, "/payments", {{"Idempotency-Key", key}}, "{}").result_int());
  EXPECT_EQ(2, orders());
  EXPECT_FALSE(on_loop_.load()) << "a transaction ran on the loop thread";
}

// 8 clients on keep-alive connections, 1,000 requests over 700 keys (30 % duplicates), served
// by one loop thread: every request is answered 201 (or 409 while its twin runs, then 201 on a
// retry), every answer of a key carries the same order, and there is one order per key.
// Requests the parser refuses are answered before the connection ends: a body over 1 MiB
// (413 payload_too_large, as idem::http::Endpoint's default max_body_bytes), a header section
// over 8 KiB (431), a malformed request line (400); nothing reaches the guard.
TEST_F(AsyncHttpTest, RequestsTheParserRefusesAreAnswered) {
  const std::string key = "Idempotency-Key: \"big-1\"\r\n";
  Res big = Client(server_.port())
                .send_raw("POST /orders HTTP/1.1\r\nHost: 127.0.0.1\r\n" + key +
                          "Content-Length: 2097152\r\n\r\n{\"sku\":");
  EXPECT_EQ(413, big.result_int());
  EXPECT_EQ("payload_too_large", code_of(big));
  EXPECT_FALSE(big.keep_alive());
  Res just_over = Client(server_.port())
                      .send_raw("POST /orders HTTP/1.1\r\nHost: 127.0.0.1\r\n" + key +
                                "Content-Length: 1048577\r\n\r\n");
  EXPECT_EQ(413, just_over.result_int());
  Res header = Client(server_.port())
                   .send_raw("POST /orders HTTP/1.1\r\nHost: 127.0.0.1\r\nCookie: " +
                             std::string(9000, 'c') + "\r\n\r\n");
  EXPECT_EQ(431, header.result_int());
  Res garbage = Client(server_.port()).send_raw("NOT HTTP AT ALL\r\n\r\n");
  EXPECT_EQ(400, garbage.result_int());
  EXPECT_EQ(0, orders());
  EXPECT_EQ(0u, guard_.stats().snapshot().executed);
}

TEST_F(AsyncHttpTest, ManyClientsOnOneLoopThreadGetOneOrderPerKey) {
  constexpr int kKeys = 700, kRequests = 1000, kClients = 8;
  const std::string run = idem::test::unique_name("storm");
  auto key_of = [&](int i) { return "\"" + run + "_" + std::to_string(i < kKeys ? i : (i * 7) % kKeys) + "\""; };
  std::mutex m;
  std::map<std::string, std::string> body_of;  // key -> the order it got
  std::atomic<int> answered{0}, replayed{0}, busy{0}, wrong{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < kClients; ++t) {
    clients.emplace_back([&, t] {
      Client c(server_.port());
      for (int i = t; i < kRequests; i += kClients) {
        const std::string key = key_of(i);
        const std::string body = "{\"order\":" + key + "}";
        Res r = c.post(key, body);
        for (int retry = 0; r.result_int() == 409 && retry < 200; ++retry) {
          ++busy;
          std::this_thread::sleep_for(5ms);
          r = c.post(key, body);
        }
        ++answered;
        if (r.result_int() != 201) {
          ++wrong;
          continue;
        }
        if (header(r, "Idempotent-Replayed") == "true") ++replayed;
        std::lock_guard<std::mutex> lock(m);
        auto [it, fresh] = body_of.emplace(key, r.body());
        if (!fresh && it->second != r.body()) ++wrong;
      }
    });
  }
  for (auto& c : clients) c.join();
  EXPECT_EQ(kRequests, answered.load());
  EXPECT_EQ(0, wrong.load());
  EXPECT_EQ(static_cast<std::size_t>(kKeys), body_of.size());
  EXPECT_EQ(kRequests - kKeys, replayed.load());
  EXPECT_EQ(kKeys, orders()) << "one order per key";
  EXPECT_FALSE(on_loop_.load()) << "a transaction ran on the loop thread";
  ::testing::Test::RecordProperty("in_progress_answers", busy.load());
}

}  // namespace
