// SPDX-License-Identifier: MIT
// examples/refund: partial refunds of paid orders, requested by several processes at once with
// double submits and retries, against a slow provider that fails sometimes; checked from the
// merchant's database and the provider's ledger afterwards.
//
//   idem_refund [--orders N] [--max-requests N] [--max-sends N] [--processes N] [--threads N]
//               [--abandon-percent N] [--seed N] [--provider-delay-ms N]
//               [--fail-before-percent N] [--lost-answer-percent N] [--provider-db PATH]
//               [--db PATH | --postgres DSN [--prefix P]]
//
// The run: the orders are seeded, then N worker processes (copies of this binary) send their
// share of the refund requests on T threads each, all against one database; then the refunds
// whose client gave up are swept (retried with their own key), and both ledgers are read back
// and checked. --processes 0 runs the workers' loop in this process.
//
// Exit status: 0 when every check passed, 1 on any violation, 2 on bad flags, 3 on an error.
#include <chrono>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/child_process.hpp"
#include "simulation.hpp"
#include "sqlite_backend.hpp"
#ifdef REFUND_WITH_POSTGRES
#include "postgres_backend.hpp"
#endif

namespace {

void usage(std::ostream& out) {
  out << "usage: idem_refund [--orders N] [--max-requests N] [--max-sends N] [--processes N]\n"
         "       [--threads N] [--abandon-percent N] [--seed N] [--provider-delay-ms N]\n"
         "       [--fail-before-percent N] [--lost-answer-percent N] [--provider-db PATH]\n"
         "       [--db PATH | --postgres DSN [--prefix P]]\n"
         "defaults: 40 orders, 1-5 requests each sent 1-3 times, 3 processes x 4 threads,\n"
         "db refund.sqlite; the provider waits 0-8 ms, fails 10% before and 10% after applying\n";
}

long long number(const std::string& flag, const char* text, long long min, long long max) {
  char* end = nullptr;
  long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || v < min || v > max) {
    throw std::invalid_argument(flag + " needs an integer in " + std::to_string(min) + ".." +
                                std::to_string(max) + ", got '" + text + "'");
  }
  return v;
}

struct Args {
  refund::Config cfg;
  std::string db = "refund.sqlite";
  std::string dsn;
  std::string prefix;
  int worker = -1;  // >= 0: run as worker `worker` and write to `answers`
  std::string answers;
  bool provider_db_given = false;
  std::vector<std::string> forwarded;  // the flags a worker gets again
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const char* v = argv[++i];
    bool forward = true;
    auto& c = a.cfg;
    if (flag == "--orders")
      c.orders = static_cast<int>(number(flag, v, 1, 100000));
    else if (flag == "--max-requests")
      c.max_requests = static_cast<int>(number(flag, v, 1, 50));
    else if (flag == "--max-sends")
      c.max_sends = static_cast<int>(number(flag, v, 1, 50));
    else if (flag == "--processes")
      c.processes = static_cast<int>(number(flag, v, 0, 64));
    else if (flag == "--threads")
      c.threads = static_cast<int>(number(flag, v, 1, 256));
    else if (flag == "--abandon-percent")
      c.abandon_percent = static_cast<int>(number(flag, v, 0, 100));
    else if (flag == "--seed")
      c.seed = static_cast<std::uint64_t>(number(flag, v, 0, 1LL << 62)), forward = false;
    else if (flag == "--provider-delay-ms")
      c.provider.max_delay = std::chrono::milliseconds(number(flag, v, 0, 10000));
    else if (flag == "--fail-before-percent")
      c.provider.fail_before_percent = static_cast<int>(number(flag, v, 0, 90));
    else if (flag == "--lost-answer-percent")
      c.provider.lost_answer_percent = static_cast<int>(number(flag, v, 0, 90));
    else if (flag == "--provider-db")
      c.provider.path = v, a.provider_db_given = true, forward = false;
    else if (flag == "--db")
      a.db = v;
    else if (flag == "--postgres")
      a.dsn = v;
    else if (flag == "--prefix")
      a.prefix = v;
    else if (flag == "--worker")
      a.worker = static_cast<int>(number(flag, v, 0, 63)), forward = false;
    else if (flag == "--answers")
      a.answers = v, forward = false;
    else
      throw std::invalid_argument("unknown flag " + flag);
    if (forward) {
      a.forwarded.push_back(flag);
      a.forwarded.push_back(v);
    }
  }
  if (a.cfg.provider.fail_before_percent + a.cfg.provider.lost_answer_percent > 90) {
    throw std::invalid_argument("the provider must succeed at least 10% of the time");
  }
  if (!a.prefix.empty() && a.dsn.empty())
    throw std::invalid_argument("--prefix goes with --postgres");
