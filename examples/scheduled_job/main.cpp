// SPDX-License-Identifier: MIT
// examples/scheduled_job: three scheduler processes fire "close payments stuck in PAYING" at
// the same 20 ticks; one tick is fired by nobody, one scheduler is killed (kill -9) in the
// middle of a tick, and the payments' success callbacks race the job. Checked from the
// database afterwards: every tick ran once, every due payment was decided once, no payment
// was both paid and closed.
//
//   idem_scheduled_job [--schedulers N] [--ticks N] [--period-ms N] [--lease-ms N]
//                      [--payments N] [--callback-percent N] [--missed-tick N]
//                      [--kill-at-tick N] [--kill-after-items N] [--seed N]
//                      [--db PATH | --postgres DSN [--prefix P]]
//
// Exit status: 0 when every check passed, 1 on any violation, 2 on bad flags, 3 on an error.
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../common/child_process.hpp"
#include "simulation.hpp"
#include "sqlite_backend.hpp"
#ifdef SCHEDULED_JOB_WITH_POSTGRES
#include "postgres_backend.hpp"
#endif

namespace {

void usage(std::ostream& out) {
  out << "usage: idem_scheduled_job [--schedulers N] [--ticks N] [--period-ms N] [--lease-ms N]\n"
         "       [--payments N] [--callback-percent N] [--missed-tick N] [--kill-at-tick N]\n"
         "       [--kill-after-items N] [--seed N] [--db PATH | --postgres DSN [--prefix P]]\n"
         "defaults: 3 schedulers, 20 ticks of 150 ms, tick lease 1000 ms, 200 payments,\n"
         "25% with a success callback, tick 5 fired by nobody, the last scheduler killed\n"
         "inside the first tick >= 8 it runs (0 disables either), db scheduled_job.sqlite\n";
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
  scheduled_job::Config cfg;
  std::string db = "scheduled_job.sqlite";
  std::string dsn, prefix;
  int scheduler = -1;      // >= 0: run as this scheduler instance
  long long start_ms = 0;  // the schedulers' common start (ms since the epoch)
  std::vector<std::string> forwarded;
};

Args parse(int argc, char** argv) {
  Args a;
  auto& c = a.cfg;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const char* v = argv[++i];
    bool forward = true;
    if (flag == "--schedulers")
      c.schedulers = static_cast<int>(number(flag, v, 1, 32));
    else if (flag == "--ticks")
      c.ticks = static_cast<int>(number(flag, v, 1, 10000));
    else if (flag == "--period-ms")
      c.period = std::chrono::milliseconds(number(flag, v, 10, 60000));
    else if (flag == "--lease-ms")
      c.lease = std::chrono::milliseconds(number(flag, v, 10, 600000));
    else if (flag == "--payments")
      c.payments = static_cast<int>(number(flag, v, 0, 1000000));
    else if (flag == "--callback-percent")
      c.callback_percent = static_cast<int>(number(flag, v, 0, 100));
    else if (flag == "--missed-tick")
      c.missed_tick = static_cast<int>(number(flag, v, 0, 10000));
    else if (flag == "--kill-at-tick")
      c.kill_at_tick = static_cast<int>(number(flag, v, 0, 10000));
    else if (flag == "--kill-after-items")
      c.kill_after_items = static_cast<int>(number(flag, v, 0, 100000));
    else if (flag == "--seed")
      c.seed = static_cast<std::uint64_t>(number(flag, v, 0, 1LL << 62)), forward = false;
    else if (flag == "--db")
      a.db = v;
    else if (flag == "--postgres")
      a.dsn = v;
    else if (flag == "--prefix")
      a.prefix = v;
    else if (flag == "--scheduler")
      a.scheduler = static_cast<int>(number(flag, v, 0, 31)), forward = false;
    else if (flag == "--start-ms")
      a.start_ms = number(flag, v, 1, 1LL << 50), forward = false;
    else
      throw std::invalid_argument("unknown flag " + flag);
    if (forward) {
      a.forwarded.push_back(flag);
      a.forwarded.push_back(v);
    }
  }
  if (!a.prefix.empty() && a.dsn.empty())
    throw std::invalid_argument("--prefix goes with --postgres");
  if (c.kill_at_tick > 0 && c.schedulers < 2) {
    throw std::invalid_argument("--kill-at-tick needs at least 2 schedulers (one survives)");
  }
#ifndef SCHEDULED_JOB_WITH_POSTGRES
  if (!a.dsn.empty()) throw std::invalid_argument("--postgres needs a build with idem::postgres");
#endif
  return a;
}

scheduled_job::Tables tables_of(const Args& a) {
  scheduled_job::Tables t;
  if (!a.prefix.empty()) {
    t.payments = a.prefix + "payments";
    t.effects = a.prefix + "effects";
    t.runs = a.prefix + "runs";
  }
  return t;
}

std::string instance_name(int i) { return "scheduler-" + std::to_string(i); }

