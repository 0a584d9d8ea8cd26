// SPDX-License-Identifier: MIT
// A bounded pool of client connections, kept apart by autocommit mode.
#include "pool.hpp"

#include <exception>
#include <string>

#include "errors.hpp"
#include "idem/detail/readable_file.hpp"
#include "idem/errors.hpp"
#include "idem/mysql/client.hpp"

namespace idem::mysql::detail {
namespace {

// Options that cannot work are configuration errors, told before any connection: timeouts
// the client library cannot hold (it takes whole seconds as an unsigned int, where 0 means
// "wait forever": a larger value wrapped to a call that never returned), a port that is none,
// and TLS settings that cannot work (the client library would only say "SSL connection
// error" at every connect). The bounds are the URI's (parse_uri).
void check_options(const ConnectionOptions& o) {
  const std::pair<const char*, std::pair<std::chrono::seconds, long long>> timeouts[] = {
      {"connect_timeout", {o.connect_timeout, 3600}},
      {"read_timeout", {o.read_timeout, 86400}},
      {"write_timeout", {o.write_timeout, 86400}}};
  for (const auto& [name, value] : timeouts) {
    if (value.first.count() < 1 || value.first.count() > value.second) {
      throw UsageError("idem::mysql: ConnectionOptions::" + std::string(name) + " is " +
                       std::to_string(value.first.count()) + " s; it must be 1 to " +
                       std::to_string(value.second) + " seconds");
    }
  }
  if (o.port > 65535) {
    throw UsageError("idem::mysql: ConnectionOptions::port " + std::to_string(o.port) +
                     " is not a TCP port");
  }
  if (o.tls_cert.empty() != o.tls_key.empty()) {
    throw UsageError("idem::mysql: tls_cert and tls_key go together");
  }
  const std::string who = "idem::mysql: ";
  idem::detail::require_readable_file(who, "tls_ca", o.tls_ca);
  idem::detail::require_readable_file(who, "tls_cert", o.tls_cert);
  idem::detail::require_readable_file(who, "tls_key", o.tls_key);
}

}  // namespace

Pool::Pool(ConnectSettings settings, std::size_t size, std::chrono::milliseconds wait)
    : settings_(std::move(settings)), size_(size), wait_(wait) {
  check_options(settings_.options);
}

Pool::~Pool() {
  for (auto& list : idle_) {
    for (Connection* c : list) delete c;
  }
}

Pool::Lease Pool::acquire(bool autocommit) {
  const auto deadline = std::chrono::steady_clock::now() + wait_;
  // Set once the server refused a new connection for its connection limit while this pool
  // held others: from then on this call waits for one of them instead of opening one.
  std::exception_ptr server_full;
  Connection* conn = nullptr;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      auto idle = [&] { return !idle_[0].empty() || !idle_[1].empty(); };
      auto ready = [&] { return idle() || (!server_full && open_ < size_); };
      if (!cv_.wait_until(lock, deadline, ready)) {
        if (server_full) std::rethrow_exception(server_full);
        throw StorageUnavailable("mysql: connection pool exhausted: " + std::to_string(size_) +
                                 " connections in use for " + std::to_string(wait_.count()) +
                                 " ms");
      }
      auto& same = idle_[autocommit ? 1 : 0];
      auto& other = idle_[autocommit ? 0 : 1];
      if (!same.empty()) {
        conn = same.back();
        same.pop_back();
      } else if (!server_full && open_ < size_) {
        ++open_;  // a place reserved; the connection opens outside the lock
      } else {
        conn = other.back();
        other.pop_back();
      }
    }
    if (conn != nullptr && conn->closed_by_server()) {
      // Closed while idle (wait_timeout, a restart, KILL): replaced before anything runs on
      // it, in its place in the pool (its place is this call's to fill or give up).
      delete conn;
      conn = nullptr;
    }
    if (conn != nullptr) break;
    try {  // this call holds a place in open_
      conn = new Connection(settings_);
      break;
    } catch (const ServerError& e) {
      bool others = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --open_;
        others = open_ > 0;
      }
      cv_.notify_one();
      // The server's (or this user's) connection limit: while this pool holds connections,
      // one of them comes back soon, and a call gets it within the pool's wait instead of
      // failing at once.
      if (!others || !is_connection_limit(e.error_number())) throw;
      server_full = std::current_exception();
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --open_;
      }
      cv_.notify_one();
      throw;
    }
  }
  Lease lease(this, conn);
  // A switch is one round trip; on failure the lease closes the connection.
  conn->set_autocommit(autocommit);
  return lease;
}

void Pool::give_back(Connection* conn) noexcept {
  if (!conn->broken() && (conn->handle()->server_status & SERVER_STATUS_IN_TRANS) != 0) {
    conn->rollback();  // never lend a connection with a transaction still open
  }
  conn->unwatch_transaction();
  std::vector<Connection*> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (conn->broken()) {
      dropped.push_back(conn);
      // A connection that broke usually means the server restarted or the network failed:
      // the idle ones are most likely dead too, so close them instead of failing on each.
      for (auto& list : idle_) {
        dropped.insert(dropped.end(), list.begin(), list.end());
        list.clear();
      }
      open_ -= dropped.size();
    } else {
      idle_[conn->autocommit() ? 1 : 0].push_back(conn);
    }
  }
  cv_.notify_all();
  for (Connection* c : dropped) delete c;  // closes outside the lock
}

std::size_t Pool::open_connections() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return open_;
}

}  // namespace idem::mysql::detail
