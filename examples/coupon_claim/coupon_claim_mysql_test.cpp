// SPDX-License-Identifier: MIT
// examples/coupon_claim on MySQL / MariaDB (IDEM_TEST_MYSQL_URI): concurrent claims of one
// coupon wait on the unique key and all answer the one row; and the binary's run passes its
// checks. Private tables.
#include <gtest/gtest.h>

#include "backends.hpp"
#include "server_checks.hpp"
#include "support/test_env.hpp"

namespace {

TEST(CouponClaimMysql, ThirtyTwoConcurrentClicksMakeOneRowAndOneAnswer) {
  std::string uri;
  IDEM_REQUIRE_ENV(uri, "IDEM_TEST_MYSQL_URI");
  coupon_claim::MysqlBackend backend{uri, idem::test::unique_name("coupon")};
  coupon_claim::test::expect_concurrent_clicks_make_one_row(backend);
  backend.drop();
}

TEST(CouponClaimMysqlBinary, ClicksTimeoutsFailuresAndLostAnswersPassEveryCheck) {
  std::string uri;
  IDEM_REQUIRE_ENV(uri, "IDEM_TEST_MYSQL_URI");
  const std::string table = idem::test::unique_name("couponb");
  coupon_claim::test::expect_binary_run_passes(IDEM_COUPON_CLAIM_BIN, "--mysql", uri, table,
                                               "mysql");
  coupon_claim::MysqlBackend{uri, table}.drop();
}

}  // namespace
