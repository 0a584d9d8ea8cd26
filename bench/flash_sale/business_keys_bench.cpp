// SPDX-License-Identifier: MIT
// What the business-key helpers cost against the usual hand-written alternatives, interleaved
// A/B in one process, medians of rounds:
//
//   sqlite_duplicate   UniqueInsert on an existing key  vs  INSERT, catch the constraint error,
//                      SELECT the id
//   pg_duplicate       UniqueInsert on an existing key  vs  SAVEPOINT + INSERT, catch
//                      unique_violation, ROLLBACK TO SAVEPOINT, SELECT the id (what keeps a
//                      PostgreSQL transaction usable without ON CONFLICT)
//   pg_first_insert    UniqueInsert of a new key        vs  plain INSERT ... RETURNING id
//   pg_hot_stock       StockTable::deduct on one row, 8 threads  vs  SELECT ... FOR UPDATE,
//                      check, UPDATE
//
// Each operation is one committed transaction. PostgreSQL parts run when IDEM_TEST_POSTGRES_DSN
// is set (scripts/bench.sh starts a server). Prints figures, then `ratio <name> = <ours/baseline
// throughput>` (higher is better for us).
#include <pqxx/pqxx>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "idem/postgres/sql_driver.hpp"
#include "idem/sqlite/sql_driver.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "idem/stock.hpp"
#include "idem/unique_insert.hpp"

