// SPDX-License-Identifier: MIT
// examples/coupon_claim: "a user claims a coupon once", where the business table's unique key
// is the whole guard: user_coupon unique (user_id, coupon_id).
//
// A claim runs, in one transaction,
//
//     INSERT INTO user_coupon (user_id, coupon_id, request_id, claimed_at) VALUES (...)
//       ON CONFLICT (user_id, coupon_id) DO NOTHING RETURNING id
//     -- nothing returned: SELECT id FROM user_coupon WHERE user_id = ... AND coupon_id = ...
//
// (idem::UniqueInsert), and answers "claimed:<id>" either way. The first click inserts the row;
// every other click, retry and second tab, concurrent or late, finds it and gets the same
// answer. The trap is treating the duplicate as an error: a plain INSERT whose unique violation
// becomes "coupon already claimed" (HTTP 409) tells a user who double-clicked that something
// went wrong, and on PostgreSQL the violation also aborts the surrounding transaction.
//
// No idempotency record is needed: the answer is derivable from the row, and the row is kept
// for as long as the claim matters (a record would expire with its retention). When the answer
// is NOT a row (limited coupons that can run out, a computed discount), add the guard or a
// StockTable as examples/flash_sale does.
#pragma once

#include <cstdint>
#include <string>

#include "idem/unique_insert.hpp"

namespace coupon_claim {

/// The claim, for any transaction type with an idem::SqlDriver.
class CouponDesk {
 public:
  /// @param table a validated identifier: id (integer key), user_id, coupon_id, request_id,
  ///        claimed_at (ms), unique (user_id, coupon_id)
  explicit CouponDesk(std::string table = "user_coupon")
      : claims_(std::move(table), {"user_id", "coupon_id"}, {"request_id", "claimed_at"}) {}

  /// Claims `coupon_id` for `user_id` in `tx`. @return "claimed:<row id>", the same for the
  /// first claim and every repeat. @throws the driver's errors (never for a duplicate).
  template <class Tx>
  std::string claim(Tx& tx, std::int64_t user_id, const std::string& coupon_id,
                    const std::string& request_id, std::int64_t now_ms) const {
    auto r = claims_.insert(tx, user_id, coupon_id, request_id, now_ms);
    return "claimed:" + std::to_string(r.id);
  }

  /// Inserted vs already-there counts (the unique-conflict count at the database).
  idem::UniqueInsertStats stats() const { return claims_.stats(); }

 private:
  idem::UniqueInsert claims_;
};

}  // namespace coupon_claim
