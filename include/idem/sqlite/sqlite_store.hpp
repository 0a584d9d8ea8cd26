// SPDX-License-Identifier: MIT
// idem::sqlite: the embedded durable store (SQLite in WAL mode), no server needed.
//
// File: sqlite/sqlite_store.hpp
//
// `SqliteStore` keeps idempotency records in a table with a unique key on (key, scope) — by
// default `api_idempotency (idem_key, biz_type)`, or `mq_consume_record (message_id,
// consumer_group)` for MQ consumers — created by an idempotent, versioned migration. Tables
// created now are schema version 3: `WITHOUT ROWID`, keyed by (key, scope), idem fingerprints
// stored as their 32 bytes, the status as an integer (0 in progress, 1 completed, 2 failed),
// no index besides the key (the purge walks the key). Tables of versions 1 (created before
// schema 2, or adopted by name) and 2 keep their layout and work unchanged
// (docs/versioning.md).
//
// Concurrency: SQLite allows one writer at a time. A `Database` serialises this process's
// writers on a timed mutex (FIFO-ish, no busy polling) and takes the file lock with
// `BEGIN IMMEDIATE` (other processes wait up to `busy_timeout`). Readers run in parallel on
// pooled connections (WAL). A transactional handler runs inside the write transaction, so its
// business writes commit atomically with the record, and a duplicate waiting for the lock
// replays the committed response when it gets it.
//
// The SQLite client (`Database`, `Transaction`, `Session`, `Statement`) is in
// idem/sqlite/database.hpp, included here. Statements take bound values only (`?`
// placeholders), never string-built SQL:
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
#include "idem/sqlite/database.hpp"
#include "idem/store.hpp"

namespace idem::sqlite {

/// Options of a SqliteStore.
struct SqliteStoreOptions {
  /// Table holding the records (a validated SQL identifier).
  std::string table = "api_idempotency";
  /// Column holding Key::id().
  std::string key_column = "idem_key";
  /// Column holding Key::scope().
  std::string scope_column = "biz_type";
  /// Time source for lease_until, created_at and expires_at (empty means the system clock).
  /// Leases and retention are judged by it too: every process sharing the file must read the
  /// same clock (one host's system clock); a step of that clock shortens or lengthens every
  /// live lease and retention by the step (docs/design.md, "Whose clock decides").
  Clock clock;
  /// Options of the Database a path-constructed store opens.
  DatabaseOptions database;
  /// Create the table (and its version row) when missing. false: the store only reads what
  /// is there (no write lock, nothing created or changed; tools such as idemctl): the table's
  /// version row, or, without one, its layout; a missing table is then a StorageError.
  bool migrate = true;

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

  /// Opens `path` and migrates the table (unless `options.migrate` is false). @throws
  /// idem::StorageError (also for a table of a newer schema version), idem::UsageError for a
  /// bad table or column name.
  explicit SqliteStore(std::string path, SqliteStoreOptions options = {});
  /// Uses a shared database (e.g. the one the business tables live in) and migrates the table.
  explicit SqliteStore(std::shared_ptr<Database> database, SqliteStoreOptions options = {});
  /// Releases the store's hold on its Database (shared with whoever else holds it). No call
  /// may still run on the store (a guard using it): destroy the guards first.
  ~SqliteStore();
  SqliteStore(const SqliteStore&) = delete;
  SqliteStore& operator=(const SqliteStore&) = delete;

