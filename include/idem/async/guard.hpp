// SPDX-License-Identifier: MIT
// idem::async::AsyncGuard: the idempotency guard for event-loop servers. The same protocol as
// idem::IdempotencyGuard, the same decisions (one core drives both), without ever blocking the
// loop thread: a duplicate (busy, done, mismatch) is answered by the fast store's reply alone.
//
// File: async/guard.hpp
//
// One call of `guard.async_run(key, fingerprint, handler, token)`, Asio style: `token` is a
// callback `void(std::exception_ptr, GuardResult<R>)`, `net::use_future`, or (C++20)
// `net::use_awaitable`; failures arrive as the exception the synchronous guard would throw.
//
//   fast claim ........... on the loop (AsyncRedisStore: hiredis async, pipelined)
//   durable store ........ two-phase begin / complete / release: on the worker pool for
//                          PooledDurable<S> (S a synchronous durable store: SqliteStore, ...)
//   the handler .......... `R(Transaction&)`: transactional, on the durable store's worker pool
//                          inside its transaction, never on the loop;
//                          `R()`: two-phase, on AsyncGuardOptions::pool (it may block);
//                          `on_loop(R())`: two-phase, on the loop (it must not block);
//                          `with_reply<R>(void(Reply<R>))`: two-phase, asynchronous: answers
//                          later through the Reply, from any thread;
//                          `() -> net::awaitable<R>` (C++20): two-phase, a coroutine on the
//                          loop (an external payment call does not hold a thread)
//   fast follow-up ....... complete / fill / release, on the loop; the call is answered after
//                          it, so a duplicate sent after the answer is a replay
//
// Deadlines and cancellation (CallOptions, AsyncGuardOptions::timeout, and the token's
// cancellation slot where the Asio has them): the call is answered at once with
// idem::DeadlineExceeded / idem::Cancelled, never with a success, and the protocol is brought
// to a safe end in the background:
//
//   cancelled while ...                    what happens to the key
//   the fast claim is in flight            a granted claim is released
//   the durable begin is in flight         a granted claim is released (durable, then fast)
//   the transaction runs                   it rolls back (checked before COMMIT) and the
//                                          claims are released; if COMMIT had begun, its
//                                          outcome stands and is recorded like any other
//   the two-phase handler runs             its outcome is unknown: the handler goes on (a Reply
//                                          says cancelled(), a coroutine is cancelled where
//                                          Asio can); a response is recorded (duplicates
//                                          replay it), a failure releases; a handler that never
//                                          answers leaves the key to its lease
//   the durable completion is in flight    it finishes; the fast store follows
//   the durable store has committed        not cancelled: the result is delivered
//
// Threading: each call runs on its own strand of the guard's executor, so one guard serves an
// io_context run by one thread or many. The stores must outlive the guard and its calls, and the
// guard its calls: destroy it once the loop is stopped, or once every call was answered (a call
// still running, a handler's Reply answered later, would use a destroyed guard).
#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "idem/async/call.hpp"
#include "idem/async/function.hpp"
#include "idem/async/net.hpp"
#include "idem/async/store.hpp"
#include "idem/async/worker_pool.hpp"
#include "idem/detail/guard_core.hpp"
#include "idem/guard.hpp"

namespace idem::async {

/// Options of an AsyncGuard.
struct AsyncGuardOptions {
  /// Lease, retention, observer, step hook, durable source, warn: the same meaning as for
  /// IdempotencyGuard. Not supported (the constructor throws idem::UsageError when set):
  /// bypass, wait_for_result, store_attempts other than 1, heartbeat, fast_store_retry_after.
  GuardOptions guard;
  /// Where synchronous handlers `R()` run (they may block). Null: such handlers are refused
  /// (idem::UsageError); transactional handlers use the durable store's own pool.
  WorkerPool* pool = nullptr;
  /// Default deadline of every call, from its start (CallOptions::deadline overrides it).
  /// 0 means none.
  std::chrono::milliseconds timeout{0};
};

/// Counters of what only an asynchronous call can do (the protocol's counters are
/// AsyncGuard::stats(), the same GuardStats as the synchronous guard).
struct AsyncGuardStats {
  std::atomic<std::uint64_t> cancelled{0};          ///< calls answered idem::Cancelled
  std::atomic<std::uint64_t> deadline_exceeded{0};  ///< calls answered idem::DeadlineExceeded
  /// Cancelled calls whose claims were released in the background (no work had started).
  std::atomic<std::uint64_t> released_after_cancel{0};
  /// Cancelled calls whose work finished anyway and was recorded (duplicates replay it).
  std::atomic<std::uint64_t> recorded_after_cancel{0};
};

namespace detail {

enum class HandlerKind { kTransactional, kPooled, kOnLoop, kReply, kAwaitable };

template <class T>
struct is_reply_handler : std::false_type {};
template <class R, class Fn>
struct is_reply_handler<ReplyHandler<R, Fn>> : std::true_type {
  using result = R;
};
template <class T>
struct is_loop_handler : std::false_type {};
template <class Fn>
struct is_loop_handler<LoopHandler<Fn>> : std::true_type {};

#if defined(IDEM_ASIO_HAS_CO_AWAIT)
template <class T>
struct awaitable_value {
  static constexpr bool value = false;
};
template <class T, class Ex>
struct awaitable_value<net::awaitable<T, Ex>> {
  static constexpr bool value = true;
  using type = T;
};
#endif

template <class Fn, class Tx, class = void>
struct plain_handler {
  static_assert(std::is_invocable_v<Fn&>,
                "idem::async: the handler must be callable as handler(Transaction&) "
                "(transactional), handler() (two-phase), on_loop(handler), "
                "with_reply<R>(handler) or, in C++20, handler() -> net::awaitable<R>");
  using invoked = std::invoke_result_t<Fn&>;
#if defined(IDEM_ASIO_HAS_CO_AWAIT)
  static constexpr bool kAwaitable = awaitable_value<invoked>::value;
  using raw = typename std::conditional_t<kAwaitable, awaitable_value<invoked>,
                                          std::enable_if<true, invoked>>::type;
#else
  static constexpr bool kAwaitable = false;
  using raw = invoked;
#endif
  static constexpr HandlerKind kind = kAwaitable ? HandlerKind::kAwaitable : HandlerKind::kPooled;
  using result = ::idem::detail::stored_t<raw>;
};
template <class Fn, class Tx>
struct plain_handler<Fn, Tx, std::enable_if_t<::idem::detail::kTakesTransaction<Fn, Tx>>> {
  static constexpr HandlerKind kind = HandlerKind::kTransactional;
  using result = ::idem::detail::stored_t<std::invoke_result_t<Fn&, Tx&>>;
};

template <class Fn, class Tx>
struct handler_traits : plain_handler<Fn, Tx> {};
template <class R, class Fn, class Tx>
struct handler_traits<ReplyHandler<R, Fn>, Tx> {
  static constexpr HandlerKind kind = HandlerKind::kReply;
  using result = ::idem::detail::stored_t<R>;
};
template <class Fn, class Tx>
struct handler_traits<LoopHandler<Fn>, Tx> {
  static constexpr HandlerKind kind = HandlerKind::kOnLoop;
  using result = ::idem::detail::stored_t<std::invoke_result_t<Fn&>>;
};

inline std::exception_ptr usage(const char* what) {
  return std::make_exception_ptr(UsageError(what));
}

}  // namespace detail

/// The asynchronous idempotency guard (see the file comment).
///
/// @tparam Durable an asynchronous durable store (idem::async::PooledDurable over a
///         synchronous durable store; tested with SqliteStore) or idem::NoDurableStore for a
///         fast-store-only guard.
template <class Durable = NoDurableStore>
class AsyncGuard {
 public:
  /// The durable store's transaction type (what transactional handlers receive).
  using Transaction = typename Durable::Transaction;
  /// False for a fast-store-only guard.
  static constexpr bool kHasDurable = !std::is_same_v<Durable, NoDurableStore>;

