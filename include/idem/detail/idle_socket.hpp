// SPDX-License-Identifier: MIT
// What a pooled connection's socket holds while the connection sits idle, seen without blocking
// and without reading: a server that closed the connection behind the client's back (an idle
// timeout, KILL, a restart) shows as the end of the stream. Used by the MySQL and Redis pools
// before they lend an idle connection.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <cerrno>

namespace idem::detail {

/// An idle connection's socket: as it was left (kQuiet), closed by the server or failed
/// (kClosed), or holding bytes nobody asked for (kUnread: the server's last words before it
/// closed, or a record a TLS layer keeps; the protocol must tell which).
enum class IdleSocket { kQuiet, kClosed, kUnread };

/// One non-blocking MSG_PEEK of `fd`; nothing is consumed. A negative `fd` is kClosed.
inline IdleSocket peek_idle_socket(int fd) noexcept {
  if (fd < 0) return IdleSocket::kClosed;
  char byte = 0;
  const ssize_t n = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return IdleSocket::kUnread;
  if (n == 0) return IdleSocket::kClosed;
  return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? IdleSocket::kQuiet
                                                                   : IdleSocket::kClosed;
}

}  // namespace idem::detail
