// SPDX-License-Identifier: MIT
// How the HTTP and gRPC adapters tell an idem error of their own call from one their handler
// threw.
//
// File: detail/handler_error.hpp
//
// The adapters answer idem's errors with a status (400 invalid_key, 503 store_timeout, ...). A
// handler may throw idem errors too: a storage failure of its own SQL through idem's clients
// (idem::sqlite's StorageTimeout, say) is answered as a store failure, which it is; any other
// (an InvalidKey of a key the handler built, a UsageError) is the handler's failure and must
// propagate unchanged, never be answered as if the client's request had broken a rule.
#pragma once

#include <exception>
#include <utility>

#include "idem/errors.hpp"

namespace idem::detail {

/// Carries a handler's own idem error (other than a storage failure) past the guard, which
/// releases its claim as for any exception; the adapter rethrows `error` unchanged.
struct HandlerError {
  std::exception_ptr error;
};

/// True for the handler errors an adapter answers as a store failure: StorageError (and its
/// kinds) and LeaseLost.
inline bool is_store_failure(const Error& e) noexcept {
  return dynamic_cast<const StorageError*>(&e) != nullptr ||
         dynamic_cast<const LeaseLost*>(&e) != nullptr;
}

/// Runs `handler`: its StorageError and LeaseLost pass as they are, any other idem::Error
/// leaves as a HandlerError, anything else unchanged.
template <class Fn>
decltype(auto) call_handler(Fn&& handler) {
  try {
    return std::forward<Fn>(handler)();
  } catch (const StorageError&) {
    throw;
  } catch (const LeaseLost&) {
    throw;
  } catch (const Error&) {
    throw HandlerError{std::current_exception()};
  }
}

}  // namespace idem::detail
