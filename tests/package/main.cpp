// SPDX-License-Identifier: MIT
// Built against an installed idem: proves the exported package and its dependencies resolve.
#include <idem/idem.hpp>
#include <idem/sqlite/sqlite_store.hpp>

#include <cstdio>

int main() {
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable(":memory:");
  idem::IdempotencyGuard guard{fast, durable};
  auto key = idem::Key::make("payment", "order_1");
  int runs = 0;
  for (int i = 0; i < 3; ++i) {
    auto r = guard.run(key, idem::fingerprint("body"), [&](idem::sqlite::Transaction&) {
      ++runs;
      return std::string("pay_1");
    });
    if (!r.ok() || *r.value != "pay_1") return 1;
  }
  std::printf("package consumer: handler ran %d time(s) for 3 calls\n", runs);
  return runs == 1 ? 0 : 1;
}
