// SPDX-License-Identifier: MIT
// idem::mysql::MysqlAttemptLedger: failed attempts per MQ message, on MySQL / MariaDB.
//
// File: mysql/attempt_ledger.hpp
//
// The MySQL twin of idem::sqlite::SqliteAttemptLedger (docs/mq.md): table
// `mq_consume_attempt (message_id, consumer_group, failures, last_error, updated_at,
// PRIMARY KEY (message_id, consumer_group))`, one statement per failure:
//
//   INSERT ... VALUES (?, ?, LAST_INSERT_ID(1), ?, UTC_TIMESTAMP(3))
//   ON DUPLICATE KEY UPDATE failures = LAST_INSERT_ID(failures + 1), ...
//
// The count comes back with the statement's own answer (LAST_INSERT_ID(expr); the table has no
// AUTO_INCREMENT column). Concurrent failures of one message serialise on the row, so no count
// is lost; a restarted consumer continues from the stored count. The upsert runs on failures
// only, never on the hot path. Connections come from a MysqlStore's pool.
//
// @code
//   idem::mysql::MysqlStore durable{
//       idem::mysql::MysqlStoreOptions::mq_consume_record("mysql://app:secret@db/billing")};
//   idem::ConsumerOptions co;
//   co.attempts = std::make_shared<idem::mysql::MysqlAttemptLedger>(durable);
// @endcode
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "idem/attempt_ledger.hpp"
#include "idem/errors.hpp"
#include "idem/key.hpp"
#include "idem/mysql/mysql_store.hpp"
#include "idem/sql.hpp"

namespace idem::mysql {

/// Durable AttemptLedger in MySQL. Thread-safe. The store must outlive it.
class MysqlAttemptLedger final : public AttemptLedger {
 public:
  /// Creates the table if missing.
  /// @param store supplies connections (it must outlive the ledger)
  /// @param table a validated identifier
  /// @param migrate create the table when it is missing
  /// @throws idem::UsageError for a bad table name, idem::StorageError subclasses.
  explicit MysqlAttemptLedger(MysqlStore& store, std::string table = "mq_consume_attempt",
                              bool migrate = true)
      : store_(store), table_(std::move(table)) {
    const std::string t = "`" + check_sql_identifier("table", table_) + "`";
    upsert_ = "INSERT INTO " + t +
              " (message_id, consumer_group, failures, last_error, updated_at)"
              " VALUES (?, ?, LAST_INSERT_ID(1), ?, UTC_TIMESTAMP(3))"
              " ON DUPLICATE KEY UPDATE failures = LAST_INSERT_ID(failures + 1),"
              " last_error = VALUES(last_error), updated_at = VALUES(updated_at)";
    select_ = "SELECT failures FROM " + t + " WHERE message_id = ? AND consumer_group = ?";
    delete_ = "DELETE FROM " + t + " WHERE message_id = ? AND consumer_group = ?";
    if (migrate) {
      store_.with_session([&](Session& s) {
        s.exec_text("CREATE TABLE IF NOT EXISTS " + t +
                    " (message_id varchar(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
                    " consumer_group varchar(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
                    " failures int NOT NULL,"
                    " last_error text NOT NULL,"
                    " updated_at datetime(3) NOT NULL,"
                    " PRIMARY KEY (message_id, consumer_group)"
                    ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin");
      });
    }
  }

  /// One upsert (autocommit). @return the failures counted so far.
  /// @throws idem::StorageError subclasses.
  std::uint32_t record_failure(const Key& key, std::string_view error) override {
    // Keep the stored error short (operators read it; the dead-letter sink gets it whole), and
    // valid text whatever the exception said: bytes outside printable ASCII become '?'.
    std::string e(error.substr(0, 1024));
    for (char& c : e) {
      if (c < 0x20 || c > 0x7e) c = '?';
    }
    return store_.with_session([&](Session& s) {
      s.exec(upsert_, key.id(), key.scope(), e);
      return static_cast<std::uint32_t>(s.last_insert_id());
    });
  }

  /// Failures stored for `key` (0 when none).
  std::uint32_t failures(const Key& key) override {
    return store_.with_session([&](Session& s) {
      return static_cast<std::uint32_t>(s.query_int64(select_, key.id(), key.scope()).value_or(0));
    });
  }

  /// Deletes the row of `key`.
  void clear(const Key& key) override {
    store_.with_session([&](Session& s) { s.exec(delete_, key.id(), key.scope()); });
  }

  /// The table in use.
  const std::string& table() const noexcept { return table_; }

 private:
  MysqlStore& store_;
  std::string table_, upsert_, select_, delete_;
};

}  // namespace idem::mysql
