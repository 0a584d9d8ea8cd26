// SPDX-License-Identifier: MIT
// Session and Transaction: the public face of a pooled connection.
#include "idem/mysql/client.hpp"

#include "connection.hpp"

namespace idem::mysql {

std::uint64_t Session::run(std::string_view sql, const Param* params, std::size_t count,
                           Rows* rows) {
  return conn_->execute(sql, params, count, rows, "statement").affected;
}

void Session::exec_text(std::string_view sql) { conn_->text(sql, "statement"); }

std::uint64_t Session::last_insert_id() const noexcept { return conn_->last_insert_id(); }

st_mysql* Session::native_handle() const noexcept { return conn_->handle(); }

bool Transaction::open() const noexcept { return conn_->transaction_open(); }

namespace detail {
Connection& connection_of(Session& session) noexcept { return *session.conn_; }

std::optional<std::int64_t> helper_value(Session& session, std::string_view sql,
                                         const Param* params, std::size_t count) {
  Rows rows;
  Connection::Outcome out;
  try {
    out = session.conn_->execute(sql, params, count, &rows, "statement");
  } catch (const DuplicateKey&) {
    return std::nullopt;  // MySQL rolled back this statement only
  }
  if (!rows.empty()) {
    if (rows[0].empty() || rows[0][0].is_null()) return std::nullopt;
    return rows[0][0].as_int64();
  }
  if (out.affected == 0) return std::nullopt;
  return static_cast<std::int64_t>(out.insert_id);
}
}  // namespace detail

}  // namespace idem::mysql
