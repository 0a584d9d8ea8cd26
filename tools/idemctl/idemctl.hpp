// SPDX-License-Identifier: MIT
// idemctl's pieces: duration parsing, record sources (one per store), the SQLite admin, the
// response escaping and the duplicate-log counter.
//
// Adding a store is a few lines: a RecordSource for the per-key commands (lookup, the store's
// own owner-fenced release, and attempts or nullopt; any FastStore fits FastStoreSource
// below), and an Admin for stats / purge / duplicates --top when it is a relational store.
#pragma once

#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <istream>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/detail/redact.hpp"
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

/// Parses "7d", "12h", "30m", "45s", "2w" or a sequence of them, largest unit first, each
/// once ("1d12h"; "1d1d" or "30m1h" is refused: a typo, not a duration). Units: s, m, h, d,
/// w; at most idem::kMaxTerm (100 years). @throws UsageError naming the problem.
inline std::chrono::seconds parse_duration(std::string_view text) {
  if (text.empty()) throw UsageError("empty duration (expected e.g. 7d, 12h, 30m)");
  std::chrono::seconds total{0};
  std::int64_t previous_unit = 0;  // each unit smaller than the one before
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
      case 's':
        unit = 1;
        break;
      case 'm':
        unit = 60;
        break;
      case 'h':
        unit = 3600;
        break;
      case 'd':
        unit = 86400;
        break;
      case 'w':
        unit = 7 * 86400;
        break;
      default:
        throw UsageError("bad duration unit '" + std::string(1, text[i]) + "' in '" +
                         std::string(text) + "' (units: s m h d w)");
    }
    if (previous_unit != 0 && unit >= previous_unit) {
      throw UsageError("bad duration '" + std::string(text) +
                       "' (each unit once, largest first, e.g. 1d12h)");
    }
    previous_unit = unit;
    ++i;
    total += std::chrono::seconds(n * unit);
  }
  if (total.count() <= 0) throw UsageError("duration '" + std::string(text) + "' must be positive");
  if (total > idem::kMaxTerm) {
    throw UsageError("duration '" + std::string(text) +
                     "' is too long (at most 36500d, the longest term idem keeps a record)");
  }
  return total;
}

/// One store the per-key commands (`show`, `response`, `release`, `duplicates`) act on.
class RecordSource {
 public:
  virtual ~RecordSource() = default;
  /// Column title, e.g. "sqlite:orders.sqlite".
  virtual std::string name() const = 0;
  /// The record, or nullopt. @throws StoreError.
  virtual std::optional<idem::Record> lookup(const idem::Key& key) = 0;
  /// Removes `owner`'s in-progress record with the store's own owner-fenced release (the
  /// operation a service's guard calls), never a plain delete: a completed or failed record, or
  /// one another attempt holds, is left as it is.
  /// @return false when `owner` did not hold an in-progress record. @throws StoreError.
  virtual bool release(const idem::Key& key, const idem::OwnerToken& owner) = 0;
  /// How many attempts held the record (1 + lease takeovers), where the store keeps that count;
  /// nullopt for an absent record or a store that does not count them (`duplicates` then says
  /// "not recorded" instead of a number). @throws StoreError.
  virtual std::optional<std::int64_t> attempts(const idem::Key& key) = 0;
  /// Extra rows for `show` (name, value). Default: `attempts` where the store counts them.
  virtual std::vector<std::pair<std::string, std::string>> extra(const idem::Key& key) {
    auto n = attempts(key);
    if (!n) return {};
    return {{"attempts", std::to_string(*n)}};
  }
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
  bool release(const idem::Key& key, const idem::OwnerToken& owner) override {
    try {
      return store_->release(key, owner);
    } catch (const idem::Error& e) {
      throw StoreError(name_ + ": " + e.what());
    }
  }
  /// A FastStore record keeps no attempt count.
  std::optional<std::int64_t> attempts(const idem::Key&) override { return std::nullopt; }

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
  /// A record that more than one attempt held.
  struct KeyAttempts {
    std::string scope, id;      ///< the record's key
    std::int64_t attempts = 0;  ///< 1 + lease takeovers
  };
  /// Records whose `attempts` exceed 1 (an attempt took over an expired lease), most first
  /// (then by scope and id), at most `limit`.
  virtual std::vector<KeyAttempts> most_attempts(std::size_t limit) = 0;
};

