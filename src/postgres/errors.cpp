// SPDX-License-Identifier: MIT
// The one place libpqxx exceptions become idem exceptions (SQLSTATE and message kept).
#include "errors.hpp"

#include <exception>
#include <pqxx/pqxx>
#include <string>
#include <utility>

#include "idem/errors.hpp"

namespace idem::postgres::detail {

std::string sqlstate_of(const std::exception& e) {
  // libpqxx 6 derives transaction_rollback from failure, without a SQLSTATE; 7 from sql_error.
  if (dynamic_cast<const pqxx::serialization_failure*>(&e) != nullptr) return "40001";
  if (dynamic_cast<const pqxx::deadlock_detected*>(&e) != nullptr) return "40P01";
  if (dynamic_cast<const pqxx::statement_completion_unknown*>(&e) != nullptr) return "40003";
  if (const auto* s = dynamic_cast<const pqxx::sql_error*>(&e)) return s->sqlstate();
  return {};
}

bool is_pqxx_exception(const std::exception& e) noexcept {
  return dynamic_cast<const pqxx::failure*>(&e) != nullptr ||
         dynamic_cast<const pqxx::usage_error*>(&e) != nullptr ||
         dynamic_cast<const pqxx::internal_error*>(&e) != nullptr ||
         dynamic_cast<const pqxx::conversion_error*>(&e) != nullptr ||
         dynamic_cast<const pqxx::range_error*>(&e) != nullptr;
}

namespace {
std::string trimmed(const char* what) {
  std::string s = what == nullptr ? std::string() : std::string(what);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

std::string describe(std::string_view context, const std::exception& e) {
  std::string what = "postgres: ";
  what.append(context);
  what.append(": ");
  auto state = sqlstate_of(e);
  if (!state.empty()) {
    what.append("[SQLSTATE ");
    what.append(state);
    what.append("] ");
  }
  what.append(scrub(trimmed(e.what())));
  return what;
}

}  // namespace

namespace {
// Every translation keeps the libpqxx exception in flight as its cause: the idem exception is
// also a std::nested_exception, so `std::rethrow_if_nested(e)` rethrows the pqxx::sql_error
// (its sqlstate(), its query()). Call only inside a catch block.
template <class E>
[[noreturn]] void throw_caused(std::string what) {
  std::throw_with_nested(E(std::move(what)));
}

[[noreturn]] void throw_for_sqlstate(const std::string& state, std::string what) {
  switch (sqlstate_kind(state)) {
    case SqlstateKind::kUnavailable:
      throw_caused<StorageUnavailable>(std::move(what));
    case SqlstateKind::kTimeout:
      throw_caused<StorageTimeout>(std::move(what));
    case SqlstateKind::kUnknown:
      throw_caused<OutcomeUnknown>(std::move(what));
    case SqlstateKind::kError:
      break;
  }
  throw_caused<StorageError>(std::move(what));
}
}  // namespace

void rethrow_translated(std::string_view context) {
  try {
    throw;
  } catch (const idem::Error&) {
    throw;
  } catch (const pqxx::in_doubt_error& e) {
    throw_caused<OutcomeUnknown>(describe(context, e));
  } catch (const pqxx::broken_connection& e) {
    // A database, role, password or URI that is wrong stays wrong: retrying cannot help, so it
    // is a usage (configuration) error, as a malformed Redis URI is.
    if (is_configuration_error(e.what())) {
      throw_caused<UsageError>(describe(context, e) + " (configuration error: check the conninfo)");
    }
    if (refused_by_tls_checks(e.what())) throw_caused<StorageError>(describe(context, e));
    throw_caused<StorageUnavailable>(describe(context, e));
  } catch (const pqxx::transaction_rollback& e) {
    throw_for_sqlstate(sqlstate_of(e), describe(context, e));
  } catch (const pqxx::sql_error& e) {
    throw_for_sqlstate(e.sqlstate(), describe(context, e));
  } catch (const std::exception& e) {
    throw_caused<StorageError>(describe(context, e));
  } catch (...) {
    throw_caused<StorageError>("postgres: " + std::string(context) + ": unknown exception");
  }
}

}  // namespace idem::postgres::detail
