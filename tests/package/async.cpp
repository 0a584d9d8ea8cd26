// SPDX-License-Identifier: MIT
// Consumer of idem::async (header-only, on Boost.Asio): AsyncGuard over MemoryStore on one
// io_context thread. No server is needed.
#include <idem/async/guard.hpp>
#include <idem/idem.hpp>
#include <string>

#include "consumer.hpp"

int main() {
  check_version();
  idem::async::net::io_context io;
  idem::MemoryStore memory;
  idem::async::InlineFastStore fast{memory};
  idem::async::AsyncGuard<> guard{io.get_executor(), fast};
  const auto key = idem::Key::make("payment", "o1");
  int runs = 0;
  std::string first, second;
  auto handler = idem::async::on_loop([&] {
    ++runs;
    return std::string("order_1");
  });
  guard.async_run(key, "fp", handler, [&](std::exception_ptr e, idem::GuardResult<std::string> r) {
    CONSUMER_CHECK(!e && r.outcome == idem::Outcome::kExecuted);
    first = *r.value;
    guard.async_run(key, "fp", handler,
                    [&](std::exception_ptr e2, idem::GuardResult<std::string> r2) {
                      CONSUMER_CHECK(!e2);
                      CONSUMER_CHECK(r2.outcome == idem::Outcome::kReplayed);
                      second = *r2.value;
                    });
  });
  io.run();
  CONSUMER_CHECK(runs == 1 && first == "order_1" && second == "order_1");
  // A blocking handler without a worker pool is refused, typed.
  io.restart();
  bool refused = false;
  guard.async_run(
      idem::Key::make("payment", "o2"), "fp", [] { return std::string("x"); },
      [&](std::exception_ptr e, idem::GuardResult<std::string>) {
        try {
          if (e) std::rethrow_exception(e);
        } catch (const idem::UsageError& u) {
          check_typed(u, idem::errc::kInvalidArgument);
          refused = true;
        }
      });
  io.run();
  CONSUMER_CHECK(refused);
  std::printf("async: executed once on the loop, replayed, a blocking handler refused\n");
  return 0;
}
