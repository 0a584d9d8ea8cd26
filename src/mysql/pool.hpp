// SPDX-License-Identifier: MIT
// A bounded pool of client connections, kept apart by autocommit mode.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "connection.hpp"

namespace idem::mysql::detail {

/// A bounded, thread-safe pool. Connections open lazily (at most `size`), broken ones are
/// closed instead of returned, and an idle connection is lent in the autocommit mode asked
/// for: transactional work runs on `autocommit = 0` sessions, where the first statement opens
/// the transaction (no BEGIN round trip), single statements and reads on `autocommit = 1`
/// ones (no COMMIT round trip). Each mode keeps its own idle list, so switching a session's
/// mode (one round trip) happens only when one mode has no idle connection left.
class Pool {
 public:
  Pool(ConnectSettings settings, std::size_t size, std::chrono::milliseconds wait);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  /// A lent connection (RAII: returned on destruction, closed if broken or dropped).
  class Lease {
   public:
    Lease(Lease&& other) noexcept : pool_(other.pool_), conn_(other.conn_) {
      other.conn_ = nullptr;
    }
    Lease& operator=(Lease&&) = delete;
    ~Lease() {
      if (conn_ != nullptr) pool_->give_back(conn_);
    }
    Connection& operator*() const noexcept { return *conn_; }
    Connection* operator->() const noexcept { return conn_; }
    /// Closes the connection instead of returning it.
    void drop() noexcept { conn_->mark_broken(); }

   private:
    friend class Pool;
    Lease(Pool* pool, Connection* conn) noexcept : pool_(pool), conn_(conn) {}
    Pool* pool_;
    Connection* conn_;
  };

  /// Lends a connection in `autocommit` mode.
  /// When the server refuses a new connection for its connection limit (max_connections,
  /// max_user_connections) while this pool holds others, waits for one of those instead.
  /// @throws idem::StorageUnavailable when none is free within the wait (the server's refusal
  ///         when it refused), or a new one cannot be opened (a non-retryable
  ///         idem::StorageError for bad credentials or database).
  Lease acquire(bool autocommit);

  /// Connections open (idle and lent).
  std::size_t open_connections() const;
  /// The settings connections open with.
  const ConnectSettings& settings() const noexcept { return settings_; }

 private:
  void give_back(Connection* conn) noexcept;

  ConnectSettings settings_;
  std::size_t size_;
  std::chrono::milliseconds wait_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Connection*> idle_[2];  // [0]: autocommit off, [1]: on
  std::size_t open_ = 0;
};

}  // namespace idem::mysql::detail
