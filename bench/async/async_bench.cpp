// SPDX-License-Identifier: MIT
// idem::async on one loop thread against the synchronous guard on 8 threads, same Redis,
// interleaved in one process (A B B A ...). Prints ops/s, p50, p99, the loop's 1 ms timer
// lateness and `ratio <name> = <value>` (ours over the synchronous baseline, median of the
// per-round ratios; higher is better).
//
//   idem_async_bench --url redis://127.0.0.1:6379 [--only replay|first|durable]
//                    [--ops 16000] [--rounds 11] [--threads 8] [--in-flight 256]
//                    [--auto-pipeline 0|1] [--name-suffix S] [--side ours|sync]
//
// Ours (side A): AsyncGuard<> + AsyncRedisStore (default options), one io_context run by ONE
// thread, `--in-flight` calls in flight at any time (each answer starts the next call), the
// handler on the loop (on_loop). Baseline (side B): IdempotencyGuard<> + RedisStore (default
// options: pool_size 8; `--auto-pipeline 1` turns on RedisStoreOptions::auto_pipeline) on
// `--threads` threads, each calling guard.run in a loop. Both sides make the same number of
// calls per round.
//
// `--only durable`: no ratio; the figure the loop-stall test (tests/integration/async,
// AsyncLoopStall) checks with a generous margin: 1,000 calls in flight on one loop thread
// over 700 keys (30 % duplicates), slow transactional handlers on PooledDurable<SqliteStore>,
// and the worst lateness of a 1 ms timer on the same loop while they run.
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../common/side_by_side.hpp"
#include "idem/async/guard.hpp"
#include "idem/async/pooled_durable.hpp"
#include "idem/async/redis_store.hpp"
#include "idem/guard.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"

namespace {

namespace net = idem::async::net;
using Clock = idem::bench::Clock;
using idem::bench::median;
using idem::bench::percentile;
using namespace std::chrono_literals;

struct Args {
  std::string url;
  std::string only;
  int ops = 16000;  // calls per side per round
  int rounds = 11;
  int threads = 8;
  int in_flight = 256;
  bool auto_pipeline = false;
  std::string name_suffix;
  std::string side;  // "ours" / "sync": one side only (profiling)
};

// A 1 ms timer on the loop: how late each expiry ran (the loop's stalls), and for each gap
// between two expiries what the loop thread did: ran (its CPU time), waited for a CPU (its
// run-queue wait, /proc/thread-self/schedstat), or slept (the rest: idle in epoll, or blocked
// on a lock).
class TickProbe {
 public:
  /// One expiry.
  struct Tick {
    double late_ms = 0;      ///< after its due time
    double cpu_ms = 0;       ///< the loop's CPU time since the previous expiry
    double runqueue_ms = 0;  ///< the loop's wait for a CPU since the previous expiry
    double gap_ms = 0;       ///< wall time since the previous expiry
  };

  explicit TickProbe(net::io_context& io) : timer_(io) {}
  void start() {
    running_ = true;
    sample(last_);
    arm();
  }
  void stop() {
    running_ = false;
    timer_.cancel();
  }
  const std::vector<Tick>& ticks() const noexcept { return ticks_; }

