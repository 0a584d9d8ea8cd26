// SPDX-License-Identifier: MIT
// The local tier of RedisStore (RedisStoreOptions::local_tier) against the real redis-server:
// hot completed keys answered with no command sent, in-progress keys and other fingerprints
// always asked of Redis, the expiry and size bounds, invalidations from another process (a
// helper binary) after a delete, a fill and a release, and 64 threads on a few hot keys with
// failing handlers (releases) interleaved: each key's effect exactly once.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/errors.hpp"
#include "idem/guard.hpp"
#include "idem/redis/redis_store.hpp"
#include "local_tier_support.hpp"
#include "raw_redis.hpp"
#include "support/test_env.hpp"

namespace {

using idem::ClaimStatus;
using idem::Key;
using idem::OwnerToken;
using idem::redis::RedisStore;
using idem::redis::RedisStoreOptions;
using namespace std::chrono_literals;

using idem::test::eventually;

class LocalTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(url_, "IDEM_TEST_REDIS_URL");
    // A prefix of this test alone: the broadcasts it hears are its own writes.
    prefix_ = idem::test::unique_name("idemlt") + ":";
  }
  RedisStoreOptions options(std::size_t entries = 1000, std::size_t bytes = 1 << 20) const {
    RedisStoreOptions o{url_};
    o.auto_pipeline = true;  // so that pipelined_commands counts every command sent (sent())
    o.key_prefix = prefix_;
    o.local_tier.enabled = true;
    o.local_tier.max_entries = entries;
    o.local_tier.max_bytes = bytes;
    return o;
  }
  static void wait_tracking(const RedisStore& s) {
    ASSERT_TRUE(eventually([&] { return s.local_tier_stats().tracking; }))
        << "tracking never established";
  }
  // Commands the store sent (every single call goes through its auto-pipeline, which the
  // stores of these tests turn on).
  static std::uint64_t sent(const RedisStore& s) { return s.pool_stats().pipelined_commands; }
  static Key key(const std::string& id) { return Key::make("tier", id); }
  static void complete(RedisStore& s, const Key& k, const std::string& fp,
                       const std::string& response, std::chrono::seconds retention = 60s) {
    ASSERT_TRUE(idem::test::complete_first(s, k, fp, response, retention));
  }
  static void warm(RedisStore& s, const Key& k, const std::string& fp, std::uint64_t writes = 0) {
    ASSERT_TRUE(idem::test::warm(s, k, fp, writes));
  }
  std::string url_, prefix_;
};

TEST_F(LocalTierTest, HotCompletedKeyIsReplayedWithNoCommandSent) {
  RedisStore s(options());
  wait_tracking(s);
  const Key k = key("hot");
  complete(s, k, "fp", "order_1");
  RedisStoreOptions plain{url_};
  plain.key_prefix = prefix_;
  const auto remote = RedisStore(plain).claim(k, "fp", OwnerToken::generate(), 5000ms);
  ASSERT_EQ(ClaimStatus::kDone, remote.status);
  warm(s, k, "fp", 2);
  const auto before = sent(s);
  const auto hits = s.local_tier_stats().hits;
  for (int i = 0; i < 1000; ++i) {
    auto r = s.claim(k, "fp", OwnerToken::generate(), 5000ms);
    ASSERT_EQ(ClaimStatus::kDone, r.status);
    ASSERT_EQ("order_1", r.response);
    ASSERT_FALSE(r.failed);
    // The same answer as Redis gives.
    ASSERT_EQ(remote.holder, r.holder);
    ASSERT_EQ(remote.first_seen, r.first_seen);
  }
  EXPECT_EQ(before, sent(s)) << "a hot completed key must not reach Redis";
  EXPECT_EQ(hits + 1000, s.local_tier_stats().hits);
  // lookup is answered from the tier too, within the record's expiry in Redis.
  auto rec = s.lookup(k);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
  EXPECT_EQ("order_1", rec->response);
  EXPECT_EQ(before, sent(s));
  idem::test::RawRedis raw(url_);
  const long long pttl = raw.integer({"PTTL", s.redis_key(k)});
  EXPECT_LE(rec->expires_at, idem::system_now() + std::chrono::milliseconds(pttl) + 50ms);
}

