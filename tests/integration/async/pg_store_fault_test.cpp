// SPDX-License-Identifier: MIT
// AsyncGuard on AsyncPostgresStore alone while PostgreSQL restarts (stopped until a call met the
// outage, then started: pg::stop_until_observed_then_start) in the middle of a run on one loop
// thread: two-phase calls (their durable
// statements on the loop's pipelined connection) and transactional ones (on the pool), new keys
// and duplicates in every wave. Every call is answered; every error is an idem::StorageError
// subclass; a transactional key has exactly one effect; a two-phase handler runs again only
// after a caller of its key was answered with an error once its handler had run (its outcome
// unknown), and never when an earlier run was answered as executed; once the server is back every
// key runs or replays within its lease (nothing stuck). The shared server is restarted, so ctest
// runs this alone (SERIAL).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "async_guard_suite.hpp"
#include "pg_store_support.hpp"

namespace {

using namespace idem::test::async_pg;  // NOLINT(google-build-using-namespace)
using idem::Key;
using idem::Outcome;
using idem::test::Answer;
using namespace std::chrono_literals;

struct Call {
  const Key* key = nullptr;
  std::atomic<bool> ran{false};  // a two-phase handler of this call ran
  Answer<> answer;
};

struct KeyState {
  bool two_phase = false;
  int executed = 0;          // calls answered kExecuted
  int errors_after_run = 0;  // calls answered with an error after their handler ran
};

TEST(AsyncPgStoreFault, ARestartMidRunAnswersEveryCallTypedAndDoublesNothing) {
  std::string dsn, script;
  IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
  IDEM_REQUIRE_ENV(script, "IDEM_SERVERS_SCRIPT");
  const std::string effects = pg::table("idem_test_effects");  // created while the server is up
  auto so = sync_options();
  so.pool_wait = 2s;
  so.client_timeout = 2s;
  PostgresStore sync(so);
  idem::async::WorkerPool workers({4, 4096});
  idem::test::Loop loop;
  AsyncPostgresStoreOptions ao;
  ao.connect_timeout = 1s;
  ao.reconnect_backoff = 50ms;
  auto store = std::make_unique<AsyncPostgresStore>(loop.io().get_executor(), sync, workers, ao);
  idem::async::AsyncGuardOptions go;
  go.pool = &workers;
  go.guard.lease = 3s;
  idem::async::AsyncGuard<AsyncPostgresStore> guard{loop.io().get_executor(), *store, go};

  // Runs of each two-phase key's handler, counted on the loop (on_loop handlers).
  std::map<std::string, int> runs;
  constexpr int kNew = 20, kDup = 10;
  const std::string prefix = idem::test::unique_name("pgsfault");
  std::deque<Key> keys;  // stable addresses: calls on the loop refer to them
  std::map<std::string, KeyState> state;
  std::deque<Call> calls;
  auto start = [&](const Key& k) -> Call& {
    Call& c = calls.emplace_back();
    c.key = &k;
    const bool two_phase = state[k.id()].two_phase;
    idem::async::net::post(loop.io(), [&guard, &k, &c, &runs, &effects, two_phase] {
      if (two_phase) {
        guard.async_run(k, "fp", idem::async::on_loop([&c, &runs, id = k.id()] {
                          ++runs[id];
                          c.ran = true;
                          return "resp_" + id;
                        }),
                        c.answer.callback());
      } else {
        guard.async_run(k, "fp",
                        [id = k.id(), &effects](pqxx::work& tx) {
                          tx.exec_params("INSERT INTO " + effects + " (key_id) VALUES ($1)", id);
                          return "resp_" + id;
                        },
                        c.answer.callback());
      }
    });
    return c;
  };
  std::atomic<int> storage_errors{0};  // read by the restart thread too
  int answered = 0, untyped = 0, wrong = 0;
  // Waits for `c`; false if it failed (typed or not).
  auto settle = [&](Call& c) {
    const auto& r = c.answer.wait(60s);
    EXPECT_TRUE(r.done) << "a call was never answered";
    if (!r.done) return false;
    ++answered;
    KeyState& ks = state[c.key->id()];
    if (r.error) {
      if (idem::test::holds<idem::StorageError>(r.error)) {
        ++storage_errors;
      } else {
        ++untyped;
        ADD_FAILURE() << idem::test::what_of(r.error);
      }
      if (c.ran.load()) ++ks.errors_after_run;
      return false;
    }
    if (r.result.outcome == Outcome::kExecuted) ++ks.executed;
    if (r.result.ok() && *r.result.value != "resp_" + c.key->id()) ++wrong;
    if (!r.result.ok() && r.result.outcome != Outcome::kInProgress) ++wrong;
    return r.result.ok();
  };

  std::atomic<bool> restarting{false}, restarted{false};
  std::thread restart;
  int waves_after = 0;
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
    std::vector<Call*> wave;
    for (int j = 0; j < kNew; ++j) {
      keys.push_back(Key::make("async.pgsfault", prefix + "_" + std::to_string(keys.size())));
      state[keys.back().id()].two_phase = keys.size() % 2 == 0;
      wave.push_back(&start(keys.back()));
    }
    for (int j = 0; j < kDup && w > 0; ++j) {
      wave.push_back(&start(keys[keys.size() - 2 * kNew + static_cast<std::size_t>(j * 2)]));
    }
    for (Call* c : wave) settle(*c);
    if (restarting.load() && !restarted.load()) std::this_thread::sleep_for(20ms);
  }
  restart.join();
  EXPECT_EQ(0, untyped);
  EXPECT_EQ(0, wrong);
  EXPECT_GT(storage_errors.load(), 0) << "the restart was not observed";

