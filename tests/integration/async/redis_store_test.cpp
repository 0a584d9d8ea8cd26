// SPDX-License-Identifier: MIT
// AsyncRedisStore against the real redis-server: the synchronous FastStore conformance suite
// through the asynchronous calls, records shared with the synchronous RedisStore, many calls
// in flight on one connection, foreign values, and AsyncGuard with SQLite behind it.
#include "idem/async/redis_store.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "../postgres/tcp_proxy.hpp"
#include "async_guard_suite.hpp"
#include "async_support.hpp"
#include "blocking_adapters.hpp"
#include "conformance/fast_store_conformance.hpp"
#include "idem/async/pooled_durable.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "raw_redis.hpp"

namespace {

using idem::async::AsyncRedisStore;
using idem::async::AsyncRedisStoreOptions;
using idem::test::BlockingFastStore;

std::unique_ptr<idem::FastStore> make_async(const std::string& url) {
  return std::make_unique<BlockingFastStore>(
      [&](idem::async::Executor ex) { return std::make_unique<AsyncRedisStore>(ex, url); });
}

std::unique_ptr<idem::FastStore> make_async_script_claim(const std::string& url) {
  return std::make_unique<BlockingFastStore>([&](idem::async::Executor ex) {
    AsyncRedisStoreOptions o;
    o.uri = url;
    o.claim_script = true;
    return std::make_unique<AsyncRedisStore>(ex, o);
  });
}

}  // namespace

// Redis records (format 2) keep no owner once completed, as RedisStore's.
IDEM_FAST_STORE_CONFORMANCE(AsyncRedis,
                            (FastStoreFactory{"async_redis", "IDEM_TEST_REDIS_URL", make_async,
                                              false}),
                            (FastStoreFactory{"async_redis_script_claim", "IDEM_TEST_REDIS_URL",
                                              make_async_script_claim, false}))

namespace {

class AsyncRedisStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { IDEM_REQUIRE_ENV(url_, "IDEM_TEST_REDIS_URL"); }
  idem::Key key(const std::string& tag) {
    return idem::Key::make("async.redis", idem::test::unique_name(tag));
  }
  std::string url_;
};

// One Redis, two clients: what the asynchronous store writes the synchronous one reads, and
// the other way round (the same encoding and scripts).
TEST_F(AsyncRedisStoreTest, RecordsAreSharedWithTheSynchronousStore) {
  idem::redis::RedisStore sync{url_};
  BlockingFastStore async_store(
      [&](idem::async::Executor ex) { return std::make_unique<AsyncRedisStore>(ex, url_); });
  auto k = key("shared");
  auto a = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            async_store.claim(k, "fp", a, std::chrono::seconds(30)).status);
  EXPECT_EQ(idem::ClaimStatus::kBusy,
            sync.claim(k, "fp", idem::OwnerToken::generate(), std::chrono::seconds(30)).status);
  EXPECT_TRUE(sync.complete(k, a, "from sync", std::chrono::seconds(60)));
  auto r = async_store.claim(k, "fp", idem::OwnerToken::generate(), std::chrono::seconds(30));
  EXPECT_EQ(idem::ClaimStatus::kDone, r.status);
  EXPECT_EQ("from sync", r.response);
  EXPECT_EQ(sync.redis_key(k),
            static_cast<AsyncRedisStore&>(async_store.async_store()).redis_key(k));
}

