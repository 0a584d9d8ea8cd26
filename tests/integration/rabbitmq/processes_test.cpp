// SPDX-License-Identifier: MIT
// Two consumer processes (examples/rabbitmq_consumer) on one RabbitMQ queue with prefetch 32,
// one killed with SIGKILL mid-batch: its unacked deliveries return to the queue and the other
// consumes them. Every published id has exactly one effect row or one dead letter, and the
// redeliveries the library counted equal those the processes' delivery logs show.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <thread>

#include "scenario.hpp"

namespace {

using namespace std::chrono_literals;
using idem::test::slurp;
using idem::test::summary_value;

class RabbitProcessesTest : public idem::test::RabbitTest {
 protected:
  // c1 is slow *inside* each handler's transaction (30 ms), so the kill lands mid-transaction
  // (SQLite rolls it back). With consume() per message (a MemoryStore per process), c1 has
  // committed its first three messages without acking them: c2 gets them back and acks them as
  // duplicates. With `batched` both consumers run consume_batch and share Redis as the fast
  // store (when IDEM_TEST_REDIS_URL is set): c1 dies holding the Redis claims of its whole
  // batch, having committed nothing, and c2 answers retry_later for those (held, nacked with
  // requeue, redelivered) until the lease (2 s) ends.
  void run_kill_scenario(bool batched) {
    const std::string q = queue_name("idem-test-orders");
    const std::string group = idem::test::unique_name("billing");
    const std::string db = dir_.file("billing.db");
    idem::test::declare_orders_queue(*publisher_, q);
    const auto orders = idem::test::make_orders(q, 2000);
    for (std::size_t at = 0; at < orders.messages.size(); at += 500) {
      std::vector<idem::rabbitmq::OutgoingMessage> part(
          orders.messages.begin() + static_cast<long>(at),
          orders.messages.begin() + static_cast<long>(std::min(orders.messages.size(), at + 500)));
      publisher_->publish(part);
    }
    ASSERT_EQ(orders.messages.size(), publisher_->queue_info(q).messages);

    std::vector<std::string> common;
    std::string redis;
    if (batched) {
      common.push_back("--consume-batch");
      redis = idem::test::server_env("IDEM_TEST_REDIS_URL");
      if (!redis.empty()) {
        common.insert(common.end(),
                      {"--fast-store", "redis", "--redis", redis, "--lease-ms", "2000"});
      }
    }
    auto args = [&](const std::string& name, std::vector<std::string> extra) {
      extra.insert(extra.end(), common.begin(), common.end());
      return idem::test::consumer_args(url_, q, group, name, db, dir_.file(name + ".log"), extra);
    };
    // c1: slow, collects its whole prefetch window (32) as one batch before it starts, acks
    // only at the end of the batch: killed mid-batch, all 32 are unacked. It stops inside the
    // handler of its fourth message (three committed, one transaction open; with
    // consume_batch, inside the batch's one transaction) and is killed once it says so, which
    // no scheduling delay can move.
    std::vector<std::string> c1_extra{"--linger-ms", "3000",        "--delay-ms", "30",
                                      "--delay-inside", "--hang-inside-after", "3"};
    pid_t c1 = idem::test::spawn(args("c1", c1_extra), dir_.file("c1.out"));
    ASSERT_GT(c1, 0);
    ASSERT_TRUE(idem::test::eventually(
        [&] { return idem::test::read_log(dir_.file("c1.log")).size() >= 32; }, 30s))
        << slurp(dir_.file("c1.out"));
    pid_t c2 = idem::test::spawn(args("c2", {"--exit-when-drained"}), dir_.file("c2.out"));
    ASSERT_GT(c2, 0);
    ASSERT_TRUE(idem::test::eventually(
        [&] { return slurp(dir_.file("c1.out")).find("hanging inside") != std::string::npos; },
        30s))
        << slurp(dir_.file("c1.out"));
    ASSERT_EQ(0, ::kill(c1, SIGKILL));
    int status = 0;
    ::waitpid(c1, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status));
    const auto c1_log = idem::test::read_log(dir_.file("c1.log"));
    EXPECT_EQ(32u, c1_log.size()) << "c1 was to die inside its first batch of 32";