  /// Fast store in front of a durable store; calls run on strands of `executor`.
  AsyncGuard(Executor executor, AsyncFastStore& fast, Durable& durable,
             AsyncGuardOptions options = {})
      : executor_(std::move(executor)),
        fast_(&fast),
        durable_(&durable),
        options_(checked(std::move(options))),
        core_(true, options_.guard, kWho, fast.name(), durable.name()) {}

  /// Durable store only.
  template <
      class D = Durable,
      std::enable_if_t<std::is_same_v<D, Durable> && !std::is_same_v<D, NoDurableStore>, int> = 0>
  AsyncGuard(Executor executor, D& durable, AsyncGuardOptions options = {})
      : executor_(std::move(executor)),
        fast_(nullptr),
        durable_(&durable),
        options_(checked(std::move(options))),
        core_(false, options_.guard, kWho, "none", durable.name()) {}

  /// Fast store only: best effort, as IdempotencyGuard's fast-only mode.
  template <class D = Durable, std::enable_if_t<std::is_same_v<D, NoDurableStore>, int> = 0>
  AsyncGuard(Executor executor, AsyncFastStore& fast, AsyncGuardOptions options = {})
      : executor_(std::move(executor)),
        fast_(&fast),
        durable_(nullptr),
        options_(checked(std::move(options))),
        core_(true, options_.guard, kWho, fast.name(), "none") {}

  AsyncGuard(const AsyncGuard&) = delete;
  AsyncGuard& operator=(const AsyncGuard&) = delete;

  /// The response type of `Fn` (std::string, idem::Unit for void, or a type with a Codec).
  template <class Fn>
  using result_t = typename detail::handler_traits<std::decay_t<Fn>,
                                                   ::idem::detail::transaction_t<Durable>>::result;

  /// Runs `handler` at most once for `key`, or answers the duplicate; completes `token` with
  /// `void(std::exception_ptr, GuardResult<R>)`. `key` and `fingerprint` are copied.
  template <class Fn, class Token>
  auto async_run(const Key& key, std::string_view fingerprint, Fn&& handler, Token&& token) {
    return async_run(key, fingerprint, CallOptions{}, std::forward<Fn>(handler),
                     std::forward<Token>(token));
  }

  /// As above, with a deadline and/or a CancelSignal.
  template <class Fn, class Token>
  auto async_run(const Key& key, std::string_view fingerprint, CallOptions call, Fn&& handler,
                 Token&& token) {
    using R = result_t<Fn>;
    using Signature = void(std::exception_ptr, GuardResult<R>);
    return net::async_initiate<Token, Signature>(
        [this](auto completion, const Key& k, std::string fp, CallOptions co, auto fn) {
          // this-> spelled out: clang's -Wunused-lambda-capture misses the implicit use.
          this->template start<R>(k, std::move(fp), std::move(co), std::move(fn),
                                  std::move(completion));
        },
        token, Key(key), std::string(fingerprint), std::move(call),
        std::decay_t<Fn>(std::forward<Fn>(handler)));
  }

  /// The protocol's counters (the same as IdempotencyGuard's).
  const GuardStats& stats() const noexcept { return core_.stats(); }
  /// What only asynchronous calls count (cancellations, deadlines).
  const AsyncGuardStats& async_stats() const noexcept { return async_stats_; }
  /// The options in force.
  const AsyncGuardOptions& options() const noexcept { return options_; }
  /// The executor calls run on.
  const Executor& executor() const noexcept { return executor_; }

 private:
  static constexpr std::string_view kWho = "idem::async::AsyncGuard";

  // GuardOptions this guard does not implement are refused, never ignored.
  static AsyncGuardOptions checked(AsyncGuardOptions o) {
    auto refuse = [](const char* field, const char* why) {
      throw UsageError(std::string(kWho) + ": GuardOptions::" + field +
                       " is not supported by the asynchronous guard (" + why + ")");
    };
    if (o.guard.bypass) refuse("bypass", "run the handler without the guard instead");
    if (o.guard.wait_for_result.count() != 0) {
      refuse("wait_for_result", "a duplicate is answered kInProgress at once");
    }
    if (o.guard.store_attempts != 1) {
      refuse("store_attempts", "a transient durable-store failure is answered, typed");
    }
    if (o.guard.heartbeat) refuse("heartbeat", "choose a lease longer than the handler");
    if (o.guard.fast_store_retry_after.count() != 0) {
      refuse("fast_store_retry_after", "every call tries the fast store");
    }
    if (o.timeout.count() < 0) {
      throw UsageError(std::string(kWho) + ": AsyncGuardOptions::timeout is negative");
    }
    return o;
  }
  template <class R, class Fn>
  class RunOp;

