// SPDX-License-Identifier: MIT
// idem::http::Endpoint's options through a real cpp-httplib server on loopback and a real
// httplib::Client: bare-token keys, guarded methods, the pass-through of an absent optional
// key, canonical-JSON fingerprints, the body limit (413 before anything is stored), over-long
// key headers as problem+json, the error formatter, the replay hook, store failures that
// leave a log line and a metric behind, and duplicates that wait for the first result.
#include <gtest/gtest.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "idem/http/httplib.hpp"
#include "idem/http/json.hpp"
#include "idem/log.hpp"
#include "idem/memory_store.hpp"
#include "idem/prometheus/prometheus_observer.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/failing_store.hpp"
#include "support/prometheus_text.hpp"
#include "support/raw_exchange.hpp"
#include "support/test_env.hpp"

namespace {

using idem::http::Response;
using Tx = idem::sqlite::Transaction;

// Log lines a LoggingObserver sends.
struct Lines {
  std::mutex mutex;
  std::vector<std::string> lines;
  std::vector<std::string> containing(const std::string& needle) {
    std::lock_guard<std::mutex> lock(mutex);
    std::vector<std::string> out;
    for (auto& l : lines) {
      if (l.find(needle) != std::string::npos) out.push_back(l);
    }
    return out;
  }
};

class EndpointHttp : public ::testing::Test {
 protected:
  EndpointHttp() {
    durable_.database().write([](Tx& tx) {
      tx.exec("CREATE TABLE orders (id INTEGER PRIMARY KEY, body TEXT NOT NULL)");
    });
    auto observers = std::make_shared<idem::ObserverList>();
    observers->add(std::make_shared<idem::PrometheusObserver>(registry_));
    idem::LoggingObserverOptions lo;
    lo.min_level = idem::LogLevel::kDebug;
    observers->add(std::make_shared<idem::LoggingObserver>(
        [this](idem::LogLevel, std::string_view line) {
          std::lock_guard<std::mutex> lock(log_.mutex);
          log_.lines.emplace_back(line);
        },
        lo));
    idem::GuardOptions go;
    go.observer = observers;
    guard_ =
        std::make_unique<idem::IdempotencyGuard<idem::sqlite::SqliteStore>>(fast_, durable_, go);
    server_.set_tcp_nodelay(true);
  }
  ~EndpointHttp() override {
    server_.stop();
    if (thread_.joinable()) thread_.join();
  }

  // An endpoint (kept alive by the fixture) with `options` on top of the defaults.
  idem::http::Endpoint<idem::sqlite::SqliteStore>& endpoint(idem::http::EndpointOptions o) {
    if (o.scope.empty()) o.scope = "http.test.orders";
    endpoints_.push_back(
        std::make_unique<idem::http::Endpoint<idem::sqlite::SqliteStore>>(*guard_, std::move(o)));
    return *endpoints_.back();
  }

  // The handler every route runs: one order row per execution, in the guard's transaction.
  httplib::Server::Handler handler(idem::http::Endpoint<idem::sqlite::SqliteStore>& e,
                                   const std::string& route) {
    return idem::http::httplib_handler(
        e, route, [](const httplib::Request&) { return std::string("alice"); },
        [this](const httplib::Request& req, Tx& tx) {
          ++runs_;
          tx.exec("INSERT INTO orders (body) VALUES (?)", req.body);
          auto id = tx.query_int64("SELECT last_insert_rowid()").value_or(0);
          return Response{201,
                          {{"Content-Type", "application/json"}},
                          "{\"order\":" + std::to_string(id) + "}"};
        });
  }

  void serve() {
    port_ = server_.bind_to_any_port("127.0.0.1");
    ASSERT_GT(port_, 0);
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }

