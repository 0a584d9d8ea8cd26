// SPDX-License-Identifier: MIT
// examples/refund: a refund request, safe to repeat and to race, for any database idem's
// business-table helpers run on (SQLite, PostgreSQL).
//
// A user or a support tool asks to refund part of a paid order, with its own request id. The
// network retries, the tool double-submits, two agents refund the same order at once. The
// rules:
//
//   * each refund request applies at most once (its idempotency key: scope "refund", id = the
//     client's request id; the same id is the refund id the payment provider de-duplicates by);
//   * the refunds of an order never add up to more than was paid, even when *different*
//     requests race: the reservation is ONE conditional UPDATE,
//
//         UPDATE refund_orders
//            SET refunded = refunded + :amount,
//                status   = CASE WHEN refunded + :amount = paid THEN 'REFUNDED'
//                                ELSE 'PARTIALLY_REFUNDED' END
//          WHERE order_no = :order AND status IN ('PAID', 'PARTIALLY_REFUNDED')
//            AND refunded + :amount <= paid
//
//     so the check and the increment cannot be split by another refund (SQLite runs one writer
//     at a time; PostgreSQL makes the second UPDATE wait for the first's row lock and then
//     re-evaluates the WHERE clause against the committed row). Reading `refunded`, comparing
//     in C++ and writing back is the trap: two requests both read 6000 of 10000, both pass, and
//     12000 is refunded;
//   * the order moves PAID -> PARTIALLY_REFUNDED -> REFUNDED in that same statement;
//   * a refund of an unpaid, cancelled or fully refunded order, or one that exceeds what is
//     left, is a final business answer ("rejected:..."), stored and replayed, never an error;
//   * the provider call is external, so the guard runs two-phase (the handler takes no
//     transaction): reserve (one local transaction), call the provider with the refund id,
//     settle (one local transaction). A provider failure throws: the claim is released and the
//     reservation stays (the money is promised), so the retry, from the client or from a sweep
//     of pending refunds, calls the provider again with the SAME refund id and the provider
//     answers its first refund instead of paying twice. Releasing the reservation on a provider
//     timeout is the second trap: the provider may have paid.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/guard.hpp"
#include "idem/key.hpp"
#include "idem/sql.hpp"
#include "idem/sql_driver.hpp"
#include "idem/state_machine.hpp"
#include "idem/unique_insert.hpp"

namespace refund {

/// Scope of the refund requests' idempotency keys.
inline constexpr const char* kScope = "refund";

/// One refund request, as the user or the support tool sends it.
struct Request {
  /// The client's request id: the key's id, and the refund id the provider de-duplicates by.
  std::string request_id;
  /// The order to refund.
  std::string order_no;
  /// Minor units (cents), positive.
  std::int64_t amount = 0;

