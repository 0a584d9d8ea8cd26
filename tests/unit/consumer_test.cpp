// SPDX-License-Identifier: MIT
// IdempotentConsumer over SQLite (mq_consume_record) and MemoryStore: verdicts, concurrency,
// poison messages, durable attempt counts, redeliveries.
#include "idem/consumer.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/memory_store.hpp"
#include "idem/sqlite/attempt_ledger.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/failing_store.hpp"
#include "support/test_env.hpp"

namespace {

using idem::Delivery;
using idem::Verdict;
using idem::sqlite::SqliteStore;
using idem::sqlite::Transaction;

idem::GuardOptions mq_guard_options() {
  idem::GuardOptions o;
  o.durable_source = idem::DuplicateSource::kMqRecord;
  return o;
}

// One consumer process: a SQLite file with the consume record, effects and attempt ledger.
struct Node {
  explicit Node(const std::string& path, idem::ConsumerOptions options = {},
                bool with_fast = true)
      : durable(path, idem::sqlite::SqliteStoreOptions::mq_consume_record()),
        guard(with_fast ? idem::IdempotencyGuard<SqliteStore>(fast, durable, mq_guard_options())
                        : idem::IdempotencyGuard<SqliteStore>(durable, mq_guard_options())),
        consumer(guard, "billing", with_ledger(std::move(options))) {
    durable.database().write([](Transaction& tx) {
      tx.exec("CREATE TABLE IF NOT EXISTS effect (message_id TEXT NOT NULL)");
    });
  }

  idem::ConsumerOptions with_ledger(idem::ConsumerOptions o) {
    if (!o.attempts) {
      o.attempts = std::make_shared<idem::sqlite::SqliteAttemptLedger>(durable.shared_database());
    }
    return o;
  }

  long effects(const std::string& id) {
    return static_cast<long>(durable.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM effect WHERE message_id = ?", id).value_or(-1);
    }));
  }

  Verdict apply(const std::string& id, const std::string& body, std::uint32_t count = 1) {
    auto fp = idem::fingerprint(body);
    return consumer.consume(Delivery{id, fp, body, count}, [&](Transaction& tx) {
      tx.exec("INSERT INTO effect (message_id) VALUES (?)", id);
    });
  }

  idem::MemoryStore fast;
  SqliteStore durable;
  idem::IdempotencyGuard<SqliteStore> guard;
  idem::IdempotentConsumer<SqliteStore> consumer;
};

class ConsumerTest : public ::testing::Test {
 protected:
  std::string db() { return dir_.file("mq.sqlite"); }
  idem::test::TempDir dir_;
};

TEST_F(ConsumerTest, DuplicateIsAckedWithoutRunning) {
  Node n{db()};
  EXPECT_EQ(Verdict::kAck, n.apply("order_1:paid:v1", "{\"amount\":10}"));
  EXPECT_EQ(Verdict::kAckDuplicate, n.apply("order_1:paid:v1", "{\"amount\":10}"));
  EXPECT_EQ(1, n.effects("order_1:paid:v1"));
  auto s = n.consumer.stats().snapshot();
  EXPECT_EQ(2u, s.deliveries);
  EXPECT_EQ(1u, s.acked);
  EXPECT_EQ(1u, s.duplicates);
  auto rec = n.durable.lookup(idem::Key::make("billing", "order_1:paid:v1"));
  ASSERT_TRUE(rec);
  EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
}

TEST_F(ConsumerTest, DuplicateCaughtByTheRecordTableAfterARestart) {
  { Node n{db()}; EXPECT_EQ(Verdict::kAck, n.apply("m1", "a")); }
  Node n{db()};  // a new process: empty fast store
  EXPECT_EQ(Verdict::kAckDuplicate, n.apply("m1", "a"));
  EXPECT_EQ(1, n.effects("m1"));
  EXPECT_EQ(1u, n.guard.stats().snapshot().durable_conflicts);
}

TEST_F(ConsumerTest, ConcurrentDuplicateIsRetryLater) {
  Node n{db()};
  std::promise<void> entered, release;
  auto released = release.get_future().share();
  auto first = std::async(std::launch::async, [&] {
    return n.consumer.consume(Delivery{"m1", ""}, [&](Transaction& tx) {
      tx.exec("INSERT INTO effect (message_id) VALUES ('m1')");
      entered.set_value();
      released.wait();
    });
  });
  entered.get_future().wait();
  bool ran = false;
  EXPECT_EQ(Verdict::kRetryLater,
            n.consumer.consume(Delivery{"m1", ""}, [&](Transaction&) { ran = true; }));
  release.set_value();
  EXPECT_EQ(Verdict::kAck, first.get());
  EXPECT_FALSE(ran);
  EXPECT_EQ(Verdict::kAckDuplicate,  // the broker's redelivery
            n.consumer.consume(Delivery{"m1", ""}, [&](Transaction&) { ran = true; }));
  EXPECT_FALSE(ran);
  EXPECT_EQ(1, n.effects("m1"));
}

