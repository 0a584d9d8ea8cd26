// SPDX-License-Identifier: MIT
// Cost as the record table grows (scripts/bench.sh scale; README.md in this folder).
//
// Phase `sizes`: fills the durable store's record table with completed records (through
// IdempotentConsumer::consume_batch, 1,000 per transaction: the store's own batch writer, so the
// rows are exactly what the store writes) to each size in turn, and at each size measures, with
// a durable-only guard (no fast store in front: every call reaches the table):
//   * first execution: guard.run on a new key whose handler inserts one small business row;
//   * replay: guard.run on a completed key picked uniformly at random among all records;
// `--calls` of each, in alternating chunks, every call timed: p50 and p99. Next to each replay,
// the baseline of the same lookup without idem: a hand-written read of a record's response by
// its key (its own connection, one prepared statement; another uniformly random key), timed
// the same way: how much of the replay's growth with the table is the database's. Then the table's
// bytes per record (SQLite: the file after a checkpoint, and the record table with its indexes
// from dbstat; PostgreSQL: pg_total_relation_size).
//
// Phase `purge`: adds `--purge` expired records to the same table, then runs the store's
// purge_expired() while a concurrent writer keeps running first executions: the purge's total
// time, and the longest any writer call took meanwhile (against its longest before the purge).
//
// Prints `ratio <backend>_first_exec_<N>_vs_1e4` and `..._replay_...` (p50 throughput at the
// largest size over the smallest: 1 means flat) and the p99 ratios.
//
//   idem_bench_scale --backend sqlite|postgres [--phase sizes|purge|all] [--sizes 1e4,1e5,1e6]
//                    [--calls 5000] [--purge 1e6] [--db PATH] [--dsn CONNINFO] [--schema NAME]
//                    [--mmap-size BYTES] [--cache-kib KIB]   (SQLite DatabaseOptions; default: the
//                                                             library's defaults)
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../common/raw_sqlite.hpp"
#include "../common/side_by_side.hpp"
#include "idem/consumer.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#ifdef IDEM_BENCH_WITH_POSTGRES
#include "idem/postgres/postgres_store.hpp"
#endif

namespace {

using idem::bench::percentile;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string backend = "sqlite";
  std::string phase = "all";
  std::vector<long> sizes{10'000, 100'000, 1'000'000};
  int calls = 5000;
  long purge = 1'000'000;
  std::string db;       // SQLite file (kept between the phases)
  std::string dsn;      // PostgreSQL
  std::string schema;   // PostgreSQL schema (kept between the phases)
  long mmap_size = -1;  // SQLite DatabaseOptions::mmap_size (-1: the default)
  long cache_kib = -1;  // SQLite DatabaseOptions::cache_size_kib (-1: the default)
};

long parse_count(const std::string& s) {
  // "1e6", "1000000", "10^6"
  const auto caret = s.find('^');
  if (caret != std::string::npos) {
    return std::lround(std::pow(std::stod(s.substr(0, caret)), std::stod(s.substr(caret + 1))));
  }
  return std::lround(std::stod(s));
}

std::string size_name(long n) {
  const int e = static_cast<int>(std::lround(std::log10(static_cast<double>(n))));
  if (std::lround(std::pow(10.0, e)) == n) return "1e" + std::to_string(e);
  return std::to_string(n);
}

constexpr const char* kScope = "payment";
constexpr std::size_t kFillBatch = 1000;

std::string record_id(long n) { return "order_" + std::to_string(n); }

// A summary of one set of timed calls.
struct Timing {
  double p50 = 0, p99 = 0, max = 0;
  std::size_t calls = 0;
};

Timing summarise(const std::vector<double>& us) {
  Timing t;
  t.calls = us.size();
  if (us.empty()) return t;
  t.p50 = percentile(us, 0.5);
  t.p99 = percentile(us, 0.99);
  t.max = *std::max_element(us.begin(), us.end());
  return t;
}

