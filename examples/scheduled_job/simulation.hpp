// SPDX-License-Identifier: MIT
// The run of examples/scheduled_job: the seeded payments, one scheduler instance's loop (fire
// every tick, catch up what is open), the payment callbacks that race the job, and the checks
// read back from the database.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "idem/guard.hpp"
#include "job.hpp"
#include "state.hpp"

namespace scheduled_job {

/// Sizes and behaviour of one run.
struct Config {
  /// Scheduler processes firing the job.
  int schedulers = 3;
  /// Ticks of the job (1..ticks).
  int ticks = 20;
  /// Time between ticks.
  std::chrono::milliseconds period{150};
  /// Lease of a tick run: how long a crashed run blocks its tick before another instance
  /// takes it over.
  std::chrono::milliseconds lease{1000};
  /// Payments stuck in PAYING, due at a uniform tick in 1..ticks+3 (some never due in the run).
  int payments = 200;
  /// Percent of payments whose success callback arrives during the run (twice: the provider
  /// retries), some before the job closes them, some after (late).
  int callback_percent = 25;
  /// The tick no instance fires (all paused): caught up at the next fire. 0: none.
  int missed_tick = 5;
  /// The last scheduler is killed (kill -9) inside the first tick >= this it runs, while
  /// item `kill_after_items` of that tick is in its transaction. 0: no kill.
  int kill_at_tick = 8;
  /// See kill_at_tick.
  int kill_after_items = 3;
  /// Random seed (0: random; resolved once and handed to the schedulers).
  std::uint64_t seed = 0;
};

/// The seeded payments of `cfg` (deterministic in cfg.seed).
inline std::vector<PaymentSeed> make_payments(const Config& cfg) {
  std::mt19937_64 rng(cfg.seed);
  std::vector<PaymentSeed> out;
  for (int i = 0; i < cfg.payments; ++i) {
    char no[32];
    std::snprintf(no, sizeof no, "PAY-%04d", i);
    out.push_back(
        PaymentSeed{no, 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(cfg.ticks + 3))});
  }
  return out;
}

/// The guard options of the job: the tick lease.
inline idem::GuardOptions guard_options(const Config& cfg) {
  idem::GuardOptions o;
  o.lease = cfg.lease;
  return o;
}

/// What one scheduler did.
struct SchedulerStats {
  int ran = 0;     ///< ticks this instance ran
  int done = 0;    ///< attempts answered "already run"
  int busy = 0;    ///< attempts answered "in progress elsewhere" (retried at the next fire)
  int closed = 0;  ///< payments its runs closed
  int skipped_fires = 0;
  int errors = 0;  ///< retryable errors (retried at the next fire)
};

/// One scheduler instance: fires every tick at start + tick * period + skew, and each time
/// runs every tick up to the current one it has not seen completed (so a tick that was in
/// progress elsewhere, or that nobody fired, is taken care of at a later fire). After the last
/// tick it keeps catching up until every tick is done (or 4 leases passed).
template <class Backend>
SchedulerStats run_scheduler(Backend& backend, const Config& cfg, const std::string& instance,
                             std::chrono::system_clock::time_point start,
                             std::chrono::milliseconds skew,
                             const typename Job<Backend>::ItemHook& on_item = {}) {
  using Durable = typename Backend::Durable;
  idem::IdempotencyGuard<Durable> guard{backend.durable(), guard_options(cfg)};
  Job<Backend> job{backend, guard, backend.tables(), instance};
  SchedulerStats st;
  std::set<int> done;
  auto catch_up = [&](int upto, int fire) {
    for (int t = 1; t <= upto; ++t) {
      if (done.count(t) != 0) continue;
      TickRun run;
      try {
        switch (job.run_tick(t, fire, run, on_item)) {
          case Job<Backend>::Attempt::kRan:
            ++st.ran;
            st.closed += run.closed;
            done.insert(t);
            break;
          case Job<Backend>::Attempt::kDone:
            ++st.done;
            done.insert(t);
            break;
          case Job<Backend>::Attempt::kBusy:
            ++st.busy;
            break;
        }
      } catch (const idem::Error& e) {
        // A lost lease (this run was too slow and was taken over) or a store hiccup: the tick
        // is still open for this instance; the next fire looks again.
        ++st.errors;
        if (!e.retryable()) throw;
      }
    }
  };
  std::mt19937_64 rng(cfg.seed ^ std::hash<std::string>{}(instance));
  for (int fire = 1; fire <= cfg.ticks; ++fire) {
    // Each fire a little late, by a different amount each time (timers, load): the instances
    // take turns winning the ticks.
    auto jitter = std::chrono::milliseconds(rng() % 15);
    std::this_thread::sleep_until(start + fire * cfg.period + skew + jitter);
    if (fire == cfg.missed_tick) {  // every instance is paused at this tick
      ++st.skipped_fires;
      continue;
    }
    catch_up(fire, fire);
  }
  auto deadline = std::chrono::system_clock::now() + 4 * cfg.lease;
  while (static_cast<int>(done.size()) < cfg.ticks && std::chrono::system_clock::now() < deadline) {
    std::this_thread::sleep_for(cfg.period);
    catch_up(cfg.ticks, cfg.ticks + 1);
  }
  return st;
}

