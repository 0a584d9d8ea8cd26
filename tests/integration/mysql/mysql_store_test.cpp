// SPDX-License-Identifier: MIT
// MysqlStore on MariaDB: MySQL's own traps, each on the real server — 1062 is a duplicate,
// never an error; REPEATABLE READ's gap / next-key locks (a duplicate racing a takeover, two
// handlers deadlocking) end in retries or typed errors; what goes over the wire (no RETURNING,
// no ON DUPLICATE KEY UPDATE, no BEGIN); a connection lost at COMMIT; utf8mb4 and
// binary-safe bodies; an oversize response refused before anything is written; bad
// configuration typed and non-retryable; adopting the seed table.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../postgres/tcp_proxy.hpp"
#include "idem/guard.hpp"
#include "idem/memory_store.hpp"
#include "mysql_test_support.hpp"

namespace {

namespace my = idem::test::my;
using idem::ClaimStatus;
using idem::Outcome;
using idem::mysql::MysqlStore;
using idem::mysql::Transaction;

idem::Key key(const std::string& prefix = "k") {
  return idem::Key::make("payment", idem::test::unique_name(prefix));
}

long effects(const idem::Key& k) { return my::count_where("idem_test_effects", "key_id", k.id()); }

// effects(k) once it reads `n`, or what it reads after `timeout`: a COMMIT whose connection was
// cut right after the server received it is applied by the server on its own time, after the
// client already saw the connection go.
long effects_once(const idem::Key& k, long n,
                  std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  long seen = effects(k);
  while (seen != n && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    seen = effects(k);
  }
  return seen;
}

// The caller's retry of `k` after a failure (a guard call that inserts the effect): it runs
// the handler, and the key ends with exactly one effect.
void expect_the_retry_executes_once(MysqlStore& store, const idem::Key& k) {
  idem::IdempotencyGuard guard{store};
  auto retry = guard.run(k, "fp", [&](Transaction& tx) {
    my::insert_effect(tx, k.id());
    return std::string("paid");
  });
  EXPECT_EQ(Outcome::kExecuted, retry.outcome);
  EXPECT_EQ(1, effects(k));
}

class MysqlStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { IDEM_REQUIRE_MYSQL(); }
};

// Durable-only guard, 32 threads, one key: the duplicates reach MySQL and hit 1062 (or wait on
// the uncommitted row); none is an error.
TEST_F(MysqlStoreTest, DuplicateKeyIsAnAnswerNeverAnError) {
  MysqlStore store{my::options()};
  idem::IdempotencyGuard guard{store};
  auto k = key("dup");
  std::atomic<int> runs{0}, executed{0}, other{0}, errors{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&] {
      while (!go.load()) std::this_thread::yield();
      try {
        auto r = guard.run(k, "fp", [&](Transaction& tx) {
          ++runs;
          my::insert_effect(tx, k.id());
          std::this_thread::sleep_for(std::chrono::milliseconds(30));
          return std::string("paid");
        });
        (r.outcome == Outcome::kExecuted ? executed : other).fetch_add(1);
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        ++errors;
      }
    });
  }
  go = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(0, errors.load());
  EXPECT_EQ(1, runs.load());
  EXPECT_EQ(1, executed.load());
  EXPECT_EQ(31, other.load());
  EXPECT_EQ(1, effects(k));
}

