// SPDX-License-Identifier: MIT
// Internal: the columns of a record table that idem's statements write besides the key pair,
// for the stores' checks of a table they adopt (SQLite, PostgreSQL, MySQL).
#pragma once

#include <string>
#include <string_view>

namespace idem::detail {

/// Every record column idem writes, but the key and scope columns (named per table).
inline constexpr std::string_view kRecordColumnNames[] = {
    "status",     "fingerprint", "owner",      "response_body", "lease_until",
    "expires_at", "attempts",    "created_at", "updated_at"};

/// Whether idem writes column `name` of a table keyed by (`key_column`, `scope_column`).
inline bool is_record_column(std::string_view name, std::string_view key_column,
                             std::string_view scope_column) noexcept {
  if (name == key_column || name == scope_column) return true;
  for (std::string_view c : kRecordColumnNames) {
    if (name == c) return true;
  }
  return false;
}

}  // namespace idem::detail
