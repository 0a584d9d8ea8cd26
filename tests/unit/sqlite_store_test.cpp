// SPDX-License-Identifier: MIT
// SqliteStore: the durable conformance suite, plus SQLite specifics.
#include "idem/sqlite/sqlite_store.hpp"

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "conformance/durable_store_conformance.hpp"

namespace {

struct SqliteTraits {
  using Store = idem::sqlite::SqliteStore;
  static const char* env_var() { return nullptr; }
  static std::unique_ptr<Store> make(const std::string&) {
    static idem::test::TempDir dir;
    auto store = std::make_unique<Store>(dir.file(idem::test::unique_name("db") + ".sqlite"));
    store->database().write([](idem::sqlite::Transaction& tx) {
      tx.exec(
          "CREATE TABLE IF NOT EXISTS idem_test_effects ("
          " id INTEGER PRIMARY KEY, key_id TEXT NOT NULL)");
    });
    return store;
  }
  static void insert_effect(idem::sqlite::Transaction& tx, const std::string& key_id) {
    tx.exec("INSERT INTO idem_test_effects (key_id) VALUES (?)", key_id);
  }
  static long count_effects(Store& store, const std::string& key_id) {
    return static_cast<long>(store.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM idem_test_effects WHERE key_id = ?", key_id)
          .value_or(-1);
    }));
  }
  static long count_records(Store& store) {
    return static_cast<long>(store.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM api_idempotency").value_or(-1);
    }));
  }
};

// The same store, called as if the fast store had granted every claim: run_transactional and
// begin always pass DurableHint{fast_claimed = true} (so the read-snapshot precheck is always
// skipped, even for completed and mismatched duplicates). The suite must pass unchanged: a hint
// only makes a store faster, it never changes an answer. (Whatever hint the guard passes is
// replaced by the forced one.)
class AlwaysHintedSqliteStore : public idem::sqlite::SqliteStore {
 public:
  using SqliteStore::SqliteStore;
  template <class Handler>
  idem::TransactionalResult run_transactional(const idem::Key& key, std::string_view fingerprint,
                                              const idem::OwnerToken& owner,
                                              std::chrono::seconds retention, Handler&& handler,
                                              idem::DurableHint = {}) {
    return SqliteStore::run_transactional(key, fingerprint, owner, retention,
                                          std::forward<Handler>(handler), hint());
  }
  idem::ClaimResult begin(const idem::Key& key, std::string_view fingerprint,
                          const idem::OwnerToken& owner, std::chrono::milliseconds lease,
                          idem::DurableHint = {}) {
    return SqliteStore::begin(key, fingerprint, owner, lease, hint());
  }

 private:
  static idem::DurableHint hint() {
    idem::DurableHint h;
    h.fast_claimed = true;
    return h;
  }
};

struct HintedSqliteTraits : SqliteTraits {
  using Store = AlwaysHintedSqliteStore;
  static std::unique_ptr<Store> make(const std::string&) {
    static idem::test::TempDir dir;
    auto store = std::make_unique<Store>(dir.file(idem::test::unique_name("db") + ".sqlite"));
    store->database().write([](idem::sqlite::Transaction& tx) {
      tx.exec(
          "CREATE TABLE IF NOT EXISTS idem_test_effects ("
          " id INTEGER PRIMARY KEY, key_id TEXT NOT NULL)");
    });
    return store;
  }
  static long count_effects(Store& store, const std::string& key_id) {
    return SqliteTraits::count_effects(store, key_id);
  }
  static long count_records(Store& store) { return SqliteTraits::count_records(store); }
};

// Both fit the durable store contract, batch operations included (the guard always passes its
// hint: there is one DurableHint parameter, no overload to detect).
static_assert(idem::detail::check_durable_store<idem::sqlite::SqliteStore>());
static_assert(idem::detail::check_batch_store<idem::sqlite::SqliteStore>());
static_assert(idem::detail::check_durable_store<AlwaysHintedSqliteStore>());

}  // namespace

namespace idem::test {
using SqliteTypes = ::testing::Types<SqliteTraits>;
INSTANTIATE_TYPED_TEST_SUITE_P(SqliteAlwaysHinted, DurableStoreConformance,
                               ::testing::Types<HintedSqliteTraits>);
INSTANTIATE_TYPED_TEST_SUITE_P(Sqlite, DurableStoreConformance, SqliteTypes);
}  // namespace idem::test

namespace {

// The README's SQLite quick start, as written there: business tables made through
// durable.database().write(...), then a transactional handler writing to them once.
TEST(SqliteStore, ReadmeQuickStartCreatesBusinessTablesAndChargesOnce) {
  idem::test::TempDir dir;
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable{dir.file("payments.db")};
  durable.database().write([](idem::sqlite::Transaction& tx) {
    tx.exec_script(
        "CREATE TABLE IF NOT EXISTS account (id INTEGER PRIMARY KEY, balance INTEGER);"
        "CREATE TABLE IF NOT EXISTS payment (order_no TEXT PRIMARY KEY, amount INTEGER)");
  });
  durable.database().write(
      [](idem::sqlite::Transaction& tx) { tx.exec("INSERT INTO account VALUES (1, 1000)"); });
  idem::IdempotencyGuard guard{fast, durable};
  auto key = idem::Key::make("payment", "o_1");
  for (int i = 0; i < 3; ++i) {
    auto r = guard.run(key, idem::fingerprint("100"), [&](idem::sqlite::Transaction& tx) {
      tx.exec("UPDATE account SET balance = balance - ? WHERE id = ?", 100, 1);
      tx.exec("INSERT INTO payment (order_no, amount) VALUES (?, ?)", "o_1", 100);
      return "pay_o_1";  // a C string: stored as std::string
    });
    ASSERT_TRUE(r.ok());
    EXPECT_EQ("pay_o_1", *r.value);
  }
  durable.database().read([](idem::sqlite::Session& db) {
    EXPECT_EQ(900, db.query_int64("SELECT balance FROM account WHERE id = 1").value_or(-1));
    EXPECT_EQ(1, db.query_int64("SELECT count(*) FROM payment").value_or(-1));
  });
}

// A MemoryStore at its max_records in front of SQLite: new keys run on the durable store alone
// (degraded), once each, and their duplicates are answered from it.
TEST(SqliteStore, AFullMemoryStoreInFrontDegradesToTheDurableStore) {
  idem::MemoryStoreOptions mo;
  mo.max_records = 1;
  idem::MemoryStore fast{mo};
  idem::sqlite::SqliteStore durable{":memory:"};
  idem::IdempotencyGuard guard{fast, durable};
  int runs = 0;
  for (int round = 0; round < 2; ++round) {
    for (const char* id : {"a", "b", "c"}) {
      auto r = guard.run(idem::Key::make("s", id), "",
                         [&](idem::sqlite::Transaction&) { return std::to_string(++runs); });
      ASSERT_TRUE(r.ok());
      EXPECT_EQ(round == 0 ? idem::Outcome::kExecuted : idem::Outcome::kReplayed, r.outcome) << id;
      EXPECT_EQ(std::string(id) != "a", r.degraded) << id;
    }
  }
  EXPECT_EQ(3, runs);
  EXPECT_EQ(1u, fast.size());
}

// The write lock is first come first served: a thread that commits and writes again at once
// (the purge's batches, a batch consumer) queues behind a writer that was already waiting,
// instead of taking the lock back ahead of it for as long as it keeps writing.
TEST(SqliteStore, AWaitingWriterGoesBeforeAThreadThatWritesAgainAtOnce) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore store{dir.file("fifo.db")};
  idem::sqlite::Database& db = store.database();
  db.write([](idem::sqlite::Transaction& tx) { tx.exec("CREATE TABLE t (x TEXT)"); });
  std::atomic<bool> inside{false};
  std::atomic<bool> other_started{false};
  std::thread looping([&] {
    db.write([&](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT INTO t VALUES ('first')");
      inside = true;
      while (!other_started) std::this_thread::yield();
      // The other writer is blocked on the lock by now (it asked right after saying so).
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    });
    for (int i = 0; i < 20; ++i) {
      db.write([&](idem::sqlite::Transaction& tx) { tx.exec("INSERT INTO t VALUES ('again')"); });
    }
  });
  while (!inside) std::this_thread::yield();
  other_started = true;
  db.write([](idem::sqlite::Transaction& tx) { tx.exec("INSERT INTO t VALUES ('waiting')"); });
  looping.join();
  const auto order = db.read([](idem::sqlite::Session& s) {
    return s.query_text(
        "SELECT group_concat(x, ',') FROM (SELECT x FROM t ORDER BY rowid LIMIT 3)");
  });
  EXPECT_EQ("first,waiting,again", order.value_or(""));
}

TEST(SqliteStore, MigrationIsIdempotentAndVersioned) {
  idem::test::TempDir dir;
  auto path = dir.file("m.sqlite");
  { idem::sqlite::SqliteStore a(path); }
  idem::sqlite::SqliteStore b(path);  // second run: a no-op
  auto version = b.database().read([](idem::sqlite::Session& s) {
    return s.query_int64("SELECT version FROM idem_schema_version WHERE name = ?",
                         "api_idempotency");
  });
  EXPECT_EQ(3, version.value_or(0));
  EXPECT_EQ(3, b.schema_version());
  idem::sqlite::SqliteStore mq(b.shared_database(),
                               idem::sqlite::SqliteStoreOptions::mq_consume_record());
  auto key = idem::Key::make("billing-consumer", "msg-1");
  auto r = mq.run_transactional(key, "", idem::OwnerToken::generate(), std::chrono::seconds(60),
                                [](idem::sqlite::Transaction&) { return std::string("acked"); });
  EXPECT_EQ(idem::TransactionalStatus::kCommitted, r.status);
  auto n = mq.database().read([](idem::sqlite::Session& s) {
    return s.query_int64(
        "SELECT count(*) FROM mq_consume_record WHERE message_id = 'msg-1' AND "
        "consumer_group = 'billing-consumer'");
  });
  EXPECT_EQ(1, n.value_or(0));
}

