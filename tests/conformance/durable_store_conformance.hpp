// SPDX-License-Identifier: MIT
// One typed suite every durable store must pass (SQLite always; PostgreSQL when configured),
// covering the store protocol and the guard on top of it, counting business rows.
//
// A Traits type provides:
//   using Store = ...;                                   // the durable store
//   static const char* env_var();                        // null: no server needed
//   static std::unique_ptr<Store> make(const std::string& env_value);
//   static void insert_effect(typename Store::Transaction&, const std::string& key_id);
//   static long count_effects(Store&, const std::string& key_id);
//   static long count_records(Store&);                   // rows in the record table
// and the adapter's test file does:
//   using Types = ::testing::Types<MyTraits>;
//   namespace idem::test { INSTANTIATE_TYPED_TEST_SUITE_P(Name, DurableStoreConformance, Types); }
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "idem/guard.hpp"
#include "idem/memory_store.hpp"
#include "support/failing_store.hpp"
#include "support/reassigning_handler.hpp"
#include "support/test_env.hpp"

namespace idem::test {

template <class Traits>
class DurableStoreConformance : public ::testing::Test {
 protected:
  using Store = typename Traits::Store;
  using TxType = typename Store::Transaction;


  void SetUp() override {
    std::string value;
    if (Traits::env_var() != nullptr) IDEM_REQUIRE_ENV(value, Traits::env_var());
    store_ = Traits::make(value);
    ASSERT_NE(store_, nullptr);
  }

  Key key(const std::string& scope = "payment") {
    return Key::make(scope, unique_name(
        ::testing::UnitTest::GetInstance()->current_test_info()->name()));
  }

  // Many threads, one key, a handler that sleeps: one effect; every answer is the response or
  // in_progress; afterwards every caller gets the response. `expect_response`: every call says
  // the key is likely new and what its response will be (CallOptions::expected_response).
  template <class Guard>
  void storm(Guard& guard, bool transactional, bool expect_response = false) {
    auto k = key();
    const std::string expected = "pay_" + k.id();
    CallOptions options;
    if (expect_response) {
      options.likely_new = true;
      options.expected_response = expected;
    }
    constexpr int kThreads = 32;
    std::atomic<int> runs{0}, executed{0}, in_progress{0}, replayed{0}, wrong{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&] {
        while (!go.load()) std::this_thread::yield();
        try {
          GuardResult<std::string> r;
          if (transactional) {
            r = guard.run(k, "fp", options, [&](TxType& tx) {
              ++runs;
              Traits::insert_effect(tx, k.id());
              std::this_thread::sleep_for(std::chrono::milliseconds(50));
              return std::string("pay_") + k.id();
            });
          } else {
            r = guard.run(k, "fp", options, [&] {
              ++runs;
              std::this_thread::sleep_for(std::chrono::milliseconds(50));
              return std::string("pay_") + k.id();
            });
          }
          if (r.outcome == Outcome::kExecuted) ++executed;
          if (r.outcome == Outcome::kReplayed) ++replayed;
          if (r.outcome == Outcome::kInProgress) ++in_progress;
          if (r.outcome == Outcome::kFingerprintMismatch) ++wrong;
          if (r.ok() && *r.value != "pay_" + k.id()) ++wrong;
        } catch (const std::exception& e) {
          ADD_FAILURE() << "caller got an exception: " << e.what();
          ++wrong;
        }
      });
    }
    go = true;
    for (auto& t : threads) t.join();
    EXPECT_EQ(1, runs.load());
    EXPECT_EQ(1, executed.load());
    EXPECT_EQ(kThreads - 1, replayed.load() + in_progress.load());
    EXPECT_EQ(0, wrong.load());
    if (transactional) {
      EXPECT_EQ(1, Traits::count_effects(*store_, k.id()));
    }
    for (int i = 0; i < 4; ++i) {
      GuardResult<std::string> again;
      if (transactional) {
        again = guard.run(k, "fp", options, [&](TxType&) { ++runs; return std::string("x"); });
      } else {
        again = guard.run(k, "fp", [&] { ++runs; return std::string("x"); });
      }
      EXPECT_EQ(Outcome::kReplayed, again.outcome);
      EXPECT_EQ("pay_" + k.id(), again.value.value_or("<none>"));
    }
    EXPECT_EQ(1, runs.load());
  }

  std::unique_ptr<Store> store_;
  const std::chrono::seconds retention_{600};
  const std::chrono::milliseconds lease_{30'000};
};