  template <class R, class Fn, class Completion>
  void start(const Key& key, std::string fingerprint, CallOptions call, Fn fn,
             Completion completion) {
    using Op = RunOp<R, Fn>;
    auto handler_ex = net::get_associated_executor(completion, executor_);
    auto tracked = net::prefer(handler_ex, net::execution::outstanding_work.tracked);
    typename Op::Final final = [completion = std::move(completion), tracked](
                                   std::exception_ptr e, GuardResult<R> r) mutable {
      net::dispatch(tracked, [completion = std::move(completion), e, r = std::move(r)]() mutable {
        completion(e, std::move(r));
      });
    };
    auto op =
        std::make_shared<Op>(*this, key, std::move(fingerprint), std::move(fn), std::move(final));
#if defined(IDEM_ASIO_HAS_CANCELLATION_SLOT)
    auto slot = net::get_associated_cancellation_slot(completion);
    if (slot.is_connected()) op->bind_slot(slot);
#endif
    op->begin(std::move(call));
  }

  Executor executor_;
  AsyncFastStore* fast_;
  Durable* durable_;
  AsyncGuardOptions options_;
  ::idem::detail::GuardCore core_;
  AsyncGuardStats async_stats_;
};

/// `AsyncGuard guard{executor, durable}` (durable store only) deduces the durable store's type,
/// as `IdempotencyGuard guard{durable}` does; a fast store alone deduces a fast-only guard.
template <class D, std::enable_if_t<!std::is_base_of_v<AsyncFastStore, D>, int> = 0>
AsyncGuard(Executor, D&) -> AsyncGuard<D>;
/// As above, with options.
template <class D, std::enable_if_t<!std::is_base_of_v<AsyncFastStore, D>, int> = 0>
AsyncGuard(Executor, D&, AsyncGuardOptions) -> AsyncGuard<D>;

/// One call's state machine. Every member function runs on the call's strand; the worker
/// threads only run the handler (and the transaction body) and post their answers back.
template <class Durable>
template <class R, class Fn>
class AsyncGuard<Durable>::RunOp : public std::enable_shared_from_this<RunOp<R, Fn>> {
 public:
  using Final = Function<void(std::exception_ptr, GuardResult<R>)>;
  using Traits = detail::handler_traits<Fn, ::idem::detail::transaction_t<Durable>>;
  static constexpr detail::HandlerKind kKind = Traits::kind;
  using Clock = std::chrono::steady_clock;

  enum class Phase {
    kFastClaim,     // the fast claim is in flight
    kDurableBegin,  // two-phase begin in flight
    kTransaction,   // the transaction (and its handler) runs on the pool
    kHandler,       // the two-phase / fast-only handler runs
    kComplete,      // the durable (or, fast-only, the fast) completion is in flight
    kFollowUp,      // the durable store decided; the fast store follows
    kDone,
  };

  RunOp(AsyncGuard& g, const Key& key, std::string fingerprint, Fn fn, Final final)
      : g_(g),
        strand_(net::make_strand(g.executor_)),
        work_(net::prefer(g.executor_, net::execution::outstanding_work.tracked)),
        key_(key),
        fingerprint_(std::move(fingerprint)),
        call_(key_, fingerprint_, mode(), g.core_.call_options(), g.core_.observed()),
        fn_(std::move(fn)),
        final_(std::move(final)),
        cancel_flag_(std::make_shared<std::atomic<bool>>(false)),
        timer_(strand_) {
    call_.own();  // the call holds its own copies from the start
  }
  // A call the loop never answered (stopped with it in flight) leaves no listener behind on a
  // signal that outlives it.
  ~RunOp() {
    if (cancel_signal_) cancel_signal_->remove(cancel_listener_);
  }
  RunOp(const RunOp&) = delete;
  RunOp& operator=(const RunOp&) = delete;

  static constexpr Mode mode() noexcept {
    if constexpr (!kHasDurable) {
      return Mode::kFastOnly;
    } else if constexpr (kKind == detail::HandlerKind::kTransactional) {
      return Mode::kTransactional;
    } else {
      return Mode::kTwoPhase;
    }
  }

#if defined(IDEM_ASIO_HAS_CANCELLATION_SLOT)
  template <class Slot>
  void bind_slot(Slot& slot) {
    std::weak_ptr<RunOp> weak = this->shared_from_this();
    slot.assign([weak, strand = strand_](net::cancellation_type) {
      net::post(strand, [weak] {
        if (auto op = weak.lock()) op->cancel(false);
      });
    });
    slot_clear_ = [slot]() mutable { slot.clear(); };
  }
#endif

  void begin(CallOptions call) {
    net::dispatch(strand_, [self = this->shared_from_this(), call = std::move(call)]() mutable {
      self->run(std::move(call));
    });
  }

