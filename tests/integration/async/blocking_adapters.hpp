// SPDX-License-Identifier: MIT
// The synchronous store interfaces implemented by waiting on the asynchronous ones, so the
// synchronous conformance suites (tests/conformance) run unchanged through idem::async's
// stores: every answer they check comes from an async_* call completed on a loop thread.
#pragma once

#include <chrono>
#include <exception>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "idem/async/store.hpp"
#include "idem/durable_store.hpp"

namespace idem::test {

/// A thread running an io_context until destroyed.
class LoopThread {
 public:
  LoopThread()
      : work_(idem::async::net::make_work_guard(io_)), thread_([this] { io_.run(); }) {}
  ~LoopThread() {
    work_.reset();
    io_.stop();
    thread_.join();
  }
  LoopThread(const LoopThread&) = delete;
  LoopThread& operator=(const LoopThread&) = delete;
  idem::async::Executor executor() { return io_.get_executor(); }
  idem::async::net::io_context& io() noexcept { return io_; }

 private:
  idem::async::net::io_context io_;
  idem::async::net::executor_work_guard<idem::async::net::io_context::executor_type> work_;
  std::thread thread_;
};

/// Starts `start(executor, done)` and waits for `done(error, value)`; rethrows the error.
template <class T, class Start>
T wait_for(idem::async::Executor ex, Start&& start) {
  auto p = std::make_shared<std::promise<T>>();
  std::future<T> f = p->get_future();
  start(ex, idem::async::Completion<T>([p](std::exception_ptr e, T v) {
          if (e) {
            p->set_exception(e);
          } else {
            p->set_value(std::move(v));
          }
        }));
  return f.get();
}

/// A FastStore that is an AsyncFastStore waited on (the store's answers and errors unchanged).
class BlockingFastStore final : public FastStore {
 public:
  /// `make(executor)` builds the asynchronous store on this adapter's loop.
  template <class Make>
  explicit BlockingFastStore(Make&& make) : store_(make(loop_.executor())) {}
  ~BlockingFastStore() override {
    // The store's connections belong to the loop: destroy it there.
    std::promise<void> done;
    idem::async::net::post(loop_.io(), [&] {
      store_.reset();
      done.set_value();
    });
    done.get_future().wait();
  }

  ClaimResult claim(const Key& k, std::string_view fp, const OwnerToken& o,
                    std::chrono::milliseconds lease) override {
    return wait_for<ClaimResult>(loop_.executor(), [&](auto ex, auto done) {
      store_->async_claim(k, fp, o, lease, ex, std::move(done));
    });
  }
  bool complete(const Key& k, const OwnerToken& o, std::string_view r,
                std::chrono::seconds ret) override {
    return wait_for<bool>(loop_.executor(), [&](auto ex, auto done) {
      store_->async_complete(k, o, r, ret, ex, std::move(done));
    });
  }
  bool fail(const Key& k, const OwnerToken& o, std::string_view reason,
            std::chrono::seconds ret) override {
    return wait_for<bool>(loop_.executor(), [&](auto ex, auto done) {
      store_->async_fail(k, o, reason, ret, ex, std::move(done));
    });
  }
  bool release(const Key& k, const OwnerToken& o) override {
    return wait_for<bool>(loop_.executor(), [&](auto ex, auto done) {
      store_->async_release(k, o, ex, std::move(done));
    });
  }
  void fill(const Key& k, std::string_view fp, std::string_view r,
            std::chrono::seconds ret) override {
    (void)wait_for<bool>(loop_.executor(), [&](auto ex, auto done) {
      store_->async_fill(k, fp, r, ret, ex, std::move(done));
    });
  }
  void refill(const Key& k, std::string_view fp, std::string_view r, std::chrono::seconds ret,
              const RecordOrigin& origin) override {
    (void)wait_for<bool>(loop_.executor(), [&](auto ex, auto done) {
      store_->async_refill(k, fp, r, ret, origin, ex, std::move(done));
    });
  }
  std::optional<Record> lookup(const Key& k) override {
    return wait_for<std::optional<Record>>(loop_.executor(), [&](auto ex, auto done) {
      store_->async_lookup(k, ex, std::move(done));
    });
  }
  std::string_view name() const noexcept override { return store_->name(); }

  idem::async::AsyncFastStore& async_store() noexcept { return *store_; }

 private:
  LoopThread loop_;
  std::unique_ptr<idem::async::AsyncFastStore> store_;
};

/// The durable store contract (idem/durable_store.hpp) implemented by waiting on an
/// asynchronous durable store `A` (AsyncPostgresStore, PooledDurable<S>); `Sync` is the
/// synchronous store behind it, for what the asynchronous contract leaves out (purge).
template <class A, class Sync>
class BlockingDurable {
 public:
  using Transaction = typename A::Transaction;

  BlockingDurable(A& async_store, Sync& sync_store, idem::async::Executor ex)
      : a_(&async_store), sync_(&sync_store), ex_(std::move(ex)) {}

  std::string_view name() const noexcept { return a_->name(); }

  template <class Handler>
  TransactionalResult run_transactional(const Key& key, std::string_view fp,
                                        const OwnerToken& owner, std::chrono::seconds retention,
                                        Handler&& handler, DurableHint hint = {}) {
    auto* h = std::addressof(handler);
    return wait_for<TransactionalResult>(ex_, [&](auto ex, auto done) {
      a_->async_run_transactional(
          key, fp, owner, retention, hint,
          [h](Transaction& tx) -> std::string { return (*h)(tx); }, ex, std::move(done));
    });
  }
  ClaimResult begin(const Key& key, std::string_view fp, const OwnerToken& owner,
                    std::chrono::milliseconds lease, DurableHint hint = {}) {
    return wait_for<ClaimResult>(ex_, [&](auto ex, auto done) {
      a_->async_begin(key, fp, owner, lease, hint, ex, std::move(done));
    });
  }
  bool complete(const Key& key, const OwnerToken& owner, std::string_view response,
                std::chrono::seconds retention) {
    return wait_for<bool>(ex_, [&](auto ex, auto done) {
      a_->async_complete(key, owner, response, retention, ex, std::move(done));
    });
  }
  bool release(const Key& key, const OwnerToken& owner) {
    return wait_for<bool>(
        ex_, [&](auto ex, auto done) { a_->async_release(key, owner, ex, std::move(done)); });
  }
  bool fail(const Key& key, const OwnerToken& owner, std::string_view reason,
            std::chrono::seconds retention) {
    return wait_for<bool>(ex_, [&](auto ex, auto done) {
      a_->async_fail(key, owner, reason, retention, ex, std::move(done));
    });
  }
  std::optional<Record> lookup(const Key& key) {
    return wait_for<std::optional<Record>>(
        ex_, [&](auto ex, auto done) { a_->async_lookup(key, ex, std::move(done)); });
  }
  std::size_t purge_expired(std::size_t batch_size) { return sync_->purge_expired(batch_size); }

  Sync& sync_store() noexcept { return *sync_; }

 private:
  A* a_;
  Sync* sync_;
  idem::async::Executor ex_;
};

}  // namespace idem::test