TYPED_TEST_SUITE_P(DurableStoreConformance);

TYPED_TEST_P(DurableStoreConformance, TransactionalRunCommitsRecordAndEffectTogether) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto& store = *this->store_;
  auto k = this->key();
  auto owner = OwnerToken::generate();
  auto r = store.run_transactional(k, "fp", owner, this->retention_, [&](Tx& tx) {
    TypeParam::insert_effect(tx, k.id());
    return std::string("pay_1");
  });
  EXPECT_EQ(TransactionalStatus::kCommitted, r.status);
  EXPECT_EQ("pay_1", r.response);
  EXPECT_EQ(1, TypeParam::count_effects(store, k.id()));
  int runs = 0;
  auto again = store.run_transactional(k, "fp", OwnerToken::generate(), this->retention_,
                                       [&](Tx& tx) {
                                         ++runs;
                                         TypeParam::insert_effect(tx, k.id());
                                         return std::string("pay_2");
                                       });
  EXPECT_EQ(TransactionalStatus::kReplayed, again.status);
  EXPECT_EQ("pay_1", again.response);
  EXPECT_EQ(owner.str(), again.holder);
  EXPECT_EQ(0, runs);
  EXPECT_EQ(1, TypeParam::count_effects(store, k.id()));
  auto rec = store.lookup(k);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(Record::Status::kCompleted, rec->status);
  EXPECT_EQ("fp", rec->fingerprint);
}

TYPED_TEST_P(DurableStoreConformance, HandlerThrowsRollsBackEverything) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto& store = *this->store_;
  auto k = this->key();
  EXPECT_THROW(store.run_transactional(k, "fp", OwnerToken::generate(), this->retention_,
                                       [&](Tx& tx) -> std::string {
                                         TypeParam::insert_effect(tx, k.id());
                                         throw std::runtime_error("declined");
                                       }),
               std::runtime_error);
  EXPECT_EQ(0, TypeParam::count_effects(store, k.id()));
  EXPECT_FALSE(store.lookup(k).has_value());
  auto retry = store.run_transactional(k, "fp", OwnerToken::generate(), this->retention_,
                                       [&](Tx& tx) {
                                         TypeParam::insert_effect(tx, k.id());
                                         return std::string("ok");
                                       });
  EXPECT_EQ(TransactionalStatus::kCommitted, retry.status);
  EXPECT_EQ(1, TypeParam::count_effects(store, k.id()));
}

TYPED_TEST_P(DurableStoreConformance, MismatchWinsOverReplayAndInProgress) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto& store = *this->store_;
  auto done = this->key();
  (void)store.run_transactional(done, "fp", OwnerToken::generate(), this->retention_,
                                [](Tx&) { return std::string("r"); });
  auto r = store.run_transactional(done, "other", OwnerToken::generate(), this->retention_,
                                   [](Tx&) { return std::string("never"); });
  EXPECT_EQ(TransactionalStatus::kMismatch, r.status);
  auto running = this->key();
  ASSERT_EQ(ClaimStatus::kClaimed,
            store.begin(running, "fp", OwnerToken::generate(), this->lease_).status);
  EXPECT_EQ(ClaimStatus::kMismatch,
            store.begin(running, "other", OwnerToken::generate(), this->lease_).status);
  EXPECT_EQ(ClaimStatus::kBusy,
            store.begin(running, "fp", OwnerToken::generate(), this->lease_).status);
}

TYPED_TEST_P(DurableStoreConformance, TwoPhaseLeaseExpiryFencesTheStaleOwner) {
  auto& store = *this->store_;
  auto k = this->key();
  auto stale = OwnerToken::generate();
  auto fresh = OwnerToken::generate();
  // A lease of 1 s: the busy check right after the claim must come before it ends (a 200 ms
  // lease was outlived between two calls once, on a loaded CI machine).
  ASSERT_EQ(ClaimStatus::kClaimed,
            store.begin(k, "fp", stale, std::chrono::milliseconds(1000)).status);
  EXPECT_EQ(ClaimStatus::kBusy, store.begin(k, "fp", fresh, this->lease_).status);
  std::this_thread::sleep_for(std::chrono::milliseconds(1300));
  auto takeover = store.begin(k, "fp", fresh, this->lease_);
  EXPECT_EQ(ClaimStatus::kClaimed, takeover.status);
  EXPECT_TRUE(takeover.took_over);
  EXPECT_FALSE(store.complete(k, stale, "stale", this->retention_));
  EXPECT_FALSE(store.release(k, stale));
  EXPECT_TRUE(store.complete(k, fresh, "fresh", this->retention_));
  auto r = store.begin(k, "fp", OwnerToken::generate(), this->lease_);
  EXPECT_EQ(ClaimStatus::kDone, r.status);
  EXPECT_EQ("fresh", r.response);
}

