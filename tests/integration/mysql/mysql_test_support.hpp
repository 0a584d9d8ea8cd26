// SPDX-License-Identifier: MIT
// MySQL test helpers: a throwaway database per test process (dropped at exit), stores and
// business tables in it, and a direct connection for counting rows.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>

#include "idem/mysql/mysql_store.hpp"
#include "raw_mysql.hpp"
#include "support/test_env.hpp"

namespace idem::test::my {

/// IDEM_TEST_MYSQL_URI or "".
inline std::string base_uri() { return server_env("IDEM_TEST_MYSQL_URI"); }

/// The server's connection settings with `database` (default: this process's database).
mysql::ConnectionOptions connection(const std::string& database);

/// The database of this test process: created on first use, dropped when the process ends.
class Database final : public ::testing::Environment {
 public:
  static const std::string& name() {
    static const std::string n = [] {
      std::string s = unique_name("idem_test");
      ::testing::AddGlobalTestEnvironment(new Database(s));  // gtest owns it
      auto o = mysql::parse_uri(base_uri());
      RawConnection c(o, false);
      c.query("CREATE DATABASE IF NOT EXISTS " + s +
              " CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci");
      c.query("CREATE TABLE " + s +
              ".idem_test_effects (id bigint PRIMARY KEY AUTO_INCREMENT,"
              " key_id varchar(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL)"
              " ENGINE=InnoDB");
      return s;
    }();
    return n;
  }
  void TearDown() override {
    try {
      RawConnection c(mysql::parse_uri(base_uri()), false);
      c.query("DROP DATABASE IF EXISTS " + name_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "could not drop database %s: %s\n", name_.c_str(), e.what());
    }
  }

 private:
  explicit Database(std::string n) : name_(std::move(n)) {}
  std::string name_;
};

inline mysql::ConnectionOptions connection(const std::string& database = Database::name()) {
  auto o = mysql::parse_uri(base_uri());
  o.database = database;
  return o;
}

/// A connection to this process's database, outside idem.
inline RawConnection& raw() {
  thread_local std::unique_ptr<RawConnection> c;
  if (!c) c = std::make_unique<RawConnection>(connection());
  return *c;
}

/// Options for a store in this process's database.
inline mysql::MysqlStoreOptions options() {
  mysql::MysqlStoreOptions o;
  o.connection = connection();
  o.pool_size = 40;
  return o;
}

/// The business effect of a test handler.
inline void insert_effect(mysql::Transaction& tx, const std::string& key_id) {
  tx.exec("INSERT INTO idem_test_effects (key_id) VALUES (?)", key_id);
}

/// The server's general log written to mysql.general_log, emptied first, while this object
/// lives (stop() ends the logging early; read the lines before the object goes). The log is a
/// global setting and ctest runs test processes side by side: a server-side named lock held
/// for the object's life keeps other processes' logging and emptying out of its window.
class GeneralLog {
 public:
  GeneralLog() {
    if (raw().scalar("SELECT GET_LOCK('idem_test_general_log', 120)") != 1) {
      throw std::runtime_error("the general log stayed taken for 120 s");
    }
    raw().query("SET GLOBAL general_log = 0");
    raw().query("TRUNCATE TABLE mysql.general_log");
    raw().query("SET GLOBAL log_output = 'TABLE'; SET GLOBAL general_log = 1");
  }
  /// Switches the log off; its lines stay readable while this object lives.
  void stop() {
    if (stopped_) return;
    stopped_ = true;
    raw().query("SET GLOBAL general_log = 0");
  }
  ~GeneralLog() {
    try {
      stop();
      raw().scalar("SELECT RELEASE_LOCK('idem_test_general_log')");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "could not switch the general log off: %s\n", e.what());
    }
  }
  GeneralLog(const GeneralLog&) = delete;
  GeneralLog& operator=(const GeneralLog&) = delete;

 private:
  bool stopped_ = false;
};

/// Rows of `table` whose `column` equals `value`.
inline long count_where(const std::string& table, const std::string& column,
                        const std::string& value) {
  return raw().scalar("SELECT count(*) FROM " + table + " WHERE " + column + " = " +
                      raw().quote(value));
}

}  // namespace idem::test::my

/// Skips (or fails under scripts/test.sh) without IDEM_TEST_MYSQL_URI.
#define IDEM_REQUIRE_MYSQL()                            \
  do {                                                  \
    std::string idem_uri_;                              \
    IDEM_REQUIRE_ENV(idem_uri_, "IDEM_TEST_MYSQL_URI"); \
  } while (0)
