// SPDX-License-Identifier: MIT
// AsyncGuard's outcome suite on PooledDurable<PostgresStore> (the real server:
// IDEM_TEST_POSTGRES_DSN): PostgreSQL alone, and MemoryStore in front of it. The transactions
// and idem's statements run on the worker pool, never on the loop.
#include <memory>
#include <string>

#include "async_guard_suite.hpp"
#include "idem/async/pooled_durable.hpp"
#include "idem/memory_store.hpp"
#include "pg_test_support.hpp"

namespace {

namespace pg = idem::test::pg;
using idem::async::PooledDurable;
using idem::postgres::PostgresStore;

// The worker pool's 4 threads hold at most 4 connections.
idem::postgres::PostgresStoreOptions store_options() {
  auto o = pg::options();
  o.pool_size = 8;
  return o;
}

struct PostgresBase {
  using Durable = PooledDurable<PostgresStore>;
  static const char* env_var() { return "IDEM_TEST_POSTGRES_DSN"; }
  explicit PostgresBase(const std::string&)
      : store(store_options()), workers({4, 256}), pooled(store, workers) {}
  Durable& durable() { return pooled; }
  idem::async::WorkerPool& pool() { return workers; }
  void insert_effect(pqxx::work& tx, const std::string& id) { pg::insert_effect(tx, id); }
  // One connection for every count (the suites count hundreds of keys; a connection each
  // would take seconds). Called from the test's thread only.
  long count_effects(const std::string& id) {
    if (!reader) reader = std::make_unique<pqxx::connection>(pg::dsn());
    pqxx::nontransaction tx(*reader);
    return tx
        .exec_params("SELECT count(*) FROM " + pg::table("idem_test_effects") +
                         " WHERE key_id = $1",
                     id)[0][0]
        .as<long>();
  }
  PostgresStore store;
  idem::async::WorkerPool workers;
  Durable pooled;
  std::unique_ptr<pqxx::connection> reader;
};

struct PostgresOnly : PostgresBase {
  using PostgresBase::PostgresBase;
  idem::async::AsyncFastStore* fast() { return nullptr; }
  void forget_fast(const idem::Key&) {}
};

struct MemoryPostgres : PostgresBase {
  explicit MemoryPostgres(const std::string& v) : PostgresBase(v), fast_adapter(memory) {}
  idem::async::AsyncFastStore* fast() { return &fast_adapter; }
  void forget_fast(const idem::Key&) { memory.clear(); }
  idem::MemoryStore memory;
  idem::async::InlineFastStore fast_adapter;
};

}  // namespace

namespace idem::test {
using PostgresEnvs = ::testing::Types<PostgresOnly, MemoryPostgres>;
INSTANTIATE_TYPED_TEST_SUITE_P(Postgres, AsyncGuardSuite, PostgresEnvs);
}  // namespace idem::test
