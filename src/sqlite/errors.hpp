// SPDX-License-Identifier: MIT
// The one place SQLite result codes become idem exceptions.
#pragma once

#include <string_view>

struct sqlite3;

namespace idem::sqlite::detail {

/// Throws the idem exception for `rc` with SQLite's message and `context`.
[[noreturn]] void throw_error(sqlite3* db, int rc, std::string_view context);

}  // namespace idem::sqlite::detail