 private:
  void run(CallOptions call) {
    g_.core_.start(call_);
    if (call.cancel && call.cancel->emitted()) {
      // Cancelled before it started: answered before any store I/O. (The listener installed
      // below runs at once for an emitted signal, but only posts the cancel behind this job,
      // after the claim had gone out.)
      cancel(false);
      finish();
      return;
    }
    auto deadline = call.deadline;
    if (deadline == Clock::time_point::max() && g_.options_.timeout.count() > 0) {
      deadline = Clock::now() + g_.options_.timeout;
    }
    deadline_ = deadline;
    if (deadline != Clock::time_point::max() && deadline <= Clock::now()) {
      // Past its deadline before it started: answered before any store I/O, as a call
      // cancelled before it started (the timer below would only fire behind the claim).
      cancel(true);
      finish();
      return;
    }
    if (deadline != Clock::time_point::max()) {
      timer_.expires_at(deadline);
      timer_.async_wait([self = this->shared_from_this()](const error_code& ec) {
        if (!ec) self->cancel(true);
      });
    }
    if (call.cancel) {
      cancel_signal_ = call.cancel;
      std::weak_ptr<RunOp> weak = this->shared_from_this();
      // The listener holds no strand (nor anything of the loop): a signal may outlive the
      // io_context, and destroying it then must touch nothing of the loop's.
      cancel_listener_ = cancel_signal_->install([weak] {
        if (auto op = weak.lock()) {
          net::post(op->strand_, [weak] {
            if (auto o = weak.lock()) o->cancel(false);
          });
        }
      });
    }
    if (abandoned_) return;  // cancelled meanwhile
    if (g_.fast_ != nullptr) {
      phase_ = Phase::kFastClaim;
      t0_ = call_.now();
      return fast_claim();
    }
    durable_phase();
  }

  void fast_claim() {
    g_.fast_->async_claim(
        key_, fingerprint_, call_.owner(), call_.options.lease, strand_,
        [self = this->shared_from_this()](std::exception_ptr e, ClaimResult c) mutable {
          self->on_fast_claim(std::move(e), std::move(c));
        });
  }

  // --- 2. fast claim ------------------------------------------------------------------------

  // Releases, owner-checked, the claims whose answers were lost or whose release failed while
  // the fast store failed (GuardCore::note_lost_claim), now that it answered a claim. Sent
  // without waiting for them (this call goes on); the answers touch neither this call nor the
  // guard (either may be gone by then), so a release that fails leaves its claim to end with
  // its lease, as before.
  void release_lost_claims() {
    std::vector<::idem::detail::GuardCore::LostClaim> lost;
    try {
      lost = g_.core_.take_lost_claims();
    } catch (...) {
      return;
    }
    for (auto& l : lost) {
      auto held = std::make_shared<::idem::detail::GuardCore::LostClaim>(std::move(l));
      try {
        g_.fast_->async_release(held->key, held->owner, strand_,
                                [held](std::exception_ptr, bool) {});
      } catch (...) {
        // Ends with its lease.
      }
    }
  }

  // The record that answered this call's claim is this guard's lost claim `lost` (a stalled
  // store applied it late): released (owner-checked, after the releases sent before it), then
  // the claim asked again, once. A failed release answers `c` as it came.
  void release_lost_then_ask_again(const OwnerToken& lost, ClaimResult c) {
    asked_again_ = true;
    g_.core_.forget_lost_claim(key_, lost);
    auto first = std::make_shared<ClaimResult>(std::move(c));
    try {
      g_.fast_->async_release(
          key_, lost, strand_,
          [self = this->shared_from_this(), first](std::exception_ptr e, bool) mutable {
            if (e || self->abandoned_) {
              return self->on_fast_claim(nullptr, std::move(*first));
            }
            self->fast_claim();
          });
    } catch (...) {
      on_fast_claim(nullptr, std::move(*first));
    }
  }

  void on_fast_claim(std::exception_ptr e, ClaimResult c) {
    call_.fast_claim = call_.since(t0_);
    if (e) {
      try {
        std::rethrow_exception(e);
      } catch (const StorageError& x) {
        if constexpr (!kHasDurable) {
          g_.core_.fast_burst(key_, x);  // a fast-only call fails: not degraded
          g_.core_.note_lost_claim(key_, call_.owner(), x, call_.options.lease);
          return fail(e);
        } else {
          g_.core_.fast_claim_failed(call_, x);
          if (abandoned_) return finish();
          return durable_phase();
        }
      } catch (...) {
        return fail(e);
      }
    }
    if (g_.core_.has_lost_claims()) release_lost_claims();
    if (!asked_again_) {
      std::optional<OwnerToken> lost;
      try {
        lost = g_.core_.lost_claim_holding(key_, c);
      } catch (...) {
      }
      if (lost) return release_lost_then_ask_again(*lost, std::move(c));
    }
    bool granted = false;
    try {
      granted = g_.core_.fast_claim_answered(call_, c);
    } catch (...) {
      return crash(std::current_exception());
    }
    if (!granted) {
      if (abandoned_) return finish();
      if (::idem::detail::is_unstored(c)) {  // written back by a batch: never a response
        auto error = std::make_exception_ptr(::idem::detail::unstored_answer(key_, c));
        g_.core_.store_failed(key_, StoreRole::kFast, error);
        return fail(std::move(error));
      }
      return answer_duplicate(c, Source::kFastStore, DuplicateSource::kFastStore);
    }
    if (abandoned_) return release_after_cancel();
    durable_phase();
  }

  // --- 3. durable store (or the handler alone) ------------------------------------------------

  void durable_phase() {
    if constexpr (!kHasDurable) {
      run_handler();
    } else if constexpr (kKind == detail::HandlerKind::kTransactional) {
      transaction();
    } else {
      phase_ = Phase::kDurableBegin;
      t0_ = call_.now();
      g_.durable_->async_begin(
          key_, fingerprint_, call_.owner(), call_.options.lease, call_.hint(), strand_,
          [self = this->shared_from_this()](std::exception_ptr e, ClaimResult d) mutable {
            self->on_begin(std::move(e), std::move(d));
          });
    }
  }

  // What a worker thread reads to tell that its call was cancelled or ran past its deadline:
  // the loop sets cancel_flag_ from a job posted behind the work, which may come too late.
  struct StopCheck {
    std::shared_ptr<std::atomic<bool>> flag;
    std::shared_ptr<CancelSignal> signal;
    Clock::time_point deadline;
    // Throws Cancelled or DeadlineExceeded ("... <when>") when the call is stopped.
    void operator()(const char* when) const {
      if (flag->load() || (signal && signal->emitted())) {
        throw Cancelled(std::string("idem::async: cancelled") + when);
      }
      if (deadline != Clock::time_point::max() && Clock::now() >= deadline) {
        throw DeadlineExceeded(std::string("idem::async: past its deadline") + when);
      }
    }
  };
  StopCheck stop_check() const { return StopCheck{cancel_flag_, cancel_signal_, deadline_}; }

