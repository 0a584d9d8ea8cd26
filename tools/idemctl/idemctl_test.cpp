// SPDX-License-Identifier: MIT
// idemctl, run as a binary: show / stats / purge / key, usage and exit statuses.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

#include "idem/guard.hpp"
#include "idem/http/idempotency_key.hpp"
#include "idemctl.hpp"
#include "idemctl_test_support.hpp"
#include "support/test_env.hpp"

namespace {

using idemctl_test::contains;
using idemctl_test::idemctl;
using idemctl_test::quote;
using idemctl_test::Run;

class IdemctlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.file("records.sqlite");
    idem::sqlite::SqliteStoreOptions old_options;
    old_options.clock = old_clock_.as_clock();
    {
      // Records written "ten days ago".
      idem::sqlite::SqliteStore old_store{path_, old_options};
      idem::IdempotencyGuard old_guard{old_store};
      for (int i = 0; i < 2; ++i) {
        (void)old_guard.run(idem::Key::make("order.create", "old_" + std::to_string(i)), "fp",
                            [](idem::sqlite::Transaction&) { return std::string("old"); });
      }
      (void)old_store.begin(idem::Key::make("order.create", "old_stuck"), "fp",
                            idem::OwnerToken::generate(), std::chrono::seconds(30));
    }
    idem::sqlite::SqliteStore store{path_};
    idem::IdempotencyGuard guard{store};
    auto r = guard.run(idem::Key::make("order.create", "abc"), "fp1",
                       [](idem::sqlite::Transaction&) { return std::string(1234, 'x'); });
    ASSERT_TRUE(r.ok());
    (void)guard.run(idem::Key::make("payment", "p1"), "",
                    [](idem::sqlite::Transaction&) { return std::string("paid"); });
    (void)store.begin(idem::Key::make("payment", "running"), "", idem::OwnerToken::generate(),
                      std::chrono::seconds(60));
    db_ = " --db " + quote(path_) + " ";
  }

  idem::test::TempDir dir_;
  idem::ManualClock old_clock_{idem::system_now() - std::chrono::hours(240)};
  std::string path_;
  std::string db_;
};

TEST(IdemctlDuration, ParsesUnitsAndRejectsTheRest) {
  using idemctl::parse_duration;
  EXPECT_EQ(std::chrono::seconds(7 * 86400), parse_duration("7d"));
  EXPECT_EQ(std::chrono::seconds(12 * 3600), parse_duration("12h"));
  EXPECT_EQ(std::chrono::seconds(30 * 60), parse_duration("30m"));
  EXPECT_EQ(std::chrono::seconds(45), parse_duration("45s"));
  EXPECT_EQ(std::chrono::seconds(14 * 86400), parse_duration("2w"));
  EXPECT_EQ(std::chrono::seconds(86400 + 12 * 3600), parse_duration("1d12h"));
  for (const char* bad : {"", "7", "d", "7x", "-7d", "7 d", "0d", "7d3", "99999999999d"}) {
    EXPECT_THROW(parse_duration(bad), idemctl::UsageError) << bad;
  }
}

TEST_F(IdemctlTest, UsageAndBadArgumentsExit2) {
  auto help = idemctl("--help");
  EXPECT_EQ(0, help.status);
  EXPECT_TRUE(contains(help.out, "usage: idemctl"));
  auto none = idemctl("");
  EXPECT_EQ(2, none.status);
  EXPECT_TRUE(contains(none.out, "idemctl: no command"));
  EXPECT_EQ(2, idemctl(db_ + "frobnicate").status);
  EXPECT_EQ(2, idemctl(db_ + "--bogus stats").status);
  EXPECT_EQ(2, idemctl(db_ + "show order.create").status);
  auto bad_scope = idemctl(db_ + "show 'bad scope' x");
  EXPECT_EQ(2, bad_scope.status);
  EXPECT_TRUE(contains(bad_scope.out, "scope.charset"));
  auto bad_duration = idemctl(db_ + "purge --older-than 7x");
  EXPECT_EQ(2, bad_duration.status);
  EXPECT_TRUE(contains(bad_duration.out, "bad duration unit 'x'"));
  EXPECT_EQ(2, idemctl(db_ + "purge").status);
  EXPECT_EQ(2, idemctl(db_ + "purge --older-than 7d --expired").status);
  EXPECT_EQ(2, idemctl("stats").status);  // no --db
}

