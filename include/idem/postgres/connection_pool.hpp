// SPDX-License-Identifier: MIT
// idem::postgres: the bounded libpqxx connection pool of the PostgreSQL adapter.
//
// File: postgres/connection_pool.hpp
//
// `ConnectionPool` lends `pqxx::connection`s (RAII `PooledConnection`): at most `size` open,
// opened lazily with the owner's setup (prepared statements, session settings), closed instead
// of returned when they broke, and a borrower waits at most `wait` before
// `idem::StorageUnavailable`. `PostgresStore::pool()` is the store's; business code may borrow
// from it for statements outside a guarded call.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <pqxx/pqxx>
#include <string>

#include "idem/export.hpp"

namespace idem::postgres {

namespace detail {
struct PoolSlot;  // one pooled connection (src/postgres/connection_pool.cpp)
}  // namespace detail

/// A connection lent by the pool (RAII: returned on destruction, dropped if it broke).
class IDEM_EXPORT PooledConnection {
 public:
  /// Takes over `other`'s loan (`other` then returns nothing).
  PooledConnection(PooledConnection&& other) noexcept;
  PooledConnection& operator=(PooledConnection&&) = delete;
  PooledConnection(const PooledConnection&) = delete;
  /// Returns the connection to the pool, or closes it if it broke.
  ~PooledConnection();
  /// The libpqxx connection (valid while this object lives).
  pqxx::connection& get() const noexcept;
  /// Marks the connection unusable: it is closed instead of returned.
  void mark_broken() noexcept { broken_ = true; }

 private:
  friend class ConnectionPool;
  PooledConnection(class ConnectionPool* pool, detail::PoolSlot* slot) noexcept
      : pool_(pool), slot_(slot) {}
  ConnectionPool* pool_;
  detail::PoolSlot* slot_;
  bool broken_ = false;
};

/// A bounded, thread-safe pool of libpqxx connections. Connections are opened lazily, get the
/// store's prepared statements and session settings, and are replaced when they break.
class IDEM_EXPORT ConnectionPool {
 public:
  /// Connection setup run once per new connection (prepare statements, SET ...).
  using Setup = std::function<void(pqxx::connection&)>;
  /// @param conninfo libpq conninfo or URI; @param size most connections; @param wait how
  /// long `acquire` waits when all are in use; @param setup run on each new connection.
  ConnectionPool(std::string conninfo, std::size_t size, std::chrono::milliseconds wait,
                 Setup setup);
  /// Closes the idle connections. Every PooledConnection must have been returned.
  ~ConnectionPool();
  ConnectionPool(const ConnectionPool&) = delete;
  ConnectionPool& operator=(const ConnectionPool&) = delete;

  /// Lends a connection. @throws idem::StorageUnavailable when none is free within the wait,
  /// or a new connection cannot be opened.
  PooledConnection acquire();
  /// Connections currently open (idle + lent).
  std::size_t open_connections() const;

 private:
  friend class PooledConnection;
  void give_back(detail::PoolSlot* slot, bool broken) noexcept;
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::postgres