TEST_F(ConsumerTest, ManyThreadsManyDuplicatesOneEffectEach) {
  Node n{db()};
  constexpr int kThreads = 8, kMessages = 40;
  std::atomic<int> acks{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int m = 0; m < kMessages; ++m) {
        std::string id = "m" + std::to_string(m);
        // Redeliver until the message is acked (as a broker would).
        for (;;) {
          Verdict v = n.apply(id, "body" + std::to_string(m));
          if (v == Verdict::kAck) acks.fetch_add(1);
          if (idem::should_ack(v)) break;
          ASSERT_EQ(Verdict::kRetryLater, v);
          std::this_thread::yield();
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(kMessages, acks.load());
  for (int m = 0; m < kMessages; ++m) EXPECT_EQ(1, n.effects("m" + std::to_string(m)));
}

TEST_F(ConsumerTest, ConcurrentDuplicatesWithoutAFastStoreSerialiseOnTheRecord) {
  Node n{db(), {}, /*with_fast=*/false};
  std::vector<std::future<Verdict>> f;
  for (int i = 0; i < 6; ++i) {
    f.push_back(std::async(std::launch::async, [&] { return n.apply("m1", "x"); }));
  }
  int ack = 0, dup = 0;
  for (auto& x : f) {
    Verdict v = x.get();
    ack += v == Verdict::kAck;
    dup += v == Verdict::kAckDuplicate;
  }
  EXPECT_EQ(1, ack);
  EXPECT_EQ(5, dup);
  EXPECT_EQ(1, n.effects("m1"));
}

TEST_F(ConsumerTest, SameIdDifferentBodyIsAMismatch) {
  Node n{db()};
  EXPECT_EQ(Verdict::kAck, n.apply("m1", "amount=10"));
  EXPECT_EQ(Verdict::kMismatch, n.apply("m1", "amount=99"));
  EXPECT_FALSE(idem::should_ack(Verdict::kMismatch));
  EXPECT_EQ(1, n.effects("m1"));
  EXPECT_EQ(1u, n.consumer.stats().snapshot().mismatched);
}

struct Sink {
  std::mutex mutex;
  std::vector<idem::DeadLetter> letters;
  std::function<void(const idem::DeadLetter&)> fn() {
    return [this](const idem::DeadLetter& d) {
      std::lock_guard<std::mutex> lock(mutex);
      letters.push_back(d);
    };
  }
};

Verdict poison(Node& n, const std::string& id, int* runs = nullptr) {
  return n.consumer.consume(Delivery{id, "", "payload-" + id}, [&](Transaction& tx) {
    tx.exec("INSERT INTO effect (message_id) VALUES (?)", id);  // rolled back
    if (runs != nullptr) ++*runs;
    throw std::runtime_error("cannot parse " + id);
  });
}

TEST_F(ConsumerTest, PoisonGoesToDeadLetterAfterMaxAttemptsAndOthersKeepFlowing) {
  Sink sink;
  idem::ConsumerOptions o;
  o.max_attempts = 3;
  o.dead_letter = sink.fn();
  Node n{db(), o};
  int runs = 0;
  EXPECT_EQ(Verdict::kRetryLater, poison(n, "bad", &runs));
  EXPECT_EQ(Verdict::kAck, n.apply("good1", "x"));
  EXPECT_EQ(Verdict::kRetryLater, poison(n, "bad", &runs));
  EXPECT_EQ(Verdict::kAck, n.apply("good2", "x"));
  EXPECT_TRUE(sink.letters.empty());
  EXPECT_EQ(Verdict::kDeadLetter, poison(n, "bad", &runs));
  ASSERT_EQ(1u, sink.letters.size());
  EXPECT_EQ("bad", sink.letters[0].message_id);
  EXPECT_EQ("billing", sink.letters[0].group);
  EXPECT_EQ("payload-bad", sink.letters[0].payload);
  EXPECT_EQ(3u, sink.letters[0].attempts);
  EXPECT_NE(sink.letters[0].error.find("cannot parse bad"), std::string::npos);
  // Redelivered later: acked as a duplicate, the handler does not run, no second letter.
  EXPECT_EQ(Verdict::kAckDuplicate, poison(n, "bad", &runs));
  EXPECT_EQ(3, runs);
  EXPECT_EQ(1u, sink.letters.size());
  EXPECT_TRUE(n.consumer.dead_lettered("bad"));
  EXPECT_FALSE(n.consumer.dead_lettered("good1"));
  auto rec = n.durable.lookup(idem::Key::make("billing", "bad"));
  ASSERT_TRUE(rec);
  EXPECT_EQ(idem::Record::Status::kFailed, rec->status);
  EXPECT_EQ(0, n.effects("bad"));
  EXPECT_EQ(1, n.effects("good1"));
  EXPECT_EQ(Verdict::kAck, n.apply("good3", "x"));
  auto s = n.consumer.stats().snapshot();
  EXPECT_EQ(3u, s.failures);
  EXPECT_EQ(1u, s.dead_lettered);
}

TEST_F(ConsumerTest, AttemptCountSurvivesAConsumerRestart) {
  Sink sink;
  idem::ConsumerOptions o;
  o.max_attempts = 3;
  o.dead_letter = sink.fn();
  {
    Node n{db(), o};
    EXPECT_EQ(Verdict::kRetryLater, poison(n, "bad"));
    EXPECT_EQ(Verdict::kRetryLater, poison(n, "bad"));
  }
  Node n{db(), o};  // restarted: the durable ledger remembers two failures
  EXPECT_EQ(Verdict::kDeadLetter, poison(n, "bad"));
  EXPECT_EQ(1u, sink.letters.size());
}

TEST_F(ConsumerTest, AMessageThatSucceedsOnARedeliveryForgetsItsFailures) {
  idem::ConsumerOptions o;
  o.max_attempts = 2;
  auto ledger = std::make_shared<idem::MemoryAttemptLedger>();
  o.attempts = ledger;
  Node n{db(), o};
  EXPECT_EQ(Verdict::kRetryLater, poison(n, "flaky"));
  EXPECT_EQ(1u, ledger->failures(idem::Key::make("billing", "flaky")));
  EXPECT_EQ(Verdict::kAck, n.apply("flaky", "", 2));
  EXPECT_EQ(0u, ledger->failures(idem::Key::make("billing", "flaky")));
}

TEST_F(ConsumerTest, AThrowingSinkKeepsTheMessageWithTheBroker) {
  idem::ConsumerOptions o;
  o.max_attempts = 1;
  int calls = 0;
  o.dead_letter = [&](const idem::DeadLetter&) {
    if (++calls == 1) throw std::runtime_error("dead-letter stream unreachable");
  };
  Node n{db(), o};
  EXPECT_THROW(poison(n, "bad"), std::runtime_error);
  EXPECT_FALSE(n.consumer.dead_lettered("bad"));  // the claim was released
  EXPECT_EQ(Verdict::kDeadLetter, poison(n, "bad"));
  EXPECT_EQ(2, calls);
  EXPECT_TRUE(n.consumer.dead_lettered("bad"));
}

// The broker connection drops while the last failure is handed to the sink: the count is
// kept, the message comes back redelivered, and it goes to the sink without a fourth run.
// A transport without a delivery count (and `consume(id, fingerprint, handler)`) says 1 on every
// delivery: the in-process ledger still forgets a message once it succeeds, in `consume` and in
// `consume_batch`, so it does not grow with every message that ever failed.
TEST_F(ConsumerTest, MemoryLedgerForgetsAMessageThatSucceedsOnAFirstDelivery) {
  auto ledger = std::make_shared<idem::MemoryAttemptLedger>();
  idem::ConsumerOptions o;
  o.attempts = ledger;
  Node n{db(), o};
  const auto key_of = [](const std::string& id) { return idem::Key::make("billing", id); };
  bool fail = true;
  auto handler = [&](Transaction& tx) {
    if (fail) throw std::runtime_error("not yet");
    tx.exec("INSERT INTO effect (message_id) VALUES ('m1')");
  };
  EXPECT_EQ(Verdict::kRetryLater, n.consumer.consume("m1", "", handler));
  EXPECT_EQ(1u, ledger->failures(key_of("m1")));
  fail = false;
  EXPECT_EQ(Verdict::kAck, n.consumer.consume("m1", "", handler));
  EXPECT_EQ(0u, ledger->failures(key_of("m1")));
  EXPECT_EQ(1, n.effects("m1"));

  fail = true;
  std::vector<Delivery> batch{Delivery{"m2", ""}, Delivery{"m3", ""}};
  auto run_batch = [&] {
    return n.consumer.consume_batch(batch, [&](Transaction& tx, std::size_t i) {
      if (fail && i == 0) throw std::runtime_error("not yet");
      tx.exec("INSERT INTO effect (message_id) VALUES (?)", std::string(batch[i].message_id));
    });
  };
  auto first = run_batch();
  EXPECT_EQ(Verdict::kRetryLater, first[0]);
  EXPECT_EQ(Verdict::kAck, first[1]);
  EXPECT_EQ(1u, ledger->failures(key_of("m2")));
  fail = false;
  batch = {Delivery{"m2", ""}};
  EXPECT_EQ(Verdict::kAck, run_batch()[0]);
  EXPECT_EQ(0u, ledger->failures(key_of("m2")));
  EXPECT_EQ(1, n.effects("m2"));
  EXPECT_EQ(1, n.effects("m3"));
}

// A store failing part-way through a batch (here the attempt ledger, read for redeliveries)
// leaves every delivery of the batch counted, as consume() counts its one.
TEST_F(ConsumerTest, ABatchCountsEveryDeliveryEvenWhenAStoreFails) {
  struct DownLedger final : idem::AttemptLedger {
    std::uint32_t record_failure(const idem::Key&, std::string_view) override { return 1; }
    std::uint32_t failures(const idem::Key&) override {
      throw idem::StorageUnavailable("ledger down");
    }
    void clear(const idem::Key&) override {}
  };
  idem::ConsumerOptions o;
  o.attempts = std::make_shared<DownLedger>();
  Node n{db(), o};
  std::vector<Delivery> batch{Delivery{"r1", "", "", 1}, Delivery{"r2", "", "", 2},
                              Delivery{"r3", "", "", 3}, Delivery{"r4", "", "", 2}};
  EXPECT_THROW(n.consumer.consume_batch(batch, [](Transaction&, std::size_t) {}),
               idem::StorageUnavailable);
  auto stats = n.consumer.stats().snapshot();
  EXPECT_EQ(4u, stats.deliveries);
  EXPECT_EQ(3u, stats.redeliveries);
}

TEST_F(ConsumerTest, ARedeliveryAfterAFailedHandOffIsDeadLetteredWithoutRunningAgain) {
  Sink sink;
  idem::ConsumerOptions o;
  o.max_attempts = 3;
  bool sink_down = false;
  o.dead_letter = [&](const idem::DeadLetter& d) {
    if (sink_down) throw std::runtime_error("connection to the broker lost");
    sink.letters.push_back(d);
  };
  Node n{db(), o};
  int runs = 0;
  auto deliver = [&](std::uint32_t count) {
    return n.consumer.consume(Delivery{"bad", "", "payload-bad", count}, [&](Transaction&) {
      ++runs;
      throw std::runtime_error("cannot parse bad");
    });
  };
  EXPECT_EQ(Verdict::kRetryLater, deliver(1));
  EXPECT_EQ(Verdict::kRetryLater, deliver(2));
  sink_down = true;
  EXPECT_THROW(deliver(3), std::runtime_error);
  EXPECT_EQ(3, runs);
  EXPECT_FALSE(n.consumer.dead_lettered("bad"));
  sink_down = false;
  EXPECT_EQ(Verdict::kDeadLetter, deliver(4));
  EXPECT_EQ(3, runs) << "the handler does not run a fourth time";
  ASSERT_EQ(1u, sink.letters.size());
  EXPECT_EQ(3u, sink.letters[0].attempts);
  EXPECT_TRUE(n.consumer.dead_lettered("bad"));
  EXPECT_EQ(Verdict::kAckDuplicate, deliver(5));
  EXPECT_EQ(1u, sink.letters.size());

  // A producer's copy (a new broker entry, delivery count 1) is not checked against the ledger
  // (first deliveries read no ledger row, docs/mq.md): after a failed hand-off it runs the
  // handler once more, and is dead-lettered with one attempt more than max_attempts.
  sink_down = true;
  for (std::uint32_t count : {1u, 2u}) {
    (void)n.consumer.consume(Delivery{"bad3", "", "payload-bad3", count}, [&](Transaction&) {
      ++runs;
      throw std::runtime_error("cannot parse bad3");
    });
  }
  EXPECT_THROW(n.consumer.consume(Delivery{"bad3", "", "payload-bad3", 3},
                                  [&](Transaction&) {
                                    ++runs;
                                    throw std::runtime_error("cannot parse bad3");
                                  }),
               std::runtime_error);
  sink_down = false;
  EXPECT_EQ(Verdict::kDeadLetter,
            n.consumer.consume(Delivery{"bad3", "", "payload-bad3", 1}, [&](Transaction&) {
              ++runs;
              throw std::runtime_error("cannot parse bad3");
            }));
  EXPECT_EQ(7, runs);
  ASSERT_EQ(2u, sink.letters.size());
  EXPECT_EQ(4u, sink.letters[1].attempts);
  sink.letters.pop_back();

  // The same in a batch: a redelivered message with its attempts used up is dead-lettered
  // before the batch runs, and the others in the batch are applied.
  sink_down = true;
  EXPECT_EQ(Verdict::kRetryLater, poison(n, "bad2"));
  EXPECT_EQ(Verdict::kRetryLater, poison(n, "bad2"));
  EXPECT_THROW(poison(n, "bad2"), std::runtime_error);
  sink_down = false;
  const std::string ok_fp = idem::fingerprint("x");
  std::vector<Delivery> batch{Delivery{"bad2", "", "payload-bad2", 2},
                              Delivery{"ok", ok_fp, "x", 1}};
  int batch_runs = 0;
  auto v = n.consumer.consume_batch(batch, [&](Transaction& tx, std::size_t i) {
    ++batch_runs;
    tx.exec("INSERT INTO effect (message_id) VALUES (?)", batch[i].message_id);
  });
  EXPECT_EQ((std::vector<Verdict>{Verdict::kDeadLetter, Verdict::kAck}), v);
  EXPECT_EQ(1, batch_runs);
  EXPECT_EQ(0, n.effects("bad2"));
  EXPECT_EQ(1, n.effects("ok"));
  ASSERT_EQ(2u, sink.letters.size());
  EXPECT_EQ("bad2", sink.letters[1].message_id);
  EXPECT_EQ(3u, sink.letters[1].attempts);
  // Each dead letter counted once ("bad" at its fourth delivery, "bad3" at its copy, "bad2" in
  // the batch).
  EXPECT_EQ(3u, n.consumer.stats().snapshot().dead_lettered);
}

TEST_F(ConsumerTest, RetryableHandlerErrorsPropagateWithoutCounting) {
  idem::ConsumerOptions o;
  o.max_attempts = 1;
  Node n{db(), o};
  auto timeout = [](Transaction&) { throw idem::StorageTimeout("business table locked"); };
  EXPECT_THROW(n.consumer.consume(Delivery{"m1", ""}, timeout), idem::StorageTimeout);
  EXPECT_THROW(n.consumer.consume(Delivery{"m1", ""}, timeout), idem::StorageTimeout);
  EXPECT_EQ(0u, n.consumer.stats().snapshot().dead_lettered);
  EXPECT_EQ(Verdict::kAck, n.apply("m1", ""));
}

TEST_F(ConsumerTest, InvalidMessageIdGoesToTheDeadLetterSink) {
  Sink sink;
  idem::ConsumerOptions o;
  o.dead_letter = sink.fn();
  Node n{db(), o};
  bool ran = false;
  EXPECT_EQ(Verdict::kDeadLetter,
            n.consumer.consume(Delivery{"has space", "", "p"}, [&](Transaction&) { ran = true; }));
  EXPECT_FALSE(ran);
  ASSERT_EQ(1u, sink.letters.size());
  EXPECT_EQ(0u, sink.letters[0].attempts);
  EXPECT_NE(sink.letters[0].error.find("id.charset"), std::string::npos);
}

TEST_F(ConsumerTest, RedeliveriesAreCounted) {
  Node n{db()};
  EXPECT_EQ(Verdict::kAck, n.apply("m1", "x", 1));
  EXPECT_EQ(Verdict::kAckDuplicate, n.apply("m1", "x", 2));  // e.g. taken over by XAUTOCLAIM
  EXPECT_EQ(Verdict::kAckDuplicate, n.apply("m1", "x", 1));  // a producer retry
  auto s = n.consumer.stats().snapshot();
  EXPECT_EQ(1u, s.redeliveries);
  EXPECT_EQ(2u, s.duplicates);
}

TEST_F(ConsumerTest, TwoPhaseHandlerForExternalEffects) {
  Node n{db()};
  int calls = 0;
  auto external = [&] { ++calls; };
  EXPECT_EQ(Verdict::kAck, n.consumer.consume("m1", "", external));
  EXPECT_EQ(Verdict::kAckDuplicate, n.consumer.consume("m1", "", external));
  EXPECT_EQ(1, calls);
}

TEST_F(ConsumerTest, FastStoreOnlyConsumer) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  Sink sink;
  idem::ConsumerOptions o;
  o.max_attempts = 2;
  o.dead_letter = sink.fn();
  idem::IdempotentConsumer consumer{guard, "g", o};
  int calls = 0;
  EXPECT_EQ(Verdict::kAck, consumer.consume("m1", "", [&] { ++calls; }));
  EXPECT_EQ(Verdict::kAckDuplicate, consumer.consume("m1", "", [&] { ++calls; }));
  auto bad = [] { throw std::runtime_error("poison"); };
  EXPECT_EQ(Verdict::kRetryLater, consumer.consume("m2", "", bad));
  EXPECT_EQ(Verdict::kDeadLetter, consumer.consume("m2", "", bad));
  EXPECT_EQ(Verdict::kAckDuplicate, consumer.consume("m2", "", bad));
  EXPECT_EQ(1, calls);
  EXPECT_EQ(1u, sink.letters.size());
  // The fast store records the dead letter as failed, as durable stores do.
  auto rec = fast.lookup(idem::Key::make("g", "m2"));
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kFailed, rec->status);
  EXPECT_TRUE(fast.claim(idem::Key::make("g", "m2"), "", idem::OwnerToken::generate(),
                         std::chrono::seconds(30))
                  .failed);
}

