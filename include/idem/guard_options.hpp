// SPDX-License-Identifier: MIT
// The options of a guard (idem::GuardOptions, idem::CallOptions) and the protocol steps a step
// hook sees.
//
// File: guard_options.hpp (guard.hpp includes it; the synchronous and the asynchronous guard
// take these options)
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>

#include "idem/key.hpp"
#include "idem/observer.hpp"
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
    case Step::kFastClaimed:
      return "fast_claimed";
    case Step::kDurableClaimed:
      return "durable_claimed";
    case Step::kHandlerReturned:
      return "handler_returned";
    case Step::kDurableCommitted:
      return "durable_committed";
    case Step::kFastCompleted:
      return "fast_completed";
  }
  return "unknown";
}

/// Options of an IdempotencyGuard.
struct GuardOptions {
  /// How long an in-progress claim is honoured before another attempt may take it over.
  /// Choose it longer than the slowest handler. Positive, at most kMaxTerm (100 years).
  std::chrono::milliseconds lease = kDefaultLease;
  /// How long a completed record (and its response) is kept. Positive, at most kMaxTerm (100
  /// years: pass kMaxTerm for "keep forever").
  std::chrono::seconds retention = kDefaultRetention;
  /// Receives events for logs and metrics (null means none). Shared so adapters outlive calls.
  std::shared_ptr<Observer> observer;
  /// The label of duplicates the durable store catches (kMqRecord for consume records).
  DuplicateSource durable_source = DuplicateSource::kUniqueIndex;
  /// Called at each protocol step of a call that runs the handler (empty means none). For fault
  /// injection in tests, which kill the process inside it: the claims a killed process leaves
  /// behind end with their lease, as after a crash. Whatever it throws propagates; thrown at
  /// Step::kDurableClaimed or kHandlerReturned it counts as the handler's exception (the claim
  /// is released, as for a failed handler).
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
  /// waiter costs a claim per backoff step, not a busy loop. The wait counts from the call's
  /// start; the waiting call is one call (GuardStats, the Observer) with the answer it returns.
  /// Per call: CallOptions. Not negative (the guard refuses it with a UsageError).
  std::chrono::milliseconds wait_for_result{0};
  /// Transient failures (idem::StorageUnavailable, StorageTimeout, OutcomeUnknown) of the
  /// durable store's begin, complete, release (after a handler failed) and run_transactional
  /// are tried again up to this many
  /// times in all (1: no retry), after a backoff with full jitter between
  /// `store_retry_backoff` and 8 times it. Safe because the call keeps its owner token: a claim
  /// or commit that was applied before the failure is recognised as this attempt's own (a
  /// transactional retry then replays what committed). A handler's own exceptions are never
  /// retried, and two-phase handlers never run twice. Counted in GuardStats::store_retries.
  /// At least 1 (0 is a UsageError).
  unsigned store_attempts = 1;
  /// The first backoff of store_attempts. Not negative (0: no pause).
  std::chrono::milliseconds store_retry_backoff{20};
  /// Lease keep-alive for long handlers: while a handler runs, one thread of the guard extends
  /// its claims every lease/3 (FastStore::extend; in two-phase mode also the durable record,
  /// where the durable store has `bool extend(const Key&, const OwnerToken&,
  /// std::chrono::milliseconds)`: SqliteStore and PostgresStore do; in transactional mode the
  /// open transaction holds the record). A failed extension reaches the observer
  /// (on_store_error) and is tried again at the next beat; a claim found lost (taken over after
  /// its lease ended) is reported (on_lease_lost) and no longer extended: the attempt is fenced,
  /// its completion throws LeaseLost. Per call: CallOptions::heartbeat.
  bool heartbeat = false;
  /// After the fast store failed, IdempotencyGuard::run calls (of a guard with a durable store)
  /// skip it for this long: they go to the durable store alone (degraded, counted in
  /// GuardStats::degraded, as when the fast store fails; the durable store's answer is always
  /// right), then the first call after the pause tries the fast store again. While the fast store
  /// is down this saves every call the failed attempt (a connect attempt or refusal, an exception,
  /// the observer's on_store_error); the price is that calls keep skipping it for up to this long
  /// after it is back. 0 (the default): every call tries the fast store. A guard without a durable
  /// store never skips it (its calls fail instead). Not negative.
  std::chrono::milliseconds fast_store_retry_after{0};
};

/// What one call may set differently from the guard's options (a refund keeps its record 30
/// days, a cart 10 minutes). Unset fields take the GuardOptions value.
struct CallOptions {
  /// GuardOptions::lease for this call. Positive, at most kMaxTerm.
  std::optional<std::chrono::milliseconds> lease;
  /// GuardOptions::retention for this call. Positive, at most kMaxTerm.
  std::optional<std::chrono::seconds> retention;
  /// GuardOptions::wait_for_result for this call (0: answer kInProgress at once).
  std::optional<std::chrono::milliseconds> wait_for_result;
  /// GuardOptions::heartbeat for this call (a handler that may outlive its lease).
  std::optional<bool> heartbeat;
  /// The key is very likely new (a message's first delivery, a request id the caller just
  /// made): the durable store claims at once instead of first reading for a completed duplicate
  /// (PostgreSQL, MySQL and SQLite read first when no fast store granted the claim). Never
  /// changes an answer: a duplicate is still found by the claim, in a few more statements.
  /// IdempotentConsumer::consume sets it for a first delivery (delivery_count 1).
  bool likely_new = false;
  /// The encoded response the handler will return, when it is known before the handler runs
  /// (a handler whose answer is fixed, such as IdempotentConsumer::consume's). In transactional
  /// mode the durable store may then write the record completed when it claims and leave out the
  /// completion statement (one statement and one round trip fewer per first execution on
  /// PostgreSQL, MySQL and SQLite; DurableHint::expected_response). A response that differs is
  /// stored as usual, at the usual cost: this never changes an answer. The bytes must outlive
  /// the call.
  std::optional<std::string_view> expected_response = std::nullopt;
};

}  // namespace idem
