// SPDX-License-Identifier: MIT
// What the guard tells the world: always-on counters (GuardStats) and an optional Observer
// that logging and metrics adapters implement.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "idem/clock.hpp"
#include "idem/key.hpp"
#include "idem/outcome.hpp"

namespace idem {

/// Where a duplicate was recognised (for "why are there two identical transactions?").
enum class DuplicateSource {
  kFastStore,     ///< the fast store's claim (Redis SET NX / memory)
  kUniqueIndex,   ///< the durable store's unique key (api_idempotency)
  kStateMachine,  ///< a conditional state transition found the target state already there
  kMqRecord,      ///< the MQ consume record (mq_consume_record)
};

/// Stable name: fast_store, unique_index, state_machine, mq_record.
constexpr std::string_view duplicate_source_name(DuplicateSource s) noexcept {
  switch (s) {
    case DuplicateSource::kFastStore: return "fast_store";
    case DuplicateSource::kUniqueIndex: return "unique_index";
    case DuplicateSource::kStateMachine: return "state_machine";
    case DuplicateSource::kMqRecord: return "mq_record";
  }
  return "unknown";
}

/// How the guard ran a call.
enum class Mode {
  kFastOnly,       ///< fast store only (best effort)
  kTransactional,  ///< handler inside the durable store's transaction
  kTwoPhase,       ///< durable in-progress record, handler outside, then complete
};

/// Stable name: fast_only, transactional, two_phase.
constexpr std::string_view mode_name(Mode m) noexcept {
  switch (m) {
    case Mode::kFastOnly: return "fast_only";
    case Mode::kTransactional: return "transactional";
    case Mode::kTwoPhase: return "two_phase";
  }
  return "unknown";
}

/// A duplicate was detected: logged once per detection.
struct DuplicateEvent {
  const Key& key;           ///< the duplicated key
  Outcome outcome;          ///< kReplayed, kInProgress or kFingerprintMismatch
  DuplicateSource source;   ///< who recognised it (fast store, unique index, state machine, ...)
  TimePoint first_seen;     ///< when the first attempt created the record (epoch if unknown)
  std::string_view holder;  ///< the first attempt's owner token (empty if unknown)
};

/// The role a store plays in a guard.
enum class StoreRole {
  kFast,     ///< the fast store (claim at the entrance)
  kDurable,  ///< the durable store (the relational backstop)
};

/// Stable name: fast, durable.
constexpr std::string_view store_role_name(StoreRole r) noexcept {
  switch (r) {
    case StoreRole::kFast: return "fast";
    case StoreRole::kDurable: return "durable";
  }
  return "unknown";
}

/// A store failed during a call: reported for every failure (a fast-store outage also raises
/// on_fast_store_down once per burst), whether the call then went on degraded or threw.
struct StoreErrorEvent {
  /// The call's key; null when the failure was outside a keyed call: an HTTP pass-through's
  /// plain transaction or its handler's own storage failure (store "handler" when the handler
  /// ran outside the durable store's transaction).
  const Key* key;
  /// Which of the guard's stores failed (fast or durable).
  StoreRole role;
  /// The store's name() ("redis", "postgres", "sqlite", "memory", ...).
  std::string_view store;
  /// The failure: error.code() is its idem::errc, error.what() the backend's message.
  const Error& error;
};

/// Why a request was refused before (or instead of) running its handler. Stable names, used
/// as the `reason` label of idem_rejected_requests_total.
enum class RejectReason {
  kMissingKey,           ///< a required Idempotency-Key was not sent (400)
  kInvalidKey,           ///< malformed, repeated or over-long key (400)
  kPayloadTooLarge,      ///< the body is over the endpoint's limit (413)
  kFingerprintMismatch,  ///< the key was used with another payload (422)
};

/// Stable name: missing_key, invalid_key, payload_too_large, fingerprint_mismatch.
constexpr std::string_view reject_reason_name(RejectReason r) noexcept {
  switch (r) {
    case RejectReason::kMissingKey: return "missing_key";
    case RejectReason::kInvalidKey: return "invalid_key";
    case RejectReason::kPayloadTooLarge: return "payload_too_large";
    case RejectReason::kFingerprintMismatch: return "fingerprint_mismatch";
  }
  return "unknown";
}

/// A request an endpoint refused with a client error.
struct RejectedRequestEvent {
  /// The endpoint's scope ("http.orders.create"); empty when the server library refused the
  /// request before any endpoint saw it.
  std::string_view scope;
  /// Why it was refused.
  RejectReason reason;
  /// The status answered (400, 413, 422).
  int status;
};

/// Why a request ran its handler with no idempotency store I/O at all.
enum class PassthroughReason {
  kNoKey,     ///< the key is optional and the request sent none
  kMethod,    ///< the method is not one the endpoint guards (GET, PUT, ...)
  kDisabled,  ///< the guard's kill switch is on
};

/// Stable name: no_key, method, disabled.
constexpr std::string_view passthrough_reason_name(PassthroughReason r) noexcept {
  switch (r) {
    case PassthroughReason::kNoKey: return "no_key";
    case PassthroughReason::kMethod: return "method";
    case PassthroughReason::kDisabled: return "disabled";
  }
  return "unknown";
}

/// A request or call that ran its handler without idempotency (no record, no store I/O).
struct PassthroughEvent {
  /// The endpoint's or the key's scope.
  std::string_view scope;
  /// Why no idempotency applied.
  PassthroughReason reason;
};

/// A guarded call finished with an outcome (not called when it threw).
struct CallEvent {
  const Key& key;   ///< the call's key
  Outcome outcome;  ///< how it ended
  Mode mode;        ///< transactional, two-phase or fast-only
  Source source;    ///< who answered: the handler, the fast store or the durable store
  bool degraded;    ///< the fast store failed during this call (the durable store decided)
  std::chrono::nanoseconds fast_claim{0};  ///< time in the fast store's claim
  std::chrono::nanoseconds durable{0};     ///< time in the durable store, handler excluded
  std::chrono::nanoseconds handler{0};     ///< time in the handler
  std::chrono::nanoseconds total{0};       ///< the whole call
  /// True when the fast store granted this call's claim (for a fast-store claim counter).
  bool fast_claimed = false;
};

/// A message its broker delivered again (IdempotentConsumer: a delivery count above 1).
struct RedeliveryEvent {
  /// The consumer group (the records' scope).
  std::string_view group;
  /// The message id as delivered (it may not be a valid key id).
  std::string_view message_id;
  /// The broker's delivery count, this delivery included (2 or more).
  std::uint32_t delivery_count;
};

/// Receives the guard's events. Every method has an empty default; override what you need.
/// Methods are called on the calling thread and must be thread-safe and must not throw.
class Observer {
 public:
  virtual ~Observer() = default;
  /// Every call that ended with an outcome.
  virtual void on_call(const CallEvent&) noexcept {}
  /// Every duplicate detected, with its source.
  virtual void on_duplicate(const DuplicateEvent&) noexcept {}
  /// The fast store failed after having worked: once per burst of failures.
  virtual void on_fast_store_down(const Key&, const Error&) noexcept {}
  /// The fast store works again after a burst of `failed_calls` failures.
  virtual void on_fast_store_recovered(std::uint64_t /*failed_calls*/) noexcept {}
  /// An expired lease of another attempt was taken over (`store`: "fast" or "durable").
  virtual void on_takeover(const Key&, std::string_view /*store*/) noexcept {}
  /// This attempt's lease was lost before it completed (`store`: "fast" or "durable").
  virtual void on_lease_lost(const Key&, std::string_view /*store*/) noexcept {}
  /// The handler threw; the claim was released and the exception rethrown.
  virtual void on_handler_error(const Key&) noexcept {}
  /// The same, with the handler's exception (to log its cause): by default calls
  /// on_handler_error(key). Override one of the two.
  virtual void on_handler_exception(const Key& key, const std::exception_ptr& /*error*/) noexcept {
    on_handler_error(key);
  }
  /// The durable store's transaction was retried: by the store (serialization failure,
  /// deadlock; where its options' on_retry calls this, reason the SQLSTATE) or by the guard
  /// after a transient failure (GuardOptions::store_attempts; reason the error's errc name,
  /// e.g. "store_unavailable").
  virtual void on_durable_retry(const Key&, std::string_view /*reason*/) noexcept {}
  /// A store failed (every failure; see StoreErrorEvent).
  virtual void on_store_error(const StoreErrorEvent&) noexcept {}
  /// An endpoint refused a request with a client error (400, 413, 422).
  virtual void on_rejected_request(const RejectedRequestEvent&) noexcept {}
  /// A request or call ran its handler with no idempotency store I/O.
  virtual void on_passthrough(const PassthroughEvent&) noexcept {}
  /// An IdempotentConsumer received a redelivery (told to its guard's observer).
  virtual void on_redelivery(const RedeliveryEvent&) noexcept {}
};

/// Fans events out to several observers (e.g. a logger and Prometheus).
class ObserverList final : public Observer {
 public:
  /// Adds an observer; not thread-safe against concurrent calls: add before use.
  void add(std::shared_ptr<Observer> o) { list_.push_back(std::move(o)); }
  void on_call(const CallEvent& e) noexcept override {
    for (auto& o : list_) o->on_call(e);
  }
  void on_duplicate(const DuplicateEvent& e) noexcept override {
    for (auto& o : list_) o->on_duplicate(e);
  }
  void on_fast_store_down(const Key& k, const Error& e) noexcept override {
    for (auto& o : list_) o->on_fast_store_down(k, e);
  }
  void on_fast_store_recovered(std::uint64_t n) noexcept override {
    for (auto& o : list_) o->on_fast_store_recovered(n);
  }
  void on_takeover(const Key& k, std::string_view s) noexcept override {
    for (auto& o : list_) o->on_takeover(k, s);
  }
  void on_lease_lost(const Key& k, std::string_view s) noexcept override {
    for (auto& o : list_) o->on_lease_lost(k, s);
  }
  void on_handler_error(const Key& k) noexcept override {
    for (auto& o : list_) o->on_handler_error(k);
  }
  void on_handler_exception(const Key& k, const std::exception_ptr& e) noexcept override {
    for (auto& o : list_) o->on_handler_exception(k, e);
  }
  void on_durable_retry(const Key& k, std::string_view r) noexcept override {
    for (auto& o : list_) o->on_durable_retry(k, r);
  }
  void on_store_error(const StoreErrorEvent& e) noexcept override {
    for (auto& o : list_) o->on_store_error(e);
  }
  void on_rejected_request(const RejectedRequestEvent& e) noexcept override {
    for (auto& o : list_) o->on_rejected_request(e);
  }
  void on_passthrough(const PassthroughEvent& e) noexcept override {
    for (auto& o : list_) o->on_passthrough(e);
  }
  void on_redelivery(const RedeliveryEvent& e) noexcept override {
    for (auto& o : list_) o->on_redelivery(e);
  }

