// SPDX-License-Identifier: MIT
// What a PostgreSQL failure means to idem, for both PostgreSQL stores: the synchronous one
// (errors.cpp, from libpqxx exceptions) and the asynchronous one (src/async, from libpq's results
// and connection messages). Header-only, so the asynchronous library needs none of
// libidem_postgres's internals.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

#include "idem/detail/redact.hpp"

namespace idem::postgres::detail {

// libpq's errors for a conninfo or URI it cannot parse quote the offending token, which may be
// a piece of a password: "invalid percent-encoded token: "Pa%ss"", "missing "=" after "secret"
// in connection info string", "invalid integer value "pw" for connection option "port"" (a
// password holding a raw '/'). In such a message every quoted token is masked but "=", a
// connection option's name and a URI (whose password mask_passwords masks).
inline std::string mask_parse_error_tokens(std::string s) {
  static constexpr std::string_view kParseErrors[] = {"in connection info string",
                                                      "invalid connection option",
                                                      "invalid URI",
                                                      "in URI",
                                                      "URI query parameter",
                                                      "percent-encoded",
                                                      "invalid integer value",
                                                      "invalid port number",
                                                      "unterminated quoted string"};
  bool parse_error = false;
  for (std::string_view e : kParseErrors) parse_error = parse_error || s.find(e) != s.npos;
  if (!parse_error) return s;
  static constexpr std::string_view kKept[] = {"=",
                                               "host",
                                               "hostaddr",
                                               "port",
                                               "dbname",
                                               "user",
                                               "password",
                                               "passfile",
                                               "channel_binding",
                                               "connect_timeout",
                                               "client_encoding",
                                               "options",
                                               "application_name",
                                               "fallback_application_name",
                                               "keepalives",
                                               "keepalives_idle",
                                               "keepalives_interval",
                                               "keepalives_count",
                                               "tcp_user_timeout",
                                               "replication",
                                               "gssencmode",
                                               "sslmode",
                                               "requiressl",
                                               "sslcompression",
                                               "sslcert",
                                               "sslkey",
                                               "sslpassword",
                                               "sslrootcert",
                                               "sslcrl",
                                               "sslcrldir",
                                               "sslsni",
                                               "requirepeer",
                                               "ssl_min_protocol_version",
                                               "ssl_max_protocol_version",
                                               "krbsrvname",
                                               "gsslib",
                                               "service",
                                               "target_session_attrs",
                                               "load_balance_hosts"};
  std::string out;
  std::size_t i = 0;
  while (i < s.size()) {
    const std::size_t open = s.find('"', i);
    const std::size_t close = open == s.npos ? s.npos : s.find('"', open + 1);
    if (close == s.npos) break;
    const std::string_view token(s.data() + open + 1, close - open - 1);
    bool kept = token.find("://") != token.npos;
    for (std::string_view k : kKept) kept = kept || token == k;
    out.append(s, i, open + 1 - i);
    out.append(kept ? token : std::string_view("***"));
    out.push_back('"');
    i = close + 1;
  }
  out.append(s, i, s.npos);
  return out;
}

// libpq ends a URI's user information at its first '@' (before any '/'): the rest of a
// password holding a raw '@' becomes the host name, which "could not translate host name
// \"...\"" then quotes, and no mask can tell it from a host. Such a URI (a second '@' after the
// first, before the query) is refused up front. @return the message to refuse it with, or ""
// when the string is not a URI or has no such '@'.
inline std::string raw_at_in_uri_userinfo(std::string_view conninfo) {
  if (conninfo.rfind("postgresql://", 0) != 0 && conninfo.rfind("postgres://", 0) != 0) return {};
  const std::string_view rest = conninfo.substr(0, conninfo.find('?'));
  const std::size_t first = rest.find('@');
  if (first == std::string_view::npos || rest.find('@', first + 1) == std::string_view::npos) {
    return {};
  }
  return "the postgresql:// URI has more than one '@': a '@' in the user name or password must "
         "be percent-encoded as %40 (the URI is not shown: it holds a password)";
}

// Every password is masked before a message enters an idem error: the forms of
// idem/detail/redact.hpp, and the tokens libpq's parse errors quote.
inline std::string scrub(std::string s) {
  return mask_parse_error_tokens(idem::detail::mask_passwords(std::move(s)));
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

// Whether `message` contains one of `texts` (libpq reports a failed connection by text only).
template <std::size_t N>
bool mentions_any(std::string_view message, const std::string_view (&texts)[N]) noexcept {
  for (std::string_view t : texts) {
    if (message.find(t) != std::string_view::npos) return true;
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
  return mentions_any(message, kConfigurationMessages);
}

/// What the server says when it refuses a connection for a connection limit (SQLSTATE 53300;
/// libpq reports a refused connection by text only): max_connections, the slots reserved for
/// superusers, a role's or a database's CONNECTION LIMIT.
inline constexpr std::string_view kConnectionLimitMessages[] = {
    "too many clients already",
    "remaining connection slots are reserved",
    "too many connections for role",
    "too many connections for database",
};
/// True when a failed connection's message says the server's connection limit refused it
/// (english server messages: under another lc_messages it is not recognised, and the pool
/// fails the call at once as for any other refusal).
inline bool is_connection_limit(std::string_view message) noexcept {
  return mentions_any(message, kConnectionLimitMessages);
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