// The record table's status check accepts exactly the three states (version 3: the integers
// 0, 1 and 2, status_literal), and costs no ephemeral b-tree per write (SQLite builds one for
// `status IN (...)` on every INSERT and every UPDATE that sets status, several times the cost
// of the row itself).
TEST(SqliteStore, StatusCheckIsEnforcedWithoutAnEphemeralTable) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore store(dir.file("check.sqlite"),
                                  idem::sqlite::SqliteStoreOptions::mq_consume_record());
  EXPECT_EQ("0", store.status_literal(idem::Record::Status::kInProgress));
  EXPECT_EQ("1", store.status_literal(idem::Record::Status::kCompleted));
  EXPECT_EQ("2", store.status_literal(idem::Record::Status::kFailed));
  const std::string insert =
      "INSERT INTO mq_consume_record (message_id, consumer_group, status, fingerprint, owner,"
      " lease_until, created_at, updated_at) VALUES (?1, 'g', ?2, '', 'o', 1, 1, 1)";
  store.database().write([&](idem::sqlite::Transaction& tx) {
    for (int status : {0, 1, 2}) {
      EXPECT_EQ(1, tx.exec(insert, "m-" + std::to_string(status), status));
    }
    EXPECT_THROW(tx.exec(insert, std::string("m-bad"), 3), idem::StorageError);
    EXPECT_THROW(tx.exec(insert, std::string("m-negative"), -1), idem::StorageError);
    EXPECT_THROW(tx.exec(insert, std::string("m-half"), 1.5), idem::StorageError);
    EXPECT_THROW(tx.exec(insert, std::string("m-text"), std::string("completed")),
                 idem::StorageError);
    EXPECT_THROW(tx.exec(insert, std::string("m-empty"), std::string("")), idem::StorageError);
    for (const std::string& sql :
         {"EXPLAIN " + insert, std::string("EXPLAIN UPDATE mq_consume_record SET status = 1"
                                           " WHERE message_id = ?1 AND consumer_group = 'g'")}) {
      idem::sqlite::Statement plan = tx.prepare(sql);
      int opcodes = 0;
      while (plan.step()) {
        ++opcodes;
        EXPECT_NE("OpenEphemeral", plan.column_bytes(1)) << sql;
      }
      EXPECT_GT(opcodes, 10) << sql;  // a real program was listed
    }
  });
}

namespace {

// The record table as schema version 1 created it (idem before schema 2), verbatim.
void create_schema_one_table(idem::sqlite::Transaction& tx) {
  tx.exec_script(
      "CREATE TABLE idem_schema_version ("
      " name TEXT PRIMARY KEY, version INTEGER NOT NULL, applied_at INTEGER NOT NULL);"
      "CREATE TABLE api_idempotency ( id INTEGER PRIMARY KEY, idem_key VARCHAR(128) NOT NULL,"
      " biz_type VARCHAR(64) NOT NULL, status VARCHAR(16) NOT NULL  CHECK (status ="
      " 'in_progress' OR status = 'completed' OR status = 'failed'), fingerprint VARCHAR(64) NOT"
      " NULL DEFAULT '', owner VARCHAR(32) NOT NULL, response_body BLOB, lease_until INTEGER NOT"
      " NULL, expires_at INTEGER, attempts INTEGER NOT NULL DEFAULT 1, created_at INTEGER NOT"
      " NULL, updated_at INTEGER NOT NULL, UNIQUE (idem_key, biz_type));"
      "CREATE INDEX api_idempotency_expires_idx ON api_idempotency (expires_at) WHERE status <>"
      " 'in_progress';"
      "INSERT INTO idem_schema_version VALUES ('api_idempotency', 1, 1);");
}

std::string stored_type(idem::sqlite::SqliteStore& store, const idem::Key& key) {
  return store.database()
      .read([&](idem::sqlite::Session& s) {
        return s.query_text("SELECT typeof(fingerprint) FROM " + store.table() +
                                " WHERE idem_key = ? AND biz_type = ?",
                            key.id(), key.scope());
      })
      .value_or("absent");
}

// Three records as an older idem wrote them, the fingerprint as that table stores it (`stored_fp`:
// text, or a Blob of its 32 bytes): "done" completed, "held" in progress held by `owner`, and
// "old" completed with its retention over.
template <class Fingerprint>
void insert_older_records(idem::sqlite::Transaction& tx, const Fingerprint& stored_fp,
                          const std::string& owner, std::int64_t now) {
  const std::string insert =
      "INSERT INTO api_idempotency (idem_key, biz_type, status, fingerprint, owner,"
      " response_body, lease_until, expires_at, created_at, updated_at) VALUES"
      " (?1, 'pay', ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?8)";
  tx.exec(insert, "done", "completed", stored_fp, owner, idem::sqlite::Blob{"pay_1"}, now,
          now + 3'600'000, now);
  tx.exec(insert, "held", "in_progress", stored_fp, owner, nullptr, now + 60'000, nullptr, now);
  tx.exec(insert, "old", "completed", stored_fp, owner, idem::sqlite::Blob{"gone"}, now - 10,
          now - 5, now - 20);
}

// What a table of an older version holding insert_older_records' rows (fingerprint `fp`) must
// still do: "done" replays (and mismatches another payload), "held" is busy and its owner
// completes it, a new record commits with its fingerprint stored as `fresh_fp_type` (the
// table's own layout), and the purge deletes "old" only (expect_older_table_purges_by_age
// follows with the operator's purge by age).
void expect_older_table_works(idem::sqlite::SqliteStore& store, const std::string& fp,
                              const std::string& owner, const char* fresh_fp_type) {
  const auto done = idem::Key::make("pay", "done");
  auto replay = store.run_transactional(done, fp, idem::OwnerToken::generate(),
                                        std::chrono::seconds(60), [](idem::sqlite::Transaction&) {
                                          ADD_FAILURE() << "ran again";
                                          return std::string("x");
                                        });
  EXPECT_EQ(idem::TransactionalStatus::kReplayed, replay.status);
  EXPECT_EQ("pay_1", replay.response);
  EXPECT_EQ(owner, replay.holder);
  EXPECT_EQ(idem::ClaimStatus::kMismatch,
            store
                .begin(done, idem::fingerprint("amount=11"), idem::OwnerToken::generate(),
                       std::chrono::seconds(30))
                .status);
  const auto held = idem::Key::make("pay", "held");
  EXPECT_EQ(idem::ClaimStatus::kBusy,
            store.begin(held, fp, idem::OwnerToken::generate(), std::chrono::seconds(30)).status);
  EXPECT_TRUE(store.complete(held, idem::OwnerToken::from_string(owner), "pay_2",
                             std::chrono::seconds(60)));
  EXPECT_EQ("pay_2", store.lookup(held)->response);
  EXPECT_EQ(idem::Record::Status::kCompleted, store.lookup(held)->status);
  EXPECT_EQ(fp, store.lookup(held)->fingerprint);
  const auto fresh = idem::Key::make("pay", "fresh");
  auto r =
      store.run_transactional(fresh, fp, idem::OwnerToken::generate(), std::chrono::seconds(60),
                              [](idem::sqlite::Transaction&) { return std::string("p3"); });
  EXPECT_EQ(idem::TransactionalStatus::kCommitted, r.status);
  EXPECT_EQ(fresh_fp_type, stored_type(store, fresh));
  EXPECT_EQ(fp, store.lookup(fresh)->fingerprint);
  EXPECT_EQ(1u, store.purge_expired());
  EXPECT_FALSE(store.lookup(idem::Key::make("pay", "old")).has_value());
  EXPECT_TRUE(store.lookup(done).has_value());
}

// An operator's purge of an older table (after expect_older_table_works): every finished
// record written before the cutoff goes, whatever its retention; a claim in progress stays.
void expect_older_table_purges_by_age(idem::sqlite::SqliteStore& store, const std::string& fp) {
  const auto busy = idem::Key::make("pay", "busy");
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            store.begin(busy, fp, idem::OwnerToken::generate(), std::chrono::seconds(30)).status);
  const auto later = idem::system_now() + std::chrono::minutes(1);
  EXPECT_EQ(3u, store.purge_older_than(later, 2));  // done, held and fresh, two per batch
  for (const char* id : {"done", "held", "fresh"}) {
    EXPECT_FALSE(store.lookup(idem::Key::make("pay", id)).has_value()) << id;
  }
  EXPECT_TRUE(store.lookup(busy).has_value());
  EXPECT_EQ(0u, store.purge_older_than(later, 2));
}

// The path of a new file in `dir` holding a table made by `create` (an older version's DDL) and
// insert_older_records' rows, the fingerprint stored as `stored_fp`.
template <class Create, class Fingerprint>
std::string older_table_file(idem::test::TempDir& dir, const char* name, Create create,
                             const Fingerprint& stored_fp, const std::string& owner) {
  const auto path = dir.file(name);
  idem::sqlite::Database db(path);
  db.write([&](idem::sqlite::Transaction& tx) {
    create(tx);
    insert_older_records(tx, stored_fp, owner, idem::to_millis(idem::system_now()));
  });
  return path;
}

}  // namespace

// Tables of schema version 1 (rowid, a unique index, fingerprints as text) are used as they
// are: their records replay, their claims complete, new records are written in their layout,
// and the purge works.
TEST(SqliteStore, SchemaOneTablesStayReadableAndCompletable) {
  idem::test::TempDir dir;
  const std::string fp = idem::fingerprint("amount=10");
  const std::string owner = idem::OwnerToken::generate().str();
  idem::sqlite::SqliteStore store(
      older_table_file(dir, "v1.sqlite", create_schema_one_table, fp, owner));
  auto version = store.database().read([](idem::sqlite::Session& s) {
    return s.query_int64("SELECT version FROM idem_schema_version WHERE name = 'api_idempotency'");
  });
  EXPECT_EQ(1, version.value_or(0));
  EXPECT_EQ(1, store.schema_version());
  // New records keep the table's layout (text fingerprints an earlier version reads).
  expect_older_table_works(store, fp, owner, "text");
  expect_older_table_purges_by_age(store, fp);
}

// A version row that does not match its table (here a version-1 table whose row says 3) is
// refused when the store opens, with or without migrate, instead of every record written
// after the first answer being read back as corrupt.
TEST(SqliteStore, AVersionRowThatDoesNotMatchItsTableIsRefused) {
  idem::test::TempDir dir;
  const std::string path = dir.file("lying.sqlite");
  {
    idem::sqlite::Database db(path);
    db.write([](idem::sqlite::Transaction& tx) {
      create_schema_one_table(tx);
      tx.exec("UPDATE idem_schema_version SET version = 3 WHERE name = 'api_idempotency'");
    });
  }
  for (bool migrate : {true, false}) {
    idem::sqlite::SqliteStoreOptions o;
    o.migrate = migrate;
    try {
      idem::sqlite::SqliteStore store(path, o);
      ADD_FAILURE() << "opened (migrate " << migrate << ")";
    } catch (const idem::StorageError& e) {
      EXPECT_FALSE(e.retryable());
      EXPECT_NE(std::string::npos, std::string(e.what()).find("its layout is version 1's"))
          << e.what();
    }
  }
}

