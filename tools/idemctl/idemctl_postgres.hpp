// SPDX-License-Identifier: MIT
// idemctl's PostgreSQL source: `show` through PostgresStore::lookup, `stats` and `purge` with
// the same statements as the SQLite source, written for PostgreSQL (timestamptz columns,
// batched deletes that skip locked rows).
#pragma once

#include <memory>
#include <optional>
#include <pqxx/pqxx>
#include <string>
#include <utility>
#include <vector>

#include "idem/postgres/postgres_store.hpp"
#include "idemctl.hpp"

namespace idemctl {

/// True when `db` names a PostgreSQL database rather than an SQLite file: a postgresql:// or
/// postgres:// URI, or a libpq conninfo string ("host=... dbname=...", recognised by an '=').
inline bool is_postgres_dsn(const std::string& db) {
  return db.rfind("postgresql://", 0) == 0 || db.rfind("postgres://", 0) == 0 ||
         db.find('=') != std::string::npos;
}

/// The PostgreSQL durable store as a RecordSource and an Admin. Leases and retention are
/// judged by the database clock, as PostgresStore does.
class PostgresSource final : public RecordSource, public Admin {
 public:
  /// Connects with `options.conninfo` (never migrates) and checks that the record table
  /// exists. @throws StoreError when the server cannot be reached or the table is missing.
  explicit PostgresSource(idem::postgres::PostgresStoreOptions options) {
    options.migrate = false;
    options.pool_size = 1;
    if (options.pool_wait.count() == 0) options.pool_wait = std::chrono::seconds(10);
    dsn_ = options.conninfo;
    try {
      store_ = std::make_unique<idem::postgres::PostgresStore>(std::move(options));
      bool has_table = store_->with_transaction([&](pqxx::work& tx) {
        return !tx.exec_params1("SELECT to_regclass($1)::text", store_->qualified_table())[0]
                    .is_null();
      });
      if (!has_table) {
        throw StoreError(name() + " has no table '" + store_->qualified_table() +
                         "' (not an idem database, or use --table / --mq)");
      }
    } catch (const idem::Error& e) {
      throw StoreError("cannot open " + name() + ": " + e.what());
    } catch (const pqxx::failure& e) {
      throw StoreError("cannot open " + name() + ": " + e.what());
    }
  }

  /// "postgres:<dsn without password>".
  std::string name() const override { return "postgres:" + redact_dsn(dsn_); }

  std::optional<idem::Record> lookup(const idem::Key& key) override {
    return guarded([&] { return store_->lookup(key); });
  }

  bool release(const idem::Key& key, const idem::OwnerToken& owner) override {
    return guarded([&] { return store_->release(key, owner); });
  }

  std::optional<std::int64_t> attempts(const idem::Key& key) override {
    const auto& o = store_->options();
    return guarded([&] {
      return store_->with_transaction([&](pqxx::work& tx) -> std::optional<std::int64_t> {
        auto r = tx.exec_params("SELECT attempts FROM " + store_->qualified_table() + " WHERE " +
                                    o.key_column + " = $1 AND " + o.scope_column + " = $2",
                                std::string(key.id()), std::string(key.scope()));
        if (r.empty()) return std::nullopt;
        return r[0][0].as<std::int64_t>();
      });
    });
  }

  std::vector<KeyAttempts> most_attempts(std::size_t limit) override {
    const auto& o = store_->options();
    const std::string cols = o.scope_column + ", " + o.key_column;
    return guarded([&] {
      return store_->with_transaction([&](pqxx::work& tx) {
        auto r =
            tx.exec_params("SELECT " + cols + ", attempts FROM " + store_->qualified_table() +
                               " WHERE attempts > 1 ORDER BY attempts DESC, " + cols + " LIMIT $1",
                           static_cast<long long>(limit));
        std::vector<KeyAttempts> out;
        for (const auto& row : r) {
          out.push_back(
              {row[0].as<std::string>(), row[1].as<std::string>(), row[2].as<std::int64_t>()});
        }
        return out;
      });
    });
  }

  Stats stats(idem::TimePoint) override {
    return guarded([&] {
      return store_->with_transaction([&](pqxx::work& tx) {
        auto r = tx.exec1(
            "SELECT count(*) FILTER (WHERE status = 'in_progress'),"
            " count(*) FILTER (WHERE status = 'completed'),"
            " count(*) FILTER (WHERE status = 'failed'),"
            " count(*) FILTER (WHERE status = 'in_progress' AND lease_until <= clock_timestamp()),"
            " count(*) FILTER (WHERE status <> 'in_progress' AND expires_at <= now())"
            " FROM " +
            store_->qualified_table());
        Stats st;
        st.in_progress = r[0].as<std::int64_t>();
        st.completed = r[1].as<std::int64_t>();
        st.failed = r[2].as<std::int64_t>();
        st.stale_in_progress = r[3].as<std::int64_t>();
        st.past_retention = r[4].as<std::int64_t>();
        return st;
      });
    });
  }

  std::int64_t purge_older_than(idem::TimePoint cutoff, bool dry_run) override {
    const std::string table = store_->qualified_table();
    // Rows by their key: tables of either schema version (version 1 also had an `id`).
    const std::string key = store_->options().key_column + ", " + store_->options().scope_column;
    const std::string where =
        " WHERE status <> 'in_progress' AND updated_at < to_timestamp($1::bigint / 1000.0)";
    const long long t = idem::to_millis(cutoff);
    if (dry_run) {
      return guarded([&] {
        return store_->with_transaction([&](pqxx::work& tx) {
          return tx.exec_params1("SELECT count(*) FROM " + table + where, t)[0].as<std::int64_t>();
        });
      });
    }
    std::int64_t total = 0;
    for (;;) {
      // Short batches that skip rows a service transaction holds: never waits on the service.
      auto n = guarded([&] {
        return store_->with_transaction([&](pqxx::work& tx) {
          return static_cast<std::int64_t>(
              tx.exec_params("DELETE FROM " + table + " WHERE (" + key + ") IN (SELECT " + key +
                                 " FROM " + table + where + " LIMIT 1000 FOR UPDATE SKIP LOCKED)",
                             t)
                  .affected_rows());
        });
      });
      total += n;
      if (n < 1000) return total;
    }
  }

  std::int64_t purge_expired() override {
    return guarded([&] { return static_cast<std::int64_t>(store_->purge_expired(1000)); });
  }

 private:
  template <class Fn>
  auto guarded(Fn&& fn) -> decltype(fn()) {
    try {
      return fn();
    } catch (const idem::Error& e) {
      throw StoreError(name() + ": " + e.what());
    } catch (const pqxx::failure& e) {
      throw StoreError(name() + ": " + e.what());
    }
  }

  std::string dsn_;
  std::unique_ptr<idem::postgres::PostgresStore> store_;
};

}  // namespace idemctl
