// SPDX-License-Identifier: MIT
// examples/scheduled_job: a compensation job ("close payments stuck in PAYING once they are
// due") fired by several scheduler instances at the same ticks, for any database idem's
// helpers run on (SQLite, PostgreSQL).
//
// Two kinds of key, and both are needed:
//
//   * one key per (job, tick): Key("job.close_unpaid", "tick-<n>"). Every instance fires every
//     tick; the guard lets one of them run it (two-phase: the tick's handler runs the items'
//     own guarded transactions), the others are answered "in progress" or "done" and move on.
//     An instance that finds a tick in progress comes back to it at its next fire, so a tick
//     whose runner crashed is taken over once its lease ends, and a tick nobody fired (all
//     instances paused, a deploy) is caught up at the next fire. None is skipped, none runs
//     twice.
//   * one key per item: Key("payment.settle", <payment_no>), the SAME key the payment's own
//     success callback uses. "Close P" and "P was paid" are two answers to one question (how
//     did P end?), so whichever comes first decides it and the other is answered with that
//     decision: a late success callback after the close replays "closed" (refund the payer)
//     instead of marking a closed payment paid, and a close after the callback replays
//     "paid". A tick key alone would not stop that race; an item key alone would let every
//     instance scan every tick.
//
// A run that crashes half way leaves its committed items done (their records replay) and the
// rest PAYING: the next tick, on any instance, selects them again because they are still due.
// The item's state change and its record commit in one transaction (transactional mode), so a
// crash inside an item rolls both back.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "idem/errors.hpp"
#include "idem/guard.hpp"
#include "idem/key.hpp"
#include "idem/sql.hpp"
#include "idem/sql_driver.hpp"
#include "idem/state_machine.hpp"

namespace scheduled_job {

/// The job's name: the scope of its tick keys.
inline constexpr const char* kJob = "job.close_unpaid";
/// The scope of the per-payment keys, shared by the job and the payment callback.
inline constexpr const char* kSettle = "payment.settle";

/// The key of one tick of the job.
inline idem::Key tick_key(int tick) {
  return idem::Key::make(kJob, "tick-" + std::to_string(tick));
}
/// The key that decides how payment `payment_no` ends (paid or closed).
inline idem::Key settle_key(const std::string& payment_no) {
  return idem::Key::make(kSettle, payment_no);
}

/// Names of the business tables (validated identifiers).
struct Tables {
  /// payment_no, status (PAYING -> PAID | CLOSED), due_tick.
  std::string payments = "sched_payments";
  /// One row per applied effect: payment_no, kind (paid / closed), actor, tick. No unique key
  /// on purpose: the run counts these rows to prove nothing was applied twice.
  std::string effects = "sched_effects";
  /// One row per started tick run: job, tick, instance, fire (the tick at which it was fired),
  /// finished, items.
  std::string runs = "sched_tick_runs";
};

/// The payment lifecycle: PAYING -> PAID (the provider's callback) or CLOSED (the job).
inline idem::StateMachine payment_state_machine(const std::string& table) {
  return idem::StateMachine{
      table, "payment_no", "status", {{"PAYING", "PAID"}, {"PAYING", "CLOSED"}}};
}

/// The statement in `Tx`'s dialect: "?N" placeholders become "$N" on PostgreSQL.
template <class Tx>
std::string in_dialect(std::string sql) {
  if (idem::SqlDriver<Tx>::kDialect == idem::SqlDialect::kPostgres) {
    for (auto& c : sql) {
      if (c == '?') c = '$';
    }
  }
  return sql;
}

/// The per-payment decisions, over a `Backend` whose `Durable::Transaction` has an
/// idem::SqlDriver and an idem::StateMachineDriver. Both go through the guard with the
/// payment's settle key (transactional: the state change, the effect row and the record commit
/// together).
template <class Durable>
class Settlement {
 public:
  using Tx = typename Durable::Transaction;

  Settlement(idem::IdempotencyGuard<Durable>& guard, Tables tables)
      : guard_(guard),
        tables_(std::move(tables)),
        machine_(payment_state_machine(tables_.payments)) {
    idem::check_sql_identifier("effects table", tables_.effects);
  }

  /// The job's compensation: PAYING -> CLOSED. `before_commit` (may be empty) runs inside the
  /// transaction after the state change (the example's crash point).
  /// @return the outcome and the decision ("closed", or "paid" if the callback came first).
  idem::GuardResult<std::string> close(const std::string& payment_no, const std::string& actor,
                                       int tick, const std::function<void()>& before_commit = {}) {
    return decide(payment_no, "CLOSED", "closed", actor, tick, before_commit);
  }

