// SPDX-License-Identifier: MIT
// examples/refund on SQLite: a repeated request refunds once; concurrent *different* requests
// never refund more than was paid; the status follows the amounts; refunds of unpaid orders
// are replayed final answers; a provider failure keeps the reservation and the retry reuses
// the refund id; a lease lost mid-call and a completion lost after settling refund once; and
// the binary's own run (3 processes x 4 threads on one file) passes its checks.
#include "refund.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "idem/memory_store.hpp"
#include "provider_stub.hpp"
#include "sqlite_backend.hpp"
#include "support/run_command.hpp"
#include "support/test_env.hpp"

namespace {

using refund::Request;

// A provider whose behaviour a test scripts per call: it books each refund id once (like the
// stub), and `script` may delay a call or lose its answer after booking.
class ScriptedProvider final : public refund::Provider {
 public:
  struct Call {
    std::string refund_id;
    bool applied = false;  // false: de-duplicated
  };
  // Returns true to lose this call's answer after booking it.
  std::function<bool(const std::string& refund_id, int call)> script;

  std::string refund(const std::string& refund_id, const std::string& order_no,
                     std::int64_t amount) override {
    int n;
    bool applied;
    std::string ref;
    {
      std::lock_guard<std::mutex> lock(mu_);
      n = static_cast<int>(calls_.size());
      applied = booked_.emplace(refund_id, Booking{order_no, amount, "PR-" + refund_id}).second;
      calls_.push_back(Call{refund_id, applied});
      ref = booked_[refund_id].ref;
    }
    if (script && script(refund_id, n)) throw refund::ProviderError("lost answer (applied)");
    return ref;
  }
  std::size_t calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_.size();
  }
  std::size_t booked() {
    std::lock_guard<std::mutex> lock(mu_);
    return booked_.size();
  }
  std::int64_t booked_amount() {
    std::lock_guard<std::mutex> lock(mu_);
    std::int64_t sum = 0;
    for (auto& [id, b] : booked_) sum += b.amount;
    return sum;
  }

 private:
  struct Booking {
    std::string order_no;
    std::int64_t amount;
    std::string ref;
  };
  std::mutex mu_;
  std::vector<Call> calls_;
  std::map<std::string, Booking> booked_;
};

class RefundTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = std::make_unique<refund::SqliteBackend>(dir_.file("refund.sqlite"));
    backend_->reset({{"ORD-1", 10000, "PAID"},
                     {"ORD-UNPAID", 10000, "WAIT_PAY"},
                     {"ORD-CANCELLED", 10000, "CANCELLED"}});
  }
  std::unique_ptr<refund::RefundDesk<refund::SqliteBackend>> desk(idem::GuardOptions options = {}) {
    return std::make_unique<refund::RefundDesk<refund::SqliteBackend>>(*backend_, fast_, provider_,
                                                                       options);
  }
  refund::OrderRow order(const std::string& no) { return backend_->read().orders.at(no); }

  idem::test::TempDir dir_;
  std::unique_ptr<refund::SqliteBackend> backend_;
  idem::MemoryStore fast_;
  ScriptedProvider provider_;
};

TEST_F(RefundTest, ARepeatedRequestRefundsOnceAndReplaysItsAnswer) {
  auto d = desk();
  Request r{"rq-1", "ORD-1", 2500};
  auto first = d->refund(r);
  ASSERT_EQ(idem::Outcome::kExecuted, first.outcome);
  EXPECT_EQ("refunded:2500:PR-rq-1", *first.value);
  for (int i = 0; i < 4; ++i) {
    auto again = d->refund(r);
    EXPECT_EQ(idem::Outcome::kReplayed, again.outcome);
    EXPECT_EQ(*first.value, *again.value);
  }
  EXPECT_EQ(1u, provider_.calls());
  auto l = backend_->read();
  EXPECT_EQ(1u, l.refunds.size());
  EXPECT_EQ("SUCCEEDED", l.refunds.at("rq-1").status);
  EXPECT_EQ(2500, l.orders.at("ORD-1").refunded);
  EXPECT_EQ("PARTIALLY_REFUNDED", l.orders.at("ORD-1").status);
  // The same request id with another amount is a client error, never a second refund.
  auto changed = d->refund(Request{"rq-1", "ORD-1", 3000});
  EXPECT_EQ(idem::Outcome::kFingerprintMismatch, changed.outcome);
  EXPECT_EQ(2500, order("ORD-1").refunded);
}

