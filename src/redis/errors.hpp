// SPDX-License-Identifier: MIT
// The one place where hiredis and server failures become idem exceptions.
#pragma once

#include <string_view>

#include "idem/export.hpp"

namespace idem::redis::detail {

/// What went wrong, as the adapter saw it. Nothing of hiredis leaves errors.cpp but messages.
struct Failure {
  enum class Kind {
    kContext,        ///< the connection failed: `hiredis_err` (REDIS_ERR_*) and `sys_errno`
    kServer,         ///< the server answered an error reply: `message` is its text
    kProtocol,       ///< the reply had a shape idem's scripts never produce
    kPoolExhausted,  ///< no free connection within pool_wait_timeout
    kServerDown,     ///< a connect failed moments ago (reconnect_backoff): `message` says why
    kCorrupt,        ///< a value under an idem key that idem did not write
    kTls,            ///< TLS refused: certificate not trusted, name mismatch, handshake error
    kRefusedDown,    ///< a connect was refused for good moments ago (TLS, AUTH): `message`
  };
  Kind kind;
  std::string_view context;      ///< what was being done, e.g. "claim idem:{payment|o1}"
  std::string_view message;      ///< hiredis errstr, server reply, or detail
  int hiredis_err = 0;           ///< redisContext::err for kContext
  int sys_errno = 0;             ///< errno right after the failing hiredis call
  bool write_may_apply = false;  ///< a timeout could leave this write applied (OutcomeUnknown)
  /// The command was written whole before the connection failed (closed, reset, an I/O
  /// error while reading its reply): with write_may_apply, the server may have applied it.
  bool sent = false;
};

/// True when a kContext failure means the server went away (refused, reset, EOF): connections
/// opened before it are stale too.
/// (server_gone and throw_error are exported from a shared libidem_redis for libidem_mq.)
IDEM_EXPORT bool server_gone(int hiredis_err, int sys_errno) noexcept;

/// Throws the idem exception for `f` (StorageUnavailable, StorageTimeout, OutcomeUnknown,
/// StorageError or CorruptRecord), keeping the backend's message in what().
[[noreturn]] IDEM_EXPORT void throw_error(const Failure& f);

}  // namespace idem::redis::detail
