// SPDX-License-Identifier: MIT
// Faults of the real redis-server: kill -9 and restart in the middle of guarded calls, a server
// busy in a script, a slow server (timeouts), maxmemory reached, a read-only replica, flushed
// scripts, a heartbeat that cannot reach a stalled server. These change the shared server, so ctest runs them serially (RUN_SERIAL).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "idem/guard.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "raw_redis.hpp"
#include "support/test_env.hpp"

namespace {

using idem::Key;
using idem::Outcome;
using idem::OwnerToken;
using idem::redis::RedisStore;
using idem::redis::RedisStoreOptions;
using namespace std::chrono_literals;

class RedisFaultTest : public ::testing::Test {
 protected:
  void SetUp() override { IDEM_REQUIRE_ENV(url_, "IDEM_TEST_REDIS_URL"); }
  void servers(const std::string& what) {
    std::string script;
    script = idem::test::server_env("IDEM_SERVERS_SCRIPT");
    ASSERT_FALSE(script.empty()) << "IDEM_SERVERS_SCRIPT is not set (eval scripts/servers.sh env)";
    std::string cmd = "\"" + script + "\" " + what + " >/dev/null 2>&1";
    ASSERT_EQ(0, std::system(cmd.c_str())) << cmd;
  }
  Key key(const std::string& tag) { return Key::make("redis.fault", idem::test::unique_name(tag)); }
  std::string url_;
};

class CountingObserver : public idem::Observer {
 public:
  std::atomic<int> downs{0}, recoveries{0};
  void on_fast_store_down(const Key&, const idem::Error&) noexcept override { ++downs; }
  void on_fast_store_recovered(std::uint64_t) noexcept override { ++recoveries; }
};

// kill -9 of redis-server while 4 threads run guarded calls (each key called 12 times) with the
// SQLite durable store; then redis-server restarts on the same port.
TEST_F(RedisFaultTest, KillNineMidRunKeepsExactlyOnceAndTheFastPathComesBack) {
  std::string servers_script;
  IDEM_REQUIRE_ENV(servers_script, "IDEM_SERVERS_SCRIPT");
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable(dir.file("fault.db"));
  durable.database().write(
      [](idem::sqlite::Transaction& tx) { tx.exec("CREATE TABLE effect (k TEXT NOT NULL)"); });
  RedisStoreOptions o{url_};
  o.command_timeout = 300ms;
  o.connect_timeout = 300ms;
  RedisStore fast(o);
  auto observer = std::make_shared<CountingObserver>();
  idem::GuardOptions go;
  go.observer = observer;
  idem::IdempotencyGuard guard{fast, durable, go};

  constexpr int kKeys = 600;
  constexpr int kThreads = 4;
  std::vector<Key> keys;
  for (int i = 0; i < kKeys; ++i) keys.push_back(key("k" + std::to_string(i)));
  std::atomic<int> done_calls{0}, wrong{0}, errors{0};
  std::mutex error_mutex;
  std::string first_error;
  std::atomic<bool> stop{false};
  // At step i thread t calls keys i+t, i+t+1, i+t+2 (mod kKeys): every key gets 12 calls,
  // 3 from each thread, at nearby moments.
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kKeys && !stop.load(); ++i) {
        for (int d = 0; d < 3; ++d) {
          const Key& k = keys[static_cast<std::size_t>((i + t + d) % kKeys)];
          try {
            auto r = guard.run(k, "fp", [&](idem::sqlite::Transaction& tx) {
              tx.exec("INSERT INTO effect (k) VALUES (?)", k.id());
              return "resp_" + k.id();
            });
            if (r.ok() && *r.value != "resp_" + k.id()) ++wrong;
            if (!r.ok() && r.outcome != Outcome::kInProgress) ++wrong;
          } catch (const std::exception& e) {
            ++errors;
            std::lock_guard<std::mutex> lock(error_mutex);
            if (first_error.empty()) first_error = e.what();
          }
          ++done_calls;
        }
        std::this_thread::sleep_for(1ms);
      }
    });
  }
  auto wait_calls = [&](int n) {
    auto deadline = std::chrono::steady_clock::now() + 60s;
    while (done_calls.load() < n && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(5ms);
    }
  };
  wait_calls(300);
  const auto before_kill = guard.stats().snapshot();
  EXPECT_GT(before_kill.fast_claims, 0u);
  servers("redis-kill");
  const int at_kill = done_calls.load();
  wait_calls(at_kill + 600);  // a run of calls while Redis is down
  const auto while_down = guard.stats().snapshot();
  servers("redis-start");
  const auto restarted_at = std::chrono::steady_clock::now();
  for (auto& t : threads) t.join();

  const auto end = guard.stats().snapshot();
  std::printf(
      "calls %d (kill at %d); before kill: fast_claims %llu; while down: degraded %llu; "
      "end: executed %llu replayed %llu in_progress %llu degraded %llu refills %llu\n",
      done_calls.load(), at_kill, static_cast<unsigned long long>(before_kill.fast_claims),
      static_cast<unsigned long long>(while_down.degraded),
      static_cast<unsigned long long>(end.executed), static_cast<unsigned long long>(end.replayed),
      static_cast<unsigned long long>(end.in_progress),
      static_cast<unsigned long long>(end.degraded),
      static_cast<unsigned long long>(end.fast_refills));
  EXPECT_EQ(0, errors.load()) << first_error;
  EXPECT_EQ(0, wrong.load());
  EXPECT_GT(while_down.degraded, before_kill.degraded);

  // Exactly once: one effect row per executed key, never two.
  auto dup_keys = durable.database().read([&](idem::sqlite::Session& s) {
    return s.query_int64(
        "SELECT COUNT(*) FROM (SELECT k FROM effect GROUP BY k HAVING COUNT(*) > 1)");
  });
  EXPECT_EQ(0, dup_keys.value_or(-1));
  auto rows = durable.database().read(
      [&](idem::sqlite::Session& s) { return s.query_int64("SELECT COUNT(*) FROM effect"); });
  EXPECT_EQ(static_cast<std::int64_t>(guard.stats().snapshot().executed), rows.value_or(-1));

  // The same process, the same store: Redis is used again without any restart of ours.
  const auto after_restart = guard.stats().snapshot();
  bool fast_again = false;
  auto deadline = std::chrono::steady_clock::now() + 15s;
  int n = 0;
  while (!fast_again && std::chrono::steady_clock::now() < deadline) {
    auto k = key("recover" + std::to_string(n++));
    auto first = guard.run(k, "fp", [&](idem::sqlite::Transaction&) { return std::string("r"); });
    auto second = guard.run(k, "fp", [&](idem::sqlite::Transaction&) { return std::string("x"); });
    EXPECT_TRUE(first.ok());
    EXPECT_EQ("r", second.value.value_or("?"));
    auto now = guard.stats().snapshot();
    fast_again = now.fast_claims > after_restart.fast_claims &&
                 now.fast_hits > after_restart.fast_hits &&
                 second.source == idem::Source::kFastStore;
    if (!fast_again) std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(fast_again) << "the fast path did not come back after redis-server restarted";
  std::printf("fast path used again at most %lld ms after redis-server answered PING again\n",
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                         std::chrono::steady_clock::now() - restarted_at)
                                         .count()));
  // The outage is reported once per burst, not once per failed call.
  EXPECT_GE(observer->downs.load(), 1);
  EXPECT_LE(observer->downs.load(), 3);
  EXPECT_GT(while_down.degraded - before_kill.degraded, 100u);
  EXPECT_GE(observer->recoveries.load(), 1);
  auto ps = fast.pool_stats();
  EXPECT_GE(ps.connects, 2u);
  EXPECT_GE(ps.dropped, 1u);
}