  /// Transactional mode (the durable store contract, idem/durable_store.hpp). In the write
  /// transaction the record is looked up first; when absent (or an expired in-progress record
  /// of a crashed two-phase attempt), the handler runs and the record is then written once,
  /// already completed (no in-progress row, no second write). Unless `hint.expects_absent()`, a
  /// completed duplicate or a mismatch is answered from a read snapshot without the write lock.
  template <class Handler>
  TransactionalResult run_transactional(const Key& key, std::string_view fingerprint,
                                        const OwnerToken& owner, std::chrono::seconds retention,
                                        Handler&& handler, DurableHint hint = {}) {
    idem::detail::check_term(retention, "idem::sqlite: the retention");  // before the handler
    // A completed duplicate or a mismatch needs no write lock: answer it from a read snapshot
    // (skipped when the fast store just granted the claim: the record is then almost surely
    // absent; the write transaction checks anyway).
    if (!hint.expects_absent()) {
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

  /// Two-phase begin: claims in its own committed transaction. Unless `hint.expects_absent()`, a
  /// completed duplicate or a mismatch is answered from a read snapshot first.
  ClaimResult begin(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                    std::chrono::milliseconds lease, DurableHint hint = {});
  /// Two-phase complete: only while `owner` holds the in-progress record. false: lease lost.
  bool complete(const Key& key, const OwnerToken& owner, std::string_view response,
                std::chrono::seconds retention);
  /// Deletes the in-progress record of `owner`. false when it did not hold it.
  bool release(const Key& key, const OwnerToken& owner);
  /// Keeps `owner`'s in-progress record alive: its lease ends `lease` from now (the guard's
  /// heartbeat). @return false when `owner` no longer holds it.
  bool extend(const Key& key, const OwnerToken& owner, std::chrono::milliseconds lease);
  /// Marks `owner`'s in-progress record failed (kept for `retention`, replayed as kDone with
  /// `reason` as response). Used by MQ consumers for poison messages. false: lease lost.
  bool fail(const Key& key, const OwnerToken& owner, std::string_view reason,
            std::chrono::seconds retention);
  /// Reads a record. nullopt when absent.
  std::optional<Record> lookup(const Key& key);
  /// Deletes completed and failed records whose retention ended by the time of the call, until
  /// none is left, in short write transactions: on a version-3 table each takes the next
  /// `batch_size` rows in key order and deletes the expired ones among them (one pass reads the
  /// table once); on tables of versions 1 and 2 each deletes up to `batch_size` rows found
  /// through the expiry index. Never touches in-progress rows. @return rows deleted.
  /// @throws UsageError when `batch_size` is 0.
  std::size_t purge_expired(std::size_t batch_size = 1000);
  /// Deletes completed and failed records last written before `cutoff`, whatever their
  /// retention (an operator's purge: `idemctl purge --older-than`), until none is left, in short
  /// write transactions that walk the key `batch_size` rows at a time (one pass reads the table
  /// once; no table version indexes the update time). Never touches in-progress rows.
  /// @return rows deleted. @throws UsageError when `batch_size` is 0.
  std::size_t purge_older_than(TimePoint cutoff, std::size_t batch_size = 1000);
  /// "sqlite".
  std::string_view name() const noexcept { return "sqlite"; }
  /// The database (for business tables, reads and tests).
  Database& database() noexcept { return *database_; }
  /// The shared database handle.
  std::shared_ptr<Database> shared_database() const noexcept { return database_; }
  /// The table name in use.
  const std::string& table() const noexcept { return options_.table; }
  /// The record table's schema version (1, 2 or 3; docs/versioning.md).
  int schema_version() const noexcept;
  /// How `status` is spelled in SQL over this table, for queries of your own (operators'
  /// counts, tests): `1` in a version-3 table (0 in progress, 1 completed, 2 failed),
  /// `'completed'` in tables of versions 1 and 2. For example:
  /// @code
  ///   auto done = store.status_literal(idem::Record::Status::kCompleted);
  ///   session.query_int64("SELECT count(*) FROM " + store.table() + " WHERE status = " + done);
  /// @endcode
  std::string status_literal(Record::Status status) const;

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
  /// completes the existing in-progress record for `owner` instead). @throws LeaseLost if that
  /// record changed meanwhile.
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
                 const OwnerToken& owner, std::string_view response, std::chrono::seconds retention,
                 const ClaimResult& decided) {
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
  std::size_t purge_walking_key(const std::string& finished, std::int64_t bound,
                                std::size_t batch_size);
  TimePoint now() const { return options_.clock(); }

  std::shared_ptr<Database> database_;
  SqliteStoreOptions options_;
  struct Sql;
  std::unique_ptr<Sql> sql_;
};

}  // namespace idem::sqlite
