// SPDX-License-Identifier: MIT
// One typed suite for IdempotentConsumer on every durable store (the mq_consume_record preset
// and the store's attempt ledger): one effect per message id under concurrent redeliveries,
// single and in batches, poison messages dead-lettered after max_attempts across a consumer
// restart, mismatches, no failure count lost between threads, a record held by another
// transaction answered "retry later" for that message alone. Each test runs with an in-process
// fast store in front and without one.
//
// A Traits type provides:
//   using Store = ...;                                       // the durable store
//   static const char* env_var();                            // null: no server needed
//   static std::unique_ptr<Store> make_store();              // mq_consume_record preset
//   static std::unique_ptr<Store> make_store_short_lock_wait(); // ... whose lock waits end soon
//   static std::shared_ptr<AttemptLedger> make_ledger(Store&);
//   static void insert_effect(typename Store::Transaction&, const std::string& id);
//   static long count_effects(const std::string& id);
//   static long completed_records(const std::string& group);  // mq_consume_record rows
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/consumer.hpp"
#include "idem/memory_store.hpp"
#include "support/test_env.hpp"

namespace idem::test {

template <class Traits>
class MqConformance : public ::testing::Test {
 protected:
  using StoreType = typename Traits::Store;
  using TxType = typename StoreType::Transaction;
  using GuardType = IdempotencyGuard<StoreType>;

  void SetUp() override {
    std::string value;
    if (Traits::env_var() != nullptr) IDEM_REQUIRE_ENV(value, Traits::env_var());
    store_ = Traits::make_store();
  }

  // A guard over `store` (mq_record duplicates, 10 s lease), `fast` in front when not null.
  static std::unique_ptr<GuardType> make_guard(StoreType& store, FastStore* fast) {
    GuardOptions go;
    go.durable_source = DuplicateSource::kMqRecord;
    go.lease = std::chrono::seconds(10);
    if (fast == nullptr) return std::make_unique<GuardType>(store, go);
    return std::make_unique<GuardType>(*fast, store, go);
  }

  ConsumerOptions options(StoreType& store) {
    ConsumerOptions co;
    co.max_attempts = 3;
    co.attempts = Traits::make_ledger(store);
    co.dead_letter = [this](const DeadLetter& d) {
      std::lock_guard<std::mutex> lock(dead_mutex_);
      dead_.push_back(d);
    };
    return co;
  }

  // Runs `body(guard, group)` with MemoryStore in front, then durable only.
  template <class Body>
  void both(Body&& body) {
    for (bool with_fast : {true, false}) {
      SCOPED_TRACE(with_fast ? "memory fast store in front" : "durable store only");
      MemoryStore fast;
      auto guard = make_guard(*store_, with_fast ? &fast : nullptr);
      dead_.clear();
      body(*guard, unique_name("billing"));
    }
  }

  std::vector<Verdict> batch(IdempotentConsumer<StoreType>& consumer,
                             const std::vector<std::string>& ids, const std::string& poison = "",
                             std::map<std::string, int>* calls = nullptr) {
    std::vector<std::string> fps;
    for (const auto& id : ids) fps.push_back(fingerprint("body of " + id));
    std::vector<Delivery> deliveries;
    for (std::size_t i = 0; i < ids.size(); ++i) deliveries.push_back(Delivery{ids[i], fps[i]});
    return consumer.consume_batch(deliveries, [&](TxType& tx, std::size_t i) {
      if (calls != nullptr) ++(*calls)[ids[i]];
      Traits::insert_effect(tx, ids[i]);
      if (ids[i] == poison) throw std::runtime_error("poison " + ids[i]);
    });
  }

