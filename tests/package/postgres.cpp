// SPDX-License-Identifier: MIT
// Consumer of idem::postgres; nothing listens on port 1.
#include <idem/postgres/postgres_store.hpp>

#include "consumer.hpp"

int main() {
  check_version();
  try {
    idem::postgres::PostgresStore durable{"host=127.0.0.1 port=1 connect_timeout=2"};
    CONSUMER_CHECK(false);
  } catch (const idem::StorageUnavailable& e) {
    check_typed(e, idem::errc::kStoreUnavailable);
  }
  std::printf("postgres: unreachable server reported as store_unavailable\n");
  return 0;
}
