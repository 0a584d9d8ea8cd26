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

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "idem/codec.hpp"
#include "idem/detail/guard_core.hpp"
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
using stored_t = std::conditional_t<std::is_void_v<R>, Unit, std::decay_t<R>>;

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
    return std::invoke(fn, args...);
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
  static constexpr bool kHasDurable = !std::is_same_v<Durable, NoDurableStore>;
  // A durable store that does not fit the contract fails here, naming the missing member.
  static_assert(detail::check_durable_store<Durable>());

  /// Fast store in front of a durable store (the production shape).
  IdempotencyGuard(FastStore& fast, Durable& durable, GuardOptions options = {})
      : fast_(&fast), durable_(&durable), core_(true, std::move(options), kWho) {}

  /// Durable store only: correct, one durable round trip per call.
  template <class D = Durable,
            std::enable_if_t<std::is_same_v<D, Durable> && !std::is_base_of_v<FastStore, D> &&
                                 !std::is_same_v<D, NoDurableStore>,
                             int> = 0>
  explicit IdempotencyGuard(D& durable, GuardOptions options = {})
      : fast_(nullptr), durable_(&durable), core_(false, std::move(options), kWho) {}

  /// Fast store only: best effort (see the file comment).
  template <class D = Durable, std::enable_if_t<std::is_same_v<D, NoDurableStore>, int> = 0>
  explicit IdempotencyGuard(FastStore& fast, GuardOptions options = {})
      : fast_(&fast), durable_(nullptr), core_(true, std::move(options), kWho) {}

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
  auto run(const Key& key, std::string_view fingerprint, Fn&& handler)
      -> GuardResult<typename detail::response_type<std::decay_t<Fn>,
                                                    detail::transaction_t<Durable>>::type> {
    using Tx = detail::transaction_t<Durable>;
    using R = typename detail::response_type<std::decay_t<Fn>, Tx>::type;
    detail::CallState call{key, fingerprint, mode_of<Fn>(), core_.call_options(),
                           core_.observed()};
    core_.start(call);

    // 2. Fast store claim.
    if (fast_ != nullptr) {
      auto t0 = call.now();
      try {
        ClaimResult c = fast_->claim(key, fingerprint, call.owner(), call.options.lease);
        call.fast_claim = call.since(t0);
        if (!core_.fast_claim_answered(call, c)) {
          return duplicate<R>(call, c, Source::kFastStore, DuplicateSource::kFastStore);
        }
      } catch (const StorageError& e) {
        call.fast_claim = call.since(t0);
        core_.fast_claim_failed(call, e);
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

  /// Convenience overload: builds the key from scope and id. @throws idem::InvalidKey.
  template <class Fn>
  auto run(std::string_view scope, std::string_view id, std::string_view fingerprint,
           Fn&& handler) {
    return run(Key::make(scope, id), fingerprint, std::forward<Fn>(handler));
  }

  /// One call whose steps a caller ran itself, for a whole batch at once
  /// (IdempotentConsumer::consume_batch). See report().
  struct ReportedCall {
    ReportedCall(const Key& k, Outcome o, Source s) noexcept : key(k), outcome(o), source(s) {}
    const Key& key;
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
    core_.count_call(c.fast_claimed, c.degraded);
    if (c.source == Source::kFastStore) core_.count_fast_hit();
    if (c.source == Source::kDurableStore) core_.count_durable_conflict();
    core_.count_outcome(c.outcome);
    Observer* o = core_.options().observer.get();
    if (o == nullptr) return;
    if (c.outcome != Outcome::kExecuted) {
      o->on_duplicate(DuplicateEvent{c.key, c.outcome,
                                     c.source == Source::kFastStore ? DuplicateSource::kFastStore
                                                                    : core_.durable_source(),
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
    core_.count_call(c.fast_claimed, c.degraded);
    core_.handler_error(c.key);
  }
  /// A batch caller's durable store took over an expired lease.
  void report_takeover(const Key& key, std::string_view store) noexcept {
    core_.takeover(key, store);
  }
  /// The fast store failed for a batch of `calls` calls (`key`: one of its keys): a burst of
  /// failures begins (on_fast_store_down once). Count the calls with ReportedCall::degraded.
  void report_fast_failure(const Key& key, const Error& e, std::uint64_t calls) noexcept {
    core_.fast_burst(key, e, calls);
  }
  /// The fast store answered a batch: closes a burst of failures (on_fast_store_recovered).
  void report_fast_ok() noexcept { core_.fast_ok(); }
  /// A fast-store record was rewritten from the durable store for a batch call.
  void report_fast_refill() noexcept { core_.count_refill(); }
  /// Whether an observer listens (batch callers time their phases only then).
  bool observed() const noexcept { return core_.observed(); }

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
  using Call = detail::CallState;

  template <class Fn>
  static constexpr Mode mode_of() noexcept {
    if constexpr (!kHasDurable) {
      return Mode::kFastOnly;
    } else if constexpr (detail::kTakesTransaction<std::decay_t<Fn>,
                                                   detail::transaction_t<Durable>>) {
      return Mode::kTransactional;
    } else {
      return Mode::kTwoPhase;
    }
  }

  template <class R, class Fn>
  GuardResult<R> run_fast_only(Call& call, Fn& handler) {
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
    if (!fast_->complete(call.key(), call.owner(), bytes, call.options.retention)) {
      throw core_.lease_lost(call, "fast");
    }
    return core_.template executed<R>(call, std::move(value));
  }

  template <class R, class Fn>
  GuardResult<R> run_transactional(Call& call, Fn& handler) {
    std::optional<R> value;
    std::chrono::nanoseconds handler_time{0};
    bool handler_threw = false;
    auto t0 = call.now();
    TransactionalResult d;
    try {
      auto body = [&](Transaction& tx) -> std::string {
        auto h0 = call.now();
        value.reset();  // the store may retry the transaction (serialization failure)
        try {
          core_.step(Step::kDurableClaimed, call.key());
          value.emplace(detail::invoke_stored<R>(handler, tx));
          core_.step(Step::kHandlerReturned, call.key());
        } catch (...) {
          handler_time += call.since(h0);
          handler_threw = true;
          throw;
        }
        handler_time += call.since(h0);
        return Codec<R>::encode(*value);
      };
      d = durable_->run_transactional(call.key(), call.fingerprint(), call.owner(),
                                      call.options.retention, body, call.hint());
    } catch (...) {
      // The transaction was rolled back (or, for OutcomeUnknown, may have committed: then the
      // durable record replays it to the retry). Either way the fast claim must not block the
      // retry for a whole lease.
      call.handler = handler_time;
      call.durable = call.since(t0) - handler_time;
      if (handler_threw) {
        handler_failed(call);
      } else {
        release_fast(call);
      }
      throw;
    }
    call.handler = handler_time;
    call.durable = call.since(t0) - handler_time;
    if (d.status == TransactionalStatus::kCommitted) {
      if (d.took_over) core_.takeover(call.key(), "durable");
      core_.step(Step::kDurableCommitted, call.key());
    }
    ClaimResult c = detail::claim_of(d);
    return after_durable<R>(call, c, std::move(value));
  }

  template <class R, class Fn>
  GuardResult<R> run_two_phase(Call& call, Fn& handler) {
    auto t0 = call.now();
    ClaimResult d;
    try {
      d = durable_->begin(call.key(), call.fingerprint(), call.owner(), call.options.lease,
                          call.hint());
    } catch (...) {
      call.durable = call.since(t0);
      release_fast(call);
      throw;
    }
    call.durable = call.since(t0);
    if (d.status != ClaimStatus::kClaimed) {
      return after_durable<R>(call, d, std::nullopt);
    }
    if (d.took_over) core_.takeover(call.key(), "durable");

    std::optional<R> value;
    auto h0 = call.now();
    try {
      core_.step(Step::kDurableClaimed, call.key());
      value.emplace(detail::invoke_stored<R>(handler));
      core_.step(Step::kHandlerReturned, call.key());
    } catch (...) {
      call.handler = call.since(h0);
      // Release the durable claim first: once it is gone a retry may run at once.
      try {
        durable_->release(call.key(), call.owner());
      } catch (...) {
        // The record stays in progress until its lease ends; a retry then takes over.
      }
      handler_failed(call);
      throw;
    }
    call.handler = call.since(h0);
    std::string bytes = Codec<R>::encode(*value);
    auto c0 = call.now();
    // If this throws, the durable record stays in progress (owned by us) until the lease ends,
    // and the fast claim is kept too, so duplicates answer "in progress" meanwhile.
    bool completed = durable_->complete(call.key(), call.owner(), bytes, call.options.retention);
    call.durable += call.since(c0);
    if (!completed) {
      release_fast(call);
      throw core_.lease_lost(call, "durable");
    }
    core_.step(Step::kDurableCommitted, call.key());
    d.status = ClaimStatus::kClaimed;
    d.response = std::move(bytes);
    return after_durable<R>(call, d, std::move(value));
  }

  // Step 4 and the durable store's duplicate answers, shared by both durable modes: the core
  // says what the fast store does, this guard does it (blocking), then answers.
  template <class R>
  GuardResult<R> after_durable(Call& call, ClaimResult& d, std::optional<R> value) {
    follow_up(call, core_.durable_answered(call, detail::durable_answer(d.status)), d.response);
    if (d.status == ClaimStatus::kClaimed) return core_.template executed<R>(call, std::move(value));
    return duplicate<R>(call, d, Source::kDurableStore, core_.durable_source());
  }

  template <class R>
  // Consumes `c` (its strings move into the result: no copies on the replay path).
  GuardResult<R> duplicate(Call& call, ClaimResult& c, Source source, DuplicateSource dup_source) {
    return core_.template duplicate<R>(call, detail::DuplicateAnswer::from(c), source, dup_source);
  }

  void follow_up(Call& call, detail::FastNext next, std::string_view response) {
    using detail::FastNext;
    if (next == FastNext::kRelease) return release_fast(call);
    try {
      if (next == FastNext::kComplete) {
        next = core_.fast_complete_answered(
            call, fast_->complete(call.key(), call.owner(), response, call.options.retention));
      }
      if (next == FastNext::kFill) {
        fast_->fill(call.key(), call.fingerprint(), response, call.options.retention);
        core_.fast_filled(call);
      }
    } catch (const StorageError& e) {
      // The durable store replays from now on; the fast store is refilled by the next duplicate.
      core_.fast_follow_up_failed(call, e);
    }
  }

  void release_fast(Call& call) noexcept {
    if (core_.release_next(call) != detail::FastNext::kRelease) return;
    try {
      fast_->release(call.key(), call.owner());
    } catch (const StorageError& e) {
      // The claim ends with its lease; duplicates answer "in progress" until then.
      core_.fast_follow_up_failed(call, e);
    } catch (...) {
    }
  }

  void handler_failed(Call& call) {
    release_fast(call);
    core_.handler_failed(call);
  }

  FastStore* fast_;
  Durable* durable_;
  detail::GuardCore core_;
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
