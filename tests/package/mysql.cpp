// SPDX-License-Identifier: MIT
// Consumer of idem::mysql (MySQL / MariaDB durable store); nothing listens on port 1.
#include <idem/mysql/mysql_store.hpp>

#include "consumer.hpp"

int main() {
  check_version();
  try {
    idem::mysql::MysqlStore durable{"mysql://idem:idem@127.0.0.1:1/idem"};
    CONSUMER_CHECK(false);
  } catch (const idem::StorageUnavailable& e) {
    check_typed(e, idem::errc::kStoreUnavailable);
  }
  std::printf("mysql: unreachable server reported as store_unavailable\n");
  return 0;
}
