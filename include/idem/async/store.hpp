// SPDX-License-Identifier: MIT
// The two storage roles of idem, asynchronously: what AsyncGuard asks of a fast store and of a
// durable store, and the adapters for stores whose calls never block.
//
// File: async/store.hpp
//
// Every operation takes its arguments as views (read during the call only: a store copies what
// it keeps), an executor, and a completion `done(error, value)` that runs on that executor:
// `error` is null and `value` the answer, or `error` holds the idem exception the synchronous
// store would have thrown (the same types, through the same choke points). A store never
// blocks the calling thread: it sends and returns (Redis, PostgreSQL on the loop), or hands the
// work to a bounded WorkerPool (SQLite, MySQL, transactional handlers).
//
// The answers mean exactly what the synchronous FastStore / durable store answers mean
// (idem/store.hpp): the same record rules (idem/detail/record_rules.hpp) decide them.
#pragma once

#include <chrono>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "idem/async/function.hpp"
#include "idem/async/net.hpp"
#include "idem/key.hpp"
#include "idem/store.hpp"

namespace idem::async {

/// A completion: `done(nullptr, value)` or `done(error, T{})`.
template <class T>
using Completion = Function<void(std::exception_ptr, T)>;

/// The fast store, asynchronously (see the file comment and idem::FastStore).
class AsyncFastStore {
 public:
  virtual ~AsyncFastStore() = default;

  /// FastStore::claim. `done` runs on `ex`.
  virtual void async_claim(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                           std::chrono::milliseconds lease, const Executor& ex,
                           Completion<ClaimResult> done) = 0;

  /// FastStore::complete: true, or false when the lease was lost.
  virtual void async_complete(const Key& key, const OwnerToken& owner, std::string_view response,
                              std::chrono::seconds retention, const Executor& ex,
                              Completion<bool> done) = 0;

  /// FastStore::fail: marks `owner`'s in-progress record failed with `reason` (a dead-lettered
  /// message); true, or false when the lease was lost.
  virtual void async_fail(const Key& key, const OwnerToken& owner, std::string_view reason,
                          std::chrono::seconds retention, const Executor& ex,
                          Completion<bool> done) = 0;

  /// FastStore::release: true, or false when `owner` did not hold the claim.
  virtual void async_release(const Key& key, const OwnerToken& owner, const Executor& ex,
                             Completion<bool> done) = 0;

  /// FastStore::fill (the value is always true).
  virtual void async_fill(const Key& key, std::string_view fingerprint, std::string_view response,
                          std::chrono::seconds retention, const Executor& ex,
                          Completion<bool> done) = 0;

  /// FastStore::refill: as async_fill, keeping what the durable store reported of the
  /// record's first attempt (`origin`, whose view need only last for the call). This default
  /// calls async_fill (the record reports the time it was written back and no owner).
  virtual void async_refill(const Key& key, std::string_view fingerprint, std::string_view response,
                            std::chrono::seconds retention, const RecordOrigin& origin,
                            const Executor& ex, Completion<bool> done) {
    (void)origin;
    async_fill(key, fingerprint, response, retention, ex, std::move(done));
  }

  /// FastStore::lookup.
  virtual void async_lookup(const Key& key, const Executor& ex,
                            Completion<std::optional<Record>> done) = 0;

  /// A short name for logs and metrics ("memory", "redis", "redis-cluster").
  virtual std::string_view name() const noexcept = 0;
};

/// A synchronous FastStore whose calls never block (idem::MemoryStore), used asynchronously:
/// each call runs inline and `done` is dispatched to the executor (inline when the caller runs
/// there). Do not wrap a store that does I/O (RedisStore): use AsyncRedisStore.
class InlineFastStore final : public AsyncFastStore {
 public:
  /// `store` must outlive this adapter.
  explicit InlineFastStore(FastStore& store) noexcept : store_(&store) {}

  void async_claim(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                   std::chrono::milliseconds lease, const Executor& ex,
                   Completion<ClaimResult> done) override {
    answer(ex, std::move(done), [&] { return store_->claim(key, fingerprint, owner, lease); });
  }
  void async_complete(const Key& key, const OwnerToken& owner, std::string_view response,
                      std::chrono::seconds retention, const Executor& ex,
                      Completion<bool> done) override {
    answer(ex, std::move(done),
           [&] { return store_->complete(key, owner, response, retention); });
  }
  void async_fail(const Key& key, const OwnerToken& owner, std::string_view reason,
                  std::chrono::seconds retention, const Executor& ex,
                  Completion<bool> done) override {
    answer(ex, std::move(done), [&] { return store_->fail(key, owner, reason, retention); });
  }
  void async_release(const Key& key, const OwnerToken& owner, const Executor& ex,
                     Completion<bool> done) override {
    answer(ex, std::move(done), [&] { return store_->release(key, owner); });
  }
  void async_fill(const Key& key, std::string_view fingerprint, std::string_view response,
                  std::chrono::seconds retention, const Executor& ex,
                  Completion<bool> done) override {
    answer(ex, std::move(done), [&] {
      store_->fill(key, fingerprint, response, retention);
      return true;
    });
  }
  void async_refill(const Key& key, std::string_view fingerprint, std::string_view response,
                    std::chrono::seconds retention, const RecordOrigin& origin, const Executor& ex,
                    Completion<bool> done) override {
    answer(ex, std::move(done), [&] {
      store_->refill(key, fingerprint, response, retention, origin);
      return true;
    });
  }
  void async_lookup(const Key& key, const Executor& ex,
                    Completion<std::optional<Record>> done) override {
    answer(ex, std::move(done), [&] { return store_->lookup(key); });
  }
  std::string_view name() const noexcept override { return store_->name(); }

  /// The wrapped store.
  FastStore& store() const noexcept { return *store_; }

 private:
  template <class T, class Fn>
  static void answer(const Executor& ex, Completion<T> done, Fn&& fn) {
    std::exception_ptr error;
    T value{};
    try {
      value = fn();
    } catch (...) {
      error = std::current_exception();
    }
    net::dispatch(ex, [done = std::move(done), error, value = std::move(value)]() mutable {
      done(error, std::move(value));
    });
  }

  FastStore* store_;
};

}  // namespace idem::async
