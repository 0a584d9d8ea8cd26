// SPDX-License-Identifier: MIT
// MysqlStore: the durable conformance suite, in a throwaway database.
#include <gtest/gtest.h>

#include "conformance/durable_store_conformance.hpp"
#include "mysql_test_support.hpp"

namespace {

struct MysqlTraits {
  using Store = idem::mysql::MysqlStore;
  static const char* env_var() { return "IDEM_TEST_MYSQL_URI"; }
  static std::unique_ptr<Store> make(const std::string&) {
    return std::make_unique<Store>(idem::test::my::options());
  }
  static void insert_effect(idem::mysql::Transaction& tx, const std::string& key_id) {
    idem::test::my::insert_effect(tx, key_id);
  }
  static long count_effects(Store&, const std::string& key_id) {
    return idem::test::my::count_where("idem_test_effects", "key_id", key_id);
  }
  static long count_records(Store&) {
    return idem::test::my::raw().scalar("SELECT count(*) FROM api_idempotency");
  }
};

// The same store reading the record before opening the transaction (read_first).
struct MysqlReadFirstTraits : MysqlTraits {
  static std::unique_ptr<Store> make(const std::string&) {
    auto o = idem::test::my::options();
    o.read_first = true;
    return std::make_unique<Store>(o);
  }
};

}  // namespace

namespace idem::test {
using MysqlTypes = ::testing::Types<MysqlTraits, MysqlReadFirstTraits>;
INSTANTIATE_TYPED_TEST_SUITE_P(Mysql, DurableStoreConformance, MysqlTypes);
}  // namespace idem::test