  std::unique_ptr<StoreType> store_;
  std::mutex dead_mutex_;
  std::vector<DeadLetter> dead_;
};

TYPED_TEST_SUITE_P(MqConformance);

TYPED_TEST_P(MqConformance, EightThreadsRedeliveringFortyIdsApplyEachOnce) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  this->both([&](auto& guard, const std::string& group) {
    IdempotentConsumer<typename TypeParam::Store> consumer{guard, group,
                                                           this->options(*this->store_)};
    std::vector<std::string> ids;
    for (int i = 0; i < 40; ++i) ids.push_back(unique_name("order") + ":paid:v1");
    std::atomic<int> acked{0}, duplicates{0}, retries{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        auto order = ids;
        std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(t)));
        for (const auto& id : order) {
          const std::string body = "{\"id\":\"" + id + "\"}";
          const std::string fp = fingerprint(body);
          for (std::uint32_t count = 1;; ++count) {  // redeliver until the loop may ack
            Verdict v = Verdict::kRetryLater;
            try {
              v = consumer.consume(Delivery{id, fp, body, count},
                                   [&](Tx& tx) { TypeParam::insert_effect(tx, id); });
            } catch (const std::exception& e) {
              ADD_FAILURE() << e.what();
              return;
            }
            if (v == Verdict::kAck) ++acked;
            if (v == Verdict::kAckDuplicate) ++duplicates;
            if (v != Verdict::kRetryLater) {
              EXPECT_TRUE(should_ack(v)) << verdict_name(v);
              break;
            }
            ++retries;
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(40, acked.load());
    EXPECT_EQ(8 * 40 - 40, duplicates.load());
    for (const auto& id : ids) EXPECT_EQ(1, TypeParam::count_effects(id)) << id;
    EXPECT_EQ(static_cast<std::uint64_t>(retries.load()), consumer.stats().snapshot().retry_later);
    EXPECT_TRUE(this->dead_.empty());
    EXPECT_EQ(40, TypeParam::completed_records(group));
  });
}

TYPED_TEST_P(MqConformance, PoisonMessageIsDeadLetteredAfterThreeAttemptsAcrossARestart) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  using Store = typename TypeParam::Store;  // NOLINT
  this->both([&](auto& guard, const std::string& group) {
    const std::string poison = unique_name("poison");
    const std::string good = unique_name("good");
    auto fail = [](Tx&) { throw std::runtime_error("cannot apply"); };
    {
      IdempotentConsumer<Store> consumer{guard, group, this->options(*this->store_)};
      EXPECT_EQ(Verdict::kRetryLater, consumer.consume(Delivery{poison, "fp", "p", 1}, fail));
      EXPECT_EQ(Verdict::kAck, consumer.consume(Delivery{good, "fp", "g", 1}, [&](Tx& tx) {
        TypeParam::insert_effect(tx, good);
      }));
      EXPECT_EQ(Verdict::kRetryLater, consumer.consume(Delivery{poison, "fp", "p", 2}, fail));
    }
    // A restarted consumer (new objects) continues from the two stored failures.
    IdempotentConsumer<Store> consumer{guard, group, this->options(*this->store_)};
    EXPECT_EQ(Verdict::kDeadLetter, consumer.consume(Delivery{poison, "fp", "p", 3}, fail));
    ASSERT_EQ(1u, this->dead_.size());
    EXPECT_EQ(poison, this->dead_[0].message_id);
    EXPECT_EQ(3u, this->dead_[0].attempts);
    EXPECT_EQ("p", this->dead_[0].payload);
    EXPECT_NE(std::string::npos, this->dead_[0].error.find("cannot apply"));
    bool ran = false;
    EXPECT_EQ(Verdict::kAckDuplicate,
              consumer.consume(Delivery{poison, "fp", "p", 4}, [&](Tx&) { ran = true; }));
    EXPECT_FALSE(ran);
    auto rec = this->store_->lookup(Key::make(group, poison));
    ASSERT_TRUE(rec.has_value());
    EXPECT_EQ(Record::Status::kFailed, rec->status);
    EXPECT_EQ(0u, TypeParam::make_ledger(*this->store_)->failures(Key::make(group, poison)));
    EXPECT_EQ(1, TypeParam::count_effects(good));
  });
}

TYPED_TEST_P(MqConformance, SameIdWithAnotherBodyIsAMismatchAndRunsNothing) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  this->both([&](auto& guard, const std::string& group) {
    IdempotentConsumer<typename TypeParam::Store> consumer{guard, group,
                                                           this->options(*this->store_)};
    const std::string id = unique_name("msg");
    EXPECT_EQ(Verdict::kAck, consumer.consume(Delivery{id, fingerprint("a"), "a", 1},
                                              [&](Tx& tx) { TypeParam::insert_effect(tx, id); }));
    EXPECT_EQ(Verdict::kMismatch,
              consumer.consume(Delivery{id, fingerprint("b"), "b", 1},
                               [&](Tx& tx) { TypeParam::insert_effect(tx, id); }));
    EXPECT_EQ(1, TypeParam::count_effects(id));
  });
}

