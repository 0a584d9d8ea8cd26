// SPDX-License-Identifier: MIT
// The names PostgresStore writes into its SQL unquoted (schema, table, key and scope columns):
// besides idem's identifier rule (idem/sql.hpp), what PostgreSQL itself demands of them.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <string>
#include <string_view>

#include "idem/errors.hpp"
#include "idem/sql.hpp"

namespace idem::postgres::detail {

// PostgreSQL's reserved key words (both of its reserved categories): not a table's or a
// column's name unless quoted.
inline bool is_reserved_word(const std::string& name) {
  // Space-separated, with a space at each end: " name " is found only as a whole word.
  static constexpr std::string_view kReserved =
      " all analyse analyze and any array as asc asymmetric authorization binary both case cast"
      " check collate collation column concurrently constraint create cross current_catalog"
      " current_date current_role current_schema current_time current_timestamp current_user"
      " default deferrable desc distinct do else end except false fetch for foreign freeze from"
      " full grant group having ilike in initially inner intersect into is isnull join lateral"
      " leading left like limit localtime localtimestamp natural not notnull null offset on only"
      " or order outer overlaps placing primary references returning right select session_user"
      " similar some symmetric system_user table tablesample then to trailing true union unique"
      " user using variadic verbose when where window with ";
  return kReserved.find(" " + name + " ") != std::string_view::npos;
}

// check_sql_identifier, and: lower case (PostgreSQL folds an unquoted name, so "Orders" would
// be created as orders while idem's catalog lookups asked for "Orders"), not a reserved word,
// and at most `max_bytes` long (the table's name is the stem of its constraint and index names,
// which PostgreSQL cuts at 63 bytes: a longer stem made two of them the same name).
inline const std::string& check_pg_identifier(std::string_view what, const std::string& name,
                                              std::size_t max_bytes = 63) {
  check_sql_identifier(what, name);
  const auto upper = [](char c) { return std::isupper(static_cast<unsigned char>(c)) != 0; };
  if (std::any_of(name.begin(), name.end(), upper)) {
    throw UsageError("idem::postgres: the " + std::string(what) + " name '" + name +
                     "' has upper-case letters: PostgreSQL folds unquoted names to lower case, "
                     "write it in lower case");
  }
  if (is_reserved_word(name)) {
    throw UsageError("idem::postgres: the " + std::string(what) + " name '" + name +
                     "' is a PostgreSQL reserved word");
  }
  if (name.size() > max_bytes) {
    throw UsageError("idem::postgres: the " + std::string(what) + " name '" + name + "' has " +
                     std::to_string(name.size()) + " bytes, at most " + std::to_string(max_bytes) +
                     " here");
  }
  return name;
}

}  // namespace idem::postgres::detail