  void transaction() {
    if constexpr (kKind == detail::HandlerKind::kTransactional) {
      phase_ = Phase::kTransaction;
      t0_ = call_.now();
      auto self = this->shared_from_this();
      // The body reads the signal and the deadline itself: the loop sets cancel_flag_ from a
      // job posted behind the transaction's submission, which may come after the COMMIT.
      const StopCheck stop = stop_check();
      // Runs on a worker thread, inside the durable transaction. The store may run it again
      // after a serialization failure (the earlier attempt was rolled back).
      auto body = [self, stop](Transaction& tx) -> std::string {
        RunOp& op = *self;
        op.value_.reset();
        try {
          stop("");
        } catch (...) {
          op.cancelled_in_body_ = true;
          throw;
        }
        auto h0 = op.call_.now();
        try {
          op.g_.core_.step(Step::kDurableClaimed, op.key_);
          op.value_.emplace(::idem::detail::invoke_stored<R>(op.fn_, tx));
          op.g_.core_.step(Step::kHandlerReturned, op.key_);
        } catch (...) {
          op.handler_time_ += op.call_.since(h0);
          op.handler_threw_ = true;
          throw;
        }
        op.handler_time_ += op.call_.since(h0);
        // Checked before COMMIT: a call cancelled (or past its deadline) meanwhile commits
        // nothing.
        try {
          stop(" before commit");
        } catch (...) {
          op.cancelled_in_body_ = true;
          throw;
        }
        return Codec<R>::encode(*op.value_);
      };
      g_.durable_->async_run_transactional(
          key_, fingerprint_, call_.owner(), call_.options.retention, call_.hint(), std::move(body),
          strand_, [self](std::exception_ptr e, TransactionalResult d) mutable {
            self->on_transaction(std::move(e), std::move(d));
          });
    }
  }

  // Whether `e` is the worker pool's refusal (an overload of idem's own threads, not a failure
  // of the durable store nor of the handler); if so, told to the observer as the pool's.
  bool pool_refused(const std::exception_ptr& e) noexcept {
    try {
      std::rethrow_exception(e);
    } catch (const WorkerPoolFull& full) {
      if (g_.core_.options().observer != nullptr) {
        g_.core_.store_error(key_, StoreRole::kDurable, "worker_pool", full);
      }
      return true;
    } catch (...) {
      return false;
    }
  }

  // A durable step failed with `e`: told to the observer (as the pool's when the pool refused
  // the work).
  void durable_failed(const std::exception_ptr& e) noexcept {
    if (!e || pool_refused(e) || g_.core_.options().observer == nullptr) return;
    try {
      std::rethrow_exception(e);
    } catch (const Error& x) {
      g_.core_.store_error(key_, StoreRole::kDurable, x);
    } catch (...) {  // not an idem::Error: not reported (as GuardCore::store_failed)
    }
  }

  void on_transaction(std::exception_ptr e, TransactionalResult d) {
    call_.handler = handler_time_;
    call_.durable = call_.since(t0_) - handler_time_;
    if (e) {
      // Rolled back (or, for OutcomeUnknown, perhaps committed: the durable record then replays
      // it to the retry). Either way the fast claim must not block the retry for a lease.
      // The caller's cancellation (counted as such when it was answered) is not a store
      // failure.
      if (handler_threw_) {
        g_.core_.handler_failed(call_, e);
      } else if (!cancelled_in_body_) {
        durable_failed(e);
      }
      return release_then_fail(std::move(e), false);
    }
    if (d.status == TransactionalStatus::kCommitted) {
      if (d.took_over) g_.core_.takeover(key_, "durable");
      try {
        g_.core_.step(Step::kDurableCommitted, key_);
      } catch (...) {
        return crash(std::current_exception());
      }
    }
    after_durable(::idem::detail::claim_of(d));
  }

  void on_begin(std::exception_ptr e, ClaimResult d) {
    call_.durable = call_.since(t0_);
    if (e) {
      durable_failed(e);
      if (::idem::detail::begin_may_stand(e)) return release_unanswered_begin(std::move(e));
      return release_then_fail(std::move(e), false);
    }
    if (d.status != ClaimStatus::kClaimed) return after_durable(std::move(d));
    if (d.took_over) g_.core_.takeover(key_, "durable");
    durable_claimed_ = true;
    if (abandoned_) return release_after_cancel();
    try {
      g_.core_.step(Step::kDurableClaimed, key_);
    } catch (...) {
      return crash(std::current_exception());
    }
    run_handler();
  }

  // --- the handler (two-phase / fast only) --------------------------------------------------

