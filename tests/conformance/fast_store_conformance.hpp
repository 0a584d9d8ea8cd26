// SPDX-License-Identifier: MIT
// One suite every idem::FastStore must pass (memory always; Redis, Redis Cluster when their
// server is configured). Instantiate with IDEM_FAST_STORE_CONFORMANCE(Prefix, factory).
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "idem/store.hpp"
#include "support/test_env.hpp"

namespace idem::test {

/// How to build a store for the suite. `env_var`: skip (or fail under scripts/test.sh) when
/// unset; null for stores that need no server.
struct FastStoreFactory {
  std::string name;
  const char* env_var;
  std::function<std::unique_ptr<FastStore>(const std::string& env_value)> make;
  /// Whether a completed record reports its attempt's owner token as the holder of a duplicate
  /// (ClaimResult::holder, "may be empty"): Redis drops it to keep records small.
  bool keeps_completed_owner = true;
};

inline void PrintTo(const FastStoreFactory& f, std::ostream* os) { *os << f.name; }

class FastStoreConformance : public ::testing::TestWithParam<FastStoreFactory> {
 protected:
  void SetUp() override {
    std::string value;
    if (GetParam().env_var != nullptr) IDEM_REQUIRE_ENV(value, GetParam().env_var);
    store_ = GetParam().make(value);
    ASSERT_NE(store_, nullptr);
  }
  Key key() {
    return Key::make("conformance", unique_name(
        ::testing::UnitTest::GetInstance()->current_test_info()->name()));
  }
  std::unique_ptr<FastStore> store_;
  const std::chrono::milliseconds lease_{30'000};
  const std::chrono::seconds retention_{600};
};

TEST_P(FastStoreConformance, FirstClaimWinsThenBusyThenMismatch) {
  auto k = key();
  auto a = OwnerToken::generate();
  auto b = OwnerToken::generate();
  EXPECT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp1", a, lease_).status);
  auto busy = store_->claim(k, "fp1", b, lease_);
  EXPECT_EQ(ClaimStatus::kBusy, busy.status);
  EXPECT_EQ(a.str(), busy.holder);
  EXPECT_NE(0, to_millis(busy.first_seen));
  EXPECT_EQ(ClaimStatus::kMismatch, store_->claim(k, "fp2", b, lease_).status);
}

TEST_P(FastStoreConformance, CompleteThenReplay) {
  auto k = key();
  auto a = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", a, lease_).status);
  EXPECT_TRUE(store_->complete(k, a, "order_42", retention_));
  auto again = store_->claim(k, "fp", OwnerToken::generate(), lease_);
  EXPECT_EQ(ClaimStatus::kDone, again.status);
  EXPECT_EQ("order_42", again.response);
  EXPECT_EQ(GetParam().keeps_completed_owner ? a.str() : std::string(), again.holder);
  auto rec = store_->lookup(k);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(Record::Status::kCompleted, rec->status);
  EXPECT_EQ("order_42", rec->response);
}

// A lease or retention longer than kMaxTerm is refused before the store is touched ("now" plus
// seconds::max() overflows: a record born expired, or a crash converting it); kMaxTerm works.
TEST_P(FastStoreConformance, TermsLongerThanTheLongestAreRefused) {
  auto k = key();
  auto a = OwnerToken::generate();
  const auto too_long = kMaxTerm + std::chrono::seconds(1);
  EXPECT_THROW((void)store_->claim(k, "fp", a, std::chrono::milliseconds::max()), UsageError);
  EXPECT_FALSE(store_->lookup(k).has_value());
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", a, lease_).status);
  EXPECT_THROW((void)store_->extend(k, a, std::chrono::milliseconds::max()), UsageError);
  EXPECT_THROW((void)store_->complete(k, a, "r", std::chrono::seconds::max()), UsageError);
  EXPECT_THROW((void)store_->fail(k, a, "r", too_long), UsageError);
  EXPECT_THROW(store_->fill(Key::make("other", k.id()), "fp", "r", std::chrono::seconds::max()),
               UsageError);
  EXPECT_EQ(Record::Status::kInProgress, store_->lookup(k)->status);
  EXPECT_TRUE(store_->complete(k, a, "r", kMaxTerm));
  auto again = store_->claim(k, "fp", OwnerToken::generate(), kMaxTerm);
  EXPECT_EQ(ClaimStatus::kDone, again.status);
  EXPECT_EQ("r", again.response);
}

// fail() records a dead-lettered message: every store reports it as failed (ClaimResult::failed,
// Record::Status::kFailed), never as a completed record with a marker in its response.
TEST_P(FastStoreConformance, FailedRecordIsReportedAsFailed) {
  auto k = key();
  auto a = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", a, lease_).status);
  EXPECT_FALSE(store_->fail(k, OwnerToken::generate(), "not mine", retention_));
  EXPECT_TRUE(store_->fail(k, a, "poison: bad amount", retention_));
  auto again = store_->claim(k, "fp", OwnerToken::generate(), lease_);
  EXPECT_EQ(ClaimStatus::kDone, again.status);
  EXPECT_TRUE(again.failed);
  EXPECT_EQ("poison: bad amount", again.response);
  auto rec = store_->lookup(k);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(Record::Status::kFailed, rec->status);
  EXPECT_FALSE(store_->complete(k, a, "late", retention_));  // finished: nothing to complete
  auto done = key();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(done, "fp", a, lease_).status);
  ASSERT_TRUE(store_->complete(done, a, "ok", retention_));
  EXPECT_FALSE(store_->claim(done, "fp", OwnerToken::generate(), lease_).failed);
}

// A claim retried by the attempt that holds it (its first answer was lost) is still that
// attempt's: kClaimed with `kept`, not busy, and its completion works.
TEST_P(FastStoreConformance, ClaimRetriedByItsOwnerIsKept) {
  auto k = key();
  auto a = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", a, lease_).status);
  auto retried = store_->claim(k, "fp", a, lease_);
  EXPECT_EQ(ClaimStatus::kClaimed, retried.status);
  EXPECT_TRUE(retried.kept);
  EXPECT_FALSE(retried.took_over);
  EXPECT_EQ(ClaimStatus::kBusy, store_->claim(k, "fp", OwnerToken::generate(), lease_).status);
  EXPECT_EQ(ClaimStatus::kMismatch, store_->claim(k, "other", a, lease_).status);
  EXPECT_TRUE(store_->complete(k, a, "r", retention_));
  EXPECT_EQ(ClaimStatus::kDone, store_->claim(k, "fp", a, lease_).status);
}

TEST_P(FastStoreConformance, MismatchWinsOverReplay) {
  auto k = key();
  auto a = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", a, lease_).status);
  ASSERT_TRUE(store_->complete(k, a, "r", retention_));
  EXPECT_EQ(ClaimStatus::kMismatch, store_->claim(k, "other", a, lease_).status);
}

TEST_P(FastStoreConformance, OnlyTheOwnerCompletesOrReleases) {
  auto k = key();
  auto a = OwnerToken::generate();
  auto stranger = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", a, lease_).status);
  EXPECT_FALSE(store_->complete(k, stranger, "x", retention_));
  EXPECT_FALSE(store_->release(k, stranger));
  EXPECT_EQ(ClaimStatus::kBusy, store_->claim(k, "fp", stranger, lease_).status);
  EXPECT_TRUE(store_->release(k, a));
  EXPECT_FALSE(store_->release(k, a));
  EXPECT_FALSE(store_->complete(k, a, "late", retention_));
  EXPECT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", stranger, lease_).status);
}

TEST_P(FastStoreConformance, ExpiredLeaseIsTakenOverAndStaleOwnerRefused) {
  auto k = key();
  auto stale = OwnerToken::generate();
  auto fresh = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed,
            store_->claim(k, "fp", stale, std::chrono::milliseconds(150)).status);
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", fresh, lease_).status);
  EXPECT_FALSE(store_->complete(k, stale, "stale", retention_));
  EXPECT_FALSE(store_->release(k, stale));
  EXPECT_TRUE(store_->complete(k, fresh, "fresh", retention_));
  auto r = store_->claim(k, "fp", OwnerToken::generate(), lease_);
  EXPECT_EQ(ClaimStatus::kDone, r.status);
  EXPECT_EQ("fresh", r.response);
}

