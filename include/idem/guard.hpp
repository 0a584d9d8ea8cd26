// SPDX-License-Identifier: MIT
// idem::IdempotencyGuard: run a handler at most once per key, and answer every duplicate.
//
// File: guard.hpp
//
// One call of `guard.run(key, fingerprint, handler)`:
//
//   1. The key is already valid (idem::Key validates on construction).
//   2. Fast store claim, one round trip: claimed / busy (answer kInProgress, the durable store
//      is not touched) / done (replay the stored response) / mismatch / failure (go on with the
//      durable store alone; the call is counted as degraded and the first failure of a burst is
//      reported to the Observer).
//   3. Durable store, in the mode the handler's signature selects:
//      - `handler(Transaction&)`: **transactional**. One durable transaction holds the record
//        *and* the handler's business writes; commit makes both visible at once. A duplicate
//        that reaches the durable store waits on its unique key and then replays. This is
//        exactly-once *effect* for database-local side effects, even with the fast store down
//        or a lease expired.
//      - `handler()`: **two-phase**, for external side effects (a payment gateway). An
//        in-progress record is committed, the handler runs outside any transaction, and the
//        record is completed only while this attempt's owner token still matches. A crash
//        between the phases leaves the record in progress until its lease ends; then a retry
//        takes over. If the lease ended and another attempt took over before this one
//        completed, `run` throws idem::LeaseLost (a retry replays the winner). Pass the key to
//        the external party so it can de-duplicate as well.
//   4. After the durable commit, the fast store is completed with the response. If that fails
//      the answer is still right: the durable store replays from then on and refills it.
//   5. The handler throws: the transaction rolls back, the claims are released so a retry can
//      run at once, and the exception propagates unchanged. A final business rejection that
//      should be replayed ("insufficient funds") is a *response*, not an exception.
//
// Store combinations: fast + durable (the production shape), durable only (correct, one more
// round trip per duplicate), fast only (best effort: if the fast store loses a record, e.g. a
// Redis failover, a duplicate can run again; if it is down, `run` throws StorageUnavailable).
//
// @code
//   idem::MemoryStore fast;
//   idem::sqlite::SqliteStore durable{"payments.db"};
//   idem::IdempotencyGuard guard{fast, durable};
//   auto key = idem::Key::make("payment", order_no);
//   auto r = guard.run(key, idem::fingerprint(body), [&](idem::sqlite::Transaction& tx) {
//     tx.exec("UPDATE account SET balance = balance - ? WHERE id = ?", amount, account);
//     tx.exec("INSERT INTO payment(order_no, amount) VALUES (?, ?)", order_no, amount);
//     return "pay_" + order_no;                    // stored, and replayed to every duplicate
//   });
//   if (r.ok()) reply(200, *r.value); else reply(idem::http_status(r.outcome), ...);
// @endcode
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

#include "idem/codec.hpp"
#include "idem/detail/plain_transaction.hpp"
#include "idem/durable_store.hpp"
#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"
#include "idem/store.hpp"