  void run_handler() {
    phase_ = Phase::kHandler;
    h0_ = call_.now();
    auto self = this->shared_from_this();
    if constexpr (kKind == detail::HandlerKind::kPooled) {
      WorkerPool* pool = g_.options_.pool;
      if (pool == nullptr) {
        return on_handler(detail::usage("idem::async: a synchronous handler R() needs "
                                        "AsyncGuardOptions::pool (it may block); wrap it in "
                                        "idem::async::on_loop() if it never does"),
                          std::nullopt);
      }
      // Checked on the worker before the handler starts: a call cancelled (or past its
      // deadline) while its job waited in the queue runs nothing (the loop's own cancellation
      // may come after the job started).
      pool->submit(
          strand_,
          [self, stop = stop_check()] {
            try {
              stop(" before the handler started");
            } catch (...) {
              self->cancelled_before_handler_ = true;
              throw;
            }
            return ::idem::detail::invoke_stored<R>(self->fn_);
          },
          [self](std::exception_ptr e, std::optional<R> v) mutable {
            self->on_handler(std::move(e), std::move(v));
          });
    } else if constexpr (kKind == detail::HandlerKind::kOnLoop) {
      std::exception_ptr e;
      std::optional<R> v;
      try {
        v.emplace(::idem::detail::invoke_stored<R>(fn_.fn));
      } catch (...) {
        e = std::current_exception();
      }
      on_handler(std::move(e), std::move(v));
    } else if constexpr (kKind == detail::HandlerKind::kReply) {
      typename Reply<typename detail::is_reply_handler<Fn>::result>::Sink sink =
          [self, strand = strand_](std::exception_ptr e, std::optional<R> v) mutable {
            // Posted, never inline: a handler that throws after taking the reply is reported
            // with what it threw (thrown_ is set before this runs).
            net::post(strand, [self, e = std::move(e), v = std::move(v)]() mutable {
              self->on_handler(std::move(e), std::move(v));
            });
          };
      Reply<typename detail::is_reply_handler<Fn>::result> reply(std::move(sink), cancel_flag_);
      try {
        fn_.fn(std::move(reply));
      } catch (...) {
        // Thrown before answering: the reply (moved into the handler) answers as dropped if
        // the handler kept it; report what was thrown.
        thrown_ = std::current_exception();
      }
    } else if constexpr (kKind == detail::HandlerKind::kAwaitable) {
#if defined(IDEM_ASIO_HAS_CO_AWAIT)
      spawn_coroutine();
#endif
    }
  }

#if defined(IDEM_ASIO_HAS_CO_AWAIT)
  void spawn_coroutine() {
    auto self = this->shared_from_this();
    using Raw = typename Traits::raw;
    if constexpr (std::is_void_v<Raw>) {
      auto done = [self](std::exception_ptr e) {
        std::optional<R> v;
        if (!e) v.emplace();
        self->on_handler(std::move(e), std::move(v));
      };
#if defined(IDEM_ASIO_HAS_CANCELLATION_SLOT)
      net::co_spawn(strand_, fn_(), net::bind_cancellation_slot(coro_cancel_.slot(), done));
#else
      net::co_spawn(strand_, fn_(), done);
#endif
    } else {
      auto done = [self](std::exception_ptr e, Raw value) {
        std::optional<R> v;
        if (!e) v.emplace(std::move(value));
        self->on_handler(std::move(e), std::move(v));
      };
#if defined(IDEM_ASIO_HAS_CANCELLATION_SLOT)
      net::co_spawn(strand_, fn_(), net::bind_cancellation_slot(coro_cancel_.slot(), done));
#else
      net::co_spawn(strand_, fn_(), done);
#endif
    }
  }
#endif

  void on_handler(std::exception_ptr e, std::optional<R> v) {
    if (phase_ != Phase::kHandler) return;  // a second answer (a Reply answered twice)
    call_.handler = call_.since(h0_);
    if (thrown_) {
      e = thrown_;
      v.reset();
    }
    if (e || !v) {
      if (!e) e = std::make_exception_ptr(StorageError("idem::async: the handler gave no value"));
      // A full worker pool refused to run the handler: idem's overload, not the handler's
      // failure (told as the pool's, as for the durable work it refuses).
      // Nor is a call stopped before its handler started (the handler never ran).
      if (!pool_refused(e) && !cancelled_before_handler_) g_.core_.handler_failed(call_, e);
      // Two-phase: release the durable claim first (a retry may then run at once).
      if constexpr (kHasDurable) {
        phase_ = Phase::kFollowUp;
        g_.durable_->async_release(
            key_, call_.owner(), strand_,
            [self = this->shared_from_this(), e](std::exception_ptr re, bool) mutable {
              // Failing: the record stays in progress until its lease.
              self->durable_failed(re);
              self->release_then_fail(std::move(e), false);
            });
        return;
      } else {
        return release_then_fail(std::move(e), false);
      }
    }
    try {
      g_.core_.step(Step::kHandlerReturned, key_);
    } catch (...) {
      return crash(std::current_exception());
    }
    value_ = std::move(v);
    bytes_ = Codec<R>::encode(*value_);
    phase_ = Phase::kComplete;
    t0_ = call_.now();
    if constexpr (kHasDurable) {
      // If this fails, the durable record stays in progress (ours) until the lease ends, and
      // the fast claim is kept too, so duplicates answer "in progress" meanwhile.
      g_.durable_->async_complete(
          key_, call_.owner(), bytes_, call_.options.retention, strand_,
          [self = this->shared_from_this()](std::exception_ptr ce, bool ok) mutable {
            self->on_durable_complete(std::move(ce), ok);
          });
    } else {
      // Fast only: the fast store is the only record; its failures propagate.
      g_.fast_->async_complete(
          key_, call_.owner(), bytes_, call_.options.retention, strand_,
          [self = this->shared_from_this()](std::exception_ptr ce, bool ok) mutable {
            self->on_fast_only_complete(std::move(ce), ok);
          });
    }
  }

  void on_fast_only_complete(std::exception_ptr e, bool ok) {
    phase_ = Phase::kFollowUp;
    if (e) {
      g_.core_.store_failed(key_, StoreRole::kFast, e);
      if (::idem::detail::completion_refused_for_good(e)) {
        // The handler ran: mark the record failed so no retry runs it again (as two-phase).
        g_.fast_->async_fail(
            key_, call_.owner(), ::idem::detail::unstored_reason(e), call_.options.retention,
            strand_, [self = this->shared_from_this(), e](std::exception_ptr me, bool) mutable {
              // The mark refused too: its lease ends the record; the caller is told the
              // handler ran.
              self->fail(me ? ::idem::detail::handler_ran_unrecorded(e) : std::move(e));
            });
        return;
      }
      return fail(::idem::detail::after_the_handler_ran(std::move(e)));
    }
    if (!ok) return write_back_vanished();
    note_recorded();
    deliver_executed();
  }

  // As IdempotencyGuard does: a fast-only completion that found no record under its key at all
  // (evicted, flushed, a restart without persistence) writes its response back, so retries
  // replay it instead of running the handler again; another attempt's record (or a failure to
  // tell or to write): LeaseLost, whose retry replays the winner.
  void write_back_vanished() {
    auto lost = [](RunOp& op) {
      op.fail(std::make_exception_ptr(op.g_.core_.lease_lost(op.call_, "fast")));
    };
    g_.fast_->async_lookup(key_, strand_,
                           [self = this->shared_from_this(), lost](
                               std::exception_ptr e, std::optional<Record> rec) mutable {
                             if (e || rec) return lost(*self);
                             RunOp& op = *self;
                             op.g_.fast_->async_fill(
                                 op.key_, op.fingerprint_, op.bytes_, op.call_.options.retention,
                                 op.strand_, [self, lost](std::exception_ptr fe, bool) mutable {
                                   if (fe) return lost(*self);
                                   self->g_.core_.count_refill();
                                   self->note_recorded();
                                   self->deliver_executed();
                                 });
                           });
  }

