// SPDX-License-Identifier: MIT
// A payment provider stand-in for examples/refund: slow, failing sometimes, and de-duplicating
// refunds by the refund id it is given, as real providers do with their idempotency keys. Its
// ledger is its own SQLite file (never the merchant's database, never the merchant's
// transaction), shared by every process of a run, so a refund that one process's call applied
// is known to the retry another process makes.
//
// Each call: waits 0..max_delay, then
//   * fail_before_percent: fails without applying anything ("provider unavailable");
//   * otherwise applies the refund once per refund id (a repeat answers the first refund's
//     reference and pays nothing), commits, and then, lost_answer_percent of the time, loses
//     the answer ("timeout"): the merchant cannot tell this from the first case and must retry
//     with the same refund id.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

#include "idem/sqlite/sqlite_store.hpp"
#include "refund.hpp"

namespace refund {

/// How the stub behaves.
struct ProviderStubOptions {
  /// The provider's ledger (an SQLite file of its own; created if missing).
  std::string path = "refund_provider.sqlite";
  /// Each call waits a uniform 0..max_delay first.
  std::chrono::milliseconds max_delay{8};
  /// Percent of calls that fail before applying anything.
  int fail_before_percent = 10;
  /// Percent of calls that apply the refund and then lose the answer.
  int lost_answer_percent = 10;
  /// Random seed (0: random).
  std::uint64_t seed = 0;
};

/// One refund as the provider booked it.
struct ProviderRefund {
  std::string order_no;
  std::int64_t amount = 0;
  std::string ref;
  /// Calls that reached the ledger for this refund id (the first applied it, the others were
  /// de-duplicated).
  std::int64_t calls = 0;
  /// Of those, calls whose answer was lost after the refund was applied.
  std::int64_t lost = 0;
};

/// What the provider saw, over every process.
struct ProviderStats {
  std::int64_t calls = 0, failed_before = 0, lost_answers = 0, applied = 0, deduplicated = 0;
};

/// The stub (see the file comment). Thread-safe; several processes may share its file.
class ProviderStub final : public Provider {
 public:
  explicit ProviderStub(ProviderStubOptions options)
      : options_(std::move(options)),
        db_(std::make_unique<idem::sqlite::Database>(options_.path)),
        seed_(options_.seed != 0 ? options_.seed : std::random_device{}()) {
    db_->write([](idem::sqlite::Transaction& tx) {
      tx.exec_script(
          "CREATE TABLE IF NOT EXISTS provider_refunds ("
          " id INTEGER PRIMARY KEY AUTOINCREMENT,"
          " refund_id TEXT NOT NULL UNIQUE,"
          " order_no TEXT NOT NULL,"
          " amount INTEGER NOT NULL,"
          " calls INTEGER NOT NULL DEFAULT 0,"
          " lost INTEGER NOT NULL DEFAULT 0);"
          "CREATE TABLE IF NOT EXISTS provider_stats (name TEXT PRIMARY KEY, n INTEGER NOT NULL);");
    });
  }

  /// Empties the ledger and the counters (before a run).
  void reset() {
    db_->write([](idem::sqlite::Transaction& tx) {
      tx.exec("DELETE FROM provider_refunds");
      tx.exec("DELETE FROM provider_stats");
    });
  }

  std::string refund(const std::string& refund_id, const std::string& order_no,
                     std::int64_t amount) override {
    auto& rng = generator();
    if (options_.max_delay.count() > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(
          rng() % static_cast<std::uint64_t>(options_.max_delay.count() * 1000 + 1)));
    }
    const int roll = static_cast<int>(rng() % 100);
    if (roll < options_.fail_before_percent) {
      db_->write([](idem::sqlite::Transaction& tx) {
        count(tx, "calls");
        count(tx, "failed_before");
      });
      throw ProviderError("provider: unavailable (refund " + refund_id + " not applied)");
    }
    const bool lose = roll < options_.fail_before_percent + options_.lost_answer_percent;
    std::string ref = db_->write([&](idem::sqlite::Transaction& tx) {
      count(tx, "calls");
      int inserted = tx.exec(
          "INSERT INTO provider_refunds (refund_id, order_no, amount) VALUES (?, ?, ?)"
          " ON CONFLICT (refund_id) DO NOTHING",
          refund_id, order_no, amount);
      count(tx, inserted == 1 ? "applied" : "deduplicated");
      auto st = tx.prepare("SELECT id, order_no, amount FROM provider_refunds WHERE refund_id = ?");
      st.bind_all(refund_id);
      if (!st.step()) throw std::logic_error("provider: refund row vanished");
      std::string booked = "PR-" + std::to_string(st.column_int64(0));
      if (st.column_bytes(1) != order_no || st.column_int64(2) != amount) {
        // A real provider answers 422 here; the merchant must never send it.
        throw std::logic_error("provider: refund id " + refund_id +
                               " reused with another order or amount");
      }
      tx.exec("UPDATE provider_refunds SET calls = calls + 1, lost = lost + ? WHERE refund_id = ?",
              lose ? 1 : 0, refund_id);
      if (lose) count(tx, "lost_answers");
      return booked;
    });
    if (lose) {
      throw ProviderError("provider: no answer in time (refund " + refund_id + " was applied)");
    }
    return ref;
  }

  /// The ledger, by refund id.
  std::map<std::string, ProviderRefund> ledger() {
    return db_->read([](idem::sqlite::Session& s) {
      std::map<std::string, ProviderRefund> out;
      auto st =
          s.prepare("SELECT refund_id, order_no, amount, id, calls, lost FROM provider_refunds");
      while (st.step()) {
        out[st.column_bytes(0)] = ProviderRefund{st.column_bytes(1), st.column_int64(2),
                                                 "PR-" + std::to_string(st.column_int64(3)),
                                                 st.column_int64(4), st.column_int64(5)};
      }
      return out;
    });
  }

  /// The counters, over every process that shared the file.
  ProviderStats stats() {
    return db_->read([](idem::sqlite::Session& s) {
      auto n = [&](const char* name) {
        return s.query_int64("SELECT n FROM provider_stats WHERE name = ?", name).value_or(0);
      };
      return ProviderStats{n("calls"), n("failed_before"), n("lost_answers"), n("applied"),
                           n("deduplicated")};
    });
  }

 private:
  static void count(idem::sqlite::Transaction& tx, const char* name) {
    tx.exec(
        "INSERT INTO provider_stats (name, n) VALUES (?, 1)"
        " ON CONFLICT (name) DO UPDATE SET n = n + 1",
        name);
  }

  std::mt19937_64& generator() {
    thread_local std::mt19937_64 rng = [&] {
      std::uint64_t s = seed_ ^ (static_cast<std::uint64_t>(::getpid()) << 20) ^
                        std::hash<std::thread::id>{}(std::this_thread::get_id());
      return std::mt19937_64(s);
    }();
    return rng;
  }

  ProviderStubOptions options_;
  std::unique_ptr<idem::sqlite::Database> db_;
  std::uint64_t seed_;
};

}  // namespace refund
