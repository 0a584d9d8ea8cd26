// SPDX-License-Identifier: MIT
// PostgreSQL stopped (pg_ctl stop -m fast) in the middle of a run of guarded payments, until a
// call met the outage, then started again: calls fail with typed, retryable idem errors while it
// is down, succeed after it is back, and no key is ever applied twice. Runs alone (RUN_SERIAL): it
// restarts the shared server.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "idem/guard.hpp"
#include "idem/memory_store.hpp"
#include "pg_test_support.hpp"

namespace {

namespace pg = idem::test::pg;

TEST(PostgresRestart, CallsFailRetryablyWhileDownAndSucceedAfterWithNoDoubleEffect) {
  IDEM_REQUIRE_POSTGRES();
  std::string script;
  IDEM_REQUIRE_ENV(script, "IDEM_SERVERS_SCRIPT");
  auto o = pg::options();
  o.pool_size = 8;
  o.pool_wait = std::chrono::milliseconds(2000);
  idem::postgres::PostgresStore store(o);
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, store};

  constexpr int kThreads = 4;
  std::atomic<bool> restarted{false};
  std::atomic<int> handler_runs{0}, failures{0}, done_keys{0};
  std::mutex m;
  std::map<std::string, int> error_kinds;
  std::vector<std::string> all_keys[kThreads];
  auto worker = [&](int t) {
    int after_restart = 0;
    for (int i = 0; !restarted.load() || after_restart < 15; ++i) {
      if (restarted.load()) ++after_restart;
      auto key =
          idem::Key::make("payment", idem::test::unique_name("restart_t" + std::to_string(t)));
      all_keys[t].push_back(key.id());
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      for (;;) {
        ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no success for " << key.id();
        try {
          auto r = guard.run(key, "", [&](pqxx::work& tx) {
            ++handler_runs;
            tx.exec_params(
                "INSERT INTO " + pg::table("payment") + " (order_no, amount) VALUES ($1, 1)",
                key.id());
            return std::string("paid");
          });
          if (r.ok()) {
            ++done_keys;
            break;
          }
        } catch (const idem::Error& e) {
          EXPECT_TRUE(e.retryable()) << e.what();
          ++failures;
          std::lock_guard<std::mutex> lock(m);
          ++error_kinds[std::string(idem::errc_name(e.code()))];
        } catch (const std::exception& e) {
          ADD_FAILURE() << "untyped error: " << e.what();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  while (done_keys.load() < 20) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const int rc = pg::stop_until_observed_then_start(script, failures);
  restarted = true;
  for (auto& t : threads) t.join();
  ASSERT_EQ(0, rc) << "pg-stop / pg-start";

  for (const auto& [kind, n] : error_kinds)
    std::printf("  errors while down: %s x%d\n", kind.c_str(), n);
  EXPECT_GT(failures.load(), 0) << "the restart was not observed";
  long keys = 0;
  for (auto& ks : all_keys) {
    for (auto& id : ks) {
      ++keys;
      EXPECT_EQ(1, pg::count_where("payment", "order_no", id)) << id;
    }
  }
  EXPECT_EQ(keys, done_keys.load());
  EXPECT_GE(handler_runs.load(), keys);  // rolled-back attempts ran again; their effects did not
}

TEST(PostgresRestart, TwoPhaseCallsFailTypedWhileDownAndEveryKeyEndsCompleted) {
  IDEM_REQUIRE_POSTGRES();
  std::string script;
  IDEM_REQUIRE_ENV(script, "IDEM_SERVERS_SCRIPT");
  auto o = pg::options();
  o.pool_size = 4;
  idem::postgres::PostgresStore store(o);
  idem::GuardOptions go;
  go.lease = std::chrono::milliseconds(1000);  // a claim stranded by the restart is taken over
  idem::IdempotencyGuard guard{store, go};

  std::atomic<bool> restarted{false};
  std::atomic<int> failures{0}, done_keys{0};
  std::vector<std::string> keys;
  std::mutex m;
  auto worker = [&](int t) {
    int after_restart = 0;
    while (!restarted.load() || after_restart < 10) {
      if (restarted.load()) ++after_restart;
      auto key = idem::Key::make("gateway", idem::test::unique_name("tp" + std::to_string(t)));
      {
        std::lock_guard<std::mutex> lock(m);
        keys.push_back(key.id());
      }
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      for (;;) {
        ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no success for " << key.id();
        try {
          // External side effect (no transaction): two-phase mode.
          auto r = guard.run(key, "", [] { return std::string("charged"); });
          if (r.ok()) {
            ++done_keys;
            break;
          }
        } catch (const idem::Error& e) {
          EXPECT_TRUE(e.retryable()) << e.what();
          ++failures;
        } catch (const std::exception& e) {
          ADD_FAILURE() << "untyped error: " << e.what();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) threads.emplace_back(worker, t);
  while (done_keys.load() < 10) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const int rc = pg::stop_until_observed_then_start(script, failures);
  restarted = true;
  for (auto& t : threads) t.join();
  ASSERT_EQ(0, rc) << "pg-stop / pg-start";
  EXPECT_GT(failures.load(), 0) << "the restart was not observed";
  for (const auto& id : keys) {
    auto rec = store.lookup(idem::Key::make("gateway", id));
    ASSERT_TRUE(rec.has_value()) << id;
    EXPECT_EQ(idem::Record::Status::kCompleted, rec->status) << id;
    EXPECT_EQ("charged", rec->response) << id;
  }
}

}  // namespace
