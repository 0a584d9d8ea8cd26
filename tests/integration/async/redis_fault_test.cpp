// SPDX-License-Identifier: MIT
// AsyncGuard over AsyncRedisStore + SQLite while redis-server is killed (kill -9) in the middle
// of a run on one loop thread, then restarted: every call is answered, every error is a typed
// idem::Error, no key has two effects, and after the restart every key replays. And while it is
// paused (CLIENT PAUSE): calls with a deadline end at it, typed; the others are decided by the
// durable store; nothing is stuck once the pause and the claims' leases are over. The shared
// server is disturbed, so ctest runs this alone (SERIAL).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "async_guard_suite.hpp"
#include "idem/async/pooled_durable.hpp"
#include "idem/async/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "raw_redis.hpp"

namespace {

using idem::Key;
using idem::Outcome;
using idem::test::Answer;
using namespace std::chrono_literals;

void servers(const std::string& what) {
  const std::string script = idem::test::server_env("IDEM_SERVERS_SCRIPT");
  ASSERT_FALSE(script.empty()) << "IDEM_SERVERS_SCRIPT is not set (eval scripts/servers.sh env)";
  const std::string cmd = "\"" + script + "\" " + what + " >/dev/null 2>&1";
  ASSERT_EQ(0, std::system(cmd.c_str())) << cmd;
}

TEST(AsyncRedisFault, KillNineMidRunAnswersEveryCallTypedAndDoublesNothing) {
  std::string url, script;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_URL");
  IDEM_REQUIRE_ENV(script, "IDEM_SERVERS_SCRIPT");
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore sqlite(dir.file("fault.db"));
  sqlite.database().write(
      [](idem::sqlite::Transaction& tx) { tx.exec("CREATE TABLE effect (k TEXT NOT NULL)"); });
  idem::async::WorkerPool workers({4, 4096});
  idem::async::PooledDurable<idem::sqlite::SqliteStore> durable(sqlite, workers);
  idem::test::Loop loop;
  std::optional<idem::async::AsyncRedisStore> fast;
  idem::async::AsyncRedisStoreOptions o;
  o.uri = url;
  o.command_timeout = 300ms;
  o.connect_timeout = 300ms;
  o.reconnect_backoff = 50ms;
  loop.run([&] { fast.emplace(loop.io().get_executor(), o); });
  idem::async::AsyncGuardOptions go;
  go.pool = &workers;
  idem::async::AsyncGuard guard{loop.io().get_executor(), *fast, durable, go};

  constexpr int kKeys = 300, kWaves = 24, kPerWave = 50;  // every key called 4 times
  std::vector<Key> keys;
  for (int i = 0; i < kKeys; ++i) {
    keys.push_back(Key::make("async.fault", idem::test::unique_name("k" + std::to_string(i))));
  }
  auto handler = [](const Key& k) {
    return [id = k.id()](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT INTO effect (k) VALUES (?)", id);
      return "resp_" + id;
    };
  };
  int answered = 0, typed_errors = 0, untyped = 0, wrong = 0;
  for (int w = 0; w < kWaves; ++w) {
    if (w == kWaves / 3) servers("redis-kill");  // calls of earlier waves may still be in flight
    std::vector<Answer<>> answers(kPerWave);
    for (int j = 0; j < kPerWave; ++j) {
      const Key& k = keys[static_cast<std::size_t>((w * kPerWave + j) % kKeys)];
      idem::async::net::post(loop.io(), [&guard, &k, &a = answers[j], &handler] {
        guard.async_run(k, "fp", handler(k), a.callback());
      });
    }
    for (int j = 0; j < kPerWave; ++j) {
      const auto& c = answers[j].wait(30s);
      ASSERT_TRUE(c.done) << "a call was never answered";
      ++answered;
      const Key& k = keys[static_cast<std::size_t>((w * kPerWave + j) % kKeys)];
      if (c.error) {
        if (idem::test::holds<idem::Error>(c.error)) {
          ++typed_errors;
        } else {
          ++untyped;
        }
        continue;
      }
      if (c.result.ok() && *c.result.value != "resp_" + k.id()) ++wrong;
      if (!c.result.ok() && c.result.outcome != Outcome::kInProgress) ++wrong;
    }
  }
  const auto while_down = guard.stats().snapshot();
  servers("redis-start");
  EXPECT_EQ(kWaves * kPerWave, answered);
  EXPECT_EQ(0, untyped);
  EXPECT_EQ(0, wrong);
  EXPECT_GT(while_down.degraded, 0u) << "the kill did not reach the fast store";
  // The durable store decides while Redis is down: the calls degrade, they do not fail.
  EXPECT_EQ(0, typed_errors);

  auto doubled = sqlite.database().read([](idem::sqlite::Session& s) {
    return s.query_int64(
        "SELECT COUNT(*) FROM (SELECT k FROM effect GROUP BY k HAVING COUNT(*) > 1)");
  });
  EXPECT_EQ(0, doubled.value_or(-1)) << "a key ran twice";

  // After the restart every key replays its one response (the fast store is refilled).
  std::this_thread::sleep_for(200ms);
  int replayed = 0;
  for (int round = 0; round < 2; ++round) {
    std::vector<Answer<>> answers(kKeys);
    for (int i = 0; i < kKeys; ++i) {
      idem::async::net::post(loop.io(), [&guard, &k = keys[static_cast<std::size_t>(i)],
                                         &a = answers[static_cast<std::size_t>(i)], &handler] {
        guard.async_run(k, "fp", handler(k), a.callback());
      });
    }
    for (int i = 0; i < kKeys; ++i) {
      const auto& c = answers[static_cast<std::size_t>(i)].wait(30s);
      ASSERT_TRUE(c.done);
      ASSERT_FALSE(c.error) << idem::test::what_of(c.error);
      if (round == 1 && c.result.outcome == Outcome::kReplayed) ++replayed;
    }
  }
  EXPECT_EQ(kKeys, replayed);
  auto total = sqlite.database().read(
      [](idem::sqlite::Session& s) { return s.query_int64("SELECT COUNT(*) FROM effect"); });
  EXPECT_EQ(kKeys, total.value_or(-1)) << "one effect per key";
  loop.run([&] { fast.reset(); });
}


// CLIENT PAUSE 1500 ALL in the middle of a run: Redis accepts connections and commands but
// answers nothing for 1.5 s. Calls with a 250 ms deadline are answered idem::DeadlineExceeded
// at it (their claims are released in the background once Redis answers); calls without one
// see their fast claim time out (command_timeout 400 ms, StorageTimeout) and are decided by
// SQLite alone. Every call is answered; every error is DeadlineExceeded; once the pause ends,
// every key runs or replays within its lease (a claim written after its reply timed out holds
// the key until then), with exactly one effect.
TEST(AsyncRedisFault, APauseEndsCallsAtTheirDeadlinesTypedAndLeavesNothingStuck) {
  std::string url;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_URL");
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore sqlite(dir.file("pause.db"));
  sqlite.database().write(
      [](idem::sqlite::Transaction& tx) { tx.exec("CREATE TABLE effect (k TEXT NOT NULL)"); });
  idem::async::WorkerPool workers({4, 4096});
  idem::async::PooledDurable<idem::sqlite::SqliteStore> durable(sqlite, workers);
  idem::test::Loop loop;
  std::optional<idem::async::AsyncRedisStore> fast;
  idem::async::AsyncRedisStoreOptions o;
  o.uri = url;
  o.command_timeout = 400ms;
  o.connect_timeout = 300ms;
  o.reconnect_backoff = 50ms;
  loop.run([&] { fast.emplace(loop.io().get_executor(), o); });
  idem::async::AsyncGuardOptions go;
  go.pool = &workers;
  go.guard.lease = 2s;
  idem::async::AsyncGuard guard{loop.io().get_executor(), *fast, durable, go};
  constexpr int kKeys = 200;
  std::vector<Key> keys;
  for (int i = 0; i < kKeys; ++i) {
    keys.push_back(Key::make("async.pause", idem::test::unique_name("k" + std::to_string(i))));
  }
  auto handler = [](const Key& k) {
    return [id = k.id()](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT INTO effect (k) VALUES (?)", id);
      return "resp_" + id;
    };
  };
  auto call = [&](const Key& k, Answer<>& a, idem::async::CallOptions co) {
    idem::async::net::post(loop.io(), [&guard, &k, &a, &handler, co] {
      guard.async_run(k, "fp", co, handler(k), a.callback());
    });
  };
  // Before: a quarter of the keys completed (the pause then meets replays and first runs).
  {
    std::vector<Answer<>> before(kKeys / 4);
    for (int i = 0; i < kKeys / 4; ++i) call(keys[static_cast<std::size_t>(i)], before[static_cast<std::size_t>(i)], {});
    for (auto& a : before) ASSERT_EQ(Outcome::kExecuted, a.wait().result.outcome) << idem::test::what_of(a.wait().error);
  }
  idem::test::RawRedis raw(url);
  ASSERT_EQ("OK", raw.text({"CLIENT", "PAUSE", "1500", "ALL"}));
  const auto paused_at = std::chrono::steady_clock::now();
  std::vector<Answer<>> during(kKeys);
  for (int i = 0; i < kKeys; ++i) {
    idem::async::CallOptions co;
    if (i % 2 == 0) co.deadline = std::chrono::steady_clock::now() + 250ms;
    call(keys[static_cast<std::size_t>(i)], during[static_cast<std::size_t>(i)], co);
  }
  int deadlines = 0, decided = 0, untyped = 0, other_errors = 0;
  for (int i = 0; i < kKeys; ++i) {
    const auto& c = during[static_cast<std::size_t>(i)].wait(30s);
    ASSERT_TRUE(c.done) << "a call was never answered";
    if (c.error) {
      if (idem::test::holds<idem::DeadlineExceeded>(c.error)) {
        ++deadlines;
        EXPECT_EQ(0, i % 2) << "a call without a deadline ended with DeadlineExceeded";
      } else if (idem::test::holds<idem::Error>(c.error)) {
        ++other_errors;
        ADD_FAILURE() << "call " << i << ": " << idem::test::what_of(c.error);
      } else {
        ++untyped;
      }
      continue;
    }
    ++decided;
    EXPECT_NE(0, i % 2) << "a call with a 250 ms deadline succeeded while Redis was paused";
    EXPECT_TRUE(c.result.ok()) << idem::outcome_name(c.result.outcome);
    EXPECT_EQ("resp_" + keys[static_cast<std::size_t>(i)].id(), c.result.value.value_or(""));
  }
  EXPECT_EQ(kKeys / 2, deadlines);
  EXPECT_EQ(kKeys / 2, decided);
  EXPECT_EQ(0, untyped);
  EXPECT_EQ(0, other_errors);
  EXPECT_GE(guard.async_stats().deadline_exceeded.load(), static_cast<std::uint64_t>(kKeys / 2));
  EXPECT_GT(guard.stats().snapshot().degraded, 0u) << "the pause did not reach the fast store";
  // After the pause (and the leases of claims written after their replies timed out), every
  // key runs or replays.
  std::this_thread::sleep_until(paused_at + 1600ms);
  const auto settle_by = std::chrono::steady_clock::now() + go.guard.lease + 5s;
  std::vector<int> pending(kKeys);
  for (int i = 0; i < kKeys; ++i) pending[static_cast<std::size_t>(i)] = i;
  while (!pending.empty() && std::chrono::steady_clock::now() < settle_by) {
    std::vector<Answer<>> answers(pending.size());
    for (std::size_t j = 0; j < pending.size(); ++j) {
      call(keys[static_cast<std::size_t>(pending[j])], answers[j], {});
    }
    std::vector<int> again;
    for (std::size_t j = 0; j < pending.size(); ++j) {
      const auto& c = answers[j].wait(30s);
      ASSERT_TRUE(c.done);
      ASSERT_FALSE(c.error) << idem::test::what_of(c.error);
      if (c.result.outcome == Outcome::kInProgress) {
        again.push_back(pending[j]);
      } else {
        EXPECT_EQ("resp_" + keys[static_cast<std::size_t>(pending[j])].id(),
                  c.result.value.value_or(""));
      }
    }
    pending = std::move(again);
    if (!pending.empty()) std::this_thread::sleep_for(100ms);
  }
  EXPECT_TRUE(pending.empty()) << pending.size() << " keys still in progress "
                               << "a lease and 5 s after the pause";
  auto per_key = sqlite.database().read([](idem::sqlite::Session& s) {
    return s.query_int64(
        "SELECT COUNT(*) FROM (SELECT k FROM effect GROUP BY k HAVING COUNT(*) <> 1)");
  });
  EXPECT_EQ(0, per_key.value_or(-1)) << "a key ran twice";
  auto total = sqlite.database().read(
      [](idem::sqlite::Session& s) { return s.query_int64("SELECT COUNT(*) FROM effect"); });
  EXPECT_EQ(kKeys, total.value_or(-1)) << "one effect per key";
  loop.run([&] { fast.reset(); });
}

}  // namespace

namespace idem::test {
// The suite header brings helpers only here (its typed suite is instantiated elsewhere).
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(AsyncGuardSuite);
}  // namespace idem::test