// --- consume_batch: one transaction per batch -------------------------------------------------

// One consume_batch of `ids` (bodies "body of <id>"): each handler writes an effect row, and
// the one of `poison_id` then throws.
std::vector<Verdict> run_batch(idem::IdempotentConsumer<SqliteStore>& consumer,
                               const std::vector<std::string>& ids,
                               const std::string& poison_id = "") {
  std::vector<std::string> fps;
  for (const auto& id : ids) fps.push_back(idem::fingerprint("body of " + id));
  std::vector<Delivery> batch;
  for (std::size_t i = 0; i < ids.size(); ++i) batch.push_back(Delivery{ids[i], fps[i]});
  return consumer.consume_batch(batch, [&](Transaction& tx, std::size_t i) {
    tx.exec("INSERT INTO effect (message_id) VALUES (?)", ids[i]);
    if (ids[i] == poison_id) throw std::runtime_error("poison " + ids[i]);
  });
}

std::vector<Verdict> apply_batch(Node& n, const std::vector<std::string>& ids,
                                 const std::string& poison_id = "") {
  return run_batch(n.consumer, ids, poison_id);
}

TEST_F(ConsumerTest, BatchAcksNewDropsDuplicatesInsideAndAcrossBatches) {
  Node n{db()};
  EXPECT_EQ(Verdict::kAck, n.apply("m0", "body of m0"));
  auto v = apply_batch(n, {"m1", "m2", "m1", "m0", "m3"});
  std::vector<Verdict> want{Verdict::kAck, Verdict::kAck, Verdict::kAckDuplicate,
                            Verdict::kAckDuplicate, Verdict::kAck};
  EXPECT_EQ(want, v);
  for (const char* id : {"m0", "m1", "m2", "m3"}) EXPECT_EQ(1, n.effects(id)) << id;
  EXPECT_EQ(Verdict::kAckDuplicate, n.apply("m2", "body of m2"));  // the single path sees it
  auto s = n.consumer.stats().snapshot();
  EXPECT_EQ(4u, s.acked);
  EXPECT_EQ(3u, s.duplicates);
}