TEST_P(FastStoreConformance, RetentionEnds) {
  auto k = key();
  auto a = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", a, lease_).status);
  ASSERT_TRUE(store_->complete(k, a, "r", std::chrono::seconds(1)));
  std::this_thread::sleep_for(std::chrono::milliseconds(1300));
  EXPECT_FALSE(store_->lookup(k).has_value());
  EXPECT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", a, lease_).status);
}

TEST_P(FastStoreConformance, ResponsesAreByteIdentical) {
  std::string binary;
  for (int i = 0; i < 256; ++i) binary.push_back(static_cast<char>(i));
  std::string big(1 << 20, '\0');
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 131) ^ (i >> 7));
  for (const std::string& response : {std::string(), binary, big}) {
    auto k = key();
    auto a = OwnerToken::generate();
    ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", a, lease_).status);
    ASSERT_TRUE(store_->complete(k, a, response, retention_));
    auto r = store_->claim(k, "fp", OwnerToken::generate(), lease_);
    ASSERT_EQ(ClaimStatus::kDone, r.status);
    EXPECT_EQ(response.size(), r.response.size());
    EXPECT_TRUE(response == r.response);
  }
}

TEST_P(FastStoreConformance, FillWritesACompletedRecord) {
  auto k = key();
  store_->fill(k, "fp", "refilled", retention_);
  auto r = store_->claim(k, "fp", OwnerToken::generate(), lease_);
  EXPECT_EQ(ClaimStatus::kDone, r.status);
  EXPECT_EQ("refilled", r.response);
}

