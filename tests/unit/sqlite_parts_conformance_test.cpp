// SPDX-License-Identifier: MIT
// The shared business-key, state machine, stream and MQ suites on SQLite (the same suites run on
// PostgreSQL and MySQL), in a temporary database file.
#include <gtest/gtest.h>

#include "conformance/business_keys_conformance.hpp"
#include "conformance/mq_conformance.hpp"
#include "conformance/state_machine_conformance.hpp"
#include "conformance/stream_conformance.hpp"
#include "idem/sqlite/attempt_ledger.hpp"
#include "idem/sqlite/sql_driver.hpp"
#include "idem/sqlite/state_machine.hpp"
#include "idem/sqlite/stream_store.hpp"
#include "support/test_env.hpp"

namespace {

const std::string& db_path() {
  static idem::test::TempDir dir;
  static const std::string path = dir.file("parts.db");
  return path;
}

idem::sqlite::Database& shared_db() {
  static idem::sqlite::Database db{db_path()};
  return db;
}

struct SqliteParts {
  using Tx = idem::sqlite::Transaction;
  static constexpr bool kConcurrentWriters = false;  // one writer at a time
  static const char* env_var() { return nullptr; }
  static void exec(const std::string& sql) {
    shared_db().write([&](Tx& tx) { tx.exec_script(sql); });
  }
  static long long scalar(const std::string& sql) {
    return shared_db().read(
        [&](idem::sqlite::Session& s) { return s.query_int64(sql).value_or(-1); });
  }
  static std::string text(const std::string& sql) {
    return shared_db().read(
        [&](idem::sqlite::Session& s) { return s.query_text(sql).value_or(""); });
  }
  static std::string quote(const std::string& v) {
    std::string out = "'";
    for (char c : v) out += c == '\'' ? std::string("''") : std::string(1, c);
    return out + "'";
  }
  template <class Fn>
  static auto in_tx(Fn&& fn) {
    return shared_db().write([&](Tx& tx) { return fn(tx); });
  }
  static std::string status_in(Tx& tx, const std::string& table, const std::string& id) {
    return tx.query_text("SELECT status FROM " + table + " WHERE order_no = ?", id).value_or("");
  }
  static std::string coupon_ddl(const std::string& t) {
    return "CREATE TABLE " + t +
           " (id INTEGER PRIMARY KEY, user_id INTEGER NOT NULL, coupon_id TEXT NOT NULL,"
           " channel TEXT NOT NULL, UNIQUE (user_id, coupon_id))";
  }
  static std::string stock_ddl(const std::string& t) {
    return "CREATE TABLE " + t + " (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL)";
  }
  static std::string orders_ddl(const std::string& t) {
    return "CREATE TABLE " + t +
           " (order_no TEXT PRIMARY KEY, status TEXT NOT NULL, paid_at TEXT, paid_amount INTEGER)";
  }
  static std::string paid_at_value() { return "2026-01-01T10:00:00Z"; }
};

struct SqliteStream {
  using Store = idem::sqlite::SqliteStore;
  using Chunks = idem::sqlite::ChunkStore;
  static const char* env_var() { return nullptr; }
  static std::unique_ptr<Store> make_store() { return std::make_unique<Store>(db_path()); }
  static std::unique_ptr<Chunks> make_chunks(Store& s) {
    return std::make_unique<Chunks>(s.shared_database());
  }
};

}  // namespace

namespace idem::test {
using SqlitePartsTypes = ::testing::Types<SqliteParts>;
using SqliteStreamTypes = ::testing::Types<SqliteStream>;
INSTANTIATE_TYPED_TEST_SUITE_P(Sqlite, BusinessKeysConformance, SqlitePartsTypes);
INSTANTIATE_TYPED_TEST_SUITE_P(Sqlite, StateMachineConformance, SqlitePartsTypes);
INSTANTIATE_TYPED_TEST_SUITE_P(Sqlite, StreamConformance, SqliteStreamTypes);
}  // namespace idem::test

// The shared MQ suite on SQLite (the mq_consume_record preset, SqliteAttemptLedger).

namespace {

struct SqliteMq {
  using Store = idem::sqlite::SqliteStore;
  static constexpr bool kConcurrentWriters = false;  // one writer at a time
  static const char* env_var() { return nullptr; }
  static std::unique_ptr<Store> make_store() {
    return std::make_unique<Store>(db_path(),
                                   idem::sqlite::SqliteStoreOptions::mq_consume_record());
  }
  static std::unique_ptr<Store> make_store_short_lock_wait() { return make_store(); }
  static std::shared_ptr<idem::AttemptLedger> make_ledger(Store& s) {
    return std::make_shared<idem::sqlite::SqliteAttemptLedger>(s.shared_database());
  }
  static void insert_effect(idem::sqlite::Transaction& tx, const std::string& id) {
    tx.exec("CREATE TABLE IF NOT EXISTS mq_effects (key_id TEXT NOT NULL)");
    tx.exec("INSERT INTO mq_effects (key_id) VALUES (?)", id);
  }
  static long count_effects(const std::string& id) {
    return static_cast<long>(shared_db().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM mq_effects WHERE key_id = ?", id).value_or(0);
    }));
  }
  static long completed_records(const std::string& group) {
    return static_cast<long>(shared_db().read([&](idem::sqlite::Session& s) {
      return s
          .query_int64(
              "SELECT count(*) FROM mq_consume_record WHERE consumer_group = ? AND"
              " status = 1",  // version 3: 1 is completed
              group)
          .value_or(0);
    }));
  }
};

}  // namespace

namespace idem::test {
using SqliteMqTypes = ::testing::Types<SqliteMq>;
INSTANTIATE_TYPED_TEST_SUITE_P(Sqlite, MqConformance, SqliteMqTypes);
}  // namespace idem::test