// The failing message is delivered twice in the first batch: one failed attempt (its repeat is
// not run again and not counted: it comes back, kRetryLater), so it is dead-lettered by the
// second batch, at its second attempt.
TEST_F(ConsumerTest, BatchIsolatesAFailingHandlerAndDeadLettersItEventually) {
  Sink sink;
  idem::ConsumerOptions o;
  o.max_attempts = 2;
  o.dead_letter = sink.fn();
  Node n{db(), o};
  auto v = apply_batch(n, {"a", "bad", "b", "bad"}, "bad");
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kRetryLater, Verdict::kAck,
                                  Verdict::kRetryLater}),
            v);
  EXPECT_EQ(1, n.effects("a"));
  EXPECT_EQ(0, n.effects("bad"));  // rolled back to its savepoint
  EXPECT_EQ(1, n.effects("b"));
  EXPECT_FALSE(n.durable.lookup(idem::Key::make("billing", "bad")));
  EXPECT_EQ(1u, n.consumer.stats().snapshot().failures);
  EXPECT_TRUE(sink.letters.empty()) << "two deliveries in one batch spent both attempts";
  v = apply_batch(n, {"bad", "c"}, "bad");
  EXPECT_EQ((std::vector<Verdict>{Verdict::kDeadLetter, Verdict::kAck}), v);
  ASSERT_EQ(1u, sink.letters.size());
  EXPECT_EQ(2u, sink.letters[0].attempts);
  EXPECT_TRUE(n.consumer.dead_lettered("bad"));
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAckDuplicate}), apply_batch(n, {"bad"}, "bad"));
}

