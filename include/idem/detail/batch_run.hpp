// SPDX-License-Identifier: MIT
// The batch protocol of IdempotencyGuard::run_batch (internal).
//
// File: detail/batch_run.hpp (internal: guard.hpp includes it, services do not)
//
//   1. Fast store: one claim_batch for the first call of each key. A call the fast store
//      answers as done, busy or mismatched is decided there and never reaches the database.
//      If the fast store fails, every call goes on to the durable store (degraded).
//   2. One durable transaction for the rest. First run, no savepoints: the records of the
//      first call of each key are written completed in one record_batch_in (with the insert
//      that assumes fresh keys when every fast claim was granted afresh, or, without granted
//      fast claims, when every call said its key is likely new; if a record exists after all,
//      the transaction rolls back and runs again with the tolerant insert); then,
//      in order, each call whose record was written runs its handler, and an existing record
//      decides the others (decide_in: done, mismatch, busy, or taken over). A handler that
//      throws (not a retryable idem error), or a record locked past the store's lock wait,
//      rolls the transaction back, and it runs again with a savepoint per call: a failing
//      handler then loses only its own writes. Later calls of a key already in the batch are
//      decided by the record the first one wrote (in progress when the first one failed: a
//      key runs once per batch).
//   3. Fast store: one complete_batch for the claims that committed (or found a committed
//      record: the fast store had lost it); the others are released.
// Every call is counted in GuardStats and told to the observer as run() would count and tell
// it (mode kTransactional; phase timings are the batch's, the handler time the call's own).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "idem/batch.hpp"
#include "idem/detail/guard_core.hpp"
#include "idem/durable_store.hpp"
#include "idem/errors.hpp"
#include "idem/store.hpp"

namespace idem::detail {

// Thrown inside the first transaction to roll it back and run the batch again with a
// savepoint per call. Never escapes BatchRun.
struct BatchRerun {};
// Thrown inside the first transaction when the insert that assumes fresh keys found a record:
// the transaction rolls back and the first run starts again with the tolerant insert.
struct BatchRecordsExist {};
// Thrown out of a careful pass whose transaction a failing handler statement ended: the pass
// runs again without that call.
struct CarefulRestart {};

/// One run_batch call: its state, per call, and the three steps.
template <class Durable>
class BatchRun {
 public:
  using Tx = typename Durable::Transaction;

  BatchRun(GuardCore& core, FastStore* fast, Durable& durable, std::vector<BatchCall>& calls,
           std::string_view response)
      : core_(core),
        fast_(fast),
        durable_(durable),
        calls_(calls),
        n_(calls.size()),
        response_(response),
        first_(n_, 0),
        fast_claimed_(n_, 0),
        to_durable_(n_, 1),
        took_over_(n_, 0),
        tickets_(n_) {
    result_.answers.resize(n_);
    // The batch's own copy of every fingerprint, taken before any handler runs.
    std::size_t bytes = 0;
    for (const BatchCall& c : calls_) bytes += c.fingerprint.size();
    fingerprint_bytes_.reserve(bytes);
    for (const BatchCall& c : calls_) fingerprint_bytes_.append(c.fingerprint);
    fingerprints_.reserve(n_);
    std::size_t at = 0;
    for (const BatchCall& c : calls_) {
      fingerprints_.emplace_back(fingerprint_bytes_.data() + at, c.fingerprint.size());
      at += c.fingerprint.size();
    }
    // Later calls of a key go neither to the fast store nor into the batch insert: the record
    // the first call wrote decides them.
    std::unordered_set<std::string> seen;
    for (std::size_t i = 0; i < n_; ++i) first_[i] = seen.insert(calls_[i].key.str()).second;
  }
  BatchRun(const BatchRun&) = delete;
  BatchRun& operator=(const BatchRun&) = delete;

  /// Runs the batch; `handler(tx, i)` for each call `i` that may run.
  template <class Fn>
  BatchResult run(Fn& handler) {
    timed_ = core_.observed();
    if (timed_) {
      start_ = SteadyClock::now();
      handler_time_.assign(n_, std::chrono::nanoseconds{0});
    }
    if (fast_ != nullptr) {
      claim_fast();
      if (timed_) fast_claim_ = SteadyClock::now() - start_;
    }
    const auto durable_start = timed_ ? SteadyClock::now() : SteadyClock::time_point{};
    try {
      if (std::find(to_durable_.begin(), to_durable_.end(), 1) != to_durable_.end()) {
        run_durable(handler);
      }
    } catch (...) {
      // The batch's transaction failed: every call is counted (as a run() call that fails)
      // and the failure told to the observer once, under the first key.
      for (std::size_t i = 0; i < n_; ++i) core_.count_call(fast_claimed_[i] != 0, degraded_);
      if (n_ > 0) core_.durable_failed(calls_[0].key);
      if (fast_ != nullptr) {
        for (std::size_t i = 0; i < n_; ++i) {
          if (fast_claimed_[i] != 0) release_fast(i);
        }
      }
      throw;
    }
    if (timed_) transaction_ = SteadyClock::now() - durable_start;
    if (fast_ != nullptr) finish_fast();
    report_calls();
    return std::move(result_);
  }

