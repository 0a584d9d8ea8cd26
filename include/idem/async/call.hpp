// SPDX-License-Identifier: MIT
// Per-call options of an asynchronous guarded call (deadline, cancellation) and the handler
// forms AsyncGuard accepts besides plain callables.
//
// File: async/call.hpp
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/async/function.hpp"
#include "idem/codec.hpp"
#include "idem/errors.hpp"

namespace idem::async {

/// A cancellation request that works with every Asio version: `emit()` from any thread cancels
/// the calls it was given to (CallOptions::cancel). Where the Asio has per-operation
/// cancellation (IDEM_ASIO_HAS_CANCELLATION_SLOT), a completion token bound to a cancellation
/// slot cancels the call too; both end the call the same way (see AsyncGuard).
class CancelSignal {
 public:
  CancelSignal() = default;
  CancelSignal(const CancelSignal&) = delete;
  CancelSignal& operator=(const CancelSignal&) = delete;

  /// Requests cancellation (idempotent, thread-safe). Calls given this signal afterwards are
  /// cancelled as soon as they start.
  void emit() {
    std::vector<std::pair<std::uint64_t, Function<void()>>> listeners;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (emitted_) return;
      emitted_ = true;
      listeners = std::move(listeners_);
    }
    for (auto& [id, on_emit] : listeners) on_emit();
  }

  /// Whether emit() was called.
  bool emitted() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return emitted_;
  }

  /// For AsyncGuard: `on_emit` runs once, on the thread that emits (or at once if emitted
  /// already). Every call given the signal has its own listener (one signal may serve all the
  /// calls of a connection). @return the listener's id, for remove(); 0 when it ran at once.
  std::uint64_t install(Function<void()> on_emit) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!emitted_) {
        listeners_.emplace_back(++last_id_, std::move(on_emit));
        return last_id_;
      }
    }
    on_emit();
    return 0;
  }
  /// For AsyncGuard: forgets listener `id` (its call ended); other listeners stay.
  void remove(std::uint64_t id) {
    Function<void()> old;  // destroyed after the lock is released
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = listeners_.begin(); it != listeners_.end(); ++it) {
      if (it->first == id) {
        old = std::move(it->second);
        listeners_.erase(it);
        break;
      }
    }
  }

 private:
  mutable std::mutex mutex_;
  bool emitted_ = false;
  std::uint64_t last_id_ = 0;
  std::vector<std::pair<std::uint64_t, Function<void()>>> listeners_;
};

/// Options of one asynchronous call.
struct CallOptions {
  /// The call's deadline; past it the call ends with idem::DeadlineExceeded (see AsyncGuard for
  /// what becomes of its claim). time_point::max() means the guard's default timeout, if any.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  /// Emitting it cancels the call (idem::Cancelled). Null means none.
  std::shared_ptr<CancelSignal> cancel;
};

/// How an asynchronous handler answers: call it once with the response (`reply(value)`, or
/// `reply()` for `Reply<void>`), or `reply.fail(error)`. Movable, callable from any thread.
/// Destroyed without an answer, it fails the call (idem::StorageError "the handler dropped its
/// reply"): the claims are released, as when a handler throws.
template <class R>
class Reply {
 public:
  /// The stored type (void becomes idem::Unit).
  using value_type = std::conditional_t<std::is_void_v<R>, Unit, R>;
  /// For AsyncGuard.
  using Sink = Function<void(std::exception_ptr, std::optional<value_type>)>;

  /// For AsyncGuard: `sink` receives the answer; `cancelled` is set when the call is cancelled.
  Reply(Sink sink, std::shared_ptr<std::atomic<bool>> cancelled)
      : sink_(std::move(sink)), cancelled_(std::move(cancelled)) {}
  /// Moves the answer's duty (`other` no longer answers).
  Reply(Reply&&) noexcept = default;
  /// A Reply that had not answered fails its call first (as its destructor does), then takes
  /// `other`'s duty.
  Reply& operator=(Reply&& other) noexcept {
    if (this != &other) {
      drop();
      sink_ = std::move(other.sink_);
      cancelled_ = std::move(other.cancelled_);
    }
    return *this;
  }
  Reply(const Reply&) = delete;
  Reply& operator=(const Reply&) = delete;
  ~Reply() { drop(); }

  /// Answers with `value` (the response stored and replayed to duplicates).
  template <class T = R, std::enable_if_t<!std::is_void_v<T>, int> = 0>
  void operator()(value_type value) {
    answer(nullptr, std::optional<value_type>(std::move(value)));
  }
  /// Answers a `Reply<void>`.
  template <class T = R, std::enable_if_t<std::is_void_v<T>, int> = 0>
  void operator()() {
    answer(nullptr, std::optional<value_type>(value_type{}));
  }
  /// Fails the handler with `error` (propagated to the caller unchanged; claims released).
  void fail(std::exception_ptr error) { answer(std::move(error), std::nullopt); }

  /// True once the call was cancelled or ran past its deadline: the caller has been answered
  /// already. An answer given now is still recorded (duplicates will replay it); a handler that
  /// can stop safely may `fail` instead.
  bool cancelled() const noexcept { return cancelled_ && cancelled_->load(); }

 private:
  void answer(std::exception_ptr e, std::optional<value_type> v) {
    if (!sink_) return;  // answered already
    Sink s = std::move(sink_);
    s(std::move(e), std::move(v));
  }
  void drop() {
    if (sink_) {
      answer(std::make_exception_ptr(
                 StorageError("idem::async: the handler dropped its reply without answering")),
             std::nullopt);
    }
  }

  Sink sink_;
  std::shared_ptr<std::atomic<bool>> cancelled_;
};

/// A handler that answers through a Reply<R> (for asynchronous two-phase work, e.g. a payment
/// gateway call on the same loop): made by idem::async::with_reply<R>(fn), where fn is
/// `void(Reply<R>)`.
template <class R, class Fn>
struct ReplyHandler {
  Fn fn;  ///< the user's handler, `void(Reply<R>)`
};

/// Wraps `fn(Reply<R>)` as an asynchronous two-phase handler.
template <class R, class Fn>
ReplyHandler<R, std::decay_t<Fn>> with_reply(Fn&& fn) {
  return ReplyHandler<R, std::decay_t<Fn>>{std::forward<Fn>(fn)};
}

/// A synchronous handler that never blocks, run on the call's executor (the loop) instead of a
/// worker thread: made by idem::async::on_loop(fn), fn being `R()`.
template <class Fn>
struct LoopHandler {
  Fn fn;  ///< the user's handler, `R()`
};

/// Wraps `fn()` to run on the loop (only for handlers that never block).
template <class Fn>
LoopHandler<std::decay_t<Fn>> on_loop(Fn&& fn) {
  return LoopHandler<std::decay_t<Fn>>{std::forward<Fn>(fn)};
}

}  // namespace idem::async
