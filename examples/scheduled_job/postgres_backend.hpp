// SPDX-License-Identifier: MIT
// examples/scheduled_job on PostgreSQL: the same tables next to the record table, on the
// store's pooled connections. A scheduler killed inside an item's transaction loses its
// connection; the server rolls the transaction back (state change, effect and record alike).
#pragma once

#include <memory>
#include <pqxx/pqxx>
#include <string>
#include <utility>
#include <vector>

#include "idem/postgres/postgres_store.hpp"
#include "idem/postgres/sql_driver.hpp"
#include "idem/postgres/state_machine.hpp"
#include "job.hpp"
#include "state.hpp"

namespace scheduled_job {

/// The job's Backend on PostgreSQL.
class PostgresBackend {
 public:
  using Durable = idem::postgres::PostgresStore;

  /// Connects, migrates the record table `record_table`, creates the tables (under an advisory
  /// lock: several schedulers start at once).
  PostgresBackend(const std::string& dsn, Tables tables = {},
                  const std::string& record_table = "api_idempotency")
      : t_(std::move(tables)) {
    idem::check_sql_identifier("payments table", t_.payments);
    idem::check_sql_identifier("effects table", t_.effects);
    idem::check_sql_identifier("runs table", t_.runs);
    idem::postgres::PostgresStoreOptions o;
    o.conninfo = dsn;
    o.table = record_table;
    o.pool_size = 8;
    store_ = std::make_unique<Durable>(o);
    store_->with_transaction([&](pqxx::work& tx) {
      tx.exec("SELECT pg_advisory_xact_lock(hashtext(" + tx.quote(t_.payments) + "))");
      tx.exec("CREATE TABLE IF NOT EXISTS " + t_.payments +
              " (payment_no text PRIMARY KEY, status text NOT NULL, due_tick int NOT NULL)");
      tx.exec("CREATE TABLE IF NOT EXISTS " + t_.effects +
              " (id bigserial PRIMARY KEY, payment_no text NOT NULL, kind text NOT NULL,"
              " actor text NOT NULL, tick int NOT NULL)");
      tx.exec("CREATE TABLE IF NOT EXISTS " + t_.runs +
              " (id bigserial PRIMARY KEY, job text NOT NULL, tick int NOT NULL,"
              " instance text NOT NULL, fire int NOT NULL, finished boolean NOT NULL DEFAULT false,"
              " items int NOT NULL DEFAULT 0)");
    });
  }

  Durable& durable() noexcept { return *store_; }
  std::string name() const { return "postgres"; }
  const Tables& tables() const noexcept { return t_; }

  void reset(const std::vector<PaymentSeed>& payments) {
    store_->with_transaction([&](pqxx::work& tx) {
      tx.exec("DELETE FROM " + t_.payments);
      tx.exec("DELETE FROM " + t_.effects);
      tx.exec("DELETE FROM " + t_.runs);
      tx.exec_params("DELETE FROM " + store_->qualified_table() + " WHERE biz_type IN ($1, $2)",
                     std::string(kJob), std::string(kSettle));
      for (const auto& p : payments) {
        tx.exec_params("INSERT INTO " + t_.payments +
                           " (payment_no, status, due_tick) VALUES ($1, 'PAYING', $2)",
                       p.payment_no, p.due_tick);
      }
    });
  }

  std::vector<std::string> due(int tick) {
    return store_->with_transaction([&](pqxx::work& tx) {
      std::vector<std::string> out;
      for (const auto& row : tx.exec_params("SELECT payment_no FROM " + t_.payments +
                                                " WHERE status = 'PAYING' AND due_tick <= $1"
                                                " ORDER BY payment_no",
                                            tick)) {
        out.push_back(row[0].as<std::string>());
      }
      return out;
    });
  }

  std::int64_t start_run(int tick, const std::string& instance, int fire) {
    return store_->with_transaction([&](pqxx::work& tx) {
      return tx
          .exec_params1("INSERT INTO " + t_.runs +
                            " (job, tick, instance, fire) VALUES ($1, $2, $3, $4) RETURNING id",
                        std::string(kJob), tick, instance, fire)[0]
          .as<std::int64_t>();
    });
  }

  void finish_run(std::int64_t id, int items) {
    store_->with_transaction([&](pqxx::work& tx) {
      tx.exec_params("UPDATE " + t_.runs + " SET finished = true, items = $1 WHERE id = $2", items,
                     id);
    });
  }

  State read() {
    return store_->with_transaction([&](pqxx::work& tx) {
      State st;
      for (const auto& row : tx.exec("SELECT payment_no, status, due_tick FROM " + t_.payments)) {
        st.payments[row[0].as<std::string>()] =
            PaymentRow{row[1].as<std::string>(), row[2].as<int>()};
      }
      for (const auto& row :
           tx.exec("SELECT payment_no, kind, actor, tick FROM " + t_.effects + " ORDER BY id")) {
        st.effects.push_back(EffectRow{row[0].as<std::string>(), row[1].as<std::string>(),
                                       row[2].as<std::string>(), row[3].as<int>()});
      }
      for (const auto& row : tx.exec("SELECT tick, instance, fire, finished, items FROM " +
                                     t_.runs + " ORDER BY id")) {
        st.runs.push_back(RunRow{row[0].as<int>(), row[1].as<std::string>(), row[2].as<int>(),
                                 row[3].as<bool>(), row[4].as<int>()});
      }
      auto counts = tx.exec_params1(
          "SELECT count(*) FILTER (WHERE status = 'in_progress'),"
          " count(*) FILTER (WHERE status = 'completed' AND biz_type = $1) FROM " +
              store_->qualified_table() + " WHERE biz_type IN ($1, $2)",
          std::string(kJob), std::string(kSettle));
      st.records_in_progress = counts[0].as<std::int64_t>();
      st.ticks_completed = counts[1].as<std::int64_t>();
      return st;
    });
  }

  /// Drops the tables and the record table (tests on private names).
  void drop() {
    store_->with_transaction([&](pqxx::work& tx) {
      tx.exec("DROP TABLE IF EXISTS " + t_.payments + ", " + t_.effects + ", " + t_.runs + ", " +
              store_->qualified_table());
    });
  }

 private:
  Tables t_;
  std::unique_ptr<Durable> store_;
};

}  // namespace scheduled_job