TEST_F(ConsumerTest, BatchMismatchAndRetryableFailureRollsEverythingBack) {
  Node n{db()};
  EXPECT_EQ(Verdict::kAck, n.apply("m1", "other body"));
  EXPECT_EQ((std::vector<Verdict>{Verdict::kMismatch, Verdict::kAck}),
            apply_batch(n, {"m1", "m2"}));
  std::vector<Delivery> batch{Delivery{"m3", ""}, Delivery{"m4", ""}};
  EXPECT_THROW(n.consumer.consume_batch(batch,
                                        [&](Transaction& tx, std::size_t i) {
                                          tx.exec("INSERT INTO effect (message_id) VALUES (?)",
                                                  std::string(batch[i].message_id));
                                          if (i == 1) throw idem::StorageTimeout("locked");
                                        }),
               idem::StorageTimeout);
  EXPECT_EQ(0, n.effects("m3"));
  EXPECT_FALSE(n.durable.lookup(idem::Key::make("billing", "m3")));
  // The batch's fast claims were released: a redelivery runs at once.
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kAck}), apply_batch(n, {"m3", "m4"}));
  EXPECT_EQ(1, n.effects("m3"));
}

// The fast store decides what it can before the database: a completed message is acked as a
// duplicate, a message claimed elsewhere is retried later, another body is a mismatch, and
// none of them touches the record table (shown by deleting the durable record first: the
// answer still comes from the fast store).
TEST_F(ConsumerTest, BatchAnswersFastStoreDuplicatesWithoutTheDatabase) {
  Node n{db()};
  ASSERT_EQ(Verdict::kAck, n.apply("done", "body of done"));
  n.durable.database().write([](Transaction& tx) { tx.exec("DELETE FROM mq_consume_record"); });
  auto elsewhere = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            n.fast.claim(idem::Key::make("billing", "busy"), idem::fingerprint("body of busy"),
                         elsewhere, std::chrono::seconds(30)).status);
  n.fast.fill(idem::Key::make("billing", "other"), idem::fingerprint("another body"), "x",
              std::chrono::seconds(60));
  auto v = apply_batch(n, {"done", "busy", "other", "new"});
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAckDuplicate, Verdict::kRetryLater,
                                  Verdict::kMismatch, Verdict::kAck}),
            v);
  EXPECT_EQ(1, n.effects("done"));
  EXPECT_EQ(0, n.effects("busy"));
  EXPECT_EQ(0, n.effects("other"));
  EXPECT_EQ(1, n.effects("new"));
  EXPECT_FALSE(n.durable.lookup(idem::Key::make("billing", "done")));
  // The executed message's fast record is completed, so its duplicates stop at the entrance.
  auto rec = n.fast.lookup(idem::Key::make("billing", "new"));
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
}

// A fast store that lost a completed record is refilled from the durable record the batch
// found, and a failed handler's fast claim is released.
TEST_F(ConsumerTest, BatchRefillsTheFastStoreAndReleasesFailedClaims) {
  Node n{db()};
  ASSERT_EQ(Verdict::kAck, n.apply("m1", "body of m1"));
  n.fast.clear();  // the fast store forgot everything (a Redis flush)
  auto v = apply_batch(n, {"m1", "bad"}, "bad");
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAckDuplicate, Verdict::kRetryLater}), v);
  auto rec = n.fast.lookup(idem::Key::make("billing", "m1"));
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
  EXPECT_FALSE(n.fast.lookup(idem::Key::make("billing", "bad")).has_value());
  EXPECT_EQ(1, n.effects("m1"));
}

// With the fast store failing every call, batches still apply each message exactly once (the
// durable record decides), and verdicts are the same as with it.
TEST_F(ConsumerTest, BatchWithTheFastStoreDownStillAppliesOnce) {
  idem::MemoryStore inner;
  idem::test::SwitchableFastStore fast{inner};
  fast.failing = true;
  SqliteStore durable{db(), idem::sqlite::SqliteStoreOptions::mq_consume_record()};
  durable.database().write([](Transaction& tx) {
    tx.exec("CREATE TABLE IF NOT EXISTS effect (message_id TEXT NOT NULL)");
  });
  idem::IdempotencyGuard<SqliteStore> guard{fast, durable, mq_guard_options()};
  idem::IdempotentConsumer<SqliteStore> consumer{guard, "billing"};
  auto run = [&](const std::vector<std::string>& ids) {
    std::vector<std::string> fps;
    for (const auto& id : ids) fps.push_back(idem::fingerprint("body of " + id));
    std::vector<Delivery> batch;
    for (std::size_t i = 0; i < ids.size(); ++i) batch.push_back(Delivery{ids[i], fps[i]});
    return consumer.consume_batch(batch, [&](Transaction& tx, std::size_t i) {
      tx.exec("INSERT INTO effect (message_id) VALUES (?)", ids[i]);
    });
  };
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kAck, Verdict::kAckDuplicate}),
            run({"a", "b", "a"}));
  fast.failing = false;
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAckDuplicate, Verdict::kAck}), run({"b", "c"}));
  for (const char* id : {"a", "b", "c"}) {
    auto count = durable.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM effect WHERE message_id = ?", std::string(id));
    });
    EXPECT_EQ(1, count.value_or(-1)) << id;
  }
}

// --- batch calls in the guard's counters and observer ---------------------------------------

