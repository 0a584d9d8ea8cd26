// SPDX-License-Identifier: MIT
// RedisStore against the real redis-server of scripts/servers.sh: the shared FastStore
// conformance suite, the key layout and TTLs, foreign values, URIs, unreachable servers and an
// exhausted pool.
#include "idem/redis/redis_store.hpp"

#include <gtest/gtest.h>

#include <cctype>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "conformance/fast_store_conformance.hpp"
#include "idem/fingerprint.hpp"
#include "pool.hpp"
#include "raw_redis.hpp"
#include "support/test_env.hpp"

namespace {

using idem::ClaimStatus;
using idem::Key;
using idem::OwnerToken;
using idem::redis::RedisStore;
using idem::redis::RedisStoreOptions;
using namespace std::chrono_literals;

std::unique_ptr<idem::FastStore> make_redis(const std::string& url) {
  return std::make_unique<RedisStore>(RedisStoreOptions{url});
}

// The Lua claim that servers older than 7.0 get, run against this server.
std::unique_ptr<idem::FastStore> make_redis_script_claim(const std::string& url) {
  RedisStoreOptions o{url};
  o.claim_script = true;
  return std::make_unique<RedisStore>(o);
}

}  // namespace

IDEM_FAST_STORE_CONFORMANCE(Redis,
                            (FastStoreFactory{"redis", "IDEM_TEST_REDIS_URL", make_redis, false}),
                            (FastStoreFactory{"redis_script_claim", "IDEM_TEST_REDIS_URL",
                                              make_redis_script_claim, false}))

namespace {

class RedisStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(url_, "IDEM_TEST_REDIS_URL");
    store_ = std::make_unique<RedisStore>(RedisStoreOptions{url_});
    raw_ = std::make_unique<idem::test::RawRedis>(url_);
  }
  Key key() {
    return Key::make(
        "redis.test",
        idem::test::unique_name(::testing::UnitTest::GetInstance()->current_test_info()->name()));
  }
  std::string url_;
  std::unique_ptr<RedisStore> store_;
  std::unique_ptr<idem::test::RawRedis> raw_;
};

TEST_F(RedisStoreTest, KeyLayoutIsPrefixHashTagScopeBarId) {
  EXPECT_EQ("idem:{payment|order_1}", store_->redis_key(Key::make("payment", "order_1")));
  EXPECT_EQ("idem:{a:b|c}", store_->redis_key(Key::make("a:b", "c")));
  EXPECT_EQ("idem:{a|b:c}", store_->redis_key(Key::make("a", "b:c")));
  RedisStoreOptions o{url_};
  o.key_prefix = "svc1:idem:";
  RedisStore custom(o);
  EXPECT_EQ("svc1:idem:{payment|x}", custom.redis_key(Key::make("payment", "x")));
  o.key_prefix = "";
  RedisStore bare(o);
  EXPECT_EQ("{payment|x}", bare.redis_key(Key::make("payment", "x")));
  o.key_prefix = "bad{";
  EXPECT_THROW(RedisStore{o}, idem::UsageError);
}

// Options no deployment needs are configuration errors at construction: a huge wait made the
// pool's deadline overflow ("exhausted" after 0 ms, a retryable error per call), a huge
// connect timeout reached hiredis as an invalid one, a huge pool size threw std::length_error.
TEST_F(RedisStoreTest, OptionsBeyondTheirBoundsAreUsageErrors) {
  const auto huge = std::chrono::milliseconds::max();
  for (auto field : {&RedisStoreOptions::connect_timeout, &RedisStoreOptions::command_timeout,
                     &RedisStoreOptions::pool_wait_timeout, &RedisStoreOptions::reconnect_backoff,
                     &RedisStoreOptions::topology_refresh_interval,
                     &RedisStoreOptions::sentinel_check_interval}) {
    RedisStoreOptions o{url_};
    o.*field = huge;
    EXPECT_THROW(RedisStore{o}, idem::UsageError);
    o.*field = std::chrono::hours(24);  // the largest taken
    EXPECT_NO_THROW(RedisStore{o});
  }
  RedisStoreOptions o{url_};
  o.pool_size = static_cast<std::size_t>(-1);
  EXPECT_THROW(RedisStore{o}, idem::UsageError);
}