// A record written back from the durable store keeps its first attempt's creation time (and
// owner, where completed records keep one), also over a claim of its own (the guard's
// write-back of a durable replay); none given: now.
TEST_P(FastStoreConformance, RefillKeepsWhenTheFirstAttemptBegan) {
  const TimePoint first_seen{std::chrono::milliseconds(to_millis(system_now()) - 3'600'000)};
  const auto first = OwnerToken::generate();
  auto k = key();
  const auto mine = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", mine, lease_).status);
  store_->refill(k, "fp", "replayed", retention_, RecordOrigin{first_seen, first.str()});
  auto r = store_->claim(k, "fp", OwnerToken::generate(), lease_);
  EXPECT_EQ(ClaimStatus::kDone, r.status);
  EXPECT_EQ("replayed", r.response);
  EXPECT_EQ(to_millis(first_seen), to_millis(r.first_seen));
  EXPECT_EQ(GetParam().keeps_completed_owner ? first.str() : std::string(), r.holder)
      << "never the overwritten claim's owner";
  auto found = store_->lookup(k);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(Record::Status::kCompleted, found->status);
  EXPECT_EQ(to_millis(first_seen), to_millis(found->created_at));
  EXPECT_FALSE(store_->complete(k, mine, "late", retention_)) << "the claim was overwritten";

  auto fresh = Key::make(k.scope(), k.id() + "-now");
  const auto before = to_millis(system_now());
  store_->refill(fresh, "fp", "r", retention_, RecordOrigin{});
  auto now = store_->claim(fresh, "fp", OwnerToken::generate(), lease_);
  EXPECT_EQ(ClaimStatus::kDone, now.status);
  EXPECT_GE(to_millis(now.first_seen), before);
}

