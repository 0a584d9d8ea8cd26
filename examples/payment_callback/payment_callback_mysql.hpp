// SPDX-License-Identifier: MIT
// examples/payment_callback on MySQL / MariaDB: the same callback logic (idem::StateMachine's
// one conditional UPDATE WAIT_PAY -> PAID with paid_at, and the payment row, in one InnoDB
// transaction) on connections of an idem::mysql::MysqlStore's pool; optionally behind an
// IdempotencyGuard with Redis in front and the seed table api_idempotency behind it.
//
// Concurrent callbacks for one order: the second UPDATE waits for the first transaction's row
// lock, then re-reads the committed row (an UPDATE always reads the latest version), changes
// nothing, and the state machine's locking read sees PAID: a duplicate (REPEATABLE READ's
// snapshot would have shown WAIT_PAY). No second payment row.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "idem/guard.hpp"
#include "idem/mysql/mysql_store.hpp"
#include "idem/mysql/state_machine.hpp"
#include "payment_callback.hpp"

namespace payment_callback {

/// The MySQL calls of CallbackLogic.
class MysqlBackend {
 public:
  /// The transaction type.
  using Tx = idem::mysql::Transaction;
  /// Creates the tables if missing (InnoDB, utf8mb4).
  MysqlBackend(idem::mysql::MysqlStore& store, Tables tables)
      : store_(store), t_(std::move(tables)) {
    idem::check_sql_identifier("orders table", t_.orders);
    idem::check_sql_identifier("payments table", t_.payments);
    idem::check_sql_identifier("refunds table", t_.refunds);
    store_.with_session([&](idem::mysql::Session& s) {
      s.exec_text("CREATE TABLE IF NOT EXISTS " + t_.orders +
                  " (order_no varchar(64) PRIMARY KEY, amount bigint NOT NULL,"
                  " status varchar(16) NOT NULL, paid_at bigint) ENGINE=InnoDB");
      s.exec_text("CREATE TABLE IF NOT EXISTS " + t_.payments +
                  " (order_no varchar(64) PRIMARY KEY, trade_no varchar(64) NOT NULL,"
                  " amount bigint NOT NULL, paid_at bigint NOT NULL) ENGINE=InnoDB");
      s.exec_text("CREATE TABLE IF NOT EXISTS " + t_.refunds +
                  " (id bigint AUTO_INCREMENT PRIMARY KEY, order_no varchar(64) NOT NULL,"
                  " trade_no varchar(64) NOT NULL, amount bigint NOT NULL,"
                  " UNIQUE KEY uk_order_trade (order_no, trade_no)) ENGINE=InnoDB");
    });
  }
  /// One transaction on a pooled connection.
  template <class Fn>
  auto write(Fn&& fn) {
    return store_.with_transaction(std::forward<Fn>(fn));
  }
  /// The payment row of a transitioned order.
  void insert_payment(Tx& tx, const Callback& cb) {
    tx.exec(
        "INSERT INTO " + t_.payments + " (order_no, trade_no, amount, paid_at) VALUES (?, ?, ?, ?)",
        cb.order_no, cb.trade_no, cb.amount, cb.paid_at);
  }
  /// A refund, once per (order, trade): a repeat hits uk_order_trade (1062), which rolls back
  /// that statement only.
  void insert_refund(Tx& tx, const Callback& cb) {
    try {
      tx.exec("INSERT INTO " + t_.refunds + " (order_no, trade_no, amount) VALUES (?, ?, ?)",
              cb.order_no, cb.trade_no, cb.amount);
    } catch (const idem::mysql::DuplicateKey&) {
      // refunded before
    }
  }
  /// The order's paid_at.
  std::optional<std::int64_t> paid_at(Tx& tx, const std::string& order_no) {
    return tx.query_int64("SELECT paid_at FROM " + t_.orders + " WHERE order_no = ?", order_no);
  }

 private:
  idem::mysql::MysqlStore& store_;
  Tables t_;
};

/// The callback handler on MySQL. Thread-safe.
class MysqlPaymentCallbackHandler : public CallbackLogic<MysqlBackend> {
 public:
  /// @param store    supplies the connections (its pool); the tables are created if missing
  /// @param observer receives one on_duplicate (source state_machine) per duplicate callback
  explicit MysqlPaymentCallbackHandler(idem::mysql::MysqlStore& store,
                                       std::shared_ptr<idem::Observer> observer = nullptr,
                                       const Tables& tables = {})
      : CallbackLogic<MysqlBackend>(MysqlBackend{store, tables}, tables, std::move(observer)) {}
};

/// The same handler behind an IdempotencyGuard keyed by the gateway's trade number: a fast
/// store (Redis) answers repeated callbacks at the entrance, the record in `records` (the seed
/// table api_idempotency) backs it, and the state machine stays the last line of defence. The
/// guard runs in two-phase mode (the callback's transaction is the handler's own).
class GuardedPaymentCallbackHandler {
 public:
  GuardedPaymentCallbackHandler(idem::FastStore& fast, idem::mysql::MysqlStore& records,
                                MysqlPaymentCallbackHandler& handler)
      : guard_(fast, records, guard_options()), handler_(handler) {}

  /// Handles one callback: kTransitioned when this call paid the order; a replayed answer is
  /// reported as kAlreadyThere.
  Answer handle(const Callback& cb) {
    auto key = idem::Key::make("payment.callback", cb.trade_no);
    std::optional<Answer> ran;
    auto r = guard_.run(key, idem::fingerprint(cb.order_no + "|" + std::to_string(cb.amount)), [&] {
      ran = handler_.handle(cb);
      return ran->body;
    });
    if (ran) return *ran;
    Answer a;
    a.body = r.ok() ? *r.value : "fail";  // still in progress after the wait: the gateway retries
    a.transition = Transition::kAlreadyThere;
    a.status = r.ok() ? "replayed" : "in progress";
    return a;
  }

  /// The guard's counters.
  const idem::GuardStats& stats() const noexcept { return guard_.stats(); }

 private:
  // A callback that finds the same trade in progress (the gateway's concurrent retries) waits
  // for the first one's answer and replays it ("success"), rather than answering "fail", which
  // only makes the gateway call again.
  static idem::GuardOptions guard_options() {
    idem::GuardOptions o;
    o.wait_for_result = std::chrono::seconds(10);
    return o;
  }
  idem::IdempotencyGuard<idem::mysql::MysqlStore> guard_;
  MysqlPaymentCallbackHandler& handler_;
};

}  // namespace payment_callback