    ASSERT_EQ(0, idem::test::wait_for(c2, 100s)) << slurp(dir_.file("c2.out"));
    const std::string out = slurp(dir_.file("c2.out"));
    idem::test::check_orders_outcome(*publisher_, q, db, orders,
                                     [&](const std::string& name) { return drain(name); });

    // Redeliveries: every delivery of a broker message (x-seq) after its first, as the logs
    // show, equals what the library counted. c1 only got first deliveries; c2 got c1's 32
    // back, each poison message twice more, and every retry_later once more per requeue.
    std::map<std::string, int> deliveries;
    std::uint64_t flagged = 0;
    for (const auto* name : {"c1", "c2"}) {
      for (const auto& d : idem::test::read_log(dir_.file(std::string(name) + ".log"))) {
        ++deliveries[d.seq];
        flagged += d.redelivered ? 1 : 0;
      }
    }
    for (const auto& d : c1_log) EXPECT_FALSE(d.redelivered);
    std::uint64_t observed = 0;
    for (const auto& [seq, n] : deliveries) observed += static_cast<std::uint64_t>(n - 1);
    EXPECT_EQ(orders.messages.size(), deliveries.size()) << "every message was delivered";
    EXPECT_GE(observed, 32u + 2 * orders.poison.size());
    EXPECT_EQ(observed, flagged) << "the broker flagged exactly the redeliveries";
    EXPECT_EQ(observed, summary_value(out, "redeliveries")) << out;
    EXPECT_EQ(orders.poison.size(), summary_value(out, "dead_lettered")) << out;
    EXPECT_EQ(3u, summary_value(out, "parked")) << out;
    // Each poison message failed 3 times; retry_later: 2 per poison message, plus (with the
    // Redis fast store) every delivery of c1's batch while its claims lasted.
    EXPECT_EQ(3 * orders.poison.size(), summary_value(out, "failures")) << out;
    if (batched && !redis.empty()) {
      EXPECT_GT(summary_value(out, "retry_later"), 2 * orders.poison.size() + 32) << out;
    } else {
      EXPECT_EQ(2 * orders.poison.size(), summary_value(out, "retry_later")) << out;
    }
    EXPECT_EQ(summary_value(out, "retry_later"), summary_value(out, "requeued")) << out;
    // What c1 committed before it died came back to c2 as duplicates, with the producer's
    // 200 retries.
    long by_c1 = 0;
    idem::sqlite::Database{db}.read([&](idem::sqlite::Session& s) {
      by_c1 = static_cast<long>(
          s.query_int64("SELECT count(*) FROM effect WHERE consumer = 'c1'").value_or(-1));
    });
    EXPECT_EQ(200u + static_cast<std::uint64_t>(by_c1), summary_value(out, "duplicates")) << out;
    if (batched) {
      EXPECT_EQ(0, by_c1);  // killed inside its only batch transaction
    } else {
      EXPECT_EQ(3, by_c1);  // three committed, the fourth rolled back by the kill
    }
    std::printf(
        "published %zu ids in %zu messages; c1 killed with 32 unacked; %llu "
        "redeliveries observed; c2: %s",
        orders.ids.size(), orders.messages.size(), static_cast<unsigned long long>(observed),
        out.substr(out.rfind("summary ")).c_str());
  }

  idem::test::TempDir dir_;
};

TEST_F(RabbitProcessesTest, KillNineMidBatchStillOneEffectPerMessage) { run_kill_scenario(false); }

TEST_F(RabbitProcessesTest, ConsumeBatchKillNineInsideTheTransactionStillOneEffectPerMessage) {
  run_kill_scenario(true);
}

}  // namespace
