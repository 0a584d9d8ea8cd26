// SPDX-License-Identifier: MIT
// The one place SQLite result codes become idem exceptions.
#include "errors.hpp"

#include <sqlite3.h>

#include <string>

#include "idem/errors.hpp"

namespace idem::sqlite::detail {

void throw_error(sqlite3* db, int rc, std::string_view context) {
  std::string what = "sqlite: ";
  what.append(context);
  what.append(": ");
  what.append(sqlite3_errstr(rc));
  if (db != nullptr) {
    const char* msg = sqlite3_errmsg(db);
    if (msg != nullptr && std::string_view(msg) != sqlite3_errstr(rc)) {
      what.append(" (");
      what.append(msg);
      what.append(")");
    }
  }
  what.append(" [code ");
  what.append(std::to_string(rc));
  what.append("]");
  if (rc == SQLITE_READONLY_DIRECTORY) {
    what.append(
        ": the database's directory must be writable (WAL keeps the -wal and -shm "
        "files beside the database)");
  }
  switch (rc & 0xFF) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      throw StorageTimeout(what);
    case SQLITE_READONLY:
      // A file, directory or mount that cannot be written stays so until someone changes it:
      // not retryable. A WAL recovery in progress by another connection passes.
      if (rc == SQLITE_READONLY_RECOVERY) throw StorageUnavailable(what);
      throw StorageError(what);
    case SQLITE_CANTOPEN:
    case SQLITE_PERM:
    case SQLITE_FULL:
    case SQLITE_NOMEM:
      throw StorageUnavailable(what);
    default:
      throw StorageError(what);
  }
}

}  // namespace idem::sqlite::detail
