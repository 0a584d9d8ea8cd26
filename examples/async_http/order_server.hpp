// SPDX-License-Identifier: MIT
// examples/async_http: a Boost.Beast HTTP/1.1 server whose connections share ONE loop thread,
// serving `POST /orders` with an `Idempotency-Key` through idem::async::AsyncGuard.
//
// The loop never waits for a database: a duplicate is answered from the fast store's reply on
// the loop, and the order's transaction runs on the durable store's worker pool. The HTTP rules
// are idem's (idem/http/idempotency_key.hpp and response.hpp, independent of cpp-httplib):
//
//   * the key is the RFC 8941 string of `Idempotency-Key` ("..."), scoped by route and principal
//     (`X-Tenant`, "" when absent) into the stored key; missing: 400, malformed: 400;
//   * the fingerprint covers the method, the route and the body: the same key with another body
//     is 422;
//   * the first request's response (status, headers, body) is stored with the order, in the
//     same transaction, and replayed byte for byte with `Idempotent-Replayed: true`;
//   * a duplicate that arrives while the first one runs: 409 with `Retry-After: 1`;
//   * a store failure: its problem+json answer (503 with `Retry-After` when retryable).
#pragma once

#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/async/guard.hpp"
#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/http/endpoint.hpp"
#include "idem/http/idempotency_key.hpp"
#include "idem/http/response.hpp"

namespace async_http {

namespace net = idem::async::net;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = net::ip::tcp;

/// A Beast string view (boost::string_view in Boost 1.74) as a std::string_view.
inline std::string_view sv(beast::string_view s) noexcept { return {s.data(), s.size()}; }

/// The key scope of `POST /orders`.
inline constexpr std::string_view kScope = "http.orders.create";

/// A problem+json answer for `code`, with Retry-After when it is retryable.
inline idem::http::Response problem(idem::errc code, std::string_view detail) {
  idem::http::Response r = idem::http::problem(code, detail);
  if (idem::is_retryable(code)) r.headers.push_back({"Retry-After", "1"});
  return r;
}

/// A routing error (no idem involved): `status` with a one-line JSON body.
inline idem::http::Response plain(int status, std::string_view error) {
  idem::http::Response r;
  r.status = status;
  r.headers.push_back({"Content-Type", "application/json"});
  r.body = "{\"error\":" + idem::http::json_string(error) + "}";
  return r;
}

/// The HTTP answer of a finished guarded call.
inline idem::http::Response answer(std::exception_ptr error,
                                   idem::GuardResult<idem::http::Response> r) {
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const idem::Error& e) {
      // The exception's text (backend messages) stays in the server's logs; the client gets
      // the code's public message.
      return problem(e.code(), idem::errc_message(e.code()));
    } catch (...) {
      return problem(idem::errc::kStorageError, "the order could not be created");
    }
  }
  switch (r.outcome) {
    case idem::Outcome::kExecuted:
      return std::move(*r.value);
    case idem::Outcome::kReplayed: {
      idem::http::Response replay = std::move(*r.value);
      replay.headers.push_back({std::string(idem::http::kReplayedHeader), "true"});
      return replay;
    }
    case idem::Outcome::kInProgress:
      return problem(idem::errc::kInProgress,
                     "a request with this Idempotency-Key is still being processed; retry "
                     "after 1 s");
    case idem::Outcome::kFingerprintMismatch:
      return problem(idem::errc::kFingerprintMismatch,
                     "this Idempotency-Key was already used with a different request payload");
  }
  return problem(idem::errc::kStorageError, "unknown outcome");
}

/// The server: accepts connections on `endpoint`, one session per connection, every session
/// on the io_context's thread(s) (each on its own strand). `create(tx, body)` makes an order
/// inside the durable store's transaction and returns the response to store and send.
template <class Durable>
class OrderServer {
 public:
  /// The guard's transaction type (what `create` receives).
  using Tx = typename Durable::Transaction;
  /// Makes one order: runs on the durable store's worker pool, inside its transaction.
  using Create = std::function<idem::http::Response(Tx&, std::string_view body)>;

  OrderServer(net::io_context& io, idem::async::AsyncGuard<Durable>& guard, Create create,
              const tcp::endpoint& endpoint)
      : io_(io), guard_(guard), create_(std::move(create)), acceptor_(net::make_strand(io)) {
    acceptor_.open(endpoint.protocol());
    acceptor_.set_option(net::socket_base::reuse_address(true));
    acceptor_.bind(endpoint);
    acceptor_.listen(net::socket_base::max_listen_connections);
  }

  /// The bound port (for port 0).
  unsigned short port() const { return acceptor_.local_endpoint().port(); }

  /// Starts accepting (call once; the io_context's run() serves).
  void start() { accept(); }

  /// Stops accepting (from the loop); open sessions end with their connections.
  void stop() {
    beast::error_code ignored;
    acceptor_.close(ignored);
  }

 private:
  class Session;

  void accept() {
    acceptor_.async_accept(net::make_strand(io_), [this](beast::error_code ec, tcp::socket s) {
      if (ec) return;  // closed
      std::make_shared<Session>(*this, std::move(s))->read();
      accept();
    });
  }