TYPED_TEST_P(MqConformance, AttemptLedgerLosesNoFailureUnderSixteenThreads) {
  auto ledger = TypeParam::make_ledger(*this->store_);
  auto key = Key::make("billing", unique_name("msg"));
  constexpr int kThreads = 16, kEach = 10;
  std::mutex mutex;
  std::set<std::uint32_t> answers;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) {
        auto n = ledger->record_failure(key, "boom \xff\n");
        std::lock_guard<std::mutex> lock(mutex);
        answers.insert(n);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(static_cast<std::size_t>(kThreads * kEach), answers.size());  // 1 .. 160, each once
  EXPECT_EQ(1u, *answers.begin());
  EXPECT_EQ(static_cast<std::uint32_t>(kThreads * kEach), *answers.rbegin());
  auto restarted = TypeParam::make_ledger(*this->store_);
  EXPECT_EQ(static_cast<std::uint32_t>(kThreads * kEach), restarted->failures(key));
  restarted->clear(key);
  EXPECT_EQ(0u, ledger->failures(key));
}

TYPED_TEST_P(MqConformance, BatchAppliesEachIdOnceInsideAndAcrossBatches) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  this->both([&](auto& guard, const std::string& group) {
    IdempotentConsumer<typename TypeParam::Store> consumer{guard, group,
                                                           this->options(*this->store_)};
    const std::string u = unique_name("b");
    const std::string a = u + "-a", b = u + "-\"b\\{x},y'", c = u + "-c", d = u + "-d";
    EXPECT_EQ(Verdict::kAck, consumer.consume(Delivery{c, fingerprint("body of " + c)},
                                              [&](Tx& tx) { TypeParam::insert_effect(tx, c); }));
    EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kAck, Verdict::kAckDuplicate,
                                    Verdict::kAckDuplicate}),
              this->batch(consumer, {a, b, a, c}));
    EXPECT_EQ((std::vector<Verdict>{Verdict::kAckDuplicate, Verdict::kAck}),
              this->batch(consumer, {b, d}));
    for (const auto& id : {a, b, c, d}) EXPECT_EQ(1, TypeParam::count_effects(id)) << id;
    for (const auto& id : {a, b, d}) {
      auto rec = this->store_->lookup(Key::make(group, id));
      ASSERT_TRUE(rec.has_value()) << id;
      EXPECT_EQ(Record::Status::kCompleted, rec->status);
      EXPECT_EQ(fingerprint("body of " + id), rec->fingerprint);
    }
    EXPECT_EQ(Verdict::kAckDuplicate,
              consumer.consume(Delivery{b, fingerprint("body of " + b)},
                               [&](Tx& tx) { TypeParam::insert_effect(tx, b); }));
    EXPECT_EQ(Verdict::kMismatch,
              consumer.consume(Delivery{d, fingerprint("another body")},
                               [&](Tx& tx) { TypeParam::insert_effect(tx, d); }));
  });
}

TYPED_TEST_P(MqConformance, BatchWithAFailingHandlerRerunsWithSavepoints) {
  this->both([&](auto& guard, const std::string& group) {
    IdempotentConsumer<typename TypeParam::Store> consumer{guard, group,
                                                           this->options(*this->store_)};
    const std::string u = unique_name("f");
    const std::string x = u + "-x", bad = u + "-bad", y = u + "-y";
    std::map<std::string, int> calls;
    EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kRetryLater, Verdict::kAck}),
              this->batch(consumer, {x, bad, y}, bad, &calls));
    EXPECT_EQ(1u, consumer.stats().snapshot().batch_reruns);
    EXPECT_EQ(2, calls[x]);  // its first run was rolled back with the batch
    EXPECT_EQ(1, TypeParam::count_effects(x));
    EXPECT_EQ(1, TypeParam::count_effects(y));
    EXPECT_EQ(0, TypeParam::count_effects(bad));
    EXPECT_FALSE(this->store_->lookup(Key::make(group, bad)).has_value());
    // The poison message ends in the dead-letter sink after max_attempts (3).
    this->batch(consumer, {bad}, bad);
    EXPECT_EQ((std::vector<Verdict>{Verdict::kDeadLetter}), this->batch(consumer, {bad}, bad));
    ASSERT_EQ(1u, this->dead_.size());
    EXPECT_EQ(bad, this->dead_[0].message_id);
    EXPECT_EQ((std::vector<Verdict>{Verdict::kAckDuplicate}), this->batch(consumer, {bad}, bad));
  });
}

