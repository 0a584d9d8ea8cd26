// SPDX-License-Identifier: MIT
// AsyncGuard on the embedded stores: MemoryStore in front of SQLite on a worker pool, and SQLite
// alone (no server needed).
#include <memory>
#include <string>

#include "async_guard_suite.hpp"
#include "idem/async/pooled_durable.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"

namespace {

using idem::async::PooledDurable;
using idem::sqlite::SqliteStore;

struct SqliteBase {
  using Durable = PooledDurable<SqliteStore>;
  static const char* env_var() { return nullptr; }
  explicit SqliteBase(const std::string&)
      : sqlite(dir.file("async.db")), workers({4, 256}), pooled(sqlite, workers) {
    sqlite.database().write([](idem::sqlite::Transaction& tx) {
      tx.exec("CREATE TABLE idem_test_effects (key_id TEXT NOT NULL)");
    });
  }
  Durable& durable() { return pooled; }
  idem::async::WorkerPool& pool() { return workers; }
  void insert_effect(idem::sqlite::Transaction& tx, const std::string& id) {
    tx.exec("INSERT INTO idem_test_effects (key_id) VALUES (?)", id);
  }
  long count_effects(const std::string& id) {
    return static_cast<long>(sqlite.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM idem_test_effects WHERE key_id = ?", id)
          .value_or(-1);
    }));
  }
  idem::test::TempDir dir;
  SqliteStore sqlite;
  idem::async::WorkerPool workers;
  Durable pooled;
};

struct MemorySqlite : SqliteBase {
  explicit MemorySqlite(const std::string& v) : SqliteBase(v), fast_adapter(memory) {}
  idem::async::AsyncFastStore* fast() { return &fast_adapter; }
  void forget_fast(const idem::Key&) { memory.clear(); }
  idem::MemoryStore memory;
  idem::async::InlineFastStore fast_adapter;
};

struct SqliteOnly : SqliteBase {
  using SqliteBase::SqliteBase;
  idem::async::AsyncFastStore* fast() { return nullptr; }
  void forget_fast(const idem::Key&) {}
};

}  // namespace

namespace idem::test {
using SqliteEnvs = ::testing::Types<MemorySqlite, SqliteOnly>;
INSTANTIATE_TYPED_TEST_SUITE_P(Embedded, AsyncGuardSuite, SqliteEnvs);
}  // namespace idem::test
