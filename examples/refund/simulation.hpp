// SPDX-License-Identifier: MIT
// The refund run of examples/refund: a deterministic plan (orders, refund requests, who sends
// each request how often), the worker loop that sends them, the sweep of abandoned refunds,
// and the checks read back from both ledgers (the merchant's database and the provider's).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <ostream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "idem/memory_store.hpp"
#include "ledger.hpp"
#include "provider_stub.hpp"
#include "refund.hpp"

namespace refund {

/// Sizes and behaviour of one run.
struct Config {
  /// Orders (order 0 is the fixed cap case: 3 requests of 5000 on 10000 paid).
  int orders = 40;
  /// Distinct refund requests per order: 1..max_requests.
  int max_requests = 5;
  /// Sends per request (a double submit, a second agent, a retry after a timeout): 1..max_sends,
  /// spread over the processes.
  int max_sends = 3;
  /// Worker processes sharing the database (0: the workers' loop runs in this process).
  int processes = 3;
  /// Threads per worker.
  int threads = 4;
  /// Percent of requests whose client gives up after a provider failure (the sweep completes
  /// them).
  int abandon_percent = 5;
  /// Random seed (0: random; resolved once and handed to the workers).
  std::uint64_t seed = 0;
  /// The provider stub.
  ProviderStubOptions provider;
};

/// One planned request and who sends it.
struct PlannedRequest {
  Request request;
  std::vector<int> senders;  ///< worker index of each send
  bool abandon = false;      ///< its client gives up after a provider failure
};

/// Everything a run does, derived from the seed (every worker derives the same plan).
struct Plan {
  std::vector<OrderSeed> orders;
  std::vector<PlannedRequest> requests;
};

/// The plan of `cfg` (deterministic in cfg.seed).
inline Plan make_plan(const Config& cfg) {
  Plan p;
  std::mt19937_64 rng(cfg.seed);
  const int workers = std::max(1, cfg.processes);
  const std::int64_t amounts[] = {1000, 2000, 2500, 3000, 5000};
  for (int i = 0; i < cfg.orders; ++i) {
    char no[32];
    std::snprintf(no, sizeof no, "ORD-%04d", i);
    int roll = static_cast<int>(rng() % 100);
    std::string status = i == 0 || roll >= 20 ? "PAID" : roll < 10 ? "WAIT_PAY" : "CANCELLED";
    p.orders.push_back(OrderSeed{no, 10000, status});
    int n = i == 0 ? 3 : 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(cfg.max_requests));
    for (int j = 0; j < n; ++j) {
      PlannedRequest r;
      r.request.order_no = no;
      r.request.request_id =
          "rf-" + std::to_string(cfg.seed % 1000000) + "-" + no + "-" + std::to_string(j);
      r.request.amount = i == 0 ? 5000 : amounts[rng() % 5];
      int sends = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(cfg.max_sends));
      for (int s = 0; s < sends; ++s) r.senders.push_back(static_cast<int>(rng() % workers));
      r.abandon = static_cast<int>(rng() % 100) < cfg.abandon_percent;
      p.requests.push_back(std::move(r));
    }
  }
  return p;
}

/// What one worker did.
struct WorkerStats {
  std::uint64_t sends = 0, attempts = 0, in_progress = 0, provider_failures = 0,
                retryable_errors = 0, abandoned = 0;
  WorkerStats& operator+=(const WorkerStats& o) {
    sends += o.sends;
    attempts += o.attempts;
    in_progress += o.in_progress;
    provider_failures += o.provider_failures;
    retryable_errors += o.retryable_errors;
    abandoned += o.abandoned;
    return *this;
  }
};

/// Prefix of answers that are not final: the client gave up.
inline constexpr const char* kAbandoned = "~abandoned";

