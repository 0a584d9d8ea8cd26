// SPDX-License-Identifier: MIT
// idemctl, run as a binary: show / stats / purge / key, usage and exit statuses.
#include "idemctl.hpp"

#include <gtest/gtest.h>
#include <sqlite3.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "idem/guard.hpp"
#include "idem/http/idempotency_key.hpp"
#include "idem/log.hpp"
#include "idem/version.hpp"
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
      (void)old_store.begin(idem::Key::make("order.create", "old_stuck"), "fp", stuck_owner_,
                            std::chrono::seconds(30));
    }
    idem::sqlite::SqliteStore store{path_};
    idem::IdempotencyGuard guard{store};
    auto r = guard.run(idem::Key::make("order.create", "abc"), "fp1",
                       [](idem::sqlite::Transaction&) { return std::string(1234, 'x'); });
    ASSERT_TRUE(r.ok());
    (void)guard.run(idem::Key::make("payment", "p1"), "",
                    [](idem::sqlite::Transaction&) { return std::string("paid"); });
    (void)store.begin(idem::Key::make("payment", "running"), "", running_owner_,
                      std::chrono::seconds(60));
    db_ = " --db " + quote(path_) + " ";
  }

  idem::Record::Status status_of(const std::string& scope, const std::string& id) {
    idem::sqlite::SqliteStore store{path_};
    auto r = store.lookup(idem::Key::make(scope, id));
    if (!r) throw std::runtime_error(scope + "|" + id + " is absent");
    return r->status;
  }

  idem::OwnerToken stuck_owner_ = idem::OwnerToken::generate();
  idem::OwnerToken running_owner_ = idem::OwnerToken::generate();
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
  EXPECT_EQ(std::chrono::seconds(7 * 86400 + 86400 + 3600 + 60 + 1), parse_duration("1w1d1h1m1s"));
  for (const char* bad : {"", "7", "d", "7x", "-7d", "7 d", "0d", "7d3", "99999999999d", "1d1d",
                          "30m1h", "36501d", "300000w", "5215w1d"}) {
    EXPECT_THROW(parse_duration(bad), idemctl::UsageError) << bad;
  }
  EXPECT_EQ(idem::kMaxTerm, parse_duration("36500d"));  // the longest term idem keeps
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

// A --db URI of a scheme idemctl has no store for (a typo of postgresql://, a Redis URL) is a
// usage error that prints no password: it was opened as a SQLite file name, whose error
// printed the URI as given.
TEST_F(IdemctlTest, ADbUriOfAnUnknownSchemeIsAUsageErrorThatHidesThePassword) {
  for (const std::string db :
       {"postgressql://app:sekrit@127.0.0.1:1/shop", "Postgresql://app:sekrit@127.0.0.1:1/shop",
        "redis://app:sekrit@127.0.0.1:1", "amqp://app:sekrit@127.0.0.1:1/"}) {
    auto r = idemctl("--db " + quote(db) + " stats");
    EXPECT_EQ(2, r.status) << db << ": " << r.out;
    EXPECT_TRUE(contains(r.out, "no store for the scheme")) << r.out;
    EXPECT_FALSE(contains(r.out, "sekrit")) << r.out;
  }
  auto spaced = idemctl("--db ' postgresql://app:sekrit@127.0.0.1:1/shop' stats");
  EXPECT_EQ(2, spaced.status) << spaced.out;
  EXPECT_TRUE(contains(spaced.out, "starts with white space")) << spaced.out;
  EXPECT_FALSE(contains(spaced.out, "sekrit")) << spaced.out;
}