TEST_F(LocalTierTest, InProgressKeyIsAlwaysAskedOfRedis) {
  RedisStore holder(RedisStoreOptions{url_});
  RedisStoreOptions o = options();
  RedisStore s(o);
  wait_tracking(s);
  const Key k = key("busy");
  RedisStoreOptions ho{url_};
  ho.key_prefix = prefix_;
  RedisStore first(ho);
  OwnerToken owner = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, first.claim(k, "fp", owner, 10000ms).status);
  for (int i = 0; i < 20; ++i) {
    const auto before = sent(s);
    EXPECT_EQ(ClaimStatus::kBusy, s.claim(k, "fp", OwnerToken::generate(), 5000ms).status);
    EXPECT_EQ(before + 1, sent(s));
    auto rec = s.lookup(k);
    ASSERT_TRUE(rec.has_value());
    EXPECT_EQ(idem::Record::Status::kInProgress, rec->status);
  }
  EXPECT_EQ(0U, s.local_tier_stats().entries);
  EXPECT_EQ(0U, s.local_tier_stats().hits);
  // Released by its owner: the next claim is a fresh one, from Redis.
  ASSERT_TRUE(first.release(k, owner));
  EXPECT_EQ(ClaimStatus::kClaimed, s.claim(k, "fp", OwnerToken::generate(), 5000ms).status);
}

TEST_F(LocalTierTest, FingerprintMismatchGoesToRedisAndIsAMismatch) {
  RedisStore s(options());
  wait_tracking(s);
  const Key k = key("mismatch");
  complete(s, k, "fp-a", "paid");
  warm(s, k, "fp-a", 2);
  const auto before = sent(s);
  const auto st = s.local_tier_stats();
  auto r = s.claim(k, "fp-b", OwnerToken::generate(), 5000ms);
  EXPECT_EQ(ClaimStatus::kMismatch, r.status);
  EXPECT_TRUE(r.response.empty());
  EXPECT_EQ(before + 1, sent(s)) << "a mismatch is answered by Redis";
  EXPECT_EQ(st.fingerprint_misses + 1, s.local_tier_stats().fingerprint_misses);
  EXPECT_EQ(st.hits, s.local_tier_stats().hits);
  // The entry stays for its own fingerprint.
  EXPECT_EQ(ClaimStatus::kDone, s.claim(k, "fp-a", OwnerToken::generate(), 5000ms).status);
  EXPECT_EQ(before + 1, sent(s));
}

TEST_F(LocalTierTest, EntryNeverOutlivesTheRecordInRedis) {
  RedisStore s(options());
  wait_tracking(s);
  const Key k = key("expiry");
  complete(s, k, "fp", "short", 1s);
  warm(s, k, "fp");
  idem::test::RawRedis raw(url_);
  // Redis expires the key (an expiry also broadcasts, but the bound holds without it: the
  // entry's own deadline is the PTTL read, counted from before the read was sent).
  ASSERT_TRUE(eventually([&] { return raw.integer({"EXISTS", s.redis_key(k)}) == 0; }, 3000ms));
  auto r = s.claim(k, "fp", OwnerToken::generate(), 5000ms);
  EXPECT_EQ(ClaimStatus::kClaimed, r.status) << "served a record Redis no longer has";
}

TEST_F(LocalTierTest, EntriesAndBytesBoundsEvictLeastRecentlyUsed) {
  {
    RedisStore s(options(3));
    wait_tracking(s);
    for (int i = 0; i < 5; ++i) {
      const Key k = key("n" + std::to_string(i));
      complete(s, k, "fp", "r");
      // After the invalidations of every write so far (claim and completion of each key): a
      // late one would drop an entry uncounted as an eviction.
      warm(s, k, "fp", 2 * static_cast<std::uint64_t>(i + 1));
    }
    auto st = s.local_tier_stats();
    EXPECT_EQ(3U, st.entries);
    EXPECT_GE(st.evictions, 2U);
    // The oldest are gone: asked of Redis (and kept again).
    const auto before = sent(s);
    EXPECT_EQ(ClaimStatus::kDone, s.claim(key("n0"), "fp", OwnerToken::generate(), 5000ms).status);
    EXPECT_GT(sent(s), before);
    EXPECT_LE(s.local_tier_stats().entries, 3U);
  }
  {
    const std::string big(1000, 'x');
    // Room for two such records (1000 + key + fingerprint + owner + 128 each), not three.
    RedisStore s(options(1000, 2600));
    wait_tracking(s);
    for (int i = 0; i < 4; ++i) {
      const Key k = key("b" + std::to_string(i));
      complete(s, k, "fp", big);
      warm(s, k, "fp", 2 * static_cast<std::uint64_t>(i + 1));
    }
    auto st = s.local_tier_stats();
    EXPECT_EQ(2U, st.entries);
    EXPECT_LE(st.bytes, 2600U);
    // A record larger than max_bytes is never kept.
    const Key huge = key("huge");
    complete(s, huge, "fp", std::string(4000, 'y'));
    const auto before = sent(s);
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(ClaimStatus::kDone, s.claim(huge, "fp", OwnerToken::generate(), 5000ms).status);
    }
    EXPECT_EQ(0U, s.local_tier_stats().hits - st.hits);
    EXPECT_EQ(before + 5, sent(s)) << "no read to fill the tier with a record it cannot keep";
  }
}