 private:
  struct Sample {
    Clock::time_point at{};
    double cpu_ms = 0, runqueue_ms = 0;
  };
  static void sample(Sample& s) {
    s.at = Clock::now();
    timespec ts{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    s.cpu_ms = static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
    unsigned long long run = 0, wait = 0;
    if (FILE* f = std::fopen("/proc/thread-self/schedstat", "r")) {
      if (std::fscanf(f, "%llu %llu", &run, &wait) != 2) wait = 0;
      std::fclose(f);
    }
    s.runqueue_ms = static_cast<double>(wait) / 1e6;
  }
  void arm() {
    due_ = Clock::now() + 1ms;
    timer_.expires_at(due_);
    timer_.async_wait([this](const idem::async::error_code& ec) {
      if (ec || !running_) return;
      Sample now;
      sample(now);
      Tick t;
      t.late_ms = std::chrono::duration<double, std::milli>(now.at - due_).count();
      t.cpu_ms = now.cpu_ms - last_.cpu_ms;
      t.runqueue_ms = now.runqueue_ms - last_.runqueue_ms;
      t.gap_ms = std::chrono::duration<double, std::milli>(now.at - last_.at).count();
      ticks_.push_back(t);
      last_ = now;
      arm();
    });
  }
  net::steady_timer timer_;
  Clock::time_point due_{};
  Sample last_;
  bool running_ = false;
  std::vector<Tick> ticks_;
};

// One io_context run by the calling thread for each phase (`io_context(1)`: a one-thread loop,
// as an event-loop server configures it), an AsyncRedisStore and a fast-store-only AsyncGuard.
class AsyncSide {
 public:
  explicit AsyncSide(const std::string& url)
      : io_(1), store_(io_.get_executor(), url), guard_(io_.get_executor(), store_, options()) {}

  static idem::async::AsyncGuardOptions options() {
    idem::async::AsyncGuardOptions o;
    o.guard.retention = std::chrono::seconds(300);
    return o;
  }

  // `ops` calls, `window` in flight; `key_of(i)` names call i's key; `response` the handler's
  // answer (a replay never runs it). Records each call's latency and the timer's lateness.
  idem::bench::Phase run(int ops, int window, const std::function<idem::Key(int)>& key_of,
                         const std::string& fp, const std::string& response, idem::Outcome expected,
                         std::atomic<long>& bad, std::vector<TickProbe::Tick>& lateness) {
    std::vector<Clock::time_point> t0(static_cast<std::size_t>(ops));
    std::vector<double> lat(static_cast<std::size_t>(ops));
    int started = 0, answered = 0;
    TickProbe probe(io_);
    std::function<void()> launch = [&] {
      const int i = started++;
      t0[static_cast<std::size_t>(i)] = Clock::now();
      guard_.async_run(key_of(i), fp, idem::async::on_loop([&response] { return response; }),
                       [&, i](std::exception_ptr e, idem::GuardResult<std::string> r) {
                         lat[static_cast<std::size_t>(i)] =
                             std::chrono::duration<double, std::micro>(
                                 Clock::now() - t0[static_cast<std::size_t>(i)])
                                 .count();
                         if (e || r.outcome != expected) ++bad;
                         if (++answered == ops) {
                           probe.stop();
                           io_.stop();
                           return;
                         }
                         if (started < ops) launch();
                       });
    };
    const auto start = Clock::now();
    net::post(io_, [&] {
      probe.start();
      for (int w = 0; w < window && started < ops; ++w) launch();
    });
    io_.restart();
    io_.run();
    const double secs = std::chrono::duration<double>(Clock::now() - start).count();
    lateness.insert(lateness.end(), probe.ticks().begin(), probe.ticks().end());
    idem::bench::Phase p;
    p.ops_per_s = ops / secs;
    p.lat_us = std::move(lat);
    return p;
  }

  // Runs one call to completion (set-up: completes keys for the replays).
  void once(const idem::Key& k, const std::string& fp, const std::string& response) {
    bool done = false;
    guard_.async_run(k, fp, idem::async::on_loop([&response] { return response; }),
                     [&](std::exception_ptr, idem::GuardResult<std::string>) {
                       done = true;
                       io_.stop();
                     });
    io_.restart();
    io_.run();
    if (!done) std::exit(3);
  }

  idem::async::AsyncRedisStats store_stats() const { return store_.stats(); }