TEST_F(RefundTest, ThirtyTwoConcurrentDifferentRequestsNeverRefundMoreThanPaid) {
  auto d = desk();
  std::atomic<int> refunded{0}, exceeds{0}, other{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&, i] {
      // 1000 each, one of them twice from two threads (a second agent).
      Request r{"rq-" + std::to_string(i % 31), "ORD-1", 1000};
      for (;;) {
        auto a = d->refund(r);
        if (a.outcome == idem::Outcome::kInProgress) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          continue;
        }
        if (a.ok() && a.value->rfind("refunded:", 0) == 0) {
          ++refunded;
        } else if (a.ok() && (*a.value == "rejected:exceeds_refundable" ||
                              *a.value == "rejected:order_REFUNDED")) {
          ++exceeds;  // nothing left (once the 10th refund made it REFUNDED: order_REFUNDED)
        } else {
          ++other;
        }
        return;
      }
    });
  }
  for (auto& t : threads) t.join();
  auto l = backend_->read();
  EXPECT_EQ(10u, l.refunds.size());
  EXPECT_EQ(10000, l.orders.at("ORD-1").refunded);
  EXPECT_EQ("REFUNDED", l.orders.at("ORD-1").status);
  EXPECT_EQ(10u, provider_.booked());
  EXPECT_EQ(10000, provider_.booked_amount());
  EXPECT_EQ(0, other.load());
  EXPECT_EQ(32, refunded.load() + exceeds.load());
  EXPECT_GE(refunded.load(), 10);  // 10 requests, plus the duplicate if it was one of them
  EXPECT_LE(refunded.load(), 11);
}

TEST_F(RefundTest, StatusMovesPaidPartiallyRefundedRefundedAndThenRejects) {
  auto d = desk();
  EXPECT_EQ("PAID", order("ORD-1").status);
  EXPECT_EQ("refunded:3000:PR-a", *d->refund(Request{"a", "ORD-1", 3000}).value);
  EXPECT_EQ("PARTIALLY_REFUNDED", order("ORD-1").status);
  EXPECT_EQ("rejected:exceeds_refundable", *d->refund(Request{"b", "ORD-1", 7001}).value);
  EXPECT_EQ("refunded:7000:PR-c", *d->refund(Request{"c", "ORD-1", 7000}).value);
  EXPECT_EQ("REFUNDED", order("ORD-1").status);
  EXPECT_EQ("rejected:order_REFUNDED", *d->refund(Request{"d", "ORD-1", 1}).value);
  EXPECT_EQ("rejected:bad_amount", *d->refund(Request{"e", "ORD-1", 0}).value);
  EXPECT_EQ("rejected:unknown_order", *d->refund(Request{"f", "ORD-404", 10}).value);
  auto l = backend_->read();
  EXPECT_EQ(2u, l.refunds.size());  // rejections leave no refund row
  EXPECT_EQ(10000, l.orders.at("ORD-1").refunded);
}

TEST_F(RefundTest, RefundsOfUnpaidOrCancelledOrdersAreReplayedFinalAnswers) {
  auto d = desk();
  auto unpaid = d->refund(Request{"u", "ORD-UNPAID", 100});
  EXPECT_EQ(idem::Outcome::kExecuted, unpaid.outcome);  // an answer, not an error
  EXPECT_EQ("rejected:order_WAIT_PAY", *unpaid.value);
  EXPECT_EQ("rejected:order_CANCELLED", *d->refund(Request{"c", "ORD-CANCELLED", 100}).value);
  // The order is paid later: the request that was told "not refundable" keeps being told so;
  // a new request id refunds.
  backend_->write([](idem::sqlite::Transaction& tx) {
    tx.exec(
        "UPDATE refund_orders SET status = 'PAID', paid = amount WHERE order_no = 'ORD-UNPAID'");
  });
  auto again = d->refund(Request{"u", "ORD-UNPAID", 100});
  EXPECT_EQ(idem::Outcome::kReplayed, again.outcome);
  EXPECT_EQ("rejected:order_WAIT_PAY", *again.value);
  EXPECT_EQ("refunded:100:PR-u2", *d->refund(Request{"u2", "ORD-UNPAID", 100}).value);
  EXPECT_EQ(0, order("ORD-CANCELLED").refunded);
  EXPECT_EQ(1u, provider_.calls());
}