// The steps docs/versioning.md gives to move a version-1 table to version 2, verbatim.
TEST(SqliteStore, SchemaOneTableMovedToVersionTwoKeepsItsRecords) {
  idem::test::TempDir dir;
  const auto path = dir.file("move.sqlite");
  const std::string fp = idem::fingerprint("amount=10");
  const auto now = idem::to_millis(idem::system_now());
  {
    auto db = std::make_shared<idem::sqlite::Database>(path);
    db->write([&](idem::sqlite::Transaction& tx) {
      create_schema_one_table(tx);
      tx.exec(
          "INSERT INTO api_idempotency (idem_key, biz_type, status, fingerprint, owner,"
          " response_body, lease_until, expires_at, created_at, updated_at) VALUES"
          " ('done', 'pay', 'completed', ?1, 'o', x'7061795f31', ?2, ?3, ?2, ?2)",
          fp, now, now + 3'600'000);
    });
    db->write([](idem::sqlite::Transaction& tx) {
      tx.exec_script(
          "CREATE TABLE api_idempotency_v2 ("
          "  idem_key VARCHAR(128) NOT NULL, biz_type VARCHAR(64) NOT NULL,"
          "  status VARCHAR(16) NOT NULL"
          "    CHECK (status = 'in_progress' OR status = 'completed' OR status = 'failed'),"
          "  fingerprint BLOB NOT NULL DEFAULT '', owner VARCHAR(32) NOT NULL, response_body BLOB,"
          "  lease_until INTEGER NOT NULL, expires_at INTEGER, attempts INTEGER NOT NULL DEFAULT 1,"
          "  created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,"
          "  PRIMARY KEY (idem_key, biz_type)) WITHOUT ROWID;"
          "INSERT INTO api_idempotency_v2"
          "  SELECT idem_key, biz_type, status, fingerprint, owner, response_body, lease_until,"
          "         expires_at, attempts, created_at, updated_at"
          "  FROM api_idempotency;"
          "DROP TABLE api_idempotency;"
          "ALTER TABLE api_idempotency_v2 RENAME TO api_idempotency;"
          "CREATE INDEX api_idempotency_expires_idx ON api_idempotency (expires_at)"
          "  WHERE status <> 'in_progress';"
          "UPDATE idem_schema_version SET version = 2 WHERE name = 'api_idempotency';");
    });
  }
  idem::sqlite::SqliteStore store(path);
  const auto done = idem::Key::make("pay", "done");
  auto replay = store.begin(done, fp, idem::OwnerToken::generate(), std::chrono::seconds(30));
  EXPECT_EQ(idem::ClaimStatus::kDone, replay.status);
  EXPECT_EQ("pay_1", replay.response);
  EXPECT_EQ("text", stored_type(store, done));  // copied as it was
  const auto fresh = idem::Key::make("pay", "fresh");
  EXPECT_EQ(
      idem::TransactionalStatus::kCommitted,
      store
          .run_transactional(fresh, fp, idem::OwnerToken::generate(), std::chrono::seconds(60),
                             [](idem::sqlite::Transaction&) { return std::string("p"); })
          .status);
  EXPECT_EQ("blob", stored_type(store, fresh));  // new rows are packed
  EXPECT_EQ(fp, store.lookup(fresh)->fingerprint);
}

namespace {

// The record table as schema version 2 created it (idem before schema 3), verbatim: status as
// text, an expiry index.
void create_schema_two_table(idem::sqlite::Transaction& tx) {
  tx.exec_script(
      "CREATE TABLE idem_schema_version ("
      " name TEXT PRIMARY KEY, version INTEGER NOT NULL, applied_at INTEGER NOT NULL);"
      "CREATE TABLE api_idempotency ( idem_key VARCHAR(128) NOT NULL, biz_type VARCHAR(64) NOT"
      " NULL, status VARCHAR(16) NOT NULL  CHECK (status = 'in_progress' OR status = 'completed'"
      " OR status = 'failed'), fingerprint BLOB NOT NULL DEFAULT '', owner VARCHAR(32) NOT NULL,"
      " response_body BLOB, lease_until INTEGER NOT NULL, expires_at INTEGER, attempts INTEGER"
      " NOT NULL DEFAULT 1, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL, PRIMARY KEY"
      " (idem_key, biz_type)) WITHOUT ROWID;"
      "CREATE INDEX IF NOT EXISTS api_idempotency_expires_idx ON api_idempotency (expires_at)"
      " WHERE status <> 'in_progress';"
      "INSERT INTO idem_schema_version VALUES ('api_idempotency', 2, 1);");
}

// A fingerprint as version 2 stores it: its 32 bytes.
std::string packed(const std::string& fp) {
  std::string bytes;
  for (std::size_t i = 0; i + 1 < fp.size(); i += 2) {
    bytes.push_back(static_cast<char>(std::stoi(fp.substr(i, 2), nullptr, 16)));
  }
  return bytes;
}

}  // namespace

// Tables of schema version 2 (status as text, an expiry index) are used as they are: their
// records replay, mismatch and stay busy, their claims complete, new records are written in
// their layout (an older binary still reads them), and the purge works through their index.
TEST(SqliteStore, SchemaTwoTablesStayReadableAndCompletable) {
  idem::test::TempDir dir;
  const std::string fp = idem::fingerprint("amount=10");
  const std::string owner = idem::OwnerToken::generate().str();
  const std::string stored = packed(fp);
  idem::sqlite::SqliteStore store(older_table_file(dir, "v2.sqlite", create_schema_two_table,
                                                   idem::sqlite::Blob{stored}, owner));
  EXPECT_EQ(2, store.schema_version());
  EXPECT_EQ("'completed'", store.status_literal(idem::Record::Status::kCompleted));
  expect_older_table_works(store, fp, owner, "blob");
  auto spelled = [&](const char* id) {
    return store.database()
        .read([&](idem::sqlite::Session& s) {
          return s.query_text(
              "SELECT typeof(status) || ':' || status FROM api_idempotency WHERE idem_key = ?",
              std::string(id));
        })
        .value_or("absent");
  };
  EXPECT_EQ("text:completed", spelled("fresh"));  // the table's own spelling
  EXPECT_EQ("text:completed", spelled("held"));
  expect_older_table_purges_by_age(store, fp);
}

namespace {
void drop_version_rows(const std::string& path) {
  idem::sqlite::Database db(path);
  db.write(
      [](idem::sqlite::Transaction& tx) { tx.exec_script("DELETE FROM idem_schema_version"); });
}

std::optional<std::int64_t> version_row(idem::sqlite::SqliteStore& store) {
  return store.database().read([](idem::sqlite::Session& s) {
    return s.query_int64("SELECT version FROM idem_schema_version WHERE name = 'api_idempotency'");
  });
}
}  // namespace

// A table idem made whose version row is gone (a `.dump` of the table alone, copied into
// another file) is read as the layout it is, and its version row written again.
TEST(SqliteStore, TablesWithoutTheirVersionRowAreReadAsTheirLayout) {
  idem::test::TempDir dir;
  const std::string fp = idem::fingerprint("amount=10");
  const std::string owner = idem::OwnerToken::generate().str();
  {
    const auto path = older_table_file(dir, "v2.sqlite", create_schema_two_table,
                                       idem::sqlite::Blob{packed(fp)}, owner);
    drop_version_rows(path);
    idem::sqlite::SqliteStore store(path);
    EXPECT_EQ(2, store.schema_version());
    EXPECT_EQ(2, version_row(store).value_or(0));
    expect_older_table_works(store, fp, owner, "blob");
  }
  {
    const auto path = older_table_file(dir, "v1.sqlite", create_schema_one_table, fp, owner);
    drop_version_rows(path);
    idem::sqlite::SqliteStore store(path);
    EXPECT_EQ(1, store.schema_version());
    expect_older_table_works(store, fp, owner, "text");
  }
  const auto path = dir.file("v3.sqlite");
  const auto k = idem::Key::make("pay", "made");
  {
    idem::sqlite::SqliteStore store(path);
    ASSERT_EQ(idem::TransactionalStatus::kCommitted,
              store
                  .run_transactional(k, fp, idem::OwnerToken::generate(), std::chrono::seconds(60),
                                     [](idem::sqlite::Transaction&) { return std::string("r"); })
                  .status);
  }
  drop_version_rows(path);
  idem::sqlite::SqliteStore store(path);
  EXPECT_EQ(3, store.schema_version());
  EXPECT_EQ(3, version_row(store).value_or(0));
  auto replay =
      store.run_transactional(k, fp, idem::OwnerToken::generate(), std::chrono::seconds(60),
                              [](idem::sqlite::Transaction&) { return std::string("again"); });
  EXPECT_EQ(idem::TransactionalStatus::kReplayed, replay.status);
  EXPECT_EQ("r", replay.response);
}

// A table adopted by name is checked before idem writes anything to the file: a key column
// that turns keys into numbers, a unique key that does not compare bytes (or none), a missing
// column are each a UsageError naming it.
TEST(SqliteStore, TablesAdoptedByNameAreCheckedBeforeUse) {
  const std::string rest =
      " status TEXT NOT NULL, fingerprint TEXT NOT NULL DEFAULT '', owner TEXT NOT NULL,"
      " response_body BLOB, lease_until INTEGER NOT NULL, expires_at INTEGER,"
      " attempts INTEGER NOT NULL DEFAULT 1, created_at INTEGER NOT NULL,"
      " updated_at INTEGER NOT NULL";
  struct Case {
    std::string ddl;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"idem_key INTEGER NOT NULL, biz_type TEXT NOT NULL," + rest +
           ", UNIQUE (idem_key, biz_type)",
       "declared INTEGER"},
      {"idem_key TEXT NOT NULL, biz_type NUMERIC NOT NULL," + rest +
           ", UNIQUE (idem_key, biz_type)",
       "declared NUMERIC"},
      {"idem_key TEXT COLLATE NOCASE NOT NULL, biz_type TEXT NOT NULL," + rest +
           ", UNIQUE (idem_key, biz_type)",
       "compares bytes"},
      {"idem_key TEXT NOT NULL, biz_type TEXT NOT NULL," + rest, "unique key"},
      {"idem_key TEXT NOT NULL, biz_type TEXT NOT NULL," + rest +
           ", UNIQUE (idem_key, biz_type, status)",
       "unique key"},
      {"idem_key TEXT NOT NULL, biz_type TEXT NOT NULL, status TEXT NOT NULL,"
       " UNIQUE (idem_key, biz_type)",
       "no column 'fingerprint'"},
      {"idem_key TEXT NOT NULL, biz_type TEXT NOT NULL, tenant TEXT NOT NULL," + rest +
           ", UNIQUE (idem_key, biz_type)",
       "(tenant)"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.ddl);
    idem::test::TempDir dir;
    const auto path = dir.file("adopt.sqlite");
    {
      idem::sqlite::Database db(path);
      db.write([&](idem::sqlite::Transaction& tx) {
        tx.exec_script("CREATE TABLE api_idempotency (" + c.ddl + ")");
      });
    }
    try {
      idem::sqlite::SqliteStore store(path);
      ADD_FAILURE() << "adopted";
    } catch (const idem::UsageError& e) {
      EXPECT_NE(std::string::npos, std::string(e.what()).find(c.says)) << e.what();
    }
    idem::sqlite::Database db(path);
    EXPECT_EQ(0, db.read([](idem::sqlite::Session& s) {
                     return s.query_int64(
                         "SELECT count(*) FROM sqlite_master WHERE name IN"
                         " ('idem_schema_version', 'api_idempotency_expires_idx')");
                   }).value_or(-1));  // the migration's transaction rolled back
  }
}

