// SPDX-License-Identifier: MIT
// The flash sale on the embedded default: MemoryStore in front of SqliteStore, business tables
// in the same SQLite file (so the order, the deduction and the idempotency record commit
// together).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "flash_sale.hpp"
#include "idem/sqlite/sql_driver.hpp"
#include "idem/sqlite/sqlite_store.hpp"

namespace flash_sale {

/// The SQLite backend of run_sale.
class SqliteBackend {
 public:
  /// The durable store type.
  using Durable = idem::sqlite::SqliteStore;

  /// Opens (creates) `path`, the store's table and the sale's tables.
  explicit SqliteBackend(const std::string& path);

  /// The durable store.
  Durable& durable() { return *store_; }
  /// "sqlite + memory".
  std::string name() const { return "sqlite + memory"; }
  /// Empties the sale's tables and the scope's idempotency records; seeds the stock.
  void reset(const Config& cfg);
  /// Reads orders, stock and records from the database.
  DbState read_state(const Config& cfg);
  /// Deletes the order row `id` (a sold-out attempt's own insert) in `tx`.
  void remove_order(idem::sqlite::Transaction& tx, std::int64_t id);

 private:
  std::shared_ptr<idem::sqlite::Database> db_;
  std::unique_ptr<Durable> store_;
};

/// A whole sale on MemoryStore + SqliteStore (`cfg.db`).
Report run_sqlite_sale(const Config& cfg);

}  // namespace flash_sale
