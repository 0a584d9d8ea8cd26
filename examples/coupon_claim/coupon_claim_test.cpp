// SPDX-License-Identifier: MIT
// examples/coupon_claim on SQLite: sixty-four concurrent claims of one coupon by one user make
// one row and sixty-four "claimed" answers with its id; a claim rolled back before commit
// leaves nothing and the retry claims; and the binary's run (clicks, timeouts, failures, lost
// answers) passes its checks.
#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "backends.hpp"
#include "coupon.hpp"
#include "support/run_command.hpp"
#include "support/test_env.hpp"

namespace {

using coupon_claim::CouponDesk;
using coupon_claim::SqliteBackend;

TEST(CouponClaim, SixtyFourConcurrentClicksMakeOneRowAndOneAnswer) {
  idem::test::TempDir dir;
  SqliteBackend backend{dir.file("coupon.sqlite")};
  CouponDesk desk;
  std::vector<std::string> answers(64);
  std::vector<std::thread> threads;
  for (int i = 0; i < 64; ++i) {
    threads.emplace_back([&, i] {
      answers[static_cast<std::size_t>(i)] = backend.write([&](idem::sqlite::Transaction& tx) {
        return desk.claim(tx, 7, "C-1", "click-" + std::to_string(i), 1000 + i);
      });
    });
  }
  for (auto& t : threads) t.join();
  auto rows = backend.rows();
  ASSERT_EQ(1u, rows.size());
  ASSERT_EQ(1u, rows.at({7, "C-1"}).size());
  const std::string expected = "claimed:" + std::to_string(rows.at({7, "C-1"}).front());
  for (const auto& a : answers) EXPECT_EQ(expected, a);
  EXPECT_EQ(1u, desk.stats().inserted);
  EXPECT_EQ(63u, desk.stats().already_exists);
  // Another coupon, another user: their own rows.
  backend.write([&](idem::sqlite::Transaction& tx) {
    EXPECT_NE(expected, desk.claim(tx, 7, "C-2", "x", 1));
    EXPECT_NE(expected, desk.claim(tx, 8, "C-1", "y", 1));
  });
  EXPECT_EQ(3u, backend.rows().size());
}

TEST(CouponClaim, AClaimRolledBackBeforeCommitLeavesNothingAndTheRetryClaims) {
  idem::test::TempDir dir;
  SqliteBackend backend{dir.file("coupon.sqlite")};
  CouponDesk desk;
  EXPECT_THROW(backend.write([&](idem::sqlite::Transaction& tx) -> std::string {
    desk.claim(tx, 1, "C-1", "first", 1);
    throw std::runtime_error("the server died before COMMIT");
  }),
               std::runtime_error);
  EXPECT_TRUE(backend.rows().empty());
  auto a = backend.write(
      [&](idem::sqlite::Transaction& tx) { return desk.claim(tx, 1, "C-1", "retry", 2); });
  auto b = backend.write(
      [&](idem::sqlite::Transaction& tx) { return desk.claim(tx, 1, "C-1", "again", 3); });
  EXPECT_EQ(a, b);
  EXPECT_EQ(1u, backend.rows().size());
}

TEST(CouponClaimBinary, ClicksTimeoutsFailuresAndLostAnswersPassEveryCheck) {
  idem::test::TempDir dir;
  auto r = idem::test::run_command(
      {IDEM_COUPON_CLAIM_BIN, "--users", "300", "--db", dir.file("coupon.sqlite")});
  EXPECT_EQ(0, r.status) << r.output;
  EXPECT_EQ(1u, r.lines_starting("PASS").size()) << r.output;
  EXPECT_EQ(4u, r.lines_starting("check ok").size()) << r.output;
  EXPECT_TRUE(r.lines_starting("check FAIL").empty()) << r.output;
  EXPECT_EQ(2, idem::test::run_command({IDEM_COUPON_CLAIM_BIN, "--users", "0"}).status);
  EXPECT_EQ(2, idem::test::run_command(
                   {IDEM_COUPON_CLAIM_BIN, "--fail-percent", "50", "--lost-percent", "50"})
                   .status);
}

}  // namespace
