// SPDX-License-Identifier: MIT
// examples/refund on PostgreSQL (IDEM_TEST_POSTGRES_DSN): concurrent different refund requests
// of one order wait at the conditional UPDATE and never refund more than was paid; a provider
// failure keeps the reservation; and the binary's run (3 processes x 4 threads on one
// database, the provider failing and slow) passes its checks. Private tables per test.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "idem/memory_store.hpp"
#include "postgres_backend.hpp"
#include "provider_stub.hpp"
#include "support/run_command.hpp"
#include "support/test_env.hpp"

namespace {

using refund::Request;

class RefundPgTest : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(dsn_, "IDEM_TEST_POSTGRES_DSN");
    prefix_ = idem::test::unique_name("rf") + "_";
    refund::Tables t{prefix_ + "orders", prefix_ + "refunds"};
    backend_ = std::make_unique<refund::PostgresBackend>(dsn_, t, prefix_ + "idem");
    backend_->reset({{"ORD-1", 10000, "PAID"}, {"ORD-2", 10000, "CANCELLED"}});
    refund::ProviderStubOptions po;
    po.path = dir_.file("provider.sqlite");
    po.max_delay = std::chrono::milliseconds(5);
    po.fail_before_percent = 0;
    po.lost_answer_percent = 0;
    provider_ = std::make_unique<refund::ProviderStub>(po);
    desk_ = std::make_unique<refund::RefundDesk<refund::PostgresBackend>>(
        *backend_, fast_, *provider_, idem::GuardOptions{}, t);
  }
  void TearDown() override {
    if (backend_) backend_->drop();
  }

  std::string dsn_, prefix_;
  idem::test::TempDir dir_;
  std::unique_ptr<refund::PostgresBackend> backend_;
  idem::MemoryStore fast_;
  std::unique_ptr<refund::ProviderStub> provider_;
  std::unique_ptr<refund::RefundDesk<refund::PostgresBackend>> desk_;
};

TEST_F(RefundPgTest, TwentyFourConcurrentDifferentRequestsNeverRefundMoreThanPaid) {
  std::atomic<int> refunded{0}, exceeds{0}, other{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 24; ++i) {
    threads.emplace_back([&, i] {
      auto a = desk_->refund(Request{"rq-" + std::to_string(i), "ORD-1", 1500});
      if (a.ok() && a.value->rfind("refunded:", 0) == 0) {
        ++refunded;
      } else if (a.ok() && *a.value == "rejected:exceeds_refundable") {
        ++exceeds;
      } else {
        ++other;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(6, refunded.load());  // 6 x 1500 = 9000; a 7th would exceed 10000
  EXPECT_EQ(18, exceeds.load());
  EXPECT_EQ(0, other.load());
  auto l = backend_->read();
  EXPECT_EQ(9000, l.orders.at("ORD-1").refunded);
  EXPECT_EQ("PARTIALLY_REFUNDED", l.orders.at("ORD-1").status);
  EXPECT_EQ(6u, l.refunds.size());
  EXPECT_EQ(6u, provider_->ledger().size());
  EXPECT_EQ(24, l.records_completed);
  EXPECT_EQ(0, l.records_in_progress);
  // The last 1000 brings it to REFUNDED; a cancelled order's refund is a final answer.
  EXPECT_EQ(0u, desk_->refund(Request{"rq-last", "ORD-1", 1000}).value->rfind("refunded:1000:", 0));
  EXPECT_EQ("REFUNDED", backend_->read().orders.at("ORD-1").status);
  EXPECT_EQ("rejected:order_CANCELLED", *desk_->refund(Request{"rq-c", "ORD-2", 1}).value);
}

TEST_F(RefundPgTest, AProviderFailureKeepsTheReservationUntilTheRetrySettlesIt) {
  refund::ProviderStubOptions po;
  po.path = dir_.file("provider.sqlite");
  po.max_delay = std::chrono::milliseconds(0);
  po.fail_before_percent = 0;
  po.lost_answer_percent = 90;  // applied, then the answer is lost, most of the time
  po.seed = 3;
  refund::ProviderStub flaky{po};
  refund::RefundDesk<refund::PostgresBackend> desk{
      *backend_, fast_, flaky, idem::GuardOptions{}, {prefix_ + "orders", prefix_ + "refunds"}};
  Request r{"rq-flaky", "ORD-1", 7000};
  int failures = 0;
  for (;;) {
    try {
      auto a = desk.refund(r);
      ASSERT_TRUE(a.ok());
      EXPECT_EQ(0u, a.value->rfind("refunded:7000:PR-", 0));
      break;
    } catch (const refund::ProviderError&) {
      ++failures;
      auto l = backend_->read();
      EXPECT_EQ("PENDING", l.refunds.at("rq-flaky").status);
      EXPECT_EQ(7000, l.orders.at("ORD-1").refunded);  // reserved while pending
    }
    ASSERT_LT(failures, 200);
  }
  auto ledger = flaky.ledger();
  ASSERT_EQ(1u, ledger.size());
  EXPECT_EQ(7000, ledger.at("rq-flaky").amount);
  EXPECT_EQ(failures + 1, ledger.at("rq-flaky").calls);
  EXPECT_EQ("SUCCEEDED", backend_->read().refunds.at("rq-flaky").status);
}

TEST(RefundPgBinary, ThreeProcessesOnOneDatabasePassEveryCheck) {
  std::string dsn;
  IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
  const std::string prefix = idem::test::unique_name("rfb") + "_";
  auto r = idem::test::run_command({IDEM_REFUND_BIN, "--orders", "30", "--processes", "3",
                                    "--threads", "4", "--postgres", dsn, "--prefix", prefix});
  EXPECT_EQ(0, r.status) << r.output;
  EXPECT_EQ(1u, r.lines_starting("PASS").size()) << r.output;
  EXPECT_TRUE(r.lines_starting("check FAIL").empty()) << r.output;
  EXPECT_EQ(14u, r.lines_starting("check ok").size()) << r.output;
  EXPECT_NE(std::string::npos, r.output.find("backend postgres")) << r.output;
  refund::PostgresBackend{dsn, {prefix + "orders", prefix + "refunds"}, prefix + "idem"}.drop();
}

}  // namespace