TYPED_TEST_P(MqConformance, EightThreadsOfOverlappingBatchesApplyEachIdOnce) {
  this->both([&](auto& guard, const std::string& group) {
    IdempotentConsumer<typename TypeParam::Store> consumer{guard, group,
                                                           this->options(*this->store_)};
    std::vector<std::string> ids;
    for (int i = 0; i < 40; ++i) ids.push_back(unique_name("o") + ":paid:v1");
    std::atomic<int> acked{0};
    std::atomic<int> redelivered_after_error{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        auto order = ids;
        std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(t)));
        for (std::size_t from = 0; from < order.size(); from += 10) {
          std::vector<std::string> pending(order.begin() + static_cast<std::ptrdiff_t>(from),
                                           order.begin() + static_cast<std::ptrdiff_t>(from + 10));
          while (!pending.empty()) {  // redeliver what answered retry_later
            std::vector<Verdict> verdicts;
            try {
              verdicts = this->batch(consumer, pending);
            } catch (const idem::Error& e) {
              // A retryable store failure (MySQL: deadlocks past max_retries re-runs between
              // the overlapping batches) is the consumer's "do not ack": the broker redelivers
              // the whole batch. Anything else fails the test.
              if (!e.retryable() || ++redelivered_after_error > 20) {
                ADD_FAILURE() << e.what();
                return;
              }
              continue;
            } catch (const std::exception& e) {
              ADD_FAILURE() << e.what();
              return;
            }
            std::vector<std::string> again;
            for (std::size_t i = 0; i < pending.size(); ++i) {
              if (verdicts[i] == Verdict::kAck) ++acked;
              if (verdicts[i] == Verdict::kRetryLater) again.push_back(pending[i]);
              EXPECT_TRUE(verdicts[i] == Verdict::kAck || verdicts[i] == Verdict::kAckDuplicate ||
                          verdicts[i] == Verdict::kRetryLater)
                  << verdict_name(verdicts[i]);
            }
            pending = std::move(again);
            if (!pending.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(40, acked.load());
    for (const auto& id : ids) EXPECT_EQ(1, TypeParam::count_effects(id)) << id;
    EXPECT_TRUE(this->dead_.empty());
  });
}

// A record held by another open transaction: the batch's record insert waits on it; past the
// store's lock wait the batch runs again one delivery at a time and only that one answers
// "retry later".
TYPED_TEST_P(MqConformance, BatchWithARecordLockedElsewhereAnswersRetryLaterForItAlone) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  using Store = typename TypeParam::Store;  // NOLINT
  if constexpr (!TypeParam::kConcurrentWriters) {
    GTEST_SKIP() << "one write transaction at a time: no record can be held elsewhere";
  }
  auto store = TypeParam::make_store_short_lock_wait();
  auto guard = TestFixture::make_guard(*store, nullptr);
  IdempotentConsumer<Store> consumer{*guard, unique_name("billing"), this->options(*store)};
  const std::string group = consumer.group();
  const std::string u = unique_name("l");
  const std::string held = u + "-held", free = u + "-free";
  std::promise<void> holding, done;
  std::atomic<bool> rolled_back{false};
  std::thread holder([&] {
    try {
      store->with_transaction([&](Tx& tx) {
        auto c = store->claim_in(tx, Key::make(group, held), fingerprint("body of " + held),
                                 OwnerToken::generate(), std::chrono::milliseconds(0));
        EXPECT_EQ(ClaimStatus::kClaimed, c.status);
        holding.set_value();
        done.get_future().wait();
        throw std::runtime_error("roll back");  // the holder gives up
      });
    } catch (const std::runtime_error&) {
      rolled_back = true;
    }
  });
  holding.get_future().wait();
  std::vector<Verdict> v;
  try {
    v = this->batch(consumer, {free, held});
  } catch (...) {
    done.set_value();
    holder.join();
    throw;
  }
  done.set_value();
  holder.join();
  EXPECT_TRUE(rolled_back.load());
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kRetryLater}), v);
  EXPECT_EQ(1, TypeParam::count_effects(free));
  EXPECT_EQ(0, TypeParam::count_effects(held));
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck}), this->batch(consumer, {held}));
  EXPECT_EQ(1, TypeParam::count_effects(held));
}

REGISTER_TYPED_TEST_SUITE_P(MqConformance, EightThreadsRedeliveringFortyIdsApplyEachOnce,
                            PoisonMessageIsDeadLetteredAfterThreeAttemptsAcrossARestart,
                            SameIdWithAnotherBodyIsAMismatchAndRunsNothing,
                            AttemptLedgerLosesNoFailureUnderSixteenThreads,
                            BatchAppliesEachIdOnceInsideAndAcrossBatches,
                            BatchWithAFailingHandlerRerunsWithSavepoints,
                            EightThreadsOfOverlappingBatchesApplyEachIdOnce,
                            BatchWithARecordLockedElsewhereAnswersRetryLaterForItAlone);

}  // namespace idem::test