// What the guard told its observer.
struct Recorder final : idem::Observer {
  struct Call {
    idem::Outcome outcome;
    idem::Source source;
    idem::Mode mode;
    bool fast_claimed;
    bool degraded;
    std::chrono::nanoseconds handler, total;
  };
  std::vector<Call> calls;
  std::vector<idem::DuplicateSource> duplicates;
  int handler_errors = 0, downs = 0;
  std::vector<std::uint64_t> recovered;
  void on_call(const idem::CallEvent& e) noexcept override {
    calls.push_back(
        Call{e.outcome, e.source, e.mode, e.fast_claimed, e.degraded, e.handler, e.total});
  }
  void on_duplicate(const idem::DuplicateEvent& e) noexcept override {
    duplicates.push_back(e.source);
  }
  void on_handler_error(const idem::Key&) noexcept override { ++handler_errors; }
  void on_fast_store_down(const idem::Key&, const idem::Error&) noexcept override { ++downs; }
  void on_fast_store_recovered(std::uint64_t n) noexcept override { recovered.push_back(n); }
};

// A consumer over its own SQLite file and fast store, its guard observed by a Recorder.
struct Observed {
  explicit Observed(const std::string& path)
      : fast{inner},
        durable(path, idem::sqlite::SqliteStoreOptions::mq_consume_record()),
        guard(fast, durable, options()),
        consumer(guard, "billing", ledger()) {
    durable.database().write([](Transaction& tx) {
      tx.exec("CREATE TABLE IF NOT EXISTS effect (message_id TEXT NOT NULL)");
    });
  }
  idem::GuardOptions options() {
    auto o = mq_guard_options();
    o.observer = recorder;
    return o;
  }
  idem::ConsumerOptions ledger() {
    idem::ConsumerOptions o;
    o.attempts = std::make_shared<idem::sqlite::SqliteAttemptLedger>(durable.shared_database());
    return o;
  }
  // One delivery through consume(), or through consume_batch() as a batch of one.
  Verdict deliver(bool batched, const std::string& id, const std::string& body) {
    const std::string fp = idem::fingerprint(body);
    auto effect = [&](Transaction& tx) {
      tx.exec("INSERT INTO effect (message_id) VALUES (?)", id);
      if (id == "bad") throw std::runtime_error("poison");
    };
    if (!batched) return consumer.consume(Delivery{id, fp, body}, effect);
    return consumer.consume_batch(std::vector<Delivery>{Delivery{id, fp, body}},
                                  [&](Transaction& tx, std::size_t) { effect(tx); })[0];
  }
  std::vector<Verdict> batch(const std::vector<std::string>& ids) {
    return run_batch(consumer, ids, "bad");
  }

  std::shared_ptr<Recorder> recorder = std::make_shared<Recorder>();
  idem::MemoryStore inner;
  idem::test::SwitchableFastStore fast;
  SqliteStore durable;
  idem::IdempotencyGuard<SqliteStore> guard;
  idem::IdempotentConsumer<SqliteStore> consumer;
};

// The same deliveries, one by one through consume() on one consumer and as batches of one on
// another, leave the same guard counters and the same observer events: executed, fast-store
// replay and mismatch, a replay from the record table after the fast store was flushed, a
// failing handler, a message in progress elsewhere.
TEST_F(ConsumerTest, BatchCallsCountInTheGuardAsSingleCallsDo) {
  idem::test::TempDir other;
  Observed single{db()}, batched{other.file("mq.sqlite")};
  for (Observed* o : {&single, &batched}) {
    const bool b = o == &batched;
    SCOPED_TRACE(b ? "consume_batch" : "consume");
    EXPECT_EQ(Verdict::kAck, o->deliver(b, "m1", "b1"));
    EXPECT_EQ(Verdict::kAckDuplicate, o->deliver(b, "m1", "b1"));
    EXPECT_EQ(Verdict::kMismatch, o->deliver(b, "m1", "another body"));
    o->inner.clear();
    EXPECT_EQ(Verdict::kAckDuplicate, o->deliver(b, "m1", "b1"));
    EXPECT_EQ(Verdict::kRetryLater, o->deliver(b, "bad", "b2"));
    ASSERT_EQ(idem::ClaimStatus::kClaimed,
              o->inner
                  .claim(idem::Key::make("billing", "busy"), idem::fingerprint("b3"),
                         idem::OwnerToken::generate(), std::chrono::seconds(30))
                  .status);
    EXPECT_EQ(Verdict::kRetryLater, o->deliver(b, "busy", "b3"));
    EXPECT_EQ(Verdict::kAck, o->deliver(b, "m2", "b4"));
  }
  const auto a = single.guard.stats().snapshot(), b = batched.guard.stats().snapshot();
  EXPECT_EQ(7u, b.calls);
  EXPECT_EQ(2u, b.executed);
  EXPECT_EQ(2u, b.replayed);
  EXPECT_EQ(1u, b.mismatched);
  EXPECT_EQ(1u, b.in_progress);
  EXPECT_EQ(1u, b.handler_errors);
  EXPECT_EQ(3u, b.fast_hits);          // replay, mismatch, busy
  EXPECT_EQ(1u, b.durable_conflicts);  // the replay after the flush
  EXPECT_EQ(4u, b.fast_claims);        // m1, m1 after the flush, bad, m2
  for (auto [x, y] : {std::pair{a.calls, b.calls},
                      {a.executed, b.executed},
                      {a.replayed, b.replayed},
                      {a.in_progress, b.in_progress},
                      {a.mismatched, b.mismatched},
                      {a.handler_errors, b.handler_errors},
                      {a.fast_hits, b.fast_hits},
                      {a.fast_claims, b.fast_claims},
                      {a.durable_conflicts, b.durable_conflicts},
                      {a.degraded, b.degraded},
                      {a.takeovers, b.takeovers},
                      {a.leases_lost, b.leases_lost},
                      {a.fast_refills, b.fast_refills}}) {
    EXPECT_EQ(x, y);
  }
  EXPECT_DOUBLE_EQ(a.fast_hit_rate(), b.fast_hit_rate());
  const Recorder &ra = *single.recorder, &rb = *batched.recorder;
  ASSERT_EQ(ra.calls.size(), rb.calls.size());
  for (std::size_t i = 0; i < ra.calls.size(); ++i) {
    EXPECT_EQ(ra.calls[i].outcome, rb.calls[i].outcome) << i;
    EXPECT_EQ(ra.calls[i].source, rb.calls[i].source) << i;
    EXPECT_EQ(ra.calls[i].fast_claimed, rb.calls[i].fast_claimed) << i;
    EXPECT_EQ(idem::Mode::kTransactional, rb.calls[i].mode) << i;
  }
  EXPECT_EQ(ra.duplicates, rb.duplicates);
  EXPECT_EQ(1, rb.handler_errors);
  EXPECT_EQ(ra.handler_errors, rb.handler_errors);
}

