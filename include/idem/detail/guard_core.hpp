// SPDX-License-Identifier: MIT
// The guard's decisions, written once for every driver of the protocol.
//
// File: detail/guard_core.hpp (internal: idem::IdempotencyGuard and idem::async::AsyncGuard
// include it, services do not)
//
// A driver performs the round trips (a blocking call, or an asynchronous one whose completion
// comes back later); `GuardCore` decides what each answer means and what comes next, keeps the
// counters (GuardStats) and tells the Observer. The state of one call lives in a `CallState`
// that the driver passes to every step explicitly (no thread-locals), so the steps of one call
// may run on different threads, one after another.
//
//   step                         driver calls                 the core answers / records
//   call begins                  start(c)                     calls counted, clock started
//   fast claim answered          fast_claim_answered(c, r)    true: claimed (go on to the
//                                                             durable store); false: a
//                                                             duplicate (answer it)
//   fast claim failed            fast_claim_failed(c, e)      degraded (durable store alone)
//   durable store decided        durable_answered(c, a)       the fast follow-up: kComplete,
//                                                             kFill, kRelease or kNothing
//   fast complete answered       fast_complete_answered(c,ok) kFill when the claim was lost
//   fast record filled           fast_filled(c)               refill counted
//   fast follow-up failed        fast_follow_up_failed(c, e)  the burst of failures
//   handler threw                handler_failed(c, e)         counted; then release (release_next)
//   lease lost                   lease_lost(c, store)         the idem::LeaseLost to throw
//   the answer                   executed<R>(c, v) /          the GuardResult, counted and
//                                duplicate<R>(c, a, ...)      reported (on_duplicate, on_call)
//
// The record's own rules (what a found record means) are the stores' rulebook
// (record_rules.hpp); these are the guard's: which store follows which, and what is counted.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/clock.hpp"
#include "idem/codec.hpp"
#include "idem/durable_store.hpp"
#include "idem/errors.hpp"
#include "idem/guard_options.hpp"
#include "idem/key.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"
#include "idem/store.hpp"

namespace idem::detail {

using SteadyClock = std::chrono::steady_clock;
inline std::chrono::nanoseconds since(SteadyClock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now() - t);
}

/// The lease, retention and heartbeat one call runs with (copied from GuardOptions at its
/// start, or from its CallOptions).
struct CallTerms {
  std::chrono::milliseconds lease = kDefaultLease;
  std::chrono::seconds retention = kDefaultRetention;
  bool heartbeat = false;
  bool likely_new = false;  // CallOptions::likely_new
  // CallOptions::expected_response
  std::optional<std::string_view> expected_response = std::nullopt;
};

/// A call that waits for the first attempt's result (GuardOptions::wait_for_result): its
/// attempts share this. The call is counted and reported once, with its final answer: an
/// attempt answered kInProgress before `until` is neither counted nor reported (`deferred`
/// says so, and the driver asks again); the first attempt's start is the call's.
struct WaitTurn {
  explicit WaitTurn(SteadyClock::time_point u) noexcept : until(u) {}
  SteadyClock::time_point until;  ///< after this, a kInProgress answer is the call's answer
  SteadyClock::time_point began{};
  unsigned attempts = 0;
  bool deferred = false;  ///< the last attempt's kInProgress answer was held back
  bool degraded = false;  ///< an attempt went on without the fast store (counted once)
};

/// The state of one guarded call, passed to every GuardCore step.
///
/// The key and fingerprint are views of the caller's (a blocking call outlives its steps);
/// own() copies them for a call that outlives its caller's arguments (an asynchronous one).
class CallState {
 public:
  CallState(const Key& key, std::string_view fingerprint, Mode m, CallTerms o, bool t,
            OwnerToken owner = OwnerToken::generate())
      : mode(m),
        options(o),
        timed(t),
        key_(&key),
        fingerprint_(fingerprint),
        owner_(std::move(owner)) {}
  CallState(const CallState&) = delete;
  CallState& operator=(const CallState&) = delete;

  /// The call's key.
  const Key& key() const noexcept { return key_copy_ ? *key_copy_ : *key_; }
  /// The payload's fingerprint ("" is one like any other: see IdempotencyGuard::run).
  std::string_view fingerprint() const noexcept {
    return owned_ ? std::string_view(fingerprint_copy_) : fingerprint_;
  }
  /// This attempt's owner token.
  const OwnerToken& owner() const noexcept { return owner_; }
  /// Copies the key and fingerprint into the call (idempotent).
  void own() {
    if (owned_) return;
    key_copy_.emplace(*key_);
    fingerprint_copy_.assign(fingerprint_.data(), fingerprint_.size());
    owned_ = true;
  }

  Mode mode = Mode::kFastOnly;
  CallTerms options;
  bool fast_claimed = false;  ///< the fast store granted this call's claim
  bool degraded = false;      ///< the fast store failed for this call
  ClaimTicket fast_ticket;    ///< the fast claim's ticket, for its completion
  WaitTurn* wait = nullptr;   ///< a waiting call's turn (null: the call does not wait)
  // Timings feed only the observer's CallEvent: without an observer the clock is not read.
  bool timed = false;
  SteadyClock::time_point start{};
  std::chrono::nanoseconds fast_claim{0};
  std::chrono::nanoseconds durable{0};
  std::chrono::nanoseconds handler{0};

