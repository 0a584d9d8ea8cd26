// SPDX-License-Identifier: MIT
// idem::StockTable: stock deduction with one conditional UPDATE, which can never take the
// quantity below zero; inside a guarded transaction it is applied once per idempotency key.
//
// File: stock.hpp
//
// `deduct(tx, sku, n)` runs, in the caller's transaction,
//
//     UPDATE stock SET qty = qty - ?2 WHERE sku = ?1 AND qty >= ?2 RETURNING qty
//
// and answers kDeducted (with the quantity left), or, when no row changed, reads the row once
// and answers kInsufficient (with the quantity there is) or kUnknownItem. The check and the
// decrement are one statement: two buyers of the last unit cannot both pass the check, on SQLite
// (one writer at a time) or on PostgreSQL (the second UPDATE waits for the first's row lock, then
// re-evaluates `qty >= n` against the committed row under READ COMMITTED), or on MySQL (an
// UPDATE reads the latest committed row whatever the isolation level; there the new quantity
// comes back through `qty = LAST_INSERT_ID(qty - ?2)`, MySQL having no RETURNING: a deduction
// therefore sets the connection's LAST_INSERT_ID() to the quantity left, so read an order's
// AUTO_INCREMENT id before deducting, not after). No read-modify-write, no SELECT ... FOR
// UPDATE, no negative stock (keep the quantity column an integer: a row whose quantity is NULL
// is answered kUnknownItem).
//
// What the conditional UPDATE alone does *not* give is "applied once": a retried or
// double-clicked order runs it again. Run it inside a transactional IdempotencyGuard handler:
// the deduction and the idempotency record commit together, so a repeat of the same key replays
// the stored response and never reaches the UPDATE. A sold-out answer is a *response* (a
// value the handler returns, e.g. "sold_out"), not an exception: it is stored and replayed too,
// so the client that was told "sold out" keeps being told so, even if stock comes back later.
//
// @code
//   static const idem::StockTable stock{"stock", "sku", "qty"};
//   auto r = guard.run(key, fp, [&](idem::sqlite::Transaction& tx) -> std::string {
//     auto d = stock.deduct(tx, sku, 1);
//     if (!d.ok()) return "sold_out";                    // stored and replayed, not thrown
//     tx.exec("INSERT INTO orders (user_id, sku) VALUES (?, ?)", user_id, sku);
//     return "ordered";
//   });
// @endcode
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "idem/errors.hpp"
#include "idem/sql.hpp"
#include "idem/sql_driver.hpp"

namespace idem {

/// What a deduction found.
enum class DeductStatus {
  kDeducted,      ///< the quantity was taken; `remaining` is what is left
  kInsufficient,  ///< fewer than requested (sold out when `remaining` is 0); nothing changed
  kUnknownItem,   ///< no row for this item (or its quantity is NULL); nothing changed
};

/// Stable name: deducted, insufficient, unknown_item.
constexpr std::string_view deduct_status_name(DeductStatus s) noexcept {
  switch (s) {
    case DeductStatus::kDeducted: return "deducted";
    case DeductStatus::kInsufficient: return "insufficient";
    case DeductStatus::kUnknownItem: return "unknown_item";
  }
  return "unknown";
}

/// The answer of StockTable::deduct.
struct [[nodiscard]] Deduction {
  /// Deducted, insufficient, or unknown item.
  DeductStatus status = DeductStatus::kDeducted;
  /// kDeducted: the quantity after the deduction. kInsufficient: the quantity there is.
  /// kUnknownItem: 0.
  std::int64_t remaining = 0;

