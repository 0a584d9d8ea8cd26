// SPDX-License-Identifier: MIT
// idem::sqlite::SqliteAttemptLedger: failed attempts per MQ message, durable across restarts.
//
// File: sqlite/attempt_ledger.hpp
//
// Table `mq_consume_attempt (message_id, consumer_group, failures, last_error, updated_at,
// UNIQUE (message_id, consumer_group))`. A failure is one upsert
//
//   INSERT ... VALUES (?, ?, 1, ?, ?)
//   ON CONFLICT (message_id, consumer_group)
//   DO UPDATE SET failures = failures + 1, ... RETURNING failures
//
// so concurrent consumers (threads or processes sharing the file) never lose a count, and a
// restarted consumer continues from the stored count instead of granting a poison message
// max_attempts fresh tries. The statement is PostgreSQL-compatible apart from the `?`
// placeholders. Rows are written only for failures (the success path costs nothing) and are
// deleted when the message succeeds on a redelivery or is dead-lettered.
//
// Header-only over idem::sqlite's Database (link idem::sqlite).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "idem/clock.hpp"
#include "idem/attempt_ledger.hpp"
#include "idem/errors.hpp"
#include "idem/key.hpp"
#include "idem/sql.hpp"
#include "idem/sqlite/sqlite_store.hpp"

namespace idem::sqlite {

/// Durable AttemptLedger in a SQLite database (share the consume record's Database).
class SqliteAttemptLedger final : public AttemptLedger {
 public:
  /// Creates the table if missing.
  /// @throws idem::UsageError for a bad table name, idem::StorageError when SQLite fails.
  explicit SqliteAttemptLedger(std::shared_ptr<Database> database,
                               std::string table = "mq_consume_attempt", Clock clock = {})
      : database_(std::move(database)), table_(std::move(table)), clock_(std::move(clock)) {
    if (!database_) throw UsageError("idem::sqlite::SqliteAttemptLedger: null database");
    const auto& t = check_sql_identifier("table", table_);
    if (!clock_) clock_ = system_now;
    upsert_ = "INSERT INTO " + t +
              " (message_id, consumer_group, failures, last_error, updated_at)"
              " VALUES (?1, ?2, 1, ?3, ?4)"
              " ON CONFLICT (message_id, consumer_group) DO UPDATE SET"
              " failures = " + t + ".failures + 1, last_error = excluded.last_error,"
              " updated_at = excluded.updated_at"
              " RETURNING failures";
    select_ = "SELECT failures FROM " + t + " WHERE message_id = ?1 AND consumer_group = ?2";
    delete_ = "DELETE FROM " + t + " WHERE message_id = ?1 AND consumer_group = ?2";
    database_->write([&](Transaction& tx) {
      tx.exec_script("CREATE TABLE IF NOT EXISTS " + t +
                     " (message_id VARCHAR(128) NOT NULL,"
                     " consumer_group VARCHAR(64) NOT NULL,"
                     " failures INTEGER NOT NULL,"
                     " last_error TEXT NOT NULL,"
                     " updated_at BIGINT NOT NULL,"
                     " UNIQUE (message_id, consumer_group))");
    });
  }

  /// One upsert in its own transaction. @return the failures counted so far.
  /// @throws idem::StorageError subclasses.
  std::uint32_t record_failure(const Key& key, std::string_view error) override {
    // Keep the stored error short: it is for operators, the dead-letter sink gets it whole.
    std::string_view e = error.substr(0, 1024);
    return database_->write([&](Transaction& tx) {
      auto n = tx.query_int64(upsert_, key.id(), key.scope(), e, to_millis(clock_()));
      return static_cast<std::uint32_t>(n.value_or(1));
    });
  }

  /// Failures stored for `key` (0 when none).
  std::uint32_t failures(const Key& key) override {
    return database_->read([&](Session& s) {
      return static_cast<std::uint32_t>(s.query_int64(select_, key.id(), key.scope()).value_or(0));
    });
  }

  /// Deletes the row of `key`.
  void clear(const Key& key) override {
    database_->write([&](Transaction& tx) { tx.exec(delete_, key.id(), key.scope()); });
  }

  /// The table name in use.
  const std::string& table() const noexcept { return table_; }

 private:
  std::shared_ptr<Database> database_;
  std::string table_;
  Clock clock_;
  std::string upsert_, select_, delete_;
};

}  // namespace idem::sqlite