// Sets a server config value for one test and puts the old value back, whatever happens.
class ConfigOverride {
 public:
  ConfigOverride(idem::test::RawRedis& admin, std::string name, const std::string& value)
      : admin_(admin), name_(std::move(name)) {
    auto r = admin_.cmd({"CONFIG", "GET", name_});
    if (r && r->type == REDIS_REPLY_ARRAY && r->elements == 2) {
      old_.assign(r->element[1]->str, r->element[1]->len);
    }
    ok_ = admin_.text({"CONFIG", "SET", name_, value}) == "OK";
  }
  ~ConfigOverride() { admin_.cmd({"CONFIG", "SET", name_, old_}); }
  ConfigOverride(const ConfigOverride&) = delete;
  ConfigOverride& operator=(const ConfigOverride&) = delete;
  bool ok() const noexcept { return ok_; }

 private:
  idem::test::RawRedis& admin_;
  std::string name_;
  std::string old_;
  bool ok_ = false;
};

// A Lua script that spins for `ms` milliseconds on the server, without writing.
std::string spin_script(int ms) {
  return "local t = redis.call('TIME') local start = t[1] * 1000000 + t[2] "
         "while true do local n = redis.call('TIME') "
         "if n[1] * 1000000 + n[2] - start > " +
         std::to_string(ms * 1000) + " then break end end return 1";
}

