// SPDX-License-Identifier: MIT
// The hand-written SQLite baselines of the benchmarks (bench/sqlite, bench/mq, bench/scale): the
// sqlite3 C API as a careful user writes it, with idem's connection settings (WAL,
// synchronous=NORMAL), prepared statements kept for the connection's life, and the seed tables'
// record recipe: a record row with a unique key on the business key, written in the same
// transaction as the business row; a duplicate is caught by the unique violation and answered
// by reading the stored response.
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace idem::bench {

/// One prepared statement (finalized with its owner).
class RawStatement {
 public:
  RawStatement(sqlite3* db, const std::string& sql) : db_(db) {
    if (sqlite3_prepare_v3(db, sql.c_str(), static_cast<int>(sql.size()), SQLITE_PREPARE_PERSISTENT,
                           &stmt_, nullptr) != SQLITE_OK) {
      throw std::runtime_error("bench: prepare '" + sql + "': " + sqlite3_errmsg(db));
    }
  }
  RawStatement(const RawStatement&) = delete;
  RawStatement& operator=(const RawStatement&) = delete;
  ~RawStatement() { sqlite3_finalize(stmt_); }

  RawStatement& text(int i, std::string_view v) {
    sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_STATIC);
    return *this;
  }
  RawStatement& blob(int i, std::string_view v) {
    sqlite3_bind_blob(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_STATIC);
    return *this;
  }
  RawStatement& integer(int i, std::int64_t v) {
    sqlite3_bind_int64(stmt_, i, v);
    return *this;
  }
  /// Steps once; SQLITE_ROW, SQLITE_DONE or an error code (the statement is then reset).
  int step() {
    const int rc = sqlite3_step(stmt_);
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) sqlite3_reset(stmt_);
    return rc;
  }
  /// Steps to the end and resets; throws on an error.
  void run() {
    const int rc = step();
    if (rc != SQLITE_DONE && rc != SQLITE_ROW) fail(rc);
    sqlite3_reset(stmt_);
  }
  void reset() { sqlite3_reset(stmt_); }
  sqlite3_stmt* get() const noexcept { return stmt_; }
  [[noreturn]] void fail(int rc) const {
    throw std::runtime_error(std::string("bench: ") + sqlite3_sql(stmt_) + ": " +
                             sqlite3_errstr(rc) + " (" + sqlite3_errmsg(db_) + ")");
  }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
};

/// A connection with idem's settings (WAL, synchronous=NORMAL, busy timeout).
class RawSqlite {
 public:
  explicit RawSqlite(const std::string& path) {
    if (sqlite3_open_v2(path.c_str(), &db_,
                        SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                        nullptr) != SQLITE_OK) {
      throw std::runtime_error("bench: cannot open " + path);
    }
    sqlite3_extended_result_codes(db_, 1);
    sqlite3_busy_timeout(db_, 10'000);
    exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL");
  }
  RawSqlite(const RawSqlite&) = delete;
  RawSqlite& operator=(const RawSqlite&) = delete;
  ~RawSqlite() { sqlite3_close_v2(db_); }

  void exec(const std::string& sql) {
    char* err = nullptr;
    if (sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
      std::string msg = err != nullptr ? err : "";
      sqlite3_free(err);
      throw std::runtime_error("bench: " + sql + ": " + msg);
    }
  }
  sqlite3* get() const noexcept { return db_; }

 private:
  sqlite3* db_ = nullptr;
};

/// The record table of the recipe, in the shape of the seed's `api_idempotency` (a surrogate
/// `id` primary key and a unique key on (idem_key, biz_type)), with only the columns the
/// guarantee needs: status and response. `without_rowid`: keyed by the unique key itself
/// (`PRIMARY KEY (idem_key, biz_type) WITHOUT ROWID`: one b-tree instead of two).
inline std::string raw_record_table_sql(const std::string& table, bool without_rowid) {
  if (without_rowid) {
    return "CREATE TABLE " + table +
           " (idem_key TEXT NOT NULL, biz_type TEXT NOT NULL, status TEXT NOT NULL,"
           " response_body BLOB, PRIMARY KEY (idem_key, biz_type)) WITHOUT ROWID";
  }
  return "CREATE TABLE " + table +
         " (id INTEGER PRIMARY KEY, idem_key TEXT NOT NULL, biz_type TEXT NOT NULL,"
         " status TEXT NOT NULL, response_body BLOB, UNIQUE (idem_key, biz_type))";
}

/// The recipe for one request: BEGIN IMMEDIATE; INSERT the record (status COMPLETED, the
/// response); the business statement; COMMIT. A unique violation on the record rolls back and
/// reads the stored response.
class RawRecordGuard {
 public:
  /// `business` is the business statement, its parameters bound by the caller's `bind`.
  RawRecordGuard(RawSqlite& db, const std::string& table, const std::string& business)
      : begin_(db.get(), "BEGIN IMMEDIATE"),
        commit_(db.get(), "COMMIT"),
        rollback_(db.get(), "ROLLBACK"),
        insert_(db.get(), "INSERT INTO " + table +
                              " (idem_key, biz_type, status, response_body)"
                              " VALUES (?1, ?2, 'COMPLETED', ?3)"),
        read_(db.get(), "SELECT status, response_body FROM " + table +
                            " WHERE idem_key = ?1 AND biz_type = ?2"),
        business_(db.get(), business) {}

  /// The business statement, to bind before run().
  RawStatement& business() noexcept { return business_; }

  /// Runs the request. @return nullopt when it ran; the stored response of a duplicate.
  std::optional<std::string> run(std::string_view scope, std::string_view id,
                                 std::string_view response) {
    begin_.run();
    const int rc = insert_.text(1, id).text(2, scope).blob(3, response).step();
    if ((rc & 0xFF) == SQLITE_CONSTRAINT) {
      rollback_.run();
      return read(scope, id);
    }
    if (rc != SQLITE_DONE) insert_.fail(rc);
    insert_.reset();
    business_.run();
    commit_.run();
    return std::nullopt;
  }

  /// The stored response of (scope, id) (a duplicate's answer); nullopt when absent.
  std::optional<std::string> read(std::string_view scope, std::string_view id) {
    std::optional<std::string> out;
    if (read_.text(1, id).text(2, scope).step() == SQLITE_ROW) {
      const void* p = sqlite3_column_blob(read_.get(), 1);
      const int n = sqlite3_column_bytes(read_.get(), 1);
      out.emplace(p == nullptr ? "" : static_cast<const char*>(p), static_cast<std::size_t>(n));
    }
    read_.reset();
    return out;
  }

 private:
  RawStatement begin_, commit_, rollback_, insert_, read_, business_;
};

}  // namespace idem::bench
