// SPDX-License-Identifier: MIT
// Helpers of the one-thread, per-call side-by-side benchmarks (bench/postgres, bench/mysql):
// a fast store that is down, environment knobs, medians, the driver's CPU time, timed loops,
// and a plain hiredis connection for hand-written baselines.
#pragma once

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "idem/errors.hpp"
#include "idem/store.hpp"

namespace idem::bench {

/// A fast store that is down: every call fails as a refused Redis connection would.
class DownFastStore final : public idem::FastStore {
 public:
  idem::ClaimResult claim(const idem::Key&, std::string_view, const idem::OwnerToken&,
                          std::chrono::milliseconds) override {
    throw idem::StorageUnavailable("bench: fast store down");
  }
  bool complete(const idem::Key&, const idem::OwnerToken&, std::string_view,
                std::chrono::seconds) override {
    throw idem::StorageUnavailable("bench: fast store down");
  }
  bool fail(const idem::Key&, const idem::OwnerToken&, std::string_view,
            std::chrono::seconds) override {
    throw idem::StorageUnavailable("bench: fast store down");
  }
  bool release(const idem::Key&, const idem::OwnerToken&) override {
    throw idem::StorageUnavailable("bench: fast store down");
  }
  void fill(const idem::Key&, std::string_view, std::string_view, std::chrono::seconds) override {
    throw idem::StorageUnavailable("bench: fast store down");
  }
  std::optional<idem::Record> lookup(const idem::Key&) override {
    throw idem::StorageUnavailable("bench: fast store down");
  }
  std::string_view name() const noexcept override { return "down"; }
};

/// The integer in environment variable `name`, or `fallback`.
inline int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v == nullptr ? fallback : std::atoi(v);
}

/// The middle element (upper median) of `v`; 0 for none.
inline double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// This process's CPU time, in microseconds.
inline double cpu_now_us() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

/// Per-call microseconds of `calls` runs of fn(i); adds the driver's own CPU time per call
/// (client-side cost, excluding the server) to `cpu`.
inline double timed(int calls, const std::function<void(int)>& fn,
                    std::vector<double>* cpu = nullptr) {
  const double c0 = cpu_now_us();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) fn(i);
  auto ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  if (cpu != nullptr) cpu->push_back((cpu_now_us() - c0) / calls);
  return static_cast<double>(ns) / 1000.0 / calls;
}

}  // namespace idem::bench
