// SPDX-License-Identifier: MIT
// The one place where hiredis and server failures become idem exceptions (see errors.hpp).
#include "errors.hpp"

#include <hiredis/hiredis.h>

#include <cerrno>
#include <string>

#include "idem/errors.hpp"

namespace idem::redis::detail {
namespace {

bool starts_with(std::string_view s, std::string_view p) noexcept {
  return s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}

// An error reply's code is its first word ("LOADING Redis is loading ..."). A command that
// failed inside a script may come back wrapped ("ERR Error running script ...: -READONLY ..."
// on older servers), so a code is also recognised after "-" or a space within an ERR reply.
bool has_code(std::string_view msg, std::string_view code) {
  if (starts_with(msg, code) && (msg.size() == code.size() || msg[code.size()] == ' ')) {
    return true;
  }
  if (!starts_with(msg, "ERR")) return false;
  std::string dashed = "-" + std::string(code) + " ";
  std::string spaced = " " + std::string(code) + " ";
  return msg.find(dashed) != std::string_view::npos || msg.find(spaced) != std::string_view::npos;
}

bool is_timeout(int hiredis_err, int sys_errno, std::string_view errstr) noexcept {
  if (hiredis_err != REDIS_ERR_IO) return false;
  if (sys_errno == EAGAIN || sys_errno == EWOULDBLOCK || sys_errno == ETIMEDOUT ||
      sys_errno == EINPROGRESS) {
    return true;
  }
  // errno may have been overwritten after hiredis set errstr from it.
  return errstr.find("timed out") != std::string_view::npos ||
         errstr.find("temporarily unavailable") != std::string_view::npos;
}

std::string compose(const Failure& f, std::string_view label) {
  std::string what = "redis: ";
  what.append(f.context);
  what.append(": ");
  what.append(label);
  if (!f.message.empty()) {
    what.append(": ");
    what.append(f.message);
  }
  return what;
}

}  // namespace

bool server_gone(int hiredis_err, int sys_errno) noexcept {
  if (hiredis_err == REDIS_ERR_EOF) return true;
  if (hiredis_err != REDIS_ERR_IO) return false;
  return sys_errno == ECONNREFUSED || sys_errno == ECONNRESET || sys_errno == EPIPE ||
         sys_errno == ENOENT || sys_errno == ECONNABORTED;
}

void throw_error(const Failure& f) {
  using Kind = Failure::Kind;
  switch (f.kind) {
    case Kind::kContext: {
      if (is_timeout(f.hiredis_err, f.sys_errno, f.message)) {
        if (f.write_may_apply) {
          throw OutcomeUnknown(compose(f, "timed out; the write may have been applied"));
        }
        throw StorageTimeout(compose(f, "timed out"));
      }
      // The connection broke after the write went out whole: the server may have applied it
      // before the connection was lost (the reply is what was lost).
      if (f.write_may_apply && f.sent &&
          (f.hiredis_err == REDIS_ERR_EOF || f.hiredis_err == REDIS_ERR_IO)) {
        throw OutcomeUnknown(
            compose(f, "connection lost after the write was sent; the write may have been "
                       "applied"));
      }
      switch (f.hiredis_err) {
        case REDIS_ERR_EOF:
          throw StorageUnavailable(compose(f, "connection closed by the server"));
        case REDIS_ERR_PROTOCOL:
          throw StorageError(compose(f, "protocol error"));
        case REDIS_ERR_OOM:
          throw StorageError(compose(f, "client out of memory"));
        case REDIS_ERR_IO:
          throw StorageUnavailable(compose(f, "I/O error"));
        default:
          throw StorageUnavailable(compose(f, "connection error"));
      }
    }
    case Kind::kServer: {
      const std::string_view m = f.message;
      if (has_code(m, "LOADING") || has_code(m, "BUSY") || has_code(m, "MASTERDOWN") ||
          has_code(m, "READONLY") || has_code(m, "TRYAGAIN") || has_code(m, "CLUSTERDOWN") ||
          has_code(m, "MOVED") || has_code(m, "ASK")) {
        // MOVED / ASK reach here only past the redirect limit (a cluster in flux), or from a
        // cluster node addressed with redis:// instead of redis-cluster://.
        throw StorageUnavailable(compose(f, "server unavailable"));
      }
      // maxmemory reached with noeviction: writes are refused until keys expire or memory is
      // freed, a state that passes. Retryable (a completion refused so is OutcomeUnknown, not
      // a response "refused for good"), and a guard with a durable store runs the call there.
      if (has_code(m, "OOM")) throw StorageUnavailable(compose(f, "server out of memory"));
      // maxclients: the server refused a new connection (and closed it); it passes as other
      // clients leave.
      if (m.find("max number of clients reached") != std::string_view::npos) {
        throw StorageUnavailable(compose(f, "server connection limit (maxclients)"));
      }
      if (has_code(m, "WRONGTYPE")) {
        throw CorruptRecord(compose(f, "the key holds a value idem did not write"));
      }
      if (has_code(m, "NOAUTH") || has_code(m, "WRONGPASS")) {
        throw StorageError(compose(f, "authentication failed"));
      }
      throw StorageError(compose(f, "server error"));
    }
    case Kind::kProtocol:
      throw StorageError(compose(f, "unexpected reply"));
    case Kind::kPoolExhausted:
      throw StorageUnavailable(compose(f, "connection pool exhausted"));
    case Kind::kServerDown:
      throw StorageUnavailable(compose(f, "server unreachable (last connect failed)"));
    case Kind::kCorrupt:
      throw CorruptRecord(compose(f, "the key holds a value idem did not write"));
    case Kind::kTls:
      // Not retryable: the same certificate fails again until the configuration changes.
      throw StorageError(compose(f, "TLS"));
    case Kind::kRefusedDown:
      // As the refusal itself: the server or the credentials fail again until they change.
      throw StorageError(compose(f, "not tried: the last connect was refused"));
  }
  throw StorageError(compose(f, "unknown failure"));
}

}  // namespace idem::redis::detail