/// The SQLite durable store as a RecordSource and an Admin.
class SqliteSource final : public RecordSource, public Admin {
 public:
  /// Opens an existing database file holding `options.table`. Never creates a file.
  /// @throws StoreError when the file or the table is missing or unreadable.
  SqliteSource(const std::string& path, idem::sqlite::SqliteStoreOptions options,
               bool read_only = false)
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
      idem::sqlite::DatabaseOptions o;
      o.read_only = read_only;  // a command that only reads changes nothing, not even the mode
      db_ = std::make_shared<idem::sqlite::Database>(path, o);
      bool has_table = db_->read([&](idem::sqlite::Session& s) {
        return s.query_int64("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
                             table_)
                   .value_or(0) == 1;
      });
      if (!has_table) {
        throw StoreError("sqlite:" + path + " has no table '" + table_ +
                         "' (not an idem database, or use --table / --mq)");
      }
      options_.migrate = false;  // reads what is there: creates, changes or locks nothing
      store_ = std::make_unique<idem::sqlite::SqliteStore>(db_, options_);
    } catch (const idem::Error& e) {
      throw StoreError("cannot open sqlite:" + path + ": " + e.what());
    }
  }

  std::string name() const override { return "sqlite:" + path_; }

  std::optional<idem::Record> lookup(const idem::Key& key) override {
    return guarded([&] { return store_->lookup(key); });
  }

  bool release(const idem::Key& key, const idem::OwnerToken& owner) override {
    return guarded([&] { return store_->release(key, owner); });
  }

  std::optional<std::int64_t> attempts(const idem::Key& key) override {
    return guarded([&] {
      return db_->read([&](idem::sqlite::Session& s) {
        return s.query_int64("SELECT attempts FROM " + table_ + " WHERE " + options_.key_column +
                                 " = ? AND " + options_.scope_column + " = ?",
                             key.id(), key.scope());
      });
    });
  }

  std::vector<KeyAttempts> most_attempts(std::size_t limit) override {
    return guarded([&] {
      return db_->read([&](idem::sqlite::Session& s) {
        auto st = s.prepare("SELECT " + options_.scope_column + ", " + options_.key_column +
                            ", attempts FROM " + table_ +
                            " WHERE attempts > 1 ORDER BY attempts"
                            " DESC, " +
                            options_.scope_column + ", " + options_.key_column + " LIMIT ?");
        st.bind_all(static_cast<std::int64_t>(limit));
        std::vector<KeyAttempts> out;
        while (st.step())
          out.push_back({st.column_bytes(0), st.column_bytes(1), st.column_int64(2)});
        return out;
      });
    });
  }

  Stats stats(idem::TimePoint now) override {
    return guarded([&] {
      return db_->read([&](idem::sqlite::Session& s) {
        Stats st;
        auto t = idem::to_millis(now);
        // The status as the table's version spells it (text, or an integer in version 3).
        auto literal = [&](idem::Record::Status status) { return store_->status_literal(status); };
        const std::string in_progress = literal(idem::Record::Status::kInProgress);
        auto by_status = [&](idem::Record::Status status) {
          return s
              .query_int64("SELECT count(*) FROM " + table_ + " WHERE status = " + literal(status))
              .value_or(0);
        };
        auto at_now = [&](const std::string& where) {
          return s.query_int64("SELECT count(*) FROM " + table_ + " WHERE " + where, t).value_or(0);
        };
        st.in_progress = by_status(idem::Record::Status::kInProgress);
        st.completed = by_status(idem::Record::Status::kCompleted);
        st.failed = by_status(idem::Record::Status::kFailed);
        st.stale_in_progress = at_now("status = " + in_progress + " AND lease_until <= ?");
        st.past_retention = at_now("status <> " + in_progress + " AND expires_at <= ?");
        return st;
      });
    });
  }

  std::int64_t purge_older_than(idem::TimePoint cutoff, bool dry_run) override {
    auto t = idem::to_millis(cutoff);
    const std::string where = " WHERE status <> " +
                              store_->status_literal(idem::Record::Status::kInProgress) +
                              " AND updated_at < ?1";
    if (dry_run) {
      return guarded([&] {
        return db_->read([&](idem::sqlite::Session& s) {
          return s.query_int64("SELECT count(*) FROM " + table_ + where, t).value_or(0);
        });
      });
    }
    // Short batches that walk the key (the service's writers wait at most one batch).
    return guarded(
        [&] { return static_cast<std::int64_t>(store_->purge_older_than(cutoff, 1000)); });
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

/// `bytes` with every byte outside printable ASCII made visible: `\\` for a backslash, `\n`,
/// `\r`, `\t`, and `\xHH` (two upper-case hex digits) for any other byte below 0x20 or above
/// 0x7E (NUL, escape sequences, UTF-8). Printable ASCII, quotes included, is kept as it is.
inline std::string escape_bytes(std::string_view bytes) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(bytes.size());
  for (char ch : bytes) {
    auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20 || c > 0x7E) {
          out += "\\x";
          out += kHex[c >> 4];
          out += kHex[c & 0xF];
        } else {
          out += ch;
        }
    }
  }
  return out;
}