/// Sends one request until it gets a final answer (or its client gives up): in progress
/// elsewhere and retryable errors wait and retry, a provider failure retries with the same
/// request (or gives up if `abandon`). The client retries for longer than a lease (kRetryFor):
/// a handler that failed during a database outage cannot release its claim either, and the
/// record then stays in progress until its lease ends. @return the answer text, kAbandoned, or
/// "!<error>".
inline constexpr std::chrono::seconds kRetryFor{30};
template <class Desk>
std::string send_until_final(Desk& desk, const Request& req, bool abandon, WorkerStats& st) {
  const auto give_up_at = std::chrono::steady_clock::now() + kRetryFor;
  for (int attempt = 0; std::chrono::steady_clock::now() < give_up_at; ++attempt) {
    ++st.attempts;
    // Short pauses first (another thread finishes within milliseconds), then up to 100 ms.
    const auto pause = std::chrono::milliseconds(std::min(3 + attempt, 100));
    try {
      auto r = desk.refund(req);
      if (r.ok()) return *r.value;
      if (r.outcome == idem::Outcome::kFingerprintMismatch) return "!fingerprint_mismatch";
      ++st.in_progress;  // another process or thread runs it now
      std::this_thread::sleep_for(pause);
    } catch (const ProviderError&) {
      ++st.provider_failures;
      if (abandon) {
        ++st.abandoned;
        return kAbandoned;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    } catch (const idem::Error& e) {
      if (!e.retryable()) return "!" + std::string(idem::errc_name(e.code())) + ": " + e.what();
      ++st.retryable_errors;
      std::this_thread::sleep_for(pause);
    } catch (const std::exception& e) {
      return std::string("!") + e.what();
    }
  }
  return "!gave up after " + std::to_string(kRetryFor.count()) + " s";
}

/// One send's answer, as a worker reports it.
struct SentAnswer {
  std::string request_id;
  std::string answer;
};

/// Worker `index`'s share of the plan, on `threads` threads. Sends are taken roughly in plan
/// order (every worker the same), so the sends of one request overlap across processes.
template <class Desk>
std::vector<SentAnswer> run_worker(Desk& desk, const Plan& plan, int index, int threads,
                                   std::uint64_t seed, WorkerStats& stats) {
  struct Task {
    std::size_t request;
    std::uint64_t order;
  };
  std::vector<Task> tasks;
  std::mt19937_64 rng(seed * 7919 + static_cast<std::uint64_t>(index));
  for (std::size_t i = 0; i < plan.requests.size(); ++i) {
    for (int s : plan.requests[i].senders) {
      if (s == index) tasks.push_back(Task{i, i * 8 + rng() % 24});
    }
  }
  std::sort(tasks.begin(), tasks.end(),
            [](const Task& a, const Task& b) { return a.order < b.order; });
  std::vector<SentAnswer> answers(tasks.size());
  std::atomic<std::size_t> next{0};
  std::mutex mu;
  auto loop = [&] {
    WorkerStats local;
    for (;;) {
      std::size_t t = next.fetch_add(1);
      if (t >= tasks.size()) break;
      const PlannedRequest& pr = plan.requests[tasks[t].request];
      ++local.sends;
      answers[t] =
          SentAnswer{pr.request.request_id, send_until_final(desk, pr.request, pr.abandon, local)};
    }
    std::lock_guard<std::mutex> lock(mu);
    stats += local;
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < std::max(1, threads); ++i) pool.emplace_back(loop);
  for (auto& t : pool) t.join();
  return answers;
}

/// Writes a worker's answers and counters to `path` (tab-separated lines).
inline void write_answers(const std::string& path, const std::vector<SentAnswer>& answers,
                          const WorkerStats& st) {
  std::ofstream out(path, std::ios::trunc);
  for (const auto& a : answers) out << "A\t" << a.request_id << "\t" << a.answer << "\n";
  out << "S\t" << st.sends << "\t" << st.attempts << "\t" << st.in_progress << "\t"
      << st.provider_failures << "\t" << st.retryable_errors << "\t" << st.abandoned << "\n";
}

/// Reads what write_answers wrote. @return false when the file is missing or has no counters
/// line (the worker did not finish).
inline bool read_answers(const std::string& path, std::vector<SentAnswer>& answers,
                         WorkerStats& st) {
  std::ifstream in(path);
  std::string line;
  bool finished = false;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string tag;
    std::getline(f, tag, '\t');
    if (tag == "A") {
      SentAnswer a;
      std::getline(f, a.request_id, '\t');
      std::getline(f, a.answer);
      answers.push_back(std::move(a));
    } else if (tag == "S") {
      WorkerStats w;
      f >> w.sends >> w.attempts >> w.in_progress >> w.provider_failures >> w.retryable_errors >>
          w.abandoned;
      st += w;
      finished = true;
    }
  }
  return finished;
}