// A record table remade by hand under its version row, its key declared COLLATE NOCASE (the
// same columns otherwise): 'Order-1' and 'order-1' were one record, the second key replaying
// the first one's answer. Refused, with migrate and without, before any record.
TEST(SqliteStore, ATableRemadeWithKeysThatIgnoreCaseIsRefused) {
  idem::test::TempDir dir;
  const auto path = dir.file("remade.sqlite");
  { idem::sqlite::SqliteStore made(path); }
  {
    idem::sqlite::Database db(path);
    db.write([](idem::sqlite::Transaction& tx) {
      std::string ddl =
          tx.query_text("SELECT sql FROM sqlite_master WHERE name = 'api_idempotency'").value();
      const std::string key = "idem_key VARCHAR(128) NOT NULL";
      ASSERT_NE(std::string::npos, ddl.find(key)) << ddl;
      ddl.replace(ddl.find(key), key.size(), key + " COLLATE NOCASE");
      tx.exec("DROP TABLE api_idempotency");
      tx.exec_script(ddl);
    });
  }
  for (bool migrate : {true, false}) {
    SCOPED_TRACE(migrate);
    idem::sqlite::SqliteStoreOptions o;
    o.migrate = migrate;
    try {
      idem::sqlite::SqliteStore store(path, o);
      ADD_FAILURE() << "a table whose keys ignore case was used";
    } catch (const idem::UsageError& e) {
      EXPECT_NE(std::string::npos, std::string(e.what()).find("compares bytes")) << e.what();
    }
  }
}

// A table adopted by name need not have an `id` column: its purge names rows by their key.
TEST(SqliteStore, TablesAdoptedWithoutAnIdColumnArePurged) {
  idem::test::TempDir dir;
  const auto path = dir.file("noid.sqlite");
  {
    idem::sqlite::Database db(path);
    db.write([](idem::sqlite::Transaction& tx) {
      tx.exec_script(
          "CREATE TABLE api_idempotency (idem_key TEXT NOT NULL, biz_type TEXT NOT NULL,"
          " status TEXT NOT NULL, fingerprint TEXT NOT NULL DEFAULT '', owner TEXT NOT NULL,"
          " response_body BLOB, lease_until INTEGER NOT NULL, expires_at INTEGER,"
          " attempts INTEGER NOT NULL DEFAULT 1, created_at INTEGER NOT NULL,"
          " updated_at INTEGER NOT NULL, PRIMARY KEY (idem_key, biz_type))");
    });
  }
  idem::ManualClock clock;
  idem::sqlite::SqliteStoreOptions o;
  o.clock = clock.as_clock();
  idem::sqlite::SqliteStore store(path, o);
  EXPECT_EQ(1, store.schema_version());
  const auto done = idem::Key::make("pay", "done");
  const auto busy = idem::Key::make("pay", "busy");
  ASSERT_EQ(
      idem::TransactionalStatus::kCommitted,
      store
          .run_transactional(done, "fp", idem::OwnerToken::generate(), std::chrono::seconds(1),
                             [](idem::sqlite::Transaction&) { return std::string("r"); })
          .status);
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            store.begin(busy, "fp", idem::OwnerToken::generate(), std::chrono::hours(1)).status);
  clock.advance(std::chrono::seconds(5));
  EXPECT_EQ(1u, store.purge_expired(10));
  EXPECT_FALSE(store.lookup(done).has_value());
  EXPECT_TRUE(store.lookup(busy).has_value());
}

// migrate = false reads what is there and writes nothing: no table is created (a missing one
// is a StorageError), a table without its version row keeps none, no write lock is taken; a
// newer version is refused either way.
TEST(SqliteStore, WithoutMigrationNothingIsCreatedOrLocked) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStoreOptions read_only;
  read_only.migrate = false;
  auto db = std::make_shared<idem::sqlite::Database>(dir.file("ro.sqlite"));
  EXPECT_THROW(idem::sqlite::SqliteStore(db, read_only), idem::StorageError);
  auto count = [&](const char* sql) {
    return db->read([&](idem::sqlite::Session& s) { return s.query_int64(sql); }).value_or(-1);
  };
  EXPECT_EQ(0, count("SELECT count(*) FROM sqlite_master"));
  const auto k = idem::Key::make("pay", "k");
  {
    idem::sqlite::SqliteStore made(db);
    (void)made.run_transactional(k, "fp", idem::OwnerToken::generate(), std::chrono::seconds(60),
                                 [](idem::sqlite::Transaction&) { return std::string("r"); });
  }
  db->write(
      [](idem::sqlite::Transaction& tx) { tx.exec_script("DROP TABLE idem_schema_version"); });
  {
    auto held = db->begin();  // a writer: the store neither waits for it nor needs it
    idem::sqlite::SqliteStore store(db, read_only);
    EXPECT_EQ(3, store.schema_version());
    ASSERT_TRUE(store.lookup(k).has_value());
    EXPECT_EQ("r", store.lookup(k)->response);
  }
  EXPECT_EQ(0, count("SELECT count(*) FROM sqlite_master WHERE name = 'idem_schema_version'"));
  db->write([](idem::sqlite::Transaction& tx) {
    tx.exec_script(
        "CREATE TABLE idem_schema_version (name TEXT PRIMARY KEY, version INTEGER NOT NULL,"
        " applied_at INTEGER NOT NULL); INSERT INTO idem_schema_version VALUES"
        " ('api_idempotency', 4, 0)");
  });
  for (bool migrate : {true, false}) {
    idem::sqlite::SqliteStoreOptions o;
    o.migrate = migrate;
    try {
      idem::sqlite::SqliteStore store(db, o);
      ADD_FAILURE() << "a newer table was used, migrate=" << migrate;
    } catch (const idem::StorageError& e) {
      EXPECT_NE(std::string::npos, std::string(e.what()).find("newer than this idem")) << e.what();
    }
  }
}

// A guarded call inside a transactional handler on the same Database would wait for its own
// write lock: it is a UsageError at once, not a retryable timeout after busy_timeout.
TEST(SqliteStore, AWriteInsideTheHandlersOwnTransactionIsAUsageError) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStoreOptions o;
  o.database.busy_timeout = std::chrono::minutes(5);  // a wait would fail the test by timing out
  idem::sqlite::SqliteStore store(dir.file("nested.sqlite"), o);
  idem::IdempotencyGuard guard{store};
  bool refused = false;
  auto r = guard.run(idem::Key::make("order", "outer"), "fp", [&](idem::sqlite::Transaction&) {
    try {
      (void)guard.run(idem::Key::make("stock", "inner"), "fp",
                      [](idem::sqlite::Transaction&) { return std::string("x"); });
    } catch (const idem::UsageError& e) {
      refused = std::string(e.what()).find("already holds") != std::string::npos;
    }
    return std::string("outer");
  });
  EXPECT_TRUE(refused);
  EXPECT_TRUE(r.ok());
  EXPECT_FALSE(store.lookup(idem::Key::make("stock", "inner")).has_value());
}

// A database file deleted under an open store: its next write (at most a second later) is a
// StorageError rather than a commit into a file no other process will see.
TEST(SqliteStore, AFileDeletedWhileOpenStopsItsWrites) {
  idem::test::TempDir dir;
  const auto path = dir.file("gone.sqlite");
  idem::sqlite::SqliteStore store(path);
  idem::IdempotencyGuard guard{store};
  ASSERT_TRUE(guard
                  .run(idem::Key::make("pay", "1"), "fp",
                       [](idem::sqlite::Transaction&) { return std::string("r"); })
                  .ok());
  ASSERT_EQ(0, std::remove(path.c_str()));
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // past the once-a-second check
  int ran = 0;
  try {
    (void)guard.run(idem::Key::make("pay", "2"), "fp", [&](idem::sqlite::Transaction&) {
      ++ran;
      return std::string("r");
    });
    ADD_FAILURE() << "wrote into a deleted file";
  } catch (const idem::StorageError& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("deleted or replaced")) << e.what();
  }
  // And every write after it, not one a second (the check found the file moved once: the
  // writes within the next second went into the deleted file).
  for (int i = 3; i < 8; ++i) {
    EXPECT_THROW((void)guard.run(idem::Key::make("pay", std::to_string(i)), "fp",
                                 [&](idem::sqlite::Transaction&) {
                                   ++ran;
                                   return std::string("r");
                                 }),
                 idem::StorageError)
        << i;
  }
  EXPECT_EQ(0, ran);
}

// A handler that catches the error of its own statement after SQLite ended the transaction by
// itself (ON CONFLICT ROLLBACK here; SQLITE_FULL or an I/O error alike): its later statements
// and idem's record would each have committed on their own, a replayed "success" with no
// effect behind it. They are refused: nothing of the call is kept, and the retry runs once.
TEST(SqliteStore, AHandlerThatCatchesAnErrorAfterSqliteRolledBackKeepsNothing) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore store(dir.file("ended.sqlite"));
  store.database().write([](idem::sqlite::Transaction& tx) {
    tx.exec_script(
        "CREATE TABLE payment (order_no TEXT PRIMARY KEY);"
        "CREATE TABLE audit (note TEXT);"
        "CREATE TABLE coupon (code TEXT UNIQUE ON CONFLICT ROLLBACK);"
        "INSERT INTO coupon (code) VALUES ('once');");
  });
  idem::IdempotencyGuard guard{store};
  const auto key = idem::Key::make("pay", "ended");
  try {
    (void)guard.run(key, "fp", [](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT INTO payment (order_no) VALUES ('ended')");
      try {
        tx.exec("INSERT INTO coupon (code) VALUES ('once')");  // SQLite rolls back everything
      } catch (const idem::StorageError&) {
        tx.exec("INSERT INTO audit (note) VALUES ('coupon taken')");
      }
      return std::string("paid");
    });
    ADD_FAILURE() << "answered although nothing was kept";
  } catch (const idem::StorageError& e) {
    EXPECT_TRUE(e.retryable()) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("rolled back by SQLite")) << e.what();
  }
  auto count = [&](const char* table) {
    return store.database()
        .read([&](idem::sqlite::Session& s) {
          return s.query_int64(std::string("SELECT count(*) FROM ") + table);
        })
        .value_or(-1);
  };
  EXPECT_EQ(0, count("payment"));
  EXPECT_EQ(0, count("audit"));
  EXPECT_FALSE(store.lookup(key).has_value());
  auto retry = guard.run(key, "fp", [](idem::sqlite::Transaction& tx) {
    tx.exec("INSERT INTO payment (order_no) VALUES ('ended')");
    return std::string("paid");
  });
  EXPECT_EQ(idem::Outcome::kExecuted, retry.outcome);
  EXPECT_EQ(1, count("payment"));
}

TEST(SqliteStore, TheWalIsCutBackToItsLimit) {
  idem::test::TempDir dir;
  idem::sqlite::DatabaseOptions bad;
  bad.journal_size_limit = -2;
  EXPECT_THROW(idem::sqlite::Database(dir.file("bad.sqlite"), bad), idem::UsageError);
  idem::sqlite::Database db(dir.file("wal.sqlite"));
  EXPECT_EQ(64 * 1024 * 1024, db.read([](idem::sqlite::Session& s) {
                                  return s.query_int64("PRAGMA journal_size_limit");
                                }).value_or(-1));
}

