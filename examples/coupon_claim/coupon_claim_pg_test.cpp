// SPDX-License-Identifier: MIT
// examples/coupon_claim on PostgreSQL (IDEM_TEST_POSTGRES_DSN): concurrent claims of one coupon
// wait on the unique index and all answer the one row; and the binary's run passes its checks.
// Private tables.
#include <gtest/gtest.h>

#include "backends.hpp"
#include "server_checks.hpp"
#include "support/test_env.hpp"

namespace {

TEST(CouponClaimPg, ThirtyTwoConcurrentClicksMakeOneRowAndOneAnswer) {
  std::string dsn;
  IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
  coupon_claim::PostgresBackend backend{dsn, idem::test::unique_name("coupon")};
  coupon_claim::test::expect_concurrent_clicks_make_one_row(backend);
  backend.drop();
}

TEST(CouponClaimPgBinary, ClicksTimeoutsFailuresAndLostAnswersPassEveryCheck) {
  std::string dsn;
  IDEM_REQUIRE_ENV(dsn, "IDEM_TEST_POSTGRES_DSN");
  const std::string table = idem::test::unique_name("couponb");
  coupon_claim::test::expect_binary_run_passes(IDEM_COUPON_CLAIM_BIN, "--postgres", dsn, table,
                                               "postgres");
  coupon_claim::PostgresBackend{dsn, table}.drop();
}

}  // namespace
