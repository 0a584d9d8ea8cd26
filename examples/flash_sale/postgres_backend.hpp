// SPDX-License-Identifier: MIT
// The flash sale on PostgreSQL, with Redis (or the in-process store) in front: the order row,
// the stock deduction and the idempotency record commit in the guard's pqxx::work. The
// simulated failover empties Redis mid-sale (FLUSHALL, or only this run's keys).
#pragma once

#include <cstdint>
#include <memory>
#include <pqxx/pqxx>
#include <string>

#include "flash_sale.hpp"
#include "redis_failover.hpp"
#include "idem/postgres/postgres_store.hpp"
#include "idem/postgres/sql_driver.hpp"

namespace flash_sale {

/// Where the PostgreSQL sale runs.
struct PostgresSaleOptions {
  /// libpq conninfo or postgresql:// URI.
  std::string dsn;
  /// Schema for the sale's tables and the idempotency records (created if missing; a validated
  /// identifier). Empty: the connection's default (usually public).
  std::string schema;
  /// Redis fast store (redis://host[:port][/db]); empty: the in-process FailoverStore.
  std::string redis_url;
  /// RedisStoreOptions::key_prefix of the run.
  std::string redis_prefix = "idem:";
  /// The simulated failover: true sends FLUSHALL (use a Redis of your own), false deletes only
  /// the keys under `redis_prefix` (what tests on a shared server do).
  bool flushall = true;
};

/// The PostgreSQL backend of run_sale.
class PostgresBackend {
 public:
  /// The durable store type.
  using Durable = idem::postgres::PostgresStore;

  /// Connects (creating the schema if given), migrates the record table, creates the sale's
  /// tables. @throws idem::StorageError subclasses, idem::UsageError for a bad schema name.
  explicit PostgresBackend(const PostgresSaleOptions& options);

  /// The durable store.
  Durable& durable() { return *store_; }
  /// "postgres + redis" or "postgres + memory".
  std::string name() const { return name_; }
  /// Empties the sale's tables and the scope's idempotency records; seeds the stock.
  void reset(const Config& cfg);
  /// Reads orders, stock and records from the database.
  DbState read_state(const Config& cfg);
  /// Deletes the order row `id` (a sold-out attempt's own insert) in `tx`.
  void remove_order(pqxx::work& tx, std::int64_t id);

 private:
  std::string name_;
  std::unique_ptr<Durable> store_;
};

/// A whole sale on PostgreSQL (+ Redis when `options.redis_url` is set).
Report run_postgres_sale(const Config& cfg, const PostgresSaleOptions& options);

}  // namespace flash_sale
