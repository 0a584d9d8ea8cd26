// SPDX-License-Identifier: MIT
// One asynchronous Redis connection (hiredis async on Asio) and a node that keeps one open:
// connect with a deadline, AUTH / SELECT, pipelined commands each with a reply deadline,
// reconnects with a backoff, every failure described for idem's one error choke point.
#pragma once

#include <hiredis/async.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>

#include "hiredis_asio.hpp"
#include "idem/async/function.hpp"
#include "idem/async/net.hpp"
#include "redis/uri.hpp"

namespace idem::async::detail {

/// Why a command got no reply: what errors.cpp's throw_error needs (kContext failures).
struct ConnectionFailure {
  int hiredis_err = 0;        ///< REDIS_ERR_* (REDIS_ERR_IO with ETIMEDOUT for a timeout)
  int sys_errno = 0;          ///< errno when hiredis failed, ETIMEDOUT for a timeout
  std::string message;        ///< hiredis errstr or our own description
  bool timed_out = false;     ///< the reply (or the connect) did not come in time
  bool sent = false;          ///< the command may have reached the server (a write may apply)
  bool server_down = false;   ///< failed fast: a connect failed less than a backoff ago
  bool server_reply = false;  ///< the server refused the connection's setup (AUTH, SELECT):
                              ///< `message` holds its error reply
};

/// A command's answer: exactly one of `reply` (valid during the call only; error replies too)
/// and `failure` is non-null.
using ReplyCallback = Function<void(const redisReply* reply, const ConnectionFailure* failure)>;

/// Settings of every connection of a node.
struct ConnectionSettings {
  redis::detail::Endpoint endpoint;
  std::chrono::milliseconds connect_timeout{500};
  std::chrono::milliseconds command_timeout{1000};
  std::chrono::milliseconds reconnect_backoff{100};
};

/// Counters of a node's connections.
struct ConnectionStats {
  std::uint64_t connects = 0;          ///< connections established
  std::uint64_t connect_failures = 0;  ///< connects that failed or timed out
  std::uint64_t dropped = 0;           ///< established connections that broke or timed out
  std::uint64_t fast_failures = 0;     ///< commands refused during the reconnect backoff
  std::uint64_t timeouts = 0;          ///< replies that did not come within command_timeout
  std::uint64_t commands = 0;          ///< commands sent
};

class Connection;

/// One Redis server as seen from one executor: keeps one connection open (opened on demand,
/// replaced when it breaks), pipelines every command on it, and fails fast while the server is
/// down. Not thread-safe: every call on the executor given at construction.
class Node {
 public:
  Node(Executor executor, ConnectionSettings settings);
  ~Node();  // closes the connection: pending commands get a failure
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  /// Sends one command, `resp` being its RESP encoding. `callback` runs on the executor, later
  /// (never inside send()).
  void send(std::string_view resp, ReplyCallback callback);

  /// Closes the connection (pending commands fail as closed); the next send reconnects.
  void close();

  const ConnectionSettings& settings() const noexcept { return settings_; }
  const ConnectionStats& stats() const noexcept { return stats_; }
  /// Commands sent and not yet answered.
  std::size_t in_flight() const noexcept;

 private:
  friend class Connection;
  void connect_failed(const std::string& why);
  void connected();

  Executor executor_;
  ConnectionSettings settings_;
  std::shared_ptr<Connection> conn_;
  std::chrono::steady_clock::time_point down_until_{};
  std::string down_reason_;
  ConnectionStats stats_;
};

/// Formats a command as RESP into `out` (appended).
void append_resp(std::string& out, int argc, const std::string_view* argv);

}  // namespace idem::async::detail