TEST_F(RefundTest, AProviderFailureKeepsTheReservationAndTheRetryReusesTheRefundId) {
  auto d = desk();
  provider_.script = [](const std::string&, int call) { return call < 2; };  // 2 lost answers
  Request r{"rq-lost", "ORD-1", 6000};
  EXPECT_THROW(d->refund(r), refund::ProviderError);
  // The money is promised: the reservation stays, so a racing request cannot take it.
  auto l = backend_->read();
  EXPECT_EQ("PENDING", l.refunds.at("rq-lost").status);
  EXPECT_EQ(6000, l.orders.at("ORD-1").refunded);
  EXPECT_EQ("rejected:exceeds_refundable", *d->refund(Request{"rq-other", "ORD-1", 5000}).value);
  EXPECT_THROW(d->refund(r), refund::ProviderError);  // the claim was released: it ran again
  auto ok = d->refund(r);
  EXPECT_EQ(idem::Outcome::kExecuted, ok.outcome);
  EXPECT_EQ("refunded:6000:PR-rq-lost", *ok.value);
  EXPECT_EQ(3u, provider_.calls());   // three calls with the same refund id ...
  EXPECT_EQ(1u, provider_.booked());  // ... one refund
  l = backend_->read();
  EXPECT_EQ("SUCCEEDED", l.refunds.at("rq-lost").status);
  EXPECT_EQ(6000, l.orders.at("ORD-1").refunded);
  // After a failure the record is gone, so the fingerprint cannot catch a changed amount; the
  // refund row does: the same id with another amount is refused, the original completes.
  provider_.script = [](const std::string& id, int) { return id == "rq-2"; };
  EXPECT_THROW(d->refund(Request{"rq-2", "ORD-1", 1000}), refund::ProviderError);
  try {
    (void)d->refund(Request{"rq-2", "ORD-1", 2000});
    ADD_FAILURE() << "a reused request id was accepted";
  } catch (const idem::Error& e) {
    EXPECT_EQ(idem::errc::kFingerprintMismatch, e.code());
  }
  EXPECT_EQ(7000, order("ORD-1").refunded);
}

