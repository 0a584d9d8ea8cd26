// SPDX-License-Identifier: MIT
// idemctl's MySQL / MariaDB source: `show` through MysqlStore::lookup, `stats` and `purge` on
// the same table (UTC datetime columns, batched deletes by key that take no gap locks).
#pragma once

#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "idem/mysql/mysql_store.hpp"
#include "idemctl.hpp"

namespace idemctl {

/// True when `db` names a MySQL / MariaDB database: a mysql:// or mariadb:// URI.
inline bool is_mysql_uri(const std::string& db) {
  return db.rfind("mysql://", 0) == 0 || db.rfind("mariadb://", 0) == 0;
}

/// The MySQL durable store as a RecordSource and an Admin. Leases and retention are judged by
/// the database clock (UTC), as MysqlStore does.
class MysqlSource final : public RecordSource, public Admin {
 public:
  /// Connects with `options.uri` (never migrates) and checks that the record table exists.
  /// @throws StoreError when the server cannot be reached or the table is missing.
  explicit MysqlSource(idem::mysql::MysqlStoreOptions options) : uri_(options.uri) {
    options.migrate = false;
    options.pool_size = 1;
    try {
      store_ = std::make_unique<idem::mysql::MysqlStore>(std::move(options));
      const auto& o = store_->options();
      table_ = "`" + o.table + "`";
      key_ = "`" + o.key_column + "`, `" + o.scope_column + "`";
      bool has_table = store_->with_session([&](idem::mysql::Session& s) {
        return s.query_int64(
                    "SELECT count(*) FROM information_schema.TABLES"
                    " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
                    o.table)
                   .value_or(0) == 1;
      });
      if (!has_table) {
        throw StoreError(name() + " has no table '" + o.table +
                         "' (not an idem database, or use --table / --mq)");
      }
      // Reads the table's definition: refuses a schema version newer than this idemctl knows.
      (void)store_->max_response_bytes();
    } catch (const idem::UsageError& e) {
      throw UsageError(e.what());  // a bad URI or option: exit status 2
    } catch (const idem::Error& e) {
      throw StoreError("cannot open " + name() + ": " + e.what());
    }
  }

  /// "mysql:<uri without password>".
  std::string name() const override { return "mysql:" + redact_dsn(uri_); }

  std::optional<idem::Record> lookup(const idem::Key& key) override {
    return guarded([&] { return store_->lookup(key); });
  }

  bool release(const idem::Key& key, const idem::OwnerToken& owner) override {
    return guarded([&] { return store_->release(key, owner); });
  }

  std::optional<std::int64_t> attempts(const idem::Key& key) override {
    const auto& o = store_->options();
    return guarded([&] {
      return store_->with_session([&](idem::mysql::Session& s) {
        return s.query_int64("SELECT attempts FROM " + table_ + " WHERE `" + o.key_column +
                                 "` = ? AND `" + o.scope_column + "` = ?",
                             key.id(), key.scope());
      });
    });
  }

  std::vector<KeyAttempts> most_attempts(std::size_t limit) override {
    const auto& o = store_->options();
    const std::string cols = "`" + o.scope_column + "`, `" + o.key_column + "`";
    return guarded([&] {
      return store_->with_session([&](idem::mysql::Session& s) {
        auto rows = s.query("SELECT " + cols + ", attempts FROM " + table_ +
                                " WHERE attempts > 1 ORDER BY attempts DESC, " + cols +
                                " LIMIT ?",
                            static_cast<std::int64_t>(limit));
        std::vector<KeyAttempts> out;
        for (const auto& row : rows) {
          out.push_back({std::string(row[0].bytes()), std::string(row[1].bytes()),
                         row[2].as_int64()});
        }
        return out;
      });
    });
  }

  Stats stats(idem::TimePoint) override {
    return guarded([&] {
      return store_->with_session([&](idem::mysql::Session& s) {
        auto rows = s.query(
            "SELECT COALESCE(SUM(status = 'in_progress'), 0),"
            " COALESCE(SUM(status = 'completed'), 0), COALESCE(SUM(status = 'failed'), 0),"
            " COALESCE(SUM(status = 'in_progress' AND lease_until <= UTC_TIMESTAMP(3)), 0),"
            " COALESCE(SUM(status <> 'in_progress' AND expires_at <= UTC_TIMESTAMP(3)), 0)"
            " FROM " +
            table_);
        Stats st;
        st.in_progress = rows[0][0].as_int64();
        st.completed = rows[0][1].as_int64();
        st.failed = rows[0][2].as_int64();
        st.stale_in_progress = rows[0][3].as_int64();
        st.past_retention = rows[0][4].as_int64();
        return st;
      });
    });
  }

  std::int64_t purge_older_than(idem::TimePoint cutoff, bool dry_run) override {
    const std::string before = utc_datetime(cutoff);
    const std::string where = " WHERE status <> 'in_progress' AND updated_at < ?";
    if (dry_run) {
      return guarded([&] {
        return store_->with_session([&](idem::mysql::Session& s) {
          return s.query_int64("SELECT count(*) FROM " + table_ + where, before).value_or(0);
        });
      });
    }
    std::int64_t total = 0;
    for (;;) {
      // A plain read finds a batch, one DELETE by key removes it: row locks only, nothing
      // held between batches, the service never waits long on idemctl.
      auto [found, deleted] = guarded([&] {
        return store_->with_session([&](idem::mysql::Session& s) {
          auto keys = s.query("SELECT " + key_ + " FROM " + table_ + where + " LIMIT 1000", before);
          if (keys.empty()) return std::pair<std::size_t, std::int64_t>{0, 0};
          std::string sql = "DELETE FROM " + table_ + where + " AND (" + key_ + ") IN (";
          std::vector<idem::mysql::Param> params{idem::mysql::detail::to_param(before)};
          for (std::size_t i = 0; i < keys.size(); ++i) {
            sql += i == 0 ? "(?, ?)" : ", (?, ?)";
            params.push_back(idem::mysql::detail::to_param(std::string_view(keys[i][0].bytes())));
            params.push_back(idem::mysql::detail::to_param(std::string_view(keys[i][1].bytes())));
          }
          sql += ")";
          auto n = s.run(sql, params.data(), params.size(), nullptr);
          return std::pair<std::size_t, std::int64_t>{keys.size(), static_cast<std::int64_t>(n)};
        });
      });
      total += deleted;
      if (found < 1000) return total;
    }
  }

  std::int64_t purge_expired() override {
    return guarded([&] { return static_cast<std::int64_t>(store_->purge_expired(1000)); });
  }

 private:
  // "YYYY-MM-DD HH:MM:SS.mmm" in UTC: what the table's datetime columns hold.
  static std::string utc_datetime(idem::TimePoint t) {
    const long long ms = idem::to_millis(t);
    std::time_t secs = static_cast<std::time_t>(ms / 1000);
    std::tm tm{};
    gmtime_r(&secs, &tm);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
    char out[40];
    std::snprintf(out, sizeof out, "%s.%03lld", buf, ms % 1000);
    return out;
  }

  template <class Fn>
  auto guarded(Fn&& fn) -> decltype(fn()) {
    try {
      return fn();
    } catch (const idem::Error& e) {
      throw StoreError(name() + ": " + e.what());
    }
  }

  std::string uri_, table_, key_;
  std::unique_ptr<idem::mysql::MysqlStore> store_;
};

}  // namespace idemctl