// A pool size no machine runs is a usage error at once: every reader opens with the
// Database, and such a size opened descriptors until none was left, then blamed the file.
TEST(SqliteStore, APoolSizeBeyondItsBoundIsAUsageError) {
  idem::test::TempDir dir;
  idem::sqlite::DatabaseOptions o;
  o.pool_size = static_cast<std::size_t>(-1);
  EXPECT_THROW(idem::sqlite::Database(dir.file("huge.sqlite"), o), idem::UsageError);
  o.pool_size = 1025;
  EXPECT_THROW(idem::sqlite::Database(dir.file("huge.sqlite"), o), idem::UsageError);
}

// The steps docs/versioning.md gives to move a version-2 table to version 3, verbatim.
TEST(SqliteStore, SchemaTwoTableMovedToVersionThreeKeepsItsRecords) {
  idem::test::TempDir dir;
  const std::string fp = idem::fingerprint("amount=10");
  const std::string owner = idem::OwnerToken::generate().str();
  const std::string stored = packed(fp);
  const auto path = older_table_file(dir, "move3.sqlite", create_schema_two_table,
                                     idem::sqlite::Blob{stored}, owner);
  {
    idem::sqlite::Database db(path);
    db.write([](idem::sqlite::Transaction& tx) {
      tx.exec_script(
          "CREATE TABLE api_idempotency_v3 ("
          "  idem_key VARCHAR(128) NOT NULL, biz_type VARCHAR(64) NOT NULL,"
          "  status INTEGER NOT NULL CHECK (status = 0 OR status = 1 OR status = 2),"
          "  fingerprint BLOB NOT NULL DEFAULT '', owner VARCHAR(32) NOT NULL, response_body BLOB,"
          "  lease_until INTEGER NOT NULL, expires_at INTEGER, attempts INTEGER NOT NULL DEFAULT 1,"
          "  created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,"
          "  PRIMARY KEY (idem_key, biz_type)) WITHOUT ROWID;"
          "INSERT INTO api_idempotency_v3"
          "  SELECT idem_key, biz_type,"
          "         CASE status WHEN 'in_progress' THEN 0 WHEN 'completed' THEN 1"
          "                     WHEN 'failed' THEN 2 END,"
          "         fingerprint, owner, response_body, lease_until, expires_at, attempts,"
          "         created_at, updated_at"
          "  FROM api_idempotency;"
          "DROP TABLE api_idempotency;"
          "ALTER TABLE api_idempotency_v3 RENAME TO api_idempotency;"
          "UPDATE idem_schema_version SET version = 3 WHERE name = 'api_idempotency';");
    });
  }
  idem::sqlite::SqliteStore store(path);
  EXPECT_EQ(3, store.schema_version());
  const auto done = idem::Key::make("pay", "done");
  auto replay = store.begin(done, fp, idem::OwnerToken::generate(), std::chrono::seconds(30));
  EXPECT_EQ(idem::ClaimStatus::kDone, replay.status);
  EXPECT_EQ("pay_1", replay.response);
  const auto held = idem::Key::make("pay", "held");
  EXPECT_EQ(idem::ClaimStatus::kBusy,
            store.begin(held, fp, idem::OwnerToken::generate(), std::chrono::seconds(30)).status);
  EXPECT_TRUE(store.complete(held, idem::OwnerToken::from_string(owner), "pay_2",
                             std::chrono::seconds(60)));
  EXPECT_EQ("pay_2", store.lookup(held)->response);
  EXPECT_EQ(1u, store.purge_expired());  // "old", found by walking the key
  EXPECT_FALSE(store.lookup(idem::Key::make("pay", "old")).has_value());
  EXPECT_EQ(0, store.database()
                   .read([](idem::sqlite::Session& s) {
                     return s.query_int64(
                         "SELECT count(*) FROM sqlite_master WHERE type = 'index' AND sql IS NOT"
                         " NULL");
                   })
                   .value_or(-1));
}

// Version 3's purge walks the primary key `batch_size` rows per transaction: across batch
// boundaries it deletes exactly the completed and failed records whose retention ended, never
// an in-progress one (whatever its times) or a live one, and a second pass finds nothing.
TEST(SqliteStore, PurgeWalksTheKeyAcrossBatches) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore store(dir.file("purge3.sqlite"),
                                  idem::sqlite::SqliteStoreOptions::mq_consume_record());
  ASSERT_EQ(3, store.schema_version());
  const auto now = idem::to_millis(idem::system_now());
  int expired = 0, kept = 0;
  store.database().write([&](idem::sqlite::Transaction& tx) {
    const std::string insert =
        "INSERT INTO mq_consume_record (message_id, consumer_group, status, fingerprint, owner,"
        " lease_until, expires_at, created_at, updated_at) VALUES (?1, ?2, ?3, '', 'o', ?4, ?5,"
        " 1, 1)";
    for (int i = 0; i < 500; ++i) {
      const std::string id = "m" + std::to_string(i * 7919 % 500);  // out of key order
      const std::string group = i % 3 == 0 ? "a" : "b";
      switch (i % 5) {
        case 0:  // completed, retention over
          tx.exec(insert, id, group, 1, now, now - 1);
          ++expired;
          break;
        case 1:  // failed, retention over
          tx.exec(insert, id, group, 2, now, now - 1000);
          ++expired;
          break;
        case 2:  // completed, live
          tx.exec(insert, id, group, 1, now, now + 3'600'000);
          ++kept;
          break;
        case 3:  // in progress, lease and expiry long past: never the purge's
          tx.exec(insert, id, group, 0, now - 5000, now - 5000);
          ++kept;
          break;
        default:  // completed without an expiry
          tx.exec(insert, id, group, 1, now, nullptr);
          ++kept;
          break;
      }
    }
  });
  EXPECT_EQ(static_cast<std::size_t>(expired), store.purge_expired(7));
  auto count = [&](const std::string& where) {
    return store.database()
        .read([&](idem::sqlite::Session& s) {
          return s.query_int64("SELECT count(*) FROM mq_consume_record WHERE " + where);
        })
        .value_or(-1);
  };
  EXPECT_EQ(kept, count("1"));
  EXPECT_EQ(0, count("status <> 0 AND expires_at <= " + std::to_string(now)));
  EXPECT_EQ(100, count("status = 0"));
  EXPECT_EQ(0u, store.purge_expired(7));
  EXPECT_EQ(0u, store.purge_expired(1000));
  EXPECT_THROW(store.purge_expired(0), idem::UsageError);
  // By age (every row above was written at 1 ms): nothing written before 1 ms, then every
  // finished row, 100 of them in batches of 7 (and 100 exactly in a batch of 100: the walk's
  // last batch ends on the table's last row).
  EXPECT_EQ(0u, store.purge_older_than(idem::from_millis(1), 7));
  EXPECT_EQ(static_cast<std::size_t>(kept - 100), store.purge_older_than(idem::from_millis(2), 7));
  EXPECT_EQ(100, count("1"));
  EXPECT_EQ(100, count("status = 0"));
  EXPECT_EQ(0u, store.purge_older_than(idem::from_millis(2), 100));
  EXPECT_THROW(store.purge_older_than(idem::from_millis(2), 0), idem::UsageError);
}

// Both purges run over and over, in batches of 3, while four threads run guarded first
// executions and replays on keys that sort between the old rows: the purges delete exactly the
// old finished rows (their sum is their number), never an in-progress claim or a record a writer
// just completed; every writer call is answered, each handler ran once, every replay answered
// the first response.
TEST(SqliteStore, PurgesNextToWritersDeleteOnlyWhatTheyMay) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore store(dir.file("purge_writers.sqlite"));
  store.database().write([](idem::sqlite::Transaction& tx) {
    tx.exec("CREATE TABLE effects (key_id TEXT NOT NULL)");
  });
  const auto now = idem::to_millis(idem::system_now());
  constexpr int kOld = 1000;
  int old_finished = 0;
  store.database().write([&](idem::sqlite::Transaction& tx) {
    const std::string insert =
        "INSERT INTO api_idempotency (idem_key, biz_type, status, fingerprint, owner,"
        " response_body, lease_until, expires_at, created_at, updated_at)"
        " VALUES (?1, 'pay', ?2, '', 'o', 'r', 1, ?3, 1, 1)";
    for (int i = 0; i < kOld; ++i) {
      char id[8];
      std::snprintf(id, sizeof id, "p%04d", i);
      switch (i % 3) {
        case 0:  // completed, retention over: both purges may take it
          tx.exec(insert, std::string(id), 1, now - 1);
          ++old_finished;
          break;
        case 1:  // completed, retention running, written long ago: the age purge's
          tx.exec(insert, std::string(id), 1, now + 3'600'000);
          ++old_finished;
          break;
        default:  // in progress, lease and expiry long past: neither purge's
          tx.exec(insert, std::string(id), 0, now - 1);
          break;
      }
    }
  });
  const auto cutoff = idem::from_millis(now);  // every writer's record is written after it
  constexpr int kThreads = 4, kCalls = 250;
  std::atomic<int> writers_left{kThreads};
  std::atomic<int> executed{0}, replayed_right{0}, wrong{0};
  std::size_t purged = 0;
  std::atomic<int> errors{0};  // exceptions, counted rather than ending the process
  std::thread purger([&] {
    try {
      do {
        purged += store.purge_expired(3);
        purged += store.purge_older_than(cutoff, 3);
      } while (writers_left.load() > 0);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "purge: " << e.what();
      ++errors;
    }
  });
  std::vector<std::thread> writers;
  for (int t = 0; t < kThreads; ++t) {
    writers.emplace_back([&, t] {
      idem::IdempotencyGuard<idem::sqlite::SqliteStore> guard{store};
      for (int i = 0; i < kCalls; ++i) {
        char id[16];
        std::snprintf(id, sizeof id, "p%04dw%d", i * kThreads + t, t);
        const auto key = idem::Key::make("pay", id);
        for (int attempt = 0; attempt < 2; ++attempt) {
          try {
            auto r = guard.run(key, "", [&](idem::sqlite::Transaction& tx) {
              tx.exec("INSERT INTO effects (key_id) VALUES (?)", std::string(id));
              return std::string(id);
            });
            if (attempt == 0 && r.outcome == idem::Outcome::kExecuted && r.value == id) {
              ++executed;
            } else if (attempt == 1 && r.outcome == idem::Outcome::kReplayed && r.value == id) {
              ++replayed_right;
            } else {
              ++wrong;
            }
          } catch (const std::exception& e) {
            ADD_FAILURE() << id << ": " << e.what();
            ++errors;
          }
        }
      }
      --writers_left;
    });
  }
  for (auto& w : writers) w.join();
  purger.join();
  purged += store.purge_expired(3);
  purged += store.purge_older_than(cutoff, 3);
  EXPECT_EQ(kThreads * kCalls, executed.load());
  EXPECT_EQ(kThreads * kCalls, replayed_right.load());
  EXPECT_EQ(0, wrong.load());
  EXPECT_EQ(0, errors.load());
  EXPECT_EQ(static_cast<std::size_t>(old_finished), purged);
  auto count = [&](const std::string& sql) {
    return store.database()
        .read([&](idem::sqlite::Session& s) { return s.query_int64(sql); })
        .value_or(-1);
  };
  EXPECT_EQ(kThreads * kCalls, count("SELECT count(*) FROM effects"));
  EXPECT_EQ(kThreads * kCalls, count("SELECT count(DISTINCT key_id) FROM effects"));
  EXPECT_EQ(kOld - old_finished,
            count("SELECT count(*) FROM api_idempotency WHERE idem_key NOT LIKE '%w%'"));
  EXPECT_EQ(kOld - old_finished, count("SELECT count(*) FROM api_idempotency WHERE status = 0"));
  EXPECT_EQ(kThreads * kCalls, count("SELECT count(*) FROM api_idempotency WHERE status = 1"
                                     " AND idem_key = CAST(response_body AS TEXT)"));
}

