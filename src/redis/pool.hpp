// SPDX-License-Identifier: MIT
// A bounded, thread-safe pool of hiredis connections with RAII checkout.
#pragma once

#include <hiredis/hiredis.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "hiredis_handles.hpp"
#include "idem/export.hpp"
#include "idem/redis/redis_store.hpp"
#include "tls.hpp"
#include "uri.hpp"

namespace idem::redis::detail {

/// Pool settings (zeros already replaced by defaults).
struct PoolSettings {
  Endpoint endpoint;
  std::size_t size = 8;
  std::chrono::milliseconds connect_timeout{500};
  std::chrono::milliseconds command_timeout{1000};
  std::chrono::milliseconds wait_timeout{100};
  std::chrono::milliseconds reconnect_backoff{100};
  /// rediss://: opens the connections over TLS (shared by every pool of one store); null: TCP.
  std::shared_ptr<TlsConnector> tls;
};

/// Connections are made on demand up to `size`, kept idle between calls, and dropped when
/// they break. When one breaks because the server went away (EOF, reset, refused), every
/// connection opened before is stale too: the pool's epoch moves on and idle connections of
/// older epochs are dropped at checkout instead of failing one call each. After a failed
/// connect, callers fail at once for `reconnect_backoff` (one caller probes per period), so a
/// dead server costs microseconds per call, and a server that comes back is found within a
/// backoff period.
/// Exported from a shared libidem_redis for libidem_mq, which runs on it (not API).
class IDEM_EXPORT Pool {
 public:
  explicit Pool(PoolSettings settings);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  struct Connection {
    ContextUPtr context;
    std::uint64_t epoch = 0;
  };

  /// A lent connection; given back on destruction unless discarded.
  class Lease {
   public:
    Lease(Lease&& other) noexcept : pool_(other.pool_), conn_(std::move(other.conn_)) {
      other.pool_ = nullptr;
    }
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    ~Lease() {
      if (pool_ != nullptr) pool_->give_back(std::move(conn_));
    }
    /// The hiredis context (valid until discard or destruction).
    redisContext* get() const noexcept { return conn_.context.get(); }
    /// Drops the connection (it failed). `server_gone`: older connections are stale too.
    void discard(bool server_gone) noexcept {
      if (pool_ != nullptr) pool_->drop(std::move(conn_), server_gone);
      pool_ = nullptr;
    }

   private:
    friend class Pool;
    Lease(Pool* pool, Connection conn) noexcept : pool_(pool), conn_(std::move(conn)) {}
    Pool* pool_;
    Connection conn_;
  };

  /// Lends a connection: idle, new, or freed within wait_timeout.
  /// @param what names the call for error messages (only read on failure).
  /// @throws StorageUnavailable (exhausted, server down), StorageTimeout (connect timed out),
  ///         StorageError (AUTH/SELECT refused).
  Lease acquire(std::string_view what);

  /// Counts a NOSCRIPT reload (for stats).
  void count_script_load() noexcept;

  /// Counters.
  RedisPoolStats stats() const;

  /// Settings in force.
  const PoolSettings& settings() const noexcept { return settings_; }

 private:
  Connection connect();  // no lock held; throws
  void give_back(Connection conn) noexcept;
  void drop(Connection conn, bool server_gone) noexcept;

  const PoolSettings settings_;
  mutable std::mutex mutex_;
  std::condition_variable freed_;
  std::vector<Connection> idle_;
  std::size_t open_ = 0;  // idle + lent + being connected
  std::uint64_t epoch_ = 0;
  // Server-down state: set by a failed connect, cleared by a successful one.
  bool down_ = false;
  bool probing_ = false;
  std::chrono::steady_clock::time_point next_probe_{};
  std::string last_error_;
  bool last_error_tls_ = false;  // the last connect failed TLS checks: not a server outage
  RedisPoolStats stats_;
};

}  // namespace idem::redis::detail
