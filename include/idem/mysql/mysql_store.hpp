// SPDX-License-Identifier: MIT
// idem::mysql: the MySQL / MariaDB durable backstop (MariaDB Connector/C), transactional and
// two-phase, on the tables payment and order services already have.
//
// File: mysql/mysql_store.hpp
//
// `MysqlStore` keeps idempotency records in an InnoDB table with a unique key on (key, scope):
// by default the seed table `api_idempotency (idem_key, biz_type)` with its
// `uk_idem_key_biz_type`, or `mq_consume_record (message_id, consumer_group)` for MQ consumers.
// `migrate()` creates it (utf8mb4, binary key columns, a `longblob` response) with idem's
// columns — fingerprint, owner, lease_until, expires_at, attempts — next to the seed's, under a
// named lock (concurrent processes are safe; twice is a no-op), versioned in
// `idem_schema_version`. An existing table of the seed's shape is adopted only when asked
// (`adopt_existing_table`): idem then adds its columns to it (see docs/mysql.md for the exact
// ALTER TABLE). The same DDL ships as `share/idem/mysql_schema.sql`.
//
// Transactional mode (`run_transactional`, what `IdempotencyGuard` uses for
// `handler(idem::mysql::Transaction&)`): the handler's business statements run on the same
// connection, in the same InnoDB transaction as the record:
//
//     INSERT record (in_progress)   -- the transaction's first statement opens it
//     <handler's statements>
//     UPDATE record SET completed, response
//     COMMIT
//
// Connections for transactions run with autocommit off, so no BEGIN round trip is needed.
// When the response is known before the handler runs (DurableHint::expected_response, which
// IdempotentConsumer::consume sets), the INSERT writes the record completed with it and the
// UPDATE is left out; a handler whose response differs has it written in its place.
// A duplicate (error 1062) is never an error: the existing record is read (a locking read, so
// REPEATABLE READ's snapshot cannot hide a row committed meanwhile) and replayed, answered as
// in progress, or, for a crashed two-phase attempt whose lease ended, taken over. A duplicate
// that reaches MySQL while the first transaction is in flight waits on the unique key for at
// most `lock_wait_timeout`, then answers kBusy. Deadlocks (1213: InnoDB's gap and next-key
// locks make them possible between concurrent duplicates) and lock wait timeouts (1205) of the
// transaction re-run it at most `max_retries` times, then are typed (StorageUnavailable,
// StorageTimeout).
//
// Two-phase mode (`begin` / `complete` / `release` / `fail`): autocommit statements, usually
// one round trip each; `complete` applies only `WHERE owner = <token> AND status =
// 'in_progress'`, so an attempt whose lease was taken over completes nothing.
//
// Time: leases, retention and timestamps use the *database* clock in UTC (`UTC_TIMESTAMP(3)`)
// and are stored as UTC in `datetime(3)` columns (MySQL's datetime has no time zone); the
// session's time_zone is never read or changed.
//
// A connection lost at COMMIT (2006, 2013) is resolved on a fresh connection with a locking
// read of the record (it waits until the lost transaction is finished): committed (the answer
// stands), not committed (a retryable StorageUnavailable: nothing was applied), or, when the
// server cannot be asked, OutcomeUnknown: a retry with the same key then replays or runs once,
// decided by the unique key.
//
// @code
//   idem::mysql::MysqlStore durable{"mysql://app:secret@db:3306/payments"};
//   idem::IdempotencyGuard guard{fast, durable};
//   auto r = guard.run(key, idem::fingerprint(body), [&](idem::mysql::Transaction& tx) {
//     tx.exec("UPDATE account SET balance = balance - ? WHERE id = ?", amount, account);
//     tx.exec("INSERT INTO payment (order_no, amount) VALUES (?, ?)", order_no, amount);
//     return "pay_" + order_no;                 // stored; every duplicate gets it back
//   });
// @endcode
#pragma once

#include <atomic>
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

#include "idem/durable_store.hpp"
#include "idem/errors.hpp"
#include "idem/export.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/mysql/client.hpp"
#include "idem/store.hpp"