  /// Now, or epoch for an untimed call.
  SteadyClock::time_point now() const noexcept {
    return timed ? SteadyClock::now() : SteadyClock::time_point{};
  }
  /// The time since `t`, or zero for an untimed call.
  std::chrono::nanoseconds since(SteadyClock::time_point t) const noexcept {
    return timed ? detail::since(t) : std::chrono::nanoseconds{0};
  }
  /// What the durable store may skip for this call (DurableHint).
  DurableHint hint() const noexcept {
    DurableHint h;
    h.fast_claimed = fast_claimed;
    h.likely_new = options.likely_new;
    h.expected_response = options.expected_response;
    return h;
  }

 private:
  const Key* key_;
  std::optional<Key> key_copy_;
  std::string_view fingerprint_;
  std::string fingerprint_copy_;
  bool owned_ = false;
  OwnerToken owner_;
};

/// What the fast store does after the durable store decided (or after a fast complete).
enum class FastNext {
  kNothing,   ///< nothing: answer
  kComplete,  ///< complete this call's fast claim with the response
  kFill,      ///< overwrite the fast record with the durable one
  kRelease,   ///< release this call's fast claim
};

/// The durable store's answer, as the guard sees it.
enum class DurableAnswer { kExecuted, kReplayed, kBusy, kMismatch };

/// The DurableAnswer of a durable claim status (kClaimed: this call executed).
constexpr DurableAnswer durable_answer(ClaimStatus s) noexcept {
  switch (s) {
    case ClaimStatus::kClaimed:
      return DurableAnswer::kExecuted;
    case ClaimStatus::kDone:
      return DurableAnswer::kReplayed;
    case ClaimStatus::kBusy:
      return DurableAnswer::kBusy;
    case ClaimStatus::kMismatch:
      return DurableAnswer::kMismatch;
  }
  return DurableAnswer::kBusy;
}

/// How long the fast store keeps a record the durable store answered with: `retention` (the
/// call's) for a record this call wrote or whose expiry the durable store did not report; for a
/// replay whose record ends at `record_expires`, what is left of that (by the system clock,
/// never more than `retention`), so a record written back to the fast store never outlives the
/// durable one, nor replays after its own retention. Zero when less than a second is left: the
/// fast store is not written.
inline std::chrono::seconds fast_term(std::chrono::seconds retention,
                                      TimePoint record_expires) noexcept {
  if (record_expires == TimePoint{}) return retention;
  const auto left = std::chrono::duration_cast<std::chrono::seconds>(record_expires - system_now());
  if (left.count() <= 0) return std::chrono::seconds{0};
  return left < retention ? left : retention;
}

/// fast_term of the durable store's answer `d`: its record's expiry for a replay, the call's
/// retention otherwise (a record this call wrote).
inline std::chrono::seconds fast_term(std::chrono::seconds retention,
                                      const ClaimResult& d) noexcept {
  return d.status == ClaimStatus::kDone ? fast_term(retention, d.expires_at) : retention;
}

/// What writing the durable answer `d` back to the fast store tells it of the record's first
/// attempt (FastStore::refill): the durable store's report for a replay; for the record this
/// call wrote, its `owner` (its creation: the write-back's time).
inline RecordOrigin origin_of(const ClaimResult& d, const OwnerToken& owner) noexcept {
  if (d.status == ClaimStatus::kDone) return RecordOrigin{d.first_seen, d.holder};
  return RecordOrigin{TimePoint{}, owner.str()};
}

/// The reason a record is marked failed with when its first attempt ran (two-phase: the effect
/// happened) but its response could never be stored (e.g. larger than the store takes): the
/// rest of the reason says why. Calls on the key then fail (unstored_answer) instead of running
/// the handler again.
inline constexpr std::string_view kUnstoredMarker = "idem:unstored:";

/// The reason to mark a record failed with when its completion was refused with `e`.
inline std::string unstored_reason(const Error& e) {
  std::string what = e.what();
  if (what.size() > 400) what.resize(400);
  return std::string(kUnstoredMarker) + std::string(errc_name(e.code())) + ": " + what;
}

/// unstored_reason of `e` when it is an idem::Error; empty otherwise.
inline std::string unstored_reason(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& x) {
    return unstored_reason(x);
  } catch (...) {
    return {};
  }
}

/// Whether `c` answers a record whose first attempt ran but whose response was not stored.
inline bool is_unstored(const ClaimResult& c) noexcept {
  return c.status == ClaimStatus::kDone && c.failed &&
         std::string_view(c.response).substr(0, kUnstoredMarker.size()) == kUnstoredMarker;
}

