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
#include <cstddef>
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
#include <vector>

#include "idem/batch.hpp"
#include "idem/codec.hpp"
#include "idem/detail/batch_run.hpp"
#include "idem/detail/guard_core.hpp"
#include "idem/detail/plain_transaction.hpp"
#include "idem/durable_store.hpp"
#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/guard_options.hpp"
#include "idem/key.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"
#include "idem/store.hpp"

namespace idem {

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
      : fast_(&fast),
        durable_(&durable),
        core_(true, std::move(options), kWho, fast.name(), durable.name()) {}

  /// Durable store only: correct, one durable round trip per call.
  template <class D = Durable,
            std::enable_if_t<std::is_same_v<D, Durable> && !std::is_base_of_v<FastStore, D> &&
                                 !std::is_same_v<D, NoDurableStore>,
                             int> = 0>
  explicit IdempotencyGuard(D& durable, GuardOptions options = {})
      : fast_(nullptr),
        durable_(&durable),
        core_(false, std::move(options), kWho, "none", durable.name()) {}

  /// Fast store only: best effort (see the file comment).
  template <class D = Durable, std::enable_if_t<std::is_same_v<D, NoDurableStore>, int> = 0>
  explicit IdempotencyGuard(FastStore& fast, GuardOptions options = {})
      : fast_(&fast),
        durable_(nullptr),
        core_(true, std::move(options), kWho, fast.name(), "none") {}

  IdempotencyGuard(const IdempotencyGuard&) = delete;
  IdempotencyGuard& operator=(const IdempotencyGuard&) = delete;
  /// Stops the heartbeat thread (if one was started). No call may still run.
  ~IdempotencyGuard() {
    {
      std::lock_guard<std::mutex> lock(beat_mutex_);
      beat_stop_ = true;
    }
    beat_cv_.notify_all();
    if (beat_thread_.joinable()) beat_thread_.join();
  }