namespace idem::mysql {

/// Options of a MysqlStore.
struct MysqlStoreOptions {
  /// `mysql://user:password@host:port/database?...` (see parse_uri). When empty,
  /// `connection` is used as it is.
  std::string uri;
  /// Connection settings (filled from `uri` when that is set).
  ConnectionOptions connection;
  /// Most connections the pool opens (lazily). 0 means 16. When the server refuses one more
  /// for a connection limit (max_connections, max_user_connections, the account's
  /// MAX_USER_CONNECTIONS: errors 1040, 1203, 1226), a call waits for one of the pool's open
  /// connections instead (pool_wait).
  std::size_t pool_size = 16;
  /// How long a call waits for a free connection, then throws StorageUnavailable (the server's
  /// refusal, when the server's connection limit was why). 0 means 5 s.
  std::chrono::milliseconds pool_wait{5'000};
  /// innodb_lock_wait_timeout of every pooled session: how long a claim waits for a concurrent
  /// transaction holding the same key before answering kBusy (it also bounds the lock waits
  /// of the handler's own statements). Whole seconds, at least 1. Keep it below the
  /// connection's read_timeout.
  std::chrono::seconds lock_wait_timeout{2};
  /// Table holding the records (a validated identifier).
  std::string table = "api_idempotency";
  /// Column holding Key::id() (varchar(128)).
  std::string key_column = "idem_key";
  /// Column holding Key::scope() (varchar(64)).
  std::string scope_column = "biz_type";
  /// Times a transaction is re-run after a deadlock (1213) or a lock wait timeout (1205).
  /// 0 means never.
  unsigned max_retries = 3;
  /// Called before each such re-run with the key and the error number; must not throw.
  std::function<void(const Key&, unsigned)> on_retry;
  /// Transactional mode: read the record with one autocommit SELECT before opening the
  /// transaction, so a completed duplicate is replayed in one round trip. true: always;
  /// false: only when the guard's DurableHint does not expect the record absent (no fast store
  /// granted the claim, and the call did not set CallOptions::likely_new).
  bool read_first = false;
  /// Run the migration on construction. false: the table must exist.
  bool migrate = true;
  /// Migration: when the table exists but idem did not create it (no version row), add idem's
  /// columns to it (and make its key columns compare bytes, its response column binary) instead
  /// of refusing. See docs/mysql.md.
  bool adopt_existing_table = false;
  /// Fault injection for tests and drills: called in transactional mode right before COMMIT,
  /// with the transaction. Empty in production.
  std::function<void(Transaction&)> before_commit;

  /// The MQ consume record: `mq_consume_record (message_id, consumer_group)`.
  static MysqlStoreOptions mq_consume_record(std::string uri = {}) {
    MysqlStoreOptions o;
    o.uri = std::move(uri);
    o.table = "mq_consume_record";
    o.key_column = "message_id";
    o.scope_column = "consumer_group";
    return o;
  }
};

/// Counters of a MysqlStore (always on).
struct MysqlStoreStats {
  /// Transactions re-run after 1213 / 1205.
  std::uint64_t retries = 0;
  /// Claims that waited lock_wait_timeout on a concurrent holder and answered kBusy.
  std::uint64_t lock_timeouts = 0;
  /// Connections lost at COMMIT and resolved by reading the record (committed or not).
  std::uint64_t commits_resolved = 0;
  /// Connections lost at COMMIT whose outcome could not be established (OutcomeUnknown).
  std::uint64_t commits_unknown = 0;
};

/// The MySQL / MariaDB durable store (see the file comment). Thread-safe; share one per
/// process and table.
class IDEM_EXPORT MysqlStore {
 public:
  /// What transactional handlers receive.
  using Transaction = idem::mysql::Transaction;

  /// Connects lazily with `uri`, default options, and runs the migration.
  /// @throws idem::UsageError for a bad URI; idem::StorageUnavailable when the server cannot
  ///         be reached; a non-retryable idem::StorageError for bad credentials or an unknown
  ///         database.
  explicit MysqlStore(std::string uri);
  /// @throws as above, and idem::UsageError for a bad table/column name or option, or a table
  ///         that exists without idem's columns (see adopt_existing_table).
  explicit MysqlStore(MysqlStoreOptions options);
  /// Closes the pool's connections. No call may still run on the store (a guard using it, a
  /// transaction from with_transaction): destroy the guards first.
  ~MysqlStore();
  MysqlStore(const MysqlStore&) = delete;
  MysqlStore& operator=(const MysqlStore&) = delete;