 private:
  std::vector<std::shared_ptr<Observer>> list_;
};

/// A snapshot of GuardStats.
struct GuardStatsSnapshot {
  /// Calls of run() (and calls reported by batches; a call that waited for the first result
  /// counts once). A call is counted once more in bypassed, or as one of executed, replayed,
  /// in_progress, mismatched or handler_errors, or not at all when it ended with an error
  /// thrown to its caller (a store's StorageError, LeaseLost, ...): Observer::on_store_error
  /// and Observer::on_lease_lost report those.
  std::uint64_t calls = 0;
  /// Calls that ran the handler to completion (Outcome::kExecuted).
  std::uint64_t executed = 0;
  /// Duplicates answered with the stored response (Outcome::kReplayed).
  std::uint64_t replayed = 0;
  /// Duplicates answered "in progress" (Outcome::kInProgress).
  std::uint64_t in_progress = 0;
  /// Keys reused with another payload (Outcome::kFingerprintMismatch).
  std::uint64_t mismatched = 0;
  /// Calls whose handler threw (rolled back and released).
  std::uint64_t handler_errors = 0;
  /// Duplicates the fast store recognised (busy, done or mismatch at the claim).
  std::uint64_t fast_hits = 0;
  /// Claims the fast store granted.
  std::uint64_t fast_claims = 0;
  /// Duplicates the durable store recognised (the unique key caught them).
  std::uint64_t durable_conflicts = 0;
  /// Calls in which the fast store failed (the durable store decided alone).
  std::uint64_t degraded = 0;
  /// Claims that took over a record whose lease had expired.
  std::uint64_t takeovers = 0;
  /// Attempts whose completion was refused: another attempt took the key over (LeaseLost).
  std::uint64_t leases_lost = 0;
  /// Fast-store records rewritten: from the durable store, or (fast-only) a completion's
  /// response written back where the fast store had lost the call's record.
  std::uint64_t fast_refills = 0;
  /// Durable-store operations run again after a transient failure (GuardOptions::store_retry).
  std::uint64_t store_retries = 0;
  /// Calls that found the key in progress and waited for the first result
  /// (GuardOptions::wait_for_result, CallOptions::wait_for_result).
  std::uint64_t waits = 0;
  /// Calls run without any idempotency because GuardOptions::bypass was on.
  std::uint64_t bypassed = 0;