// A cluster or Sentinel URI naming a plain Redis (or nodes that are all down) fails typed, and
// the error says what the nodes answered, not only that no node serves the key.
TEST_F(RedisStoreTest, ScaleOutUrisNamingAPlainServerSayWhatItAnswered) {
  const std::string host_port = url_.substr(url_.find("://") + 3);
  RedisStoreOptions cluster{"redis-cluster://" + host_port};
  RedisStore as_cluster(cluster);
  try {
    (void)as_cluster.lookup(Key::make("payment", "x"));
    ADD_FAILURE() << "a plain server served as a cluster";
  } catch (const idem::StorageUnavailable& e) {
    EXPECT_NE(std::string(e.what()).find("cluster support disabled"), std::string::npos)
        << e.what();
  }
  RedisStoreOptions sentinel{"redis-sentinel://" + host_port + "/svc"};
  RedisStore as_sentinel(sentinel);
  try {
    (void)as_sentinel.lookup(Key::make("payment", "x"));
    ADD_FAILURE() << "a plain server served as a sentinel";
  } catch (const idem::StorageUnavailable& e) {
    EXPECT_NE(std::string(e.what()).find("(last: "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("SENTINEL"), std::string::npos) << e.what();
  }
}

TEST_F(RedisStoreTest, RecordLivesUnderItsKeyWithLeaseThenRetentionTtl) {
  auto k = key();
  auto rk = store_->redis_key(k);
  auto owner = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", owner, 20'000ms).status);
  EXPECT_EQ("string", raw_->text({"TYPE", rk}));
  long long lease_ttl = raw_->integer({"PTTL", rk});
  EXPECT_GT(lease_ttl, 10'000);
  EXPECT_LE(lease_ttl, 20'000);
  auto rec = store_->lookup(k);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kInProgress, rec->status);
  EXPECT_EQ(owner.str(), rec->owner);
  EXPECT_EQ("fp", rec->fingerprint);
  EXPECT_GT(rec->lease_until, idem::system_now());

  ASSERT_TRUE(store_->complete(k, owner, "pay_1", std::chrono::seconds(3600)));
  long long retention_ttl = raw_->integer({"PTTL", rk});
  EXPECT_GT(retention_ttl, 3'000'000);
  EXPECT_LE(retention_ttl, 3'600'000);
  rec = store_->lookup(k);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
  EXPECT_EQ("pay_1", rec->response);
  EXPECT_GT(rec->expires_at, idem::system_now() + std::chrono::seconds(3000));
}

// Owner tokens were 32 hex characters before they became OwnerToken::kLength base64url
// characters; records are length-prefixed, so records holding the longer tokens stay valid.
TEST_F(RedisStoreTest, RecordsWithThirtyTwoCharacterOwnersStayValid) {
  const std::string old_owner = "0123456789abcdef0123456789abcdef";
  const long long now = idem::to_millis(idem::system_now());
  const std::string head = std::to_string(now) + ":" + std::to_string(now + 60'000) + ":2:fp";
  // In progress, held by an attempt with an old token: busy for others, completable by it.
  auto held = key();
  raw_->cmd({"SET", store_->redis_key(held), "I1P32:" + old_owner + head, "PX", "60000"});
  auto busy = store_->claim(held, "fp", OwnerToken::generate(), 30'000ms);
  EXPECT_EQ(ClaimStatus::kBusy, busy.status);
  EXPECT_EQ(old_owner, busy.holder);
  EXPECT_TRUE(store_->complete(held, OwnerToken::from_string(old_owner), "pay_7",
                               std::chrono::seconds(3600)));
  auto replay = store_->claim(held, "fp", OwnerToken::generate(), 30'000ms);
  EXPECT_EQ(ClaimStatus::kDone, replay.status);
  EXPECT_EQ("pay_7", replay.response);
  EXPECT_EQ(old_owner, replay.holder);
  // Completed with an old token: replays.
  auto done = key();
  raw_->cmd({"SET", store_->redis_key(done), "I1C32:" + old_owner + head + "pay_8", "PX", "60000"});
  auto again = store_->claim(done, "fp", OwnerToken::generate(), 30'000ms);
  EXPECT_EQ(ClaimStatus::kDone, again.status);
  EXPECT_EQ("pay_8", again.response);
}

// Format 1 (records written before schema 2: decimal lengths and times, the fingerprint as its
// 64 hex characters, the owner kept in completed records): read, completed and released in
// their own format by this version, as they were written by the previous one.
TEST_F(RedisStoreTest, FormatOneRecordsStayReadableAndCompletable) {
  const std::string fp = idem::fingerprint("amount=10");
  const std::string old_owner = OwnerToken::generate().str();
  const long long now = idem::to_millis(idem::system_now());
  const std::string head = "I1P" + std::to_string(old_owner.size()) + ":" + old_owner +
                           std::to_string(now) + ":" + std::to_string(now + 60'000) + ":64:" + fp;
  RedisStore other(RedisStoreOptions{url_});  // no claim of its own in memory: the scripts
  auto held = key();
  const std::string rk = store_->redis_key(held);
  raw_->cmd({"SET", rk, head, "PX", "60000"});
  auto busy = store_->claim(held, fp, OwnerToken::generate(), 30'000ms);
  EXPECT_EQ(ClaimStatus::kBusy, busy.status);
  EXPECT_EQ(old_owner, busy.holder);
  EXPECT_EQ(now, idem::to_millis(busy.first_seen));
  EXPECT_EQ(
      ClaimStatus::kMismatch,
      store_->claim(held, idem::fingerprint("amount=11"), OwnerToken::generate(), 30'000ms).status);
  auto rec = other.lookup(held);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kInProgress, rec->status);
  EXPECT_EQ(fp, rec->fingerprint);
  EXPECT_EQ(old_owner, rec->owner);
  // Another owner can neither complete nor release it; its own owner completes it.
  EXPECT_FALSE(other.complete(held, OwnerToken::generate(), "x", std::chrono::seconds(60)));
  EXPECT_FALSE(other.release(held, OwnerToken::generate()));
  ASSERT_TRUE(other.complete(held, OwnerToken::from_string(old_owner), "pay_9",
                             std::chrono::seconds(3600)));
  const std::string completed = raw_->text({"GET", rk});
  EXPECT_EQ("I1C", completed.substr(0, 3));
  EXPECT_GT(raw_->integer({"PTTL", rk}), 3'000'000);
  auto replay = store_->claim(held, fp, OwnerToken::generate(), 30'000ms);
  EXPECT_EQ(ClaimStatus::kDone, replay.status);
  EXPECT_EQ("pay_9", replay.response);
  EXPECT_EQ(old_owner, replay.holder);
  EXPECT_EQ(now, idem::to_millis(replay.first_seen));
  // Released by its owner; failed by its owner.
  auto released = key();
  raw_->cmd({"SET", store_->redis_key(released), head, "PX", "60000"});
  EXPECT_TRUE(other.release(released, OwnerToken::from_string(old_owner)));
  EXPECT_EQ(ClaimStatus::kClaimed,
            store_->claim(released, fp, OwnerToken::generate(), 30'000ms).status);
  auto failed = key();
  raw_->cmd({"SET", store_->redis_key(failed), head, "PX", "60000"});
  EXPECT_TRUE(
      other.fail(failed, OwnerToken::from_string(old_owner), "dead", std::chrono::seconds(60)));
  auto f = store_->claim(failed, fp, OwnerToken::generate(), 30'000ms);
  EXPECT_EQ(ClaimStatus::kDone, f.status);
  EXPECT_TRUE(f.failed);
  EXPECT_EQ("dead", f.response);
  // A claim of this version over a format-1 record it replaced on its claiming thread (lease
  // lost): the format-1 record is put back with its own deadline.
  auto stale_key = key();
  auto stale = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(stale_key, fp, stale, 30'000ms).status);
  const std::string srk = store_->redis_key(stale_key);
  const std::string foreign_claim = "I1P" + std::to_string(old_owner.size()) + ":" + old_owner +
                                    std::to_string(now) + ":" + std::to_string(now + 50'000) +
                                    ":64:" + fp;
  raw_->cmd({"SET", srk, foreign_claim, "PX", "50000"});
  EXPECT_FALSE(store_->complete(stale_key, stale, "stale", std::chrono::seconds(3600)));
  EXPECT_EQ(foreign_claim, raw_->text({"GET", srk}));
  EXPECT_LE(raw_->integer({"PTTL", srk}), 50'000);
}

// Format 2: one tag byte, binary times, the 64-hex fingerprint packed into 32 bytes, the
// generated owner token packed into 12 bytes while in progress and dropped once completed. A
// completed record with an empty response is 40 bytes (an embedded string in Redis) and costs
// at most 150 bytes of MEMORY USAGE with a key of ~40 bytes (136 on Redis 7.0; the layout
// docs/redis.md and bench/redis measure).
TEST_F(RedisStoreTest, CompletedRecordIsCompact) {
  // "idem:{payment|order_<19 characters>}": 40 bytes.
  auto forty_byte_key = [](const std::string& tag) {
    std::string id = idem::test::unique_name(tag);
    id = id.size() >= 19 ? id.substr(id.size() - 19) : std::string(19 - id.size(), 'x') + id;
    return Key::make("payment", "order_" + id);
  };
  auto k = forty_byte_key("m");
  const std::string rk = store_->redis_key(k);
  ASSERT_EQ(40u, rk.size());
  const std::string fp = idem::fingerprint("amount=10&currency=EUR");
  auto owner = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, fp, owner, 30'000ms).status);
  const std::string claim = raw_->text({"GET", rk});
  EXPECT_EQ(1u + 12 + 12 + 33, claim.size());  // tag, owner, created, deadline, fingerprint
  EXPECT_EQ('\xA9', claim[0]);
  ASSERT_TRUE(store_->complete(k, owner, "", std::chrono::seconds(3600)));
  const std::string done = raw_->text({"GET", rk});
  EXPECT_EQ(40u, done.size());  // tag, created, fingerprint
  EXPECT_EQ('\xA2', done[0]);
  EXPECT_EQ(claim.substr(13, 6) + claim.substr(25), done.substr(1));
  const long long bytes = raw_->integer({"MEMORY", "USAGE", rk, "SAMPLES", "0"});
  RecordProperty("memory_usage_bytes", std::to_string(bytes));
  EXPECT_LE(bytes, 150) << "MEMORY USAGE of a completed record with an empty response";
  auto replay = store_->claim(k, fp, OwnerToken::generate(), 30'000ms);
  EXPECT_EQ(ClaimStatus::kDone, replay.status);
  EXPECT_TRUE(replay.response.empty());
  EXPECT_TRUE(replay.holder.empty());  // completed records keep no owner token
  EXPECT_EQ(idem::to_millis(store_->lookup(k)->created_at), idem::to_millis(replay.first_seen));
  auto rec = store_->lookup(k);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(fp, rec->fingerprint);
  EXPECT_GT(rec->expires_at, idem::system_now() + std::chrono::seconds(3000));
  // The general script writes the same layout (no claim of its own in memory).
  RedisStore other(RedisStoreOptions{url_});
  auto k2 = key();
  auto owner2 = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k2, fp, owner2, 30'000ms).status);
  ASSERT_TRUE(other.complete(k2, owner2, "", std::chrono::seconds(3600)));
  const std::string done2 = raw_->text({"GET", store_->redis_key(k2)});
  EXPECT_EQ(40u, done2.size());
  EXPECT_EQ('\xA2', done2[0]);
  // So does fill.
  auto k3 = forty_byte_key("f");
  store_->fill(k3, fp, "", std::chrono::seconds(3600));
  EXPECT_EQ(40u, raw_->text({"GET", store_->redis_key(k3)}).size());
  EXPECT_LE(raw_->integer({"MEMORY", "USAGE", store_->redis_key(k3), "SAMPLES", "0"}), 150);
}

// Owner tokens that do not pack (not 15 base64url characters) are stored as given; every one
// holds, completes and releases its own claim only.
TEST_F(RedisStoreTest, AnyOwnerTokenHoldsItsClaim) {
  const std::string token = OwnerToken::generate().str();
  for (const std::string& o :
       {token, std::string("AAAAAAAAAAAAAAA"), std::string("_______________"), token.substr(1),
        token + "A", std::string("abcdefghijklmn!"), std::string(32, 'f'), std::string(255, 'x'),
        std::string("a\0b", 3)}) {
    SCOPED_TRACE(o);
    const OwnerToken owner = OwnerToken::from_string(o);
    for (int path = 0; path < 3; ++path) {  // native complete, general complete, release
      auto k = key();
      ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", owner, 30'000ms).status);
      auto busy = store_->claim(k, "fp", OwnerToken::generate(), 30'000ms);
      EXPECT_EQ(ClaimStatus::kBusy, busy.status);
      EXPECT_EQ(o, busy.holder);
      EXPECT_EQ(o, store_->lookup(k)->owner);
      RedisStore other(RedisStoreOptions{url_});
      EXPECT_FALSE(other.release(k, OwnerToken::generate()));
      if (path == 2) {
        EXPECT_TRUE(other.release(k, owner));
        EXPECT_FALSE(store_->lookup(k).has_value());
        continue;
      }
      ASSERT_TRUE((path == 0 ? *store_ : other).complete(k, owner, "r", std::chrono::seconds(60)));
      EXPECT_EQ("r", store_->claim(k, "fp", OwnerToken::generate(), 30'000ms).response);
    }
  }
  EXPECT_THROW(store_->claim(key(), "fp", OwnerToken::from_string(std::string(256, 'x')), 30'000ms),
               idem::UsageError);
}

// Fingerprints that do not pack (not 64 lowercase hex characters) are stored as given.
TEST_F(RedisStoreTest, AnyFingerprintRoundTrips) {
  const std::string hex = idem::fingerprint("x");
  std::string upper = hex;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (const std::string& fp : {std::string(), std::string("fp"), upper, hex.substr(1), hex + "0",
                                std::string(300, 'z'), std::string("a\0b\xff", 4)}) {
    SCOPED_TRACE(fp.size());
    for (bool general : {false, true}) {
      auto k = key();
      auto owner = OwnerToken::generate();
      ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, fp, owner, 30'000ms).status);
      EXPECT_EQ(fp, store_->lookup(k)->fingerprint);
      EXPECT_EQ(ClaimStatus::kBusy, store_->claim(k, fp, OwnerToken::generate(), 30'000ms).status);
      RedisStore other(RedisStoreOptions{url_});
      ASSERT_TRUE((general ? other : *store_).complete(k, owner, "r", std::chrono::seconds(60)));
      auto done = store_->claim(k, fp, OwnerToken::generate(), 30'000ms);
      EXPECT_EQ(ClaimStatus::kDone, done.status);
      EXPECT_EQ("r", done.response);
      EXPECT_EQ(fp, store_->lookup(k)->fingerprint);
      EXPECT_EQ(ClaimStatus::kMismatch,
                store_->claim(k, fp + "!", OwnerToken::generate(), 30'000ms).status);
    }
  }
}

TEST_F(RedisStoreTest, EveryClaimAnswerCarriesHolderAndFirstSeen) {
  auto k = key();
  auto a = OwnerToken::generate();
  auto before = idem::system_now();
  auto first = store_->claim(k, "fp", a, 30'000ms);
  ASSERT_EQ(ClaimStatus::kClaimed, first.status);
  EXPECT_FALSE(first.took_over);

  auto busy = store_->claim(k, "fp", OwnerToken::generate(), 30'000ms);
  EXPECT_EQ(ClaimStatus::kBusy, busy.status);
  EXPECT_EQ(a.str(), busy.holder);
  EXPECT_GE(busy.first_seen, before);
  EXPECT_TRUE(busy.response.empty());

  // A mismatch wins over busy...
  auto mismatch = store_->claim(k, "other", OwnerToken::generate(), 30'000ms);
  EXPECT_EQ(ClaimStatus::kMismatch, mismatch.status);
  EXPECT_EQ(a.str(), mismatch.holder);
  EXPECT_EQ(busy.first_seen, mismatch.first_seen);

  ASSERT_TRUE(store_->complete(k, a, "resp", std::chrono::seconds(60)));
  auto done = store_->claim(k, "fp", OwnerToken::generate(), 30'000ms);
  EXPECT_EQ(ClaimStatus::kDone, done.status);
  EXPECT_EQ("resp", done.response);
  EXPECT_TRUE(done.holder.empty());  // a completed record keeps no owner token
  EXPECT_EQ(busy.first_seen, done.first_seen);
  EXPECT_FALSE(done.failed);

  // ...and over done.
  EXPECT_EQ(ClaimStatus::kMismatch,
            store_->claim(k, "other", OwnerToken::generate(), 30'000ms).status);
  // An empty fingerprint is a fingerprint like any other.
  EXPECT_EQ(ClaimStatus::kMismatch, store_->claim(k, "", OwnerToken::generate(), 30'000ms).status);
}

TEST_F(RedisStoreTest, CompleteOfACompletedRecordIsRefused) {
  auto k = key();
  auto a = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", a, 30'000ms).status);
  ASSERT_TRUE(store_->complete(k, a, "first", std::chrono::seconds(60)));
  EXPECT_FALSE(store_->complete(k, a, "second", std::chrono::seconds(60)));
  EXPECT_FALSE(store_->release(k, a));
  EXPECT_EQ("first", store_->claim(k, "fp", a, 30'000ms).response);
}

// complete() on the claiming thread replaces the record in one write and, when the record is
// not its claim any more, puts the other record back as it was (value and deadline).
TEST_F(RedisStoreTest, StaleOwnerOnItsClaimingThreadLeavesTheNewClaimIntact) {
  auto k = key();
  auto rk = store_->redis_key(k);
  auto stale = OwnerToken::generate();
  auto stale_claim = store_->claim(k, "fp", stale, 150ms);
  ASSERT_EQ(ClaimStatus::kClaimed, stale_claim.status);
  std::this_thread::sleep_for(400ms);
  auto fresh = OwnerToken::generate();
  std::string fresh_record;
  std::thread other(
      [&] { ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", fresh, 30'000ms).status); });
  other.join();
  fresh_record = raw_->text({"GET", rk});
  EXPECT_FALSE(
      store_->complete_claimed(k, stale, stale_claim.ticket, "stale", std::chrono::seconds(3600)));
  EXPECT_EQ(fresh_record, raw_->text({"GET", rk}));
  long long ttl = raw_->integer({"PTTL", rk});
  EXPECT_GT(ttl, 20'000);
  EXPECT_LE(ttl, 30'000);
  std::thread finish(
      [&] { EXPECT_TRUE(store_->complete(k, fresh, "fresh", std::chrono::seconds(60))); });
  finish.join();
  auto r = store_->claim(k, "fp", OwnerToken::generate(), 30'000ms);
  EXPECT_EQ(ClaimStatus::kDone, r.status);
  EXPECT_EQ("fresh", r.response);
}

// Within the lease margin (native_complete_fraction of the lease since the claim was sent),
// complete is one native SET ... XX (no script): the store's counter and the server's
// commandstats both show it.
TEST_F(RedisStoreTest, CompleteWithinTheLeaseMarginIsOneNativeSet) {
  auto k = key();
  auto a = OwnerToken::generate();
  const auto before = store_->command_stats();
  auto claimed = store_->claim(k, "fp", a, 30'000ms);
  ASSERT_EQ(ClaimStatus::kClaimed, claimed.status);
  EXPECT_TRUE(claimed.ticket);
  EXPECT_TRUE(store_->complete_claimed(k, a, claimed.ticket, "paid", std::chrono::seconds(600)));
  const auto after = store_->command_stats();
  EXPECT_EQ(before.native_completes + 1, after.native_completes);
  EXPECT_EQ(before.script_completes, after.script_completes);
  // The record written is the full completed record, with the retention as its TTL.
  auto r = store_->claim(k, "fp", OwnerToken::generate(), 30'000ms);
  EXPECT_EQ(ClaimStatus::kDone, r.status);
  EXPECT_EQ("paid", r.response);
  long long ttl = raw_->integer({"PTTL", store_->redis_key(k)});
  EXPECT_GT(ttl, 500'000);
  EXPECT_LE(ttl, 600'000);
}

// What passes from claim to complete is the claim's ticket, not the claiming thread: a claim
// made on one thread is completed natively on another; complete() without the ticket takes
// the owner-checked script; a ticket of another key or owner is not used (script, refused).
TEST_F(RedisStoreTest, ATicketCompletesNativelyOnAnotherThreadAndOnlyForItsOwnClaim) {
  auto k = key();
  auto a = OwnerToken::generate();
  const auto before = store_->command_stats();
  idem::ClaimResult claimed;
  std::thread claimer([&] { claimed = store_->claim(k, "fp", a, 30'000ms); });
  claimer.join();
  ASSERT_EQ(ClaimStatus::kClaimed, claimed.status);
  bool completed = false;
  std::thread completer([&] {
    completed = store_->complete_claimed(k, a, claimed.ticket, "paid", std::chrono::seconds(60));
  });
  completer.join();
  EXPECT_TRUE(completed);
  EXPECT_EQ(before.native_completes + 1, store_->command_stats().native_completes);
  EXPECT_EQ(before.script_completes, store_->command_stats().script_completes);
  EXPECT_EQ("paid", store_->claim(k, "fp", OwnerToken::generate(), 30'000ms).response);

  auto k2 = key();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k2, "fp", a, 30'000ms).status);
  EXPECT_TRUE(store_->complete(k2, a, "scripted", std::chrono::seconds(60)));
  EXPECT_EQ(before.native_completes + 1, store_->command_stats().native_completes);
  EXPECT_EQ(before.script_completes + 1, store_->command_stats().script_completes);

  // k3 claimed by b: a's ticket of k (another key), or b's ticket with a's token, is not
  // used natively, and the owner check refuses a.
  auto k3 = key();
  auto b = OwnerToken::generate();
  auto b_claim = store_->claim(k3, "fp", b, 30'000ms);
  ASSERT_EQ(ClaimStatus::kClaimed, b_claim.status);
  EXPECT_FALSE(store_->complete_claimed(k3, a, claimed.ticket, "x", std::chrono::seconds(60)));
  EXPECT_FALSE(store_->complete_claimed(k3, a, b_claim.ticket, "x", std::chrono::seconds(60)));
  EXPECT_EQ(before.native_completes + 1, store_->command_stats().native_completes);
  EXPECT_EQ(idem::Record::Status::kInProgress, store_->lookup(k3)->status);
  EXPECT_TRUE(store_->complete_claimed(k3, b, b_claim.ticket, "b's", std::chrono::seconds(60)));
  EXPECT_EQ(before.native_completes + 2, store_->command_stats().native_completes);
}

// A native complete that finds another attempt's claim (its own was lost: FLUSHALL, eviction,
// an operator's release) puts that claim back for the longest it may have had left, not until
// the deadline the record keeps: a heartbeat extended only its time to live. The other attempt
// keeps its key (a third is refused) and completes.
TEST_F(RedisStoreTest, ANativeCompleteThatMeetsAnotherClaimPutsItBackUncut) {
  auto k = key();
  auto c = OwnerToken::generate();
  auto c_claim = store_->claim(k, "fp", c, 30'000ms);
  ASSERT_EQ(ClaimStatus::kClaimed, c_claim.status);
  raw_->cmd({"DEL", store_->redis_key(k)});  // c's claim lost
  auto d = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", d, 2'000ms).status);
  ASSERT_TRUE(store_->extend(k, d, 20'000ms));  // d's heartbeat
  const auto before = store_->command_stats();
  EXPECT_FALSE(store_->complete_claimed(k, c, c_claim.ticket, "c's", std::chrono::seconds(60)));
  EXPECT_EQ(before.native_completes + 1, store_->command_stats().native_completes);
  EXPECT_GT(raw_->integer({"PTTL", store_->redis_key(k)}), 19'000);
  std::this_thread::sleep_for(2'200ms);  // past the deadline d's record keeps
  EXPECT_EQ(ClaimStatus::kBusy, store_->claim(k, "fp", OwnerToken::generate(), 2'000ms).status);
  EXPECT_TRUE(store_->complete(k, d, "d's", std::chrono::seconds(60)));
  EXPECT_EQ("d's", store_->claim(k, "fp", OwnerToken::generate(), 2'000ms).response);
}

// Past the margin (here: fraction 0.5 of a 2 s lease, completed after 1.2 s, the lease still
// live), complete takes the owner-checked script, and still succeeds.
TEST_F(RedisStoreTest, CompletePastTheLeaseMarginTakesTheScript) {
  auto k = key();
  auto a = OwnerToken::generate();
  const auto before = store_->command_stats();
  auto claimed = store_->claim(k, "fp", a, 2'000ms);
  ASSERT_EQ(ClaimStatus::kClaimed, claimed.status);
  std::this_thread::sleep_for(1'200ms);
  EXPECT_TRUE(
      store_->complete_claimed(k, a, claimed.ticket, "late but live", std::chrono::seconds(60)));
  const auto after = store_->command_stats();
  EXPECT_EQ(before.native_completes, after.native_completes);
  EXPECT_EQ(before.script_completes + 1, after.script_completes);
  EXPECT_EQ("late but live", store_->claim(k, "fp", OwnerToken::generate(), 30'000ms).response);
}

// native_complete_fraction = 0 turns the native path off: every complete is a script.
TEST_F(RedisStoreTest, NativeCompleteCanBeTurnedOff) {
  RedisStoreOptions o{url_};
  o.native_complete_fraction = 0;
  RedisStore scripted(o);
  auto k = key();
  auto a = OwnerToken::generate();
  auto claimed = scripted.claim(k, "fp", a, 30'000ms);
  ASSERT_EQ(ClaimStatus::kClaimed, claimed.status);
  EXPECT_TRUE(scripted.complete_claimed(k, a, claimed.ticket, "r", std::chrono::seconds(60)));
  EXPECT_EQ(0u, scripted.command_stats().native_completes);
  EXPECT_EQ(1u, scripted.command_stats().script_completes);
  o.native_complete_fraction = 0.95;
  EXPECT_THROW(RedisStore{o}, idem::UsageError);
  o.native_complete_fraction = -0.1;
  EXPECT_THROW(RedisStore{o}, idem::UsageError);
}

// The stale owner's complete runs past its lease, so it takes the script (and is refused).
TEST_F(RedisStoreTest, StaleOwnersCompleteTakesTheScriptAndIsRefused) {
  auto k = key();
  auto stale = OwnerToken::generate();
  auto stale_claim = store_->claim(k, "fp", stale, 150ms);
  ASSERT_EQ(ClaimStatus::kClaimed, stale_claim.status);
  std::this_thread::sleep_for(400ms);
  auto fresh = OwnerToken::generate();
  std::thread other(
      [&] { ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", fresh, 30'000ms).status); });
  other.join();
  const auto before = store_->command_stats();
  EXPECT_FALSE(
      store_->complete_claimed(k, stale, stale_claim.ticket, "stale", std::chrono::seconds(60)));
  EXPECT_EQ(before.script_completes + 1, store_->command_stats().script_completes);
  EXPECT_EQ(before.native_completes, store_->command_stats().native_completes);
  auto rec = store_->lookup(k);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(fresh.str(), rec->owner);
}

// If the margin's assumption fails (here: a foreign writer replaces the claim within the
// margin), the native complete notices from the value SET ... GET returns, puts that value
// back for the longest it may have had left (here this claim's 30 s lease, over the other's
// 20 s: never shorter than its own), and answers "lease lost".
TEST_F(RedisStoreTest, NativeCompleteThatFindsAnotherRecordPutsItBack) {
  auto k = key();
  auto rk = store_->redis_key(k);
  auto a = OwnerToken::generate();
  auto claimed = store_->claim(k, "fp", a, 30'000ms);
  ASSERT_EQ(ClaimStatus::kClaimed, claimed.status);
  auto b = OwnerToken::generate();
  raw_->cmd({"DEL", rk});
  std::thread other(
      [&] { ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", b, 20'000ms).status); });
  other.join();
  const std::string b_record = raw_->text({"GET", rk});
  const auto before = store_->command_stats();
  EXPECT_FALSE(store_->complete_claimed(k, a, claimed.ticket, "mine", std::chrono::seconds(600)));
  EXPECT_EQ(before.native_completes + 1, store_->command_stats().native_completes);
  EXPECT_EQ(b_record, raw_->text({"GET", rk}));
  long long ttl = raw_->integer({"PTTL", rk});
  EXPECT_GT(ttl, 25'000);
  EXPECT_LE(ttl, 30'000);
}

// claim_batch and complete_batch are one pipeline each, and completes within the margin are
// native.
TEST_F(RedisStoreTest, BatchesArePipelinedAndCompletedNatively) {
  std::vector<Key> keys;
  std::vector<OwnerToken> owners;
  for (int i = 0; i < 20; ++i) {
    keys.push_back(Key::make("redis.test", idem::test::unique_name("pipelined")));
    owners.push_back(OwnerToken::generate());
  }
  std::vector<idem::ClaimRequest> claims;
  std::vector<idem::CompleteRequest> completes;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    claims.push_back({&keys[i], "fp", &owners[i]});
    completes.push_back({&keys[i], &owners[i], "done"});
  }
  const auto before = store_->command_stats();
  auto answers = store_->claim_batch(claims, 30'000ms);
  for (std::size_t i = 0; i < answers.size(); ++i) {
    EXPECT_EQ(ClaimStatus::kClaimed, answers[i].status);
    completes[i].ticket = &answers[i].ticket;
  }
  auto ok = store_->complete_batch(completes, std::chrono::seconds(60));
  EXPECT_EQ(std::vector<bool>(keys.size(), true), ok);
  const auto after = store_->command_stats();
  EXPECT_EQ(before.pipelined_claim_batches + 1, after.pipelined_claim_batches);
  EXPECT_EQ(before.pipelined_complete_batches + 1, after.pipelined_complete_batches);
  EXPECT_EQ(before.native_completes + keys.size(), after.native_completes);
  EXPECT_EQ(before.script_completes, after.script_completes);
  answers = store_->claim_batch(claims, 30'000ms);
  for (const auto& c : answers) {
    EXPECT_EQ(ClaimStatus::kDone, c.status);
    EXPECT_EQ("done", c.response);
  }
}

// A batch whose claims share one owner token (IdempotencyGuard::run_batch: the batch is one
// attempt) completes natively in any order, each key with its own record (its ticket); a late
// complete of a key already completed is refused.
TEST_F(RedisStoreTest, BatchSharingOneOwnerCompletesNativelyInAnyOrder) {
  std::vector<Key> keys;
  for (int i = 0; i < 12; ++i) {
    keys.push_back(Key::make("redis.test", idem::test::unique_name("shared_owner")));
  }
  const auto owner = OwnerToken::generate();
  std::vector<idem::ClaimRequest> claims;
  for (const auto& k : keys) claims.push_back({&k, "fp", &owner});
  const auto before = store_->command_stats();
  auto answers = store_->claim_batch(claims, 30'000ms);
  for (const auto& c : answers) EXPECT_EQ(ClaimStatus::kClaimed, c.status);
  std::vector<idem::CompleteRequest> completes;
  std::vector<std::string> responses;
  for (std::size_t i = 0; i < keys.size(); ++i) responses.push_back("r" + std::to_string(i));
  for (std::size_t i = keys.size(); i-- > 0;) {
    completes.push_back({&keys[i], &owner, responses[i], &answers[i].ticket});
  }
  EXPECT_EQ(std::vector<bool>(keys.size(), true),
            store_->complete_batch(completes, std::chrono::seconds(60)));
  EXPECT_EQ(before.native_completes + keys.size(), store_->command_stats().native_completes);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    auto c = store_->claim(keys[i], "fp", OwnerToken::generate(), 30'000ms);
    EXPECT_EQ(ClaimStatus::kDone, c.status);
    EXPECT_EQ(responses[i], c.response);
  }
  // The next batch: a late complete of an earlier key (completed already) is refused and
  // leaves its record as it is, with its ticket or without.
  std::vector<Key> more{Key::make("redis.test", idem::test::unique_name("shared_owner"))};
  std::vector<idem::ClaimRequest> next{{&more[0], "fp", &owner}};
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim_batch(next, 30'000ms)[0].status);
  const std::string record = raw_->text({"GET", store_->redis_key(keys[0])});
  EXPECT_EQ(std::vector<bool>{false},
            store_->complete_batch({{&keys[0], &owner, "late"}}, std::chrono::seconds(60)));
  EXPECT_EQ(std::vector<bool>{false},
            store_->complete_batch({{&keys[0], &owner, "late", &answers[0].ticket}},
                                   std::chrono::seconds(60)));
  EXPECT_EQ(record, raw_->text({"GET", store_->redis_key(keys[0])}));
  EXPECT_EQ(std::vector<bool>{true},
            store_->complete_batch({{&more[0], &owner, "next"}}, std::chrono::seconds(60)));
}

TEST_F(RedisStoreTest, SecondCompleteIsRefusedAndChangesNothing) {
  auto k = key();
  auto rk = store_->redis_key(k);
  auto a = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", a, 30'000ms).status);
  ASSERT_TRUE(store_->complete(k, a, "first", std::chrono::seconds(600)));
  std::string after_first = raw_->text({"GET", rk});
  // Claim again on this thread (a replay), then a late complete with a's token: refused.
  ASSERT_EQ(ClaimStatus::kDone, store_->claim(k, "fp", a, 30'000ms).status);
  EXPECT_FALSE(store_->complete(k, a, "second", std::chrono::seconds(60)));
  EXPECT_EQ(after_first, raw_->text({"GET", rk}));
  EXPECT_GT(raw_->integer({"PTTL", rk}), 500'000);
}

TEST_F(RedisStoreTest, ForeignValueWrittenDuringAClaimIsKeptAndReported) {
  auto k = key();
  auto rk = store_->redis_key(k);
  auto a = OwnerToken::generate();
  auto claimed = store_->claim(k, "fp", a, 30'000ms);
  ASSERT_EQ(ClaimStatus::kClaimed, claimed.status);
  raw_->cmd({"SET", rk, "someone else's value"});
  EXPECT_THROW(store_->complete_claimed(k, a, claimed.ticket, "r", std::chrono::seconds(60)),
               idem::CorruptRecord);
  EXPECT_EQ("someone else's value", raw_->text({"GET", rk}));
  auto b = OwnerToken::generate();
  raw_->cmd({"DEL", rk});
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", b, 30'000ms).status);
  raw_->cmd({"DEL", rk});
  raw_->cmd({"RPUSH", rk, "x"});
  EXPECT_THROW(store_->complete(k, b, "r", std::chrono::seconds(60)), idem::CorruptRecord);
  EXPECT_EQ(1, raw_->integer({"LLEN", rk}));
}

TEST_F(RedisStoreTest, FillOverwritesAndKeepsTheFingerprint) {
  auto k = key();
  auto a = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", a, 30'000ms).status);
  store_->fill(k, "fp", "from_durable", std::chrono::seconds(60));
  // The in-progress owner lost its record to the fill.
  EXPECT_FALSE(store_->complete(k, a, "late", std::chrono::seconds(60)));
  auto r = store_->claim(k, "fp", OwnerToken::generate(), 30'000ms);
  EXPECT_EQ(ClaimStatus::kDone, r.status);
  EXPECT_EQ("from_durable", r.response);
  EXPECT_EQ("", r.holder);
  EXPECT_EQ(ClaimStatus::kMismatch,
            store_->claim(k, "fp2", OwnerToken::generate(), 30'000ms).status);
  long long ttl = raw_->integer({"PTTL", store_->redis_key(k)});
  EXPECT_GT(ttl, 30'000);
  EXPECT_LE(ttl, 60'000);
}

TEST_F(RedisStoreTest, ForeignValuesAreCorruptRecordsNeverCrashes) {
  struct Case {
    const char* name;
    std::function<void(const std::string&)> write;
  };
  auto& raw = *raw_;
  std::vector<Case> cases = {
      {"plain string",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "hello"});
       }},
      {"list",
       [&](const std::string& k) {
         raw.cmd({"LPUSH", k, "a", "b"});
       }},
      {"hash",
       [&](const std::string& k) {
         raw.cmd({"HSET", k, "f", "v"});
       }},
      {"set",
       [&](const std::string& k) {
         raw.cmd({"SADD", k, "m"});
       }},
      {"empty string",
       [&](const std::string& k) {
         raw.cmd({"SET", k, ""});
       }},
      {"truncated owner",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "I1P32:abc"});
       }},
      {"no creation time",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "I1C3:abc"});
       }},
      {"truncated fingerprint",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "I1C3:abc17:64:ff"});
       }},
      {"bad status",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "I1X0:1:0:"});
       }},
      {"negative length",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "I1C-1:1:0:"});
       }},
      {"in progress with a response",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "I1P3:abc1:0:extra"});
       }},
      {"format 2, truncated",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "\xA2"});
       }},
      {"format 2, unknown tag bits",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "\xA6" + std::string(6, '\1') + "R" + std::string(4, '\0')});
       }},
      {"format 2, completed with an owner flag",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "\xAA" + std::string(6, '\1') + "H" + std::string(32, '\7')});
       }},
      {"format 2, owner longer than the value",
       [&](const std::string& k) {
         raw.cmd({"SET", k,
                  "\xA1\x20"
                  "abc"});
       }},
      {"format 2, truncated packed owner",
       [&](const std::string& k) {
         raw.cmd({"SET", k,
                  "\xA9"
                  "abcde"});
       }},
      {"format 2, truncated times",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "\xA2\1\2\3"});
       }},
      {"format 2, unknown fingerprint kind",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "\xA2" + std::string(6, '\1') + "X"});
       }},
      {"format 2, truncated packed fingerprint",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "\xA2" + std::string(6, '\1') + "H" + std::string(31, '\7')});
       }},
      {"format 2, raw fingerprint longer than the value",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "\xA2" + std::string(6, '\1') + std::string("R\0\0\1\0", 5) + "abc"});
       }},
      {"format 2, in progress with a response",
       [&](const std::string& k) {
         raw.cmd({"SET", k,
                  std::string("\xA1\0", 2) + std::string(12, '\1') + std::string("R\0\0\0\1", 5) +
                      "ab"});
       }},
      {"huge length",
       [&](const std::string& k) {
         raw.cmd({"SET", k, "I1C99999999999999999999:x"});
       }},
  };
  RedisStoreOptions script_options{url_};
  script_options.claim_script = true;
  RedisStore script_store(script_options);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto k = key();
    c.write(store_->redis_key(k));
    EXPECT_THROW(script_store.claim(k, "fp", OwnerToken::generate(), 30'000ms),
                 idem::CorruptRecord);
    auto rk = store_->redis_key(k);
    c.write(rk);
    auto owner = OwnerToken::generate();
    EXPECT_THROW(store_->claim(k, "fp", owner, 30'000ms), idem::CorruptRecord);
    EXPECT_THROW(store_->complete(k, owner, "r", std::chrono::seconds(60)), idem::CorruptRecord);
    EXPECT_THROW(store_->fail(k, owner, "r", std::chrono::seconds(60)), idem::CorruptRecord);
    EXPECT_THROW(store_->release(k, owner), idem::CorruptRecord);
    EXPECT_THROW(store_->lookup(k), idem::CorruptRecord);
    try {
      store_->claim(k, "fp", owner, 30'000ms);
    } catch (const idem::CorruptRecord& e) {
      EXPECT_EQ(idem::errc::kCorruptRecord, e.code());
      EXPECT_NE(std::string(e.what()).find(rk), std::string::npos) << e.what();
    }
    // The store still works, and fill repairs the key.
    store_->fill(k, "fp", "repaired", std::chrono::seconds(60));
    EXPECT_EQ("repaired", store_->claim(k, "fp", owner, 30'000ms).response);
  }
}

// unix:// URIs, against a private redis-server listening on a Unix socket only (no TCP port,
// so nothing can clash with other servers), started and stopped by this test.
TEST(RedisStoreUnixSocket, ClaimCompleteAuthAndSelectDbOverAUnixSocket) {
  std::string url;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_URL");  // servers are expected: redis-server exists
  idem::test::TempDir dir;
  const std::string sock = dir.file("r.sock");
  const std::string pid = dir.file("r.pid");
  const std::string start = "redis-server --port 0 --unixsocket " + sock + " --dir " +
                            dir.file("") + " --save '' --appendonly no --daemonize yes" +
                            " --pidfile " + pid + " --logfile " + dir.file("r.log") +
                            " --requirepass 's3cr@t:pw'";
  ASSERT_EQ(0, std::system(start.c_str()));
  struct Stop {
    std::string pid;
    ~Stop() { std::system(("kill $(cat " + pid + ") 2>/dev/null").c_str()); }
  } stop{pid};
  // The password is %-escaped in the URI ('@' is %40, ':' is %3A).
  RedisStoreOptions o{"unix://:s3cr%40t%3Apw@" + sock + "?db=3"};
  RedisStore store(o);
  auto k = Key::make("redis.unix", "k1");
  auto owner = OwnerToken::generate();
  // The server may still be starting: the first calls may be refused.
  idem::ClaimResult first;
  bool claimed = false;
  for (int i = 0; i < 100 && !claimed; ++i) {
    try {
      first = store.claim(k, "fp", owner, 30'000ms);
      claimed = true;
    } catch (const idem::StorageUnavailable&) {
      std::this_thread::sleep_for(50ms);
    }
  }
  ASSERT_TRUE(claimed);
  EXPECT_EQ(ClaimStatus::kClaimed, first.status);
  EXPECT_TRUE(store.complete(k, owner, "over unix", std::chrono::seconds(60)));
  EXPECT_EQ("over unix", store.claim(k, "fp", OwnerToken::generate(), 30'000ms).response);
  idem::test::RawRedis raw("unix://" + sock);
  raw.cmd({"AUTH", "s3cr@t:pw"});
  EXPECT_EQ("<nil>", raw.text({"GET", store.redis_key(k)}));  // db 0: not there
  raw.cmd({"SELECT", "3"});
  EXPECT_NE("<nil>", raw.text({"GET", store.redis_key(k)}));  // db 3: there

  // A wrong password is a configuration error, not an outage; the password is not echoed. The
  // calls failed fast until the next connect (reconnect_backoff) say the same: they were typed
  // as an outage (retryable) after a first non-retryable refusal.
  RedisStoreOptions wrong_options{"unix://:not-it@" + sock};
  wrong_options.reconnect_backoff = std::chrono::seconds(30);
  RedisStore wrong(wrong_options);
  for (int i = 0; i < 3; ++i) {
    try {
      (void)wrong.lookup(k);
      ADD_FAILURE() << "no exception";
    } catch (const idem::StorageUnavailable& e) {
      ADD_FAILURE() << "a refused AUTH is not unavailability (call " << i << "): " << e.what();
    } catch (const idem::StorageError& e) {
      EXPECT_EQ(idem::errc::kStorageError, e.code());
      EXPECT_NE(std::string::npos, std::string(e.what()).find("authentication")) << e.what();
      EXPECT_EQ(std::string::npos, std::string(e.what()).find("not-it")) << e.what();
    }
  }
}

TEST(RedisStoreUnreachable, RefusedConnectIsStorageUnavailableAndLaterCallsFailFast) {
  RedisStoreOptions o;
  o.uri = "redis://127.0.0.1:1";  // nothing listens on port 1
  o.reconnect_backoff = std::chrono::seconds(30);
  RedisStore store(o);
  auto k = Key::make("redis.test", "unreachable");
  auto owner = OwnerToken::generate();
  try {
    (void)store.claim(k, "fp", owner, 1000ms);
    ADD_FAILURE() << "no exception";
  } catch (const idem::StorageUnavailable& e) {
    EXPECT_TRUE(e.retryable());
    EXPECT_NE(std::string::npos, std::string(e.what()).find("refused")) << e.what();
  }
  // Within the backoff, calls fail without trying to connect again, naming the last error.
  for (int i = 0; i < 3; ++i) {
    try {
      (void)store.complete(k, owner, "r", std::chrono::seconds(1));
      ADD_FAILURE() << "no exception";
    } catch (const idem::StorageUnavailable& e) {
      EXPECT_NE(std::string::npos, std::string(e.what()).find("refused")) << e.what();
    }
  }
  auto s = store.pool_stats();
  EXPECT_EQ(1u, s.connect_failures);
  EXPECT_EQ(3u, s.fast_failures);
  EXPECT_EQ(0u, s.open);
}

TEST(RedisStoreUnreachable, UnresolvableHostIsStorageUnavailable) {
  RedisStore store{"redis://no-such-host.invalid:6379"};
  EXPECT_THROW((void)store.lookup(Key::make("redis.test", "x")), idem::StorageUnavailable);
}

TEST(RedisPoolTest, ExhaustedPoolFailsAfterTheWaitTime) {
  std::string url;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_URL");
  idem::redis::detail::PoolSettings s;
  s.endpoint = idem::redis::detail::parse_uri(url);
  s.size = 1;
  s.wait_timeout = 150ms;
  idem::redis::detail::Pool pool(s);
  {
    auto held = pool.acquire("test");
    ASSERT_NE(nullptr, held.get());
    try {
      auto second = pool.acquire("claim idem:{x|y}");
      ADD_FAILURE() << "no exception";
    } catch (const idem::StorageUnavailable& e) {
      EXPECT_NE(std::string::npos, std::string(e.what()).find("exhausted")) << e.what();
    }
    EXPECT_EQ(1u, pool.stats().exhausted);
  }
  // Given back: lent again (the same connection, nothing new opened).
  { auto again = pool.acquire("test"); }
  EXPECT_EQ(1u, pool.stats().connects);
}

TEST(RedisPoolTest, AWaiterGetsTheConnectionWhenItIsGivenBack) {
  std::string url;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_URL");
  idem::redis::detail::PoolSettings s;
  s.endpoint = idem::redis::detail::parse_uri(url);
  s.size = 1;
  s.wait_timeout = 60s;  // long: the waiter must be woken by the give-back, not time out
  idem::redis::detail::Pool pool(s);
  auto held = std::make_unique<idem::redis::detail::Pool::Lease>(pool.acquire("test"));
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    auto lease = pool.acquire("test");
    got = true;
  });
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(got.load());
  held.reset();
  waiter.join();
  EXPECT_TRUE(got.load());
  EXPECT_EQ(0u, pool.stats().exhausted);
}

TEST(RedisPoolTest, ExhaustedStoreThrowsStorageUnavailable) {
  // Through the public API: one connection, lent to a thread blocked inside a call is hard to
  // arrange without stalling the server; with pool_wait_timeout 0 and a pool of 1, a second
  // concurrent call must fail at once instead of waiting.
  std::string url;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_URL");
  RedisStoreOptions o{url};
  o.pool_size = 1;
  o.pool_wait_timeout = 0ms;
  RedisStore store(o);
  std::atomic<int> unavailable{0}, ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 300; ++i) {
        try {
          (void)store.lookup(Key::make("redis.test", "exhaust" + std::to_string(t)));
          ++ok;
        } catch (const idem::StorageUnavailable&) {
          ++unavailable;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(1200, ok + unavailable);
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(static_cast<std::uint64_t>(unavailable.load()), store.pool_stats().exhausted);
  EXPECT_LE(store.pool_stats().open, 1u);
}

}  // namespace
