// SPDX-License-Identifier: MIT
// Asynchronous Redis connections (see redis_connection.hpp).
#include "redis_connection.hpp"

#include <cerrno>
#include <charconv>
#include <optional>
#include <utility>

namespace idem::async::detail {

void append_resp(std::string& out, int argc, const std::string_view* argv) {
  char num[24];
  auto number = [&](std::size_t n) {
    auto res = std::to_chars(num, num + sizeof num, n);
    out.append(num, static_cast<std::size_t>(res.ptr - num));
  };
  out.push_back('*');
  number(static_cast<std::size_t>(argc));
  out.append("\r\n");
  for (int i = 0; i < argc; ++i) {
    out.push_back('$');
    number(argv[i].size());
    out.append("\r\n");
    out.append(argv[i].data(), argv[i].size());
    out.append("\r\n");
  }
}

// One hiredis async context. Lives (self_) until hiredis has let go of it; its Node may be gone
// before (node_ is then null).
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  using Clock = std::chrono::steady_clock;

  Connection(Node* node, Executor executor) : node_(node), executor_(executor), timer_(executor) {}

  // Opens the context. false: failed at once (`why` says why); nothing is left behind.
  bool start(const ConnectionSettings& s, std::string& why) {
    const redis::detail::Endpoint& ep = s.endpoint;
    redisAsyncContext* ac = ep.unix_socket ? redisAsyncConnectUnix(ep.path.c_str())
                                           : redisAsyncConnect(ep.host.c_str(), ep.port);
    if (ac == nullptr) {
      why = "cannot allocate a hiredis context";
      return false;
    }
    if (ac->err != 0) {
      why = ac->errstr;
      redisAsyncFree(ac);
      return false;
    }
    adapter_ = HiredisAsio::attach(ac, executor_);
    if (!adapter_) {
      why = "cannot watch the socket";
      redisAsyncFree(ac);
      return false;
    }
    ac_ = ac;
    ac->data = this;
    self_ = shared_from_this();
    redisAsyncSetConnectCallback(ac, &Connection::on_connect);  // arms the first write wait
    redisAsyncSetDisconnectCallback(ac, &Connection::on_disconnect);
    command_timeout_ = s.command_timeout;
    connect_deadline_ = Clock::now() + s.connect_timeout;
    arm_timer(connect_deadline_);
    // AUTH and SELECT go first on the wire: every later command runs authenticated.
    if (!ep.password.empty()) {
      std::string resp;
      if (ep.user.empty()) {
        const std::string_view argv[] = {"AUTH", ep.password};
        append_resp(resp, 2, argv);
      } else {
        const std::string_view argv[] = {"AUTH", ep.user, ep.password};
        append_resp(resp, 3, argv);
      }
      setup(resp, "AUTH");
    }
    if (ep.db != 0) {
      std::string db = std::to_string(ep.db);
      const std::string_view argv[] = {"SELECT", db};
      std::string resp;
      append_resp(resp, 2, argv);
      setup(resp, "SELECT");
    }
    return true;
  }

  bool alive() const noexcept { return ac_ != nullptr; }
  std::size_t in_flight() const noexcept { return pending_.size(); }
  void detach() noexcept { node_ = nullptr; }

  void send(std::string_view resp, ReplyCallback cb) {
    if (ac_ == nullptr || redisAsyncFormattedCommand(ac_, &Connection::on_reply, nullptr,
                                                     resp.data(), resp.size()) != REDIS_OK) {
      ConnectionFailure f = failure_.value_or(ConnectionFailure{});
      if (f.message.empty()) f.message = "the connection is closing";
      f.hiredis_err = f.hiredis_err != 0 ? f.hiredis_err : REDIS_ERR_OTHER;
      f.sent = false;
      fail_later(std::move(cb), std::move(f));
      return;
    }
    const Clock::time_point deadline = Clock::now() + command_timeout_;
    pending_.push_back(Pending{std::move(cb), deadline});
    if (!timer_armed_) arm_timer(pending_.front().deadline);
  }

