// SPDX-License-Identifier: MIT
// The payment callback is paid once however often, however concurrently and however late it
// arrives; every callback is answered "success"; each duplicate is logged with source
// state_machine.
#include "payment_callback.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include "support/test_env.hpp"

namespace {

using payment_callback::Callback;
using payment_callback::Transition;

class PaymentCallbackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    db_ = std::make_unique<idem::sqlite::Database>(dir_.file("pay.sqlite"));
    logger_ = std::make_shared<idem::LoggingObserver>(
        [this](idem::LogLevel, std::string_view line) {
          std::lock_guard<std::mutex> lock(mutex_);
          lines_.emplace_back(line);
        });
    handler_ = std::make_unique<payment_callback::PaymentCallbackHandler>(*db_, logger_);
    set_order("ORD-1", "WAIT_PAY");
  }

  void set_order(const std::string& no, const std::string& status) {
    db_->write([&](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT OR REPLACE INTO orders (order_no, amount, status) VALUES (?, 1999, ?)", no,
              status);
    });
  }
  std::int64_t count(const std::string& sql) {
    return db_->read([&](idem::sqlite::Session& s) { return s.query_int64(sql).value_or(-1); });
  }
  std::string status(const std::string& no) {
    return db_->read([&](idem::sqlite::Session& s) {
      return s.query_text("SELECT status FROM orders WHERE order_no = ?", no).value_or("");
    });
  }
  std::size_t duplicate_lines() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t n = 0;
    for (auto& l : lines_) {
      if (l.find("idem duplicate key=payment.callback|ORD-1 source=state_machine") == 0) ++n;
    }
    return n;
  }

  idem::test::TempDir dir_;
  std::unique_ptr<idem::sqlite::Database> db_;
  std::shared_ptr<idem::LoggingObserver> logger_;
  std::unique_ptr<payment_callback::PaymentCallbackHandler> handler_;
  std::mutex mutex_;
  std::vector<std::string> lines_;
};

TEST_F(PaymentCallbackTest, RepeatedCallbackPaysOnceAndKeepsTheFirstPaidAt) {
  for (int i = 0; i < 5; ++i) {
    auto a = handler_->handle(Callback{"ORD-1", "T-1", 1999, 1000 + i});
    EXPECT_EQ("success", a.body);
    EXPECT_EQ(i == 0 ? Transition::kTransitioned : Transition::kAlreadyThere, a.transition);
    EXPECT_EQ("PAID", a.status);
  }
  EXPECT_EQ(1, count("SELECT count(*) FROM payments WHERE order_no = 'ORD-1'"));
  EXPECT_EQ(1000, count("SELECT paid_at FROM orders WHERE order_no = 'ORD-1'"));
  EXPECT_EQ(4u, duplicate_lines());
}

// An order number that is not a valid key id ("ORD 1": a blank) is still paid once, and its
// repeated callback still answers "success" (the duplicate's log line, keyed by it, is skipped;
// it threw after the commit, and the gateway would have retried for ever).
TEST_F(PaymentCallbackTest, AnOrderNumberThatIsNoKeyIdStillAnswersItsDuplicates) {
  set_order("ORD 1", "WAIT_PAY");
  for (int i = 0; i < 3; ++i) {
    auto a = handler_->handle(Callback{"ORD 1", "T-9", 1999, 1000 + i});
    EXPECT_EQ("success", a.body);
    EXPECT_EQ(i == 0 ? Transition::kTransitioned : Transition::kAlreadyThere, a.transition);
  }
  EXPECT_EQ(1, count("SELECT count(*) FROM payments WHERE order_no = 'ORD 1'"));
}

TEST_F(PaymentCallbackTest, ThirtyTwoConcurrentCallbacksPayOnceAndAllSucceed) {
  std::atomic<int> success{0}, transitioned{0}, already{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&, i] {
      auto a = handler_->handle(Callback{"ORD-1", "T-1", 1999, 5000 + i});
      if (a.body == "success") ++success;
      if (a.transition == Transition::kTransitioned) ++transitioned;
      if (a.transition == Transition::kAlreadyThere) ++already;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(32, success.load());
  EXPECT_EQ(1, transitioned.load());
  EXPECT_EQ(31, already.load());
  EXPECT_EQ(1, count("SELECT count(*) FROM payments"));
  EXPECT_EQ("PAID", status("ORD-1"));
  EXPECT_EQ(31u, duplicate_lines());
}

TEST_F(PaymentCallbackTest, LateCallbackAfterShippedIsADuplicateNotARegression) {
  ASSERT_EQ(Transition::kTransitioned, handler_->handle(Callback{"ORD-1", "T-1", 1999, 7}).transition);
  db_->write([](idem::sqlite::Transaction& tx) {
    tx.exec("UPDATE orders SET status = 'SHIPPED' WHERE order_no = 'ORD-1'");
  });
  auto late = handler_->handle(Callback{"ORD-1", "T-1", 1999, 99});
  EXPECT_EQ("success", late.body);
  EXPECT_EQ(Transition::kAlreadyThere, late.transition);
  EXPECT_EQ("SHIPPED", late.status);
  EXPECT_EQ("SHIPPED", status("ORD-1"));
  EXPECT_EQ(7, count("SELECT paid_at FROM orders WHERE order_no = 'ORD-1'"));
  EXPECT_EQ(1, count("SELECT count(*) FROM payments"));
}

TEST_F(PaymentCallbackTest, CallbackForACancelledOrderIsAcknowledgedAndRefundedOnce) {
  set_order("ORD-2", "CANCELLED");
  for (int i = 0; i < 3; ++i) {
    auto a = handler_->handle(Callback{"ORD-2", "T-2", 500, 1});
    EXPECT_EQ("success", a.body);
    EXPECT_EQ(Transition::kRejected, a.transition);
    EXPECT_TRUE(a.refund_needed);
  }
  EXPECT_EQ("CANCELLED", status("ORD-2"));
  EXPECT_EQ(0, count("SELECT count(*) FROM payments WHERE order_no = 'ORD-2'"));
  EXPECT_EQ(1, count("SELECT count(*) FROM refunds WHERE order_no = 'ORD-2'"));
}

TEST_F(PaymentCallbackTest, UnknownOrderAsksTheGatewayToRetry) {
  auto a = handler_->handle(Callback{"ORD-404", "T-9", 1, 1});
  EXPECT_EQ("fail", a.body);
  EXPECT_EQ(Transition::kNotFound, a.transition);
  EXPECT_FALSE(a.refund_needed);
}

}  // namespace
