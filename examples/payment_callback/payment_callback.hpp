// SPDX-License-Identifier: MIT
// examples/payment_callback: a payment gateway's "paid" callback, safe to receive any number of
// times, concurrently and late, because the order moves WAIT_PAY -> PAID in ONE conditional
// UPDATE through idem::StateMachine (the third layer of defence: a state machine).
//
// The gateway retries its callback until it reads "success", so the same callback arrives
// many times; every one must be answered "success", and the order must be paid (paid_at set,
// payment row written) exactly once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "idem/key.hpp"
#include "idem/log.hpp"
#include "idem/observer.hpp"
#include "idem/sql.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "idem/sqlite/state_machine.hpp"
#include "idem/state_machine.hpp"

namespace payment_callback {

/// What the transition found (idem's state-machine answer).
using Transition = idem::Transition;

/// One callback from the gateway.
struct Callback {
  std::string order_no;
  std::string trade_no;      ///< the gateway's transaction id
  std::int64_t amount = 0;   ///< minor units
  std::int64_t paid_at = 0;  ///< ms since the epoch, as the gateway reports it
};

/// What the handler answered.
struct Answer {
  /// The body the gateway reads: "success" stops its retries, "fail" makes it retry.
  std::string body;
  /// What the transition found: kTransitioned (this callback paid the order), kAlreadyThere
  /// (paid before, or shipped since: a duplicate), kRejected (e.g. CANCELLED), kNotFound.
  Transition transition = Transition::kRejected;
  /// The order's status after the callback ("" for an unknown order).
  std::string status;
  /// True when money arrived for an order that cannot take it (e.g. CANCELLED): refund it.
  bool refund_needed = false;
};

/// Names of the example's tables (a PostgreSQL test uses private ones; validated identifiers).
struct Tables {
  /// order_no, amount, status, paid_at (ms since the epoch).
  std::string orders = "orders";
  /// One row per paid order: order_no (primary key), trade_no, amount, paid_at.
  std::string payments = "payments";
  /// One row per (order_no, trade_no) refunded.
  std::string refunds = "refunds";
};

/// The order lifecycle: WAIT_PAY -> PAID -> SHIPPED, WAIT_PAY -> CANCELLED.
inline idem::StateMachine order_state_machine(const std::string& orders_table) {
  return idem::StateMachine{orders_table, "order_no", "status",
                            {{"WAIT_PAY", "PAID"}, {"PAID", "SHIPPED"}, {"WAIT_PAY", "CANCELLED"}}};
}

/// The callback logic, for any backend (see PaymentCallbackHandler for SQLite and
/// PostgresPaymentCallbackHandler in payment_callback_pg.hpp). `Backend` provides
/// `write(fn(Tx&))` (one transaction, retried by the backend as needed), and on a `Tx`:
/// `insert_payment`, `insert_refund` (once per (order, trade)), `paid_at` (of the order).
/// The WAIT_PAY -> PAID transition (one conditional UPDATE setting paid_at) and the payment
/// row commit together; a duplicate is reported once to the observer with the first paid_at.
template <class Backend>
class CallbackLogic {
 public:
  /// @param backend  the database calls; @param tables the table names
  /// @param observer receives one on_duplicate (source state_machine) per duplicate callback
  CallbackLogic(Backend backend, const Tables& tables, std::shared_ptr<idem::Observer> observer)
      : backend_(std::move(backend)),
        machine_(order_state_machine(tables.orders)),
        observer_(std::move(observer)) {}

