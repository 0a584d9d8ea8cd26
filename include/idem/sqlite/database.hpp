// SPDX-License-Identifier: MIT
// idem::sqlite: the SQLite client the embedded store and business code share.
//
// File: sqlite/database.hpp
//
// A `Database` is one SQLite file in WAL mode with a pool of reader connections and one writer
// (this process's writers queue on a lock with a timeout; other processes' on the file lock,
// up to `DatabaseOptions::busy_timeout`). `write` runs a function in a transaction and commits,
// `read` in a pooled read session (`read_short` on the idle writer's connection, whose page
// cache stays warm); statements take bound values only (`?` placeholders):
//
// @code
//   auto db = std::make_shared<idem::sqlite::Database>("payments.db");
//   db->write([&](idem::sqlite::Transaction& tx) {
//     tx.exec("INSERT INTO payment (order_no, amount) VALUES (?, ?)", order_no, amount);
//   });
//   auto n = db->read([](idem::sqlite::Session& s) {
//     return s.query_int64("SELECT count(*) FROM payment");
//   });
// @endcode
//
// Every failure is an idem error: a wait past `busy_timeout` is `StorageTimeout`, an unopenable
// file `StorageUnavailable`, anything else `StorageError`. No SQLite header is included.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "idem/errors.hpp"
#include "idem/export.hpp"

struct sqlite3;
struct sqlite3_stmt;

namespace idem::sqlite {

/// A value to bind as a BLOB (std::string and std::string_view bind as TEXT).
struct Blob {
  std::string_view bytes;  ///< the bytes (must stay valid until the statement is stepped)
};

/// A prepared statement: bind, step, read columns. Cached statements are reset when released.
class IDEM_EXPORT Statement {
 public:
  /// Takes over `other`'s statement (`other` is left empty).
  Statement(Statement&& other) noexcept;
  Statement& operator=(Statement&&) = delete;
  Statement(const Statement&) = delete;
  ~Statement();

  ///@{
  /// Binds parameter `index` (1-based): an integer, a double, text (string, view, C string,
  /// bound without a copy: it must stay valid until the statement is stepped), a Blob, NULL
  /// (nullptr, or a null C string, as libpq and the MySQL adapter read it), or an optional
  /// (nullopt binds NULL). @throws idem::StorageError.
  Statement& bind(int index, std::int64_t value);
  Statement& bind(int index, double value);
  Statement& bind(int index, std::string_view text);
  Statement& bind(int index, Blob blob);
  Statement& bind(int index, std::nullptr_t);
  Statement& bind(int index, const char* text) {
    return text == nullptr ? bind(index, nullptr) : bind(index, std::string_view(text));
  }
  Statement& bind(int index, const std::string& text) {
    return bind(index, std::string_view(text));
  }
  template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
  Statement& bind(int index, T value) {
    return bind(index, static_cast<std::int64_t>(value));
  }
  template <class T>
  Statement& bind(int index, const std::optional<T>& value) {
    return value ? bind(index, *value) : bind(index, nullptr);
  }
  ///@}

  /// Binds the text and blobs of the following bind calls without SQLite copying them
  /// (SQLITE_STATIC): each must stay valid and unchanged until the statement is released (a
  /// cached statement's bindings are cleared then). For many values, or large ones, that the
  /// caller holds for the statement's whole use.
  Statement& borrow_values() noexcept {
    borrow_ = true;
    return *this;
  }
  /// Binds all arguments to ?1, ?2, ...
  template <class... Args>
  Statement& bind_all(const Args&... args) {
    int i = 0;
    (bind(++i, args), ...);
    return *this;
  }

  /// Runs one step. @return true when a row is available. @throws idem::StorageError.
  bool step();
  /// Rows changed by the last completed statement on this connection.
  int changes() const noexcept;

  /// True when column `col` (0-based) of the current row is NULL.
  bool column_is_null(int col) const noexcept;
  /// True when column `col` holds an INTEGER (not NULL, text, real or blob).
  bool column_is_integer(int col) const noexcept;
  /// True when column `col` holds a BLOB. Ask before reading the column as another type.
  bool column_is_blob(int col) const noexcept;
  /// Column `col` as an integer (0 for NULL).
  std::int64_t column_int64(int col) const noexcept;
  /// Column `col` as a double (0 for NULL).
  double column_double(int col) const noexcept;
  /// TEXT or BLOB column as bytes (empty for NULL).
  std::string column_bytes(int col) const;
  /// TEXT or BLOB column as a view of SQLite's own buffer, without a copy (empty for NULL).
  /// Valid until the statement steps again, is reset or released, or the same column is read
  /// as another type.
  std::string_view column_view(int col) const noexcept;