template <class Open>
int run(const Args& a, Open open, const std::string& where) {
  const scheduled_job::Config& cfg = a.cfg;
  auto backend = open();

  if (a.scheduler >= 0) {  // one scheduler instance
    const bool victim = cfg.kill_at_tick > 0 && a.scheduler == cfg.schedulers - 1;
    auto start = std::chrono::system_clock::time_point(std::chrono::milliseconds(a.start_ms));
    // Clock skew between hosts: the victim runs fast, so it is the one running the ticks when
    // it dies; the others take turns (run_scheduler jitters each fire).
    auto skew = victim ? std::chrono::milliseconds(-40) : std::chrono::milliseconds(0);
    bool paused = false;
    auto hook = [&](int tick, int index) {
      if (!victim || paused || tick < cfg.kill_at_tick || index != cfg.kill_after_items) return;
      paused = true;  // inside this payment's transaction: tell the parent, wait for the kill
      std::cout << "PAUSED " << tick << std::endl;
      std::this_thread::sleep_for(std::chrono::seconds(60));
    };
    auto st =
        scheduled_job::run_scheduler(*backend, cfg, instance_name(a.scheduler), start, skew, hook);
    std::cout << "S " << st.ran << " " << st.done << " " << st.busy << " " << st.closed << " "
              << st.errors << std::endl;
    return 0;
  }

  examples::TempDir tmp("idem-scheduled-job");
  auto payments = scheduled_job::make_payments(cfg);
  backend->reset(payments);
  scheduled_job::Report rep;
  rep.config = cfg;
  rep.backend = backend->name();
  rep.where = where;
  auto t0 = std::chrono::steady_clock::now();
  // A common start a little ahead, so every process has opened its database by then.
  auto start = std::chrono::system_clock::now() + std::chrono::milliseconds(700);
  long long start_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(start.time_since_epoch()).count();
  std::vector<std::unique_ptr<examples::ChildProcess>> children;
  for (int i = 0; i < cfg.schedulers; ++i) {
    std::vector<std::string> args = a.forwarded;
    args.insert(args.end(), {"--seed", std::to_string(cfg.seed), "--scheduler", std::to_string(i),
                             "--start-ms", std::to_string(start_ms)});
    children.push_back(std::make_unique<examples::ChildProcess>(
        args, examples::ChildProcess::Output::kFile, tmp.file("scheduler-" + std::to_string(i))));
  }
  std::map<std::string, scheduled_job::CallbackAnswers> callbacks;
  std::thread provider(
      [&] { callbacks = scheduled_job::send_callbacks(*backend, cfg, payments, start); });

  // The victim writes "PAUSED <tick>" to its file when it is inside a payment's transaction;
  // then it gets a kill -9.
  if (cfg.kill_at_tick > 0) {
    const std::string file = tmp.file("scheduler-" + std::to_string(cfg.schedulers - 1));
    auto& victim = *children.back();
    for (;;) {
      std::ifstream in(file);
      std::string word;
      int tick = 0;
      while (in >> word) {
        if (word == "PAUSED" && in >> tick) break;
      }
      if (tick > 0) {
        victim.kill(SIGKILL);
        rep.killed = true;
        rep.killed_tick = tick;
        rep.killed_instance = instance_name(cfg.schedulers - 1);
        break;
      }
      if (!victim.running()) break;  // it ended without pausing
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  for (int i = 0; i < cfg.schedulers; ++i) {
    rep.exit_status.push_back(children[static_cast<std::size_t>(i)]->wait());
    std::ifstream in(tmp.file("scheduler-" + std::to_string(i)));
    std::string tag;
    scheduled_job::SchedulerStats st;
    while (in >> tag) {
      if (tag == "S") in >> st.ran >> st.done >> st.busy >> st.closed >> st.errors;
    }
    rep.schedulers.push_back(st);
  }
  provider.join();
  rep.elapsed =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  rep.callbacks = std::move(callbacks);
  rep.state = backend->read();
  scheduled_job::evaluate(rep);
  scheduled_job::print_report(rep, std::cout);
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
    std::cerr << "idem_scheduled_job: " << e.what() << "\n";
    usage(std::cerr);
    return 2;
  }
  try {
#ifdef SCHEDULED_JOB_WITH_POSTGRES
    if (!a.dsn.empty()) {
      std::string record_table = a.prefix.empty() ? "api_idempotency" : a.prefix + "idem";
      return run(
          a,
          [&] {
            return std::make_unique<scheduled_job::PostgresBackend>(a.dsn, tables_of(a),
                                                                    record_table);
          },
          "postgres" + (a.prefix.empty() ? std::string() : ", tables " + a.prefix + "*"));
    }
#endif
    return run(
        a, [&] { return std::make_unique<scheduled_job::SqliteBackend>(a.db, tables_of(a)); },
        a.db);
  } catch (const std::exception& e) {
    std::cerr << "idem_scheduled_job: " << e.what() << "\n";
    return 3;
  }
}