/// The callbacks of one payment, as the provider sent them.
struct CallbackAnswers {
  std::vector<std::string> answers;  ///< "paid", or "closed" (late: refund), or "!error"
};

/// Sends the success callbacks of the chosen payments at random times during the run, each
/// twice (the provider retries), through the payment's settle key.
template <class Backend>
std::map<std::string, CallbackAnswers> send_callbacks(Backend& backend, const Config& cfg,
                                                      const std::vector<PaymentSeed>& payments,
                                                      std::chrono::system_clock::time_point start) {
  using Durable = typename Backend::Durable;
  idem::IdempotencyGuard<Durable> guard{backend.durable(), guard_options(cfg)};
  Settlement<Durable> settlement{guard, backend.tables()};
  std::mt19937_64 rng(cfg.seed * 31 + 7);
  struct Send {
    std::chrono::system_clock::time_point at;
    std::string payment_no;
  };
  std::vector<Send> sends;
  const auto span = (cfg.ticks + 2) * cfg.period;
  for (const auto& p : payments) {
    if (static_cast<int>(rng() % 100) >= cfg.callback_percent) continue;
    auto at = start + std::chrono::milliseconds(rng() % static_cast<std::uint64_t>(span.count()));
    sends.push_back(Send{at, p.payment_no});
    sends.push_back(Send{at + std::chrono::milliseconds(5 + rng() % 20), p.payment_no});
  }
  std::sort(sends.begin(), sends.end(), [](const Send& a, const Send& b) { return a.at < b.at; });
  std::map<std::string, CallbackAnswers> out;
  for (const auto& s : sends) {
    std::this_thread::sleep_until(s.at);
    std::string answer;
    for (int attempt = 0; attempt < 500 && answer.empty(); ++attempt) {
      try {
        auto r = settlement.paid(s.payment_no, "callback");
        if (r.ok()) {
          answer = *r.value;
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the job holds it now
        }
      } catch (const idem::Error& e) {
        if (!e.retryable()) answer = "!" + std::string(e.what());
        // An outage (a database restart): back off, as a gateway retrying its callback does,
        // so that the 500 attempts span seconds, not a few milliseconds.
        std::this_thread::sleep_for(std::chrono::milliseconds(std::min(20 + 10 * attempt, 200)));
      }
    }
    out[s.payment_no].answers.push_back(answer.empty() ? "!no answer" : answer);
  }
  return out;
}

/// One check of the end state.
struct Check {
  std::string name;
  bool ok = false;
  std::string detail;
};

/// The outcome of a run.
struct Report {
  Config config;
  std::string backend, where;
  std::vector<SchedulerStats> schedulers;
  std::vector<int> exit_status;  ///< per scheduler
  bool killed = false;           ///< the kill was sent
  int killed_tick = 0;           ///< the tick the killed scheduler was in
  std::string killed_instance;
  std::map<std::string, CallbackAnswers> callbacks;
  State state;
  std::chrono::milliseconds elapsed{0};
  int closed = 0, paid = 0, late_callbacks = 0, not_due = 0, still_paying = 0;
  std::vector<Check> checks;
  std::vector<std::string> samples;

  bool ok() const {
    return std::all_of(checks.begin(), checks.end(), [](const Check& c) { return c.ok; });
  }
};

