// SPDX-License-Identifier: MIT
// examples/order_http: an order service whose POST /orders honours Idempotency-Key.
//
//   order_http [--port N] [--db PATH | --postgres DSN] [--redis URL] [--log]
//   (env: IDEM_ORDER_PORT, IDEM_ORDER_DB, IDEM_ORDER_DSN, IDEM_ORDER_REDIS)
//
// Then:
//   curl -i -X POST http://127.0.0.1:8080/orders -H 'Idempotency-Key: "abc"'
//        -H 'Content-Type: application/json' -d '{"sku":"A1","qty":2}'     (one line)
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include "idem/log.hpp"
#include "idem/log/fmt_sink.hpp"
#include "idem/memory_store.hpp"
#include "idem/prometheus/prometheus_observer.hpp"
#include "order_server.hpp"
#ifdef ORDER_HTTP_WITH_POSTGRES
#include "postgres_orders.hpp"
#endif
#ifdef ORDER_HTTP_WITH_REDIS
#include "idem/redis/redis_store.hpp"
#endif

namespace {

volatile std::sig_atomic_t g_stop = 0;

void usage(std::ostream& out) {
  out << "usage: order_http [--port N] [--db PATH | --postgres DSN] [--redis URL] [--log]\n"
         "  --port N        port to listen on (default 8080, env IDEM_ORDER_PORT; 0 = any free)\n"
         "  --db PATH       SQLite file for orders and idempotency records (default\n"
         "                  orders.sqlite, env IDEM_ORDER_DB)\n"
         "  --postgres DSN  PostgreSQL (postgresql:// URI or libpq conninfo) instead of SQLite\n"
         "                  (env IDEM_ORDER_DSN; needs a build with idem::postgres)\n"
         "  --redis URL     Redis fast store in front of the database instead of the in-process\n"
         "                  one (redis://host:port[/db], env IDEM_ORDER_REDIS; needs idem::redis)\n"
         "  --log           log duplicates and store events to stderr\n";
}

const char* env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}

// Serves until SIGINT/SIGTERM.
template <class Durable, class Orders>
void serve(idem::FastStore& fast, Durable& durable, Orders& orders, idem::GuardOptions options,
           prometheus::Registry& registry, int port, const std::string& what) {
  idem::IdempotencyGuard<Durable> guard{fast, durable, std::move(options)};
  order_http::ServerOptions server_options;
  server_options.port = port;
  order_http::OrderServer<Durable, Orders> server{guard, orders, registry, server_options};
  server.start();
  std::cout << "order_http listening on " << server.url() << " (" << what << ", fast store "
            << fast.name() << ")" << std::endl;
  std::signal(SIGINT, [](int) { g_stop = 1; });
  std::signal(SIGTERM, [](int) { g_stop = 1; });
  while (g_stop == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  server.stop();
}

}  // namespace

int main(int argc, char** argv) {
  int port = std::atoi(env_or("IDEM_ORDER_PORT", "8080"));
  std::string db = env_or("IDEM_ORDER_DB", "orders.sqlite");
  std::string dsn = env_or("IDEM_ORDER_DSN", "");
  std::string redis = env_or("IDEM_ORDER_REDIS", "");
  bool log = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "order_http: " << a << " needs a value\n";
        usage(std::cerr);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--port") {
      std::string v = value();
      char* end = nullptr;
      long p = std::strtol(v.c_str(), &end, 10);
      if (*end != '\0' || p < 0 || p > 65535) {
        std::cerr << "order_http: bad port '" << v << "'\n";
        return 2;
      }
      port = static_cast<int>(p);
    } else if (a == "--db") {
      db = value();
    } else if (a == "--postgres") {
      dsn = value();
    } else if (a == "--redis") {
      redis = value();
    } else if (a == "--log") {
      log = true;
    } else if (a == "-h" || a == "--help") {
      usage(std::cout);
      return 0;
    } else {
      std::cerr << "order_http: unknown argument '" << a << "'\n";
      usage(std::cerr);
      return 2;
    }
  }
#ifndef ORDER_HTTP_WITH_POSTGRES
  if (!dsn.empty()) {
    std::cerr << "order_http: this build has no PostgreSQL backend (idem::postgres); "
                 "run without --postgres / IDEM_ORDER_DSN to use SQLite\n";
    return 2;
  }
#endif
#ifndef ORDER_HTTP_WITH_REDIS
  if (!redis.empty()) {
    std::cerr << "order_http: this build has no Redis fast store (idem::redis); "
                 "run without --redis / IDEM_ORDER_REDIS\n";
    return 2;
  }
#endif

  try {
    prometheus::Registry registry;
    auto observers = std::make_shared<idem::ObserverList>();
    observers->add(std::make_shared<idem::PrometheusObserver>(registry));
    if (log) observers->add(std::make_shared<idem::LoggingObserver>(idem::log::stderr_sink()));
    idem::GuardOptions options;
    options.observer = observers;

    std::unique_ptr<idem::FastStore> fast;
#ifdef ORDER_HTTP_WITH_REDIS
    if (!redis.empty()) fast = std::make_unique<idem::redis::RedisStore>(redis);
#endif
    if (!fast) fast = std::make_unique<idem::MemoryStore>();

#ifdef ORDER_HTTP_WITH_POSTGRES
    if (!dsn.empty()) {
      idem::postgres::PostgresStore durable{dsn};  // connects and migrates: fails fast
      order_http::PostgresOrders orders{durable};
      serve(*fast, durable, orders, options, registry, port, "postgres");
      return 0;
    }
#endif
    idem::sqlite::SqliteStore durable{db};
    order_http::SqliteOrders orders{durable.database()};
    serve(*fast, durable, orders, options, registry, port, "db " + db);
  } catch (const std::exception& e) {
    std::cerr << "order_http: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