  httplib::Result send(const std::string& method, const std::string& path,
                       const std::string& key_field, const std::string& body,
                       const std::string& content_type = "application/json") {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(30, 0);
    c.set_write_timeout(30, 0);
    httplib::Headers h;
    if (!key_field.empty()) h.emplace("Idempotency-Key", key_field);
    if (method == "POST") return c.Post(path.c_str(), h, body, content_type.c_str());
    if (method == "PUT") return c.Put(path.c_str(), h, body, content_type.c_str());
    if (method == "PATCH") return c.Patch(path.c_str(), h, body, content_type.c_str());
    return c.Get(path.c_str(), h);
  }

  long count(const std::string& table) {
    return static_cast<long>(durable_.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM " + table).value_or(-1);
    }));
  }

  double metric(const std::string& name, const std::map<std::string, std::string>& labels = {}) {
    auto text = prometheus::TextSerializer().Serialize(registry_.Collect());
    return idem::test::metric_value(text, name, labels).value_or(-1);
  }

  static std::string code_of(const httplib::Result& r) {
    auto at = r->body.find("\"code\":\"");
    if (at == std::string::npos) return "";
    at += 8;
    return r->body.substr(at, r->body.find('"', at) - at);
  }

  idem::test::TempDir dir_;
  idem::MemoryStore inner_;
  idem::test::SwitchableFastStore fast_{inner_};
  idem::sqlite::SqliteStore durable_{dir_.file("endpoint.sqlite")};
  prometheus::Registry registry_;
  Lines log_;
  std::unique_ptr<idem::IdempotencyGuard<idem::sqlite::SqliteStore>> guard_;
  std::vector<std::unique_ptr<idem::http::Endpoint<idem::sqlite::SqliteStore>>> endpoints_;
  std::atomic<int> runs_{0};
  httplib::Server server_;
  std::thread thread_;
  int port_ = -1;
};

// cpp-httplib puts the fields of an application/x-www-form-urlencoded body into
// Request::params beside the query's: the view's query has the query's alone (the body is in
// the fingerprint already, and a fingerprint_material hook can then leave a body field out).
TEST(RequestView, TheQueryHoldsTheQueryParametersNotTheFormBodysFields) {
  httplib::Request req;
  req.method = "POST";
  req.path = "/orders";
  req.target = "/orders?a=1&b=two+words";
  req.body = "item=x%21&ts=5&a=1&flag";
  req.headers.emplace("Content-Type", "application/x-www-form-urlencoded; charset=utf-8");
  for (auto [n, v] : {std::pair<const char*, const char*>{"a", "1"},
                      {"b", "two words"},
                      {"item", "x!"},
                      {"ts", "5"},
                      {"a", "1"},
                      {"flag", ""}}) {
    req.params.emplace(n, v);
  }
  auto query_of = [](const idem::http::RequestView& v) {
    std::multiset<std::string> q;
    for (const auto& [n, value] : v.query) q.insert(std::string(n) + "=" + std::string(value));
    return q;
  };
  EXPECT_EQ((std::multiset<std::string>{"a=1", "b=two words"}),
            query_of(idem::http::request_view(req, "/orders", "alice")));
  // Any other body: every parameter is the query's.
  req.headers = {{"Content-Type", "text/plain"}};
  EXPECT_EQ(6u, idem::http::request_view(req, "/orders", "alice").query.size());
}

// One route, many resources (/accounts/:id/refund): the key is scoped by the route, and the
// concrete path and query are in the fingerprint, so the same key sent to another account (or
// with another query) is a 422, never account 1's stored response; the same target replays.
TEST_F(EndpointHttp, AKeyReusedOnAnotherResourceOfTheRouteIs422NotItsReplay) {
  auto& e = endpoint({});
  server_.Post(R"(/accounts/(\d+)/refund)", handler(e, "/accounts/:id/refund"));
  serve();
  auto first = send("POST", "/accounts/1/refund", "\"refund-1\"", "{\"amount\":5}");
  ASSERT_TRUE(first);
  EXPECT_EQ(201, first->status);
  for (const char* target : {"/accounts/2/refund", "/accounts/1/refund?dry_run=true"}) {
    auto other = send("POST", target, "\"refund-1\"", "{\"amount\":5}");
    ASSERT_TRUE(other) << target;
    EXPECT_EQ(422, other->status) << target;
    EXPECT_EQ("fingerprint_mismatch", code_of(other)) << target;
  }
  auto again = send("POST", "/accounts/1/refund", "\"refund-1\"", "{\"amount\":5}");
  ASSERT_TRUE(again);
  EXPECT_EQ(201, again->status);
  EXPECT_EQ(first->body, again->body);
  EXPECT_EQ("true", again->get_header_value("Idempotent-Replayed"));
  EXPECT_EQ(1, runs_.load());
  EXPECT_EQ(1, count("orders"));
}