namespace idem {

/// Points of the protocol, in order, as a step hook sees them. Fault-injection tests stop or kill
/// the process at each to prove that a crash there loses nothing and doubles nothing.
enum class Step {
  kFastClaimed,       ///< the fast store granted the claim
  kDurableClaimed,    ///< the durable store granted the claim (two-phase: the in-progress
                      ///< record is committed; transactional: the record was found absent in
                      ///< the open transaction, before the handler; it is written completed
                      ///< after the handler)
  kHandlerReturned,   ///< the handler returned (transactional: before COMMIT)
  kDurableCommitted,  ///< the durable store committed the completed record
  kFastCompleted,     ///< the fast store holds the completed record
};

/// Stable name: fast_claimed, durable_claimed, handler_returned, durable_committed,
/// fast_completed.
constexpr std::string_view step_name(Step s) noexcept {
  switch (s) {
    case Step::kFastClaimed: return "fast_claimed";
    case Step::kDurableClaimed: return "durable_claimed";
    case Step::kHandlerReturned: return "handler_returned";
    case Step::kDurableCommitted: return "durable_committed";
    case Step::kFastCompleted: return "fast_completed";
  }
  return "unknown";
}

/// Options of an IdempotencyGuard.
struct GuardOptions {
  /// How long an in-progress claim is honoured before another attempt may take it over.
  /// Choose it longer than the slowest handler. Must be positive.
  std::chrono::milliseconds lease = kDefaultLease;
  /// How long a completed record (and its response) is kept. Must be positive.
  std::chrono::seconds retention = kDefaultRetention;
  /// Receives events for logs and metrics (null means none). Shared so adapters outlive calls.
  std::shared_ptr<Observer> observer;
  /// The label of duplicates the durable store catches (kMqRecord for consume records).
  DuplicateSource durable_source = DuplicateSource::kUniqueIndex;
  /// Called at each protocol step of a call that runs the handler (empty means none). For fault
  /// injection in tests, which kill the process inside it. Whatever it throws propagates; claims
  /// it leaves behind end with their lease, as after a crash.
  std::function<void(Step, const Key&)> step_hook;
  /// Kill switch: every call runs its handler directly, with no store I/O and no
  /// idempotency at all (transactional handlers in a plain transaction of the durable store).
  /// For an incident in which the stores themselves are the problem. The guard logs a warning
  /// once (LogSink below) and tells the observer each call (on_passthrough, reason disabled).
  bool bypass = false;
  /// Where the guard's own warnings go (today: the bypass warning). Empty: standard error.
  std::function<void(std::string_view)> warn;
  /// A duplicate that finds the key in progress waits up to this long for the first attempt's
  /// result and replays it (or, when the first attempt failed and released the key, runs the
  /// handler itself), instead of answering kInProgress at once. 0 (the default) does not wait.
  /// Waiters in one process wake as soon as a call of this guard completes the key; across
  /// processes they try again after a backoff with jitter (5 ms doubling up to 100 ms), so a
  /// waiter costs a claim per backoff step, not a busy loop. Per call: CallOptions.
  std::chrono::milliseconds wait_for_result{0};
  /// Transient failures (idem::StorageUnavailable, StorageTimeout, OutcomeUnknown) of the
  /// durable store's begin, complete and run_transactional are tried again up to this many
  /// times in all (1: no retry), after a backoff with full jitter between
  /// `store_retry_backoff` and 8 times it. Safe because the call keeps its owner token: a claim
  /// or commit that was applied before the failure is recognised as this attempt's own (a
  /// transactional retry then replays what committed). A handler's own exceptions are never
  /// retried, and two-phase handlers never run twice. Counted in GuardStats::store_retries.
  unsigned store_attempts = 1;
  /// The first backoff of store_attempts.
  std::chrono::milliseconds store_retry_backoff{20};
};

/// What one call may set differently from the guard's options (a refund keeps its record 30
/// days, a cart 10 minutes). Unset fields take the GuardOptions value.
struct CallOptions {
  /// GuardOptions::lease for this call. Must be positive.
  std::optional<std::chrono::milliseconds> lease;
  /// GuardOptions::retention for this call. Must be positive.
  std::optional<std::chrono::seconds> retention;
  /// GuardOptions::wait_for_result for this call (0: answer kInProgress at once).
  std::optional<std::chrono::milliseconds> wait_for_result;
};

namespace detail {
/// Stand-in transaction type for stores that have none, so traits never form `void&`.
struct NoTransaction {};

template <class Durable>
using transaction_t = std::conditional_t<std::is_void_v<typename Durable::Transaction>,
                                         NoTransaction, typename Durable::Transaction>;

template <class Fn, class Tx>
inline constexpr bool kTakesTransaction =
    !std::is_same_v<Tx, NoTransaction> && std::is_invocable_v<Fn&, Tx&>;

template <class R>
using stored_t = typename stored_type<R>::type;  // codec.hpp: the codec selection

template <class Fn, class Tx, bool kTx = kTakesTransaction<Fn, Tx>>
struct response_type {
  using type = stored_t<std::invoke_result_t<Fn&, Tx&>>;
};
template <class Fn, class Tx>
struct response_type<Fn, Tx, false> {
  static_assert(std::is_invocable_v<Fn&>,
                "idem: the handler must be callable as handler(Transaction&) (transactional) "
                "or handler() (two-phase / fast only)");
  using type = stored_t<std::invoke_result_t<Fn&>>;
};

template <class R, class Fn, class... Args>
R invoke_stored(Fn& fn, Args&... args) {
  if constexpr (std::is_void_v<std::invoke_result_t<Fn&, Args&...>>) {
    std::invoke(fn, args...);
    return Unit{};
  } else {
    return R(std::invoke(fn, args...));  // explicit: a std::string_view result becomes a string
  }
}

using SteadyClock = std::chrono::steady_clock;
inline std::chrono::nanoseconds since(SteadyClock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now() - t);
}
}  // namespace detail

/// Runs handlers at most once per idempotency key and answers every duplicate with the first
/// response. Thread-safe; one guard serves any number of threads and keys. The stores must
/// outlive the guard.
///
/// @tparam Durable the durable store type (idem::sqlite::SqliteStore,
///         idem::postgres::PostgresStore) or NoDurableStore for a fast-store-only guard.
template <class Durable = NoDurableStore>
class IdempotencyGuard {
 public:
  /// The durable store's transaction type, as transactional handlers receive it.
  using Transaction = typename Durable::Transaction;
  /// False for a fast-store-only guard (Durable is NoDurableStore).
  static constexpr bool kHasDurable = !std::is_same_v<Durable, NoDurableStore>;
  // A durable store that does not fit the contract fails here, naming the missing member.
  static_assert(detail::check_durable_store<Durable>());

  /// Fast store in front of a durable store (the production shape).
  IdempotencyGuard(FastStore& fast, Durable& durable, GuardOptions options = {})
      : fast_(&fast), durable_(&durable), options_(std::move(options)) {
    check_options();
  }

  /// Durable store only: correct, one durable round trip per call.
  template <class D = Durable,
            std::enable_if_t<std::is_same_v<D, Durable> && !std::is_base_of_v<FastStore, D> &&
                                 !std::is_same_v<D, NoDurableStore>,
                             int> = 0>
  explicit IdempotencyGuard(D& durable, GuardOptions options = {})
      : fast_(nullptr), durable_(&durable), options_(std::move(options)) {
    check_options();
  }