  void on_durable_complete(std::exception_ptr e, bool ok) {
    call_.durable += call_.since(t0_);
    phase_ = Phase::kFollowUp;
    if (e) {
      durable_failed(e);
      // Refused for good (the response is larger than the store takes): mark the record
      // failed, or every retry after the lease would run the handler again.
      if (::idem::detail::completion_refused_for_good(e)) return mark_unstored(std::move(e));
      return fail(::idem::detail::after_the_handler_ran(std::move(e)));
    }
    if (!ok) {
      auto lost = std::make_exception_ptr(g_.core_.lease_lost(call_, "durable"));
      return release_then_fail(std::move(lost), false);
    }
    try {
      g_.core_.step(Step::kDurableCommitted, key_);
    } catch (...) {
      return crash(std::current_exception());
    }
    ClaimResult d;
    d.status = ClaimStatus::kClaimed;
    d.response = std::move(bytes_);
    after_durable(std::move(d));
  }

  // --- 4. after the durable decision: the fast store follows, then the answer -----------------

  // The completion was refused with `e` for good: the durable record is marked failed (later
  // calls get unstored_answer) and the fast claim released; the caller gets `e`. If the mark
  // fails too, the record ends with its lease, as before.
  void mark_unstored(std::exception_ptr e) {
    g_.durable_->async_fail(
        key_, call_.owner(), ::idem::detail::unstored_reason(e), call_.options.retention, strand_,
        [self = this->shared_from_this(), e](std::exception_ptr fe, bool ok) mutable {
          if (fe) {  // the mark refused too: the caller is told the handler ran
            self->durable_failed(fe);
            return self->fail(::idem::detail::handler_ran_unrecorded(e));
          }
          if (!ok) return self->fail(std::move(e));  // no longer ours
          self->release_then_fail(std::move(e), false);
        });
  }

  void after_durable(ClaimResult d) {
    phase_ = Phase::kFollowUp;
    if (::idem::detail::is_unstored(d)) {
      // Its first attempt ran but could not store its response: never replayed, never run again.
      auto error = std::make_exception_ptr(::idem::detail::unstored_answer(key_, d));
      durable_failed(error);
      return release_then_fail(std::move(error), false);
    }
    const auto a = ::idem::detail::durable_answer(d.status);
    fast_term_ = ::idem::detail::fast_term(call_.options.retention, d);
    durable_ = std::move(d);
    if (a == ::idem::detail::DurableAnswer::kExecuted && abandoned_) note_recorded();
    follow_up(g_.core_.durable_answered(call_, a, fast_term_));
  }

  void follow_up(::idem::detail::FastNext next) {
    using ::idem::detail::FastNext;
    auto self = this->shared_from_this();
    switch (next) {
      case FastNext::kNothing:
        return deliver_durable();
      case FastNext::kComplete:
        g_.fast_->async_complete(key_, call_.owner(), durable_->response, fast_term_, strand_,
                                 [self](std::exception_ptr e, bool ok) mutable {
                                   if (e) return self->follow_up_failed(e);
                                   FastNext n = FastNext::kNothing;
                                   try {
                                     n = self->g_.core_.fast_complete_answered(self->call_, ok);
                                   } catch (...) {
                                     return self->crash(std::current_exception());
                                   }
                                   self->follow_up(n);
                                 });
        return;
      case FastNext::kFill:
        g_.fast_->async_refill(key_, fingerprint_, durable_->response, fast_term_,
                               ::idem::detail::origin_of(*durable_, call_.owner()), strand_,
                               [self](std::exception_ptr e, bool) mutable {
                                 if (e) return self->follow_up_failed(e);
                                 try {
                                   self->g_.core_.fast_filled(self->call_);
                                 } catch (...) {
                                   return self->crash(std::current_exception());
                                 }
                                 self->deliver_durable();
                               });
        return;
      case FastNext::kRelease:
        g_.fast_->async_release(key_, call_.owner(), strand_,
                                [self](std::exception_ptr e, bool) mutable {
                                  if (e) return self->follow_up_failed(e);
                                  self->deliver_durable();
                                });
        return;
    }
  }

  void follow_up_failed(std::exception_ptr e) {
    try {
      std::rethrow_exception(e);
    } catch (const Error& x) {
      // The durable store replays from now on; the fast store is refilled by the next duplicate
      // (a release that failed ends with its lease).
      g_.core_.fast_follow_up_failed(call_, x);
    } catch (...) {
    }
    deliver_durable();
  }

  void deliver_durable() {
    if (durable_->status == ClaimStatus::kClaimed) return deliver_executed();
    if (abandoned_) return finish();
    Source src = Source::kDurableStore;
    answer_duplicate(*durable_, src, g_.core_.durable_source());
  }

  void deliver_executed() {
    if (abandoned_) return finish();
    GuardResult<R> r = g_.core_.template executed<R>(call_, std::move(value_));
    answer(nullptr, std::move(r));
  }

  void answer_duplicate(ClaimResult& c, Source source, DuplicateSource dup_source) {
    GuardResult<R> r;
    try {
      r = g_.core_.template duplicate<R>(call_, ::idem::detail::DuplicateAnswer::from(c), source,
                                         dup_source);
    } catch (...) {
      return fail(std::current_exception());
    }
    answer(nullptr, std::move(r));
  }

  // --- failures, cancellation, the answer -----------------------------------------------------

  // Releases the fast claim (if any), then fails with `e`.
  // A begin that may stand although it failed (detail::begin_may_stand) is released, then the
  // fast claim, then the caller is answered with the begin's error. A failed release leaves the
  // record to its lease.
  void release_unanswered_begin(std::exception_ptr e) {
    phase_ = Phase::kFollowUp;
    g_.durable_->async_release(
        key_, call_.owner(), strand_,
        [self = this->shared_from_this(), e](std::exception_ptr, bool) mutable {
          self->release_then_fail(std::move(e), false);
        });
  }