TEST_F(EndpointHttp, BareTokenKeysOnlyWhereTheEndpointAllowsThem) {
  auto& strict = endpoint({});
  idem::http::EndpointOptions lenient_options;
  lenient_options.scope = "http.test.lenient";
  lenient_options.key_syntax = idem::http::KeySyntax::kAllowBareToken;
  auto& lenient = endpoint(lenient_options);
  server_.Post("/strict", handler(strict, "/strict"));
  server_.Post("/lenient", handler(lenient, "/lenient"));
  serve();

  const std::string stripe_key = "7f7d6f9c-9b2a-4c1e-8f00-2b1d3c4e5f60";
  auto refused = send("POST", "/strict", stripe_key, "{}");
  ASSERT_TRUE(refused);
  EXPECT_EQ(400, refused->status);
  EXPECT_EQ("invalid_key", code_of(refused));
  EXPECT_EQ("application/problem+json", refused->get_header_value("Content-Type"));

  auto first = send("POST", "/lenient", stripe_key, "{}");
  ASSERT_TRUE(first);
  EXPECT_EQ(201, first->status);
  auto bare_again = send("POST", "/lenient", stripe_key, "{}");
  auto quoted_again = send("POST", "/lenient", "\"" + stripe_key + "\"", "{}");
  for (auto* r : {&bare_again, &quoted_again}) {
    ASSERT_TRUE(*r);
    EXPECT_EQ(201, (*r)->status);
    EXPECT_EQ("true", (*r)->get_header_value("Idempotent-Replayed"));
    EXPECT_EQ(first->body, (*r)->body);
  }
  // Bare tokens are visible ASCII without '"' or ',' (a comma could be two folded keys).
  auto comma = send("POST", "/lenient", "a,b", "{}");
  ASSERT_TRUE(comma);
  EXPECT_EQ(400, comma->status);
  EXPECT_EQ(1, runs_.load());
  EXPECT_EQ(1, count("orders"));
  EXPECT_EQ(2, metric("idem_rejected_requests_total", {{"reason", "invalid_key"}}));
}

TEST_F(EndpointHttp, OnlyGuardedMethodsTouchTheStores) {
  auto& e = endpoint({});  // guarded: POST and PATCH
  server_.Post("/items", handler(e, "/items"));
  server_.Patch("/items", handler(e, "/items"));
  server_.Put("/items", handler(e, "/items"));
  serve();

  for (int i = 0; i < 3; ++i) {
    auto put = send("PUT", "/items", "\"same\"", "{\"v\":1}");
    ASSERT_TRUE(put);
    EXPECT_EQ(201, put->status);
    EXPECT_EQ("", put->get_header_value("Idempotent-Replayed"));
  }
  EXPECT_EQ(3, runs_.load());
  EXPECT_EQ(0, fast_.calls.load());        // no fast-store I/O at all
  EXPECT_EQ(0, count("api_idempotency"));  // and no record
  EXPECT_EQ(3, metric("idem_passthrough_requests_total", {{"reason", "method"}}));

  for (const char* method : {"POST", "POST", "PATCH", "PATCH"}) {
    auto r = send(method, "/items", "\"same\"", "{\"v\":1}");
    ASSERT_TRUE(r);
    EXPECT_EQ(201, r->status);
  }
  EXPECT_EQ(5, runs_.load());  // one POST and one PATCH ran (the key is scoped by method)
  EXPECT_EQ(2, count("api_idempotency"));
}