// A key whose id (or scope) starts with "--" is valid: the per-key commands take it after
// `--`. A fingerprint's bytes a terminal would act on are printed escaped.
TEST_F(IdemctlTest, PerKeyCommandsTakeAKeyAfterDashesAndEscapeTheFingerprint) {
  {
    idem::sqlite::SqliteStore store{path_};
    idem::IdempotencyGuard guard{store};
    (void)guard.run(idem::Key::make("order.create", "--yes"), "\x1b[31mred",
                    [](idem::sqlite::Transaction&) { return std::string("dashed"); });
  }
  EXPECT_EQ(2, idemctl(db_ + "show order.create --yes").status);
  auto show = idemctl(db_ + "show -- order.create --yes");
  EXPECT_EQ(0, show.status) << show.out;
  EXPECT_TRUE(contains(show.out, "key order.create|--yes")) << show.out;
  EXPECT_TRUE(contains(show.out, "\\x1B[31mred")) << show.out;
  EXPECT_FALSE(contains(show.out, "\x1b")) << show.out;
  auto response = idemctl(db_ + "response -- order.create --yes");
  EXPECT_EQ(0, response.status) << response.out;
  EXPECT_TRUE(contains(response.out, "dashed")) << response.out;
  auto duplicates = idemctl(db_ + "duplicates -- order.create --yes");
  EXPECT_EQ(0, duplicates.status) << duplicates.out;
  EXPECT_TRUE(contains(duplicates.out, "order.create|--yes")) << duplicates.out;
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

  EXPECT_FALSE(contains(r.out, "(expired)")) << r.out;
  auto old = idemctl(db_ + "show order.create old_0");  // its retention ended nine days ago
  EXPECT_EQ(0, old.status) << old.out;
  EXPECT_TRUE(contains(old.out, "(expired)")) << old.out;

  auto running = idemctl(db_ + "show payment running");
  EXPECT_EQ(0, running.status);
  EXPECT_TRUE(contains(running.out, "in_progress")) << running.out;
  EXPECT_TRUE(contains(running.out, "0 bytes")) << running.out;

  auto absent = idemctl(db_ + "show order.create nothing");
  EXPECT_EQ(1, absent.status);
  EXPECT_TRUE(contains(absent.out, "(absent)"));
}

// idemctl reads a SQLite file as it is: it creates, changes and locks nothing (a table without
// its version row stays without one), and a writer holding the file does not hold it up.
TEST_F(IdemctlTest, ReadingChangesNothingAndWaitsForNoWriter) {
  auto tables = [&] {
    idem::sqlite::Database db(path_);
    return db.read([](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM sqlite_master WHERE name = 'idem_schema_version'");
    });
  };
  {
    idem::sqlite::Database db(path_);
    db.write(
        [](idem::sqlite::Transaction& tx) { tx.exec_script("DROP TABLE idem_schema_version"); });
  }
  ASSERT_EQ(0, tables().value_or(-1));
  {
    idem::sqlite::DatabaseOptions o;
    o.busy_timeout = std::chrono::seconds(60);
    idem::sqlite::Database writer(path_, o);
    auto held = writer.begin();  // another process would wait 60 s for it
    auto r = idemctl(db_ + "show order.create abc");
    EXPECT_EQ(0, r.status) << r.out;
    EXPECT_TRUE(contains(r.out, "completed")) << r.out;
    held.rollback();
  }  // closed: the journal mode can change below
  EXPECT_EQ(0, tables().value_or(-1));
  // Nor its journal mode: a file in rollback-journal mode stays so (idem's own connections
  // would set WAL).
  auto journal_mode = [&](const char* set) {
    sqlite3* raw = nullptr;
    EXPECT_EQ(SQLITE_OK, sqlite3_open(path_.c_str(), &raw));
    std::string mode;
    sqlite3_stmt* st = nullptr;
    EXPECT_EQ(SQLITE_OK,
              sqlite3_prepare_v2(raw, set ? set : "PRAGMA journal_mode", -1, &st, nullptr));
    if (sqlite3_step(st) == SQLITE_ROW) {
      mode = reinterpret_cast<const char*>(sqlite3_column_text(st, 0));
    }
    sqlite3_finalize(st);
    sqlite3_close(raw);
    return mode;
  };
  ASSERT_EQ("delete", journal_mode("PRAGMA journal_mode=DELETE"));
  auto again = idemctl(db_ + "show order.create abc");
  EXPECT_EQ(0, again.status) << again.out;
  EXPECT_EQ("delete", journal_mode(nullptr));
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

// More rows than one batch (1,000), old and recent interleaved in key order: the purge walks
// the key batch by batch and deletes exactly the old finished rows, never an in-progress one.
TEST_F(IdemctlTest, PurgeOlderThanWalksTheKeyAcrossBatches) {
  const auto now = idem::to_millis(idem::system_now());
  const auto ten_days_ago = now - 10LL * 24 * 3600 * 1000;
  {
    idem::sqlite::SqliteStore store{path_};
    const std::string insert =
        "INSERT INTO " + store.table() +
        " (idem_key, biz_type, status, fingerprint, owner, lease_until, expires_at, created_at,"
        " updated_at) VALUES (?1, 'bulk', ?2, '', 'o', ?3, ?3, ?3, ?3)";
    const auto done = std::stoll(store.status_literal(idem::Record::Status::kCompleted));
    const auto held = std::stoll(store.status_literal(idem::Record::Status::kInProgress));
    store.database().write([&](idem::sqlite::Transaction& tx) {
      for (int i = 0; i < 3000; ++i) {
        const std::string id = "k" + std::to_string(i * 7 % 3000);  // out of key order
        if (i % 3 == 0) tx.exec(insert, id, done, ten_days_ago);    // old: purged
        if (i % 3 == 1) tx.exec(insert, id, done, now);             // recent: kept
        if (i % 3 == 2) tx.exec(insert, id, held, ten_days_ago);    // in progress: kept
      }
    });
  }
  auto r = idemctl(db_ + "purge --older-than 7d");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "purged 1002 ")) << r.out;  // 1,000 here, 2 of the fixture's
  idem::sqlite::SqliteStore store{path_};
  const auto left = store.database().read([&](idem::sqlite::Session& s) {
    return s.query_int64("SELECT count(*) FROM " + store.table() + " WHERE biz_type = 'bulk'");
  });
  EXPECT_EQ(2000, left.value_or(-1));
  EXPECT_TRUE(contains(idemctl(db_ + "purge --older-than 7d").out, "purged 0 "));
}

