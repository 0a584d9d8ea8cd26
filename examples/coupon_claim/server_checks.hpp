// SPDX-License-Identifier: MIT
// The checks examples/coupon_claim's tests run on each database server (PostgreSQL, MySQL):
// concurrent clicks of one coupon make one row and one answer, and the binary's run on that
// server passes every check.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "coupon.hpp"
#include "support/run_command.hpp"

namespace coupon_claim::test {

/// 32 transactions of `backend` claim coupon C-1 for user 7 at once, each holding the key a
/// moment: one row, every answer "claimed:<its id>", 31 answered from the existing row.
template <class Backend>
void expect_concurrent_clicks_make_one_row(Backend& backend) {
  CouponDesk desk{backend.table()};
  std::vector<std::string> answers(32);
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&, i] {
      answers[static_cast<std::size_t>(i)] = backend.write([&](typename Backend::Tx& tx) {
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
}

/// Runs `binary` with 300 users on `flag target` (--postgres DSN, --mysql URI) and table
/// `table`: exit 0, PASS, the four checks ok, the report naming `backend_name`.
inline void expect_binary_run_passes(const std::string& binary, const std::string& flag,
                                     const std::string& target, const std::string& table,
                                     const std::string& backend_name) {
  auto r = idem::test::run_command({binary, "--users", "300", flag, target, "--table", table});
  EXPECT_EQ(0, r.status) << r.output;
  EXPECT_EQ(1u, r.lines_starting("PASS").size()) << r.output;
  EXPECT_EQ(4u, r.lines_starting("check ok").size()) << r.output;
  EXPECT_NE(std::string::npos, r.output.find("backend " + backend_name)) << r.output;
}

}  // namespace coupon_claim::test
