// SPDX-License-Identifier: MIT
// IdempotentConsumer over PostgresStore (the mq_consume_record preset) and the PostgreSQL
// attempt ledger, on the real server (Redis in front where IDEM_TEST_REDIS_URL is set): one
// effect row per message id under concurrent redeliveries, poison messages dead-lettered after
// max_attempts across a consumer restart, no failure count lost between threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "idem/consumer.hpp"
#include "idem/memory_store.hpp"
#include "idem/postgres/attempt_ledger.hpp"
#include "idem/redis/redis_store.hpp"
#include "pg_test_support.hpp"

namespace {

namespace pg = idem::test::pg;
using idem::Verdict;
using idem::postgres::PostgresAttemptLedger;
using idem::postgres::PostgresStore;
using idem::postgres::PostgresStoreOptions;

PostgresStoreOptions mq_options() {
  auto o = PostgresStoreOptions::mq_consume_record(pg::dsn());
  o.schema = pg::Schema::name();
  o.pool_size = 40;
  return o;
}

long effects_of(const std::string& id) {
  return pg::count_where("idem_test_effects", "key_id", id);
}

TEST(PostgresAttemptLedger, SixteenThreadsLoseNoFailureAndTheCountSurvivesARestart) {
  IDEM_REQUIRE_POSTGRES();
  PostgresStore store{mq_options()};
  PostgresAttemptLedger ledger{store};
  EXPECT_EQ(pg::Schema::name() + ".mq_consume_attempt", ledger.table());
  auto key = idem::Key::make("billing", idem::test::unique_name("msg"));
  constexpr int kThreads = 16, kEach = 10;
  std::mutex mutex;
  std::set<std::uint32_t> answers;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) {
        auto n = ledger.record_failure(key, "boom \xff\n");
        std::lock_guard<std::mutex> lock(mutex);
        answers.insert(n);
      }
    });
  }
  for (auto& th : threads) th.join();
  // Every upsert saw a distinct count: 1 .. 160.
  EXPECT_EQ(static_cast<std::size_t>(kThreads * kEach), answers.size());
  EXPECT_EQ(1u, *answers.begin());
  EXPECT_EQ(static_cast<std::uint32_t>(kThreads * kEach), *answers.rbegin());

  PostgresAttemptLedger restarted{store};
  EXPECT_EQ(static_cast<std::uint32_t>(kThreads * kEach), restarted.failures(key));
  restarted.clear(key);
  EXPECT_EQ(0u, ledger.failures(key));
  EXPECT_THROW(PostgresAttemptLedger(store, "bad name"), idem::UsageError);
}

// The consumer with or without Redis in front.
class ConsumerPg : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_POSTGRES();
    if (GetParam()) {
      std::string url;
      IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_URL");
      idem::redis::RedisStoreOptions ro{url};
      ro.key_prefix = idem::test::unique_name("consumer_pg") + ":";
      fast_ = std::make_unique<idem::redis::RedisStore>(ro);
    }
    durable_ = std::make_unique<PostgresStore>(mq_options());
    guard_ = make_guard(fast_.get());
    group_ = idem::test::unique_name("billing");
  }

  // A guard over durable_ (mq_record duplicates, 10 s lease), `fast` in front when not null.
  std::unique_ptr<idem::IdempotencyGuard<PostgresStore>> make_guard(idem::FastStore* fast) {
    idem::GuardOptions go;
    go.durable_source = idem::DuplicateSource::kMqRecord;
    go.lease = std::chrono::seconds(10);
    if (fast == nullptr)
      return std::make_unique<idem::IdempotencyGuard<PostgresStore>>(*durable_, go);
    return std::make_unique<idem::IdempotencyGuard<PostgresStore>>(*fast, *durable_, go);
  }

  idem::ConsumerOptions options(std::vector<idem::DeadLetter>* dead) {
    idem::ConsumerOptions co;
    co.max_attempts = 3;
    co.attempts = std::make_shared<PostgresAttemptLedger>(*durable_);
    co.dead_letter = [this, dead](const idem::DeadLetter& d) {
      std::lock_guard<std::mutex> lock(dead_mutex_);
      dead->push_back(d);
    };
    return co;
  }

  std::unique_ptr<idem::redis::RedisStore> fast_;
  std::unique_ptr<PostgresStore> durable_;
  std::unique_ptr<idem::IdempotencyGuard<PostgresStore>> guard_;
  std::string group_;
  std::mutex dead_mutex_;
};