TEST(IdemctlVersion, PrintsTheLibraryVersion) {
  auto r = idemctl("--version");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_EQ(std::string("idemctl (idem) ") + idem::version() + "\n", r.out);
  EXPECT_EQ(std::string(IDEM_VERSION_STRING), idem::version());
  EXPECT_EQ(2, idemctl("--version stats").status);
}

TEST(IdemctlEscape, MakesEveryNonPrintableByteVisible) {
  using idemctl::escape_bytes;
  EXPECT_EQ(R"({"id": 1})", escape_bytes(R"({"id": 1})"));
  EXPECT_EQ(R"(a\nb\r\tc\\d)", escape_bytes("a\nb\r\tc\\d"));
  EXPECT_EQ(R"(\x00\x1B[31m\x7F\xC3\xA9\xFF)",
            escape_bytes(std::string("\0\x1b[31m\x7f\xc3\xa9\xff", 10)));
  EXPECT_EQ("", escape_bytes(""));
}

// A response with every kind of byte: printable, control, NUL, UTF-8, 0xFF, backslash.
const char kOddBytes[] = "ok\n\0\x1b[31m\xc3\xa9\xff\\end";
const std::string kOddResponse{kOddBytes, sizeof kOddBytes - 1};

TEST_F(IdemctlTest, ResponsePrintsTheStoredBytesEscapedOrRaw) {
  {
    idem::sqlite::SqliteStore store{path_};
    idem::IdempotencyGuard guard{store};
    ASSERT_TRUE(guard
                    .run(idem::Key::make("order.create", "odd"), "",
                         [](idem::sqlite::Transaction&) { return kOddResponse; })
                    .ok());
  }
  auto escaped = idemctl(db_ + "response order.create odd");
  EXPECT_EQ(0, escaped.status) << escaped.out;
  EXPECT_EQ("ok\\n\\x00\\x1B[31m\\xC3\\xA9\\xFF\\\\end\n", escaped.out);

  auto raw = idemctl(db_ + "response order.create odd --raw", /*with_stderr=*/false);
  EXPECT_EQ(0, raw.status);
  EXPECT_EQ(kOddResponse, raw.out);  // byte for byte, no newline added

  auto big = idemctl(db_ + "response order.create abc --raw", false);
  EXPECT_EQ(std::string(1234, 'x'), big.out);
}

TEST_F(IdemctlTest, ResponseOfAMissingOrUnfinishedRecordIsAClearError) {
  auto absent = idemctl(db_ + "response order.create nothing");
  EXPECT_EQ(1, absent.status) << absent.out;
  EXPECT_EQ("idemctl: no record of order.create|nothing in sqlite:" + path_ + "\n", absent.out);
  EXPECT_EQ("", idemctl(db_ + "response order.create nothing --raw", false).out);

  auto running = idemctl(db_ + "response payment running");
  EXPECT_EQ(4, running.status) << running.out;
  EXPECT_TRUE(contains(running.out, "payment|running is in progress in sqlite:")) << running.out;
  EXPECT_TRUE(contains(running.out, running_owner_.str())) << running.out;
  EXPECT_TRUE(contains(running.out, "no response is stored yet")) << running.out;

  EXPECT_EQ(2, idemctl(db_ + "response order.create").status);
  EXPECT_EQ(2, idemctl(db_ + "response order.create abc --bogus").status);
  EXPECT_EQ(2, idemctl("response order.create abc").status);  // no store
}

