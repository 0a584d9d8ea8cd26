// SPDX-License-Identifier: MIT
// Consumer of idem::async_redis. No server is needed: nothing listens on port 1, so the claim
// fails with a typed error, on the loop.
#include <idem/async/guard.hpp>
#include <idem/async/redis_store.hpp>
#include <idem/idem.hpp>
#include <string>

#include "consumer.hpp"

int main() {
  check_version();
  idem::async::net::io_context io;
  idem::async::AsyncRedisStore fast{io.get_executor(), "redis://127.0.0.1:1"};
  CONSUMER_CHECK(fast.redis_key(idem::Key::make("payment", "o1")) == "idem:{payment|o1}");
  idem::async::AsyncGuard<> guard{io.get_executor(), fast};
  bool failed = false;
  guard.async_run(idem::Key::make("payment", "o1"), "",
                  idem::async::on_loop([] { return std::string("x"); }),
                  [&](std::exception_ptr e, idem::GuardResult<std::string>) {
                    try {
                      if (e) std::rethrow_exception(e);
                    } catch (const idem::StorageUnavailable& u) {
                      check_typed(u, idem::errc::kStoreUnavailable);
                      failed = true;
                    }
                  });
  io.run();
  CONSUMER_CHECK(failed);
  try {
    idem::async::AsyncRedisStore bad{io.get_executor(), "rediss-nope://h"};
    CONSUMER_CHECK(false);
  } catch (const idem::UsageError& e) {
    check_typed(e, idem::errc::kInvalidArgument);
  }
  std::printf("async_redis: unreachable server reported as store_unavailable\n");
  return 0;
}
