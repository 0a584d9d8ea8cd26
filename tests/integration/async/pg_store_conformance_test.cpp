// SPDX-License-Identifier: MIT
// The durable conformance suite (tests/conformance) through AsyncPostgresStore, waited on: its
// two-phase calls on the loop's pipelined connection, its transactions on the pool (the real
// server: IDEM_TEST_POSTGRES_DSN).
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "conformance/durable_store_conformance.hpp"
#include "pg_store_support.hpp"

namespace {

using namespace idem::test::async_pg;  // NOLINT(google-build-using-namespace)

// The durable store contract through AsyncPostgresStore, waited on (tests/conformance).
class BlockingAsyncPg : Holder,
                        public idem::test::BlockingDurable<AsyncPostgresStore, PostgresStore> {
 public:
  BlockingAsyncPg()
      : Holder(),
        idem::test::BlockingDurable<AsyncPostgresStore, PostgresStore>(*async, sync,
                                                                        loop.executor()) {}
};

struct AsyncPgTraits {
  using Store = BlockingAsyncPg;
  static const char* env_var() { return "IDEM_TEST_POSTGRES_DSN"; }
  static std::unique_ptr<Store> make(const std::string&) { return std::make_unique<Store>(); }
  static void insert_effect(pqxx::work& tx, const std::string& key_id) {
    pg::insert_effect(tx, key_id);
  }
  static long count_effects(Store&, const std::string& key_id) {
    return pg::count_where("idem_test_effects", "key_id", key_id);
  }
  static long count_records(Store&) {
    return pg::scalar("SELECT count(*) FROM " + pg::table("api_idempotency"));
  }
};

}  // namespace

namespace idem::test {
using AsyncPgTypes = ::testing::Types<AsyncPgTraits>;
INSTANTIATE_TYPED_TEST_SUITE_P(AsyncPostgres, DurableStoreConformance, AsyncPgTypes);
}  // namespace idem::test
