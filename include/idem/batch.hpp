// SPDX-License-Identifier: MIT
// Batch calls of idem::IdempotencyGuard (run_batch): what a caller passes and gets back.
//
// File: batch.hpp
//
// `guard.run_batch(calls, response, handler)` runs many guarded calls with one fast-store
// round trip for all claims, ONE durable transaction for all records and handlers, and one
// fast-store round trip for all completions. It is the protocol of IdempotentConsumer::
// consume_batch (one transaction per read of a message broker), usable by any caller whose
// handlers return nothing worth replaying: every record a batch writes stores the same
// `response` bytes (a marker such as "consumed"), so the records can be written before the
// handlers run, in one statement.
//
// @code
//   std::vector<idem::BatchCall> calls;
//   for (const auto& m : messages) calls.push_back({idem::Key::make("billing", m.id), m.fp});
//   idem::BatchResult r = guard.run_batch(std::move(calls), "consumed",
//       [&](idem::sqlite::Transaction& tx, std::size_t i) { record_payment(tx, messages[i]); });
//   for (std::size_t i = 0; i < messages.size(); ++i) {
//     const idem::BatchAnswer& a = r.answers[i];
//     if (a.error) { /* the handler of call i threw: its writes rolled back alone */ }
//     else if (a.outcome == idem::Outcome::kExecuted) { /* committed now */ }
//   }
// @endcode
#pragma once

#include <cstddef>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "idem/clock.hpp"
#include "idem/key.hpp"
#include "idem/outcome.hpp"

namespace idem {

/// One call of a batch (IdempotencyGuard::run_batch).
struct BatchCall {
  /// The call's key (the batch owns it: run_batch takes the calls by value).
  Key key;
  /// The payload's fingerprint ("" for no payload check, compared like any other: see
  /// IdempotencyGuard::run). run_batch copies the bytes before any handler runs, so a handler
  /// that rewrites them changes nothing the records store.
  std::string_view fingerprint;
  /// A retry or a redelivery: a record of the key may exist although the fast store grants
  /// the claim (the durable store then skips the insert that assumes fresh keys).
  bool retried = false;
  /// The caller says the key is very likely new (as CallOptions::likely_new: a message's first
  /// delivery). When every call of a batch says so and no fast store granted the claims (none
  /// in front, or it failed), the durable store may write the records with the insert that
  /// assumes fresh keys, as after fresh fast claims; a record found anyway (a producer's
  /// duplicate) costs the batch's transaction one rerun before any handler ran
  /// (BatchResult::records_existed). Never changes an answer.
  bool likely_new = false;
};

/// The answer of one call of a batch.
struct BatchAnswer {
  /// kExecuted: the handler ran and its writes committed with the record. kReplayed: a
  /// record existed (completed, or failed: see `failed`). kInProgress: another attempt holds
  /// the key, or the handler threw (see `error`). kFingerprintMismatch: the key exists with
  /// another fingerprint; nothing ran.
  Outcome outcome = Outcome::kInProgress;
  /// Who answered: the handler, the fast store or the durable store.
  Source source = Source::kHandler;
  /// kReplayed: the record ended as failed (a dead-lettered message); `response` is the reason.
  bool failed = false;
  /// Set when this call's handler threw an exception that is not a retryable idem error: its
  /// writes were rolled back alone (the other calls of the batch committed), its claims were
  /// released, and `outcome` is kInProgress. A retryable idem error thrown by a handler rolls
  /// the whole batch back instead and propagates from run_batch.
  std::exception_ptr error;
  /// kExecuted: the batch's response; kReplayed: the stored bytes.
  std::string response;
  /// Duplicates: the owner token of the record's attempt (empty when unknown).
  std::string holder;
  /// Duplicates: when the record's first attempt began (epoch when unknown).
  TimePoint first_seen{};
  /// kReplayed: when the record's retention ends (epoch when the store does not report it).
  TimePoint expires_at{};
};

/// What run_batch did.
struct BatchResult {
  /// One answer per call, in the order of the calls.
  std::vector<BatchAnswer> answers;
  /// The durable transaction ran a second time with a savepoint per call, because a handler
  /// failed (or a record was locked by another transaction) in the first, savepoint-free run.
  bool rerun = false;
  /// The durable transaction ran again with the tolerant record insert because the insert
  /// that assumes fresh keys (every fast claim granted afresh, or every call likely new)
  /// found a record of one of them.
  bool records_existed = false;
};

}  // namespace idem