  /// Share of detected duplicates that the fast store stopped (0 when there were none).
  double fast_hit_rate() const noexcept {
    auto dup = fast_hits + durable_conflicts;
    return dup == 0 ? 0.0 : static_cast<double>(fast_hits) / static_cast<double>(dup);
  }
};

/// Always-on, lock-free counters of one guard.
class GuardStats {
 public:
  ///@{
  /// The counters, as in GuardStatsSnapshot.
  std::atomic<std::uint64_t> calls{0}, executed{0}, replayed{0}, in_progress{0}, mismatched{0},
      handler_errors{0}, fast_hits{0}, fast_claims{0}, durable_conflicts{0}, degraded{0},
      takeovers{0}, leases_lost{0}, fast_refills{0}, store_retries{0}, waits{0}, bypassed{0};
  ///@}

  /// A consistent-enough copy (each counter read once, relaxed).
  GuardStatsSnapshot snapshot() const noexcept {
    GuardStatsSnapshot s;
    s.calls = calls.load(std::memory_order_relaxed);
    s.executed = executed.load(std::memory_order_relaxed);
    s.replayed = replayed.load(std::memory_order_relaxed);
    s.in_progress = in_progress.load(std::memory_order_relaxed);
    s.mismatched = mismatched.load(std::memory_order_relaxed);
    s.handler_errors = handler_errors.load(std::memory_order_relaxed);
    s.fast_hits = fast_hits.load(std::memory_order_relaxed);
    s.fast_claims = fast_claims.load(std::memory_order_relaxed);
    s.durable_conflicts = durable_conflicts.load(std::memory_order_relaxed);
    s.degraded = degraded.load(std::memory_order_relaxed);
    s.takeovers = takeovers.load(std::memory_order_relaxed);
    s.leases_lost = leases_lost.load(std::memory_order_relaxed);
    s.fast_refills = fast_refills.load(std::memory_order_relaxed);
    s.store_retries = store_retries.load(std::memory_order_relaxed);
    s.waits = waits.load(std::memory_order_relaxed);
    s.bypassed = bypassed.load(std::memory_order_relaxed);
    return s;
  }
};

}  // namespace idem
