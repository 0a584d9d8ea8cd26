// SPDX-License-Identifier: MIT
// The hiredis <-> Asio adapter (see hiredis_asio.hpp).
#include "hiredis_asio.hpp"

namespace idem::async::detail {

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
                       if (self->want_write_) redisAsyncHandleWrite(self->ac_);
                       if (self->want_write_) self->arm_write();
                     });
}

}  // namespace idem::async::detail
