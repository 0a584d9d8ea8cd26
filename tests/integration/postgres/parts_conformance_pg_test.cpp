// SPDX-License-Identifier: MIT
// The shared business-key, state machine, stream and MQ suites on PostgreSQL (the same suites run
// on SQLite and MySQL), in this process's throwaway schema.
#include <gtest/gtest.h>

#include "conformance/business_keys_conformance.hpp"
#include "conformance/mq_conformance.hpp"
#include "conformance/state_machine_conformance.hpp"
#include "conformance/stream_conformance.hpp"
#include "idem/postgres/attempt_ledger.hpp"
#include "idem/postgres/sql_driver.hpp"
#include "idem/postgres/state_machine.hpp"
#include "idem/postgres/stream_store.hpp"
#include "pg_test_support.hpp"

namespace {

namespace pg = idem::test::pg;

idem::postgres::PostgresStore& shared_store() {
  static idem::postgres::PostgresStore store{pg::options()};
  return store;
}

// The helpers name bare tables: statements run with the test schema on the search path.
struct PgParts {
  using Tx = pqxx::work;
  static constexpr bool kConcurrentWriters = true;
  static const char* env_var() { return "IDEM_TEST_POSTGRES_DSN"; }
  static std::string on_path(const std::string& sql) {
    return "SET LOCAL search_path = " + pg::Schema::name() + "; " + sql;
  }
  static void exec(const std::string& sql) { pg::exec(on_path(sql)); }
  static long long scalar(const std::string& sql) { return pg::scalar(on_path(sql)); }
  static std::string text(const std::string& sql) {
    auto r = pg::exec(on_path(sql));
    return r.empty() || r[0][0].is_null() ? std::string() : r[0][0].as<std::string>();
  }
  static std::string quote(const std::string& v) {
    std::string out = "'";
    for (char c : v) out += c == '\'' ? std::string("''") : std::string(1, c);
    return out + "'";
  }
  template <class Fn>
  static auto in_tx(Fn&& fn) {
    return shared_store().with_transaction([&](pqxx::work& tx) {
      tx.exec("SET LOCAL search_path = " + pg::Schema::name());
      return fn(tx);
    });
  }
  static std::string status_in(Tx& tx, const std::string& table, const std::string& id) {
    return tx.exec_params1("SELECT status FROM " + table + " WHERE order_no = $1", id)[0]
        .as<std::string>();
  }
  static std::string coupon_ddl(const std::string& t) {
    return "CREATE TABLE " + t +
           " (id bigserial PRIMARY KEY, user_id bigint NOT NULL, coupon_id text NOT NULL,"
           " channel text NOT NULL, UNIQUE (user_id, coupon_id))";
  }
  static std::string stock_ddl(const std::string& t) {
    return "CREATE TABLE " + t + " (sku text PRIMARY KEY, qty integer NOT NULL)";
  }
  static std::string orders_ddl(const std::string& t) {
    return "CREATE TABLE " + t +
           " (order_no text PRIMARY KEY, status text NOT NULL, paid_at timestamptz,"
           " paid_amount bigint)";
  }
  static std::string paid_at_value() { return "2026-01-01T10:00:00Z"; }
};

struct PgStream {
  using Store = idem::postgres::PostgresStore;
  using Chunks = idem::postgres::ChunkStore;
  static const char* env_var() { return "IDEM_TEST_POSTGRES_DSN"; }
  static std::unique_ptr<Store> make_store() { return std::make_unique<Store>(pg::options()); }
  static std::unique_ptr<Chunks> make_chunks(Store& s) { return std::make_unique<Chunks>(s); }
};

}  // namespace

namespace idem::test {
using PgPartsTypes = ::testing::Types<PgParts>;
using PgStreamTypes = ::testing::Types<PgStream>;
INSTANTIATE_TYPED_TEST_SUITE_P(Postgres, BusinessKeysConformance, PgPartsTypes);
INSTANTIATE_TYPED_TEST_SUITE_P(Postgres, StateMachineConformance, PgPartsTypes);
INSTANTIATE_TYPED_TEST_SUITE_P(Postgres, StreamConformance, PgStreamTypes);
}  // namespace idem::test

// The shared MQ suite on PostgreSQL (the mq_consume_record preset, PostgresAttemptLedger).

namespace {

struct PgMq {
  using Store = idem::postgres::PostgresStore;
  static constexpr bool kConcurrentWriters = true;
  static const char* env_var() { return "IDEM_TEST_POSTGRES_DSN"; }
  static idem::postgres::PostgresStoreOptions mq_options() {
    auto o = idem::postgres::PostgresStoreOptions::mq_consume_record(pg::dsn());
    o.schema = pg::Schema::name();
    o.pool_size = 40;
    return o;
  }
  static std::unique_ptr<Store> make_store() { return std::make_unique<Store>(mq_options()); }
  static std::unique_ptr<Store> make_store_short_lock_wait() {
    auto o = mq_options();
    o.lock_timeout = std::chrono::milliseconds(300);
    return std::make_unique<Store>(o);
  }
  static std::shared_ptr<idem::AttemptLedger> make_ledger(Store& s) {
    return std::make_shared<idem::postgres::PostgresAttemptLedger>(s);
  }
  static void insert_effect(pqxx::work& tx, const std::string& id) { pg::insert_effect(tx, id); }
  static long count_effects(const std::string& id) {
    return pg::count_where("idem_test_effects", "key_id", id);
  }
  static long completed_records(const std::string& group) {
    return pg::scalar("SELECT count(*) FROM " + pg::table("mq_consume_record") +
                      " WHERE consumer_group = '" + group + "' AND status = 'completed'");
  }
};

}  // namespace

namespace idem::test {
using PgMqTypes = ::testing::Types<PgMq>;
INSTANTIATE_TYPED_TEST_SUITE_P(Postgres, MqConformance, PgMqTypes);
}  // namespace idem::test
