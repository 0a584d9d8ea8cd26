// SPDX-License-Identifier: MIT
// hiredis's asynchronous context driven by an Asio executor: the adapter hiredis lacks (it ships
// ae, glib, ivykis, libev, libevent, libuv, macOS and Qt adapters, none for Asio).
//
// hiredis asks its event library, through five hooks, to watch the socket for reading or
// writing and to clean up; the adapter answers each with an `async_wait` on a
// `posix::stream_descriptor` wrapping the context's socket:
//
//   addRead / addWrite   arm a wait (idempotent: one wait per direction at a time), and re-arm
//                        after each readiness while hiredis still wants it
//   delRead / delWrite   stop wanting (a wait already armed completes and is ignored)
//   cleanup              hiredis frees the context and closes the socket itself: the
//                        descriptor is released (never closed twice), pending waits complete
//                        with operation_aborted and do nothing
//
// Cleanup runs inside redisAsyncHandleRead / redisAsyncHandleWrite (a connection error) or
// redisAsyncFree, so every completion handler holds a shared_ptr to the adapter: it is freed
// only once hiredis has let go of it and no wait is pending.
//
// Threading: every hiredis call on the context, and the adapter's own handlers, run on the
// executor given to attach() (use a strand when the io_context runs on several threads).
#pragma once

#include <hiredis/async.h>

#include <memory>

#include "idem/async/net.hpp"

namespace idem::async::detail {

/// Drives one redisAsyncContext from an Asio executor (see the file comment).
class HiredisAsio : public std::enable_shared_from_this<HiredisAsio> {
 public:
  /// Hooks `ac`'s event callbacks to waits on `executor`. Call right after redisAsyncConnect*
  /// (before any command or connect callback). The adapter stays alive while attached.
  /// @return the adapter, or null when `ac` already has an event library attached or its
  ///         socket cannot be watched (the caller then frees `ac`).
  static std::shared_ptr<HiredisAsio> attach(redisAsyncContext* ac, const Executor& executor);

  HiredisAsio(const HiredisAsio&) = delete;
  HiredisAsio& operator=(const HiredisAsio&) = delete;
  ~HiredisAsio();

  /// True until hiredis called cleanup (the context is gone then).
  bool attached() const noexcept { return ac_ != nullptr; }

  /// Waits started since attach (for tests: re-arming is bounded by readiness, never a spin).
  unsigned long waits_started() const noexcept { return waits_; }

 private:
  struct Private {};

 public:
  HiredisAsio(Private, redisAsyncContext* ac, const Executor& executor);

 private:
  static void add_read(void* self);
  static void del_read(void* self);
  static void add_write(void* self);
  static void del_write(void* self);
  static void cleanup(void* self);

  void arm_read();
  void arm_write();

  net::posix::stream_descriptor socket_;
  redisAsyncContext* ac_;
  bool want_read_ = false, want_write_ = false;
  bool reading_ = false, writing_ = false;  // a wait is armed
  unsigned long waits_ = 0;
  // Keeps the adapter alive from attach until cleanup (hiredis holds a raw pointer).
  std::shared_ptr<HiredisAsio> self_;
};

}  // namespace idem::async::detail