// A complete whose connection is lost after the command went out (the proxy forwards it, then
// closes both sides) may have been applied: OutcomeUnknown, as the synchronous store says, not
// StorageUnavailable (here it was applied: the record is completed).
TEST_F(AsyncRedisStoreTest, AWriteWhoseAnswerIsLostIsOutcomeUnknown) {
  const auto colon = url_.rfind(':');
  ASSERT_NE(std::string::npos, colon) << url_;
  idem::test::CommitDroppingProxy proxy(std::stoi(url_.substr(colon + 1)));
  const std::string via = "redis://127.0.0.1:" + std::to_string(proxy.port());
  idem::redis::RedisStore direct{url_};
  BlockingFastStore async_store(
      [&](idem::async::Executor ex) { return std::make_unique<AsyncRedisStore>(ex, via); });
  // A first complete loads its script (EVALSHA would otherwise answer NOSCRIPT: not applied).
  auto warm = key("warm");
  auto warm_owner = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            async_store.claim(warm, "fp", warm_owner, std::chrono::seconds(30)).status);
  ASSERT_TRUE(async_store.complete(warm, warm_owner, "ok", std::chrono::seconds(60)));
  auto k = key("lost-answer");
  auto owner = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            async_store.claim(k, "fp", owner, std::chrono::seconds(30)).status);
  proxy.drop_pattern = "answer-the-client-never-hears";
  proxy.drop_next_commit = true;
  try {
    (void)async_store.complete(k, owner, "answer-the-client-never-hears", std::chrono::seconds(60));
    ADD_FAILURE() << "answered";
  } catch (const idem::OutcomeUnknown& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("may have been applied")) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not OutcomeUnknown: " << e.what();
  }
  EXPECT_EQ(1, proxy.dropped.load());
  // The server runs what reached it before the close (at once, or moments later).
  std::optional<idem::Record> record;
  for (int i = 0; i < 200; ++i) {
    record = direct.lookup(k);
    if (record && record->status == idem::Record::Status::kCompleted) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(record.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, record->status);
}

// The records the asynchronous store writes are byte for byte RedisStore's (format 2), the
// times aside; a format-1 claim of an earlier release is completed in its own format.
TEST_F(AsyncRedisStoreTest, WritesTheSynchronousStoresRecordFormat) {
  idem::redis::RedisStore sync{url_};
  BlockingFastStore async_store(
      [&](idem::async::Executor ex) { return std::make_unique<AsyncRedisStore>(ex, url_); });
  idem::test::RawRedis raw(url_);
  const auto owner = idem::OwnerToken::generate();
  const std::string fp = idem::fingerprint("{\"amount\": 42}");
  const auto lease = std::chrono::seconds(30);
  const auto retention = std::chrono::seconds(60);
  auto get = [&](const idem::Key& k) { return raw.text({"GET", sync.redis_key(k)}); };
  auto same_but_times = [](const std::string& a, const std::string& b, std::size_t times_at,
                           std::size_t times_len) {
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(a.substr(0, times_at), b.substr(0, times_at));
    EXPECT_EQ(a.substr(times_at + times_len), b.substr(times_at + times_len));
  };
  // In progress: <tag 0xA9> <owner: 12 bytes> <created: 6> <deadline: 6> 'H' <fingerprint: 32>.
  auto ks = key("fmt-sync"), ka = key("fmt-async");
  ASSERT_EQ(idem::ClaimStatus::kClaimed, sync.claim(ks, fp, owner, lease).status);
  ASSERT_EQ(idem::ClaimStatus::kClaimed, async_store.claim(ka, fp, owner, lease).status);
  const std::string claim_s = get(ks), claim_a = get(ka);
  EXPECT_EQ(static_cast<char>(0xA9), claim_a[0]);
  EXPECT_EQ(1u + 12 + 6 + 6 + 1 + 32, claim_a.size());
  same_but_times(claim_s, claim_a, 13, 12);
  // Completed: <tag 0xA2> <created: 6> 'H' <fingerprint: 32> <response>.
  ASSERT_TRUE(sync.complete(ks, owner, "order_7", retention));
  ASSERT_TRUE(async_store.complete(ka, owner, "order_7", retention));
  const std::string done_s = get(ks), done_a = get(ka);
  EXPECT_EQ(static_cast<char>(0xA2), done_a[0]);
  EXPECT_EQ(1u + 6 + 1 + 32 + 7, done_a.size());
  same_but_times(done_s, done_a, 1, 6);
  // Filled (no claim): the same completed record.
  auto fs = key("fill-sync"), fa = key("fill-async");
  sync.fill(fs, fp, "order_7", retention);
  async_store.fill(fa, fp, "order_7", retention);
  same_but_times(get(fs), get(fa), 1, 6);
  same_but_times(done_a, get(fa), 1, 6);
  // Failed: <tag 0xA3>.
  auto xs = key("fail-sync"), xa = key("fail-async");
  ASSERT_EQ(idem::ClaimStatus::kClaimed, sync.claim(xs, fp, owner, lease).status);
  ASSERT_EQ(idem::ClaimStatus::kClaimed, async_store.claim(xa, fp, owner, lease).status);
  ASSERT_TRUE(sync.fail(xs, owner, "poison", retention));
  ASSERT_TRUE(async_store.fail(xa, owner, "poison", retention));
  EXPECT_EQ(static_cast<char>(0xA3), get(xa)[0]);
  same_but_times(get(xs), get(xa), 1, 6);
  // Format 1 (an earlier release's claim): completed by the asynchronous store in format 1,
  // replayed by both; a format-1 claim of another owner is busy for both.
  auto old = key("format1");
  const long long now = idem::to_millis(idem::system_now());
  const std::string v1 = "I1P" + std::to_string(owner.str().size()) + ":" + owner.str() +
                         std::to_string(now) + ":" + std::to_string(now + 30000) + ":" +
                         std::to_string(fp.size()) + ":" + fp;
  raw.cmd({"SET", sync.redis_key(old), v1, "PX", "30000"});
  EXPECT_EQ(idem::ClaimStatus::kBusy,
            async_store.claim(old, fp, idem::OwnerToken::generate(), lease).status);
  ASSERT_TRUE(async_store.complete(old, owner, "from v1", retention));
  EXPECT_EQ("I1C", get(old).substr(0, 3));
  EXPECT_EQ("from v1", sync.claim(old, fp, idem::OwnerToken::generate(), lease).response);
  EXPECT_EQ("from v1", async_store.lookup(old).value().response);
  auto old2 = key("format1-release");
  raw.cmd({"SET", sync.redis_key(old2), v1, "PX", "30000"});
  EXPECT_FALSE(async_store.release(old2, idem::OwnerToken::generate()));
  EXPECT_TRUE(async_store.release(old2, owner));
  EXPECT_EQ("<nil>", get(old2));
}