 private:
  BatchAnswer& answer(std::size_t i) { return result_.answers[i]; }

  // Step 2: first without savepoints; if a handler fails, that transaction rolls back and
  // the batch runs again with a savepoint per call.
  template <class Fn>
  void run_durable(Fn& handler) {
    const std::vector<BatchAnswer> before = result_.answers;
    auto roll_back = [&] {
      for (std::size_t i = 0; i < n_; ++i) {
        if (to_durable_[i] != 0) answer(i) = before[i];
      }
      std::fill(took_over_.begin(), took_over_.end(), 0);
      std::fill(handler_time_.begin(), handler_time_.end(), std::chrono::nanoseconds{0});
    };
    // The plain record insert when every claim was fresh in the fast store, or, with no claim
    // granted there (no fast store, or it failed), when every call said its key is likely new:
    // no record is expected. A record found anyway (the fast store lost it, a producer's
    // duplicate) costs one rerun.
    likely_new_ = !fresh_claims_ && (fast_ == nullptr || degraded_) && all_likely_new();
    new_records_ = fresh_claims_ || likely_new_;
    bool committed = false;
    for (bool again = true; again;) {
      again = false;
      try {
        durable_.with_transaction([&](Tx& tx) { first_pass(tx, handler); });
        committed = true;
      } catch (const BatchRecordsExist&) {
        roll_back();  // nothing ran yet: the records are written first
        new_records_ = false;
        result_.records_existed = true;
        again = true;
      } catch (const BatchRerun&) {
        // Rolled back: a handler failed (or a record was locked by another transaction).
      }
    }
    if (committed) return;
    roll_back();
    result_.rerun = true;
    // A handler's failed statement that ended the whole transaction (a driver that aborts it
    // on any error) leaves no savepoint to go back to: the pass runs again without that call,
    // its error kept. Each such run fails one more call, so at most one per call.
    std::unordered_set<std::string> failed;  // keys whose first call failed
    for (;;) {
      try {
        durable_.with_transaction([&](Tx& tx) { careful_pass(tx, handler, failed); });
        return;
      } catch (const CarefulRestart&) {
        for (std::size_t i = 0; i < n_; ++i) {
          if (to_durable_[i] != 0 && !answer(i).error) answer(i) = before[i];
        }
        std::fill(took_over_.begin(), took_over_.end(), 0);
      }
    }
  }

  // Whether every call whose record the batch writes said its key is likely new (and none is
  // a retry).
  bool all_likely_new() const noexcept {
    for (std::size_t i = 0; i < n_; ++i) {
      if (to_durable_[i] == 0 || first_[i] == 0) continue;
      if (!calls_[i].likely_new || calls_[i].retried) return false;
    }
    return true;
  }

  // Step 1: one claim_batch for the first call of each key. A fast-store failure leaves every
  // call to the durable store (degraded; claims the failed round trip may have made end with
  // their lease).
  void claim_fast() {
    std::vector<ClaimRequest> requests;
    std::vector<std::size_t> index;
    for (std::size_t i = 0; i < n_; ++i) {
      if (first_[i] == 0) continue;
      requests.push_back(ClaimRequest{&calls_[i].key, fingerprints_[i], &owner_});
      index.push_back(i);
    }
    try {
      std::vector<ClaimResult> answers = fast_->claim_batch(requests, core_.options().lease);
      if (core_.has_lost_claims()) core_.release_lost_claims(*fast_);
      ask_again(requests, answers);
      fresh_claims_ = true;
      for (std::size_t j = 0; j < index.size(); ++j) {
        const std::size_t i = index[j];
        ClaimResult& c = answers[j];
        if (c.status == ClaimStatus::kClaimed) {
          fast_claimed_[i] = 1;
          tickets_[i] = std::move(c.ticket);
          // A takeover or a retry may find a record its earlier holder committed.
          if (c.took_over || calls_[i].retried) fresh_claims_ = false;
          if (c.took_over) core_.takeover(calls_[i].key, "fast");  // as run() reports it
          continue;
        }
        to_durable_[i] = 0;
        settle(i, c, Source::kFastStore);
      }
      core_.fast_ok();
    } catch (const StorageError& e) {
      fresh_claims_ = false;
      degraded_ = true;
      if (!requests.empty()) core_.fast_burst(*requests.front().key, e, requests.size());
      // Claims the lost round trip may have made are released once the fast store answers.
      for (const ClaimRequest& r : requests) {
        core_.note_lost_claim(*r.key, owner_, e, core_.options().lease);
      }
    }
  }