  /// Fast store only: best effort (see the file comment).
  template <class D = Durable, std::enable_if_t<std::is_same_v<D, NoDurableStore>, int> = 0>
  explicit IdempotencyGuard(FastStore& fast, GuardOptions options = {})
      : fast_(&fast), durable_(nullptr), options_(std::move(options)) {
    check_options();
  }

  IdempotencyGuard(const IdempotencyGuard&) = delete;
  IdempotencyGuard& operator=(const IdempotencyGuard&) = delete;

  /// Runs `handler` at most once for `key`, or answers the duplicate.
  ///
  /// @param key         the operation's key (validated by idem::Key)
  /// @param fingerprint the payload's fingerprint (idem::fingerprint(body)), or "" to skip
  ///                    the payload check
  /// @param handler     `R(Transaction&)` for transactional mode, `R()` for two-phase (or
  ///                    fast-only) mode. R is std::string, void, or a type with an idem::Codec.
  /// @return the outcome and, for executed/replayed, the response.
  /// @throws whatever the handler throws (after rollback and release);
  ///         idem::StorageError subclasses when the durable store fails (or the fast store in
  ///         a fast-only guard); idem::LeaseLost when a two-phase or fast-only attempt lost
  ///         its lease before completing; idem::CorruptRecord if a stored response cannot be
  ///         decoded.
  template <class Fn>
  auto run(const Key& key, std::string_view fingerprint, Fn&& handler) -> GuardResult<
      typename detail::response_type<std::decay_t<Fn>, detail::transaction_t<Durable>>::type> {
    return run(key, fingerprint, CallOptions{}, std::forward<Fn>(handler));
  }

  /// As run(key, fingerprint, handler), with this call's own lease, retention and wait.
  /// @throws idem::UsageError for a lease or retention that is not positive, or a negative
  ///         wait; otherwise as run().
  template <class Fn>
  auto run(const Key& key, std::string_view fingerprint, const CallOptions& call_options,
           Fn&& handler)
      -> GuardResult<
          typename detail::response_type<std::decay_t<Fn>, detail::transaction_t<Durable>>::type> {
    using Tx = detail::transaction_t<Durable>;
    using R = typename detail::response_type<std::decay_t<Fn>, Tx>::type;
    const auto lease = call_options.lease.value_or(options_.lease);
    const auto retention = call_options.retention.value_or(options_.retention);
    const auto wait = call_options.wait_for_result.value_or(options_.wait_for_result);
    if (lease.count() <= 0) throw UsageError("idem::CallOptions::lease must be positive");
    if (retention.count() <= 0) {
      throw UsageError("idem::CallOptions::retention must be positive");
    }
    if (wait.count() < 0) throw UsageError("idem::CallOptions::wait_for_result is negative");
    if (options_.bypass) return bypassed<R>(key, handler);
    GuardResult<R> r = run_once<R>(key, fingerprint, lease, retention, handler);
    if (r.outcome != Outcome::kInProgress || wait.count() == 0) return r;
    return wait_for_first<R>(key, fingerprint, lease, retention, wait, handler, std::move(r));
  }

 private:
  template <class R, class Fn>
  GuardResult<R> run_once(const Key& key, std::string_view fingerprint,
                          std::chrono::milliseconds lease, std::chrono::seconds retention,
                          Fn& handler) {
    using Tx = detail::transaction_t<Durable>;
    Call<R> call{key, fingerprint, options_.observer != nullptr};
    call.lease = lease;
    call.retention = retention;
    call.start = call.now();
    stats_.calls.fetch_add(1, std::memory_order_relaxed);
    if constexpr (!kHasDurable) {
      call.mode = Mode::kFastOnly;
    } else if constexpr (detail::kTakesTransaction<std::decay_t<Fn>, Tx>) {
      call.mode = Mode::kTransactional;
    } else {
      call.mode = Mode::kTwoPhase;
    }

    // 2. Fast store claim.
    if (fast_ != nullptr) {
      auto t0 = call.now();
      try {
        ClaimResult c = fast_->claim(key, fingerprint, call.owner, call.lease);
        call.fast_claim = call.since(t0);
        fast_ok();
        if (c.status == ClaimStatus::kClaimed) {
          call.fast_claimed = true;
          stats_.fast_claims.fetch_add(1, std::memory_order_relaxed);
          if (c.took_over) note_takeover(key, "fast");
          step(Step::kFastClaimed, key);
        } else {
          stats_.fast_hits.fetch_add(1, std::memory_order_relaxed);
          return duplicate(call, c, Source::kFastStore, DuplicateSource::kFastStore);
        }
      } catch (const StorageError& e) {
        call.fast_claim = call.since(t0);
        call.degraded = true;
        fast_failed(key, e);
        if constexpr (!kHasDurable) throw;
      }
    }

    // 3. Durable store (or the handler alone, fast-only).
    if constexpr (!kHasDurable) {
      return run_fast_only<R>(call, handler);
    } else if constexpr (detail::kTakesTransaction<std::decay_t<Fn>, Tx>) {
      return run_transactional<R>(call, handler);
    } else {
      return run_two_phase<R>(call, handler);
    }
  }