TEST_P(FastStoreConformance, HostileIdsAreStoredVerbatim) {
  for (std::string id : {"';DROP_TABLE_api_idempotency;--", "a}b{c", "{x}", "\"q\\uote\"",
                         "%s%n", "a|b|c"}) {
    auto k = Key::make("conformance", id + unique_name(""));
    auto a = OwnerToken::generate();
    ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", a, lease_).status) << id;
    ASSERT_TRUE(store_->complete(k, a, id, retention_));
    auto r = store_->claim(k, "fp", a, lease_);
    EXPECT_EQ(ClaimStatus::kDone, r.status);
    EXPECT_EQ(id, r.response);
  }
  // Scope "a:b" + id "c" and scope "a" + id "b:c" are different records.
  auto suffix = unique_name("");
  auto k1 = Key::make("a:b", "c" + suffix);
  auto k2 = Key::make("a", "b:c" + suffix);
  auto o = OwnerToken::generate();
  EXPECT_EQ(ClaimStatus::kClaimed, store_->claim(k1, "fp", o, lease_).status);
  EXPECT_EQ(ClaimStatus::kClaimed, store_->claim(k2, "fp", o, lease_).status);
}

TEST_P(FastStoreConformance, ConcurrentClaimsHaveOneWinner) {
  auto k = key();
  constexpr int kThreads = 32;
  std::atomic<int> claimed{0}, busy{0}, other{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      while (!go.load()) std::this_thread::yield();
      auto r = store_->claim(k, "fp", OwnerToken::generate(), lease_);
      if (r.status == ClaimStatus::kClaimed) {
        ++claimed;
      } else if (r.status == ClaimStatus::kBusy) {
        ++busy;
      } else {
        ++other;
      }
    });
  }
  go = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(1, claimed.load());
  EXPECT_EQ(kThreads - 1, busy.load());
  EXPECT_EQ(0, other.load());
}

// claim_batch answers exactly what single claims made in the same order answer: the same
// scenario is played once with claim() on one set of keys and once with claim_batch() on
// another, and every answer (status, response, holder) must match, and match the expectation.
TEST_P(FastStoreConformance, BatchClaimAnswersLikeSingleClaims) {
  auto a = OwnerToken::generate();
  auto b = OwnerToken::generate();
  auto c = OwnerToken::generate();
  struct Scenario {
    Key fresh, done, busy, twice;
  };
  auto prepare = [&](const std::string& tag) {
    Scenario s{Key::make("conformance", unique_name("batch_fresh_" + tag)),
               Key::make("conformance", unique_name("batch_done_" + tag)),
               Key::make("conformance", unique_name("batch_busy_" + tag)),
               Key::make("conformance", unique_name("batch_twice_" + tag))};
    EXPECT_EQ(ClaimStatus::kClaimed, store_->claim(s.done, "fp", a, lease_).status);
    EXPECT_TRUE(store_->complete(s.done, a, "order_7", retention_));
    EXPECT_EQ(ClaimStatus::kClaimed, store_->claim(s.busy, "fp", a, lease_).status);
    return s;
  };
  Scenario one = prepare("single");
  Scenario many = prepare("batch");
  auto requests = [&](const Scenario& s) {
    return std::vector<ClaimRequest>{
        {&s.fresh, "fp", &b}, {&s.done, "fp", &b},  {&s.busy, "fp", &b},
        {&s.done, "no", &b},  {&s.busy, "no", &b},  {&s.twice, "fp", &b},
        {&s.twice, "fp", &c}, {&s.twice, "no", &c},
    };
  };
  std::vector<ClaimResult> singles;
  for (const auto& r : requests(one)) {
    singles.push_back(store_->claim(*r.key, r.fingerprint, *r.owner, lease_));
  }
  std::vector<ClaimResult> batch = store_->claim_batch(requests(many), lease_);
  const std::vector<ClaimStatus> want{ClaimStatus::kClaimed,  ClaimStatus::kDone,
                                      ClaimStatus::kBusy,     ClaimStatus::kMismatch,
                                      ClaimStatus::kMismatch, ClaimStatus::kClaimed,
                                      ClaimStatus::kBusy,     ClaimStatus::kMismatch};
  ASSERT_EQ(want.size(), batch.size());
  ASSERT_EQ(want.size(), singles.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(want[i], singles[i].status) << "single " << i;
    EXPECT_EQ(want[i], batch[i].status) << "batch " << i;
    EXPECT_EQ(singles[i].response, batch[i].response) << i;
    EXPECT_EQ(singles[i].holder, batch[i].holder) << i;
  }
  EXPECT_EQ("order_7", batch[1].response);
  EXPECT_EQ(a.str(), batch[2].holder);
  EXPECT_EQ(b.str(), batch[6].holder);  // the batch's own earlier claim of the same key
}

