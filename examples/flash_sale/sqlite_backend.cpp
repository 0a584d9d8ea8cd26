// SPDX-License-Identifier: MIT
// The flash sale's SQLite backend: schema, reset, the end-state queries.
#include "sqlite_backend.hpp"

#include "failover_store.hpp"

namespace flash_sale {

using idem::sqlite::Session;
using idem::sqlite::Transaction;

SqliteBackend::SqliteBackend(const std::string& path)
    : db_(std::make_shared<idem::sqlite::Database>(path)),
      store_(std::make_unique<Durable>(db_)) {
  db_->write([](Transaction& tx) {
    // CHECK (qty >= 0) is defence in depth: the conditional UPDATE never needs it.
    tx.exec_script(
        "CREATE TABLE IF NOT EXISTS flash_stock ("
        " sku TEXT PRIMARY KEY,"
        " qty INTEGER NOT NULL CHECK (qty >= 0));"
        "CREATE TABLE IF NOT EXISTS flash_order ("
        " id INTEGER PRIMARY KEY AUTOINCREMENT,"
        " user_id INTEGER NOT NULL,"
        " sku TEXT NOT NULL,"
        " request_id TEXT NOT NULL,"
        " created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),"
        " UNIQUE (user_id, sku));");
  });
}

void SqliteBackend::reset(const Config& cfg) {
  db_->write([&](Transaction& tx) {
    tx.exec("DELETE FROM flash_order WHERE sku = ?", cfg.sku);
    tx.exec("INSERT INTO flash_stock (sku, qty) VALUES (?1, ?2) "
            "ON CONFLICT (sku) DO UPDATE SET qty = excluded.qty",
            cfg.sku, cfg.stock);
    tx.exec("DELETE FROM " + store_->table() + " WHERE biz_type = ?", kScope);
  });
}

DbState SqliteBackend::read_state(const Config& cfg) {
  return db_->read([&](Session& s) {
    DbState st;
    auto rows = s.prepare("SELECT user_id, id FROM flash_order WHERE sku = ? ORDER BY id");
    rows.bind_all(cfg.sku);
    while (rows.step()) {
      st.orders[rows.column_int64(0)].push_back(rows.column_int64(1));
      ++st.order_rows;
    }
    st.stock_left = s.query_int64("SELECT qty FROM flash_stock WHERE sku = ?", cfg.sku);
    const std::string t = store_->table();
    st.records_completed =
        s.query_int64("SELECT count(*) FROM " + t + " WHERE biz_type = ? AND status = " +
                          store_->status_literal(idem::Record::Status::kCompleted),
                      kScope)
            .value_or(0);
    st.records_in_progress =
        s.query_int64("SELECT count(*) FROM " + t + " WHERE biz_type = ? AND status = " +
                          store_->status_literal(idem::Record::Status::kInProgress),
                      kScope)
            .value_or(0);
    return st;
  });
}

void SqliteBackend::remove_order(Transaction& tx, std::int64_t id) {
  tx.exec("DELETE FROM flash_order WHERE id = ?", id);
}

Report run_sqlite_sale(const Config& cfg) {
  SqliteBackend backend(cfg.db);
  FailoverStore fast;
  return run_sale(backend, fast, cfg, [&] { fast.failover(); });
}

}  // namespace flash_sale