TYPED_TEST_P(DurableStoreConformance, TwoPhaseReleaseLetsARetryRun) {
  auto& store = *this->store_;
  auto k = this->key();
  auto a = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store.begin(k, "fp", a, this->lease_).status);
  EXPECT_TRUE(store.release(k, a));
  EXPECT_FALSE(store.lookup(k).has_value());
  EXPECT_EQ(ClaimStatus::kClaimed, store.begin(k, "fp", OwnerToken::generate(), this->lease_)
                                       .status);
}

// fail() (a dead-lettered message) is reported as failed by every durable store, and a begin
// retried by the attempt that holds the record keeps its claim (the rulebook's kKeep).
TYPED_TEST_P(DurableStoreConformance, FailedRecordAndRetriedBeginFollowTheRulebook) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto& store = *this->store_;
  auto k = this->key();
  auto a = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store.begin(k, "fp", a, this->lease_).status);
  auto retried = store.begin(k, "fp", a, this->lease_);
  EXPECT_EQ(ClaimStatus::kClaimed, retried.status);
  EXPECT_TRUE(retried.kept);
  EXPECT_FALSE(retried.took_over);
  EXPECT_EQ(ClaimStatus::kBusy, store.begin(k, "fp", OwnerToken::generate(), this->lease_).status);
  EXPECT_FALSE(store.fail(k, OwnerToken::generate(), "not mine", this->retention_));
  EXPECT_TRUE(store.fail(k, a, "poison", this->retention_));
  auto again = store.begin(k, "fp", OwnerToken::generate(), this->lease_);
  EXPECT_EQ(ClaimStatus::kDone, again.status);
  EXPECT_TRUE(again.failed);
  EXPECT_EQ("poison", again.response);
  auto rec = store.lookup(k);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(Record::Status::kFailed, rec->status);
  bool ran = false;
  auto tx = store.run_transactional(k, "fp", OwnerToken::generate(), this->retention_,
                                    [&](Tx&) {
                                      ran = true;
                                      return std::string("x");
                                    });
  EXPECT_FALSE(ran);
  EXPECT_TRUE(tx.failed);
  EXPECT_EQ("poison", tx.response);
}

TYPED_TEST_P(DurableStoreConformance, ResponsesAreByteIdentical) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto& store = *this->store_;
  std::string binary;
  for (int i = 0; i < 256; ++i) binary.push_back(static_cast<char>(i));
  std::string big(1 << 20, '\0');
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 131) ^ (i >> 7));
  for (const std::string& response : {std::string(), binary, big}) {
    auto k = this->key();
    (void)store.run_transactional(k, "fp", OwnerToken::generate(), this->retention_,
                                  [&](Tx&) { return response; });
    auto r = store.run_transactional(k, "fp", OwnerToken::generate(), this->retention_,
                                     [&](Tx&) { return std::string("never"); });
    ASSERT_EQ(TransactionalStatus::kReplayed, r.status);
    EXPECT_EQ(response.size(), r.response.size());
    EXPECT_TRUE(response == r.response);
  }
}