/// Fills the checks from the database state, the callbacks' answers and the processes' exits.
inline void evaluate(Report& rep) {
  const Config& cfg = rep.config;
  const State& s = rep.state;
  auto add = [&](std::string name, bool ok, std::string detail) {
    rep.checks.push_back(Check{std::move(name), ok, std::move(detail)});
  };
  auto sample = [&](std::string x) {
    if (rep.samples.size() < 8) rep.samples.push_back(std::move(x));
  };

  // Ticks.
  std::map<int, int> started, finished;
  std::map<int, const RunRow*> finished_run;
  for (const auto& r : s.runs) {
    ++started[r.tick];
    if (r.finished) {
      ++finished[r.tick];
      finished_run[r.tick] = &r;
    }
  }
  int not_once = 0;
  for (int t = 1; t <= cfg.ticks; ++t) {
    if (finished[t] != 1) {
      ++not_once;
      sample("tick " + std::to_string(t) + " ran to the end " + std::to_string(finished[t]) +
             " times");
    }
  }
  add("every tick 1.." + std::to_string(cfg.ticks) + " ran to the end exactly once (none skipped)",
      not_once == 0 && finished.size() == static_cast<std::size_t>(cfg.ticks),
      std::to_string(finished.size()) + " ticks finished, " + std::to_string(not_once) +
          " not exactly once");
  int restarted = 0;
  bool restart_is_the_kill = true;
  for (const auto& [t, n] : started) {
    if (n == 1) continue;
    ++restarted;
    bool ok = rep.killed && t == rep.killed_tick && n == 2;
    for (const auto& r : s.runs) {
      if (r.tick == t && !r.finished && r.instance != rep.killed_instance) ok = false;
    }
    if (!ok) {
      restart_is_the_kill = false;
      sample("tick " + std::to_string(t) + " was started " + std::to_string(n) + " times");
    }
  }
  add("no tick started twice, except the one whose scheduler was killed (taken over after its "
      "lease)",
      restart_is_the_kill && restarted == (rep.killed ? 1 : 0),
      std::to_string(restarted) + " ticks started twice");
  if (cfg.kill_at_tick > 0) {
    bool unfinished = false;
    int committed = 0;  // payments the killed run closed before it died
    for (const auto& r : s.runs) {
      if (r.tick == rep.killed_tick && r.instance == rep.killed_instance && !r.finished) {
        unfinished = true;
      }
    }
    for (const auto& e : s.effects) {
      if (e.actor == rep.killed_instance && e.tick == rep.killed_tick) ++committed;
    }
    int status = rep.exit_status.empty() ? -1 : rep.exit_status.back();
    add("a scheduler was killed (kill -9) in the middle of a tick run",
        rep.killed && status == 137 && unfinished,
        rep.killed ? rep.killed_instance + " in tick " + std::to_string(rep.killed_tick) +
                         " after closing " + std::to_string(committed) + " payments, exit status " +
                         std::to_string(status)
                   : std::string("no kill happened"));
  }
  if (cfg.missed_tick > 0 && cfg.missed_tick <= cfg.ticks) {
    auto it = finished_run.find(cfg.missed_tick);
    bool late = it != finished_run.end() && it->second->fire > cfg.missed_tick;
    add("the tick nobody fired (" + std::to_string(cfg.missed_tick) + ") was caught up later", late,
        it == finished_run.end()
            ? "never ran"
            : "ran at tick " + std::to_string(it->second->fire) + " by " + it->second->instance);
  }

  // Payments.
  std::map<std::string, std::vector<const EffectRow*>> effects;
  for (const auto& e : s.effects) effects[e.payment_no].push_back(&e);
  int due_not_once = 0, not_due_closed = 0, both = 0, status_mismatch = 0;
  for (const auto& [no, p] : s.payments) {
    const auto& es = effects[no];
    bool due = p.due_tick <= cfg.ticks;
    if (!due) ++rep.not_due;
    if (due && es.size() != 1) {
      ++due_not_once;
      sample(no + " (due at tick " + std::to_string(p.due_tick) + ") has " +
             std::to_string(es.size()) + " effects");
    }
    std::set<std::string> kinds;
    for (const auto* e : es) kinds.insert(e->kind);
    if (kinds.size() > 1 || es.size() > 1) ++both;
    if (!due && kinds.count("closed") != 0) ++not_due_closed;
    std::string expected = es.empty() ? "PAYING" : es[0]->kind == "paid" ? "PAID" : "CLOSED";
    if (p.status != expected) {
      ++status_mismatch;
      sample(no + " is " + p.status + " with effect " + expected);
    }
    if (p.status == "CLOSED") ++rep.closed;
    if (p.status == "PAID") ++rep.paid;
    if (p.status == "PAYING") ++rep.still_paying;
  }
  add("every due payment decided exactly once (one effect row each)", due_not_once == 0,
      std::to_string(rep.closed) + " closed, " + std::to_string(rep.paid) + " paid, " +
          std::to_string(due_not_once) + " due payments not decided exactly once");
  add("no payment both paid and closed (a late callback replays the close)", both == 0,
      std::to_string(both) + " with two effects");
  add("payments not due yet untouched by the job", not_due_closed == 0,
      std::to_string(rep.not_due) + " not due, " + std::to_string(not_due_closed) + " closed");
  add("every status matches its effect", status_mismatch == 0,
      std::to_string(status_mismatch) + " mismatches");

  int wrong_answers = 0, callbacks = 0;
  for (const auto& [no, c] : rep.callbacks) {
    auto p = s.payments.find(no);
    std::string final_state = p == s.payments.end() ? "?" : p->second.status;
    for (auto& ch : final_state)
      ch = static_cast<char>(ch >= 'A' && ch <= 'Z' ? ch - 'A' + 'a' : ch);
    bool late = false;
    for (const auto& a : c.answers) {
      ++callbacks;
      if (a != final_state) {
        ++wrong_answers;
        sample("callback of " + no + " answered " + a + ", payment is " + final_state);
      }
      late = late || a == "closed";
    }
    if (late) ++rep.late_callbacks;
  }
  add("every callback answered with the payment's decision", wrong_answers == 0,
      std::to_string(callbacks) + " callbacks, " + std::to_string(rep.late_callbacks) +
          " payments told \"closed\" (late: refund the payer), " + std::to_string(wrong_answers) +
          " wrong");
  add("no idempotency record in progress; one completed record per tick",
      s.records_in_progress == 0 && s.ticks_completed == cfg.ticks,
      std::to_string(s.records_in_progress) + " in progress, " + std::to_string(s.ticks_completed) +
          " tick records");
  int bad_exit = 0;
  for (std::size_t i = 0; i < rep.exit_status.size(); ++i) {
    bool victim = rep.killed && i + 1 == rep.exit_status.size();
    if (!victim && rep.exit_status[i] != 0) ++bad_exit;
  }
  add("every other scheduler process finished cleanly", bad_exit == 0,
      std::to_string(bad_exit) + " did not");
}

