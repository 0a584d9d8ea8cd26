// SPDX-License-Identifier: MIT
// The side-by-side harness of the Redis benchmarks (bench/redis, bench/cluster): run a body on N
// threads for a phase, interleave two sides round by round (alternating which goes first), and
// print both sides' ops/s, p50 and p99 and `ratio <name> = <median of the per-round ratios>`.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace idem::bench {

using Clock = std::chrono::steady_clock;

/// One side's phase: throughput and every call's latency.
struct Phase {
  double ops_per_s = 0;
  std::vector<double> lat_us;
};

/// Runs `body(thread, i)` `ops` times on each of `threads` threads, started together.
inline Phase run_phase(int threads, int ops, const std::function<void(int, int)>& body) {
  std::vector<std::vector<double>> lat(static_cast<std::size_t>(threads));
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      auto& mine = lat[static_cast<std::size_t>(t)];
      mine.reserve(static_cast<std::size_t>(ops));
      ++ready;
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < ops; ++i) {
        auto t0 = Clock::now();
        body(t, i);
        mine.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  auto start = Clock::now();
  go = true;
  for (auto& th : pool) th.join();
  Phase p;
  p.ops_per_s = static_cast<double>(threads) * ops /
                std::chrono::duration<double>(Clock::now() - start).count();
  for (auto& v : lat) p.lat_us.insert(p.lat_us.end(), v.begin(), v.end());
  return p;
}

/// The q-quantile of `v` (0 for an empty one).
inline double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  auto k = static_cast<std::size_t>(q * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

inline double median(std::vector<double> v) { return percentile(std::move(v), 0.5); }

/// Both sides of a comparison, round by round.
struct Comparison {
  std::vector<double> a_ops, b_ops, ratios;
  std::vector<double> a_lat, b_lat;
};

/// Runs side A (`fa(round, thread, i)`) and side B `rounds` times each, alternating which goes
/// first. `only` = "a" or "b" runs one side alone (for profiling; its ratios are then 1).
inline Comparison interleave(int rounds, int threads, int ops,
                             const std::function<void(int, int, int)>& fa,
                             const std::function<void(int, int, int)>& fb,
                             const std::string& only = "") {
  Comparison c;
  for (int round = 0; round < rounds; ++round) {
    auto run_a = [&] { return run_phase(threads, ops, [&](int t, int i) { fa(round, t, i); }); };
    auto run_b = [&] { return run_phase(threads, ops, [&](int t, int i) { fb(round, t, i); }); };
    Phase pa, pb;
    if (only == "a") {
      pa = run_a();
      pb = pa;
    } else if (only == "b") {
      pb = run_b();
      pa = pb;
    } else if (round % 2 == 0) {
      pa = run_a();
      pb = run_b();
    } else {
      pb = run_b();
      pa = run_a();
    }
    c.a_ops.push_back(pa.ops_per_s);
    c.b_ops.push_back(pb.ops_per_s);
    c.ratios.push_back(pa.ops_per_s / pb.ops_per_s);
    c.a_lat.insert(c.a_lat.end(), pa.lat_us.begin(), pa.lat_us.end());
    c.b_lat.insert(c.b_lat.end(), pb.lat_us.begin(), pb.lat_us.end());
  }
  return c;
}

/// Prints both sides (median ops/s, p50, p99 over every call), the per-round ratios and
/// `ratio <name> = <median ratio>`.
inline void report(const std::string& name, const char* a_label, const char* b_label,
                   const Comparison& c) {
  const int w = static_cast<int>(std::max(std::strlen(a_label), std::strlen(b_label)));
  std::printf("%-44s %-*s %9.0f ops/s  p50 %7.1f us  p99 %7.1f us\n", name.c_str(), w, a_label,
              median(c.a_ops), percentile(c.a_lat, 0.5), percentile(c.a_lat, 0.99));
  std::printf("%-44s %-*s %9.0f ops/s  p50 %7.1f us  p99 %7.1f us\n", "", w, b_label,
              median(c.b_ops), percentile(c.b_lat, 0.5), percentile(c.b_lat, 0.99));
  std::printf("%-44s per-round ratios:", "");
  for (double r : c.ratios) std::printf(" %.3f", r);
  std::printf("\nratio %s = %.3f\n", name.c_str(), median(c.ratios));
  std::fflush(stdout);
}

}  // namespace idem::bench