// A fingerprint is any bytes (a raw digest, NUL bytes, invalid UTF-8): every store keeps it
// exactly. The same bytes replay, any other bytes are a mismatch (a prefix, a value that spells
// another's stored form), and lookup() gives the bytes back. PostgreSQL's text column holds
// neither NUL bytes nor invalid UTF-8 (src/postgres/text_fingerprint.hpp says how it keeps them).
TYPED_TEST_P(DurableStoreConformance, FingerprintsOfAnyBytesAreKeptExactly) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto& store = *this->store_;
  std::string digest;
  for (int i = 0; i < 32; ++i) digest.push_back(static_cast<char>(i * 37 + 200));
  const std::vector<std::string> fps = {std::string("sha\0rest", 8),
                                        "sha",
                                        digest,
                                        "\xC3\x28",  // invalid UTF-8
                                        "caf\xC3\xA9",
                                        "hi",
                                        std::string("\x01") + "6869",  // the marker, then hex
                                        std::string("\x01") + "016869",
                                        "\x01"};
  for (const std::string& fp : fps) {
    auto k = this->key();
    auto first = store.run_transactional(k, fp, OwnerToken::generate(), this->retention_,
                                         [&](Tx&) { return std::string("r_") + k.id(); });
    ASSERT_EQ(TransactionalStatus::kCommitted, first.status);
    auto again = store.run_transactional(k, fp, OwnerToken::generate(), this->retention_,
                                         [](Tx&) { return std::string("never"); });
    EXPECT_EQ(TransactionalStatus::kReplayed, again.status);
    EXPECT_EQ(std::string("r_") + k.id(), again.response);
    for (const std::string& other : fps) {
      if (other == fp) continue;
      EXPECT_EQ(TransactionalStatus::kMismatch,
                store
                    .run_transactional(k, other, OwnerToken::generate(), this->retention_,
                                       [](Tx&) { return std::string("never"); })
                    .status);
    }
    auto rec = store.lookup(k);
    ASSERT_TRUE(rec.has_value());
    EXPECT_TRUE(rec->fingerprint == fp);
    // The two-phase claim compares the same way.
    auto held = this->key();
    ASSERT_EQ(ClaimStatus::kClaimed,
              store.begin(held, fp, OwnerToken::generate(), this->lease_).status);
    EXPECT_EQ(ClaimStatus::kBusy,
              store.begin(held, fp, OwnerToken::generate(), this->lease_).status);
    EXPECT_EQ(
        ClaimStatus::kMismatch,
        store.begin(held, fp == "sha" ? "hi" : "sha", OwnerToken::generate(), this->lease_).status);
  }
}

// A replay says when its record's retention ends, whichever read found the record (the read
// before a claim, the claim's own read, a two-phase claim), and so does the guard's result.
TYPED_TEST_P(DurableStoreConformance, ReplaysReportWhenTheirRecordExpires) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto& store = *this->store_;
  auto k = this->key();
  const TimePoint before = system_now();
  ASSERT_EQ(TransactionalStatus::kCommitted,
            store
                .run_transactional(k, "fp", OwnerToken::generate(), this->retention_,
                                   [](Tx&) { return std::string("r"); })
                .status);
  const TimePoint after = system_now();
  auto within = [&](TimePoint t) {
    // The store's clock (a database server's) may differ a little from this process's, and a
    // store may keep a record somewhat longer than asked (MySQL: up to a tenth more).
    return t >= before + this->retention_ - std::chrono::seconds(5) &&
           t <= after + this->retention_ + this->retention_ / 10 + std::chrono::seconds(5);
  };
  DurableHint claimed;  // the fast store granted the claim: no read before it
  claimed.fast_claimed = true;
  for (const DurableHint& h : {DurableHint{}, claimed}) {
    auto r = store.run_transactional(
        k, "fp", OwnerToken::generate(), this->retention_, [](Tx&) { return std::string("never"); },
        h);
    ASSERT_EQ(TransactionalStatus::kReplayed, r.status);
    EXPECT_TRUE(within(r.expires_at)) << to_millis(r.expires_at);
  }
  auto c = store.begin(k, "fp", OwnerToken::generate(), this->lease_);
  ASSERT_EQ(ClaimStatus::kDone, c.status);
  EXPECT_TRUE(within(c.expires_at)) << to_millis(c.expires_at);
  IdempotencyGuard<typename TypeParam::Store> guard{store};
  auto g = guard.run(k, "fp", [](Tx&) { return std::string("never"); });
  ASSERT_EQ(Outcome::kReplayed, g.outcome);
  EXPECT_TRUE(within(g.expires_at)) << to_millis(g.expires_at);
}

