// SPDX-License-Identifier: MIT
// Where an asynchronous Redis command goes: one server, the master a Sentinel names, or the
// Redis Cluster node owning the key's hash slot; MOVED / ASK followed, the layout re-discovered
// after failures, every failure typed. The asynchronous twin of src/redis/router.hpp, built on
// the same URI parsing, hash slots and redirect parsing.
#pragma once

#include <array>
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "idem/async/function.hpp"
#include "idem/async/net.hpp"
#include "idem/redis/redis_store.hpp"
#include "redis/router.hpp"
#include "redis_connection.hpp"

namespace idem::async::detail {

/// The answer of a routed command: exactly one of `reply` (valid during the call only; error
/// replies other than followed redirects included) and `error` (an idem exception) is set.
using RoutedCallback = Function<void(const redisReply* reply, std::exception_ptr error)>;

/// What a command is, for error messages and the write-may-apply rule.
struct CommandInfo {
  const char* op = "call";  ///< "claim", "complete", ...
  bool write = false;       ///< a timeout after sending leaves the write's outcome unknown
};

/// Routing settings.
struct ClientSettings {
  ConnectionSettings connection;  ///< endpoint replaced per node
  std::chrono::milliseconds refresh_interval{100};
  std::chrono::milliseconds sentinel_check{1000};
};

/// Routes commands of one executor (see the file comment). Not thread-safe: every call on the
/// executor given at construction. Destroying it fails the commands still in flight.
class RedisClient {
 public:
  RedisClient(Executor executor, redis::detail::Topology topology, ClientSettings settings);
  ~RedisClient();
  RedisClient(const RedisClient&) = delete;
  RedisClient& operator=(const RedisClient&) = delete;

  /// Sends the command `resp` (RESP) about `key` (a Redis key) to the node serving it.
  /// `callback` runs on the executor, never inside command(). After close(): fails with
  /// StorageUnavailable.
  void command(std::string_view key, std::string resp, CommandInfo info, RoutedCallback callback);

  /// Closes every connection: commands in flight fail (StorageUnavailable), and so does every
  /// later one, including those their callbacks send while the connections close.
  void close();

  /// True for a Redis Cluster.
  bool clustered() const noexcept;
  /// "redis", "redis-sentinel" or "redis-cluster".
  std::string_view name() const noexcept;
  /// Routing counters.
  redis::RedisRouteStats route_stats() const;
  /// Connection counters summed over the data nodes.
  ConnectionStats connection_stats() const;
  /// Commands in flight on every node.
  std::size_t in_flight() const;

 private:
  struct Core;
  std::shared_ptr<Core> core_;
};

}  // namespace idem::async::detail