  // One request: the answer is given to `done` on the session's strand.
  template <class Done>
  void handle(const bhttp::request<bhttp::string_body>& req, const net::any_io_executor& ex,
              Done done) {
    if (req.target() != "/orders") return done(plain(404, "not found (try POST /orders)"));
    if (req.method() != bhttp::verb::post) {
      idem::http::Response r = plain(405, "/orders takes POST");
      r.headers.push_back({"Allow", "POST"});
      return done(std::move(r));
    }
    std::vector<std::string_view> fields;
    for (const auto& f : req) {
      if (idem::http::iequals(sv(f.name_string()), idem::http::kIdempotencyKeyHeader)) {
        fields.push_back(sv(f.value()));
      }
    }
    idem::http::ParsedKey parsed = idem::http::parse_idempotency_key(fields);
    using Status = idem::http::ParsedKey::Status;
    if (parsed.status == Status::kMissing) {
      return done(problem(idem::errc::kMissingKey,
                          "POST /orders requires an Idempotency-Key header, e.g. "
                          "Idempotency-Key: \"8e03978e-40d5-43e8-bc93-6894a57f9324\""));
    }
    if (parsed.status != Status::kOk) {
      return done(problem(idem::errc::kInvalidKey, parsed.detail));
    }
    // Demo only: the principal is taken from an unauthenticated header. A real server takes it
    // from its authentication (a verified token's subject), or any client could read another
    // tenant's stored responses by sending its name.
    const std::string_view principal = sv(req["X-Tenant"]);
    const idem::Key key =
        idem::http::scoped_key(kScope, principal, "POST", "/orders", parsed.value);
    idem::http::RequestView view;
    view.method = "POST";
    view.route = "/orders";
    view.principal = principal;
    view.path = sv(req.target());  // path and query as sent: a reused key elsewhere is a 422
    view.body = req.body();
    const std::string fp = idem::fingerprint(idem::http::fingerprint_material(view, {}, view.body));
    guard_.async_run(
        key, fp,
        [create = &create_, body = req.body()](Tx& tx) { return (*create)(tx, body); },
        net::bind_executor(ex, [done = std::move(done)](
                                   std::exception_ptr e,
                                   idem::GuardResult<idem::http::Response> r) mutable {
          done(answer(std::move(e), std::move(r)));
        }));
  }

  net::io_context& io_;
  idem::async::AsyncGuard<Durable>& guard_;
  Create create_;
  tcp::acceptor acceptor_;
};

// One connection: read a request, answer it, read the next (keep-alive).
template <class Durable>
class OrderServer<Durable>::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(OrderServer& server, tcp::socket socket) : server_(server), stream_(std::move(socket)) {}

  void read() {
    req_ = {};
    stream_.expires_after(std::chrono::seconds(30));
    bhttp::async_read(stream_, buffer_, req_,
                      [self = this->shared_from_this()](beast::error_code ec, std::size_t) {
                        self->on_read(ec);
                      });
  }

 private:
  void on_read(beast::error_code ec) {
    if (ec) {
      // A request the parser refused is answered (as idem::http::Endpoint and cpp-httplib
      // answer them), then the connection ends: the rest of it is unread. The peer closing,
      // a timeout or a message cut short end the connection without an answer.
      if (ec == bhttp::error::body_limit) {  // over Beast's 1 MiB: Endpoint's max_body_bytes
        return refuse(problem(idem::errc::kPayloadTooLarge,
                              "the request body is larger than this server accepts (1 MiB)"));
      }
      if (ec == bhttp::error::header_limit) {
        return refuse(plain(431, "the request's header section is larger than 8 KiB"));
      }
      if (ec.category() == bhttp::make_error_code(bhttp::error::bad_method).category() &&
          ec != bhttp::error::end_of_stream && ec != bhttp::error::partial_message) {
        return refuse(plain(400, "malformed HTTP request"));
      }
      beast::error_code ignored;
      stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
      return;
    }
    server_.handle(req_, stream_.get_executor(),
                   [self = this->shared_from_this()](idem::http::Response r) {
                     self->write(std::move(r));
                   });
  }

  // Answers a request the parser refused and ends the connection.
  void refuse(idem::http::Response r) {
    req_.keep_alive(false);
    write(std::move(r));
  }

  void write(idem::http::Response r) {
    res_ = {};
    res_.version(req_.version());
    res_.result(static_cast<unsigned>(r.status));
    for (const auto& h : r.headers) res_.insert(h.name, h.value);
    res_.body() = std::move(r.body);
    res_.keep_alive(req_.keep_alive());
    res_.prepare_payload();
    bhttp::async_write(stream_, res_,
                       [self = this->shared_from_this()](beast::error_code ec, std::size_t) {
                         if (ec) return;
                         if (!self->res_.keep_alive()) {
                           beast::error_code ignored;
                           self->stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
                           return;
                         }
                         self->read();
                       });
  }

  OrderServer& server_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  bhttp::request<bhttp::string_body> req_;
  bhttp::response<bhttp::string_body> res_;
};

}  // namespace async_http