  /// Transactional mode (see the durable store contract, idem/durable_store.hpp, and the file
  /// comment).
  /// @param key the operation's key
  /// @param fingerprint the payload's fingerprint
  /// @param owner this attempt's token
  /// @param retention how long the completed record is kept
  /// @param hint what the guard knows (DurableHint); never changes the answer
  /// @param handler `std::string(Transaction&)`; may be called again after a deadlock or lock
  ///        wait timeout (the earlier transaction was rolled back).
  /// @return kCommitted (ran and committed; `response` holds its bytes), kReplayed, kBusy,
  ///         kMismatch.
  /// @throws whatever the handler throws (after rollback); idem::UsageError for a response
  ///         larger than the response column accepts (nothing is written);
  ///         idem::StorageError subclasses.
  template <class Handler>
  TransactionalResult run_transactional(const Key& key, std::string_view fingerprint,
                                        const OwnerToken& owner, std::chrono::seconds retention,
                                        Handler&& handler, DurableHint hint = {}) {
    auto call = [](void* h, Transaction& tx) -> std::string {
      return (*static_cast<std::remove_reference_t<Handler>*>(h))(tx);
    };
    return run_transactional_impl(key, fingerprint, owner, retention,
                                  HandlerRef{call, static_cast<void*>(std::addressof(handler))},
                                  hint);
  }

  /// Two-phase begin: claims in its own committed statement, for `lease` (database clock).
  ClaimResult begin(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                    std::chrono::milliseconds lease, DurableHint hint = {});
  /// Two-phase complete: only while `owner` holds the in-progress record. false: lease lost.
  /// @throws idem::UsageError for a response larger than the column accepts (nothing is
  ///         written; the record stays in progress); idem::OutcomeUnknown if the connection
  ///         broke and the record cannot be re-read.
  bool complete(const Key& key, const OwnerToken& owner, std::string_view response,
                std::chrono::seconds retention);
  /// Deletes the in-progress record of `owner`. false when it did not hold it.
  bool release(const Key& key, const OwnerToken& owner);
  /// Keeps `owner`'s in-progress record alive: its lease ends `lease` from now on the server's
  /// clock (the guard's heartbeat). @return false when `owner` no longer holds it.
  bool extend(const Key& key, const OwnerToken& owner, std::chrono::milliseconds lease);
  /// Marks `owner`'s in-progress record failed (kept for `retention`, replayed as kDone with
  /// ClaimResult::failed and `reason` as response). false: lease lost.
  bool fail(const Key& key, const OwnerToken& owner, std::string_view reason,
            std::chrono::seconds retention);
  /// Reads a record. nullopt when absent.
  std::optional<Record> lookup(const Key& key);
  /// Deletes completed and failed records whose retention ended, in batches of `batch_size`:
  /// each batch is found with a plain (non-locking) read on the expires_at index and deleted
  /// by key in one short autocommit statement (row locks only, no gap locks, nothing held
  /// between batches). Never touches in-progress rows. @return rows deleted.
  std::size_t purge_expired(std::size_t batch_size = 1000);
  /// "mysql".
  std::string_view name() const noexcept { return "mysql"; }

  /// Inside the caller's open transaction (one of this store's, e.g. from with_transaction):
  /// claim or find the record. `lease` 0 means the transaction is the lease. A concurrent
  /// holder of the key beyond lock_wait_timeout answers kBusy; only the claim's statement is
  /// rolled back, `tx` stays usable.
  ClaimResult claim_in(Transaction& tx, const Key& key, std::string_view fingerprint,
                       const OwnerToken& owner, std::chrono::milliseconds lease);
  /// Inside the caller's open transaction: complete `owner`'s record.
  /// @throws idem::LeaseLost if `owner` does not hold it; idem::UsageError for a response the
  ///         column cannot hold.
  void complete_in(Transaction& tx, const Key& key, const OwnerToken& owner,
                   std::string_view response, std::chrono::seconds retention);
  // --- the batch operations of the durable store contract (idem/durable_store.hpp) ---------