TEST_P(ConsumerPg, EightThreadsRedeliveringFortyIdsApplyEachOnce) {
  std::vector<idem::DeadLetter> dead;
  idem::IdempotentConsumer<PostgresStore> consumer{*guard_, group_, options(&dead)};
  std::vector<std::string> ids;
  for (int i = 0; i < 40; ++i) ids.push_back(idem::test::unique_name("order") + ":paid:v1");
  std::atomic<int> acked{0}, duplicates{0}, retries{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto order = ids;
      std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(t)));
      for (const auto& id : order) {
        const std::string body = "{\"id\":\"" + id + "\"}";
        const std::string fp = idem::fingerprint(body);
        // Deliver until the verdict lets the loop ack, as a broker redelivers.
        for (std::uint32_t count = 1;; ++count) {
          auto v = consumer.consume(idem::Delivery{id, fp, body, count},
                                    [&](pqxx::work& tx) { pg::insert_effect(tx, id); });
          if (v == Verdict::kAck) ++acked;
          if (v == Verdict::kAckDuplicate) ++duplicates;
          if (v != Verdict::kRetryLater) {
            EXPECT_TRUE(idem::should_ack(v)) << idem::verdict_name(v);
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
  for (const auto& id : ids) EXPECT_EQ(1, effects_of(id)) << id;
  auto s = consumer.stats().snapshot();
  EXPECT_EQ(40u, s.acked);
  EXPECT_EQ(static_cast<std::uint64_t>(retries.load()), s.retry_later);
  EXPECT_EQ(static_cast<std::uint64_t>(retries.load()), s.redeliveries);
  EXPECT_TRUE(dead.empty());
  // The records are in mq_consume_record, keyed (message_id, consumer_group).
  EXPECT_EQ(40, pg::scalar("SELECT count(*) FROM " + pg::table("mq_consume_record") +
                           " WHERE consumer_group = '" + group_ + "' AND status = 'completed'"));
}

TEST_P(ConsumerPg, PoisonMessageIsDeadLetteredAfterThreeAttemptsAcrossARestart) {
  std::vector<idem::DeadLetter> dead;
  const std::string poison = idem::test::unique_name("poison");
  const std::string good = idem::test::unique_name("good");
  auto fail = [](pqxx::work&) { throw std::runtime_error("cannot apply"); };
  {
    idem::IdempotentConsumer<PostgresStore> consumer{*guard_, group_, options(&dead)};
    EXPECT_EQ(Verdict::kRetryLater, consumer.consume(idem::Delivery{poison, "fp", "p", 1}, fail));
    // Other messages keep flowing.
    EXPECT_EQ(Verdict::kAck,
              consumer.consume(idem::Delivery{good, "fp", "g", 1},
                               [&](pqxx::work& tx) { pg::insert_effect(tx, good); }));
    EXPECT_EQ(Verdict::kRetryLater, consumer.consume(idem::Delivery{poison, "fp", "p", 2}, fail));
  }
  // A restarted consumer (new objects) continues from the two stored failures.
  idem::IdempotentConsumer<PostgresStore> consumer{*guard_, group_, options(&dead)};
  EXPECT_EQ(Verdict::kDeadLetter, consumer.consume(idem::Delivery{poison, "fp", "p", 3}, fail));
  ASSERT_EQ(1u, dead.size());
  EXPECT_EQ(poison, dead[0].message_id);
  EXPECT_EQ(3u, dead[0].attempts);
  EXPECT_EQ("p", dead[0].payload);
  EXPECT_NE(std::string::npos, dead[0].error.find("cannot apply"));
  // Later deliveries are acked as duplicates without running; the record is failed.
  bool ran = false;
  EXPECT_EQ(Verdict::kAckDuplicate, consumer.consume(idem::Delivery{poison, "fp", "p", 4},
                                                     [&](pqxx::work&) { ran = true; }));
  EXPECT_FALSE(ran);
  EXPECT_TRUE(consumer.dead_lettered(poison));
  auto rec = durable_->lookup(idem::Key::make(group_, poison));
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kFailed, rec->status);
  EXPECT_EQ(0u, PostgresAttemptLedger(*durable_).failures(idem::Key::make(group_, poison)));
  EXPECT_EQ(1u, dead.size());
  EXPECT_EQ(1, effects_of(good));
}

TEST_P(ConsumerPg, SameIdWithAnotherBodyIsAMismatchAndRunsNothing) {
  std::vector<idem::DeadLetter> dead;
  idem::IdempotentConsumer<PostgresStore> consumer{*guard_, group_, options(&dead)};
  const std::string id = idem::test::unique_name("msg");
  EXPECT_EQ(Verdict::kAck, consumer.consume(idem::Delivery{id, idem::fingerprint("a"), "a", 1},
                                            [&](pqxx::work& tx) { pg::insert_effect(tx, id); }));
  EXPECT_EQ(Verdict::kMismatch,
            consumer.consume(idem::Delivery{id, idem::fingerprint("b"), "b", 1},
                             [&](pqxx::work& tx) { pg::insert_effect(tx, id); }));
  EXPECT_EQ(1, effects_of(id));
}

// --- consume_batch: one statement writes a batch's records ---------------------------------

std::vector<Verdict> pg_batch(idem::IdempotentConsumer<PostgresStore>& consumer,
                              const std::vector<std::string>& ids, const std::string& poison = "",
                              std::map<std::string, int>* calls = nullptr) {
  std::vector<std::string> fps;
  for (const auto& id : ids) fps.push_back(idem::fingerprint("body of " + id));
  std::vector<idem::Delivery> batch;
  for (std::size_t i = 0; i < ids.size(); ++i) batch.push_back(idem::Delivery{ids[i], fps[i]});
  return consumer.consume_batch(batch, [&](pqxx::work& tx, std::size_t i) {
    if (calls != nullptr) ++(*calls)[ids[i]];
    pg::insert_effect(tx, ids[i]);
    if (ids[i] == poison) throw std::runtime_error("poison " + ids[i]);
  });
}

TEST_P(ConsumerPg, BatchAppliesEachIdOnceInsideAndAcrossBatches) {
  std::vector<idem::DeadLetter> dead;
  idem::IdempotentConsumer<PostgresStore> consumer{*guard_, group_, options(&dead)};
  const std::string u = idem::test::unique_name("b");
  // Ids with the characters a text[] literal must escape.
  const std::string a = u + "-a", b = u + "-\"b\\{x},y", c = u + "-c", d = u + "-d";
  EXPECT_EQ(Verdict::kAck, consumer.consume(idem::Delivery{c, idem::fingerprint("body of " + c)},
                                            [&](pqxx::work& tx) { pg::insert_effect(tx, c); }));
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kAck, Verdict::kAckDuplicate,
                                  Verdict::kAckDuplicate}),
            pg_batch(consumer, {a, b, a, c}));
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAckDuplicate, Verdict::kAck}),
            pg_batch(consumer, {b, d}));
  for (const auto& id : {a, b, c, d}) EXPECT_EQ(1, effects_of(id)) << id;
  for (const auto& id : {a, b, d}) {
    auto rec = durable_->lookup(idem::Key::make(group_, id));
    ASSERT_TRUE(rec.has_value()) << id;
    EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
    EXPECT_EQ(idem::fingerprint("body of " + id), rec->fingerprint);
  }
  // The single-message path sees what the batch wrote.
  EXPECT_EQ(Verdict::kAckDuplicate,
            consumer.consume(idem::Delivery{b, idem::fingerprint("body of " + b)},
                             [&](pqxx::work& tx) { pg::insert_effect(tx, b); }));
  EXPECT_EQ(Verdict::kMismatch,
            consumer.consume(idem::Delivery{d, idem::fingerprint("another body")},
                             [&](pqxx::work& tx) { pg::insert_effect(tx, d); }));
  EXPECT_EQ(0u, consumer.stats().snapshot().batch_reruns);
  // Without a fast store, first deliveries let the batch assume fresh keys: c (written by
  // consume()) and then b met the plain insert, one rerun each. Redis in front knew them.
  EXPECT_EQ(fast_ ? 0u : 2u, consumer.stats().snapshot().batch_record_conflicts);
}

