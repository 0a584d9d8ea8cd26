// SPDX-License-Identifier: MIT
// The payment callback on PostgreSQL (real server: IDEM_TEST_POSTGRES_DSN): paid once however
// often, however concurrently and however late the callback arrives; every callback answered
// "success"; a cancelled order refunded once. Each test uses private tables.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include "payment_callback_pg.hpp"
#include "support/test_env.hpp"

namespace {

using payment_callback::Callback;
using payment_callback::Transition;

class PaymentCallbackPgTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string dsn;
    IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
    store_ = std::make_unique<idem::postgres::PostgresStore>(dsn);
    tables_.orders = idem::test::unique_name("cb_orders");
    tables_.payments = idem::test::unique_name("cb_payments");
    tables_.refunds = idem::test::unique_name("cb_refunds");
    logger_ = std::make_shared<idem::LoggingObserver>(
        [this](idem::LogLevel, std::string_view line) {
          std::lock_guard<std::mutex> lock(mutex_);
          lines_.emplace_back(line);
        });
    handler_ = std::make_unique<payment_callback::PostgresPaymentCallbackHandler>(
        *store_, logger_, tables_);
    set_order("ORD-1", "WAIT_PAY");
  }
  void TearDown() override {
    if (!store_) return;
    store_->with_transaction([&](pqxx::work& tx) {
      tx.exec("DROP TABLE IF EXISTS " + tables_.orders + ", " + tables_.payments + ", " +
              tables_.refunds);
    });
  }

  void set_order(const std::string& no, const std::string& status) {
    store_->with_transaction([&](pqxx::work& tx) {
      tx.exec_params("INSERT INTO " + tables_.orders +
                         " (order_no, amount, status) VALUES ($1, 1999, $2)"
                         " ON CONFLICT (order_no) DO UPDATE SET status = EXCLUDED.status",
                     no, status);
    });
  }
  long long count(const std::string& sql) {
    return store_->with_transaction([&](pqxx::work& tx) {
      auto r = tx.exec(sql);
      return r.empty() || r[0][0].is_null() ? -1LL : r[0][0].as<long long>();
    });
  }
  std::string status(const std::string& no) {
    return store_->with_transaction([&](pqxx::work& tx) {
      return tx.exec_params1("SELECT status FROM " + tables_.orders + " WHERE order_no = $1", no)[0]
          .as<std::string>();
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

  std::unique_ptr<idem::postgres::PostgresStore> store_;
  payment_callback::Tables tables_;
  std::shared_ptr<idem::LoggingObserver> logger_;
  std::unique_ptr<payment_callback::PostgresPaymentCallbackHandler> handler_;
  std::mutex mutex_;
  std::vector<std::string> lines_;
};

TEST_F(PaymentCallbackPgTest, RepeatedCallbackPaysOnceAndKeepsTheFirstPaidAt) {
  for (int i = 0; i < 5; ++i) {
    auto a = handler_->handle(Callback{"ORD-1", "T-1", 1999, 1000 + i});
    EXPECT_EQ("success", a.body);
    EXPECT_EQ(i == 0 ? Transition::kTransitioned : Transition::kAlreadyThere, a.transition);
    EXPECT_EQ("PAID", a.status);
  }
  EXPECT_EQ(1, count("SELECT count(*) FROM " + tables_.payments));
  EXPECT_EQ(1000, count("SELECT paid_at FROM " + tables_.orders + " WHERE order_no = 'ORD-1'"));
  EXPECT_EQ(4u, duplicate_lines());
}

TEST_F(PaymentCallbackPgTest, ThirtyTwoConcurrentCallbacksPayOnceAndAllSucceed) {
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
  EXPECT_EQ(1, count("SELECT count(*) FROM " + tables_.payments));
  EXPECT_EQ("PAID", status("ORD-1"));
  // paid_at is the winner's, and the payment row carries the same one.
  EXPECT_EQ(count("SELECT paid_at FROM " + tables_.payments),
            count("SELECT paid_at FROM " + tables_.orders + " WHERE order_no = 'ORD-1'"));
  EXPECT_EQ(31u, duplicate_lines());
}

TEST_F(PaymentCallbackPgTest, LateCallbackAfterShippedIsADuplicateNotARegression) {
  ASSERT_EQ(Transition::kTransitioned,
            handler_->handle(Callback{"ORD-1", "T-1", 1999, 7}).transition);
  set_order("ORD-1", "SHIPPED");
  auto late = handler_->handle(Callback{"ORD-1", "T-1", 1999, 99});
  EXPECT_EQ("success", late.body);
  EXPECT_EQ(Transition::kAlreadyThere, late.transition);
  EXPECT_EQ("SHIPPED", late.status);
  EXPECT_EQ("SHIPPED", status("ORD-1"));
  EXPECT_EQ(7, count("SELECT paid_at FROM " + tables_.orders + " WHERE order_no = 'ORD-1'"));
  EXPECT_EQ(1, count("SELECT count(*) FROM " + tables_.payments));
}

TEST_F(PaymentCallbackPgTest, CallbackForACancelledOrderIsAcknowledgedAndRefundedOnce) {
  set_order("ORD-2", "CANCELLED");
  for (int i = 0; i < 3; ++i) {
    auto a = handler_->handle(Callback{"ORD-2", "T-2", 500, 1});
    EXPECT_EQ("success", a.body);
    EXPECT_EQ(Transition::kRejected, a.transition);
    EXPECT_EQ("CANCELLED", a.status);
    EXPECT_TRUE(a.refund_needed);
  }
  EXPECT_EQ("CANCELLED", status("ORD-2"));
  EXPECT_EQ(0, count("SELECT count(*) FROM " + tables_.payments));
  EXPECT_EQ(1, count("SELECT count(*) FROM " + tables_.refunds));
}

TEST_F(PaymentCallbackPgTest, UnknownOrderAsksTheGatewayToRetry) {
  auto a = handler_->handle(Callback{"ORD-404", "T-9", 1, 1});
  EXPECT_EQ("fail", a.body);
  EXPECT_EQ(Transition::kNotFound, a.transition);
  EXPECT_FALSE(a.refund_needed);
  EXPECT_EQ(0, count("SELECT count(*) FROM " + tables_.refunds));
}

}  // namespace