// complete_batch answers what complete() would: true for the owner's live claims, false for
// another owner's claim and an absent key; the completed records then replay.
TEST_P(FastStoreConformance, BatchCompleteAnswersLikeSingleCompletes) {
  auto a = OwnerToken::generate();
  auto stranger = OwnerToken::generate();
  auto k1 = key();
  auto k2 = Key::make("conformance", unique_name("batch_complete_2"));
  auto held = Key::make("conformance", unique_name("batch_complete_held"));
  auto absent = Key::make("conformance", unique_name("batch_complete_absent"));
  auto claims = store_->claim_batch({{&k1, "fp", &a}, {&k2, "fp", &a}}, lease_);
  ASSERT_EQ(ClaimStatus::kClaimed, claims[0].status);
  ASSERT_EQ(ClaimStatus::kClaimed, claims[1].status);
  ASSERT_EQ(ClaimStatus::kClaimed, store_->claim(held, "fp", stranger, lease_).status);
  std::vector<bool> ok = store_->complete_batch(
      {{&k1, &a, "r1"}, {&held, &a, "not mine"}, {&k2, &a, "r2"}, {&absent, &a, "none"}},
      retention_);
  EXPECT_EQ((std::vector<bool>{true, false, true, false}), ok);
  auto r1 = store_->claim(k1, "fp", stranger, lease_);
  EXPECT_EQ(ClaimStatus::kDone, r1.status);
  EXPECT_EQ("r1", r1.response);
  EXPECT_EQ("r2", store_->claim(k2, "fp", stranger, lease_).response);
  EXPECT_EQ(ClaimStatus::kBusy, store_->claim(held, "fp", a, lease_).status);
  EXPECT_FALSE(store_->lookup(absent).has_value());
  // Completing again is refused: the claims are completed now.
  EXPECT_EQ((std::vector<bool>{false}), store_->complete_batch({{&k1, &a, "again"}}, retention_));
}

// A batch claim whose lease expired and was taken over cannot be completed by the stale owner.
TEST_P(FastStoreConformance, BatchCompleteAfterTakeoverIsRefused) {
  auto stale = OwnerToken::generate();
  auto fresh = OwnerToken::generate();
  auto k = key();
  ASSERT_EQ(ClaimStatus::kClaimed,
            store_->claim_batch({{&k, "fp", &stale}}, std::chrono::milliseconds(150))[0].status);
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  std::thread other([&] {
    EXPECT_EQ(ClaimStatus::kClaimed, store_->claim(k, "fp", fresh, lease_).status);
  });
  other.join();
  EXPECT_EQ((std::vector<bool>{false}),
            store_->complete_batch({{&k, &stale, "stale"}}, retention_));
  auto rec = store_->lookup(k);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(Record::Status::kInProgress, rec->status);
  EXPECT_EQ(fresh.str(), rec->owner);
}

}  // namespace idem::test

#define IDEM_FAST_STORE_CONFORMANCE(prefix, ...)                                      \
  namespace idem::test {                                                             \
  INSTANTIATE_TEST_SUITE_P(prefix, FastStoreConformance, ::testing::Values(__VA_ARGS__), \
                           [](const ::testing::TestParamInfo<FastStoreFactory>& p) {   \
                             return p.param.name;                                    \
                           });                                                       \
  }