// A crashed two-phase attempt left an expired lease; 32 transactional duplicates race to take
// it over. Under REPEATABLE READ their failed INSERTs hold shared next-key locks on the row and
// the takeovers' UPDATEs want exclusive ones: InnoDB resolves that with deadlocks (1213),
// which the store retries. Exactly one runs the handler; nobody sees an untyped error.
TEST_F(MysqlStoreTest, DuplicatesRacingATakeoverNeverSeeAnUntypedError) {
  for (int round = 0; round < 3; ++round) {
    MysqlStore store{my::options()};
    auto k = key("takeover");
    ASSERT_EQ(
        ClaimStatus::kClaimed,
        store.begin(k, "fp", idem::OwnerToken::generate(), std::chrono::milliseconds(100)).status);
    std::this_thread::sleep_for(std::chrono::milliseconds(250));  // the owner "crashed"
    idem::IdempotencyGuard guard{store};
    std::atomic<int> runs{0}, executed{0}, typed{0}, untyped{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> threads;
    for (int i = 0; i < 32; ++i) {
      threads.emplace_back([&, i] {
        while (!go.load()) std::this_thread::yield();
        try {
          idem::GuardResult<std::string> r;
          if (i % 4 == 0) {
            r = guard.run(k, "fp", [&] {  // two-phase takers too
              ++runs;
              return std::string("paid");
            });
          } else {
            r = guard.run(k, "fp", [&](Transaction& tx) {
              ++runs;
              my::insert_effect(tx, k.id());
              return std::string("paid");
            });
          }
          if (r.outcome == Outcome::kExecuted) ++executed;
        } catch (const idem::Error& e) {
          ++typed;  // allowed only as a retryable, typed answer
          EXPECT_TRUE(e.retryable()) << e.what();
        } catch (const std::exception& e) {
          ADD_FAILURE() << "untyped: " << e.what();
          ++untyped;
        }
      });
    }
    go = true;
    for (auto& t : threads) t.join();
    EXPECT_EQ(0, untyped.load());
    EXPECT_EQ(1, runs.load());
    EXPECT_EQ(1, executed.load());
    EXPECT_LE(effects(k), 1);
    auto rec = store.lookup(k);
    ASSERT_TRUE(rec.has_value());
    EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
  }
}

// Two handlers lock two rows in opposite order: InnoDB kills one with 1213 and rolls it back;
// the store re-runs that transaction, so both calls succeed and each effect exists once.
TEST_F(MysqlStoreTest, DeadlockInHandlersIsRetried) {
  const std::string rows = idem::test::unique_name("locks");
  my::raw().query("CREATE TABLE " + rows + " (id int PRIMARY KEY, n int NOT NULL) ENGINE=InnoDB");
  my::raw().query("INSERT INTO " + rows + " VALUES (1, 0), (2, 0)");
  auto o = my::options();
  std::atomic<int> retries_seen{0};
  o.on_retry = [&](const idem::Key&, unsigned n) {
    if (n == 1213) ++retries_seen;
  };
  MysqlStore store{o};
  idem::IdempotencyGuard guard{store};
  auto ka = key("dla"), kb = key("dlb");
  std::atomic<int> runs{0};
  auto handler = [&](const idem::Key& k, int first, int second) {
    return [&, first, second](Transaction& tx) {
      ++runs;
      tx.exec("UPDATE " + rows + " SET n = n + 1 WHERE id = ?", first);
      std::this_thread::sleep_for(std::chrono::milliseconds(150));
      tx.exec("UPDATE " + rows + " SET n = n + 1 WHERE id = ?", second);
      my::insert_effect(tx, k.id());
      return std::string("ok");
    };
  };
  idem::GuardResult<std::string> ra, rb;
  std::thread a([&] { ra = guard.run(ka, "", handler(ka, 1, 2)); });
  std::thread b([&] { rb = guard.run(kb, "", handler(kb, 2, 1)); });
  a.join();
  b.join();
  EXPECT_EQ(Outcome::kExecuted, ra.outcome);
  EXPECT_EQ(Outcome::kExecuted, rb.outcome);
  EXPECT_GE(retries_seen.load(), 1);
  EXPECT_GE(store.stats().retries, 1u);
  EXPECT_EQ(3, runs.load());  // the victim ran twice, its first run rolled back
  EXPECT_EQ(1, effects(ka));
  EXPECT_EQ(1, effects(kb));
  EXPECT_EQ(4, my::raw().scalar("SELECT SUM(n) FROM " + rows));
  my::raw().query("DROP TABLE " + rows);
}

// Retries spent: a deadlock is StorageUnavailable, a lock wait timeout StorageTimeout, both
// keeping the server's error number; nothing of the failed call is committed.
TEST_F(MysqlStoreTest, LockConflictsAfterTheRetriesAreTyped) {
  const std::string rows = idem::test::unique_name("locks");
  my::raw().query("CREATE TABLE " + rows + " (id int PRIMARY KEY, n int NOT NULL) ENGINE=InnoDB");
  my::raw().query("INSERT INTO " + rows + " VALUES (1, 0), (2, 0)");
  auto o = my::options();
  o.max_retries = 1;
  o.lock_wait_timeout = std::chrono::seconds(1);
  MysqlStore store{o};
  idem::IdempotencyGuard guard{store};

  // 1205: another session holds the business row for longer than every attempt waits.
  my::RawConnection holder(my::connection());
  holder.query("START TRANSACTION; SELECT * FROM " + rows + " WHERE id = 1 FOR UPDATE");
  auto k = key("lwt");
  int runs = 0;
  try {
    (void)guard.run(k, "", [&](Transaction& tx) {
      ++runs;
      my::insert_effect(tx, k.id());
      tx.exec("UPDATE " + rows + " SET n = n + 1 WHERE id = 1");
      return std::string("never");
    });
    ADD_FAILURE() << "no error";
  } catch (const idem::StorageTimeout& e) {
    auto* info = dynamic_cast<const idem::mysql::ServerError*>(&e);
    ASSERT_NE(nullptr, info);
    EXPECT_EQ(1205u, info->error_number());
    EXPECT_TRUE(e.retryable());
  }
  holder.query("ROLLBACK");
  EXPECT_EQ(2, runs);  // once, plus max_retries
  EXPECT_EQ(0, effects(k));
  EXPECT_FALSE(store.lookup(k).has_value());
  // Nothing is stuck: the retry of the same key runs now.
  EXPECT_EQ(Outcome::kExecuted, guard
                                    .run(k, "",
                                         [&](Transaction& tx) {
                                           my::insert_effect(tx, k.id());
                                           return std::string("ok");
                                         })
                                    .outcome);
  EXPECT_EQ(1, effects(k));

  // 1213 with no retries left: the victim gets StorageUnavailable(1213), the other succeeds.
  auto o0 = my::options();
  o0.max_retries = 0;
  MysqlStore no_retry{o0};
  idem::IdempotencyGuard g0{no_retry};
  std::atomic<int> unavailable{0}, ok{0};
  auto run = [&](int first, int second) {
    auto kk = key("dl0");
    try {
      (void)g0.run(kk, "", [&](Transaction& tx) {
        tx.exec("UPDATE " + rows + " SET n = n + 1 WHERE id = ?", first);
        std::this_thread::sleep_for(std::chrono::milliseconds(150));
        tx.exec("UPDATE " + rows + " SET n = n + 1 WHERE id = ?", second);
        return std::string("ok");
      });
      ++ok;
    } catch (const idem::StorageUnavailable& e) {
      auto* info = dynamic_cast<const idem::mysql::ServerError*>(&e);
      EXPECT_TRUE(info != nullptr && info->error_number() == 1213u) << e.what();
      EXPECT_FALSE(no_retry.lookup(kk).has_value());  // rolled back with the record
      ++unavailable;
    }
  };
  std::thread a([&] { run(1, 2); });
  std::thread b([&] { run(2, 1); });
  a.join();
  b.join();
  EXPECT_EQ(1, ok.load());
  EXPECT_EQ(1, unavailable.load());
  my::raw().query("DROP TABLE " + rows);
}

// MariaDB 11.6.2+ (innodb_snapshot_isolation, its default under REPEATABLE READ) answers a
// locking read or write of a row changed after the transaction's snapshot with 1020 and rolls
// the transaction back. The test server (10.11) has no such conflicts: the handler raises the
// error number with SIGNAL. It is re-run like a deadlock; when it persists, StorageUnavailable
// with the number, nothing committed.
TEST_F(MysqlStoreTest, SnapshotConflictsAreReRunLikeDeadlocks) {
  auto o = my::options();
  std::vector<unsigned> seen;
  o.on_retry = [&](const idem::Key&, unsigned n) { seen.push_back(n); };
  MysqlStore store{o};
  idem::IdempotencyGuard guard{store};
  const std::string conflict =
      "SIGNAL SQLSTATE 'HY000' SET MYSQL_ERRNO = 1020,"
      " MESSAGE_TEXT = 'Record has changed since last read in table ''t'''";
  auto k = key("snapshot");
  int runs = 0;
  auto r = guard.run(k, "", [&](Transaction& tx) {
    ++runs;
    my::insert_effect(tx, k.id());
    if (runs == 1) tx.exec_text(conflict);
    return std::string("ok");
  });
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  EXPECT_EQ(2, runs);
  EXPECT_EQ(1, effects(k));
  EXPECT_EQ(std::vector<unsigned>{1020}, seen);

  auto k2 = key("snapshot_stays");
  int runs2 = 0;
  try {
    (void)guard.run(k2, "", [&](Transaction& tx) {
      ++runs2;
      my::insert_effect(tx, k2.id());
      tx.exec_text(conflict);
      return std::string("never");
    });
    ADD_FAILURE() << "a conflict on every run succeeded";
  } catch (const idem::StorageUnavailable& e) {
    EXPECT_TRUE(e.retryable());
    EXPECT_EQ(1020u, dynamic_cast<const idem::mysql::ServerError&>(e).error_number());
  }
  EXPECT_EQ(1 + static_cast<int>(o.max_retries), runs2);
  EXPECT_EQ(0, effects(k2));
  EXPECT_FALSE(store.lookup(k2).has_value());
}

// A handler that swallows the deadlock error cannot go on outside the rolled-back
// transaction: its next statement throws without being sent, and the store re-runs it.
TEST_F(MysqlStoreTest, HandlerCannotContinueAfterTheServerRolledBack) {
  const std::string rows = idem::test::unique_name("locks");
  my::raw().query("CREATE TABLE " + rows + " (id int PRIMARY KEY, n int NOT NULL) ENGINE=InnoDB");
  my::raw().query("INSERT INTO " + rows + " VALUES (1, 0), (2, 0)");
  MysqlStore store{my::options()};
  idem::IdempotencyGuard guard{store};
  std::atomic<int> swallowed{0}, closed{0};
  auto run = [&](const idem::Key& k, int first, int second) {
    return guard.run(k, "", [&, first, second](Transaction& tx) {
      tx.exec("UPDATE " + rows + " SET n = n + 1 WHERE id = ?", first);
      std::this_thread::sleep_for(std::chrono::milliseconds(150));
      try {
        tx.exec("UPDATE " + rows + " SET n = n + 1 WHERE id = ?", second);
      } catch (const idem::StorageError&) {
        ++swallowed;  // the handler ignores the deadlock ...
        if (!tx.open()) ++closed;
      }
      my::insert_effect(tx, k.id());  // ... and this must not run outside the transaction
      return std::string("ok");
    });
  };
  auto ka = key("sw"), kb = key("sw");
  std::thread a([&] { EXPECT_EQ(Outcome::kExecuted, run(ka, 1, 2).outcome); });
  std::thread b([&] { EXPECT_EQ(Outcome::kExecuted, run(kb, 2, 1).outcome); });
  a.join();
  b.join();
  EXPECT_EQ(1, swallowed.load());
  EXPECT_EQ(1, closed.load());
  EXPECT_EQ(1, effects(ka));
  EXPECT_EQ(1, effects(kb));
  EXPECT_EQ(4, my::raw().scalar("SELECT SUM(n) FROM " + rows));
  // DDL ends a transaction implicitly: refused as a usage error.
  EXPECT_THROW((void)guard.run(key("ddl"), "",
                               [&](Transaction& tx) {
                                 tx.exec_text("CREATE TABLE IF NOT EXISTS " + rows + "_x (a int)");
                                 return std::string("x");
                               }),
               idem::UsageError);
  my::raw().query("DROP TABLE " + rows);
  my::raw().query("DROP TABLE IF EXISTS " + rows + "_x");
}

// What goes over the wire, from the server's general log: no RETURNING, no ON DUPLICATE KEY
// UPDATE, no BEGIN; a first execution is claim, business statement, completion, COMMIT.
TEST_F(MysqlStoreTest, StatementsOnTheWire) {
  auto o = my::options();
  // Two sessions, one per autocommit mode (transactions, single statements), whose log lines
  // are read below.
  o.pool_size = 2;
  MysqlStore store{o};
  const long long reads = store.with_session(
      [](idem::mysql::Session& s) { return s.query_int64("SELECT CONNECTION_ID()").value(); });
  const long long writes = store.with_transaction(
      [](Transaction& tx) { return tx.query_int64("SELECT CONNECTION_ID()").value(); });
  ASSERT_NE(reads, writes);
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, store};
  idem::IdempotencyGuard durable_only{store};
  auto k = key("wire");
  my::GeneralLog log;
  auto r = guard.run(k, "fp", [&](Transaction& tx) {
    my::insert_effect(tx, k.id());
    return std::string("paid");
  });
  auto dup = durable_only.run(k, "fp", [&](Transaction&) { return std::string("never"); });
  log.stop();
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  EXPECT_EQ(Outcome::kReplayed, dup.outcome);
  auto lines = my::raw().query(
      "SELECT command_type, CONVERT(argument USING utf8mb4) FROM mysql.general_log WHERE "
      "thread_id IN (" +
      std::to_string(reads) + ", " + std::to_string(writes) +
      ") AND command_type IN ('Query', 'Execute') ORDER BY event_time");
  std::vector<std::string> sent;
  for (auto& l : lines) sent.push_back(*l[1]);
  ASSERT_EQ(5u, sent.size()) << ::testing::PrintToString(sent);
  EXPECT_EQ(0u, sent[0].find("INSERT INTO `api_idempotency`"));
  EXPECT_EQ(0u, sent[1].find("INSERT INTO idem_test_effects"));
  EXPECT_EQ(0u, sent[2].find("UPDATE `api_idempotency` SET status = 'completed'"));
  // The row the claim inserted is completed by its id (the table's primary key).
  EXPECT_NE(std::string::npos, sent[2].find(" WHERE `id` = ")) << sent[2];
  EXPECT_EQ("COMMIT", sent[3]);
  EXPECT_EQ(0u, sent[4].find("SELECT status"));  // the replay: one read, nothing else
  for (const auto& s : sent) {
    EXPECT_EQ(std::string::npos, s.find("RETURNING")) << s;
    EXPECT_EQ(std::string::npos, s.find("ON DUPLICATE KEY")) << s;
    EXPECT_EQ(std::string::npos, s.find("BEGIN")) << s;
  }
}

// With CallOptions::expected_response (what IdempotentConsumer::consume passes), the claim
// inserts the record completed and no completion UPDATE follows: claim, business statement,
// COMMIT. A handler whose response differs has it written over the record before the COMMIT.
TEST_F(MysqlStoreTest, StatementsOnTheWireWithAnExpectedResponse) {
  auto o = my::options();
  o.pool_size = 1;
  MysqlStore store{o};
  const long long session = store.with_transaction(
      [](Transaction& tx) { return tx.query_int64("SELECT CONNECTION_ID()").value(); });
  idem::IdempotencyGuard guard{store};
  idem::CallOptions call;
  call.likely_new = true;
  call.expected_response = "consumed";
  auto as_expected = key("wire-expected");
  auto differs = key("wire-differs");
  my::GeneralLog log;
  auto r = guard.run(as_expected, "fp", call, [&](Transaction& tx) {
    my::insert_effect(tx, as_expected.id());
    return std::string("consumed");
  });
  auto other = guard.run(differs, "fp", call, [&](Transaction& tx) {
    my::insert_effect(tx, differs.id());
    return std::string("a receipt");
  });
  log.stop();
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  EXPECT_EQ(Outcome::kExecuted, other.outcome);
  auto lines = my::raw().query(
      "SELECT CONVERT(argument USING utf8mb4) FROM mysql.general_log WHERE thread_id = " +
      std::to_string(session) +
      " AND command_type IN ('Query', 'Execute') ORDER BY event_time");
  std::vector<std::string> sent;
  for (auto& l : lines) sent.push_back(*l[0]);
  ASSERT_EQ(7u, sent.size()) << ::testing::PrintToString(sent);
  EXPECT_EQ(0u, sent[0].find("INSERT INTO `api_idempotency`"));
  EXPECT_NE(std::string::npos, sent[0].find("'completed'")) << sent[0];
  EXPECT_EQ(0u, sent[1].find("INSERT INTO idem_test_effects"));
  EXPECT_EQ("COMMIT", sent[2]);
  EXPECT_EQ(0u, sent[3].find("INSERT INTO `api_idempotency`"));
  EXPECT_EQ(0u, sent[4].find("INSERT INTO idem_test_effects"));
  EXPECT_EQ(0u, sent[5].find("UPDATE `api_idempotency` SET response_body")) << sent[5];
  EXPECT_EQ("COMMIT", sent[6]);
  auto a = store.lookup(as_expected);
  auto b = store.lookup(differs);
  ASSERT_TRUE(a.has_value() && b.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, a->status);
  EXPECT_EQ("consumed", a->response);
  EXPECT_EQ(idem::Record::Status::kCompleted, b->status);
  EXPECT_EQ("a receipt", b->response);
  EXPECT_EQ(Outcome::kReplayed,
            guard.run(differs, "fp", call, [](Transaction&) { return std::string("x"); })
                .outcome);
}

