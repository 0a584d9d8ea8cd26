// SPDX-License-Identifier: MIT
// Time as idem sees it: an injectable clock, so leases and retention are testable without sleeping.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>

#include "idem/export.hpp"  // says first when the build cannot compile idem

namespace idem {

/// Wall-clock milliseconds; what records store as lease_until, created_at, expires_at.
using TimePoint = std::chrono::time_point<std::chrono::system_clock, std::chrono::milliseconds>;

/// A clock is any callable returning the current time. The default reads the system clock.
using Clock = std::function<TimePoint()>;

/// The system clock, truncated to milliseconds.
inline TimePoint system_now() {
  return std::chrono::time_point_cast<std::chrono::milliseconds>(
      std::chrono::system_clock::now());
}

/// Milliseconds since the Unix epoch.
inline long long to_millis(TimePoint t) noexcept { return t.time_since_epoch().count(); }
/// Inverse of to_millis.
inline TimePoint from_millis(long long ms) noexcept {
  return TimePoint(std::chrono::milliseconds(ms));
}

/// A clock that only moves when told to; thread-safe. For tests of leases and retention.
///
/// @code
///   idem::ManualClock clock;
///   idem::MemoryStoreOptions options;
///   options.clock = clock.as_clock();
///   idem::MemoryStore store{options};
///   clock.advance(std::chrono::seconds(31));   // the lease has now expired
/// @endcode
class ManualClock {
 public:
  /// Starts at `start` (default: the current system time).
  explicit ManualClock(TimePoint start = system_now()) : now_ms_(to_millis(start)) {}
  /// The current manual time.
  TimePoint now() const noexcept { return from_millis(now_ms_.load()); }
  /// Moves time forward by `d`.
  void advance(std::chrono::milliseconds d) noexcept { now_ms_ += d.count(); }
  /// A `Clock` reading this object (which must outlive it).
  Clock as_clock() const {
    return [this] { return now(); };
  }

 private:
  std::atomic<long long> now_ms_;
};

}  // namespace idem