  // Busy and mismatch answers that came from this guard's lost claims (a stalled store applied
  // them late; GuardCore::lost_claim_holding): those claims are released (owner-checked) and
  // their keys claimed again, in one more batch.
  void ask_again(const std::vector<ClaimRequest>& requests, std::vector<ClaimResult>& answers) {
    std::vector<ClaimRequest> again;
    std::vector<std::size_t> where;
    for (std::size_t j = 0; j < answers.size(); ++j) {
      const Key& key = *requests[j].key;
      auto lost = core_.lost_claim_holding(key, answers[j]);
      if (!lost) continue;
      core_.release_lost_claim(*fast_, key, *lost);
      again.push_back(requests[j]);
      where.push_back(j);
    }
    if (again.empty()) return;
    std::vector<ClaimResult> second = fast_->claim_batch(again, core_.options().lease);
    for (std::size_t k = 0; k < where.size(); ++k) answers[where[k]] = std::move(second[k]);
  }

  // Step 2, first run, inside `tx`: the records of the first call of each key, written
  // completed in one batch call; then, in order, each call's handler (or, when a record
  // existed, the record's answer). No savepoints: a failing handler (not retryable) or a
  // record locked by another transaction throws BatchRerun, which rolls `tx` back. A
  // retryable idem error thrown by a handler propagates (the batch rolls back).
  template <class Fn>
  void first_pass(Tx& tx, Fn& handler) {
    std::vector<ClaimRequest> requests;
    std::vector<std::size_t> index;
    for (std::size_t i = 0; i < n_; ++i) {
      if (to_durable_[i] == 0 || first_[i] == 0) continue;
      requests.push_back(ClaimRequest{&calls_[i].key, fingerprints_[i], &owner_});
      index.push_back(i);
    }
    std::vector<bool> written;
    try {
      DurableHint hint;
      hint.fast_claimed = new_records_ && !likely_new_;
      hint.likely_new = new_records_ && likely_new_;
      std::optional<std::vector<bool>> w =
          durable_.record_batch_in(tx, requests, response_, core_.options().retention, hint);
      if (!w) throw BatchRecordsExist{};  // `tx` is aborted
      written = std::move(*w);
    } catch (const StorageTimeout&) {
      throw BatchRerun{};  // a key locked by another transaction: decide one by one
    }
    std::vector<char> recorded(n_, 0);
    for (std::size_t j = 0; j < index.size(); ++j) recorded[index[j]] = written[j] ? 1 : 0;
    for (std::size_t i = 0; i < n_; ++i) {
      if (to_durable_[i] == 0) continue;
      ClaimResult c;
      if (recorded[i] == 0 && !claim_record(tx, i, c)) continue;
      try {
        run_handler(handler, tx, i);
      } catch (...) {
        const std::exception_ptr error = typed(std::current_exception());
        if (retryable(error)) std::rethrow_exception(error);
        throw BatchRerun{};
      }
      if (recorded[i] == 0) record(tx, i, c);
      executed(i);
    }
  }

  // Step 2 after a first run rolled back: a savepoint per call, so a failing handler loses
  // only its own writes (its answer keeps the error) and the others commit.
  // A later call of a key whose first call failed here is not run again (the key runs once
  // per batch): it answers in progress, as a duplicate beside a failing run() call would.
  template <class Fn>
  void careful_pass(Tx& tx, Fn& handler, std::unordered_set<std::string>& failed) {
    for (std::size_t i = 0; i < n_; ++i) {
      if (to_durable_[i] == 0) continue;
      if (answer(i).error) continue;  // failed in an earlier run of this pass
      if (first_[i] == 0 && !failed.empty() && failed.count(calls_[i].key.str()) != 0) {
        BatchAnswer& a = answer(i);
        a.outcome = Outcome::kInProgress;
        a.source = Source::kDurableStore;
        continue;
      }
      durable_.savepoint(tx);
      ClaimResult c;
      if (!claim_record(tx, i, c)) {
        durable_.release_savepoint(tx);
        continue;
      }
      try {
        run_handler(handler, tx, i);
      } catch (...) {
        const std::exception_ptr error = typed(std::current_exception());
        if (retryable(error)) std::rethrow_exception(error);  // rolls the whole batch back
        took_over_[i] = 0;
        answer(i).error = error;
        failed.insert(calls_[i].key.str());
        try {
          durable_.rollback_to_savepoint(tx);
        } catch (const StorageError& e) {
          if (e.retryable()) throw;
          throw CarefulRestart{};  // the handler's failure ended `tx` (see run_durable)
        }
        durable_.release_savepoint(tx);
        continue;
      }
      record(tx, i, c);
      durable_.release_savepoint(tx);
      executed(i);
    }
  }