/// Prints the summary, the checks and PASS/FAIL.
inline void print_report(const Report& r, std::ostream& out) {
  const auto& c = r.config;
  out << "scheduled job: " << c.schedulers << " scheduler processes x " << c.ticks << " ticks of "
      << c.period.count() << " ms, " << c.payments << " payments stuck in PAYING, backend "
      << r.backend << " (" << r.where << ")\n";
  SchedulerStats sum;
  for (const auto& s : r.schedulers) {
    sum.ran += s.ran;
    sum.done += s.done;
    sum.busy += s.busy;
    sum.errors += s.errors;
  }
  out << "  ticks: " << sum.done << " attempts answered \"already run\", " << sum.busy
      << " answered \"in progress elsewhere\" (looked at again next fire), " << sum.errors
      << " retryable errors; tick " << c.missed_tick << " fired by nobody";
  if (r.killed) {
    out << "; " << r.killed_instance << " killed (kill -9) inside tick " << r.killed_tick;
  }
  out << " (" << r.elapsed.count() << " ms)\n";
  std::map<std::string, std::vector<int>> ran;  // from the database: the killed one's too
  std::map<std::string, int> closed;
  for (const auto& run : r.state.runs) {
    if (run.finished) ran[run.instance].push_back(run.tick);
  }
  for (const auto& e : r.state.effects) {
    if (e.kind == "closed") ++closed[e.actor];
  }
  for (int i = 0; i < c.schedulers; ++i) {
    const std::string name = "scheduler-" + std::to_string(i);
    out << "    " << name << ": ran ticks";
    for (int t : ran[name]) out << " " << t;
    if (ran[name].empty()) out << " (none)";
    out << "; closed " << closed[name] << " payments"
        << (r.killed && name == r.killed_instance ? " (killed)" : "") << "\n";
  }
  out << "  payments: " << r.closed << " closed by the job, " << r.paid
      << " paid by their callback; " << r.late_callbacks
      << " payments' callbacks came after the close (answered \"closed\": refund the payer); "
      << r.still_paying << " still PAYING (not due in the run)\n";
  for (const auto& ch : r.checks) {
    out << "  check " << (ch.ok ? "ok  " : "FAIL") << "  " << ch.name << " (" << ch.detail << ")\n";
  }
  for (const auto& s : r.samples) out << "    e.g. " << s << "\n";
  out << (r.ok() ? "PASS" : "FAIL") << "\n";
}

}  // namespace scheduled_job