// The server closes connections idle past its `timeout` (as managed Redis services do, and
// CLIENT KILL or an unnoticed restart alike): the store's pooled connection is replaced before
// use, so the first call after the idle period succeeds. A fast-only guard shows it: the fast
// store's errors are its caller's.
TEST_F(RedisFaultTest, AConnectionTheServerClosedWhileIdleIsReplacedBeforeUse) {
  idem::test::RawRedis admin(url_);
  std::string old = "0";
  if (auto r = admin.cmd({"CONFIG", "GET", "timeout"});
      r && r->type == REDIS_REPLY_ARRAY && r->elements == 2) {
    old.assign(r->element[1]->str, r->element[1]->len);
  }
  ASSERT_EQ("OK", admin.text({"CONFIG", "SET", "timeout", "1"}));
  struct Restore {  // on a fresh connection: the server closes this one too
    std::string url, value;
    ~Restore() { idem::test::RawRedis(url).cmd({"CONFIG", "SET", "timeout", value}); }
  } restore{url_, old};
  RedisStoreOptions o;
  o.uri = url_;
  o.pool_size = 1;
  RedisStore store{o};
  idem::IdempotencyGuard guard{store};
  auto run = [&](const std::string& tag) {
    return guard.run(key(tag), "fp", [] { return std::string("ok"); });
  };
  EXPECT_EQ(Outcome::kExecuted, run("before-idle").outcome);
  std::this_thread::sleep_for(2500ms);  // past the 1 s timeout: the server closed the connection
  EXPECT_EQ(Outcome::kExecuted, run("after-idle").outcome);
  EXPECT_GE(store.pool_stats().dropped, 1u) << "the closed connection was dropped, not used";
}

TEST_F(RedisFaultTest, ServerBusyInAScriptIsStorageUnavailable) {
  idem::test::RawRedis admin(url_);
  idem::test::RawRedis blocker(url_);
  ConfigOverride threshold(admin, "busy-reply-threshold", "50");
  ASSERT_TRUE(threshold.ok());
  RedisStore store(RedisStoreOptions{url_});
  auto k = key("busy");
  (void)store.lookup(k);  // open a connection before the server stalls
  blocker.send({"EVAL", spin_script(800), "0"});
  std::this_thread::sleep_for(200ms);
  try {
    (void)store.claim(k, "fp", OwnerToken::generate(), 1000ms);
    ADD_FAILURE() << "no exception";
  } catch (const idem::StorageUnavailable& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("BUSY")) << e.what();
    EXPECT_TRUE(e.retryable());
  }
  auto r = blocker.receive();
  ASSERT_TRUE(r);
  EXPECT_EQ(idem::ClaimStatus::kClaimed,
            store.claim(k, "fp", OwnerToken::generate(), 1000ms).status);
}