  void record(Tx& tx, std::size_t i, const ClaimResult& c) {
    durable_.record_in(tx, calls_[i].key, fingerprints_[i], owner_, response_,
                       core_.options().retention, c);
  }

  void executed(std::size_t i) {
    BatchAnswer& a = answer(i);
    a.outcome = Outcome::kExecuted;
    a.source = Source::kHandler;
  }

  // handler(tx, i), timed when an observer listens.
  template <class Fn>
  void run_handler(Fn& handler, Tx& tx, std::size_t i) {
    if (!timed_) {
      handler(tx, i);
      return;
    }
    const auto t0 = SteadyClock::now();
    try {
      handler(tx, i);
    } catch (...) {
      handler_time_[i] = SteadyClock::now() - t0;
      throw;
    }
    handler_time_[i] = SteadyClock::now() - t0;
  }

  // The record check of call `i` inside `tx` (both passes): true when the call may run (`c`
  // holds the claim); false when an existing record decided it.
  bool claim_record(Tx& tx, std::size_t i, ClaimResult& c) {
    c = durable_.decide_in(tx, calls_[i].key, fingerprints_[i], owner_);
    if (c.status != ClaimStatus::kClaimed) {
      settle(i, c, Source::kDurableStore);
      return false;
    }
    took_over_[i] = c.took_over ? 1 : 0;
    return true;
  }

  // The answer of call `i`, decided by a record a store found (done, mismatch or busy).
  void settle(std::size_t i, ClaimResult& c, Source source) {
    BatchAnswer& a = answer(i);
    a.outcome = c.status == ClaimStatus::kDone       ? Outcome::kReplayed
                : c.status == ClaimStatus::kMismatch ? Outcome::kFingerprintMismatch
                                                     : Outcome::kInProgress;
    a.source = source;
    a.failed = c.status == ClaimStatus::kDone && c.failed;
    a.response = std::move(c.response);
    a.holder = std::move(c.holder);
    a.first_seen = c.first_seen;
    a.expires_at = c.expires_at;
  }

  // The store's idem error for a driver exception a handler's statement threw (the durable
  // store contract's optional typed_error), else `e`.
  std::exception_ptr typed(std::exception_ptr e) const noexcept {
    if constexpr (has_typed_error<Durable>::value) {
      return durable_.typed_error(std::move(e));
    } else {
      return e;
    }
  }

  // True for an idem error that says nothing about the call (e.g. the handler's own
  // StorageTimeout): it aborts the whole batch instead of failing the call alone.
  static bool retryable(const std::exception_ptr& e) noexcept {
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      return err.retryable();
    } catch (...) {
      return false;
    }
  }

  void release_fast(std::size_t i) noexcept {
    try {
      fast_->release(calls_[i].key, owner_);
    } catch (...) {
      // Released once the fast store answers again (else it ends with its lease).
      core_.note_unreleased_claim(calls_[i].key, owner_, core_.options().lease);
    }
  }

  // A failed record the fast store had lost, written back as failed (rare: no batch call).
  void fail_fast(std::size_t i, std::string_view reason) noexcept {
    try {
      // false: the claim expired meanwhile; the durable record answers from now on.
      (void)fast_->fail(calls_[i].key, owner_, reason, core_.options().retention);
    } catch (const StorageError& e) {
      // A follow-up's failure: the calls were decided (not degraded, as in run()).
      core_.fast_burst(calls_[i].key, e);
    } catch (...) {
    }
  }

  // A replayed record the fast store had lost, written over this batch's claim for what is left
  // of its retention (fast_term; none: the claim is released), with what the durable store
  // reported of its first attempt (FastStore::refill).
  void refill_for(std::size_t i, const BatchAnswer& a, std::chrono::seconds term) noexcept {
    if (term.count() <= 0) return release_fast(i);
    try {
      fast_->refill(calls_[i].key, fingerprints_[i], a.response, term,
                    RecordOrigin{a.first_seen, a.holder});
      core_.count_refill();
    } catch (const StorageError& e) {
      core_.fast_burst(calls_[i].key, e);
    } catch (...) {
    }
  }

