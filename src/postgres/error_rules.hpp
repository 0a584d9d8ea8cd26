// SPDX-License-Identifier: MIT
// What a PostgreSQL failure means to idem, for both PostgreSQL stores: the synchronous one
// (errors.cpp, from libpqxx exceptions) and the asynchronous one (src/async, from libpq's results
// and connection messages). Header-only, so the asynchronous library needs none of
// libidem_postgres's internals.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace idem::postgres::detail {

// libpq quotes a malformed URI whole in its message ("... in URI: "postgresql://u:pw@[bad"")
// and a message may carry conninfo text: every password is masked before it enters an idem
// message ("://user:***@", "password=***"). A malformed URI's password may hold any character
// ('#', '?', '/', a blank): everything from the user name's ':' to the last '@' before the
// quote or line ends is masked (more than the password, never less).
inline std::string scrub(std::string s) {
  for (std::size_t p = s.find("://"); p != std::string::npos; p = s.find("://", p + 3)) {
    const std::size_t start = p + 3;
    std::size_t end = s.find_first_of("\"\n", start);
    if (end == std::string::npos) end = s.size();
    const std::size_t at = end == start ? std::string::npos : s.rfind('@', end - 1);
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

// libpq's TLS checks refused the server: an untrusted certificate, one for another host name,
// no root certificate to verify with. It fails again until the configuration changes (or it is
// an impostor): StorageError, not retryable, not an outage.
inline bool refused_by_tls_checks(std::string_view what) noexcept {
  for (std::string_view needle :
       {"certificate verify failed", "does not match host name", "root certificate file"}) {
    if (what.find(needle) != std::string_view::npos) return true;
  }
  return false;
}

// libpq's and the server's texts for a connection that can never succeed as configured. libpq
// reports a failed connection by message only (no SQLSTATE), so these are matched as text; the
// server's FATAL lines are in English unless its lc_messages says otherwise.
inline constexpr std::string_view kConfigurationMessages[] = {
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
/// True when a failed connection's message says it can never succeed as configured: unknown
/// database or role, a refused password or pg_hba.conf rule, a malformed conninfo string or
/// URI (libpq reports these by text only).
inline bool is_configuration_error(std::string_view message) noexcept {
  for (auto m : kConfigurationMessages) {
    if (message.find(m) != std::string_view::npos) return true;
  }
  return false;
}

/// The idem error a SQLSTATE stands for.
enum class SqlstateKind {
  kUnavailable,  ///< StorageUnavailable: transient, the store is unavailable for now
  kTimeout,      ///< StorageTimeout: statement_timeout or lock_timeout
  kUnknown,      ///< OutcomeUnknown: the server cannot tell whether the statement completed
  kError,        ///< StorageError: anything else
};

/// What `state` means (see SqlstateKind).
inline SqlstateKind sqlstate_kind(const std::string& state) noexcept {
  // Class 08: connection exception; 57P01-3: shutdown / cannot connect now; 53: insufficient
  // resources (too many connections, disk full, out of memory); 25006: read-only transaction
  // (a standby after failover): all transient, the store is unavailable for now.
  if (state.rfind("08", 0) == 0 || state == "57P01" || state == "57P02" || state == "57P03" ||
      state.rfind("53", 0) == 0 || state == "25006") {
    return SqlstateKind::kUnavailable;
  }
  // 57014: statement_timeout (query_canceled); 55P03: lock_timeout.
  if (state == "57014" || state == "55P03") return SqlstateKind::kTimeout;
  // 40001/40P01 reach here only once the retries are spent: transient contention.
  if (state == "40001" || state == "40P01") return SqlstateKind::kUnavailable;
  // 40003: the server cannot tell whether the statement completed.
  if (state == "40003") return SqlstateKind::kUnknown;
  return SqlstateKind::kError;
}

}  // namespace idem::postgres::detail
