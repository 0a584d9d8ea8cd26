// SPDX-License-Identifier: MIT
// idem::StateMachine on MariaDB: the shared state machine suite through the MySQL driver
// (its read after a 0-row UPDATE is a locking one: REPEATABLE READ's snapshot must not hide a
// transition committed meanwhile).
#include "idem/mysql/state_machine.hpp"

#include <gtest/gtest.h>

#include "conformance/state_machine_conformance.hpp"
#include "mysql_test_support.hpp"

namespace {

namespace my = idem::test::my;

idem::mysql::MysqlStore& shared_store() {
  static idem::mysql::MysqlStore store{my::options()};
  return store;
}

struct MysqlStateMachineTraits {
  using Tx = idem::mysql::Transaction;
  static constexpr bool kConcurrentWriters = true;
  static const char* env_var() { return "IDEM_TEST_MYSQL_URI"; }
  static void exec(const std::string& sql) { my::raw().query(sql); }
  static long long scalar(const std::string& sql) { return my::raw().scalar(sql); }
  static std::string text(const std::string& sql) {
    auto rows = my::raw().query(sql);
    return rows.empty() || !rows[0][0] ? std::string() : *rows[0][0];
  }
  static std::string quote(const std::string& v) { return my::raw().quote(v); }
  template <class Fn>
  static auto in_tx(Fn&& fn) {
    return shared_store().with_transaction([&](Tx& tx) { return fn(tx); });
  }
  static std::string status_in(Tx& tx, const std::string& table, const std::string& id) {
    return tx.query_text("SELECT status FROM " + table + " WHERE order_no = ?", id).value_or("");
  }
  static std::string orders_ddl(const std::string& t) {
    return "CREATE TABLE " + t +
           " (order_no varchar(64) COLLATE utf8mb4_bin PRIMARY KEY,"
           " status varchar(32) NOT NULL, paid_at datetime NULL, paid_amount bigint NULL)"
           " ENGINE=InnoDB";
  }
  static std::string paid_at_value() { return "2026-01-01 10:00:00"; }
};

}  // namespace

namespace idem::test {
using MysqlStateMachineTypes = ::testing::Types<MysqlStateMachineTraits>;
INSTANTIATE_TYPED_TEST_SUITE_P(Mysql, StateMachineConformance, MysqlStateMachineTypes);
}  // namespace idem::test
