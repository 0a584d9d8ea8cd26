// SPDX-License-Identifier: MIT
// The RabbitMQ node stopped and started again (scripts/servers.sh rabbitmq-restart) while two
// consumer processes consume and a producer publishes: the consumers and the producer
// reconnect, nothing is lost, nothing is applied twice. And a delivery held past the broker's
// consumer_timeout. Both change the shared node: SERIAL.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "scenario.hpp"
#include "support/run_command.hpp"

namespace {

using namespace std::chrono_literals;
using idem::test::slurp;
using idem::test::summary_value;

class RabbitRestartTest : public idem::test::RabbitTest {
 protected:
  idem::test::TempDir dir_;
};

long effect_rows(const std::string& db) {
  try {
    idem::sqlite::Database database{db};
    return static_cast<long>(database.read([](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM effect").value_or(0);
    }));
  } catch (const idem::StorageError&) {
    return 0;  // not created yet
  }
}

TEST_F(RabbitRestartTest, BrokerRestartedMidRunNothingLostNothingTwice) {
  std::string script;
  IDEM_REQUIRE_ENV(script, "IDEM_SERVERS_SCRIPT");
  const std::string q = queue_name("idem-test-restart");
  const std::string group = idem::test::unique_name("billing");
  const std::string db = dir_.file("billing.db");
  const std::string done = dir_.file("producer.done");
  idem::test::declare_orders_queue(*publisher_, q);
  const auto orders = idem::test::make_orders(q, 2000);
  const std::size_t half = orders.messages.size() / 2;

  // The producer: the first half now; the second half while the broker restarts, one message
  // per `pause` until `slow_until` is set (so it is still publishing whenever the broker goes
  // down: the restart's stop can take seconds to begin on a loaded machine), then the rest at
  // once. A batch that fails (refused, lost, unconfirmed) is published again with the same ids:
  // the consumers de-duplicate what had reached the queue.
  auto publish_range = [&](idem::rabbitmq::Publisher& p, std::size_t from, std::size_t to,
                           std::chrono::milliseconds pause, int& failures,
                           const std::atomic<bool>* slow_until) {
    for (std::size_t at = from; at < to;) {
      const bool slow = slow_until != nullptr && !slow_until->load();
      std::vector<idem::rabbitmq::OutgoingMessage> part(
          orders.messages.begin() + static_cast<long>(at),
          orders.messages.begin() + static_cast<long>(std::min(to, at + (slow ? 1 : 500))));
      try {
        p.publish(part);
        at += part.size();
        if (slow) std::this_thread::sleep_for(pause);
      } catch (const idem::StorageError& e) {
        ASSERT_TRUE(e.retryable()) << e.what();
        ++failures;
        std::this_thread::sleep_for(200ms);
      }
    }
  };
  int failures = 0;
  publish_range(*publisher_, 0, half, 0ms, failures, nullptr);
  ASSERT_EQ(0, failures);

  auto args = [&](const std::string& name) {
    return idem::test::consumer_args(
        url_, q, group, name, db, dir_.file(name + ".log"),
        {"--delay-ms", "3", "--exit-when-drained", "--drain-after", done});
  };
  pid_t c1 = idem::test::spawn(args("c1"), dir_.file("c1.out"));
  pid_t c2 = idem::test::spawn(args("c2"), dir_.file("c2.out"));
  ASSERT_GT(c1, 0);
  ASSERT_GT(c2, 0);
  // Restart once the consumers are well into the backlog.
  ASSERT_TRUE(idem::test::eventually([&] { return effect_rows(db) >= 300; }, 60s))
      << slurp(dir_.file("c1.out")) << slurp(dir_.file("c2.out"));
  std::atomic<bool> restarted{false};
  int restart_rc = -1;
  double restart_s = 0;
  std::thread restart([&] {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string cmd = "\"" + script + "\" rabbitmq-restart >/dev/null 2>&1";
    restart_rc = std::system(cmd.c_str());
    restart_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    restarted = true;
  });
  {
    idem::rabbitmq::PublisherOptions po;
    po.connection = idem::test::rabbit_connection(url_);
    po.connection.reconnect_backoff_max = 300ms;
    po.confirm_timeout = 3s;
    po.max_attempts = 2;
    idem::rabbitmq::Publisher producer{po};
    publish_range(producer, half, orders.messages.size(), 100ms, failures, &restarted);
  }
  restart.join();
  ASSERT_EQ(0, restart_rc) << "servers.sh rabbitmq-restart failed";
  ASSERT_TRUE(restarted);
  std::ofstream(done) << "done\n";

  ASSERT_EQ(0, idem::test::wait_for(c1, 120s)) << slurp(dir_.file("c1.out"));
  ASSERT_EQ(0, idem::test::wait_for(c2, 120s)) << slurp(dir_.file("c2.out"));
  const std::string out1 = slurp(dir_.file("c1.out")), out2 = slurp(dir_.file("c2.out"));
  idem::test::check_orders_outcome(*publisher_, q, db, orders,
                                   [&](const std::string& name) { return drain(name); });

  // Both consumers lost their connection and came back.
  EXPECT_GE(summary_value(out1, "connection_losses"), 1u) << out1;
  EXPECT_GE(summary_value(out2, "connection_losses"), 1u) << out2;
  EXPECT_GE(summary_value(out1, "connects"), 2u) << out1;
  EXPECT_GE(summary_value(out2, "connects"), 2u) << out2;
  // The producer hit the restart and published again.
  EXPECT_GE(failures, 1);
  // Redeliveries: the library counts the deliveries the broker flagged (here the logs cannot
  // tell redeliveries from copies: a batch the producer published again after a lost confirm
  // carries the same x-seq headers). Flags mark deliveries of messages the broker handed out
  // before: to a consumer that died, into a socket that closed unread, or before the restart.
  std::uint64_t flagged = 0;
  for (const auto* name : {"c1", "c2"}) {
    for (const auto& d : idem::test::read_log(dir_.file(std::string(name) + ".log"))) {
      flagged += d.redelivered ? 1 : 0;
    }
  }
  const std::uint64_t counted =
      summary_value(out1, "redeliveries") + summary_value(out2, "redeliveries");
  EXPECT_EQ(flagged, counted) << out1 << out2;
  // The producer's retries, and what was committed but not acked before the stop, came back
  // as duplicates (200 producer retries at least).
  EXPECT_GE(summary_value(out1, "duplicates") + summary_value(out2, "duplicates"), 200u);
  std::printf("restart took %.1f s; producer failures %d; redeliveries flagged %llu\nc1: %sc2: %s",
              restart_s, failures, static_cast<unsigned long long>(flagged),
              out1.substr(out1.rfind("summary ")).c_str(),
              out2.substr(out2.rfind("summary ")).c_str());
}

// A delivery held past the broker's consumer_timeout: the broker closes the channel with 406
// PRECONDITION_FAILED ("delivery acknowledgement ... timed out") and requeues the delivery.
// That close is retryable (StorageUnavailable), unlike a 406 for a queue declared with other
// arguments: the next receive reconnects and gets the message again. The broker's timeout is
// lowered for the test (channels read it at each tick: SERIAL keeps other tests away), then
// restored.
TEST_F(RabbitRestartTest, AnAckTimeoutIsRetryableAndTheNextReceiveGetsTheMessageAgain) {
  std::string script;
  IDEM_REQUIRE_ENV(script, "IDEM_SERVERS_SCRIPT");
  auto set_timeouts = [&](long consumer_timeout_ms, long tick_ms) {
    return idem::test::run_command({script, "rabbitmq-eval",
                                    "application:set_env(rabbit, consumer_timeout, " +
                                        std::to_string(consumer_timeout_ms) +
                                        "), application:set_env(rabbit, channel_tick_interval, " +
                                        std::to_string(tick_ms) + ")."});
  };
  struct Restore {
    std::function<void()> fn;
    ~Restore() { fn(); }
  } restore{[&] { (void)set_timeouts(1800000, 60000); }};
  const auto set = set_timeouts(1000, 200);
  ASSERT_EQ(0, set.status) << set.output;

  const std::string q = queue_name("idem-test-ack-timeout");
  idem::rabbitmq::QueueConsumer c{consumer_options(q)};
  c.connect();
  publish(q, {{"m1", "1"}});
  auto held = c.receive(1, 2s);
  ASSERT_EQ(1u, held.size());
  EXPECT_FALSE(held[0].redelivered);
  std::this_thread::sleep_for(3s);  // past the timeout and a few of the channel's ticks
  bool refused = false;
  for (int i = 0; i < 20 && !refused; ++i) {
    try {
      (void)c.receive(1, 500ms);
    } catch (const idem::StorageError& e) {
      refused = true;
      EXPECT_TRUE(e.retryable()) << e.what();
      EXPECT_EQ(idem::errc::kStoreUnavailable, e.code()) << e.what();
      EXPECT_NE(std::string::npos, std::string(e.what()).find("406")) << e.what();
    }
  }
  ASSERT_TRUE(refused) << "the broker did not close the channel of the held delivery";
  EXPECT_FALSE(c.ack(held[0]));  // its channel is gone: nothing to settle
  std::vector<idem::rabbitmq::Message> again;
  for (int i = 0; i < 20 && again.empty(); ++i) again = c.receive(1, 500ms);
  ASSERT_EQ(1u, again.size());
  EXPECT_EQ("m1", again[0].message_id);
  EXPECT_TRUE(again[0].redelivered);
  EXPECT_EQ(1u, c.ack({&again[0]}));
}

}  // namespace
