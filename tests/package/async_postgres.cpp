// SPDX-License-Identifier: MIT
// Consumer of idem::async_postgres. No server is needed: nothing listens on port 1, so the
// durable begin, sent from the loop, fails with a typed error.
#include <idem/async/guard.hpp>
#include <idem/async/postgres_store.hpp>
#include <idem/idem.hpp>
#include <string>

#include "consumer.hpp"

int main() {
  check_version();
  idem::async::net::io_context io;
  idem::postgres::PostgresStoreOptions so;
  so.conninfo = "host=127.0.0.1 port=1 dbname=idem user=idem";
  so.migrate = false;  // connects lazily: nothing is tried before the first call
  idem::postgres::PostgresStore sync{so};
  idem::async::WorkerPool pool;
  idem::async::AsyncPostgresStore durable{io.get_executor(), sync, pool};
  CONSUMER_CHECK(durable.name() == "postgres");
  idem::async::AsyncGuard<idem::async::AsyncPostgresStore> guard{io.get_executor(), durable};
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
  std::printf("async_postgres: unreachable server reported as store_unavailable\n");
  return 0;
}