TEST_F(EndpointHttp, AnAbsentOptionalKeyIsATruePassThrough) {
  idem::http::EndpointOptions o;
  o.key_required = false;
  auto& e = endpoint(o);
  server_.Post("/orders", handler(e, "/orders"));
  serve();
  for (int i = 0; i < 3; ++i) {
    auto r = send("POST", "/orders", "", "{\"sku\":\"A1\"}");
    ASSERT_TRUE(r);
    EXPECT_EQ(201, r->status);
  }
  EXPECT_EQ(3, runs_.load());
  EXPECT_EQ(3, count("orders"));
  EXPECT_EQ(0, count("api_idempotency"));  // no record under a random key
  EXPECT_EQ(0, fast_.calls.load());
  EXPECT_EQ(3, metric("idem_passthrough_requests_total", {{"reason", "no_key"}}));
  EXPECT_EQ(3u, log_.containing("idem passthrough scope=http.test.orders reason=no_key").size());
  // With a key the same endpoint guards.
  ASSERT_EQ(201, send("POST", "/orders", "\"k\"", "{}")->status);
  ASSERT_EQ(201, send("POST", "/orders", "\"k\"", "{}")->status);
  EXPECT_EQ(4, runs_.load());
  EXPECT_EQ(1, count("api_idempotency"));
}

TEST_F(EndpointHttp, JsonBodiesAreComparedByMeaning) {
  idem::http::EndpointOptions o;
  o.fingerprint = idem::http::json_fingerprint({"Content-Type"});
  auto& e = endpoint(o);
  server_.Post("/orders", handler(e, "/orders"));
  serve();
  auto first = send("POST", "/orders", "\"j\"", R"({"sku":"A1","qty":2,"note":"caf\u00e9"})");
  ASSERT_TRUE(first);
  ASSERT_EQ(201, first->status);
  auto reserialised =
      send("POST", "/orders", "\"j\"",
           "{\n  \"note\": \"caf\xC3\xA9\",\n  \"qty\": 2.0,\n  \"sku\": \"A1\"\n}");
  ASSERT_TRUE(reserialised);
  EXPECT_EQ(201, reserialised->status);
  EXPECT_EQ("true", reserialised->get_header_value("Idempotent-Replayed"));
  EXPECT_EQ(first->body, reserialised->body);
  auto changed = send("POST", "/orders", "\"j\"", R"({"sku":"A1","qty":3,"note":"café"})");
  ASSERT_TRUE(changed);
  EXPECT_EQ(422, changed->status);
  EXPECT_EQ("fingerprint_mismatch", code_of(changed));
  EXPECT_EQ(1, runs_.load());
  EXPECT_EQ(1, metric("idem_rejected_requests_total", {{"reason", "fingerprint_mismatch"}}));
}

TEST_F(EndpointHttp, ABodyOverTheLimitIs413BeforeAnythingIsStored) {
  auto& e = endpoint({});  // max_body_bytes: 1 MiB by default
  server_.Post("/orders", handler(e, "/orders"));
  serve();
  const std::string big(50u << 20, 'x');  // 50 MB
  auto r = send("POST", "/orders", "\"big\"", big, "application/octet-stream");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(413, r->status);
  EXPECT_EQ("payload_too_large", code_of(r));
  EXPECT_EQ("application/problem+json", r->get_header_value("Content-Type"));
  EXPECT_EQ(0, runs_.load());
  EXPECT_EQ(0, count("api_idempotency"));
  EXPECT_EQ(0, fast_.calls.load());
  // 1 MiB exactly is accepted.
  auto at_limit = send("POST", "/orders", "\"edge\"", std::string(1u << 20, 'y'));
  ASSERT_TRUE(at_limit);
  EXPECT_EQ(201, at_limit->status);
  EXPECT_EQ(1, metric("idem_rejected_requests_total", {{"reason", "payload_too_large"}}));
}

