// SPDX-License-Identifier: MIT
// Expected results of a guarded call, as values: executed, replayed, in progress, mismatch.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "idem/clock.hpp"
#include "idem/errors.hpp"

namespace idem {

/// What a guarded call did.
enum class Outcome {
  kExecuted,             ///< this call ran the handler; `value` is its response
  kReplayed,             ///< an earlier call completed; `value` is that call's response
  kInProgress,           ///< another attempt holds the key; answer PROCESSING (HTTP 409)
  kFingerprintMismatch,  ///< the key was used with another payload; a client error (HTTP 422)
};

/// Stable name: executed, replayed, in_progress, fingerprint_mismatch.
constexpr std::string_view outcome_name(Outcome o) noexcept {
  switch (o) {
    case Outcome::kExecuted: return "executed";
    case Outcome::kReplayed: return "replayed";
    case Outcome::kInProgress: return "in_progress";
    case Outcome::kFingerprintMismatch: return "fingerprint_mismatch";
  }
  return "unknown";
}

/// HTTP status for an outcome: 200 for executed/replayed (the handler's own status wins in
/// idem::http), 409 in progress, 422 mismatch.
constexpr int http_status(Outcome o) noexcept {
  switch (o) {
    case Outcome::kExecuted:
    case Outcome::kReplayed: return 200;
    case Outcome::kInProgress: return 409;
    case Outcome::kFingerprintMismatch: return 422;
  }
  return 500;
}

/// Which layer answered a call.
enum class Source {
  kHandler,       ///< the handler ran (outcome kExecuted)
  kFastStore,     ///< the fast store recognised the duplicate (Redis / memory)
  kDurableStore,  ///< the durable store recognised it (unique index, record table)
};

/// Stable name: handler, fast_store, durable_store.
constexpr std::string_view source_name(Source s) noexcept {
  switch (s) {
    case Source::kHandler: return "handler";
    case Source::kFastStore: return "fast_store";
    case Source::kDurableStore: return "durable_store";
  }
  return "unknown";
}

/// The result of `IdempotencyGuard::run`. Check `outcome` (or `ok()`) before using `value`.
template <class T>
struct [[nodiscard]] GuardResult {
  /// Executed, replayed, in progress, or fingerprint mismatch.
  Outcome outcome = Outcome::kExecuted;
  /// Set for kExecuted and kReplayed.
  std::optional<T> value;
  /// Which layer answered.
  Source source = Source::kHandler;
  /// True when the fast store failed during this call and the durable store alone decided.
  bool degraded = false;
  /// For duplicates: when the first attempt created the record (epoch when unknown). A fast
  /// store's record written back from the durable store (after the fast store lost it) keeps
  /// the first attempt's (FastStore::refill; a custom fast store without refill reports the
  /// time it was written back). So does `holder`, where the fast store keeps owners.
  TimePoint first_seen{};
  /// For duplicates: the owner token of the first attempt (empty when unknown).
  std::string holder;
  /// For replays: when the stored record's retention ends (epoch when the store does not report
  /// it: MemoryStore, SqliteStore, PostgresStore and MysqlStore do, RedisStore does not).
  TimePoint expires_at{};

  /// True for kExecuted and kReplayed: `value` holds the response.
  bool ok() const noexcept {
    return outcome == Outcome::kExecuted || outcome == Outcome::kReplayed;
  }
  /// The error code a service should answer with when !ok().
  errc error() const noexcept {
    return outcome == Outcome::kInProgress ? errc::kInProgress : errc::kFingerprintMismatch;
  }
};

}  // namespace idem
