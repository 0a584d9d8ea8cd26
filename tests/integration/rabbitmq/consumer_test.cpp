// SPDX-License-Identifier: MIT
// IdempotentConsumer on a real RabbitMQ queue through idem::rabbitmq::ConsumerLoop: ack, ack
// duplicate, retry later (nack-requeue while another consumer holds the message), mismatch
// parked, poison dead-lettered after max_attempts with the rest flowing, ids from headers,
// quorum delivery counts, a lost ack after the commit.
#include "idem/consumer.hpp"

#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <regex>
#include <stdexcept>
#include <string>
#include <thread>

#include "../postgres/tcp_proxy.hpp"
#include "idem/memory_store.hpp"
#include "idem/rabbitmq/consumer_loop.hpp"
#include "idem/sqlite/attempt_ledger.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "rabbit_support.hpp"

namespace {

using idem::Verdict;
using idem::rabbitmq::ConsumerLoop;
using idem::rabbitmq::ConsumerLoopOptions;
using idem::rabbitmq::Message;
using idem::rabbitmq::QueueConsumer;
using idem::sqlite::SqliteStore;
using idem::sqlite::Transaction;
using namespace std::chrono_literals;

// One consumer "process": a SQLite file with the consume record, the effects and the attempt
// ledger, a guard over a fast store (its own MemoryStore, or one shared with other nodes as
// Redis would be), and an IdempotentConsumer whose dead letters go to `<queue>.dead`.
struct Node {
  // `dead` empty: no dead-letter sink.
  Node(const std::string& db, idem::rabbitmq::Publisher& publisher,
       const idem::rabbitmq::Destination& dead, idem::FastStore* shared_fast = nullptr)
      : durable(db, idem::sqlite::SqliteStoreOptions::mq_consume_record()),
        guard(shared_fast ? *shared_fast : own_fast, durable, guard_options()),
        consumer(guard, "billing", consumer_options(publisher, dead)) {
    durable.database().write([](Transaction& tx) {
      tx.exec("CREATE TABLE IF NOT EXISTS effect (message_id TEXT NOT NULL, body TEXT)");
    });
  }

  static idem::GuardOptions guard_options() {
    idem::GuardOptions o;
    o.durable_source = idem::DuplicateSource::kMqRecord;
    return o;
  }

  idem::ConsumerOptions consumer_options(idem::rabbitmq::Publisher& publisher,
                                         const idem::rabbitmq::Destination& dead) {
    idem::ConsumerOptions o;
    o.max_attempts = 3;
    if (!dead.empty()) o.dead_letter = idem::rabbitmq::dead_letter_sink(publisher, dead);
    o.attempts = std::make_shared<idem::sqlite::SqliteAttemptLedger>(durable.shared_database());
    return o;
  }

  // The business effect: one row, in the consume record's transaction. Bodies starting with
  // "poison" fail.
  void apply(Transaction& tx, const Message& m) {
    if (m.body.rfind("poison", 0) == 0) throw std::runtime_error("cannot apply " + m.body);
    tx.exec("INSERT INTO effect (message_id, body) VALUES (?, ?)",
            idem::rabbitmq::message_id_of(m, ids), m.body);
  }

  std::map<std::string, long> effects() {
    std::map<std::string, long> out;
    durable.database().read([&](idem::sqlite::Session& s) {
      auto st = s.prepare("SELECT message_id, count(*) FROM effect GROUP BY message_id");
      while (st.step()) out[st.column_bytes(0)] = static_cast<long>(st.column_int64(1));
    });
    return out;
  }

  idem::MemoryStore own_fast;
  SqliteStore durable;
  idem::IdempotencyGuard<SqliteStore> guard;
  idem::IdempotentConsumer<SqliteStore> consumer;
  idem::rabbitmq::MessageIdRule ids;
};

class RabbitConsumerTest : public idem::test::RabbitTest {
 protected:
  void SetUp() override {
    RabbitTest::SetUp();
    if (HasFatalFailure() || IsSkipped()) return;
    queue_ = queue_name("idem-test-consumer");
    dead_ = idem::rabbitmq::declare_dead_letters(*publisher_, queue_);
    park_ = idem::rabbitmq::declare_parking(*publisher_, queue_);
    declare(queue_);
  }

