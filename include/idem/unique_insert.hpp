// SPDX-License-Identifier: MIT
// idem::UniqueInsert: insert a row guarded by the business table's own unique key, where a
// duplicate is a success that names the existing row, never an error.
//
// File: unique_insert.hpp
//
// Some operations need no separate idempotency record: the business table's unique key *is* the
// guard. "A user claims a coupon once" is `user_coupon unique (user_id, coupon_id)`; "one order
// per user in this sale" is `flash_order unique (user_id, sku)`. The first claim inserts the
// row; every repeat (double click, retry after a timeout, a second browser tab with a new
// request id) must get the same answer, "you have it, here is its id", not
// "duplicate key value violates unique constraint".
//
// `insert(tx, values...)` runs, in the caller's transaction,
//
//     INSERT INTO user_coupon (user_id, coupon_id, ...) VALUES (?1, ?2, ...)
//       ON CONFLICT (user_id, coupon_id) DO NOTHING RETURNING id
//
// and, when no row came back (the key exists), `SELECT id FROM user_coupon WHERE user_id = ?1
// AND coupon_id = ?2`. It answers kInserted with the new id, or kAlreadyExists with the
// existing row's id. On MySQL (no ON CONFLICT, no RETURNING) the INSERT is plain: a duplicate
// is error 1062, which rolls back that statement only, the new id is LAST_INSERT_ID (the id
// column must be AUTO_INCREMENT), and the SELECT is a locking read (REPEATABLE READ's snapshot
// could hide the row that conflicted). Another unique key than the named one conflicting is
// then a StorageError.
//
// Guarantees:
//   * A duplicate is a value (kAlreadyExists), never an exception, and never aborts the
//     caller's transaction: `ON CONFLICT DO NOTHING` raises no error, so a PostgreSQL
//     transaction is not put into the aborted state and no savepoint is needed.
//   * Of many concurrent inserts of one key, exactly one answers kInserted (once its transaction
//     commits) and all answer the same id. On PostgreSQL (READ COMMITTED) a concurrent insert of
//     the same key waits for the first transaction: if it commits, the waiter answers
//     kAlreadyExists with its id; if it rolls back, the waiter inserts. Under REPEATABLE READ or
//     SERIALIZABLE, PostgreSQL may instead raise a serialization failure: retry the transaction.
//   * Only the named unique key counts as "already exists". Any other constraint (another unique
//     index, NOT NULL, CHECK, a foreign key) still fails the statement as usual. The key columns
//     must be exactly the columns of a unique index or constraint (SQLite and PostgreSQL reject
//     the statement otherwise) and NOT NULL: a NULL key value is refused with idem::UsageError,
//     since SQL treats NULLs as distinct and the row would be inserted again every time.
//   * Table and column names are validated identifiers (idem::check_sql_identifier); every value
//     is a bound parameter.
//
// When to use this and when an idempotency record (IdempotencyGuard): see docs/flash-sale.md. In
// short: a unique business key answers "does this row exist"; a guard answers "what did the
// first call respond" for any operation, including ones that create nothing (a sold-out answer,
// a rejected payment). They combine: a guarded handler that inserts with UniqueInsert replays
// its response to the same key, and still answers correctly to a *different* key for the same
// business row.
//
// @code
//   #include "idem/sqlite/sql_driver.hpp"   // or the PostgreSQL adapter's driver header
//   #include "idem/unique_insert.hpp"
//
//   static const idem::UniqueInsert user_coupon{"user_coupon", {"user_id", "coupon_id"},
//                                               {"claimed_at"}};
//   db.write([&](idem::sqlite::Transaction& tx) {
//     auto r = user_coupon.insert(tx, user_id, coupon_id, now_ms);   // keys, then values
//     return r.id;                          // the same id for the first claim and every repeat
//   });
// @endcode
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/errors.hpp"
#include "idem/key.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"
#include "idem/sql.hpp"
#include "idem/sql_driver.hpp"