// A lease or retention longer than kMaxTerm ("forever" spelled seconds::max()) is refused
// before anything runs, by the store and by the guard: "now" plus it would overflow into the
// past (a record born expired, a duplicate run again). kMaxTerm itself works.
TYPED_TEST_P(DurableStoreConformance, TermsLongerThanTheLongestAreRefusedBeforeAnythingRuns) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto& store = *this->store_;
  auto k = this->key();
  int ran = 0;
  auto handler = [&](Tx&) {
    ++ran;
    return std::string("r");
  };
  const auto too_long = kMaxTerm + std::chrono::seconds(1);
  EXPECT_THROW((void)store.run_transactional(k, "fp", OwnerToken::generate(),
                                             std::chrono::seconds::max(), handler),
               UsageError);
  EXPECT_THROW((void)store.run_transactional(k, "fp", OwnerToken::generate(), too_long, handler),
               UsageError);
  EXPECT_THROW((void)store.begin(k, "fp", OwnerToken::generate(), std::chrono::milliseconds::max()),
               UsageError);
  EXPECT_EQ(0, ran);
  EXPECT_FALSE(store.lookup(k).has_value());
  const auto owner = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, store.begin(k, "fp", owner, this->lease_).status);
  EXPECT_THROW((void)store.complete(k, owner, "r", std::chrono::seconds::max()), UsageError);
  EXPECT_THROW((void)store.fail(k, owner, "r", too_long), UsageError);
  EXPECT_EQ(Record::Status::kInProgress, store.lookup(k)->status);
  EXPECT_TRUE(store.complete(k, owner, "r", kMaxTerm));
  auto replay = store.run_transactional(k, "fp", OwnerToken::generate(), kMaxTerm, handler);
  EXPECT_EQ(TransactionalStatus::kReplayed, replay.status);
  EXPECT_EQ(0, ran);

  IdempotencyGuard<typename TypeParam::Store> guard{store};
  CallOptions forever;
  forever.retention = std::chrono::seconds::max();
  EXPECT_THROW((void)guard.run(this->key("other"), "fp", forever, handler), UsageError);
  CallOptions never_taken_over;
  never_taken_over.lease = std::chrono::milliseconds::max();
  EXPECT_THROW((void)guard.run(this->key("other"), "fp", never_taken_over, handler), UsageError);
  GuardOptions options;
  options.retention = too_long;
  EXPECT_THROW((IdempotencyGuard<typename TypeParam::Store>{store, options}), UsageError);
  EXPECT_EQ(0, ran);
}

TYPED_TEST_P(DurableStoreConformance, HostileIdsAreStoredVerbatim) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto& store = *this->store_;
  auto before = TypeParam::count_records(store);
  std::vector<std::string> ids = {"';DROP_TABLE_api_idempotency;--",
                                  "'; DROP TABLE api_idempotency;--",
                                  "quote'\"back\\slash", "$1", "?", "%_*"};
  for (auto& id : ids) {
    if (id.find(' ') != std::string::npos) {
      EXPECT_THROW((void)Key::make("payment", id), InvalidKey);
      continue;
    }
    auto k = Key::make("payment", id + unique_name("_"));
    auto r = store.run_transactional(k, "fp", OwnerToken::generate(), this->retention_,
                                     [&](Tx& tx) {
                                       TypeParam::insert_effect(tx, k.id());
                                       return k.id();
                                     });
    EXPECT_EQ(TransactionalStatus::kCommitted, r.status);
    auto rec = store.lookup(k);
    ASSERT_TRUE(rec.has_value()) << id;
    EXPECT_EQ(k.id(), rec->response);
    EXPECT_EQ(1, TypeParam::count_effects(store, k.id()));
  }
  EXPECT_EQ(before + 5, TypeParam::count_records(store));  // the table is intact
}