// In a real batch: a repeat of an id inside the batch is a unique conflict (the record its
// first delivery wrote answered it), handler time is the delivery's own, total covers it.
TEST_F(ConsumerTest, BatchCallsReachTheObserverWithTheirSourcesAndTimings) {
  Observed o{db()};
  ASSERT_EQ(Verdict::kAck, o.deliver(false, "done", "body of done"));
  o.recorder->calls.clear();
  o.recorder->duplicates.clear();
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kAck, Verdict::kAckDuplicate,
                                  Verdict::kAckDuplicate, Verdict::kRetryLater}),
            o.batch({"x", "y", "x", "done", "bad"}));
  const Recorder& r = *o.recorder;
  ASSERT_EQ(4u, r.calls.size());  // the failing handler is an error, not a call
  EXPECT_EQ(1, r.handler_errors);
  EXPECT_EQ(idem::Outcome::kExecuted, r.calls[0].outcome);
  EXPECT_EQ(idem::Source::kHandler, r.calls[0].source);
  EXPECT_EQ(idem::Outcome::kExecuted, r.calls[1].outcome);
  EXPECT_EQ(idem::Outcome::kReplayed, r.calls[2].outcome);
  EXPECT_EQ(idem::Source::kDurableStore, r.calls[2].source);
  EXPECT_FALSE(r.calls[2].fast_claimed);
  EXPECT_EQ(idem::Outcome::kReplayed, r.calls[3].outcome);
  EXPECT_EQ(idem::Source::kFastStore, r.calls[3].source);
  EXPECT_EQ((std::vector<idem::DuplicateSource>{idem::DuplicateSource::kMqRecord,
                                                idem::DuplicateSource::kFastStore}),
            r.duplicates);
  for (int i : {0, 1}) {
    EXPECT_TRUE(r.calls[i].fast_claimed);
    EXPECT_GT(r.calls[i].handler.count(), 0);
    EXPECT_GE(r.calls[i].total, r.calls[i].handler);
  }
  EXPECT_EQ(0, r.calls[3].handler.count());
  const auto s = o.guard.stats().snapshot();
  EXPECT_EQ(6u, s.calls);  // "done" before, then five deliveries
  EXPECT_EQ(1u, s.fast_hits);
  EXPECT_EQ(1u, s.durable_conflicts);
  EXPECT_EQ(1u, s.handler_errors);
}

// A fast store failing for a whole batch: every call counts as degraded, the observer hears
// of the outage once, and of the recovery (with the failed calls) at the next batch.
TEST_F(ConsumerTest, BatchWithTheFastStoreDownIsDegradedInTheGuardCounters) {
  Observed o{db()};
  o.fast.failing = true;
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kAck}), o.batch({"a", "b"}));
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAckDuplicate}), o.batch({"a"}));
  auto s = o.guard.stats().snapshot();
  EXPECT_EQ(3u, s.degraded);
  EXPECT_EQ(1u, s.durable_conflicts);
  EXPECT_EQ(0u, s.fast_claims);
  EXPECT_EQ(1, o.recorder->downs);
  ASSERT_EQ(3u, o.recorder->calls.size());
  for (const auto& c : o.recorder->calls) EXPECT_TRUE(c.degraded);
  o.fast.failing = false;
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck}), o.batch({"c"}));
  EXPECT_EQ((std::vector<std::uint64_t>{3}), o.recorder->recovered);
  EXPECT_TRUE(o.batch({}).empty());  // an empty read: nothing decided, nothing counted
  s = o.guard.stats().snapshot();
  EXPECT_EQ(3u, s.degraded);
  EXPECT_EQ(1u, s.fast_claims);
}

// The first durable run of a batch has no savepoints; a failing handler makes the batch run
// again with one per message. Effects stay once; handlers of a rerun batch ran twice.
TEST_F(ConsumerTest, BatchRerunsWithSavepointsOnlyWhenAHandlerFails) {
  Node n{db()};
  std::map<std::string, int> calls;
  auto run = [&](const std::vector<std::string>& ids, const std::string& poison) {
    std::vector<std::string> fps;
    for (const auto& id : ids) fps.push_back(idem::fingerprint("body of " + id));
    std::vector<Delivery> batch;
    for (std::size_t i = 0; i < ids.size(); ++i) batch.push_back(Delivery{ids[i], fps[i]});
    return n.consumer.consume_batch(batch, [&](Transaction& tx, std::size_t i) {
      ++calls[ids[i]];
      tx.exec("INSERT INTO effect (message_id) VALUES (?)", ids[i]);
      if (ids[i] == poison) throw std::runtime_error("poison");
    });
  };
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kAck}), run({"a", "b"}, ""));
  EXPECT_EQ(0u, n.consumer.stats().snapshot().batch_reruns);
  EXPECT_EQ(1, calls["a"]);
  EXPECT_EQ(1, calls["b"]);

  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kRetryLater, Verdict::kAck}),
            run({"c", "bad", "d"}, "bad"));
  EXPECT_EQ(1u, n.consumer.stats().snapshot().batch_reruns);
  EXPECT_EQ(2, calls["c"]);    // first run rolled back, then again with a savepoint
  EXPECT_EQ(2, calls["bad"]);  // failed in both runs: one failed attempt counted
  EXPECT_EQ(1, calls["d"]);    // not reached in the first run
  EXPECT_EQ(1u, n.consumer.stats().snapshot().failures);
  for (const char* id : {"a", "b", "c", "d"}) EXPECT_EQ(1, n.effects(id)) << id;
  EXPECT_EQ(0, n.effects("bad"));
  EXPECT_FALSE(n.durable.lookup(idem::Key::make("billing", "bad")));
}

// A record whose retention ended no longer counts: the batch removes it and runs the message
// again (as consume does); a live record still answers the duplicate.
TEST_F(ConsumerTest, BatchRunsAgainAfterTheRecordRetentionEnded) {
  idem::ManualClock clock;
  auto options = idem::sqlite::SqliteStoreOptions::mq_consume_record();
  options.clock = clock.as_clock();
  SqliteStore durable{db(), options};
  durable.database().write([](Transaction& tx) {
    tx.exec("CREATE TABLE IF NOT EXISTS effect (message_id TEXT NOT NULL)");
  });
  idem::GuardOptions go = mq_guard_options();
  go.retention = std::chrono::hours(1);
  idem::IdempotencyGuard<SqliteStore> guard{durable, go};
  idem::IdempotentConsumer<SqliteStore> consumer{guard, "billing"};
  const std::string fp = idem::fingerprint("body");
  auto run = [&] {
    return consumer.consume_batch({Delivery{"m1", fp}}, [&](Transaction& tx, std::size_t) {
      tx.exec("INSERT INTO effect (message_id) VALUES ('m1')");
    });
  };
  auto effects = [&] {
    return durable.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM effect").value_or(-1);
    });
  };
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck}), run());
  clock.advance(std::chrono::minutes(59));
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAckDuplicate}), run());
  EXPECT_EQ(1, effects());
  clock.advance(std::chrono::minutes(2));
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck}), run());
  EXPECT_EQ(2, effects());
  auto rec = durable.lookup(idem::Key::make("billing", "m1"));
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
  EXPECT_GT(rec->expires_at, clock.now());
}