/// Duplicates of one key counted from log lines, by outcome.
struct DuplicateCount {
  std::int64_t total = 0;                 ///< every `idem duplicate` line of the key
  std::int64_t replayed = 0;              ///< outcome=replayed
  std::int64_t in_progress = 0;           ///< outcome=in_progress
  std::int64_t fingerprint_mismatch = 0;  ///< outcome=fingerprint_mismatch
};

/// The value of field `name=` in a LoggingObserver line, unquoted (a value that
/// log::quote_field put in "..." with \", \\ and \xHH escapes), or nullopt when absent.
inline std::optional<std::string> log_field(std::string_view line, std::string_view name) {
  std::size_t at = 0;
  for (;;) {
    at = line.find(name, at);
    if (at == std::string_view::npos) return std::nullopt;
    bool starts = at == 0 || line[at - 1] == ' ';
    at += name.size();
    if (starts && at < line.size() && line[at] == '=') break;
  }
  ++at;
  std::string out;
  if (at >= line.size() || line[at] != '"') {
    auto end = line.find(' ', at);
    return std::string(line.substr(at, end == std::string_view::npos ? end : end - at));
  }
  for (std::size_t i = at + 1; i < line.size(); ++i) {
    char c = line[i];
    if (c == '"') return out;
    if (c != '\\' || i + 1 >= line.size()) {
      out += c;
    } else if (line[i + 1] == 'x') {
      // Exactly two hex digits, as quote_field writes them; anything else (a line cut or
      // interleaved by another writer) is not LoggingObserver's, and is skipped.
      auto hex = [&](std::size_t j) -> int {
        if (j >= line.size()) return -1;
        const char h = line[j];
        if (h >= '0' && h <= '9') return h - '0';
        if (h >= 'a' && h <= 'f') return h - 'a' + 10;
        if (h >= 'A' && h <= 'F') return h - 'A' + 10;
        return -1;
      };
      const int hi = hex(i + 2), lo = hex(i + 3);
      if (hi < 0 || lo < 0) return std::nullopt;
      out += static_cast<char>(hi * 16 + lo);
      i += 3;
    } else {
      out += line[++i];
    }
  }
  return std::nullopt;  // unterminated: not a line LoggingObserver wrote
}

