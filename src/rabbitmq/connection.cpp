// SPDX-License-Identifier: MIT
// One rabbitmq-c connection with one channel (see connection.hpp).
#include "connection.hpp"

#include <amqp_framing.h>
#include <amqp_ssl_socket.h>
#include <amqp_tcp_socket.h>
#include <arpa/inet.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/time.h>

#include <algorithm>
#include <vector>

#include "errors.hpp"
#include "idem/detail/readable_file.hpp"
#include "idem/detail/redact.hpp"
#include "idem/errors.hpp"

namespace idem::rabbitmq::detail {
namespace {

timeval to_timeval(std::chrono::milliseconds ms) noexcept {
  return timeout_until(std::chrono::steady_clock::now() + ms);
}

// Whether `host` is an IPv4 or IPv6 address rather than a name.
bool is_ip_address(const std::string& host) noexcept {
  unsigned char buf[sizeof(in6_addr)];
  return inet_pton(AF_INET, host.c_str(), buf) == 1 || inet_pton(AF_INET6, host.c_str(), buf) == 1;
}

amqp_table_entry_t utf8_entry(const char* key, std::string_view value) noexcept {
  amqp_table_entry_t e{};
  e.key = amqp_cstring_bytes(key);
  e.value.kind = AMQP_FIELD_KIND_UTF8;
  e.value.value.bytes = bytes_of(value);
  return e;
}

}  // namespace

Connection::Connection(const ConnectionOptions& options, std::string role)
    : options_(options), role_(std::move(role)), backoff_(options.reconnect_backoff) {
  const std::string who = "idem::rabbitmq::" + role_ + ": ";
  // At most a day: a larger wait overflowed the client's deadline arithmetic into a timeout
  // at once (a service that could never connect, told as a retryable StorageTimeout).
  constexpr std::chrono::milliseconds kDay = std::chrono::hours(24);
  if (options_.connect_timeout.count() <= 0 || options_.rpc_timeout.count() <= 0 ||
      options_.connect_timeout > kDay || options_.rpc_timeout > kDay) {
    throw UsageError(who + "connect_timeout and rpc_timeout must be positive and at most a day");
  }
  if (options_.reconnect_backoff.count() <= 0 ||
      options_.reconnect_backoff_max < options_.reconnect_backoff ||
      options_.reconnect_backoff_max > kDay) {
    throw UsageError(who +
                     "reconnect_backoff must be positive and at most reconnect_backoff_max, "
                     "itself at most a day");
  }
  if (options_.heartbeat.count() < 0 || options_.heartbeat.count() > 65535) {
    throw UsageError(who + "heartbeat must be between 0 and 65535 seconds");
  }
  url_buffer_ = options_.url;
  amqp_connection_info info{};
  amqp_default_connection_info(&info);
  if (url_buffer_.empty() || amqp_parse_url(url_buffer_.data(), &info) != AMQP_STATUS_OK) {
    throw UsageError(who + "not an amqp:// URL: '" + idem::detail::mask_refused_uri(options_.url) +
                     "' (expected amqp[s]://user:password@host:port/vhost, reserved characters "
                     "of the user name and password percent-encoded)");
  }
  tls_ = info.ssl != 0;
  if (!tls_ && (!options_.tls_ca.empty() || !options_.tls_cert.empty())) {
    throw UsageError(who + "tls_ca and tls_cert need an amqps:// URL");
  }
  if (options_.tls_cert.empty() != options_.tls_key.empty()) {
    throw UsageError(who + "tls_cert and tls_key go together");
  }
  idem::detail::require_readable_file(who, "tls_ca", options_.tls_ca);
  idem::detail::require_readable_file(who, "tls_cert", options_.tls_cert);
  idem::detail::require_readable_file(who, "tls_key", options_.tls_key);
  host_ = info.host;
  user_ = info.user;
  password_ = info.password;
  vhost_ = info.vhost;
  port_ = info.port;
  if (options_.heartbeat_thread && options_.heartbeat.count() > 0) {
    heartbeat_thread_ = std::thread([this] { heartbeat_loop(); });
  }
}

Connection::~Connection() {
  if (heartbeat_thread_.joinable()) {
    {
      std::lock_guard<std::mutex> l(stop_mutex_);
      stopping_ = true;
    }
    stop_cv_.notify_all();
    heartbeat_thread_.join();
  }
  std::lock_guard<std::mutex> l(mutex_);
  close();
}

void Connection::ensure(std::unique_lock<std::mutex>& held, std::chrono::milliseconds budget) {
  if (live()) return;
  auto now = Clock::now();
  if (now < next_attempt_) {
    const auto wait = next_attempt_ - now;
    const bool in_time = wait <= budget;
    held.unlock();
    std::this_thread::sleep_for(in_time ? wait : Clock::duration(budget));
    held.lock();
    if (live()) return;  // another caller connected meanwhile
    if (!in_time) {
      const std::string what = role_ + " connect to " + host_ + ":" + std::to_string(port_);
      throw_error(Failure{Failure::Kind::kBackoff, what, last_error_});
    }
  }
  try {
    connect_once();
    backoff_ = options_.reconnect_backoff;
  } catch (const std::exception& e) {
    state_.reset();
    ++stats_.failed_connects;
    last_error_ = e.what();
    next_attempt_ = Clock::now() + backoff_;
    backoff_ = std::min(backoff_ * 2, options_.reconnect_backoff_max);
    throw;
  }
}

void Connection::connect_once() {
  const std::string what = role_ + " connect to " + host_ + ":" + std::to_string(port_);
  StatePtr st(amqp_new_connection());
  if (!st) throw_error(Failure{Failure::Kind::kLibrary, what, {}, AMQP_STATUS_NO_MEMORY});
  // Owned by the state.
  amqp_socket_t* socket = tls_ ? amqp_ssl_socket_new(st.get()) : amqp_tcp_socket_new(st.get());
  if (socket == nullptr) {
    throw_error(Failure{Failure::Kind::kLibrary, what, {}, AMQP_STATUS_NO_MEMORY});
  }
  if (tls_) configure_tls(socket, what);
  timeval tv = to_timeval(options_.connect_timeout);
  int rc = amqp_socket_open_noblock(socket, host_.c_str(), port_, &tv);
  if (rc != AMQP_STATUS_OK) throw_error(Failure{Failure::Kind::kLibrary, what, {}, rc});
  amqp_set_handshake_timeout(st.get(), &tv);
  std::vector<amqp_table_entry_t> props;
  if (!options_.name.empty()) props.push_back(utf8_entry("connection_name", options_.name));
  amqp_table_t table{static_cast<int>(props.size()), props.empty() ? nullptr : props.data()};
  state_ = std::move(st);
  check(amqp_login_with_properties(state_.get(), vhost_.c_str(), 0, AMQP_DEFAULT_FRAME_SIZE,
                                   static_cast<int>(options_.heartbeat.count()), &table,
                                   AMQP_SASL_METHOD_PLAIN, user_.c_str(), password_.c_str()),
        what + ": login");
  timeval rpc = to_timeval(options_.rpc_timeout);
  amqp_set_rpc_timeout(state_.get(), &rpc);
  channel_ = 1;
  amqp_channel_open(state_.get(), channel_);
  check_last("channel.open");
  if (setup_) setup_();
  id_ = ++next_id_;
  ++stats_.connects;
  touched();
}

// The broker is authenticated: its certificate must chain to tls_ca (else the system's trust
// store) and name the URL's host. TLS 1.2 at least; a client certificate when given.
// rabbitmq-c's own host check compares DNS names only, so a URL's IP address is checked by
// OpenSSL against the certificate's IP entries instead, during the handshake.
void Connection::configure_tls(amqp_socket_t* socket, const std::string& what) {
  amqp_ssl_socket_set_verify_peer(socket, 1);
  const bool by_address = is_ip_address(host_);
  amqp_ssl_socket_set_verify_hostname(socket, by_address ? 0 : 1);
  int rc = amqp_ssl_socket_set_ssl_versions(socket, AMQP_TLSv1_2, AMQP_TLSvLATEST);
  if (rc == AMQP_STATUS_OK && by_address) {
    auto* ctx = static_cast<SSL_CTX*>(amqp_ssl_socket_get_context(socket));
    if (ctx == nullptr ||
        X509_VERIFY_PARAM_set1_ip_asc(SSL_CTX_get0_param(ctx), host_.c_str()) != 1) {
      rc = AMQP_STATUS_SSL_ERROR;
    }
  }
  if (rc == AMQP_STATUS_OK) {
    if (!options_.tls_ca.empty()) {
      rc = amqp_ssl_socket_set_cacert(socket, options_.tls_ca.c_str());
    } else {
      auto* ctx = static_cast<SSL_CTX*>(amqp_ssl_socket_get_context(socket));
      if (ctx == nullptr || SSL_CTX_set_default_verify_paths(ctx) != 1) rc = AMQP_STATUS_SSL_ERROR;
    }
  }
  if (rc == AMQP_STATUS_OK && !options_.tls_cert.empty()) {
    rc = amqp_ssl_socket_set_key(socket, options_.tls_cert.c_str(), options_.tls_key.c_str());
  }
  if (rc != AMQP_STATUS_OK) {
    throw UsageError("idem::rabbitmq::" + what + ": the TLS files were refused (" +
                     amqp_error_string2(rc) + "): check tls_ca, tls_cert and tls_key");
  }
}

Connection::HeartbeatResult Connection::heartbeat_if_due() noexcept {
  if (!live()) return HeartbeatResult::kNotDue;
  const int interval = amqp_get_heartbeat(state_.get());
  if (interval <= 0) return HeartbeatResult::kNotDue;
  const auto now = Clock::now();
  if (now - last_call_ < std::chrono::milliseconds(interval * 500)) return HeartbeatResult::kNotDue;
  amqp_frame_t f{};
  f.frame_type = AMQP_FRAME_HEARTBEAT;
  f.channel = 0;
  if (amqp_send_frame(state_.get(), &f) != AMQP_STATUS_OK) {
    drop();
    return HeartbeatResult::kFailed;
  }
  last_call_ = now;
  return HeartbeatResult::kSent;
}

void Connection::heartbeat_loop() {
  const auto period = std::clamp<std::chrono::milliseconds>(
      std::chrono::duration_cast<std::chrono::milliseconds>(options_.heartbeat) / 4,
      std::chrono::milliseconds(50), std::chrono::milliseconds(5000));
  std::unique_lock<std::mutex> stop(stop_mutex_);
  while (!stop_cv_.wait_for(stop, period, [this] { return stopping_; })) {
    // A caller holding the lock is inside rabbitmq-c (which heartbeats while it waits) or
    // about to be: skip this round rather than wait behind it.
    std::unique_lock<std::mutex> l(mutex_, std::try_to_lock);
    if (l.owns_lock() && heartbeat_if_due() == HeartbeatResult::kSent) ++stats_.thread_heartbeats;
  }
}

void Connection::check(const amqp_rpc_reply_t& r, std::string_view what) {
  switch (r.reply_type) {
    case AMQP_RESPONSE_NORMAL:
      return;
    case AMQP_RESPONSE_LIBRARY_EXCEPTION:
      fail_status(r.library_error, what);
    case AMQP_RESPONSE_SERVER_EXCEPTION:
      fail_if_closed(r.reply, what);
      break;
    case AMQP_RESPONSE_NONE:
      break;
  }
  drop();
  throw_error(Failure{Failure::Kind::kProtocol, what, {}});
}

void Connection::check_last(std::string_view what) {
  check(amqp_get_rpc_reply(state_.get()), what);
}

void Connection::fail_status(int status, std::string_view what, bool write_may_apply) {
  drop();
  throw_error(Failure{Failure::Kind::kLibrary, what, {}, status, 0, write_may_apply});
}

void Connection::fail_if_closed(const amqp_method_t& method, std::string_view what,
                                bool write_may_apply) {
  if (method.id == AMQP_CONNECTION_CLOSE_METHOD) {
    const auto* m = static_cast<const amqp_connection_close_t*>(method.decoded);
    const int code = m->reply_code;
    const std::string text = str(m->reply_text);
    amqp_connection_close_ok_t ok{};
    amqp_send_method(state_.get(), 0, AMQP_CONNECTION_CLOSE_OK_METHOD, &ok);
    fail_server(code, text, what, write_may_apply);
  }
  if (method.id == AMQP_CHANNEL_CLOSE_METHOD) {
    const auto* m = static_cast<const amqp_channel_close_t*>(method.decoded);
    const int code = m->reply_code;
    const std::string text = str(m->reply_text);
    amqp_channel_close_ok_t ok{};
    amqp_send_method(state_.get(), channel_, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
    // The channel's consumer, confirm mode and delivery tags are gone with it: start over on
    // a new connection rather than re-open channels on this one.
    fail_server(code, text, what, write_may_apply);
  }
}

void Connection::fail_server(int code, std::string_view text, std::string_view what,
                             bool write_may_apply) {
  const std::string message(text);
  drop();
  throw_error(Failure{Failure::Kind::kServer, what, message, 0, code, write_may_apply});
}

void Connection::drop() noexcept {
  if (!state_) return;
  state_.reset();
  if (id_ != 0) {
    ++stats_.connection_losses;
    id_ = 0;
    // A broker that just went away may be back soon: try again at once, then back off.
    next_attempt_ = Clock::now();
    backoff_ = options_.reconnect_backoff;
  }
}

void Connection::close() noexcept {
  if (!state_) return;
  amqp_channel_close(state_.get(), channel_, AMQP_REPLY_SUCCESS);
  amqp_connection_close(state_.get(), AMQP_REPLY_SUCCESS);
  state_.reset();
  id_ = 0;
}

void validate(const QueueOptions& q) {
  if (q.name.empty()) throw UsageError("idem::rabbitmq: a queue needs a name");
  if (q.type == QueueType::kQuorum && !q.durable) {
    throw UsageError("idem::rabbitmq: quorum queues are always durable (queue '" + q.name + "')");
  }
  if (q.delivery_limit != 0 && q.type != QueueType::kQuorum) {
    throw UsageError("idem::rabbitmq: delivery_limit needs a quorum queue (queue '" + q.name +
                     "')");
  }
}

void declare_queue(Connection& c, const QueueOptions& q) {
  std::vector<amqp_table_entry_t> args;
  if (q.type == QueueType::kQuorum) args.push_back(utf8_entry("x-queue-type", "quorum"));
  if (!q.dead_letter_exchange.empty()) {
    args.push_back(utf8_entry("x-dead-letter-exchange", q.dead_letter_exchange));
  }
  if (!q.dead_letter_routing_key.empty()) {
    args.push_back(utf8_entry("x-dead-letter-routing-key", q.dead_letter_routing_key));
  }
  if (q.delivery_limit != 0) {
    amqp_table_entry_t e{};
    e.key = amqp_cstring_bytes("x-delivery-limit");
    e.value.kind = AMQP_FIELD_KIND_I64;
    e.value.value.i64 = q.delivery_limit;
    args.push_back(e);
  }
  amqp_table_t table{static_cast<int>(args.size()), args.empty() ? nullptr : args.data()};
  amqp_queue_declare(c.state(), c.channel(), bytes_of(q.name), q.declare ? 0 : 1, q.durable ? 1 : 0,
                     0, 0, table);
  c.check_last("queue.declare " + q.name);
}

}  // namespace idem::rabbitmq::detail
