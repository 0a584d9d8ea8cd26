// SPDX-License-Identifier: MIT
// idem::AttemptLedger: failed attempts counted per message, for IdempotentConsumer's dead
// letters; MemoryAttemptLedger, the in-process one.
//
// File: attempt_ledger.hpp
//
// The durable ledgers (idem::sqlite::SqliteAttemptLedger, idem::postgres::PostgresAttemptLedger,
// idem::mysql::MysqlAttemptLedger) implement this interface in their adapters' folders.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "idem/key.hpp"

namespace idem {

/// Counts failed attempts per message. Implementations must be thread-safe.
/// MemoryAttemptLedger forgets on restart; idem::sqlite::SqliteAttemptLedger does not.
class AttemptLedger {
 public:
  virtual ~AttemptLedger() = default;
  /// Adds one failure of `key` with its error. @return the failures counted so far (>= 1).
  virtual std::uint32_t record_failure(const Key& key, std::string_view error) = 0;
  /// Failures counted for `key` (0 when none).
  virtual std::uint32_t failures(const Key& key) = 0;
  /// Forgets `key` (after it succeeded or was dead-lettered).
  virtual void clear(const Key& key) = 0;
};

/// In-process AttemptLedger: counts are lost when the consumer restarts (a poison message then
/// gets up to max_attempts more tries). Use a durable ledger in production.
class MemoryAttemptLedger final : public AttemptLedger {
 public:
  /// Adds one failure of `key`. @return the failures counted so far.
  std::uint32_t record_failure(const Key& key, std::string_view) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return ++counts_[key.str()];
  }
  /// Failures counted for `key`.
  std::uint32_t failures(const Key& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = counts_.find(key.str());
    return it == counts_.end() ? 0 : it->second;
  }
  /// Forgets `key`.
  void clear(const Key& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (counts_.empty()) return;  // the usual case: IdempotentConsumer clears on every success
    counts_.erase(key.str());
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::string, std::uint32_t> counts_;
};

}  // namespace idem
