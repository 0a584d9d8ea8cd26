// SPDX-License-Identifier: MIT
// idem::StateMachine's PostgreSQL driver: bound parameters, errors translated.
#include "idem/postgres/state_machine.hpp"

#include "errors.hpp"
#include "idem/postgres/detail/pqxx_compat.hpp"

namespace idem::postgres::detail {

long long state_machine_update(pqxx::transaction_base& tx, const std::string& sql,
                               const std::vector<std::optional<std::string>>& params) {
  for (const auto& p : params) refuse_nul_in("idem::StateMachine", p);
  try {
    return static_cast<long long>(exec_dynamic(tx, sql, params).affected_rows());
  } catch (const pqxx::transaction_rollback&) {
    throw;  // 40001/40P01: the caller re-runs the whole transaction
  } catch (...) {
    rethrow_translated("state machine update");
  }
}

std::optional<std::string> state_machine_current(pqxx::transaction_base& tx, const std::string& sql,
                                                 const std::string& id) {
  refuse_nul("idem::StateMachine", id);
  try {
    pqxx::result r = exec_params(tx, sql, id);
    if (r.empty()) return std::nullopt;
    return r[0][0].is_null() ? std::string() : r[0][0].as<std::string>();
  } catch (const pqxx::transaction_rollback&) {
    throw;
  } catch (...) {
    rethrow_translated("state machine read");
  }
}

}  // namespace idem::postgres::detail