  // GuardOptions::bypass: the handler alone, no store I/O.
  template <class R, class Fn>
  GuardResult<R> bypassed(const Key& key, Fn& handler) {
    using Tx = detail::transaction_t<Durable>;
    if (!bypass_warned_.exchange(true)) {
      const std::string text =
          "idem: WARNING: GuardOptions::bypass is on: handlers run with NO idempotency (no "
          "store I/O; duplicates run again) until it is turned off";
      if (options_.warn) {
        options_.warn(text);
      } else {
        std::fprintf(stderr, "%s\n", text.c_str());
      }
    }
    stats_.calls.fetch_add(1, std::memory_order_relaxed);
    stats_.bypassed.fetch_add(1, std::memory_order_relaxed);
    if (auto* o = options_.observer.get()) {
      o->on_passthrough(PassthroughEvent{key.scope(), PassthroughReason::kDisabled});
    }
    GuardResult<R> r;
    r.outcome = Outcome::kExecuted;
    if constexpr (detail::kTakesTransaction<std::decay_t<Fn>, Tx>) {
      auto body = [&](Tx& tx) { return detail::invoke_stored<R>(handler, tx); };
      r.value.emplace(detail::run_plain_transaction(*durable_, body));
    } else {
      r.value.emplace(detail::invoke_stored<R>(handler));
    }
    stats_.executed.fetch_add(1, std::memory_order_relaxed);
    return r;
  }

  // GuardOptions::wait_for_result: tries again until the key is no longer in progress or the
  // bound passes. Woken early by completions of this guard (notify_waiters).
  template <class R, class Fn>
  GuardResult<R> wait_for_first(const Key& key, std::string_view fingerprint,
                                std::chrono::milliseconds lease, std::chrono::seconds retention,
                                std::chrono::milliseconds wait, Fn& handler, GuardResult<R> r) {
    stats_.waits.fetch_add(1, std::memory_order_relaxed);
    const auto deadline = detail::SteadyClock::now() + wait;
    std::chrono::milliseconds step{5};
    waiting_.fetch_add(1, std::memory_order_relaxed);
    struct Leave {
      std::atomic<int>& n;
      ~Leave() { n.fetch_sub(1, std::memory_order_relaxed); }
    } leave{waiting_};
    while (r.outcome == Outcome::kInProgress) {
      const auto now = detail::SteadyClock::now();
      if (now >= deadline) break;
      auto pause = std::chrono::duration_cast<std::chrono::milliseconds>(
          jittered(step) + std::chrono::milliseconds{1});
      pause = std::min(pause, std::chrono::duration_cast<std::chrono::milliseconds>(
                                  deadline - now + std::chrono::milliseconds{1}));
      {
        std::unique_lock<std::mutex> lock(wait_mutex_);
        const std::uint64_t seen = completions_;
        wait_cv_.wait_for(lock, pause, [&] { return completions_ != seen; });
      }
      step = std::min(step * 2, std::chrono::milliseconds{100});
      r = run_once<R>(key, fingerprint, lease, retention, handler);
    }
    return r;
  }

  // Wakes the waiters of wait_for_first after a call completed a key.
  void notify_waiters() noexcept {
    if (waiting_.load(std::memory_order_relaxed) == 0) return;
    {
      std::lock_guard<std::mutex> lock(wait_mutex_);
      ++completions_;
    }
    wait_cv_.notify_all();
  }

  // A duration drawn uniformly from [d/2, d] (jitter against synchronised retries).
  static std::chrono::nanoseconds jittered(std::chrono::nanoseconds d) {
    thread_local std::minstd_rand rng{std::random_device{}()};
    std::uniform_int_distribution<std::int64_t> pick(d.count() / 2, d.count());
    return std::chrono::nanoseconds{pick(rng)};
  }

  // Runs `op` (a durable-store operation that keeps the call's owner token) again after a
  // transient failure, up to GuardOptions::store_attempts in all.
  // `handler_threw`: set when the failure came out of the handler (never retried).
  template <class Op>
  auto with_store_retry(const Key& key, Op&& op, const bool* handler_threw = nullptr)
      -> decltype(op()) {
    for (unsigned attempt = 1;; ++attempt) {
      try {
        return op();
      } catch (const StorageError& e) {
        if (attempt >= options_.store_attempts || !e.retryable()) throw;
        if (handler_threw != nullptr && *handler_threw) throw;
        store_error(key, StoreRole::kDurable, e);
        stats_.store_retries.fetch_add(1, std::memory_order_relaxed);
        std::this_thread::sleep_for(
            jittered(options_.store_retry_backoff * (1u << std::min(attempt - 1, 3u))));
      }
    }
  }

 public:
  /// Convenience overload: builds the key from scope and id. @throws idem::InvalidKey.
  template <class Fn>
  auto run(std::string_view scope, std::string_view id, std::string_view fingerprint,
           Fn&& handler) {
    return run(Key::make(scope, id), fingerprint, std::forward<Fn>(handler));
  }

