// SPDX-License-Identifier: MIT
// The payment callback on MariaDB (IDEM_TEST_MYSQL_URI): paid once however often, however
// concurrently and however late the callback arrives; every callback answered "success"; a
// cancelled order refunded once; and the same behind a guard with Redis in front
// (IDEM_TEST_REDIS_URL) and the seed table api_idempotency. Each test uses private tables.
#include "payment_callback_mysql.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "idem/redis/redis_store.hpp"
#include "support/test_env.hpp"

namespace {

using payment_callback::Callback;
using payment_callback::Transition;

class PaymentCallbackMysqlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string uri;
    IDEM_REQUIRE_ENV(uri, "IDEM_TEST_MYSQL_URI");
    store_ = std::make_unique<idem::mysql::MysqlStore>(uri);
    tables_.orders = idem::test::unique_name("cb_orders");
    tables_.payments = idem::test::unique_name("cb_payments");
    tables_.refunds = idem::test::unique_name("cb_refunds");
    handler_ =
        std::make_unique<payment_callback::MysqlPaymentCallbackHandler>(*store_, nullptr, tables_);
    set_order("ORD-1", "WAIT_PAY");
  }
  void TearDown() override {
    if (!store_) return;
    store_->with_session([&](idem::mysql::Session& s) {
      s.exec_text("DROP TABLE IF EXISTS " + tables_.orders + ", " + tables_.payments + ", " +
                  tables_.refunds);
    });
  }
  void set_order(const std::string& no, const std::string& status) {
    store_->with_session([&](idem::mysql::Session& s) {
      s.exec("INSERT INTO " + tables_.orders +
                 " (order_no, amount, status) VALUES (?, 1999, ?)"
                 " ON DUPLICATE KEY UPDATE status = VALUES(status)",
             no, status);
    });
  }
  long long count(const std::string& sql) {
    return store_->with_session(
        [&](idem::mysql::Session& s) { return s.query_int64(sql).value_or(-1); });
  }

  std::unique_ptr<idem::mysql::MysqlStore> store_;
  payment_callback::Tables tables_;
  std::unique_ptr<payment_callback::MysqlPaymentCallbackHandler> handler_;
};

TEST_F(PaymentCallbackMysqlTest, RepeatedCallbackPaysOnceAndKeepsTheFirstPaidAt) {
  for (int i = 0; i < 5; ++i) {
    auto a = handler_->handle(Callback{"ORD-1", "T-1", 1999, 1000 + i});
    EXPECT_EQ("success", a.body);
    EXPECT_EQ(i == 0 ? Transition::kTransitioned : Transition::kAlreadyThere, a.transition);
    EXPECT_EQ("PAID", a.status);
  }
  EXPECT_EQ(1, count("SELECT count(*) FROM " + tables_.payments));
  EXPECT_EQ(1000, count("SELECT paid_at FROM " + tables_.orders + " WHERE order_no = 'ORD-1'"));
}

TEST_F(PaymentCallbackMysqlTest, ThirtyTwoConcurrentCallbacksPayOnceAndAllSucceed) {
  std::atomic<int> success{0}, transitioned{0}, already{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&, i] {
      try {
        auto a = handler_->handle(Callback{"ORD-1", "T-1", 1999, 5000 + i});
        if (a.body == "success") ++success;
        if (a.transition == Transition::kTransitioned) ++transitioned;
        if (a.transition == Transition::kAlreadyThere) ++already;
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(32, success.load());
  EXPECT_EQ(1, transitioned.load());
  EXPECT_EQ(31, already.load());
  EXPECT_EQ(1, count("SELECT count(*) FROM " + tables_.payments));
  EXPECT_EQ(count("SELECT paid_at FROM " + tables_.payments),
            count("SELECT paid_at FROM " + tables_.orders + " WHERE order_no = 'ORD-1'"));
}

TEST_F(PaymentCallbackMysqlTest, LateCallbackAfterShippedAndCancelledOrders) {
  ASSERT_EQ(Transition::kTransitioned,
            handler_->handle(Callback{"ORD-1", "T-1", 1999, 7}).transition);
  set_order("ORD-1", "SHIPPED");
  auto late = handler_->handle(Callback{"ORD-1", "T-1", 1999, 99});
  EXPECT_EQ("success", late.body);
  EXPECT_EQ(Transition::kAlreadyThere, late.transition);
  EXPECT_EQ(7, count("SELECT paid_at FROM " + tables_.orders + " WHERE order_no = 'ORD-1'"));
  set_order("ORD-2", "CANCELLED");
  for (int i = 0; i < 3; ++i) {
    auto a = handler_->handle(Callback{"ORD-2", "T-2", 500, 1});
    EXPECT_EQ("success", a.body);
    EXPECT_TRUE(a.refund_needed);
  }
  EXPECT_EQ(1, count("SELECT count(*) FROM " + tables_.refunds));
  EXPECT_EQ("fail", handler_->handle(Callback{"ORD-404", "T-9", 1, 1}).body);
}

// Redis in front, the seed table behind: repeated callbacks stop at Redis, the order is paid
// once, every caller reads "success" (or "fail" while the first is in flight: a retry).
TEST_F(PaymentCallbackMysqlTest, GuardedWithRedisPaysOnce) {
  std::string redis;
  IDEM_REQUIRE_ENV(redis, "IDEM_TEST_REDIS_URL");
  idem::redis::RedisStoreOptions ro{redis};
  ro.key_prefix = idem::test::unique_name("cb") + ":";
  idem::redis::RedisStore fast{ro};
  payment_callback::GuardedPaymentCallbackHandler guarded{fast, *store_, *handler_};
  const std::string trade = idem::test::unique_name("T");
  std::atomic<int> transitioned{0}, other{0}, failed{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&] {
      for (int attempt = 0; attempt < 100; ++attempt) {  // the gateway retries on "fail"
        auto a = guarded.handle(Callback{"ORD-1", trade, 1999, 42});
        if (a.body == "success") {
          (a.transition == Transition::kTransitioned ? transitioned : other).fetch_add(1);
          return;
        }
        ++failed;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      ADD_FAILURE() << "no success";
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(1, transitioned.load());
  EXPECT_EQ(31, other.load());
  // The concurrent callbacks waited for the first one's answer (wait_for_result): none was
  // answered "fail" (which only makes the gateway call again).
  EXPECT_EQ(0, failed.load());
  EXPECT_EQ(1, count("SELECT count(*) FROM " + tables_.payments));
  EXPECT_GE(guarded.stats().snapshot().fast_hits, 1u);
  EXPECT_EQ(1, count("SELECT count(*) FROM api_idempotency WHERE biz_type = 'payment.callback'"
                     " AND idem_key = '" +
                     trade + "' AND status = 'completed'"));
}

}  // namespace
