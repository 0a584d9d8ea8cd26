// SPDX-License-Identifier: MIT
// PostgreSQL test helpers: a throwaway schema per test process (dropped at exit), stores and
// business tables in it, and a direct connection for counting rows.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "idem/postgres/postgres_store.hpp"
#include "support/test_env.hpp"

namespace idem::test::pg {

/// IDEM_TEST_POSTGRES_DSN or "".
inline std::string dsn() { return server_env("IDEM_TEST_POSTGRES_DSN"); }

/// This thread's connection for the helpers below, outside idem: opened on first use and
/// again when `reopen` (a server restart broke it). One connection per helper call cost a
/// PostgreSQL backend start each, and tests count hundreds of keys one by one.
inline pqxx::connection& helper_connection(bool reopen = false) {
  thread_local std::unique_ptr<pqxx::connection> c;
  if (reopen || c == nullptr || !c->is_open()) c = std::make_unique<pqxx::connection>(dsn());
  return *c;
}

/// Runs `fn(pqxx::work&)` on this thread's helper connection and commits. A connection found
/// broken before the commit (the server was restarted since its last use) is reopened and
/// `fn` runs once more: its first transaction never committed. A commit that fails is thrown.
template <class Fn>
auto with_helper_tx(Fn&& fn) {
  for (int attempt = 0;; ++attempt) {
    std::optional<pqxx::work> tx;
    std::optional<decltype(fn(*tx))> r;
    try {
      tx.emplace(helper_connection(attempt > 0));
      r.emplace(fn(*tx));
    } catch (const pqxx::broken_connection&) {
      if (attempt > 0) throw;
      continue;
    }
    tx->commit();
    return std::move(*r);
  }
}

/// Runs SQL outside idem (setup, counting, cleanup), in a transaction of its own.
inline pqxx::result exec(const std::string& sql) {
  return with_helper_tx([&](pqxx::work& tx) { return tx.exec(sql); });
}

/// First column of the first row as a number.
inline long scalar(const std::string& sql) { return exec(sql)[0][0].as<long>(); }

/// The schema of this test process: created on first use, dropped when the process ends.
class Schema final : public ::testing::Environment {
 public:
  static const std::string& name() {
    static const std::string n = [] {
      std::string s = unique_name("idem_test");
      ::testing::AddGlobalTestEnvironment(new Schema(s));  // gtest owns it
      exec("CREATE SCHEMA IF NOT EXISTS " + s);
      exec("CREATE TABLE IF NOT EXISTS " + s +
           ".idem_test_effects (id bigserial PRIMARY KEY, key_id text NOT NULL)");
      exec("CREATE TABLE IF NOT EXISTS " + s +
           ".payment (id bigserial PRIMARY KEY, order_no text NOT NULL, amount bigint NOT NULL)");
      exec("CREATE TABLE IF NOT EXISTS " + s +
           ".account (id text PRIMARY KEY, balance bigint NOT NULL)");
      return s;
    }();
    return n;
  }
  void TearDown() override {
    try {
      exec("DROP SCHEMA IF EXISTS " + name_ + " CASCADE");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "could not drop schema %s: %s\n", name_.c_str(), e.what());
    }
  }

 private:
  explicit Schema(std::string n) : name_(std::move(n)) {}
  std::string name_;
};

/// `<schema>.<table>`.
inline std::string table(const std::string& t) { return Schema::name() + "." + t; }

/// Options for a store in this process's schema.
inline postgres::PostgresStoreOptions options() {
  postgres::PostgresStoreOptions o;
  o.conninfo = dsn();
  o.schema = Schema::name();
  o.pool_size = 40;
  return o;
}

/// The business effect of a test handler.
inline void insert_effect(pqxx::work& tx, const std::string& key_id) {
  tx.exec_params("INSERT INTO " + table("idem_test_effects") + " (key_id) VALUES ($1)", key_id);
}

/// Rows of `table` whose `column` equals `value` (bound).
inline long count_where(const std::string& t, const std::string& column, const std::string& value) {
  return with_helper_tx([&](pqxx::work& tx) {
    return tx
        .exec_params("SELECT count(*) FROM " + table(t) + " WHERE " + column + " = $1", value)[0][0]
        .as<long>();
  });
}

/// The DSN with its port replaced (e.g. by a proxy's).
inline std::string dsn_with_port(int port) {
  std::string d = dsn();
  auto at = d.find("port=");
  if (at == std::string::npos) return d + " port=" + std::to_string(port);
  auto end = d.find(' ', at);
  return d.substr(0, at) + "port=" + std::to_string(port) +
         (end == std::string::npos ? "" : d.substr(end));
}

/// The DSN's port (5432 when it names none).
inline int dsn_port() {
  std::string d = dsn();
  auto at = d.find("port=");
  return at == std::string::npos ? 5432 : std::atoi(d.c_str() + at + 5);
}

/// A PostgreSQL outage the calls of a test cannot miss: stops the shared server with `script`
/// (scripts/servers.sh `pg-stop`: pg_ctl stop -m fast, its connections terminated), keeps it
/// down until `seen` (the test's count of calls that failed on the outage) is above zero or 30 s
/// passed, and starts it again (`pg-start`). A plain `pg-restart` can be over before any call
/// notices it on a fast machine, and a restart no call saw proves nothing.
/// @return 0 when both commands succeeded.
inline int stop_until_observed_then_start(const std::string& script, const std::atomic<int>& seen) {
  auto run = [&](const char* what) {
    return std::system(("\"" + script + "\" " + what + " >/dev/null 2>&1").c_str());
  };
  const int stopped = run("pg-stop");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (seen.load() == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return stopped | run("pg-start");
}

}  // namespace idem::test::pg

/// Skips (or fails under scripts/test.sh) without IDEM_TEST_POSTGRES_DSN.
#define IDEM_REQUIRE_POSTGRES()                            \
  do {                                                     \
    std::string idem_dsn_;                                 \
    IDEM_REQUIRE_ENV(idem_dsn_, "IDEM_TEST_POSTGRES_DSN"); \
  } while (0)
