// SPDX-License-Identifier: MIT
// idem::async::AsyncPostgresStore: PostgreSQL as AsyncGuard's durable store, its two-phase
// statements non-blocking on the loop (libpq's asynchronous API, pipeline mode), its
// transactions on a worker pool (libpqxx). libpq never appears in this header.
//
// File: async/postgres_store.hpp
//
// One guard, every handler form: the store routes each call where it can run without blocking
// the loop.
//
//   two-phase handlers ..... `R()` on the pool, `on_loop`, `with_reply`, coroutines: the durable
//     (begin, complete,      begin, complete, release, fail and lookup are idem's own statements,
//      release, fail)        sent from the loop on pipelined libpq connections: a thousand calls
//                            in flight cost one socket and no thread
//   transactional handlers . `R(pqxx::work&)`: the whole transaction (claim, handler, completion,
//                            COMMIT) on the worker pool through the synchronous PostgresStore
//                            (PooledDurable<PostgresStore>), since the handler's own statements
//                            block
//
// Both halves read and write the same rows with the same SQL (the PostgresStore given at
// construction names the table and runs the migration): a record claimed by one is completed,
// released or replayed by the other, and by any synchronous PostgresStore on the same table.
//
//   begin      one round trip: `INSERT ... ON CONFLICT DO NOTHING` and the record's read,
//              pipelined in one implicit transaction; what the read found decided by the
//              rulebook (idem/detail/record_rules.hpp): replay, mismatch, busy, our own claim,
//              or an expired lease taken over (fenced on the old owner; one more round trip)
//   complete   `UPDATE ... WHERE owner = <token> AND status = 'in_progress'` (as release and
//   fail...    fail): an attempt whose lease was taken over completes nothing (false)
//
// Deadlines. Connecting (TCP, authentication, the session's settings and prepared statements)
// has `connect_timeout`. Each statement has `statement_timeout`: the server cancels a statement
// that runs longer (it is the session's statement_timeout: StorageTimeout, nothing applied), and
// the client gives a batch `statement_timeout + client_grace` from when it was sent: past that
// the server is not answering at all, so the connection is closed (the server rolls back what
// had not committed) and every batch in flight on it fails. A lock wait on a key another
// transaction holds ends after `lock_timeout` (short: a pipelined connection answers in order,
// so a waiting statement holds up the statements behind it): a begin then answers kBusy.
//
// Failures are the synchronous store's types: StorageUnavailable (connection lost or refused,
// server shutting down; during the `reconnect_backoff` after a failed connect, calls fail at
// once), StorageTimeout (a deadline above), UsageError (a database, role, password or conninfo
// that can never work), CorruptRecord (a row idem did not write). A completion or failure record
// whose answer was lost with its connection is resolved by reading the record on a fresh
// connection (applied: true; still in progress: written again once); when that read fails too,
// OutcomeUnknown. A begin, release or lookup whose connection broke is tried once more (each is
// safe to repeat: a begin finds its own claim).
//
// Threading: the connections run on a strand of the executor given at construction; calls may
// come from any thread, and completions run on the executor each call names. The store may be
// destroyed from any thread once no call will be started on it: its connections are closed on
// that strand, and calls still in flight complete with StorageUnavailable. The PostgresStore
// and the WorkerPool must outlive it.
//
// @code
//   idem::postgres::PostgresStore sync{"host=127.0.0.1 dbname=payments"};  // migration, pool
//   idem::async::WorkerPool pool;
//   idem::async::AsyncPostgresStore durable{io.get_executor(), sync, pool};
//   idem::async::AsyncGuardOptions o;
//   o.pool = &pool;
//   idem::async::AsyncGuard guard{io.get_executor(), fast, durable, o};
//   guard.async_run(key, fp, idem::async::with_reply<std::string>([&](auto reply) {
//     gateway.charge(order, [reply = std::move(reply)](std::string id) mutable { reply(id); });
//   }), on_answer);                                          // durable statements on the loop
//   guard.async_run(key2, fp2, [&](pqxx::work& tx) { return book(tx, order); },
//                   on_answer);                              // a transaction on the pool
// @endcode
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "idem/async/net.hpp"
#include "idem/async/pooled_durable.hpp"
#include "idem/async/store.hpp"
#include "idem/async/worker_pool.hpp"
#include "idem/export.hpp"
#include "idem/postgres/postgres_store.hpp"