  /// One call whose steps a caller ran itself, for a whole batch at once
  /// (IdempotentConsumer::consume_batch). See report().
  struct ReportedCall {
    /// The call of `k`, ended with `o`, answered by `s`.
    ReportedCall(const Key& k, Outcome o, Source s) noexcept : key(k), outcome(o), source(s) {}
    const Key& key;             ///< the call's key
    Outcome outcome;            ///< any but a handler error (report_handler_error)
    Source source;              ///< kHandler when executed, else who recognised the duplicate
    bool fast_claimed = false;  ///< the fast store granted this call's claim
    bool degraded = false;      ///< the fast store failed for this call
    TimePoint first_seen{};     ///< duplicates: when the record's first attempt began
    std::string_view holder;    ///< duplicates: the record's owner token (may be empty)
    std::chrono::nanoseconds fast_claim{0};  ///< the batch's fast-store claim
    std::chrono::nanoseconds durable{0};     ///< the batch's durable transaction, handlers excluded
    std::chrono::nanoseconds handler{0};     ///< this call's handler
    std::chrono::nanoseconds total{0};       ///< from the batch's start to this call's answer
  };

  /// Counts `c` in GuardStats and tells the observer (on_duplicate, on_call with mode
  /// kTransactional) exactly as run() would for the same outcome and source, so fast-store hit
  /// rate, unique conflicts and call counts include calls decided in batches.
  void report(const ReportedCall& c) noexcept {
    count_reported(c);
    if (c.source == Source::kFastStore) stats_.fast_hits.fetch_add(1, std::memory_order_relaxed);
    if (c.source == Source::kDurableStore) {
      stats_.durable_conflicts.fetch_add(1, std::memory_order_relaxed);
    }
    count_outcome(c.outcome);
    Observer* o = options_.observer.get();
    if (o == nullptr) return;
    if (c.outcome != Outcome::kExecuted) {
      o->on_duplicate(DuplicateEvent{
          c.key, c.outcome,
          c.source == Source::kFastStore ? DuplicateSource::kFastStore : options_.durable_source,
          c.first_seen, c.holder});
    }
    CallEvent e{c.key,     c.outcome,  Mode::kTransactional,
                c.source,  c.degraded, c.fast_claim,
                c.durable, c.handler,  c.total};
    e.fast_claimed = c.fast_claimed;
    o->on_call(e);
  }
  /// The handler of a batch call threw (its writes rolled back): counted as run() counts a
  /// call whose handler threw (on_handler_error, no on_call). `c.outcome` is not used.
  void report_handler_error(const ReportedCall& c) noexcept {
    count_reported(c);
    stats_.handler_errors.fetch_add(1, std::memory_order_relaxed);
    if (auto* o = options_.observer.get()) o->on_handler_error(c.key);
  }
  /// A batch caller's durable store took over an expired lease.
  void report_takeover(const Key& key, std::string_view store) noexcept {
    note_takeover(key, store);
  }
  /// The fast store failed for a batch of `calls` calls (`key`: one of its keys): a burst of
  /// failures begins (on_fast_store_down once). Count the calls with ReportedCall::degraded.
  void report_fast_failure(const Key& key, const Error& e, std::uint64_t calls) noexcept {
    fast_burst(key, e, calls);
  }
  /// The fast store answered a batch: closes a burst of failures (on_fast_store_recovered).
  void report_fast_ok() noexcept { fast_ok(); }
  /// A fast-store record was rewritten from the durable store for a batch call.
  void report_fast_refill() noexcept {
    stats_.fast_refills.fetch_add(1, std::memory_order_relaxed);
  }
  /// Whether an observer listens (batch callers time their phases only then).
  bool observed() const noexcept { return options_.observer != nullptr; }

  /// The guard's counters (always on).
  const GuardStats& stats() const noexcept { return stats_; }
  /// The options in force.
  const GuardOptions& options() const noexcept { return options_; }
  /// The fast store, or null.
  FastStore* fast_store() const noexcept { return fast_; }
  /// The durable store, or null.
  Durable* durable_store() const noexcept { return durable_; }

 private:
  template <class R>
  struct Call {
    const Key& key;
    std::string_view fingerprint;
    // Timings feed only the observer's CallEvent: without an observer the clock is not read.
    bool timed = false;
    detail::SteadyClock::time_point start{};
    OwnerToken owner = OwnerToken::generate();
    std::chrono::milliseconds lease{0};
    std::chrono::seconds retention{0};
    Mode mode = Mode::kFastOnly;
    bool fast_claimed = false;
    bool degraded = false;
    std::chrono::nanoseconds fast_claim{0};
    std::chrono::nanoseconds durable{0};
    std::chrono::nanoseconds handler{0};

    detail::SteadyClock::time_point now() const noexcept {
      return timed ? detail::SteadyClock::now() : detail::SteadyClock::time_point{};
    }
    std::chrono::nanoseconds since(detail::SteadyClock::time_point t) const noexcept {
      return timed ? detail::since(t) : std::chrono::nanoseconds{0};
    }
  };

  template <class R>
  static DurableHint hint(const Call<R>& call) noexcept {
    DurableHint h;
    h.fast_claimed = call.fast_claimed;
    return h;
  }

  void check_options() const {
    if (options_.lease.count() <= 0) {
      throw UsageError("idem::IdempotencyGuard: GuardOptions::lease must be positive");
    }
    if (options_.retention.count() <= 0) {
      throw UsageError("idem::IdempotencyGuard: GuardOptions::retention must be positive");
    }
  }