/// Completes every refund left PENDING (its client gave up after a provider failure): the same
/// request through the same guard key, so the provider sees the same refund id. This is the
/// compensation job a service runs on a schedule.
/// @return request id -> the answer it got.
template <class Desk, class Backend>
std::map<std::string, std::string> sweep_pending(Desk& desk, Backend& backend) {
  std::map<std::string, std::string> done;
  Ledger l = backend.read();
  for (const auto& [id, row] : l.refunds) {
    if (row.status != "PENDING") continue;
    WorkerStats ignored;
    done[id] = send_until_final(desk, Request{id, row.order_no, row.amount}, false, ignored);
  }
  return done;
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
  std::string backend;
  std::string where;
  std::size_t requests = 0;
  WorkerStats workers;
  int worker_failures = 0;  ///< worker processes that did not finish cleanly
  std::map<std::string, std::string> swept;
  Ledger ledger;
  std::map<std::string, ProviderRefund> provider;
  ProviderStats provider_stats;
  std::int64_t refunded_total = 0, refunds_succeeded = 0;
  std::size_t rejected_exceeds = 0, rejected_state = 0, orders_refunded_fully = 0,
              orders_partially = 0;
  std::chrono::milliseconds elapsed{0};
  std::vector<Check> checks;
  std::vector<std::string> samples;

  bool ok() const {
    return std::all_of(checks.begin(), checks.end(), [](const Check& c) { return c.ok; });
  }
};