// Many claims in flight on one connection from one loop thread, answered in order.
TEST_F(AsyncRedisStoreTest, AThousandClaimsInFlightShareOneConnection) {
  idem::test::LoopThread loop;
  auto store = std::make_unique<AsyncRedisStore>(loop.executor(), url_);
  constexpr int kCalls = 1000;
  std::vector<idem::Key> keys;
  for (int i = 0; i < kCalls; ++i) keys.push_back(key("many" + std::to_string(i % 700)));
  std::promise<void> all;
  std::atomic<int> answered{0}, claimed{0}, busy{0}, errors{0};
  auto owner = idem::OwnerToken::generate();
  idem::async::net::post(loop.io(), [&] {
    for (int i = 0; i < kCalls; ++i) {
      store->async_claim(keys[i], "fp", owner, std::chrono::seconds(30), loop.executor(),
                         [&](std::exception_ptr e, idem::ClaimResult c) {
                           if (e) ++errors;
                           if (c.status == idem::ClaimStatus::kClaimed) ++claimed;
                           if (c.status == idem::ClaimStatus::kBusy) ++busy;
                           if (++answered == kCalls) all.set_value();
                         });
    }
  });
  ASSERT_EQ(std::future_status::ready, all.get_future().wait_for(std::chrono::seconds(30)));
  EXPECT_EQ(0, errors.load());
  // Keys 700..999 repeat keys 0..299, claimed by the same owner: its own claim, kept.
  EXPECT_EQ(kCalls, claimed.load());
  std::promise<idem::async::AsyncRedisStats> stats;
  idem::async::net::post(loop.io(), [&] { stats.set_value(store->stats()); });
  auto s = stats.get_future().get();
  EXPECT_EQ(1u, s.connects);
  EXPECT_GE(s.commands, static_cast<std::uint64_t>(kCalls));
  // Destroyed from this thread while the loop runs: the store closes on its strand.
  store.reset();
}

