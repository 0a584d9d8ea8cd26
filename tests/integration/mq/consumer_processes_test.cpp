// SPDX-License-Identifier: MIT
// Two consumer processes in one Redis Streams group, one killed with SIGKILL mid-batch: every
// published message has exactly one effect row or one dead letter, and the redelivery count
// the library reports equals the redeliveries the processes' delivery logs show.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "idem/mq/redis_streams.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/processes.hpp"
#include "support/test_env.hpp"

namespace {

using Clock = std::chrono::steady_clock;

using idem::test::slurp;
using idem::test::spawn;
using idem::test::summary_value;
using idem::test::wait_for;

// `kill_inside`: c1 does its slow work inside the handler's transaction and stops inside the
// third handler, so the kill lands mid-transaction (SQLite rolls it back) while c1 holds the
// message's claim in Redis (the fast store), which blocks that message until c1's lease (3 s)
// ends; otherwise c1 is slow before each message and dies between messages.
// `batched`: both consumers run consume_batch() per XREADGROUP batch instead of consume().
void run_kill_scenario(bool kill_inside, bool batched = false) {
  std::string url;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_URL");
  idem::test::TempDir dir;
  const std::string stream = idem::test::unique_name("idem-test:mq:orders");
  const std::string dead = stream + ".dead";
  // A fresh group per run: the consume records in Redis (the shared fast store) outlive a run.
  const std::string group = idem::test::unique_name("billing");
  const std::string db = dir.file("billing.db");
  idem::mq::RedisStreams redis{{url}};
  ASSERT_TRUE(redis.create_group(stream, group));

  // --- producer: N messages, every 10th re-published later (a producer retry: same message
  // id, new entry id), a few poison messages, and three entries that reuse an id with another
  // body (a producer bug: parked, not applied).
  constexpr int kMessages = 2000;
  std::set<std::string> published, poison, mismatched;
  std::vector<idem::mq::Fields> entries;
  auto body_of = [](int i) { return "{\"order\":" + std::to_string(i) + "}"; };
  for (int i = 0; i < kMessages; ++i) {
    std::string id = "order_" + std::to_string(i) + ":paid:v1";
    entries.push_back({{"message_id", id}, {"body", body_of(i)}});
    published.insert(id);
    if (i % 10 == 9) {
      int j = i - 7;
      entries.push_back({{"message_id", "order_" + std::to_string(j) + ":paid:v1"},
                         {"body", body_of(j)}});
    }
    if (i % 600 == 550) {  // a producer bug: the same id with another body
      entries.push_back({{"message_id", "order_" + std::to_string(i - 50) + ":paid:v1"},
                         {"body", "{\"order\":-1}"}});
      mismatched.insert("order_" + std::to_string(i - 50) + ":paid:v1");
    }
    if (i % 400 == 123) {
      std::string p = "poison_" + std::to_string(i);
      entries.push_back({{"message_id", p}, {"body", "poison " + std::to_string(i)}});
      published.insert(p);
      poison.insert(p);
    }
  }
  for (std::size_t at = 0; at < entries.size(); at += 500) {
    std::vector<idem::mq::Fields> part(entries.begin() + static_cast<long>(at),
                                       entries.begin() + static_cast<long>(
                                           std::min(entries.size(), at + 500)));
    redis.add_many(stream, part);
  }
  ASSERT_EQ(entries.size(), redis.length(stream));

  auto args = [&](const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> a{IDEM_MQ_CONSUMER_BIN, "--redis", url, "--stream", stream,
                               "--group", group, "--consumer", name, "--db", db,
                               "--log", dir.file(name + ".log"), "--max-attempts", "3",
                               "--fast-store", "redis", "--lease-ms", "2000"};
    if (batched) a.push_back("--consume-batch");
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  // c1: slow (30 ms per message, batches of 16), never claims; it gets killed. Killed inside,
  // it stops inside the handler of its third message (claim held, transaction open) and is
  // killed only once it says so: the kill cannot land between two messages, however loaded the
  // machine. Its 3 s lease leaves c2 (which takes over entries idle for 1 s) ample time to
  // meet that claim.
  std::vector<std::string> c1_extra{"--batch", "16", "--delay-ms", "30", "--claim-every-ms", "0"};
  if (kill_inside) {
    c1_extra.insert(c1_extra.end(),
                    {"--delay-inside", "--hang-inside-after", "2", "--lease-ms", "3000"});
  }
  pid_t c1 = spawn(args("c1", c1_extra), dir.file("c1.out"));
  ASSERT_GT(c1, 0);
  auto deadline = Clock::now() + std::chrono::seconds(30);
  while (slurp(dir.file("c1.log")).empty() && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_FALSE(slurp(dir.file("c1.log")).empty()) << slurp(dir.file("c1.out"));
  // c2: fast, takes over entries idle for 1 s, exits when the group has nothing left.
  pid_t c2 = spawn(args("c2", {"--batch", "32", "--claim-idle-ms", "1000", "--claim-every-ms",
                               "250", "--exit-when-drained"}),
                   dir.file("c2.out"));
  ASSERT_GT(c2, 0);
  if (kill_inside) {
    deadline = Clock::now() + std::chrono::seconds(30);
    while (slurp(dir.file("c1.out")).find("hanging inside") == std::string::npos &&
           Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_NE(std::string::npos, slurp(dir.file("c1.out")).find("hanging inside"))
        << slurp(dir.file("c1.out"));
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
  }
  ASSERT_EQ(0, ::kill(c1, SIGKILL));
  int status = 0;
  ::waitpid(c1, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  const auto left_by_c1 = redis.pending(stream, group).of("c1");
  EXPECT_GT(left_by_c1, 0u) << "c1 was expected to die with entries pending (mid-batch)";

  ASSERT_EQ(0, wait_for(c2, std::chrono::seconds(100))) << slurp(dir.file("c2.out"));
  const std::string out = slurp(dir.file("c2.out"));

  // --- nothing pending, nothing left to deliver.
  EXPECT_EQ(0u, redis.pending(stream, group).count);
  EXPECT_EQ(0u, redis.pending(stream, group).of("c1"));

  // --- exactly one effect row per consumed message; consumed ∪ dead letter = published.
  idem::sqlite::Database database{db};
  std::map<std::string, long> effects;
  database.read([&](idem::sqlite::Session& s) {
    auto st = s.prepare("SELECT message_id, count(*) FROM effect GROUP BY message_id");
    while (st.step()) effects[st.column_bytes(0)] = static_cast<long>(st.column_int64(1));
  });
  std::set<std::string> dead_letters;
  std::size_t dead_entries = 0;
  for (const auto& e : redis.range(dead)) {
    ++dead_entries;
    dead_letters.insert(*e.find("message_id"));
    EXPECT_EQ("3", *e.find("attempts"));
  }
  EXPECT_EQ(poison, dead_letters);
  EXPECT_EQ(poison.size(), dead_entries) << "each poison message dead-lettered once";
  std::set<std::string> consumed_or_dead = dead_letters;
  for (const auto& [id, n] : effects) {
    EXPECT_EQ(1, n) << id << " has " << n << " effect rows";
    EXPECT_EQ(0u, dead_letters.count(id)) << id << " both consumed and dead-lettered";
    consumed_or_dead.insert(id);
  }
  EXPECT_EQ(published, consumed_or_dead);
  // Mismatched entries were parked (and acked), never applied: their ids keep one effect row.
  std::set<std::string> parked;
  for (const auto& e : redis.range(stream + ".parked")) parked.insert(*e.find("message_id"));
  EXPECT_EQ(mismatched, parked);
  EXPECT_EQ(3u, mismatched.size());
  EXPECT_EQ(published.size() - poison.size(), effects.size());

  // --- redeliveries: every delivery of an entry after its first, as the logs show (each
  // process logs a batch before processing it), equals what the library counted. c1 reads only
  // new entries, so all redeliveries happen in c2, which reports its count at exit.
  std::map<std::string, int> deliveries;
  for (const auto* name : {"c1", "c2"}) {
    std::istringstream log(slurp(dir.file(std::string(name) + ".log")));
    std::string entry_id, count, message_id;
    while (log >> entry_id >> count >> message_id) ++deliveries[entry_id];
  }
  std::uint64_t observed = 0;
  for (const auto& [id, n] : deliveries) observed += static_cast<std::uint64_t>(n - 1);
  EXPECT_EQ(entries.size(), deliveries.size()) << "every entry was delivered";
  EXPECT_GE(observed, left_by_c1 + 2 * poison.size());
  EXPECT_EQ(observed, summary_value(out, "redeliveries")) << out;
#ifdef MQ_CONSUMER_WITH_PROMETHEUS
  // The same count as a Prometheus counter (idem_mq_redeliveries_total, told by the consumer).
  {
    std::smatch m;
    std::regex re("summary-metrics .*\\bmetric_redeliveries=([0-9]+)");
    ASSERT_TRUE(std::regex_search(out, m, re)) << out;
    EXPECT_EQ(observed, std::stoull(m[1])) << out;
  }
#endif
  EXPECT_GE(summary_value(out, "claimed"), left_by_c1) << out;
  EXPECT_EQ(poison.size(), summary_value(out, "dead_lettered")) << out;
  // Each poison message is retried twice (max_attempts 3). Killed inside a message, c1 also
  // left its Redis claim behind (with consume_batch: the claims of its whole batch): c2
  // answered retry_later for those messages until the lease ended (3 s from the claim; c2
  // takes the entry over after 1 s idle, and again every second while it stays pending).
  if (kill_inside) {
    EXPECT_GT(summary_value(out, "retry_later"), 2 * poison.size()) << out;
  } else if (!batched) {
    // Killed between messages (c1 sleeps 30 ms before each one), c1 held no claim, unless the
    // kill hit the 1-3 ms of a consume() call (more on a loaded machine): then c2 answered
    // retry_later for that one message until its 2 s lease ended, taking it over again every
    // 250 ms once it had been idle for 1 s (a handful of extra answers, never more).
    EXPECT_GE(summary_value(out, "retry_later"), 2 * poison.size()) << out;
    EXPECT_LE(summary_value(out, "retry_later"), 2 * poison.size() + 8) << out;
  } else {
    // Killed between messages, c1 held no claim, unless the kill hit the few milliseconds of
    // a consume_batch call (after the slow pre-processing of its batch).
    EXPECT_GE(summary_value(out, "retry_later"), 2 * poison.size()) << out;
  }

  std::printf("published %zu ids in %zu entries; c1 killed with %llu pending; %llu "
              "redeliveries observed; c2: %s",
              published.size(), entries.size(), static_cast<unsigned long long>(left_by_c1),
              static_cast<unsigned long long>(observed),
              out.substr(out.rfind("summary ")).c_str());
  redis.del(stream);
  redis.del(dead);
  redis.del(stream + ".parked");
}

TEST(MqConsumerProcesses, KillNineMidBatchStillOneEffectPerMessage) { run_kill_scenario(false); }

TEST(MqConsumerProcesses, KillNineInsideTheTransactionStillOneEffectPerMessage) {
  run_kill_scenario(true);
}

TEST(MqConsumerProcesses, ConsumeBatchKillNineMidBatchStillOneEffectPerMessage) {
  run_kill_scenario(false, true);
}

TEST(MqConsumerProcesses, ConsumeBatchKillNineInsideTheTransactionStillOneEffectPerMessage) {
  run_kill_scenario(true, true);
}

#if defined(MQ_CONSUMER_WITH_PROMETHEUS) && defined(MQ_CONSUMER_WITH_HTTP)
// GET http://127.0.0.1:<port><path> over a plain socket; the whole response, or "".
std::string http_get(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = ::read(fd, buf, sizeof buf)) > 0) response.append(buf, static_cast<std::size_t>(n));
    }
  }
  ::close(fd);
  return response;
}

// The consumer's /metrics: a poison message is retried (taken back with XAUTOCLAIM) until it
// is dead-lettered; idem_mq_redeliveries_total, scraped over HTTP, equals the redeliveries the
// consumer reports at exit, and the guard's counters are there too.
TEST(MqConsumerProcesses, MetricsEndpointCountsRedeliveries) {
  std::string url;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_URL");
  idem::test::TempDir dir;
  const std::string stream = idem::test::unique_name("idem-test:mq:metrics");
  const std::string group = idem::test::unique_name("billing");
  idem::mq::RedisStreams redis{{url}};
  ASSERT_TRUE(redis.create_group(stream, group));
  redis.add_many(stream, {{{"message_id", "m1:paid:v1"}, {"body", "{}"}},
                          {{"message_id", "m2:paid:v1"}, {"body", "poison"}},
                          {{"message_id", "m3:paid:v1"}, {"body", "{}"}}});
  pid_t pid = spawn({IDEM_MQ_CONSUMER_BIN, "--redis", url, "--stream", stream, "--group", group,
                     "--consumer", "cm", "--db", dir.file("m.db"), "--fast-store", "memory",
                     "--max-attempts", "3", "--claim-idle-ms", "50", "--claim-every-ms", "50",
                     "--metrics-port", "0"},
                    dir.file("cm.out"));
  ASSERT_GT(pid, 0);
  // The port, from "cm: metrics on http://127.0.0.1:<port>/metrics".
  int port = 0;
  std::smatch m;
  const std::regex port_re("metrics on http://127\\.0\\.0\\.1:([0-9]+)/metrics");
  auto deadline = Clock::now() + std::chrono::seconds(30);
  while (port == 0 && Clock::now() < deadline) {
    std::string out = slurp(dir.file("cm.out"));
    if (std::regex_search(out, m, port_re)) port = std::stoi(m[1]);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_GT(port, 0) << slurp(dir.file("cm.out"));
  // Wait until the poison message is dead-lettered (attempt 3 = 2 redeliveries).
  deadline = Clock::now() + std::chrono::seconds(30);
  while (redis.length(stream + ".dead") == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(1u, redis.length(stream + ".dead")) << slurp(dir.file("cm.out"));
  std::string metrics = http_get(port, "/metrics");
  ASSERT_NE(std::string::npos, metrics.find("200 OK")) << metrics;
  std::regex value_re("\\nidem_mq_redeliveries_total(\\{[^}]*\\})? ([0-9.e+]+)");
  ASSERT_TRUE(std::regex_search(metrics, m, value_re)) << metrics;
  const auto scraped = static_cast<std::uint64_t>(std::stod(m[2]));
  EXPECT_NE(std::string::npos, metrics.find("idem_calls_total")) << metrics;

  ASSERT_EQ(0, ::kill(pid, SIGTERM));
  ASSERT_EQ(0, wait_for(pid, std::chrono::seconds(30))) << slurp(dir.file("cm.out"));
  std::string out = slurp(dir.file("cm.out"));
  EXPECT_EQ(2u, summary_value(out, "redeliveries")) << out;
  EXPECT_EQ(2u, scraped) << metrics;
  EXPECT_EQ(1u, summary_value(out, "dead_lettered")) << out;
  redis.del(stream);
  redis.del(stream + ".dead");
}
#endif

}  // namespace