double micros_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// What one size measured.
struct SizeResult {
  long size = 0;
  Timing first, replay, plain_read;
  double file_bytes_per_record = 0, table_bytes_per_record = 0;
};

// The backend-specific parts: stores, business statement, sizes on disk.
template <class Store>
struct Backend;

template <>
struct Backend<idem::sqlite::SqliteStore> {
  using Tx = idem::sqlite::Transaction;
  std::shared_ptr<idem::sqlite::Database> db;
  std::unique_ptr<idem::sqlite::SqliteStore> store;
  std::string path;
  std::unique_ptr<idem::bench::RawSqlite> raw;  // plain_read()'s connection
  std::unique_ptr<idem::bench::RawStatement> raw_select;

  explicit Backend(const Args& a) : path(a.db) {
    idem::sqlite::DatabaseOptions o;
    if (a.mmap_size >= 0) o.mmap_size = a.mmap_size;
    if (a.cache_kib >= 0) o.cache_size_kib = a.cache_kib;
    std::printf("sqlite: DatabaseOptions mmap_size %lld bytes, cache_size_kib %lld%s\n",
                static_cast<long long>(o.mmap_size), static_cast<long long>(o.cache_size_kib),
                o.cache_size_kib == 0 ? " (SQLite's default, 2,000)" : "");
    db = std::make_shared<idem::sqlite::Database>(path, o);
    store = std::make_unique<idem::sqlite::SqliteStore>(db);
    db->write([](Tx& tx) {
      tx.exec("CREATE TABLE IF NOT EXISTS payment (order_no TEXT PRIMARY KEY, amount INTEGER)");
    });
  }
  static const char* name() { return "sqlite"; }
  static const char* file_label() { return "file"; }
  // The hand-written read of a completed record's response by its key, on a connection of its
  // own with the statement prepared once: the same lookup without idem.
  bool plain_read(const std::string& id) {
    if (!raw_select) {
      const idem::sqlite::SqliteStoreOptions o;  // the store's column names (its defaults)
      raw = std::make_unique<idem::bench::RawSqlite>(path);
      raw_select = std::make_unique<idem::bench::RawStatement>(
          raw->get(), "SELECT response_body FROM " + store->table() + " WHERE " + o.key_column +
                          " = ?1 AND " + o.scope_column + " = ?2");
    }
    raw_select->text(1, id).text(2, kScope);
    const int rc = raw_select->step();
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) raw_select->fail(rc);
    const bool found = rc == SQLITE_ROW && sqlite3_column_bytes(raw_select->get(), 0) > 0;
    raw_select->reset();
    return found;
  }
  void business(Tx& tx, const std::string& id) {
    tx.exec("INSERT INTO payment (order_no, amount) VALUES (?, ?)", id, 100);
  }
  // A store writing records whose retention ended a day ago (its clock runs two days behind).
  std::unique_ptr<idem::sqlite::SqliteStore> expired_writer() {
    idem::sqlite::SqliteStoreOptions o;
    o.clock = [] { return idem::system_now() - std::chrono::hours(48); };
    return std::make_unique<idem::sqlite::SqliteStore>(db, o);
  }
  void after_expired_fill() {}
  long records() {
    return db->read([&](idem::sqlite::Session& s) {
      return *s.query_int64("SELECT count(*) FROM " + store->table());
    });
  }
  // (file bytes, record table + its indexes bytes)
  std::pair<double, double> bytes() {
    double file = 0, table = 0;
    db->read([&](idem::sqlite::Session& s) {
      s.exec_script("PRAGMA wal_checkpoint(TRUNCATE)");
      try {
        table = static_cast<double>(
            s.query_int64("SELECT sum(pgsize) FROM dbstat WHERE name IN (SELECT name FROM"
                          " sqlite_schema WHERE tbl_name = ?)",
                          store->table())
                .value_or(0));
      } catch (const idem::Error&) {
        table = 0;  // built without SQLITE_ENABLE_DBSTAT_VTAB
      }
    });
    file = static_cast<double>(std::filesystem::file_size(path));
    return {file, table};
  }
  std::string conditions() {
    return db->read([&](idem::sqlite::Session& s) {
      return "SQLite " + std::string(*s.query_text("SELECT sqlite_version()")) +
             ", WAL synchronous=NORMAL, cache_size=" +
             std::to_string(*s.query_int64("PRAGMA cache_size")) +
             ", mmap_size=" + std::to_string(*s.query_int64("PRAGMA mmap_size")) +
             ", page_size=" + std::to_string(*s.query_int64("PRAGMA page_size"));
    });
  }
};

