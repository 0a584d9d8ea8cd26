// SPDX-License-Identifier: MIT
// examples/refund on SQLite: the refund tables and the idempotency records in one file, which
// several processes may share (one writer at a time, BEGIN IMMEDIATE; readers in parallel).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "idem/sqlite/sql_driver.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "idem/sqlite/state_machine.hpp"
#include "ledger.hpp"
#include "refund.hpp"

namespace refund {

/// The Backend of RefundDesk on SQLite.
class SqliteBackend {
 public:
  /// The guard's durable store.
  using Durable = idem::sqlite::SqliteStore;

  /// Opens (creates) `path` with the record table and the refund tables.
  explicit SqliteBackend(const std::string& path, Tables tables = {})
      : store_(std::make_unique<Durable>(path)), tables_(std::move(tables)) {
    idem::check_sql_identifier("orders table", tables_.orders);
    idem::check_sql_identifier("refunds table", tables_.refunds);
    store_->database().write([&](idem::sqlite::Transaction& tx) {
      // No CHECK (refunded <= paid) on purpose: the conditional UPDATE is what keeps it, and
      // the run's checks read the sums back; a constraint would hide a wrong pattern behind
      // errors. In a service, add it as defence in depth.
      tx.exec_script("CREATE TABLE IF NOT EXISTS " + tables_.orders +
                     " (order_no TEXT PRIMARY KEY, amount INTEGER NOT NULL,"
                     " paid INTEGER NOT NULL, refunded INTEGER NOT NULL DEFAULT 0,"
                     " status TEXT NOT NULL);"
                     "CREATE TABLE IF NOT EXISTS " +
                     tables_.refunds +
                     " (id INTEGER PRIMARY KEY AUTOINCREMENT, request_id TEXT NOT NULL UNIQUE,"
                     " order_no TEXT NOT NULL, amount INTEGER NOT NULL, status TEXT NOT NULL,"
                     " provider_ref TEXT);");
    });
  }

  /// The durable store.
  Durable& durable() noexcept { return *store_; }
  /// "sqlite".
  std::string name() const { return "sqlite"; }
  /// One write transaction.
  template <class Fn>
  auto write(Fn&& fn) {
    return store_->database().write(std::forward<Fn>(fn));
  }

  /// Empties the refund tables and the scope's records, then seeds `orders`.
  void reset(const std::vector<OrderSeed>& orders) {
    write([&](idem::sqlite::Transaction& tx) {
      tx.exec("DELETE FROM " + tables_.refunds);
      tx.exec("DELETE FROM " + tables_.orders);
      tx.exec("DELETE FROM " + store_->table() + " WHERE biz_type = ?", kScope);
      for (const auto& o : orders) {
        tx.exec("INSERT INTO " + tables_.orders +
                    " (order_no, amount, paid, status) VALUES (?, ?, ?, ?)",
                o.order_no, o.amount, o.status == "PAID" ? o.amount : 0, o.status);
      }
    });
  }

  /// The merchant's ledger, read from the database.
  Ledger read() {
    return store_->database().read([&](idem::sqlite::Session& s) {
      Ledger l;
      auto o = s.prepare("SELECT order_no, status, amount, paid, refunded FROM " + tables_.orders);
      while (o.step()) {
        l.orders[o.column_bytes(0)] =
            OrderRow{o.column_bytes(1), o.column_int64(2), o.column_int64(3), o.column_int64(4)};
      }
      auto r = s.prepare("SELECT request_id, order_no, amount, status, provider_ref FROM " +
                         tables_.refunds);
      while (r.step()) {
        l.refunds[r.column_bytes(0)] =
            RefundRow{r.column_bytes(1), r.column_int64(2), r.column_bytes(3), r.column_bytes(4)};
      }
      const std::string t = store_->table();
      l.records_completed =
          s.query_int64("SELECT count(*) FROM " + t + " WHERE biz_type = ? AND status = " +
                            store_->status_literal(idem::Record::Status::kCompleted),
                        kScope)
              .value_or(0);
      l.records_in_progress =
          s.query_int64("SELECT count(*) FROM " + t + " WHERE biz_type = ? AND status = " +
                            store_->status_literal(idem::Record::Status::kInProgress),
                        kScope)
              .value_or(0);
      return l;
    });
  }

 private:
  std::unique_ptr<Durable> store_;
  Tables tables_;
};

}  // namespace refund
