// SPDX-License-Identifier: MIT
// examples/payment_callback on PostgreSQL: the same callback logic (idem::StateMachine's one
// conditional UPDATE WAIT_PAY -> PAID with paid_at, and the payment row, in one transaction)
// on connections of an idem::postgres::PostgresStore's pool.
//
// Concurrent callbacks for one order: under READ COMMITTED the second UPDATE waits for the
// first transaction's row lock, then re-checks `status = 'WAIT_PAY'`, changes nothing, and the
// state machine reads PAID: a duplicate. No serialization failure, no second payment row.
#pragma once

#include <pqxx/pqxx>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "idem/postgres/postgres_store.hpp"
#include "idem/postgres/state_machine.hpp"
#include "payment_callback.hpp"

namespace payment_callback {

/// The PostgreSQL calls of CallbackLogic.
class PostgresBackend {
 public:
  /// The transaction type.
  using Tx = pqxx::work;
  /// Creates the tables if missing (serialized by an advisory lock).
  PostgresBackend(idem::postgres::PostgresStore& store, Tables tables)
      : store_(store), t_(std::move(tables)) {
    idem::check_sql_identifier("orders table", t_.orders);
    idem::check_sql_identifier("payments table", t_.payments);
    idem::check_sql_identifier("refunds table", t_.refunds);
    store_.with_transaction([&](pqxx::work& tx) {
      tx.exec("SELECT pg_advisory_xact_lock(hashtext(" + tx.quote(t_.orders) + "))");
      tx.exec("CREATE TABLE IF NOT EXISTS " + t_.orders +
              " (order_no varchar(64) PRIMARY KEY, amount bigint NOT NULL,"
              " status varchar(16) NOT NULL, paid_at bigint)");
      tx.exec("CREATE TABLE IF NOT EXISTS " + t_.payments +
              " (order_no varchar(64) PRIMARY KEY, trade_no varchar(64) NOT NULL,"
              " amount bigint NOT NULL, paid_at bigint NOT NULL)");
      tx.exec("CREATE TABLE IF NOT EXISTS " + t_.refunds +
              " (id bigserial PRIMARY KEY, order_no varchar(64) NOT NULL,"
              " trade_no varchar(64) NOT NULL, amount bigint NOT NULL,"
              " UNIQUE (order_no, trade_no))");
    });
  }
  /// One transaction on a pooled connection (libpqxx errors become idem errors).
  template <class Fn>
  auto write(Fn&& fn) {
    return store_.with_transaction(std::forward<Fn>(fn));
  }
  /// The payment row of a transitioned order.
  void insert_payment(Tx& tx, const Callback& cb) {
    tx.exec_params("INSERT INTO " + t_.payments +
                       " (order_no, trade_no, amount, paid_at) VALUES ($1, $2, $3, $4)",
                   cb.order_no, cb.trade_no, cb.amount, cb.paid_at);
  }
  /// A refund, once per (order, trade).
  void insert_refund(Tx& tx, const Callback& cb) {
    tx.exec_params("INSERT INTO " + t_.refunds +
                       " (order_no, trade_no, amount) VALUES ($1, $2, $3)"
                       " ON CONFLICT (order_no, trade_no) DO NOTHING",
                   cb.order_no, cb.trade_no, cb.amount);
  }
  /// The order's paid_at.
  std::optional<std::int64_t> paid_at(Tx& tx, const std::string& order_no) {
    auto r = tx.exec_params("SELECT paid_at FROM " + t_.orders + " WHERE order_no = $1", order_no);
    if (r.empty() || r[0][0].is_null()) return std::nullopt;
    return r[0][0].as<std::int64_t>();
  }

 private:
  idem::postgres::PostgresStore& store_;
  Tables t_;
};

/// The callback handler on PostgreSQL. Thread-safe.
class PostgresPaymentCallbackHandler : public CallbackLogic<PostgresBackend> {
 public:
  /// @param store    supplies the connections (its pool); the tables are created if missing
  /// @param observer receives one on_duplicate (source state_machine) per duplicate callback
  explicit PostgresPaymentCallbackHandler(idem::postgres::PostgresStore& store,
                                          std::shared_ptr<idem::Observer> observer = nullptr,
                                          const Tables& tables = {})
      : CallbackLogic<PostgresBackend>(PostgresBackend{store, tables}, tables,
                                       std::move(observer)) {}
};

}  // namespace payment_callback
