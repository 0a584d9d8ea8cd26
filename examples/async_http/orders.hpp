// SPDX-License-Identifier: MIT
// examples/async_http: the orders of the example (a SQLite table) and their creation, inside the
// guard's transaction.
#pragma once

#include <string>
#include <string_view>

#include "idem/http/response.hpp"
#include "idem/sqlite/sqlite_store.hpp"

namespace async_http {

/// Creates the orders table (once).
inline void create_orders_table(idem::sqlite::SqliteStore& store) {
  store.database().write([](idem::sqlite::Transaction& tx) {
    tx.exec("CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, body TEXT NOT NULL)");
  });
}

/// One order from `body`, in `tx` (the guard's transaction: the order and idem's record commit
/// together). An empty body is refused with 400 (stored and replayed like any answer below 500).
inline idem::http::Response create_order(idem::sqlite::Transaction& tx, std::string_view body) {
  idem::http::Response r;
  if (body.empty()) {
    r.status = 400;
    r.headers.push_back({"Content-Type", "application/json"});
    r.body = "{\"error\":\"empty order\"}";
    return r;
  }
  tx.exec("INSERT INTO orders (body) VALUES (?)", std::string(body));
  const long long id = tx.query_int64("SELECT last_insert_rowid()").value_or(0);
  r.status = 201;
  r.headers.push_back({"Content-Type", "application/json"});
  // The order's id as a header too (stored and replayed with the body). No Location: this
  // example serves no GET route for an order.
  r.headers.push_back({"X-Order-Id", std::to_string(id)});
  r.body = "{\"order_id\":" + std::to_string(id) + ",\"status\":\"created\"}";
  return r;
}

}  // namespace async_http
