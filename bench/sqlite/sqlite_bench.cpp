// SPDX-License-Identifier: MIT
// The guard's transactional path on SQLite (the demo's, MQ's and HTTP's) against the same
// business write without idempotency, in the same process, rounds interleaved (ours, plain,
// plain, ours, ...), medians of the per-round ratios:
//
// * first execution: guard.run on a new key (MemoryStore in front, then one SQLite write
//   transaction holding the record and one payment row) vs one write transaction inserting the
//   payment row;
// * the same without a fast store (durable only);
// * durable replay: guard.run on a completed key without a fast store (answered from a read
//   snapshot) vs a read of the payment row.
//
// and against hand-written sqlite3 code giving the same guarantee (bench/common/raw_sqlite.hpp:
// one transaction inserting a record row with a unique key on the business key, its status and
// response, and the payment row; a duplicate caught by the unique violation and answered by
// reading the stored response), in the seed's table shape (surrogate id + unique key) and keyed
// by the unique key itself (WITHOUT ROWID).
//
//   idem_bench_sqlite [--ops N] [--rounds N] [--only LOOP]
//
// --only runs one loop alone (for callgrind or perf): ours_first, ours_durable_first,
// plain_first, handwritten_first, handwritten_without_rowid_first, ours_replay, plain_replay,
// handwritten_replay.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "../common/raw_sqlite.hpp"
#include "idem/idem.hpp"
#include "idem/sqlite/sqlite_store.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ops/s of `fn(i)` for i in [0, n).
double rate(int n, const std::function<void(int)>& fn) {
  auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) fn(i);
  return n / std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Side {
  std::vector<double> ours, plain, ratios;
};

void report(const char* name, const Side& s) {
  std::printf("%-44s ours: %8.0f ops/s  plain: %8.0f ops/s (medians)\n", name, median(s.ours),
              median(s.plain));
  std::printf("ratio %s = %.3f\n", name, median(s.ratios));
}

}  // namespace