 private:
  net::io_context io_;
  idem::async::AsyncRedisStore store_;
  idem::async::AsyncGuard<> guard_;
};

// The lateness figures, and where the worst gap went.
void print_lateness(const char* what, const std::vector<TickProbe::Tick>& ticks) {
  if (ticks.empty()) return;
  std::vector<double> late;
  for (const auto& t : ticks) late.push_back(t.late_ms);
  const auto worst = std::max_element(ticks.begin(), ticks.end(), [](const auto& x, const auto& y) {
    return x.late_ms < y.late_ms;
  });
  std::printf(
      "  loop 1 ms timer lateness during %s: max %.2f ms, p99 %.3f ms, p50 %.3f ms (%zu ticks)\n",
      what, worst->late_ms, percentile(late, 0.99), percentile(late, 0.5), ticks.size());
  std::printf(
      "    the worst gap (%.2f ms): the loop ran %.2f ms, waited for a CPU %.2f ms, slept %.2f ms "
      "(idle, or blocked on a lock)\n",
      worst->gap_ms, worst->cpu_ms, worst->runqueue_ms,
      std::max(0.0, worst->gap_ms - worst->cpu_ms - worst->runqueue_ms));
  // What a lock can cost the loop, apart from the kernel's CPU waits: each gap's time neither
  // running nor waiting for a CPU, beyond the timer's own 1 ms of idling.
  std::vector<double> slept;
  for (const auto& t : ticks) {
    slept.push_back(std::max(0.0, t.gap_ms - t.cpu_ms - t.runqueue_ms - 1.0));
  }
  std::printf("    asleep beyond the 1 ms period (blocked, or idle): max %.2f ms, p99 %.3f ms\n",
              *std::max_element(slept.begin(), slept.end()), percentile(slept, 0.99));
}

std::string run_id() {
  std::random_device rd;
  return std::to_string(rd() % 1000000);
}

// A then B on even rounds, B then A on odd ones.
idem::bench::Comparison interleave(const Args& a,
                                   const std::function<idem::bench::Phase(int)>& ours,
                                   const std::function<idem::bench::Phase(int)>& sync) {
  idem::bench::Comparison c;
  for (int round = 0; round < a.rounds; ++round) {
    idem::bench::Phase pa, pb;
    if (a.side == "ours") {
      pa = ours(round);
      pb = pa;
    } else if (a.side == "sync") {
      pb = sync(round);
      pa = pb;
    } else if (round % 2 == 0) {
      pa = ours(round);
      pb = sync(round);
    } else {
      pb = sync(round);
      pa = ours(round);
    }
    c.a_ops.push_back(pa.ops_per_s);
    c.b_ops.push_back(pb.ops_per_s);
    c.ratios.push_back(pa.ops_per_s / pb.ops_per_s);
    c.a_lat.insert(c.a_lat.end(), pa.lat_us.begin(), pa.lat_us.end());
    c.b_lat.insert(c.b_lat.end(), pb.lat_us.begin(), pb.lat_us.end());
  }
  return c;
}

// --only durable: the loop's lateness under durable work (see the file comment).
int durable_figure(const Args& a) {
  const char* dir_env = std::getenv("TMPDIR");
  const std::string path =
      std::string(dir_env != nullptr ? dir_env : "/tmp") + "/idem-async-bench-" + run_id() + ".db";
  int status = 0;
  {
    net::io_context io(1);
    idem::async::AsyncRedisStore fast(io.get_executor(), a.url);
    idem::sqlite::SqliteStore sqlite(path);
    sqlite.database().write(
        [](idem::sqlite::Transaction& tx) { tx.exec("CREATE TABLE effect (k TEXT NOT NULL)"); });
    idem::async::WorkerPool workers({4, 4096});
    idem::async::PooledDurable<idem::sqlite::SqliteStore> durable(sqlite, workers);
    idem::async::AsyncGuardOptions o;
    o.pool = &workers;
    idem::async::AsyncGuard guard(io.get_executor(), fast, durable, o);
    constexpr int kKeys = 700, kCalls = 1000;
    const std::string id = run_id();
    std::vector<idem::Key> keys;
    for (int i = 0; i < kKeys; ++i) {
      keys.push_back(idem::Key::make("bench.async.durable", id + "_" + std::to_string(i)));
    }
    std::vector<TickProbe::Tick> late;
    std::vector<double> lat;
    int answered_total = 0, errors = 0;
    for (int round = 0; round < a.rounds; ++round) {
      // Each round: fresh keys (the 700 first calls run, the other 300 are duplicates).
      std::vector<idem::Key> round_keys;
      for (int i = 0; i < kKeys; ++i) {
        round_keys.push_back(idem::Key::make(
            "bench.async.durable", id + "_" + std::to_string(round) + "_" + std::to_string(i)));
      }
      TickProbe probe(io);
      int answered = 0;
      std::vector<Clock::time_point> t0(kCalls);
      // The calls arrive 50 per loop turn (as from many connections' reads), not all in one
      // handler.
      std::function<void(int)> arrive = [&](int from) {
        for (int c = from; c < std::min(from + 50, kCalls); ++c) {
          const idem::Key& k =
              round_keys[static_cast<std::size_t>(c < kKeys ? c : (c * 7) % kKeys)];
          t0[static_cast<std::size_t>(c)] = Clock::now();
          guard.async_run(
              k, "fp",
              [id = k.id()](idem::sqlite::Transaction& tx) {
                tx.exec("INSERT INTO effect (k) VALUES (?)", id);
                std::this_thread::sleep_for(2ms);  // a slow business transaction
                return "pay_" + id;
              },
              [&, c](std::exception_ptr e, idem::GuardResult<std::string>) {
                lat.push_back(std::chrono::duration<double, std::micro>(
                                  Clock::now() - t0[static_cast<std::size_t>(c)])
                                  .count());
                if (e) ++errors;  // the bounded pool's refusals (StorageUnavailable)
                if (++answered == kCalls) {
                  probe.stop();
                  io.stop();
                }
              });
        }
        if (from + 50 < kCalls) net::post(io, [&arrive, from] { arrive(from + 50); });
      };
      net::post(io, [&] {
        probe.start();
        arrive(0);
      });
      io.restart();
      io.run();
      answered_total += answered;
      late.insert(late.end(), probe.ticks().begin(), probe.ticks().end());
    }
    std::printf(
        "durable work on the pool: %d rounds of 1,000 calls in flight on one loop thread over 700 "
        "new keys (30 %% duplicates), transactional handlers sleeping 2 ms on "
        "PooledDurable<SqliteStore> (4 workers), AsyncRedisStore in front\n",
        a.rounds);
    std::printf("  answered %d, errors %d (refused by the pool's queue or in progress)\n",
                answered_total, errors);
    std::printf("  call latency p50 %.1f ms, p99 %.1f ms\n", percentile(lat, 0.5) / 1000,
                percentile(lat, 0.99) / 1000);
    print_lateness("the durable work", late);
    if (answered_total != a.rounds * kCalls) status = 1;
  }
  std::remove(path.c_str());
  std::remove((path + "-wal").c_str());
  std::remove((path + "-shm").c_str());
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--url") {
      a.url = v;
    } else if (k == "--only") {
      a.only = v;
    } else if (k == "--ops") {
      a.ops = std::atoi(v.c_str());
    } else if (k == "--rounds") {
      a.rounds = std::atoi(v.c_str());
    } else if (k == "--threads") {
      a.threads = std::atoi(v.c_str());
    } else if (k == "--in-flight") {
      a.in_flight = std::atoi(v.c_str());
    } else if (k == "--auto-pipeline") {
      a.auto_pipeline = v == "1";
    } else if (k == "--name-suffix") {
      a.name_suffix = v;
    } else if (k == "--side") {
      a.side = v;
    }
  }
  if (a.url.empty() || a.threads <= 0 || a.ops <= 0 || a.in_flight <= 0) {
    std::fprintf(stderr,
                 "usage: idem_async_bench --url redis://host:port [--only replay|first|durable] "
                 "[--ops N] [--rounds N] [--threads N] [--in-flight N] [--auto-pipeline 0|1]\n");
    return 2;
  }
  if (a.only == "durable") return durable_figure(a);
  auto want = [&](const char* part) { return a.only.empty() || a.only == part; };