  template <class R, class Fn>
  GuardResult<R> run_fast_only(Call<R>& call, Fn& handler) {
    std::optional<R> value;
    auto t0 = call.now();
    try {
      value.emplace(detail::invoke_stored<R>(handler));
    } catch (...) {
      call.handler = call.since(t0);
      handler_failed(call);
      throw;
    }
    call.handler = call.since(t0);
    // Codec<std::string> is the identity: complete from the value itself, no copy.
    std::string encoded;
    std::string_view bytes;
    if constexpr (std::is_same_v<R, std::string>) {
      bytes = *value;
    } else {
      encoded = Codec<R>::encode(*value);
      bytes = encoded;
    }
    // In a fast-only guard the fast store is the only record: its failures propagate.
    bool completed = false;
    try {
      completed = fast_->complete(call.key, call.owner, bytes, call.retention);
    } catch (const Error& e) {
      store_error(call.key, StoreRole::kFast, e);
      throw;
    }
    if (!completed) {
      note_lease_lost(call.key, "fast");
      throw LeaseLost("idem: the lease on '" + call.key.str() +
                      "' expired and was taken over before the handler completed; "
                      "raise GuardOptions::lease above the handler's duration");
    }
    return executed(call, std::move(value));
  }

  template <class R, class Fn>
  GuardResult<R> run_transactional(Call<R>& call, Fn& handler) {
    std::optional<R> value;
    std::chrono::nanoseconds handler_time{0};
    bool handler_threw = false;
    auto t0 = call.now();
    TransactionalResult d;
    try {
      auto body = [&](Transaction& tx) -> std::string {
        auto h0 = call.now();
        value.reset();  // the store may retry the transaction (serialization failure)
        handler_threw = false;
        try {
          step(Step::kDurableClaimed, call.key);
          value.emplace(detail::invoke_stored<R>(handler, tx));
          step(Step::kHandlerReturned, call.key);
        } catch (...) {
          handler_time += call.since(h0);
          handler_threw = true;
          throw;
        }
        handler_time += call.since(h0);
        return Codec<R>::encode(*value);
      };
      d = with_store_retry(
          call.key,
          [&] {
            return durable_->run_transactional(call.key, call.fingerprint, call.owner,
                                               call.retention, body, hint(call));
          },
          &handler_threw);
    } catch (...) {
      // The transaction was rolled back (or, for OutcomeUnknown, may have committed: then the
      // durable record replays it to the retry). Either way the fast claim must not block the
      // retry for a whole lease.
      call.handler = handler_time;
      call.durable = call.since(t0) - handler_time;
      if (handler_threw) {
        handler_failed(call);
      } else {
        durable_failed(call.key);
        release_fast(call);
      }
      throw;
    }
    call.handler = handler_time;
    call.durable = call.since(t0) - handler_time;
    if (d.status == TransactionalStatus::kCommitted) {
      if (d.took_over) note_takeover(call.key, "durable");
      step(Step::kDurableCommitted, call.key);
      ClaimResult c;
      c.response = std::move(d.response);
      return after_durable<R>(call, c, std::move(value));
    }
    ClaimResult c;
    c.status = d.status == TransactionalStatus::kReplayed   ? ClaimStatus::kDone
               : d.status == TransactionalStatus::kMismatch ? ClaimStatus::kMismatch
                                                            : ClaimStatus::kBusy;
    c.response = std::move(d.response);
    c.failed = d.failed;
    c.holder = std::move(d.holder);
    c.first_seen = d.first_seen;
    return after_durable<R>(call, c, std::move(value));
  }

  template <class R, class Fn>
  GuardResult<R> run_two_phase(Call<R>& call, Fn& handler) {
    auto t0 = call.now();
    ClaimResult d;
    try {
      d = with_store_retry(call.key, [&] {
        return durable_->begin(call.key, call.fingerprint, call.owner, call.lease, hint(call));
      });
    } catch (...) {
      call.durable = call.since(t0);
      durable_failed(call.key);
      release_fast(call);
      throw;
    }
    call.durable = call.since(t0);
    if (d.status != ClaimStatus::kClaimed) {
      return after_durable<R>(call, d, std::nullopt);
    }
    if (d.took_over) note_takeover(call.key, "durable");

    std::optional<R> value;
    auto h0 = call.now();
    try {
      step(Step::kDurableClaimed, call.key);
      value.emplace(detail::invoke_stored<R>(handler));
      step(Step::kHandlerReturned, call.key);
    } catch (...) {
      call.handler = call.since(h0);
      // Release the durable claim first: once it is gone a retry may run at once.
      try {
        durable_->release(call.key, call.owner);
      } catch (...) {
        // The record stays in progress until its lease ends; a retry then takes over.
        durable_failed(call.key);
      }
      handler_failed(call);
      throw;
    }
    call.handler = call.since(h0);
    std::string bytes = Codec<R>::encode(*value);
    auto c0 = call.now();
    // If this throws, the durable record stays in progress (owned by us) until the lease ends,
    // and the fast claim is kept too, so duplicates answer "in progress" meanwhile.
    bool completed = false;
    try {
      completed = with_store_retry(call.key, [&] {
        return durable_->complete(call.key, call.owner, bytes, call.retention);
      });
    } catch (...) {
      durable_failed(call.key);
      throw;
    }
    call.durable += call.since(c0);
    if (!completed) {
      release_fast(call);
      note_lease_lost(call.key, "durable");
      throw LeaseLost("idem: the lease on '" + call.key.str() +
                      "' expired and was taken over before the handler completed; "
                      "raise GuardOptions::lease above the handler's duration");
    }
    step(Step::kDurableCommitted, call.key);
    d.status = ClaimStatus::kClaimed;
    d.response = std::move(bytes);
    return after_durable<R>(call, d, std::move(value));
  }