  ConsumerLoopOptions loop_options() {
    ConsumerLoopOptions o;
    o.wait = 300ms;
    o.retry_delay = 50ms;
    o.park = park_;
    return o;
  }

  // Polls until the queue has been quiet (nothing received, nothing held) for `quiet` polls.
  template <class Loop, class Fn>
  void run_until_drained(Loop& loop, Fn&& poll, int quiet = 2) {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    int idle = 0;
    while (idle < quiet && std::chrono::steady_clock::now() < deadline) {
      idle = (poll() == 0 && loop.held() == 0) ? idle + 1 : 0;
    }
    ASSERT_GE(idle, quiet) << "the queue did not drain";
  }

  std::string queue_;
  idem::rabbitmq::Destination dead_, park_;
  idem::test::TempDir dir_;
};

TEST_F(RabbitConsumerTest, AckAndAckDuplicateOnceEachWithBothLoops) {
  for (bool batched : {false, true}) {
    Node node{dir_.file(batched ? "b.db" : "e.db"), *publisher_, dead_};
    QueueConsumer broker{consumer_options(queue_)};
    ConsumerLoop loop{broker, node.consumer, loop_options(), publisher_.get()};
    broker.connect();
    // m1 twice: a producer retry (same message id, a new broker message).
    publish(queue_, {{"m1", "one"}, {"m2", "two"}, {"m1", "one"}, {"m3", "three"}});
    auto handler = [&](Transaction& tx, const Message& m) { node.apply(tx, m); };
    run_until_drained(loop,
                      [&] { return batched ? loop.poll_batch(handler) : loop.poll_each(handler); });
    std::map<std::string, long> expected{{"m1", 1}, {"m2", 1}, {"m3", 1}};
    EXPECT_EQ(expected, node.effects()) << "batched=" << batched;
    auto s = node.consumer.stats().snapshot();
    EXPECT_EQ(3u, s.acked);
    EXPECT_EQ(1u, s.duplicates);
    EXPECT_EQ(0u, s.redeliveries);
    EXPECT_EQ(4u, loop.stats().acked);
    EXPECT_EQ(0u, broker.unsettled());
    broker.close();
    EXPECT_EQ(0u, publisher_->queue_info(queue_).messages);
  }
}

// Consumer A holds m1 (its handler is running); a producer retry of m1 reaches consumer B,
// whose fast-store claim is busy: retry_later, held, nacked back with requeue, redelivered to
// B until A commits; then B acks it as a duplicate. One effect.
TEST_F(RabbitConsumerTest, RetryLaterRequeuesWhileAnotherConsumerHoldsTheMessage) {
  idem::MemoryStore shared_fast;  // what Redis is to two processes
  Node a{dir_.file("shared.db"), *publisher_, dead_, &shared_fast};
  Node b{dir_.file("shared.db"), *publisher_, dead_, &shared_fast};
  QueueConsumer broker_a{consumer_options(queue_, 1)};
  QueueConsumer broker_b{consumer_options(queue_, 1)};
  ConsumerLoop loop_a{broker_a, a.consumer, loop_options(), publisher_.get()};
  ConsumerLoop loop_b{broker_b, b.consumer, loop_options(), publisher_.get()};
  broker_a.connect();
  publish(queue_, {{"m1", "one"}});
  std::mutex mu;
  std::condition_variable cv;
  bool a_running = false, release_a = false;
  std::thread ta([&] {
    std::size_t got = 0;
    while (got == 0) {
      got = loop_a.poll_each([&](Transaction& tx, const Message& m) {
        {
          std::unique_lock<std::mutex> l(mu);
          a_running = true;
          cv.notify_all();
          cv.wait(l, [&] { return release_a; });
        }
        a.apply(tx, m);
      });
    }
  });
  {
    std::unique_lock<std::mutex> l(mu);
    ASSERT_TRUE(cv.wait_for(l, 10s, [&] { return a_running; }));
  }
  broker_b.connect();
  publish(queue_, {{"m1", "one"}});  // the producer's retry
  auto handler_b = [&](Transaction& tx, const Message& m) { b.apply(tx, m); };
  ASSERT_TRUE(idem::test::eventually([&] {
    loop_b.poll_each(handler_b);
    return b.consumer.stats().snapshot().retry_later >= 3;
  }));
  EXPECT_EQ(0u, b.effects().size());  // A has not committed
  {
    std::lock_guard<std::mutex> l(mu);
    release_a = true;
  }
  cv.notify_all();
  ta.join();
  run_until_drained(loop_b, [&] { return loop_b.poll_each(handler_b); });
  std::map<std::string, long> expected{{"m1", 1}};
  EXPECT_EQ(expected, a.effects());
  auto sa = a.consumer.stats().snapshot();
  auto sb = b.consumer.stats().snapshot();
  EXPECT_EQ(1u, sa.acked);
  EXPECT_EQ(0u, sb.acked);
  EXPECT_EQ(1u, sb.duplicates);
  EXPECT_GE(sb.retry_later, 3u);
  // Every retry_later went back to the queue and came back flagged redelivered.
  EXPECT_EQ(sb.retry_later, loop_b.stats().requeued);
  EXPECT_EQ(sb.retry_later, sb.redeliveries);
  broker_a.close();
  broker_b.close();
  EXPECT_EQ(0u, publisher_->queue_info(queue_).messages);
}

TEST_F(RabbitConsumerTest, MismatchIsParkedAndAckedOrRejectedToTheDeadLetterExchange) {
  Node node{dir_.file("m.db"), *publisher_, dead_};
  QueueConsumer broker{consumer_options(queue_)};
  ConsumerLoop loop{broker, node.consumer, loop_options(), publisher_.get()};
  broker.connect();
  publish(queue_, {{"m1", "the real body"}, {"m1", "another body"}});
  auto handler = [&](Transaction& tx, const Message& m) { node.apply(tx, m); };
  run_until_drained(loop, [&] { return loop.poll_batch(handler); });
  EXPECT_EQ(1u, node.effects()["m1"]);
  EXPECT_EQ(1u, node.consumer.stats().snapshot().mismatched);
  EXPECT_EQ(1u, loop.stats().parked);
  auto parked = drain(queue_ + ".parked");
  ASSERT_EQ(1u, parked.size());
  EXPECT_EQ("m1", parked[0].message_id);
  EXPECT_EQ("another body", parked[0].body);
  ASSERT_NE(nullptr, parked[0].header("x-idem-verdict"));
  EXPECT_EQ("mismatch", *parked[0].header("x-idem-verdict"));

  // Without a parking destination: rejected without requeue, to the queue's own
  // x-dead-letter-exchange.
  const std::string q2 = queue_name("idem-test-consumer");
  auto dead2 = idem::rabbitmq::declare_dead_letters(*publisher_, q2);
  auto o = consumer_options(q2);
  o.queue.dead_letter_exchange = dead2.exchange;
  QueueConsumer broker2{o};
  auto lo = loop_options();
  lo.park = {};
  Node node2{dir_.file("m2.db"), *publisher_, dead2};
  ConsumerLoop loop2{broker2, node2.consumer, lo};
  broker2.connect();
  publish(q2, {{"m1", "the real body"}, {"m1", "another body"}});
  auto handler2 = [&](Transaction& tx, const Message& m) { node2.apply(tx, m); };
  run_until_drained(loop2, [&] { return loop2.poll_batch(handler2); });
  EXPECT_EQ(1u, loop2.stats().rejected);
  auto rejected = drain(q2 + ".dead");
  ASSERT_EQ(1u, rejected.size());
  EXPECT_EQ("another body", rejected[0].body);
}

TEST_F(RabbitConsumerTest, PoisonIsDeadLetteredAfterMaxAttemptsWhileTheRestFlows) {
  for (bool batched : {false, true}) {
    const std::string db = dir_.file(batched ? "pb.db" : "pe.db");
    Node node{db, *publisher_, dead_};
    QueueConsumer broker{consumer_options(queue_)};
    ConsumerLoop loop{broker, node.consumer, loop_options(), publisher_.get()};
    broker.connect();
    std::vector<std::pair<std::string, std::string>> msgs{{"p1", "poison 1"}};
    for (int i = 0; i < 20; ++i) msgs.emplace_back("m" + std::to_string(i), "ok");
    publish(queue_, msgs);
    auto handler = [&](Transaction& tx, const Message& m) { node.apply(tx, m); };
    run_until_drained(loop,
                      [&] { return batched ? loop.poll_batch(handler) : loop.poll_each(handler); });
    auto effects = node.effects();
    EXPECT_EQ(20u, effects.size());
    for (const auto& [id, n] : effects) EXPECT_EQ(1, n) << id;
    auto s = node.consumer.stats().snapshot();
    EXPECT_EQ(1u, s.dead_lettered);
    EXPECT_EQ(3u, s.failures);
    EXPECT_EQ(2u, s.redeliveries);  // the poison message's second and third deliveries
    EXPECT_EQ(2u, loop.stats().requeued);
    EXPECT_TRUE(node.consumer.dead_lettered("p1"));
    auto dl = drain(queue_ + ".dead");
    ASSERT_EQ(1u, dl.size());
    EXPECT_EQ("p1", dl[0].message_id);
    EXPECT_EQ("poison 1", dl[0].body);
    ASSERT_NE(nullptr, dl[0].header("x-idem-attempts"));
    EXPECT_EQ("3", *dl[0].header("x-idem-attempts"));
    EXPECT_EQ("billing", *dl[0].header("x-idem-group"));
    EXPECT_NE(std::string::npos, dl[0].header("x-idem-error")->find("cannot apply")) << batched;
    // A later copy of the poison message is a duplicate: acked, nothing runs.
    publish(queue_, {{"p1", "poison 1"}});
    run_until_drained(loop, [&] { return loop.poll_each(handler); });
    EXPECT_EQ(1u, node.consumer.stats().snapshot().duplicates);
    EXPECT_TRUE(drain(queue_ + ".dead").empty());
    broker.close();
    EXPECT_EQ(0u, publisher_->queue_info(queue_).messages);
  }
}

// A consumer without a dead-letter sink never drops a poison message: after max_attempts the
// loop rejects it without requeue, to the queue's own x-dead-letter-exchange.
TEST_F(RabbitConsumerTest, PoisonWithoutASinkGoesToTheQueuesDeadLetterExchange) {
  for (bool batched : {false, true}) {
    const std::string q = queue_name("idem-test-consumer");
    auto dead = idem::rabbitmq::declare_dead_letters(*publisher_, q);
    auto o = consumer_options(q);
    o.queue.dead_letter_exchange = dead.exchange;
    QueueConsumer broker{o};
    Node node{dir_.file(batched ? "nsb.db" : "nse.db"), *publisher_, {}};
    ConsumerLoop loop{broker, node.consumer, loop_options(), publisher_.get()};
    broker.connect();
    publish(q, {{"p1", "poison 1"}, {"m1", "ok"}});
    auto handler = [&](Transaction& tx, const Message& m) { node.apply(tx, m); };
    run_until_drained(loop,
                      [&] { return batched ? loop.poll_batch(handler) : loop.poll_each(handler); });
    EXPECT_EQ(1u, node.consumer.stats().snapshot().dead_lettered) << batched;
    EXPECT_TRUE(node.consumer.dead_lettered("p1"));
    EXPECT_EQ(1u, loop.stats().rejected);
    auto dl = drain(q + ".dead");
    ASSERT_EQ(1u, dl.size()) << batched;
    EXPECT_EQ("p1", dl[0].message_id);
    EXPECT_EQ("poison 1", dl[0].body);
    EXPECT_EQ(1, node.effects()["m1"]);
    broker.close();
    EXPECT_EQ(0u, publisher_->queue_info(q).messages);
  }
}

// Publishes `body` with no message-id property (the Publisher insists on one).
void publish_without_id(const std::string& url, const std::string& queue, const std::string& body,
                        const idem::rabbitmq::Headers& headers) {
  std::string buf = url;
  amqp_connection_info info{};
  ASSERT_EQ(AMQP_STATUS_OK, amqp_parse_url(buf.data(), &info));
  amqp_connection_state_t c = amqp_new_connection();
  amqp_socket_t* s = amqp_tcp_socket_new(c);
  ASSERT_EQ(AMQP_STATUS_OK, amqp_socket_open(s, info.host, info.port));
  ASSERT_EQ(AMQP_RESPONSE_NORMAL, amqp_login(c, info.vhost, 0, 131072, 0, AMQP_SASL_METHOD_PLAIN,
                                             info.user, info.password)
                                      .reply_type);
  amqp_channel_open(c, 1);
  std::vector<amqp_table_entry_t> entries;
  for (const auto& [k, v] : headers) {
    amqp_table_entry_t e{};
    e.key = amqp_cstring_bytes(k.c_str());
    e.value.kind = AMQP_FIELD_KIND_UTF8;
    e.value.value.bytes = amqp_cstring_bytes(v.c_str());
    entries.push_back(e);
  }
  amqp_basic_properties_t p{};
  p._flags = AMQP_BASIC_HEADERS_FLAG;
  p.headers = amqp_table_t{static_cast<int>(entries.size()), entries.data()};
  EXPECT_EQ(AMQP_STATUS_OK,
            amqp_basic_publish(c, 1, amqp_cstring_bytes(""), amqp_cstring_bytes(queue.c_str()), 0,
                               0, &p, amqp_cstring_bytes(body.c_str())));
  amqp_channel_close(c, 1, AMQP_REPLY_SUCCESS);
  amqp_connection_close(c, AMQP_REPLY_SUCCESS);
  amqp_destroy_connection(c);
}

// No message-id property: a configured header, else the business-number builder; a message
// with neither cannot be keyed and is dead-lettered at once (attempts 0).
TEST_F(RabbitConsumerTest, MessageIdsFromAHeaderOrTheBusinessNumber) {
  Node node{dir_.file("ids.db"), *publisher_, dead_};
  node.ids.header = "x-msg-id";
  node.ids.build = idem::rabbitmq::business_id_from_headers();
  QueueConsumer broker{consumer_options(queue_)};
  auto lo = loop_options();
  lo.ids = node.ids;
  ConsumerLoop loop{broker, node.consumer, lo, publisher_.get()};
  broker.connect();
  publish_without_id(url_, queue_, "a", {{"x-msg-id", "from-header"}});
  publish_without_id(url_, queue_, "b",
                     {{"biz_no", "order_7"}, {"event", "paid"}, {"version", "3"}});
  publish_without_id(url_, queue_, "b",
                     {{"biz_no", "order_7"}, {"event", "paid"}, {"version", "3"}});
  publish_without_id(url_, queue_, "c", {{"biz_no", "order_7"}, {"event", "paid"}});  // no version
  auto handler = [&](Transaction& tx, const Message& m) { node.apply(tx, m); };
  run_until_drained(loop, [&] { return loop.poll_batch(handler); });
  std::map<std::string, long> expected{{"from-header", 1}, {"order_7:paid:v3", 1}};
  EXPECT_EQ(expected, node.effects());
  auto s = node.consumer.stats().snapshot();
  EXPECT_EQ(2u, s.acked);
  EXPECT_EQ(1u, s.duplicates);
  EXPECT_EQ(1u, s.dead_lettered);
  auto dl = drain(queue_ + ".dead");
  ASSERT_EQ(1u, dl.size());
  EXPECT_EQ("c", dl[0].body);
  EXPECT_EQ("0", *dl[0].header("x-idem-attempts"));
}

// A quorum queue counts deliveries itself: the poison message reaches the consumer with
// delivery counts 1, 2, 3 (x-delivery-count 0, 1, 2).
TEST_F(RabbitConsumerTest, QuorumQueueDeliveryCountsReachTheConsumer) {
  const std::string q = queue_name("idem-test-consumer");
  auto dead = idem::rabbitmq::declare_dead_letters(*publisher_, q);
  auto o = consumer_options(q);
  o.queue.type = idem::rabbitmq::QueueType::kQuorum;
  QueueConsumer broker{o};
  broker.connect();
  Node node{dir_.file("q.db"), *publisher_, dead};
  ConsumerLoop loop{broker, node.consumer, loop_options(), publisher_.get()};
  publish(q, {{"p1", "poison"}, {"m1", "ok"}});
  std::vector<std::uint32_t> counts;
  auto handler = [&](Transaction& tx, const Message& m) {
    if (m.message_id == "p1") counts.push_back(idem::rabbitmq::delivery_count_of(m));
    node.apply(tx, m);
  };
  run_until_drained(loop, [&] { return loop.poll_each(handler); });
  EXPECT_EQ((std::vector<std::uint32_t>{1, 2, 3}), counts);
  EXPECT_EQ(2u, node.consumer.stats().snapshot().redeliveries);
  EXPECT_EQ(1u, node.consumer.stats().snapshot().dead_lettered);
  EXPECT_EQ(1u, drain(q + ".dead").size());
}

// The commit happened, the ack never reached the broker (the connection died in between):
// the redelivery is answered from the consume record, nothing runs twice.
TEST_F(RabbitConsumerTest, AckLostAfterTheCommitIsADuplicateOnRedelivery) {
  Node node{dir_.file("lost.db"), *publisher_, dead_};
  QueueConsumer broker{consumer_options(queue_)};
  ConsumerLoop loop{broker, node.consumer, loop_options(), publisher_.get()};
  broker.connect();
  publish(queue_, {{"m1", "one"}, {"m2", "two"}});
  auto batch = loop.receive();
  while (batch.size() < 2) {
    auto more = loop.receive();
    batch.insert(batch.end(), more.begin(), more.end());
  }
  idem::rabbitmq::Deliveries d{batch};
  auto verdicts = node.consumer.consume_batch(
      d.all(), [&](Transaction& tx, std::size_t i) { node.apply(tx, batch[i]); });
  EXPECT_EQ((std::vector<Verdict>{Verdict::kAck, Verdict::kAck}), verdicts);
  broker.close();                   // dies before the ack
  loop.settle(batch, d, verdicts);  // nothing to send: stale
  EXPECT_EQ(2u, loop.stats().stale);
  auto handler = [&](Transaction& tx, const Message& m) { node.apply(tx, m); };
  run_until_drained(loop, [&] { return loop.poll_batch(handler); });
  std::map<std::string, long> expected{{"m1", 1}, {"m2", 1}};
  EXPECT_EQ(expected, node.effects());
  auto s = node.consumer.stats().snapshot();
  EXPECT_EQ(2u, s.duplicates);
  EXPECT_EQ(2u, s.redeliveries);
  broker.close();
  EXPECT_EQ(0u, publisher_->queue_info(queue_).messages);
}

// A store fails while the connection stays up (here the handler's own database times out: a
// retryable idem error, which consume and consume_batch propagate). The deliveries the failed
// call left without a verdict are held and requeued after retry_delay, not left unacked on the
// live channel (the broker would return them only when the connection closes, and a prefetch
// window full of them would stop the consumer). Every message ends applied once and settled.
TEST_F(RabbitConsumerTest, AStoreFailureOnALiveConnectionRequeuesTheUnsettledDeliveries) {
  for (bool batched : {false, true}) {
    SCOPED_TRACE(batched ? "poll_batch" : "poll_each");
    Node node{dir_.file(batched ? "fail_b.db" : "fail_e.db"), *publisher_, dead_};
    QueueConsumer broker{consumer_options(queue_)};
    ConsumerLoop loop{broker, node.consumer, loop_options(), publisher_.get()};
    broker.connect();
    publish(queue_, {{"m1", "one"}, {"m2", "two"}, {"m3", "three"}});
    std::atomic<int> timeouts{0};
    auto handler = [&](Transaction& tx, const Message& m) {
      if (m.body == "two" && timeouts.fetch_add(1) == 0) {
        throw idem::StorageTimeout("the business database did not answer in time");
      }
      node.apply(tx, m);
    };
    int errors = 0;
    run_until_drained(loop, [&]() -> std::size_t {
      try {
        return batched ? loop.poll_batch(handler) : loop.poll_each(handler);
      } catch (const idem::StorageTimeout&) {
        ++errors;
        return 1;  // not idle
      }
    });
    EXPECT_EQ(1, errors);
    std::map<std::string, long> expected{{"m1", 1}, {"m2", 1}, {"m3", 1}};
    EXPECT_EQ(expected, node.effects());
    EXPECT_EQ(0u, broker.unsettled());
    EXPECT_EQ(0u, loop.held());
    broker.close();
    EXPECT_EQ(0u, publisher_->queue_info(queue_).messages);
  }
}

// A loop destroyed while it holds deliveries for a later requeue (a failed batch, a long
// retry_delay), its channel still open: the held deliveries are nacked back to the queue at
// once, so that the next loop on the same channel gets them (left unacked, they would come back
// only when the connection closes, and fill the prefetch window meanwhile).
TEST_F(RabbitConsumerTest, ALoopDestroyedWhileHoldingDeliveriesRequeuesThem) {
  Node node{dir_.file("held.db"), *publisher_, dead_};
  QueueConsumer broker{consumer_options(queue_)};
  broker.connect();
  publish(queue_, {{"m1", "one"}, {"m2", "two"}, {"m3", "three"}});
  {
    auto options = loop_options();
    options.retry_delay = 600s;  // held far longer than this test runs
    ConsumerLoop first{broker, node.consumer, options, publisher_.get()};
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (first.held() < 3 && std::chrono::steady_clock::now() < deadline) {
      try {
        (void)first.poll_batch([](Transaction&, const Message&) {
          throw idem::StorageTimeout("the business database did not answer in time");
        });
      } catch (const idem::StorageTimeout&) {  // the batch is held
      }
    }
    ASSERT_EQ(3u, first.held());
    ASSERT_EQ(3u, broker.unsettled());
  }  // destroyed holding them
  EXPECT_EQ(0u, broker.unsettled()) << "the held deliveries were left unacked on the channel";
  ConsumerLoop second{broker, node.consumer, loop_options(), publisher_.get()};
  run_until_drained(second, [&] {
    return second.poll_batch([&](Transaction& tx, const Message& m) { node.apply(tx, m); });
  });
  std::map<std::string, long> expected{{"m1", 1}, {"m2", 1}, {"m3", 1}};
  EXPECT_EQ(expected, node.effects());
  EXPECT_EQ(0u, broker.unsettled());
  broker.close();
  EXPECT_EQ(0u, publisher_->queue_info(queue_).messages);
}

// The connection dies after the broker got a publish and before its confirm came back (a
// proxy forwards the frame, then cuts both sides): the Publisher reconnects and publishes the
// message again with the same id. Two copies reach the queue; the consumer applies one.
TEST_F(RabbitConsumerTest, UnconfirmedPublishIsPublishedAgainAndTheCopyIsADuplicate) {
  std::smatch m;
  ASSERT_TRUE(std::regex_search(url_, m, std::regex(":([0-9]+)/")));
  idem::test::CommitDroppingProxy proxy{std::stoi(m[1])};
  idem::rabbitmq::PublisherOptions po;
  po.connection = idem::test::rabbit_connection(
      std::regex_replace(url_, std::regex(":[0-9]+/"), ":" + std::to_string(proxy.port()) + "/"));
  idem::rabbitmq::Publisher producer{po};
  idem::rabbitmq::OutgoingMessage out;
  out.routing_key = queue_;
  out.message_id = "order_9:paid:v1";
  out.body = "COMMIT order 9";  // the proxy cuts the connection after forwarding this
  proxy.drop_next_commit = true;
  producer.publish(out);  // confirmed on the second round
  EXPECT_EQ(1, proxy.dropped.load());
  auto ps = producer.stats();
  EXPECT_EQ(2u, ps.published);
  EXPECT_EQ(1u, ps.republished);
  EXPECT_EQ(1u, ps.confirmed);
  EXPECT_EQ(1u, ps.connection.connection_losses);
  EXPECT_EQ(2u, publisher_->queue_info(queue_).messages);

  Node node{dir_.file("p.db"), *publisher_, dead_};
  QueueConsumer broker{consumer_options(queue_)};
  ConsumerLoop loop{broker, node.consumer, loop_options(), publisher_.get()};
  auto handler = [&](Transaction& tx, const Message& msg) { node.apply(tx, msg); };
  run_until_drained(loop, [&] { return loop.poll_batch(handler); });
  std::map<std::string, long> expected{{"order_9:paid:v1", 1}};
  EXPECT_EQ(expected, node.effects());
  EXPECT_EQ(1u, node.consumer.stats().snapshot().acked);
  EXPECT_EQ(1u, node.consumer.stats().snapshot().duplicates);
}

}  // namespace
