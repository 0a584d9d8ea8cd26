// SPDX-License-Identifier: MIT
// examples/async_http: `POST /orders` with Idempotency-Key on ONE loop thread (Boost.Beast +
// idem::async::AsyncGuard); the orders and idem's records in SQLite on a worker pool, Redis
// (AsyncRedisStore, on the loop) or an in-process MemoryStore in front.
//
//   async_http [--port 8080] [--db orders.db] [--redis redis://127.0.0.1:6379]
//
//   curl -i -X POST localhost:8080/orders -H 'Idempotency-Key: "k1"' -d '{"sku":"A1","qty":2}'
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <string>

#include "idem/async/pooled_durable.hpp"
#include "idem/async/redis_store.hpp"
#include "idem/memory_store.hpp"
#include "order_server.hpp"
#include "orders.hpp"

constexpr const char* kUsage = "usage: async_http [--port N] [--db FILE] [--redis URL]\n";

int main(int argc, char** argv) {
  unsigned short port = 8080;
  std::string db = "orders.db", redis;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "async_http: %s needs a value\n", k.c_str());
      std::fputs(kUsage, stderr);
      return 2;
    }
    if (k == "--port") {
      char* end = nullptr;
      errno = 0;
      const long n = std::strtol(argv[i + 1], &end, 10);
      if (errno != 0 || end == argv[i + 1] || *end != '\0' || n < 0 || n > 65535) {
        std::fprintf(stderr, "async_http: --port needs 0..65535, got '%s'\n", argv[i + 1]);
        return 2;
      }
      port = static_cast<unsigned short>(n);
    } else if (k == "--db") {
      db = argv[i + 1];
    } else if (k == "--redis") {
      redis = argv[i + 1];
    } else {
      std::fputs(kUsage, stderr);
      return 2;
    }
  }
  // A port in use, a database that cannot be opened, a refused Redis URL: a message and exit 1.
  try {
    namespace net = async_http::net;
    net::io_context io(1);  // ONE loop thread serves every connection
    idem::sqlite::SqliteStore sqlite(db);
    async_http::create_orders_table(sqlite);
    // The transactions: 4 threads. Emptied (below) before the guard its queued jobs use is gone.
    std::optional<idem::async::WorkerPool> workers(std::in_place);
    idem::async::PooledDurable<idem::sqlite::SqliteStore> durable(sqlite, *workers);
    idem::MemoryStore memory;
    std::unique_ptr<idem::async::AsyncFastStore> fast;
    if (redis.empty()) {
      fast = std::make_unique<idem::async::InlineFastStore>(memory);
    } else {
      fast = std::make_unique<idem::async::AsyncRedisStore>(io.get_executor(), redis);
    }
    idem::async::AsyncGuardOptions o;
    o.pool = &*workers;
    idem::async::AsyncGuard guard(io.get_executor(), *fast, durable, o);
    async_http::OrderServer<idem::async::PooledDurable<idem::sqlite::SqliteStore>> server(
        io, guard, async_http::create_order,
        async_http::tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
    server.start();
    net::signal_set signals(io, SIGINT, SIGTERM);
    signals.async_wait([&](const auto&, int) {
      server.stop();
      io.stop();
    });
    std::printf("async_http: POST http://127.0.0.1:%u/orders (fast store: %s)\n", server.port(),
                redis.empty() ? "memory" : redis.c_str());
    std::fflush(stdout);
    io.run();
    // Stopped with calls in flight: their queued transactions run (and commit or roll back) now,
    // while the guard, the stores and the server they use are still alive; their completions
    // stay queued on the stopped loop and are destroyed with it.
    workers.reset();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "async_http: %s\n", e.what());
    return 1;
  }
  return 0;
}
