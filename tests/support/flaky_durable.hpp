// SPDX-License-Identifier: MIT
// FlakyDurable: a durable store over SqliteStore whose operations fail with a transient error
// a set number of times, optionally after applying (an answer lost with its connection): the
// guards' retries and their recognition of writes already applied, synchronous and
// asynchronous (through PooledDurable).
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "idem/errors.hpp"
#include "idem/sqlite/sqlite_store.hpp"

namespace idem::test {

// A durable store whose begin, complete and run_transactional fail with a transient error a
// set number of times before reaching SQLite (a dropped connection, a failover).
class FlakyDurable {
 public:
  using Transaction = idem::sqlite::Transaction;
  explicit FlakyDurable(idem::sqlite::SqliteStore& inner) : inner_(inner) {}
  int fail_begin = 0, fail_complete = 0, fail_transactional = 0, fail_release = 0;
  // A completion with a longer response is refused for good, as MySQL refuses one over
  // max_allowed_packet (a UsageError before anything is written).
  std::size_t max_response = static_cast<std::size_t>(-1);
  bool applied_then_lost = false;  // run_transactional commits, then reports OutcomeUnknown
  bool complete_applied_then_lost = false;  // a failing complete applies, then OutcomeUnknown
  bool begin_applied_then_lost = false;     // a failing begin applies, then OutcomeUnknown
  bool refuse_fail = false;  // fail() throws a non-retryable StorageError (a disk I/O error)
  idem::DurableHint last_hint;              // what the guard passed last

  template <class Handler>
  idem::TransactionalResult run_transactional(const idem::Key& k, std::string_view fp,
                                              const idem::OwnerToken& o,
                                              std::chrono::seconds retention, Handler&& h,
                                              idem::DurableHint hint) {
    if (fail_transactional > 0) {
      --fail_transactional;
      if (applied_then_lost) {
        inner_.run_transactional(k, fp, o, retention, h, hint);
        throw idem::OutcomeUnknown("test: connection lost at COMMIT");
      }
      throw idem::StorageUnavailable("test: connection refused");
    }
    last_hint = hint;
    return inner_.run_transactional(k, fp, o, retention, std::forward<Handler>(h), hint);
  }
  idem::ClaimResult begin(const idem::Key& k, std::string_view fp, const idem::OwnerToken& o,
                          std::chrono::milliseconds lease, idem::DurableHint hint) {
    last_hint = hint;
    if (fail_begin > 0) {
      --fail_begin;
      if (begin_applied_then_lost) {
        (void)inner_.begin(k, fp, o, lease, hint);
        throw idem::OutcomeUnknown("test: connection lost before the answer");
      }
      throw idem::StorageTimeout("test: no answer in time");
    }
    return inner_.begin(k, fp, o, lease, hint);
  }
  bool complete(const idem::Key& k, const idem::OwnerToken& o, std::string_view r,
                std::chrono::seconds retention) {
    if (fail_complete > 0) {
      --fail_complete;
      if (complete_applied_then_lost) {
        (void)inner_.complete(k, o, r, retention);
        throw idem::OutcomeUnknown("test: connection lost before the answer, re-read failed");
      }
      throw idem::StorageUnavailable("test: connection reset");
    }
    if (r.size() > max_response) {
      throw idem::UsageError("test: a response of " + std::to_string(r.size()) +
                             " bytes is larger than the store takes");
    }
    return inner_.complete(k, o, r, retention);
  }
  bool release(const idem::Key& k, const idem::OwnerToken& o) {
    if (fail_release > 0) {
      --fail_release;
      throw idem::StorageUnavailable("test: connection reset");
    }
    return inner_.release(k, o);
  }
  bool fail(const idem::Key& k, const idem::OwnerToken& o, std::string_view reason,
            std::chrono::seconds retention) {
    if (refuse_fail) throw idem::StorageError("test: disk I/O error (the mark refused too)");
    return inner_.fail(k, o, reason, retention);
  }
  std::optional<idem::Record> lookup(const idem::Key& k) { return inner_.lookup(k); }
  std::size_t purge_expired(std::size_t n) { return inner_.purge_expired(n); }
  std::string_view name() const noexcept { return "flaky"; }

 private:
  idem::sqlite::SqliteStore& inner_;
};

}  // namespace idem::test
