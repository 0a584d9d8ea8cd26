// SPDX-License-Identifier: MIT
// idem::sqlite: the embedded durable store (SQLite in WAL mode), no server needed.
//
// File: sqlite/sqlite_store.hpp
//
// `SqliteStore` keeps idempotency records in a table with a unique key on (key, scope) — by
// default `api_idempotency (idem_key, biz_type)`, or `mq_consume_record (message_id,
// consumer_group)` for MQ consumers — created by an idempotent, versioned migration.
//
// Concurrency: SQLite allows one writer at a time. A `Database` serialises this process's
// writers on a timed mutex (FIFO-ish, no busy polling) and takes the file lock with
// `BEGIN IMMEDIATE` (other processes wait up to `busy_timeout`). Readers run in parallel on
// pooled connections (WAL). A transactional handler runs inside the write transaction, so its
// business writes commit atomically with the record, and a duplicate waiting for the lock
// replays the committed response when it gets it.
//
// Statements take bound values only (`?` placeholders), never string-built SQL:
//
// @code
//   idem::sqlite::SqliteStore durable{"payments.db"};
//   durable.database().write([](idem::sqlite::Transaction& tx) {
//     tx.exec("CREATE TABLE IF NOT EXISTS payment (order_no TEXT PRIMARY KEY, amount INTEGER)");
//   });
//   idem::IdempotencyGuard guard{durable};
//   auto r = guard.run(key, fp, [&](idem::sqlite::Transaction& tx) {
//     tx.exec("INSERT INTO payment (order_no, amount) VALUES (?, ?)", order_no, amount);
//     return std::string("pay_") + order_no;
//   });
// @endcode
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/clock.hpp"
#include "idem/durable_store.hpp"
#include "idem/errors.hpp"
#include "idem/export.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/store.hpp"

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
  /// (nullptr), or an optional (nullopt binds NULL). @throws idem::StorageError.
  Statement& bind(int index, std::int64_t value);
  Statement& bind(int index, double value);
  Statement& bind(int index, std::string_view text);
  Statement& bind(int index, Blob blob);
  Statement& bind(int index, std::nullptr_t);
  Statement& bind(int index, const char* text) { return bind(index, std::string_view(text)); }
  Statement& bind(int index, const std::string& text) { return bind(index, std::string_view(text)); }
  template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
  Statement& bind(int index, T value) {
    return bind(index, static_cast<std::int64_t>(value));
  }
  template <class T>
  Statement& bind(int index, const std::optional<T>& value) {
    return value ? bind(index, *value) : bind(index, nullptr);
  }
  ///@}

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
  /// Column `col` as an integer (0 for NULL).
  std::int64_t column_int64(int col) const noexcept;
  /// Column `col` as a double (0 for NULL).
  double column_double(int col) const noexcept;
  /// TEXT or BLOB column as bytes (empty for NULL).
  std::string column_bytes(int col) const;

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
  /// Pooled connections (readers run in parallel; one writer at a time). 0 means 8.
  /// A ":memory:" database always uses one connection.
  std::size_t pool_size = 8;
  /// How long a writer waits for the write lock (this process and others). 0 means 10 s.
  std::chrono::milliseconds busy_timeout{10'000};
  /// PRAGMA synchronous: "NORMAL" (WAL default: durable against a process crash, the last
  /// commits may be lost on power failure) or "FULL".
  std::string synchronous = "NORMAL";
};

/// A SQLite database file with a connection pool and an in-process writer lock. Thread-safe.
/// Share one Database between the stores and business code of a process (shared_ptr).
class IDEM_EXPORT Database {
 public:
  /// Opens (creates) `path` in WAL mode. @throws idem::StorageUnavailable when it cannot.
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
    ReadLease lease = acquire_reader();
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
  ReadLease acquire_reader();
  std::unique_ptr<Impl> impl_;
};

/// Options of a SqliteStore.
struct SqliteStoreOptions {
  /// Table holding the records (a validated SQL identifier).
  std::string table = "api_idempotency";
  /// Column holding Key::id().
  std::string key_column = "idem_key";
  /// Column holding Key::scope().
  std::string scope_column = "biz_type";
  /// Time source for lease_until, created_at and expires_at (empty means the system clock).
  Clock clock;
  /// Options of the Database a path-constructed store opens.
  DatabaseOptions database;