TEST_F(EndpointHttp, TheServerLimitsAnswerProblemJsonToo) {
  auto& e = endpoint({});
  server_.Post("/orders", handler(e, "/orders"));
  // cpp-httplib refuses these before any handler: a header line over 8 KiB, a body over
  // set_payload_max_length (it reads and discards the body, so nothing reaches the endpoint).
  server_.set_payload_max_length(e.options().max_body_bytes);
  server_.set_error_handler(idem::http::problem_error_handler(e));
  server_.Get("/teapot", [](const httplib::Request&, httplib::Response& res) {
    res.status = 418;
    res.set_content("short and stout", "text/plain");
  });
  // A routed handler's own empty-bodied 400 and 413 (no Idempotency-Key sent) are its answers.
  server_.Get(R"(/bare/(\d+))", [](const httplib::Request& req, httplib::Response& res) {
    res.status = std::stoi(req.matches[1]);
  });
  serve();
  for (int status : {400, 413}) {
    auto bare = send("GET", "/bare/" + std::to_string(status), "", "");
    ASSERT_TRUE(bare);
    EXPECT_EQ(status, bare->status);
    EXPECT_EQ("", bare->body) << "a handler's own " << status << " was rewritten";
  }

  auto long_key = send("POST", "/orders", "\"" + std::string(9000, 'k') + "\"", "{}");
  ASSERT_TRUE(long_key);
  EXPECT_EQ(400, long_key->status);
  EXPECT_EQ("invalid_key", code_of(long_key));
  EXPECT_EQ("application/problem+json", long_key->get_header_value("Content-Type"));
  EXPECT_NE(std::string::npos, long_key->body.find("8192 bytes")) << long_key->body;
  // Under the server's limit but over the key's: the endpoint's own 400.
  auto over_key = send("POST", "/orders", "\"" + std::string(300, 'k') + "\"", "{}");
  ASSERT_TRUE(over_key);
  EXPECT_EQ(400, over_key->status);
  EXPECT_NE(std::string::npos, over_key->body.find("at most 255")) << over_key->body;

  auto big = send("POST", "/orders", "\"big\"", std::string(50u << 20, 'x'));
  ASSERT_TRUE(big) << httplib::to_string(big.error());
  EXPECT_EQ(413, big->status);
  EXPECT_EQ("payload_too_large", code_of(big));
  EXPECT_EQ(0, runs_.load());
  EXPECT_EQ(0, count("api_idempotency"));
  // Everything else keeps its own answer.
  auto teapot = send("GET", "/teapot", "", "");
  ASSERT_TRUE(teapot);
  EXPECT_EQ(418, teapot->status);
  EXPECT_EQ("short and stout", teapot->body);
  auto missing = send("GET", "/nowhere", "", "");
  ASSERT_TRUE(missing);
  EXPECT_EQ(404, missing->status);
  EXPECT_EQ(2, metric("idem_rejected_requests_total", {{"reason", "invalid_key"}}));
  EXPECT_EQ(1, metric("idem_rejected_requests_total", {{"reason", "payload_too_large"}}));
  EXPECT_EQ(1u,
            log_.containing("idem rejected request scope=- reason=invalid_key status=400").size());
}

// cpp-httplib answers a header section it cannot read with a 400 and keeps the connection
// open, reading what follows the over-long line (the other headers, the body) as further
// requests. One over-long key is one rejection: its lines read as requests keep the bare 400
// and leave no metric or log line behind. The tail is sent after a pause so that it is still
// in the socket when the server has answered the first 400 (what a slow link does).
TEST_F(EndpointHttp, TheRestOfARefusedHeaderSectionIsNotCountedAsMoreRejections) {
  auto& e = endpoint({});
  server_.Post("/orders", handler(e, "/orders"));
  server_.set_error_handler(idem::http::problem_error_handler(e));
  serve();
  const std::string head = "POST /orders HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: \"" +
                           std::string(9000, 'k') + "\"\r\n";
  const std::string tail =
      "Content-Type: application/json\r\nContent-Length: 2\r\nX-Trace: a b c\r\n\r\n{}";
  const std::string answers =
      idem::test::exchange_raw("127.0.0.1", port_, {head, tail}, std::chrono::milliseconds(300));
  ASSERT_NE(std::string::npos, answers.find("HTTP/1.1 400")) << answers;
  EXPECT_NE(std::string::npos, answers.find("application/problem+json")) << answers;
  EXPECT_EQ(1, metric("idem_rejected_requests_total", {{"reason", "invalid_key"}})) << answers;
  EXPECT_EQ(1u,
            log_.containing("idem rejected request scope=- reason=invalid_key status=400").size());
  EXPECT_EQ(0, runs_.load());
}