  const std::string id = run_id();
  const std::string tag = "t" + std::to_string(a.threads);
  const std::string suffix = (a.auto_pipeline ? "_autopipeline" : "") + a.name_suffix;
  const std::string fp = idem::fingerprint("{\"order\":\"20001\",\"amount\":100}");
  const std::string response = "{\"payment_no\":\"pay_20001\",\"status\":\"PAID\"}";

  AsyncSide ours(a.url);
  idem::redis::RedisStoreOptions so{a.url};
  so.auto_pipeline = a.auto_pipeline;  // every other option: its default (pool_size 8)
  idem::redis::RedisStore sync_store(so);
  idem::GuardOptions gopt;
  gopt.retention = std::chrono::seconds(300);
  idem::IdempotencyGuard sync_guard{sync_store, gopt};
  const int per_thread = a.ops / a.threads;
  const int ops = per_thread * a.threads;  // both sides make exactly this many calls

  std::printf(
      "ours: AsyncGuard + AsyncRedisStore, ONE loop thread, %d calls in flight; baseline: "
      "IdempotencyGuard + RedisStore (pool_size %zu, auto_pipeline %s) on %d threads; "
      "%d calls per side per round, %d rounds (A B B A ...)\n",
      a.in_flight, sync_store.options().pool_size, a.auto_pipeline ? "on" : "off", a.threads, ops,
      a.rounds);