  /// The fingerprint: the same request id with another order or amount is a client error.
  std::string fingerprint() const {
    return idem::fingerprint(order_no + "|" + std::to_string(amount));
  }
};

/// Names of the business tables (validated identifiers; tests use private ones).
struct Tables {
  /// order_no, amount, paid, refunded, status.
  std::string orders = "refund_orders";
  /// One row per accepted refund request: request_id (unique), order_no, amount, status
  /// (PENDING -> SUCCEEDED), provider_ref. Not "refunds": examples/payment_callback has a
  /// table of that name of another shape, and both may share one database.
  std::string refunds = "refund_requests";
};

/// The payment provider failed or did not answer: the refund may or may not have been applied.
/// Retry with the same refund id.
class ProviderError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The payment provider as the refund desk sees it. Implementations must be thread-safe.
class Provider {
 public:
  virtual ~Provider() = default;
  /// Refunds `amount` of `order_no`, once per `refund_id`: a repeat of the id answers the first
  /// refund's reference and refunds nothing.
  /// @return the provider's reference of the refund.
  /// @throws ProviderError when it failed or did not answer (applied or not: unknown).
  virtual std::string refund(const std::string& refund_id, const std::string& order_no,
                             std::int64_t amount) = 0;
};

/// The answer texts (what the guard stores and replays):
///   "refunded:<amount>:<provider ref>"   the refund was paid out
///   "rejected:exceeds_refundable"        more than what is left to refund
///   "rejected:order_<STATUS>"            the order is WAIT_PAY, CANCELLED or REFUNDED
///   "rejected:unknown_order"
///   "rejected:bad_amount"                amount <= 0
inline std::string refunded_answer(std::int64_t amount, const std::string& provider_ref) {
  return "refunded:" + std::to_string(amount) + ":" + provider_ref;
}

/// The refund logic over a `Backend` (examples/refund/sqlite_backend.hpp, postgres_backend.hpp):
///   using Durable;                       // the guard's durable store
///   Durable& durable();
///   template <class Fn> auto write(Fn);  // one local transaction: fn(Durable::Transaction&)
/// The SQL runs through idem::SqlDriver / idem::StateMachineDriver of the transaction type, so
/// the same statements serve every dialect.
template <class Backend>
class RefundDesk {
 public:
  using Durable = typename Backend::Durable;
  using Tx = typename Durable::Transaction;

  /// @param backend  the database; @param fast the guard's fast store
  /// @param provider the payment provider; @param options the guard's options (lease: longer
  ///        than the slowest provider call); @param tables the table names
  RefundDesk(Backend& backend, idem::FastStore& fast, Provider& provider,
             idem::GuardOptions options = {}, Tables tables = {})
      : backend_(backend),
        provider_(provider),
        tables_(std::move(tables)),
        guard_(fast, backend.durable(), std::move(options)),
        refunds_(tables_.refunds, {"request_id"}, {"order_no", "amount", "status"}),
        refund_states_(tables_.refunds, "request_id", "status", {{"PENDING", "SUCCEEDED"}}) {
    idem::check_sql_identifier("orders table", tables_.orders);
  }

  /// Handles one request (thread-safe): executed or replayed with the answer text, or
  /// kInProgress (another attempt holds the key: retry shortly), or kFingerprintMismatch.
  /// @throws ProviderError (retry with the same request), idem::Error subclasses (retry when
  ///         retryable(); a request id reused with another order or amount after its first
  ///         attempt failed is errc::kFingerprintMismatch).
  idem::GuardResult<std::string> refund(const Request& r) {
    auto key = idem::Key::make(kScope, r.request_id);
    return guard_.run(key, r.fingerprint(), [&]() -> std::string {
      if (r.amount <= 0) return "rejected:bad_amount";
      // 1. Reserve the amount (or find this request's reservation from an earlier attempt).
      Reservation res = backend_.write([&](Tx& tx) { return reserve(tx, r); });
      if (res.kind == Reservation::kRejected) return res.answer;
      if (res.kind == Reservation::kSettled) return refunded_answer(r.amount, res.provider_ref);
      // 2. The provider, outside any transaction, with the refund id: a repeat is harmless.
      std::string ref = provider_.refund(r.request_id, r.order_no, r.amount);
      // 3. Settle: PENDING -> SUCCEEDED, once (a second settle finds it already there).
      backend_.write([&](Tx& tx) { settle(tx, r.request_id, ref); });
      return refunded_answer(r.amount, ref);
    });
  }

  /// The guard (its stats).
  idem::IdempotencyGuard<Durable>& guard() noexcept { return guard_; }
  /// The table names.
  const Tables& tables() const noexcept { return tables_; }

 private:
  struct Reservation {
    enum Kind { kReserved, kPending, kSettled, kRejected } kind = kReserved;
    std::string answer;        // kRejected
    std::string provider_ref;  // kSettled
  };

