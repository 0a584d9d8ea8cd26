// SPDX-License-Identifier: MIT
// SqlDriver for idem::sqlite::Transaction: lets UniqueInsert and StockTable run inside a SQLite
// write transaction (a guarded handler's, or one from Database::write / Database::begin).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "idem/sql_driver.hpp"
#include "idem/sqlite/sqlite_store.hpp"

namespace idem {

/// SQLite: `?N` placeholders; statements are prepared once per connection and cached.
template <>
struct SqlDriver<sqlite::Transaction> {
  /// Placeholder style.
  static constexpr SqlDialect kDialect = SqlDialect::kSqlite;

  /// Runs `sql` with `args` bound to ?1, ?2, ... and answers the first column of the first
  /// row (nullopt for no row or NULL). The statement runs to completion (RETURNING applies all
  /// its changes on the first step). @throws idem::StorageError subclasses.
  template <class... Args>
  static std::optional<std::int64_t> query_int64(sqlite::Transaction& tx, const std::string& sql,
                                                 const Args&... args) {
    sqlite::Statement st = tx.prepare(sql);
    st.borrow_values().bind_all(args...);  // the arguments outlive the statement
    if (!st.step()) return std::nullopt;  // never step again after DONE: it would re-run
    std::optional<std::int64_t> value;
    if (!st.column_is_null(0)) value = st.column_int64(0);
    while (st.step()) {
    }
    return value;
  }
};

}  // namespace idem