// Records the fast store no longer knows (lost, evicted, another prefix): with Redis in front
// every claim of the batch is fresh, so the plain record insert runs, meets the committed
// record, and the batch runs once more with the tolerant insert. Without a fast store the
// same happens because every message is a first delivery (a producer's duplicate looks like
// this); a batch with a redelivery in it takes the tolerant insert at once. Either way: one
// effect per id, the handler never ran twice.
TEST_P(ConsumerPg, BatchMeetingRecordsTheFastStoreLostRunsTheInsertAgainTolerantly) {
  std::vector<idem::DeadLetter> dead;
  idem::IdempotentConsumer<PostgresStore> consumer{*guard_, group_, options(&dead)};
  const std::string u = idem::test::unique_name("lost");
  const std::string x = u + "-x", y = u + "-y", z = u + "-z";
  std::map<std::string, int> calls;
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck}), pg_batch(consumer, {x}, "", &calls));

  std::unique_ptr<idem::redis::RedisStore> forgetful;
  if (fast_) {
    idem::redis::RedisStoreOptions ro = fast_->options();
    ro.key_prefix = idem::test::unique_name("consumer_pg_lost") + ":";
    forgetful = std::make_unique<idem::redis::RedisStore>(ro);
  }
  auto guard = make_guard(forgetful.get());
  idem::IdempotentConsumer<PostgresStore> again{*guard, group_, options(&dead)};
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kAckDuplicate, Verdict::kAck}),
            pg_batch(again, {y, x, z}, "", &calls));
  const auto stats = again.stats().snapshot();
  EXPECT_EQ(1u, stats.batch_record_conflicts);
  EXPECT_EQ(0u, stats.batch_reruns);
  // The guard counts the batch's calls: x was caught by the record table.
  const auto g = guard->stats().snapshot();
  EXPECT_EQ(3u, g.calls);
  EXPECT_EQ(2u, g.executed);
  EXPECT_EQ(1u, g.replayed);
  EXPECT_EQ(1u, g.durable_conflicts);
  EXPECT_EQ(fast_ ? 3u : 0u, g.fast_claims);
  for (const auto& id : {x, y, z}) {
    EXPECT_EQ(1, calls[id]) << id;
    EXPECT_EQ(1, effects_of(id)) << id;
  }
  if (forgetful) {
    // The batch refilled the fast store: x is answered there now.
    auto c = forgetful->claim(idem::Key::make(group_, x), idem::fingerprint("body of " + x),
                              idem::OwnerToken::generate(), std::chrono::seconds(10));
    EXPECT_EQ(idem::ClaimStatus::kDone, c.status);
  }
  // A redelivery of x beside a new id: no insert assuming fresh keys (or, with Redis in front,
  // x is answered there), so no rerun.
  const std::string w = u + "-w";
  const std::string fw = idem::fingerprint("body of " + w), fx = idem::fingerprint("body of " + x);
  const std::vector<idem::Delivery> mixed{idem::Delivery{w, fw, "", 1},
                                          idem::Delivery{x, fx, "", 2}};
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kAckDuplicate}),
            again.consume_batch(mixed, [&](pqxx::work& tx, std::size_t i) {
              ++calls[std::string(mixed[i].message_id)];
              pg::insert_effect(tx, std::string(mixed[i].message_id));
            }));
  EXPECT_EQ(1u, again.stats().snapshot().batch_record_conflicts);
  for (const auto& id : {w, x}) {
    EXPECT_EQ(1, calls[id]) << id;
    EXPECT_EQ(1, effects_of(id)) << id;
  }
}