TEST_F(LocalTierTest, DisabledTierSendsEveryClaim) {
  RedisStoreOptions o{url_};
  o.auto_pipeline = true;  // counted by sent()
  o.key_prefix = prefix_;
  RedisStore s(o);
  const Key k = key("off");
  complete(s, k, "fp", "r");
  const auto before = sent(s);
  for (int i = 0; i < 10; ++i) s.claim(k, "fp", OwnerToken::generate(), 5000ms);
  EXPECT_EQ(before + 10, sent(s));
  EXPECT_EQ(0U, s.local_tier_stats().hits);
}

// A helper process (redis_local_tier_peer) with its own store and tier: it replays from its
// tier, and sees deletes, fills and releases made here.
class Peer {
 public:
  Peer(const std::string& url, const std::string& prefix) {
    int in[2], out[2];
    if (::pipe(in) != 0 || ::pipe(out) != 0) throw std::runtime_error("pipe");
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      ::close(in[1]);
      ::close(out[0]);
      ::execl(IDEM_LOCAL_TIER_PEER, IDEM_LOCAL_TIER_PEER, url.c_str(), prefix.c_str(),
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    to_ = ::fdopen(in[1], "w");
    from_ = ::fdopen(out[0], "r");
  }
  ~Peer() {
    std::fclose(to_);  // EOF: the peer exits
    std::fclose(from_);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;
  // One command line; its one-line answer.
  std::string ask(const std::string& line) {
    std::fprintf(to_, "%s\n", line.c_str());
    std::fflush(to_);
    char buf[4096];
    if (std::fgets(buf, sizeof buf, from_) == nullptr) return "<peer gone>";
    std::string s(buf);
    if (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }

 private:
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
};

TEST_F(LocalTierTest, TwoProcessesDeleteFillAndReleaseReachTheOthersTier) {
  RedisStoreOptions o{url_};
  o.key_prefix = prefix_;
  RedisStore here(o);
  Peer peer(url_, prefix_);
  ASSERT_EQ("ok", peer.ask("wait_tracking"));
  idem::test::RawRedis raw(url_);

  // Completed here, replayed there from its tier (no command sent).
  const Key k = key("shared");
  complete(here, k, "fp", "v1");
  ASSERT_EQ("ok", peer.ask("warm " + k.id() + " fp 2"));
  EXPECT_EQ("done v1 local", peer.ask("claim " + k.id() + " fp"));

  // An operator delete (redis-cli DEL): the peer drops the entry, then asks Redis.
  ASSERT_EQ(1, raw.integer({"DEL", here.redis_key(k)}));
  ASSERT_EQ("ok", peer.ask("wait_gone " + k.id()));
  EXPECT_EQ("claimed remote", peer.ask("claim " + k.id() + " fp"));

  // A fill here (the durable store's answer written back) replaces the record there.
  const Key f = key("filled");
  complete(here, f, "fp", "old");
  ASSERT_EQ("ok", peer.ask("warm " + f.id() + " fp 6"));
  here.fill(f, "fp", "new", 60s);
  ASSERT_EQ("ok", peer.ask("wait_gone " + f.id()));
  EXPECT_EQ("done new remote", peer.ask("claim " + f.id() + " fp"));

  // A release here of an in-progress record: the peer saw it busy (never kept), then claims.
  const Key r = key("released");
  OwnerToken owner = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, here.claim(r, "fp", owner, 10000ms).status);
  EXPECT_EQ("busy remote", peer.ask("claim " + r.id() + " fp"));
  ASSERT_TRUE(here.release(r, owner));
  EXPECT_EQ("claimed remote", peer.ask("claim " + r.id() + " fp"));

  // FLUSHDB-like events are covered by the fault tests; the peer saw invalidations.
  EXPECT_NE("invalidations 0", peer.ask("invalidations"));
}

// 64 threads through the guard on 4 hot keys, every fourth handler call failing (the guard
// releases the claim, a later call runs again): each key's successful effect happens once,
// every later call replays it (mostly from the tier), and no call sees another key's value.
TEST_F(LocalTierTest, ConcurrentSixtyFourThreadsHotKeysWithReleasesExactlyOnce) {
  RedisStore s(options());
  wait_tracking(s);
  idem::IdempotencyGuard guard{s};
  constexpr int kThreads = 64, kKeys = 4, kCalls = 200;
  std::atomic<int> effects[kKeys] = {};
  std::atomic<int> attempts[kKeys] = {};
  std::atomic<int> wrong{0}, other{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kCalls; ++i) {
        const int n = (t + i) % kKeys;
        const std::string expected = "effect_" + std::to_string(n);
        try {
          auto r = guard.run(key("c" + std::to_string(n)), "fp", [&]() -> std::string {
            if (attempts[n]++ % 4 != 3) throw std::runtime_error("handler failed");
            ++effects[n];
            return expected;
          });
          if (r.ok()) {
            if (*r.value != expected) ++wrong;
          } else if (r.outcome != idem::Outcome::kInProgress) {
            ++other;
          }
        } catch (const std::runtime_error&) {
          // This call's handler failed: the guard released the claim.
        }
      }
    });
  }
  go = true;
  for (auto& th : threads) th.join();
  for (int n = 0; n < kKeys; ++n) EXPECT_EQ(1, effects[n].load()) << "key " << n;
  EXPECT_EQ(0, wrong.load());
  EXPECT_EQ(0, other.load());
  EXPECT_GT(s.local_tier_stats().hits, 0U);
}