  // Back up: every key runs or replays within a lease and a few seconds (nothing stuck).
  const auto settle_by = std::chrono::steady_clock::now() + go.guard.lease + 10s;
  std::vector<const Key*> pending;
  for (const Key& k : keys) pending.push_back(&k);
  while (!pending.empty() && std::chrono::steady_clock::now() < settle_by) {
    std::vector<Call*> wave;
    for (const Key* k : pending) wave.push_back(&start(*k));
    std::vector<const Key*> again;
    for (std::size_t j = 0; j < wave.size(); ++j) {
      if (!settle(*wave[j])) again.push_back(pending[j]);
    }
    pending = std::move(again);
    if (!pending.empty()) std::this_thread::sleep_for(100ms);
  }
  EXPECT_TRUE(pending.empty()) << pending.size() << " keys never ran nor replayed";
  EXPECT_EQ(0, untyped);
  EXPECT_EQ(0, wrong);

  std::map<std::string, int> ran;
  loop.run([&] { ran = runs; });
  int two_phase_reruns = 0, transactional = 0;
  for (const Key& k : keys) {
    const KeyState& ks = state[k.id()];
    if (ks.two_phase) {
      const int n = ran[k.id()];
      EXPECT_GE(n, 1) << k.str();
      EXPECT_LE(ks.executed, 1) << k.str() << ": two callers were told it executed";
      EXPECT_LE(n, 1 + ks.errors_after_run)
          << k.str() << ": the handler ran again though no caller was told its outcome failed";
      two_phase_reruns += n - 1;
    } else {
      ++transactional;
    }
  }
  EXPECT_EQ(0, pg::scalar("SELECT count(*) FROM (SELECT key_id FROM " + effects +
                          " WHERE key_id LIKE '" + prefix + "\\_%' GROUP BY key_id"
                          " HAVING count(*) <> 1) x"))
      << "a transactional key ran twice";
  EXPECT_EQ(transactional, pg::scalar("SELECT count(*) FROM " + effects + " WHERE key_id LIKE '" +
                                      prefix + "\\_%'"))
      << "one effect per transactional key";
  std::printf(
      "  %d calls answered, %d typed storage errors while PostgreSQL restarted; %d "
      "two-phase handlers ran again after an unknown outcome\n",
      answered, storage_errors.load(), two_phase_reruns);
  std::promise<void> closed;
  idem::async::net::post(loop.io(), [&] {
    store.reset();
    closed.set_value();
  });
  closed.get_future().wait();
  drain(loop.io());
}

}  // namespace

namespace idem::test {
// The suite header brings helpers only here (its typed suite is instantiated elsewhere).
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(AsyncGuardSuite);
}  // namespace idem::test
