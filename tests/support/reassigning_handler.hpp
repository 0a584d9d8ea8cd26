// SPDX-License-Identifier: MIT
// A handler that reassigns the Key and the fingerprint its caller passed to guard.run (the
// fingerprint's old heap buffer is freed on the spot), for the aliasing tests of every store:
// the call must still complete exactly the key and fingerprint it acquired. Built with
// -DIDEM_SANITIZE='address;undefined', a guard that kept the caller's variables reads freed
// memory here.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <type_traits>

#include "idem/guard.hpp"
#include "idem/store.hpp"

namespace idem::test {

/// A fingerprint long enough to live on the heap (std::string's inline buffer holds 15).
inline std::string heap_fingerprint(const std::string& seed) {
  return "fp-" + seed + "-" + std::string(64, 'a');
}

/// Runs `guard.run(arg_key, arg_fingerprint, handler)` where the handler first reassigns
/// arg_key to `other` and arg_fingerprint to another heap string (freeing the first), then
/// calls `effect` (with the transaction when Tx is not void) and returns "pay". `runs` counts
/// the handler's runs.
template <class Tx, class Guard, class Effect>
GuardResult<std::string> run_reassigning(Guard& guard, const Key& acquired, const Key& other,
                                         const std::string& fingerprint, int& runs, Effect effect) {
  Key arg_key = acquired;
  std::string arg_fingerprint = fingerprint;
  auto reassign = [&] {
    arg_key = other;
    arg_fingerprint = std::string(256, 'z');  // move-assigned: the old buffer is freed now
  };
  if constexpr (std::is_void_v<Tx>) {
    return guard.run(arg_key, arg_fingerprint, [&] {
      ++runs;
      reassign();
      effect();
      return std::string("pay");
    });
  } else {
    return guard.run(arg_key, arg_fingerprint, [&](Tx& tx) {
      ++runs;
      reassign();
      effect(tx);
      return std::string("pay");
    });
  }
}

/// The records a store holds after run_reassigning: `acquired` completed with "pay" and the
/// original fingerprint, nothing under `other`. Works for FastStore and durable stores alike.
template <class Store>
void expect_acquired_key_completed(Store& store, const Key& acquired, const Key& other,
                                   const std::string& fingerprint) {
  auto rec = store.lookup(acquired);
  ASSERT_TRUE(rec.has_value()) << "no record for the acquired key " << acquired.str();
  EXPECT_EQ(Record::Status::kCompleted, rec->status);
  EXPECT_EQ("pay", rec->response);
  EXPECT_EQ(fingerprint, rec->fingerprint);
  EXPECT_FALSE(store.lookup(other).has_value()) << "a record for " << other.str();
}

/// The duplicate of the acquired key replays "pay" without running a handler.
template <class Tx, class Guard>
void expect_replay(Guard& guard, const Key& acquired, const std::string& fingerprint, int& runs) {
  const int before = runs;
  GuardResult<std::string> r;
  if constexpr (std::is_void_v<Tx>) {
    r = guard.run(acquired, fingerprint, [&] {
      ++runs;
      return std::string("again");
    });
  } else {
    r = guard.run(acquired, fingerprint, [&](Tx&) {
      ++runs;
      return std::string("again");
    });
  }
  EXPECT_EQ(Outcome::kReplayed, r.outcome);
  EXPECT_EQ("pay", r.value.value_or("<none>"));
  EXPECT_EQ(before, runs);
}

}  // namespace idem::test