#ifdef IDEM_BENCH_WITH_POSTGRES
template <>
struct Backend<idem::postgres::PostgresStore> {
  using Tx = pqxx::work;
  std::unique_ptr<idem::postgres::PostgresStore> store;
  std::string dsn, schema, business_sql;
  std::unique_ptr<pqxx::connection> raw;  // plain_read()'s connection

  explicit Backend(const Args& a) : dsn(a.dsn), schema(a.schema) {
    idem::postgres::PostgresStoreOptions o;
    o.conninfo = dsn;
    o.schema = schema;
    store = std::make_unique<idem::postgres::PostgresStore>(o);
    business_sql = "INSERT INTO " + schema + ".payment (order_no, amount) VALUES ($1, $2)";
    store->with_transaction([&](Tx& tx) {
      tx.exec("CREATE TABLE IF NOT EXISTS " + schema +
              ".payment (id bigserial PRIMARY KEY, order_no text NOT NULL, amount bigint NOT"
              " NULL)");
    });
  }
  static const char* name() { return "postgres"; }
  static const char* file_label() { return "database"; }
  // The hand-written read of a completed record's response by its key, on a connection of its
  // own with the statement prepared once: the same lookup without idem.
  bool plain_read(const std::string& id) {
    if (!raw) {
      const auto& o = store->options();
      raw = std::make_unique<pqxx::connection>(dsn);
      raw->prepare("plain_read", "SELECT response_body FROM " + store->qualified_table() +
                                     " WHERE " + o.key_column + " = $1 AND " + o.scope_column +
                                     " = $2");
    }
    pqxx::nontransaction nt(*raw);
    auto r = nt.exec_prepared("plain_read", id, kScope);
    return r.size() == 1 && !r[0][0].is_null();
  }
  void business(Tx& tx, const std::string& id) { tx.exec_params(business_sql, id, 100); }
  // The database clock decides expiry: records written with a 1 s retention, then a wait.
  std::unique_ptr<idem::postgres::PostgresStore> expired_writer() {
    idem::postgres::PostgresStoreOptions o = store->options();
    o.migrate = false;
    o.conninfo = dsn + " options='-c synchronous_commit=off'";
    return std::make_unique<idem::postgres::PostgresStore>(o);
  }
  void after_expired_fill() { std::this_thread::sleep_for(std::chrono::milliseconds(1500)); }
  long records() {
    return store->with_transaction([&](Tx& tx) {
      return tx.exec("SELECT count(*) FROM " + store->qualified_table())[0][0].as<long>();
    });
  }
  std::pair<double, double> bytes() {
    // VACUUM runs outside a transaction block: a pooled connection in autocommit.
    auto c = store->pool().acquire();
    pqxx::nontransaction nt(c.get());
    nt.exec("VACUUM ANALYZE " + store->qualified_table());
    auto r = nt.exec_params(
        "SELECT pg_database_size(current_database()),"
        " pg_total_relation_size($1::regclass)",
        store->qualified_table());
    return {r[0][0].as<double>(), r[0][1].as<double>()};
  }
  std::string conditions() {
    return store->with_transaction([&](Tx& tx) {
      auto show = [&](const char* s) {
        return tx.exec(std::string("SHOW ") + s)[0][0].as<std::string>();
      };
      return "PostgreSQL " + show("server_version") + ", shared_buffers=" + show("shared_buffers") +
             ", fsync=" + show("fsync") + ", synchronous_commit=" + show("synchronous_commit");
    });
  }
};
#endif