// insert_new_completed_batch_in: all written, or false with the transaction aborted; inside
// with_transaction it runs idem's prepared statement, on the caller's own connection a one-off
// statement (idem prepares nothing there).
TEST(PostgresBatchRecords, PlainInsertWritesAllOrReportsAnExistingRecord) {
  IDEM_REQUIRE_POSTGRES();
  PostgresStore store{mq_options()};
  const std::string group = idem::test::unique_name("plain_insert");
  auto k1 = idem::Key::make(group, "m1"), k2 = idem::Key::make(group, "m2"),
       k3 = idem::Key::make(group, "m3");
  auto o1 = idem::OwnerToken::generate(), o2 = idem::OwnerToken::generate(),
       o3 = idem::OwnerToken::generate();
  const std::vector<idem::ClaimRequest> first{{&k1, "fp1", &o1}, {&k2, "fp2", &o2}};
  const std::string prepared_count =
      "SELECT count(*) FROM pg_prepared_statements WHERE name = 'idem_insert_new_completed_batch'";
  store.with_transaction([&](pqxx::work& tx) {
    EXPECT_TRUE(store.insert_new_completed_batch_in(tx, first, "done", std::chrono::hours(1)));
    EXPECT_EQ(1, tx.exec(prepared_count)[0][0].as<long>());
  });
  for (const auto* k : {&k1, &k2}) {
    auto rec = store.lookup(*k);
    ASSERT_TRUE(rec.has_value());
    EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
    EXPECT_EQ("done", rec->response);
  }
  // m2 exists: nothing of this call is written, the transaction is aborted.
  const std::vector<idem::ClaimRequest> second{{&k3, "fp3", &o3}, {&k2, "fp2", &o2}};
  bool written = true;
  EXPECT_THROW(store.with_transaction([&](pqxx::work& tx) {
    written = store.insert_new_completed_batch_in(tx, second, "done", std::chrono::hours(1));
    tx.exec("SELECT 1");  // aborted transaction
  }),
               std::exception);
  EXPECT_FALSE(written);
  EXPECT_FALSE(store.lookup(k3).has_value());
  // On the caller's own connection: same answers, no prepared statement left behind.
  pqxx::connection own(pg::dsn());
  {
    pqxx::work tx(own);
    EXPECT_TRUE(store.insert_new_completed_batch_in(tx, {idem::ClaimRequest{&k3, "fp3", &o3}},
                                                    "done", std::chrono::hours(1)));
    EXPECT_EQ(0, tx.exec(prepared_count)[0][0].as<long>());
    tx.commit();
  }
  EXPECT_TRUE(store.lookup(k3).has_value());
  // Another store (another table) on a transaction of this store's pool writes its own table:
  // this store's prepared statements are not used for it.
  auto other_options = mq_options();
  other_options.table = "mq_consume_record_other";
  PostgresStore other{other_options};
  auto k4 = idem::Key::make(group, "m4");
  store.with_transaction([&](pqxx::work& tx) {
    EXPECT_TRUE(other.insert_new_completed_batch_in(tx, {idem::ClaimRequest{&k4, "fp4", &o3}},
                                                    "done", std::chrono::hours(1)));
    std::vector<bool> again = other.insert_completed_batch_in(
        tx, {idem::ClaimRequest{&k1, "fp1", &o1}}, "done", std::chrono::hours(1));
    EXPECT_EQ(std::vector<bool>{true}, again);  // k1 exists in this store's table only
  });
  EXPECT_TRUE(other.lookup(k4).has_value());
  EXPECT_TRUE(other.lookup(k1).has_value());
  EXPECT_FALSE(store.lookup(k4).has_value());
  const std::vector<idem::ClaimRequest> twice{{&k1, "fp1", &o1}, {&k1, "fp1", &o1}};
  store.with_transaction([&](pqxx::work& tx) {
    EXPECT_THROW(store.insert_new_completed_batch_in(tx, twice, "done", std::chrono::hours(1)),
                 idem::UsageError);
  });
}

