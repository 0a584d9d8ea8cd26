// SPDX-License-Identifier: MIT
// The hiredis <-> Asio adapter (see hiredis_asio.hpp).
#include "hiredis_asio.hpp"

#include <hiredis/sds.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace idem::async::detail {
namespace {

// Writes what hiredis has buffered with send(2) and MSG_NOSIGNAL, as far as the socket takes it
// now: hiredis writes with write(2), which raises SIGPIPE on a connection the server closed and
// ends an event-loop server that does not ignore SIGPIPE. What is left (EAGAIN) stays buffered
// for the next write-ready; a failure is left in c->err with the buffer emptied, and
// redisAsyncHandleWrite then disconnects with it (redisBufferWrite returns at once on c->err)
// without writing anything itself.
void send_buffered(redisContext* c) noexcept {
  if ((c->flags & REDIS_CONNECTED) == 0 || c->err != 0) return;  // hiredis checks the connect
  const std::size_t len = sdslen(c->obuf);
  std::size_t off = 0;
  while (off < len) {
    const ssize_t n = ::send(c->fd, c->obuf + off, len - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<std::size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      break;
    } else {
      c->err = REDIS_ERR_IO;
      std::snprintf(c->errstr, sizeof(c->errstr), "%s",
                    n < 0 ? std::strerror(errno) : "connection closed");
      off = len;  // nothing more is written on this connection
      break;
    }
  }
  if (off == 0) return;
  std::memmove(c->obuf, c->obuf + off, len - off);
  sdssetlen(c->obuf, len - off);  // sds.h, inline: libhiredis's sds symbols are C, undeclared
  c->obuf[len - off] = '\0';
}

}  // namespace

std::shared_ptr<HiredisAsio> HiredisAsio::attach(redisAsyncContext* ac, const Executor& executor) {
  if (ac == nullptr || ac->ev.data != nullptr || ac->c.fd < 0) return nullptr;
  std::shared_ptr<HiredisAsio> a;
  try {
    a = std::make_shared<HiredisAsio>(Private{}, ac, executor);
  } catch (const std::exception&) {
    return nullptr;  // the descriptor could not be registered with the reactor
  }
  a->self_ = a;
  ac->ev.data = a.get();
  ac->ev.addRead = &HiredisAsio::add_read;
  ac->ev.delRead = &HiredisAsio::del_read;
  ac->ev.addWrite = &HiredisAsio::add_write;
  ac->ev.delWrite = &HiredisAsio::del_write;
  ac->ev.cleanup = &HiredisAsio::cleanup;
  return a;
}

HiredisAsio::HiredisAsio(Private, redisAsyncContext* ac, const Executor& executor)
    : socket_(executor, ac->c.fd), ac_(ac) {}

HiredisAsio::~HiredisAsio() {
  // Never close hiredis's socket: it closes it in redisFree.
  if (socket_.is_open()) {
    error_code ignored;
    socket_.release();
    (void)ignored;
  }
}

void HiredisAsio::add_read(void* self) {
  auto* a = static_cast<HiredisAsio*>(self);
  a->want_read_ = true;
  a->arm_read();
}

void HiredisAsio::del_read(void* self) { static_cast<HiredisAsio*>(self)->want_read_ = false; }

void HiredisAsio::add_write(void* self) {
  auto* a = static_cast<HiredisAsio*>(self);
  a->want_write_ = true;
  a->arm_write();
}

void HiredisAsio::del_write(void* self) { static_cast<HiredisAsio*>(self)->want_write_ = false; }

void HiredisAsio::cleanup(void* self) {
  auto* a = static_cast<HiredisAsio*>(self);
  a->want_read_ = a->want_write_ = false;
  a->ac_ = nullptr;
  // Cancels the armed waits (they complete with operation_aborted) without closing the fd.
  if (a->socket_.is_open()) a->socket_.release();
  // The last reference may be a pending wait's handler, or this: `a` may be gone after this.
  std::shared_ptr<HiredisAsio> keep = std::move(a->self_);
}

void HiredisAsio::arm_read() {
  if (reading_ || ac_ == nullptr) return;
  reading_ = true;
  ++waits_;
  socket_.async_wait(net::posix::stream_descriptor::wait_read,
                     [self = shared_from_this()](const error_code& ec) {
                       self->reading_ = false;
                       if (ec == net::error::operation_aborted || self->ac_ == nullptr) return;
                       // Other errors (a reset socket): let hiredis read and find out.
                       if (self->want_read_) redisAsyncHandleRead(self->ac_);
                       if (self->want_read_) self->arm_read();
                     });
}

void HiredisAsio::arm_write() {
  if (writing_ || ac_ == nullptr) return;
  writing_ = true;
  ++waits_;
  socket_.async_wait(net::posix::stream_descriptor::wait_write,
                     [self = shared_from_this()](const error_code& ec) {
                       self->writing_ = false;
                       if (ec == net::error::operation_aborted || self->ac_ == nullptr) return;
                       if (self->want_write_) {
                         send_buffered(&self->ac_->c);
                         redisAsyncHandleWrite(self->ac_);
                       }
                       if (self->want_write_) self->arm_write();
                     });
}

}  // namespace idem::async::detail
