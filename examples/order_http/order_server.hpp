// SPDX-License-Identifier: MIT
// The order service of examples/order_http: POST /orders through idem::http, GET /orders/{no}
// (the caller's own orders only),
// GET /metrics, and a checkout form with server-issued tokens (GET/POST /checkout). The
// business tables live behind an `Orders` repository and the guard's durable store is a
// template parameter, so another database plugs in with its own repository.
#pragma once

#include <httplib.h>
#include <nlohmann/json.hpp>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "idem/guard.hpp"
#include "idem/http/form_token.hpp"
#include "idem/http/httplib.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"

namespace order_http {

/// One order as the API shows it.
struct Order {
  std::string order_no;
  std::string sku;
  long long qty = 0;
  std::string status;

  nlohmann::json to_json() const {
    return {{"order_no", order_no}, {"sku", sku}, {"qty", qty}, {"status", status}};
  }
};

/// The orders table on SQLite (the embedded default). A PostgreSQL repository offers the same
/// two calls on pqxx::work.
class SqliteOrders {
 public:
  using Transaction = idem::sqlite::Transaction;

  explicit SqliteOrders(idem::sqlite::Database& db) : db_(db) {
    db_.write([](Transaction& tx) {
      tx.exec_script(
          "CREATE TABLE IF NOT EXISTS orders ("
          " id INTEGER PRIMARY KEY AUTOINCREMENT,"
          " order_no TEXT NOT NULL UNIQUE,"
          " principal TEXT NOT NULL,"
          " sku TEXT NOT NULL,"
          " qty INTEGER NOT NULL,"
          " status TEXT NOT NULL,"
          " paid_at INTEGER,"
          " created_at INTEGER NOT NULL)");
    });
  }

  /// Inserts an order in `tx` (the guard's transaction) and returns it.
  Order create(Transaction& tx, const std::string& principal, const std::string& sku,
               long long qty) {
    tx.exec("INSERT INTO orders (order_no, principal, sku, qty, status, created_at) "
            "VALUES ('pending-' || hex(randomblob(8)), ?, ?, ?, 'WAIT_PAY', ?)",
            principal, sku, qty, idem::to_millis(idem::system_now()));
    auto id = tx.query_int64("SELECT last_insert_rowid()").value_or(0);
    char no[32];
    std::snprintf(no, sizeof no, "ORD-%06lld", static_cast<long long>(id));
    tx.exec("UPDATE orders SET order_no = ? WHERE id = ?", std::string(no), id);
    return Order{no, sku, qty, "WAIT_PAY"};
  }

  /// Reads an order by number, if `principal` placed it.
  std::optional<Order> find(const std::string& principal, const std::string& order_no) {
    return db_.read([&](idem::sqlite::Session& s) -> std::optional<Order> {
      auto st = s.prepare(
          "SELECT order_no, sku, qty, status FROM orders WHERE order_no = ? AND principal = ?");
      st.bind_all(order_no, principal);
      if (!st.step()) return std::nullopt;
      return Order{st.column_bytes(0), st.column_bytes(1), st.column_int64(2),
                   st.column_bytes(3)};
    });
  }

  /// Number of orders (for tests and the demo).
  long long count() {
    return db_.read([](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM orders").value_or(0);
    });
  }

