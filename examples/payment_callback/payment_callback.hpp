// SPDX-License-Identifier: MIT
// examples/payment_callback: a payment gateway's "paid" callback, safe to receive any number of
// times, concurrently and late, because the order moves WAIT_PAY -> PAID in ONE conditional
// UPDATE (the third layer of defence: a state machine).
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
#include "idem/sqlite/sqlite_store.hpp"

namespace payment_callback {

/// What a conditional transition did.
enum class Transition {
  kTransitioned,  ///< the row was in `from` and is now in `to`: do the work
  kAlreadyThere,  ///< the row is already in `to` (or a later state): a duplicate
  kRejected,      ///< the row is in another state (e.g. CANCELLED), or absent
};

/// The result of a transition; `current` is the row's state after it ("" when absent).
struct TransitionResult {
  Transition kind = Transition::kRejected;
  std::string current;
};

/// WAIT_PAY -> PAID for `order_no`, setting paid_at: one conditional UPDATE; when it changes no
/// row, the current status tells a duplicate (PAID, or SHIPPED which comes after PAID) from a
/// rejection. Runs in the caller's write transaction.
inline TransitionResult mark_paid(idem::sqlite::Transaction& tx, const std::string& order_no,
                                  std::int64_t paid_at_ms) {
  int changed = tx.exec(
      "UPDATE orders SET status = 'PAID', paid_at = ? WHERE order_no = ? AND status = 'WAIT_PAY'",
      paid_at_ms, order_no);
  if (changed == 1) return {Transition::kTransitioned, "PAID"};
  auto current = tx.query_text("SELECT status FROM orders WHERE order_no = ?", order_no);
  if (!current) return {Transition::kRejected, ""};
  if (*current == "PAID" || *current == "SHIPPED") return {Transition::kAlreadyThere, *current};
  return {Transition::kRejected, *current};
}

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
  /// What the transition found.
  Transition transition = Transition::kRejected;
  /// The order's status after the callback.
  std::string status;
  /// True when money arrived for an order that cannot take it (e.g. CANCELLED): refund it.
  bool refund_needed = false;
};

/// The callback handler. Thread-safe.
class PaymentCallbackHandler {
 public:
  /// @param db       the database holding `orders` and `payments` (created if missing)
  /// @param observer receives one on_duplicate (source state_machine) per duplicate callback
  explicit PaymentCallbackHandler(idem::sqlite::Database& db,
                                  std::shared_ptr<idem::Observer> observer = nullptr)
      : db_(db), observer_(std::move(observer)) {
    db_.write([](idem::sqlite::Transaction& tx) {
      tx.exec_script(
          "CREATE TABLE IF NOT EXISTS orders ("
          " order_no TEXT PRIMARY KEY, amount INTEGER NOT NULL, status TEXT NOT NULL,"
          " paid_at INTEGER);"
          "CREATE TABLE IF NOT EXISTS payments ("
          " order_no TEXT PRIMARY KEY, trade_no TEXT NOT NULL, amount INTEGER NOT NULL,"
          " paid_at INTEGER NOT NULL);"
          "CREATE TABLE IF NOT EXISTS refunds ("
          " id INTEGER PRIMARY KEY AUTOINCREMENT, order_no TEXT NOT NULL,"
          " trade_no TEXT NOT NULL, amount INTEGER NOT NULL, UNIQUE (order_no, trade_no));");
    });
  }

  /// Handles one callback: the transition and the payment row commit together.
  Answer handle(const Callback& cb) {
    std::optional<std::int64_t> first_paid_at;
    Answer answer = db_.write([&](idem::sqlite::Transaction& tx) {
      TransitionResult t = mark_paid(tx, cb.order_no, cb.paid_at);
      Answer a;
      a.transition = t.kind;
      a.status = t.current;
      switch (t.kind) {
        case Transition::kTransitioned:
          tx.exec("INSERT INTO payments (order_no, trade_no, amount, paid_at) VALUES (?, ?, ?, ?)",
                  cb.order_no, cb.trade_no, cb.amount, cb.paid_at);
          a.body = "success";
          break;
        case Transition::kAlreadyThere:
          first_paid_at = tx.query_int64("SELECT paid_at FROM orders WHERE order_no = ?",
                                         cb.order_no);
          a.body = "success";
          break;
        case Transition::kRejected:
          if (t.current.empty()) {
            a.body = "fail";  // unknown order: let the gateway retry (it may not be visible yet)
          } else {
            // Paid after the order was cancelled: acknowledge, and refund once per trade.
            tx.exec("INSERT OR IGNORE INTO refunds (order_no, trade_no, amount) VALUES (?, ?, ?)",
                    cb.order_no, cb.trade_no, cb.amount);
            a.refund_needed = true;
            a.body = "success";
          }
          break;
      }
      return a;
    });
    if (answer.transition == Transition::kAlreadyThere && observer_) {
      // "Why are there two identical callbacks?": one line per duplicate, like the guard's.
      auto key = idem::Key::make("payment.callback", cb.order_no);
      observer_->on_duplicate(idem::DuplicateEvent{
          key, idem::Outcome::kReplayed, idem::DuplicateSource::kStateMachine,
          idem::from_millis(first_paid_at.value_or(0)), ""});
    }
    return answer;
  }

 private:
  idem::sqlite::Database& db_;
  std::shared_ptr<idem::Observer> observer_;
};

}  // namespace payment_callback