namespace idem {

/// What an insert guarded by a unique key found.
enum class InsertStatus {
  kInserted,       ///< this call inserted the row; `id` is the new row's id
  kAlreadyExists,  ///< a row with this key exists; `id` is that row's id (a success)
};

/// Stable name: inserted, already_exists.
constexpr std::string_view insert_status_name(InsertStatus s) noexcept {
  switch (s) {
    case InsertStatus::kInserted: return "inserted";
    case InsertStatus::kAlreadyExists: return "already_exists";
  }
  return "unknown";
}

/// The answer of UniqueInsert::insert. Both statuses are successes.
struct [[nodiscard]] InsertResult {
  /// Inserted now, or already there.
  InsertStatus status = InsertStatus::kInserted;
  /// The id of the row holding the key: the new one, or the existing one.
  std::int64_t id = 0;

  /// True when this call inserted the row.
  bool inserted() const noexcept { return status == InsertStatus::kInserted; }
};

/// Options of a UniqueInsert.
struct UniqueInsertOptions {
  /// The column whose value identifies the row (returned as InsertResult::id). It must hold an
  /// integer (an INTEGER PRIMARY KEY, a BIGSERIAL, ...). A validated SQL identifier.
  std::string id_column = "id";
  /// Told of every duplicate (kAlreadyExists) with DuplicateSource::kUniqueIndex and outcome
  /// kReplayed, for the "why are there two identical requests" log. The event's key is
  /// Key(scope = table name, id = the key values joined by ':'), when both are valid key parts;
  /// otherwise (long or non-printable values) no event is sent. Null means none.
  std::shared_ptr<Observer> observer;
};

/// Counters of one UniqueInsert (all calls, all threads).
struct UniqueInsertStats {
  /// Rows this helper inserted (counted when the statement ran; a later rollback is not seen).
  std::uint64_t inserted = 0;
  /// Duplicates: the unique key existed (the "unique-conflict count at the database").
  std::uint64_t already_exists = 0;
};

namespace detail {
/// Appends a key value's text for duplicate events. false when it has no plain text form.
template <class T>
bool append_key_text(std::string& out, const T& v);

template <class T>
bool append_key_text(std::string& out, const std::optional<T>& v) {
  return v.has_value() && append_key_text(out, *v);
}

template <class T>
bool append_key_text(std::string& out, const T& v) {
  if constexpr (std::is_same_v<T, std::nullptr_t>) {
    return false;
  } else if constexpr (std::is_integral_v<T>) {
    out += std::to_string(v);
    return true;
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out += std::string_view(v);
    return true;
  } else {
    return false;
  }
}
}  // namespace detail

/// An insert guarded by the table's own unique key (see the file comment). Thread-safe and
/// immutable after construction (counters aside); build one per table and keep it.
class UniqueInsert {
 public:
  /// @param table          the business table, e.g. "user_coupon"
  /// @param key_columns    the columns of its unique key, e.g. {"user_id", "coupon_id"}; at
  ///                       least one
  /// @param value_columns  further columns written by the insert (not part of the key); may be
  ///                       empty
  /// @param options        the id column and an optional observer
  /// @throws idem::UsageError for an invalid identifier, no key column, or a column named twice.
  UniqueInsert(std::string table, std::vector<std::string> key_columns,
               std::vector<std::string> value_columns = {}, UniqueInsertOptions options = {})
      : table_(std::move(table)),
        key_columns_(std::move(key_columns)),
        value_columns_(std::move(value_columns)),
        options_(std::move(options)) {
    check_sql_identifier("table", table_);
    check_sql_identifier("id column", options_.id_column);
    if (key_columns_.empty()) {
      throw UsageError("idem::UniqueInsert: table '" + table_ + "' needs at least one key column");
    }
    std::vector<const std::string*> all;
    for (const auto& c : key_columns_) all.push_back(&check_sql_identifier("key column", c));
    for (const auto& c : value_columns_) all.push_back(&check_sql_identifier("value column", c));
    for (std::size_t i = 0; i < all.size(); ++i) {
      for (std::size_t j = i + 1; j < all.size(); ++j) {
        if (same_sql_identifier(*all[i], *all[j])) {
          throw UsageError("idem::UniqueInsert: column '" + *all[i] + "' named twice");
        }
      }
    }
    for (std::size_t d = 0; d < kSqlDialects; ++d) build(static_cast<SqlDialect>(d));
  }

  UniqueInsert(const UniqueInsert&) = delete;
  UniqueInsert& operator=(const UniqueInsert&) = delete;