// insert_completed_batch_in answers each request in its own place: requests in no particular
// order, over two scopes (the statement returns the written rows in key order), with records
// already there for some of them.
TEST(PostgresBatchRecords, TolerantInsertReportsEachRequestInItsPlace) {
  IDEM_REQUIRE_POSTGRES();
  PostgresStore store{mq_options()};
  const std::string g1 = idem::test::unique_name("tolerant_b"), g2 = g1 + "_a";
  std::vector<idem::Key> keys;
  for (const char* id : {"m7", "m1", "m5", "m3"}) {
    keys.push_back(idem::Key::make(g1, id));
    keys.push_back(idem::Key::make(g2, id));
  }
  const auto owner = idem::OwnerToken::generate();
  // Records of g1/m5 and g2/m1 exist before the batch.
  store.with_transaction([&](pqxx::work& tx) {
    EXPECT_TRUE(store.insert_new_completed_batch_in(
        tx, {idem::ClaimRequest{&keys[4], "fp", &owner}, idem::ClaimRequest{&keys[3], "fp", &owner}},
        "earlier", std::chrono::hours(1)));
  });
  std::vector<idem::ClaimRequest> batch;
  for (const auto& k : keys) batch.push_back(idem::ClaimRequest{&k, "fp", &owner});
  std::vector<bool> written;
  store.with_transaction([&](pqxx::work& tx) {
    written = store.insert_completed_batch_in(tx, batch, "done", std::chrono::hours(1));
  });
  const std::vector<bool> expected{true, true, true, false, false, true, true, true};
  EXPECT_EQ(expected, written);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    auto rec = store.lookup(keys[i]);
    ASSERT_TRUE(rec.has_value()) << keys[i].str();
    EXPECT_EQ(expected[i] ? "done" : "earlier", rec->response) << keys[i].str();
    EXPECT_EQ(owner.str(), rec->owner) << keys[i].str();
  }
}

