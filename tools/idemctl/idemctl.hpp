// SPDX-License-Identifier: MIT
// idemctl's pieces: duration parsing, record sources (one per store) and the SQLite admin.
//
// Adding a store is a few lines: a RecordSource for `show` (any FastStore or durable store
// with lookup() fits FastStoreSource / DurableSource below), and an Admin for purge/stats when
// it is a relational store.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/key.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "idem/store.hpp"
#ifdef IDEMCTL_WITH_REDIS
#include "idem/redis/redis_store.hpp"
#endif

namespace idemctl {

/// A bad command line: printed with the usage text, exit status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A store that cannot be opened or read: exit status 3.
class StoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Parses "7d", "12h", "30m", "45s", "2w" or a sequence of them ("1d12h"). Units: s, m, h, d,
/// w. @throws UsageError naming the problem.
inline std::chrono::seconds parse_duration(std::string_view text) {
  if (text.empty()) throw UsageError("empty duration (expected e.g. 7d, 12h, 30m)");
  std::chrono::seconds total{0};
  std::size_t i = 0;
  while (i < text.size()) {
    std::size_t start = i;
    std::int64_t n = 0;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
      n = n * 10 + (text[i] - '0');
      if (n > 100'000'000) throw UsageError("duration '" + std::string(text) + "' is too long");
      ++i;
    }
    if (i == start || i == text.size()) {
      throw UsageError("bad duration '" + std::string(text) +
                       "' (expected <number><unit>, unit one of s m h d w, e.g. 7d, 12h, 30m)");
    }
    std::int64_t unit = 0;
    switch (text[i]) {
      case 's': unit = 1; break;
      case 'm': unit = 60; break;
      case 'h': unit = 3600; break;
      case 'd': unit = 86400; break;
      case 'w': unit = 7 * 86400; break;
      default:
        throw UsageError("bad duration unit '" + std::string(1, text[i]) + "' in '" +
                         std::string(text) + "' (units: s m h d w)");
    }
    ++i;
    total += std::chrono::seconds(n * unit);
  }
  if (total.count() <= 0) throw UsageError("duration '" + std::string(text) + "' must be positive");
  return total;
}

/// One store `show` reads a record from.
class RecordSource {
 public:
  virtual ~RecordSource() = default;
  /// Column title, e.g. "sqlite:orders.sqlite".
  virtual std::string name() const = 0;
  /// The record, or nullopt. @throws StoreError.
  virtual std::optional<idem::Record> lookup(const idem::Key& key) = 0;
  /// Extra rows for `show` (name, value), e.g. attempts. Default none.
  virtual std::vector<std::pair<std::string, std::string>> extra(const idem::Key&) { return {}; }
};

/// A RecordSource over any FastStore (memory, Redis, Redis Cluster).
class FastStoreSource final : public RecordSource {
 public:
  FastStoreSource(std::string name, std::unique_ptr<idem::FastStore> store)
      : name_(std::move(name)), store_(std::move(store)) {}
  std::string name() const override { return name_; }
  std::optional<idem::Record> lookup(const idem::Key& key) override {
    try {
      return store_->lookup(key);
    } catch (const idem::Error& e) {
      throw StoreError(name_ + ": " + e.what());
    }
  }

 private:
  std::string name_;
  std::unique_ptr<idem::FastStore> store_;
};

/// Relational maintenance: counts by status and purges.
class Admin {
 public:
  virtual ~Admin() = default;
  /// Counts per status, plus in-progress rows whose lease ended and finished rows whose
  /// retention ended.
  struct Stats {
    std::int64_t in_progress = 0, completed = 0, failed = 0;
    std::int64_t stale_in_progress = 0, past_retention = 0;
  };
  virtual Stats stats(idem::TimePoint now) = 0;
  /// Deletes completed/failed records last updated before `cutoff` (or counts them when
  /// `dry_run`). In-progress records are never touched. @return the number of records.
  virtual std::int64_t purge_older_than(idem::TimePoint cutoff, bool dry_run) = 0;
  /// Deletes records whose retention ended. @return the number deleted.
  virtual std::int64_t purge_expired() = 0;
};

/// The SQLite durable store as a RecordSource and an Admin.
class SqliteSource final : public RecordSource, public Admin {
 public:
  /// Opens an existing database file holding `options.table`. Never creates a file.
  /// @throws StoreError when the file or the table is missing or unreadable.
  SqliteSource(const std::string& path, idem::sqlite::SqliteStoreOptions options)
      : path_(path), table_(options.table), options_(options) {
    if (path.empty()) throw UsageError("no database: pass --db PATH (or set IDEMCTL_DB)");
    if (path != ":memory:") {
      if (std::FILE* f = std::fopen(path.c_str(), "rb")) {
        std::fclose(f);
      } else {
        throw StoreError("cannot open sqlite:" + path + ": no such file or not readable");
      }
    }
    try {
      db_ = std::make_shared<idem::sqlite::Database>(path);
      bool has_table = db_->read([&](idem::sqlite::Session& s) {
        return s.query_int64("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
                             table_)
                   .value_or(0) == 1;
      });
      if (!has_table) {
        throw StoreError("sqlite:" + path + " has no table '" + table_ +
                         "' (not an idem database, or use --table / --mq)");
      }
      store_ = std::make_unique<idem::sqlite::SqliteStore>(db_, options_);
    } catch (const idem::Error& e) {
      throw StoreError("cannot open sqlite:" + path + ": " + e.what());
    }
  }