TEST_F(RefundTest, ALeaseLostDuringASlowProviderCallStillRefundsOnce) {
  idem::GuardOptions options;
  options.lease = std::chrono::milliseconds(150);
  auto d = desk(options);
  provider_.script = [](const std::string&, int call) {
    if (call == 0) std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the first
    return false;
  };
  Request r{"rq-slow", "ORD-1", 4000};
  std::string slow_error;
  std::thread slow([&] {
    try {
      (void)d->refund(r);
    } catch (const idem::LeaseLost& e) {
      slow_error = "lease_lost";
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(250));  // the lease has expired
  auto takeover = d->refund(r);
  slow.join();
  EXPECT_EQ(idem::Outcome::kExecuted, takeover.outcome);
  EXPECT_EQ("refunded:4000:PR-rq-slow", *takeover.value);
  EXPECT_EQ("lease_lost", slow_error);  // the slow attempt's completion was refused
  EXPECT_EQ(2u, provider_.calls());     // both called the provider, with one refund id
  EXPECT_EQ(1u, provider_.booked());
  EXPECT_EQ(*takeover.value, *d->refund(r).value);  // its retry replays
  EXPECT_EQ(4000, order("ORD-1").refunded);
}

TEST_F(RefundTest, ACompletionLostAfterSettlingIsAnsweredWithoutCallingTheProviderAgain) {
  idem::GuardOptions options;
  options.lease = std::chrono::milliseconds(100);
  options.step_hook = [](idem::Step s, const idem::Key&) {
    // A crash after the handler returned (refund settled), before the record completed.
    if (s == idem::Step::kHandlerReturned) throw std::runtime_error("crash");
  };
  auto crashing = desk(options);
  Request r{"rq-crash", "ORD-1", 1500};
  EXPECT_THROW(crashing->refund(r), std::runtime_error);
  EXPECT_EQ("SUCCEEDED", backend_->read().refunds.at("rq-crash").status);
  auto d = desk();
  auto retry = d->refund(r);  // (the released or expired record is claimed again)
  EXPECT_EQ(idem::Outcome::kExecuted, retry.outcome);
  EXPECT_EQ("refunded:1500:PR-rq-crash", *retry.value);
  EXPECT_EQ(1u, provider_.calls());  // the settled row answered; no second provider call
  EXPECT_EQ(1500, order("ORD-1").refunded);
}

TEST(RefundProviderStub, DeduplicatesByRefundIdAcrossInstancesAndFailsAsConfigured) {
  idem::test::TempDir dir;
  refund::ProviderStubOptions o;
  o.path = dir.file("provider.sqlite");
  o.max_delay = std::chrono::milliseconds(0);
  o.fail_before_percent = 30;
  o.lost_answer_percent = 30;
  o.seed = 42;
  refund::ProviderStub a{o}, b{o};  // two processes' views of one ledger
  int failures = 0, answers = 0;
  std::set<std::string> refs;
  for (int i = 0; i < 200; ++i) {
    auto& p = i % 2 == 0 ? a : b;
    try {
      refs.insert(p.refund("r-" + std::to_string(i % 10), "ORD-1", 100 + i % 10));
      ++answers;
    } catch (const refund::ProviderError&) {
      ++failures;
    }
  }
  auto ledger = a.ledger();
  EXPECT_EQ(10u, ledger.size());
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(100 + i, ledger.at("r-" + std::to_string(i)).amount);
  }
  EXPECT_EQ(10u, refs.size());
  auto st = b.stats();
  EXPECT_EQ(200, st.calls);
  EXPECT_EQ(10, st.applied);
  EXPECT_EQ(failures, st.failed_before + st.lost_answers);
  EXPECT_GT(st.failed_before, 20);
  EXPECT_GT(st.lost_answers, 20);
  EXPECT_EQ(st.calls - st.failed_before, st.applied + st.deduplicated);
  // Same id, other amount: asked through a view that injects no failures, so the roll of the
  // dice (seeded per process and thread) cannot answer "unavailable" before the ledger is read.
  refund::ProviderStubOptions reliable = o;
  reliable.fail_before_percent = 0;
  reliable.lost_answer_percent = 0;
  refund::ProviderStub c{reliable};
  EXPECT_THROW(c.refund("r-1", "ORD-1", 999), std::logic_error);
  EXPECT_EQ(100 + 1, c.ledger().at("r-1").amount);  // the ledger kept the first amount
}

// The example itself, as a user runs it: several processes on one SQLite file.
TEST(RefundBinary, ThreeProcessesOnOneSqliteFilePassEveryCheck) {
  idem::test::TempDir dir;
  auto r = idem::test::run_command({IDEM_REFUND_BIN, "--orders", "30", "--processes", "3",
                                    "--threads", "4", "--db", dir.file("refund.sqlite")});
  EXPECT_EQ(0, r.status) << r.output;
  EXPECT_EQ(1u, r.lines_starting("PASS").size()) << r.output;
  EXPECT_TRUE(r.lines_starting("check FAIL").empty()) << r.output;
  EXPECT_EQ(14u, r.lines_starting("check ok").size()) << r.output;
  EXPECT_NE(std::string::npos, r.output.find("3 process(es) x 4 threads")) << r.output;
}

TEST(RefundBinary, InProcessRunAndFlagErrors) {
  idem::test::TempDir dir;
  auto r =
      idem::test::run_command({IDEM_REFUND_BIN, "--orders", "15", "--processes", "0", "--threads",
                               "8", "--seed", "7", "--db", dir.file("refund.sqlite")});
  EXPECT_EQ(0, r.status) << r.output;
  EXPECT_EQ(1u, r.lines_starting("PASS").size()) << r.output;
  EXPECT_EQ(2, idem::test::run_command({IDEM_REFUND_BIN, "--orders", "x"}).status);
  EXPECT_EQ(2, idem::test::run_command({IDEM_REFUND_BIN, "--frobnicate", "1"}).status);
  EXPECT_EQ(2, idem::test::run_command(
                   {IDEM_REFUND_BIN, "--fail-before-percent", "60", "--lost-answer-percent", "40"})
                   .status);
}

}  // namespace
