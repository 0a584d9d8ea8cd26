// SPDX-License-Identifier: MIT
// The pause before a durable store re-runs a transaction that the database rolled back for
// contention (MySQL deadlock 1213 / lock wait timeout 1205, PostgreSQL serialization failure
// 40001 / deadlock 40P01).
#pragma once

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>

namespace idem::detail {

/// Sleeps a random time of up to 1, 2, 4, ... 64 ms (doubling with each re-run, `rerun` counted
/// from 0), so that transactions that conflicted on the same keys do not meet again in
/// lockstep: eight MySQL consumers of overlapping batches deadlocked three times in a row
/// without it.
inline void pause_before_rerun(unsigned rerun) {
  thread_local std::minstd_rand rng{std::random_device{}()};
  std::uniform_int_distribution<unsigned> micros(0, 1000u << std::min(rerun, 6u));
  std::this_thread::sleep_for(std::chrono::microseconds(micros(rng)));
}

}  // namespace idem::detail