  // Step 3.
  void finish_fast() {
    const auto retention = core_.options().retention;
    std::vector<CompleteRequest> requests;
    std::vector<std::size_t> index;
    for (std::size_t i = 0; i < n_; ++i) {
      if (fast_claimed_[i] == 0) continue;
      const BatchAnswer& a = answer(i);
      if (a.outcome == Outcome::kExecuted && !a.error) {
        requests.push_back(CompleteRequest{&calls_[i].key, &owner_, response_, &tickets_[i]});
        index.push_back(i);
      } else if (a.outcome == Outcome::kReplayed && a.source == Source::kDurableStore) {
        // The fast store had lost the record: put the durable answer back.
        if (a.failed) {
          fail_fast(i, a.response);
          continue;
        }
        refill_for(i, a, fast_term(retention, a.expires_at));
      } else {
        release_fast(i);  // busy, mismatch or a failed handler
      }
    }
    if (requests.empty()) return;
    try {
      std::vector<bool> ok = fast_->complete_batch(requests, retention);
      for (std::size_t j = 0; j < index.size(); ++j) {
        if (ok[j]) continue;
        // The claim expired meanwhile: the durable answer stands; overwrite the fast record.
        fast_->refill(*requests[j].key, fingerprints_[index[j]], requests[j].response, retention,
                      RecordOrigin{TimePoint{}, owner_.str()});
        core_.count_refill();
      }
    } catch (const StorageError& e) {
      // The durable store replays from now on; a later duplicate refills the fast store. The
      // calls were decided before: not degraded (as a run() call's failed follow-up).
      core_.fast_burst(*requests.front().key, e, requests.size());
    }
  }

  // Each call counted in the guard's stats and told to its observer, as run() would have.
  void report_calls() {
    const auto end = timed_ ? SteadyClock::now() : SteadyClock::time_point{};
    std::chrono::nanoseconds handlers{0};
    for (const auto& h : handler_time_) handlers += h;
    const auto durable =
        transaction_ > handlers ? transaction_ - handlers : std::chrono::nanoseconds{0};
    for (std::size_t i = 0; i < n_; ++i) {
      const BatchAnswer& a = answer(i);
      BatchCallReport c{calls_[i].key, a.outcome, a.source};
      c.fast_claimed = fast_claimed_[i] != 0;
      c.degraded = degraded_;
      c.first_seen = a.first_seen;
      c.holder = a.holder;
      if (timed_) {
        c.fast_claim = fast_claim_;
        if (a.source != Source::kFastStore) c.durable = durable;
        c.handler = handler_time_[i];
        c.total = end - start_;
      }
      if (a.error) {
        core_.report_batch_handler_error(c, a.error);
        continue;
      }
      if (took_over_[i] != 0) core_.takeover(calls_[i].key, "durable");
      core_.report_batch_call(c);
    }
  }

  GuardCore& core_;
  FastStore* fast_;
  Durable& durable_;
  std::vector<BatchCall>& calls_;
  const std::size_t n_;
  const std::string response_;                  // the batch's own copy
  std::string fingerprint_bytes_;               // every call's fingerprint, in order
  std::vector<std::string_view> fingerprints_;  // views into fingerprint_bytes_
  // The batch is one attempt: its claims share one owner token (fencing is per key, so a
  // token only has to differ from other attempts on the same key).
  const OwnerToken owner_ = OwnerToken::generate();
  std::vector<char> first_;           // the first call of its key in the batch
  std::vector<char> fast_claimed_;    // the fast store granted its claim
  std::vector<char> to_durable_;      // decided by the durable store (not by the fast store)
  std::vector<char> took_over_;       // the durable store took an expired lease over
  std::vector<ClaimTicket> tickets_;  // the granted fast claims' tickets, for complete_batch
  BatchResult result_;
  bool fresh_claims_ = false;  // the fast store granted every claim, none a takeover
  bool new_records_ = false;   // first_pass writes the records with the plain insert
  bool likely_new_ = false;    // ... because the calls said their keys are likely new
  bool degraded_ = false;      // the fast store failed for this batch
  // Phase timings, only when an observer listens.
  bool timed_ = false;
  SteadyClock::time_point start_{};
  std::chrono::nanoseconds fast_claim_{0}, transaction_{0};
  std::vector<std::chrono::nanoseconds> handler_time_;
};

}  // namespace idem::detail
