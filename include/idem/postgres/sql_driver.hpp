// SPDX-License-Identifier: MIT
// SqlDriver for libpqxx transactions (pqxx::work and every other pqxx::transaction_base): lets
// UniqueInsert and StockTable run inside the caller's PostgreSQL transaction, e.g. the
// `pqxx::work&` a transactional IdempotencyGuard handler receives from PostgresStore.
//
// Errors: a failing statement throws libpqxx's own exception, unchanged, exactly as the
// caller's own `tx.exec(...)` would. The transaction is then aborted (PostgreSQL's rule), and
// whoever owns it decides: a durable store that retries the whole transaction on
// pqxx::serialization_failure / deadlock_detected (the guard allows for such retries) must see
// them as they are, so translating them here would break that.
// A *duplicate* of the unique key is never an error (ON CONFLICT DO NOTHING), so it never
// aborts the transaction.
#pragma once

#include <cstdint>
#include <optional>
#include <pqxx/pqxx>
#include <string>
#include <type_traits>

#include "idem/postgres/detail/pqxx_compat.hpp"
#include "idem/sql_driver.hpp"

namespace idem {

/// PostgreSQL through libpqxx: `$N` placeholders, values sent as parameters (exec_params).
template <class Tx>
struct SqlDriver<Tx, std::enable_if_t<std::is_base_of_v<pqxx::transaction_base, Tx>>> {
  /// Placeholder style.
  static constexpr SqlDialect kDialect = SqlDialect::kPostgres;

  /// Runs `sql` with `args` as $1, $2, ... and answers the first column of the first row
  /// (nullopt for no row or NULL). @throws pqxx exceptions (see the file comment).
  template <class... Args>
  static std::optional<std::int64_t> query_int64(Tx& tx, const std::string& sql,
                                                 const Args&... args) {
    (postgres::detail::refuse_nul_in("idem (PostgreSQL)", args), ...);
    pqxx::result r = postgres::detail::exec_params(tx, sql, args...);
    if (r.empty() || r[0][0].is_null()) return std::nullopt;
    return r[0][0].template as<std::int64_t>();
  }
};

}  // namespace idem