  /// Contract: what a claim decides inside `tx` (claim_in with lease 0: an in-progress row;
  /// the open transaction is the lease).
  ClaimResult decide_in(Transaction& tx, const Key& key, std::string_view fingerprint,
                        const OwnerToken& owner);
  /// Contract: after decide_in granted the claim, the record completed (complete_in).
  void record_in(Transaction& tx, const Key& key, std::string_view fingerprint,
                 const OwnerToken& owner, std::string_view response, std::chrono::seconds retention,
                 const ClaimResult& decided);
  /// Contract: for each request, writes its record already completed with `response` when no
  /// record of its key exists. Multi-row INSERTs, rows in key order (concurrent batches lock
  /// in the same order): one for up to 1,000 requests, fewer rows per statement when the
  /// response is large (a statement stays within the server's max_allowed_packet); when a
  /// record of one of a statement's keys exists (1062: MySQL rolls back that statement only,
  /// `tx` stays usable), one INSERT per request of that statement decides which were written.
  /// So the answer is never nullopt, whatever the hint.
  /// @return for each request, whether its record was written (false: a record exists; decide
  ///         with decide_in).
  /// @throws idem::UsageError for a key given twice or a request without key or owner.
  std::optional<std::vector<bool>> record_batch_in(Transaction& tx,
                                                   const std::vector<ClaimRequest>& requests,
                                                   std::string_view response,
                                                   std::chrono::seconds retention,
                                                   DurableHint hint);
  /// Contract: `SAVEPOINT idem_batch`.
  void savepoint(Transaction& tx);
  /// Contract: `ROLLBACK TO SAVEPOINT idem_batch`.
  void rollback_to_savepoint(Transaction& tx);
  /// Contract: `RELEASE SAVEPOINT idem_batch`.
  void release_savepoint(Transaction& tx);

  /// Runs `fn(Transaction&)` in a transaction on a pooled connection and commits it (rolled
  /// back if fn throws). A deadlock (1213) or lock wait timeout (1205) rolls it back and runs
  /// `fn` again, at most `max_retries` times (so fn may be called more than once), then
  /// throws typed. A connection lost at COMMIT (2006, 2013, ...) is idem::OutcomeUnknown: the
  /// transaction may have committed (there is no record here to read back); make `fn`'s writes
  /// decide a retry (a unique key). For business code, the MQ batch path and tests.
  /// @return what fn returns.
  template <class Fn>
  auto with_transaction(Fn&& fn) {
    using R = std::invoke_result_t<Fn&, Transaction&>;
    if constexpr (std::is_void_v<R>) {
      run_in_transaction([&](Transaction& tx) { fn(tx); });
    } else {
      std::optional<R> out;
      run_in_transaction([&](Transaction& tx) { out.emplace(fn(tx)); });
      return std::move(*out);
    }
  }

  /// Runs `fn(Session&)` on a pooled autocommit connection (each statement commits alone).
  template <class Fn>
  auto with_session(Fn&& fn) {
    using R = std::invoke_result_t<Fn&, Session&>;
    if constexpr (std::is_void_v<R>) {
      run_in_session([&](Session& s) { fn(s); });
    } else {
      std::optional<R> out;
      run_in_session([&](Session& s) { out.emplace(fn(s)); });
      return std::move(*out);
    }
  }

  /// Runs the migration (what the constructor does unless options.migrate is false).
  void migrate();
  /// The options in force (defaults applied, `connection` parsed from `uri`).
  const MysqlStoreOptions& options() const noexcept { return options_; }
  /// A snapshot of the store's counters.
  MysqlStoreStats stats() const noexcept;
  /// Connections open in the pool.
  std::size_t open_connections() const;
  /// The largest response (in bytes) the response column and the server's
  /// max_allowed_packet accept; larger ones are refused with idem::UsageError before anything
  /// is written. Reads the table's definition on first use; the packet limit is each
  /// connection's own (read when it connects: a global max_allowed_packet lowered later holds
  /// for the connections opened after it, and this answers for one of the pool's).
  std::uint64_t max_response_bytes();

 private:
  struct HandlerRef {
    std::string (*call)(void*, Transaction&);
    void* self;
    std::string operator()(Transaction& tx) const { return call(self, tx); }
  };
  TransactionalResult run_transactional_impl(const Key& key, std::string_view fingerprint,
                                             const OwnerToken& owner,
                                             std::chrono::seconds retention, HandlerRef handler,
                                             DurableHint hint);
  void run_in_transaction(const std::function<void(Transaction&)>& fn);
  void run_in_session(const std::function<void(Session&)>& fn);

  struct Impl;
  MysqlStoreOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::mysql
