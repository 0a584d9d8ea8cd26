// SPDX-License-Identifier: MIT
// The flash sale on MySQL / MariaDB, with Redis (or the in-process store) in front: the order
// row, the stock deduction and the idempotency record (the seed table api_idempotency) commit
// in the guard's idem::mysql::Transaction. The simulated failover empties Redis mid-sale.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "flash_sale.hpp"
#include "idem/mysql/mysql_store.hpp"
#include "idem/mysql/sql_driver.hpp"
#include "redis_failover.hpp"

namespace flash_sale {

/// Where the MySQL sale runs.
struct MysqlSaleOptions {
  /// mysql://user:password@host:port/database (the database is created if missing).
  std::string uri;
  /// Redis fast store (redis://host[:port][/db]); empty: the in-process FailoverStore.
  std::string redis_url;
  /// RedisStoreOptions::key_prefix of the run.
  std::string redis_prefix = "idem:";
  /// The simulated failover: FLUSHALL (true) or only the keys under `redis_prefix`.
  bool flushall = true;
};

/// The MySQL backend of run_sale.
class MysqlBackend {
 public:
  /// The durable store type.
  using Durable = idem::mysql::MysqlStore;

  /// Connects (creating the database if missing), migrates api_idempotency, creates the sale's
  /// tables (InnoDB). @throws idem::StorageError subclasses, idem::UsageError for a bad URI.
  explicit MysqlBackend(const MysqlSaleOptions& options);

  /// The durable store.
  Durable& durable() { return *store_; }
  /// "mysql + redis" or "mysql + memory".
  std::string name() const { return name_; }
  /// Empties the sale's tables and the scope's idempotency records; seeds the stock.
  void reset(const Config& cfg);
  /// Reads orders, stock and records from the database.
  DbState read_state(const Config& cfg);
  /// Deletes the order row `id` (a sold-out attempt's own insert) in `tx`.
  void remove_order(idem::mysql::Transaction& tx, std::int64_t id);

 private:
  std::string name_;
  std::unique_ptr<Durable> store_;
};

/// A whole sale on MySQL (+ Redis when `options.redis_url` is set).
Report run_mysql_sale(const Config& cfg, const MysqlSaleOptions& options);

}  // namespace flash_sale