namespace idem::async {

/// Options of an AsyncPostgresStore's loop connections (its transactions use the
/// PostgresStore's own pool and options).
struct AsyncPostgresStoreOptions {
  /// libpq conninfo or postgresql:// URI of the loop's connections. Empty means the
  /// PostgresStore's (`PostgresStoreOptions::conninfo`). libpq resolves a host name with a
  /// blocking lookup while connecting: give a numeric `host` or `hostaddr`.
  std::string conninfo;
  /// Pipelined connections; each call goes to the next one in turn. 0 means 1.
  std::size_t connections = 1;
  /// Longest wait for a connection to open and be set up; the calls waiting for it then fail
  /// (StorageTimeout). 0 means 2 s.
  std::chrono::milliseconds connect_timeout{2'000};
  /// Longest run of one statement on the server (the session's statement_timeout: the server
  /// cancels it, StorageTimeout). 0 means 1 s.
  std::chrono::milliseconds statement_timeout{1'000};
  /// How much longer than `statement_timeout` the client waits for a batch's answer before it
  /// closes the connection (a server or network that stopped answering). 0 means 1 s.
  std::chrono::milliseconds client_grace{1'000};
  /// Longest wait on a key's row lock held by another transaction (the session's lock_timeout):
  /// a begin then answers kBusy. Keep it short: the statements pipelined behind a waiting one
  /// wait too. 0 means 100 ms.
  std::chrono::milliseconds lock_timeout{100};
  /// After a failed connect, calls on that connection fail at once for this long
  /// (StorageUnavailable). 0 means a connect per call.
  std::chrono::milliseconds reconnect_backoff{100};
};

/// Counters of an AsyncPostgresStore's loop connections.
struct AsyncPostgresStats {
  std::uint64_t connects = 0;             ///< connections opened (a reconnect counts)
  std::uint64_t batches = 0;              ///< statement batches sent
  std::uint64_t failed_batches = 0;       ///< batches that got no results (connection, deadline)
  std::uint64_t lock_timeouts = 0;        ///< begins answered kBusy after lock_timeout
  std::uint64_t retries = 0;              ///< begins, releases, lookups sent again after a break
  std::uint64_t outcomes_resolved = 0;    ///< completions whose lost answer was settled (a
                                          ///< read, or the write sent once more after it)
  std::uint64_t outcomes_unknown = 0;     ///< ... that no read could settle (OutcomeUnknown)
};

/// PostgreSQL as AsyncGuard's durable store (see the file comment).
class IDEM_EXPORT AsyncPostgresStore {
 public:
  /// What transactional handlers receive (the synchronous store's transaction, on the pool).
  using Transaction = postgres::PostgresStore::Transaction;

  /// Two-phase calls on connections of its own on `executor`'s loop, transactional calls on
  /// `pool` through `store`; both must outlive this store. The record table is `store`'s
  /// (its options name it; its constructor migrated it). Connects on first use.
  /// @throws idem::UsageError for a negative option.
  AsyncPostgresStore(Executor executor, postgres::PostgresStore& store, WorkerPool& pool,
                     AsyncPostgresStoreOptions options = {});
  /// Closes the loop's connections (on their strand); calls in flight complete with
  /// StorageUnavailable.
  ~AsyncPostgresStore();
  AsyncPostgresStore(const AsyncPostgresStore&) = delete;
  AsyncPostgresStore& operator=(const AsyncPostgresStore&) = delete;

  /// PostgresStore::run_transactional on a worker of the pool (PooledDurable): `body`
  /// (`std::string(pqxx::work&)`) runs there, inside the transaction.
  template <class Body>
  void async_run_transactional(const Key& key, std::string_view fingerprint,
                               const OwnerToken& owner, std::chrono::seconds retention,
                               DurableHint hint, Body body, const Executor& ex,
                               Completion<TransactionalResult> done) {
    pooled_.async_run_transactional(key, fingerprint, owner, retention, hint, std::move(body), ex,
                                    std::move(done));
  }

  /// Two-phase claim, from the loop: claimed (perhaps taking over an expired lease), or the
  /// record's answer (done, busy, mismatch). The hint changes nothing.
  void async_begin(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                   std::chrono::milliseconds lease, DurableHint hint, const Executor& ex,
                   Completion<ClaimResult> done);
  /// Completes `owner`'s in-progress record with `response`: true, or false when the lease
  /// was lost. OutcomeUnknown when the answer was lost and the record could not be re-read.
  void async_complete(const Key& key, const OwnerToken& owner, std::string_view response,
                      std::chrono::seconds retention, const Executor& ex, Completion<bool> done);
  /// Marks `owner`'s in-progress record failed with `reason` (replayed as kDone, failed):
  /// true, or false when the lease was lost.
  void async_fail(const Key& key, const OwnerToken& owner, std::string_view reason,
                  std::chrono::seconds retention, const Executor& ex, Completion<bool> done);
  /// Deletes `owner`'s in-progress record: true, or false when it did not hold it.
  void async_release(const Key& key, const OwnerToken& owner, const Executor& ex,
                     Completion<bool> done);
  /// Reads the record of `key` (nullopt when absent).
  void async_lookup(const Key& key, const Executor& ex, Completion<std::optional<Record>> done);

  /// "postgres".
  std::string_view name() const noexcept { return "postgres"; }
  /// The synchronous store (transactions, migration, purge_expired; on the pool).
  postgres::PostgresStore& store() const noexcept { return pooled_.store(); }
  /// The pool transactions run on.
  WorkerPool& pool() const noexcept { return pooled_.pool(); }
  /// The options in force (zeros replaced).
  const AsyncPostgresStoreOptions& options() const noexcept;
  /// The loop connections' counters (exact when read on the loop, or when it is idle).
  AsyncPostgresStats stats() const;

 private:
  class Impl;
  PooledDurable<postgres::PostgresStore> pooled_;
  std::shared_ptr<Impl> impl_;
};

}  // namespace idem::async