#ifndef REFUND_WITH_POSTGRES
  if (!a.dsn.empty()) throw std::invalid_argument("--postgres needs a build with idem::postgres");
#endif
  return a;
}

refund::Tables tables_of(const Args& a) {
  refund::Tables t;
  if (!a.prefix.empty()) {
    t.orders = a.prefix + "orders";
    t.refunds = a.prefix + "refunds";
  }
  return t;
}

idem::GuardOptions guard_options() {
  idem::GuardOptions o;
  o.lease = std::chrono::seconds(10);  // far above the slowest provider call
  // A database that goes away for a moment (a failover, a restart): the record's statements,
  // and the release after a failed handler, are tried again rather than failing the request.
  o.store_attempts = 4;
  return o;
}

// The whole run on one backend (`open()` makes a Backend connected to the run's database).
template <class Open>
int run(const Args& a, Open open, const std::string& where) {
  using Backend = std::decay_t<decltype(*open())>;
  refund::Config cfg = a.cfg;
  auto backend = open();
  idem::MemoryStore fast;  // per process; the durable record is what processes share

  if (a.worker >= 0) {  // a worker: its share of the plan, answers to the file
    refund::ProviderStub provider{cfg.provider};
    refund::RefundDesk<Backend> desk{*backend, fast, provider, guard_options(), tables_of(a)};
    refund::WorkerStats st;
    auto answers =
        refund::run_worker(desk, refund::make_plan(cfg), a.worker, cfg.threads, cfg.seed, st);
    refund::write_answers(a.answers, answers, st);
    return 0;
  }

  examples::TempDir tmp("idem-refund");
  if (!a.provider_db_given) cfg.provider.path = tmp.file("provider.sqlite");
  refund::ProviderStub provider{cfg.provider};
  refund::Plan plan = refund::make_plan(cfg);
  backend->reset(plan.orders);
  provider.reset();
  refund::RefundDesk<Backend> desk{*backend, fast, provider, guard_options(), tables_of(a)};

  refund::Report rep;
  rep.config = cfg;
  rep.backend = backend->name();
  rep.where = where;
  rep.requests = plan.requests.size();
  std::vector<refund::SentAnswer> answers;
  auto start = std::chrono::steady_clock::now();
  if (cfg.processes == 0) {
    answers = refund::run_worker(desk, plan, 0, cfg.threads, cfg.seed, rep.workers);
  } else {
    std::vector<std::unique_ptr<examples::ChildProcess>> children;
    for (int i = 0; i < cfg.processes; ++i) {
      std::vector<std::string> args = a.forwarded;
      args.insert(args.end(), {"--seed", std::to_string(cfg.seed), "--provider-db",
                               cfg.provider.path, "--worker", std::to_string(i), "--answers",
                               tmp.file("answers-" + std::to_string(i))});
      children.push_back(std::make_unique<examples::ChildProcess>(
          args, examples::ChildProcess::Output::kFile,
          tmp.file("worker-" + std::to_string(i) + ".log")));
    }
    for (int i = 0; i < cfg.processes; ++i) {
      int status = children[static_cast<std::size_t>(i)]->wait();
      bool finished =
          refund::read_answers(tmp.file("answers-" + std::to_string(i)), answers, rep.workers);
      if (status != 0 || !finished) {
        ++rep.worker_failures;
        std::cerr << "idem_refund: worker " << i << " exited with status " << status << "\n";
      }
    }
  }
  rep.swept = refund::sweep_pending(desk, *backend);
  rep.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  rep.ledger = backend->read();
  rep.provider = provider.ledger();
  rep.provider_stats = provider.stats();
  refund::evaluate(rep, plan, answers);
  refund::print_report(rep, std::cout);
  return rep.ok() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string flag = argv[i];
      if (flag == "--help" || flag == "-h") {
        usage(std::cout);
        return 0;
      }
    }
    a = parse(argc, argv);
    if (a.cfg.seed == 0) a.cfg.seed = std::random_device{}() % 1000000 + 1;
  } catch (const std::exception& e) {
    std::cerr << "idem_refund: " << e.what() << "\n";
    usage(std::cerr);
    return 2;
  }
  try {
#ifdef REFUND_WITH_POSTGRES
    if (!a.dsn.empty()) {
      std::string record_table = a.prefix.empty() ? "api_idempotency" : a.prefix + "idem";
      return run(
          a,
          [&] {
            return std::make_unique<refund::PostgresBackend>(a.dsn, tables_of(a), record_table);
          },
          "postgres" + (a.prefix.empty() ? std::string() : ", tables " + a.prefix + "*"));
    }
#endif
    return run(
        a, [&] { return std::make_unique<refund::SqliteBackend>(a.db, tables_of(a)); }, a.db);
  } catch (const std::exception& e) {
    std::cerr << "idem_refund: " << e.what() << "\n";
    return 3;
  }
}
