// SPDX-License-Identifier: MIT
// idem::rabbitmq::QueueConsumer and Publisher against a real RabbitMQ node: properties and
// headers, acks (single and multiple), nack/reject, redelivery flags and counts, confirms,
// unroutable publishes, typed errors, stale deliveries, heartbeats over a long handler.
#include "idem/rabbitmq/client.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>

#include "../postgres/tcp_proxy.hpp"
#include "idem/errors.hpp"
#include "idem/rabbitmq/consumer_loop.hpp"
#include "rabbit_support.hpp"

namespace {

using idem::rabbitmq::Message;
using idem::rabbitmq::OutgoingMessage;
using idem::rabbitmq::QueueConsumer;
using idem::rabbitmq::QueueType;
using namespace std::chrono_literals;

class RabbitClientTest : public idem::test::RabbitTest {};

TEST_F(RabbitClientTest, PublishConsumeAckKeepsPropertiesAndHeaders) {
  const std::string q = queue_name();
  QueueConsumer c{consumer_options(q)};
  c.connect();  // declares the queue before anything is published to it
  OutgoingMessage m;
  m.routing_key = q;
  m.message_id = "order_1:paid:v1";
  m.body = std::string("a\0b", 3);
  m.content_type = "application/json";
  m.headers = {{"biz_no", "order_1"}, {"event", "paid"}};
  publisher_->publish(m);
  auto batch = c.receive(10, 2s);
  ASSERT_EQ(1u, batch.size());
  const Message& got = batch[0];
  EXPECT_EQ("order_1:paid:v1", got.message_id);
  EXPECT_EQ(std::string("a\0b", 3), got.body);  // binary safe
  EXPECT_EQ("application/json", got.content_type);
  ASSERT_NE(nullptr, got.header("biz_no"));
  EXPECT_EQ("order_1", *got.header("biz_no"));
  EXPECT_EQ(nullptr, got.header("missing"));
  EXPECT_FALSE(got.redelivered);
  EXPECT_FALSE(got.x_delivery_count.has_value());
  EXPECT_EQ(1u, idem::rabbitmq::delivery_count_of(got));
  EXPECT_EQ("", got.exchange);
  EXPECT_EQ(q, got.routing_key);
  EXPECT_EQ(c.connection(), got.connection);
  EXPECT_EQ(1u, c.unsettled());
  EXPECT_TRUE(c.ack(got));
  EXPECT_EQ(0u, c.unsettled());
  EXPECT_TRUE(c.receive(10, 100ms).empty());
  c.close();
  EXPECT_EQ(0u, publisher_->queue_info(q).messages);  // acked, not requeued by the close
  auto s = c.stats();
  EXPECT_EQ(1u, s.deliveries);
  EXPECT_EQ(1u, s.acked);
  EXPECT_EQ(1u, s.connection.connects);
  auto ps = publisher_->stats();
  EXPECT_EQ(1u, ps.published);
  EXPECT_EQ(1u, ps.confirmed);
}

TEST_F(RabbitClientTest, PrefetchBoundsUnackedDeliveriesAndLingerCollectsABatch) {
  const std::string q = queue_name();
  QueueConsumer c{consumer_options(q, 8)};
  c.connect();
  std::vector<std::pair<std::string, std::string>> msgs;
  for (int i = 0; i < 20; ++i) msgs.emplace_back("m" + std::to_string(i), "x");
  publish(q, msgs);
  // At most `prefetch` unacked deliveries: asking for 20 gets 8.
  auto first = c.receive(20, 2s, 300ms);
  ASSERT_EQ(8u, first.size());
  EXPECT_TRUE(c.receive(20, 200ms).empty());
  std::vector<const Message*> acks;
  for (const auto& m : first) acks.push_back(&m);
  EXPECT_EQ(8u, c.ack(acks));  // one multiple ack
  std::size_t total = first.size();
  for (int i = 0; i < 10 && total < 20; ++i) {
    auto more = c.receive(20, 1s, 200ms);
    std::vector<const Message*> a;
    for (const auto& m : more) a.push_back(&m);
    c.ack(a);
    total += more.size();
  }
  EXPECT_EQ(20u, total);
  EXPECT_EQ(20u, c.stats().acked);
}

TEST_F(RabbitClientTest, MultipleAckNeverCoversAnUnsettledDelivery) {
  const std::string q = queue_name();
  QueueConsumer c{consumer_options(q)};
  c.connect();
  publish(q, {{"m1", "1"}, {"m2", "2"}, {"m3", "3"}});
  auto batch = c.receive(3, 2s, 300ms);
  ASSERT_EQ(3u, batch.size());
  // m1 stays unsettled: acking m2 and m3 must not use a multiple ack up to m3.
  EXPECT_EQ(2u, c.ack({&batch[1], &batch[2]}));
  EXPECT_EQ(1u, c.unsettled());
  c.close();  // m1 returns to the queue
  auto again = c.receive(3, 2s, 200ms);
  ASSERT_EQ(1u, again.size());
  EXPECT_EQ("m1", again[0].message_id);
  EXPECT_TRUE(again[0].redelivered);
  EXPECT_TRUE(c.ack(again[0]));
}

TEST_F(RabbitClientTest, NackRequeueRedeliversFlaggedAndRejectGoesToTheDeadLetterExchange) {
  const std::string q = queue_name();
  auto dead = idem::rabbitmq::declare_dead_letters(*publisher_, q);
  auto o = consumer_options(q);
  o.queue.dead_letter_exchange = dead.exchange;
  QueueConsumer c{o};
  c.connect();
  publish(q, {{"m1", "1"}});
  auto first = c.receive(1, 2s);
  ASSERT_EQ(1u, first.size());
  EXPECT_FALSE(first[0].redelivered);
  EXPECT_TRUE(c.nack(first[0], true));
  auto second = c.receive(1, 2s);
  ASSERT_EQ(1u, second.size());
  EXPECT_TRUE(second[0].redelivered);
  EXPECT_EQ(2u, idem::rabbitmq::delivery_count_of(second[0]));
  EXPECT_TRUE(c.reject(second[0], false));  // broker-side dead-lettering
  auto dl = drain(q + ".dead");
  ASSERT_EQ(1u, dl.size());
  EXPECT_EQ("m1", dl[0].message_id);
  EXPECT_EQ(0u, publisher_->queue_info(q).messages);
  EXPECT_EQ(1u, c.stats().nacked);
  EXPECT_EQ(1u, c.stats().rejected);
}

// Quorum queues count returns in x-delivery-count; delivery_count_of() turns it into the
// delivery count idem expects (1 for a first delivery).
TEST_F(RabbitClientTest, QuorumQueueCountsDeliveries) {
  const std::string q = queue_name();
  auto o = consumer_options(q);
  o.queue.type = QueueType::kQuorum;
  QueueConsumer c{o};
  c.connect();
  publish(q, {{"m1", "1"}});
  for (std::uint32_t expected = 1; expected <= 4; ++expected) {
    auto b = c.receive(1, 5s);
    ASSERT_EQ(1u, b.size()) << "delivery " << expected;
    EXPECT_EQ(expected, idem::rabbitmq::delivery_count_of(b[0]));
    EXPECT_EQ(expected > 1, b[0].redelivered);
    if (expected == 1) {
      EXPECT_FALSE(b[0].x_delivery_count.has_value());
    } else {
      ASSERT_TRUE(b[0].x_delivery_count.has_value());
      EXPECT_EQ(expected - 1, *b[0].x_delivery_count);
    }
    if (expected < 4) {
      EXPECT_TRUE(c.nack(b[0], true));
    } else {
      EXPECT_TRUE(c.ack(b[0]));
    }
  }
}

// A quorum queue with a delivery limit dead-letters (broker side) past the limit.
TEST_F(RabbitClientTest, QuorumDeliveryLimitDeadLetters) {
  const std::string q = queue_name();
  auto dead = idem::rabbitmq::declare_dead_letters(*publisher_, q);
  auto o = consumer_options(q);
  o.queue.type = QueueType::kQuorum;
  o.queue.delivery_limit = 2;
  o.queue.dead_letter_exchange = dead.exchange;
  QueueConsumer c{o};
  c.connect();
  publish(q, {{"m1", "1"}});
  int deliveries = 0;
  for (;;) {
    auto b = c.receive(1, 1s);
    if (b.empty()) break;
    ++deliveries;
    c.nack(b[0], true);
  }
  EXPECT_EQ(3, deliveries);  // the first delivery and two returns
  auto dl = drain(q + ".dead");
  ASSERT_EQ(1u, dl.size());
  EXPECT_EQ("m1", dl[0].message_id);
}

TEST_F(RabbitClientTest, ClosedConnectionMakesItsDeliveriesStaleAndTheBrokerRedelivers) {
  const std::string q = queue_name();
  QueueConsumer c{consumer_options(q)};
  c.connect();
  publish(q, {{"m1", "1"}, {"m2", "2"}});
  auto b = c.receive(2, 2s, 300ms);
  ASSERT_EQ(2u, b.size());
  const auto first_connection = c.connection();
  c.close();
  EXPECT_FALSE(c.ack(b[0]));  // nothing sent: the broker requeued it with the connection
  EXPECT_FALSE(c.nack(b[1], true));
  auto again = c.receive(2, 2s, 300ms);
  ASSERT_EQ(2u, again.size());
  EXPECT_NE(first_connection, c.connection());
  for (const auto& m : again) {
    EXPECT_TRUE(m.redelivered);
    EXPECT_EQ(c.connection(), m.connection);
  }
  EXPECT_EQ(2u, c.ack({&again[0], &again[1]}));
  EXPECT_EQ(2u, c.stats().stale_settles);
  EXPECT_EQ(2u, c.stats().connection.connects);
}

TEST_F(RabbitClientTest, PublishBatchConfirmsEveryMessage) {
  const std::string q = queue_name();
  declare(q);
  std::vector<std::pair<std::string, std::string>> msgs;
  for (int i = 0; i < 500; ++i) msgs.emplace_back("b" + std::to_string(i), std::to_string(i));
  publish(q, msgs);
  EXPECT_EQ(500u, publisher_->queue_info(q).messages);
  auto s = publisher_->stats();
  EXPECT_EQ(500u, s.published);
  EXPECT_EQ(500u, s.confirmed);
  EXPECT_EQ(0u, s.republished);
  EXPECT_EQ(500u, publisher_->purge_queue(q));
}

TEST_F(RabbitClientTest, UnroutableMandatoryPublishIsAnErrorAndTheOthersAreConfirmed) {
  const std::string q = queue_name();
  declare(q);
  OutgoingMessage ok, lost;
  ok.routing_key = q;
  ok.message_id = "ok";
  lost.routing_key = q + ".nobody";
  lost.message_id = "lost";
  try {
    publisher_->publish(std::vector<OutgoingMessage>{ok, lost});
    FAIL() << "expected an unroutable error";
  } catch (const idem::StorageError& e) {
    EXPECT_FALSE(e.retryable()) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("unroutable")) << e.what();
  }
  EXPECT_EQ(1u, publisher_->queue_info(q).messages);
  EXPECT_EQ(1u, publisher_->stats().returned);
}