TEST_F(RedisFaultTest, SlowServerIsStorageTimeoutAndACompleteIsOutcomeUnknown) {
  idem::test::RawRedis blocker(url_);
  RedisStoreOptions o{url_};
  o.command_timeout = 150ms;
  RedisStore store(o);
  auto k = key("slow");
  auto owner = OwnerToken::generate();
  // Load the complete script now (a fresh server would answer the stalled EVALSHA with
  // NOSCRIPT, and then nothing would apply).
  auto warm = key("slow_warmup");
  ASSERT_EQ(idem::ClaimStatus::kClaimed, store.claim(warm, "fp", owner, 30'000ms).status);
  ASSERT_TRUE(store.complete(warm, owner, "r", std::chrono::seconds(60)));
  ASSERT_EQ(idem::ClaimStatus::kClaimed, store.claim(k, "fp", owner, 30'000ms).status);
  blocker.send({"EVAL", spin_script(1200), "0"});
  std::this_thread::sleep_for(50ms);
  EXPECT_THROW((void)store.claim(key("slow2"), "fp", OwnerToken::generate(), 1000ms),
               idem::StorageTimeout);
  EXPECT_THROW((void)store.complete(k, owner, "r", std::chrono::seconds(60)), idem::OutcomeUnknown);
  ASSERT_TRUE(blocker.receive());
  // Timed-out connections were dropped; fresh ones work. And the "unknown" complete did apply
  // once the server caught up: exactly why a timed-out write is OutcomeUnknown.
  EXPECT_GE(store.pool_stats().dropped, 2u);
  // The server runs the request the dropped connection had sent once it is free again.
  auto rec = store.lookup(k);
  for (int i = 0; i < 100 && rec && rec->status != idem::Record::Status::kCompleted; ++i) {
    std::this_thread::sleep_for(20ms);
    rec = store.lookup(k);
  }
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
  EXPECT_EQ("r", rec->response);
  EXPECT_FALSE(store.complete(k, owner, "again", std::chrono::seconds(60)));
}

// maxmemory reached with noeviction: a state that passes (keys expire), so retryable
// StorageUnavailable with the server's message, never a permanent StorageError (a fast-only
// completion refused so marked the record failed for the whole retention).
TEST_F(RedisFaultTest, MaxmemoryReachedIsRetryableWithTheServerMessage) {
  idem::test::RawRedis admin(url_);
  RedisStore store(RedisStoreOptions{url_});
  auto done = key("oom_done");
  auto o1 = OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed, store.claim(done, "fp", o1, 30'000ms).status);
  ASSERT_TRUE(store.complete(done, o1, "kept", std::chrono::seconds(60)));
  {
    ConfigOverride policy(admin, "maxmemory-policy", "noeviction");
    ConfigOverride maxmemory(admin, "maxmemory", "1");
    ASSERT_TRUE(policy.ok() && maxmemory.ok());
    try {
      (void)store.claim(key("oom"), "fp", OwnerToken::generate(), 1000ms);
      ADD_FAILURE() << "no exception";
    } catch (const idem::StorageUnavailable& e) {
      EXPECT_TRUE(e.retryable());
      EXPECT_EQ(idem::errc::kStoreUnavailable, e.code());
      EXPECT_NE(std::string::npos, std::string(e.what()).find("OOM")) << e.what();
    }
    // Replays still answer: they need no memory.
    auto replay = store.claim(done, "fp", OwnerToken::generate(), 1000ms);
    EXPECT_EQ(idem::ClaimStatus::kDone, replay.status);
    EXPECT_EQ("kept", replay.response);
  }
  EXPECT_EQ(idem::ClaimStatus::kClaimed,
            store.claim(key("oom_after"), "fp", OwnerToken::generate(), 1000ms).status);
}

// A fast-only guard whose completion Redis refuses for maxmemory (noeviction) after the
// handler ran: OutcomeUnknown (retryable: the handler ran, the retry replays or runs again
// after the lease), never a response "refused for good" that marked the key failed for the
// whole retention.
TEST_F(RedisFaultTest, ACompletionRefusedForMaxmemoryIsOutcomeUnknownNotAFailedKey) {
  idem::test::RawRedis admin(url_);
  RedisStore store(RedisStoreOptions{url_});
  idem::GuardOptions options;
  options.lease = 1000ms;
  idem::IdempotencyGuard guard{store, options};
  auto k = key("oom_complete");
  int runs = 0;
  {
    ConfigOverride policy(admin, "maxmemory-policy", "noeviction");
    ASSERT_TRUE(policy.ok());
    std::optional<ConfigOverride> full;
    try {
      (void)guard.run(k, "fp", [&] {
        ++runs;
        full.emplace(admin, "maxmemory", "1");  // full while the handler runs
        return std::string(4096, 'r');
      });
      ADD_FAILURE() << "the refused completion was not reported";
    } catch (const idem::OutcomeUnknown& e) {
      EXPECT_TRUE(e.retryable());
      EXPECT_NE(std::string::npos, std::string(e.what()).find("OOM")) << e.what();
    }
  }
  auto rec = store.lookup(k);
  EXPECT_TRUE(!rec || rec->status != idem::Record::Status::kFailed)
      << "the key was marked failed: " << rec->response;
}

// Redis lost the call's record while the handler ran (FLUSHDB here; an eviction or a restart
// without persistence alike): the response is written back, and the retry replays it.
TEST_F(RedisFaultTest, AFastOnlyRecordLostDuringTheHandlerIsWrittenBack) {
  idem::test::RawRedis admin(url_);
  RedisStore store(RedisStoreOptions{url_});
  idem::IdempotencyGuard guard{store};
  auto k = key("lost_record");
  int runs = 0;
  auto first = guard.run(k, "fp", [&] {
    ++runs;
    admin.cmd({"DEL", store.redis_key(k)});
    return std::string("charged");
  });
  EXPECT_EQ(idem::Outcome::kExecuted, first.outcome);
  auto retry = guard.run(k, "fp", [&] {
    ++runs;
    return std::string("again");
  });
  EXPECT_EQ(idem::Outcome::kReplayed, retry.outcome);
  EXPECT_EQ("charged", retry.value.value_or(""));
  EXPECT_EQ(1, runs);
}

// maxclients reached: the server answers a connection beyond it with "ERR max number of
// clients reached" (and closes it), before running anything. That is a retryable
// StorageUnavailable naming the limit; it was a permanent StorageError, and a fast-only
// completion refused so marked its key failed for the whole retention. No key is left failed,
// and each runs at most once.
TEST_F(RedisFaultTest, MaxclientsReachedIsRetryableAndFailsNoKey) {
  idem::test::RawRedis admin(url_);
  RedisStoreOptions o{url_};
  o.pool_size = 8;
  RedisStore store(o);
  (void)store.lookup(key("warm"));  // the pool's first connection
  const std::string info = admin.text({"INFO", "clients"});
  const auto at = info.find("connected_clients:");
  ASSERT_NE(std::string::npos, at) << info;
  const long connected = std::atol(info.c_str() + at + 18);
  std::vector<idem::Key> keys;
  for (int i = 0; i < 60; ++i) keys.push_back(key("full_" + std::to_string(i)));
  std::atomic<int> runs{0};
  std::mutex errors_mutex;
  std::vector<std::string> permanent;
  {
    ConfigOverride limit(admin, "maxclients", std::to_string(connected));
    ASSERT_TRUE(limit.ok());
    idem::IdempotencyGuard guard{store};
    std::vector<std::thread> threads;
    for (int t = 0; t < 6; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 10; ++i) {
          try {
            (void)guard.run(keys[static_cast<std::size_t>(t * 10 + i)], "fp", [&] {
              ++runs;
              std::this_thread::sleep_for(2ms);
              return std::string("r");
            });
          } catch (const idem::Error& e) {
            if (!e.retryable()) {
              std::lock_guard<std::mutex> lock(errors_mutex);
              permanent.push_back(e.what());
            }
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    // A store whose first connection the server refuses: typed, retryable, named.
    RedisStore fresh(RedisStoreOptions{url_});
    try {
      (void)fresh.lookup(key("refused"));
      ADD_FAILURE() << "a connection beyond maxclients answered";
    } catch (const idem::StorageUnavailable& e) {
      EXPECT_TRUE(e.retryable());
      EXPECT_NE(std::string::npos, std::string(e.what()).find("maxclients")) << e.what();
    }
  }
  EXPECT_TRUE(permanent.empty()) << permanent.size() << " non-retryable, e.g. "
                                 << permanent.front();
  for (const auto& k : keys) {
    auto rec = store.lookup(k);
    EXPECT_TRUE(!rec || rec->status != idem::Record::Status::kFailed) << k.str();
  }
  EXPECT_LE(runs.load(), 60);
}

TEST_F(RedisFaultTest, ReadOnlyReplicaIsStorageUnavailable) {
  idem::test::RawRedis admin(url_);
  RedisStore store(RedisStoreOptions{url_});
  // A replica of a master that does not exist (port 1): read-only, its data kept.
  struct BackToMaster {
    idem::test::RawRedis& admin;
    ~BackToMaster() { admin.cmd({"REPLICAOF", "NO", "ONE"}); }
  } back_to_master{admin};
  ASSERT_EQ("OK", admin.text({"REPLICAOF", "127.0.0.1", "1"}));
  bool readonly = false, masterdown = false;
  std::string what;
  try {
    (void)store.claim(key("ro"), "fp", OwnerToken::generate(), 1000ms);
  } catch (const idem::StorageUnavailable& e) {
    what = e.what();
    readonly = what.find("READONLY") != std::string::npos;
  } catch (const std::exception& e) {
    what = e.what();
  }
  ConfigOverride stale(admin, "replica-serve-stale-data", "no");
  ASSERT_TRUE(stale.ok());
  try {
    (void)store.lookup(key("md"));
  } catch (const idem::StorageUnavailable& e) {
    masterdown = std::string(e.what()).find("MASTERDOWN") != std::string::npos;
    if (!masterdown) what += std::string(" | ") + e.what();
  } catch (const std::exception& e) {
    what += std::string(" | ") + e.what();
  }
  EXPECT_EQ("OK", admin.text({"REPLICAOF", "NO", "ONE"}));
  EXPECT_TRUE(readonly) << what;
  EXPECT_TRUE(masterdown) << what;
  EXPECT_EQ(idem::ClaimStatus::kClaimed,
            store.claim(key("rw"), "fp", OwnerToken::generate(), 1000ms).status);
}

TEST_F(RedisFaultTest, FlushedScriptsAreReloadedOnNoscript) {
  idem::test::RawRedis admin(url_);
  // Completes take the script here (a native complete within the lease margin needs none).
  RedisStoreOptions options{url_};
  options.native_complete_fraction = 0;
  RedisStore store(options);
  auto k = key("noscript");
  auto owner = OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed, store.claim(k, "fp", owner, 30'000ms).status);
  ASSERT_TRUE(store.lookup(k).has_value());
  const auto loads = store.pool_stats().script_loads;
  ASSERT_EQ("OK", admin.text({"SCRIPT", "FLUSH"}));
  EXPECT_EQ(idem::ClaimStatus::kBusy,
            store.claim(k, "fp", OwnerToken::generate(), 30'000ms).status);
  EXPECT_TRUE(store.complete(k, owner, "r", std::chrono::seconds(60)));  // NOSCRIPT, load, retry
  EXPECT_EQ("r", store.lookup(k).value().response);                      // NOSCRIPT, load, retry
  EXPECT_EQ(loads + 2, store.pool_stats().script_loads);
  EXPECT_EQ("r", store.lookup(k).value().response);  // loaded: no reload
  EXPECT_EQ(loads + 2, store.pool_stats().script_loads);
}

// Counts the failures and lost leases the guard reports.
struct FailureCounter final : idem::Observer {
  std::atomic<int> store_errors{0}, leases_lost{0};
  void on_store_error(const idem::StoreErrorEvent&) noexcept override { ++store_errors; }
  void on_lease_lost(const Key&, std::string_view) noexcept override { ++leases_lost; }
};

// The heartbeat keeps a long handler's claim alive; when the server stalls for longer than the
// lease (as under SIGSTOP), the beats time out (reported), the claim expires, another process
// takes the key, and the first attempt is fenced: its completion throws LeaseLost and the
// record is the second attempt's.
TEST_F(RedisFaultTest, AStalledServerEndsTheHeartbeatAndTheOldOwnerIsFenced) {
  idem::test::RawRedis blocker(url_);
  RedisStoreOptions o{url_};
  o.command_timeout = 150ms;
  RedisStore first_store(o), second_store(RedisStoreOptions{url_});
  auto counter = std::make_shared<FailureCounter>();
  idem::GuardOptions go;
  go.lease = 400ms;
  go.heartbeat = true;
  go.observer = counter;
  idem::IdempotencyGuard first{first_store, go};
  idem::IdempotencyGuard second{second_store};
  const Key k = key("beat");
  // Load the scripts the stalled calls will need (a fresh server answers NOSCRIPT otherwise).
  auto warm = key("beat_warmup");
  auto w = OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed, first_store.claim(warm, "", w, 30'000ms).status);
  ASSERT_TRUE(first_store.extend(warm, w, 30'000ms));
  ASSERT_TRUE(first_store.complete(warm, w, "r", std::chrono::seconds(60)));

  std::atomic<int> runs{0};
  std::atomic<bool> lease_lost{false};
  std::thread a([&] {
    try {
      (void)first.run(k, "", [&] {
        ++runs;
        std::this_thread::sleep_for(200ms);
        blocker.send({"EVAL", spin_script(1500), "0"});  // the server stalls 1.5 s
        std::this_thread::sleep_for(2500ms);
        return std::string("first");
      });
    } catch (const idem::LeaseLost&) {
      lease_lost = true;
    }
  });
  std::this_thread::sleep_for(300ms);
  ASSERT_TRUE(blocker.receive());  // the stall is over; the claim's TTL ran out meanwhile
  auto r = second.run(k, "", [&] {
    ++runs;
    return std::string("second");
  });
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  a.join();
  EXPECT_TRUE(lease_lost) << "the first attempt's completion must be refused";
  EXPECT_EQ(2, runs.load());  // fast-store only: best effort, the takeover is the point here
  EXPECT_GE(counter->store_errors.load(), 1) << "the beats that timed out were reported";
  EXPECT_GE(counter->leases_lost.load(), 1);
  auto rec = second_store.lookup(k);
  ASSERT_TRUE(rec);
  EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
  EXPECT_EQ("second", rec->response);
}

// Extending is owner-checked and changes only the TTL.
TEST_F(RedisFaultTest, ExtendIsOwnerCheckedAndKeepsTheRecordBytes) {
  RedisStore store(RedisStoreOptions{url_});
  const Key k = key("extend");
  auto mine = OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed, store.claim(k, "fp", mine, 100ms).status);
  EXPECT_FALSE(store.extend(k, OwnerToken::generate(), 10'000ms));
  EXPECT_TRUE(store.extend(k, mine, 10'000ms));
  std::this_thread::sleep_for(250ms);  // past the first lease
  EXPECT_EQ(idem::ClaimStatus::kBusy, store.claim(k, "fp", OwnerToken::generate(), 100ms).status);
  EXPECT_TRUE(store.complete(k, mine, "done", std::chrono::seconds(60)));
  EXPECT_FALSE(store.extend(k, mine, 10'000ms)) << "a completed record is not extended";
  EXPECT_FALSE(store.extend(key("absent"), mine, 10'000ms));
}

}  // namespace
