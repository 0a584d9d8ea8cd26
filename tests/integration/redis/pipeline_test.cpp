// SPDX-License-Identifier: MIT
// Auto-pipelining (RedisStoreOptions::auto_pipeline) against real redis-servers: 64 threads of
// mixed calls on a few keys (each effect once), replies reaching their own callers under load,
// CLIENT KILL of the shared connection and kill -9 of the server in the middle of batches
// (every caller answered once, typed errors only, no effect lost or doubled). The kill tests use
// a private redis-server on a Unix socket (password, db 2), started and killed here.
#include <gtest/gtest.h>
#include <signal.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "idem/errors.hpp"
#include "idem/guard.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "raw_redis.hpp"
#include "support/private_redis.hpp"
#include "support/test_env.hpp"

namespace {

using idem::ClaimStatus;
using idem::Key;
using idem::OwnerToken;
using idem::redis::RedisStore;
using idem::redis::RedisStoreOptions;
using namespace std::chrono_literals;

constexpr int kThreads = 64;

// The errors a pipelined call may end with when its connection or server goes away.
bool outage_error(const idem::Error& e) {
  return e.code() == idem::errc::kStoreUnavailable || e.code() == idem::errc::kStoreTimeout ||
         e.code() == idem::errc::kOutcomeUnknown;
}

// What the threads of one test saw, counted.
struct Tally {
  std::atomic<long> started{0}, answered{0}, typed{0}, untyped{0}, wrong{0};
  std::mutex mutex;
  std::string first_problem;
  std::string first_typed;  // written by the first typed error only (typed is atomic)
  void problem(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex);
    if (first_problem.empty()) first_problem = what;
  }
  // Runs one call: counts it, and its typed outage error (returned false) or any other error.
  template <class F>
  bool call(F&& f) {
    ++started;
    try {
      f();
      ++answered;
      return true;
    } catch (const idem::Error& e) {
      ++answered;
      if (outage_error(e)) {
        if (typed++ == 0) first_typed = e.what();
      } else {
        ++untyped;
        problem(e.what());
      }
    } catch (const std::exception& e) {
      ++answered;
      ++untyped;
      problem(std::string("not an idem::Error: ") + e.what());
    }
    return false;
  }
};

void run_threads(int n, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int t = 0; t < n; ++t) threads.emplace_back(body, t);
  for (auto& t : threads) t.join();
}

using idem::test::PrivateRedis;

class RedisPipeline : public ::testing::Test {
 protected:
  void SetUp() override { IDEM_REQUIRE_ENV(url_, "IDEM_TEST_REDIS_URL"); }
  Key key(const std::string& tag) {
    return Key::make("redis.pipeline", idem::test::unique_name(tag));
  }
  std::string url_;
};

