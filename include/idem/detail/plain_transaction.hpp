// SPDX-License-Identifier: MIT
// A durable store's own transaction without an idempotency record, for handlers that run with
// no idempotency at all (an HTTP pass-through, the guard's kill switch) but still take the
// store's transaction type.
#pragma once

#include <type_traits>
#include <utility>

#include "idem/errors.hpp"

namespace idem::detail {

template <class D, class Fn, class = void>
struct has_plain_with_transaction : std::false_type {};
template <class D, class Fn>
struct has_plain_with_transaction<
    D, Fn, std::void_t<decltype(std::declval<D&>().with_transaction(std::declval<Fn&>()))>>
    : std::true_type {};

template <class D, class Fn, class = void>
struct has_plain_database_write : std::false_type {};
template <class D, class Fn>
struct has_plain_database_write<
    D, Fn, std::void_t<decltype(std::declval<D&>().database().write(std::declval<Fn&>()))>>
    : std::true_type {};

/// Whether `run_plain_transaction(durable, fn)` can run `fn` for store type D.
template <class D, class Fn>
inline constexpr bool kHasPlainTransaction =
    has_plain_with_transaction<D, Fn>::value || has_plain_database_write<D, Fn>::value;

/// Runs `fn(tx)` in one committed transaction of `durable` that holds no idempotency record:
/// `durable.with_transaction(fn)` (PostgreSQL) or `durable.database().write(fn)` (SQLite).
/// @return what `fn` returns
/// @throws what the store or `fn` throws; idem::UsageError when the store offers neither.
template <class D, class Fn>
std::invoke_result_t<Fn&, typename D::Transaction&> run_plain_transaction(D& durable, Fn& fn) {
  if constexpr (has_plain_with_transaction<D, Fn>::value) {
    return durable.with_transaction(fn);
  } else if constexpr (has_plain_database_write<D, Fn>::value) {
    return durable.database().write(fn);
  } else {
    (void)durable;
    throw UsageError(
        "idem: this durable store offers no plain transaction (with_transaction(fn) or "
        "database().write(fn)), so a transactional handler cannot run without a record");
  }
}

}  // namespace idem::detail