// Readers look up (and so fill the tier with) the key a writer is working on, while the writer
// completes it and then deletes it, key after key: a read answered before the delete whose fill
// comes after the delete's invalidation must not be kept (its ticket is stale), or the deleted
// record would be served forever (no later write would remove it). At the end every key is
// deleted, so nothing may stay in the tier.
TEST_F(LocalTierTest, ConcurrentFillsRacingDeletesNeverKeepAStaleRecord) {
  RedisStore s(options(100000, 64 << 20));
  wait_tracking(s);
  RedisStoreOptions wo{url_};
  wo.key_prefix = prefix_;
  RedisStore writer(wo);
  idem::test::RawRedis raw(url_);
  constexpr int kKeys = 300;
  std::vector<Key> keys;
  for (int i = 0; i < kKeys; ++i) keys.push_back(key("race" + std::to_string(i)));
  std::atomic<int> current{0};
  std::atomic<bool> stop{false};
  std::atomic<long> found{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 16; ++t) {
    readers.emplace_back([&] {
      while (!stop.load()) {
        if (s.lookup(keys[static_cast<std::size_t>(current.load())])) ++found;
      }
    });
  }
  for (int i = 0; i < kKeys; ++i) {
    current = i;
    complete(writer, keys[static_cast<std::size_t>(i)], "fp", "v" + std::to_string(i));
    std::this_thread::sleep_for(200us);  // the readers find it, and keep it
    ASSERT_EQ(1, raw.integer({"DEL", s.redis_key(keys[static_cast<std::size_t>(i)])}));
  }
  stop = true;
  for (auto& th : readers) th.join();
  EXPECT_GT(found.load(), 0);
  EXPECT_GT(s.local_tier_stats().fills, 0U);
  // Every delete's invalidation arrives; then nothing is kept, nothing is found.
  ASSERT_TRUE(eventually([&] { return s.local_tier_stats().invalidations >= 3U * kKeys; }));
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(0U, s.local_tier_stats().entries) << "a deleted record stayed in the tier";
  int stale = 0;
  for (const Key& k : keys) stale += s.lookup(k).has_value() ? 1 : 0;
  EXPECT_EQ(0, stale);
}

}  // namespace
