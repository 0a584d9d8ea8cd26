// SPDX-License-Identifier: MIT
// What examples/refund reads back from the merchant's database to check a run: the orders,
// the refund rows and the idempotency records of the "refund" scope.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace refund {

/// A seeded order.
struct OrderSeed {
  std::string order_no;
  std::int64_t amount = 0;  ///< the order total
  std::string status;       ///< PAID (paid = amount), WAIT_PAY or CANCELLED (paid = 0)
};

/// An order as the database holds it.
struct OrderRow {
  std::string status;
  std::int64_t amount = 0, paid = 0, refunded = 0;
};

/// A refund row as the database holds it.
struct RefundRow {
  std::string order_no;
  std::int64_t amount = 0;
  std::string status;        ///< PENDING or SUCCEEDED
  std::string provider_ref;  ///< empty while PENDING
};

/// The merchant's side of a run.
struct Ledger {
  std::map<std::string, OrderRow> orders;    ///< by order_no
  std::map<std::string, RefundRow> refunds;  ///< by request_id
  std::int64_t records_completed = 0;        ///< idempotency records of the scope
  std::int64_t records_in_progress = 0;
};

}  // namespace refund