TYPED_TEST_P(DurableStoreConformance, PurgeDeletesExpiredCompletedRowsOnly) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto& store = *this->store_;
  std::vector<Key> done;
  for (int i = 0; i < 5; ++i) {
    done.push_back(this->key());
    (void)store.run_transactional(done.back(), "", OwnerToken::generate(),
                                  std::chrono::seconds(1), [](Tx&) { return std::string(); });
  }
  auto live = this->key();
  ASSERT_EQ(ClaimStatus::kClaimed,
            store.begin(live, "", OwnerToken::generate(), std::chrono::milliseconds(100))
                .status);
  auto kept = this->key();
  (void)store.run_transactional(kept, "", OwnerToken::generate(), this->retention_,
                                [](Tx&) { return std::string(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_GE(store.purge_expired(2), 5u);
  for (auto& k : done) EXPECT_FALSE(store.lookup(k).has_value());
  EXPECT_TRUE(store.lookup(live).has_value());  // in progress (even with its lease over)
  EXPECT_TRUE(store.lookup(kept).has_value());
}

TYPED_TEST_P(DurableStoreConformance, GuardDurableOnlyStormRunsOnce) {
  IdempotencyGuard<typename TypeParam::Store> guard{*this->store_};
  this->storm(guard, true);
}

// DurableHint::expected_response may only save the store a statement: the record is the same
// whether the handler's response is the expected one or not, a failing handler leaves nothing,
// and a duplicate, a mismatch and a replay are answered as without the hint.
TYPED_TEST_P(DurableStoreConformance, ExpectedResponseHintNeverChangesAnAnswer) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto& store = *this->store_;
  DurableHint hint;
  hint.likely_new = true;
  const std::string marker = "consumed";
  hint.expected_response = marker;
  int runs = 0;
  auto handler = [&](const Key& k, std::string response) {
    return [&runs, &k, response](Tx& tx) {
      ++runs;
      TypeParam::insert_effect(tx, k.id());
      return response;
    };
  };
  // The expected response: committed, stored, replayed (with and without the hint).
  auto as_expected = this->key();
  auto owner = OwnerToken::generate();
  auto r = store.run_transactional(as_expected, "fp", owner, this->retention_,
                                   handler(as_expected, marker), hint);
  EXPECT_EQ(TransactionalStatus::kCommitted, r.status);
  EXPECT_EQ(marker, r.response);
  auto rec = store.lookup(as_expected);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(Record::Status::kCompleted, rec->status);
  EXPECT_EQ(marker, rec->response);
  EXPECT_EQ("fp", rec->fingerprint);
  for (const DurableHint& h : {hint, DurableHint{}}) {
    auto again = store.run_transactional(as_expected, "fp", OwnerToken::generate(),
                                         this->retention_, handler(as_expected, "again"), h);
    EXPECT_EQ(TransactionalStatus::kReplayed, again.status);
    EXPECT_EQ(marker, again.response);
    EXPECT_EQ(owner.str(), again.holder);
    auto other = store.run_transactional(as_expected, "other", OwnerToken::generate(),
                                         this->retention_, handler(as_expected, "never"), h);
    EXPECT_EQ(TransactionalStatus::kMismatch, other.status);
  }
  EXPECT_EQ(1, runs);
  EXPECT_EQ(1, TypeParam::count_effects(store, as_expected.id()));

  // Another response (binary, longer): it is what the record holds and replays.
  auto differs = this->key();
  const std::string actual =
      std::string("receipt") + '\0' + '\xff' + " with more bytes than the expected one";
  r = store.run_transactional(differs, "fp", OwnerToken::generate(), this->retention_,
                              handler(differs, actual), hint);
  EXPECT_EQ(TransactionalStatus::kCommitted, r.status);
  EXPECT_EQ(actual, r.response);
  rec = store.lookup(differs);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(Record::Status::kCompleted, rec->status);
  EXPECT_EQ(actual, rec->response);
  auto replay = store.run_transactional(differs, "fp", OwnerToken::generate(), this->retention_,
                                        handler(differs, marker), hint);
  EXPECT_EQ(TransactionalStatus::kReplayed, replay.status);
  EXPECT_EQ(actual, replay.response);
  EXPECT_EQ(2, runs);
  EXPECT_EQ(1, TypeParam::count_effects(store, differs.id()));

  // A failing handler: nothing is left, and the retry runs and commits.
  auto failing = this->key();
  EXPECT_THROW(store.run_transactional(failing, "fp", OwnerToken::generate(), this->retention_,
                                       [&](Tx& tx) -> std::string {
                                         TypeParam::insert_effect(tx, failing.id());
                                         throw std::runtime_error("declined");
                                       },
                                       hint),
               std::runtime_error);
  EXPECT_FALSE(store.lookup(failing).has_value());
  EXPECT_EQ(0, TypeParam::count_effects(store, failing.id()));
  r = store.run_transactional(failing, "fp", OwnerToken::generate(), this->retention_,
                              handler(failing, marker), hint);
  EXPECT_EQ(TransactionalStatus::kCommitted, r.status);
  EXPECT_EQ(1, TypeParam::count_effects(store, failing.id()));

  // A crashed two-phase attempt's expired lease is taken over, then completed as usual.
  auto crashed = this->key();
  ASSERT_EQ(ClaimStatus::kClaimed,
            store.begin(crashed, "fp", OwnerToken::generate(), std::chrono::milliseconds(50))
                .status);
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  r = store.run_transactional(crashed, "fp", OwnerToken::generate(), this->retention_,
                              handler(crashed, marker), hint);
  EXPECT_EQ(TransactionalStatus::kCommitted, r.status);
  EXPECT_TRUE(r.took_over);
  rec = store.lookup(crashed);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(Record::Status::kCompleted, rec->status);
  EXPECT_EQ(marker, rec->response);
}

TYPED_TEST_P(DurableStoreConformance, GuardStormWithAnExpectedResponseRunsOnce) {
  IdempotencyGuard<typename TypeParam::Store> durable_only{*this->store_};
  this->storm(durable_only, true, true);
  MemoryStore fast;
  IdempotencyGuard guard{fast, *this->store_};
  this->storm(guard, true, true);
}

TYPED_TEST_P(DurableStoreConformance, GuardMemoryPlusDurableStormRunsOnce) {
  MemoryStore fast;
  IdempotencyGuard guard{fast, *this->store_};
  this->storm(guard, true);
  EXPECT_GE(guard.stats().snapshot().fast_hits, 1u);
}

TYPED_TEST_P(DurableStoreConformance, GuardTwoPhaseStormRunsOnce) {
  MemoryStore fast;
  IdempotencyGuard guard{fast, *this->store_};
  this->storm(guard, false);
  IdempotencyGuard<typename TypeParam::Store> durable_only{*this->store_};
  this->storm(durable_only, false);
}

TYPED_TEST_P(DurableStoreConformance, FastStoreFailingEveryCallStillExactlyOnce) {
  MemoryStore memory;
  SwitchableFastStore fast(memory);
  fast.failing = true;
  IdempotencyGuard guard{static_cast<FastStore&>(fast), *this->store_};
  this->storm(guard, true);
  auto s = guard.stats().snapshot();
  EXPECT_GE(s.degraded, 32u);
  EXPECT_EQ(0u, s.fast_hits);
}

TYPED_TEST_P(DurableStoreConformance, FastStoreThatLostTheRecordIsRefilled) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto k = this->key();
  int runs = 0;
  {
    MemoryStore fast;
    IdempotencyGuard guard{fast, *this->store_};
    auto r = guard.run(k, "fp", [&](Tx& tx) {
      ++runs;
      TypeParam::insert_effect(tx, k.id());
      return std::string("first");
    });
    EXPECT_EQ(Outcome::kExecuted, r.outcome);
  }
  MemoryStore fresh;  // a Redis that lost its data (flush, failover)
  IdempotencyGuard guard{fresh, *this->store_};
  auto r = guard.run(k, "fp", [&](Tx&) { ++runs; return std::string("second"); });
  EXPECT_EQ(Outcome::kReplayed, r.outcome);
  EXPECT_EQ(Source::kDurableStore, r.source);
  EXPECT_EQ("first", r.value.value());
  EXPECT_EQ(1u, guard.stats().snapshot().durable_conflicts);
  auto refilled = fresh.lookup(k);
  ASSERT_TRUE(refilled.has_value());
  EXPECT_EQ("first", refilled->response);
  EXPECT_NE(0, to_millis(r.first_seen)) << "the record's creation";
  auto third = guard.run(k, "fp", [&](Tx&) { ++runs; return std::string("third"); });
  EXPECT_EQ(Source::kFastStore, third.source);
  EXPECT_EQ(to_millis(r.first_seen), to_millis(third.first_seen))
      << "the write-back keeps when the first attempt began";
  EXPECT_EQ(r.holder, third.holder) << "and who ran it";
  EXPECT_EQ(1, runs);
  EXPECT_EQ(1, TypeParam::count_effects(*this->store_, k.id()));
}

