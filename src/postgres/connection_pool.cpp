// SPDX-License-Identifier: MIT
// A bounded pool of libpqxx connections: lazy opening, bounded wait, broken ones replaced.
#include <condition_variable>
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
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!cv_.wait_for(lock, wait_, [&] { return !idle_.empty() || open_ < size_; })) {
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
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --open_;
      }
      cv_.notify_one();
      detail::rethrow_translated("connect");
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