  if (want("replay")) {
    // Completed keys, cycled by both sides (each call of either side is a replay).
    constexpr int kKeys = 2000;
    std::vector<idem::Key> keys;
    for (int i = 0; i < kKeys; ++i) {
      keys.push_back(idem::Key::make("bench.async.replay", id + "_" + std::to_string(i)));
      ours.once(keys.back(), fp, response);
    }
    std::atomic<long> bad{0};
    std::vector<TickProbe::Tick> lateness;
    auto c = interleave(
        a,
        [&](int round) {
          return ours.run(
              ops, a.in_flight,
              [&](int i) { return keys[static_cast<std::size_t>((i + round * 7) % kKeys)]; }, fp,
              response, idem::Outcome::kReplayed, bad, lateness);
        },
        [&](int) {
          return idem::bench::run_phase(a.threads, per_thread, [&](int t, int i) {
            auto r = sync_guard.run(keys[static_cast<std::size_t>((t * per_thread + i) % kKeys)],
                                    fp, [] { return std::string("never"); });
            if (r.outcome != idem::Outcome::kReplayed) ++bad;
          });
        });
    if (bad.load() != 0) std::printf("WARNING: %ld replays were not kReplayed\n", bad.load());
    idem::bench::report("async_replay_one_loop_vs_sync_" + tag + suffix, "one loop:", "sync:", c);
    print_lateness("the replays", lateness);
  }

  if (want("first")) {
    std::atomic<long> bad{0};
    std::vector<TickProbe::Tick> lateness;
    auto key_of = [&](const char* side, int round, int i) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "%s_%s_%s_%d_%d", id.c_str(), side, suffix.c_str(), round, i);
      return idem::Key::make("bench.async.first", buf);
    };
    auto c = interleave(
        a,
        [&](int round) {
          return ours.run(
              ops, a.in_flight, [&](int i) { return key_of("a", round, i); }, fp, response,
              idem::Outcome::kExecuted, bad, lateness);
        },
        [&](int round) {
          return idem::bench::run_phase(a.threads, per_thread, [&](int t, int i) {
            auto r = sync_guard.run(key_of("s", round, t * per_thread + i), fp,
                                    [&] { return response; });
            if (r.outcome != idem::Outcome::kExecuted) ++bad;
          });
        });
    if (bad.load() != 0) std::printf("WARNING: %ld first calls were not kExecuted\n", bad.load());
    idem::bench::report("async_first_exec_vs_sync_" + tag + suffix, "one loop:", "sync:", c);
    print_lateness("the first executions", lateness);
  }
  const auto st = ours.store_stats();
  std::printf("  AsyncRedisStore: %llu connection(s), %llu commands, %llu timeouts\n",
              static_cast<unsigned long long>(st.connects),
              static_cast<unsigned long long>(st.commands),
              static_cast<unsigned long long>(st.timeouts));
  return 0;
}