TEST_F(EndpointHttp, ReplaceableErrorFormatterAndReplayHook) {
  idem::http::EndpointOptions o;
  o.retry_after = std::chrono::seconds(7);
  o.error_formatter = [](idem::errc code, std::string_view detail) {
    return Response{idem::http_status(code),
                    {{"Content-Type", "application/vnd.shop.error+json"}},
                    "{\"error\":\"" + std::string(idem::errc_name(code)) +
                        "\",\"len\":" + std::to_string(detail.size()) + "}"};
  };
  std::atomic<int> replays{0};
  o.on_replay = [&](const idem::http::ReplayInfo& info, Response& r) {
    ++replays;
    EXPECT_EQ("http.test.orders", info.key.scope());
    EXPECT_EQ(idem::Source::kFastStore, info.source);
    r.set_header("Idempotency-First-Seen", idem::log::format_time(info.first_seen));
  };
  auto& e = endpoint(o);
  server_.Post("/orders", handler(e, "/orders"));
  serve();

  auto missing = send("POST", "/orders", "", "{}");
  ASSERT_TRUE(missing);
  EXPECT_EQ(400, missing->status);
  EXPECT_EQ("application/vnd.shop.error+json", missing->get_header_value("Content-Type"));
  EXPECT_EQ(0u, missing->body.rfind("{\"error\":\"missing_key\"", 0)) << missing->body;

  // In flight elsewhere: the formatter's 409, with the endpoint's Retry-After.
  auto key = idem::http::scoped_key("http.test.orders", "alice", "POST", "/orders", "held");
  idem::http::RequestView view;
  view.method = "POST";
  view.route = "/orders";
  view.path = "/orders";  // as idem::http::request_view fills it
  view.body = "{}";
  view.headers = {{"Content-Type", "application/json"}};
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            inner_
                .claim(key, e.request_fingerprint(view), idem::OwnerToken::generate(),
                       std::chrono::seconds(30))
                .status);
  auto held = send("POST", "/orders", "\"held\"", "{}");
  ASSERT_TRUE(held);
  EXPECT_EQ(409, held->status);
  EXPECT_EQ("7", held->get_header_value("Retry-After"));
  EXPECT_EQ(0u, held->body.rfind("{\"error\":\"in_progress\"", 0)) << held->body;

  auto before = idem::system_now();
  ASSERT_EQ(201, send("POST", "/orders", "\"r\"", "{}")->status);
  auto replay = send("POST", "/orders", "\"r\"", "{}");
  ASSERT_TRUE(replay);
  EXPECT_EQ("true", replay->get_header_value("Idempotent-Replayed"));
  auto seen = replay->get_header_value("Idempotency-First-Seen");
  EXPECT_NE("unknown", seen);
  EXPECT_EQ(idem::log::format_time(before).substr(0, 16), seen.substr(0, 16));  // same minute
  EXPECT_EQ(1, replays.load());
}