TEST_F(RabbitClientTest, BrokerRefusalsAreTypedAndTheClientRecovers) {
  const std::string q = queue_name();
  // Unknown exchange: the broker closes the channel (404); not retryable.
  OutgoingMessage m;
  m.exchange = q + ".no-such-exchange";
  m.routing_key = q;
  m.message_id = "x";
  try {
    publisher_->publish(m);
    FAIL() << "expected NOT_FOUND";
  } catch (const idem::StorageError& e) {
    EXPECT_EQ(idem::errc::kStorageError, e.code()) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("404")) << e.what();
  }
  // Unknown queue (passive declare): 404 too.
  EXPECT_THROW(publisher_->queue_info(q + ".missing"), idem::StorageError);
  // The same publisher works afterwards (a new connection).
  declare(q);
  publish(q, {{"m1", "1"}});
  EXPECT_EQ(1u, publisher_->queue_info(q).messages);
  EXPECT_GE(publisher_->stats().connection.connects, 3u);
  // Declaring the queue again with other arguments: 406 PRECONDITION_FAILED, typed.
  auto o = consumer_options(q);
  o.queue.type = QueueType::kQuorum;
  QueueConsumer c{o};
  try {
    c.connect();
    FAIL() << "expected PRECONDITION_FAILED";
  } catch (const idem::StorageError& e) {
    EXPECT_FALSE(e.retryable()) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("406")) << e.what();
  }
  // A queue that must exist (passive) and does not.
  auto passive = consumer_options(q + ".absent");
  passive.queue.declare = false;
  QueueConsumer p{passive};
  EXPECT_THROW(p.receive(1, 100ms), idem::StorageError);
}

