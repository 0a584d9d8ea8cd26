// SPDX-License-Identifier: MIT
// Failures of the asynchronous Redis layer as idem exceptions, through the Redis adapter's one
// choke point (src/redis/errors.cpp): the same types and messages as the synchronous store.
#pragma once

#include <exception>
#include <string_view>

#include "redis/errors.hpp"
#include "redis_connection.hpp"

namespace idem::async::detail {

/// The exception for a command that got no reply. `what` names the call ("claim idem:{...}");
/// `write` is true for commands whose effect may apply without a reply (complete, release,
/// fill): a timeout, or a connection lost, after sending is then OutcomeUnknown.
inline std::exception_ptr connection_error(const ConnectionFailure& f, std::string_view what,
                                           bool write) noexcept {
  using redis::detail::Failure;
  try {
    Failure out{Failure::Kind::kContext, what,        f.message,
                f.hiredis_err,           f.sys_errno, write && f.sent};
    // The command went out whole before the connection broke: a write's outcome is unknown
    // (OutcomeUnknown), as the synchronous store says, not "unavailable".
    out.sent = f.sent;
    if (f.server_down) out.kind = Failure::Kind::kServerDown;
    if (f.server_reply) out.kind = Failure::Kind::kServer;
    redis::detail::throw_error(out);
  } catch (...) {
    return std::current_exception();
  }
}

/// The exception for an error reply (`text` without the leading '-').
inline std::exception_ptr reply_error(std::string_view what, std::string_view text) noexcept {
  using redis::detail::Failure;
  try {
    redis::detail::throw_error(Failure{Failure::Kind::kServer, what, text});
  } catch (...) {
    return std::current_exception();
  }
}

/// The exception for a reply of an unexpected shape.
inline std::exception_ptr protocol_error(std::string_view what, std::string_view detail) noexcept {
  using redis::detail::Failure;
  try {
    redis::detail::throw_error(Failure{Failure::Kind::kProtocol, what, detail});
  } catch (...) {
    return std::current_exception();
  }
}

/// The exception for a value idem did not write.
inline std::exception_ptr corrupt_error(std::string_view what, std::string_view detail) noexcept {
  using redis::detail::Failure;
  try {
    redis::detail::throw_error(Failure{Failure::Kind::kCorrupt, what, detail});
  } catch (...) {
    return std::current_exception();
  }
}

}  // namespace idem::async::detail