// A table of that name that idem did not create (adopted by name) keeps its own layout.
TEST(SqliteStore, TablesAdoptedByNameKeepTheirLayout) {
  idem::test::TempDir dir;
  auto db = std::make_shared<idem::sqlite::Database>(dir.file("adopt.sqlite"));
  db->write([](idem::sqlite::Transaction& tx) {
    tx.exec_script(
        "CREATE TABLE mq_consume_record (id INTEGER PRIMARY KEY, message_id TEXT NOT NULL,"
        " consumer_group TEXT NOT NULL, status TEXT NOT NULL, fingerprint TEXT NOT NULL DEFAULT"
        " '', owner TEXT NOT NULL, response_body BLOB, lease_until INTEGER NOT NULL, expires_at"
        " INTEGER, attempts INTEGER NOT NULL DEFAULT 1, created_at INTEGER NOT NULL, updated_at"
        " INTEGER NOT NULL, UNIQUE (message_id, consumer_group))");
  });
  idem::sqlite::SqliteStore store(db, idem::sqlite::SqliteStoreOptions::mq_consume_record());
  auto version = db->read([](idem::sqlite::Session& s) {
    return s.query_int64(
        "SELECT version FROM idem_schema_version WHERE name = 'mq_consume_record'");
  });
  EXPECT_EQ(1, version.value_or(0));
  const auto key = idem::Key::make("billing", "m-1");
  const std::string fp = idem::fingerprint("m-1");
  auto r = store.run_transactional(key, fp, idem::OwnerToken::generate(), std::chrono::seconds(1),
                                   [](idem::sqlite::Transaction&) { return std::string("acked"); });
  EXPECT_EQ(idem::TransactionalStatus::kCommitted, r.status);
  EXPECT_EQ(fp, store.lookup(key)->fingerprint);
  auto count = [&](const char* sql) {
    return db->read([&](idem::sqlite::Session& s) { return s.query_int64(sql); }).value_or(-1);
  };
  EXPECT_EQ(1, count("SELECT count(*) FROM mq_consume_record WHERE typeof(fingerprint) = 'text'"));
}

// Layout 3 (tables created since schema 3; 2 had the same key and fingerprints): WITHOUT ROWID
// on (key, scope), no other index, the status as an integer, idem fingerprints as 32 raw
// bytes; any other fingerprint round-trips as text (a 32-byte one too).
TEST(SqliteStore, LayoutThreeKeysByTheKeyAndPacksFingerprints) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore store(dir.file("v3.sqlite"));
  auto count = [&](const std::string& sql) {
    return store.database()
        .read([&](idem::sqlite::Session& s) { return s.query_int64(sql); })
        .value_or(-1);
  };
  auto ddl = store.database().read([](idem::sqlite::Session& s) {
    return s.query_text("SELECT sql FROM sqlite_master WHERE name = 'api_idempotency'");
  });
  ASSERT_TRUE(ddl.has_value());
  EXPECT_NE(std::string::npos, ddl->find("WITHOUT ROWID")) << *ddl;
  EXPECT_EQ(0, count("SELECT count(*) FROM sqlite_master WHERE type = 'index' AND tbl_name ="
                     " 'api_idempotency' AND sql IS NOT NULL"));  // no index but the key
  const std::string hex = idem::fingerprint("x");
  std::string upper = hex;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  int n = 0;
  for (const std::string& fp : {hex, std::string(), std::string("fp"), upper, hex.substr(32),
                                hex.substr(1), hex + "0", std::string("a\0b", 3)}) {
    SCOPED_TRACE(fp);
    for (bool two_phase : {false, true}) {
      const auto key = idem::Key::make("pay", "k" + std::to_string(n++));
      const auto owner = idem::OwnerToken::generate();
      if (two_phase) {
        ASSERT_EQ(idem::ClaimStatus::kClaimed,
                  store.begin(key, fp, owner, std::chrono::seconds(30)).status);
        EXPECT_EQ(
            idem::ClaimStatus::kBusy,
            store.begin(key, fp, idem::OwnerToken::generate(), std::chrono::seconds(30)).status);
        ASSERT_TRUE(store.complete(key, owner, "r", std::chrono::seconds(60)));
      } else {
        ASSERT_EQ(
            idem::TransactionalStatus::kCommitted,
            store
                .run_transactional(key, fp, owner, std::chrono::seconds(60),
                                   [](idem::sqlite::Transaction&) { return std::string("r"); })
                .status);
      }
      EXPECT_EQ(fp == hex ? "blob" : "text", stored_type(store, key));
      EXPECT_EQ(fp, store.lookup(key)->fingerprint);
      auto again = store.begin(key, fp, idem::OwnerToken::generate(), std::chrono::seconds(30));
      EXPECT_EQ(idem::ClaimStatus::kDone, again.status);
      EXPECT_EQ("r", again.response);
      EXPECT_EQ(owner.str(), again.holder);
      EXPECT_EQ(idem::ClaimStatus::kMismatch,
                store.begin(key, fp + "!", idem::OwnerToken::generate(), std::chrono::seconds(30))
                    .status);
    }
  }
  EXPECT_EQ(2, count("SELECT count(*) FROM api_idempotency WHERE length(fingerprint) = 32 AND"
                     " typeof(fingerprint) = 'blob'"));
  EXPECT_EQ(n, count("SELECT count(*) FROM api_idempotency WHERE typeof(status) = 'integer'"
                     " AND status = 1"));
  // The purge walks the key (two rows per transaction here) and deletes the expired rows.
  store.database().write([](idem::sqlite::Transaction& tx) {
    tx.exec("UPDATE api_idempotency SET expires_at = 1 WHERE idem_key IN ('k0', 'k1', 'k2')");
  });
  EXPECT_EQ(3u, store.purge_expired(2));
  EXPECT_EQ(n - 3, count("SELECT count(*) FROM api_idempotency"));
  // A packed fingerprint of another length is a corrupt record, never a silent mismatch.
  store.database().write([](idem::sqlite::Transaction& tx) {
    tx.exec("UPDATE api_idempotency SET fingerprint = x'0102' WHERE idem_key = 'k3'");
  });
  const auto k3 = idem::Key::make("pay", "k3");
  EXPECT_THROW(store.lookup(k3), idem::CorruptRecord);
  // The same through a claim's read (the precheck, and the write transaction when hinted).
  EXPECT_THROW((void)store.begin(k3, hex, idem::OwnerToken::generate(), std::chrono::seconds(30)),
               idem::CorruptRecord);
  bool ran = false;
  EXPECT_THROW((void)store.run_transactional(
                   k3, hex, idem::OwnerToken::generate(), std::chrono::seconds(60),
                   [&](idem::sqlite::Transaction&) {
                     ran = true;
                     return std::string("x");
                   },
                   idem::DurableHint{true}),
               idem::CorruptRecord);
  EXPECT_FALSE(ran);
}

TEST(SqliteStore, RejectsBadIdentifiers) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStoreOptions o;
  o.table = "api; DROP TABLE x";
  EXPECT_THROW(idem::sqlite::SqliteStore(dir.file("x.sqlite"), o), idem::UsageError);
  o.table = "ok";
  o.key_column = "1bad";
  EXPECT_THROW(idem::sqlite::SqliteStore(dir.file("x.sqlite"), o), idem::UsageError);
}

TEST(SqliteStore, UnopenablePathIsUnavailable) {
  try {
    idem::sqlite::SqliteStore store("/nonexistent-dir/x/y.sqlite");
    ADD_FAILURE() << "opened";
  } catch (const idem::StorageUnavailable& e) {
    EXPECT_NE(std::string::npos,
              std::string(e.what()).find("directory '/nonexistent-dir/x/' does not exist"))
        << e.what();
  }
}

// An empty path is a UsageError (SQLite would open a private temporary file and every record
// would be gone at the next start); a path that is a directory is a StorageError no retry
// mends.
TEST(SqliteStore, AnEmptyPathOrADirectoryIsRefusedForGood) {
  EXPECT_THROW(idem::sqlite::SqliteStore(""), idem::UsageError);
  EXPECT_THROW(idem::sqlite::Database(""), idem::UsageError);
  idem::test::TempDir dir;
  std::filesystem::create_directory(dir.file("a-directory"));
  try {
    idem::sqlite::SqliteStore store(dir.file("a-directory"));
    ADD_FAILURE() << "opened a directory";
  } catch (const idem::StorageError& e) {
    EXPECT_FALSE(e.retryable()) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("is a directory")) << e.what();
  }
}

// Several connections opening one new file at once: the switch to WAL answers SQLITE_BUSY at
// once (no busy handler there); each open waits its turn within busy_timeout instead of
// failing ("database is locked" from a constructor). Separate processes meet the same lock.
TEST(SqliteDatabase, ConnectionsOpeningOneNewFileTogetherAllComeUp) {
  idem::test::TempDir dir;
  int failed = 0;
  std::string first_error;
  for (int round = 0; round < 30; ++round) {
    const std::string path = dir.file("new-" + std::to_string(round) + ".sqlite");
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    std::vector<std::string> errors(6);
    for (int t = 0; t < 6; ++t) {
      threads.emplace_back([&, t] {
        ++ready;
        while (ready.load() < 6) std::this_thread::yield();
        try {
          idem::sqlite::DatabaseOptions o;
          o.pool_size = 1;
          idem::sqlite::Database db(path, o);
        } catch (const std::exception& e) {
          errors[t] = e.what();
        }
      });
    }
    for (auto& th : threads) th.join();
    for (auto& e : errors) {
      if (e.empty()) continue;
      ++failed;
      if (first_error.empty()) first_error = e;
    }
  }
  EXPECT_EQ(0, failed) << first_error;
}