TEST_F(IdemctlTest, ResponseOfAFailedRecordIsItsReason) {
  {
    idem::sqlite::SqliteStore store{path_};
    auto owner = idem::OwnerToken::generate();
    auto key = idem::Key::make("mq", "poison");
    ASSERT_EQ(idem::ClaimStatus::kClaimed,
              store.begin(key, "", owner, std::chrono::seconds(30)).status);
    ASSERT_TRUE(store.fail(key, owner, "bad payload", std::chrono::hours(1)));
  }
  auto r = idemctl(db_ + "response mq poison");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "bad payload\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "mq|poison failed in sqlite:")) << r.out;
  EXPECT_EQ("bad payload", idemctl(db_ + "response mq poison --raw", false).out);

  auto release = idemctl(db_ + "release mq poison --yes");
  EXPECT_EQ(4, release.status) << release.out;
  EXPECT_TRUE(contains(release.out, "is failed in sqlite:")) << release.out;
  EXPECT_EQ(idem::Record::Status::kFailed, status_of("mq", "poison"));
}

TEST_F(IdemctlTest, ReleaseNeedsTheOwnerAndConfirmation) {
  // Without --owner: shows the owner, changes nothing.
  auto ask = idemctl(db_ + "release order.create old_stuck");
  EXPECT_EQ(4, ask.status) << ask.out;
  EXPECT_TRUE(contains(ask.out, "owner " + stuck_owner_.str() + ", lease until ")) << ask.out;
  EXPECT_TRUE(contains(ask.out, "(expired)")) << ask.out;
  EXPECT_TRUE(contains(ask.out, "release needs --owner")) << ask.out;
  EXPECT_EQ(idem::Record::Status::kInProgress, status_of("order.create", "old_stuck"));

  // Another owner: refused, nothing changed.
  auto other = idemctl(db_ + "release order.create old_stuck --owner someone_else --yes");
  EXPECT_EQ(4, other.status) << other.out;
  EXPECT_TRUE(contains(other.out, "owner someone_else does not hold order.create|old_stuck"))
      << other.out;
  EXPECT_EQ(idem::Record::Status::kInProgress, status_of("order.create", "old_stuck"));

  // The owner without --yes: says what it would do, exit 5, nothing changed.
  auto dry = idemctl(db_ + "release order.create old_stuck --owner " + stuck_owner_.str());
  EXPECT_EQ(5, dry.status) << dry.out;
  EXPECT_TRUE(contains(dry.out, "would release order.create|old_stuck (owner " +
                                    stuck_owner_.str() + ") in sqlite:" + path_))
      << dry.out;
  EXPECT_TRUE(contains(dry.out, "nothing changed: run again with --yes")) << dry.out;
  EXPECT_FALSE(contains(dry.out, "warning: the lease")) << dry.out;  // expired lease
  EXPECT_EQ(idem::Record::Status::kInProgress, status_of("order.create", "old_stuck"));

  // The owner with --yes: released; the next attempt runs at once.
  auto done =
      idemctl(db_ + "release order.create old_stuck --owner " + stuck_owner_.str() + " --yes");
  EXPECT_EQ(0, done.status) << done.out;
  EXPECT_TRUE(contains(done.out, "released order.create|old_stuck (owner " + stuck_owner_.str() +
                                     ") in sqlite:" + path_))
      << done.out;
  idem::sqlite::SqliteStore store{path_};
  EXPECT_FALSE(store.lookup(idem::Key::make("order.create", "old_stuck")));
  idem::IdempotencyGuard guard{store};
  int runs = 0;
  auto again = guard.run(idem::Key::make("order.create", "old_stuck"), "fp",
                         [&](idem::sqlite::Transaction&) {
                           ++runs;
                           return std::string("second");
                         });
  EXPECT_TRUE(again.ok());
  EXPECT_EQ(1, runs);

  // Released twice: the record is gone, exit 1.
  auto twice =
      idemctl(db_ + "release order.create old_stuck --owner " + stuck_owner_.str() + " --yes");
  EXPECT_EQ(4, twice.status) << twice.out;  // now completed by the retry above
  EXPECT_TRUE(contains(twice.out, "refusing to release a finished record")) << twice.out;
  auto absent = idemctl(db_ + "release order.create nothing --owner x --yes");
  EXPECT_EQ(1, absent.status) << absent.out;
  EXPECT_TRUE(contains(absent.out, "no record of order.create|nothing")) << absent.out;
  EXPECT_EQ(2, idemctl(db_ + "release order.create old_stuck --owner").status);
  EXPECT_EQ(2, idemctl(db_ + "release order.create old_stuck --force").status);
}

