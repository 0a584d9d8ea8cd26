// SPDX-License-Identifier: MIT
// idem::postgres: the PostgreSQL durable backstop (libpqxx), transactional and two-phase.
//
// File: postgres/postgres_store.hpp
//
// `PostgresStore` keeps idempotency records in a table with a unique key on (key, scope) — by
// default `api_idempotency (idem_key, biz_type)`, or `mq_consume_record (message_id,
// consumer_group)` for MQ consumers — created by a versioned migration that runs under a
// transaction-scoped advisory lock (twice is a no-op; concurrent processes are safe). The same
// DDL ships as `share/idem/schema.sql` for DBAs (`psql -v schema=payments -f schema.sql`).
//
// Transactional mode (`run_transactional`, what `IdempotencyGuard` uses for
// `handler(pqxx::work&)`): one `pqxx::work` holds the claim, the handler's business writes and
// the completion. The claim is the transaction's first statement:
//
//     INSERT ... ON CONFLICT (key, scope) DO NOTHING RETURNING true (then, if nothing was
//                                                                  inserted, a read of the row)
//
// so a unique violation never aborts the caller's transaction. When the guard expects the key
// new (DurableHint::expects_absent: the fast store granted the claim, or
// CallOptions::likely_new), the claim is a plain INSERT instead, without the speculative
// insertion ON CONFLICT costs; an existing key then raises 23505, which aborts the transaction
// before anything else ran in it, and the run starts over with the claim above (PostgreSQL logs
// that error, as it logs every one). A duplicate that reaches PostgreSQL while the first
// transaction is in flight waits on the unique index for at most `lock_timeout` (the pooled
// connections' session setting); if the first commits it replays the stored response, if the
// wait times out (SQLSTATE 55P03) the attempt is rolled back — nothing else ran in it yet, so
// no savepoint is needed — and answers kBusy.
// Round trips of a first execution: BEGIN, claim, <handler's statements>, complete, COMMIT —
// the same as hand-written code giving the same guarantee. When the response is known before
// the handler runs (DurableHint::expected_response, which IdempotentConsumer::consume sets), the
// claim inserts the record completed with it and no completion statement follows (BEGIN, claim,
// <handler's statements>, COMMIT); a handler whose response differs has it written in its place.
//
// Two-phase mode (`begin` / `complete` / `release` / `fail`): each call is one autocommit
// statement (usually one round trip); `complete` applies only `WHERE owner = <token> AND
// status = 'in_progress'`, so an attempt whose lease was taken over completes nothing.
//
// Time: leases, retention and `created_at` use the *database* clock (`clock_timestamp()`,
// `now()`), so processes on hosts with skewed clocks agree on when a lease ends.
//
// Failures: every libpqxx error raised by idem's own statements becomes an idem exception
// (SQLSTATE and server message kept in `what()`): a lost connection is StorageUnavailable,
// a wrong database, role, password or conninfo/URI is idem::UsageError (not retryable: it stays
// wrong), statement_timeout is StorageTimeout, a connection lost at COMMIT is resolved by asking
// the server (`txid_status`) and re-reading the record on a fresh connection — success, a
// retryable StorageUnavailable ("not committed"), or OutcomeUnknown; the handler is never re-run
// blind. Serialization failures and deadlocks (40001, 40P01) re-run the whole transaction at most
// `max_retries` times, each after a random pause of up to 1, 2, 4, ... ms. Database errors of the
// handler's own statements are typed the same way (a deadlock after the re-runs
// StorageUnavailable, lock_timeout StorageTimeout, a lost connection StorageUnavailable, other
// server errors StorageError); every translated error nests the libpqxx exception as its cause
// (std::rethrow_if_nested). Other exceptions of the handler propagate unchanged.
//
// @code
//   idem::postgres::PostgresStore durable{"postgresql://app@db/payments"};
//   idem::IdempotencyGuard guard{fast, durable};
//   auto r = guard.run(key, idem::fingerprint(body), [&](pqxx::work& tx) {
//     tx.exec_params("UPDATE account SET balance = balance - $1 WHERE id = $2", amount, acct);
//     tx.exec_params("INSERT INTO payment (order_no, amount) VALUES ($1, $2)", order_no, amount);
//     return "pay_" + order_no;          // stored; every duplicate gets it back
//   });
// @endcode
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <pqxx/pqxx>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/durable_store.hpp"
#include "idem/errors.hpp"
#include "idem/export.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/postgres/connection_pool.hpp"
#include "idem/store.hpp"