  /// The MQ consume record: `mq_consume_record (message_id, consumer_group)`.
  static SqliteStoreOptions mq_consume_record() {
    SqliteStoreOptions o;
    o.table = "mq_consume_record";
    o.key_column = "message_id";
    o.scope_column = "consumer_group";
    return o;
  }
};

/// The SQLite durable store (see the file comment). Thread-safe.
class IDEM_EXPORT SqliteStore {
 public:
  /// What transactional handlers receive.
  using Transaction = idem::sqlite::Transaction;

  /// Opens `path` and migrates the table. @throws idem::StorageError, idem::UsageError for a
  /// bad table or column name.
  explicit SqliteStore(std::string path, SqliteStoreOptions options = {});
  /// Uses a shared database (e.g. the one the business tables live in) and migrates the table.
  explicit SqliteStore(std::shared_ptr<Database> database, SqliteStoreOptions options = {});
  ~SqliteStore();
  SqliteStore(const SqliteStore&) = delete;
  SqliteStore& operator=(const SqliteStore&) = delete;

  /// Transactional mode (the durable store contract, idem/durable_store.hpp). In the write
  /// transaction the record is looked up first; when absent (or an expired in-progress record
  /// of a crashed two-phase attempt), the handler runs and the record is then written once,
  /// already completed (no in-progress row, no second write). Unless `hint.fast_claimed`, a completed
  /// duplicate or a mismatch is answered from a read snapshot without the write lock.
  template <class Handler>
  TransactionalResult run_transactional(const Key& key, std::string_view fingerprint,
                                        const OwnerToken& owner, std::chrono::seconds retention,
                                        Handler&& handler, DurableHint hint = {}) {
    // A completed duplicate or a mismatch needs no write lock: answer it from a read snapshot
    // (skipped when the fast store just granted the claim: the record is then almost surely
    // absent; the write transaction checks anyway).
    if (!hint.fast_claimed) {
      if (auto early = precheck(key, fingerprint)) {
        return TransactionalResult::found(std::move(*early));
      }
    }
    Transaction tx = database_->begin();
    ClaimResult claim = decide_in(tx, key, fingerprint, owner);
    if (claim.status != ClaimStatus::kClaimed) {  // rolled back by ~Transaction
      return TransactionalResult::found(std::move(claim));
    }
    std::string response = handler(tx);
    record_in(tx, key, fingerprint, owner, response, retention, claim);
    tx.commit();
    return TransactionalResult::committed(std::move(response), claim.took_over);
  }

  /// Two-phase begin: claims in its own committed transaction. Unless `hint.fast_claimed`, a
  /// completed duplicate or a mismatch is answered from a read snapshot first.
  ClaimResult begin(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                    std::chrono::milliseconds lease, DurableHint hint = {});
  /// Two-phase complete: only while `owner` holds the in-progress record. false: lease lost.
  bool complete(const Key& key, const OwnerToken& owner, std::string_view response,
                std::chrono::seconds retention);
  /// Deletes the in-progress record of `owner`. false when it did not hold it.
  bool release(const Key& key, const OwnerToken& owner);
  /// Marks `owner`'s in-progress record failed (kept for `retention`, replayed as kDone with
  /// `reason` as response). Used by MQ consumers for poison messages. false: lease lost.
  bool fail(const Key& key, const OwnerToken& owner, std::string_view reason,
            std::chrono::seconds retention);
  /// Reads a record. nullopt when absent.
  std::optional<Record> lookup(const Key& key);
  /// Deletes completed and failed records whose retention ended, `batch_size` rows per short
  /// transaction, until none is left. Never touches in-progress rows. @return rows deleted.
  std::size_t purge_expired(std::size_t batch_size = 1000);
  /// "sqlite".
  std::string_view name() const noexcept { return "sqlite"; }
  /// The database (for business tables, reads and tests).
  Database& database() noexcept { return *database_; }
  /// The shared database handle.
  std::shared_ptr<Database> shared_database() const noexcept { return database_; }
  /// The table name in use.
  const std::string& table() const noexcept { return options_.table; }

