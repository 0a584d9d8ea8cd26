// SPDX-License-Identifier: MIT
// idem::StateMachine on SQLite: the driver for idem::sqlite transactions and sessions.
#pragma once

#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "idem/sqlite/sqlite_store.hpp"
#include "idem/state_machine.hpp"

namespace idem {

/// Runs StateMachine statements on an idem::sqlite::Transaction (or any Session).
template <class Tx>
struct StateMachineDriver<Tx, std::enable_if_t<std::is_base_of_v<sqlite::Session, Tx>>> {
  /// SQLite's numbered parameter "?n".
  static std::string placeholder(int n) { return "?" + std::to_string(n); }
  /// Runs the UPDATE; @return rows changed.
  static long long update(sqlite::Session& s, const std::string& sql,
                          const std::vector<std::optional<std::string>>& params) {
    sqlite::Statement st = s.prepare(sql);
    st.borrow_values();  // the parameters outlive the statement
    int i = 0;
    for (const auto& p : params) st.bind(++i, p);
    while (st.step()) {
    }
    return st.changes();
  }
  /// Reads the state of row `id`; nullopt when there is no such row.
  static std::optional<std::string> current(sqlite::Session& s, const std::string& sql,
                                            const std::string& id) {
    sqlite::Statement st = s.prepare(sql);
    st.borrow_values().bind(1, id);
    if (!st.step()) return std::nullopt;
    return st.column_bytes(0);
  }
};

}  // namespace idem