TEST_P(ConsumerPg, BatchWithAFailingHandlerRerunsWithSavepoints) {
  std::vector<idem::DeadLetter> dead;
  idem::IdempotentConsumer<PostgresStore> consumer{*guard_, group_, options(&dead)};
  const std::string u = idem::test::unique_name("f");
  const std::string x = u + "-x", bad = u + "-bad", y = u + "-y";
  std::map<std::string, int> calls;
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kRetryLater, Verdict::kAck}),
            pg_batch(consumer, {x, bad, y}, bad, &calls));
  EXPECT_EQ(1u, consumer.stats().snapshot().batch_reruns);
  EXPECT_EQ(2, calls[x]);  // its first run was rolled back with the batch
  EXPECT_EQ(1, effects_of(x));
  EXPECT_EQ(1, effects_of(y));
  EXPECT_EQ(0, effects_of(bad));
  EXPECT_FALSE(durable_->lookup(idem::Key::make(group_, bad)).has_value());
  EXPECT_EQ(1u, PostgresAttemptLedger(*durable_).failures(idem::Key::make(group_, bad)));
  // The poison message ends in the dead-letter sink after max_attempts (3).
  pg_batch(consumer, {bad}, bad);
  EXPECT_EQ((std::vector<Verdict>{Verdict::kDeadLetter}), pg_batch(consumer, {bad}, bad));
  ASSERT_EQ(1u, dead.size());
  EXPECT_EQ(bad, dead[0].message_id);
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAckDuplicate}), pg_batch(consumer, {bad}, bad));
}

// A handler whose own statement fails (a division by zero, a constraint, a bad cast: the
// usual poison message of a database handler). libpqxx ends the whole transaction on a failed
// statement, so no savepoint is left to go back to: the batch runs again without that
// message, the others commit, the poison message counts its attempts and is dead-lettered.
// A lock wait of a handler's statement is a retryable StorageTimeout of the whole batch.
TEST_P(ConsumerPg, BatchWithAFailingHandlerStatementIsolatesItsMessage) {
  std::vector<idem::DeadLetter> dead;
  idem::IdempotentConsumer<PostgresStore> consumer{*guard_, group_, options(&dead)};
  const std::string u = idem::test::unique_name("s");
  const std::string a = u + "-a", bad = u + "-bad", b = u + "-b", bad2 = u + "-bad2";
  std::map<std::string, int> calls;
  auto run = [&](const std::vector<std::string>& ids) {
    std::vector<idem::Delivery> batch;
    for (const auto& id : ids) batch.push_back(idem::Delivery{id, ""});
    return consumer.consume_batch(batch, [&](pqxx::work& tx, std::size_t i) {
      ++calls[ids[i]];
      pg::insert_effect(tx, ids[i]);
      if (ids[i] == bad || ids[i] == bad2) tx.exec("SELECT 1/0");
    });
  };
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kRetryLater, Verdict::kAck,
                                  Verdict::kRetryLater}),
            run({a, bad, b, bad2}));
  EXPECT_EQ(1, effects_of(a));
  EXPECT_EQ(1, effects_of(b));
  EXPECT_EQ(0, effects_of(bad));
  EXPECT_EQ(0, effects_of(bad2));
  PostgresAttemptLedger ledger(*durable_);
  EXPECT_EQ(1u, ledger.failures(idem::Key::make(group_, bad)));
  EXPECT_EQ(1u, ledger.failures(idem::Key::make(group_, bad2)));
  (void)run({bad, a});
  EXPECT_EQ((std::vector<Verdict>{Verdict::kDeadLetter, Verdict::kAckDuplicate}), run({bad, a}));
  ASSERT_EQ(1u, dead.size());
  EXPECT_EQ(bad, dead[0].message_id);
  EXPECT_NE(std::string::npos, dead[0].error.find("division by zero")) << dead[0].error;
  EXPECT_EQ(1, effects_of(a));
  EXPECT_EQ(0, effects_of(bad));

  // A business row locked by another transaction past lock_timeout: retryable, nothing
  // committed, nothing counted against the message.
  const std::string c = u + "-c";
  pqxx::connection other{pg::dsn()};
  pqxx::work holder{other};
  holder.exec("LOCK TABLE " + pg::table("idem_test_effects") + " IN EXCLUSIVE MODE");
  std::vector<idem::Delivery> locked{idem::Delivery{c, ""}};
  EXPECT_THROW(consumer.consume_batch(locked,
                                      [&](pqxx::work& tx, std::size_t) {
                                        tx.exec("SET LOCAL lock_timeout = '100ms'");
                                        pg::insert_effect(tx, c);
                                      }),
               idem::StorageTimeout);
  holder.abort();
  EXPECT_EQ(0u, ledger.failures(idem::Key::make(group_, c)));
}

