// SPDX-License-Identifier: MIT
// PostgresStore: the durable conformance suite, in a throwaway schema.
#include <gtest/gtest.h>

#include "conformance/durable_store_conformance.hpp"
#include "pg_test_support.hpp"

namespace {

struct PostgresTraits {
  using Store = idem::postgres::PostgresStore;
  static const char* env_var() { return "IDEM_TEST_POSTGRES_DSN"; }
  static std::unique_ptr<Store> make(const std::string&) {
    return std::make_unique<Store>(idem::test::pg::options());
  }
  static void insert_effect(pqxx::work& tx, const std::string& key_id) {
    idem::test::pg::insert_effect(tx, key_id);
  }
  static long count_effects(Store&, const std::string& key_id) {
    return idem::test::pg::count_where("idem_test_effects", "key_id", key_id);
  }
  static long count_records(Store&) {
    return idem::test::pg::scalar("SELECT count(*) FROM " +
                                  idem::test::pg::table("api_idempotency"));
  }
};

// The same store reading the record before opening the transaction (read_first).
struct PostgresReadFirstTraits : PostgresTraits {
  static std::unique_ptr<Store> make(const std::string&) {
    auto o = idem::test::pg::options();
    o.read_first = true;
    return std::make_unique<Store>(o);
  }
};

// PostgresStore fits the durable store contract, batch operations included.
static_assert(idem::detail::check_batch_store<idem::postgres::PostgresStore>());

}  // namespace

namespace idem::test {
using PostgresTypes = ::testing::Types<PostgresTraits, PostgresReadFirstTraits>;
INSTANTIATE_TYPED_TEST_SUITE_P(Postgres, DurableStoreConformance, PostgresTypes);
}  // namespace idem::test
