// SPDX-License-Identifier: MIT
// AsyncPostgresStore's tests: a synchronous store, a pool and an AsyncPostgresStore on a loop
// thread of their own (the real server: IDEM_TEST_POSTGRES_DSN).
#pragma once

#include <future>
#include <memory>

#include "blocking_adapters.hpp"
#include "idem/async/postgres_store.hpp"
#include "pg_test_support.hpp"

namespace idem::test::async_pg {

namespace pg = idem::test::pg;
namespace anet = idem::async::net;
using idem::async::AsyncPostgresStore;
using idem::async::AsyncPostgresStoreOptions;
using idem::postgres::PostgresStore;

/// Waits for the store's close (queued on its strand by its destructor) to have run on `io`.
inline void drain(anet::io_context& io) {
  for (int i = 0; i < 2; ++i) {
    std::promise<void> p;
    anet::post(io, [&p] { p.set_value(); });
    p.get_future().wait();
  }
}

inline idem::postgres::PostgresStoreOptions sync_options() {
  auto o = pg::options();
  o.pool_size = 8;
  return o;
}

/// A synchronous store, a pool, and an AsyncPostgresStore on a loop thread of their own.
struct Holder {
  explicit Holder(AsyncPostgresStoreOptions ao = {},
                  idem::postgres::PostgresStoreOptions so = sync_options())
      : sync(so), workers({4, 256}) {
    async = std::make_unique<AsyncPostgresStore>(loop.executor(), sync, workers, std::move(ao));
  }
  ~Holder() { destroy(); }
  void destroy() {
    if (!async) return;
    std::promise<void> p;
    anet::post(loop.io(), [&] {
      async.reset();
      p.set_value();
    });
    p.get_future().wait();
    drain(loop.io());
  }
  idem::async::AsyncPostgresStats stats() {
    std::promise<idem::async::AsyncPostgresStats> p;
    anet::post(loop.io(), [&] { p.set_value(async->stats()); });
    return p.get_future().get();
  }
  idem::test::LoopThread loop;
  PostgresStore sync;
  idem::async::WorkerPool workers;
  std::unique_ptr<AsyncPostgresStore> async;
};

/// The durable store contract waited on, through AsyncPostgresStore.
using Blocking = idem::test::BlockingDurable<AsyncPostgresStore, PostgresStore>;

}  // namespace idem::test::async_pg