  /// What a column of the current row holds.
  enum class Type { kNull, kInteger, kFloat, kText, kBlob };
  /// One column of the current row, read whole by `column()`.
  struct Column {
    Type type = Type::kNull;   ///< the value's storage class
    std::int64_t integer = 0;  ///< kInteger: the value (0 otherwise)
    /// kText, kBlob: the bytes, a view of SQLite's own buffer with the lifetime of
    /// `column_view`'s (empty otherwise).
    std::string_view bytes;
  };
  /// Column `col` (0-based) of the current row: its type and its integer or its bytes, read in
  /// one call into SQLite where the `column_*` functions above take one each (a record read
  /// of several columns is a few hundred instructions cheaper). Never converts the value.
  Column column(int col) const noexcept;

 private:
  friend class Session;
  Statement(sqlite3* db, sqlite3_stmt* stmt, bool cached) noexcept
      : db_(db), stmt_(stmt), cached_(cached) {}
  // Session::exec and query_*: the arguments outlive the statement's use (it is stepped and
  // released inside the call), so text and blobs are bound without SQLite copying them.
  template <class... Args>
  Statement& bind_all_borrowed(const Args&... args) {
    borrow_ = true;
    return bind_all(args...);
  }
  sqlite3* db_;
  sqlite3_stmt* stmt_;
  bool cached_;
  bool borrow_ = false;  // bind text and blobs as SQLITE_STATIC (bindings cleared on release)
};

/// One pooled connection, lent for a read or a write. Not thread-safe; not stored.
class IDEM_EXPORT Session {
 public:
  /// Prepares `sql` (cached per connection). @throws idem::StorageError on a syntax error.
  Statement prepare(std::string_view sql);

  /// Runs a statement with bound arguments. @return rows changed.
  template <class... Args>
  int exec(std::string_view sql, const Args&... args) {
    Statement st = prepare(sql);
    st.bind_all_borrowed(args...);
    while (st.step()) {
    }
    return st.changes();
  }

  /// First column of the first row as an integer; nullopt when no row or NULL.
  template <class... Args>
  std::optional<std::int64_t> query_int64(std::string_view sql, const Args&... args) {
    Statement st = prepare(sql);
    st.bind_all_borrowed(args...);
    if (!st.step() || st.column_is_null(0)) return std::nullopt;
    return st.column_int64(0);
  }

  /// First column of the first row as bytes; nullopt when no row or NULL.
  template <class... Args>
  std::optional<std::string> query_text(std::string_view sql, const Args&... args) {
    Statement st = prepare(sql);
    st.bind_all_borrowed(args...);
    if (!st.step() || st.column_is_null(0)) return std::nullopt;
    return st.column_bytes(0);
  }

  /// Runs one or more statements without parameters (DDL). @throws idem::StorageError.
  void exec_script(const std::string& sql);

  /// The raw handle, for anything this wrapper lacks. Do not close it or end the transaction.
  sqlite3* native_handle() const noexcept;

 protected:
  /// A session on `connection` (a detail::Connection), made by Database only.
  explicit Session(void* connection) noexcept : conn_(connection) {}
  void* conn_;  ///< the detail::Connection
};

/// A write transaction (BEGIN IMMEDIATE ... COMMIT), as transactional handlers receive it.
/// Rolled back when destroyed without commit().
class IDEM_EXPORT Transaction : public Session {
 public:
  /// Takes over an open transaction (the source no longer commits or rolls back).
  Transaction(Transaction&&) noexcept;
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;
  ~Transaction();
  /// Commits. @throws idem::StorageError (then nothing was committed).
  void commit();
  /// Rolls back (also what the destructor does).
  void rollback() noexcept;