// 64 threads on the same 4 keys per round, 12 rounds: each claim that wins either releases
// (a third of the time: someone claims again) or completes; every key ends with exactly one
// effect, and every replay answers the winner's response.
TEST_F(RedisPipeline, ConcurrentPipelinedMixedCallsOnFewKeysCountEachEffectOnce) {
  RedisStoreOptions o{url_};
  o.auto_pipeline = true;
  o.command_timeout = 5000ms;
  RedisStore store(o);
  constexpr int kRounds = 12;
  constexpr int kKeys = 4;
  std::vector<Key> keys;
  for (int i = 0; i < kRounds * kKeys; ++i) keys.push_back(key("few" + std::to_string(i)));
  std::vector<std::atomic<int>> effects(keys.size());
  std::vector<std::atomic<int>> winner(keys.size());
  for (auto& w : winner) w.store(-1);
  std::atomic<long> releases{0}, replays{0}, busy{0};
  Tally tally;
  std::mutex seen_mutex;
  std::map<std::size_t, std::vector<std::string>> seen;  // replayed responses per key
  run_threads(kThreads, [&](int t) {
    std::mt19937 rng(static_cast<unsigned>(t) * 7919u + 1u);
    for (int r = 0; r < kRounds; ++r) {
      for (int j = 0; j < kKeys; ++j) {
        const std::size_t i = static_cast<std::size_t>(r * kKeys + (j + t) % kKeys);
        for (bool settled = false; !settled;) {
          const OwnerToken owner = OwnerToken::generate();
          idem::ClaimResult c;
          if (!tally.call([&] { c = store.claim(keys[i], "fp", owner, 60'000ms); })) break;
          if (c.status == ClaimStatus::kClaimed) {
            if (rng() % 3 == 0) {
              bool released = false;
              tally.call([&] { released = store.release(keys[i], owner); });
              if (!released) ++tally.wrong;
              ++releases;
              continue;
            }
            ++effects[i];
            const std::string response = "w" + std::to_string(t);
            bool completed = false;
            tally.call([&] { completed = store.complete(keys[i], owner, response, 60s); });
            if (!completed) ++tally.wrong;
            winner[i].store(t);
            settled = true;
          } else if (c.status == ClaimStatus::kDone) {
            ++replays;
            std::lock_guard<std::mutex> lock(seen_mutex);
            seen[i].push_back(c.response);
            settled = true;
          } else if (c.status == ClaimStatus::kBusy) {
            ++busy;
            std::this_thread::yield();
          } else {
            ++tally.wrong;
            settled = true;
          }
        }
      }
    }
  });
  const auto ps = store.pool_stats();
  std::printf(
      "calls %ld, releases %ld, replays %ld, busy answers %ld; %llu commands in %llu batches\n",
      tally.started.load(), releases.load(), replays.load(), busy.load(),
      static_cast<unsigned long long>(ps.pipelined_commands),
      static_cast<unsigned long long>(ps.pipelined_flushes));
  EXPECT_EQ(0, tally.untyped.load()) << tally.first_problem;
  EXPECT_EQ(0, tally.typed.load()) << tally.first_problem;  // a healthy server: no error at all
  EXPECT_EQ(0, tally.wrong.load());
  EXPECT_EQ(tally.started.load(), tally.answered.load());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(1, effects[i].load()) << "key " << i;
    const std::string expected = "w" + std::to_string(winner[i].load());
    for (const std::string& s : seen[i]) EXPECT_EQ(expected, s) << "key " << i;
  }
  EXPECT_GT(releases.load(), 0);
  EXPECT_GT(replays.load(), 0);
  // The threads' calls shared batches: fewer writes than commands.
  EXPECT_GT(ps.pipelined_commands, ps.pipelined_flushes);
  EXPECT_LE(ps.open, o.pool_size);
}

// Every thread works on keys of its own whose records name the key: any reply handed to the
// wrong caller shows as a response (or a status) that is not the caller's.
TEST_F(RedisPipeline, ConcurrentPipelinedRepliesReachTheirOwnCallers) {
  RedisStoreOptions o{url_};
  o.auto_pipeline = true;
  o.command_timeout = 5000ms;
  RedisStore store(o);
  constexpr int kOps = 60;
  Tally tally;
  const std::string base = idem::test::unique_name("own");
  run_threads(kThreads, [&](int t) {
    for (int i = 0; i < kOps; ++i) {
      const std::string id = base + "_" + std::to_string(t) + "_" + std::to_string(i);
      const Key k = Key::make("redis.pipeline", id);
      const std::string fp = "fp_" + id;
      tally.call([&] { store.fill(k, fp, "resp_" + id, 60s); });
      idem::ClaimResult c;
      tally.call([&] { c = store.claim(k, fp, OwnerToken::generate(), 30'000ms); });
      if (c.status != ClaimStatus::kDone || c.response != "resp_" + id) {
        ++tally.wrong;
        tally.problem("claim of " + id + " answered '" + c.response + "'");
      }
      tally.call(
          [&] { c = store.claim(k, "another fingerprint", OwnerToken::generate(), 1000ms); });
      if (c.status != ClaimStatus::kMismatch) ++tally.wrong;
      std::optional<idem::Record> rec;
      tally.call([&] { rec = store.lookup(k); });
      if (!rec || rec->fingerprint != fp || rec->response != "resp_" + id) {
        ++tally.wrong;
        tally.problem("lookup of " + id + " answered another record");
      }
      // A fresh key of this thread: claimed, then completed with the native SET (its
      // claim's ticket), then read back.
      const Key fresh = Key::make("redis.pipeline", id + "_fresh");
      const OwnerToken owner = OwnerToken::generate();
      tally.call([&] { c = store.claim(fresh, fp, owner, 30'000ms); });
      if (c.status != ClaimStatus::kClaimed) ++tally.wrong;
      bool done = false;
      tally.call(
          [&] { done = store.complete_claimed(fresh, owner, c.ticket, "fresh_" + id, 60s); });
      if (!done) ++tally.wrong;
      tally.call([&] { rec = store.lookup(fresh); });
      if (!rec || rec->response != "fresh_" + id) ++tally.wrong;
    }
  });
  const auto ps = store.pool_stats();
  std::printf("%llu commands in %llu batches\n",
              static_cast<unsigned long long>(ps.pipelined_commands),
              static_cast<unsigned long long>(ps.pipelined_flushes));
  EXPECT_EQ(0, tally.wrong.load()) << tally.first_problem;
  EXPECT_EQ(0, tally.untyped.load() + tally.typed.load()) << tally.first_problem;
  EXPECT_EQ(tally.started.load(), tally.answered.load());
  EXPECT_EQ(static_cast<long>(kThreads) * kOps * 7, tally.started.load());
  EXPECT_GT(ps.pipelined_commands, ps.pipelined_flushes);
  EXPECT_GT(store.command_stats().native_completes, 0u);
}

// CLIENT KILL of every connection of the store, again and again, while 64 threads claim and
// complete keys that 4 threads share. A call whose reply was lost retries with the same owner
// token (its own claim is kept; a complete that was applied shows in lookup): every key ends
// completed by exactly the one thread that held it, and every failure was a typed outage error.
TEST_F(RedisPipeline, ConcurrentPipelinedClientKillAnswersEveryCallerOnceTyped) {
  PrivateRedis server;
  RedisStoreOptions o{server.uri()};
  o.auto_pipeline = true;
  o.command_timeout = 5000ms;
  o.reconnect_backoff = 5ms;
  RedisStore store(o);
  constexpr int kKeys = 256;  // thread t works on keys 4t .. 4t+15 (mod kKeys): 4 threads a key
  std::vector<Key> keys;
  for (int i = 0; i < kKeys; ++i) keys.push_back(key("kill" + std::to_string(i)));
  std::vector<std::atomic<int>> effects(keys.size());
  std::vector<std::atomic<int>> holder(keys.size());
  for (auto& h : holder) h.store(-1);
  Tally tally;
  std::atomic<bool> running{true};
  std::atomic<int> kills{0};
  std::thread killer([&] {
    idem::test::RawRedis raw(server.raw_uri());
    raw.cmd({"AUTH", "pw"});
    while (running.load() && kills.load() < 12) {
      std::this_thread::sleep_for(15ms);
      if (raw.integer({"CLIENT", "KILL", "TYPE", "normal"}) > 0) ++kills;
    }
  });
  run_threads(kThreads, [&](int t) {
    for (int pass = 0; pass < 6; ++pass) {
      for (int j = 0; j < 16; ++j) {
        const std::size_t i = static_cast<std::size_t>((4 * t + j + 16 * pass) % kKeys);
        const OwnerToken owner = OwnerToken::generate();
        for (int attempt = 0; attempt < 500; ++attempt) {
          idem::ClaimResult c;
          if (!tally.call([&] { c = store.claim(keys[i], "fp", owner, 60'000ms); })) continue;
          if (c.status == ClaimStatus::kBusy) {
            std::this_thread::sleep_for(1ms);
            continue;
          }
          if (c.status == ClaimStatus::kDone) break;
          if (c.status != ClaimStatus::kClaimed) {
            ++tally.wrong;
            break;
          }
          // Held (now, or by an earlier attempt whose reply was lost: the same owner).
          if (c.took_over) ++tally.wrong;
          ++effects[i];
          holder[i].store(t);
          const std::string response = "t" + std::to_string(t);
          bool settled = false;
          for (int k = 0; k < 500 && !settled; ++k) {
            bool completed = false;
            if (!tally.call([&] { completed = store.complete(keys[i], owner, response, 60s); })) {
              continue;
            }
            if (completed) {
              settled = true;
              break;
            }
            // false: an earlier attempt's complete was applied (its reply lost), or it is lost.
            std::optional<idem::Record> rec;
            if (!tally.call([&] { rec = store.lookup(keys[i]); })) continue;
            settled =
                rec && rec->status == idem::Record::Status::kCompleted && rec->response == response;
            if (!settled) {
              ++tally.wrong;
              tally.problem("the complete of a held key was lost");
              settled = true;
            }
          }
          break;
        }
      }
    }
  });
  running.store(false);
  killer.join();
  const auto ps = store.pool_stats();
  std::printf(
      "calls %ld, typed outage errors %ld, kills %d; pool: connects %llu dropped %llu; "
      "%llu commands in %llu batches\n",
      tally.started.load(), tally.typed.load(), kills.load(),
      static_cast<unsigned long long>(ps.connects), static_cast<unsigned long long>(ps.dropped),
      static_cast<unsigned long long>(ps.pipelined_commands),
      static_cast<unsigned long long>(ps.pipelined_flushes));
  EXPECT_EQ(0, tally.untyped.load()) << tally.first_problem;
  EXPECT_EQ(0, tally.wrong.load()) << tally.first_problem;
  EXPECT_EQ(tally.started.load(), tally.answered.load());
  EXPECT_GT(kills.load(), 0);
  // A kill between batches is absorbed (the next batch, refused at its first byte, goes on a
  // new connection: no error); a kill under a batch fails its callers, typed. Either way the
  // shared connection was replaced, and the keys below are checked exactly once.
  EXPECT_GE(ps.dropped, 1u);
  EXPECT_GE(ps.connects, 2u);
  // Every key that was touched: one effect, completed by its holder.
  for (std::size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(1, effects[i].load()) << "key " << i;
    std::optional<idem::Record> rec;
    for (int attempt = 0; attempt < 3; ++attempt) {
      if (tally.call([&] { rec = store.lookup(keys[i]); })) break;
    }
    ASSERT_TRUE(rec.has_value()) << "key " << i;
    EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
    EXPECT_EQ("t" + std::to_string(holder[i].load()), rec->response) << "key " << i;
  }
}

// kill -9 of the server while 64 threads run: 32 through the guard with a SQLite durable store
// (each key's effect counted in SQLite), 32 straight on the store. The guard threads never see
// an error (the durable store decides while Redis is down) and execute every key once; the
// store threads get typed outage errors only; after the restart calls are pipelined again.
TEST_F(RedisPipeline, ConcurrentPipelinedServerKillNineKeepsExactlyOnce) {
  PrivateRedis server;
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable(dir.file("pipeline.db"));
  durable.database().write(
      [](idem::sqlite::Transaction& tx) { tx.exec("CREATE TABLE effect (k TEXT NOT NULL)"); });
  RedisStoreOptions o{server.uri()};
  o.auto_pipeline = true;
  o.command_timeout = 1000ms;
  o.connect_timeout = 300ms;
  o.reconnect_backoff = 20ms;
  RedisStore fast(o);
  idem::IdempotencyGuard guard{fast, durable};
  constexpr int kKeys = 120;
  std::vector<Key> keys;
  for (int i = 0; i < kKeys; ++i) keys.push_back(key("nine" + std::to_string(i)));
  Tally guard_tally, store_tally;
  std::atomic<long> guard_calls{0}, wrong{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads / 2; ++t) {
    threads.emplace_back([&, t] {
      // Thread t calls keys 7t, 7t+1, ... (mod kKeys) until the end: every key many times.
      for (int n = 0; !stop.load(); ++n) {
        const Key& k = keys[static_cast<std::size_t>((t * 7 + n) % kKeys)];
        guard_tally.call([&] {
          auto r = guard.run(k, "fp", [&](idem::sqlite::Transaction& tx) {
            tx.exec("INSERT INTO effect (k) VALUES (?)", k.id());
            return "resp_" + k.id();
          });
          if (r.ok() && *r.value != "resp_" + k.id()) ++wrong;
          if (!r.ok() && r.outcome != idem::Outcome::kInProgress) ++wrong;
        });
        ++guard_calls;
      }
    });
    threads.emplace_back([&, t] {
      for (int n = 0; !stop.load(); ++n) {
        const Key k = key("direct" + std::to_string(t) + "_" + std::to_string(n));
        const OwnerToken owner = OwnerToken::generate();
        idem::ClaimResult c;
        if (!store_tally.call([&] { c = fast.claim(k, "fp", owner, 30'000ms); })) {
          std::this_thread::sleep_for(1ms);  // the server is down: calls fail fast
          continue;
        }
        if (c.status != ClaimStatus::kClaimed) ++wrong;
        store_tally.call([&] { (void)fast.complete(k, owner, "r", 60s); });
      }
    });
  }
  auto wait_calls = [&](long n) {
    auto deadline = std::chrono::steady_clock::now() + 60s;
    while (guard_calls.load() < n && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(2ms);
    }
  };
  wait_calls(400);
  const auto flushes_before = fast.pool_stats().pipelined_flushes;
  server.kill9();
  const long at_kill = guard_calls.load();
  wait_calls(at_kill + 600);
  server.start();
  // Calls reach the new server again, pipelined (the store threads keep running).
  bool pipelined_again = false;
  for (int i = 0; i < 300 && !pipelined_again; ++i) {
    std::this_thread::sleep_for(10ms);
    try {
      const auto before = fast.pool_stats().pipelined_commands;
      (void)fast.lookup(key("probe"));
      std::this_thread::sleep_for(20ms);
      pipelined_again = fast.pool_stats().pipelined_commands > before + 100;
    } catch (const idem::StorageUnavailable&) {
      // not reconnected yet
    }
  }
  const long after_restart = guard_calls.load();
  wait_calls(after_restart + 200);  // guard calls on the fast path again
  stop.store(true);
  for (auto& t : threads) t.join();
  const auto ps = fast.pool_stats();
  std::printf(
      "guard calls %ld (kill at %ld), store calls %ld, typed errors %ld; pool: connects %llu "
      "dropped %llu fast_failures %llu; %llu commands in %llu batches (%llu before the kill)\n",
      guard_calls.load(), at_kill, store_tally.started.load(), store_tally.typed.load(),
      static_cast<unsigned long long>(ps.connects), static_cast<unsigned long long>(ps.dropped),
      static_cast<unsigned long long>(ps.fast_failures),
      static_cast<unsigned long long>(ps.pipelined_commands),
      static_cast<unsigned long long>(ps.pipelined_flushes),
      static_cast<unsigned long long>(flushes_before));
  const auto gs = guard.stats().snapshot();
  std::printf("guard: fast_claims %llu fast_hits %llu degraded %llu; first store error: %s\n",
              static_cast<unsigned long long>(gs.fast_claims),
              static_cast<unsigned long long>(gs.fast_hits),
              static_cast<unsigned long long>(gs.degraded), store_tally.first_typed.c_str());
  EXPECT_EQ(0, guard_tally.untyped.load() + guard_tally.typed.load()) << guard_tally.first_problem;
  EXPECT_EQ(0, store_tally.untyped.load()) << store_tally.first_problem;
  EXPECT_EQ(0, wrong.load());
  EXPECT_EQ(guard_tally.started.load(), guard_tally.answered.load());
  EXPECT_EQ(store_tally.started.load(), store_tally.answered.load());
  EXPECT_GT(store_tally.typed.load(), 0) << "no store call saw the server die";
  EXPECT_TRUE(pipelined_again) << "calls were not pipelined after the restart";
  EXPECT_GT(flushes_before, 0u);
  EXPECT_GE(ps.dropped, 1u);  // the shared connection broke under the calls
  // Exactly once: one effect row per executed key, never two, none lost.
  auto dup_keys = durable.database().read([&](idem::sqlite::Session& s) {
    return s.query_int64(
        "SELECT COUNT(*) FROM (SELECT k FROM effect GROUP BY k HAVING COUNT(*) > 1)");
  });
  EXPECT_EQ(0, dup_keys.value_or(-1));
  auto rows = durable.database().read(
      [&](idem::sqlite::Session& s) { return s.query_int64("SELECT COUNT(*) FROM effect"); });
  EXPECT_EQ(static_cast<std::int64_t>(guard.stats().snapshot().executed), rows.value_or(-1));
  EXPECT_EQ(kKeys, rows.value_or(-1));  // every key was called: each ran once
  EXPECT_GT(guard_calls.load(), at_kill + 600);
}

// The server stalls (DEBUG SLEEP 3) under 32 threads with command_timeout 300 ms: every call,
// written or still queued, ends within its own deadline with a typed error (StorageTimeout or
// StorageUnavailable; a complete also OutcomeUnknown), none waits for the stall to end, and
// calls work again once it has.
TEST_F(RedisPipeline, ConcurrentPipelinedCallsKeepTheirDeadlinesOnAStalledServer) {
  PrivateRedis server("--enable-debug-command yes");
  RedisStoreOptions o{server.uri()};
  o.auto_pipeline = true;
  o.command_timeout = 300ms;
  o.connect_timeout = 300ms;
  o.pool_wait_timeout = 100ms;
  o.reconnect_backoff = 10ms;
  RedisStore store(o);
  constexpr int kCallers = 32;
  std::vector<Key> keys;
  std::vector<OwnerToken> owners;
  for (int i = 0; i < kCallers; ++i) {
    keys.push_back(key("stall" + std::to_string(i)));
    owners.push_back(OwnerToken::generate());
    ASSERT_EQ(ClaimStatus::kClaimed,
              store.claim(keys.back(), "fp", owners.back(), 60'000ms).status);
  }
  idem::test::RawRedis raw(server.raw_uri());
  raw.cmd({"AUTH", "pw"});
  raw.send({"DEBUG", "SLEEP", "3"});
  std::this_thread::sleep_for(50ms);  // the server is asleep now
  Tally tally;
  std::atomic<long> late{0}, wrong_code{0};
  // The longest a call may take: queued (connect + command + pool wait), then its reply.
  const auto limit = o.connect_timeout + 2 * o.command_timeout + o.pool_wait_timeout + 400ms;
  const auto started = std::chrono::steady_clock::now();
  run_threads(kCallers, [&](int t) {
    const auto t0 = std::chrono::steady_clock::now();
    const bool complete = t % 2 == 1;
    try {
      if (complete) {
        (void)store.complete(keys[static_cast<std::size_t>(t)], owners[static_cast<std::size_t>(t)],
                             "r", 60s);
      } else {
        (void)store.claim(key("stalled_claim"), "fp", OwnerToken::generate(), 60'000ms);
      }
      ++tally.wrong;  // the server is asleep: nothing can have answered
    } catch (const idem::Error& e) {
      const auto c = e.code();
      // A written complete that timed out may have applied: OutcomeUnknown. A call still queued
      // gets what its connect got (the stalled server: AUTH timed out) or, past its wait,
      // StorageUnavailable: nothing of it was sent.
      const bool ok = c == idem::errc::kStoreTimeout || c == idem::errc::kStoreUnavailable ||
                      (complete && c == idem::errc::kOutcomeUnknown);
      if (!ok) {
        ++wrong_code;
        tally.problem(e.what());
      }
    }
    if (std::chrono::steady_clock::now() - t0 > limit) ++late;
  });
  const auto took = std::chrono::steady_clock::now() - started;
  std::printf(
      "32 calls on a stalled server ended in %lld ms\n",
      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()));
  EXPECT_EQ(0, tally.wrong.load());
  EXPECT_EQ(0, wrong_code.load()) << tally.first_problem;
  EXPECT_EQ(0, late.load());
  EXPECT_LT(took, 2500ms) << "calls waited for the stall to end";
  (void)raw.receive();  // the stall is over
  bool back = false;
  for (int i = 0; i < 100 && !back; ++i) {
    try {
      back = store.lookup(keys.front()).has_value();
    } catch (const idem::StorageError&) {
      std::this_thread::sleep_for(20ms);
    }
  }
  EXPECT_TRUE(back);
}

// Without auto-pipelining, a pooled connection the server closed while idle fails its next
// call with a typed error (over a Unix socket a write to it is EPIPE: never a SIGPIPE).
TEST_F(RedisPipeline, AKilledIdlePooledConnectionFailsTypedWithoutSigpipe) {
  PrivateRedis server;
  RedisStoreOptions o{server.uri()};
  o.auto_pipeline = false;
  RedisStore store(o);
  auto k = key("pooled_kill");
  auto owner = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store.claim(k, "fp", owner, 30'000ms).status);
  idem::test::RawRedis raw(server.raw_uri());
  raw.cmd({"AUTH", "pw"});
  EXPECT_GE(raw.integer({"CLIENT", "KILL", "TYPE", "normal"}), 1);
  std::this_thread::sleep_for(20ms);
  bool completed = false;
  for (int attempt = 0; attempt < 3 && !completed; ++attempt) {
    try {
      completed = store.complete(k, owner, "r", 60s);
    } catch (const idem::StorageError& e) {
      EXPECT_TRUE(outage_error(e)) << e.what();
    }
  }
  EXPECT_TRUE(completed);
}

// redis-server killed while a complete waits for its reply (queued behind a script that keeps
// the server busy): a write that went out whole ends OutcomeUnknown (the server may have
// applied it before it died), pooled or auto-pipelined; a call made after the kill, which
// sends nothing, ends StorageUnavailable.
TEST_F(RedisPipeline, AWriteWhoseReplyIsLostWithTheServerIsOutcomeUnknown) {
  for (const bool pipelined : {false, true}) {
    SCOPED_TRACE(pipelined ? "auto_pipeline" : "pooled");
    PrivateRedis server;
    RedisStoreOptions o{server.uri()};
    o.auto_pipeline = pipelined;
    o.command_timeout = 10'000ms;
    o.reconnect_backoff = 5ms;
    RedisStore store(o);
    const Key k = key(pipelined ? "lost_reply_p" : "lost_reply");
    const OwnerToken owner = OwnerToken::generate();
    const idem::ClaimResult claimed = store.claim(k, "fp", owner, 60'000ms);
    ASSERT_EQ(ClaimStatus::kClaimed, claimed.status);
    // The complete script is loaded before the server stalls (EVALSHA must not need EVAL).
    const Key warm = key(pipelined ? "lost_warm_p" : "lost_warm");
    ASSERT_EQ(ClaimStatus::kClaimed, store.claim(warm, "fp", owner, 60'000ms).status);
    ASSERT_TRUE(store.complete(warm, owner, "r", 60s));
    idem::test::RawRedis blocker(server.raw_uri());
    blocker.cmd({"AUTH", "pw"});
    blocker.send({"EVAL",
                  "local t = redis.call('TIME') local s = t[1] * 1000000 + t[2] while true do "
                  "local n = redis.call('TIME') if n[1] * 1000000 + n[2] - s > 3000000 then "
                  "break end end return 1",
                  "0"});
    std::this_thread::sleep_for(100ms);
    std::thread killer([&] {
      std::this_thread::sleep_for(400ms);  // the writes below are on the wire by then
      server.kill9();
    });
    std::exception_ptr complete_error;
    try {
      (void)store.complete_claimed(k, owner, claimed.ticket, "r", 60s);
    } catch (...) {
      complete_error = std::current_exception();
    }
    killer.join();
    auto code = [](const std::exception_ptr& e) {
      try {
        if (e) std::rethrow_exception(e);
      } catch (const idem::Error& x) {
        return x.code();
      } catch (...) {
      }
      return idem::errc::kStorageError;
    };
    ASSERT_TRUE(complete_error) << "the complete was answered after the server died";
    EXPECT_EQ(idem::errc::kOutcomeUnknown, code(complete_error));
    EXPECT_THROW((void)store.claim(key("after_kill"), "fp", OwnerToken::generate(), 1000ms),
                 idem::StorageUnavailable);
  }
}

// A lone caller sends at once (one batch per call, nothing waits for company); with the option
// off (the default) no call goes through a pipeline.
TEST_F(RedisPipeline, ALoneCallerFlushesAtOnceAndTheOptionTurnsItOff) {
  EXPECT_FALSE(RedisStoreOptions{}.auto_pipeline) << "auto_pipeline is opt-in";
  RedisStoreOptions o{url_};
  o.auto_pipeline = true;
  RedisStore on(o);
  for (int i = 0; i < 20; ++i) {
    auto k = key("lone" + std::to_string(i));
    auto owner = OwnerToken::generate();
    auto claimed = on.claim(k, "fp", owner, 30'000ms);
    ASSERT_EQ(ClaimStatus::kClaimed, claimed.status);
    ASSERT_TRUE(on.complete_claimed(k, owner, claimed.ticket, "r", 60s));
  }
  const auto s = on.pool_stats();
  EXPECT_EQ(40u, s.pipelined_commands);
  EXPECT_EQ(40u, s.pipelined_flushes);
  EXPECT_EQ(1u, s.connects);
  EXPECT_EQ(20u, on.command_stats().native_completes);  // native SETs, with the tickets

  // The shared connection goes back to the pool when idle: with pool_size 1, batch calls
  // (pooled connections of their own) still find it.
  RedisStoreOptions one{url_};
  one.auto_pipeline = true;
  one.pool_size = 1;
  RedisStore single(one);
  auto lone = key("lone_then_batch");
  auto lone_owner = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, single.claim(lone, "fp", lone_owner, 30'000ms).status);
  std::vector<Key> batch_keys = {key("b0"), key("b1"), key("b2")};
  std::vector<OwnerToken> batch_owners;
  for (int i = 0; i < 3; ++i) batch_owners.push_back(OwnerToken::generate());
  std::vector<idem::ClaimRequest> requests;
  for (std::size_t i = 0; i < batch_keys.size(); ++i) {
    requests.push_back(idem::ClaimRequest{&batch_keys[i], "fp", &batch_owners[i]});
  }
  for (const auto& r : single.claim_batch(requests, 30'000ms)) {
    EXPECT_EQ(ClaimStatus::kClaimed, r.status);
  }
  EXPECT_TRUE(single.complete(lone, lone_owner, "r", 60s));
  EXPECT_EQ(1u, single.pool_stats().connects);

  o.auto_pipeline = false;
  RedisStore off(o);
  auto k = key("off");
  auto owner = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, off.claim(k, "fp", owner, 30'000ms).status);
  ASSERT_TRUE(off.complete(k, owner, "r", 60s));
  EXPECT_EQ(0u, off.pool_stats().pipelined_flushes);
  EXPECT_EQ(0u, off.pool_stats().pipelined_commands);
}

}  // namespace