  // Ends the connection: every pending command fails with `why`.
  void close(ConnectionFailure why) {
    if (ac_ == nullptr) return;
    failure_ = std::move(why);
    redisAsyncContext* ac = ac_;
    ac_ = nullptr;
    timer_.cancel();
    release_later();
    redisAsyncFree(ac);  // deferred by hiredis when inside one of its callbacks
  }

 private:
  struct Pending {
    ReplyCallback cb;
    Clock::time_point deadline;
  };

  void setup(const std::string& resp, const char* what) {
    send(resp, [this, what](const redisReply* r, const ConnectionFailure*) {
      if (r != nullptr && r->type == REDIS_REPLY_ERROR) {
        ConnectionFailure f;
        f.server_reply = true;
        f.message = std::string(what) + " refused: " + std::string(r->str, r->len);
        close(std::move(f));
      }
      // No reply: the connection failed; its pending commands say why.
    });
  }

  static Connection* of(const redisAsyncContext* ac) noexcept {
    return static_cast<Connection*>(ac->data);
  }

  static void on_reply(redisAsyncContext* ac, void* reply, void*) {
    Connection* c = of(ac);
    if (c == nullptr || c->pending_.empty()) return;
    Pending p = std::move(c->pending_.front());
    c->pending_.pop_front();
    if (reply != nullptr) {
      p.cb(static_cast<const redisReply*>(reply), nullptr);
      return;
    }
    ConnectionFailure f;
    if (c->failure_) {
      f = *c->failure_;
      f.sent = f.sent || c->connected_;
    } else {
      f.hiredis_err = ac->c.err != 0 ? ac->c.err : REDIS_ERR_EOF;
      f.sys_errno = errno;
      f.message = ac->c.errstr[0] != '\0' ? ac->c.errstr : "connection closed";
      f.sent = c->connected_;
    }
    p.cb(nullptr, &f);
  }

  static void on_connect(const redisAsyncContext* ac, int status) {
    Connection* c = of(ac);
    if (c == nullptr) return;
    if (status == REDIS_OK) {
      c->connected_ = true;
      if (c->node_ != nullptr) c->node_->connected();
      // Replies are now timed from their own deadlines, not the connect deadline.
      c->arm_timer(c->pending_.empty() ? Clock::now() + c->command_timeout_
                                       : c->pending_.front().deadline);
      return;
    }
    // hiredis frees the context right after this returns (its commands get NULL replies).
    // ac->err is copied from ac->c only after this callback: read the context's own.
    ConnectionFailure f;
    f.hiredis_err = ac->c.err != 0 ? ac->c.err : REDIS_ERR_IO;
    f.sys_errno = errno;
    f.message = ac->c.errstr[0] != '\0' ? ac->c.errstr : "connect failed";
    if (c->node_ != nullptr) c->node_->connect_failed(f.message);
    c->failure_ = std::move(f);
    c->ac_ = nullptr;
    c->timer_.cancel();
    c->release_later();
  }

  static void on_disconnect(const redisAsyncContext* ac, int) {
    Connection* c = of(ac);
    if (c == nullptr) return;
    if (c->ac_ != nullptr && c->node_ != nullptr) ++c->node_->stats_.dropped;
    c->ac_ = nullptr;
    c->timer_.cancel();
    c->release_later();
  }

  // One wait at a time: re-arming cancels the previous wait, whose handler then sees a newer
  // generation and does nothing.
  void arm_timer(Clock::time_point at) {
    timer_armed_ = true;
    const std::uint64_t gen = ++timer_gen_;
    timer_.expires_at(at);
    timer_.async_wait([self = shared_from_this(), gen](const error_code& ec) {
      if (gen != self->timer_gen_) return;
      self->timer_armed_ = false;
      if (ec == net::error::operation_aborted || self->ac_ == nullptr) return;
      self->on_timer();
    });
  }

