// SPDX-License-Identifier: MIT
// idemctl, run as a binary against MariaDB (IDEM_TEST_MYSQL_URI): show, stats and purge on a
// MySQL record table, and exit status 3 (or 2 for a bad URI) with a clear message when the
// server is unreachable or the credentials are wrong.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "idem/guard.hpp"
#include "idem/mysql/mysql_store.hpp"
#include "idemctl_test_support.hpp"
#include "support/test_env.hpp"

namespace {

using idemctl_test::contains;
using idemctl_test::idemctl;
using idemctl_test::quote;

// A private record table: order.create|abc (completed, 1234 bytes), payment|p1 (completed),
// payment|running (in progress), and three rows aged ten days in SQL: old_0, old_1 (completed,
// retention over) and old_stuck (in progress, lease over).
class IdemctlMysqlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(uri_, "IDEM_TEST_MYSQL_URI");
    idem::mysql::MysqlStoreOptions o;
    o.uri = uri_;
    o.table = idem::test::unique_name("ctl_idem");
    store_ = std::make_unique<idem::mysql::MysqlStore>(o);
    idem::IdempotencyGuard guard{*store_};
    using Tx = idem::mysql::Transaction;
    ASSERT_TRUE(guard
                    .run(idem::Key::make("order.create", "abc"), "fp1",
                         [](Tx&) { return std::string(1234, 'x'); })
                    .ok());
    for (const char* id : {"old_0", "old_1"}) {
      (void)guard.run(idem::Key::make("order.create", id), "fp",
                      [](Tx&) { return std::string("old"); });
    }
    (void)guard.run(idem::Key::make("payment", "p1"), "", [](Tx&) { return std::string("paid"); });
    (void)store_->begin(idem::Key::make("payment", "running"), "", idem::OwnerToken::generate(),
                        std::chrono::seconds(60));
    (void)store_->begin(idem::Key::make("order.create", "old_stuck"), "fp",
                        idem::OwnerToken::generate(), std::chrono::seconds(30));
    const std::string t = o.table;
    store_->with_session([&](idem::mysql::Session& s) {
      s.exec("UPDATE " + t +
             " SET created_at = UTC_TIMESTAMP(3) - INTERVAL 10 DAY,"
             " updated_at = UTC_TIMESTAMP(3) - INTERVAL 10 DAY,"
             " expires_at = UTC_TIMESTAMP(3) - INTERVAL 9 DAY"
             " WHERE idem_key IN ('old_0', 'old_1')");
      s.exec("UPDATE " + t +
             " SET created_at = UTC_TIMESTAMP(3) - INTERVAL 10 DAY,"
             " updated_at = UTC_TIMESTAMP(3) - INTERVAL 10 DAY,"
             " lease_until = UTC_TIMESTAMP(3) - INTERVAL 10 DAY WHERE idem_key = 'old_stuck'");
    });
    table_ = t;
    db_ = " --mysql " + quote(uri_) + " --table " + t + " ";
  }
  void TearDown() override {
    if (store_)
      store_->with_session(
          [&](idem::mysql::Session& s) { s.exec_text("DROP TABLE IF EXISTS " + table_); });
  }

  std::string uri_, table_, db_;
  std::unique_ptr<idem::mysql::MysqlStore> store_;
};

TEST_F(IdemctlMysqlTest, ShowPrintsTheMysqlRecord) {
  auto r = idemctl(db_ + "show order.create abc");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "key order.create|abc")) << r.out;
  EXPECT_TRUE(contains(r.out, "mysql:mysql://")) << r.out;
  EXPECT_TRUE(contains(r.out, "completed")) << r.out;
  EXPECT_TRUE(contains(r.out, "1234 bytes")) << r.out;
  EXPECT_TRUE(contains(r.out, "fp1")) << r.out;
  EXPECT_TRUE(contains(r.out, "attempts     1")) << r.out;
  EXPECT_FALSE(contains(r.out, ":idem@")) << "password printed: " << r.out;
  // --db with the URI works the same.
  auto db = idemctl("--db " + quote(uri_) + " --table " + table_ + " show payment running");
  EXPECT_EQ(0, db.status) << db.out;
  EXPECT_TRUE(contains(db.out, "in_progress")) << db.out;
  auto absent = idemctl(db_ + "show order.create nothing");
  EXPECT_EQ(1, absent.status) << absent.out;
  EXPECT_TRUE(contains(absent.out, "(absent)"));
}

TEST_F(IdemctlMysqlTest, StatsCountsByStatus) {
  auto r = idemctl(db_ + "stats");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "in_progress  2  (1 with an expired lease)")) << r.out;
  EXPECT_TRUE(contains(r.out, "completed    4\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "failed       0\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "total        6  (2 past retention")) << r.out;
}

TEST_F(IdemctlMysqlTest, PurgesDeleteOnlyOldOrExpiredFinishedRecords) {
  auto dry = idemctl(db_ + "purge --older-than 7d --dry-run");
  EXPECT_EQ(0, dry.status) << dry.out;
  EXPECT_TRUE(contains(dry.out, "would purge 2 ")) << dry.out;
  auto r = idemctl(db_ + "purge --older-than 7d");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "purged 2 ")) << r.out;
  EXPECT_FALSE(store_->lookup(idem::Key::make("order.create", "old_0")));
  EXPECT_TRUE(store_->lookup(idem::Key::make("order.create", "old_stuck")));  // in progress
  EXPECT_TRUE(store_->lookup(idem::Key::make("order.create", "abc")));
  EXPECT_TRUE(contains(idemctl(db_ + "purge --expired").out, "purged 0 records past retention"));
}

TEST(IdemctlMysqlErrors, UnreachableWrongOrBadExitWithAClearMessage) {
  std::string uri;
  IDEM_REQUIRE_ENV(uri, "IDEM_TEST_MYSQL_URI");
  auto down = idemctl("--mysql mysql://u:s3cret@127.0.0.1:1/x stats");
  EXPECT_EQ(3, down.status) << down.out;
  EXPECT_TRUE(contains(down.out, "cannot open mysql:mysql://u:***@127.0.0.1:1/x")) << down.out;
  EXPECT_FALSE(contains(down.out, "s3cret")) << down.out;
  auto o = idem::mysql::parse_uri(uri);
  auto wrong = idemctl("--mysql " +
                       quote("mysql://" + o.user + ":wrong@" + o.host + ":" +
                             std::to_string(o.port) + "/" + o.database) +
                       " stats");
  EXPECT_EQ(3, wrong.status) << wrong.out;
  EXPECT_TRUE(contains(wrong.out, "1045")) << wrong.out;
  auto no_table = idemctl("--mysql " + quote(uri) + " --table no_such_idem_table stats");
  EXPECT_EQ(3, no_table.status) << no_table.out;
  EXPECT_TRUE(contains(no_table.out, "has no table")) << no_table.out;
  auto bad = idemctl("--mysql 'mysql://h/db?bogus=1' stats");
  EXPECT_EQ(2, bad.status) << bad.out;
}

}  // namespace