namespace idem::postgres {

/// Options of a PostgresStore.
struct PostgresStoreOptions {
  /// libpq conninfo ("host=... dbname=...") or a postgresql:// URI. Empty means libpq's
  /// defaults (PG* environment variables).
  std::string conninfo;
  /// Most connections the pool opens (opened lazily). 0 means 16. When the server refuses one
  /// more for its connection limit (max_connections, a role's or database's CONNECTION LIMIT:
  /// SQLSTATE 53300, recognised by libpq's English message), a call waits for one of the pool's
  /// open connections instead (pool_wait).
  std::size_t pool_size = 16;
  /// How long a call waits for a free connection when all are in use, then throws
  /// StorageUnavailable (the server's refusal, when its connection limit was why). 0 means 5 s.
  /// This wait and the three below are at most a day each (a UsageError otherwise).
  std::chrono::milliseconds pool_wait{5'000};
  /// How long a claim waits for a concurrent transaction holding the same key (on the unique
  /// index or the row) before answering kBusy. Set as the session's lock_timeout of every
  /// pooled connection, so it also bounds lock waits of the handler's own statements (a
  /// handler may `SET LOCAL lock_timeout` to change that). 0 means 2 s.
  std::chrono::milliseconds lock_timeout{2'000};
  /// statement_timeout set on every pooled connection (StorageTimeout when it fires).
  /// 0 means the server's setting (usually none).
  std::chrono::milliseconds statement_timeout{0};
  /// Client-side bound on every wait of idem on the server, whatever the network does: each
  /// idem statement (a claim, a completion, BEGIN, COMMIT, the session setup of a new
  /// connection) that gets no answer within it is cancelled (pg_cancel_backend) and its
  /// connection dropped; the call throws StorageTimeout (OutcomeUnknown for a COMMIT of
  /// with_transaction; a transactional COMMIT is resolved as when its connection is lost).
  /// It also sets TCP keepalives (idle after half of it), tcp_user_timeout and
  /// connect_timeout (at least 2 s, libpq's minimum) on every connection, unless `conninfo`
  /// sets them, so a peer that stops answering at the TCP level ends the wait of any
  /// statement, the handler's own included. A transactional handler's statements are not
  /// armed (their duration is the handler's). 0 means no bound (wait as long as TCP does).
  /// Keep it well under GuardOptions::lease.
  std::chrono::milliseconds client_timeout{5'000};
  /// Schema of the record table and of idem_schema_version (a validated identifier; created
  /// by the migration if missing).
  std::string schema = "public";
  /// Table holding the records (a validated identifier).
  std::string table = "api_idempotency";
  /// Column holding Key::id() (varchar(128)).
  std::string key_column = "idem_key";
  /// Column holding Key::scope() (varchar(64)).
  std::string scope_column = "biz_type";
  /// Times a transaction is re-run after a serialization failure or deadlock (40001, 40P01),
  /// each after a random pause of up to 1, 2, 4, ... ms (so that the transactions that
  /// conflicted do not meet again in lockstep). 0 means never.
  unsigned max_retries = 3;
  /// Called before each such re-run with the key and the SQLSTATE ("40001", "40P01"), e.g. to
  /// forward to Observer::on_durable_retry. Called on the calling thread, possibly from several
  /// threads at once; must not throw. Empty means none.
  std::function<void(const Key&, std::string_view)> on_retry;
  /// Transactional mode: read the record with one autocommit SELECT before opening the
  /// transaction, so a completed duplicate is replayed in 1 round trip instead of 4 (BEGIN,
  /// claim, read, ROLLBACK); a first execution pays 1 more. true: always. false: only when the
  /// guard's DurableHint does not expect the record absent (no fast store granted the claim,
  /// and the call did not set CallOptions::likely_new), which is when duplicates reach
  /// PostgreSQL; otherwise it claims first (fewest round trips for first executions).
  bool read_first = false;
  /// Run the migration on construction (create schema, table, index). false: the table must
  /// exist (e.g. applied from schema.sql by a DBA).
  bool migrate = true;
  /// Migration only: N >= 2 creates the table hash-partitioned by (scope, key) — e.g.
  /// `PARTITION BY HASH (biz_type, idem_key)` — into N partitions `<table>_p0` ..
  /// `<table>_p<N-1>` (declarative partitioning, PostgreSQL 12+). The unique key (key, scope)
  /// stays one constraint across partitions, because it contains the partition key; every
  /// statement is the same, and a key's statements touch one partition. purge_expired() works
  /// partition by partition. 0 or 1 means one plain table. An existing table is never changed
  /// (re-partitioning is a DBA's job). At most 1024.
  std::size_t partitions = 0;
  /// Fault injection for tests and drills: called in transactional mode right before COMMIT,
  /// with the transaction's connection. Empty in production.
  std::function<void(pqxx::connection&)> before_commit;

  /// The MQ consume record: `mq_consume_record (message_id, consumer_group)`.
  static PostgresStoreOptions mq_consume_record(std::string conninfo = {}) {
    PostgresStoreOptions o;
    o.conninfo = std::move(conninfo);
    o.table = "mq_consume_record";
    o.key_column = "message_id";
    o.scope_column = "consumer_group";
    return o;
  }
};

/// Counters of a PostgresStore (always on).
struct PostgresStoreStats {
  /// Transactions re-run after 40001/40P01.
  std::uint64_t retries = 0;
  /// Claims that waited past lock_timeout and answered kBusy.
  std::uint64_t lock_timeouts = 0;
  /// Connections lost at COMMIT and resolved by re-reading (committed or not).
  std::uint64_t commits_resolved = 0;
  /// Connections lost at COMMIT whose outcome could not be established (OutcomeUnknown).
  std::uint64_t commits_unknown = 0;
};

/// The PostgreSQL durable store (see the file comment). Thread-safe; share one per process.
class IDEM_EXPORT PostgresStore {
 public:
  /// What transactional handlers receive.
  using Transaction = pqxx::work;

  /// Connects lazily with `conninfo` (libpq conninfo or postgresql:// URI), default options.
  /// Runs the migration. @throws idem::StorageUnavailable when the database cannot be reached;
  /// idem::UsageError when it never can as configured (unknown database or role, password
  /// refused, malformed conninfo or URI).
  explicit PostgresStore(std::string conninfo);
  /// @throws idem::UsageError for a bad schema/table/column name or option, or a
  ///         misconfigured connection (see above);
  ///         idem::StorageError subclasses when the migration fails.
  explicit PostgresStore(PostgresStoreOptions options);
  /// Closes the pool's connections. No call may still run on the store (a guard using it, a
  /// transaction from with_transaction): destroy the guards first.
  ~PostgresStore();
  PostgresStore(const PostgresStore&) = delete;
  PostgresStore& operator=(const PostgresStore&) = delete;

  /// Transactional mode (the durable store contract, idem/durable_store.hpp, and the file
  /// comment). Unless the hint expects the record absent (a granted fast claim, or
  /// CallOptions::likely_new) the record is read first, so a duplicate is answered in one
  /// round trip (see PostgresStoreOptions::read_first). A hint never changes an answer.
  /// @param hint what the guard knows (DurableHint); never changes the answer
  /// @param key the operation's key; @param fingerprint the payload's fingerprint;
  /// @param owner this attempt's token; @param retention how long the completed record is kept
  /// @param handler `std::string(pqxx::work&)`; may be called again after a serialization
  ///        failure or deadlock (the earlier transaction was rolled back).
  /// @return kCommitted (handler ran and committed; `response` holds its bytes), kReplayed,
  ///         kBusy (another transaction holds the key beyond lock_timeout, or a live two-phase
  ///         lease), kMismatch.
  /// @throws whatever the handler throws (after rollback) when it is not a libpqxx exception;
  ///         idem::StorageError subclasses for database errors, the handler's statements
  ///         included (a deadlock after `max_retries` re-runs or a lost connection:
  ///         StorageUnavailable; lock_timeout or statement_timeout: StorageTimeout), each with
  ///         the libpqxx exception nested as its cause (std::rethrow_if_nested).
  template <class Handler>
  TransactionalResult run_transactional(const Key& key, std::string_view fingerprint,
                                        const OwnerToken& owner, std::chrono::seconds retention,
                                        Handler&& handler, DurableHint hint = {}) {
    auto call = [](void* h, pqxx::work& tx) -> std::string {
      return (*static_cast<std::remove_reference_t<Handler>*>(h))(tx);
    };
    return run_transactional_impl(key, fingerprint, owner, retention,
                                  HandlerRef{call, static_cast<void*>(std::addressof(handler))},
                                  hint);
  }

  /// Two-phase begin: claims in its own committed statement, for `lease` (database clock).
  /// The hint changes nothing here (the claim is one statement either way).
  ClaimResult begin(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                    std::chrono::milliseconds lease, DurableHint hint = {});
  /// Two-phase complete: only while `owner` holds the in-progress record. false: lease lost.
  /// @throws idem::OutcomeUnknown if the connection broke and the record cannot be re-read.
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
  /// Deletes completed and failed records whose retention ended, `batch_size` rows per short
  /// transaction (`FOR UPDATE SKIP LOCKED`, never waits on a busy row), until none is left.
  /// Never touches in-progress rows. A partitioned table is purged one leaf partition at a
  /// time (each batch scans and locks one partition). @return rows deleted.
  std::size_t purge_expired(std::size_t batch_size = 1000);
  /// Leaf partitions of the table (as `schema.name`, in creation order); empty for a plain
  /// table. Whoever partitioned it (this migration, a DBA), by whatever method.
  std::vector<std::string> partitions();
  /// "postgres".
  std::string_view name() const noexcept { return "postgres"; }

  /// Inside the caller's open transaction: claim or find the record, under a SAVEPOINT so a
  /// lock timeout answers kBusy without aborting `tx`. `lease` 0 means the transaction is the
  /// lease (transactional mode). For composing idem with a transaction the caller manages.
  ClaimResult claim_in(pqxx::work& tx, const Key& key, std::string_view fingerprint,
                       const OwnerToken& owner, std::chrono::milliseconds lease);
  /// Inside the caller's open transaction: complete `owner`'s record.
  /// @throws idem::LeaseLost if `owner` does not hold it.
  void complete_in(pqxx::work& tx, const Key& key, const OwnerToken& owner,
                   std::string_view response, std::chrono::seconds retention);

  /// Inside the caller's open transaction: for each request, writes its record already
  /// completed with `response` when no record of its key exists, in ONE statement for the
  /// whole list (INSERT ... SELECT FROM unnest(...) ON CONFLICT DO NOTHING RETURNING). For
  /// callers whose response is known before their handlers run (IdempotentConsumer's
  /// consume_batch); the transaction makes records and handler writes atomic. A key held by
  /// another uncommitted transaction is waited for up to the connection's lock_timeout (set
  /// on the store's pooled connections, as with_transaction uses).
  /// @return for each request, whether its record was written (false: a record exists; decide
  ///         with claim_in).
  /// @throws idem::StorageTimeout when a lock wait timed out (the transaction is aborted),
  ///         other idem::StorageError subclasses.
  std::vector<bool> insert_completed_batch_in(pqxx::work& tx,
                                              const std::vector<ClaimRequest>& requests,
                                              std::string_view response,
                                              std::chrono::seconds retention);

  /// Inside the caller's open transaction: writes every request's record already completed
  /// with `response`, in ONE plain INSERT (no ON CONFLICT). For batches where no record is
  /// expected (their fast-store claims were fresh): ~1/3 cheaper per record than
  /// insert_completed_batch_in, which it otherwise matches (key order, lock waits).
  /// @return true when every record was written; false when a record of one of the keys
  ///         exists: the transaction is then ABORTED (roll it back; run the batch again with
  ///         insert_completed_batch_in).
  /// @throws idem::StorageTimeout when a lock wait timed out (the transaction is aborted),
  ///         other idem::StorageError subclasses.
  bool insert_new_completed_batch_in(pqxx::work& tx, const std::vector<ClaimRequest>& requests,
                                     std::string_view response, std::chrono::seconds retention);

  /// Runs `fn(pqxx::work&)` in a transaction on a pooled connection and commits (business
  /// setup, tests). libpqxx errors are translated to idem errors; fn's own exceptions propagate.
  template <class Fn>
  auto with_transaction(Fn&& fn) {
    using R = std::invoke_result_t<Fn&, pqxx::work&>;
    if constexpr (std::is_void_v<R>) {
      run_in_transaction([&](pqxx::work& tx) { fn(tx); });
    } else {
      std::optional<R> out;
      run_in_transaction([&](pqxx::work& tx) { out.emplace(fn(tx)); });
      return std::move(*out);
    }
  }

  // --- the batch operations of the durable store contract (idem/durable_store.hpp) ---------

  /// Contract: what a claim decides inside `tx` (claim_in with lease 0: an in-progress row,
  /// under a savepoint; the open transaction is the lease).
  ClaimResult decide_in(pqxx::work& tx, const Key& key, std::string_view fingerprint,
                        const OwnerToken& owner) {
    return claim_in(tx, key, fingerprint, owner, std::chrono::milliseconds(0));
  }
  /// Contract: after decide_in granted the claim, the record completed (complete_in).
  void record_in(pqxx::work& tx, const Key& key, std::string_view /*fingerprint*/,
                 const OwnerToken& owner, std::string_view response, std::chrono::seconds retention,
                 const ClaimResult& /*decided*/) {
    complete_in(tx, key, owner, response, retention);
  }
  /// Contract: when `hint.expects_absent()` (fresh fast claims, or calls that said their keys
  /// are likely new), the plain insert (insert_new_completed_batch_in; nullopt when a record
  /// existed: `tx` is then aborted), else the tolerant one (insert_completed_batch_in).
  std::optional<std::vector<bool>> record_batch_in(pqxx::work& tx,
                                                   const std::vector<ClaimRequest>& requests,
                                                   std::string_view response,
                                                   std::chrono::seconds retention,
                                                   DurableHint hint);
  /// Contract: `SAVEPOINT idem_batch`.
  void savepoint(pqxx::work& tx);
  /// Contract: `ROLLBACK TO SAVEPOINT idem_batch`.
  void rollback_to_savepoint(pqxx::work& tx);
  /// Contract: `RELEASE SAVEPOINT idem_batch`.
  void release_savepoint(pqxx::work& tx);
  /// Contract: the idem error for a libpqxx exception a batch handler's statement threw (as
  /// run_transactional types them: a lock wait StorageTimeout, a lost connection
  /// StorageUnavailable, ...); any other exception as it is.
  std::exception_ptr typed_error(std::exception_ptr e) const noexcept;

  /// The connection pool (business code may share it).
  ConnectionPool& pool() noexcept { return *pool_; }
  /// The options in force (defaults applied).
  const PostgresStoreOptions& options() const noexcept { return options_; }
  /// `schema.table` as used in statements.
  const std::string& qualified_table() const noexcept { return qualified_table_; }
  /// A snapshot of the store's counters.
  PostgresStoreStats stats() const noexcept;

  /// Runs the migration (what the constructor does unless options.migrate is false).
  void migrate();

 private:
  struct HandlerRef {
    std::string (*call)(void*, pqxx::work&);
    void* self;
    std::string operator()(pqxx::work& tx) const { return call(self, tx); }
  };
  TransactionalResult run_transactional_impl(const Key& key, std::string_view fingerprint,
                                             const OwnerToken& owner,
                                             std::chrono::seconds retention, HandlerRef handler,
                                             DurableHint hint);
  void run_in_transaction(const std::function<void(pqxx::work&)>& fn);

  struct Impl;
  PostgresStoreOptions options_;
  std::string qualified_table_;
  std::string connect_info_;  // conninfo with the client-side bounds of client_timeout
  std::unique_ptr<ConnectionPool> pool_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::postgres
