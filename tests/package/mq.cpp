// SPDX-License-Identifier: MIT
// Consumer of idem::mq (Redis Streams client); nothing listens on port 1.
#include <idem/mq/redis_streams.hpp>

#include "consumer.hpp"

int main() {
  check_version();
  idem::mq::RedisStreams streams{"redis://127.0.0.1:1"};
  try {
    streams.ping();
    CONSUMER_CHECK(false);
  } catch (const idem::StorageUnavailable& e) {
    check_typed(e, idem::errc::kStoreUnavailable);
  }
  std::printf("mq: unreachable server reported as store_unavailable\n");
  return 0;
}