TEST_F(ConsumerTest, ConcurrentOverlappingBatchesOneEffectEach) {
  Node n{db()};
  constexpr int kThreads = 6, kMessages = 60;
  std::atomic<int> acks{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int from = 0; from < kMessages; from += 10) {
        std::vector<std::string> ids;
        for (int m = from; m < from + 10; ++m) ids.push_back("m" + std::to_string((m + t) % kMessages));
        for (Verdict v : apply_batch(n, ids)) acks += v == Verdict::kAck;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(kMessages, acks.load());
  for (int m = 0; m < kMessages; ++m) EXPECT_EQ(1, n.effects("m" + std::to_string(m)));
}

// Handlers that rewrite the bytes their Delivery views (message id and fingerprint, freeing
// the old buffers): consume (transactional, two-phase) and consume_batch (including its rerun
// with savepoints after a failing handler) record the ids and fingerprints as delivered, one
// effect each, and a redelivery as delivered is a duplicate, not a mismatch.
TEST_F(ConsumerTest, HandlersRewritingTheirDeliveryRecordWhatWasDelivered) {
  Sink sink;
  idem::ConsumerOptions o;
  o.max_attempts = 1;
  o.dead_letter = sink.fn();
  Node n{db(), o};
  auto expect_record = [&](const std::string& id, const std::string& fp,
                           idem::Record::Status status) {
    auto rec = n.durable.lookup(idem::Key::make("billing", id));
    ASSERT_TRUE(rec.has_value()) << id;
    EXPECT_EQ(status, rec->status) << id;
    EXPECT_EQ(fp, rec->fingerprint) << id;
    auto fast = n.fast.lookup(idem::Key::make("billing", id));
    if (status == idem::Record::Status::kCompleted) {
      ASSERT_TRUE(fast.has_value()) << id;
      EXPECT_EQ(fp, fast->fingerprint) << id;
    }
  };
  const std::string long_tail(64, 'm');
  for (int mode = 0; mode < 2; ++mode) {
    const std::string id0 = "single_" + std::to_string(mode) + "_" + long_tail;
    const std::string fp0 = idem::fingerprint("body " + id0);
    std::string id = id0, fp = fp0;
    auto rewrite = [&] {
      id = std::string(200, 'x');  // both move-assigned: the viewed buffers are freed
      fp = std::string(200, 'y');
    };
    Verdict v;
    if (mode == 0) {
      v = n.consumer.consume(Delivery{id, fp}, [&](Transaction& tx) {
        rewrite();
        tx.exec("INSERT INTO effect (message_id) VALUES (?)", id0);
      });
      EXPECT_EQ(1, n.effects(id0));
    } else {
      v = n.consumer.consume(Delivery{id, fp}, [&] { rewrite(); });
    }
    EXPECT_EQ(Verdict::kAck, v);
    expect_record(id0, fp0, idem::Record::Status::kCompleted);
    EXPECT_EQ(Verdict::kAckDuplicate, n.consumer.consume(Delivery{id0, fp0}, [] {}));
  }
  // A failing handler that rewrites its delivery is dead-lettered under what was delivered.
  {
    const std::string id0 = "poison_" + long_tail;
    const std::string fp0 = idem::fingerprint("body " + id0);
    std::string id = id0, fp = fp0;
    EXPECT_EQ(Verdict::kDeadLetter, n.consumer.consume(Delivery{id, fp}, [&](Transaction&) {
      id = std::string(200, 'x');
      fp = std::string(200, 'y');
      throw std::runtime_error("poison");
    }));
    expect_record(id0, fp0, idem::Record::Status::kFailed);
    EXPECT_EQ(Verdict::kAckDuplicate, n.consumer.consume(Delivery{id0, fp0}, [] {}));
  }
  // A batch whose first handler rewrites every delivery's bytes, and whose second fails, so
  // the batch runs again with savepoints and writes its records after the rewrite.
  std::vector<std::string> ids0, fps0;
  for (int i = 0; i < 3; ++i) {
    ids0.push_back("batch_" + std::to_string(i) + "_" + long_tail);
    fps0.push_back(idem::fingerprint("body " + ids0.back()));
  }
  std::vector<std::string> ids = ids0, fps = fps0;
  std::vector<Delivery> batch;
  for (std::size_t i = 0; i < ids.size(); ++i) batch.push_back(Delivery{ids[i], fps[i]});
  auto verdicts = n.consumer.consume_batch(batch, [&](Transaction& tx, std::size_t i) {
    for (std::size_t j = 0; j < ids.size(); ++j) {
      ids[j] = std::string(200, 'x');
      fps[j] = std::string(200, 'y');
      ids[j].shrink_to_fit();
      fps[j].shrink_to_fit();
    }
    tx.exec("INSERT INTO effect (message_id) VALUES (?)", ids0[i]);
    if (i == 1) throw std::runtime_error("poison in a batch");
  });
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kDeadLetter, Verdict::kAck}), verdicts);
  for (std::size_t i : {0u, 2u}) {
    EXPECT_EQ(1, n.effects(ids0[i]));
    expect_record(ids0[i], fps0[i], idem::Record::Status::kCompleted);
    EXPECT_EQ(Verdict::kAckDuplicate, n.consumer.consume(Delivery{ids0[i], fps0[i]}, [] {}));
  }
  EXPECT_EQ(0, n.effects(ids0[1]));
  expect_record(ids0[1], fps0[1], idem::Record::Status::kFailed);
}

TEST(ConsumerOptionsTest, RejectsBadGroupAndZeroAttempts) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  EXPECT_THROW(idem::IdempotentConsumer(guard, "bad group"), idem::InvalidKey);
  idem::ConsumerOptions o;
  o.max_attempts = 0;
  EXPECT_THROW(idem::IdempotentConsumer(guard, "g", o), idem::UsageError);
  EXPECT_EQ("ack_duplicate", idem::verdict_name(Verdict::kAckDuplicate));
}

TEST(MessageIdTest, BuildsAnIdFromBusinessNumberEventAndVersion) {
  EXPECT_EQ("order_20001:paid:v3", idem::make_message_id("order_20001", "paid", 3));
  EXPECT_THROW(idem::make_message_id("", "paid", 1), idem::InvalidKey);
}

}  // namespace
