// SPDX-License-Identifier: MIT
// Built against an installed idem: proves the exported package and its dependencies resolve.
#include <cstdio>
#include <idem/idem.hpp>
#include <idem/redis/redis_store.hpp>
#include <idem/sqlite/sqlite_store.hpp>

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

  // idem::redis links too. No server is needed here: nothing listens on port 1, so the guard
  // goes on with SQLite alone (degraded) and still runs the handler once.
  idem::redis::RedisStore redis{"redis://127.0.0.1:1"};
  idem::IdempotencyGuard degraded{redis, durable};
  auto key2 = idem::Key::make("payment", "order_2");
  int runs2 = 0;
  for (int i = 0; i < 3; ++i) {
    auto r = degraded.run(key2, idem::fingerprint("body"), [&](idem::sqlite::Transaction&) {
      ++runs2;
      return std::string("pay_2");
    });
    if (!r.ok() || *r.value != "pay_2" || !r.degraded) return 1;
  }
  std::printf("package consumer (redis down): handler ran %d time(s) for 3 calls, %llu degraded\n",
              runs2, static_cast<unsigned long long>(degraded.stats().snapshot().degraded));
  return runs == 1 && runs2 == 1 ? 0 : 1;
}
