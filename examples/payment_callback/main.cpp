// SPDX-License-Identifier: MIT
// examples/payment_callback: fires the same gateway callback 32 times concurrently, then once
// more after the order shipped, and shows that the order was paid once.
//
//   payment_callback [--db PATH]
#include <atomic>
#include <iostream>
#include <thread>
#include <vector>

#include "idem/log/fmt_sink.hpp"
#include "payment_callback.hpp"

int main(int argc, char** argv) {
  std::string path = ":memory:";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--db" && i + 1 < argc) {
      path = argv[++i];
    } else {
      std::cerr << "usage: payment_callback [--db PATH]\n";
      return 2;
    }
  }
  try {
    idem::sqlite::Database db{path};
    auto logger = std::make_shared<idem::LoggingObserver>(idem::log::stderr_sink());
    payment_callback::PaymentCallbackHandler handler{db, logger};
    db.write([](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT OR REPLACE INTO orders (order_no, amount, status) "
              "VALUES ('ORD-20001', 1999, 'WAIT_PAY')");
      tx.exec("DELETE FROM payments WHERE order_no = 'ORD-20001'");
    });
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
    db.write([](idem::sqlite::Transaction& tx) {
      tx.exec("UPDATE orders SET status = 'SHIPPED' WHERE order_no = 'ORD-20001'");
    });
    auto late = handler.handle(cb);
    auto payments = db.read([](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM payments WHERE order_no = 'ORD-20001'");
    });
    std::cout << "32 concurrent callbacks: " << success << " answered success, " << transitioned
              << " paid the order\nlate callback after SHIPPED: " << late.body
              << " (status " << late.status << ")\npayment rows: " << payments.value_or(0)
              << "\n";
    return payments.value_or(0) == 1 && transitioned == 1 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "payment_callback: " << e.what() << "\n";
    return 1;
  }
}