  // Steps 4 and the durable store's duplicate answers, shared by both durable modes.
  template <class R>
  GuardResult<R> after_durable(Call<R>& call, ClaimResult& d, std::optional<R> value) {
    switch (d.status) {
      case ClaimStatus::kClaimed:
        complete_fast(call, d.response);
        return executed(call, std::move(value));
      case ClaimStatus::kDone:
        // The fast store let a completed key through (it lost the record, was down, or this
        // guard has none): refill it so the next duplicate stops at the entrance again.
        stats_.durable_conflicts.fetch_add(1, std::memory_order_relaxed);
        complete_fast(call, d.response);
        return duplicate(call, d, Source::kDurableStore, options_.durable_source);
      case ClaimStatus::kBusy:
      case ClaimStatus::kMismatch:
        stats_.durable_conflicts.fetch_add(1, std::memory_order_relaxed);
        release_fast(call);
        return duplicate(call, d, Source::kDurableStore, options_.durable_source);
    }
    throw StorageError("idem: unknown claim status from the durable store");
  }

  template <class R>
  GuardResult<R> executed(Call<R>& call, std::optional<R> value) {
    count_outcome(Outcome::kExecuted);
    GuardResult<R> r;
    r.outcome = Outcome::kExecuted;
    r.value = std::move(value);
    r.source = Source::kHandler;
    r.degraded = call.degraded;
    emit_call(call, r);
    notify_waiters();
    return r;
  }

  template <class R>
  // Consumes `c` (its strings move into the result: no copies on the replay path).
  GuardResult<R> duplicate(Call<R>& call, ClaimResult& c, Source source,
                           DuplicateSource dup_source) {
    GuardResult<R> r;
    r.source = source;
    r.degraded = call.degraded;
    r.first_seen = c.first_seen;
    switch (c.status) {
      case ClaimStatus::kDone:
        r.outcome = Outcome::kReplayed;
        try {
          if constexpr (std::is_same_v<R, std::string>) {
            r.value.emplace(std::move(c.response));  // Codec<std::string> is the identity
          } else {
            r.value.emplace(Codec<R>::decode(c.response));
          }
        } catch (const std::exception& e) {
          CorruptRecord corrupt("idem: the stored response of '" + call.key.str() +
                                "' cannot be decoded: " + e.what());
          store_error(call.key,
                      source == Source::kFastStore ? StoreRole::kFast : StoreRole::kDurable,
                      corrupt);
          throw corrupt;
        }
        break;
      case ClaimStatus::kBusy:
        r.outcome = Outcome::kInProgress;
        break;
      case ClaimStatus::kMismatch:
        r.outcome = Outcome::kFingerprintMismatch;
        break;
      case ClaimStatus::kClaimed:
        throw StorageError("idem: internal error: a claim is not a duplicate");
    }
    count_outcome(r.outcome);
    if (auto* o = options_.observer.get()) {
      o->on_duplicate(DuplicateEvent{call.key, r.outcome, dup_source, c.first_seen, c.holder});
    }
    r.holder = std::move(c.holder);
    emit_call(call, r);
    return r;
  }

  template <class R>
  void emit_call(Call<R>& call, const GuardResult<R>& r) {
    if (auto* o = options_.observer.get()) {
      CallEvent e{call.key,       r.outcome,   call.mode,    r.source,
                  call.degraded,  call.fast_claim, call.durable, call.handler,
                  call.since(call.start)};
      e.fast_claimed = call.fast_claimed;
      o->on_call(e);
    }
  }

  template <class R>
  void complete_fast(Call<R>& call, std::string_view response) {
    if (fast_ == nullptr) return;
    try {
      if (call.fast_claimed) {
        if (fast_->complete(call.key, call.owner, response, call.retention)) {
          step(Step::kFastCompleted, call.key);
          return;
        }
        // Our fast claim expired and was taken over (or released) while the durable store
        // decided. The durable answer stands; overwrite the fast record with it.
      } else if (call.degraded) {
        return;  // the fast store failed moments ago; do not pay a second timeout
      }
      fast_->fill(call.key, call.fingerprint, response, call.retention);
      stats_.fast_refills.fetch_add(1, std::memory_order_relaxed);
      step(Step::kFastCompleted, call.key);
    } catch (const StorageError& e) {
      // The durable store replays from now on; the fast store is refilled by the next duplicate.
      fast_failed(call.key, e);
    }
  }

  template <class R>
  void release_fast(Call<R>& call) noexcept {
    if (fast_ == nullptr || !call.fast_claimed) return;
    try {
      fast_->release(call.key, call.owner);
    } catch (const StorageError& e) {
      // The claim ends with its lease; duplicates answer "in progress" until then.
      fast_failed(call.key, e);
    } catch (...) {
    }
  }

