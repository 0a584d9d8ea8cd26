// SPDX-License-Identifier: MIT
// The flash sale's PostgreSQL backend: schema, reset, the end-state queries.
#include "postgres_backend.hpp"

#include <stdexcept>
#include <utility>
#include <vector>

#include "failover_store.hpp"
#include "redis_failover.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sql.hpp"

namespace flash_sale {

namespace {

// `dsn` whose sessions use `schema` first in their search_path (so the helpers' unqualified
// flash_order / flash_stock resolve there).
std::string with_search_path(const std::string& dsn, const std::string& schema) {
  if (schema.empty()) return dsn;
  if (dsn.rfind("postgresql://", 0) == 0 || dsn.rfind("postgres://", 0) == 0) {
    return dsn + (dsn.find('?') == std::string::npos ? "?" : "&") + "options=-csearch_path%3D" +
           schema;
  }
  return dsn + " options='-csearch_path=" + schema + "'";
}

idem::postgres::PostgresStoreOptions store_options(const PostgresSaleOptions& o) {
  idem::postgres::PostgresStoreOptions s;
  s.conninfo = with_search_path(o.dsn, o.schema);
  if (!o.schema.empty()) s.schema = o.schema;
  s.pool_size = 32;
  return s;
}


}  // namespace

PostgresBackend::PostgresBackend(const PostgresSaleOptions& options)
    : name_(options.redis_url.empty() ? "postgres + memory" : "postgres + redis") {
  if (!options.schema.empty()) {
    idem::check_sql_identifier("schema", options.schema);
    try {
      pqxx::connection c{options.dsn};
      pqxx::work tx{c};
      tx.exec("CREATE SCHEMA IF NOT EXISTS " + options.schema);
      tx.commit();
    } catch (const pqxx::failure& e) {
      throw idem::StorageUnavailable(std::string("flash_sale: cannot create schema: ") + e.what());
    }
  }
  store_ = std::make_unique<Durable>(store_options(options));
  store_->with_transaction([](pqxx::work& tx) {
    tx.exec("SELECT pg_advisory_xact_lock(hashtext('flash_sale tables'))");
    // CHECK (qty >= 0) is defence in depth: the conditional UPDATE never needs it.
    tx.exec(
        "CREATE TABLE IF NOT EXISTS flash_stock ("
        " sku text PRIMARY KEY,"
        " qty bigint NOT NULL CHECK (qty >= 0))");
    tx.exec(
        "CREATE TABLE IF NOT EXISTS flash_order ("
        " id bigserial PRIMARY KEY,"
        " user_id bigint NOT NULL,"
        " sku text NOT NULL,"
        " request_id text NOT NULL,"
        " created_at timestamptz NOT NULL DEFAULT now(),"
        " UNIQUE (user_id, sku))");
  });
}

void PostgresBackend::reset(const Config& cfg) {
  store_->with_transaction([&](pqxx::work& tx) {
    tx.exec_params("DELETE FROM flash_order WHERE sku = $1", cfg.sku);
    tx.exec_params(
        "INSERT INTO flash_stock (sku, qty) VALUES ($1, $2)"
        " ON CONFLICT (sku) DO UPDATE SET qty = excluded.qty",
        cfg.sku, cfg.stock);
    tx.exec_params("DELETE FROM " + store_->qualified_table() + " WHERE biz_type = $1",
                   std::string(kScope));
  });
}

DbState PostgresBackend::read_state(const Config& cfg) {
  return store_->with_transaction([&](pqxx::work& tx) {
    DbState st;
    for (const auto& row : tx.exec_params(
             "SELECT user_id, id FROM flash_order WHERE sku = $1 ORDER BY id", cfg.sku)) {
      st.orders[row[0].as<std::int64_t>()].push_back(row[1].as<std::int64_t>());
      ++st.order_rows;
    }
    auto stock = tx.exec_params("SELECT qty FROM flash_stock WHERE sku = $1", cfg.sku);
    if (!stock.empty()) st.stock_left = stock[0][0].as<std::int64_t>();
    auto counts = tx.exec_params1(
        "SELECT count(*) FILTER (WHERE status = 'completed'),"
        " count(*) FILTER (WHERE status = 'in_progress')"
        " FROM " +
            store_->qualified_table() + " WHERE biz_type = $1",
        std::string(kScope));
    st.records_completed = counts[0].as<std::int64_t>();
    st.records_in_progress = counts[1].as<std::int64_t>();
    return st;
  });
}

void PostgresBackend::remove_order(pqxx::work& tx, std::int64_t id) {
  tx.exec_params("DELETE FROM flash_order WHERE id = $1", id);
}

Report run_postgres_sale(const Config& cfg, const PostgresSaleOptions& options) {
  PostgresBackend backend(options);
  if (options.redis_url.empty()) {
    FailoverStore fast;
    return run_sale(backend, fast, cfg, [&] { fast.failover(); });
  }
  // Start clean: a repeated seed would otherwise replay an earlier run's answers from Redis.
  clear_redis(options.redis_url, options.redis_prefix, /*flushall=*/false);
  idem::redis::RedisStoreOptions ro{options.redis_url};
  ro.key_prefix = options.redis_prefix;
  // One connection per server worker: no worker waits for one (pool_wait_timeout). A fast
  // completion that fails after the commit leaves the key answering "in progress" until its
  // lease ends, so a pool smaller than the workers turns CPU starvation into long waits.
  ro.pool_size = static_cast<std::size_t>(server_workers(cfg));
  idem::redis::RedisStore fast{ro};
  return run_sale(backend, fast, cfg,
                  [&] { clear_redis(options.redis_url, options.redis_prefix, options.flushall); });
}

}  // namespace flash_sale
