// SPDX-License-Identifier: MIT
// The one place where MariaDB Connector/C and server errors become idem exceptions.
#pragma once

#include <chrono>
#include <string_view>

namespace idem::mysql::detail {

// Error numbers idem acts on (server 1xxx, client library 2xxx).
inline constexpr unsigned kRecordChanged = 1020;  // MariaDB >= 11.6 snapshot isolation
inline constexpr unsigned kAccessDenied = 1045;
inline constexpr unsigned kBadDatabase = 1049;
inline constexpr unsigned kDuplicateEntry = 1062;
inline constexpr unsigned kLockWaitTimeout = 1205;
inline constexpr unsigned kDeadlock = 1213;
inline constexpr unsigned kDuplicateEntryWithKeyName = 1586;
inline constexpr unsigned kNeedReprepare = 1615;
inline constexpr unsigned kTooManyPreparedStatements = 1461;  // max_prepared_stmt_count
inline constexpr unsigned kServerGone = 2006;
inline constexpr unsigned kServerLost = 2013;

/// A duplicate of a unique key (1062, 1586).
constexpr bool is_duplicate(unsigned n) noexcept {
  return n == kDuplicateEntry || n == kDuplicateEntryWithKeyName;
}
/// A lock wait that ended the statement (1205), a deadlock that rolled the transaction back
/// (1213), or a row changed since the transaction's snapshot (1020, MariaDB >= 11.6 under
/// REPEATABLE READ with innodb_snapshot_isolation, its default; rolls the transaction back):
/// running the whole transaction again may succeed.
constexpr bool is_lock_conflict(unsigned n) noexcept {
  return n == kLockWaitTimeout || n == kDeadlock || n == kRecordChanged;
}
/// The connection cannot be used any more (lost, gone, or never opened): close it.
bool is_connection_failure(unsigned n) noexcept;

/// Whether error `n` refuses a new connection for a connection limit: the server's
/// max_connections (1040), max_user_connections (1203) or the account's own limits (1226).
bool is_connection_limit(unsigned n) noexcept;

/// What a failing call was doing, for the message and for what a lost connection means.
struct Context {
  std::string_view what;  ///< e.g. "claim", "commit", "statement"
  /// How long the failing call waited (a lost connection after read_timeout is a timeout).
  std::chrono::steady_clock::duration waited{};
  std::chrono::seconds read_timeout{0};
};

/// Throws the idem exception for error `number` (with the SQLSTATE and message kept, and the
/// error number readable through idem::mysql::ServerError):
///   * 1062/1586 duplicate key: DuplicateKey (callers that expect it catch it first);
///   * 1205 lock wait timeout, and 2013 after waiting read_timeout: StorageTimeout;
///   * 1213 deadlock, lost or refused connections, too many connections, a read-only server,
///     a shutdown: StorageUnavailable (retryable);
///   * 1045/1044/1049/1130 (credentials, privileges, unknown database), a bad TLS setup: a
///     non-retryable StorageError that says which setting to fix;
///   * anything else: StorageError.
[[noreturn]] void throw_error(unsigned number, std::string_view sqlstate, std::string_view message,
                              const Context& context);

/// Throws OutcomeUnknown for a connection lost at COMMIT that could not be resolved.
[[noreturn]] void throw_outcome_unknown(unsigned number, std::string_view sqlstate,
                                        std::string_view message, std::string_view context);

}  // namespace idem::mysql::detail