template <class Store>
class ScaleBench {
 public:
  using B = Backend<Store>;
  using Tx = typename B::Tx;

  explicit ScaleBench(const Args& a) : args_(a), b_(a) {}

  // Writes completed records `from` .. `to` - 1 through `store` (1,000 per transaction).
  void fill(Store& store, long from, long to, std::chrono::seconds retention) {
    idem::GuardOptions go;
    go.retention = retention;
    idem::IdempotencyGuard<Store> guard{store, go};
    idem::IdempotentConsumer<Store> consumer{guard, kScope};
    std::vector<std::string> ids;
    std::vector<idem::Delivery> batch;
    for (long n = from; n < to;) {
      ids.clear();
      batch.clear();
      for (; n < to && ids.size() < kFillBatch; ++n) ids.push_back(record_id(n));
      for (const auto& id : ids) batch.push_back(idem::Delivery{id, fp_});
      auto verdicts = consumer.consume_batch(batch, [](Tx&, std::size_t) {});
      for (auto v : verdicts) {
        if (v != idem::Verdict::kAck) {
          std::fprintf(stderr, "fill: a record was not written\n");
          std::exit(1);
        }
      }
    }
  }

  long existing() { return b_.records(); }

  // First executions and replays at the current size.
  SizeResult measure(long size) {
    idem::IdempotencyGuard<Store> guard{*b_.store};
    std::mt19937_64 rng(static_cast<std::uint64_t>(size));
    std::mt19937_64 plain_rng(static_cast<std::uint64_t>(size) + 1);  // other keys than ours
    std::uniform_int_distribution<long> pick(0, size - 1);
    std::vector<double> first, replay, plain;
    first.reserve(static_cast<std::size_t>(args_.calls));
    replay.reserve(static_cast<std::size_t>(args_.calls));
    plain.reserve(static_cast<std::size_t>(args_.calls));
    const int chunk = std::max(1, args_.calls / 5);
    long bad = 0;
    for (int done = 0; done < args_.calls; done += chunk) {
      const int n = std::min(chunk, args_.calls - done);
      for (int i = 0; i < n; ++i) {
        const std::string id = "new_" + size_name(size) + "_" + std::to_string(done + i);
        const auto t0 = Clock::now();
        auto r = guard.run(idem::Key::make(kScope, id), fp_, [&](Tx& tx) {
          b_.business(tx, id);
          return "pay_" + id;
        });
        first.push_back(micros_since(t0));
        if (r.outcome != idem::Outcome::kExecuted) ++bad;
      }
      for (int i = 0; i < n; ++i) {
        const std::string id = record_id(pick(rng));
        const auto t0 = Clock::now();
        auto r = guard.run(idem::Key::make(kScope, id), fp_,
                           [&](Tx&) -> std::string { throw std::runtime_error("ran"); });
        replay.push_back(micros_since(t0));
        if (r.outcome != idem::Outcome::kReplayed) ++bad;
        const std::string other = record_id(pick(plain_rng));
        const auto t1 = Clock::now();
        const bool found = b_.plain_read(other);
        plain.push_back(micros_since(t1));
        if (!found) ++bad;
      }
    }
    if (bad != 0) {
      std::fprintf(stderr, "size %ld: %ld calls with an unexpected outcome\n", size, bad);
      std::exit(1);
    }
    SizeResult s;
    s.size = size;
    s.first = summarise(first);
    s.replay = summarise(replay);
    s.plain_read = summarise(plain);
    const long records = b_.records();
    auto [file, table] = b_.bytes();
    s.file_bytes_per_record = file / static_cast<double>(records);
    s.table_bytes_per_record = table / static_cast<double>(records);
    return s;
  }

