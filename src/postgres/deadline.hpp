// SPDX-License-Identifier: MIT
// The client-side bound on idem's waits on PostgreSQL (PostgresStoreOptions::client_timeout).
//
// TCP keepalives and tcp_user_timeout (set on every connection, see with_client_bounds) end a
// connection whose peer stopped acknowledging: a real partition. They cannot see a peer that
// keeps the TCP connection alive but answers nothing (a stalled proxy or pooler, a hung
// server): for that, every idem operation on a connection is armed here. When its deadline
// passes, the watch asks the server to cancel the backend's statement (pg_cancel_backend from
// its own connection, itself armed) and, if no answer came within a short grace, shuts the
// socket down, so the waiting call returns at once. The caller then drops the connection and
// throws StorageTimeout.
#pragma once

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <pqxx/pqxx>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace idem::postgres::detail {

/// The keyword/value pairs of a key=value conninfo string, read as libpq reads one: a
/// keyword, optional blanks, '=', optional blanks, then a value in single quotes (backslash
/// escapes any character) or up to the next blank (backslash escapes the next character). So
/// `password= dbname=x` sets the password to "dbname=x", as libpq reads it, and a `password=`
/// at the very end sets it empty. nullopt when the string is not well formed (libpq then
/// refuses it with its own message).
inline std::optional<std::vector<std::pair<std::string, std::string>>> conninfo_pairs(
    std::string_view s) {
  std::vector<std::pair<std::string, std::string>> out;
  auto blank = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  };
  std::size_t i = 0;
  const std::size_t n = s.size();
  for (;;) {
    while (i < n && blank(s[i])) ++i;
    if (i == n) return out;
    const std::size_t k = i;
    while (i < n && !blank(s[i]) && s[i] != '=') ++i;
    std::string key(s.substr(k, i - k));
    while (i < n && blank(s[i])) ++i;
    if (i == n || s[i] != '=' || key.empty()) return std::nullopt;
    ++i;
    while (i < n && blank(s[i])) ++i;
    std::string value;
    if (i < n && s[i] == '\'') {
      for (++i;; ++i) {
        if (i == n) return std::nullopt;  // unterminated quoted string
        if (s[i] == '\\') {
          if (++i == n) return std::nullopt;
        } else if (s[i] == '\'') {
          ++i;
          break;
        }
        value.push_back(s[i]);
      }
    } else {
      for (; i < n && !blank(s[i]); ++i) {
        if (s[i] == '\\' && ++i == n) break;  // libpq drops a backslash that ends the string
        value.push_back(s[i]);
      }
    }
    out.emplace_back(std::move(key), std::move(value));
  }
}

/// The libpq connection parameters that bound a wait on a dead peer to about `limit`:
/// keepalives, tcp_user_timeout and connect_timeout, each added only when `conninfo` does not
/// set it already. A key=value string is written back as keyword='value' pairs (as libpq read
/// it: `connect_timeout = 30` is the user's setting, and an empty value at the end cannot take
/// the next pair as its value) followed by the added ones; a postgresql:// URI gets them as
/// query parameters ("?key=value"). A string libpq cannot read is returned as it is.
inline std::string with_client_bounds(const std::string& conninfo,
                                      std::chrono::milliseconds limit) {
  if (limit.count() <= 0) return conninfo;
  const long long ms = limit.count();
  const long long idle = std::max(1LL, ms / 2000);  // seconds: probes start at half the limit
  const std::pair<const char*, std::string> bounds[] = {
      {"keepalives", "1"},
      {"keepalives_idle", std::to_string(idle)},
      {"keepalives_interval", "1"},
      {"keepalives_count", "2"},
      {"tcp_user_timeout", std::to_string(ms)},
      {"connect_timeout", std::to_string(std::max(2LL, (ms + 999) / 1000))},  // libpq: >= 2 s
  };
  const bool uri = conninfo.rfind("postgresql://", 0) == 0 || conninfo.rfind("postgres://", 0) == 0;
  std::vector<std::string> keys;  // what the user set
  std::string out;
  if (uri) {
    const std::size_t q = conninfo.find('?');
    for (std::size_t at = q; at != std::string::npos && at < conninfo.size();) {
      const std::size_t next = conninfo.find('&', at + 1);
      const std::string param =
          conninfo.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1);
      keys.push_back(param.substr(0, param.find('=')));
      at = next;
    }
    out = conninfo;
  } else {
    auto pairs = conninfo_pairs(conninfo);
    if (!pairs) return conninfo;
    for (const auto& [key, value] : *pairs) {
      keys.push_back(key);
      if (!out.empty()) out += ' ';
      out.append(key).append("='");
      for (char c : value) {
        if (c == '\'' || c == '\\') out.push_back('\\');
        out.push_back(c);
      }
      out.push_back('\'');
    }
  }
  for (const auto& [name, value] : bounds) {
    if (std::find(keys.begin(), keys.end(), name) != keys.end()) continue;  // the user's
    if (uri) {
      out += out.find('?') == std::string::npos ? '?' : '&';
    } else if (!out.empty()) {
      out += ' ';
    }
    out.append(name).append("=").append(value);
  }
  return out;
}

/// Arms deadlines on connections and enforces them from one thread (see the file comment).
class DeadlineWatch {
 public:
  using Clock = std::chrono::steady_clock;