TEST_F(IdemctlTest, ReleaseWorksOnTheMqConsumeRecordTable) {
  const auto owner = idem::OwnerToken::generate();
  {
    idem::sqlite::SqliteStore mq{path_, idem::sqlite::SqliteStoreOptions::mq_consume_record()};
    ASSERT_EQ(
        idem::ClaimStatus::kClaimed,
        mq.begin(idem::Key::make("billing", "m-1"), "", owner, std::chrono::seconds(30)).status);
  }
  EXPECT_EQ(1, idemctl(db_ + "release billing m-1 --owner " + owner.str() + " --yes").status);
  auto r = idemctl(db_ + "--mq release billing m-1 --owner " + owner.str() + " --yes");
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_TRUE(contains(r.out, "released billing|m-1")) << r.out;
  idem::sqlite::SqliteStore mq{path_, idem::sqlite::SqliteStoreOptions::mq_consume_record()};
  EXPECT_FALSE(mq.lookup(idem::Key::make("billing", "m-1")));
  for (const char* cmd : {"release s x --owner o", "duplicates s x", "show s x"}) {
    EXPECT_EQ(2, idemctl(cmd).status) << cmd;  // no store given
  }
}

TEST_F(IdemctlTest, ReleaseRefusesACompletedRecordAndWarnsOfALiveLease) {
  idem::sqlite::SqliteStore store{path_};
  auto owner = store.lookup(idem::Key::make("order.create", "abc"))->owner;
  auto completed = idemctl(db_ + "release order.create abc --owner " + owner + " --yes");
  EXPECT_EQ(4, completed.status) << completed.out;
  EXPECT_TRUE(contains(completed.out, "order.create|abc is completed in sqlite:")) << completed.out;
  EXPECT_TRUE(contains(completed.out, "refusing to release a finished record")) << completed.out;
  EXPECT_EQ(idem::Record::Status::kCompleted, status_of("order.create", "abc"));

  auto live = idemctl(db_ + "release payment running --owner " + running_owner_.str() + " --yes");
  EXPECT_EQ(0, live.status) << live.out;
  EXPECT_TRUE(contains(live.out, "(live)")) << live.out;
  EXPECT_TRUE(contains(live.out, "warning: the lease in sqlite:" + path_ + " is live until"))
      << live.out;
  EXPECT_TRUE(contains(live.out, "released payment|running")) << live.out;
  EXPECT_FALSE(store.lookup(idem::Key::make("payment", "running")));
}

TEST_F(IdemctlTest, DuplicatesCountsTakeoversAndSaysWhatIsNotRecorded) {
  {
    // Three attempts hold order.create|taken: two take over an expired lease.
    idem::ManualClock clock{idem::system_now()};
    idem::sqlite::SqliteStoreOptions o;
    o.clock = clock.as_clock();
    idem::sqlite::SqliteStore store{path_, o};
    auto key = idem::Key::make("order.create", "taken");
    idem::OwnerToken last = idem::OwnerToken::generate();
    for (int i = 0; i < 3; ++i) {
      last = idem::OwnerToken::generate();
      auto c = store.begin(key, "fp", last, std::chrono::seconds(1));
      ASSERT_EQ(idem::ClaimStatus::kClaimed, c.status);
      EXPECT_EQ(i > 0, c.took_over);
      clock.advance(std::chrono::seconds(2));
    }
    ASSERT_TRUE(store.complete(key, last, "done", std::chrono::hours(1)));
  }
  auto one = idemctl(db_ + "duplicates order.create taken");
  EXPECT_EQ(0, one.status) << one.out;
  EXPECT_TRUE(contains(one.out, "attempts     3\n")) << one.out;
  EXPECT_TRUE(contains(one.out, "takeovers    2\n")) << one.out;
  EXPECT_TRUE(contains(one.out, "replays      not recorded\n")) << one.out;
  auto plain = idemctl(db_ + "duplicates order.create abc");
  EXPECT_TRUE(contains(plain.out, "takeovers    0\n")) << plain.out;
  EXPECT_EQ(1, idemctl(db_ + "duplicates order.create nothing").status);

  auto top = idemctl(db_ + "duplicates --top 5");
  EXPECT_EQ(0, top.status) << top.out;
  EXPECT_TRUE(contains(top.out,
                       "attempts  takeovers  key\n3         2          order.create|taken\n"
                       "1 record held by more than one attempt\n"))
      << top.out;
  EXPECT_TRUE(contains(top.out, "\nreplays: not recorded per key by sqlite:" + path_ +
                                    "; count them with idemctl duplicates --log FILE\n"))
      << top.out;
  auto first = idemctl(db_ + "duplicates --top 1");
  EXPECT_TRUE(contains(first.out, "1 record held by more than one attempt (the first 1)\n"))
      << first.out;
  EXPECT_EQ(2, idemctl(db_ + "duplicates --top 0").status);
  EXPECT_EQ(2, idemctl(db_ + "duplicates --top x").status);
  EXPECT_EQ(2, idemctl(db_ + "duplicates --bogus").status);
}

