// SPDX-License-Identifier: MIT
// RAII owners of the MariaDB Connector/C handles.
#pragma once

#include <mysql.h>

#include <memory>

namespace idem::mysql::detail {

struct MysqlCloser {
  void operator()(MYSQL* m) const noexcept { mysql_close(m); }
};
struct StatementCloser {
  void operator()(MYSQL_STMT* s) const noexcept { mysql_stmt_close(s); }
};
struct ResultFreer {
  void operator()(MYSQL_RES* r) const noexcept { mysql_free_result(r); }
};

/// An open (or opening) client connection; mysql_close on destruction.
using MysqlPtr = std::unique_ptr<MYSQL, MysqlCloser>;
/// A prepared statement; mysql_stmt_close on destruction.
using StatementPtr = std::unique_ptr<MYSQL_STMT, StatementCloser>;
/// A result set or result metadata; mysql_free_result on destruction.
using ResultPtr = std::unique_ptr<MYSQL_RES, ResultFreer>;

}  // namespace idem::mysql::detail