TYPED_TEST_P(DurableStoreConformance, GuardHandlerThrowsThenRetryRuns) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  MemoryStore fast;
  IdempotencyGuard guard{fast, *this->store_};
  auto k = this->key();
  EXPECT_THROW((void)guard.run(k, "", [&](Tx& tx) -> std::string {
    TypeParam::insert_effect(tx, k.id());
    throw std::runtime_error("boom");
  }),
               std::runtime_error);
  EXPECT_EQ(0, TypeParam::count_effects(*this->store_, k.id()));
  auto retry = guard.run(k, "", [&](Tx& tx) {
    TypeParam::insert_effect(tx, k.id());
    return std::string("ok");
  });
  EXPECT_EQ(Outcome::kExecuted, retry.outcome);
  EXPECT_EQ(1, TypeParam::count_effects(*this->store_, k.id()));
  // Two-phase: the durable claim is released too.
  auto k2 = this->key();
  EXPECT_THROW((void)guard.run(k2, "", []() -> std::string { throw std::runtime_error("x"); }),
               std::runtime_error);
  EXPECT_FALSE(this->store_->lookup(k2).has_value());
  EXPECT_EQ(Outcome::kExecuted, guard.run(k2, "", [] { return std::string("y"); }).outcome);
}

// A handler that reassigns the Key and fingerprint it was passed (section "the call owns what
// it acquired"): in both modes, durable only and with a fast store in front, one effect, the
// acquired key completed with its own fingerprint, nothing under the other key, and the replay
// works.
TYPED_TEST_P(DurableStoreConformance,
             HandlerReassigningItsKeyAndFingerprintCompletesTheAcquiredKey) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto& store = *this->store_;
  for (int shape = 0; shape < 4; ++shape) {
    const bool with_fast = (shape & 1) != 0;
    const bool transactional = (shape & 2) != 0;
    SCOPED_TRACE(std::string(with_fast ? "memory + " : "") + std::string(store.name()) +
                 (transactional ? ", transactional" : ", two-phase"));
    auto acquired = this->key();
    auto other = Key::make("payment", acquired.id() + "_other");
    const std::string fp = heap_fingerprint(acquired.id());
    int runs = 0;
    MemoryStore fast;
    auto check = [&](auto& guard) {
      GuardResult<std::string> r;
      if (transactional) {
        r = run_reassigning<Tx>(guard, acquired, other, fp, runs,
                                [&](Tx& tx) { TypeParam::insert_effect(tx, acquired.id()); });
      } else {
        r = run_reassigning<void>(guard, acquired, other, fp, runs, [] {});
      }
      EXPECT_EQ(Outcome::kExecuted, r.outcome);
      EXPECT_EQ("pay", r.value.value_or("<none>"));
      EXPECT_EQ(1, runs);
      expect_acquired_key_completed(store, acquired, other, fp);
      if (with_fast) expect_acquired_key_completed(fast, acquired, other, fp);
      if (transactional) expect_replay<Tx>(guard, acquired, fp, runs);
      if (!transactional) expect_replay<void>(guard, acquired, fp, runs);
      EXPECT_EQ(transactional ? 1 : 0, TypeParam::count_effects(store, acquired.id()));
      EXPECT_EQ(0, TypeParam::count_effects(store, other.id()));
      EXPECT_EQ(0u, guard.stats().snapshot().leases_lost);
    };
    try {  // every shape runs, whichever fails
      if (with_fast) {
        IdempotencyGuard guard{fast, store};
        check(guard);
      } else {
        IdempotencyGuard<typename TypeParam::Store> guard{store};
        check(guard);
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  }
}

REGISTER_TYPED_TEST_SUITE_P(DurableStoreConformance, TransactionalRunCommitsRecordAndEffectTogether,
                            HandlerThrowsRollsBackEverything, MismatchWinsOverReplayAndInProgress,
                            TwoPhaseLeaseExpiryFencesTheStaleOwner, TwoPhaseReleaseLetsARetryRun,
                            FailedRecordAndRetriedBeginFollowTheRulebook, ResponsesAreByteIdentical,
                            FingerprintsOfAnyBytesAreKeptExactly,
                            ReplaysReportWhenTheirRecordExpires,
                            TermsLongerThanTheLongestAreRefusedBeforeAnythingRuns,
                            HostileIdsAreStoredVerbatim, PurgeDeletesExpiredCompletedRowsOnly,
                            GuardDurableOnlyStormRunsOnce, GuardMemoryPlusDurableStormRunsOnce,
                            GuardTwoPhaseStormRunsOnce, FastStoreFailingEveryCallStillExactlyOnce,
                            FastStoreThatLostTheRecordIsRefilled, GuardHandlerThrowsThenRetryRuns,
                            HandlerReassigningItsKeyAndFingerprintCompletesTheAcquiredKey,
                            ExpectedResponseHintNeverChangesAnAnswer,
                            GuardStormWithAnExpectedResponseRunsOnce);

}  // namespace idem::test
