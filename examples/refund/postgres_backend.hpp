// SPDX-License-Identifier: MIT
// examples/refund on PostgreSQL: the refund tables next to the idempotency record table, the
// local transactions on the store's pooled connections. Under READ COMMITTED, a second refund
// of the same order waits at the conditional UPDATE for the first one's row lock, then
// re-evaluates `refunded + amount <= paid` against the committed row: no serialization
// failure, no over-refund.
#pragma once

#include <memory>
#include <pqxx/pqxx>
#include <string>
#include <utility>
#include <vector>

#include "idem/postgres/postgres_store.hpp"
#include "idem/postgres/sql_driver.hpp"
#include "idem/postgres/state_machine.hpp"
#include "ledger.hpp"
#include "refund.hpp"

namespace refund {

/// The Backend of RefundDesk on PostgreSQL.
class PostgresBackend {
 public:
  /// The guard's durable store.
  using Durable = idem::postgres::PostgresStore;

  /// Connects, migrates the record table (`record_table`), creates the refund tables (serialized
  /// by an advisory lock: several processes may start at once).
  /// @throws idem::StorageError subclasses; idem::UsageError for a bad name.
  PostgresBackend(const std::string& dsn, Tables tables = {},
                  const std::string& record_table = "api_idempotency")
      : tables_(std::move(tables)) {
    idem::check_sql_identifier("orders table", tables_.orders);
    idem::check_sql_identifier("refunds table", tables_.refunds);
    idem::postgres::PostgresStoreOptions o;
    o.conninfo = dsn;
    o.table = record_table;
    o.pool_size = 24;
    store_ = std::make_unique<Durable>(o);
    store_->with_transaction([&](pqxx::work& tx) {
      tx.exec("SELECT pg_advisory_xact_lock(hashtext(" + tx.quote(tables_.orders) + "))");
      tx.exec("CREATE TABLE IF NOT EXISTS " + tables_.orders +
              " (order_no text PRIMARY KEY, amount bigint NOT NULL, paid bigint NOT NULL,"
              " refunded bigint NOT NULL DEFAULT 0, status text NOT NULL)");
      tx.exec("CREATE TABLE IF NOT EXISTS " + tables_.refunds +
              " (id bigserial PRIMARY KEY, request_id text NOT NULL UNIQUE,"
              " order_no text NOT NULL, amount bigint NOT NULL, status text NOT NULL,"
              " provider_ref text)");
    });
  }

  /// The durable store.
  Durable& durable() noexcept { return *store_; }
  /// "postgres".
  std::string name() const { return "postgres"; }
  /// One transaction on a pooled connection.
  template <class Fn>
  auto write(Fn&& fn) {
    return store_->with_transaction(std::forward<Fn>(fn));
  }

  /// Empties the refund tables and the scope's records, then seeds `orders`.
  void reset(const std::vector<OrderSeed>& orders) {
    write([&](pqxx::work& tx) {
      tx.exec("DELETE FROM " + tables_.refunds);
      tx.exec("DELETE FROM " + tables_.orders);
      tx.exec_params("DELETE FROM " + store_->qualified_table() + " WHERE biz_type = $1",
                     std::string(kScope));
      for (const auto& o : orders) {
        tx.exec_params("INSERT INTO " + tables_.orders +
                           " (order_no, amount, paid, status) VALUES ($1, $2, $3, $4)",
                       o.order_no, o.amount, o.status == "PAID" ? o.amount : 0, o.status);
      }
    });
  }

  /// The merchant's ledger, read from the database.
  Ledger read() {
    return write([&](pqxx::work& tx) {
      Ledger l;
      for (const auto& row :
           tx.exec("SELECT order_no, status, amount, paid, refunded FROM " + tables_.orders)) {
        l.orders[row[0].as<std::string>()] =
            OrderRow{row[1].as<std::string>(), row[2].as<std::int64_t>(), row[3].as<std::int64_t>(),
                     row[4].as<std::int64_t>()};
      }
      for (const auto& row : tx.exec("SELECT request_id, order_no, amount, status,"
                                     " coalesce(provider_ref, '') FROM " +
                                     tables_.refunds)) {
        l.refunds[row[0].as<std::string>()] =
            RefundRow{row[1].as<std::string>(), row[2].as<std::int64_t>(), row[3].as<std::string>(),
                      row[4].as<std::string>()};
      }
      auto counts = tx.exec_params1(
          "SELECT count(*) FILTER (WHERE status = 'completed'),"
          " count(*) FILTER (WHERE status = 'in_progress') FROM " +
              store_->qualified_table() + " WHERE biz_type = $1",
          std::string(kScope));
      l.records_completed = counts[0].as<std::int64_t>();
      l.records_in_progress = counts[1].as<std::int64_t>();
      return l;
    });
  }

  /// Drops the refund tables and the record table (tests on private names).
  void drop() {
    write([&](pqxx::work& tx) {
      tx.exec("DROP TABLE IF EXISTS " + tables_.orders + ", " + tables_.refunds + ", " +
              store_->qualified_table());
    });
  }

 private:
  Tables tables_;
  std::unique_ptr<Durable> store_;
};

}  // namespace refund