  /// True when the quantity was deducted.
  bool ok() const noexcept { return status == DeductStatus::kDeducted; }
};

/// A stock table: one row per item with a quantity column (see the file comment). Thread-safe
/// and immutable; build one per table and keep it.
class StockTable {
 public:
  /// @param table            e.g. "stock"
  /// @param item_column      the item's key column, e.g. "sku" (unique in the table)
  /// @param quantity_column  the integer quantity column, e.g. "qty"
  /// @throws idem::UsageError for an invalid identifier or the same column twice.
  explicit StockTable(std::string table = "stock", std::string item_column = "sku",
                      std::string quantity_column = "qty")
      : table_(std::move(table)),
        item_(std::move(item_column)),
        quantity_(std::move(quantity_column)) {
    check_sql_identifier("table", table_);
    check_sql_identifier("item column", item_);
    check_sql_identifier("quantity column", quantity_);
    if (same_sql_identifier(item_, quantity_)) {
      throw UsageError("idem::StockTable: item and quantity columns must differ");
    }
    for (std::size_t d = 0; d < kSqlDialects; ++d) {
      auto dialect = static_cast<SqlDialect>(d);
      auto p1 = detail::placeholder(dialect, 1);
      auto p2 = detail::placeholder(dialect, 2);
      select_sql_[d] = "SELECT " + quantity_ + " FROM " + table_ + " WHERE " + item_ + " = " + p1;
      if (dialect == SqlDialect::kMysql) {
        // No RETURNING on MySQL: LAST_INSERT_ID(expr) hands the new quantity back with the
        // UPDATE's own answer. The read after a refused deduction is a locking one, so it
        // reports the quantity the UPDATE saw, not REPEATABLE READ's older snapshot.
        deduct_sql_[d] = "UPDATE " + table_ + " SET " + quantity_ + " = LAST_INSERT_ID(" +
                         quantity_ + " - " + p2 + ") WHERE " + item_ + " = " + p1 + " AND " +
                         quantity_ + " >= " + p2;
        refused_sql_[d] = select_sql_[d] + " LOCK IN SHARE MODE";
      } else {
        deduct_sql_[d] = "UPDATE " + table_ + " SET " + quantity_ + " = " + quantity_ + " - " +
                         p2 + " WHERE " + item_ + " = " + p1 + " AND " + quantity_ + " >= " + p2 +
                         " RETURNING " + quantity_;
        refused_sql_[d] = select_sql_[d];
      }
    }
  }

  /// Takes `n` units of `item` if at least `n` are there, in the caller's transaction `tx`.
  /// Never takes the quantity below zero; never throws for "not enough".
  ///
  /// @param tx    the caller's open transaction (a type with a SqlDriver)
  /// @param item  the item's key (bound)
  /// @param n     units to take; must be positive
  /// @return kDeducted with the quantity left, kInsufficient with the quantity there is, or
  ///         kUnknownItem.
  /// @throws idem::UsageError when n <= 0; the driver's storage errors.
  template <class Tx, class Item>
  Deduction deduct(Tx& tx, const Item& item, std::int64_t n) const {
    static_assert(detail::has_sql_driver<Tx>::value,
                  "idem::StockTable: no SqlDriver for this transaction type; include the "
                  "adapter's sql_driver.hpp (e.g. idem/sqlite/sql_driver.hpp)");
    using Driver = SqlDriver<Tx>;
    if (n <= 0) {
      throw UsageError("idem::StockTable: deduct " + std::to_string(n) + " from '" + table_ +
                       "': the quantity must be positive");
    }
    auto d = static_cast<std::size_t>(Driver::kDialect);
    if (auto left = Driver::query_int64(tx, deduct_sql_[d], item, n)) {
      return Deduction{DeductStatus::kDeducted, *left};
    }
    if (auto there = Driver::query_int64(tx, refused_sql_[d], item)) {
      return Deduction{DeductStatus::kInsufficient, *there};
    }
    return Deduction{DeductStatus::kUnknownItem, 0};
  }

  /// The quantity of `item`, read in `tx`; nullopt when there is no row.
  template <class Tx, class Item>
  std::optional<std::int64_t> quantity(Tx& tx, const Item& item) const {
    static_assert(detail::has_sql_driver<Tx>::value,
                  "idem::StockTable: no SqlDriver for this transaction type; include the "
                  "adapter's sql_driver.hpp (e.g. idem/sqlite/sql_driver.hpp)");
    using Driver = SqlDriver<Tx>;
    return Driver::query_int64(tx, select_sql_[static_cast<std::size_t>(Driver::kDialect)], item);
  }

  /// The conditional UPDATE in `dialect` (for logs, reviews and tests).
  const std::string& deduct_sql(SqlDialect dialect) const noexcept {
    return deduct_sql_[static_cast<std::size_t>(dialect)];
  }
  /// The table name.
  const std::string& table() const noexcept { return table_; }

 private:
  std::string table_, item_, quantity_;
  std::string deduct_sql_[kSqlDialects];
  std::string select_sql_[kSqlDialects];
  std::string refused_sql_[kSqlDialects];  // the read after a refused deduction
};

}  // namespace idem
