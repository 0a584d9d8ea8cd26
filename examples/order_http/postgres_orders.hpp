// SPDX-License-Identifier: MIT
// The orders table of examples/order_http on PostgreSQL: the same two calls as SqliteOrders,
// `create` running inside the guard's pqxx::work so the order row commits atomically with the
// idempotency record.
#pragma once

#include <optional>
#include <pqxx/pqxx>
#include <string>
#include <utility>

#include "idem/postgres/postgres_store.hpp"
#include "idem/sql.hpp"
#include "order_server.hpp"

namespace order_http {

/// The orders table on PostgreSQL (default `http_orders`). Connections come from the store's pool;
/// the table name is a validated identifier (tests use a private table per run).
class PostgresOrders {
 public:
  /// What `create` receives: the guard's transaction.
  using Transaction = pqxx::work;

  /// Creates `table` if missing (order numbers from a sequence, ORD-000001 ...).
  /// @throws idem::UsageError for a bad table name; idem::StorageError subclasses.
  explicit PostgresOrders(idem::postgres::PostgresStore& store, std::string table = "http_orders")
      : store_(store), table_(idem::check_sql_identifier("orders table", table)) {
    store_.with_transaction([&](pqxx::work& tx) {
      // Two processes starting at once must not race on CREATE TABLE IF NOT EXISTS.
      tx.exec("SELECT pg_advisory_xact_lock(hashtext(" + tx.quote(table_) + "))");
      tx.exec("CREATE TABLE IF NOT EXISTS " + table_ +
              " (id bigserial PRIMARY KEY,"
              " order_no varchar(32) NOT NULL UNIQUE,"
              " principal text NOT NULL,"
              " sku text NOT NULL,"
              " qty bigint NOT NULL,"
              " status varchar(16) NOT NULL,"
              " paid_at timestamptz,"
              " created_at timestamptz NOT NULL DEFAULT now())");
    });
  }

  /// Inserts an order in `tx` (the guard's transaction) and returns it. One statement: the
  /// order number is derived from the row's id inside the INSERT.
  Order create(pqxx::work& tx, const std::string& principal, const std::string& sku,
               long long qty) {
    auto row =
        tx.exec_params1("INSERT INTO " + table_ +
                            " (id, order_no, principal, sku, qty, status)"
                            " SELECT n, 'ORD-' || lpad(n::text, 6, '0'), $1, $2, $3, 'WAIT_PAY'"
                            " FROM (SELECT nextval(pg_get_serial_sequence(" +
                            tx.quote(table_) + ", 'id')) AS n) s RETURNING order_no",
                        principal, sku, qty);
    return Order{row[0].as<std::string>(), sku, qty, "WAIT_PAY"};
  }

  /// Reads an order by number, if `principal` placed it.
  std::optional<Order> find(const std::string& principal, const std::string& order_no) {
    return store_.with_transaction([&](pqxx::work& tx) -> std::optional<Order> {
      auto r = tx.exec_params("SELECT order_no, sku, qty, status FROM " + table_ +
                                  " WHERE order_no = $1 AND principal = $2",
                              order_no, principal);
      if (r.empty()) return std::nullopt;
      return Order{r[0][0].as<std::string>(), r[0][1].as<std::string>(), r[0][2].as<long long>(),
                   r[0][3].as<std::string>()};
    });
  }

  /// Number of orders (for tests and the demo).
  long long count() {
    return store_.with_transaction([&](pqxx::work& tx) {
      return tx.exec1("SELECT count(*) FROM " + table_)[0].as<long long>();
    });
  }

  /// Drops the table (tests).
  void drop() {
    store_.with_transaction([&](pqxx::work& tx) { tx.exec("DROP TABLE IF EXISTS " + table_); });
  }

 private:
  idem::postgres::PostgresStore& store_;
  std::string table_;
};

}  // namespace order_http