  /// Inserts the row unless its unique key exists, in the caller's transaction `tx`.
  ///
  /// @param tx    the caller's open transaction (a type with a SqlDriver: include the adapter's
  ///              sql_driver.hpp); it is never rolled back or aborted by a duplicate
  /// @param args  the key values in key_columns order, then the values in value_columns order;
  ///              key values must not be NULL
  /// @return kInserted with the new id, or kAlreadyExists with the existing row's id.
  /// @throws idem::UsageError when the number of values is wrong or a key value is NULL;
  ///         the driver's storage errors (another constraint failed, the database failed).
  template <class Tx, class... Args>
  InsertResult insert(Tx& tx, const Args&... args) const {
    static_assert(detail::has_sql_driver<Tx>::value,
                  "idem::UniqueInsert: no SqlDriver for this transaction type; include the "
                  "adapter's sql_driver.hpp (e.g. idem/sqlite/sql_driver.hpp)");
    using Driver = SqlDriver<Tx>;
    if (sizeof...(Args) != key_columns_.size() + value_columns_.size()) {
      throw UsageError("idem::UniqueInsert: '" + table_ + "' takes " +
                       std::to_string(key_columns_.size() + value_columns_.size()) +
                       " values (keys, then values), got " + std::to_string(sizeof...(Args)));
    }
    check_keys_not_null(args...);
    const Statements& sql = sql_[static_cast<std::size_t>(Driver::kDialect)];
    // Two rounds: if the conflicting row disappears between the INSERT and the SELECT (deleted
    // by a concurrent transaction on PostgreSQL), the second INSERT succeeds or finds the next.
    for (int round = 0; round < 2; ++round) {
      if (auto id = Driver::query_int64(tx, sql.insert, args...)) {
        inserted_.fetch_add(1, std::memory_order_relaxed);
        return InsertResult{InsertStatus::kInserted, *id};
      }
      if (auto id = select_existing<Driver>(tx, sql.select, args...)) {
        already_exists_.fetch_add(1, std::memory_order_relaxed);
        notify_duplicate(args...);
        return InsertResult{InsertStatus::kAlreadyExists, *id};
      }
    }
    throw StorageError("idem::UniqueInsert: '" + table_ +
                       "': the insert conflicted but no row with the key could be read (is the "
                       "unique key exactly (" + join_columns(key_columns_) + ") and '" +
                       options_.id_column + "' non-NULL?)");
  }

  /// The statements in `dialect` (for logs, reviews and tests).
  const std::string& insert_sql(SqlDialect dialect) const noexcept {
    return sql_[static_cast<std::size_t>(dialect)].insert;
  }
  /// The SELECT of the existing row's id in `dialect`.
  const std::string& select_sql(SqlDialect dialect) const noexcept {
    return sql_[static_cast<std::size_t>(dialect)].select;
  }
  /// The table name.
  const std::string& table() const noexcept { return table_; }
  /// The unique key's columns.
  const std::vector<std::string>& key_columns() const noexcept { return key_columns_; }
  /// The other inserted columns.
  const std::vector<std::string>& value_columns() const noexcept { return value_columns_; }
  /// A snapshot of the counters.
  UniqueInsertStats stats() const noexcept {
    return UniqueInsertStats{inserted_.load(std::memory_order_relaxed),
                             already_exists_.load(std::memory_order_relaxed)};
  }

 private:
  struct Statements {
    std::string insert, select;
  };

  static std::string join_columns(const std::vector<std::string>& cols) {
    std::string out;
    for (const auto& c : cols) {
      if (!out.empty()) out += ", ";
      out += c;
    }
    return out;
  }

  void build(SqlDialect dialect) {
    Statements& s = sql_[static_cast<std::size_t>(dialect)];
    std::vector<std::string> all = key_columns_;
    all.insert(all.end(), value_columns_.begin(), value_columns_.end());
    std::string values;
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (i > 0) values += ", ";
      values += detail::placeholder(dialect, i + 1);
    }
    s.insert = "INSERT INTO " + table_ + " (" + join_columns(all) + ") VALUES (" + values + ")";
    if (dialect != SqlDialect::kMysql) {
      s.insert += " ON CONFLICT (" + join_columns(key_columns_) + ") DO NOTHING RETURNING " +
                  options_.id_column;
    }
    s.select = "SELECT " + options_.id_column + " FROM " + table_ + " WHERE ";
    for (std::size_t i = 0; i < key_columns_.size(); ++i) {
      if (i > 0) s.select += " AND ";
      s.select += key_columns_[i] + " = " + detail::placeholder(dialect, i + 1);
    }
    // MySQL: the id comes from LAST_INSERT_ID (an AUTO_INCREMENT id column), a duplicate is
    // error 1062 (its driver answers no row). The read after a duplicate is a locking one, so
    // REPEATABLE READ's snapshot cannot hide the row that conflicted; the failed INSERT holds a
    // shared lock on it already.
    if (dialect == SqlDialect::kMysql) s.select += " LOCK IN SHARE MODE";
  }