/// Fills `rep.checks` from the plan, the answers every worker reported, and both ledgers.
inline void evaluate(Report& rep, const Plan& plan, const std::vector<SentAnswer>& answers) {
  auto add = [&](std::string name, bool ok, std::string detail) {
    rep.checks.push_back(Check{std::move(name), ok, std::move(detail)});
  };
  auto sample = [&](std::string s) {
    if (rep.samples.size() < 8) rep.samples.push_back(std::move(s));
  };
  const Ledger& l = rep.ledger;
  std::map<std::string, std::string> seed_status;
  for (const auto& o : plan.orders) seed_status[o.order_no] = o.status;

  // Money: per order, the refund rows add up to `refunded` and never exceed `paid`.
  std::map<std::string, std::int64_t> sums;
  for (const auto& [id, row] : l.refunds) sums[row.order_no] += row.amount;
  int over = 0, drift = 0, bad_state = 0, touched_unpaid = 0;
  for (const auto& [no, o] : l.orders) {
    std::int64_t sum = sums.count(no) != 0 ? sums[no] : 0;
    if (sum > o.paid || o.refunded > o.paid) {
      ++over;
      sample(no + ": paid " + std::to_string(o.paid) + ", refunds add up to " +
             std::to_string(sum));
    }
    if (sum != o.refunded) ++drift;
    std::string expected = seed_status[no];
    if (expected == "PAID") {
      expected = o.refunded == 0 ? "PAID" : o.refunded < o.paid ? "PARTIALLY_REFUNDED" : "REFUNDED";
      if (o.refunded == o.paid) ++rep.orders_refunded_fully;
      if (o.refunded > 0 && o.refunded < o.paid) ++rep.orders_partially;
    } else if (o.refunded != 0 || sum != 0) {
      ++touched_unpaid;
    }
    if (o.status != expected) {
      ++bad_state;
      sample(no + ": status " + o.status + ", expected " + expected);
    }
  }
  add("no order refunded beyond what was paid", over == 0,
      std::to_string(over) + " over-refunded of " + std::to_string(l.orders.size()));
  add("refunded = the sum of the order's refund rows", drift == 0,
      std::to_string(drift) + " orders differ");
  add("status follows the amounts: PAID -> PARTIALLY_REFUNDED -> REFUNDED", bad_state == 0,
      std::to_string(rep.orders_partially) + " partially, " +
          std::to_string(rep.orders_refunded_fully) + " fully refunded; " +
          std::to_string(bad_state) + " wrong");
  add("unpaid and cancelled orders never refunded", touched_unpaid == 0,
      std::to_string(touched_unpaid) + " touched");

  // The provider's ledger is the merchant's: one booking per refund id, same amount and ref.
  int pending = 0, provider_mismatch = 0, unretried_lost = 0;
  for (const auto& [id, row] : l.refunds) {
    if (row.status != "SUCCEEDED") ++pending;
    auto it = rep.provider.find(id);
    if (it == rep.provider.end() || it->second.amount != row.amount ||
        it->second.order_no != row.order_no || it->second.ref != row.provider_ref) {
      ++provider_mismatch;
      sample("refund " + id + ": merchant " + std::to_string(row.amount) + " " + row.provider_ref +
             ", provider " +
             (it == rep.provider.end() ? std::string("none")
                                       : std::to_string(it->second.amount) + " " + it->second.ref));
    }
    if (it != rep.provider.end() && it->second.calls < it->second.lost + 1) ++unretried_lost;
    if (row.status == "SUCCEEDED") {
      ++rep.refunds_succeeded;
      rep.refunded_total += row.amount;
    }
  }
  for (const auto& [id, p] : rep.provider) {
    if (l.refunds.count(id) == 0) {
      ++provider_mismatch;
      sample("provider booked " + id + " (" + std::to_string(p.amount) +
             "), the merchant has no such refund");
    }
  }
  add("no refund left pending (abandoned ones completed by the sweep)", pending == 0,
      std::to_string(pending) + " pending; " + std::to_string(rep.swept.size()) + " swept");
  add("the provider booked each refund once, with the merchant's amount and reference",
      provider_mismatch == 0,
      std::to_string(rep.provider.size()) + " bookings, " + std::to_string(provider_mismatch) +
          " differ");
  add("every answer the provider lost was retried with the same refund id",
      unretried_lost == 0 && rep.provider_stats.deduplicated >= rep.provider_stats.lost_answers,
      std::to_string(rep.provider_stats.lost_answers) + " lost answers, " +
          std::to_string(rep.provider_stats.deduplicated) + " de-duplicated calls");

  // Answers: every send of a request got the same final answer, and it matches the database.
  std::map<std::string, std::set<std::string>> by_request;
  int errors = 0;
  for (const auto& a : answers) {
    if (a.answer == kAbandoned) continue;
    by_request[a.request_id].insert(a.answer);
    if (!a.answer.empty() && a.answer[0] == '!') {
      ++errors;
      sample("request " + a.request_id + ": " + a.answer);
    }
  }
  int differing = 0, wrong = 0, unanswered = 0, unpaid_wrong = 0;
  for (const auto& pr : plan.requests) {
    const std::string& id = pr.request.request_id;
    auto row = l.refunds.find(id);
    auto it = by_request.find(id);
    if (it == by_request.end()) {
      // Every send was abandoned: the sweep must have completed it.
      if (row == l.refunds.end() || rep.swept.count(id) == 0) ++unanswered;
      continue;
    }
    if (it->second.size() != 1) {
      ++differing;
      std::string seen;
      for (const auto& s : it->second) seen += (seen.empty() ? "" : " | ") + s;
      sample("request " + id + " got [" + seen + "]");
      continue;
    }
    const std::string& answer = *it->second.begin();
    std::string expected = row != l.refunds.end()
                               ? refunded_answer(row->second.amount, row->second.provider_ref)
                           : answer.rfind("rejected:", 0) == 0 ? answer
                                                               : "rejected:...";
    // A rejection must still hold against the final ledger (refunded only grows).
    auto order = l.orders.find(pr.request.order_no);
    if (answer == "rejected:exceeds_refundable" && order != l.orders.end() &&
        order->second.refunded + pr.request.amount <= order->second.paid) {
      expected = "a refund (" + std::to_string(order->second.paid - order->second.refunded) +
                 " was still refundable)";
    }
    if (answer == "rejected:order_REFUNDED" && order != l.orders.end() &&
        order->second.status != "REFUNDED") {
      expected = "status " + order->second.status;
    }
    if (answer != expected) {
      ++wrong;
      sample("request " + id + " answered " + answer + ", database says " + expected);
    }
    if (answer == "rejected:exceeds_refundable") ++rep.rejected_exceeds;
    if (answer.rfind("rejected:order_", 0) == 0) ++rep.rejected_state;
    const std::string& st = seed_status[pr.request.order_no];
    if (st != "PAID" && answer != "rejected:order_" + st) ++unpaid_wrong;
  }
  add("every send of a request got the same answer", differing == 0,
      std::to_string(differing) + " requests with differing answers");
  add("every answer matches the database (refunded <-> a refund row)", wrong == 0 && errors == 0,
      std::to_string(wrong) + " wrong, " + std::to_string(errors) + " errors");
  add("every request answered (abandoned ones by the sweep)", unanswered == 0,
      std::to_string(unanswered) + " without an answer");
  add("refunds of unpaid or cancelled orders are a replayed final answer", unpaid_wrong == 0,
      std::to_string(rep.rejected_state) + " rejected:order_<status>, " +
          std::to_string(unpaid_wrong) + " wrong");

  // The fixed case: order 0 has 3 requests of 5000 on 10000 paid.
  if (!plan.orders.empty()) {
    const std::string& no = plan.orders[0].order_no;
    int refunded = 0, exceeds = 0;
    for (const auto& pr : plan.requests) {
      if (pr.request.order_no != no) continue;
      auto it = by_request.find(pr.request.request_id);
      std::string a = it == by_request.end() || it->second.size() != 1 ? "" : *it->second.begin();
      if (l.refunds.count(pr.request.request_id) != 0) ++refunded;
      // The third finds 10000 refunded: the order is REFUNDED by then.
      if (a == "rejected:exceeds_refundable" || a == "rejected:order_REFUNDED") ++exceeds;
    }
    auto o = l.orders.find(no);
    bool ok =
        refunded == 2 && exceeds == 1 && o != l.orders.end() && o->second.status == "REFUNDED";
    add("the cap held on " + no + " (3 x 5000 of 10000 paid: 2 refunded, 1 rejected)", ok,
        std::to_string(refunded) + " refunded, " + std::to_string(exceeds) + " rejected, status " +
            (o == l.orders.end() ? "?" : o->second.status));
  }
  add("one completed idempotency record per request, none in progress",
      l.records_in_progress == 0 &&
          l.records_completed == static_cast<std::int64_t>(plan.requests.size()),
      std::to_string(l.records_completed) + " completed, " + std::to_string(l.records_in_progress) +
          " in progress, " + std::to_string(plan.requests.size()) + " requests");
  add("every worker process finished", rep.worker_failures == 0,
      std::to_string(rep.worker_failures) + " did not");
}

