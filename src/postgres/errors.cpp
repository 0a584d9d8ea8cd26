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

// libpq quotes a malformed URI whole in its message ("... in URI: "postgresql://u:pw@[bad"")
// and a message may carry conninfo text: every password is masked before it enters an idem
// message ("://user:***@", "password=***").
std::string scrub(std::string s) {
  for (std::size_t p = s.find("://"); p != std::string::npos; p = s.find("://", p + 3)) {
    const std::size_t start = p + 3;
    std::size_t end = s.find_first_of("/?#\" \n", start);
    if (end == std::string::npos) end = s.size();
    const std::size_t at = s.rfind('@', end);
    if (at == std::string::npos || at < start) continue;
    const std::size_t colon = s.find(':', start);
    if (colon != std::string::npos && colon < at) s.replace(colon + 1, at - colon - 1, "***");
  }
  for (std::size_t p = s.find("password"); p != std::string::npos; p = s.find("password", p + 8)) {
    std::size_t v = p + 8;
    while (v < s.size() && s[v] == ' ') ++v;
    if (v >= s.size() || s[v] != '=') continue;
    ++v;
    while (v < s.size() && s[v] == ' ') ++v;
    std::size_t end;
    if (v < s.size() && s[v] == '\'') {
      end = s.find('\'', v + 1);
      end = end == std::string::npos ? s.size() : end + 1;
    } else {
      end = s.find_first_of(" \n\"", v);
      if (end == std::string::npos) end = s.size();
    }
    s.replace(v, end - v, "***");
  }
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

// libpq's TLS checks refused the server: an untrusted certificate, one for another host name,
// no root certificate to verify with. It fails again until the configuration changes (or it is
// an impostor): StorageError, not retryable, not an outage.
bool refused_by_tls_checks(std::string_view what) noexcept {
  for (std::string_view needle :
       {"certificate verify failed", "does not match host name", "root certificate file"}) {
    if (what.find(needle) != std::string_view::npos) return true;
  }
  return false;
}

// libpq's and the server's texts for a connection that can never succeed as configured. libpq
// reports a failed connection by message only (no SQLSTATE), so these are matched as text; the
// server's FATAL lines are in English unless its lc_messages says otherwise.
constexpr std::string_view kConfigurationMessages[] = {
    // The server refused who or what we asked for (SQLSTATE 3D000, 28000, 28P01, 42501).
    "\" does not exist",  // database "x" / role "x" does not exist
    "password authentication failed",
    "no password supplied",
    "no pg_hba.conf entry",
    "pg_hba.conf rejects connection",
    "is not permitted to log in",
    "permission denied for database",
    "server does not support SSL, but SSL was required",
    // libpq could not parse the conninfo string or URI.
    "in connection info string",  // missing "=" after ..., unterminated quoted string in ...
    "invalid connection option",
    "invalid URI",
    "in URI",  // unexpected character ... in URI, IPv6 host address ... in URI
    "URI query parameter",
    "percent-encoded",
    "invalid integer value",
    "invalid port number",
    "invalid sslmode value",
    "invalid gssencmode value",
    "invalid target_session_attrs value",
};
}  // namespace

bool is_configuration_error(std::string_view message) noexcept {
  for (auto m : kConfigurationMessages) {
    if (message.find(m) != std::string_view::npos) return true;
  }
  return false;
}

namespace {
// Every translation keeps the libpqxx exception in flight as its cause: the idem exception is
// also a std::nested_exception, so `std::rethrow_if_nested(e)` rethrows the pqxx::sql_error
// (its sqlstate(), its query()). Call only inside a catch block.
template <class E>
[[noreturn]] void throw_caused(std::string what) {
  std::throw_with_nested(E(std::move(what)));
}

[[noreturn]] void throw_for_sqlstate(const std::string& state, std::string what) {
  // Class 08: connection exception; 57P01-3: shutdown / cannot connect now; 53: insufficient
  // resources (too many connections, disk full, out of memory); 25006: read-only transaction
  // (a standby after failover): all transient, the store is unavailable for now.
  if (state.rfind("08", 0) == 0 || state == "57P01" || state == "57P02" || state == "57P03" ||
      state.rfind("53", 0) == 0 || state == "25006") {
    throw_caused<StorageUnavailable>(std::move(what));
  }
  // 57014: statement_timeout (query_canceled); 55P03: lock_timeout.
  if (state == "57014" || state == "55P03") throw_caused<StorageTimeout>(std::move(what));
  // 40001/40P01 reach here only once the retries are spent: transient contention.
  if (state == "40001" || state == "40P01") throw_caused<StorageUnavailable>(std::move(what));
  // 40003: the server cannot tell whether the statement completed.
  if (state == "40003") throw_caused<OutcomeUnknown>(std::move(what));
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