int main(int argc, char** argv) {
  int ops = 2000, rounds = 11;
  std::string only;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--ops") ops = std::atoi(argv[i + 1]);
    if (k == "--rounds") rounds = std::atoi(argv[i + 1]);
    if (k == "--only") only = argv[i + 1];
  }
  auto dir =
      std::filesystem::temp_directory_path() / ("idem-bench-sqlite-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable{(dir / "ours.db").string()};
  idem::sqlite::Database plain_db{(dir / "plain.db").string()};
  const char* schema = "CREATE TABLE payment (order_no TEXT PRIMARY KEY, amount INTEGER)";
  durable.database().write([&](idem::sqlite::Transaction& tx) { tx.exec(schema); });
  plain_db.write([&](idem::sqlite::Transaction& tx) { tx.exec(schema); });
  // The hand-written recipe, in its own files: the seed's table shape, and WITHOUT ROWID.
  idem::bench::RawSqlite hw_db{(dir / "handwritten.db").string()};
  idem::bench::RawSqlite hw_nr_db{(dir / "handwritten_without_rowid.db").string()};
  hw_db.exec(schema);
  hw_nr_db.exec(schema);
  hw_db.exec(idem::bench::raw_record_table_sql("api_idempotency", false));
  hw_nr_db.exec(idem::bench::raw_record_table_sql("api_idempotency", true));
  const std::string pay = "INSERT INTO payment (order_no, amount) VALUES (?1, ?2)";
  idem::bench::RawRecordGuard hw{hw_db, "api_idempotency", pay};
  idem::bench::RawRecordGuard hw_nr{hw_nr_db, "api_idempotency", pay};
  idem::IdempotencyGuard<idem::sqlite::SqliteStore> with_fast{fast, durable};
  idem::IdempotencyGuard<idem::sqlite::SqliteStore> durable_only{durable};
  const std::string fp = idem::fingerprint("{\"amount\":100}");

  Side first, first_durable, replay, first_hw, first_durable_hw, first_hw_nr, replay_hw;
  long bad = 0;
  for (int round = 0; round < rounds; ++round) {
    const std::string r = std::to_string(round);
    auto ours_first = [&](idem::IdempotencyGuard<idem::sqlite::SqliteStore>& g, const char* tag) {
      return rate(ops, [&](int i) {
        const std::string order = std::string(tag) + r + "_" + std::to_string(i);
        auto res = g.run(idem::Key::make("payment", order), fp, [&](idem::sqlite::Transaction& tx) {
          tx.exec("INSERT INTO payment (order_no, amount) VALUES (?, ?)", order, 100);
          return "pay_" + order;
        });
        if (res.outcome != idem::Outcome::kExecuted) ++bad;
      });
    };
    auto plain_first = [&](const char* tag) {
      return rate(ops, [&](int i) {
        const std::string order = std::string(tag) + r + "_" + std::to_string(i);
        plain_db.write([&](idem::sqlite::Transaction& tx) {
          tx.exec("INSERT INTO payment (order_no, amount) VALUES (?, ?)", order, 100);
        });
      });
    };
    auto ours_replay = [&] {
      return rate(ops, [&](int i) {
        const std::string order = "d" + r + "_" + std::to_string(i);
        auto res = durable_only.run(idem::Key::make("payment", order), fp,
                                    [&](idem::sqlite::Transaction&) { return std::string(); });
        if (res.outcome != idem::Outcome::kReplayed) ++bad;
      });
    };
    auto plain_replay = [&] {
      return rate(ops, [&](int i) {
        const std::string order = "d" + r + "_" + std::to_string(i);
        auto n = plain_db.read([&](idem::sqlite::Session& s) {
          return s.query_int64("SELECT amount FROM payment WHERE order_no = ?", order);
        });
        if (!n) ++bad;
      });
    };
    auto hw_first = [&](idem::bench::RawRecordGuard& g, const char* tag) {
      return rate(ops, [&](int i) {
        const std::string order = std::string(tag) + r + "_" + std::to_string(i);
        g.business().text(1, order).integer(2, 100);
        if (g.run("payment", order, "pay_" + order)) ++bad;
      });
    };
    // A duplicate, hand-written: the record INSERT fails on the unique key, ROLLBACK, read.
    auto hw_replay = [&] {
      return rate(ops, [&](int i) {
        const std::string order = "h" + r + "_" + std::to_string(i);
        hw.business().text(1, order).integer(2, 100);
        auto stored = hw.run("payment", order, "pay_" + order);
        if (!stored || *stored != "pay_" + order) ++bad;
      });
    };
    if (!only.empty()) {
      // One loop alone; replays need their keys written first (not timed).
      if (only == "ours_replay" || only == "plain_replay") {
        ours_first(durable_only, "d");
        plain_first("d");
      }
      if (only == "handwritten_replay") hw_first(hw, "h");
      const std::vector<std::pair<std::string, std::function<double()>>> loops{
          {"ours_first", [&] { return ours_first(with_fast, "f"); }},
          {"ours_durable_first", [&] { return ours_first(durable_only, "d"); }},
          {"plain_first", [&] { return plain_first("f"); }},
          {"handwritten_first", [&] { return hw_first(hw, "g"); }},
          {"handwritten_without_rowid_first", [&] { return hw_first(hw_nr, "n"); }},
          {"ours_replay", ours_replay},
          {"plain_replay", plain_replay},
          {"handwritten_replay", hw_replay}};
      bool found = false;
      for (const auto& [name, loop] : loops) {
        if (name != only) continue;
        found = true;
        std::printf("%s: %.0f ops/s\n", name.c_str(), loop());
      }
      if (!found) {
        std::fprintf(stderr, "--only: no loop '%s'\n", only.c_str());
        return 2;
      }
      continue;
    }
    auto pair = [&](Side& side, const std::function<double()>& ours,
                    const std::function<double()>& plain) {
      double o = 0, p = 0;
      if (round % 2 == 0) {
        o = ours();
        p = plain();
      } else {
        p = plain();
        o = ours();
      }
      side.ours.push_back(o);
      side.plain.push_back(p);
      side.ratios.push_back(o / p);
    };
    pair(
        first, [&] { return ours_first(with_fast, "f"); }, [&] { return plain_first("f"); });
    pair(
        first_durable, [&] { return ours_first(durable_only, "d"); },
        [&] { return plain_first("d"); });
    pair(replay, ours_replay, plain_replay);
    pair(
        first_hw, [&] { return ours_first(with_fast, "g"); }, [&] { return hw_first(hw, "g"); });
    pair(
        first_durable_hw, [&] { return ours_first(durable_only, "e"); },
        [&] { return hw_first(hw, "e"); });
    pair(
        first_hw_nr, [&] { return ours_first(with_fast, "n"); },
        [&] { return hw_first(hw_nr, "n"); });
    hw_first(hw, "h");  // the keys the hand-written duplicates meet
    pair(replay_hw, ours_replay, hw_replay);
  }
  std::filesystem::remove_all(dir);
  if (!only.empty()) return bad == 0 ? 0 : 1;
  std::printf("SQLite transactional path: %d ops x %d interleaved rounds, WAL synchronous=NORMAL\n",
              ops, rounds);
  if (bad != 0) std::printf("WARNING: %ld calls with an unexpected outcome\n", bad);
  report("sqlite_guard_first_exec_vs_plain_insert", first);
  report("sqlite_guard_durable_only_first_exec_vs_plain_insert", first_durable);
  report("sqlite_guard_durable_replay_vs_plain_read", replay);
  std::printf(
      "against the hand-written record recipe (sqlite3, record row + payment row in one "
      "transaction):\n");
  report("sqlite_guard_first_exec_vs_handwritten_record", first_hw);
  report("sqlite_guard_durable_only_first_exec_vs_handwritten_record", first_durable_hw);
  report("sqlite_guard_first_exec_vs_handwritten_record_without_rowid", first_hw_nr);
  report("sqlite_guard_durable_replay_vs_handwritten_record", replay_hw);
  return bad == 0 ? 0 : 1;
}