  template <class R>
  void handler_failed(Call<R>& call) {
    release_fast(call);
    stats_.handler_errors.fetch_add(1, std::memory_order_relaxed);
    if (auto* o = options_.observer.get()) o->on_handler_error(call.key);
    notify_waiters();  // the key is free again: a waiter may run it
  }

  // The outcome's counter (run() and report() alike).
  void count_outcome(Outcome o) noexcept {
    switch (o) {
      case Outcome::kExecuted:
        stats_.executed.fetch_add(1, std::memory_order_relaxed);
        break;
      case Outcome::kReplayed:
        stats_.replayed.fetch_add(1, std::memory_order_relaxed);
        break;
      case Outcome::kInProgress:
        stats_.in_progress.fetch_add(1, std::memory_order_relaxed);
        break;
      case Outcome::kFingerprintMismatch:
        stats_.mismatched.fetch_add(1, std::memory_order_relaxed);
        break;
    }
  }

  // What every reported call counts, as run() counts it before it knows the outcome.
  void count_reported(const ReportedCall& c) noexcept {
    stats_.calls.fetch_add(1, std::memory_order_relaxed);
    if (c.fast_claimed) stats_.fast_claims.fetch_add(1, std::memory_order_relaxed);
    if (c.degraded) stats_.degraded.fetch_add(1, std::memory_order_relaxed);
  }

  void step(Step s, const Key& key) {
    if (options_.step_hook) options_.step_hook(s, key);
  }

  void note_takeover(const Key& key, std::string_view store) {
    stats_.takeovers.fetch_add(1, std::memory_order_relaxed);
    if (auto* o = options_.observer.get()) o->on_takeover(key, store);
  }

  void note_lease_lost(const Key& key, std::string_view store) {
    stats_.leases_lost.fetch_add(1, std::memory_order_relaxed);
    if (auto* o = options_.observer.get()) o->on_lease_lost(key, store);
  }

  // Every store failure reaches the observer (on_store_error) with the key and its errc.
  void store_error(const Key& key, StoreRole role, const Error& e) noexcept {
    auto* o = options_.observer.get();
    if (o == nullptr) return;
    std::string_view store = role == StoreRole::kFast ? fast_->name() : durable_name();
    o->on_store_error(StoreErrorEvent{&key, role, store, e});
  }
  // Called inside a catch block: reports the durable store's exception in flight.
  void durable_failed(const Key& key) noexcept {
    if (options_.observer == nullptr) return;
    try {
      throw;
    } catch (const Error& e) {
      store_error(key, StoreRole::kDurable, e);
    } catch (...) {
    }
  }
  std::string_view durable_name() const noexcept {
    if constexpr (kHasDurable) {
      return durable_->name();
    } else {
      return "none";
    }
  }

  // Degraded-mode bookkeeping: count every failing call, report once per burst.
  void fast_failed(const Key& key, const Error& e) noexcept {
    stats_.degraded.fetch_add(1, std::memory_order_relaxed);
    fast_burst(key, e);
  }
  void fast_burst(const Key& key, const Error& e, std::uint64_t calls = 1) noexcept {
    store_error(key, StoreRole::kFast, e);
    burst_failures_.fetch_add(calls, std::memory_order_relaxed);
    if (!fast_down_.exchange(true, std::memory_order_acq_rel)) {
      if (auto* o = options_.observer.get()) o->on_fast_store_down(key, e);
    }
  }
  void fast_ok() noexcept {
    if (fast_down_.load(std::memory_order_relaxed) &&
        fast_down_.exchange(false, std::memory_order_acq_rel)) {
      auto n = burst_failures_.exchange(0, std::memory_order_relaxed);
      if (auto* o = options_.observer.get()) o->on_fast_store_recovered(n);
    }
  }

  FastStore* fast_;
  Durable* durable_;
  GuardOptions options_;
  GuardStats stats_;
  std::atomic<bool> bypass_warned_{false};
  // wait_for_first: calls waiting for a key's first result, woken by completions of this guard.
  std::atomic<int> waiting_{0};
  std::mutex wait_mutex_;
  std::condition_variable wait_cv_;
  std::uint64_t completions_ = 0;  // guarded by wait_mutex_
  std::atomic<bool> fast_down_{false};
  std::atomic<std::uint64_t> burst_failures_{0};
};

/// `IdempotencyGuard guard{fast}` deduces a fast-store-only guard.
IdempotencyGuard(FastStore&)->IdempotencyGuard<NoDurableStore>;
IdempotencyGuard(FastStore&, GuardOptions)->IdempotencyGuard<NoDurableStore>;

/// `IdempotencyGuard guard{durable}` deduces a durable-only guard.
template <class D, std::enable_if_t<!std::is_base_of_v<FastStore, D>, int> = 0>
IdempotencyGuard(D&) -> IdempotencyGuard<D>;
template <class D, std::enable_if_t<!std::is_base_of_v<FastStore, D>, int> = 0>
IdempotencyGuard(D&, GuardOptions) -> IdempotencyGuard<D>;

}  // namespace idem