  void sizes() {
    std::printf("%s scale: %s\n", B::name(), b_.conditions().c_str());
    std::printf(
        "durable-only guard, %d first executions and %d replays per size (uniformly"
        " random completed keys), every call timed\n",
        args_.calls, args_.calls);
    std::vector<SizeResult> results;
    long have = 0;  // fill records written so far (ids order_0 .. order_have-1)
    for (long size : args_.sizes) {
      const auto t0 = Clock::now();
      fill(*b_.store, have, size, idem::kDefaultRetention);
      const double fill_s = micros_since(t0) / 1e6;
      have = size;
      SizeResult s = measure(size);
      std::printf(
          "  %-5s records: first exec p50 %7.1f us  p99 %7.1f us | replay p50 %6.1f us  p99 "
          "%7.1f us | bytes/record: %6.1f in the %s, %6.1f in the record table (fill %.1f s)\n",
          size_name(size).c_str(), s.first.p50, s.first.p99, s.replay.p50, s.replay.p99,
          s.file_bytes_per_record, B::file_label(), s.table_bytes_per_record, fill_s);
      std::printf("  %-5s records: hand-written read of a record p50 %6.1f us  p99 %7.1f us\n",
                  size_name(size).c_str(), s.plain_read.p50, s.plain_read.p99);
      std::fflush(stdout);
      results.push_back(s);
    }
    const SizeResult& base = results.front();
    for (std::size_t i = 1; i < results.size(); ++i) {
      const SizeResult& s = results[i];
      const std::string tag = size_name(s.size) + "_vs_" + size_name(base.size);
      std::printf("ratio %s_first_exec_%s = %.3f\n", B::name(), tag.c_str(),
                  base.first.p50 / s.first.p50);
      std::printf("ratio %s_replay_%s = %.3f\n", B::name(), tag.c_str(),
                  base.replay.p50 / s.replay.p50);
      std::printf("ratio %s_first_exec_p99_%s = %.3f\n", B::name(), tag.c_str(),
                  base.first.p99 / s.first.p99);
      std::printf("ratio %s_replay_p99_%s = %.3f\n", B::name(), tag.c_str(),
                  base.replay.p99 / s.replay.p99);
      // The same growth for the read without idem: what the database alone gives up.
      std::printf("ratio %s_plain_read_%s = %.3f\n", B::name(), tag.c_str(),
                  base.plain_read.p50 / s.plain_read.p50);
      std::printf("ratio %s_plain_read_p99_%s = %.3f\n", B::name(), tag.c_str(),
                  base.plain_read.p99 / s.plain_read.p99);
    }
    // Side by side at each size: the replay over the hand-written read (p50 throughput).
    for (const SizeResult& s : results) {
      std::printf("ratio %s_replay_vs_plain_read_%s = %.3f\n", B::name(), size_name(s.size).c_str(),
                  s.plain_read.p50 / s.replay.p50);
    }
  }

  // Runs first executions on new keys until `stop`; every call's latency goes to `us`.
  void writer(const std::atomic<bool>& stop, const std::string& tag, std::vector<double>& us) {
    idem::IdempotencyGuard<Store> guard{*b_.store};
    for (long i = 0; !stop.load(); ++i) {
      const std::string id = "w_" + tag + "_" + std::to_string(i);
      const auto t0 = Clock::now();
      auto r = guard.run(idem::Key::make(kScope, id), fp_, [&](Tx& tx) {
        b_.business(tx, id);
        return "pay_" + id;
      });
      us.push_back(micros_since(t0));
      if (r.outcome != idem::Outcome::kExecuted) {
        std::fprintf(stderr, "writer: a first execution was not executed\n");
        std::exit(1);
      }
    }
  }