  /// One armed wait: arm before the statements, destroy after (the connection must outlive it).
  class Armed {
   public:
    /// Arms `watch` (null: nothing is armed) on connection `c`; `cancel`: ask the server to
    /// cancel the statement at the deadline (else only the socket is shut down).
    template <class Connection>
    Armed(DeadlineWatch* watch, Connection& c, bool cancel = true) : watch_(watch) {
      if (watch_ == nullptr) return;
      sock_ = c.sock();
      pid_ = cancel ? c.backendpid() : 0;
      watch_->arm(this);
    }
    ~Armed() {
      if (watch_ != nullptr) watch_->disarm(this);
    }
    Armed(const Armed&) = delete;
    Armed& operator=(const Armed&) = delete;
    /// True once the deadline passed (the statement was cancelled or its socket shut down).
    bool expired() const noexcept { return expired_.load(std::memory_order_acquire); }

   private:
    friend class DeadlineWatch;
    DeadlineWatch* watch_;
    int sock_ = -1;
    int pid_ = 0;
    int stage_ = 0;  // 0 armed, 1 cancel asked, 2 socket shut down
    Clock::time_point due_{};
    Armed* prev_ = nullptr;
    Armed* next_ = nullptr;
    std::atomic<bool> expired_{false};
  };

  /// `limit`: how long an armed wait may last; `conninfo`: for the cancelling connection.
  DeadlineWatch(std::chrono::milliseconds limit, std::string conninfo)
      : limit_(limit),
        grace_(
            std::clamp(limit / 4, std::chrono::milliseconds(50), std::chrono::milliseconds(500))),
        tick_(std::clamp(limit / 10, std::chrono::milliseconds(5), std::chrono::milliseconds(100))),
        conninfo_(std::move(conninfo)) {
    watcher_ = std::thread([this] { watch(); });
    canceller_ = std::thread([this] { cancel_loop(); });
  }
  ~DeadlineWatch() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cancel_cv_.notify_all();
    canceller_.join();  // bounded: its own statement is armed, and the watcher still runs
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopped_ = true;
    }
    watch_cv_.notify_all();
    watcher_.join();
  }
  DeadlineWatch(const DeadlineWatch&) = delete;
  DeadlineWatch& operator=(const DeadlineWatch&) = delete;

  /// The bound of one armed wait.
  std::chrono::milliseconds limit() const noexcept { return limit_; }

 private:
  void arm(Armed* a) {
    a->due_ = Clock::now() + limit_;
    std::lock_guard<std::mutex> lock(mutex_);
    a->prev_ = tail_;
    if (tail_ != nullptr) {
      tail_->next_ = a;
    } else {
      head_ = a;
    }
    tail_ = a;
  }
  void disarm(Armed* a) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    (a->prev_ != nullptr ? a->prev_->next_ : head_) = a->next_;
    (a->next_ != nullptr ? a->next_->prev_ : tail_) = a->prev_;
  }

  // Every tick: ask the server to cancel what is past its deadline; shut down the sockets of
  // what is still waiting after the grace. Under the lock, so no armed connection goes away.
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopped_) {
      watch_cv_.wait_for(lock, tick_);
      const auto now = Clock::now();
      for (Armed* a = head_; a != nullptr; a = a->next_) {
        if (a->due_ > now) continue;
        if (a->stage_ == 0) {
          a->stage_ = 1;
          a->expired_.store(true, std::memory_order_release);
          a->due_ = now + grace_;
          if (a->pid_ != 0 && cancels_.size() < kMaxQueuedCancels) {
            cancels_.push_back(a->pid_);
            cancel_cv_.notify_one();
          }
        } else if (a->stage_ == 1) {
          a->stage_ = 2;
          if (a->sock_ >= 0) ::shutdown(a->sock_, SHUT_RDWR);  // the wait returns at once
        }
      }
    }
  }

  // pg_cancel_backend from a connection of its own (the backend pid is all it needs; a
  // PGcancel handle is not reachable through libpqxx 6). Best effort: the socket shutdown
  // bounds the wait whether or not the cancel gets through.
  void cancel_loop() {
    std::unique_ptr<pqxx::connection> conn;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      cancel_cv_.wait(lock, [&] { return stopping_ || !cancels_.empty(); });
      if (stopping_) return;
      const int pid = cancels_.front();
      cancels_.pop_front();
      lock.unlock();
      try {
        if (!conn) conn = std::make_unique<pqxx::connection>(conninfo_);
        Armed bound(this, *conn, false);
        pqxx::nontransaction nt(*conn);
        nt.exec("SELECT pg_cancel_backend(" + std::to_string(pid) + ")");
        if (bound.expired()) conn.reset();
      } catch (...) {
        conn.reset();  // reconnect for the next one
      }
      lock.lock();
    }
  }

  static constexpr std::size_t kMaxQueuedCancels = 256;
  const std::chrono::milliseconds limit_, grace_, tick_;
  const std::string conninfo_;
  std::mutex mutex_;
  std::condition_variable watch_cv_, cancel_cv_;
  Armed* head_ = nullptr;
  Armed* tail_ = nullptr;
  std::deque<int> cancels_;
  bool stopping_ = false, stopped_ = false;
  std::thread watcher_, canceller_;
};

}  // namespace idem::postgres::detail
