// SPDX-License-Identifier: MIT
// AsyncGuard over AsyncRedisStore + PooledDurable<PostgresStore> while PostgreSQL restarts
// (stopped until a call met the outage, then started: pg::stop_until_observed_then_start) in the
// middle of a run on one loop thread: every call is
// answered, every error is an idem::StorageError subclass, no key has two effects, and once the
// server is back every key runs or replays (nothing stuck). The shared server is restarted, so
// ctest runs this alone (SERIAL).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "async_guard_suite.hpp"
#include "idem/async/pooled_durable.hpp"
#include "idem/async/redis_store.hpp"
#include "pg_test_support.hpp"

namespace {

namespace pg = idem::test::pg;
using idem::Key;
using idem::Outcome;
using idem::test::Answer;
using namespace std::chrono_literals;

TEST(AsyncPostgresFault, ARestartMidRunAnswersEveryCallTypedAndDoublesNothing) {
  std::string dsn, url, script;
  IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_URL");
  IDEM_REQUIRE_ENV(script, "IDEM_SERVERS_SCRIPT");
  const std::string effects = pg::table("idem_test_effects");  // created while the server is up
  auto so = pg::options();
  so.pool_size = 8;
  so.pool_wait = 2s;
  so.client_timeout = 2s;
  idem::postgres::PostgresStore store(so);
  idem::async::WorkerPool workers({4, 4096});
  idem::async::PooledDurable<idem::postgres::PostgresStore> durable(store, workers);
  idem::test::Loop loop;
  std::optional<idem::async::AsyncRedisStore> fast;
  loop.run([&] { fast.emplace(loop.io().get_executor(), url); });
  idem::async::AsyncGuardOptions go;
  go.pool = &workers;
  go.guard.lease = 3s;
  idem::async::AsyncGuard guard{loop.io().get_executor(), *fast, durable, go};

  // Each wave: 20 new keys and 10 duplicates of the previous wave's (first executions keep
  // reaching PostgreSQL; duplicates meet in-progress and completed records).
  constexpr int kNew = 20, kDup = 10;
  const std::string prefix = idem::test::unique_name("pgfault");
  std::deque<Key> keys;  // stable addresses: calls on the loop refer to them
  auto call = [&](const Key& k, Answer<>& a) {
    idem::async::net::post(loop.io(), [&guard, &k, &a, &effects] {
      guard.async_run(k, "fp",
                      [id = k.id(), &effects](pqxx::work& tx) {
                        tx.exec_params("INSERT INTO " + effects + " (key_id) VALUES ($1)", id);
                        return "resp_" + id;
                      },
                      a.callback());
    });
  };

  std::atomic<bool> restarting{false}, restarted{false};
  std::thread restart;
  std::atomic<int> storage_errors{0};  // read by the restart thread too
  int answered = 0, untyped = 0, wrong = 0, waves_after = 0;
  for (int w = 0; !restarted.load() || waves_after < 3; ++w) {
    ASSERT_LT(w, 3000) << "the restart never finished";
    if (restarted.load()) ++waves_after;
    if (w == 3) {
      restarting = true;
      restart = std::thread([&] {
        EXPECT_EQ(0, idem::test::pg::stop_until_observed_then_start(script, storage_errors))
            << "pg-stop / pg-start";
        restarted = true;
      });
    }
    std::vector<const Key*> wave;
    for (int j = 0; j < kNew; ++j) {
      keys.push_back(Key::make("async.pgfault", prefix + "_" + std::to_string(keys.size())));
      wave.push_back(&keys.back());
    }
    for (int j = 0; j < kDup && w > 0; ++j) {
      wave.push_back(&keys[keys.size() - 2 * kNew + static_cast<std::size_t>(j * 2)]);
    }
    std::vector<Answer<>> answers(wave.size());
    for (std::size_t j = 0; j < wave.size(); ++j) call(*wave[j], answers[j]);
    for (std::size_t j = 0; j < wave.size(); ++j) {
      const auto& c = answers[j].wait(60s);
      ASSERT_TRUE(c.done) << "a call was never answered";
      ++answered;
      const Key& k = *wave[j];
      if (c.error) {
        if (idem::test::holds<idem::StorageError>(c.error)) {
          ++storage_errors;
        } else {
          ++untyped;
          ADD_FAILURE() << idem::test::what_of(c.error);
        }
        continue;
      }
      if (c.result.ok() && *c.result.value != "resp_" + k.id()) ++wrong;
      if (!c.result.ok() && c.result.outcome != Outcome::kInProgress) ++wrong;
    }
    if (restarting.load() && !restarted.load()) std::this_thread::sleep_for(20ms);
  }
  restart.join();
  EXPECT_EQ(0, untyped);
  EXPECT_EQ(0, wrong);
  EXPECT_GT(storage_errors.load(), 0) << "the restart was not observed";

  // Back up: every key runs or replays within a lease and a few seconds (nothing stuck).
  const auto settle_by = std::chrono::steady_clock::now() + go.guard.lease + 10s;
  const int kKeys = static_cast<int>(keys.size());
  std::vector<int> pending(keys.size());
  for (int i = 0; i < kKeys; ++i) pending[static_cast<std::size_t>(i)] = i;
  while (!pending.empty() && std::chrono::steady_clock::now() < settle_by) {
    std::vector<Answer<>> answers(pending.size());
    for (std::size_t j = 0; j < pending.size(); ++j) {
      call(keys[static_cast<std::size_t>(pending[j])], answers[j]);
    }
    std::vector<int> again;
    for (std::size_t j = 0; j < pending.size(); ++j) {
      const auto& c = answers[j].wait(60s);
      ASSERT_TRUE(c.done);
      if (c.error) {
        // The pool's connections are re-established on demand; a first use may still fail.
        EXPECT_TRUE(idem::test::holds<idem::StorageError>(c.error)) << idem::test::what_of(c.error);
        again.push_back(pending[j]);
      } else if (c.result.outcome == Outcome::kInProgress) {
        again.push_back(pending[j]);
      } else {
        EXPECT_EQ("resp_" + keys[static_cast<std::size_t>(pending[j])].id(),
                  c.result.value.value_or(""));
      }
    }
    pending = std::move(again);
    if (!pending.empty()) std::this_thread::sleep_for(100ms);
  }
  EXPECT_TRUE(pending.empty()) << pending.size() << " keys never ran nor replayed";
  EXPECT_EQ(0, pg::scalar("SELECT count(*) FROM (SELECT key_id FROM " + effects +
                          " WHERE key_id LIKE '" + prefix + "\\_%' GROUP BY key_id"
                          " HAVING count(*) <> 1) x"))
      << "a key ran twice";
  EXPECT_EQ(kKeys, pg::scalar("SELECT count(*) FROM " + effects + " WHERE key_id LIKE '" +
                              prefix + "\\_%'"))
      << "one effect per key";
  std::printf("  %d calls answered, %d typed storage errors while PostgreSQL restarted\n", answered,
              storage_errors.load());
  loop.run([&] { fast.reset(); });
}

}  // namespace

namespace idem::test {
// The suite header brings helpers only here (its typed suite is instantiated elsewhere).
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(AsyncGuardSuite);
}  // namespace idem::test