  /// Runs `handler` at most once for `key`, or answers the duplicate.
  ///
  /// @param key         the operation's key (validated by idem::Key)
  /// @param fingerprint the payload's fingerprint (idem::fingerprint(body)), or "" for no
  ///                    payload check. "" is compared like any fingerprint: calls of one key
  ///                    that all pass "" never mismatch, but a key first called with a
  ///                    fingerprint and then with "" (or the reverse) is a mismatch, as two
  ///                    payloads are: a client that sometimes sends its payload's fingerprint
  ///                    and sometimes not cannot be told from one that reuses its key.
  ///                    At most 255 bytes on MySQL (its column; a UsageError there), which
  ///                    idem::fingerprint's 64 hex characters are far below.
  /// @param handler     `R(Transaction&)` for transactional mode, `R()` for two-phase (or
  ///                    fast-only) mode. R is std::string, void, or a type with an idem::Codec.
  /// @return the outcome and, for executed/replayed, the response.
  /// @throws whatever the handler throws (after rollback and release);
  ///         idem::StorageError subclasses when the durable store fails (or the fast store in
  ///         a fast-only guard); idem::LeaseLost when a two-phase or fast-only attempt lost
  ///         its lease before completing; idem::CorruptRecord if a stored response cannot be
  ///         decoded; the durable store's refusal when it cannot store the response for good
  ///         (e.g. larger than MySQL takes: a UsageError): a two-phase record is then marked
  ///         failed, and later calls on the key throw a non-retryable idem::StorageError
  ///         instead of running the handler again.
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
    const auto lease = call_options.lease.value_or(core_.options().lease);
    const auto retention = call_options.retention.value_or(core_.options().retention);
    const auto wait = call_options.wait_for_result.value_or(core_.options().wait_for_result);
    const bool beat = call_options.heartbeat.value_or(core_.options().heartbeat);
    detail::check_term(lease, "idem::CallOptions::lease");
    detail::check_term(retention, "idem::CallOptions::retention");
    if (wait.count() < 0) throw UsageError("idem::CallOptions::wait_for_result is negative");
    if (core_.options().bypass) return bypassed<R>(key, handler);
    const detail::CallTerms terms{lease, retention, beat, call_options.likely_new,
                                  call_options.expected_response};
    if (wait.count() == 0) return run_once<R>(key, fingerprint, terms, handler, nullptr);
    detail::WaitTurn turn{detail::SteadyClock::now() + wait};
    GuardResult<R> r = run_once<R>(key, fingerprint, terms, handler, &turn);
    if (!turn.deferred) return r;
    return wait_for_first<R>(key, fingerprint, terms, handler, turn, std::move(r));
  }

 private:
  // One attempt of a call (`turn`: the waiting call's, whose attempts count as one call).
  template <class R, class Fn>
  GuardResult<R> run_once(const Key& key, std::string_view fingerprint,
                          const detail::CallTerms& terms, Fn& handler, detail::WaitTurn* turn) {
    using Tx = detail::transaction_t<Durable>;
    Call<R> call{key, fingerprint, Mode::kFastOnly, terms, core_.observed()};
    call.wait = turn;
    core_.start(call);
    if constexpr (!kHasDurable) {
      call.mode = Mode::kFastOnly;
    } else if constexpr (detail::kTakesTransaction<std::decay_t<Fn>, Tx>) {
      call.mode = Mode::kTransactional;
    } else {
      call.mode = Mode::kTwoPhase;
    }

    // 2. Fast store claim (skipped for a while after it failed, when the options say so).
    bool skip_fast = false;
    if constexpr (kHasDurable) skip_fast = fast_ != nullptr && core_.skip_fast(call);
    if (fast_ != nullptr && !skip_fast) {
      auto t0 = call.now();
      std::optional<ClaimResult> unstored;  // a record whose response could not be stored
      try {
        ClaimResult c = fast_->claim(key, fingerprint, call.owner(), call.options.lease);
        call.fast_claim = call.since(t0);
        // Claims a stalled fast store applied after their answers were lost: released now, and
        // a busy or mismatch answer that came (or may have come) from one of them is asked
        // again, once.
        bool again = core_.has_lost_claims() && core_.release_lost_claims(*fast_);
        if (auto lost = core_.lost_claim_holding(key, c)) {
          core_.release_lost_claim(*fast_, key, *lost);
          again = true;
        }
        if (again && (c.status == ClaimStatus::kBusy || c.status == ClaimStatus::kMismatch)) {
          c = fast_->claim(key, fingerprint, call.owner(), call.options.lease);
          call.fast_claim = call.since(t0);
        }
        if (!core_.fast_claim_answered(call, c)) {
          if (!detail::is_unstored(c)) {
            return duplicate<R>(call, c, Source::kFastStore, DuplicateSource::kFastStore);
          }
          unstored = std::move(c);  // (written back by a batch): never a response
        }
      } catch (const StorageError& e) {
        call.fast_claim = call.since(t0);
        if constexpr (!kHasDurable) {
          core_.fast_burst(key, e);  // a fast-only call fails: not degraded
          core_.note_lost_claim(key, call.owner(), e, call.options.lease);
          throw;
        }
        core_.fast_claim_failed(call, e);
      }
      if (unstored) {
        auto error = detail::unstored_answer(key, *unstored);
        core_.store_failed(key, StoreRole::kFast, std::make_exception_ptr(error));
        throw error;
      }
    }

    // 3. Durable store (or the handler alone, fast-only). From here on the call uses its own
    //    copies of the key and fingerprint (the handler may reassign the caller's).
    call.own();
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
      if (core_.options().warn) {
        core_.options().warn(text);
      } else {
        std::fprintf(stderr, "%s\n", text.c_str());
      }
    }
    core_.counters().calls.fetch_add(1, std::memory_order_relaxed);
    core_.counters().bypassed.fetch_add(1, std::memory_order_relaxed);
    if (auto* o = core_.options().observer.get()) {
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
    core_.counters().executed.fetch_add(1, std::memory_order_relaxed);
    return r;
  }

  // GuardOptions::wait_for_result: tries again until the key is no longer in progress or the
  // bound (from the call's start) passes. Woken early by completions of this guard
  // (notify_waiters). The attempts are one call: counted and reported once, with the answer
  // the caller gets (an attempt's kInProgress before the bound is held back: turn.deferred).
  template <class R, class Fn>
  GuardResult<R> wait_for_first(const Key& key, std::string_view fingerprint,
                                const detail::CallTerms& terms, Fn& handler, detail::WaitTurn& turn,
                                GuardResult<R> r) {
    core_.counters().waits.fetch_add(1, std::memory_order_relaxed);
    const auto deadline = turn.until;
    std::chrono::milliseconds step{5};
    waiting_.fetch_add(1, std::memory_order_relaxed);
    struct Leave {
      std::atomic<int>& n;
      ~Leave() { n.fetch_sub(1, std::memory_order_relaxed); }
    } leave{waiting_};
    while (turn.deferred) {
      turn.deferred = false;
      const auto now = detail::SteadyClock::now();
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
      r = run_once<R>(key, fingerprint, terms, handler, &turn);
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
  auto with_store_retry(const Key& key, Op&& op, const bool* handler_threw = nullptr,
                        StoreRole role = StoreRole::kDurable) -> decltype(op()) {
    for (unsigned attempt = 1;; ++attempt) {
      try {
        return op();
      } catch (const StorageError& e) {
        if (attempt >= core_.options().store_attempts || !e.retryable()) throw;
        if (handler_threw != nullptr && *handler_threw) throw;
        store_error(key, role, e);
        core_.counters().store_retries.fetch_add(1, std::memory_order_relaxed);
        auto* o = core_.options().observer.get();
        if (o != nullptr && role == StoreRole::kDurable) {
          o->on_durable_retry(key, errc_name(e.code()));
        }
        std::this_thread::sleep_for(
            jittered(core_.options().store_retry_backoff * (1u << std::min(attempt - 1, 3u))));
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

  /// Runs a batch of calls with one fast-store round trip for all claims, ONE durable
  /// transaction for all records and handlers, and one fast-store round trip for all
  /// completions (see idem/batch.hpp and IdempotentConsumer::consume_batch, its main user).
  ///
  /// Each executed call's record stores `response` (batch handlers return nothing), so the
  /// records are written before the handlers run, in one statement where the store can.
  /// Calls of the same key in one batch run once: the record the first wrote decides the
  /// others (in progress when the first one's handler failed). A handler that throws loses
  /// only its own writes (the transaction runs again with a savepoint per call, so a
  /// transactional handler may run twice for one committed effect: keep its side effects in
  /// the transaction); its answer carries the exception. Every call is counted in stats() and
  /// told to the observer as run() would count and tell it.
  ///
  /// @param calls    the calls (keys and fingerprints), taken over by the batch
  /// @param response the bytes every executed call's record stores (replayed to duplicates)
  /// @param handler  `void(Transaction&, std::size_t i)`, run for call `i` inside the batch's
  ///                 transaction
  /// @return one answer per call, in order, and whether the transaction ran again.
  /// @throws idem::StorageError subclasses (nothing of the batch committed, except after
  ///         idem::OutcomeUnknown: a COMMIT whose answer was lost may have applied it all; its
  ///         fast claims are released either way, and a retry is decided by the records), a
  ///         retryable idem error thrown by a handler (the whole batch rolls back).
  template <class Fn>
  BatchResult run_batch(std::vector<BatchCall> calls, std::string_view response, Fn&& handler) {
    static_assert(detail::check_batch_store<Durable>());
    static_assert(std::is_invocable_v<Fn&, Transaction&, std::size_t>,
                  "idem: a batch handler must be callable as handler(Transaction&, std::size_t)");
    if (calls.empty()) return BatchResult{};
    detail::BatchRun<Durable> batch(core_, fast_, *durable_, calls, response);
    BatchResult r = batch.run(handler);
    for (const BatchAnswer& a : r.answers) {
      if (a.outcome == Outcome::kExecuted) {
        notify_waiters();
        break;
      }
    }
    return r;
  }


  /// The guard's counters (always on).
  const GuardStats& stats() const noexcept { return core_.stats(); }
  /// The options in force.
  const GuardOptions& options() const noexcept { return core_.options(); }
  /// The fast store, or null.
  FastStore* fast_store() const noexcept { return fast_; }
  /// The durable store, or null.
  Durable* durable_store() const noexcept { return durable_; }

 private:
  static constexpr std::string_view kWho = "idem::IdempotencyGuard";
  // One call's state (the guard core's), passed to every step.
  template <class R>
  using Call = detail::CallState;

  template <class R, class Fn>
  GuardResult<R> run_fast_only(Call<R>& call, Fn& handler) {
    std::optional<R> value;
    auto t0 = call.now();
    try {
      Beating beating(*this, call, false);
      value.emplace(detail::invoke_stored<R>(handler));
    } catch (...) {
      call.handler = call.since(t0);
      handler_failed(call, std::current_exception());
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
    // Retried as a durable completion is (store_attempts: owner-checked, so repeating it is
    // safe); a transient failure past them is OutcomeUnknown: the handler ran.
    bool completed = false;
    try {
      completed = with_store_retry(
          call.key(),
          [&] {
            return fast_->complete_claimed(call.key(), call.owner(), call.fast_ticket, bytes,
                                           call.options.retention);
          },
          nullptr, StoreRole::kFast);
    } catch (const Error& e) {
      store_error(call.key(), StoreRole::kFast, e);
      auto error = std::current_exception();
      if (detail::completion_refused_for_good(error)) {
        // The handler ran: mark the record failed so no retry runs it again (as two-phase).
        try {
          (void)fast_->fail(call.key(), call.owner(), detail::unstored_reason(e),
                            call.options.retention);
        } catch (...) {
          // The claim ends with its lease; the caller is told the handler ran.
          std::rethrow_exception(detail::handler_ran_unrecorded(error));
        }
        notify_waiters();
      }
      std::rethrow_exception(detail::after_the_handler_ran(error));
    }
    if (!completed) {
      if (wrote_back_vanished(call, bytes)) return executed(call, std::move(value));
      throw core_.lease_lost(call, "fast");
    }
    return executed(call, std::move(value));
  }

  // A fast-only completion that found no record of its own: when the key holds none at all
  // (evicted, flushed, a restart without persistence), nobody else holds it, and this call's
  // response is written back so that retries replay it instead of running the handler again
  // (a retry after LeaseLost found no winner to replay). Another attempt's record: false
  // (LeaseLost, whose retry replays the winner); so is a write-back that fails.
  bool wrote_back_vanished(detail::CallState& call, std::string_view response) noexcept {
    try {
      if (fast_->lookup(call.key())) return false;
      fast_->fill(call.key(), call.fingerprint(), response, call.options.retention);
      core_.count_refill();
      return true;
    } catch (...) {
      return false;
    }
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
          step(Step::kDurableClaimed, call.key());
          Beating beating(*this, call, false);  // the open transaction holds the record
          value.emplace(detail::invoke_stored<R>(handler, tx));
          step(Step::kHandlerReturned, call.key());
        } catch (...) {
          handler_time += call.since(h0);
          handler_threw = true;
          throw;
        }
        handler_time += call.since(h0);
        return Codec<R>::encode(*value);
      };
      d = with_store_retry(
          call.key(),
          [&] {
            return durable_->run_transactional(call.key(), call.fingerprint(), call.owner(),
                                               call.options.retention, body, call.hint());
          },
          &handler_threw);
    } catch (...) {
      // The transaction was rolled back (or, for OutcomeUnknown, may have committed: then the
      // durable record replays it to the retry). Either way the fast claim must not block the
      // retry for a whole lease.
      call.handler = handler_time;
      call.durable = call.since(t0) - handler_time;
      if (handler_threw) {
        handler_failed(call, std::current_exception());
      } else {
        durable_failed(call.key());
        release_fast(call);
      }
      throw;
    }
    call.handler = handler_time;
    call.durable = call.since(t0) - handler_time;
    if (d.status == TransactionalStatus::kCommitted) {
      if (d.took_over) note_takeover(call.key(), "durable");
      step(Step::kDurableCommitted, call.key());
    }
    ClaimResult c = detail::claim_of(d);
    return after_durable<R>(call, c, std::move(value));
  }

  template <class R, class Fn>
  GuardResult<R> run_two_phase(Call<R>& call, Fn& handler) {
    auto t0 = call.now();
    ClaimResult d;
    try {
      d = with_store_retry(call.key(), [&] {
        return durable_->begin(call.key(), call.fingerprint(), call.owner(), call.options.lease,
                               call.hint());
      });
    } catch (...) {
      call.durable = call.since(t0);
      durable_failed(call.key());
      release_unanswered_begin(call, std::current_exception());
      release_fast(call);
      throw;
    }
    call.durable = call.since(t0);
    if (d.status != ClaimStatus::kClaimed) {
      return after_durable<R>(call, d, std::nullopt);
    }
    if (d.took_over) note_takeover(call.key(), "durable");

    std::optional<R> value;
    auto h0 = call.now();
    try {
      step(Step::kDurableClaimed, call.key());
      Beating beating(*this, call, true);
      value.emplace(detail::invoke_stored<R>(handler));
      step(Step::kHandlerReturned, call.key());
    } catch (...) {
      call.handler = call.since(h0);
      // Release the durable claim first: once it is gone a retry may run at once. A transient
      // failure of the release is tried again as a completion's is (store_attempts: the
      // release is owner-checked, so repeating it is safe).
      try {
        (void)with_store_retry(call.key(),
                               [&] { return durable_->release(call.key(), call.owner()); });
      } catch (...) {
        // The record stays in progress until its lease ends; a retry then takes over.
        durable_failed(call.key());
      }
      handler_failed(call, std::current_exception());
      throw;
    }
    call.handler = call.since(h0);
    std::string bytes = Codec<R>::encode(*value);
    auto c0 = call.now();
    // If this throws, the durable record stays in progress (owned by us) until the lease ends,
    // and the fast claim is kept too, so duplicates answer "in progress" meanwhile. A
    // completion refused for good (the response is larger than the store takes) would stay so
    // for every retry after the lease, each running the handler again: the record is marked
    // failed instead, and later calls get unstored_answer.
    bool completed = false;
    try {
      unsigned tries = 0;
      completed = with_store_retry(call.key(), [&] {
        ++tries;
        return durable_->complete(call.key(), call.owner(), bytes, call.options.retention);
      });
      // A retry that found nothing left to complete may follow a try that was applied and
      // whose answer was lost with its connection (OutcomeUnknown): the record tells.
      if (!completed && tries > 1) completed = completed_by(call);
    } catch (...) {
      durable_failed(call.key());
      auto error = std::current_exception();
      if (detail::completion_refused_for_good(error) && !mark_unstored(call, error)) {
        std::rethrow_exception(detail::handler_ran_unrecorded(error));
      }
      std::rethrow_exception(detail::after_the_handler_ran(error));
    }
    call.durable += call.since(c0);
    if (!completed) {
      release_fast(call);
      throw core_.lease_lost(call, "durable");
    }
    step(Step::kDurableCommitted, call.key());
    d.status = ClaimStatus::kClaimed;
    d.response = std::move(bytes);
    return after_durable<R>(call, d, std::move(value));
  }

  // A begin that may stand although it failed (detail::begin_may_stand) is released, tried
  // store_attempts times: when the store is still away, the lease ends the record as before.
  void release_unanswered_begin(const detail::CallState& call,
                                const std::exception_ptr& error) noexcept {
    if (!detail::begin_may_stand(error)) return;
    const unsigned attempts = core_.options().store_attempts;
    for (unsigned attempt = 1; attempt <= attempts; ++attempt) {
      try {
        (void)durable_->release(call.key(), call.owner());
        return;
      } catch (...) {  // the store is still away: once more, then the lease ends the record
        if (attempt < attempts) std::this_thread::sleep_for(core_.options().store_retry_backoff);
      }
    }
  }

  // Whether the durable record of `call` is completed by the call itself (its owner token).
  bool completed_by(const detail::CallState& call) {
    const std::optional<Record> r = durable_->lookup(call.key());
    return r && r->status == Record::Status::kCompleted && r->owner == call.owner().str();
  }

  // Step 4 and the durable store's duplicate answers, shared by both durable modes: the core
  // decides what the fast store does, this guard does it (blocking), then answers.
  template <class R>
  GuardResult<R> after_durable(Call<R>& call, ClaimResult& d, std::optional<R> value) {
    if (detail::is_unstored(d)) {
      // A record whose first attempt ran but could not store its response: never replayed
      // (its reason is no response), never run again.
      release_fast(call);
      auto error = detail::unstored_answer(call.key(), d);
      core_.durable_failed(call.key(), std::make_exception_ptr(error));
      throw error;
    }
    const auto term = detail::fast_term(call.options.retention, d);
    follow_up(call, core_.durable_answered(call, detail::durable_answer(d.status), term),
              d.response, term, detail::origin_of(d, call.owner()));
    if (d.status == ClaimStatus::kClaimed) return executed(call, std::move(value));
    return duplicate<R>(call, d, Source::kDurableStore, core_.durable_source());
  }

  template <class R>
  GuardResult<R> executed(Call<R>& call, std::optional<R> value) {
    GuardResult<R> r = core_.template executed<R>(call, std::move(value));
    notify_waiters();
    return r;
  }

  template <class R>
  // Consumes `c` (its strings move into the result: no copies on the replay path).
  GuardResult<R> duplicate(Call<R>& call, ClaimResult& c, Source source,
                           DuplicateSource dup_source) {
    return core_.template duplicate<R>(call, detail::DuplicateAnswer::from(c), source, dup_source);
  }

  // The fast follow-up the core chose (complete, fill, release or nothing).
  // The record is written for `term` (detail::fast_term); a refill keeps `origin`, what the
  // durable store reported of the record's first attempt (none for a record this call wrote).
  void follow_up(detail::CallState& call, detail::FastNext next, std::string_view response,
                 std::chrono::seconds term, const RecordOrigin& origin) {
    using detail::FastNext;
    if (next == FastNext::kRelease) return release_fast(call);
    try {
      if (next == FastNext::kComplete) {
        next = core_.fast_complete_answered(
            call,
            fast_->complete_claimed(call.key(), call.owner(), call.fast_ticket, response, term));
      }
      if (next == FastNext::kFill) {
        // The fast store lost the record (a durable replay), or our fast claim expired and was
        // taken over (or released) while the durable store decided: the durable answer stands.
        fast_->refill(call.key(), call.fingerprint(), response, term, origin);
        core_.fast_filled(call);
      }
    } catch (const StorageError& e) {
      // The durable store replays from now on; the fast store is refilled by the next duplicate.
      core_.fast_follow_up_failed(call, e);
    }
  }

  // The completion was refused with `error` for good: the durable record is marked failed
  // (kept for the retention, unstored_reason) and the fast claim released, so no retry runs
  // the handler again. If the mark fails too, the record ends with its lease, as before.
  // @return false when the store refused the mark too (the record stays in progress).
  bool mark_unstored(detail::CallState& call, const std::exception_ptr& error) noexcept {
    try {
      if (!durable_->fail(call.key(), call.owner(), detail::unstored_reason(error),
                          call.options.retention)) {
        return true;  // no longer ours: the record is another attempt's
      }
    } catch (...) {
      core_.durable_failed(call.key(), std::current_exception());
      return false;
    }
    release_fast(call);
    notify_waiters();  // waiters of this process get the record's answer now
    return true;
  }

  void release_fast(detail::CallState& call) noexcept {
    if (core_.release_next(call) != detail::FastNext::kRelease) return;
    try {
      fast_->release(call.key(), call.owner());
    } catch (const StorageError& e) {
      // The claim ends with its lease; duplicates answer "in progress" until then.
      core_.fast_follow_up_failed(call, e);
    } catch (...) {
    }
  }

  void handler_failed(detail::CallState& call, const std::exception_ptr& error) {
    release_fast(call);
    core_.handler_failed(call, error);
    notify_waiters();  // the key is free again: a waiter may run it
  }

  void step(Step s, const Key& key) { core_.step(s, key); }
  void note_takeover(const Key& key, std::string_view store) { core_.takeover(key, store); }
  void store_error(const Key& key, StoreRole role, const Error& e) noexcept {
    core_.store_error(key, role, e);
  }
  // Called inside a catch block: reports the durable store's exception in flight.
  void durable_failed(const Key& key) noexcept { core_.durable_failed(key); }

  // --- heartbeat (GuardOptions::heartbeat) ----------------------------------------------------
  // The claims of one running handler, extended by the guard's heartbeat thread.
  struct Beat {
    Beat(const Key& k, const OwnerToken& o, std::chrono::milliseconds l, bool f, bool d)
        : key(k), owner(o), lease(l), fast(f), durable(d) {}
    Key key;  // copies: the caller's variables may change while the handler runs
    OwnerToken owner;
    std::chrono::milliseconds lease;
    bool fast;     // extend the fast claim
    bool durable;  // extend the durable record (two-phase)
    detail::SteadyClock::time_point next{};
  };

  static std::chrono::milliseconds beat_period(std::chrono::milliseconds lease) noexcept {
    return std::max(lease / 3, std::chrono::milliseconds{1});
  }

  // Registers the claims of `call` for the heartbeat while it lives (the handler's run).
  class Beating {
   public:
    Beating(IdempotencyGuard& g, const detail::CallState& call, bool durable_record) : g_(g) {
      if (!call.options.heartbeat) return;
      bool durable = false;
      if constexpr (kHasDurable && detail::has_extend<Durable>::value) durable = durable_record;
      (void)durable_record;
      const bool fast = g.fast_ != nullptr && (call.fast_claimed || call.mode == Mode::kFastOnly);
      if (!fast && !durable) return;
      beat_ = std::make_shared<Beat>(call.key(), call.owner(), call.options.lease, fast, durable);
      beat_->next = detail::SteadyClock::now() + beat_period(call.options.lease);
      g_.start_beating(beat_);
    }
    ~Beating() {
      if (beat_) g_.stop_beating(beat_);
    }
    Beating(const Beating&) = delete;
    Beating& operator=(const Beating&) = delete;

   private:
    IdempotencyGuard& g_;
    std::shared_ptr<Beat> beat_;
  };

  void start_beating(const std::shared_ptr<Beat>& b) {
    std::lock_guard<std::mutex> lock(beat_mutex_);
    beats_.push_back(b);
    if (!beat_thread_.joinable()) beat_thread_ = std::thread([this] { beat_loop(); });
    beat_cv_.notify_all();
  }

  void stop_beating(const std::shared_ptr<Beat>& b) noexcept {
    std::unique_lock<std::mutex> lock(beat_mutex_);
    // An extension of this claim in flight finishes first: none may land after completion.
    beat_cv_.wait(lock, [&] { return beating_ != b.get(); });
    beats_.erase(std::remove(beats_.begin(), beats_.end(), b), beats_.end());
  }

  void beat_loop() {
    std::unique_lock<std::mutex> lock(beat_mutex_);
    while (!beat_stop_) {
      auto now = detail::SteadyClock::now();
      std::shared_ptr<Beat> due;
      auto next = now + std::chrono::seconds{1};
      for (const auto& b : beats_) {
        if (b->next <= now) {
          due = b;
          break;
        }
        next = std::min(next, b->next);
      }
      if (!due) {
        beat_cv_.wait_until(lock, next);
        continue;
      }
      beating_ = due.get();
      lock.unlock();
      beat_once(*due);
      lock.lock();
      beating_ = nullptr;
      due->next = detail::SteadyClock::now() + beat_period(due->lease);
      beat_cv_.notify_all();
    }
  }

  // One extension of `b`'s claims; failures are reported, a lost claim is no longer extended.
  // A lost claim is not reported here: the completion that it refuses reports it (LeaseLost),
  // once; a call whose answer stands without that claim (a transactional call's fast claim)
  // lost nothing it needed.
  void beat_once(Beat& b) noexcept {
    if (b.fast) {
      try {
        if (!fast_->extend(b.key, b.owner, b.lease)) {
          b.fast = false;
        }
      } catch (const UsageError& e) {
        b.fast = false;  // this fast store cannot extend leases
        store_error(b.key, StoreRole::kFast, e);
      } catch (const Error& e) {
        store_error(b.key, StoreRole::kFast, e);
      } catch (...) {
      }
    }
    if constexpr (kHasDurable && detail::has_extend<Durable>::value) {
      if (b.durable) {
        try {
          if (!durable_->extend(b.key, b.owner, b.lease)) b.durable = false;
        } catch (const Error& e) {
          store_error(b.key, StoreRole::kDurable, e);
        } catch (...) {
        }
      }
    }
  }

  FastStore* fast_;
  Durable* durable_;
  detail::GuardCore core_;
  std::atomic<bool> bypass_warned_{false};
  // wait_for_first: calls waiting for a key's first result, woken by completions of this guard.
  std::atomic<int> waiting_{0};
  std::mutex wait_mutex_;
  std::condition_variable wait_cv_;
  std::uint64_t completions_ = 0;  // guarded by wait_mutex_
  // heartbeat: the claims of running handlers, and the thread extending them (started on the
  // first beat; declared last so it stops before the rest is destroyed).
  std::mutex beat_mutex_;
  std::condition_variable beat_cv_;
  std::vector<std::shared_ptr<Beat>> beats_;
  const Beat* beating_ = nullptr;  // the claim being extended right now
  bool beat_stop_ = false;
  std::thread beat_thread_;
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