/// The error every later call on such a record gets (non-retryable: a retry would get it too).
inline StorageError unstored_answer(const Key& key, const ClaimResult& c) {
  return StorageError("idem: key '" + key.str() +
                      "': its first attempt ran, but its response could not be stored (" +
                      c.response.substr(kUnstoredMarker.size()) +
                      "); the handler is not run again while the record is kept");
}

/// Whether a completion refused with `e` can never succeed (so the record is marked failed
/// rather than left to its lease, after which a retry would run the handler again): an idem
/// error that is not retryable and not a lost lease.
inline bool completion_refused_for_good(const std::exception_ptr& e) noexcept {
  try {
    std::rethrow_exception(e);
  } catch (const LeaseLost&) {
    return false;
  } catch (const Error& x) {
    return !x.retryable();
  } catch (...) {
    return false;
  }
}

/// Whether a two-phase begin that failed with `e` may stand all the same: its outcome is unknown
/// (OutcomeUnknown: its connection broke after the claim went out). Its record would hold the
/// key in progress for a lease with nothing running, so the guards release it, owner-checked
/// (nothing happens if it was not applied). Other failures are not followed by a release: a
/// connect that failed applied nothing, and a store that timed out would only make the caller
/// wait a second time.
inline bool begin_may_stand(const std::exception_ptr& e) noexcept {
  try {
    std::rethrow_exception(e);
  } catch (const OutcomeUnknown&) {
    return true;
  } catch (...) {
    return false;
  }
}

/// What a two-phase or fast-only call throws when its completion failed with `e` after its
/// handler ran: for a retryable idem error (past GuardOptions::store_attempts) OutcomeUnknown,
/// since the handler's effect happened while its record stays in progress until the lease ends
/// (a retry with the same key answers kInProgress until then, and runs the handler again after
/// it); anything else (an OutcomeUnknown already, a refusal, LeaseLost) `e` as it is.
inline std::exception_ptr after_the_handler_ran(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& x) {
    if (x.retryable() && x.code() != errc::kOutcomeUnknown) {
      return std::make_exception_ptr(OutcomeUnknown(
          std::string("idem: the handler ran, but its completion failed (") + x.what() +
          "): the record stays in progress until its lease ends; retry with the same key"));
    }
  } catch (...) {
  }
  return e;
}

/// What a caller gets when the handler ran, its completion was refused for good (`e`), and the
/// record could not be marked failed either (the store refused that too: a disk I/O error, a
/// file gone): OutcomeUnknown, which says the handler ran; the record stays in progress until
/// its lease ends, and a retry after that runs the handler again. (A plain StorageError would
/// not say that the handler ran.)
inline std::exception_ptr handler_ran_unrecorded(const std::exception_ptr& e) {
  std::string what = "?";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    what = x.what();
  } catch (...) {
  }
  return std::make_exception_ptr(OutcomeUnknown(
      "idem: the handler ran, but its completion failed (" + what +
      ") and the record could not be marked failed either: it stays in progress until its "
      "lease ends, and a retry after that runs the handler again"));
}

/// The ClaimResult a durable store's transactional answer stands for (kCommitted: kClaimed).
/// Consumes `d`'s strings.
inline ClaimResult claim_of(TransactionalResult& d) {
  ClaimResult c;
  c.status = d.status == TransactionalStatus::kCommitted  ? ClaimStatus::kClaimed
             : d.status == TransactionalStatus::kReplayed ? ClaimStatus::kDone
             : d.status == TransactionalStatus::kMismatch ? ClaimStatus::kMismatch
                                                          : ClaimStatus::kBusy;
  c.response = std::move(d.response);
  if (d.status != TransactionalStatus::kCommitted) {
    c.failed = d.failed;
    c.holder = std::move(d.holder);
    c.first_seen = d.first_seen;
    c.expires_at = d.expires_at;
  }
  return c;
}

/// A duplicate's answer (what a store said about a record it holds).
struct DuplicateAnswer {
  Outcome outcome = Outcome::kReplayed;
  std::string response;
  std::string holder;
  TimePoint first_seen{};
  TimePoint expires_at{};  ///< replays: when the record's retention ends (epoch if unknown)
  /// Consumes `c` (its strings move). @throws StorageError for kClaimed (not a duplicate).
  static DuplicateAnswer from(ClaimResult& c) {
    DuplicateAnswer a;
    switch (c.status) {
      case ClaimStatus::kDone:
        a.outcome = Outcome::kReplayed;
        break;
      case ClaimStatus::kBusy:
        a.outcome = Outcome::kInProgress;
        break;
      case ClaimStatus::kMismatch:
        a.outcome = Outcome::kFingerprintMismatch;
        break;
      case ClaimStatus::kClaimed:
        throw StorageError("idem: internal error: a claim is not a duplicate");
    }
    a.response = std::move(c.response);
    a.holder = std::move(c.holder);
    a.first_seen = c.first_seen;
    a.expires_at = c.expires_at;
    return a;
  }
};

