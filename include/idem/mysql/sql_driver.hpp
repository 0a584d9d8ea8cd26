// SPDX-License-Identifier: MIT
// SqlDriver for idem::mysql sessions and transactions: lets UniqueInsert and StockTable run
// inside the caller's MySQL transaction, e.g. the `idem::mysql::Transaction&` a transactional
// IdempotencyGuard handler receives from MysqlStore.
//
// MySQL has no ON CONFLICT and no RETURNING, so the helpers' MySQL statements are plain: a
// duplicate key is error 1062 (MySQL rolls back that one statement, the transaction stays
// usable), and a changed value comes back through LAST_INSERT_ID (see idem/sql_driver.hpp).
// Other failures are idem exceptions carrying the server's error number (idem::mysql::
// ServerError); MysqlStore's transactional mode re-runs the transaction on 1213 / 1205.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "idem/mysql/client.hpp"
#include "idem/sql_driver.hpp"

namespace idem {

/// MySQL / MariaDB through idem::mysql: `?N` placeholders (rewritten to `?`), bound values.
template <class Tx>
struct SqlDriver<Tx, std::enable_if_t<std::is_base_of_v<mysql::Session, Tx>>> {
  /// Statement dialect.
  static constexpr SqlDialect kDialect = SqlDialect::kMysql;

  /// Runs `sql` with `args` as ?1, ?2, ...: the first column of the first row, or for a
  /// statement without rows the LAST_INSERT_ID value when it changed rows; nullopt for no row,
  /// NULL, no change, or a duplicate key. @throws idem::StorageError subclasses.
  template <class... Args>
  static std::optional<std::int64_t> query_int64(Tx& tx, const std::string& sql,
                                                 const Args&... args) {
    const std::array<mysql::Param, sizeof...(Args)> p{mysql::detail::to_param(args)...};
    return mysql::detail::helper_value(tx, sql, p.data(), p.size());
  }
};

}  // namespace idem
