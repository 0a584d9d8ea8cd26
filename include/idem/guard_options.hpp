// SPDX-License-Identifier: MIT
// The options of a guard (idem::GuardOptions) and the protocol steps a step hook sees.
//
// File: guard_options.hpp (included by guard.hpp; both guards, synchronous and asynchronous,
// take these options)
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string_view>

#include "idem/key.hpp"
#include "idem/observer.hpp"
#include "idem/store.hpp"

namespace idem {

/// Points of the protocol, in order, as a step hook sees them. Fault-injection tests stop or kill
/// the process at each to prove that a crash there loses nothing and doubles nothing.
enum class Step {
  kFastClaimed,       ///< the fast store granted the claim
  kDurableClaimed,    ///< the durable store granted the claim (two-phase: the in-progress
                      ///< record is committed; transactional: the record was found absent in
                      ///< the open transaction, before the handler; it is written completed
                      ///< after the handler)
  kHandlerReturned,   ///< the handler returned (transactional: before COMMIT)
  kDurableCommitted,  ///< the durable store committed the completed record
  kFastCompleted,     ///< the fast store holds the completed record
};

/// Stable name: fast_claimed, durable_claimed, handler_returned, durable_committed,
/// fast_completed.
constexpr std::string_view step_name(Step s) noexcept {
  switch (s) {
    case Step::kFastClaimed:
      return "fast_claimed";
    case Step::kDurableClaimed:
      return "durable_claimed";
    case Step::kHandlerReturned:
      return "handler_returned";
    case Step::kDurableCommitted:
      return "durable_committed";
    case Step::kFastCompleted:
      return "fast_completed";
  }
  return "unknown";
}

/// Options of an IdempotencyGuard.
struct GuardOptions {
  /// How long an in-progress claim is honoured before another attempt may take it over.
  /// Choose it longer than the slowest handler. Must be positive.
  std::chrono::milliseconds lease = kDefaultLease;
  /// How long a completed record (and its response) is kept. Must be positive.
  std::chrono::seconds retention = kDefaultRetention;
  /// Receives events for logs and metrics (null means none). Shared so adapters outlive calls.
  std::shared_ptr<Observer> observer;
  /// The label of duplicates the durable store catches (kMqRecord for consume records).
  DuplicateSource durable_source = DuplicateSource::kUniqueIndex;
  /// Called at each protocol step of a call that runs the handler (empty means none). For fault
  /// injection in tests, which kill the process inside it. Whatever it throws propagates; claims
  /// it leaves behind end with their lease, as after a crash.
  std::function<void(Step, const Key&)> step_hook;
};

}  // namespace idem