/// Prints the summary, the checks and PASS/FAIL.
inline void print_report(const Report& r, std::ostream& out) {
  const auto& c = r.config;
  out << "refunds: " << c.orders << " orders, " << r.requests << " refund requests sent "
      << r.workers.sends << " times by " << std::max(1, c.processes) << " process(es) x "
      << c.threads << " threads, backend " << r.backend << " (" << r.where << ")\n";
  out << "  traffic: " << r.workers.attempts << " attempts in " << r.elapsed.count() << " ms; "
      << r.workers.in_progress << " \"in progress\" answers, " << r.workers.provider_failures
      << " provider failures retried, " << r.workers.retryable_errors << " retryable errors, "
      << r.workers.abandoned << " abandoned by their client, " << r.swept.size()
      << " completed by the sweep\n";
  out << "  provider: " << r.provider_stats.calls << " calls, " << r.provider_stats.applied
      << " refunds applied, " << r.provider_stats.deduplicated
      << " repeats de-duplicated by refund id, " << r.provider_stats.failed_before
      << " failed before applying, " << r.provider_stats.lost_answers
      << " answers lost after applying\n";
  out << "  ledger: " << r.refunds_succeeded << " refunds, " << r.refunded_total
      << " refunded in total; " << r.rejected_exceeds << " requests rejected (exceeds what is"
      << " left), " << r.rejected_state << " rejected (order not refundable)\n";
  for (const auto& ch : r.checks) {
    out << "  check " << (ch.ok ? "ok  " : "FAIL") << "  " << ch.name << " (" << ch.detail << ")\n";
  }
  for (const auto& s : r.samples) out << "    e.g. " << s << "\n";
  out << (r.ok() ? "PASS" : "FAIL") << "\n";
}

}  // namespace refund
