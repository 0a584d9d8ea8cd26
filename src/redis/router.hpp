// SPDX-License-Identifier: MIT
// Where a command goes: one server, the master of a Sentinel service, or the Redis Cluster node
// that owns the key's hash slot (one pool per node in every case).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "hiredis_handles.hpp"
#include "idem/redis/redis_store.hpp"
#include "pool.hpp"
#include "uri.hpp"

namespace idem::redis::detail {

/// Number of hash slots of a Redis Cluster.
inline constexpr std::size_t kSlotCount = 16384;

/// CRC16/XMODEM (polynomial 0x1021, initial value 0), the Redis Cluster key hash.
std::uint16_t crc16(std::string_view bytes) noexcept;

/// The hash slot of `key` per the Redis Cluster spec: CRC16 of the part between the first '{'
/// and the next '}' when that part is non-empty, else of the whole key; mod 16384.
IDEM_EXPORT std::uint16_t key_slot(std::string_view key) noexcept;

/// A `-MOVED <slot> <host>:<port>` or `-ASK <slot> <host>:<port>` error reply, parsed.
struct Redirect {
  bool ask = false;  ///< ASK (one command, after ASKING) rather than MOVED (the slot moved)
  int slot = 0;      ///< the hash slot
  std::string host;  ///< may be empty: the server does not know its own address
  int port = 0;      ///< TCP port
};

/// Parses a MOVED or ASK error text; nullopt for any other text.
IDEM_EXPORT std::optional<Redirect> parse_redirect(std::string_view error_text);

/// Which layout a RedisStoreOptions::uri names.
struct Topology {
  enum class Kind { kSingle, kSentinel, kCluster };
  Kind kind = Kind::kSingle;
  /// kSingle: the server; kCluster: seed nodes; kSentinel: the sentinels (no credentials).
  std::vector<Endpoint> endpoints;
  /// kSentinel: the service (master name) the sentinels monitor.
  std::string service;
  /// kSentinel, kCluster: user, password and db for every data node found later.
  Endpoint node_template;
};

/// The layout's name in stats and messages: "redis", "redis-sentinel" or "redis-cluster".
inline std::string_view topology_name(Topology::Kind kind) noexcept {
  switch (kind) {
    case Topology::Kind::kSentinel:
      return "redis-sentinel";
    case Topology::Kind::kCluster:
      return "redis-cluster";
    case Topology::Kind::kSingle:
      break;
  }
  return "redis";
}

/// Parses `redis://`, `tcp://`, `unix://` (see parse_uri), `redis-cluster://[[user]:password@]
/// h:p[,h:p...]` and `redis-sentinel://[[user]:password@]h:p[,h:p...]/<service>[/db]`.
/// @throws idem::UsageError naming what is wrong (the password is never echoed).
IDEM_EXPORT Topology parse_topology(std::string_view uri);

/// Routes commands and keeps the pools (never freed before the router: a Pool* stays valid).
/// Thread-safe. Re-discovery (slot map, Sentinel master) runs on a calling thread, at most once
/// per `refresh_interval` when triggered by failures, and never by two threads at once.
class Router {
 public:
  /// @param pool base pool settings (endpoint replaced per node).
  Router(Topology topology, PoolSettings pool, std::chrono::milliseconds refresh_interval,
         std::chrono::milliseconds sentinel_check);
  ~Router();
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  /// True for a Redis Cluster (MOVED / ASK are followed).
  bool clustered() const noexcept { return kind_ == Topology::Kind::kCluster; }

  /// The pool that serves `key` now. Discovers the layout on first use.
  /// @throws StorageUnavailable when no node / master / slot owner is known and none is found.
  Pool& pool_for(std::string_view key);

  /// The pool of a node named by a redirect (created on first use). An empty host means the
  /// host of `answered_by`.
  Pool& node(const Redirect& r, const Pool& answered_by);

  /// A MOVED reply: the slot now belongs to r's node (the whole map is re-read soon).
  void moved(const Redirect& r, const Pool& answered_by);

  /// Counts an ASK redirect that was followed.
  void asked() noexcept { ask_.fetch_add(1, std::memory_order_relaxed); }

  /// A connection failure, or a reply saying the node is no longer a usable master (READONLY,
  /// MASTERDOWN, CLUSTERDOWN, LOADING): re-discover the layout soon.
  void failed() noexcept;

  /// The nodes that serve keys now, as far as the router knows (no discovery): the one server,
  /// the Sentinel master (none before discovery), or every master owning a slot of the map.
  std::vector<Pool*> serving_nodes() const;

  /// Counts a script (re)loaded after NOSCRIPT.
  void count_script_load() noexcept { script_loads_.fetch_add(1, std::memory_order_relaxed); }

  /// Pool counters summed over every node.
  RedisPoolStats pool_stats() const;

  /// Routing counters.
  RedisRouteStats route_stats() const;

  /// "redis", "redis-sentinel" or "redis-cluster".
  std::string_view name() const noexcept;

 private:
  Pool& add_node(const std::string& host, int port);
  void maybe_refresh(bool block);
  bool refresh_slots();    // cluster.cpp
  bool discover_master();  // router.cpp

  const Topology::Kind kind_;
  const Topology topology_;
  const PoolSettings base_;
  const std::chrono::milliseconds refresh_interval_;
  const std::chrono::milliseconds sentinel_check_;

  mutable std::mutex nodes_mutex_;            // guards nodes_ (append-only)
  std::vector<std::unique_ptr<Pool>> nodes_;  // data nodes
  std::vector<std::unique_ptr<Pool>> sentinels_;
  Pool* single_ = nullptr;                                             // kSingle
  std::atomic<Pool*> master_{nullptr};                                 // kSentinel
  std::unique_ptr<std::array<std::atomic<Pool*>, kSlotCount>> slots_;  // kCluster

  // Why the last discovery found nothing, node by node (for the errors pool_for throws).
  void note_refresh_failure(std::string why);
  std::string last_refresh_failure() const;
  mutable std::mutex failure_mutex_;  // guards last_failure_
  std::string last_failure_;

  std::mutex refresh_mutex_;  // one re-discovery at a time
  std::atomic<bool> stale_{true};
  std::atomic<std::int64_t> next_refresh_ns_{0};  // steady clock; no error-driven refresh before
  std::atomic<std::int64_t> next_check_ns_{0};    // steady clock; periodic Sentinel check

  std::atomic<std::uint64_t> moved_{0}, ask_{0}, refreshes_{0}, refresh_failures_{0},
      master_changes_{0}, script_loads_{0};
};

/// Sends one command on a connection of `pool`; a failed connection is dropped and thrown as an
/// idem exception (error replies are returned).
ReplyUPtr run_command(Pool& pool, std::string_view what, int argc, const char** argv,
                      const std::size_t* lens);

}  // namespace idem::redis::detail