  void release_then_fail(std::exception_ptr e, bool) {
    phase_ = Phase::kFollowUp;
    if (abandoned_) g_.async_stats_.released_after_cancel.fetch_add(1, std::memory_order_relaxed);
    if (g_.core_.release_next(call_) != ::idem::detail::FastNext::kRelease) return fail(e);
    g_.fast_->async_release(
        key_, call_.owner(), strand_,
        [self = this->shared_from_this(), e](std::exception_ptr re, bool) mutable {
          if (re) {
            try {
              std::rethrow_exception(re);
            } catch (const Error& x) {
              // The claim ends with its lease.
              self->g_.core_.fast_follow_up_failed(self->call_, x);
            } catch (...) {
            }
          }
          self->fail(std::move(e));
        });
  }

  // A cancelled call that holds claims but started no work: give them back.
  void release_after_cancel() {
    phase_ = Phase::kFollowUp;
    g_.async_stats_.released_after_cancel.fetch_add(1, std::memory_order_relaxed);
    auto self = this->shared_from_this();
    auto fast_release = [self] {
      if (self->g_.core_.release_next(self->call_) != ::idem::detail::FastNext::kRelease) {
        return self->finish();
      }
      self->g_.fast_->async_release(self->key_, self->call_.owner(), self->strand_,
                                    [self](std::exception_ptr, bool) { self->finish(); });
    };
    if constexpr (kHasDurable) {
      if (durable_claimed_) {
        g_.durable_->async_release(
            key_, call_.owner(), strand_,
            [fast_release](std::exception_ptr, bool) mutable { fast_release(); });
        return;
      }
    }
    fast_release();
  }

  void note_recorded() {
    if (abandoned_) g_.async_stats_.recorded_after_cancel.fetch_add(1, std::memory_order_relaxed);
  }

  // The deadline passed (deadline) or the call was cancelled: answer now, end safely later.
  void cancel(bool deadline) {
    if (answered_ || abandoned_ || phase_ == Phase::kFollowUp || phase_ == Phase::kDone) return;
    abandoned_ = true;
    cancel_flag_->store(true);
#if defined(IDEM_ASIO_HAS_CO_AWAIT) && defined(IDEM_ASIO_HAS_CANCELLATION_SLOT)
    if constexpr (kKind == detail::HandlerKind::kAwaitable) {
      if (phase_ == Phase::kHandler) coro_cancel_.emit(net::cancellation_type::terminal);
    }
#endif
    const std::string what = "idem::async: the call on '" + key_.str() + "' " +
                             (deadline ? "ran past its deadline" : "was cancelled") +
                             " (its claim is released, or left to its lease if the handler's "
                             "outcome is unknown)";
    if (deadline) {
      g_.async_stats_.deadline_exceeded.fetch_add(1, std::memory_order_relaxed);
      answer(std::make_exception_ptr(DeadlineExceeded(what)), GuardResult<R>{});
    } else {
      g_.async_stats_.cancelled.fetch_add(1, std::memory_order_relaxed);
      answer(std::make_exception_ptr(Cancelled(what)), GuardResult<R>{});
    }
  }

  // The step hook threw (fault injection): as after a crash, nothing is released.
  void crash(std::exception_ptr e) {
    phase_ = Phase::kDone;
    answer(std::move(e), GuardResult<R>{});
    finish();
  }

  void fail(std::exception_ptr e) {
    if (!answered_) answer(std::move(e), GuardResult<R>{});
    finish();
  }

  void answer(std::exception_ptr e, GuardResult<R> r) {
    if (answered_) return;
    answered_ = true;
    if (!abandoned_) {
      timer_.cancel();
    }
#if defined(IDEM_ASIO_HAS_CANCELLATION_SLOT)
    if (slot_clear_) slot_clear_();
#endif
    if (cancel_signal_) cancel_signal_->remove(cancel_listener_);
    Final f = std::move(final_);
    f(std::move(e), std::move(r));
    if (!abandoned_) finish();
  }

  void finish() {
    phase_ = Phase::kDone;
    timer_.cancel();
    if (cancel_signal_) {
      cancel_signal_->remove(cancel_listener_);
      cancel_signal_.reset();
    }
  }

  AsyncGuard& g_;
  net::strand<Executor> strand_;
  Executor work_;
  const Key key_;
  const std::string fingerprint_;
  ::idem::detail::CallState call_;
  Fn fn_;
  Final final_;
  std::shared_ptr<std::atomic<bool>> cancel_flag_;
  net::steady_timer timer_;
  std::shared_ptr<CancelSignal> cancel_signal_;
  std::uint64_t cancel_listener_ = 0;  // this call's listener on cancel_signal_
#if defined(IDEM_ASIO_HAS_CANCELLATION_SLOT)
  Function<void()> slot_clear_;
#if defined(IDEM_ASIO_HAS_CO_AWAIT)
  net::cancellation_signal coro_cancel_;
#endif
#endif
  Phase phase_ = Phase::kFastClaim;
  bool answered_ = false;
  bool abandoned_ = false;
  bool durable_claimed_ = false;
  bool handler_threw_ = false;
  bool cancelled_in_body_ = false;  // the transaction body threw Cancelled (not the store)
  bool cancelled_before_handler_ = false;  // the pooled job found the call stopped: no handler
  Clock::time_point deadline_ = Clock::time_point::max();  // the call's, once it started
  bool asked_again_ = false;        // the fast claim was asked again after a lost claim's release
  std::exception_ptr thrown_;
  ::idem::detail::SteadyClock::time_point t0_{}, h0_{};
  std::chrono::nanoseconds handler_time_{0};
  std::optional<R> value_;
  std::string bytes_;
  std::optional<ClaimResult> durable_;
  std::chrono::seconds fast_term_{0};  // how long the fast store keeps durable_ (fast_term)
};

}  // namespace idem::async
