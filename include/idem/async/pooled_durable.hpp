// SPDX-License-Identifier: MIT
// idem::async::PooledDurable<Store>: any synchronous durable store (SqliteStore, MysqlStore,
// PostgresStore) used by AsyncGuard, its calls run on a bounded WorkerPool.
//
// File: async/pooled_durable.hpp
//
// A durable store whose client blocks (SQLite's file locks, the MySQL client, libpqxx) never
// runs on the loop: each operation is one job on the pool, and its answer is posted back to
// the call's executor. The store's own rules, retries and error mapping apply unchanged; the
// pool bounds how many of its calls block at once (WorkerPoolOptions::threads) and refuses,
// typed, what would start new work beyond `max_queued` (begin, run_transactional, lookup).
// Completions, failures and releases end work already admitted: they are never refused
// (WorkerPool::submit_follow_up), so an overload cannot leave a key in progress until its
// lease, nor a handler's response unrecorded.
//
// @code
//   idem::sqlite::SqliteStore sqlite{"payments.db"};
//   idem::async::WorkerPool pool{{.threads = 4}};
//   idem::async::PooledDurable durable{sqlite, pool};
//   idem::async::AsyncGuard guard{io.get_executor(), fast, durable, {.pool = &pool}};
// @endcode
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "idem/async/store.hpp"
#include "idem/async/worker_pool.hpp"
#include "idem/durable_store.hpp"

namespace idem::async {

/// A synchronous durable store on a WorkerPool (see the file comment). Both must outlive it.
template <class Store>
class PooledDurable {
  static_assert(::idem::detail::check_durable_store<Store>());

 public:
  /// What transactional handlers receive (the store's own transaction type).
  using Transaction = typename Store::Transaction;

  /// Runs `store`'s calls on `pool`; both must outlive this adapter and its calls.
  PooledDurable(Store& store, WorkerPool& pool) noexcept : store_(&store), pool_(&pool) {}

  /// Store::run_transactional on a worker: `body` (`std::string(Transaction&)`) runs there,
  /// inside the transaction, and may run again after a serialization failure.
  template <class Body>
  void async_run_transactional(const Key& key, std::string_view fingerprint,
                               const OwnerToken& owner, std::chrono::seconds retention,
                               DurableHint hint, Body body, const Executor& ex,
                               Completion<TransactionalResult> done) {
    pool_->submit(
        ex,
        [store = store_, key = Key(key), fp = std::string(fingerprint), owner = OwnerToken(owner),
         retention, hint, body = std::move(body)]() mutable {
          return store->run_transactional(key, fp, owner, retention, body, hint);
        },
        settle(std::move(done)));
  }

  /// Store::begin (two-phase claim) on a worker.
  void async_begin(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                   std::chrono::milliseconds lease, DurableHint hint, const Executor& ex,
                   Completion<ClaimResult> done) {
    pool_->submit(
        ex,
        [store = store_, key = Key(key), fp = std::string(fingerprint), owner = OwnerToken(owner),
         lease, hint] { return store->begin(key, fp, owner, lease, hint); },
        settle(std::move(done)));
  }

  /// Store::complete on a worker (never refused by the pool's bound).
  void async_complete(const Key& key, const OwnerToken& owner, std::string_view response,
                      std::chrono::seconds retention, const Executor& ex, Completion<bool> done) {
    pool_->submit_follow_up(
        ex,
        [store = store_, key = Key(key), owner = OwnerToken(owner),
         response = std::string(response),
         retention] { return store->complete(key, owner, response, retention); },
        settle(std::move(done)));
  }

  /// Store::fail on a worker (a dead-lettered message's record; never refused).
  void async_fail(const Key& key, const OwnerToken& owner, std::string_view reason,
                  std::chrono::seconds retention, const Executor& ex, Completion<bool> done) {
    pool_->submit_follow_up(
        ex,
        [store = store_, key = Key(key), owner = OwnerToken(owner), reason = std::string(reason),
         retention] { return store->fail(key, owner, reason, retention); },
        settle(std::move(done)));
  }

  /// Store::release on a worker (never refused by the pool's bound).
  void async_release(const Key& key, const OwnerToken& owner, const Executor& ex,
                     Completion<bool> done) {
    pool_->submit_follow_up(
        ex,
        [store = store_, key = Key(key), owner = OwnerToken(owner)] {
          return store->release(key, owner);
        },
        settle(std::move(done)));
  }

  /// Store::lookup on a worker.
  void async_lookup(const Key& key, const Executor& ex, Completion<std::optional<Record>> done) {
    pool_->submit(
        ex, [store = store_, key = Key(key)] { return store->lookup(key); },
        settle(std::move(done)));
  }

  /// The store's name ("sqlite", "postgres", "mysql").
  std::string_view name() const noexcept { return store_->name(); }
  /// The wrapped store (business code may use it, on the pool).
  Store& store() const noexcept { return *store_; }
  /// The pool its calls run on.
  WorkerPool& pool() const noexcept { return *pool_; }

 private:
  template <class T>
  static auto settle(Completion<T> done) {
    return [done = std::move(done)](std::exception_ptr e, std::optional<T> v) mutable {
      done(std::move(e), v ? std::move(*v) : T{});
    };
  }

  Store* store_;
  WorkerPool* pool_;
};

}  // namespace idem::async
