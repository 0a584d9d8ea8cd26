// SPDX-License-Identifier: MIT
// The one place libpqxx exceptions become idem exceptions.
#pragma once

#include <exception>
#include <string>
#include <string_view>

#include "error_rules.hpp"

namespace idem::postgres::detail {

/// Rethrows the exception in flight as an idem exception (idem exceptions pass unchanged),
/// with the libpqxx exception nested as its cause (std::nested_exception). Call only from
/// inside a catch block. `context` names the operation ("claim", "commit").
[[noreturn]] void rethrow_translated(std::string_view context);

/// The SQLSTATE of a libpqxx sql_error, or "" for anything else.
std::string sqlstate_of(const std::exception& e);

}  // namespace idem::postgres::detail

namespace idem::postgres::detail {
/// True for exceptions libpqxx throws (failure, usage, conversion and range errors).
bool is_pqxx_exception(const std::exception& e) noexcept;
}  // namespace idem::postgres::detail
