// SPDX-License-Identifier: MIT
// examples/scheduled_job on SQLite: the payments, the effects, the tick runs and the
// idempotency records in one file shared by every scheduler process.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "idem/sqlite/sql_driver.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "idem/sqlite/state_machine.hpp"
#include "job.hpp"
#include "state.hpp"

namespace scheduled_job {

/// The job's Backend on SQLite.
class SqliteBackend {
 public:
  using Durable = idem::sqlite::SqliteStore;

  /// Opens (creates) `path` and the tables.
  explicit SqliteBackend(const std::string& path, Tables tables = {})
      : store_(std::make_unique<Durable>(path)), t_(std::move(tables)) {
    idem::check_sql_identifier("payments table", t_.payments);
    idem::check_sql_identifier("effects table", t_.effects);
    idem::check_sql_identifier("runs table", t_.runs);
    store_->with_transaction([&](idem::sqlite::Transaction& tx) {
      tx.exec_script("CREATE TABLE IF NOT EXISTS " + t_.payments +
                     " (payment_no TEXT PRIMARY KEY, status TEXT NOT NULL,"
                     " due_tick INTEGER NOT NULL);"
                     "CREATE TABLE IF NOT EXISTS " +
                     t_.effects +
                     " (id INTEGER PRIMARY KEY AUTOINCREMENT, payment_no TEXT NOT NULL,"
                     " kind TEXT NOT NULL, actor TEXT NOT NULL, tick INTEGER NOT NULL);"
                     "CREATE TABLE IF NOT EXISTS " +
                     t_.runs +
                     " (id INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL,"
                     " tick INTEGER NOT NULL, instance TEXT NOT NULL, fire INTEGER NOT NULL,"
                     " finished INTEGER NOT NULL DEFAULT 0, items INTEGER NOT NULL DEFAULT 0);");
    });
  }

  Durable& durable() noexcept { return *store_; }
  std::string name() const { return "sqlite"; }
  const Tables& tables() const noexcept { return t_; }

  /// Empties the tables and both scopes' records; seeds `payments` as PAYING.
  void reset(const std::vector<PaymentSeed>& payments) {
    store_->with_transaction([&](idem::sqlite::Transaction& tx) {
      tx.exec("DELETE FROM " + t_.payments);
      tx.exec("DELETE FROM " + t_.effects);
      tx.exec("DELETE FROM " + t_.runs);
      tx.exec("DELETE FROM " + store_->table() + " WHERE biz_type IN (?, ?)", kJob, kSettle);
      for (const auto& p : payments) {
        tx.exec("INSERT INTO " + t_.payments +
                    " (payment_no, status, due_tick) VALUES (?, 'PAYING', ?)",
                p.payment_no, p.due_tick);
      }
    });
  }

  /// Payments still PAYING that are due at `tick`, in payment order.
  std::vector<std::string> due(int tick) {
    return store_->database().read([&](idem::sqlite::Session& s) {
      std::vector<std::string> out;
      auto st = s.prepare("SELECT payment_no FROM " + t_.payments +
                          " WHERE status = 'PAYING' AND due_tick <= ? ORDER BY payment_no");
      st.bind_all(tick);
      while (st.step()) out.push_back(st.column_bytes(0));
      return out;
    });
  }

  /// Records that `instance` started `tick` at `fire`. @return the run's id.
  std::int64_t start_run(int tick, const std::string& instance, int fire) {
    return store_->with_transaction([&](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT INTO " + t_.runs + " (job, tick, instance, fire) VALUES (?, ?, ?, ?)", kJob,
              tick, instance, fire);
      return tx.query_int64("SELECT last_insert_rowid()").value_or(0);
    });
  }

  /// Marks run `id` finished with `items` closed.
  void finish_run(std::int64_t id, int items) {
    store_->with_transaction([&](idem::sqlite::Transaction& tx) {
      tx.exec("UPDATE " + t_.runs + " SET finished = 1, items = ? WHERE id = ?", items, id);
    });
  }

  /// Everything the checks need.
  State read() {
    return store_->database().read([&](idem::sqlite::Session& s) {
      State st;
      auto p = s.prepare("SELECT payment_no, status, due_tick FROM " + t_.payments);
      while (p.step()) {
        st.payments[p.column_bytes(0)] =
            PaymentRow{p.column_bytes(1), static_cast<int>(p.column_int64(2))};
      }
      auto e =
          s.prepare("SELECT payment_no, kind, actor, tick FROM " + t_.effects + " ORDER BY id");
      while (e.step()) {
        st.effects.push_back(EffectRow{e.column_bytes(0), e.column_bytes(1), e.column_bytes(2),
                                       static_cast<int>(e.column_int64(3))});
      }
      auto r = s.prepare("SELECT tick, instance, fire, finished, items FROM " + t_.runs +
                         " ORDER BY id");
      while (r.step()) {
        st.runs.push_back(RunRow{static_cast<int>(r.column_int64(0)), r.column_bytes(1),
                                 static_cast<int>(r.column_int64(2)), r.column_int64(3) != 0,
                                 static_cast<int>(r.column_int64(4))});
      }
      const std::string t = store_->table();
      st.records_in_progress =
          s.query_int64("SELECT count(*) FROM " + t + " WHERE biz_type IN (?, ?) AND status = " +
                            store_->status_literal(idem::Record::Status::kInProgress),
                        kJob, kSettle)
              .value_or(0);
      st.ticks_completed =
          s.query_int64("SELECT count(*) FROM " + t + " WHERE biz_type = ? AND status = " +
                            store_->status_literal(idem::Record::Status::kCompleted),
                        kJob)
              .value_or(0);
      return st;
    });
  }

 private:
  std::unique_ptr<Durable> store_;
  Tables t_;
};

}  // namespace scheduled_job