// A store destroyed from another thread than its loop's, with calls in flight: each call is
// answered (a reply, or StorageUnavailable once the store closed), none twice, and nothing is
// touched after the store is gone (run under ASan and TSan).
TEST_F(AsyncRedisStoreTest, DestroyedFromAnotherThreadWithCallsInFlight) {
  idem::test::LoopThread loop;
  for (int round = 0; round < 20; ++round) {
    auto store = std::make_unique<AsyncRedisStore>(loop.executor(), url_);
    constexpr int kCalls = 200;
    std::atomic<int> answered{0}, unavailable{0}, other_errors{0};
    std::promise<void> all;
    auto owner = idem::OwnerToken::generate();
    for (int i = 0; i < kCalls; ++i) {
      store->async_claim(key("gone" + std::to_string(round) + "_" + std::to_string(i)), "fp", owner,
                         std::chrono::seconds(30), loop.executor(),
                         [&](std::exception_ptr e, idem::ClaimResult) {
                           if (e) {
                             try {
                               std::rethrow_exception(e);
                             } catch (const idem::StorageUnavailable&) {
                               ++unavailable;
                             } catch (...) {
                               ++other_errors;
                             }
                           }
                           if (++answered == kCalls) all.set_value();
                         });
    }
    store.reset();  // this thread, the loop busy with the store's replies
    ASSERT_EQ(std::future_status::ready, all.get_future().wait_for(std::chrono::seconds(30)));
    EXPECT_EQ(kCalls, answered.load());
    EXPECT_EQ(0, other_errors.load());
  }
}

// The order docs/async.md gives for shutting down, with calls still in flight (a server that
// accepts and never answers): the loop stopped, the store destroyed from another thread, then
// the io_context destroyed. The store's close job never runs on the stopped loop; once the
// io_context is gone, its connection must be closed anyway, and the calls' completions, posted
// to the stopped loop, are destroyed uncalled.
TEST_F(AsyncRedisStoreTest, DestroyedBesideAStoppedLoopClosesItsConnectionWhenTheLoopGoes) {
  idem::test::Listener silent(16);  // the kernel completes the connect; nothing ever answers
  auto open_fds = [] {
    std::size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
      (void)e;
      ++n;
    }
    return n;
  };
  const std::size_t before = open_fds();
  std::atomic<int> called{0};
  {
    idem::async::net::io_context io;
    AsyncRedisStoreOptions o;
    o.uri = "redis://127.0.0.1:" + std::to_string(silent.port());
    o.connect_timeout = std::chrono::seconds(30);
    o.command_timeout = std::chrono::seconds(30);
    auto store = std::make_unique<AsyncRedisStore>(io.get_executor(), o);
    auto owner = idem::OwnerToken::generate();
    for (int i = 0; i < 20; ++i) {
      store->async_claim(key("stopped" + std::to_string(i)), "fp", owner, std::chrono::seconds(30),
                         io.get_executor(),
                         [&called](std::exception_ptr, idem::ClaimResult) { ++called; });
    }
    io.run_for(std::chrono::milliseconds(200));  // connected, the claims sent, none answered
    ASSERT_GT(open_fds(), before) << "the store never opened its connection";
    io.stop();
    store.reset();  // from this thread, the loop stopped: its close job stays queued
  }                 // the io_context destroyed
  EXPECT_EQ(before, open_fds()) << "the store's connection outlived the store and its loop";
  EXPECT_EQ(0, called.load()) << "completions posted to a stopped loop are not called";
}

