// SPDX-License-Identifier: MIT
// examples/scheduled_job on PostgreSQL (IDEM_TEST_POSTGRES_DSN): one tick fired by eight
// instances at once runs once, and the binary's run (3 scheduler processes, 20 ticks, one
// killed with kill -9 inside a payment's transaction) passes its checks. Private tables.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <thread>
#include <vector>

#include "postgres_backend.hpp"
#include "simulation.hpp"
#include "support/run_command.hpp"
#include "support/test_env.hpp"

namespace {

using scheduled_job::Job;
using scheduled_job::PostgresBackend;

scheduled_job::Tables tables(const std::string& prefix) {
  return {prefix + "payments", prefix + "effects", prefix + "runs"};
}

TEST(ScheduledJobPg, OneTickFiredByEightInstancesAtOnceRunsOnce) {
  std::string dsn;
  IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
  const std::string prefix = idem::test::unique_name("sj") + "_";
  PostgresBackend backend{dsn, tables(prefix), prefix + "idem"};
  std::vector<scheduled_job::PaymentSeed> seeds;
  for (int i = 0; i < 20; ++i) seeds.push_back({"PAY-" + std::to_string(100 + i), 1 + i % 5});
  backend.reset(seeds);
  std::atomic<int> ran{0}, other{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      idem::IdempotencyGuard<PostgresBackend::Durable> guard{backend.durable()};
      Job<PostgresBackend> job{backend, guard, backend.tables(), "instance-" + std::to_string(i)};
      scheduled_job::TickRun run;
      (job.run_tick(3, 3, run) == Job<PostgresBackend>::Attempt::kRan ? ran : other)++;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(1, ran.load());
  EXPECT_EQ(7, other.load());
  auto s = backend.read();
  ASSERT_EQ(1u, s.runs.size());
  EXPECT_TRUE(s.runs[0].finished);
  EXPECT_EQ(12, s.runs[0].items);  // due at <= 3
  std::map<std::string, int> n;
  for (const auto& e : s.effects) ++n[e.payment_no];
  EXPECT_EQ(12u, n.size());
  for (const auto& [no, count] : n) EXPECT_EQ(1, count) << no;
  EXPECT_EQ(0, s.records_in_progress);
  backend.drop();
}

TEST(ScheduledJobPgBinary, ThreeSchedulersTwentyTicksOneKilledPassEveryCheck) {
  std::string dsn;
  IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
  const std::string prefix = idem::test::unique_name("sjb") + "_";
  auto r = idem::test::run_command({IDEM_SCHEDULED_JOB_BIN, "--postgres", dsn, "--prefix", prefix});
  EXPECT_EQ(0, r.status) << r.output;
  EXPECT_EQ(1u, r.lines_starting("PASS").size()) << r.output;
  EXPECT_TRUE(r.lines_starting("check FAIL").empty()) << r.output;
  EXPECT_EQ(11u, r.lines_starting("check ok").size()) << r.output;
  EXPECT_NE(std::string::npos, r.output.find("backend postgres")) << r.output;
  PostgresBackend{dsn, tables(prefix), prefix + "idem"}.drop();
}

}  // namespace
