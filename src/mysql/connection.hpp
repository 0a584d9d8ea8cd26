// SPDX-License-Identifier: MIT
// One client connection: its prepared-statement cache, binds and fetches, transaction
// tracking, and its autocommit mode.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "handles.hpp"
#include "idem/mysql/client.hpp"

namespace idem::mysql::detail {

/// What every connection of a pool is opened with.
struct ConnectSettings {
  ConnectionOptions options;
  /// Statements run once right after connecting (MYSQL_INIT_COMMAND, no extra round trip
  /// of their own), e.g. "SET SESSION innodb_lock_wait_timeout = 2".
  std::string init_sql;
};

/// One client connection (not thread-safe: one user at a time, lent by the Pool).
///
/// Statements are prepared on first use and cached by their text (up to kMaxStatements, then
/// the least recently used is closed; when the server's max_prepared_stmt_count is reached,
/// the least recently used half makes room). A connection that failed at the network level is
/// marked broken and must be dropped. Every failure is thrown through errors.cpp.
class Connection {
 public:
  /// Opens a connection (connect, read and write timeouts, utf8mb4, TCP unless a socket is
  /// given). @throws idem::StorageUnavailable when the server cannot be reached; a
  /// non-retryable idem::StorageError for bad credentials or an unknown database.
  explicit Connection(const ConnectSettings& settings);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  /// What an executed statement did.
  struct Outcome {
    std::uint64_t affected = 0;   ///< rows changed
    std::uint64_t insert_id = 0;  ///< AUTO_INCREMENT id / LAST_INSERT_ID(expr), else 0
  };

  /// Runs `sql` (prepared once, cached) with `params`; when `rows` is set, appends every
  /// result row to it. `what` names the operation in error messages.
  Outcome execute(std::string_view sql, const Param* params, std::size_t count, Rows* rows,
                  std::string_view what);

  /// Runs one statement through the text protocol and discards its results.
  void text(std::string_view sql, std::string_view what);

  /// COMMIT. @throws as execute (a lost connection here leaves the outcome unknown: callers
  /// resolve it).
  void commit(std::string_view what = "commit");
  /// ROLLBACK; a failure marks the connection broken (the server rolls back what a dropped
  /// connection had open).
  void rollback() noexcept;

  /// The session's autocommit mode (as last set by this object).
  bool autocommit() const noexcept { return autocommit_; }
  /// Switches autocommit (one round trip when it changes).
  void set_autocommit(bool on);

  /// True once a network failure made the connection unusable.
  bool broken() const noexcept { return broken_; }
  /// For an idle connection, before it is lent: true when the server has closed it meanwhile
  /// (wait_timeout, a restart, KILL): its socket is at end of file, or holds bytes nobody asked
  /// for and a ping fails. One non-blocking peek at the socket, no round trip, in the usual
  /// case.
  bool closed_by_server();
  void mark_broken() noexcept { broken_ = true; }

  /// Starts watching the open transaction (see Transaction::open): from now on, a statement
  /// that finds the transaction ended by the server throws, and so does every later one.
  void watch_transaction() noexcept;
  /// Stops watching (the transaction was committed or rolled back by its owner).
  void unwatch_transaction() noexcept;
  /// False once the server ended the watched transaction (deadlock rollback, implicit
  /// commit).
  bool transaction_open() const noexcept { return !ended_; }
  /// True when the server ended the watched transaction by rolling it back (1213 and
  /// friends), as opposed to committing it implicitly.
  bool transaction_rolled_back() const noexcept { return ended_ && ended_number_ != 0; }

  /// The last statement's insert id.
  std::uint64_t last_insert_id() const noexcept { return last_insert_id_; }
  /// The raw handle.
  MYSQL* handle() const noexcept { return mysql_.get(); }
  /// The read timeout in force (for telling a timeout from a lost connection).
  std::chrono::seconds read_timeout() const noexcept { return read_timeout_; }
  /// Whether the server rolls back the whole transaction on a lock wait timeout
  /// (innodb_rollback_on_timeout), read once at connect.
  bool rollback_on_timeout() const noexcept { return rollback_on_timeout_; }
  /// The session's max_allowed_packet, read at connect: the server copies it from the global
  /// value when the session starts and a session cannot change it, so it holds for this
  /// connection's life (a lowered global reaches new connections only). 0 if unknown.
  std::uint64_t max_allowed_packet() const noexcept { return max_allowed_packet_; }

  /// Most statements cached per connection.
  static constexpr std::size_t kMaxStatements = 256;

 private:
  struct Statement;
  Statement& prepare(std::string_view sql, std::string_view what);
  // Closes the `n` least recently used statements.
  void close_oldest(std::size_t n);
  [[noreturn]] void fail(unsigned number, const char* sqlstate, const char* message,
                         std::string_view what, std::chrono::steady_clock::time_point started);
  [[noreturn]] void fail_stmt(MYSQL_STMT* stmt, std::string_view what,
                              std::chrono::steady_clock::time_point started);
  [[noreturn]] void fail_conn(std::string_view what, std::chrono::steady_clock::time_point started);
  void check_watched(unsigned error_number);
  [[noreturn]] void throw_ended() const;

  MysqlPtr mysql_;
  // Keyed by a view of the Statement's own copy of its SQL (no allocation per lookup).
  std::unordered_map<std::string_view, std::unique_ptr<Statement>> statements_;
  std::list<Statement*> lru_;  // most recently used first
  std::vector<MYSQL_BIND> binds_;
  bool autocommit_ = true;
  bool broken_ = false;
  bool watching_ = false;
  bool seen_open_ = false;  // the watched transaction was seen open by the server
  bool ended_ = false;
  unsigned ended_number_ = 0;  // 0: implicit commit; else the error that rolled it back
  bool rollback_on_timeout_ = false;
  std::uint64_t max_allowed_packet_ = 0;
  std::uint64_t last_insert_id_ = 0;
  std::chrono::seconds read_timeout_{0};
};

}  // namespace idem::mysql::detail
