// SPDX-License-Identifier: MIT
// Faults of the local tier's invalidation connection (serial: they disturb every tracking
// client of the shared server): CLIENT KILL TYPE pubsub drops the tier until tracking is back,
// a flush-all message (FLUSHDB of another db) drops it, and a user whose ACL refuses CLIENT
// gets the ttl_when_untracked bound, logged once.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "idem/errors.hpp"
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

class LocalTierFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(url_, "IDEM_TEST_REDIS_URL");
    prefix_ = idem::test::unique_name("idemltf") + ":";
  }
  RedisStoreOptions options(const std::string& url) const {
    RedisStoreOptions o{url};
    o.auto_pipeline = true;  // pipelined_commands counts every command sent
    o.key_prefix = prefix_;
    o.local_tier.enabled = true;
    return o;
  }
  static void complete(RedisStore& s, const Key& k, const std::string& response) {
    ASSERT_TRUE(idem::test::complete_first(s, k, "fp", response));
  }
  static bool warm(RedisStore& s, const Key& k) { return idem::test::warm(s, k, "fp"); }
  std::string url_, prefix_;
};

TEST_F(LocalTierFaultTest, KilledInvalidationConnectionDropsTheTierUntilTrackingIsBack) {
  RedisStore s(options(url_));
  ASSERT_TRUE(eventually([&] { return s.local_tier_stats().tracking; }));
  const Key k = Key::make("tier", "killed");
  complete(s, k, "v1");
  ASSERT_TRUE(warm(s, k));
  const auto before = s.local_tier_stats();
  idem::test::RawRedis raw(url_);
  ASSERT_GE(raw.integer({"CLIENT", "KILL", "TYPE", "pubsub"}), 1);
  // Deleted while no invalidation can arrive: the drop, not a message, keeps this correct.
  ASSERT_EQ(1, raw.integer({"DEL", s.redis_key(k)}));
  ASSERT_TRUE(eventually([&] { return s.local_tier_stats().drops > before.drops; }));
  EXPECT_EQ(0U, s.local_tier_stats().entries);
  EXPECT_EQ(ClaimStatus::kClaimed, s.claim(k, "fp", OwnerToken::generate(), 5000ms).status);
  // Tracking comes back on a new connection, and the tier serves again.
  ASSERT_TRUE(eventually([&] {
    auto st = s.local_tier_stats();
    return st.tracking && st.tracking_starts > before.tracking_starts;
  }));
  const Key k2 = Key::make("tier", "after_kill");
  complete(s, k2, "v2");
  ASSERT_TRUE(warm(s, k2));
  raw.integer({"DEL", s.redis_key(k2)});
  ASSERT_TRUE(eventually([&] { return s.local_tier_stats().entries == 0; }));
  EXPECT_EQ(ClaimStatus::kClaimed, s.claim(k2, "fp", OwnerToken::generate(), 5000ms).status);
}

TEST_F(LocalTierFaultTest, FlushAllMessageDropsTheWholeTier) {
  RedisStore s(options(url_));
  ASSERT_TRUE(eventually([&] { return s.local_tier_stats().tracking; }));
  std::vector<Key> keys;
  for (int i = 0; i < 3; ++i) {
    keys.push_back(Key::make("tier", "flush" + std::to_string(i)));
    complete(s, keys.back(), "v");
  }
  // The invalidation of a key's own completion can arrive after the read that warmed it (the
  // claim's read made Redis track the key) and evict it: warm all three until the tier holds
  // them together.
  ASSERT_TRUE(eventually([&] {
    for (const Key& k : keys) {
      if (!warm(s, k)) return false;
    }
    return s.local_tier_stats().entries == 3U;
  }));
  const auto before = s.local_tier_stats();
  ASSERT_EQ(3U, before.entries);
  // FLUSHDB of another (empty) db: Redis tells every tracking client "everything changed".
  idem::test::RawRedis raw(url_);
  ASSERT_EQ("OK", raw.text({"SELECT", "13"}));
  ASSERT_EQ("OK", raw.text({"FLUSHDB"}));
  ASSERT_TRUE(eventually([&] { return s.local_tier_stats().drops > before.drops; }));
  EXPECT_EQ(0U, s.local_tier_stats().entries);
  EXPECT_TRUE(s.local_tier_stats().tracking);  // the connection itself is fine
}

