// SPDX-License-Identifier: MIT
// A bounded pool of libpqxx connections: lazy opening, bounded wait, broken ones replaced.
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <vector>

#include "errors.hpp"
#include "idem/postgres/postgres_store.hpp"

namespace idem::postgres {

struct detail::PoolSlot {
  std::unique_ptr<pqxx::connection> conn;
};

class IDEM_LOCAL ConnectionPool::Impl {
 public:
  Impl(std::string conninfo, std::size_t size, std::chrono::milliseconds wait, Setup setup)
      : conninfo_(std::move(conninfo)), size_(size), wait_(wait), setup_(std::move(setup)) {}

  ~Impl() {
    for (auto* s : idle_) delete s;
  }

  detail::PoolSlot* acquire() {
    const auto deadline = std::chrono::steady_clock::now() + wait_;
    // Set once the server refused a new connection for its connection limit while this pool
    // held others: from then on this call waits for one of them instead of opening one.
    std::exception_ptr server_full;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        auto ready = [&] { return !idle_.empty() || (!server_full && open_ < size_); };
        if (!cv_.wait_until(lock, deadline, ready)) {
          if (server_full) std::rethrow_exception(server_full);
          throw StorageUnavailable("postgres: connection pool exhausted: " + std::to_string(size_) +
                                   " connections in use for " + std::to_string(wait_.count()) +
                                   " ms");
        }
        if (!idle_.empty()) {
          auto* s = idle_.back();
          idle_.pop_back();
          return s;
        }
        ++open_;  // reserve a place, open outside the lock
      }
      try {
        auto slot = std::make_unique<detail::PoolSlot>();
        slot->conn = std::make_unique<pqxx::connection>(conninfo_);
        if (setup_) setup_(*slot->conn);
        return slot.release();
      } catch (const pqxx::broken_connection& e) {
        bool others = false;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          --open_;
          others = open_ > 0;
        }
        cv_.notify_one();
        // The server's connection limit (max_connections, a role's or database's CONNECTION
        // LIMIT): while this pool holds connections, one of them comes back soon, and the call
        // gets it within the pool's wait instead of failing at once.
        if (!others || !detail::is_connection_limit(e.what())) {
          detail::rethrow_translated("connect");
        }
        try {
          detail::rethrow_translated("connect");
        } catch (...) {
          server_full = std::current_exception();
        }
      } catch (...) {
        release_place_and_rethrow();
      }
    }
  }

  void give_back(detail::PoolSlot* slot, bool broken) noexcept {
    std::vector<detail::PoolSlot*> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (broken || !slot->conn->is_open()) {
        dropped.push_back(slot);
        // A connection that broke usually means the server restarted or the network failed:
        // the idle ones are most likely dead too, so drop them instead of failing on each.
        dropped.insert(dropped.end(), idle_.begin(), idle_.end());
        idle_.clear();
        open_ -= dropped.size();
      } else {
        idle_.push_back(slot);
      }
    }
    cv_.notify_all();
    for (auto* s : dropped) delete s;  // closes outside the lock
  }

  // A connection could not be opened: the place reserved for it is free again.
  [[noreturn]] void release_place_and_rethrow() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --open_;
    }
    cv_.notify_one();
    detail::rethrow_translated("connect");
  }

  std::size_t open() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return open_;
  }

 private:
  std::string conninfo_;
  std::size_t size_;
  std::chrono::milliseconds wait_;
  Setup setup_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<detail::PoolSlot*> idle_;
  std::size_t open_ = 0;
};

ConnectionPool::ConnectionPool(std::string conninfo, std::size_t size,
                               std::chrono::milliseconds wait, Setup setup)
    : impl_(std::make_unique<Impl>(std::move(conninfo), size, wait, std::move(setup))) {}

ConnectionPool::~ConnectionPool() = default;

PooledConnection ConnectionPool::acquire() { return PooledConnection(this, impl_->acquire()); }

std::size_t ConnectionPool::open_connections() const { return impl_->open(); }

void ConnectionPool::give_back(detail::PoolSlot* slot, bool broken) noexcept {
  impl_->give_back(slot, broken);
}

PooledConnection::PooledConnection(PooledConnection&& other) noexcept
    : pool_(other.pool_), slot_(other.slot_), broken_(other.broken_) {
  other.slot_ = nullptr;
}

PooledConnection::~PooledConnection() {
  if (slot_ != nullptr) pool_->give_back(slot_, broken_);
}

pqxx::connection& PooledConnection::get() const noexcept { return *slot_->conn; }

}  // namespace idem::postgres