  std::string name() const override { return "sqlite:" + path_; }

  std::optional<idem::Record> lookup(const idem::Key& key) override {
    return guarded([&] { return store_->lookup(key); });
  }

  std::vector<std::pair<std::string, std::string>> extra(const idem::Key& key) override {
    auto attempts = guarded([&] {
      return db_->read([&](idem::sqlite::Session& s) {
        return s.query_int64("SELECT attempts FROM " + table_ + " WHERE " +
                                 options_.key_column + " = ? AND " + options_.scope_column +
                                 " = ?",
                             key.id(), key.scope());
      });
    });
    if (!attempts) return {};
    return {{"attempts", std::to_string(*attempts)}};
  }

  Stats stats(idem::TimePoint now) override {
    return guarded([&] {
      return db_->read([&](idem::sqlite::Session& s) {
        Stats st;
        auto t = idem::to_millis(now);
        auto by_status = [&](const char* status) {
          return s.query_int64("SELECT count(*) FROM " + table_ + " WHERE status = ?", status)
              .value_or(0);
        };
        auto at_now = [&](const std::string& where) {
          return s.query_int64("SELECT count(*) FROM " + table_ + " WHERE " + where, t)
              .value_or(0);
        };
        st.in_progress = by_status("in_progress");
        st.completed = by_status("completed");
        st.failed = by_status("failed");
        st.stale_in_progress = at_now("status = 'in_progress' AND lease_until <= ?");
        st.past_retention = at_now("status <> 'in_progress' AND expires_at <= ?");
        return st;
      });
    });
  }

  std::int64_t purge_older_than(idem::TimePoint cutoff, bool dry_run) override {
    auto t = idem::to_millis(cutoff);
    const std::string where = " WHERE status <> 'in_progress' AND updated_at < ?1";
    if (dry_run) {
      return guarded([&] {
        return db_->read([&](idem::sqlite::Session& s) {
          return s.query_int64("SELECT count(*) FROM " + table_ + where, t).value_or(0);
        });
      });
    }
    std::int64_t total = 0;
    for (;;) {
      // Short batches: the service's writers wait at most one batch.
      int n = guarded([&] {
        return db_->write([&](idem::sqlite::Transaction& tx) {
          // Rows named by their unique key: schema 2 tables have no id column.
          const std::string key = options_.key_column + ", " + options_.scope_column;
          return tx.exec("DELETE FROM " + table_ + " WHERE (" + key + ") IN (SELECT " + key +
                             " FROM " + table_ + where + " LIMIT 1000)",
                         t);
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
    }
  }

  std::string path_;
  std::string table_;
  idem::sqlite::SqliteStoreOptions options_;
  std::shared_ptr<idem::sqlite::Database> db_;
  std::unique_ptr<idem::sqlite::SqliteStore> store_;
};

/// `dsn` with any password replaced by "***" (URI userinfo, `password=` of a conninfo string
/// or URI query), so names printed in errors and headers never leak it.
inline std::string redact_dsn(const std::string& dsn) {
  std::string out = dsn;
  auto scheme = out.find("://");
  if (scheme != std::string::npos) {
    auto at = out.find('@', scheme + 3);
    auto colon = out.find(':', scheme + 3);
    if (at != std::string::npos && colon != std::string::npos && colon < at) {
      out.replace(colon + 1, at - colon - 1, "***");
    }
  }
  auto p = out.find("password=");
  if (p != std::string::npos) {
    auto end = out.find_first_of(scheme != std::string::npos ? "&" : " ", p);
    out.replace(p + 9, (end == std::string::npos ? out.size() : end) - p - 9, "***");
  }
  return out;
}

/// The fast store named by `url` as a RecordSource: `redis://`, `tcp://` or `unix://` opens an
/// idem::redis::RedisStore whose keys start with `key_prefix` (the service's
/// RedisStoreOptions::key_prefix). Connects lazily: an unreachable server shows up as a
/// StoreError from lookup(). @throws StoreError for an unknown scheme, a malformed URL, or a
/// build without idem::redis.
inline std::unique_ptr<RecordSource> open_fast_source(const std::string& url,
                                                      const std::string& key_prefix = "idem:") {
#ifdef IDEMCTL_WITH_REDIS
  const bool redis = url.rfind("redis://", 0) == 0 || url.rfind("tcp://", 0) == 0 ||
                     url.rfind("unix://", 0) == 0;
  if (!redis) {
    throw StoreError("cannot open fast store '" + redact_dsn(url) +
                     "': unknown scheme (expected redis://, tcp:// or unix://)");
  }
  try {
    idem::redis::RedisStoreOptions options{url};
    options.key_prefix = key_prefix;
    return std::make_unique<FastStoreSource>(
        "redis:" + redact_dsn(url), std::make_unique<idem::redis::RedisStore>(options));
  } catch (const idem::Error& e) {
    throw StoreError("cannot open fast store '" + redact_dsn(url) + "': " + e.what());
  }
#else
  (void)key_prefix;
  throw StoreError("cannot open fast store '" + redact_dsn(url) +
                   "': this idemctl was built without a Redis adapter (idem::redis)");
#endif
}

}  // namespace idemctl