TEST_F(AsyncRedisStoreTest, AForeignValueIsACorruptRecordAndUsageErrorsAreTyped) {
  BlockingFastStore async_store(
      [&](idem::async::Executor ex) { return std::make_unique<AsyncRedisStore>(ex, url_); });
  auto& store = static_cast<AsyncRedisStore&>(async_store.async_store());
  idem::test::RawRedis raw(url_);
  auto k = key("foreign");
  raw.cmd({"SET", store.redis_key(k), "not an idem record"});
  EXPECT_THROW(
      (void)async_store.claim(k, "fp", idem::OwnerToken::generate(), std::chrono::seconds(30)),
      idem::CorruptRecord);
  EXPECT_THROW((void)async_store.lookup(k), idem::CorruptRecord);
  EXPECT_THROW(
      (void)async_store.complete(k, idem::OwnerToken::generate(), "x", std::chrono::seconds(60)),
      idem::CorruptRecord);
  auto h = key("hash");
  raw.cmd({"HSET", store.redis_key(h), "f", "v"});
  EXPECT_THROW(
      (void)async_store.claim(h, "fp", idem::OwnerToken::generate(), std::chrono::seconds(30)),
      idem::CorruptRecord);
  raw.cmd({"DEL", store.redis_key(k), store.redis_key(h)});
  EXPECT_THROW(
      (void)async_store.claim(k, "fp", idem::OwnerToken::generate(), std::chrono::milliseconds(0)),
      idem::UsageError);
  EXPECT_THROW(
      (void)async_store.complete(k, idem::OwnerToken::generate(), "x", std::chrono::seconds(0)),
      idem::UsageError);
  idem::test::LoopThread loop;
  EXPECT_THROW(AsyncRedisStore(loop.executor(), "redis://[bad"), idem::UsageError);
  // No TLS in this store: a rediss:// address is refused, never reached in cleartext (with
  // its password in the AUTH).
  EXPECT_THROW(AsyncRedisStore(loop.executor(), "rediss://:secret@127.0.0.1:6380"),
               idem::UsageError);
  AsyncRedisStoreOptions bad;
  bad.uri = url_;
  bad.key_prefix = "a{b";
  EXPECT_THROW(AsyncRedisStore(loop.executor(), bad), idem::UsageError);
}

// A script cache flushed under the store (restart, failover): NOSCRIPT, then EVAL reloads it.
TEST_F(AsyncRedisStoreTest, AFlushedScriptCacheIsReloaded) {
  BlockingFastStore async_store(
      [&](idem::async::Executor ex) { return std::make_unique<AsyncRedisStore>(ex, url_); });
  idem::test::RawRedis raw(url_);
  auto k = key("noscript");
  auto a = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            async_store.claim(k, "fp", a, std::chrono::seconds(30)).status);
  raw.cmd({"SCRIPT", "FLUSH"});
  EXPECT_TRUE(async_store.complete(k, a, "after flush", std::chrono::seconds(60)));
  EXPECT_EQ("after flush", async_store.lookup(k).value().response);
  EXPECT_GE(static_cast<AsyncRedisStore&>(async_store.async_store()).stats().script_loads, 1u);
}

}  // namespace

namespace {

struct RedisSqlite {
  using Durable = idem::async::PooledDurable<idem::sqlite::SqliteStore>;
  static const char* env_var() { return "IDEM_TEST_REDIS_URL"; }
  explicit RedisSqlite(const std::string& url)
      : sqlite(dir.file("async.db")),
        workers({4, 256}),
        pooled(sqlite, workers),
        redis(std::in_place, loop.executor(), url),
        raw(url) {
    sqlite.database().write([](idem::sqlite::Transaction& tx) {
      tx.exec("CREATE TABLE idem_test_effects (key_id TEXT NOT NULL)");
    });
  }
  ~RedisSqlite() {
    std::promise<void> p;
    idem::async::net::post(loop.io(), [&] {
      redis.reset();
      p.set_value();
    });
    p.get_future().wait();
  }
  idem::async::AsyncFastStore* fast() { return &*redis; }
  Durable& durable() { return pooled; }
  idem::async::WorkerPool& pool() { return workers; }
  void insert_effect(idem::sqlite::Transaction& tx, const std::string& id) {
    tx.exec("INSERT INTO idem_test_effects (key_id) VALUES (?)", id);
  }
  long count_effects(const std::string& id) {
    return static_cast<long>(sqlite.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM idem_test_effects WHERE key_id = ?", id)
          .value_or(-1);
    }));
  }
  void forget_fast(const idem::Key& k) { raw.cmd({"DEL", redis->redis_key(k)}); }

  idem::test::TempDir dir;
  idem::sqlite::SqliteStore sqlite;
  idem::async::WorkerPool workers;
  Durable pooled;
  idem::test::LoopThread loop;
  std::optional<AsyncRedisStore> redis;
  idem::test::RawRedis raw;
};

}  // namespace

namespace idem::test {
using RedisEnvs = ::testing::Types<RedisSqlite>;
INSTANTIATE_TYPED_TEST_SUITE_P(Redis, AsyncGuardSuite, RedisEnvs);
}  // namespace idem::test