  /// Handles one callback (thread-safe).
  Answer handle(const Callback& cb) {
    std::optional<std::int64_t> first_paid_at;
    Answer answer = backend_.write([&](typename Backend::Tx& tx) {
      first_paid_at.reset();
      idem::TransitionResult t = machine_.transition(tx, cb.order_no, "WAIT_PAY", "PAID",
                                                     {{"paid_at", std::to_string(cb.paid_at)}});
      Answer a;
      a.transition = t.kind;
      a.status = t.kind == Transition::kTransitioned ? "PAID" : t.current;
      if (t.kind == Transition::kRejected && t.current == "SHIPPED") {
        a.transition = Transition::kAlreadyThere;  // shipped comes after paid: a late duplicate
      }
      switch (a.transition) {
        case Transition::kTransitioned:
          backend_.insert_payment(tx, cb);
          a.body = "success";
          break;
        case Transition::kAlreadyThere:
          first_paid_at = backend_.paid_at(tx, cb.order_no);
          a.body = "success";
          break;
        case Transition::kNotFound:
          a.body = "fail";  // unknown order: let the gateway retry (it may not be visible yet)
          break;
        case Transition::kRejected:
          // Paid after the order was cancelled: acknowledge, and refund once per trade.
          backend_.insert_refund(tx, cb);
          a.refund_needed = true;
          a.body = "success";
          break;
      }
      return a;
    });
    if (answer.transition == Transition::kAlreadyThere && observer_) {
      // "Why are there two identical callbacks?": one line per duplicate, like the guard's.
      // After the commit nothing may throw: an order number that is no key id ("ORD 1") is
      // simply not reported (the gateway must still get its "success").
      try {
        auto key = idem::Key::make("payment.callback", cb.order_no);
        observer_->on_duplicate(idem::DuplicateEvent{
            key, idem::Outcome::kReplayed, idem::DuplicateSource::kStateMachine,
            idem::from_millis(first_paid_at.value_or(0)), ""});
      } catch (const idem::InvalidKey&) {
      }
    }
    return answer;
  }

  /// The backend (tests read through it).
  Backend& backend() noexcept { return backend_; }

 private:
  Backend backend_;
  idem::StateMachine machine_;
  std::shared_ptr<idem::Observer> observer_;
};

/// The SQLite calls of CallbackLogic.
class SqliteBackend {
 public:
  /// The transaction type.
  using Tx = idem::sqlite::Transaction;
  /// Creates the tables if missing.
  SqliteBackend(idem::sqlite::Database& db, Tables tables) : db_(db), t_(std::move(tables)) {
    idem::check_sql_identifier("payments table", t_.payments);
    idem::check_sql_identifier("refunds table", t_.refunds);
    idem::check_sql_identifier("orders table", t_.orders);
    db_.write([&](Tx& tx) {
      tx.exec_script("CREATE TABLE IF NOT EXISTS " + t_.orders +
                     " (order_no TEXT PRIMARY KEY, amount INTEGER NOT NULL, status TEXT NOT NULL,"
                     " paid_at INTEGER);"
                     "CREATE TABLE IF NOT EXISTS " + t_.payments +
                     " (order_no TEXT PRIMARY KEY, trade_no TEXT NOT NULL, amount INTEGER NOT NULL,"
                     " paid_at INTEGER NOT NULL);"
                     "CREATE TABLE IF NOT EXISTS " + t_.refunds +
                     " (id INTEGER PRIMARY KEY AUTOINCREMENT, order_no TEXT NOT NULL,"
                     " trade_no TEXT NOT NULL, amount INTEGER NOT NULL, UNIQUE (order_no, trade_no));");
    });
  }
  /// One write transaction.
  template <class Fn>
  auto write(Fn&& fn) {
    return db_.write(std::forward<Fn>(fn));
  }
  /// The payment row of a transitioned order.
  void insert_payment(Tx& tx, const Callback& cb) {
    tx.exec("INSERT INTO " + t_.payments + " (order_no, trade_no, amount, paid_at) VALUES (?, ?, ?, ?)",
            cb.order_no, cb.trade_no, cb.amount, cb.paid_at);
  }
  /// A refund, once per (order, trade).
  void insert_refund(Tx& tx, const Callback& cb) {
    tx.exec("INSERT OR IGNORE INTO " + t_.refunds + " (order_no, trade_no, amount) VALUES (?, ?, ?)",
            cb.order_no, cb.trade_no, cb.amount);
  }
  /// The order's paid_at.
  std::optional<std::int64_t> paid_at(Tx& tx, const std::string& order_no) {
    return tx.query_int64("SELECT paid_at FROM " + t_.orders + " WHERE order_no = ?", order_no);
  }

 private:
  idem::sqlite::Database& db_;
  Tables t_;
};

/// The callback handler on SQLite. Thread-safe.
class PaymentCallbackHandler : public CallbackLogic<SqliteBackend> {
 public:
  /// @param db       the database holding the tables (created if missing)
  /// @param observer receives one on_duplicate (source state_machine) per duplicate callback
  explicit PaymentCallbackHandler(idem::sqlite::Database& db,
                                  std::shared_ptr<idem::Observer> observer = nullptr,
                                  const Tables& tables = {})
      : CallbackLogic<SqliteBackend>(SqliteBackend{db, tables}, tables, std::move(observer)) {}
};

}  // namespace payment_callback