  /// Inside an open write transaction: claim or find the record (used by run_transactional;
  /// public for stores that compose it). `lease` 0 means the transaction itself is the lease.
  ClaimResult claim_in(Transaction& tx, const Key& key, std::string_view fingerprint,
                       const OwnerToken& owner, std::chrono::milliseconds lease);
  /// Inside an open write transaction: complete `owner`'s record. @throws LeaseLost if not held.
  void complete_in(Transaction& tx, const Key& key, const OwnerToken& owner,
                   std::string_view response, std::chrono::seconds retention);
  /// Inside an open write transaction: what a claim by `owner` would find (the rulebook,
  /// idem/detail/record_rules.hpp), writing nothing (except deleting a record whose retention
  /// ended). kClaimed when the record is absent, in progress with an expired lease
  /// (`took_over`), or `owner`'s own (`kept`); else kDone / kBusy / kMismatch.
  ClaimResult find_in(Transaction& tx, const Key& key, std::string_view fingerprint,
                      const OwnerToken& owner);
  /// Inside an open write transaction, after find_in answered kClaimed: writes the record
  /// completed with `response` (INSERT; with `took_over` — pass it for a `kept` claim too —
  /// completes the existing in-progress record for `owner` instead). @throws LeaseLost if that record changed meanwhile.
  void insert_completed_in(Transaction& tx, const Key& key, std::string_view fingerprint,
                           const OwnerToken& owner, std::string_view response,
                           std::chrono::seconds retention, bool took_over);
  /// Inside an open write transaction: for each request, writes its record already completed
  /// with `response` when no record of its key exists (INSERT ... ON CONFLICT DO NOTHING: one
  /// statement per record where find_in plus insert_completed_in take two). For callers
  /// whose response is known before their handlers run (IdempotentConsumer's consume_batch);
  /// the transaction makes records and handler writes atomic.
  /// @return for each request, whether its record was written (false: a record exists and
  ///         nothing was written; decide with find_in).
  std::vector<bool> insert_completed_batch_in(Transaction& tx,
                                              const std::vector<ClaimRequest>& requests,
                                              std::string_view response,
                                              std::chrono::seconds retention);

  /// Runs `fn(Transaction&)` in a write transaction and commits it (rolled back if fn throws).
  /// @return what fn returns.
  template <class Fn>
  auto with_transaction(Fn&& fn) {
    return database_->write(std::forward<Fn>(fn));
  }

  // --- the batch operations of the durable store contract (idem/durable_store.hpp) ---------

  /// Contract: what a claim decides inside `tx` (find_in: nothing is written; the write
  /// transaction is the lease).
  ClaimResult decide_in(Transaction& tx, const Key& key, std::string_view fingerprint,
                        const OwnerToken& owner) {
    return find_in(tx, key, fingerprint, owner);
  }
  /// Contract: after decide_in granted `decided`, the record written completed
  /// (insert_completed_in).
  void record_in(Transaction& tx, const Key& key, std::string_view fingerprint,
                 const OwnerToken& owner, std::string_view response,
                 std::chrono::seconds retention, const ClaimResult& decided) {
    insert_completed_in(tx, key, fingerprint, owner, response, retention,
                        decided.took_over || decided.kept);
  }
  /// Contract: insert_completed_batch_in (the hint changes nothing: SQLite's tolerant insert
  /// costs what a plain one does). Never nullopt.
  std::optional<std::vector<bool>> record_batch_in(Transaction& tx,
                                                   const std::vector<ClaimRequest>& requests,
                                                   std::string_view response,
                                                   std::chrono::seconds retention, DurableHint) {
    return insert_completed_batch_in(tx, requests, response, retention);
  }
  /// Contract: `SAVEPOINT idem_batch`.
  void savepoint(Transaction& tx);
  /// Contract: `ROLLBACK TO SAVEPOINT idem_batch`.
  void rollback_to_savepoint(Transaction& tx);
  /// Contract: `RELEASE SAVEPOINT idem_batch`.
  void release_savepoint(Transaction& tx);

 private:
  std::optional<ClaimResult> precheck(const Key& key, std::string_view fingerprint);
  void init();
  void migrate();
  TimePoint now() const { return options_.clock(); }

  std::shared_ptr<Database> database_;
  SqliteStoreOptions options_;
  struct Sql;
  std::unique_ptr<Sql> sql_;
};

}  // namespace idem::sqlite