/// One call of a batch (IdempotencyGuard::run_batch), as GuardCore counts and reports it.
struct BatchCallReport {
  /// The call of `k`, ended with `o`, answered by `s`.
  BatchCallReport(const Key& k, Outcome o, Source s) noexcept : key(k), outcome(o), source(s) {}
  const Key& key;             ///< the call's key
  Outcome outcome;            ///< the call's outcome (not read for a handler error)
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

/// The guard's decisions and bookkeeping (see the file comment). Thread-safe: its state is
/// the counters and the fast store's up/down flag, all atomic.
class GuardCore {
 public:
  /// `has_fast`: the guard has a fast store. `who` names the guard in UsageError messages; the
  /// store names (FastStore::name, the durable store's name()) label StoreErrorEvent.
  /// @throws UsageError when the lease or the retention is not positive or longer than
  /// kMaxTerm, when wait_for_result, store_retry_backoff or fast_store_retry_after is negative,
  /// or when store_attempts is 0.
  GuardCore(bool has_fast, GuardOptions options, std::string_view who,
            std::string_view fast_name = "none", std::string_view durable_name = "none")
      : has_fast_(has_fast),
        options_(std::move(options)),
        fast_name_(fast_name),
        durable_name_(durable_name) {
    const std::string w(who);
    check_term(options_.lease, w + ": GuardOptions::lease");
    check_term(options_.retention, w + ": GuardOptions::retention");
    auto not_negative = [&](std::chrono::milliseconds d, const char* name) {
      if (d.count() < 0) throw UsageError(w + ": GuardOptions::" + name + " is negative");
    };
    not_negative(options_.wait_for_result, "wait_for_result");
    not_negative(options_.store_retry_backoff, "store_retry_backoff");
    not_negative(options_.fast_store_retry_after, "fast_store_retry_after");
    if (options_.store_attempts == 0) {
      throw UsageError(w + ": GuardOptions::store_attempts is 0 (1 means one attempt, no retry)");
    }
  }

  /// The options in force.
  const GuardOptions& options() const noexcept { return options_; }
  /// The counters.
  const GuardStats& stats() const noexcept { return stats_; }
  /// The counters, for what a driver counts itself (bypassed calls, waits, store retries).
  GuardStats& counters() noexcept { return stats_; }
  /// Whether an observer listens (drivers time their phases only then).
  bool observed() const noexcept { return options_.observer != nullptr; }
  /// A call's lease, retention and heartbeat.
  CallTerms call_options() const noexcept {
    return CallTerms{options_.lease, options_.retention, options_.heartbeat};
  }
  /// The label of duplicates the durable store catches.
  DuplicateSource durable_source() const noexcept { return options_.durable_source; }

  /// A call begins (or, for a waiting call, another of its attempts: counted once).
  void start(CallState& c) noexcept {
    if (c.wait != nullptr && c.wait->attempts++ > 0) {
      c.start = c.wait->began;
      return;
    }
    stats_.calls.fetch_add(1, std::memory_order_relaxed);
    c.start = c.now();
    if (c.wait != nullptr) c.wait->began = c.start;
  }

  /// The fast store answered the claim: true when it was granted (go on: its ticket moves into
  /// the call), false when `r` is a duplicate to answer. Throws what the step hook throws.
  bool fast_claim_answered(CallState& c, ClaimResult& r) {
    fast_ok();
    if (r.status != ClaimStatus::kClaimed) return false;  // counted by duplicate()
    c.fast_claimed = true;
    c.fast_ticket = std::move(r.ticket);
    stats_.fast_claims.fetch_add(1, std::memory_order_relaxed);
    if (r.took_over) takeover(c.key(), "fast");
    step(Step::kFastClaimed, c.key());
    return true;
  }
  /// The fast claim failed: the call goes on degraded (a fast-only guard fails instead).
  void fast_claim_failed(CallState& c, const Error& e) noexcept {
    count_degraded(c);
    fast_burst(c.key(), e);
    note_lost_claim(c.key(), c.owner(), e, c.options.lease);
  }

  /// A claim whose answer was lost (see note_lost_claim): released once the fast store answers,
  /// then watched for a lease (lost_claim_holding).
  struct LostClaim {
    Key key;
    OwnerToken owner;
    std::int64_t lease_ns = 0;  ///< the claim's lease
    /// 0: not released yet (kept however long the fast store stays silent: a stalled store
    /// applies the claim when it runs again, whenever that is). Else: released at least once
    /// (take_lost_claims), watched until then (steady clock): a claim the store applied just
    /// after its release has ended by itself by then.
    std::int64_t watch_until_ns = 0;
  };
  /// Most lost claims kept; beyond it the oldest are left to end with their lease.
  static constexpr std::size_t kMaxLostClaims = 1024;

