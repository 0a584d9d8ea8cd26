// SPDX-License-Identifier: MIT
// idem::StateMachine on PostgreSQL: the driver for libpqxx transactions.
//
// Statements run in the caller's transaction. libpqxx errors become idem exceptions, except
// serialization failures and deadlocks (pqxx::transaction_rollback: 40001, 40P01), which are
// rethrown unchanged so PostgresStore::run_transactional (or the caller) can re-run the
// whole transaction.
#pragma once

#include <optional>
#include <pqxx/pqxx>
#include <string>
#include <type_traits>
#include <vector>

#include "idem/export.hpp"
#include "idem/state_machine.hpp"

namespace idem::postgres::detail {
/// Runs a StateMachine UPDATE; @return rows changed.
IDEM_EXPORT long long state_machine_update(pqxx::transaction_base& tx, const std::string& sql,
                                           const std::vector<std::optional<std::string>>& params);
/// Reads a row's state; nullopt when there is no such row.
IDEM_EXPORT std::optional<std::string> state_machine_current(pqxx::transaction_base& tx,
                                                             const std::string& sql,
                                                             const std::string& id);
}  // namespace idem::postgres::detail

namespace idem {

/// Runs StateMachine statements on any libpqxx transaction (pqxx::work, subtransaction, ...).
template <class Tx>
struct StateMachineDriver<Tx, std::enable_if_t<std::is_base_of_v<pqxx::transaction_base, Tx>>> {
  /// PostgreSQL's numbered parameter "$n".
  static std::string placeholder(int n) { return "$" + std::to_string(n); }
  /// Runs the UPDATE; @return rows changed.
  static long long update(pqxx::transaction_base& tx, const std::string& sql,
                          const std::vector<std::optional<std::string>>& params) {
    return postgres::detail::state_machine_update(tx, sql, params);
  }
  /// Reads the state of row `id`; nullopt when there is no such row.
  static std::optional<std::string> current(pqxx::transaction_base& tx, const std::string& sql,
                                            const std::string& id) {
    return postgres::detail::state_machine_current(tx, sql, id);
  }
};

}  // namespace idem
