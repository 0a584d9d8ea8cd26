// SPDX-License-Identifier: MIT
// The flash sale's PostgreSQL backend: schema, reset, the end-state queries, and the Redis
// failover (hiredis here only; never in a header).
#include "postgres_backend.hpp"

#include <hiredis/hiredis.h>

#include <initializer_list>
#include <stdexcept>
#include <utility>
#include <vector>

#include "failover_store.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sql.hpp"

namespace flash_sale {

namespace {

// `dsn` whose sessions use `schema` first in their search_path (so the helpers' unqualified
// flash_order / flash_stock resolve there).
std::string with_search_path(const std::string& dsn, const std::string& schema) {
  if (schema.empty()) return dsn;
  if (dsn.rfind("postgresql://", 0) == 0 || dsn.rfind("postgres://", 0) == 0) {
    return dsn + (dsn.find('?') == std::string::npos ? "?" : "&") +
           "options=-csearch_path%3D" + schema;
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

struct RedisReply {
  redisReply* r;
  ~RedisReply() {
    if (r != nullptr) freeReplyObject(r);
  }
};

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
      throw idem::StorageUnavailable(std::string("flash_sale: cannot create schema: ") +
                                     e.what());
    }
  }
  store_ = std::make_unique<Durable>(store_options(options));
  store_->with_transaction([](pqxx::work& tx) {
    tx.exec("SELECT pg_advisory_xact_lock(hashtext('flash_sale tables'))");
    // CHECK (qty >= 0) is defence in depth: the conditional UPDATE never needs it.
    tx.exec("CREATE TABLE IF NOT EXISTS flash_stock ("
            " sku text PRIMARY KEY,"
            " qty bigint NOT NULL CHECK (qty >= 0))");
    tx.exec("CREATE TABLE IF NOT EXISTS flash_order ("
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
    tx.exec_params("INSERT INTO flash_stock (sku, qty) VALUES ($1, $2)"
                   " ON CONFLICT (sku) DO UPDATE SET qty = excluded.qty",
                   cfg.sku, cfg.stock);
    tx.exec_params("DELETE FROM " + store_->qualified_table() + " WHERE biz_type = $1",
                   std::string(kScope));
  });
}

DbState PostgresBackend::read_state(const Config& cfg) {
  return store_->with_transaction([&](pqxx::work& tx) {
    DbState st;
    for (const auto& row :
         tx.exec_params("SELECT user_id, id FROM flash_order WHERE sku = $1 ORDER BY id", cfg.sku)) {
      st.orders[row[0].as<std::int64_t>()].push_back(row[1].as<std::int64_t>());
      ++st.order_rows;
    }
    auto stock = tx.exec_params("SELECT qty FROM flash_stock WHERE sku = $1", cfg.sku);
    if (!stock.empty()) st.stock_left = stock[0][0].as<std::int64_t>();
    auto counts = tx.exec_params1(
        "SELECT count(*) FILTER (WHERE status = 'completed'),"
        " count(*) FILTER (WHERE status = 'in_progress')"
        " FROM " + store_->qualified_table() + " WHERE biz_type = $1",
        std::string(kScope));
    st.records_completed = counts[0].as<std::int64_t>();
    st.records_in_progress = counts[1].as<std::int64_t>();
    return st;
  });
}

void PostgresBackend::remove_order(pqxx::work& tx, std::int64_t id) {
  tx.exec_params("DELETE FROM flash_order WHERE id = $1", id);
}

void clear_redis(const std::string& url, const std::string& prefix, bool flushall) {
  // redis://[[user]:password@]host[:port][/db]
  std::string rest = url;
  const std::string scheme = "redis://";
  if (rest.rfind(scheme, 0) != 0) throw std::runtime_error("flash_sale: expected redis:// URL");
  rest = rest.substr(scheme.size());
  std::string user, password, host = "127.0.0.1";
  int port = 6379, db = 0;
  if (auto at = rest.rfind('@'); at != std::string::npos) {
    std::string auth = rest.substr(0, at);
    rest = rest.substr(at + 1);
    auto colon = auth.find(':');
    user = colon == std::string::npos ? std::string() : auth.substr(0, colon);
    password = colon == std::string::npos ? auth : auth.substr(colon + 1);
  }
  if (auto slash = rest.find('/'); slash != std::string::npos) {
    if (slash + 1 < rest.size()) db = std::stoi(rest.substr(slash + 1));
    rest = rest.substr(0, slash);
  }
  if (auto colon = rest.rfind(':'); colon != std::string::npos) {
    port = std::stoi(rest.substr(colon + 1));
    rest = rest.substr(0, colon);
  }
  if (!rest.empty()) host = rest;

  timeval timeout{2, 0};
  std::unique_ptr<redisContext, void (*)(redisContext*)> c(
      redisConnectWithTimeout(host.c_str(), port, timeout), redisFree);
  if (!c || c->err != 0) {
    throw std::runtime_error("flash_sale: cannot reach Redis at " + host + ":" +
                             std::to_string(port) + (c ? std::string(": ") + c->errstr : ""));
  }
  redisSetTimeout(c.get(), timeout);
  auto command = [&](std::initializer_list<std::string> args) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (const auto& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    RedisReply r{static_cast<redisReply*>(redisCommandArgv(
        c.get(), static_cast<int>(argv.size()), argv.data(), lens.data()))};
    if (r.r == nullptr || r.r->type == REDIS_REPLY_ERROR) {
      throw std::runtime_error("flash_sale: Redis command failed: " +
                               std::string(r.r != nullptr ? r.r->str : c->errstr));
    }
    return r;
  };
  if (!password.empty()) {
    if (user.empty()) {
      command({"AUTH", password});
    } else {
      command({"AUTH", user, password});
    }
  }
  if (db != 0) command({"SELECT", std::to_string(db)});
  if (flushall) {
    command({"FLUSHALL"});
    return;
  }
  // Only this sale's keys: <prefix>{flash.order|...}.
  std::string cursor = "0";
  const std::string pattern = prefix + "{" + kScope + "|*";
  do {
    auto r = command({"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
    if (r.r->type != REDIS_REPLY_ARRAY || r.r->elements != 2) {
      throw std::runtime_error("flash_sale: unexpected SCAN reply");
    }
    cursor = std::string(r.r->element[0]->str, r.r->element[0]->len);
    const redisReply* keys = r.r->element[1];
    for (std::size_t i = 0; i < keys->elements; ++i) {
      command({"DEL", std::string(keys->element[i]->str, keys->element[i]->len)});
    }
  } while (cursor != "0");
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
  idem::redis::RedisStore fast{ro};
  return run_sale(backend, fast, cfg, [&] {
    clear_redis(options.redis_url, options.redis_prefix, options.flushall);
  });
}

}  // namespace flash_sale