  void purge() {
    std::printf("%s purge: %s\n", B::name(), b_.conditions().c_str());
    const long live = existing();
    const long first_id = 1'000'000'000L;  // the expired records' ids: apart from the fill's
    {
      auto writer_store = b_.expired_writer();
      const auto t0 = Clock::now();
      fill(*writer_store, first_id, first_id + args_.purge, std::chrono::seconds(1));
      std::printf("  %ld expired records added next to %ld live ones (%.1f s)\n", args_.purge, live,
                  micros_since(t0) / 1e6);
    }
    b_.after_expired_fill();
    // The writer alone first (what its calls take without a purge), then during the purge.
    // Its keys carry this run's start time: a purge run again on the same file writes new keys.
    const std::string run = std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                               std::chrono::system_clock::now().time_since_epoch())
                                               .count());
    std::vector<double> before, during;
    {
      std::atomic<bool> stop{false};
      std::thread w([&] { writer(stop, "before_" + run, before); });
      std::this_thread::sleep_for(std::chrono::seconds(3));
      stop = true;
      w.join();
    }
    std::atomic<bool> stop{false};
    std::thread w([&] { writer(stop, "during_" + run, during); });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto t0 = Clock::now();
    const std::size_t purged = b_.store->purge_expired();
    const double purge_s = micros_since(t0) / 1e6;
    stop = true;
    w.join();
    const Timing tb = summarise(before), td = summarise(during);
    std::printf("  purge_expired(): %zu records in %.2f s (%.0f records/s), default batch\n",
                purged, purge_s, static_cast<double>(purged) / purge_s);
    std::printf(
        "  concurrent writer (first executions), before the purge: %zu calls, p50 %.1f"
        " us, p99 %.1f us, longest %.1f ms\n",
        tb.calls, tb.p50, tb.p99, tb.max / 1000);
    std::printf(
        "  concurrent writer, during the purge:                   %zu calls, p50 %.1f"
        " us, p99 %.1f us, longest %.1f ms\n",
        td.calls, td.p50, td.p99, td.max / 1000);
    std::printf("%s_purge_longest_writer_stall_ms = %.1f\n", B::name(), td.max / 1000);
    if (static_cast<long>(purged) < args_.purge) {
      std::fprintf(stderr, "purge: %zu of %ld expired records deleted\n", purged, args_.purge);
      std::exit(1);
    }
  }

 private:
  const Args& args_;
  B b_;
  const std::string fp_ = idem::fingerprint("{\"amount\":100}");
};

template <class Store>
int run(const Args& a) {
  ScaleBench<Store> bench(a);
  if (a.phase == "sizes" || a.phase == "all") bench.sizes();
  if (a.phase == "purge" || a.phase == "all") bench.purge();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--backend") a.backend = v;
    if (k == "--phase") a.phase = v;
    if (k == "--calls") a.calls = std::atoi(v.c_str());
    if (k == "--purge") a.purge = parse_count(v);
    if (k == "--db") a.db = v;
    if (k == "--dsn") a.dsn = v;
    if (k == "--schema") a.schema = v;
    if (k == "--mmap-size") a.mmap_size = parse_count(v);
    if (k == "--cache-kib") a.cache_kib = parse_count(v);
    if (k == "--sizes") {
      a.sizes.clear();
      std::size_t at = 0;
      while (at <= v.size()) {
        const auto comma = v.find(',', at);
        a.sizes.push_back(parse_count(v.substr(at, comma - at)));
        if (comma == std::string::npos) break;
        at = comma + 1;
      }
    }
  }
  if (a.sizes.empty() || a.calls <= 0) {
    std::fprintf(stderr, "idem_bench_scale: --sizes and --calls must be positive\n");
    return 2;
  }
  try {
    if (a.backend == "sqlite") {
      if (a.db.empty()) {
        std::fprintf(stderr, "idem_bench_scale: --db PATH is required for sqlite\n");
        return 2;
      }
      return run<idem::sqlite::SqliteStore>(a);
    }
#ifdef IDEM_BENCH_WITH_POSTGRES
    if (a.backend == "postgres") {
      if (a.dsn.empty() || a.schema.empty()) {
        std::fprintf(stderr, "idem_bench_scale: --dsn and --schema are required for postgres\n");
        return 2;
      }
      return run<idem::postgres::PostgresStore>(a);
    }
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "idem_bench_scale: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "idem_bench_scale: unknown backend '%s'\n", a.backend.c_str());
  return 2;
}
