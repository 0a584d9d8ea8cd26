// SPDX-License-Identifier: MIT
// Consumer of idem::redis. No server is needed: nothing listens on port 1, so the store fails
// with a typed error.
#include <idem/idem.hpp>
#include <idem/redis/redis_store.hpp>
#include <string>

#include "consumer.hpp"

int main() {
  check_version();
  idem::redis::RedisStore fast{"redis://127.0.0.1:1"};
  CONSUMER_CHECK(fast.redis_key(idem::Key::make("payment", "o1")) == "idem:{payment|o1}");
  idem::IdempotencyGuard guard{fast};
  try {
    (void)guard.run(idem::Key::make("payment", "o1"), "", [] { return std::string("x"); });
    CONSUMER_CHECK(false);
  } catch (const idem::StorageUnavailable& e) {
    check_typed(e, idem::errc::kStoreUnavailable);
  }
  try {
    idem::redis::RedisStore bad{"rediss-nope://h"};
    CONSUMER_CHECK(false);
  } catch (const idem::UsageError& e) {
    check_typed(e, idem::errc::kInvalidArgument);
  }
  std::printf("redis: unreachable server reported as store_unavailable\n");
  return 0;
}