// A database that cannot be written (here: the connection set read-only, SQLITE_READONLY as a
// read-only file or mount gives it) stays so until someone changes it: a StorageError (500),
// not a retryable StorageUnavailable (503 with Retry-After).
TEST(SqliteStore, ADatabaseThatCannotBeWrittenIsAStorageErrorNotRetryable) {
  idem::test::TempDir dir;
  idem::sqlite::Database db(dir.file("ro.sqlite"));
  db.write([](idem::sqlite::Transaction& tx) {
    tx.exec("CREATE TABLE t (v INTEGER)");
    tx.exec("PRAGMA query_only = 1");
  });
  try {
    db.write([](idem::sqlite::Transaction& tx) { tx.exec("INSERT INTO t (v) VALUES (1)"); });
    ADD_FAILURE() << "a read-only database accepted a write";
  } catch (const idem::StorageError& e) {
    EXPECT_EQ(idem::errc::kStorageError, e.code()) << e.what();
    EXPECT_FALSE(e.retryable());
    EXPECT_NE(std::string::npos, std::string(e.what()).find("readonly")) << e.what();
  }
}

TEST(SqliteStore, FailedRecordReplaysItsReason) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore store(dir.file("f.sqlite"));
  auto key = idem::Key::make("billing", "poison");
  auto o = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed, store.begin(key, "", o, std::chrono::seconds(30)).status);
  EXPECT_TRUE(store.fail(key, o, "too many attempts", std::chrono::seconds(60)));
  auto r = store.begin(key, "", idem::OwnerToken::generate(), std::chrono::seconds(30));
  EXPECT_EQ(idem::ClaimStatus::kDone, r.status);
  EXPECT_TRUE(r.failed);
  EXPECT_EQ("too many attempts", r.response);
}

// Transactional mode writes the record once, completed, after the handler: inside the
// handler there is no row yet; afterwards one completed row. No AUTOINCREMENT bookkeeping.
TEST(SqliteStore, TransactionalRecordIsWrittenOnceAlreadyCompleted) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore store(dir.file("once.sqlite"));
  auto key = idem::Key::make("pay", "k1");
  long long rows_inside = -1;
  auto r = store.run_transactional(
      key, "fp", idem::OwnerToken::generate(), std::chrono::seconds(60),
      [&](idem::sqlite::Transaction& tx) {
        rows_inside = tx.query_int64("SELECT count(*) FROM api_idempotency").value_or(-1);
        return std::string("v");
      });
  EXPECT_EQ(idem::TransactionalStatus::kCommitted, r.status);
  EXPECT_EQ(0, rows_inside);
  auto rec = store.lookup(key);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
  EXPECT_EQ("v", rec->response);
  EXPECT_EQ("fp", rec->fingerprint);
  EXPECT_GT(rec->expires_at, idem::system_now());
  auto sequences = store.database().read([](idem::sqlite::Session& s) {
    return s.query_int64("SELECT count(*) FROM sqlite_master WHERE name = 'sqlite_sequence'");
  });
  EXPECT_EQ(0, sequences.value_or(-1));
}

// An in-progress row left by a crashed two-phase attempt is taken over by a transactional run
// once its lease ended: completed for the new owner, attempts counted.
TEST(SqliteStore, TransactionalRunTakesOverAnExpiredTwoPhaseRecord) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore store(dir.file("takeover.sqlite"));
  auto key = idem::Key::make("pay", "k2");
  auto crashed = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            store.begin(key, "fp", crashed, std::chrono::milliseconds(100)).status);
  auto busy =
      store.run_transactional(key, "fp", idem::OwnerToken::generate(), std::chrono::seconds(60),
                              [](idem::sqlite::Transaction&) { return std::string("x"); });
  EXPECT_EQ(idem::TransactionalStatus::kBusy, busy.status);
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  auto fresh = idem::OwnerToken::generate();
  auto r = store.run_transactional(key, "fp", fresh, std::chrono::seconds(60),
                                   [](idem::sqlite::Transaction&) { return std::string("y"); });
  EXPECT_EQ(idem::TransactionalStatus::kCommitted, r.status);
  EXPECT_TRUE(r.took_over);
  auto rec = store.lookup(key);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
  EXPECT_EQ("y", rec->response);
  EXPECT_EQ(fresh.str(), rec->owner);
  EXPECT_FALSE(store.complete(key, crashed, "late", std::chrono::seconds(60)));
  auto attempts = store.database().read([](idem::sqlite::Session& s) {
    return s.query_int64("SELECT attempts FROM api_idempotency");
  });
  EXPECT_EQ(2, attempts.value_or(0));
}

TEST(SqliteStore, InMemoryDatabaseWorksWithOneConnection) {
  idem::sqlite::SqliteStore store(":memory:");
  idem::IdempotencyGuard guard{store};
  auto key = idem::Key::make("s", "k");
  auto a = guard.run(key, "", [](idem::sqlite::Transaction&) { return std::string("v"); });
  auto b = guard.run(key, "", [](idem::sqlite::Transaction&) { return std::string("w"); });
  EXPECT_EQ(idem::Outcome::kReplayed, b.outcome);
  EXPECT_EQ("v", b.value.value());
  (void)a;
}

// BEGIN IMMEDIATE, COMMIT and ROLLBACK run as statements prepared once per connection: a COMMIT
// that fails (a deferred foreign key) rolls back and throws, and the connection's next
// transactions, committed and rolled back, work as before.
TEST(SqliteDatabase, FailedCommitRollsBackAndLaterTransactionsWork) {
  idem::test::TempDir dir;
  idem::sqlite::Database db(dir.file("tx.sqlite"));
  db.write([](idem::sqlite::Transaction& tx) {
    tx.exec_script(
        "CREATE TABLE parent (id INTEGER PRIMARY KEY);"
        "CREATE TABLE child (id INTEGER PRIMARY KEY, parent_id INTEGER"
        " REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED);");
  });
  auto children = [&] {
    return db.read([](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM child").value_or(-1);
    });
  };
  for (int round = 0; round < 3; ++round) {
    EXPECT_THROW(db.write([](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT INTO child (parent_id) VALUES (42)");  // no parent 42: COMMIT fails
    }),
                 idem::StorageError);
    EXPECT_EQ(round, children());
    db.write([&](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT INTO parent (id) VALUES (?)", 100 + round);
      tx.exec("INSERT INTO child (parent_id) VALUES (?)", 100 + round);
    });
    EXPECT_EQ(round + 1, children());
    {
      auto tx = db.begin();  // rolled back when it goes out of scope
      tx.exec("INSERT INTO parent (id) VALUES (?)", 200 + round);
    }
  }
  EXPECT_EQ(3, db.read([](idem::sqlite::Session& s) {
    return s.query_int64("SELECT count(*) FROM parent").value_or(-1);
  }));
}

