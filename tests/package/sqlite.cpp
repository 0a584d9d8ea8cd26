// SPDX-License-Identifier: MIT
// Consumer of idem::sqlite: MemoryStore in front of SQLite, business table in the same commit.
#include <idem/idem.hpp>
#include <idem/sqlite/sqlite_store.hpp>
#include <string>

#include "consumer.hpp"

int main() {
  check_version();
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable(":memory:");
  durable.database().write([](idem::sqlite::Transaction& tx) {
    tx.exec("CREATE TABLE payment (order_no TEXT PRIMARY KEY, amount INTEGER NOT NULL)");
  });
  idem::IdempotencyGuard guard{fast, durable};
  int runs = 0;
  for (int i = 0; i < 3; ++i) {
    auto r =
        guard.run(idem::Key::make("payment", "order_1"), idem::fingerprint("body"),
                  [&](idem::sqlite::Transaction& tx) {
                    ++runs;
                    tx.exec("INSERT INTO payment (order_no, amount) VALUES (?, ?)", "order_1", 100);
                    return std::string("pay_1");
                  });
    CONSUMER_CHECK(r.ok() && *r.value == "pay_1");
  }
  CONSUMER_CHECK(runs == 1);
  std::printf("sqlite: handler ran once for 3 calls\n");
  return 0;
}