  /// The provider's success callback: PAYING -> PAID.
  /// @return the outcome and the decision ("paid", or "closed" if the job came first: refund).
  idem::GuardResult<std::string> paid(const std::string& payment_no, const std::string& actor) {
    return decide(payment_no, "PAID", "paid", actor, 0, {});
  }

 private:
  idem::GuardResult<std::string> decide(const std::string& payment_no, const char* to,
                                        const char* kind, const std::string& actor, int tick,
                                        const std::function<void()>& before_commit) {
    // No fingerprint: the callback and the job ask the same question with different payloads.
    return guard_.run(settle_key(payment_no), "", [&](Tx& tx) -> std::string {
      auto t = machine_.transition(tx, payment_no, "PAYING", to);
      if (t.kind == idem::Transition::kNotFound) return "missing";
      if (t.kind != idem::Transition::kTransitioned) return lower(t.current);  // defence in depth
      idem::SqlDriver<Tx>::query_int64(
          tx,
          in_dialect<Tx>("INSERT INTO " + tables_.effects +
                         " (payment_no, kind, actor, tick) VALUES (?1, ?2, ?3, ?4) RETURNING 1"),
          payment_no, std::string(kind), actor, static_cast<std::int64_t>(tick));
      if (before_commit) before_commit();
      return kind;
    });
  }

  static std::string lower(std::string s) {
    for (auto& c : s) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    return s;
  }

  idem::IdempotencyGuard<Durable>& guard_;
  Tables tables_;
  idem::StateMachine machine_;
};

/// What one tick run did.
struct TickRun {
  int closed = 0;   ///< payments this run closed
  int decided = 0;  ///< due payments already decided (replayed: a callback, or a crashed run)
  int busy = 0;     ///< due payments another attempt held (left for the next tick)
};

/// One scheduler instance's view of the job. `Backend` provides `due(tick)` (payment numbers
/// PAYING with due_tick <= tick), `start_run(tick, instance, fire)` -> run id and
/// `finish_run(id, items)`, each in its own transaction.
template <class Backend>
class Job {
 public:
  using Durable = typename Backend::Durable;

  /// Hooks for the example's crash: `on_item(tick, index)` runs inside item `index`'s
  /// transaction of a tick run.
  using ItemHook = std::function<void(int tick, int index)>;

  Job(Backend& backend, idem::IdempotencyGuard<Durable>& guard, Tables tables, std::string instance)
      : backend_(backend),
        guard_(guard),
        settlement_(guard, tables),
        instance_(std::move(instance)) {}

  /// What one attempt at a tick found.
  enum class Attempt {
    kRan,   ///< this instance ran it now
    kDone,  ///< it had run (here or elsewhere): skip it for good
    kBusy,  ///< another instance runs it now (or crashed doing so): come back next fire
  };

  /// Tries tick `tick` at fire `fire` (two-phase: the items' transactions run inside).
  /// @throws idem::Error subclasses (a retryable one: try again at the next fire).
  Attempt run_tick(int tick, int fire, TickRun& out, const ItemHook& on_item = {}) {
    auto r = guard_.run(tick_key(tick), "", [&]() -> std::string {
      out = TickRun{};
      std::int64_t run = backend_.start_run(tick, instance_, fire);
      std::vector<std::string> due = backend_.due(tick);
      int index = 0;
      for (const auto& p : due) {
        int i = index++;
        auto d = settlement_.close(p, instance_, tick, [&] {
          if (on_item) on_item(tick, i);
        });
        if (d.outcome == idem::Outcome::kInProgress) {
          ++out.busy;  // still PAYING if the other attempt fails: the next tick selects it
        } else if (d.outcome == idem::Outcome::kExecuted && *d.value == "closed") {
          ++out.closed;
        } else {
          ++out.decided;
        }
      }
      backend_.finish_run(run, out.closed);
      return "tick " + std::to_string(tick) + ": " + std::to_string(out.closed) + " closed";
    });
    switch (r.outcome) {
      case idem::Outcome::kExecuted:
        return Attempt::kRan;
      case idem::Outcome::kReplayed:
        return Attempt::kDone;
      default:
        return Attempt::kBusy;
    }
  }

  /// The settlement (the callback side uses it too).
  Settlement<Durable>& settlement() noexcept { return settlement_; }

 private:
  Backend& backend_;
  idem::IdempotencyGuard<Durable>& guard_;
  Settlement<Durable> settlement_;
  std::string instance_;
};

}  // namespace scheduled_job