  template <class... Args>
  void check_keys_not_null(const Args&... args) const {
    std::size_t i = 0;
    bool null_key = false;
    ((null_key = null_key || (i++ < key_columns_.size() && detail::is_null_value(args))), ...);
    if (null_key) {
      throw UsageError("idem::UniqueInsert: '" + table_ +
                       "': a key value is NULL (NULLs never conflict, so the row would be "
                       "inserted again on every call)");
    }
  }

  // Binds only the key values (the first key_columns_.size() arguments) to the SELECT. The
  // key's length is known only at run time, so dispatch on it (a table has few key columns).
  template <class Driver, class Tx, class... Args>
  std::optional<std::int64_t> select_existing(Tx& tx, const std::string& sql,
                                              const Args&... args) const {
    return dispatch_prefix<Driver, sizeof...(Args)>(tx, sql, std::forward_as_tuple(args...),
                                                    key_columns_.size());
  }

  template <class Driver, std::size_t kMax, class Tx, class Tuple>
  std::optional<std::int64_t> dispatch_prefix(Tx& tx, const std::string& sql, const Tuple& t,
                                              std::size_t n) const {
    if constexpr (kMax == 0) {
      (void)tx;
      (void)sql;
      (void)t;
      (void)n;
      throw UsageError("idem::UniqueInsert: no key values");
    } else {
      if (n == kMax) return call_prefix<Driver>(tx, sql, t, std::make_index_sequence<kMax>{});
      return dispatch_prefix<Driver, kMax - 1>(tx, sql, t, n);
    }
  }

  template <class Driver, class Tx, class Tuple, std::size_t... I>
  static std::optional<std::int64_t> call_prefix(Tx& tx, const std::string& sql, const Tuple& t,
                                                 std::index_sequence<I...>) {
    return Driver::query_int64(tx, sql, std::get<I>(t)...);
  }

  template <class... Args>
  void notify_duplicate(const Args&... args) const noexcept {
    Observer* o = options_.observer.get();
    if (o == nullptr) return;
    try {
      std::string id;
      std::size_t i = 0;
      bool printable = true;
      auto add = [&](const auto& v) {
        if (i++ >= key_columns_.size()) return;
        if (!id.empty()) id += ':';
        printable = printable && detail::append_key_text(id, v);
      };
      (add(args), ...);
      if (!printable || !is_valid_scope(table_) || !is_valid_id(id)) return;
      Key key = Key::make(table_, id);
      o->on_duplicate(DuplicateEvent{key, Outcome::kReplayed, DuplicateSource::kUniqueIndex,
                                     TimePoint{}, std::string_view{}});
    } catch (...) {
      // Observers are told what is cheap to tell; a key that cannot be formed is skipped.
    }
  }

  static bool is_valid_scope(std::string_view s) noexcept {
    if (s.empty() || s.size() > kMaxScopeLength) return false;
    for (char c : s) {
      if (!detail::is_scope_char(static_cast<unsigned char>(c))) return false;
    }
    return true;
  }
  static bool is_valid_id(std::string_view s) noexcept {
    if (s.empty() || s.size() > kMaxIdLength) return false;
    for (char c : s) {
      if (!detail::is_id_char(static_cast<unsigned char>(c))) return false;
    }
    return true;
  }

  std::string table_;
  std::vector<std::string> key_columns_;
  std::vector<std::string> value_columns_;
  UniqueInsertOptions options_;
  std::array<Statements, kSqlDialects> sql_;
  mutable std::atomic<std::uint64_t> inserted_{0};
  mutable std::atomic<std::uint64_t> already_exists_{0};
};


}  // namespace idem
