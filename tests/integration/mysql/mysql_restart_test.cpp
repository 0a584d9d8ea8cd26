// SPDX-License-Identifier: MIT
// MariaDB killed (kill -9, InnoDB crash recovery on restart) under guarded payments, and at
// COMMIT; a server whose time zone is not UTC; a server out of prepared statements; sessions
// that start without autocommit; a max_allowed_packet lowered under a running store. Runs alone
// (RUN_SERIAL): it kills the shared server and changes global settings.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "idem/guard.hpp"
#include "idem/memory_store.hpp"
#include "mysql_test_support.hpp"

namespace {

namespace my = idem::test::my;
using idem::Outcome;
using idem::mysql::MysqlStore;
using idem::mysql::Transaction;

void servers(const std::string& script, const std::string& command) {
  const std::string cmd = script + " " + command + " >/dev/null 2>&1";
  ASSERT_EQ(0, std::system(cmd.c_str())) << cmd;
}

long effects(const std::string& id) { return my::count_where("idem_test_effects", "key_id", id); }

// kill -9 of mysqld while four threads pay: calls fail typed and retryable while it is down,
// succeed once it is back (InnoDB rolled back what was open), and no key runs twice.
TEST(MysqlRestart, KillNineUnderLoadLosesNothingAndDoublesNothing) {
  IDEM_REQUIRE_MYSQL();
  std::string script;
  IDEM_REQUIRE_ENV(script, "IDEM_SERVERS_SCRIPT");
  (void)my::Database::name();
  auto o = my::options();
  o.pool_size = 8;
  o.pool_wait = std::chrono::milliseconds(2000);
  MysqlStore store(o);
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, store};
  constexpr int kThreads = 4;
  std::atomic<bool> restarted{false};
  std::atomic<int> failures{0}, untyped{0};
  std::mutex m;
  std::map<std::string, int> kinds;
  std::vector<std::string> keys[kThreads];
  auto worker = [&](int t) {
    int after = 0;
    for (int i = 0; !restarted.load() || after < 15; ++i) {
      if (restarted.load()) ++after;
      auto key = idem::Key::make("payment", idem::test::unique_name("kill_t" + std::to_string(t)));
      keys[t].push_back(key.id());
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      for (;;) {
        ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no success for " << key.id();
        try {
          auto r = guard.run(key, "", [&](Transaction& tx) {
            my::insert_effect(tx, key.id());
            return std::string("paid");
          });
          if (r.ok()) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(50));  // in progress: retry
        } catch (const idem::Error& e) {
          ++failures;
          EXPECT_TRUE(e.retryable()) << e.what();
          std::lock_guard<std::mutex> lock(m);
          ++kinds[std::string(idem::errc_name(e.code()))];
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        } catch (const std::exception& e) {
          ++untyped;
          ADD_FAILURE() << "untyped: " << e.what();
          return;
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  servers(script, "mysql-kill");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  servers(script, "mysql-start");
  restarted = true;
  for (auto& th : threads) th.join();
  EXPECT_EQ(0, untyped.load());
  EXPECT_GT(failures.load(), 0) << "the kill was not seen";
  for (const auto& list : keys) {
    for (const auto& id : list) EXPECT_EQ(1, effects(id)) << id;
  }
  for (const auto& [kind, n] : kinds) std::printf("  %s: %d\n", kind.c_str(), n);
}

// The server dies between the handler and COMMIT: the commit cannot be resolved while it is
// down (OutcomeUnknown, retryable); after the restart the retry of the same key runs once
// (crash recovery rolled the transaction back).
TEST(MysqlRestart, ServerDownAtCommitIsOutcomeUnknownResolvedByTheRetry) {
  IDEM_REQUIRE_MYSQL();
  std::string script;
  IDEM_REQUIRE_ENV(script, "IDEM_SERVERS_SCRIPT");
  (void)my::Database::name();
  auto o = my::options();
  bool kill = true;
  o.before_commit = [&](Transaction&) {
    if (kill) servers(script, "mysql-kill");
  };
  MysqlStore store(o);
  idem::IdempotencyGuard guard{store};
  auto key = idem::Key::make("payment", idem::test::unique_name("commit_kill"));
  EXPECT_THROW((void)guard.run(key, "",
                               [&](Transaction& tx) {
                                 my::insert_effect(tx, key.id());
                                 return std::string("paid");
                               }),
               idem::OutcomeUnknown);
  EXPECT_EQ(1u, store.stats().commits_unknown);
  kill = false;
  servers(script, "mysql-start");
  auto r = guard.run(key, "", [&](Transaction& tx) {
    my::insert_effect(tx, key.id());
    return std::string("paid");
  });
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  EXPECT_EQ(1, effects(key.id()));
  auto again = guard.run(key, "", [&](Transaction&) { return std::string("never"); });
  EXPECT_EQ(Outcome::kReplayed, again.outcome);
  EXPECT_EQ("paid", again.value.value_or(""));
}

// datetime has no time zone: idem writes UTC whatever the server's time_zone is, and leases
// are judged on the same clock.
TEST(MysqlRestart, TimesAreUtcWhateverTheServerTimeZone) {
  IDEM_REQUIRE_MYSQL();
  (void)my::Database::name();
  my::RawConnection admin(my::connection());
  admin.query("SET GLOBAL time_zone = '+05:00'");
  struct Restore {
    ~Restore() {
      try {
        my::RawConnection(my::connection()).query("SET GLOBAL time_zone = SYSTEM");
      } catch (...) {
      }
    }
  } restore;
  MysqlStore store(my::options());  // new sessions: time_zone +05:00
  idem::IdempotencyGuard guard{store};
  auto key = idem::Key::make("payment", idem::test::unique_name("utc"));
  (void)guard.run(key, "", [&](Transaction& tx) {
    EXPECT_EQ("+05:00", tx.query_text("SELECT @@session.time_zone").value_or(""));
    return std::string("paid");
  });
  my::RawConnection utc(my::connection());
  utc.query("SET time_zone = '+00:00'");
  const long skew = utc.scalar(
      "SELECT ABS(TIMESTAMPDIFF(SECOND, created_at, UTC_TIMESTAMP())) FROM api_idempotency"
      " WHERE idem_key = " +
      utc.quote(key.id()));
  EXPECT_LE(skew, 5);
  auto rec = store.lookup(key);
  ASSERT_TRUE(rec.has_value());
  const auto now = idem::system_now();
  EXPECT_LE(std::abs((now - rec->created_at).count()), 5000);
  // A two-phase lease of 30 s is not taken for over in a +05:00 session.
  auto k2 = idem::Key::make("payment", idem::test::unique_name("utc_lease"));
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            store.begin(k2, "", idem::OwnerToken::generate(), std::chrono::seconds(30)).status);
  EXPECT_EQ(idem::ClaimStatus::kBusy,
            store.begin(k2, "", idem::OwnerToken::generate(), std::chrono::seconds(30)).status);
}

// The server's max_prepared_stmt_count is shared by every client: reached (here: lowered to
// what is prepared already), a connection makes room by closing its least recently used
// statements, and one with nothing to close fails retryable (StorageUnavailable), not with an
// untyped error.
TEST(MysqlRestart, AServerOutOfPreparedStatementsIsSurvivedOrRetryable) {
  IDEM_REQUIRE_MYSQL();
  (void)my::Database::name();
  my::RawConnection admin(my::connection());
  const long before = admin.scalar("SELECT @@GLOBAL.max_prepared_stmt_count");
  struct Restore {
    long value;
    ~Restore() {
      try {
        my::RawConnection(my::connection())
            .query("SET GLOBAL max_prepared_stmt_count = " + std::to_string(value));
      } catch (...) {
      }
    }
  } restore{before};
  auto o = my::options();
  o.pool_size = 1;
  MysqlStore store(o);
  auto select = [&](int n) {
    return store.with_session([&](idem::mysql::Session& s) {
      return s.query_int64("SELECT ?1 + " + std::to_string(n), 1).value_or(-1);
    });
  };
  for (int n = 0; n < 8; ++n) ASSERT_EQ(1 + n, select(n));
  // No room left: the limit lowered to what the server holds prepared.
  auto no_room = [&] {
    const long prepared = admin.scalar(
        "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS"
        " WHERE VARIABLE_NAME = 'PREPARED_STMT_COUNT'");
    admin.query("SET GLOBAL max_prepared_stmt_count = " + std::to_string(prepared));
    return prepared;
  };
  ASSERT_GE(no_room(), 8);
  // A statement never prepared before: room is made, it runs, and so does a guarded call.
  EXPECT_EQ(101, select(100));
  idem::IdempotencyGuard guard{store};
  auto k = idem::Key::make("payment", idem::test::unique_name("stmts"));
  EXPECT_EQ(idem::Outcome::kExecuted,
            guard.run(k, "", [](Transaction&) { return std::string("paid"); }).outcome);
  // A connection with no statement of its own to close cannot make room.
  auto plain = my::options();
  plain.pool_size = 1;
  plain.migrate = false;
  MysqlStore fresh(plain);
  no_room();
  try {
    (void)fresh.lookup(k);
    ADD_FAILURE() << "prepared a statement past max_prepared_stmt_count";
  } catch (const idem::StorageUnavailable& e) {
    EXPECT_TRUE(e.retryable());
    EXPECT_NE(std::string::npos, std::string(e.what()).find("max_prepared_stmt_count")) << e.what();
  }
}

// A server whose sessions start with autocommit off (`SET GLOBAL autocommit = 0`, or an
// init_connect that sets it, as some payment DBAs configure): the store's single-statement
// writes still commit. Before, the pool took such connections for autocommit ones, so a
// two-phase claim and its completion stayed uncommitted on their connection: another store saw
// no record, and every call ran the handler again.
TEST(MysqlRestart, SessionsStartingWithoutAutocommitStillCommitEveryWrite) {
  IDEM_REQUIRE_MYSQL();
  (void)my::Database::name();
  my::RawConnection admin(my::connection());
  admin.query("SET GLOBAL autocommit = 0");
  struct Restore {
    ~Restore() {
      try {
        my::RawConnection(my::connection()).query("SET GLOBAL autocommit = 1");
      } catch (...) {
      }
    }
  } restore;
  ASSERT_EQ(0, my::RawConnection(my::connection()).scalar("SELECT @@session.autocommit"))
      << "new sessions start with autocommit off";
  MysqlStore a(my::options());
  MysqlStore b(my::options());
  EXPECT_EQ(1, a.with_session([](idem::mysql::Session& s) {
    return s.query_int64("SELECT @@session.autocommit").value_or(-1);
  })) << "a session lent for single statements commits each";
  idem::IdempotencyGuard first{a};
  idem::IdempotencyGuard second{b};
  auto key = idem::Key::make("payment", idem::test::unique_name("ac0"));
  int charges = 0;
  auto charge = [&] {
    ++charges;  // an external call: two-phase
    return std::string("charged");
  };
  EXPECT_EQ(Outcome::kExecuted, first.run(key, "fp", charge).outcome);
  auto again = second.run(key, "fp", charge);
  EXPECT_EQ(Outcome::kReplayed, again.outcome);
  EXPECT_EQ("charged", again.value.value_or(""));
  EXPECT_EQ(Outcome::kReplayed, first.run(key, "fp", charge).outcome);
  EXPECT_EQ(1, charges);
  // A claim is seen at once by another store (its pool, its connections).
  auto held = idem::Key::make("payment", idem::test::unique_name("ac0_held"));
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            a.begin(held, "fp", idem::OwnerToken::generate(), std::chrono::seconds(30)).status);
  auto seen = b.lookup(held);
  ASSERT_TRUE(seen.has_value());
  EXPECT_EQ(idem::Record::Status::kInProgress, seen->status);
  EXPECT_EQ(idem::ClaimStatus::kBusy,
            b.begin(held, "fp", idem::OwnerToken::generate(), std::chrono::seconds(30)).status);
}

// A global max_allowed_packet lowered while a store runs reaches the store's new connections
// (the session value is read at each connect): a response over the new limit is refused before
// anything is written (transactional) or marks the record unstored after the handler's one run
// (two-phase), as the documented limit does. Before, the limit was read once per store: the
// response went to the server, which dropped the connection, and every retry (a retryable
// "server has gone away") ran the handler again.
TEST(MysqlRestart, AMaxAllowedPacketLoweredReachesTheStoresNewConnections) {
  IDEM_REQUIRE_MYSQL();
  (void)my::Database::name();
  my::RawConnection admin(my::connection());
  const long before = admin.scalar("SELECT @@GLOBAL.max_allowed_packet");
  struct Restore {
    long value;
    ~Restore() {
      try {
        my::RawConnection(my::connection())
            .query("SET GLOBAL max_allowed_packet = " + std::to_string(value));
      } catch (...) {
      }
    }
  } restore{before};
  auto o = my::options();
  o.pool_size = 1;
  MysqlStore store(o);
  const std::uint64_t was = store.max_response_bytes();
  constexpr long kLowered = 4L * 1024 * 1024;
  ASSERT_GT(was, static_cast<std::uint64_t>(kLowered));
  admin.query("SET GLOBAL max_allowed_packet = " + std::to_string(kLowered));
  // The store's connection ends (a restart, a failover, wait_timeout): its next one reads the
  // lowered value.
  const long id = static_cast<long>(store.with_session(
      [](idem::mysql::Session& s) { return s.query_int64("SELECT CONNECTION_ID()").value_or(0); }));
  ASSERT_GT(id, 0);
  admin.query("KILL CONNECTION " + std::to_string(id));
  // The next statement finds the connection gone (an idempotent read tries again on a new one).
  for (int attempt = 0; attempt < 5; ++attempt) {
    try {
      (void)store.lookup(idem::Key::make("payment", "any"));
      break;
    } catch (const idem::StorageUnavailable&) {
    }
  }
  const std::uint64_t now_max = store.max_response_bytes();
  EXPECT_LE(now_max, static_cast<std::uint64_t>(kLowered));
  EXPECT_GT(now_max, static_cast<std::uint64_t>(kLowered) / 2);

  const std::string large(static_cast<std::size_t>(kLowered) + 1024 * 1024, 'r');
  idem::IdempotencyGuard guard{store};
  auto tx_key = idem::Key::make("payment", idem::test::unique_name("packet_tx"));
  int tx_runs = 0;
  EXPECT_THROW((void)guard.run(tx_key, "fp",
                               [&](Transaction& tx) {
                                 ++tx_runs;
                                 my::insert_effect(tx, tx_key.id());
                                 return large;
                               }),
               idem::UsageError);
  EXPECT_EQ(0, effects(tx_key.id()));
  auto two_key = idem::Key::make("payment", idem::test::unique_name("packet_2p"));
  int charges = 0;
  auto charge = [&] {
    ++charges;
    return large;
  };
  for (int call = 0; call < 3; ++call) {
    try {
      (void)guard.run(two_key, "fp", charge);
      ADD_FAILURE() << "a response over max_allowed_packet was stored";
    } catch (const idem::StorageError& e) {
      EXPECT_FALSE(e.retryable()) << e.what();
    } catch (const idem::UsageError&) {
      EXPECT_EQ(0, call) << "only the first call, whose handler ran, hears the limit";
    }
  }
  EXPECT_EQ(1, charges) << "the handler ran again after its response was refused";
}

}  // namespace