/// Counts the `idem duplicate key=... outcome=...` lines (LoggingObserver::on_duplicate) of a
/// log per key ("scope|id"); other lines, whatever prefix a sink adds, are skipped.
inline std::map<std::string, DuplicateCount> count_duplicate_lines(std::istream& in) {
  std::map<std::string, DuplicateCount> counts;
  std::string line;
  while (std::getline(in, line)) {
    auto at = line.find("idem duplicate key=");
    if (at == std::string::npos) continue;
    std::string_view rest = std::string_view(line).substr(at + 15);
    auto key = log_field(rest, "key");
    if (!key || key->empty()) continue;
    auto outcome = log_field(rest, "outcome").value_or("");
    auto& c = counts[*key];
    ++c.total;
    if (outcome == "replayed") ++c.replayed;
    if (outcome == "in_progress") ++c.in_progress;
    if (outcome == "fingerprint_mismatch") ++c.fingerprint_mismatch;
  }
  return counts;
}

/// `dsn` with every password replaced by "***" (URI userinfo, `password` / `sslpassword` of a
/// conninfo string, quoted or not, or of a URI query), so names printed in errors and headers
/// never leak it: the rules of the PostgreSQL stores' messages (idem/detail/redact.hpp).
inline std::string redact_dsn(const std::string& dsn) { return idem::detail::mask_passwords(dsn); }

/// `dsn` as an error that it could not be opened shows it: redact_dsn, and, without an '@',
/// everything after its first ':' too (idem::detail::mask_refused_uri: "redis://user:secret",
/// a forgotten host, reads as a host and a port).
inline std::string redact_refused_dsn(const std::string& dsn) {
  return idem::detail::mask_refused_uri(dsn);
}

/// The scheme of `db` when it reads as a URI, leading white space ignored: a name of at least
/// two characters (letters, digits, '+', '-', '.'; a letter first) followed by ":/"; "" for
/// anything else (a SQLite file path, a conninfo). idemctl refuses URIs of schemes it has no
/// store for instead of opening them as a SQLite file, whose errors print the path (and any
/// password in it).
inline std::string uri_scheme(std::string_view db) {
  while (!db.empty() && std::isspace(static_cast<unsigned char>(db.front())) != 0) {
    db.remove_prefix(1);
  }
  std::size_t n = 0;
  while (n < db.size() && (std::isalnum(static_cast<unsigned char>(db[n])) != 0 || db[n] == '+' ||
                           db[n] == '-' || db[n] == '.')) {
    ++n;
  }
  if (n < 2 || std::isalpha(static_cast<unsigned char>(db[0])) == 0 || db.substr(n, 2) != ":/") {
    return {};
  }
  return std::string(db.substr(0, n));
}

/// The fast store named by `url` as a RecordSource: `redis://`, `tcp://` or `unix://` opens an
/// idem::redis::RedisStore whose keys start with `key_prefix` (the service's
/// RedisStoreOptions::key_prefix). Connects lazily: an unreachable server shows up as a
/// StoreError from lookup(). @throws StoreError for an unknown scheme, a malformed URL, or a
/// build without idem::redis.
inline std::unique_ptr<RecordSource> open_fast_source(const std::string& url,
                                                      const std::string& key_prefix = "idem:") {
#ifdef IDEMCTL_WITH_REDIS
  const bool redis =
      url.rfind("redis://", 0) == 0 || url.rfind("tcp://", 0) == 0 || url.rfind("unix://", 0) == 0;
  if (!redis) {
    throw StoreError("cannot open fast store '" + redact_refused_dsn(url) +
                     "': unknown scheme (expected redis://, tcp:// or unix://)");
  }
  try {
    idem::redis::RedisStoreOptions options{url};
    options.key_prefix = key_prefix;
    return std::make_unique<FastStoreSource>("redis:" + redact_dsn(url),
                                             std::make_unique<idem::redis::RedisStore>(options));
  } catch (const idem::Error& e) {
    throw StoreError("cannot open fast store '" + redact_refused_dsn(url) + "': " + e.what());
  }
#else
  (void)key_prefix;
  throw StoreError("cannot open fast store '" + redact_refused_dsn(url) +
                   "': this idemctl was built without a Redis adapter (idem::redis)");
#endif
}

}  // namespace idemctl