namespace {

// Baseline statements go through the same driver (one place for libpqxx version differences).
template <class Tx, class... Args>
std::optional<std::int64_t> pg(Tx& tx, const std::string& sql, const Args&... args) {
  return idem::SqlDriver<Tx>::query_int64(tx, sql, args...);
}

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Runs `a` and `b` alternately for `rounds` rounds of `ops` operations each; returns the median
// throughput (ops/s) of each.
std::pair<double, double> interleave(int rounds, int ops, const std::function<void(int)>& a,
                                     const std::function<void(int)>& b) {
  std::vector<double> ra, rb;
  int serial = 0;
  for (int r = 0; r < rounds; ++r) {
    for (int which = 0; which < 2; ++which) {
      const auto& fn = (r % 2 == which) ? a : b;  // alternate which goes first
      auto t0 = Clock::now();
      for (int i = 0; i < ops; ++i) fn(serial++);
      double s = std::chrono::duration<double>(Clock::now() - t0).count();
      ((&fn == &a) ? ra : rb).push_back(ops / s);
    }
  }
  return {median(ra), median(rb)};
}

void report(const char* name, const char* ours, const char* baseline,
            std::pair<double, double> r) {
  std::printf("%-18s ours %-34s %10.0f ops/s   baseline %-40s %10.0f ops/s\n", name, ours, r.first,
              baseline, r.second);
}

void ratio(const char* name, std::pair<double, double> r) {
  std::printf("ratio %s = %.2f\n", name, r.second > 0 ? r.first / r.second : 0.0);
}

void bench_sqlite(int rounds, int ops) {
  std::string path = "/tmp/idem_bench_business_keys_" + std::to_string(::getpid()) + ".sqlite";
  std::remove(path.c_str());
  {
    idem::sqlite::Database db(path);
    db.write([](idem::sqlite::Transaction& tx) {
      tx.exec_script(
          "CREATE TABLE user_coupon (id INTEGER PRIMARY KEY, user_id INTEGER NOT NULL,"
          " coupon_id TEXT NOT NULL, UNIQUE (user_id, coupon_id));"
          "INSERT INTO user_coupon (user_id, coupon_id) VALUES (1, 'C');");
    });
    idem::UniqueInsert claim{"user_coupon", {"user_id", "coupon_id"}};
    auto ours = [&](int) {
      db.write([&](idem::sqlite::Transaction& tx) { return claim.insert(tx, 1, "C").id; });
    };
    auto baseline = [&](int) {
      db.write([&](idem::sqlite::Transaction& tx) {
        try {
          tx.exec("INSERT INTO user_coupon (user_id, coupon_id) VALUES (?, ?)", 1, "C");
        } catch (const idem::StorageError&) {
          // SQLite: a failed statement does not abort the transaction.
        }
        return tx.query_int64("SELECT id FROM user_coupon WHERE user_id = ? AND coupon_id = ?",
                              1, "C");
      });
    };
    auto r = interleave(rounds, ops, ours, baseline);
    report("sqlite_duplicate", "(ON CONFLICT DO NOTHING + SELECT)", "(INSERT, catch, SELECT)", r);
    ratio("sqlite_duplicate_claim", r);
  }
  std::remove(path.c_str());
  std::remove((path + "-wal").c_str());
  std::remove((path + "-shm").c_str());
}

void bench_postgres(const std::string& dsn, int rounds, int ops) {
  const std::string suffix = std::to_string(::getpid());
  const std::string uc = "idem_bench_uc_" + suffix, st = "idem_bench_stock_" + suffix;
  pqxx::connection c{dsn};
  {
    pqxx::work tx{c};
    tx.exec("CREATE TABLE " + uc +
            " (id BIGSERIAL PRIMARY KEY, user_id BIGINT NOT NULL, coupon_id TEXT NOT NULL,"
            " UNIQUE (user_id, coupon_id))");
    tx.exec("INSERT INTO " + uc + " (user_id, coupon_id) VALUES (1, 'C')");
    tx.exec("CREATE TABLE " + st + " (sku TEXT PRIMARY KEY, qty BIGINT NOT NULL)");
    tx.commit();
  }
  idem::UniqueInsert claim{uc, {"user_id", "coupon_id"}};

  {
    auto ours = [&](int) {
      pqxx::work tx{c};
      (void)claim.insert(tx, 1, "C");
      tx.commit();
    };
    auto baseline = [&](int) {
      pqxx::work tx{c};
      // Explicit savepoint: with libpqxx 6.4 a pqxx::subtransaction that hit an error left the
      // outer transaction aborted ("current transaction is aborted").
      tx.exec("SAVEPOINT claim");
      try {
        pg(tx, "INSERT INTO " + uc + " (user_id, coupon_id) VALUES ($1, $2)", 1, "C");
        tx.exec("RELEASE SAVEPOINT claim");
      } catch (const pqxx::unique_violation&) {
        tx.exec("ROLLBACK TO SAVEPOINT claim");  // the outer transaction is usable again
      }
      pg(tx, "SELECT id FROM " + uc + " WHERE user_id = $1 AND coupon_id = $2", 1, "C");
      tx.commit();
    };
    auto r = interleave(rounds, ops, ours, baseline);
    report("pg_duplicate", "(ON CONFLICT DO NOTHING + SELECT)",
           "(SAVEPOINT, INSERT, catch, SELECT)", r);
    ratio("pg_duplicate_claim", r);
  }
  {
    auto ours = [&](int n) {
      pqxx::work tx{c};
      (void)claim.insert(tx, 1000000 + n, "A");
      tx.commit();
    };
    auto baseline = [&](int n) {
      pqxx::work tx{c};
      pg(tx, "INSERT INTO " + uc + " (user_id, coupon_id) VALUES ($1, $2) RETURNING id",
         1000000 + n, "B");
      tx.commit();
    };
    auto r = interleave(rounds, ops, ours, baseline);
    report("pg_first_insert", "(ON CONFLICT DO NOTHING RETURNING)", "(INSERT RETURNING)", r);
    ratio("pg_first_insert", r);
  }
  {
    // 8 threads on one hot row. Stock is refilled before each run so every call deducts.
    constexpr int kThreads = 8;
    idem::StockTable stock{st, "sku", "qty"};
    std::vector<std::unique_ptr<pqxx::connection>> conns;
    for (int i = 0; i < kThreads; ++i) conns.push_back(std::make_unique<pqxx::connection>(dsn));
    auto run_threads = [&](const std::function<void(pqxx::connection&)>& op, int per_thread) {
      {
        pqxx::work tx{c};
        tx.exec("INSERT INTO " + st + " (sku, qty) VALUES ('HOT', 1000000000) "
                "ON CONFLICT (sku) DO UPDATE SET qty = 1000000000");
        tx.commit();
      }
      std::vector<std::thread> ts;
      for (int t = 0; t < kThreads; ++t) {
        ts.emplace_back([&, t] {
          for (int i = 0; i < per_thread; ++i) op(*conns[static_cast<std::size_t>(t)]);
        });
      }
      for (auto& t : ts) t.join();
    };
    const int per_thread = std::max(1, ops / kThreads);
    std::vector<double> ra, rb;
    auto ours = [&](pqxx::connection& conn) {
      pqxx::work tx{conn};
      (void)stock.deduct(tx, "HOT", 1);
      tx.commit();
    };
    auto baseline = [&](pqxx::connection& conn) {
      pqxx::work tx{conn};
      auto q = pg(tx, "SELECT qty FROM " + st + " WHERE sku = $1 FOR UPDATE", "HOT").value_or(0);
      if (q >= 1) pg(tx, "UPDATE " + st + " SET qty = qty - 1 WHERE sku = $1", "HOT");
      tx.commit();
    };
    for (int r = 0; r < rounds; ++r) {
      for (int which = 0; which < 2; ++which) {
        bool is_ours = (r % 2 == which);
        auto t0 = Clock::now();
        run_threads(is_ours ? std::function<void(pqxx::connection&)>(ours)
                            : std::function<void(pqxx::connection&)>(baseline),
                    per_thread);
        double s = std::chrono::duration<double>(Clock::now() - t0).count();
        (is_ours ? ra : rb).push_back(per_thread * kThreads / s);
      }
    }
    std::pair<double, double> r{median(ra), median(rb)};
    report("pg_hot_stock", "(conditional UPDATE, 8 threads)", "(SELECT FOR UPDATE + UPDATE)", r);
    ratio("pg_hot_stock_deduction", r);
  }
  pqxx::work tx{c};
  tx.exec("DROP TABLE IF EXISTS " + uc);
  tx.exec("DROP TABLE IF EXISTS " + st);
  tx.commit();
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 7, ops = 400;
  if (argc > 1) rounds = std::max(1, std::atoi(argv[1]));
  if (argc > 2) ops = std::max(1, std::atoi(argv[2]));
  std::printf("business keys: %d interleaved rounds of %d operations, medians\n", rounds, ops);
  try {
    bench_sqlite(rounds, ops);
    const char* dsn = std::getenv("IDEM_TEST_POSTGRES_DSN");
    if (dsn != nullptr && *dsn != '\0') {
      bench_postgres(dsn, rounds, ops);
    } else {
      std::printf("(PostgreSQL parts skipped: IDEM_TEST_POSTGRES_DSN not set)\n");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "business_keys_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