  /// A claim of `owner` on `key` failed with `e` after it may have reached the fast store (a
  /// timeout, an unknown outcome): a stalled Redis works through its input once it runs again
  /// and applies it, leaving an in-progress record that no attempt owns until the lease ends
  /// (duplicates would hear "in progress", or "mismatch" where the lost claim carried another
  /// payload). Its owner-checked release waits here until the fast store answers again
  /// (take_lost_claims); a release of a claim that never applied changes nothing.
  void note_lost_claim(const Key& key, const OwnerToken& owner, const Error& e,
                       std::chrono::milliseconds lease) noexcept {
    if (dynamic_cast<const StorageTimeout*>(&e) == nullptr &&
        dynamic_cast<const OutcomeUnknown*>(&e) == nullptr) {
      return;  // refused or never sent: nothing can apply later
    }
    note_unreleased_claim(key, owner, lease);
  }
  /// A claim of `owner` on `key` the fast store granted could not be released or completed
  /// (it failed): it would answer "in progress" until its lease ends although its call is
  /// over. Released, owner-checked, once the fast store answers again (take_lost_claims).
  void note_unreleased_claim(const Key& key, const OwnerToken& owner,
                             std::chrono::milliseconds lease) noexcept {
    try {
      const auto lease_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(lease).count();
      std::lock_guard<std::mutex> lock(lost_mutex_);
      if (lost_claims_.size() >= kMaxLostClaims) lost_claims_.erase(lost_claims_.begin());
      lost_claims_.push_back(LostClaim{key, owner, lease_ns, 0});
      lost_pending_.store(true, std::memory_order_release);
      lost_kept_.store(true, std::memory_order_release);
    } catch (...) {
      // Out of memory: the claim ends with its lease, as before.
    }
  }
  /// Whether lost claims wait for their release (one relaxed load: the fast path's only cost).
  bool has_lost_claims() const noexcept { return lost_pending_.load(std::memory_order_relaxed); }
  /// The lost claims not released yet, for the caller to release (owner-checked). They stay
  /// kept, watched for a lease from now: a stalled store may apply one just after its release
  /// (it works through each connection's input in its own order), and lost_claim_holding then
  /// finds it under the key it answers for. Watches that ended are dropped.
  std::vector<LostClaim> take_lost_claims() {
    std::vector<LostClaim> out;
    std::lock_guard<std::mutex> lock(lost_mutex_);
    lost_pending_.store(false, std::memory_order_relaxed);
    const std::int64_t now = steady_ns();
    std::size_t kept = 0;
    for (std::size_t i = 0; i < lost_claims_.size(); ++i) {
      LostClaim& l = lost_claims_[i];
      if (l.watch_until_ns == 0) {
        out.push_back(l);
        l.watch_until_ns = now + l.lease_ns;
      }
      if (l.watch_until_ns <= now) continue;  // watched for a lease: over
      if (kept != i) lost_claims_[kept] = std::move(l);
      ++kept;
    }
    lost_claims_.erase(lost_claims_.begin() + static_cast<std::ptrdiff_t>(kept),
                       lost_claims_.end());
    lost_kept_.store(kept != 0, std::memory_order_relaxed);
    return out;
  }
  /// The owner of this guard's lost claim on `key` whose record gave the claim answer `c` (a
  /// busy or mismatch answer whose holder it is: the stalled store applied it late), to be
  /// released (owner-checked, release_lost_claim) and the claim asked again; nullopt for any
  /// other answer.
  std::optional<OwnerToken> lost_claim_holding(const Key& key, const ClaimResult& c) {
    if (c.status != ClaimStatus::kBusy && c.status != ClaimStatus::kMismatch) return std::nullopt;
    if (c.holder.empty() || !lost_kept_.load(std::memory_order_acquire)) return std::nullopt;
    std::lock_guard<std::mutex> lock(lost_mutex_);
    for (const auto& l : lost_claims_) {
      if (l.owner.str() == c.holder && l.key == key) return l.owner;
    }
    return std::nullopt;
  }
  /// `owner`'s lost claim on `key` is released: no longer kept.
  void forget_lost_claim(const Key& key, const OwnerToken& owner) noexcept {
    try {
      std::lock_guard<std::mutex> lock(lost_mutex_);
      for (auto it = lost_claims_.begin(); it != lost_claims_.end(); ++it) {
        if (it->owner == owner && it->key == key) {
          lost_claims_.erase(it);
          break;
        }
      }
      lost_kept_.store(!lost_claims_.empty(), std::memory_order_relaxed);
    } catch (...) {
      // (std::mutex::lock): it stays watched until its watch ends
    }
  }
  /// Releases the lost claims on `fast`, owner-checked, now that it answered a claim (the
  /// synchronous guard's run() and run_batch()); a failure leaves the rest to a later call.
  /// They stay watched (take_lost_claims): a claim another thread's answer came from, released
  /// here meanwhile, is still found by lost_claim_holding.
  /// @return whether one of them was still held (and is gone now).
  bool release_lost_claims(FastStore& fast) noexcept {
    std::vector<LostClaim> lost;
    try {
      lost = take_lost_claims();
    } catch (...) {
      return false;
    }
    bool released = false;
    for (std::size_t i = 0; i < lost.size(); ++i) {
      try {
        released = fast.release(lost[i].key, lost[i].owner) || released;
      } catch (...) {
        lost.erase(lost.begin(), lost.begin() + static_cast<std::ptrdiff_t>(i));
        keep_lost_claims(lost);
        return released;
      }
    }
    return released;
  }
  /// Releases `owner`'s lost claim whose record answered this call's claim of `key`
  /// (lost_claim_holding), owner-checked, on `fast`: no longer kept (the claim asked again
  /// is this call's). @throws as FastStore::release.
  void release_lost_claim(FastStore& fast, const Key& key, const OwnerToken& owner) {
    (void)fast.release(key, owner);
    forget_lost_claim(key, owner);
  }
  /// Whether the call skips the fast store (GuardOptions::fast_store_retry_after: it failed
  /// less than that long ago). A skipped call goes on degraded, as after a failure. Only for
  /// a guard with a durable store.
  bool skip_fast(CallState& c) noexcept {
    const std::int64_t until = fast_retry_at_.load(std::memory_order_relaxed);
    if (until == 0 || steady_ns() >= until) return false;
    count_degraded(c);
    burst_failures_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  /// The durable store decided: what the fast store does next, writing the record for `term`
  /// (fast_term; zero: the record's retention is over, nothing is written).
  /// (A duplicate is counted by duplicate(), which answers it.)
  FastNext durable_answered(const CallState& c, DurableAnswer a,
                            std::chrono::seconds term) noexcept {
    if (a == DurableAnswer::kBusy || a == DurableAnswer::kMismatch || term.count() <= 0) {
      return release_next(c);
    }
    return write_next(c, a == DurableAnswer::kReplayed);
  }
  /// The call gives up (busy, mismatch, a failure): release its fast claim, if it holds one.
  FastNext release_next(const CallState& c) const noexcept {
    return has_fast_ && c.fast_claimed ? FastNext::kRelease : FastNext::kNothing;
  }
  /// The durable store holds a completed record: write it to the fast store. A degraded call
  /// does not (the fast store failed moments ago; do not pay a second timeout). The record of
  /// this call's execution completes its claim; a `replayed` one (the fast store had lost it)
  /// overwrites the claim with the durable record (kFill, FastStore::refill), so that the
  /// fast store reports when the record's first attempt began, not when this call claimed.
  FastNext write_next(const CallState& c, bool replayed) const noexcept {
    if (!has_fast_) return FastNext::kNothing;
    if (c.fast_claimed) return replayed ? FastNext::kFill : FastNext::kComplete;
    if (c.degraded) return FastNext::kNothing;
    return FastNext::kFill;
  }
  /// The fast complete answered: when the claim expired and was taken over (or released)
  /// while the durable store decided, the durable answer stands: overwrite (kFill).
  FastNext fast_complete_answered(CallState& c, bool completed) {
    if (!completed) return FastNext::kFill;
    step(Step::kFastCompleted, c.key());
    return FastNext::kNothing;
  }
  /// The fast record was overwritten with the durable one.
  void fast_filled(CallState& c) {
    stats_.fast_refills.fetch_add(1, std::memory_order_relaxed);
    step(Step::kFastCompleted, c.key());
  }
  /// A fast complete, fill or release failed: the durable store replays from now on and the
  /// next duplicate refills it (a release that failed ends with its lease). A failure of the
  /// burst; the call, decided before, is not degraded (GuardStats::degraded, CallEvent agree).
  /// A claim this call holds is released once the fast store answers again
  /// (note_unreleased_claim), instead of answering "in progress" until its lease ends.
  void fast_follow_up_failed(CallState& c, const Error& e) noexcept {
    fast_burst(c.key(), e);
    if (c.fast_claimed) note_unreleased_claim(c.key(), c.owner(), c.options.lease);
  }

  /// The handler threw `error` (the driver releases the claims).
  void handler_failed(const CallState& c, const std::exception_ptr& error) noexcept {
    handler_error(c.key(), error);
  }
  /// The handler of the call on `key` threw `error`.
  void handler_error(const Key& key, const std::exception_ptr& error) noexcept {
    stats_.handler_errors.fetch_add(1, std::memory_order_relaxed);
    if (auto* o = options_.observer.get()) o->on_handler_exception(key, error);
  }
  /// A store took over an expired lease.
  void takeover(const Key& key, std::string_view store) noexcept {
    stats_.takeovers.fetch_add(1, std::memory_order_relaxed);
    if (auto* o = options_.observer.get()) o->on_takeover(key, store);
  }
  /// The call's lease was lost before it completed: counted, reported; the error to throw.
  LeaseLost lease_lost(const CallState& c, std::string_view store) noexcept {
    note_lease_lost(c.key(), store);
    return LeaseLost("idem: the claim on '" + c.key().str() +
                     "' was lost before the handler completed: its lease expired and another "
                     "attempt took it over (raise GuardOptions::lease above the handler's "
                     "duration), or it was released or removed from the store (idemctl "
                     "release, a fast store that lost its data)");
  }
  /// The claim of `key` in `store` was found lost (taken over): counted, reported.
  void note_lease_lost(const Key& key, std::string_view store) noexcept {
    stats_.leases_lost.fetch_add(1, std::memory_order_relaxed);
    if (auto* o = options_.observer.get()) o->on_lease_lost(key, store);
  }
  /// Runs the step hook (whatever it throws propagates).
  void step(Step s, const Key& key) {
    if (options_.step_hook) options_.step_hook(s, key);
  }

  /// The answer of a call whose handler ran and whose record is written.
  template <class R>
  GuardResult<R> executed(CallState& c, std::optional<R>&& value) {
    count_outcome(Outcome::kExecuted);
    GuardResult<R> r;
    r.outcome = Outcome::kExecuted;
    r.value = std::move(value);
    r.source = Source::kHandler;
    r.degraded = c.degraded;
    emit_call(c, r.outcome, r.source);
    return r;
  }
  /// The answer of a duplicate, counted (a fast-store hit or a durable conflict, by `source`)
  /// and reported; a waiting call's kInProgress before its turn ends is neither (the call asks
  /// again: WaitTurn). @throws CorruptRecord if a stored response cannot be decoded.
  template <class R>
  GuardResult<R> duplicate(CallState& c, DuplicateAnswer&& a, Source source,
                           DuplicateSource dup_source) {
    GuardResult<R> r;
    r.outcome = a.outcome;
    r.source = source;
    r.degraded = c.degraded;
    r.first_seen = a.first_seen;
    r.expires_at = a.expires_at;
    if (a.outcome == Outcome::kInProgress && c.wait != nullptr &&
        SteadyClock::now() < c.wait->until) {
      c.wait->deferred = true;
      r.holder = std::move(a.holder);
      return r;
    }
    if (source == Source::kFastStore) count_fast_hit();
    if (source == Source::kDurableStore) count_durable_conflict();
    if (a.outcome == Outcome::kReplayed) {
      try {
        if constexpr (std::is_same_v<R, std::string>) {
          r.value.emplace(std::move(a.response));  // Codec<std::string> is the identity
        } else {
          r.value.emplace(Codec<R>::decode(a.response));
        }
      } catch (const std::exception& e) {
        CorruptRecord corrupt("idem: the stored response of '" + c.key().str() +
                              "' cannot be decoded: " + e.what());
        store_error(c.key(), source == Source::kFastStore ? StoreRole::kFast : StoreRole::kDurable,
                    corrupt);
        throw corrupt;
      }
    }
    count_outcome(a.outcome);
    if (auto* o = options_.observer.get()) {
      o->on_duplicate(DuplicateEvent{c.key(), a.outcome, dup_source, a.first_seen, a.holder});
    }
    emit_call(c, a.outcome, source);
    r.holder = std::move(a.holder);
    return r;
  }

  // --- the calls of a batch (IdempotencyGuard::run_batch, detail/batch_run.hpp) ------------

  /// Counts the batch call `c` and tells the observer (on_duplicate, on_call with mode
  /// kTransactional) exactly as a run() call with the same outcome and source.
  void report_batch_call(const BatchCallReport& c) noexcept {
    count_call(c.fast_claimed, c.degraded);
    if (c.source == Source::kFastStore) count_fast_hit();
    if (c.source == Source::kDurableStore) count_durable_conflict();
    count_outcome(c.outcome);
    Observer* o = options_.observer.get();
    if (o == nullptr) return;
    if (c.outcome != Outcome::kExecuted) {
      o->on_duplicate(DuplicateEvent{c.key, c.outcome,
                                     c.source == Source::kFastStore ? DuplicateSource::kFastStore
                                                                    : options_.durable_source,
                                     c.first_seen, c.holder});
    }
    CallEvent e{c.key,     c.outcome,  Mode::kTransactional,
                c.source,  c.degraded, c.fast_claim,
                c.durable, c.handler,  c.total};
    e.fast_claimed = c.fast_claimed;
    o->on_call(e);
  }
  /// The handler of the batch call `c` threw (its writes rolled back): counted as a run()
  /// call whose handler threw (on_handler_error, no on_call).
  void report_batch_handler_error(const BatchCallReport& c,
                                  const std::exception_ptr& error) noexcept {
    count_call(c.fast_claimed, c.degraded);
    handler_error(c.key, error);
  }

  /// What every call counts before its outcome is known.
  void count_call(bool fast_claimed, bool degraded) noexcept {
    stats_.calls.fetch_add(1, std::memory_order_relaxed);
    if (fast_claimed) stats_.fast_claims.fetch_add(1, std::memory_order_relaxed);
    if (degraded) stats_.degraded.fetch_add(1, std::memory_order_relaxed);
  }
  /// A duplicate the fast store recognised.
  void count_fast_hit() noexcept { stats_.fast_hits.fetch_add(1, std::memory_order_relaxed); }
  /// A duplicate the durable store recognised.
  void count_durable_conflict() noexcept {
    stats_.durable_conflicts.fetch_add(1, std::memory_order_relaxed);
  }
  /// A fast record rewritten from the durable store.
  void count_refill() noexcept { stats_.fast_refills.fetch_add(1, std::memory_order_relaxed); }
  /// The outcome's counter.
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
  /// The fast store failed for `calls` calls: a burst of failures begins (on_fast_store_down
  /// once per burst). Count degraded calls with count_call / fast_claim_failed.
  void fast_burst(const Key& key, const Error& e, std::uint64_t calls = 1) noexcept {
    store_error(key, StoreRole::kFast, e);
    burst_failures_.fetch_add(calls, std::memory_order_relaxed);
    if (options_.fast_store_retry_after.count() > 0) {
      fast_retry_at_.store(steady_ns() + std::chrono::duration_cast<std::chrono::nanoseconds>(
                                             options_.fast_store_retry_after)
                                             .count(),
                           std::memory_order_relaxed);
    }
    if (!fast_down_.exchange(true, std::memory_order_acq_rel)) {
      if (auto* o = options_.observer.get()) o->on_fast_store_down(key, e);
    }
  }
  /// The fast store answered: closes a burst of failures (on_fast_store_recovered).
  void fast_ok() noexcept {
    if (fast_down_.load(std::memory_order_relaxed) &&
        fast_down_.exchange(false, std::memory_order_acq_rel)) {
      fast_retry_at_.store(0, std::memory_order_relaxed);
      auto n = burst_failures_.exchange(0, std::memory_order_relaxed);
      if (auto* o = options_.observer.get()) o->on_fast_store_recovered(n);
    }
  }

  /// Every store failure reaches the observer (on_store_error) with the key and its errc.
  void store_error(const Key& key, StoreRole role, const Error& e) noexcept {
    store_error(key, role, role == StoreRole::kFast ? fast_name_ : durable_name_, e);
  }
  /// The same, naming what failed: a part between the guard and its store (the asynchronous
  /// guard's worker pool refusing work is "worker_pool", not the durable store).
  void store_error(const Key& key, StoreRole role, std::string_view store,
                   const Error& e) noexcept {
    auto* o = options_.observer.get();
    if (o == nullptr) return;
    o->on_store_error(StoreErrorEvent{&key, role, store, e});
  }
  /// The store in `role` failed with `e` (anything but an idem::Error is not reported).
  void store_failed(const Key& key, StoreRole role, const std::exception_ptr& e) noexcept {
    if (options_.observer == nullptr || !e) return;
    try {
      std::rethrow_exception(e);
    } catch (const Error& x) {
      store_error(key, role, x);
    } catch (...) {
    }
  }
  /// The durable store failed with `e`.
  void durable_failed(const Key& key, const std::exception_ptr& e) noexcept {
    store_failed(key, StoreRole::kDurable, e);
  }
  /// Inside a catch block: reports the durable store's exception in flight.
  void durable_failed(const Key& key) noexcept {
    if (options_.observer == nullptr) return;
    durable_failed(key, std::current_exception());
  }

 private:
  void emit_call(CallState& c, Outcome outcome, Source source) noexcept {
    if (auto* o = options_.observer.get()) {
      CallEvent e{c.key(),      outcome,   c.mode,    source,          c.degraded,
                  c.fast_claim, c.durable, c.handler, c.since(c.start)};
      e.fast_claimed = c.fast_claimed;
      o->on_call(e);
    }
  }
  // Degraded-mode bookkeeping: the call goes on without the fast store, counted once (a waiting
  // call's later attempts are the same call); the burst is reported once (fast_burst).
  void count_degraded(CallState& c) noexcept {
    c.degraded = true;
    if (c.wait != nullptr && c.wait->degraded) return;
    if (c.wait != nullptr) c.wait->degraded = true;
    stats_.degraded.fetch_add(1, std::memory_order_relaxed);
  }

  static std::int64_t steady_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               SteadyClock::now().time_since_epoch())
        .count();
  }