TEST_F(IdemctlTest, UnreachableStoresExit3) {
  auto missing = idemctl("--db " + quote(dir_.file("nope.sqlite")) + " stats");
  EXPECT_EQ(3, missing.status);
  EXPECT_TRUE(contains(missing.out, "no such file"));
  // An SQLite file without idem's table is not silently initialised.
  std::string other = dir_.file("other.sqlite");
  { idem::sqlite::Database db{other}; }
  auto no_table = idemctl("--db " + quote(other) + " stats");
  EXPECT_EQ(3, no_table.status);
  EXPECT_TRUE(contains(no_table.out, "has no table 'api_idempotency'"));
  auto fast = idemctl(db_ + "--fast redis://127.0.0.1:1 show order.create abc");
  EXPECT_EQ(3, fast.status);
  EXPECT_TRUE(contains(fast.out, "redis://127.0.0.1:1"));
}

TEST_F(IdemctlTest, ShowPrintsTheRecord) {
  auto r = idemctl(db_ + "show order.create abc");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "key order.create|abc")) << r.out;
  EXPECT_TRUE(contains(r.out, "sqlite:" + path_)) << r.out;
  EXPECT_TRUE(contains(r.out, "completed")) << r.out;
  EXPECT_TRUE(contains(r.out, "1234 bytes")) << r.out;
  EXPECT_TRUE(contains(r.out, "fp1")) << r.out;
  EXPECT_TRUE(contains(r.out, "attempts")) << r.out;

  auto running = idemctl(db_ + "show payment running");
  EXPECT_EQ(0, running.status);
  EXPECT_TRUE(contains(running.out, "in_progress")) << running.out;
  EXPECT_TRUE(contains(running.out, "0 bytes")) << running.out;

  auto absent = idemctl(db_ + "show order.create nothing");
  EXPECT_EQ(1, absent.status);
  EXPECT_TRUE(contains(absent.out, "(absent)"));
}

TEST_F(IdemctlTest, StatsCountsByStatus) {
  auto r = idemctl(db_ + "stats");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "in_progress  2  (1 with an expired lease)")) << r.out;
  EXPECT_TRUE(contains(r.out, "completed    4\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "failed       0\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "total        6  (2 past retention")) << r.out;
}

TEST_F(IdemctlTest, PurgeOlderThanDeletesOnlyOldFinishedRecords) {
  auto dry = idemctl(db_ + "purge --older-than 7d --dry-run");
  EXPECT_EQ(0, dry.status) << dry.out;
  EXPECT_TRUE(contains(dry.out, "would purge 2 ")) << dry.out;
  EXPECT_TRUE(contains(idemctl(db_ + "stats").out, "completed    4\n"));

  auto r = idemctl(db_ + "purge --older-than 7d");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "purged 2 ")) << r.out;

  idem::sqlite::SqliteStore store{path_};
  EXPECT_FALSE(store.lookup(idem::Key::make("order.create", "old_0")));
  EXPECT_FALSE(store.lookup(idem::Key::make("order.create", "old_1")));
  EXPECT_TRUE(store.lookup(idem::Key::make("order.create", "old_stuck")));  // in progress: kept
  EXPECT_TRUE(store.lookup(idem::Key::make("order.create", "abc")));
  EXPECT_TRUE(store.lookup(idem::Key::make("payment", "p1")));
  EXPECT_TRUE(contains(idemctl(db_ + "purge --older-than 30d").out, "purged 0 "));
  EXPECT_TRUE(contains(idemctl(db_ + "purge --expired").out, "purged 0 records past retention"));
}

TEST(IdemctlKey, PrintsTheScopedHttpKey) {
  auto r = idemctl("key --scope http.orders.create --principal alice --method POST "
                   "--route /orders --key abc");
  EXPECT_EQ(0, r.status) << r.out;
  auto k = idem::http::scoped_key("http.orders.create", "alice", "POST", "/orders", "abc");
  EXPECT_EQ(k.scope() + " " + k.id() + "\n", r.out);
  EXPECT_EQ(2, idemctl("key --scope s").status);
}

}  // namespace
