// SPDX-License-Identifier: MIT
// Consumer of idem::core alone (header-only): a fast-only guard on MemoryStore.
#include <idem/idem.hpp>
#include <string>

#include "consumer.hpp"

int main() {
  check_version();
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  int runs = 0;
  for (int i = 0; i < 3; ++i) {
    auto r = guard.run(idem::Key::make("payment", "order_1"), idem::fingerprint("body"), [&] {
      ++runs;
      return std::string("pay_1");
    });
    CONSUMER_CHECK(r.ok() && *r.value == "pay_1");
  }
  CONSUMER_CHECK(runs == 1);
  try {
    (void)idem::Key::make("", "x");
    CONSUMER_CHECK(false);
  } catch (const idem::InvalidKey& e) {
    check_typed(e, idem::errc::kInvalidKey);
  }
  std::printf("core %s: handler ran once for 3 calls\n", idem::version());
  return 0;
}
