// SPDX-License-Identifier: MIT
// The small hook through which idem's business-table helpers (UniqueInsert, StockTable) run
// their statements inside the caller's own transaction, whatever the database.
//
// File: sql_driver.hpp
//
// The helpers build their SQL once, from validated identifiers, in each dialect, and bind every
// value. To run a statement they need one operation from the transaction type they are given:
// "run this statement with these bound values and give me the first column of the first row as
// an integer, if there is one". Each adapter provides it by specialising `SqlDriver`:
//
//   * idem/sqlite/sql_driver.hpp   SqlDriver<idem::sqlite::Transaction>   (`?1` placeholders)
//   * idem/postgres/...            SqlDriver<pqxx::work> and friends       (`$1` placeholders)
//   * idem/mysql/sql_driver.hpp    SqlDriver<idem::mysql::Transaction>     (`?1`, rewritten to `?`)
//
// @code
//   template <>
//   struct idem::SqlDriver<my::Tx> {
//     static constexpr idem::SqlDialect kDialect = idem::SqlDialect::kPostgres;
//     template <class... Args>
//     static std::optional<std::int64_t> query_int64(my::Tx& tx, const std::string& sql,
//                                                    const Args&... args);
//   };
// @endcode
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

namespace idem {

/// SQL dialect of a database: SQLite binds `?1, ?2, ...`, PostgreSQL `$1, $2, ...`; both accept
/// `INSERT ... ON CONFLICT (...) DO NOTHING` and `... RETURNING`. MySQL has neither: its
/// statements are plain (a duplicate is error 1062, a changed value comes back through
/// LAST_INSERT_ID(expr)), written with `?N` placeholders that its driver rewrites to `?`.
enum class SqlDialect {
  kSqlite = 0,    ///< `?N` placeholders (SQLite 3.35 or newer, for RETURNING)
  kPostgres = 1,  ///< `$N` placeholders (PostgreSQL 9.5 or newer, for ON CONFLICT)
  kMysql = 2,     ///< `?N` placeholders, no ON CONFLICT / RETURNING (MySQL 5.7+, MariaDB)
};

/// Number of dialects (for tables indexed by SqlDialect).
inline constexpr std::size_t kSqlDialects = 3;

/// How idem's business-table helpers run a statement inside a transaction of type `Tx`.
/// Left undefined: an adapter header specialises it (see the file comment). A specialisation
/// provides `kDialect` and
/// `static std::optional<std::int64_t> query_int64(Tx&, const std::string& sql, const Args&...)`,
/// which runs `sql` with `args` bound to placeholders 1, 2, ... and answers the first column of
/// the first row (nullopt when there is no row or it is NULL). For kMysql, a statement without
/// a result set (INSERT, UPDATE) answers the value LAST_INSERT_ID reports when it changed rows
/// (the new AUTO_INCREMENT id, or LAST_INSERT_ID(expr)), and nullopt when it changed none or
/// hit a duplicate key (1062). Backend failures throw
/// idem::StorageError subclasses (or the driver's own exceptions, for drivers whose
/// transactions the caller handles directly, like pqxx).
template <class Tx, class Enable = void>
struct SqlDriver;

namespace detail {

/// Placeholder number `n` (1-based) in `dialect`: "?3" or "$3".
inline std::string placeholder(SqlDialect dialect, std::size_t n) {
  return (dialect == SqlDialect::kPostgres ? "$" : "?") + std::to_string(n);
}

/// True when `Tx` has a SqlDriver specialisation (a complete type).
template <class Tx, class = void>
struct has_sql_driver : std::false_type {};
template <class Tx>
struct has_sql_driver<Tx, std::void_t<decltype(SqlDriver<Tx>::kDialect)>> : std::true_type {};

/// True when an argument is a NULL value (nullptr, a null C string, which every adapter binds
/// as NULL, or an empty std::optional).
template <class T>
bool is_null_value(const T&) noexcept {
  return false;
}
inline bool is_null_value(std::nullptr_t) noexcept { return true; }
inline bool is_null_value(const char* text) noexcept { return text == nullptr; }
template <class T>
bool is_null_value(const std::optional<T>& v) noexcept {
  return !v.has_value();
}

}  // namespace detail

}  // namespace idem
