// SPDX-License-Identifier: MIT
// AsyncGuard's outcome suite on AsyncPostgresStore alone (the real server:
// IDEM_TEST_POSTGRES_DSN): every duplicate reaches PostgreSQL through the loop's connection,
// transactional handlers run on the pool, two-phase handlers' durable statements on the loop.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <type_traits>

#include "async_guard_suite.hpp"
#include "pg_store_support.hpp"

namespace {

using namespace idem::test::async_pg;  // NOLINT(google-build-using-namespace)
using idem::Key;

// AsyncGuard's suite: the store on the suite's own loop, durable only (every duplicate reaches
// PostgreSQL through the loop's connection).
struct AsyncPgEnv {
  using Durable = AsyncPostgresStore;
  static const char* env_var() { return "IDEM_TEST_POSTGRES_DSN"; }
  AsyncPgEnv(const std::string&, anet::io_context& io)
      : io_(io),
        sync(sync_options()),
        workers({4, 256}),
        store(std::make_unique<AsyncPostgresStore>(io.get_executor(), sync, workers)) {}
  ~AsyncPgEnv() {
    store.reset();
    drain(io_);
  }
  Durable& durable() { return *store; }
  idem::async::WorkerPool& pool() { return workers; }
  idem::async::AsyncFastStore* fast() { return nullptr; }
  void forget_fast(const Key&) {}
  void insert_effect(pqxx::work& tx, const std::string& id) { pg::insert_effect(tx, id); }
  long count_effects(const std::string& id) {
    if (!reader) reader = std::make_unique<pqxx::connection>(pg::dsn());
    pqxx::nontransaction tx(*reader);
    return tx
        .exec_params("SELECT count(*) FROM " + pg::table("idem_test_effects") +
                         " WHERE key_id = $1",
                     id)[0][0]
        .as<long>();
  }
  anet::io_context& io_;
  PostgresStore sync;
  idem::async::WorkerPool workers;
  std::unique_ptr<AsyncPostgresStore> store;
  std::unique_ptr<pqxx::connection> reader;
};

// The store fits AsyncGuard: one guard for both handler forms.
static_assert(std::is_same_v<AsyncPostgresStore::Transaction, pqxx::work>);

}  // namespace

namespace idem::test {
using AsyncPgEnvs = ::testing::Types<AsyncPgEnv>;
INSTANTIATE_TYPED_TEST_SUITE_P(AsyncPostgres, AsyncGuardSuite, AsyncPgEnvs);
}  // namespace idem::test