 private:
  friend class Database;
  struct Lease;
  explicit Transaction(std::unique_ptr<Lease> lease);
  std::unique_ptr<Lease> lease_;
};

/// Options of a Database.
struct DatabaseOptions {
  /// Pooled connections (readers run in parallel; one writer at a time). 0 means 8; at most
  /// 1024 (all are opened at once). A ":memory:" database always uses one connection.
  std::size_t pool_size = 8;
  /// How long a writer waits for the write lock (this process and others). 0 means 10 s.
  std::chrono::milliseconds busy_timeout{10'000};
  /// PRAGMA synchronous: "NORMAL" (WAL default: durable against a process crash, the last
  /// commits may be lost on power failure) or "FULL".
  std::string synchronous = "NORMAL";
  /// PRAGMA mmap_size, in bytes: how much of the database file each connection reads through
  /// a memory map of it instead of read() calls. A page read through the map costs no system
  /// call and no copy, and the map is the OS page cache, shared by every connection (it adds
  /// no memory per connection). 0 turns it off (every page read is a read() into the
  /// connection's own cache). SQLite caps it at its compile-time maximum (2 GiB on Linux).
  std::int64_t mmap_size = 0;
  /// PRAGMA cache_size, in KiB: SQLite's own page cache, one per connection (the pool's readers
  /// and the writer each have theirs). 0 keeps SQLite's default (2,000 KiB).
  std::int64_t cache_size_kib = 0;
  /// PRAGMA journal_size_limit, in bytes: the size the -wal file is cut back to when a
  /// checkpoint has copied all of it into the database. A checkpoint cannot finish while any
  /// connection (of any process: a report, a backup, a `sqlite3` shell) keeps a read
  /// transaction open, so the -wal grows meanwhile by every commit; without a limit it keeps
  /// that size on disk afterwards. -1: no limit (SQLite's default).
  std::int64_t journal_size_limit = 64 * 1024 * 1024;
  /// Opens the file read-only (SQLITE_OPEN_READONLY) and leaves its journal mode as it is: for
  /// tools that only read (idemctl's show, stats, ...). The file must exist; a write
  /// transaction fails with a StorageError.
  bool read_only = false;
};

/// A SQLite database file with a connection pool and an in-process writer lock. Thread-safe.
/// Share one Database between the stores and business code of a process (shared_ptr).
class IDEM_EXPORT Database {
 public:
  /// Opens (creates) `path` in WAL mode; ":memory:" is a database that lives as long as this
  /// object (one connection). Processes opening one new file together wait for each other
  /// (within busy_timeout) while it is switched to WAL.
  /// @throws idem::UsageError for an empty path or bad options; idem::StorageError (not
  ///         retryable) when `path` is a directory, a new file's directory is not writable or
  ///         the file is read-only; idem::StorageUnavailable when it cannot open for another
  ///         reason (e.g. its directory does not exist yet).
  explicit Database(std::string path, DatabaseOptions options = {});
  ~Database();
  Database(const Database&) = delete;
  Database& operator=(const Database&) = delete;

  /// Starts a write transaction (waits for the writer lock up to busy_timeout).
  /// @throws idem::StorageTimeout when the lock is not had in time.
  Transaction begin();

  /// Runs `fn(Transaction&)` in a write transaction and commits; rolls back if it throws.
  template <class Fn>
  auto write(Fn&& fn) {
    Transaction tx = begin();
    if constexpr (std::is_void_v<std::invoke_result_t<Fn&, Transaction&>>) {
      fn(tx);
      tx.commit();
    } else {
      auto result = fn(tx);
      tx.commit();
      return result;
    }
  }

  /// Runs `fn(Session&)` on a pooled connection for reading (a consistent snapshot).
  template <class Fn>
  auto read(Fn&& fn) {
    ReadLease lease = acquire_reader(false);
    return fn(static_cast<Session&>(lease));
  }

  /// As read(), for a short read (a few rows by key): on the writer's connection when no
  /// thread holds the writer lock, else on a pooled connection. The writer's page cache stays
  /// warm across this process's commits, where a pooled connection drops its whole cache at
  /// its first read after another connection's commit (SQLite's WAL rule), so a read that
  /// follows writes finds its pages cached. A writer that arrives meanwhile waits for `fn`:
  /// keep it short, and never start a write transaction inside it.
  template <class Fn>
  auto read_short(Fn&& fn) {
    ReadLease lease = acquire_reader(true);
    return fn(static_cast<Session&>(lease));
  }

  /// The path given at construction.
  const std::string& path() const noexcept;

 private:
  class Impl;
  class ReadLease : public Session {
   public:
    ReadLease(Impl* impl, void* conn) noexcept : Session(conn), impl_(impl) {}
    ReadLease(ReadLease&& o) noexcept : Session(o.conn_), impl_(o.impl_) { o.impl_ = nullptr; }
    ~ReadLease();

   private:
    Impl* impl_;
  };
  ReadLease acquire_reader(bool short_read);
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::sqlite