TEST_F(IdemctlTest, DuplicatesCountsTheLogLinesPerKey) {
  // The service's LoggingObserver, its lines behind a sink's own prefix, into a file.
  std::string log_path = dir_.file("service.log");
  {
    std::ofstream log{log_path};
    log << "2026-12-01 10:00:00 info service started\n";
    auto sink = [&](idem::LogLevel, std::string_view line) {
      log << "2026-12-01 10:00:01 [info] " << line << "\n";
    };
    idem::GuardOptions go;
    go.observer = std::make_shared<idem::LoggingObserver>(sink);
    idem::sqlite::SqliteStore store{path_};
    idem::IdempotencyGuard guard{store, go};
    auto handler = [](idem::sqlite::Transaction&) { return std::string("ok"); };
    for (int i = 0; i < 4; ++i) (void)guard.run(idem::Key::make("order.create", "a"), "f", handler);
    (void)guard.run(idem::Key::make("order.create", "a"), "other", handler);  // mismatch
    for (int i = 0; i < 3; ++i) (void)guard.run(idem::Key::make("payment", "b"), "", handler);
    (void)guard.run(idem::Key::make("payment", "c"), "", handler);  // no duplicate
  }
  auto r = idemctl(db_ + "duplicates --log " + quote(log_path));
  EXPECT_EQ(0, r.status) << r.out;
  EXPECT_EQ(
      "duplicates  replayed  in_progress  mismatch  key\n"
      "4           3         0            1         order.create|a\n"
      "2           2         0            0         payment|b\n"
      "2 keys with duplicates in " +
          log_path + "\n",
      r.out);
  auto top = idemctl("duplicates --log - --top 1 < " + quote(log_path));
  EXPECT_EQ(0, top.status) << top.out;
  EXPECT_TRUE(contains(top.out, "order.create|a\n2 keys")) << top.out;
  EXPECT_FALSE(contains(top.out, "payment|b")) << top.out;
  EXPECT_EQ(3, idemctl("duplicates --log " + quote(dir_.file("none.log"))).status);
}

TEST(IdemctlLog, ReadsQuotedFields) {
  std::istringstream in(
      "x idem duplicate key=\"s|a b\\x22\\\\\" source=fast_store outcome=in_progress owner=o\n"
      "idem duplicate key=s|plain source=unique_index outcome=replayed\n"
      "idem duplicate key=\"unterminated outcome=replayed\n"
      // Cut or interleaved lines: an escape without its two hex digits is skipped, not fatal.
      "idem duplicate key=\"payment|ab\\x]1c\" outcome=replayed\n"
      "idem duplicate key=\"payment|ab\\x4\" outcome=replayed\n"
      "idem lease takeover key=s|plain store=fast\n");
  auto counts = idemctl::count_duplicate_lines(in);
  ASSERT_EQ(2u, counts.size());
  EXPECT_EQ(1, counts["s|a b\"\\"].in_progress);
  EXPECT_EQ(1, counts["s|plain"].replayed);
  EXPECT_EQ(1, counts["s|plain"].total);
}

TEST(IdemctlKey, PrintsTheScopedHttpKey) {
  auto r = idemctl(
      "key --scope http.orders.create --principal alice --method POST "
      "--route /orders --key abc");
  EXPECT_EQ(0, r.status) << r.out;
  auto k = idem::http::scoped_key("http.orders.create", "alice", "POST", "/orders", "abc");
  EXPECT_EQ(k.scope() + " " + k.id() + "\n", r.out);
  EXPECT_EQ(2, idemctl("key --scope s").status);
}

}  // namespace