TEST_P(ConsumerPg, EightThreadsOfOverlappingBatchesApplyEachIdOnce) {
  std::vector<idem::DeadLetter> dead;
  idem::IdempotentConsumer<PostgresStore> consumer{*guard_, group_, options(&dead)};
  std::vector<std::string> ids;
  for (int i = 0; i < 40; ++i) ids.push_back(idem::test::unique_name("o") + ":paid:v1");
  std::atomic<int> acked{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto order = ids;
      std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(t)));
      for (std::size_t from = 0; from < order.size(); from += 10) {
        std::vector<std::string> pending(order.begin() + static_cast<std::ptrdiff_t>(from),
                                         order.begin() + static_cast<std::ptrdiff_t>(from + 10));
        // Redeliver what answered retry_later, as the broker would.
        while (!pending.empty()) {
          auto verdicts = pg_batch(consumer, pending);
          std::vector<std::string> again;
          for (std::size_t i = 0; i < pending.size(); ++i) {
            if (verdicts[i] == Verdict::kAck) ++acked;
            if (verdicts[i] == Verdict::kRetryLater) again.push_back(pending[i]);
            EXPECT_TRUE(verdicts[i] == Verdict::kAck || verdicts[i] == Verdict::kAckDuplicate ||
                        verdicts[i] == Verdict::kRetryLater)
                << idem::verdict_name(verdicts[i]);
          }
          pending = std::move(again);
          if (!pending.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(40, acked.load());
  for (const auto& id : ids) EXPECT_EQ(1, effects_of(id)) << id;
  EXPECT_TRUE(dead.empty());
}

// A record held by another open transaction: the batch's single INSERT would wait on it; past
// lock_timeout the batch runs again one delivery at a time and only that delivery waits.
TEST_P(ConsumerPg, BatchWithARecordLockedElsewhereAnswersRetryLaterForItAlone) {
  auto o = mq_options();
  o.lock_timeout = std::chrono::milliseconds(300);
  PostgresStore store{o};
  idem::GuardOptions go;
  go.durable_source = idem::DuplicateSource::kMqRecord;
  idem::IdempotencyGuard<PostgresStore> guard =
      fast_ ? idem::IdempotencyGuard<PostgresStore>(*fast_, store, go)
            : idem::IdempotencyGuard<PostgresStore>(store, go);
  std::vector<idem::DeadLetter> dead;
  idem::IdempotentConsumer<PostgresStore> consumer{guard, group_, options(&dead)};
  const std::string u = idem::test::unique_name("l");
  const std::string held = u + "-held", free = u + "-free";
  std::promise<void> holding, done;
  std::atomic<bool> rolled_back{false};
  std::thread holder([&] {
    try {
      store.with_transaction([&](pqxx::work& tx) {
        auto owner = idem::OwnerToken::generate();
        auto c =
            store.claim_in(tx, idem::Key::make(group_, held), idem::fingerprint("body of " + held),
                           owner, std::chrono::milliseconds(0));
        EXPECT_EQ(idem::ClaimStatus::kClaimed, c.status);
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
    v = pg_batch(consumer, {free, held});
  } catch (...) {
    done.set_value();
    holder.join();
    throw;
  }
  done.set_value();
  holder.join();
  EXPECT_TRUE(rolled_back.load());
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kRetryLater}), v);
  EXPECT_EQ(1u, consumer.stats().snapshot().batch_reruns);
  EXPECT_EQ(1, effects_of(free));
  EXPECT_EQ(0, effects_of(held));
  // Once the holder is gone, a redelivery applies it.
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck}), pg_batch(consumer, {held}));
  EXPECT_EQ(1, effects_of(held));
}

INSTANTIATE_TEST_SUITE_P(FastStore, ConsumerPg, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? std::string("RedisInFront")
                                          : std::string("DurableOnly");
                         });

}  // namespace
