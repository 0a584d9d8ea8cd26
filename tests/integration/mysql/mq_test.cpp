// SPDX-License-Identifier: MIT
// IdempotentConsumer over MysqlStore (the mq_consume_record preset) and the MySQL attempt
// ledger: the shared MQ suite on MariaDB.
#include <gtest/gtest.h>

#include "conformance/mq_conformance.hpp"
#include "idem/mysql/attempt_ledger.hpp"
#include "mysql_test_support.hpp"

namespace {

namespace my = idem::test::my;

idem::mysql::MysqlStoreOptions mq_options() {
  auto o = idem::mysql::MysqlStoreOptions::mq_consume_record();
  o.connection = my::connection();
  o.pool_size = 40;
  return o;
}

struct MysqlMqTraits {
  using Store = idem::mysql::MysqlStore;
  static constexpr bool kConcurrentWriters = true;
  static const char* env_var() { return "IDEM_TEST_MYSQL_URI"; }
  static std::unique_ptr<Store> make_store() { return std::make_unique<Store>(mq_options()); }
  static std::unique_ptr<Store> make_store_short_lock_wait() {
    auto o = mq_options();
    o.lock_wait_timeout = std::chrono::seconds(1);  // InnoDB's smallest
    return std::make_unique<Store>(o);
  }
  static std::shared_ptr<idem::AttemptLedger> make_ledger(Store& s) {
    return std::make_shared<idem::mysql::MysqlAttemptLedger>(s);
  }
  static void insert_effect(idem::mysql::Transaction& tx, const std::string& id) {
    my::insert_effect(tx, id);
  }
  static long count_effects(const std::string& id) {
    return my::count_where("idem_test_effects", "key_id", id);
  }
  static long completed_records(const std::string& group) {
    return my::raw().scalar("SELECT count(*) FROM mq_consume_record WHERE consumer_group = " +
                            my::raw().quote(group) + " AND status = 'completed'");
  }
};

}  // namespace

namespace idem::test {
using MysqlMqTypes = ::testing::Types<MysqlMqTraits>;
INSTANTIATE_TYPED_TEST_SUITE_P(Mysql, MqConformance, MysqlMqTypes);
}  // namespace idem::test