// read_short() uses the writer's connection only while no transaction holds it: next to an
// open write transaction (of its own thread or another) it reads the committed snapshot on a
// pooled connection, without waiting for the writer (a wait would outlast the 100 ms busy
// timeout and throw) and without its uncommitted rows; and it sees every commit, this
// Database's and another's on the same file.
TEST(SqliteDatabase, ShortReadsSeeCommittedRowsAndNeverWaitForAWriter) {
  idem::test::TempDir dir;
  const auto path = dir.file("short.sqlite");
  idem::sqlite::DatabaseOptions options;
  options.busy_timeout = std::chrono::milliseconds(100);
  idem::sqlite::Database db(path, options);
  idem::sqlite::Database other_db(path, options);  // another process's connections, in effect
  db.write([](idem::sqlite::Transaction& tx) { tx.exec("CREATE TABLE t (id INTEGER)"); });
  auto count = [&] {
    return db.read_short([](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM t").value_or(-1);
    });
  };
  EXPECT_EQ(0, count());
  for (int i = 1; i <= 3; ++i) {
    (i == 2 ? other_db : db).write([&](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT INTO t (id) VALUES (?)", i);
    });
    EXPECT_EQ(i, count());
  }
  {
    auto tx = db.begin();
    tx.exec("INSERT INTO t (id) VALUES (4)");
    EXPECT_EQ(3, count());  // this thread holds the writer
    std::int64_t seen = -1;
    std::thread reader([&] {
      try {
        seen = count();
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    });
    reader.join();
    EXPECT_EQ(3, seen);
    tx.commit();
  }
  EXPECT_EQ(4, count());
  db.write([&](idem::sqlite::Transaction& tx) {
    tx.exec("INSERT INTO t (id) VALUES (5)");
    EXPECT_EQ(4, count());
  });
  EXPECT_EQ(5, count());
}

// The statement cache keeps its own copy of each statement's text: a caller's buffer that
// changes after a prepare names another statement.
TEST(SqliteDatabase, StatementCacheDoesNotDependOnTheCallersBuffer) {
  idem::sqlite::Database db(":memory:");
  std::string sql = "SELECT 1";
  auto first = db.write([&](idem::sqlite::Transaction& tx) { return tx.query_int64(sql); });
  sql[7] = '2';
  auto second = db.write([&](idem::sqlite::Transaction& tx) { return tx.query_int64(sql); });
  sql = std::string("SELECT ") + "1";  // another buffer, the first text: the cached statement
  auto third = db.write([&](idem::sqlite::Transaction& tx) { return tx.query_int64(sql); });
  EXPECT_EQ(1, first.value_or(0));
  EXPECT_EQ(2, second.value_or(0));
  EXPECT_EQ(1, third.value_or(0));
}

// Statement::column reads a column whole (type, and integer or bytes) without converting it,
// and agrees with the one-value accessors; bytes may hold NULs and are empty for NULL.
TEST(SqliteDatabase, ColumnReadsTypeAndValueWithoutConversion) {
  idem::sqlite::Database db(":memory:");
  db.write([](idem::sqlite::Transaction& tx) {
    const std::string with_nul("a\0b", 3);
    idem::sqlite::Statement st = tx.prepare("SELECT 42, 'text', ?1, NULL, 1.5, '', x''");
    st.bind(1, idem::sqlite::Blob{with_nul});
    ASSERT_TRUE(st.step());
    using Type = idem::sqlite::Statement::Type;
    const auto integer = st.column(0);
    EXPECT_EQ(Type::kInteger, integer.type);
    EXPECT_EQ(42, integer.integer);
    EXPECT_TRUE(integer.bytes.empty());
    const auto text = st.column(1);
    EXPECT_EQ(Type::kText, text.type);
    EXPECT_EQ("text", text.bytes);
    EXPECT_EQ(0, text.integer);
    const auto blob = st.column(2);
    EXPECT_EQ(Type::kBlob, blob.type);
    EXPECT_EQ(with_nul, blob.bytes);
    EXPECT_EQ(Type::kNull, st.column(3).type);
    EXPECT_TRUE(st.column(3).bytes.empty());
    const auto real = st.column(4);
    EXPECT_EQ(Type::kFloat, real.type);
    EXPECT_TRUE(real.bytes.empty());  // not converted to text
    EXPECT_DOUBLE_EQ(1.5, st.column_double(4));
    EXPECT_EQ(Type::kText, st.column(5).type);
    EXPECT_TRUE(st.column(5).bytes.empty());
    EXPECT_EQ(Type::kBlob, st.column(6).type);
    // The same row through the one-value accessors.
    EXPECT_EQ(st.column_view(1), st.column(1).bytes);
    EXPECT_EQ(st.column_int64(0), st.column(0).integer);
  });
}

// DatabaseOptions::mmap_size and cache_size_kib reach every connection (the pool's readers and
// the writer); 0 keeps SQLite's own page cache size; negative values are refused.
TEST(SqliteDatabase, MmapAndCacheSizesApplyToEveryConnection) {
  idem::test::TempDir dir;
  auto pragma = [](idem::sqlite::Session& s, const char* name) {
    return s.query_int64(std::string("PRAGMA ") + name).value_or(-1);
  };
  idem::sqlite::DatabaseOptions o;
  o.pool_size = 2;
  o.mmap_size = 64 << 20;
  o.cache_size_kib = 8192;
  idem::sqlite::Database db(dir.file("sizes.sqlite"), o);
  EXPECT_EQ(64 << 20,
            db.write([&](idem::sqlite::Transaction& tx) { return pragma(tx, "mmap_size"); }));
  EXPECT_EQ(-8192,
            db.write([&](idem::sqlite::Transaction& tx) { return pragma(tx, "cache_size"); }));
  // Both readers, held at once: each is its own connection.
  db.read([&](idem::sqlite::Session& outer) {
    db.read([&](idem::sqlite::Session& inner) {
      EXPECT_NE(outer.native_handle(), inner.native_handle());
      for (auto* s : {&outer, &inner}) {
        EXPECT_EQ(64 << 20, pragma(*s, "mmap_size"));
        EXPECT_EQ(-8192, pragma(*s, "cache_size"));
      }
    });
  });

  idem::sqlite::DatabaseOptions off;
  off.mmap_size = 0;
  idem::sqlite::Database plain(dir.file("plain.sqlite"), off);
  EXPECT_EQ(0, plain.read([&](idem::sqlite::Session& s) { return pragma(s, "mmap_size"); }));
  EXPECT_EQ(-2000, plain.read([&](idem::sqlite::Session& s) { return pragma(s, "cache_size"); }));

  for (auto bad : {std::make_pair(-1LL, 0LL), std::make_pair(0LL, -1LL)}) {
    idem::sqlite::DatabaseOptions b;
    b.mmap_size = bad.first;
    b.cache_size_kib = bad.second;
    EXPECT_THROW(idem::sqlite::Database(dir.file("bad.sqlite"), b), idem::UsageError);
  }
}

// Every SQLite wait is bounded by DatabaseOptions::busy_timeout and ends in a typed error:
// another process holding the file's write lock (BEGIN IMMEDIATE waits in SQLite's busy
// handler), this process's writer lock, and the one connection of a ":memory:" database.
TEST(SqliteStore, AWriteLockHeldElsewhereEndsInStorageTimeoutAndTheRetryRunsOnce) {
  idem::test::TempDir dir;
  const std::string path = dir.file("busy.sqlite");
  idem::sqlite::DatabaseOptions quick;
  quick.busy_timeout = std::chrono::milliseconds(200);
  auto db = std::make_shared<idem::sqlite::Database>(path, quick);
  idem::sqlite::SqliteStore store(db);
  idem::IdempotencyGuard guard{store};
  idem::sqlite::Database other_process(path);  // its own connections: its own file locks
  auto key = idem::Key::make("billing", "held");
  int effects = 0;
  auto charge = [&](idem::sqlite::Transaction&) {
    ++effects;
    return std::string("charged");
  };
  {
    auto held = other_process.begin();
    auto t0 = std::chrono::steady_clock::now();
    try {
      (void)guard.run(key, "", charge);
      ADD_FAILURE() << "a held file lock did not stop the call";
    } catch (const idem::StorageTimeout& e) {
      EXPECT_EQ(idem::errc::kStoreTimeout, e.code());
    }
    // Ended by the bound, not by the default 10 s (nor never).
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
    held.rollback();
  }
  {
    // A write transaction of this process (a long business transaction, say) holds the
    // in-process writer lock: a call on another thread waits for it, bounded the same way.
    auto mine = db->begin();
    std::thread other_thread([&] {
      try {
        (void)guard.run(key, "", charge);
        ADD_FAILURE() << "two write transactions at once";
      } catch (const idem::StorageTimeout& e) {
        EXPECT_EQ(idem::errc::kStoreTimeout, e.code());
      }
    });
    other_thread.join();
    mine.rollback();
  }
  EXPECT_EQ(0, effects);
  auto r = guard.run(key, "", charge);
  EXPECT_EQ(idem::Outcome::kExecuted, r.outcome);
  EXPECT_EQ(idem::Outcome::kReplayed, guard.run(key, "", charge).outcome);
  EXPECT_EQ(1, effects);
}

TEST(SqliteStore, AnInMemoryDatabaseReaderWaitsForTheWriterNoLongerThanBusyTimeout) {
  idem::sqlite::DatabaseOptions quick;
  quick.busy_timeout = std::chrono::milliseconds(200);
  idem::sqlite::Database db(":memory:", quick);
  db.write([](idem::sqlite::Transaction& tx) { tx.exec("CREATE TABLE t (v INTEGER)"); });
  auto tx = db.begin();
  tx.exec("INSERT INTO t (v) VALUES (1)");
  std::thread reader([&] {
    try {
      (void)db.read(
          [](idem::sqlite::Session& s) { return s.query_int64("SELECT count(*) FROM t"); });
      ADD_FAILURE() << "read the one connection while a writer held it";
    } catch (const idem::StorageTimeout& e) {
      EXPECT_EQ(idem::errc::kStoreTimeout, e.code());
    }
  });
  reader.join();
  tx.commit();
  EXPECT_EQ(1, db.read([](idem::sqlite::Session& s) {
    return s.query_int64("SELECT count(*) FROM t").value_or(-1);
  }));
}

}  // namespace

namespace {

TEST(GuardSteps, HookSeesEveryStepInOrder) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable(dir.file("steps.sqlite"));
  idem::MemoryStore fast;
  std::vector<std::string> seen;
  idem::GuardOptions options;
  options.step_hook = [&](idem::Step s, const idem::Key&) {
    seen.emplace_back(idem::step_name(s));
  };
  idem::IdempotencyGuard guard{fast, durable, options};
  (void)guard.run(idem::Key::make("s", "tx"), "",
                  [](idem::sqlite::Transaction&) { return std::string("r"); });
  EXPECT_EQ((std::vector<std::string>{"fast_claimed", "durable_claimed", "handler_returned",
                                      "durable_committed", "fast_completed"}),
            seen);
  seen.clear();
  (void)guard.run(idem::Key::make("s", "two-phase"), "", [] { return std::string("r"); });
  EXPECT_EQ((std::vector<std::string>{"fast_claimed", "durable_claimed", "handler_returned",
                                      "durable_committed", "fast_completed"}),
            seen);
  seen.clear();
  (void)guard.run(idem::Key::make("s", "tx"), "",
                  [](idem::sqlite::Transaction&) { return std::string("r"); });
  EXPECT_TRUE(seen.empty());  // a replay runs no step
}

TEST(GuardSteps, CrashBeforeTheFastStoreUpdateLosesNothing) {
  // The process "dies" after the durable commit, before the fast store hears of it: the fast
  // claim is left in progress. After its lease, the durable store replays the committed answer.
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable(dir.file("crash.sqlite"));
  idem::ManualClock clock;
  idem::MemoryStoreOptions mo;
  mo.clock = clock.as_clock();
  idem::MemoryStore fast(mo);
  idem::GuardOptions options;
  options.lease = std::chrono::seconds(5);
  options.step_hook = [](idem::Step s, const idem::Key&) {
    if (s == idem::Step::kDurableCommitted) throw std::runtime_error("killed");
  };
  auto key = idem::Key::make("payment", "crash");
  int runs = 0;
  {
    idem::IdempotencyGuard guard{fast, durable, options};
    EXPECT_THROW((void)guard.run(key, "",
                                 [&](idem::sqlite::Transaction&) {
                                   ++runs;
                                   return std::string("pay_1");
                                 }),
                 std::runtime_error);
  }
  idem::IdempotencyGuard guard{fast, durable};
  auto during = guard.run(key, "", [&](idem::sqlite::Transaction&) {
    ++runs;
    return std::string("pay_2");
  });
  EXPECT_EQ(idem::Outcome::kInProgress, during.outcome);  // the stale fast claim still answers
  clock.advance(std::chrono::seconds(6));
  auto after = guard.run(key, "", [&](idem::sqlite::Transaction&) {
    ++runs;
    return std::string("pay_3");
  });
  EXPECT_EQ(idem::Outcome::kReplayed, after.outcome);
  EXPECT_EQ("pay_1", after.value.value());
  EXPECT_EQ(1, runs);
}

}  // namespace

// A status or a time the store did not write is CorruptRecord, whatever reads it (SQLite would
// read a text lease_until as 0, and a claim would then silently take the key over).
TEST(SqliteStore, ForeignStatusAndLeaseValuesAreCorruptRecords) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore store(dir.file("corrupt.sqlite"));
  auto lease = idem::Key::make("pay", "text_lease");
  auto status = idem::Key::make("pay", "odd_status");
  auto expiry = idem::Key::make("pay", "text_expiry");
  auto number = idem::Key::make("pay", "odd_number");
  ASSERT_EQ(3, store.schema_version());  // status: 0 in progress, 1 completed, 2 failed
  store.database().write([&](idem::sqlite::Transaction& tx) {
    tx.exec(
        "INSERT INTO api_idempotency (idem_key, biz_type, status, fingerprint, owner,"
        " lease_until, created_at, updated_at) VALUES (?, ?, 0, 'fp', 'x',"
        " 'tomorrow', 1, 1)",
        lease.id(), lease.scope());
    tx.exec(
        "INSERT INTO api_idempotency (idem_key, biz_type, status, fingerprint, owner,"
        " response_body, lease_until, expires_at, created_at, updated_at) VALUES"
        " (?, ?, 1, 'fp', 'x', 'r', 1, 'never', 1, 1)",
        expiry.id(), expiry.scope());
    tx.exec_script("PRAGMA ignore_check_constraints = ON");
    const std::string odd =
        "INSERT INTO api_idempotency (idem_key, biz_type, status, fingerprint, owner,"
        " lease_until, created_at, updated_at) VALUES (?, ?, ?, 'fp', 'x', 1, 1, 1)";
    tx.exec(odd, status.id(), status.scope(), "PROCESSING");
    tx.exec(odd, number.id(), number.scope(), 7);
    tx.exec_script("PRAGMA ignore_check_constraints = OFF");
  });
  for (const auto& key : {lease, status, expiry, number}) {
    SCOPED_TRACE(key.str());
    bool ran = false;
    EXPECT_THROW(
        (void)store.begin(key, "fp", idem::OwnerToken::generate(), std::chrono::seconds(30)),
        idem::CorruptRecord);
    EXPECT_THROW((void)store.run_transactional(key, "fp", idem::OwnerToken::generate(),
                                               std::chrono::seconds(60),
                                               [&](idem::sqlite::Transaction&) {
                                                 ran = true;
                                                 return std::string("x");
                                               }),
                 idem::CorruptRecord);
    EXPECT_THROW((void)store.lookup(key), idem::CorruptRecord);
    EXPECT_FALSE(ran);
  }
}