  // The statement in this transaction's dialect: "?N" placeholders become "$N" on PostgreSQL.
  static std::string sql(std::string text) {
    if (idem::SqlDriver<Tx>::kDialect == idem::SqlDialect::kPostgres) {
      for (auto& c : text) {
        if (c == '?') c = '$';
      }
    }
    return text;
  }
  template <class... Args>
  static std::optional<std::int64_t> query(Tx& tx, const std::string& statement,
                                           const Args&... args) {
    return idem::SqlDriver<Tx>::query_int64(tx, sql(statement), args...);
  }
  static std::optional<std::string> text(Tx& tx, const std::string& statement,
                                         const std::string& id) {
    return idem::StateMachineDriver<Tx>::current(tx, sql(statement), id);
  }

  Reservation reserve(Tx& tx, const Request& r) {
    Reservation res;
    // The refund row first, under its unique request_id: a retry of this request (after a
    // provider failure, a crash, or a lease that expired) finds it instead of reserving again.
    auto row = refunds_.insert(tx, r.request_id, r.order_no, r.amount, "PENDING");
    if (!row.inserted()) {
      // Reserved before: only the same order and amount may continue it.
      auto same = query(tx,
                        "SELECT count(*) FROM " + tables_.refunds +
                            " WHERE request_id = ?1 AND order_no = ?2 AND amount = ?3",
                        r.request_id, r.order_no, r.amount);
      if (same.value_or(0) == 0) {
        throw idem::Error(
            idem::errc::kFingerprintMismatch,
            "refund request " + r.request_id + " was first made for another order or amount");
      }
      auto status = text(tx, "SELECT status FROM " + tables_.refunds + " WHERE request_id = ?1",
                         r.request_id);
      if (status && *status == "SUCCEEDED") {
        res.kind = Reservation::kSettled;  // settled, then the record's completion was lost
        res.provider_ref =
            text(tx, "SELECT provider_ref FROM " + tables_.refunds + " WHERE request_id = ?1",
                 r.request_id)
                .value_or("");
      } else {
        res.kind = Reservation::kPending;
      }
      return res;
    }
    // The cap and the state, in one conditional UPDATE (see the file comment).
    auto reserved = query(tx,
                          "UPDATE " + tables_.orders +
                              " SET refunded = refunded + ?2,"
                              " status = CASE WHEN refunded + ?2 = paid THEN 'REFUNDED'"
                              " ELSE 'PARTIALLY_REFUNDED' END"
                              " WHERE order_no = ?1 AND status IN ('PAID', 'PARTIALLY_REFUNDED')"
                              " AND refunded + ?2 <= paid RETURNING refunded",
                          r.order_no, r.amount);
    if (reserved) return res;
    // Not reservable: undo this transaction's refund row and say why (a final answer).
    (void)query(tx, "DELETE FROM " + tables_.refunds + " WHERE request_id = ?1 RETURNING 1",
                r.request_id);
    res.kind = Reservation::kRejected;
    auto status =
        text(tx, "SELECT status FROM " + tables_.orders + " WHERE order_no = ?1", r.order_no);
    if (!status) {
      res.answer = "rejected:unknown_order";
    } else if (*status == "PAID" || *status == "PARTIALLY_REFUNDED") {
      res.answer = "rejected:exceeds_refundable";
    } else {
      res.answer = "rejected:order_" + *status;
    }
    return res;
  }

  void settle(Tx& tx, const std::string& request_id, const std::string& provider_ref) {
    auto t = refund_states_.transition(tx, request_id, "PENDING", "SUCCEEDED",
                                       {{"provider_ref", provider_ref}});
    if (!t.ok()) {
      throw idem::StorageError("refund " + request_id + ": cannot settle, row is " +
                               (t.current.empty() ? std::string("missing") : t.current));
    }
  }

  Backend& backend_;
  Provider& provider_;
  Tables tables_;
  idem::IdempotencyGuard<Durable> guard_;
  idem::UniqueInsert refunds_;
  idem::StateMachine refund_states_;
};

}  // namespace refund
