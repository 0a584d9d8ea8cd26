// SPDX-License-Identifier: MIT
// Consumer window throughput: idem::stream::Window vs a std::set of seen offsets, on a stream
// with replays (10%) and short-range reordering. Interleaved runs, medians.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <set>
#include <vector>

#include "idem/stream.hpp"

namespace {

std::vector<std::uint64_t> make_workload(std::size_t n) {
  std::vector<std::uint64_t> out;
  out.reserve(n + n / 5);
  std::mt19937_64 rng(1);
  std::uint64_t next = 0;
  while (out.size() < n) {
    out.push_back(next++);
    if (rng() % 10 == 0 && next > 8) out.push_back(next - 1 - rng() % 8);  // a replay
  }
  for (std::size_t i = 1; i + 1 < out.size(); i += 37) std::swap(out[i], out[i + 1]);
  return out;
}

template <class Fn>
double offsets_per_second(const std::vector<std::uint64_t>& work, Fn&& fn,
                          std::uint64_t& fresh) {
  auto t0 = std::chrono::steady_clock::now();
  fresh = fn(work);
  auto t1 = std::chrono::steady_clock::now();
  return static_cast<double>(work.size()) / std::chrono::duration<double>(t1 - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  const auto work = make_workload(20'000'000);
  auto window_run = [](const std::vector<std::uint64_t>& w) {
    idem::stream::Window window;
    std::uint64_t fresh = 0;
    for (auto o : w) fresh += window.admit(o) ? 1 : 0;
    return fresh;
  };
  auto set_run = [](const std::vector<std::uint64_t>& w) {
    std::set<std::uint64_t> seen;
    std::uint64_t fresh = 0;
    for (auto o : w) fresh += seen.insert(o).second ? 1 : 0;
    return fresh;
  };
  std::vector<double> a, b;
  std::uint64_t fa = 0, fb = 0;
  for (int round = 0; round < 5; ++round) {
    a.push_back(offsets_per_second(work, window_run, fa));
    b.push_back(offsets_per_second(work, set_run, fb));
  }
  if (fa != fb) {
    std::printf("MISMATCH: window admitted %llu, std::set %llu\n",
                static_cast<unsigned long long>(fa), static_cast<unsigned long long>(fb));
    return 1;
  }
  std::printf("workload: %zu offsets, %llu distinct (replays and reordering), 5 interleaved runs\n",
              work.size(), static_cast<unsigned long long>(fa));
  std::printf("stream window:   %.1f M offsets/s (median)\n", median(a) / 1e6);
  std::printf("std::set:        %.1f M offsets/s (median)\n", median(b) / 1e6);
  std::printf("ratio stream_window_vs_std_set = %.2f\n", median(a) / median(b));
  return 0;
}