// The connection dies right after COMMIT reached the server: the store asks the server (a
// locking read on a fresh connection) and answers from what committed.
TEST_F(MysqlStoreTest, ConnectionLostAtCommitIsResolved) {
  auto base = my::connection();
  idem::test::CommitDroppingProxy proxy(static_cast<int>(base.port));
  auto o = my::options();
  o.connection.port = static_cast<unsigned>(proxy.port());
  o.before_commit = [&](Transaction&) { proxy.drop_next_commit = true; };
  MysqlStore store{o};
  auto k = key("lost");
  int runs = 0;
  auto r = store.run_transactional(k, "fp", idem::OwnerToken::generate(), std::chrono::seconds(600),
                                   [&](Transaction& tx) {
                                     ++runs;
                                     my::insert_effect(tx, k.id());
                                     return std::string("paid");
                                   });
  EXPECT_EQ(1, proxy.dropped.load());
  EXPECT_EQ(idem::TransactionalStatus::kCommitted, r.status);
  EXPECT_EQ("paid", r.response);
  EXPECT_EQ(1u, store.stats().commits_resolved);
  EXPECT_EQ(1, runs);
  EXPECT_EQ(1, effects(k));

  // The connection killed before COMMIT: the transaction is lost, the store says so
  // (retryable, nothing applied), and the retry of the same key runs once.
  auto k2 = key("killed");
  MysqlStore killer_store{[&] {
    auto o2 = my::options();
    o2.before_commit = [&](Transaction& tx) {
      auto id = tx.query_int64("SELECT CONNECTION_ID()").value();
      my::RawConnection admin(my::connection());
      admin.query("KILL " + std::to_string(id));
    };
    return o2;
  }()};
  EXPECT_THROW((void)killer_store.run_transactional(k2, "fp", idem::OwnerToken::generate(),
                                                    std::chrono::seconds(600),
                                                    [&](Transaction& tx) {
                                                      my::insert_effect(tx, k2.id());
                                                      return std::string("paid");
                                                    }),
               idem::StorageUnavailable);
  EXPECT_EQ(0, effects(k2));
  MysqlStore plain{my::options()};
  idem::IdempotencyGuard guard{plain};
  auto retry = guard.run(k2, "fp", [&](Transaction& tx) {
    my::insert_effect(tx, k2.id());
    return std::string("paid");
  });
  EXPECT_EQ(Outcome::kExecuted, retry.outcome);
  EXPECT_EQ(1, effects(k2));
}

// with_transaction has no record to read back: a connection lost at COMMIT is OutcomeUnknown
// (its writes may be committed, as here), never the "nothing applied" StorageUnavailable.
TEST_F(MysqlStoreTest, WithTransactionLostAtCommitIsOutcomeUnknown) {
  auto base = my::connection();
  idem::test::CommitDroppingProxy proxy(static_cast<int>(base.port));
  auto o = my::options();
  o.connection.port = static_cast<unsigned>(proxy.port());
  MysqlStore store{o};
  auto k = key("with-transaction-lost");
  EXPECT_THROW(store.with_transaction([&](Transaction& tx) {
    my::insert_effect(tx, k.id());
    proxy.drop_next_commit = true;
  }),
               idem::OutcomeUnknown);
  EXPECT_EQ(1, proxy.dropped.load());
  EXPECT_EQ(1, effects_once(k, 1));  // it did commit (the server finishes it after the cut)
  store.with_transaction([&](Transaction& tx) { my::insert_effect(tx, k.id()); });
  EXPECT_EQ(2, effects(k));  // the store works on
}

// The same with every pooled connection in use (one here): the lost connection is closed before
// the resolving read, which takes its place, so the answer is the committed result, not an
// OutcomeUnknown after the pool's wait ran out a dozen times.
TEST_F(MysqlStoreTest, ConnectionLostAtCommitIsResolvedWithAPoolOfOne) {
  auto base = my::connection();
  idem::test::CommitDroppingProxy proxy(static_cast<int>(base.port));
  auto o = my::options();
  o.connection.port = static_cast<unsigned>(proxy.port());
  o.pool_size = 1;
  o.before_commit = [&](Transaction&) { proxy.drop_next_commit = true; };
  MysqlStore store{o};
  auto k = key("lost-pool-of-one");
  auto r = store.run_transactional(k, "fp", idem::OwnerToken::generate(), std::chrono::seconds(600),
                                   [&](Transaction& tx) {
                                     my::insert_effect(tx, k.id());
                                     return std::string("paid");
                                   });
  EXPECT_EQ(1, proxy.dropped.load());
  EXPECT_EQ(idem::TransactionalStatus::kCommitted, r.status);
  EXPECT_EQ(1u, store.stats().commits_resolved);
  EXPECT_EQ(0u, store.stats().commits_unknown);
  EXPECT_EQ(1, effects(k));
}