  bool has_fast_;
  GuardOptions options_;
  std::string_view fast_name_;
  std::string_view durable_name_;
  GuardStats stats_;
  std::atomic<bool> fast_down_{false};
  std::atomic<std::uint64_t> burst_failures_{0};
  // Until when calls skip the fast store (steady clock, ns; 0: none do).
  std::atomic<std::int64_t> fast_retry_at_{0};
  /// Marks lost claims not released (the fast store failed again) as waiting for a release
  /// again (take_lost_claims left them kept, watched).
  void keep_lost_claims(const std::vector<LostClaim>& rest) noexcept {
    if (rest.empty()) return;
    try {
      std::lock_guard<std::mutex> lock(lost_mutex_);
      for (auto& l : lost_claims_) {
        for (const auto& r : rest) {
          if (l.owner == r.owner && l.key == r.key) l.watch_until_ns = 0;
        }
      }
      lost_pending_.store(true, std::memory_order_release);
    } catch (...) {
      // (std::mutex::lock): they stay watched until their watch ends
    }
  }

  // Claims whose answer was lost, waiting for their release or watched (note_lost_claim).
  std::mutex lost_mutex_;
  std::vector<LostClaim> lost_claims_;
  std::atomic<bool> lost_pending_{false};  // some wait for their release
  std::atomic<bool> lost_kept_{false};     // some are kept (waiting or watched)
};

}  // namespace idem::detail
