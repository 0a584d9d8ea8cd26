// SPDX-License-Identifier: MIT
// examples/payment_callback: fires the same gateway callback 32 times concurrently, then once
// more after the order shipped, and shows that the order was paid once.
//
//   payment_callback [--db PATH | --postgres DSN | --mysql URI [--redis URL]]
#include <unistd.h>

#include <atomic>
#include <iostream>
#include <thread>
#include <vector>

#include "idem/log/fmt_sink.hpp"
#include "payment_callback.hpp"
#ifdef PAYMENT_CALLBACK_WITH_POSTGRES
#include "payment_callback_pg.hpp"
#endif
#ifdef PAYMENT_CALLBACK_WITH_MYSQL
#include "payment_callback_mysql.hpp"
#ifdef PAYMENT_CALLBACK_WITH_REDIS
#include "idem/redis/redis_store.hpp"
#endif
#endif

namespace {

// The demo on any handler: `reset(status)` puts ORD-20001 in `status` with no payment,
// `payments()` counts its payment rows.
template <class Handler, class Reset, class Payments>
int demo(Handler& handler, Reset reset, Payments payments) {
  reset("WAIT_PAY");
  payment_callback::Callback cb{"ORD-20001", "T-30001", 1999, idem::to_millis(idem::system_now())};
  std::atomic<int> success{0}, transitioned{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&] {
      auto a = handler.handle(cb);
      if (a.body == "success") ++success;
      if (a.transition == payment_callback::Transition::kTransitioned) ++transitioned;
    });
  }
  for (auto& t : threads) t.join();
  reset("SHIPPED");
  auto late = handler.handle(cb);
  long long rows = payments();
  std::cout << "32 concurrent callbacks: " << success << " answered success, " << transitioned
            << " paid the order\nlate callback after SHIPPED: " << late.body << " (status "
            << late.status << ")\npayment rows: " << rows << "\n";
  return rows == 1 && transitioned == 1 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string path = ":memory:";
  std::string dsn, mysql_uri, redis_url;
  int backends = 0;  // --db, --postgres, --mysql: at most one
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << "usage: payment_callback [--db PATH | --postgres DSN | --mysql URI [--redis "
                   "URL]]\n";
      return 0;
    }
    if (a == "--db" && i + 1 < argc) {
      path = argv[++i];
      ++backends;
    } else if (a == "--postgres" && i + 1 < argc) {
      dsn = argv[++i];
      ++backends;
    } else if (a == "--mysql" && i + 1 < argc) {
      mysql_uri = argv[++i];
      ++backends;
    } else if (a == "--redis" && i + 1 < argc) {
      redis_url = argv[++i];
    } else {
      std::cerr << "usage: payment_callback [--db PATH | --postgres DSN | --mysql URI [--redis "
                   "URL]]\n";
      return 2;
    }
  }
  // --redis is the fast store of the MySQL backend only: anywhere else it would be ignored.
  if (!redis_url.empty() && mysql_uri.empty()) {
    std::cerr << "payment_callback: --redis needs --mysql (the fast store of the MySQL backend)\n";
    return 2;
  }
  if (backends > 1) {
    std::cerr << "payment_callback: choose one of --db, --postgres, --mysql\n";
    return 2;
  }
  try {
    auto logger = std::make_shared<idem::LoggingObserver>(idem::log::stderr_sink());
    if (!dsn.empty()) {
#ifdef PAYMENT_CALLBACK_WITH_POSTGRES
      idem::postgres::PostgresStore store{dsn};
      payment_callback::PostgresPaymentCallbackHandler handler{store, logger};
      return demo(
          handler,
          [&](const char* status) {
            store.with_transaction([&](pqxx::work& tx) {
              tx.exec_params(
                  "INSERT INTO orders (order_no, amount, status) VALUES ('ORD-20001', 1999, $1)"
                  " ON CONFLICT (order_no) DO UPDATE SET status = EXCLUDED.status,"
                  " paid_at = CASE WHEN EXCLUDED.status = 'WAIT_PAY' THEN NULL"
                  " ELSE orders.paid_at END",
                  std::string(status));
              if (std::string(status) == "WAIT_PAY") {
                tx.exec("DELETE FROM payments WHERE order_no = 'ORD-20001'");
              }
            });
          },
          [&] {
            return store.with_transaction([](pqxx::work& tx) {
              return tx.exec1("SELECT count(*) FROM payments WHERE order_no = 'ORD-20001'")[0]
                  .as<long long>();
            });
          });
#else
      std::cerr << "payment_callback: this build has no PostgreSQL backend (idem::postgres)\n";
      return 2;
#endif
    }
    if (!mysql_uri.empty()) {
#ifdef PAYMENT_CALLBACK_WITH_MYSQL
      idem::mysql::MysqlStore store{mysql_uri};  // api_idempotency migrated (the guard's records)
      payment_callback::MysqlPaymentCallbackHandler handler{store, logger};
      auto reset = [&](const char* status) {
        store.with_transaction([&](idem::mysql::Transaction& tx) {
          tx.exec(
              "INSERT INTO orders (order_no, amount, status) VALUES ('ORD-20001', 1999, ?)"
              " ON DUPLICATE KEY UPDATE status = VALUES(status),"
              " paid_at = IF(VALUES(status) = 'WAIT_PAY', NULL, paid_at)",
              std::string(status));
          if (std::string(status) == "WAIT_PAY") {
            tx.exec("DELETE FROM payments WHERE order_no = 'ORD-20001'");
            tx.exec("DELETE FROM api_idempotency WHERE biz_type = 'payment.callback'");
          }
        });
      };
      auto payments = [&] {
        return static_cast<long long>(store.with_session([](idem::mysql::Session& s) {
          return s.query_int64("SELECT count(*) FROM payments WHERE order_no = 'ORD-20001'")
              .value_or(0);
        }));
      };
      if (redis_url.empty()) return demo(handler, reset, payments);
#ifdef PAYMENT_CALLBACK_WITH_REDIS
      idem::redis::RedisStoreOptions ro{redis_url};
      // A prefix of this run: an earlier run's answers must not replay here.
      ro.key_prefix = "idem_payment_callback_" + std::to_string(::getpid()) + ":";
      idem::redis::RedisStore fast{ro};
      payment_callback::GuardedPaymentCallbackHandler guarded{fast, store, handler};
      int rc = demo(guarded, reset, payments);
      auto s = guarded.stats().snapshot();
      std::cout << "guard: " << s.fast_hits << " callbacks answered by Redis, " << s.executed
                << " ran the state machine\n";
      return rc;
#else
      std::cerr << "payment_callback: this build has no Redis adapter (idem::redis)\n";
      return 2;
#endif
#else
      std::cerr << "payment_callback: this build has no MySQL backend (idem::mysql)\n";
      return 2;
#endif
    }
    idem::sqlite::Database db{path};
    payment_callback::PaymentCallbackHandler handler{db, logger};
    return demo(
        handler,
        [&](const char* status) {
          db.write([&](idem::sqlite::Transaction& tx) {
            if (std::string(status) == "WAIT_PAY") {
              tx.exec("INSERT OR REPLACE INTO orders (order_no, amount, status) "
                      "VALUES ('ORD-20001', 1999, 'WAIT_PAY')");
              tx.exec("DELETE FROM payments WHERE order_no = 'ORD-20001'");
            } else {
              tx.exec("UPDATE orders SET status = ? WHERE order_no = 'ORD-20001'",
                      std::string(status));
            }
          });
        },
        [&] {
          return static_cast<long long>(
              db.read([](idem::sqlite::Session& s) {
                  return s.query_int64("SELECT count(*) FROM payments WHERE order_no = 'ORD-20001'");
                }).value_or(0));
        });
  } catch (const std::exception& e) {
    std::cerr << "payment_callback: " << e.what() << "\n";
    return 1;
  }
}
