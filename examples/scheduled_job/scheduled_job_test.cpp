// SPDX-License-Identifier: MIT
// examples/scheduled_job on SQLite: one tick fired by eight instances at once runs once; a late
// callback replays the close (and a close after the callback replays "paid"); a tick left in
// progress by a crashed run is taken over after its lease without redoing its committed
// payments; a tick nobody fired is caught up; and the binary's run (3 scheduler processes, 20
// ticks, one killed with kill -9) passes its checks.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <thread>
#include <vector>

#include "simulation.hpp"
#include "sqlite_backend.hpp"
#include "support/run_command.hpp"
#include "support/test_env.hpp"

namespace {

using scheduled_job::Job;
using scheduled_job::SqliteBackend;

class ScheduledJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = std::make_unique<SqliteBackend>(dir_.file("job.sqlite"));
    std::vector<scheduled_job::PaymentSeed> seeds;
    for (int i = 0; i < 12; ++i) seeds.push_back({"PAY-" + std::to_string(10 + i), 1 + i % 4});
    backend_->reset(seeds);  // 3 payments due at each of ticks 1..4
  }
  std::map<std::string, int> effects_per_payment() {
    std::map<std::string, int> n;
    for (const auto& e : backend_->read().effects) ++n[e.payment_no];
    return n;
  }

  idem::test::TempDir dir_;
  std::unique_ptr<SqliteBackend> backend_;
};

TEST_F(ScheduledJobTest, OneTickFiredByEightInstancesAtOnceRunsOnce) {
  std::atomic<int> ran{0}, other{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      idem::IdempotencyGuard<SqliteBackend::Durable> guard{backend_->durable()};
      Job<SqliteBackend> job{*backend_, guard, backend_->tables(), "instance-" + std::to_string(i)};
      scheduled_job::TickRun run;
      auto a = job.run_tick(4, 4, run, [](int, int) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));  // a slow payment
      });
      (a == Job<SqliteBackend>::Attempt::kRan ? ran : other)++;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(1, ran.load());
  EXPECT_EQ(7, other.load());
  auto s = backend_->read();
  ASSERT_EQ(1u, s.runs.size());
  EXPECT_TRUE(s.runs[0].finished);
  EXPECT_EQ(12, s.runs[0].items);  // every payment due at <= 4
  for (const auto& [no, n] : effects_per_payment()) EXPECT_EQ(1, n) << no;
  EXPECT_EQ(12u, s.effects.size());
  // Fired again later: "already run", nothing new.
  idem::IdempotencyGuard<SqliteBackend::Durable> guard{backend_->durable()};
  Job<SqliteBackend> late{*backend_, guard, backend_->tables(), "late"};
  scheduled_job::TickRun run;
  EXPECT_EQ(Job<SqliteBackend>::Attempt::kDone, late.run_tick(4, 9, run));
  EXPECT_EQ(1u, backend_->read().runs.size());
}

