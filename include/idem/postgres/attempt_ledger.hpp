// SPDX-License-Identifier: MIT
// idem::postgres::PostgresAttemptLedger: failed attempts per MQ message, on PostgreSQL.
//
// File: postgres/attempt_ledger.hpp
//
// The PostgreSQL twin of idem::sqlite::SqliteAttemptLedger (docs/mq.md): table
// `mq_consume_attempt (message_id, consumer_group, failures, last_error, updated_at,
// UNIQUE (message_id, consumer_group))`, one upsert per failure
//
//   INSERT ... VALUES ($1, $2, 1, $3)
//   ON CONFLICT (message_id, consumer_group)
//   DO UPDATE SET failures = mq_consume_attempt.failures + 1, ... RETURNING failures
//
// Concurrent failures of one message (threads or processes) serialise on the row, so no
// count is lost; a restarted consumer continues from the stored count. Rows are written only
// on failures and deleted when the message succeeds on a redelivery or is dead-lettered.
// Connections come from a PostgresStore's pool (share the consume record store's).
//
// @code
//   idem::postgres::PostgresStore durable{
//       idem::postgres::PostgresStoreOptions::mq_consume_record("postgresql://app@db/billing")};
//   idem::ConsumerOptions co;
//   co.attempts = std::make_shared<idem::postgres::PostgresAttemptLedger>(durable);
// @endcode
#pragma once

#include <cstdint>
#include <pqxx/pqxx>
#include <string>
#include <string_view>
#include <utility>

#include "idem/attempt_ledger.hpp"
#include "idem/errors.hpp"
#include "idem/key.hpp"
#include "idem/postgres/postgres_store.hpp"
#include "idem/sql.hpp"

namespace idem::postgres {

/// Durable AttemptLedger in PostgreSQL. Thread-safe. The store must outlive it.
class PostgresAttemptLedger final : public AttemptLedger {
 public:
  /// Creates the table if missing (under an advisory lock: concurrent processes are safe).
  /// @param store supplies connections and the schema (must outlive the ledger).
  /// @param table a validated identifier, in the store's schema.
  /// @param migrate create the table if missing (false: it must exist).
  /// @throws idem::UsageError for a bad table name, idem::StorageError subclasses.
  explicit PostgresAttemptLedger(PostgresStore& store, std::string table = "mq_consume_attempt",
                                 bool migrate = true)
      : store_(store) {
    check_sql_identifier("table", table);
    table_ = store_.options().schema + "." + table;
    upsert_ = "INSERT INTO " + table_ +
              " AS a (message_id, consumer_group, failures, last_error) VALUES ($1, $2, 1, $3)"
              " ON CONFLICT (message_id, consumer_group) DO UPDATE SET"
              " failures = a.failures + 1, last_error = excluded.last_error,"
              " updated_at = now()"
              " RETURNING failures";
    select_ = "SELECT failures FROM " + table_ + " WHERE message_id = $1 AND consumer_group = $2";
    delete_ = "DELETE FROM " + table_ + " WHERE message_id = $1 AND consumer_group = $2";
    if (migrate) {
      store_.with_transaction([&](pqxx::work& tx) {
        tx.exec("SELECT pg_advisory_xact_lock(hashtext(" + tx.quote(table_) + "))");
        tx.exec("CREATE TABLE IF NOT EXISTS " + table_ +
                " (message_id varchar(128) NOT NULL,"
                " consumer_group varchar(64) NOT NULL,"
                " failures integer NOT NULL,"
                " last_error text NOT NULL,"
                " updated_at timestamptz NOT NULL DEFAULT now(),"
                " UNIQUE (message_id, consumer_group))");
      });
    }
  }

  /// One upsert in its own transaction. @return the failures counted so far.
  /// @throws idem::StorageError subclasses.
  std::uint32_t record_failure(const Key& key, std::string_view error) override {
    // Keep the stored error short (operators read it; the dead-letter sink gets it whole), and
    // valid text whatever the exception said: bytes outside printable ASCII become '?'.
    std::string e(error.substr(0, 1024));
    for (char& c : e) {
      if (c < 0x20 || c > 0x7e) c = '?';
    }
    return store_.with_transaction([&](pqxx::work& tx) {
      return static_cast<std::uint32_t>(
          tx.exec_params1(upsert_, std::string(key.id()), std::string(key.scope()), e)[0]
              .as<std::int64_t>());
    });
  }

  /// Failures stored for `key` (0 when none).
  std::uint32_t failures(const Key& key) override {
    return store_.with_transaction([&](pqxx::work& tx) {
      auto r = tx.exec_params(select_, std::string(key.id()), std::string(key.scope()));
      return r.empty() ? 0u : static_cast<std::uint32_t>(r[0][0].as<std::int64_t>());
    });
  }

  /// Deletes the row of `key`.
  void clear(const Key& key) override {
    store_.with_transaction([&](pqxx::work& tx) {
      tx.exec_params(delete_, std::string(key.id()), std::string(key.scope()));
    });
  }

  /// `schema.table` in use.
  const std::string& table() const noexcept { return table_; }

 private:
  PostgresStore& store_;
  std::string table_, upsert_, select_, delete_;
};

}  // namespace idem::postgres