// KILL CONNECTION while the handler's statement runs (pt-kill, a DBA): the client sees 2013
// (MariaDB 10.11) or 1927 ER_CONNECTION_KILLED. The transaction is gone: a retryable
// StorageUnavailable, nothing applied, the connection not reused; the retry runs once.
TEST_F(MysqlStoreTest, AConnectionKilledDuringTheHandlerIsRetryable) {
  MysqlStore store{my::options()};
  auto k = key("killed-mid-statement");
  std::atomic<long long> id{0};
  std::thread killer([&] {
    for (int i = 0; i < 500 && id.load() == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // inside SLEEP(5)
    my::RawConnection admin(my::connection());
    admin.query("KILL CONNECTION " + std::to_string(id.load()));
  });
  try {
    (void)store.run_transactional(k, "fp", idem::OwnerToken::generate(), std::chrono::seconds(600),
                                  [&](Transaction& tx) {
                                    my::insert_effect(tx, k.id());
                                    id = tx.query_int64("SELECT CONNECTION_ID()").value();
                                    (void)tx.query_int64("SELECT SLEEP(5)");
                                    return std::string("paid");
                                  });
    ADD_FAILURE() << "the killed statement returned";
  } catch (const idem::StorageError& e) {
    EXPECT_TRUE(e.retryable()) << e.what();
    EXPECT_EQ(idem::errc::kStoreUnavailable, e.code()) << e.what();
  }
  killer.join();
  EXPECT_EQ(0, effects(k));
  expect_the_retry_executes_once(store, k);
}

// A pooled connection the server closed while it sat idle (wait_timeout, KILL, a restart) is
// replaced before it is lent, so the first use after the idle time succeeds: a transaction of
// the caller's (with_transaction: the MQ batch path, run_batch), a session, a guard call.
TEST_F(MysqlStoreTest, AnIdleConnectionTheServerClosedIsReplacedBeforeUse) {
  auto o = my::options();
  o.pool_size = 1;  // every use takes the one connection the server closed
  MysqlStore store{o};
  my::RawConnection admin(my::connection());
  auto close_the_idle_connection = [&] {
    const long long id = store.with_session(
        [](idem::mysql::Session& s) { return s.query_int64("SELECT CONNECTION_ID()").value(); });
    admin.query("KILL CONNECTION " + std::to_string(id));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the server closes it
  };
  close_the_idle_connection();
  EXPECT_EQ(7, store.with_transaction(
                   [](Transaction& tx) { return tx.query_int64("SELECT 7").value(); }));
  close_the_idle_connection();
  EXPECT_EQ(8, store.with_session(
                   [](idem::mysql::Session& s) { return s.query_int64("SELECT 8").value(); }));
  close_the_idle_connection();
  expect_the_retry_executes_once(store, key("after-idle-close"));
}

// The server refuses more connections than a limit allows (the account's MAX_USER_CONNECTIONS
// here, 1226; max_user_connections 1203 and max_connections 1040 alike) while the pool holds some:
// a call waits for one of the pool's own connections instead of failing, and every key runs once.
// With none of its own open, the refusal reaches the caller typed and retryable, and the retry
// succeeds once a connection is free.
TEST_F(MysqlStoreTest, CallsBeyondTheServersConnectionLimitWaitForThePoolsOwnConnections) {
  my::RawConnection admin(my::connection());
  const std::string user = "idem_cap_" + std::to_string(::getpid());
  const std::string account = "'" + user + "'@'127.0.0.1'";
  admin.query("CREATE USER " + account + " IDENTIFIED BY 'cap' WITH MAX_USER_CONNECTIONS 2");
  struct DropUser {
    my::RawConnection& admin;
    std::string account;
    ~DropUser() { admin.query("DROP USER IF EXISTS " + account); }
  } drop{admin, account};
  admin.query("GRANT ALL PRIVILEGES ON " + my::Database::name() + ".* TO " + account);
  auto o = my::options();
  o.connection.user = user;
  o.connection.password = "cap";
  o.pool_size = 6;  // more than the server lets this user open
  o.pool_wait = std::chrono::seconds(30);
  constexpr int kThreads = 6, kCalls = 4;
  std::vector<idem::Key> keys;
  for (int i = 0; i < kThreads * kCalls; ++i) keys.push_back(key("cap"));
  std::atomic<int> executed{0};
  std::mutex errors_mutex;
  std::vector<std::string> errors;
  {
    MysqlStore store{o};
    idem::IdempotencyGuard guard{store};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kCalls; ++i) {
          const idem::Key& k = keys[static_cast<std::size_t>(t * kCalls + i)];
          try {
            auto r = guard.run(k, "fp", [&](Transaction& tx) {
              my::insert_effect(tx, k.id());
              (void)tx.query_int64("SELECT SLEEP(0.05)");
              return std::string("paid");
            });
            if (r.outcome == Outcome::kExecuted) ++executed;
          } catch (const std::exception& e) {
            std::lock_guard<std::mutex> lock(errors_mutex);
            errors.push_back(e.what());
          }
        }
      });
    }
    for (auto& th : threads) th.join();
  }
  EXPECT_TRUE(errors.empty()) << errors.size() << " calls failed, e.g. " << errors.front();
  EXPECT_EQ(kThreads * kCalls, executed.load());
  for (const auto& k : keys) EXPECT_EQ(1, effects(k)) << k.str();

  // None of the pool's own: its connection is closed by the server, the user's two
  // connections are held elsewhere.
  o.pool_wait = std::chrono::milliseconds(200);
  MysqlStore fresh{o};
  auto kill_the_users_connections = [&] {
    for (const auto& row : admin.query("SELECT id FROM information_schema.processlist WHERE "
                                       "user = '" +
                                       user + "'")) {
      admin.query("KILL CONNECTION " + row.at(0).value());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the server closes them
  };
  kill_the_users_connections();
  auto capped = my::connection();
  capped.user = user;
  capped.password = "cap";
  auto k = key("cap-full");
  {
    my::RawConnection first(capped), second(capped);
    try {
      (void)fresh.run_transactional(k, "fp", idem::OwnerToken::generate(),
                                    std::chrono::seconds(600), [&](Transaction& tx) {
                                      my::insert_effect(tx, k.id());
                                      return std::string("paid");
                                    });
      ADD_FAILURE() << "a call ran beyond the user's connection limit";
    } catch (const idem::StorageError& e) {
      EXPECT_TRUE(e.retryable()) << e.what();
      EXPECT_EQ(idem::errc::kStoreUnavailable, e.code()) << e.what();
      EXPECT_NE(std::string(e.what()).find("[1226 "), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(0, effects(k));
  expect_the_retry_executes_once(fresh, k);
}

// A record table made by hand whose key column compares case-insensitively (MySQL's default
// collations), used without the migration: 'Order-1' and 'order-1' would be one record, one
// key replaying another's answer. The store refuses the table before its first record, with
// what to change; no handler runs.
TEST_F(MysqlStoreTest, AHandMadeTableWhoseKeysIgnoreCaseIsRefusedBeforeAnyRecord) {
  const std::string table = "ci_" + std::to_string(::getpid());
  auto o = my::options();
  o.table = table;
  { MysqlStore made{o}; }  // idem's layout, then the key column as a DBA might write it
  my::raw().query("ALTER TABLE " + table +
                  " MODIFY idem_key varchar(128) CHARACTER SET utf8mb4"
                  " COLLATE utf8mb4_general_ci NOT NULL");
  o.migrate = false;
  MysqlStore store{o};
  idem::IdempotencyGuard guard{store};
  int runs = 0;
  for (const char* id : {"Order-1", "order-1"}) {
    try {
      (void)guard.run(idem::Key::make("payment", id), "fp", [&](Transaction&) {
        ++runs;
        return std::string("paid ") + id;
      });
      ADD_FAILURE() << id << ": a table whose keys ignore case was used";
    } catch (const idem::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("utf8mb4_general_ci"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("idem_key"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(0, runs);
  EXPECT_EQ(0, my::count_where(table, "biz_type", "payment"));
  my::raw().query("DROP TABLE " + table);
}

// A table that cannot grow (1114: a full tablespace or disk; a MEMORY table at its size here)
// is a state that passes, as a full disk is on SQLite and PostgreSQL: a retryable
// StorageUnavailable, nothing kept. It was a permanent StorageError.
TEST_F(MysqlStoreTest, ATableThatIsFullIsRetryable) {
  const std::string table = "full_" + std::to_string(::getpid());
  my::raw().query("SET SESSION max_heap_table_size = 16384");
  my::raw().query("CREATE TABLE " + table + " (pad varchar(1000) NOT NULL) ENGINE=MEMORY");
  MysqlStore store{my::options()};
  idem::IdempotencyGuard guard{store};
  auto k = key("table-full");
  try {
    (void)guard.run(k, "fp", [&](Transaction& tx) {
      my::insert_effect(tx, k.id());
      for (int i = 0; i < 1000; ++i) {
        tx.exec("INSERT INTO " + table + " (pad) VALUES (REPEAT('x', 1000))");
      }
      return std::string("never");
    });
    ADD_FAILURE() << "the full table took every row";
  } catch (const idem::StorageError& e) {
    EXPECT_TRUE(e.retryable()) << e.what();
    EXPECT_EQ(idem::errc::kStoreUnavailable, e.code()) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("1114")) << e.what();
  }
  EXPECT_EQ(0, effects(k));
  my::raw().query("DROP TABLE " + table);
  expect_the_retry_executes_once(store, k);
}

// A statement the server interrupts (max_statement_time here; KILL QUERY alike) while the
// prepared statement's rows are fetched: Connector/C leaves that error on the connection, not on
// the statement. It must reach the caller typed and with the server's reason (1969, a
// retryable StorageTimeout), never as an empty, permanent error; nothing is applied and the
// retry runs once.
TEST_F(MysqlStoreTest, AStatementTheServerInterruptsIsTypedWithItsReason) {
  MysqlStore store{my::options()};
  auto k = key("interrupted");
  try {
    (void)store.run_transactional(k, "fp", idem::OwnerToken::generate(), std::chrono::seconds(600),
                                  [&](Transaction& tx) {
                                    my::insert_effect(tx, k.id());
                                    (void)tx.query_int64(
                                        "SET STATEMENT max_statement_time = 0.2 FOR "
                                        "SELECT SLEEP(2) FROM DUAL WHERE ? = ?",
                                        1, 1);
                                    return std::string("paid");
                                  });
    ADD_FAILURE() << "the interrupted statement returned";
  } catch (const idem::StorageError& e) {
    EXPECT_TRUE(e.retryable()) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("1969")) << e.what();
  }
  EXPECT_EQ(0, effects(k));
  expect_the_retry_executes_once(store, k);
}

// A handler that ends the transaction itself (SET autocommit = 1 here; DDL or LOCK TABLES
// alike) gets a UsageError, and its connection is not handed out again: with one connection in
// the pool, the next call's failing handler still loses its writes (a connection left in
// autocommit would have committed them, and its in-progress record with them).
TEST_F(MysqlStoreTest, AHandlerThatEndsTheTransactionLeavesNoPoisonedConnection) {
  auto o = my::options();
  o.pool_size = 1;
  MysqlStore store{o};
  auto k = key("autocommit");
  EXPECT_THROW((void)store.run_transactional(k, "fp", idem::OwnerToken::generate(),
                                             std::chrono::seconds(600),
                                             [&](Transaction& tx) {
                                               tx.exec("SET autocommit = 1");
                                               my::insert_effect(tx, k.id());
                                               return std::string("paid");
                                             }),
               idem::UsageError);
  auto k2 = key("after-autocommit");
  EXPECT_THROW((void)store.run_transactional(k2, "fp", idem::OwnerToken::generate(),
                                             std::chrono::seconds(600),
                                             [&](Transaction& tx) -> std::string {
                                               my::insert_effect(tx, k2.id());
                                               throw std::runtime_error("declined");
                                             }),
               std::runtime_error);
  EXPECT_EQ(0, effects(k2));
  EXPECT_FALSE(store.lookup(k2).has_value());
  expect_the_retry_executes_once(store, k2);
}

// Transactional mode: the claim writes the record's expiry (retention plus a margin of a tenth,
// at most 60 s), so the completion of a short transaction keeps it and leaves the expires_at
// index alone; a transaction longer than the margin, a takeover and a two-phase completion set
// it from the completion, so a record is always kept at least `retention` after it completed.
TEST_F(MysqlStoreTest, ExpiryIsWrittenByTheClaimAndKeptAtLeastTheRetention) {
  MysqlStore store{my::options()};
  auto expiry = [](const idem::Key& k) {
    auto rows = my::raw().query(
        "SELECT status, CAST(expires_at AS CHAR), TIMESTAMPDIFF(MICROSECOND, created_at,"
        " expires_at), TIMESTAMPDIFF(MICROSECOND, updated_at, expires_at) FROM api_idempotency"
        " WHERE biz_type = 'payment' AND idem_key = " +
        my::raw().quote(k.id()));
    EXPECT_EQ(1u, rows.size());
    return rows.empty() ? std::vector<std::optional<std::string>>(4) : rows[0];
  };
  // A short transaction: the claim's expiry, 600 s + 60 s from the claim, stays.
  auto k = key("expiry");
  std::optional<std::string> during;
  auto r = store.run_transactional(
      k, "fp", idem::OwnerToken::generate(), std::chrono::seconds(600), [&](Transaction& tx) {
        auto row = tx.query(
            "SELECT status, CAST(expires_at AS CHAR), TIMESTAMPDIFF(MICROSECOND, created_at,"
            " expires_at) FROM api_idempotency WHERE biz_type = 'payment' AND idem_key = ?",
            k.id());
        EXPECT_EQ(1u, row.size());
        if (row.size() == 1) {
          EXPECT_EQ("in_progress", row[0][0].bytes());
          EXPECT_EQ("660000000", row[0][2].bytes());
          during = row[0][1].bytes();
        }
        return std::string("paid");
      });
  ASSERT_EQ(idem::TransactionalStatus::kCommitted, r.status);
  auto done = expiry(k);
  EXPECT_EQ("completed", done[0].value_or(""));
  EXPECT_EQ(during, done[1]) << "the completion kept the claim's expiry";
  EXPECT_EQ("660000000", done[2].value_or(""));
  EXPECT_GE(std::stoll(done[3].value_or("0")), 600'000'000LL);

  // A transaction longer than the margin (a tenth of 1 s): the completion moves the expiry to
  // exactly `retention` after it.
  auto slow = key("expiry_slow");
  (void)store.run_transactional(slow, "", idem::OwnerToken::generate(), std::chrono::seconds(1),
                                [](Transaction&) {
                                  std::this_thread::sleep_for(std::chrono::milliseconds(300));
                                  return std::string("slow");
                                });
  auto moved = expiry(slow);
  EXPECT_EQ("completed", moved[0].value_or(""));
  EXPECT_EQ("1000000", moved[3].value_or(""));
  EXPECT_GE(std::stoll(moved[2].value_or("0")), 1'300'000LL);

  // Two-phase: begin writes no expiry, complete sets it.
  auto two = key("expiry_two_phase");
  auto owner = idem::OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed,
            store.begin(two, "", owner, std::chrono::milliseconds(60'000)).status);
  EXPECT_FALSE(expiry(two)[1].has_value()) << "no expiry while in progress";
  ASSERT_TRUE(store.complete(two, owner, "done", std::chrono::seconds(600)));
  EXPECT_EQ("600000000", expiry(two)[3].value_or(""));

  // A transactional takeover of a crashed two-phase attempt sets it from the completion too.
  auto taken = key("expiry_takeover");
  ASSERT_EQ(
      ClaimStatus::kClaimed,
      store.begin(taken, "", idem::OwnerToken::generate(), std::chrono::milliseconds(50)).status);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto t =
      store.run_transactional(taken, "", idem::OwnerToken::generate(), std::chrono::seconds(600),
                              [](Transaction&) { return std::string("taken"); });
  ASSERT_EQ(idem::TransactionalStatus::kCommitted, t.status);
  EXPECT_TRUE(t.took_over);
  EXPECT_EQ("600000000", expiry(taken)[3].value_or(""));
  EXPECT_EQ("taken", store.lookup(taken)->response);
}

// The completion finds the row the claim inserted by its id only where the table's primary
// key is one AUTO_INCREMENT column; elsewhere (here: the key columns are the primary key, and
// an AUTO_INCREMENT column is only indexed) by its key, and every answer is the same.
TEST_F(MysqlStoreTest, CompletionByIdOnlyWhereThePrimaryKeyIsOneAutoIncrementColumn) {
  const std::string t = idem::test::unique_name("api_pk");
  my::raw().query("CREATE TABLE " + t +
                  " (seq bigint NOT NULL AUTO_INCREMENT,"
                  " idem_key varchar(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
                  " biz_type varchar(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
                  " status varchar(32) NOT NULL, response_body longblob,"
                  " created_at datetime(3) NOT NULL, updated_at datetime(3) NOT NULL,"
                  " fingerprint varbinary(255) NOT NULL DEFAULT '', owner varchar(64) NOT NULL"
                  " DEFAULT '', lease_until datetime(3) NULL, expires_at datetime(3) NULL,"
                  " attempts int NOT NULL DEFAULT 1, PRIMARY KEY (idem_key, biz_type),"
                  " KEY (seq), KEY (expires_at))");
  auto o = my::options();
  o.table = t;
  o.migrate = false;
  o.pool_size = 1;  // one session: its log lines are read below
  MysqlStore store{o};
  const long long session = store.with_transaction(
      [](Transaction& tx) { return tx.query_int64("SELECT CONNECTION_ID()").value(); });
  idem::IdempotencyGuard guard{store};
  auto k = key("pk");
  my::GeneralLog log;
  auto r = guard.run(k, "fp", [&](Transaction& tx) {
    my::insert_effect(tx, k.id());
    return std::string("paid");
  });
  log.stop();
  auto updates = my::raw().query(
      "SELECT CONVERT(argument USING utf8mb4) FROM mysql.general_log WHERE thread_id = " +
      std::to_string(session) + " AND command_type = 'Execute' AND argument LIKE 'UPDATE%'");
  ASSERT_EQ(1u, updates.size());
  EXPECT_NE(std::string::npos, updates[0][0]->find(" WHERE `idem_key` = ")) << *updates[0][0];
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  auto again = guard.run(k, "fp", [&](Transaction&) { return std::string("never"); });
  EXPECT_EQ(Outcome::kReplayed, again.outcome);
  EXPECT_EQ("paid", again.value.value_or(""));
  EXPECT_EQ(1, effects(k));
  EXPECT_EQ("completed", *my::raw().query("SELECT status FROM " + t +
                                          " WHERE idem_key = " + my::raw().quote(k.id()))[0][0]);
  my::raw().query("DROP TABLE " + t);
}

// Record times are read to the millisecond, as the server computes them from the columns
// (datetime(3) and an adopted table's datetime without fractions), and a replay's first_seen is
// the record's created_at.
TEST_F(MysqlStoreTest, RecordTimesAreReadToTheMillisecond) {
  MysqlStore store{my::options()};
  auto millis = [](const std::string& table, const std::string& column, const idem::Key& k) {
    return my::raw().scalar("SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', " + column +
                            ") DIV 1000 FROM " + table +
                            " WHERE idem_key = " + my::raw().quote(k.id()));
  };
  auto ms = [](idem::TimePoint t) { return static_cast<long>(idem::to_millis(t)); };
  auto k = key("times");
  auto owner = idem::OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed,
            store.begin(k, "", owner, std::chrono::milliseconds(60'000)).status);
  auto held = store.lookup(k);
  ASSERT_TRUE(held.has_value());
  EXPECT_EQ(millis("api_idempotency", "lease_until", k), ms(held->lease_until));
  EXPECT_EQ(idem::TimePoint{}, held->expires_at) << "no expiry while in progress";
  ASSERT_TRUE(store.complete(k, owner, "done", std::chrono::seconds(600)));
  auto rec = store.lookup(k);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(millis("api_idempotency", "created_at", k), ms(rec->created_at));
  EXPECT_EQ(millis("api_idempotency", "updated_at", k), ms(rec->updated_at));
  EXPECT_EQ(millis("api_idempotency", "expires_at", k), ms(rec->expires_at));
  EXPECT_EQ(ms(rec->updated_at) + 600'000, ms(rec->expires_at));
  idem::IdempotencyGuard guard{store};
  auto replay = guard.run(k, "", [](Transaction&) { return std::string("never"); });
  EXPECT_EQ(Outcome::kReplayed, replay.outcome);
  EXPECT_EQ(ms(rec->created_at), ms(replay.first_seen));

  // Whole seconds (a datetime column without fractions, as adopted tables may have).
  const std::string t = idem::test::unique_name("api_seconds");
  my::raw().query("CREATE TABLE " + t +
                  " (id bigint primary key auto_increment,"
                  " idem_key varchar(128) CHARACTER SET ascii COLLATE ascii_bin not null,"
                  " biz_type varchar(64) CHARACTER SET ascii COLLATE ascii_bin not null,"
                  " status varchar(32) not null, response_body longblob,"
                  " created_at datetime not null, updated_at datetime not null,"
                  " fingerprint varbinary(255) NOT NULL DEFAULT '', owner varchar(64) NOT NULL"
                  " DEFAULT '', lease_until datetime NULL, expires_at datetime NULL,"
                  " attempts int NOT NULL DEFAULT 1, unique key uk (idem_key, biz_type))");
  auto o = my::options();
  o.table = t;
  o.migrate = false;
  MysqlStore seconds{o};
  auto s = key("seconds");
  (void)seconds.run_transactional(s, "", idem::OwnerToken::generate(), std::chrono::seconds(600),
                                  [](Transaction&) { return std::string("r"); });
  auto whole = seconds.lookup(s);
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(millis(t, "created_at", s), ms(whole->created_at));
  EXPECT_EQ(0, ms(whole->created_at) % 1000);
  EXPECT_EQ(millis(t, "expires_at", s), ms(whole->expires_at));
  my::raw().query("DROP TABLE " + t);
}

// Session::query hands DATETIME and TIMESTAMP values over as the server prints them (here:
// compared with the text protocol's answer), whatever their fractional digits, zero dates too.
TEST_F(MysqlStoreTest, DatetimeColumnsReadAsTheServerPrintsThem) {
  const std::string t = idem::test::unique_name("times");
  my::raw().query("CREATE TABLE " + t +
                  " (n int PRIMARY KEY, d0 datetime NULL, d1 datetime(1) NULL,"
                  " d3 datetime(3) NULL, d6 datetime(6) NULL, ts2 timestamp(2) NULL)");
  my::raw().query("SET SESSION sql_mode = ''");  // a zero date is accepted
  my::raw().query("INSERT INTO " + t +
                  " VALUES (1, '2026-12-02 03:04:05', '2026-12-02 03:04:05.9',"
                  " '1999-01-31 23:59:59.007', '2026-02-28 00:00:00.000042',"
                  " '2026-12-02 03:04:05.12'),"
                  " (2, '0000-00-00 00:00:00', NULL, '1000-01-01 00:00:00.000',"
                  " '9999-12-31 23:59:59.999999', NULL)");
  my::raw().query("SET SESSION sql_mode = DEFAULT");
  const std::string select = "SELECT d0, d1, d3, d6, ts2 FROM " + t + " ORDER BY n";
  auto text = my::raw().query(select);
  MysqlStore store{my::options()};
  auto bound = store.with_session([&](idem::mysql::Session& s) { return s.query(select); });
  ASSERT_EQ(2u, text.size());
  ASSERT_EQ(2u, bound.size());
  for (std::size_t r = 0; r < 2; ++r) {
    for (std::size_t c = 0; c < 5; ++c) {
      EXPECT_EQ(text[r][c].has_value(), !bound[r][c].is_null()) << r << "," << c;
      EXPECT_EQ(text[r][c].value_or(""), bound[r][c].bytes()) << r << "," << c;
    }
  }
  EXPECT_EQ("1999-01-31 23:59:59.007", bound[0][2].bytes());
  EXPECT_EQ("0000-00-00 00:00:00", bound[1][0].bytes());
  my::raw().query("DROP TABLE " + t);
}

// Bytes in, same bytes out: any byte value, invalid UTF-8, 4-byte characters — checked in the
// table itself with HEX(), outside idem.
TEST_F(MysqlStoreTest, ResponsesAreBinarySafeInTheTable) {
  MysqlStore store{my::options()};
  std::string body;
  for (int i = 0; i < 256; ++i) body.push_back(static_cast<char>(i));
  body += "\xf0\x9f\x92\xb3 \xc3\x28 \xff\xfe";
  auto k = key("bytes");
  (void)store.run_transactional(k, "fp", idem::OwnerToken::generate(), std::chrono::seconds(600),
                                [&](Transaction&) { return body; });
  auto hex = my::raw().query(
      "SELECT HEX(response_body), LENGTH(response_body) FROM "
      "api_idempotency WHERE idem_key = " +
      my::raw().quote(k.id()));
  ASSERT_EQ(1u, hex.size());
  static const char* digits = "0123456789ABCDEF";
  std::string expect;
  for (unsigned char c : body) {
    expect.push_back(digits[c >> 4]);
    expect.push_back(digits[c & 15]);
  }
  EXPECT_EQ(expect, *hex[0][0]);
  EXPECT_EQ(std::to_string(body.size()), *hex[0][1]);
  EXPECT_EQ(body, store.lookup(k)->response);
}

// A response larger than the column takes is a UsageError before anything is written, never a
// truncated replay; both modes.
TEST_F(MysqlStoreTest, OversizeResponseIsRefusedBeforeAnythingIsWritten) {
  MysqlStore store{my::options()};
  const std::uint64_t max = store.max_response_bytes();
  EXPECT_GT(max, 1'000'000u);  // longblob, bounded by max_allowed_packet
  std::string big(static_cast<std::size_t>(max) + 1, 'x');
  idem::IdempotencyGuard guard{store};
  auto k = key("big");
  EXPECT_THROW((void)guard.run(k, "",
                               [&](Transaction& tx) {
                                 my::insert_effect(tx, k.id());
                                 return big;
                               }),
               idem::UsageError);
  EXPECT_EQ(0, effects(k));
  EXPECT_FALSE(store.lookup(k).has_value());
  auto k2 = key("big2");
  auto owner = idem::OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed,
            store.begin(k2, "", owner, std::chrono::milliseconds(30000)).status);
  EXPECT_THROW(store.complete(k2, owner, big, std::chrono::seconds(60)), idem::UsageError);
  auto rec = store.lookup(k2);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kInProgress, rec->status);  // nothing was written
  std::string fits(static_cast<std::size_t>(std::min<std::uint64_t>(max, 3'000'000)), 'y');
  EXPECT_TRUE(store.complete(k2, owner, fits, std::chrono::seconds(60)));
  EXPECT_EQ(fits.size(), store.lookup(k2)->response.size());

  // Through the guard, two-phase: the handler's effect happened before the refusal, so the
  // record is marked failed and no retry (during the lease or after it) runs it again.
  auto k3 = key("big3");
  int external = 0;
  idem::CallOptions short_lease;
  short_lease.lease = std::chrono::milliseconds(300);
  auto charge = [&] {
    ++external;
    return big;
  };
  EXPECT_THROW((void)guard.run(k3, "", short_lease, charge), idem::UsageError);
  ASSERT_TRUE(store.lookup(k3).has_value());
  EXPECT_EQ(idem::Record::Status::kFailed, store.lookup(k3)->status);
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  for (int i = 0; i < 2; ++i) {
    try {
      (void)guard.run(k3, "", short_lease, charge);
      ADD_FAILURE() << "answered";
    } catch (const idem::UsageError& e) {
      ADD_FAILURE() << "ran again: " << e.what();
    } catch (const idem::StorageError& e) {
      EXPECT_FALSE(e.retryable());
      EXPECT_NE(std::string::npos, std::string(e.what()).find("could not be stored")) << e.what();
    }
  }
  EXPECT_EQ(1, external);
}

// record_batch_in (run_batch, consume_batch) splits a batch into statements a server takes:
// 11,000 records are more rows than one prepared INSERT has placeholders for (65,535, six a
// row), and twenty responses of an eighth of max_allowed_packet each are more bytes than one
// statement may carry (the server drops the connection). Every record is written once, and a
// batch with some records already there answers each request right.
TEST_F(MysqlStoreTest, BatchesLargerThanOneStatementAreSplit) {
  MysqlStore store{my::options()};
  auto batch = [&](const std::vector<idem::Key>& keys, const std::string& response) {
    const auto owner = idem::OwnerToken::generate();
    std::vector<idem::ClaimRequest> requests;
    for (const auto& k : keys) requests.push_back({&k, "fp", &owner});
    return store.with_transaction([&](Transaction& tx) {
      return store.record_batch_in(tx, requests, response, std::chrono::seconds(600), {}).value();
    });
  };
  auto written = [](const std::vector<bool>& v) { return std::count(v.begin(), v.end(), true); };
  const std::string prefix = idem::test::unique_name("many");
  std::vector<idem::Key> many;
  for (int i = 0; i < 11000; ++i) {
    many.push_back(idem::Key::make("payment", prefix + "-" + std::to_string(i)));
  }
  EXPECT_EQ(11000, written(batch(many, "ok")));
  EXPECT_EQ(11000, my::raw().scalar("SELECT count(*) FROM api_idempotency WHERE idem_key LIKE " +
                                    my::raw().quote(prefix + "-%")));
  // Half of them again, with as many new keys: the new ones are written, the others not.
  std::vector<idem::Key> mixed(many.begin() + 5500, many.end());
  for (int i = 0; i < 5500; ++i) {
    mixed.push_back(idem::Key::make("payment", prefix + "-new-" + std::to_string(i)));
  }
  auto answers = batch(mixed, "ok");
  ASSERT_EQ(mixed.size(), answers.size());
  for (std::size_t i = 0; i < mixed.size(); ++i) {
    ASSERT_EQ(i >= 5500, answers[i]) << mixed[i].str();
  }

  const std::uint64_t max = store.max_response_bytes();
  const std::string large(static_cast<std::size_t>(max / 8), 'r');
  std::vector<idem::Key> heavy;
  for (int i = 0; i < 20; ++i) heavy.push_back(key("heavy"));
  EXPECT_EQ(20, written(batch(heavy, large)));
  for (const auto& k : heavy) EXPECT_EQ(large.size(), store.lookup(k)->response.size());
}

TEST_F(MysqlStoreTest, BadConfigurationIsTypedAndNotRetryable) {
  auto o = my::options();
  o.connection.password = "wrong";
  try {
    MysqlStore s{o};
    ADD_FAILURE() << "connected with a wrong password";
  } catch (const idem::StorageError& e) {
    EXPECT_FALSE(e.retryable()) << e.what();
    auto* info = dynamic_cast<const idem::mysql::ServerError*>(&e);
    ASSERT_NE(nullptr, info);
    EXPECT_EQ(1045u, info->error_number());
  }
  auto nodb = my::options();
  nodb.connection.database = "idem_no_such_database";
  try {
    MysqlStore s{nodb};
    ADD_FAILURE() << "connected to a missing database";
  } catch (const idem::StorageError& e) {
    EXPECT_FALSE(e.retryable()) << e.what();
    EXPECT_EQ(1049u, dynamic_cast<const idem::mysql::ServerError&>(e).error_number());
  }
  // A server that is down: retryable (it may come back).
  auto down = my::options();
  down.connection.port = 1;  // nothing listens there
  try {
    MysqlStore s{down};
    ADD_FAILURE() << "connected to a closed port";
  } catch (const idem::StorageUnavailable& e) {
    EXPECT_TRUE(e.retryable());
  }
  // Lazy store (no migration): construction succeeds, the first call fails typed.
  down.migrate = false;
  MysqlStore lazy{down};
  EXPECT_THROW((void)lazy.lookup(key()), idem::StorageUnavailable);
  // Bad URIs and options: usage errors, before any connection.
  EXPECT_THROW(MysqlStore{"postgresql://x/y"}, idem::UsageError);
  EXPECT_THROW(MysqlStore{"mysql://u@h:99999/db"}, idem::UsageError);
  EXPECT_THROW(MysqlStore{"mysql://u@h/db?read_timeout=x"}, idem::UsageError);
  EXPECT_THROW(MysqlStore{"mysql://u@h/db?bogus=1"}, idem::UsageError);
  EXPECT_THROW(MysqlStore{"mysql://u@h:3306"}, idem::UsageError);  // no database
  EXPECT_THROW(MysqlStore{"mysql://u@::1/db"}, idem::UsageError);  // IPv6 without brackets
  auto bad = my::options();
  bad.table = "api_idempotency; DROP TABLE x";
  EXPECT_THROW(MysqlStore{bad}, idem::UsageError);
  // Options the client library cannot hold: whole seconds as an unsigned int, 0 meaning "wait
  // forever" (2^32 s wrapped to a call that never returned).
  for (auto seconds : {0LL, -1LL, 1LL << 32, 86401LL}) {
    auto timeouts = my::options();
    timeouts.connection.read_timeout = std::chrono::seconds(seconds);
    EXPECT_THROW(MysqlStore{timeouts}, idem::UsageError) << seconds;
    timeouts = my::options();
    timeouts.connection.connect_timeout = std::chrono::seconds(seconds);
    EXPECT_THROW(MysqlStore{timeouts}, idem::UsageError) << seconds;
  }
  auto far = my::options();
  far.connection.port = 70000;
  EXPECT_THROW(MysqlStore{far}, idem::UsageError);
}

// A store made with `o` fails to connect with a configuration error (not retryable).
void expect_refused(const idem::mysql::MysqlStoreOptions& o, const std::string& why) {
  try {
    MysqlStore s{o};
    ADD_FAILURE() << "connected although " << why;
  } catch (const idem::StorageError& e) {
    EXPECT_FALSE(e.retryable()) << why << ": " << e.what();
  }
}

// A guarded call on `store` runs and its response is what the record holds.
void expect_guarded_write(MysqlStore& store, const idem::Key& k, const std::string& response) {
  EXPECT_EQ(
      Outcome::kExecuted,
      idem::IdempotencyGuard{store}.run(k, "", [&](Transaction&) { return response; }).outcome);
  EXPECT_EQ(response, store.lookup(k)->response);
}

// TLS against the test server, which offers it with the test-made certificates (they name
// localhost and 127.0.0.1). A CA given authenticates the server: another CA's certificate is
// refused, and so is the right certificate reached under a name it does not carry
// (127.0.0.2, through a forwarding proxy). Refusals are configuration errors: not retryable.
TEST_F(MysqlStoreTest, TlsWithACaAuthenticatesTheServer) {
  std::string dir;
  IDEM_REQUIRE_ENV(dir, "IDEM_TEST_MYSQL_TLS_DIR");
  auto cipher = [](MysqlStore& s) {
    return s.with_session([](idem::mysql::Session& session) {
      return session
          .query_text(
              "SELECT VARIABLE_VALUE FROM information_schema.SESSION_STATUS"
              " WHERE VARIABLE_NAME = 'SSL_CIPHER'")
          .value_or("");
    });
  };
  auto verified = my::options();
  verified.pool_size = 1;
  verified.connection.tls_ca = dir + "/ca.pem";
  MysqlStore store{verified};
  EXPECT_NE("", cipher(store));
  expect_guarded_write(store, key("tls"), "over tls");

  auto other_ca = verified;
  other_ca.connection.tls_ca = dir + "/other-ca.pem";
  expect_refused(other_ca, "the certificate does not chain to the CA given");

  idem::test::CommitDroppingProxy elsewhere(static_cast<int>(verified.connection.port),
                                            0x7f000002);  // 127.0.0.2
  auto wrong_name = verified;
  wrong_name.connection.host = "127.0.0.2";
  wrong_name.connection.port = static_cast<unsigned>(elsewhere.port());
  expect_refused(wrong_name, "the certificate does not name 127.0.0.2");
  // TLS without a CA encrypts without authenticating: the same path is accepted.
  auto encrypted_only = wrong_name;
  encrypted_only.connection.tls_ca.clear();
  encrypted_only.connection.tls = true;
  MysqlStore unauthenticated{encrypted_only};
  EXPECT_NE("", cipher(unauthenticated));
}

// A user whose only credential is a client certificate (REQUIRE SUBJECT ... AND ISSUER ...):
// the store connects with tls_cert/tls_key and runs as that user; without a certificate, or
// with one of the same subject from a CA the server does not trust, it is refused, and the
// refusal is a configuration error (not retryable). Files that cannot work are usage errors
// before any connection.
TEST_F(MysqlStoreTest, ClientCertificateAuthenticatesTheUser) {
  std::string dir;
  IDEM_REQUIRE_ENV(dir, "IDEM_TEST_MYSQL_TLS_DIR");
  MysqlStore admin{my::options()};
  admin.with_session([](idem::mysql::Session& s) {
    s.exec_text("DROP USER IF EXISTS 'idem_x509'@'127.0.0.1'");
    s.exec_text(
        "CREATE USER 'idem_x509'@'127.0.0.1' REQUIRE SUBJECT '/CN=idem-client'"
        " AND ISSUER '/CN=idem test ca'");
    s.exec_text("GRANT ALL PRIVILEGES ON *.* TO 'idem_x509'@'127.0.0.1'");
  });
  auto x509 = my::options();
  x509.pool_size = 1;
  x509.connection.user = "idem_x509";
  x509.connection.password.clear();
  x509.connection.tls_ca = dir + "/ca.pem";
  x509.connection.tls_cert = dir + "/client.pem";
  x509.connection.tls_key = dir + "/client-key.pem";
  {
    MysqlStore store{x509};
    EXPECT_EQ("idem_x509@127.0.0.1", store.with_session([](idem::mysql::Session& s) {
      return s.query_text("SELECT CURRENT_USER()").value_or("");
    }));
    expect_guarded_write(store, key("x509"), "by certificate");
  }

  auto no_certificate = x509;
  no_certificate.connection.tls_cert.clear();
  no_certificate.connection.tls_key.clear();
  expect_refused(no_certificate, "no client certificate was presented");
  // Under TLS 1.3 the client ends its handshake before the server has checked the
  // certificate: the server's alert may arrive as 2026 (not retryable) or, when the client is
  // already sending its authentication, as a reset connection (2013, retryable: the client
  // cannot tell it from a network failure).
  auto untrusted = x509;
  untrusted.connection.tls_cert = dir + "/other-client.pem";
  untrusted.connection.tls_key = dir + "/other-client-key.pem";
  try {
    MysqlStore s{untrusted};
    ADD_FAILURE() << "connected with a certificate of a CA the server does not trust";
  } catch (const idem::StorageError& e) {
    const auto* server = dynamic_cast<const idem::mysql::ServerError*>(&e);
    ASSERT_NE(nullptr, server) << e.what();
    if (e.retryable()) {
      EXPECT_EQ(2013u, server->error_number()) << e.what();
    } else {
      EXPECT_EQ(2026u, server->error_number()) << e.what();
    }
  }

  auto half = x509;
  half.connection.tls_key.clear();
  EXPECT_THROW(MysqlStore{half}, idem::UsageError);
  auto missing = x509;
  missing.connection.tls_key = dir + "/no-such-key.pem";
  try {
    MysqlStore s{missing};
    ADD_FAILURE() << "a key file that does not exist was accepted";
  } catch (const idem::UsageError& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("no-such-key.pem")) << e.what();
  }
  admin.with_session(
      [](idem::mysql::Session& s) { s.exec_text("DROP USER IF EXISTS 'idem_x509'@'127.0.0.1'"); });
}

TEST(MysqlUri, ParsesEveryPart) {
  auto o = idem::mysql::parse_uri(
      "mysql://app%40x:p%3Ass%2Fw@db.example:3307/pay%5Fments?connect_timeout=3&read_timeout=7"
      "&write_timeout=9&tls=true&tls_ca=%2Fetc%2Fca.pem&tls_cert=%2Fetc%2Fc.pem"
      "&tls_key=%2Fetc%2Fk.pem");
  EXPECT_EQ("app@x", o.user);
  EXPECT_EQ("p:ss/w", o.password);
  EXPECT_EQ("db.example", o.host);
  EXPECT_EQ(3307u, o.port);
  EXPECT_EQ("pay_ments", o.database);
  EXPECT_EQ(3, o.connect_timeout.count());
  EXPECT_EQ(7, o.read_timeout.count());
  EXPECT_EQ(9, o.write_timeout.count());
  EXPECT_TRUE(o.tls);
  EXPECT_EQ("/etc/ca.pem", o.tls_ca);
  EXPECT_EQ("/etc/c.pem", o.tls_cert);
  EXPECT_EQ("/etc/k.pem", o.tls_key);
  auto v6 = idem::mysql::parse_uri("mariadb://[::1]:3306/db");
  EXPECT_EQ("::1", v6.host);
  auto d = idem::mysql::parse_uri("mysql://h/db");
  EXPECT_EQ(3306u, d.port);
  EXPECT_EQ("", d.user);
  try {
    (void)idem::mysql::parse_uri("mysql://u:secret@h/db?nope=1");
    ADD_FAILURE();
  } catch (const idem::UsageError& e) {
    EXPECT_EQ(std::string::npos, std::string(e.what()).find("secret"));  // never echoed
  }
  // A '?' left unencoded in the password: refused without any of it in the message.
  try {
    (void)idem::mysql::parse_uri("mysql://u:sec?ret@h/db");
    ADD_FAILURE();
  } catch (const idem::UsageError& e) {
    EXPECT_EQ(std::string::npos, std::string(e.what()).find("ret")) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("%3F")) << e.what();
  }
  // A raw '/' in the password: the user information ends at the last '@', as URI parsers read
  // it, so the password is neither a port in an error nor a database name.
  auto slash = idem::mysql::parse_uri("mysql://app:QZ7/x@db.example:3306/orders");
  EXPECT_EQ("QZ7/x", slash.password);
  EXPECT_EQ("db.example", slash.host);
  EXPECT_EQ(3306u, slash.port);
  EXPECT_EQ("orders", slash.database);
  auto two = idem::mysql::parse_uri("mysql://app:12/QZ7@db.example");
  EXPECT_EQ("12/QZ7", two.password);
  EXPECT_EQ("db.example", two.host);
  EXPECT_EQ("", two.database);
  EXPECT_THROW((void)idem::mysql::parse_uri("mysql://h/db?read_timeout=0"), idem::UsageError);
  EXPECT_THROW((void)idem::mysql::parse_uri("mysql://h/a%2"), idem::UsageError);
  // No '@' (a forgotten host): the password reads as a port.
  for (const char* uri : {"mysql://idem:QZ7secret", "mysql://idem:QZ7secret/db",
                          "mysql://h:1?read_timeout=QZ7secret"}) {
    try {
      (void)idem::mysql::parse_uri(uri);
      ADD_FAILURE() << uri;
    } catch (const idem::UsageError& e) {
      EXPECT_EQ(std::string::npos, std::string(e.what()).find("QZ7secret")) << e.what();
    }
  }
}

// The seed table exactly as services create it, adopted: idem adds its columns, its key
// columns start comparing bytes, its TEXT response becomes a BLOB; rows survive.
TEST_F(MysqlStoreTest, AdoptsTheSeedTable) {
  const std::string db = idem::test::unique_name("idem_adopt");
  my::RawConnection admin(my::connection(), false);
  admin.query("CREATE DATABASE " + db + " CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci");
  admin.query("CREATE TABLE " + db +
              ".api_idempotency (id bigint primary key auto_increment,"
              " idem_key varchar(128) not null, biz_type varchar(64) not null,"
              " status varchar(32) not null, response_body text,"
              " created_at datetime not null, updated_at datetime not null,"
              " unique key uk_idem_key_biz_type (idem_key, biz_type))");
  admin.query("CREATE TABLE " + db +
              ".mq_consume_record (id bigint primary key auto_increment,"
              " message_id varchar(128) not null, consumer_group varchar(64) not null,"
              " status varchar(32) not null, created_at datetime not null,"
              " unique key uk_msg_group (message_id, consumer_group))");
  admin.query("INSERT INTO " + db +
              ".api_idempotency (idem_key, biz_type, status, response_body, created_at,"
              " updated_at) VALUES ('old', 'payment', 'completed', 'kept', NOW(), NOW())");
  auto o = my::options();
  o.connection.database = db;
  EXPECT_THROW(MysqlStore{o}, idem::UsageError);  // not without being asked
  o.adopt_existing_table = true;
  {
    MysqlStore store{o};
    MysqlStore again{o};  // a second migration is a no-op
    // Keys differing in case only are two keys now.
    auto upper = idem::Key::make("payment", "Order_1"),
         lower = idem::Key::make("payment", "order_1");
    for (const auto& k : {upper, lower}) {
      auto r =
          store.run_transactional(k, "fp", idem::OwnerToken::generate(), std::chrono::seconds(600),
                                  [&](Transaction&) { return "r_" + k.id(); });
      EXPECT_EQ(idem::TransactionalStatus::kCommitted, r.status) << k.id();
    }
    EXPECT_EQ("r_Order_1", store.lookup(upper)->response);
    EXPECT_EQ("r_order_1", store.lookup(lower)->response);
    std::string bin("\x00\xff\xc3\x28", 4);
    auto kb = key("adopt_bin");
    (void)store.run_transactional(kb, "", idem::OwnerToken::generate(), std::chrono::seconds(600),
                                  [&](Transaction&) { return bin; });
    EXPECT_EQ(bin, store.lookup(kb)->response);
    EXPECT_EQ(65535u, store.max_response_bytes());  // the seed's TEXT became a BLOB
    auto mq = o;
    mq.table = "mq_consume_record";
    mq.key_column = "message_id";
    mq.scope_column = "consumer_group";
    MysqlStore records{mq};
    auto m = idem::Key::make("billing", "msg-1");
    auto owner = idem::OwnerToken::generate();
    ASSERT_EQ(ClaimStatus::kClaimed,
              records.begin(m, "", owner, std::chrono::milliseconds(30000)).status);
    EXPECT_TRUE(records.complete(m, owner, "consumed", std::chrono::seconds(60)));
  }
  auto types = admin.query(
      "SELECT COLUMN_NAME, DATA_TYPE, IFNULL(COLLATION_NAME, '') FROM information_schema.COLUMNS"
      " WHERE TABLE_SCHEMA = '" +
      db + "' AND TABLE_NAME = 'api_idempotency' ORDER BY COLUMN_NAME");
  std::map<std::string, std::pair<std::string, std::string>> col;
  for (auto& t : types) col[*t[0]] = {*t[1], *t[2]};
  EXPECT_EQ("blob", col["response_body"].first);
  EXPECT_EQ("utf8mb4_bin", col["idem_key"].second);
  EXPECT_EQ("utf8mb4_bin", col["biz_type"].second);
  for (const char* added : {"fingerprint", "owner", "lease_until", "expires_at", "attempts"}) {
    EXPECT_EQ(1u, col.count(added)) << added;
  }
  EXPECT_EQ("kept", *admin.query("SELECT response_body FROM " + db +
                                 ".api_idempotency WHERE idem_key = 'old'")[0][0]);
  EXPECT_EQ(1, admin.scalar("SELECT version FROM " + db +
                            ".idem_schema_version WHERE name = 'api_idempotency'"));
  admin.query("DROP DATABASE " + db);
}

// A seed table whose key columns are narrower than idem's keys is widened when adopted (a cut
// key would make two keys one record); schema.sql leaves such a table to the adoption (no
// version row); a key column that is not a string is refused; a version row newer than this
// idem is refused by a store that does not migrate, at its first use.
TEST_F(MysqlStoreTest, AdoptionWidensNarrowKeysAndTheVersionIsAlwaysChecked) {
  const std::string db = idem::test::unique_name("idem_narrow");
  my::RawConnection admin(my::connection(), false);
  admin.query("CREATE DATABASE " + db);
  admin.query("CREATE TABLE " + db +
              ".api_idempotency (id bigint primary key auto_increment,"
              " idem_key varchar(64) not null, biz_type varchar(32) not null,"
              " status varchar(32) not null, response_body blob,"
              " created_at datetime not null, updated_at datetime not null,"
              " unique key uk_idem_key_biz_type (idem_key, biz_type))");
  {
    std::ifstream in(std::string(IDEM_SOURCE_DIR) + "/src/mysql/schema.sql");
    std::string sql((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    my::RawConnection c(my::connection(db));
    c.query(sql);
  }
  EXPECT_EQ(0, admin.scalar("SELECT count(*) FROM " + db +
                            ".idem_schema_version WHERE name = 'api_idempotency'"));
  EXPECT_EQ(1, admin.scalar("SELECT count(*) FROM " + db +
                            ".idem_schema_version WHERE name = 'mq_consume_record'"));
  auto o = my::options();
  o.connection.database = db;
  o.adopt_existing_table = true;
  {
    MysqlStore store{o};
    const std::string prefix(64, 'k');
    const std::string scope(64, 's');
    for (const auto& k :
         {idem::Key::make(scope, prefix + "-first"), idem::Key::make(scope, prefix + "-second"),
          idem::Key::make("payment", std::string(128, 'x'))}) {
      auto r =
          store.run_transactional(k, "", idem::OwnerToken::generate(), std::chrono::seconds(60),
                                  [&](Transaction&) { return "r_" + k.id(); });
      EXPECT_EQ(idem::TransactionalStatus::kCommitted, r.status) << k.id();
      EXPECT_EQ("r_" + k.id(), store.lookup(k)->response);
    }
  }
  EXPECT_EQ(128,
            admin.scalar("SELECT CHARACTER_MAXIMUM_LENGTH FROM information_schema.COLUMNS"
                         " WHERE TABLE_SCHEMA = '" +
                         db + "' AND TABLE_NAME = 'api_idempotency' AND COLUMN_NAME = 'idem_key'"));
  admin.query("CREATE TABLE " + db +
              ".int_keys (id bigint primary key auto_increment, idem_key bigint not null,"
              " biz_type varchar(64) not null, status varchar(32) not null,"
              " created_at datetime not null, unique key uk (idem_key, biz_type))");
  auto ints = o;
  ints.table = "int_keys";
  try {
    MysqlStore store{ints};
    ADD_FAILURE() << "an integer key column was adopted";
  } catch (const idem::UsageError& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("varchar or varbinary")) << e.what();
  }
  admin.query("CREATE TABLE " + db +
              ".extra_cols (id bigint primary key auto_increment, idem_key varchar(128) not null,"
              " biz_type varchar(64) not null, tenant varchar(16) not null,"
              " status varchar(32) not null, created_at datetime not null,"
              " unique key uk (idem_key, biz_type))");
  auto extra = o;
  extra.table = "extra_cols";
  try {
    MysqlStore store{extra};
    ADD_FAILURE() << "a table with a NOT NULL column idem does not write was adopted";
  } catch (const idem::UsageError& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("(tenant)")) << e.what();
  }
  admin.query("UPDATE " + db + ".idem_schema_version SET version = 2");
  auto plain = o;
  plain.migrate = false;
  MysqlStore store{plain};
  try {
    (void)store.run_transactional(idem::Key::make("payment", "late"), "",
                                  idem::OwnerToken::generate(), std::chrono::seconds(60),
                                  [](Transaction&) { return std::string("x"); });
    ADD_FAILURE() << "a newer table was used";
  } catch (const idem::StorageError& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("newer than this idem")) << e.what();
  }
  admin.query("DROP DATABASE " + db);
}

// A table whose response column stays TEXT (migrate = false: the DBA keeps it): valid UTF-8
// (4-byte characters too) is stored, anything else refused before writing.
TEST_F(MysqlStoreTest, TextResponseColumnTakesUtf8Only) {
  const std::string t = idem::test::unique_name("api_text");
  my::raw().query("CREATE TABLE " + t +
                  " (id bigint primary key auto_increment,"
                  " idem_key varchar(128) CHARACTER SET ascii COLLATE ascii_bin not null,"
                  " biz_type varchar(64) CHARACTER SET ascii COLLATE ascii_bin not null,"
                  " status varchar(32) not null, response_body text CHARACTER SET utf8mb4,"
                  " created_at datetime(3) not null, updated_at datetime(3) not null,"
                  " fingerprint varbinary(255) NOT NULL DEFAULT '', owner varchar(64) NOT NULL"
                  " DEFAULT '', lease_until datetime(3) NULL, expires_at datetime(3) NULL,"
                  " attempts int NOT NULL DEFAULT 1, unique key uk (idem_key, biz_type))");
  auto o = my::options();
  o.table = t;
  o.migrate = false;
  MysqlStore store{o};
  const std::string json = "{\"card\":\"\xf0\x9f\x92\xb3\",\"name\":\"Zo\xc3\xab\"}";
  auto k = key("utf8");
  (void)store.run_transactional(k, "", idem::OwnerToken::generate(), std::chrono::seconds(600),
                                [&](Transaction&) { return json; });
  EXPECT_EQ(json, store.lookup(k)->response);
  auto bad = key("latin");
  EXPECT_THROW((void)store.run_transactional(bad, "", idem::OwnerToken::generate(),
                                             std::chrono::seconds(600),
                                             [&](Transaction&) { return std::string("\xff"); }),
               idem::UsageError);
  EXPECT_FALSE(store.lookup(bad).has_value());
  my::raw().query("DROP TABLE " + t);
}

// The DDL shipped for DBAs is the migration's: a store finds nothing left to do on it.
TEST_F(MysqlStoreTest, SchemaSqlMatchesTheMigration) {
  const std::string db = idem::test::unique_name("idem_schema");
  my::RawConnection admin(my::connection(), false);
  admin.query("CREATE DATABASE " + db);
  std::ifstream in(std::string(IDEM_SOURCE_DIR) + "/src/mysql/schema.sql");
  std::string sql((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(sql.empty());
  my::RawConnection c(my::connection(db));
  c.query(sql);
  c.query(sql);  // twice is safe
  auto o = my::options();
  o.connection.database = db;
  MysqlStore store{o};  // migrate(): version 1 found, nothing to do
  auto k = key("schema");
  EXPECT_EQ(idem::TransactionalStatus::kCommitted,
            store
                .run_transactional(k, "", idem::OwnerToken::generate(), std::chrono::seconds(60),
                                   [](Transaction&) { return std::string("x"); })
                .status);
  // Compare the column definitions with a store-created database.
  const std::string db2 = idem::test::unique_name("idem_migrated");
  admin.query("CREATE DATABASE " + db2);
  auto o2 = my::options();
  o2.connection.database = db2;
  { MysqlStore created{o2}; }
  auto columns = [&](const std::string& d) {
    return admin.query(
        "SELECT COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE, IFNULL(COLLATION_NAME, ''),"
        " IFNULL(COLUMN_DEFAULT, '') FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = '" +
        d + "' AND TABLE_NAME = 'api_idempotency' ORDER BY ORDINAL_POSITION");
  };
  EXPECT_EQ(columns(db), columns(db2));
  admin.query("DROP DATABASE " + db);
  admin.query("DROP DATABASE " + db2);
}

// The guard's heartbeat on MySQL: extend is owner-checked, keeps a claim past its first lease,
// and answers true even twice within one millisecond (MySQL counts changed rows only).
TEST_F(MysqlStoreTest, ExtendIsOwnerCheckedAndKeepsAClaimFromBeingTakenOver) {
  MysqlStore store{my::options()};
  auto k = key("extend");
  auto mine = idem::OwnerToken::generate();
  auto other = idem::OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed,
            store.begin(k, "", mine, std::chrono::milliseconds{100}, {}).status);
  EXPECT_FALSE(store.extend(k, other, std::chrono::seconds{10}));
  EXPECT_TRUE(store.extend(k, mine, std::chrono::seconds{10}));
  EXPECT_TRUE(store.extend(k, mine, std::chrono::seconds{10}));
  std::this_thread::sleep_for(std::chrono::milliseconds{250});
  auto c = store.begin(k, "", other, std::chrono::milliseconds{100}, {});
  EXPECT_EQ(ClaimStatus::kBusy, c.status);
  EXPECT_FALSE(c.took_over);
  ASSERT_TRUE(store.complete(k, mine, "done", std::chrono::seconds{60}));
  EXPECT_FALSE(store.extend(k, mine, std::chrono::seconds{10}));
}

}  // namespace
