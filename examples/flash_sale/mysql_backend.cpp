// SPDX-License-Identifier: MIT
// The flash sale's MySQL backend: database and tables, reset, the end-state queries.
#include "mysql_backend.hpp"

#include <utility>

#include "failover_store.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sql.hpp"

namespace flash_sale {

namespace {

idem::mysql::MysqlStoreOptions store_options(const MysqlSaleOptions& o) {
  idem::mysql::MysqlStoreOptions s;
  s.uri = o.uri;
  s.pool_size = 32;
  return s;
}

}  // namespace

MysqlBackend::MysqlBackend(const MysqlSaleOptions& options)
    : name_(options.redis_url.empty() ? "mysql + memory" : "mysql + redis") {
  auto s = store_options(options);
  {
    // The database first, from a store that does not migrate (it connects lazily).
    auto server = s;
    server.connection = idem::mysql::parse_uri(s.uri);
    const std::string db = idem::check_sql_identifier("database", server.connection.database);
    server.uri.clear();
    server.connection.database = "information_schema";  // every user may use it
    server.migrate = false;
    server.pool_size = 1;
    idem::mysql::MysqlStore admin(server);
    admin.with_session([&](idem::mysql::Session& session) {
      session.exec_text("CREATE DATABASE IF NOT EXISTS `" + db +
                        "` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin");
    });
  }
  store_ = std::make_unique<Durable>(s);
  store_->with_session([](idem::mysql::Session& session) {
    // CHECK (qty >= 0) is defence in depth (enforced by MySQL 8.0.16+ and MariaDB): the
    // conditional UPDATE never needs it.
    session.exec_text(
        "CREATE TABLE IF NOT EXISTS flash_stock ("
        " sku varchar(64) NOT NULL PRIMARY KEY,"
        " qty bigint NOT NULL CHECK (qty >= 0)) ENGINE=InnoDB");
    session.exec_text(
        "CREATE TABLE IF NOT EXISTS flash_order ("
        " id bigint NOT NULL AUTO_INCREMENT PRIMARY KEY,"
        " user_id bigint NOT NULL,"
        " sku varchar(64) NOT NULL,"
        " request_id varchar(128) NOT NULL,"
        " created_at datetime(3) NOT NULL DEFAULT CURRENT_TIMESTAMP(3),"
        " UNIQUE KEY uk_user_sku (user_id, sku)) ENGINE=InnoDB");
  });
}

void MysqlBackend::reset(const Config& cfg) {
  store_->with_transaction([&](idem::mysql::Transaction& tx) {
    tx.exec("DELETE FROM flash_order WHERE sku = ?", cfg.sku);
    tx.exec("DELETE FROM flash_stock WHERE sku = ?", cfg.sku);
    tx.exec("INSERT INTO flash_stock (sku, qty) VALUES (?, ?)", cfg.sku, cfg.stock);
    tx.exec("DELETE FROM api_idempotency WHERE biz_type = ?", std::string(kScope));
  });
}

DbState MysqlBackend::read_state(const Config& cfg) {
  return store_->with_session([&](idem::mysql::Session& s) {
    DbState st;
    for (const auto& row :
         s.query("SELECT user_id, id FROM flash_order WHERE sku = ? ORDER BY id", cfg.sku)) {
      st.orders[row[0].as_int64()].push_back(row[1].as_int64());
      ++st.order_rows;
    }
    st.stock_left = s.query_int64("SELECT qty FROM flash_stock WHERE sku = ?", cfg.sku);
    auto counts = s.query(
        "SELECT COALESCE(SUM(status = 'completed'), 0), COALESCE(SUM(status = 'in_progress'), 0)"
        " FROM api_idempotency WHERE biz_type = ?",
        std::string(kScope));
    st.records_completed = counts[0][0].as_int64();
    st.records_in_progress = counts[0][1].as_int64();
    return st;
  });
}

void MysqlBackend::remove_order(idem::mysql::Transaction& tx, std::int64_t id) {
  tx.exec("DELETE FROM flash_order WHERE id = ?", id);
}

Report run_mysql_sale(const Config& cfg, const MysqlSaleOptions& options) {
  MysqlBackend backend(options);
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
