// SPDX-License-Identifier: MIT
// examples/coupon_claim on PostgreSQL (IDEM_TEST_POSTGRES_DSN): concurrent claims of one coupon
// wait on the unique index and all answer the one row; and the binary's run passes its checks.
// Private tables.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "backends.hpp"
#include "coupon.hpp"
#include "support/run_command.hpp"
#include "support/test_env.hpp"

namespace {

TEST(CouponClaimPg, ThirtyTwoConcurrentClicksMakeOneRowAndOneAnswer) {
  std::string dsn;
  IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
  coupon_claim::PostgresBackend backend{dsn, idem::test::unique_name("coupon")};
  coupon_claim::CouponDesk desk{backend.table()};
  std::vector<std::string> answers(32);
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&, i] {
      answers[static_cast<std::size_t>(i)] = backend.write([&](pqxx::work& tx) {
        auto a = desk.claim(tx, 7, "C-1", "click-" + std::to_string(i), 1000 + i);
        std::this_thread::sleep_for(std::chrono::milliseconds(5));  // hold the key a moment
        return a;
      });
    });
  }
  for (auto& t : threads) t.join();
  auto rows = backend.rows();
  ASSERT_EQ(1u, rows.size());
  ASSERT_EQ(1u, rows.at({7, "C-1"}).size());
  for (const auto& a : answers) {
    EXPECT_EQ("claimed:" + std::to_string(rows.at({7, "C-1"}).front()), a);
  }
  EXPECT_EQ(31u, desk.stats().already_exists);
  backend.drop();
}

TEST(CouponClaimPgBinary, ClicksTimeoutsFailuresAndLostAnswersPassEveryCheck) {
  std::string dsn;
  IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
  const std::string table = idem::test::unique_name("couponb");
  auto r = idem::test::run_command(
      {IDEM_COUPON_CLAIM_BIN, "--users", "300", "--postgres", dsn, "--table", table});
  EXPECT_EQ(0, r.status) << r.output;
  EXPECT_EQ(1u, r.lines_starting("PASS").size()) << r.output;
  EXPECT_EQ(4u, r.lines_starting("check ok").size()) << r.output;
  EXPECT_NE(std::string::npos, r.output.find("backend postgres")) << r.output;
  coupon_claim::PostgresBackend{dsn, table}.drop();
}

}  // namespace