TEST_F(RabbitClientTest, WrongPasswordIsAccessRefused) {
  auto o = consumer_options(queue_name());
  std::string url = url_;
  url.replace(url.find("guest:guest"), 11, "guest:wrong");
  o.connection.url = url;
  QueueConsumer c{o};
  try {
    c.connect();
    FAIL() << "expected ACCESS_REFUSED";
  } catch (const idem::StorageError& e) {
    EXPECT_FALSE(e.retryable()) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("403")) << e.what();
  }
  EXPECT_EQ(1u, c.stats().connection.failed_connects);
}

TEST_F(RabbitClientTest, UnreachableBrokerIsUnavailableAndBacksOff) {
  auto o = consumer_options(queue_name());
  o.connection.url = "amqp://guest:guest@127.0.0.1:1/";
  // A backoff long enough that no stall of a loaded machine between the first two calls
  // outlasts it.
  o.connection.reconnect_backoff = 2s;
  o.connection.reconnect_backoff_max = 4s;
  QueueConsumer c{o};
  EXPECT_THROW(c.receive(1, 0ms), idem::StorageUnavailable);
  // Within the backoff no connect is tried: the call fails at once, still typed.
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(c.receive(1, 0ms), idem::StorageUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  EXPECT_EQ(1u, c.stats().connection.failed_connects);
  // A wait longer than the backoff waits for it, then tries again.
  EXPECT_THROW(c.receive(1, 3s), idem::StorageUnavailable);
  EXPECT_EQ(2u, c.stats().connection.failed_connects);
  idem::rabbitmq::PublisherOptions po;
  po.connection = o.connection;
  po.connection.reconnect_backoff = 200ms;
  po.connection.reconnect_backoff_max = 400ms;
  po.max_attempts = 2;
  idem::rabbitmq::Publisher p{po};
  OutgoingMessage m;
  m.routing_key = "q";
  m.message_id = "m";
  EXPECT_THROW(p.publish(m), idem::StorageUnavailable);  // never sent: not OutcomeUnknown
}

TEST(RabbitClientOptions, BadOptionsAreUsageErrors) {
  idem::rabbitmq::QueueConsumerOptions o;
  o.queue.name = "q";
  o.connection.url = "http://127.0.0.1/";
  EXPECT_THROW(QueueConsumer{o}, idem::UsageError);
  o.connection.url = "amqp://127.0.0.1/";
  o.connection.tls_ca = "/etc/ssl/certs/ca-certificates.crt";  // TLS files need amqps://
  EXPECT_THROW(QueueConsumer{o}, idem::UsageError);
  o.connection.url = "amqps://127.0.0.1/";
  o.connection.tls_ca = "/nonexistent/ca.pem";
  EXPECT_THROW(QueueConsumer{o}, idem::UsageError);
  o.connection.tls_ca.clear();
  o.connection.tls_cert = "/etc/ssl/certs/ca-certificates.crt";  // without its key
  EXPECT_THROW(QueueConsumer{o}, idem::UsageError);
  o.connection.tls_cert.clear();
  o.connection.url = "amqp://127.0.0.1/";
  o.prefetch = 0;
  EXPECT_THROW(QueueConsumer{o}, idem::UsageError);
  o.prefetch = 1;
  o.queue.name.clear();
  EXPECT_THROW(QueueConsumer{o}, idem::UsageError);
  o.queue.name = "q";
  o.queue.delivery_limit = 3;  // classic queues have none
  EXPECT_THROW(QueueConsumer{o}, idem::UsageError);
  o.queue.delivery_limit = 0;
  o.connection.rpc_timeout = std::chrono::milliseconds(0);
  EXPECT_THROW(QueueConsumer{o}, idem::UsageError);
  // A wait beyond a day overflowed into a timeout at once, retryable, on every call.
  o.connection.rpc_timeout = std::chrono::milliseconds::max();
  EXPECT_THROW(QueueConsumer{o}, idem::UsageError);
  o.connection.rpc_timeout = std::chrono::seconds(5);
  o.connection.connect_timeout = std::chrono::milliseconds::max();
  EXPECT_THROW(QueueConsumer{o}, idem::UsageError);
  o.connection.connect_timeout = std::chrono::seconds(2);
  o.connection.reconnect_backoff_max = std::chrono::milliseconds::max();
  EXPECT_THROW(QueueConsumer{o}, idem::UsageError);
  o.connection.reconnect_backoff_max = std::chrono::seconds(5);
  idem::rabbitmq::PublisherOptions po;
  po.max_attempts = 0;
  EXPECT_THROW(idem::rabbitmq::Publisher{po}, idem::UsageError);
  idem::rabbitmq::Publisher p{idem::rabbitmq::PublisherOptions{}};
  EXPECT_THROW(p.publish(OutgoingMessage{}), idem::UsageError);  // no message id
  // AMQP short strings: refused before anything of the call is sent (no broker is needed).
  OutgoingMessage ok;
  ok.message_id = "m-1";
  for (auto spoil : std::initializer_list<void (*)(OutgoingMessage&)>{
           [](OutgoingMessage& m) { m.message_id = std::string(256, 'm'); },
           [](OutgoingMessage& m) { m.content_type = std::string(256, 't'); },
           [](OutgoingMessage& m) { m.routing_key = std::string(256, 'r'); },
           [](OutgoingMessage& m) { m.exchange = std::string(256, 'x'); },
           [](OutgoingMessage& m) { m.headers.emplace_back(std::string(256, 'h'), "v"); }}) {
    OutgoingMessage bad = ok;
    spoil(bad);
    try {
      p.publish(std::vector<OutgoingMessage>{ok, bad});
      ADD_FAILURE() << "accepted";
    } catch (const idem::UsageError& e) {
      EXPECT_NE(std::string::npos, std::string(e.what()).find("message 1")) << e.what();
    }
  }
  EXPECT_EQ(0u, p.stats().published);
}

// A URL the parser refuses (a password with a reserved character left unencoded, a forgotten
// host) is named in the error with its password masked.
TEST(RabbitClientOptions, ARefusedUrlNeverShowsItsPassword) {
  for (const std::string url :
       {"amqp://guest:QZ7@ecret@127.0.0.1:5672", "amqp://guest:QZ7/ecret@127.0.0.1:5672",
        "amqp://guest:QZ7#ecret@127.0.0.1", "amqp://guest:QZ7ecret", "ampq://guest:QZ7ecret@h",
        "amqp://guest:QZ7ecret@[::1", "amqp:/guest:QZ7ecret@127.0.0.1",
        "amqp:guest:QZ7ecret@127.0.0.1"}) {
    idem::rabbitmq::PublisherOptions po;
    po.connection.url = url;
    try {
      idem::rabbitmq::Publisher p{po};
      ADD_FAILURE() << "accepted";
    } catch (const idem::UsageError& e) {
      EXPECT_EQ(std::string::npos, std::string(e.what()).find("ecret")) << e.what();
      EXPECT_NE(std::string::npos, std::string(e.what()).find("not an amqp")) << e.what();
    }
  }
}

// amqps:// against the test node's TLS listener (the test-made certificates name localhost
// and 127.0.0.1). Messages go both ways, with and without a client certificate; the broker
// is authenticated, by name and by the address the certificate carries: a certificate of
// another CA is refused, and so is the right one reached under an address it does not carry
// (127.0.0.2, through a forwarding proxy). Refusals are configuration errors: not retryable.
TEST_F(RabbitClientTest, AmqpsAuthenticatesTheBroker) {
  std::string tls_url, dir;
  IDEM_REQUIRE_ENV(tls_url, "IDEM_TEST_RABBITMQ_TLS_URL");
  IDEM_REQUIRE_ENV(dir, "IDEM_TEST_RABBITMQ_TLS_DIR");
  const std::string q = queue_name();
  auto tls = [&](const std::string& url) {
    auto c = idem::test::rabbit_connection(url);
    c.tls_ca = dir + "/ca.pem";
    return c;
  };
  auto o = consumer_options(q);
  o.connection = tls(tls_url);
  QueueConsumer c{o};
  c.connect();
  idem::rabbitmq::PublisherOptions po;
  po.connection = tls(tls_url);
  po.connection.tls_cert = dir + "/client.pem";
  po.connection.tls_key = dir + "/client-key.pem";
  idem::rabbitmq::Publisher p{po};
  OutgoingMessage m;
  m.routing_key = q;
  m.message_id = "over-tls";
  m.body = "paid";
  p.publish(m);
  auto got = c.receive(1, 5s);
  ASSERT_EQ(1u, got.size());
  EXPECT_EQ("over-tls", got[0].message_id);
  EXPECT_EQ("paid", got[0].body);
  EXPECT_TRUE(c.ack(got[0]));

  auto refused = [&](idem::rabbitmq::ConnectionOptions conn, const std::string& why) {
    auto ro = consumer_options(q);
    ro.connection = std::move(conn);
    QueueConsumer r{ro};
    try {
      r.connect();
      ADD_FAILURE() << "connected although " << why;
    } catch (const idem::StorageError& e) {
      EXPECT_FALSE(e.retryable()) << why << ": " << e.what();
    }
  };
  auto other_ca = tls(tls_url);
  other_ca.tls_ca = dir + "/other-ca.pem";
  refused(other_ca, "the certificate does not chain to the CA given");
  const char* port = std::getenv("IDEM_RABBITMQ_TLS_PORT");
  ASSERT_NE(nullptr, port);
  // An address the certificate carries as an IP entry (not a DNS name) authenticates too.
  {
    auto by_address = consumer_options(q);
    by_address.connection = tls("amqps://guest:guest@127.0.0.1:" + std::string(port) + "/%2F");
    QueueConsumer a{by_address};
    EXPECT_NO_THROW(a.connect());
  }
  idem::test::CommitDroppingProxy elsewhere(std::stoi(port), 0x7f000002);  // 127.0.0.2
  refused(tls("amqps://guest:guest@127.0.0.2:" + std::to_string(elsewhere.port()) + "/%2F"),
          "the certificate does not name 127.0.0.2");
}

// The broker drops a connection it has not heard from for about two heartbeat intervals;
// rabbitmq-c heartbeats only inside its calls. A handler that takes 4 intervals: with the
// heartbeat thread the connection survives and the ack lands; without it the broker closes
// the connection and the message comes back.
TEST_F(RabbitClientTest, HeartbeatThreadKeepsTheConnectionThroughALongHandler) {
  const std::string q = queue_name();
  for (bool thread : {true, false}) {
    auto o = consumer_options(q);
    o.connection.heartbeat = std::chrono::seconds(1);
    o.connection.heartbeat_thread = thread;
    QueueConsumer c{o};
    c.connect();
    publish(q, {{thread ? "with-thread" : "without-thread", "x"}});
    auto b = c.receive(1, 2s);
    ASSERT_EQ(1u, b.size());
    std::this_thread::sleep_for(4500ms);  // the long handler: no call into the client
    const bool acked = c.ack(b[0]);
    if (thread) {
      EXPECT_TRUE(acked);
      EXPECT_GE(c.stats().connection.thread_heartbeats, 3u);
      EXPECT_TRUE(c.receive(1, 300ms).empty());
      EXPECT_EQ(0u, c.stats().connection.connection_losses);
    } else {
      // The ack may still be written into the dead socket; either way the broker had closed
      // the connection and requeued the message, which comes back flagged.
      std::vector<Message> again;
      for (int i = 0; i < 5 && again.empty(); ++i) {
        try {
          again = c.receive(1, 2s);
        } catch (const idem::StorageUnavailable&) {
          // the loss shows here: the next call reconnects
        }
      }
      ASSERT_EQ(1u, again.size()) << "acked=" << acked;
      EXPECT_TRUE(again[0].redelivered);
      EXPECT_TRUE(c.ack(again[0]));
      EXPECT_EQ(1u, c.stats().connection.connection_losses);
    }
  }
}

}  // namespace