TEST_F(LocalTierFaultTest, RefusedTrackingFallsBackToTheShortTtlLoggedOnce) {
  idem::test::RawRedis raw(url_);
  const std::string user = "idem_lt_noclient";
  ASSERT_EQ("OK", raw.text({"ACL", "SETUSER", user, "reset", "on", ">pw", "~*", "&*", "+@all",
                            "-client"}));
  auto ep = idem::redis::detail::parse_uri(url_);
  const std::string url = "redis://" + user + ":pw@" + ep.host + ":" + std::to_string(ep.port);
  std::mutex mutex;
  std::vector<std::string> lines;
  RedisStoreOptions o = options(url);
  o.local_tier.ttl_when_untracked = 300ms;
  o.local_tier.log = [&](idem::LogLevel level, std::string_view line) {
    std::lock_guard<std::mutex> lock(mutex);
    lines.push_back(std::string(idem::log_level_name(level)) + " " + std::string(line));
  };
  {
    RedisStore s(o);
    ASSERT_TRUE(eventually([&] { return s.local_tier_stats().untracked; }));
    const Key k = Key::make("tier", "untracked");
    complete(s, k, "v1");
    ASSERT_TRUE(warm(s, k));
    EXPECT_FALSE(s.local_tier_stats().tracking);
    // Nobody tells this process about the delete: the TTL bound does. Every claim that still
    // found the entry (answered from it: done) must have started within the bound of the
    // delete. A claim starts no later than it looks, so a stall of a loaded machine cannot fail
    // this check; an entry kept past the bound is still seen by a claim started after it.
    const auto deleted_at = std::chrono::steady_clock::now();
    ASSERT_EQ(1, raw.integer({"DEL", s.redis_key(k)}));
    auto last_stale = deleted_at;
    bool claimed = false;
    for (const auto until = deleted_at + 10s;
         !claimed && std::chrono::steady_clock::now() < until;) {
      const auto started = std::chrono::steady_clock::now();
      const auto c = s.claim(k, "fp", OwnerToken::generate(), 5000ms);
      claimed = c.status == ClaimStatus::kClaimed;
      if (!claimed) {
        ASSERT_EQ(ClaimStatus::kDone, c.status);
        last_stale = started;
        std::this_thread::sleep_for(5ms);
      }
    }
    ASSERT_TRUE(claimed);
    EXPECT_LE(last_stale - deleted_at, 300ms + 200ms);
  }
  raw.integer({"ACL", "DELUSER", user});
  std::lock_guard<std::mutex> lock(mutex);
  ASSERT_EQ(1U, lines.size());
  EXPECT_NE(std::string::npos, lines[0].find("warn idem redis local tier untracked"));
  EXPECT_NE(std::string::npos, lines[0].find("ttl_ms=300"));
}

// kill -9 of redis-server and a restart (scripts/servers.sh; the records are gone with it): the
// tier is dropped when its connection ends, so the restarted, empty server decides, and
// tracking comes back with the server.
TEST_F(LocalTierFaultTest, ServerKilledAndRestartedDropsTheTierAndTrackingComesBack) {
  const std::string script = idem::test::server_env("IDEM_SERVERS_SCRIPT");
  ASSERT_FALSE(script.empty()) << "IDEM_SERVERS_SCRIPT is not set (eval scripts/servers.sh env)";
  auto servers = [&](const std::string& what) {
    const std::string cmd = "\"" + script + "\" " + what + " >/dev/null 2>&1";
    return std::system(cmd.c_str());
  };
  RedisStoreOptions o = options(url_);
  o.connect_timeout = 300ms;
  o.command_timeout = 300ms;
  RedisStore s(o);
  ASSERT_TRUE(eventually([&] { return s.local_tier_stats().tracking; }));
  const Key k = Key::make("tier", "restart");
  complete(s, k, "v1");
  ASSERT_TRUE(warm(s, k));
  const auto before = s.local_tier_stats();
  ASSERT_EQ(0, servers("redis-kill"));
  ASSERT_TRUE(eventually([&] { return s.local_tier_stats().drops > before.drops; }));
  EXPECT_EQ(0U, s.local_tier_stats().entries);
  EXPECT_FALSE(s.local_tier_stats().tracking);
  // While the server is down the tier answers nothing: calls fail typed, as without it.
  EXPECT_THROW(s.claim(k, "fp", OwnerToken::generate(), 5000ms), idem::StorageUnavailable);
  ASSERT_EQ(0, servers("redis-start"));
  ASSERT_TRUE(eventually([&] { return s.local_tier_stats().tracking; }));
  // The restarted server has no record: a fresh claim, not the old replay.
  ClaimStatus status = ClaimStatus::kDone;
  ASSERT_TRUE(eventually([&] {
    try {
      status = s.claim(k, "fp", OwnerToken::generate(), 5000ms).status;
      return true;
    } catch (const idem::StorageError&) {
      return false;  // the pool's reconnect backoff
    }
  }));
  EXPECT_EQ(ClaimStatus::kClaimed, status);
}

}  // namespace