TEST_F(ScheduledJobTest, TheCallbackAndTheCloseShareOneKeySoOnlyTheFirstApplies) {
  idem::IdempotencyGuard<SqliteBackend::Durable> guard{backend_->durable()};
  scheduled_job::Settlement<SqliteBackend::Durable> s{guard, backend_->tables()};
  // The job closes PAY-10, then its success callback arrives (late): "closed", nothing paid.
  EXPECT_EQ("closed", *s.close("PAY-10", "job", 1).value);
  auto late = s.paid("PAY-10", "callback");
  EXPECT_EQ(idem::Outcome::kReplayed, late.outcome);
  EXPECT_EQ("closed", *late.value);
  // PAY-11's callback comes first: the job's close answers "paid" and closes nothing.
  EXPECT_EQ("paid", *s.paid("PAY-11", "callback").value);
  auto close = s.close("PAY-11", "job", 2);
  EXPECT_EQ(idem::Outcome::kReplayed, close.outcome);
  EXPECT_EQ("paid", *close.value);
  auto st = backend_->read();
  EXPECT_EQ("CLOSED", st.payments.at("PAY-10").status);
  EXPECT_EQ("PAID", st.payments.at("PAY-11").status);
  ASSERT_EQ(2u, st.effects.size());
  EXPECT_EQ("closed", st.effects[0].kind);
  EXPECT_EQ("paid", st.effects[1].kind);
  // Racing: sixteen callbacks and sixteen closes of one payment at once: one effect.
  std::vector<std::thread> threads;
  std::atomic<int> closed{0}, paid{0}, executed{0};
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&, i] {
      for (;;) {
        auto r = i % 2 == 0 ? s.close("PAY-12", "job", 3) : s.paid("PAY-12", "callback");
        if (!r.ok()) continue;  // in progress: the other side holds it
        (*r.value == "closed" ? closed : paid)++;
        if (r.outcome == idem::Outcome::kExecuted) ++executed;
        return;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_TRUE(closed.load() == 32 || paid.load() == 32) << closed << " / " << paid;
  // One handler ran at all (not merely one state change): the others replayed its decision.
  EXPECT_EQ(1, executed.load());
  EXPECT_EQ(1, effects_per_payment()["PAY-12"]);
}

TEST_F(ScheduledJobTest, ACrashedTickIsTakenOverAfterItsLeaseWithoutRedoingItsPayments) {
  idem::GuardOptions options;
  options.lease = std::chrono::milliseconds(200);
  // What a run killed in tick 2 leaves: its tick record in progress (owned by a dead attempt),
  // its run row unfinished, and the one payment it committed closed.
  auto& durable = backend_->durable();
  ASSERT_EQ(
      idem::ClaimStatus::kClaimed,
      durable.begin(scheduled_job::tick_key(2), "", idem::OwnerToken::generate(), options.lease)
          .status);
  backend_->start_run(2, "dead", 2);
  idem::IdempotencyGuard<SqliteBackend::Durable> dead_guard{durable};
  scheduled_job::Settlement<SqliteBackend::Durable> dead{dead_guard, backend_->tables()};
  ASSERT_EQ("closed", *dead.close("PAY-10", "dead", 2).value);  // due at tick 1

  idem::IdempotencyGuard<SqliteBackend::Durable> guard{durable, options};
  Job<SqliteBackend> job{*backend_, guard, backend_->tables(), "alive"};
  scheduled_job::TickRun run;
  EXPECT_EQ(Job<SqliteBackend>::Attempt::kBusy, job.run_tick(2, 2, run));  // the lease holds
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  EXPECT_EQ(Job<SqliteBackend>::Attempt::kRan, job.run_tick(2, 3, run));  // taken over
  EXPECT_EQ(5, run.closed);  // due at 1 or 2: six payments, PAY-10 already closed
  for (const auto& [no, n] : effects_per_payment()) EXPECT_EQ(1, n) << no;
  auto s = backend_->read();
  EXPECT_EQ(6u, s.effects.size());
  ASSERT_EQ(2u, s.runs.size());
  EXPECT_FALSE(s.runs[0].finished);
  EXPECT_TRUE(s.runs[1].finished);
  EXPECT_EQ(3, s.runs[1].fire);
  EXPECT_EQ(0, s.records_in_progress);
}

TEST_F(ScheduledJobTest, TwoSchedulersCatchUpATickNobodyFired) {
  scheduled_job::Config cfg;
  cfg.ticks = 4;
  cfg.period = std::chrono::milliseconds(40);
  cfg.lease = std::chrono::milliseconds(500);
  cfg.missed_tick = 2;
  auto start = std::chrono::system_clock::now() + std::chrono::milliseconds(20);
  std::vector<scheduled_job::SchedulerStats> stats(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      stats[static_cast<std::size_t>(i)] = scheduled_job::run_scheduler(
          *backend_, cfg, "s" + std::to_string(i), start, std::chrono::milliseconds(3 * i));
    });
  }
  for (auto& t : threads) t.join();
  auto s = backend_->read();
  std::map<int, int> finished;
  for (const auto& r : s.runs) {
    EXPECT_TRUE(r.finished);
    ++finished[r.tick];
    if (r.tick == 2) {
      EXPECT_EQ(3, r.fire);  // fired by nobody at 2, caught up at 3
    }
  }
  EXPECT_EQ((std::map<int, int>{{1, 1}, {2, 1}, {3, 1}, {4, 1}}), finished);
  EXPECT_EQ(4, stats[0].ran + stats[1].ran);
  EXPECT_EQ(12, stats[0].closed + stats[1].closed);
  for (const auto& [no, n] : effects_per_payment()) EXPECT_EQ(1, n) << no;
}

// The example as a user runs it: 3 scheduler processes, 20 ticks, one killed with kill -9.
TEST(ScheduledJobBinary, ThreeSchedulersTwentyTicksOneKilledPassEveryCheck) {
  idem::test::TempDir dir;
  auto r = idem::test::run_command({IDEM_SCHEDULED_JOB_BIN, "--db", dir.file("job.sqlite")});
  EXPECT_EQ(0, r.status) << r.output;
  EXPECT_EQ(1u, r.lines_starting("PASS").size()) << r.output;
  EXPECT_TRUE(r.lines_starting("check FAIL").empty()) << r.output;
  EXPECT_EQ(11u, r.lines_starting("check ok").size()) << r.output;
  EXPECT_NE(std::string::npos, r.output.find("killed (kill -9) inside tick")) << r.output;
}

TEST(ScheduledJobBinary, FlagErrors) {
  EXPECT_EQ(2, idem::test::run_command({IDEM_SCHEDULED_JOB_BIN, "--ticks", "zero"}).status);
  EXPECT_EQ(2, idem::test::run_command({IDEM_SCHEDULED_JOB_BIN, "--schedulers", "1"}).status);
  EXPECT_EQ(2, idem::test::run_command({IDEM_SCHEDULED_JOB_BIN, "--prefix", "x_"}).status);
  EXPECT_EQ(0, idem::test::run_command({IDEM_SCHEDULED_JOB_BIN, "--help"}).status);
}

}  // namespace
