// SPDX-License-Identifier: MIT
// The databases examples/coupon_claim runs on: one table, user_coupon unique (user_id,
// coupon_id), and a read-back of its rows. SQLite always; PostgreSQL with idem::postgres;
// MySQL / MariaDB with idem::mysql.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "idem/sql.hpp"
#include "idem/sqlite/sql_driver.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#ifdef COUPON_CLAIM_WITH_POSTGRES
#include <pqxx/pqxx>

#include "idem/postgres/postgres_store.hpp"
#include "idem/postgres/sql_driver.hpp"
#endif
#ifdef COUPON_CLAIM_WITH_MYSQL
#include "idem/mysql/mysql_store.hpp"
#include "idem/mysql/sql_driver.hpp"
#endif

namespace coupon_claim {

/// (user_id, coupon_id) -> the ids of its rows (one, if all is well).
using Rows = std::map<std::pair<std::int64_t, std::string>, std::vector<std::int64_t>>;

/// SQLite: one file, one writer at a time.
class SqliteBackend {
 public:
  using Tx = idem::sqlite::Transaction;

  SqliteBackend(const std::string& path, std::string table = "user_coupon")
      : db_(path), table_(idem::check_sql_identifier("table", table)) {
    db_.write([&](Tx& tx) {
      tx.exec_script("CREATE TABLE IF NOT EXISTS " + table_ +
                     " (id INTEGER PRIMARY KEY AUTOINCREMENT, user_id INTEGER NOT NULL,"
                     " coupon_id TEXT NOT NULL, request_id TEXT NOT NULL,"
                     " claimed_at INTEGER NOT NULL, UNIQUE (user_id, coupon_id))");
    });
  }
  std::string name() const { return "sqlite"; }
  const std::string& table() const noexcept { return table_; }
  template <class Fn>
  auto write(Fn&& fn) {
    return db_.write(std::forward<Fn>(fn));
  }
  void reset() {
    db_.write([&](Tx& tx) { tx.exec("DELETE FROM " + table_); });
  }
  Rows rows() {
    return db_.read([&](idem::sqlite::Session& s) {
      Rows out;
      auto st = s.prepare("SELECT user_id, coupon_id, id FROM " + table_ + " ORDER BY id");
      while (st.step()) out[{st.column_int64(0), st.column_bytes(1)}].push_back(st.column_int64(2));
      return out;
    });
  }

 private:
  idem::sqlite::Database db_;
  std::string table_;
};

#ifdef COUPON_CLAIM_WITH_POSTGRES
/// PostgreSQL: a concurrent insert of the same (user, coupon) waits for the first transaction
/// on the unique index, then finds its row (or inserts, if the first rolled back).
class PostgresBackend {
 public:
  using Tx = pqxx::work;

  PostgresBackend(const std::string& dsn, std::string table = "user_coupon")
      : table_(idem::check_sql_identifier("table", table)) {
    idem::postgres::PostgresStoreOptions o;
    o.conninfo = dsn;
    o.migrate = false;  // only the store's connection pool and error translation are used
    o.pool_size = 24;
    store_ = std::make_unique<idem::postgres::PostgresStore>(o);
    store_->with_transaction([&](Tx& tx) {
      tx.exec("SELECT pg_advisory_xact_lock(hashtext(" + tx.quote(table_) + "))");
      tx.exec(
          "CREATE TABLE IF NOT EXISTS " + table_ +
          " (id bigserial PRIMARY KEY, user_id bigint NOT NULL, coupon_id text NOT NULL,"
          " request_id text NOT NULL, claimed_at bigint NOT NULL, UNIQUE (user_id, coupon_id))");
    });
  }
  std::string name() const { return "postgres"; }
  const std::string& table() const noexcept { return table_; }
  template <class Fn>
  auto write(Fn&& fn) {
    return store_->with_transaction(std::forward<Fn>(fn));
  }
  void reset() {
    write([&](Tx& tx) { tx.exec("DELETE FROM " + table_); });
  }
  Rows rows() {
    return write([&](Tx& tx) {
      Rows out;
      for (const auto& r :
           tx.exec("SELECT user_id, coupon_id, id FROM " + table_ + " ORDER BY id")) {
        out[{r[0].as<std::int64_t>(), r[1].as<std::string>()}].push_back(r[2].as<std::int64_t>());
      }
      return out;
    });
  }
  /// Drops the table (tests on private names).
  void drop() {
    write([&](Tx& tx) { tx.exec("DROP TABLE IF EXISTS " + table_); });
  }

 private:
  std::string table_;
  std::unique_ptr<idem::postgres::PostgresStore> store_;
};
#endif

#ifdef COUPON_CLAIM_WITH_MYSQL
/// MySQL / MariaDB (InnoDB): the claim's INSERT is plain; a concurrent insert of the same
/// (user, coupon) waits on the unique key for the first transaction, then gets 1062 (a
/// duplicate: the existing row's id from a locking read) or inserts, if the first rolled back.
/// A deadlock among such waiters (1213) re-runs the transaction (MysqlStore::with_transaction).
class MysqlBackend {
 public:
  using Tx = idem::mysql::Transaction;

  /// @param uri `mysql://user:password@host:port/database`; the database must exist.
  MysqlBackend(const std::string& uri, std::string table = "user_coupon")
      : table_(idem::check_sql_identifier("table", table)) {
    idem::mysql::MysqlStoreOptions o;
    o.uri = uri;
    o.migrate = false;  // only the store's connection pool and error translation are used
    o.pool_size = 24;
    store_ = std::make_unique<idem::mysql::MysqlStore>(o);
    // The seed table's shape (id bigint auto_increment, unique key uk_user_coupon), with the
    // example's string coupon ids compared as bytes and its request_id / claimed_at columns.
    store_->with_session([&](idem::mysql::Session& s) {
      s.exec_text("CREATE TABLE IF NOT EXISTS " + table_ +
                  " (id bigint PRIMARY KEY AUTO_INCREMENT, user_id bigint NOT NULL,"
                  " coupon_id varchar(64) COLLATE utf8mb4_bin NOT NULL,"
                  " request_id varchar(128) COLLATE utf8mb4_bin NOT NULL,"
                  " claimed_at bigint NOT NULL,"
                  " UNIQUE KEY uk_user_coupon (user_id, coupon_id)) ENGINE=InnoDB"
                  " DEFAULT CHARSET=utf8mb4");
    });
  }
  std::string name() const { return "mysql"; }
  const std::string& table() const noexcept { return table_; }
  template <class Fn>
  auto write(Fn&& fn) {
    return store_->with_transaction(std::forward<Fn>(fn));
  }
  void reset() {
    store_->with_session([&](idem::mysql::Session& s) { s.exec_text("DELETE FROM " + table_); });
  }
  Rows rows() {
    return store_->with_session([&](idem::mysql::Session& s) {
      Rows out;
      for (const auto& r :
           s.query("SELECT user_id, coupon_id, id FROM " + table_ + " ORDER BY id")) {
        out[{r[0].as_int64(), r[1].bytes()}].push_back(r[2].as_int64());
      }
      return out;
    });
  }
  /// Drops the table (tests on private names).
  void drop() {
    store_->with_session(
        [&](idem::mysql::Session& s) { s.exec_text("DROP TABLE IF EXISTS " + table_); });
  }

 private:
  std::string table_;
  std::unique_ptr<idem::mysql::MysqlStore> store_;
};
#endif

}  // namespace coupon_claim