TEST_F(EndpointHttp, StoreFailuresAnswerTheirCodeAndLeaveALogLineAndAMetric) {
  auto& e = endpoint({});
  server_.Post("/orders", handler(e, "/orders"));
  serve();
  fast_.failing = true;  // Redis down: the call goes on with the durable store, degraded
  auto degraded = send("POST", "/orders", "\"a\"", "{}");
  ASSERT_TRUE(degraded);
  EXPECT_EQ(201, degraded->status);
  fast_.failing = false;
  durable_.database().write([](Tx& tx) { tx.exec("DROP TABLE api_idempotency"); });
  auto failed = send("POST", "/orders", "\"b\"", "{}");
  ASSERT_TRUE(failed);
  EXPECT_EQ(500, failed->status);  // "no such table": storage_error, not retryable
  EXPECT_EQ("storage_error", code_of(failed));
  EXPECT_EQ(std::string::npos, failed->body.find("no such table"));  // stays inside

  auto lines = log_.containing("idem store error");
  ASSERT_EQ(2u, lines.size());
  EXPECT_NE(std::string::npos, lines[0].find("role=fast store=switchable code=store_unavailable"));
  EXPECT_NE(std::string::npos, lines[1].find("role=durable store=sqlite code=storage_error"));
  EXPECT_NE(std::string::npos, lines[1].find("no such table"));
  EXPECT_EQ(1, metric("idem_store_errors_total", {{"store", "switchable"}}));
  EXPECT_EQ(1, metric("idem_store_errors_total", {{"store", "sqlite"}, {"code", "storage_error"}}));
}

// A client's `Prefer: wait=N` (allowed by max_prefer_wait; the value a token or, RFC 7240, a
// quoted string) waits for the first request instead of 409; a duplicate without it is
// answered 409 at once; the handler runs once.
TEST_F(EndpointHttp, ADuplicateThatPrefersToWaitGetsTheFirstResult) {
  idem::http::EndpointOptions o;
  o.max_prefer_wait = std::chrono::seconds{20};
  auto& e = endpoint(o);
  std::mutex m;
  std::condition_variable cv;
  bool open = false;
  server_.Post("/slow",
               idem::http::httplib_handler(
                   e, "/slow", [](const httplib::Request&) { return std::string("alice"); },
                   [&](const httplib::Request&, Tx& tx) {
                     ++runs_;
                     std::unique_lock<std::mutex> lock(m);
                     cv.wait(lock, [&] { return open; });
                     tx.exec("INSERT INTO orders (body) VALUES ('slow')");
                     return Response{201, {{"Content-Type", "application/json"}}, "{\"order\":1}"};
                   }));
  serve();
  // Status and body of one POST, with an optional Prefer field (-1: no answer).
  struct Answer {
    int status = -1;
    std::string body, replayed, code;
  };
  auto post = [this](const std::string& prefer) {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(30, 0);
    httplib::Headers h{{"Idempotency-Key", "\"slow-1\""}};
    if (!prefer.empty()) h.emplace("Prefer", prefer);
    auto r = c.Post("/slow", h, "{}", "application/json");
    Answer out;
    if (r) {
      out.status = r->status;
      out.body = r->body;
      out.replayed = r->get_header_value("Idempotent-Replayed");
      out.code = code_of(r);
    }
    return out;
  };
  Answer first, waiter, quoted;
  std::thread a([&] { first = post(""); });
  while (runs_.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  std::thread b([&] { waiter = post("respond-async, wait=15"); });
  std::thread q([&] { quoted = post("wait=\"15\""); });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds{20};
  while (guard_->stats().snapshot().waits < 2) {
    ASSERT_LT(std::chrono::steady_clock::now(), until);
    std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }
  Answer impatient = post("");
  EXPECT_EQ(409, impatient.status);
  EXPECT_EQ("in_progress", impatient.code);
  {
    std::lock_guard<std::mutex> lock(m);
    open = true;
  }
  cv.notify_all();
  a.join();
  b.join();
  q.join();
  EXPECT_EQ(201, first.status);
  for (const Answer* w : {&waiter, &quoted}) {
    EXPECT_EQ(201, w->status);
    EXPECT_EQ("true", w->replayed);
    EXPECT_EQ(first.body, w->body);
  }
  EXPECT_EQ(1, runs_.load());
  EXPECT_EQ(1, count("orders"));
}

}  // namespace
