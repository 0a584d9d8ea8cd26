// SPDX-License-Identifier: MIT
// SQL identifiers idem interpolates into statements (table and column names) are validated
// here; every *value* is a bound parameter.
#pragma once

#include <string>
#include <string_view>

#include "idem/errors.hpp"

namespace idem {

/// True for `[A-Za-z_][A-Za-z0-9_]{0,62}` (a plain, unquoted SQL identifier of at most 63 bytes,
/// PostgreSQL's limit).
constexpr bool is_sql_identifier(std::string_view name) noexcept {
  if (name.empty() || name.size() > 63) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    bool alpha = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
    bool digit = c >= '0' && c <= '9';
    if (!(alpha || (i > 0 && digit))) return false;
  }
  return true;
}

/// Throws idem::UsageError naming `what` (e.g. "table") unless `name` is a plain identifier.
inline const std::string& check_sql_identifier(std::string_view what, const std::string& name) {
  if (!is_sql_identifier(name)) {
    throw UsageError("idem: invalid SQL " + std::string(what) + " name '" + name +
                     "': expected [A-Za-z_][A-Za-z0-9_]* of at most 63 bytes");
  }
  return name;
}

/// Whether two identifiers name the same column: unquoted SQL names compare without regard
/// to ASCII case ("STATUS" is status).
inline bool same_sql_identifier(std::string_view a, std::string_view b) noexcept {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) {
      return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c;
    };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

}  // namespace idem