  void on_timer() {
    const Clock::time_point now = Clock::now();
    if (!connected_ && now >= connect_deadline_) {
      ConnectionFailure f;
      f.hiredis_err = REDIS_ERR_IO;
      f.sys_errno = ETIMEDOUT;
      f.timed_out = true;
      f.message = "connect timed out";
      if (node_ != nullptr) node_->connect_failed(f.message);
      close(std::move(f));
      return;
    }
    if (!pending_.empty() && pending_.front().deadline <= now) {
      ConnectionFailure f;
      f.hiredis_err = REDIS_ERR_IO;
      f.sys_errno = ETIMEDOUT;
      f.timed_out = true;
      f.sent = true;
      f.message = "no reply in time";
      if (node_ != nullptr) {
        ++node_->stats_.timeouts;
        ++node_->stats_.dropped;
      }
      close(std::move(f));
      return;
    }
    Clock::time_point next =
        pending_.empty() ? Clock::time_point::max() : pending_.front().deadline;
    if (!connected_ && connect_deadline_ < next) next = connect_deadline_;
    if (next != Clock::time_point::max()) arm_timer(next);
  }

  void fail_later(ReplyCallback cb, ConnectionFailure f) {
    net::post(executor_, [cb = std::move(cb), f = std::move(f)]() mutable { cb(nullptr, &f); });
  }

  // hiredis is done with the context once the current call stack unwinds.
  void release_later() {
    if (!self_) return;
    net::post(executor_, [keep = std::move(self_)] {});
  }

  Node* node_;
  Executor executor_;
  redisAsyncContext* ac_ = nullptr;
  std::shared_ptr<HiredisAsio> adapter_;
  std::deque<Pending> pending_;
  net::steady_timer timer_;
  bool timer_armed_ = false;
  std::uint64_t timer_gen_ = 0;
  bool connected_ = false;
  Clock::time_point connect_deadline_{};
  std::chrono::milliseconds command_timeout_{1000};
  std::optional<ConnectionFailure> failure_;
  std::shared_ptr<Connection> self_;
};

Node::Node(Executor executor, ConnectionSettings settings)
    : executor_(std::move(executor)), settings_(std::move(settings)) {}

Node::~Node() {
  close();
  // A connection opened by a callback inside close() must not outlive its node either.
  if (conn_) {
    conn_->detach();
    close();
  }
}

void Node::close() {
  // Taken out first: the failure callbacks of its pending commands run inside close() and may
  // send again, which opens the node's next connection (kept, not dropped with this one).
  std::shared_ptr<Connection> c = std::move(conn_);
  if (!c) return;
  c->detach();
  ConnectionFailure f;
  f.hiredis_err = REDIS_ERR_OTHER;
  f.message = "the connection was closed by the client";
  c->close(std::move(f));
}

std::size_t Node::in_flight() const noexcept { return conn_ ? conn_->in_flight() : 0; }

void Node::send(std::string_view resp, ReplyCallback callback) {
  if (!conn_ || !conn_->alive()) {
    if (conn_) conn_->detach();
    conn_.reset();
    if (std::chrono::steady_clock::now() < down_until_) {
      ++stats_.fast_failures;
      ConnectionFailure f;
      f.server_down = true;
      f.message = down_reason_;
      net::post(executor_,
                [cb = std::move(callback), f = std::move(f)]() mutable { cb(nullptr, &f); });
      return;
    }
    auto c = std::make_shared<Connection>(this, executor_);
    std::string why;
    if (!c->start(settings_, why)) {
      connect_failed(why);
      ConnectionFailure f;
      f.hiredis_err = REDIS_ERR_IO;
      f.message = why;
      net::post(executor_,
                [cb = std::move(callback), f = std::move(f)]() mutable { cb(nullptr, &f); });
      return;
    }
    conn_ = std::move(c);
  }
  ++stats_.commands;
  conn_->send(resp, std::move(callback));
}

void Node::connect_failed(const std::string& why) {
  ++stats_.connect_failures;
  down_until_ = std::chrono::steady_clock::now() + settings_.reconnect_backoff;
  down_reason_ = why;
}

void Node::connected() {
  ++stats_.connects;
  down_until_ = {};
}

}  // namespace idem::async::detail
