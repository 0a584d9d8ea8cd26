// SPDX-License-Identifier: MIT
// One rabbitmq-c connection with one channel: connect, setup, reconnect backoff, heartbeat
// thread, and the checks that turn replies into idem exceptions (errors.hpp).
#pragma once

#include <amqp.h>
#include <sys/time.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "idem/rabbitmq/client.hpp"

namespace idem::rabbitmq::detail {

/// amqp_connection_state_t, destroyed (socket closed) by the deleter.
struct StateDeleter {
  void operator()(amqp_connection_state_t s) const noexcept { amqp_destroy_connection(s); }
};
using StatePtr = std::unique_ptr<std::remove_pointer_t<amqp_connection_state_t>, StateDeleter>;

/// amqp_bytes_t over a string_view (rabbitmq-c does not write through it).
inline amqp_bytes_t bytes_of(std::string_view s) noexcept {
  amqp_bytes_t b;
  b.len = s.size();
  b.bytes = const_cast<char*>(s.data());
  return b;
}

/// The time left until `deadline` (0 when it passed), as rabbitmq-c's timeouts take it.
inline timeval timeout_until(std::chrono::steady_clock::time_point deadline) noexcept {
  auto left = std::chrono::duration_cast<std::chrono::microseconds>(
      deadline - std::chrono::steady_clock::now());
  if (left.count() < 0) left = std::chrono::microseconds(0);
  timeval tv{};
  tv.tv_sec = static_cast<decltype(tv.tv_sec)>(left.count() / 1000000);
  tv.tv_usec = static_cast<decltype(tv.tv_usec)>(left.count() % 1000000);
  return tv;
}

/// A string from amqp_bytes_t.
inline std::string str(amqp_bytes_t b) {
  return b.len == 0 ? std::string() : std::string(static_cast<const char*>(b.bytes), b.len);
}

/// One connection and its channel. Every member but the constructor, the destructor and
/// lock() expects the mutex held (lock()).
class Connection {
 public:
  using Clock = std::chrono::steady_clock;
  /// Runs on each new channel (declare, qos, consume, confirm.select), under the lock.
  using Setup = std::function<void()>;

  /// Parses the URL and checks the options (UsageError); starts the heartbeat thread.
  Connection(const ConnectionOptions& options, std::string role);
  /// Closes the connection and stops the heartbeat thread.
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  /// The setup run after every connect.
  void set_setup(Setup setup) { setup_ = std::move(setup); }
  /// The connection's mutex.
  std::unique_lock<std::mutex> lock() { return std::unique_lock<std::mutex>(mutex_); }

  /// Connects (and runs the setup) unless live. Waits for the reconnect backoff at most
  /// `budget` (unlocking `held` meanwhile). @throws idem::StorageUnavailable (refused, or still
  /// in backoff), StorageTimeout, StorageError (login refused, setup refused).
  void ensure(std::unique_lock<std::mutex>& held, std::chrono::milliseconds budget);
  /// True when connected.
  bool live() const noexcept { return state_ != nullptr; }
  /// The rabbitmq-c connection (live() only).
  amqp_connection_state_t state() const noexcept { return state_.get(); }
  /// The channel of the current connection.
  amqp_channel_t channel() const noexcept { return channel_; }
  /// The current connection's id (0 when none): each connect gets a new one.
  std::uint64_t id() const noexcept { return live() ? id_ : 0; }
  /// The options in force.
  const ConnectionOptions& options() const noexcept { return options_; }

  /// Marks a call of ours (the heartbeat thread stays quiet while calls keep coming).
  void touched() noexcept { last_call_ = Clock::now(); }
  enum class HeartbeatResult { kNotDue, kSent, kFailed };
  /// Sends a heartbeat frame if no call of ours ran for half the negotiated interval.
  /// kFailed: the send failed and the connection is dropped.
  HeartbeatResult heartbeat_if_due() noexcept;

  /// Throws (after dropping the connection) unless `r` is a normal reply.
  void check(const amqp_rpc_reply_t& r, std::string_view what);
  /// Checks the reply of the last synchronous method (amqp_get_rpc_reply).
  void check_last(std::string_view what);
  /// Drops the connection and throws the error of library status `status`.
  [[noreturn]] void fail_status(int status, std::string_view what, bool write_may_apply = false);
  /// A channel.close or connection.close the broker sent: answers close-ok, drops the
  /// connection and throws. Returns (doing nothing) for any other method.
  void fail_if_closed(const amqp_method_t& method, std::string_view what,
                      bool write_may_apply = false);
  /// Closes the socket at once (no close handshake); the next ensure() reconnects.
  void drop() noexcept;
  /// Closes gracefully (channel.close, connection.close, each within the RPC timeout).
  void close() noexcept;
  /// The counters.
  ConnectionStats stats() const noexcept { return stats_; }

 private:
  void connect_once();
  [[noreturn]] void fail_server(int code, std::string_view text, std::string_view what,
                                bool write_may_apply);
  void heartbeat_loop();
  void configure_tls(amqp_socket_t* socket, const std::string& what);

  ConnectionOptions options_;
  std::string role_;
  // The parsed URL (amqp_parse_url points into url_buffer_).
  std::string url_buffer_;
  std::string host_, user_, password_, vhost_;
  int port_ = 5672;
  bool tls_ = false;  // amqps://
  Setup setup_;

  std::mutex mutex_;
  StatePtr state_;
  amqp_channel_t channel_ = 1;
  std::uint64_t id_ = 0;
  std::uint64_t next_id_ = 0;
  std::chrono::milliseconds backoff_;
  Clock::time_point next_attempt_{};
  std::string last_error_;
  Clock::time_point last_call_{};
  ConnectionStats stats_;

  std::mutex stop_mutex_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread heartbeat_thread_;
};

/// Declares (or checks) `q` on `c`'s channel. @throws as Connection::check.
void declare_queue(Connection& c, const QueueOptions& q);

/// Checks queue options (UsageError).
void validate(const QueueOptions& q);

}  // namespace idem::rabbitmq::detail
