// SPDX-License-Identifier: MIT
// idem::StateMachine on MySQL / MariaDB: the driver for idem::mysql sessions and transactions.
//
// The conditional UPDATE reads the latest committed row whatever the isolation level. The read
// that follows a 0-row UPDATE is a locking one (`LOCK IN SHARE MODE`): under InnoDB's default
// REPEATABLE READ a plain SELECT reads the transaction's snapshot, which can predate the
// concurrent transition that made the UPDATE change nothing, and would then report the old
// state (a duplicate callback answered kRejected instead of kAlreadyThere).
#pragma once

#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "idem/mysql/client.hpp"
#include "idem/state_machine.hpp"

namespace idem {

/// Runs StateMachine statements on idem::mysql::Transaction (or a Session, autocommit).
template <class Tx>
struct StateMachineDriver<Tx, std::enable_if_t<std::is_base_of_v<mysql::Session, Tx>>> {
  /// Numbered "?n" (the MySQL client rewrites them to positional `?`).
  static std::string placeholder(int n) { return "?" + std::to_string(n); }
  /// Runs the UPDATE; @return rows changed.
  static long long update(Tx& tx, const std::string& sql,
                          const std::vector<std::optional<std::string>>& params) {
    std::vector<mysql::Param> p;
    p.reserve(params.size());
    for (const auto& v : params) p.push_back(mysql::detail::to_param(v));
    return static_cast<long long>(tx.run(sql, p.data(), p.size(), nullptr));
  }
  /// Reads the state of row `id` with a locking read; nullopt when there is no such row.
  static std::optional<std::string> current(Tx& tx, const std::string& sql, const std::string& id) {
    auto rows = tx.query(sql + " LOCK IN SHARE MODE", id);
    if (rows.empty()) return std::nullopt;
    return rows[0][0].is_null() ? std::string() : rows[0][0].bytes();
  }
};

}  // namespace idem