 private:
  idem::sqlite::Database& db_;
};

/// Options of the server.
struct ServerOptions {
  /// Address to bind.
  std::string host = "127.0.0.1";
  /// Port; 0 picks a free one (see OrderServer::port()).
  int port = 0;
  /// Worker threads of the HTTP server.
  std::size_t threads = 32;
  /// Test hook called inside the transaction of each order creation, before it commits (to
  /// hold a request in flight). Empty: none.
  std::function<void()> before_commit;
  /// How long a checkout form token (GET /checkout) may be submitted for the first time.
  std::chrono::seconds form_token_ttl{30 * 60};
  /// Time source of the form tokens (empty: the system clock); tests move it to expire them.
  idem::Clock clock;
};

/// The HTTP server. `Durable` is the guard's durable store, `Orders` the repository whose
/// `create(Durable::Transaction&, principal, sku, qty)` runs inside the guard's transaction.
template <class Durable, class Orders>
class OrderServer {
 public:
  OrderServer(idem::IdempotencyGuard<Durable>& guard, Orders& orders,
              prometheus::Registry& registry, ServerOptions options)
      : orders_(orders),
        registry_(registry),
        options_(std::move(options)),
        create_(guard, endpoint_options()),
        tokens_(guard.fast_store() != nullptr ? *guard.fast_store() : own_token_store_,
                idem::http::FormTokenOptions{"form.checkout", options_.form_token_ttl,
                                             options_.clock}),
        checkout_(guard, checkout_options(tokens_, guard)) {
    server_.new_task_queue = [n = options_.threads] { return new httplib::ThreadPool(n); };
    server_.set_tcp_nodelay(true);  // small responses: do not wait for delayed ACKs
    // A body over the endpoint's limit is refused before it is read (not held in memory), and
    // what cpp-httplib refuses itself (an over-long key line, that body) is problem+json too.
    server_.set_payload_max_length(create_.options().max_body_bytes);
    server_.set_error_handler(idem::http::problem_error_handler(create_));
    server_.Post("/orders", idem::http::httplib_handler(
                                create_, "/orders", principal_of,
                                [this](const httplib::Request& req,
                                       typename Durable::Transaction& tx) {
                                  return create_order(req, tx);
                                }));
    // The checkout form: GET issues a one-time token, POST accepts only issued tokens as its
    // Idempotency-Key (a made-up or expired one is 403 unknown_token), so a resubmitted form
    // replays the order it created.
    server_.Get("/checkout", [this](const httplib::Request& req, httplib::Response& res) {
      try {
        auto t = tokens_.issue(principal_of(req));
        res.set_header("Cache-Control", "no-store");  // a cached form would reuse its token
        res.set_content(nlohmann::json{{"form_token", t.value},
                                       {"idempotency_key", t.header_value()},
                                       {"expires_at_ms", idem::to_millis(t.expires_at)}}
                            .dump(),
                        "application/json");
      } catch (const idem::Error& e) {
        idem::http::write_response(checkout_.problem(e.code(), idem::errc_message(e.code())),
                                   res);
      }
    });
    server_.Post("/checkout", idem::http::httplib_handler(
                                  checkout_, "/checkout", principal_of,
                                  [this](const httplib::Request& req,
                                         typename Durable::Transaction& tx) {
                                    return create_order(req, tx);
                                  }));
    server_.Get(R"(/orders/([A-Za-z0-9_-]+))",
                [this](const httplib::Request& req, httplib::Response& res) {
                  // Only the caller's own orders: another principal's order number is
                  // answered as unknown (404), not shown.
                  std::optional<Order> order;
                  try {
                    order = orders_.find(principal_of(req), req.matches[1]);
                  } catch (const idem::Error& e) {
                    // The database failed: a typed problem (503 + Retry-After for an outage),
                    // never its text.
                    idem::http::write_response(
                        create_.problem(e.code(), idem::errc_message(e.code())), res);
                    return;
                  }
                  if (!order) {
                    idem::http::write_response(
                        idem::http::Response{404, {{"Content-Type", "application/json"}},
                                             R"({"error":"no such order"})"},
                        res);
                    return;
                  }
                  res.set_content(order->to_json().dump(), "application/json");
                });
    server_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(prometheus::TextSerializer().Serialize(registry_.Collect()),
                      "text/plain; version=0.0.4");
    });
  }

  ~OrderServer() { stop(); }

  /// Binds and serves on a background thread. @throws std::runtime_error if the port is taken.
  void start() {
    // cpp-httplib listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, fixed when Debian
    // compiled the library): a burst of 20 connections then overflows the accept queue and
    // some clients see resets. Capture the socket and listen() again with a deep backlog
    // (Linux updates the backlog of a listening socket).
    server_.set_socket_options([this](socket_t sock) {
      int yes = 1;
      ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
      listen_socket_ = sock;
    });
    if (options_.port == 0) {
      port_ = server_.bind_to_any_port(options_.host);
    } else {
      port_ = server_.bind_to_port(options_.host, options_.port) ? options_.port : -1;
    }
    if (port_ <= 0) {
      throw std::runtime_error("cannot bind " + options_.host + ":" +
                               std::to_string(options_.port));
    }
    if (listen_socket_ >= 0) ::listen(listen_socket_, SOMAXCONN);
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }

  /// Stops serving and joins the thread.
  void stop() {
    server_.stop();
    if (thread_.joinable()) thread_.join();
  }

  /// The bound port.
  int port() const noexcept { return port_; }
  /// "http://host:port".
  std::string url() const { return "http://" + options_.host + ":" + std::to_string(port_); }

 private:
  static idem::http::EndpointOptions endpoint_options() {
    idem::http::EndpointOptions o;
    o.scope = "http.orders.create";
    o.fingerprint_headers = {"Content-Type"};
    return o;
  }

  static idem::http::EndpointOptions checkout_options(
      const idem::http::FormTokens& tokens, const idem::IdempotencyGuard<Durable>& guard) {
    idem::http::EndpointOptions o;
    o.scope = "http.checkout";
    o.fingerprint_headers = {"Content-Type"};
    tokens.require_issued(o, guard.options());
    return o;
  }

  // Demo authentication: the bearer token is the principal. A real service puts its
  // authenticated user or tenant id here.
  static std::string principal_of(const httplib::Request& req) {
    auto auth = req.get_header_value("Authorization");
    const std::string bearer = "Bearer ";
    if (auth.compare(0, bearer.size(), bearer) == 0) return auth.substr(bearer.size());
    return "anonymous";
  }

  // A SKU without control characters (a NUL would be cut short by PostgreSQL's C strings: the
  // order would store another SKU than the one it answers).
  static bool printable(const std::string& s) {
    for (unsigned char c : s) {
      if (c < 0x20 || c == 0x7f) return false;
    }
    return true;
  }

  idem::http::Response create_order(const httplib::Request& req,
                                    typename Durable::Transaction& tx) {
    auto body = nlohmann::json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded() || !body.is_object() || !body.contains("sku") ||
        !body["sku"].is_string() || !printable(body["sku"].get<std::string>()) ||
        !body.contains("qty") || !body["qty"].is_number_integer() ||
        body["qty"].get<long long>() <= 0) {
      return idem::http::Response{
          400,
          {{"Content-Type", "application/problem+json"}},
          R"({"type":"urn:order:bad-request","title":"invalid order","status":400,)"
          R"("detail":"expected {\"sku\": string without control characters, \"qty\": positive integer}"})"};
    }
    Order order = orders_.create(tx, principal_of(req), body["sku"].get<std::string>(),
                                 body["qty"].get<long long>());
    if (options_.before_commit) options_.before_commit();
    return idem::http::Response{201,
                                {{"Content-Type", "application/json"},
                                 {"Location", "/orders/" + order.order_no}},
                                order.to_json().dump()};
  }

  Orders& orders_;
  prometheus::Registry& registry_;
  ServerOptions options_;
  idem::http::Endpoint<Durable> create_;
  idem::MemoryStore own_token_store_;  // the form tokens' store when the guard has no fast store
  idem::http::FormTokens tokens_;
  idem::http::Endpoint<Durable> checkout_;
  httplib::Server server_;
  std::thread thread_;
  int port_ = -1;
  socket_t listen_socket_ = -1;
};

}  // namespace order_http
