// SPDX-License-Identifier: MIT
// The one place where MariaDB Connector/C and server errors become idem exceptions.
#include "errors.hpp"

#include <string>

#include "idem/errors.hpp"
#include "idem/mysql/client.hpp"

namespace idem::mysql::detail {
namespace {

// Server errors.
constexpr unsigned kConnectionCount = 1040;  // too many connections
constexpr unsigned kDbAccessDenied = 1044;   // no privilege on the database
constexpr unsigned kServerShutdown = 1053;   // the server is shutting down
constexpr unsigned kNetReadError = 1158;     // 1158..1161: the server's network reads/writes
constexpr unsigned kNetWriteInterrupted = 1161;
constexpr unsigned kTooManyUserConnections = 1203;  // the max_user_connections variable
// An account's own limits (CREATE USER ... WITH MAX_USER_CONNECTIONS, MAX_QUERIES_PER_HOUR...).
constexpr unsigned kUserLimitReached = 1226;
constexpr unsigned kDiskFull = 1021;           // the server waits for space, then gives up
constexpr unsigned kTableFull = 1114;          // a table (or its tablespace) cannot grow
constexpr unsigned kHostNotPrivileged = 1130;  // host not allowed to connect
constexpr unsigned kReadOnly = 1290;           // --read-only (a replica after failover)
constexpr unsigned kQueryInterrupted = 1317;   // KILL QUERY
constexpr unsigned kReadOnlyTransaction = 1792;
constexpr unsigned kConnectionKilled = 1927;         // MariaDB: KILL CONNECTION
constexpr unsigned kMariadbStatementTimeout = 1969;  // max_statement_time
constexpr unsigned kMysqlStatementTimeout = 3024;    // max_execution_time
constexpr unsigned kClientInactivityTimeout = 4031;  // MySQL 8: disconnected for inactivity
// Client library errors.
constexpr unsigned kConnectionError = 2002;
constexpr unsigned kConnHostError = 2003;
constexpr unsigned kUnknownHost = 2005;
constexpr unsigned kServerHandshake = 2012;
constexpr unsigned kTlsError = 2026;
constexpr unsigned kServerLostExtended = 2055;
constexpr unsigned kNetRead = 5013;
constexpr unsigned kNetWrite = 5014;

std::string describe(unsigned number, std::string_view sqlstate, std::string_view message,
                     std::string_view context) {
  std::string what = "mysql: ";
  what.append(context);
  what.append(": [");
  what.append(std::to_string(number));
  if (!sqlstate.empty()) {
    what.append(" ");
    what.append(sqlstate);
  }
  what.append("] ");
  what.append(message);
  return what;
}

template <class E>
[[noreturn]] void raise(const std::string& what, unsigned number, std::string_view sqlstate) {
  throw Failure<E>(what, number, std::string(sqlstate));
}

}  // namespace

bool is_connection_failure(unsigned n) noexcept {
  switch (n) {
    case kConnectionError:
    case kConnHostError:
    case kUnknownHost:
    case kServerGone:
    case kServerHandshake:
    case kServerLost:
    case kServerLostExtended:
    case kNetRead:
    case kNetWrite:
    case kServerShutdown:
    case kConnectionKilled:
    case kClientInactivityTimeout:
      return true;
    default:
      return n >= kNetReadError && n <= kNetWriteInterrupted;
  }
}

bool is_connection_limit(unsigned n) noexcept {
  return n == kConnectionCount || n == kTooManyUserConnections || n == kUserLimitReached;
}

void throw_error(unsigned number, std::string_view sqlstate, std::string_view message,
                 const Context& context) {
  std::string what = describe(number, sqlstate, message, context.what);
  if (is_duplicate(number)) {
    throw DuplicateKey(what, number, std::string(sqlstate));
  }
  if (number == kLockWaitTimeout || number == kMariadbStatementTimeout ||
      number == kMysqlStatementTimeout) {
    raise<StorageTimeout>(what, number, sqlstate);
  }
  if (number == kServerLost && context.read_timeout.count() > 0 &&
      context.waited + std::chrono::milliseconds(50) >= context.read_timeout) {
    raise<StorageTimeout>(what + " (no answer within read_timeout " +
                              std::to_string(context.read_timeout.count()) + " s)",
                          number, sqlstate);
  }
  switch (number) {
    case kAccessDenied:
      raise<StorageError>(
          what + " (check the user, password and client certificate of the connection URI)", number,
          sqlstate);
    case kDbAccessDenied:
    case kHostNotPrivileged:
      raise<StorageError>(what + " (grant the user access, or connect as another user)", number,
                          sqlstate);
    case kBadDatabase:
      raise<StorageError>(what + " (create the database, or fix the URI's database name)", number,
                          sqlstate);
    case kTlsError:
      raise<StorageError>(what + " (check the TLS settings of the connection URI)", number,
                          sqlstate);
    case kDeadlock:
    case kRecordChanged:
    case kConnectionCount:
    case kTooManyUserConnections:
    case kUserLimitReached:
    case kDiskFull:
    case kTableFull:
    case kReadOnly:
    case kReadOnlyTransaction:
    case kQueryInterrupted:
      raise<StorageUnavailable>(what, number, sqlstate);
    case kTooManyPreparedStatements:
      raise<StorageUnavailable>(
          what + " (the server's max_prepared_stmt_count, shared by every client, is reached)",
          number, sqlstate);
    default:
      break;
  }
  if (is_connection_failure(number)) raise<StorageUnavailable>(what, number, sqlstate);
  raise<StorageError>(what, number, sqlstate);
}

void throw_outcome_unknown(unsigned number, std::string_view sqlstate, std::string_view message,
                           std::string_view context) {
  // A message describe() already formatted (a caught error's what()) keeps only its own text:
  // the operation, number and state are said once.
  if (message.rfind("mysql: ", 0) == 0) {
    const auto open = message.find(": [");
    const auto close = message.find("] ");
    if (open != std::string_view::npos && close != std::string_view::npos && open < close) {
      message.remove_prefix(close + 2);
    }
  }
  raise<OutcomeUnknown>(describe(number, sqlstate, message, context), number, sqlstate);
}

}  // namespace idem::mysql::detail
