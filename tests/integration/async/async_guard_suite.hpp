// SPDX-License-Identifier: MIT
// One typed suite for AsyncGuard on every store combination: the outcomes the synchronous
// conformance suites check (exactly one effect, replays byte for byte, mismatch first, handler
// failures roll back and release, a fast store that lost the record is refilled) reached
// through the asynchronous API, plus what only it has: handlers on the loop, answering later,
// cancellation and deadlines at each step.
//
// An Env type (Traits::Env) provides:
//   using Durable = ...;                                  // AsyncGuard's durable store type
//   static const char* env_var();                         // null: no server needed
//   explicit Env(const std::string& env_value);           // stores, pool, loop thread
//     (or Env(const std::string&, anet::io_context& loop): stores on the suite's loop)
//   idem::async::AsyncFastStore* fast();                  // null: durable only
//   Durable& durable();
//   idem::async::WorkerPool& pool();
//   void insert_effect(typename Durable::Transaction&, const std::string& id);
//   long count_effects(const std::string& id);
//   void forget_fast(const idem::Key&);                   // the fast store loses a record
// and the test file does:
//   using Envs = ::testing::Types<MyEnv>;
//   INSTANTIATE_TYPED_TEST_SUITE_P(Name, AsyncGuardSuite, Envs);
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "idem/async/guard.hpp"
#include "support/test_env.hpp"

namespace idem::test {

namespace anet = idem::async::net;
using namespace std::chrono_literals;

/// What a call completed with.
template <class R = std::string>
struct Completed {
  bool done = false;
  std::exception_ptr error;
  GuardResult<R> result;
  std::thread::id thread;
};

/// An answer slot filled on the loop; read after wait().
template <class R = std::string>
class Answer {
 public:
  auto callback() {
    return [this](std::exception_ptr e, GuardResult<R> r) {
      std::lock_guard<std::mutex> lock(m_);
      c_.done = true;
      c_.error = e;
      c_.result = std::move(r);
      c_.thread = std::this_thread::get_id();
      cv_.notify_all();
    };
  }
  /// Waits (up to `limit`) for the answer.
  const Completed<R>& wait(std::chrono::milliseconds limit = 20s) {
    std::unique_lock<std::mutex> lock(m_);
    cv_.wait_for(lock, limit, [&] { return c_.done; });
    return c_;
  }
  bool done() {
    std::lock_guard<std::mutex> lock(m_);
    return c_.done;
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  Completed<R> c_;
};

template <class E>
bool holds(const std::exception_ptr& e) {
  if (!e) return false;
  try {
    std::rethrow_exception(e);
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
}

inline std::string what_of(const std::exception_ptr& e) {
  if (!e) return "<no error>";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "<not a std::exception>";
  }
}

/// A one-shot gate a handler waits on.
class Gate {
 public:
  void open() {
    std::lock_guard<std::mutex> lock(m_);
    open_ = true;
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    cv_.wait_for(lock, 20s, [&] { return open_; });
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool open_ = false;
};

/// The loop: one thread running an io_context for the whole test.
class Loop {
 public:
  Loop() : guard_(anet::make_work_guard(io_)), thread_([this] { io_.run(); }) {}
  ~Loop() {
    guard_.reset();
    io_.stop();
    thread_.join();
  }
  anet::io_context& io() noexcept { return io_; }
  std::thread::id id() const noexcept { return thread_.get_id(); }
  /// Runs `fn` on the loop and waits for it.
  template <class Fn>
  void run(Fn fn) {
    std::promise<void> p;
    anet::post(io_, [&] {
      fn();
      p.set_value();
    });
    p.get_future().wait();
  }

 private:
  anet::io_context io_;
  anet::executor_work_guard<anet::io_context::executor_type> guard_;
  std::thread thread_;
};

/// A timer on the loop firing every 1 ms; records how late each expiry ran. Start and stop it
/// on the loop.
class LoopTicker {
 public:
  explicit LoopTicker(anet::io_context& io) : timer_(io) {}
  void start() {
    running_ = true;
    arm();
  }
  void stop() {
    running_ = false;
    timer_.cancel();
  }
  /// The worst lateness seen (read after stop(), on the loop or once it is idle).
  std::chrono::microseconds worst() const noexcept { return worst_; }
  int ticks() const noexcept { return ticks_; }

 private:
  void arm() {
    due_ = std::chrono::steady_clock::now() + 1ms;
    timer_.expires_at(due_);
    timer_.async_wait([this](const idem::async::error_code& ec) {
      if (ec || !running_) return;
      auto late = std::chrono::duration_cast<std::chrono::microseconds>(
          std::chrono::steady_clock::now() - due_);
      if (late > worst_) worst_ = late;
      ++ticks_;
      arm();
    });
  }
  anet::steady_timer timer_;
  std::chrono::steady_clock::time_point due_{};
  std::chrono::microseconds worst_{0};
  int ticks_ = 0;
  bool running_ = false;
};

template <class T>
struct IsReplyHandler : std::false_type {};
template <class R, class F>
struct IsReplyHandler<idem::async::ReplyHandler<R, F>> : std::true_type {};
template <class T>
struct IsLoopHandler : std::false_type {};
template <class F>
struct IsLoopHandler<idem::async::LoopHandler<F>> : std::true_type {};

template <class Env>
class AsyncGuardSuite : public ::testing::Test {
 protected:
  using Durable = typename Env::Durable;
  using Tx = typename Durable::Transaction;
  using Guard = idem::async::AsyncGuard<Durable>;

  void SetUp() override {
    std::string value;
    if (Env::env_var() != nullptr) IDEM_REQUIRE_ENV(value, Env::env_var());
    if constexpr (std::is_constructible_v<Env, const std::string&, anet::io_context&>) {
      env_ = std::make_unique<Env>(value, loop_.io());  // its stores run on the loop
    } else {
      env_ = std::make_unique<Env>(value);
    }
  }
  void TearDown() override { env_.reset(); }

  Key key(const std::string& tag = "k") {
    return Key::make("async", unique_name(tag + "_" + ::testing::UnitTest::GetInstance()
                                                          ->current_test_info()
                                                          ->name()));
  }

  std::unique_ptr<Guard> guard(idem::async::AsyncGuardOptions o = {}) {
    if (o.pool == nullptr) o.pool = &env_->pool();
    if (env_->fast() != nullptr) {
      return std::make_unique<Guard>(loop_.io().get_executor(), *env_->fast(), env_->durable(),
                                     std::move(o));
    }
    return std::make_unique<Guard>(loop_.io().get_executor(), env_->durable(), std::move(o));
  }

  // Starts a call from the loop thread (as a server would). Each kind of handler reaches the
  // guard as one std::function type (`R(Tx&)`, `R()`, with_reply's `void(Reply<R>)`, on_loop's
  // `R()`), so the guard's call machinery is compiled once per kind and Env instead of once per
  // lambda of the suite (it made these the slowest files of the build to compile); the guard
  // runs a std::function exactly as the lambda inside it. Move-only handlers keep their type.
  template <class Fn, class R = std::string>
  void start(Guard& g, const Key& k, std::string fp, Fn fn, Answer<R>& a,
             idem::async::CallOptions co = {}) {
    post_call(g, k, std::move(fp), erase<R>(std::move(fn)), a, co);
  }

  template <class R, class Fn>
  static auto erase(Fn fn) {
    if constexpr (!std::is_copy_constructible_v<Fn>) {
      return fn;
    } else if constexpr (IsReplyHandler<Fn>::value) {
      return idem::async::with_reply<R>(
          std::function<void(idem::async::Reply<R>)>(std::move(fn.fn)));
    } else if constexpr (IsLoopHandler<Fn>::value) {
      return idem::async::on_loop(std::function<R()>(std::move(fn.fn)));
    } else if constexpr (std::is_invocable_r_v<R, Fn&, Tx&>) {
      return std::function<R(Tx&)>(std::move(fn));
    } else if constexpr (std::is_invocable_r_v<R, Fn&>) {
      return std::function<R()>(std::move(fn));
    } else {
      return fn;
    }
  }

  template <class Fn, class R>
  void post_call(Guard& g, const Key& k, std::string fp, Fn fn, Answer<R>& a,
                 idem::async::CallOptions co) {
    anet::post(loop_.io(), [&g, k, fp = std::move(fp), fn = std::move(fn), &a, co]() mutable {
      g.async_run(k, fp, co, std::move(fn), a.callback());
    });
  }

  // A transactional call that inserts the effect and answers "pay_<id>".
  auto effect_handler(const Key& k, std::atomic<int>& runs,
                      std::chrono::milliseconds sleep = 0ms) {
    return [this, id = k.id(), &runs, sleep](Tx& tx) {
      ++runs;
      env_->insert_effect(tx, id);
      if (sleep.count() > 0) std::this_thread::sleep_for(sleep);
      return "pay_" + id;
    };
  }

  Loop loop_;
  std::unique_ptr<Env> env_;
};

TYPED_TEST_SUITE_P(AsyncGuardSuite);

TYPED_TEST_P(AsyncGuardSuite, TransactionalRunsOnAWorkerCommitsOnceAndReplays) {
  auto g = this->guard();
  auto k = this->key();
  std::atomic<int> runs{0};
  std::thread::id handler_thread;
  Answer<> first;
  this->start(*g, k, "fp",
              [&, inner = this->effect_handler(k, runs)](typename TestFixture::Tx& tx) mutable {
                handler_thread = std::this_thread::get_id();
                return inner(tx);
              },
              first);
  const auto& a = first.wait();
  ASSERT_TRUE(a.done);
  ASSERT_FALSE(a.error) << what_of(a.error);
  EXPECT_EQ(Outcome::kExecuted, a.result.outcome);
  EXPECT_EQ("pay_" + k.id(), a.result.value.value_or("<none>"));
  EXPECT_NE(this->loop_.id(), handler_thread) << "a transactional handler never runs on the loop";
  EXPECT_EQ(this->loop_.id(), a.thread) << "the completion runs on the loop";
  for (int i = 0; i < 3; ++i) {
    Answer<> again;
    this->start(*g, k, "fp", this->effect_handler(k, runs), again);
    const auto& b = again.wait();
    ASSERT_FALSE(b.error) << what_of(b.error);
    EXPECT_EQ(Outcome::kReplayed, b.result.outcome);
    EXPECT_EQ("pay_" + k.id(), b.result.value.value_or("<none>"));
    EXPECT_EQ(this->env_->fast() != nullptr ? Source::kFastStore : Source::kDurableStore,
              b.result.source);
  }
  EXPECT_EQ(1, runs.load());
  EXPECT_EQ(1, this->env_->count_effects(k.id()));
  auto s = g->stats().snapshot();
  EXPECT_EQ(4u, s.calls);
  EXPECT_EQ(1u, s.executed);
  EXPECT_EQ(3u, s.replayed);
}

// Many calls of one key in flight on one loop thread, a slow handler: one effect, every caller
// answered with the response or in_progress, then every caller replays.
TYPED_TEST_P(AsyncGuardSuite, StormOnOneKeyFromOneLoopRunsOnce) {
  for (bool transactional : {true, false}) {
    auto g = this->guard();
    auto k = this->key(transactional ? "tx" : "two_phase");
    std::atomic<int> runs{0};
    constexpr int kCalls = 48;
    std::vector<Answer<>> answers(kCalls);
    for (int i = 0; i < kCalls; ++i) {
      if (transactional) {
        this->start(*g, k, "fp", this->effect_handler(k, runs, 40ms), answers[i]);
      } else {
        this->start(*g, k, "fp",
                    [&runs, id = k.id()] {
                      ++runs;
                      std::this_thread::sleep_for(40ms);
                      return "pay_" + id;
                    },
                    answers[i]);
      }
    }
    int executed = 0, replayed = 0, in_progress = 0, wrong = 0;
    for (auto& a : answers) {
      const auto& c = a.wait();
      if (c.error) {
        ADD_FAILURE() << what_of(c.error);
        ++wrong;
        continue;
      }
      if (c.result.outcome == Outcome::kExecuted) ++executed;
      if (c.result.outcome == Outcome::kReplayed) ++replayed;
      if (c.result.outcome == Outcome::kInProgress) ++in_progress;
      if (c.result.outcome == Outcome::kFingerprintMismatch) ++wrong;
      if (c.result.ok() && *c.result.value != "pay_" + k.id()) ++wrong;
    }
    EXPECT_EQ(1, runs.load());
    EXPECT_EQ(1, executed);
    EXPECT_EQ(kCalls - 1, replayed + in_progress);
    EXPECT_EQ(0, wrong);
    if (transactional) {
      EXPECT_EQ(1, this->env_->count_effects(k.id()));
    }
    Answer<> after;
    this->start(*g, k, "fp", [] { return std::string("x"); }, after);
    EXPECT_EQ(Outcome::kReplayed, after.wait().result.outcome);
    EXPECT_EQ(1, runs.load());
  }
}

TYPED_TEST_P(AsyncGuardSuite, MismatchWinsOverReplayAndInProgress) {
  auto g = this->guard();
  auto k = this->key();
  idem::test::Gate gate;
  Answer<> holder;
  this->start(*g, k, "fp1",
              [&] {
                gate.wait();
                return std::string("r1");
              },
              holder);
  // While the first call holds the key: same payload -> in progress, another -> mismatch.
  std::this_thread::sleep_for(100ms);
  Answer<> busy, mismatch_busy;
  this->start(*g, k, "fp1", [] { return std::string("never"); }, busy);
  this->start(*g, k, "fp2", [] { return std::string("never"); }, mismatch_busy);
  EXPECT_EQ(Outcome::kInProgress, busy.wait().result.outcome) << what_of(busy.wait().error);
  EXPECT_EQ(Outcome::kFingerprintMismatch, mismatch_busy.wait().result.outcome);
  gate.open();
  EXPECT_EQ(Outcome::kExecuted, holder.wait().result.outcome) << what_of(holder.wait().error);
  Answer<> mismatch_done;
  this->start(*g, k, "fp2", [] { return std::string("never"); }, mismatch_done);
  EXPECT_EQ(Outcome::kFingerprintMismatch, mismatch_done.wait().result.outcome);
}

TYPED_TEST_P(AsyncGuardSuite, HandlerFailuresRollBackReleaseAndPropagateUnchanged) {
  auto g = this->guard();
  // Transactional: nothing committed, the retry runs at once.
  auto k = this->key("tx");
  Answer<> failed;
  this->start(*g, k, "fp",
              [this, id = k.id()](typename TestFixture::Tx& tx) -> std::string {
                this->env_->insert_effect(tx, id);
                throw std::runtime_error("card declined by the handler");
              },
              failed);
  const auto& f = failed.wait();
  EXPECT_TRUE(holds<std::runtime_error>(f.error));
  EXPECT_EQ("card declined by the handler", what_of(f.error));
  EXPECT_EQ(0, this->env_->count_effects(k.id()));
  std::atomic<int> runs{0};
  Answer<> retry;
  this->start(*g, k, "fp", this->effect_handler(k, runs), retry);
  EXPECT_EQ(Outcome::kExecuted, retry.wait().result.outcome) << what_of(retry.wait().error);
  EXPECT_EQ(1, this->env_->count_effects(k.id()));
  // Two-phase, each handler form: the durable claim is released too.
  auto k2 = this->key("two_phase");
  Answer<> f1, f2, f3;
  this->start(*g, k2, "", []() -> std::string { throw std::logic_error("pooled"); }, f1);
  EXPECT_TRUE(holds<std::logic_error>(f1.wait().error)) << what_of(f1.wait().error);
  this->start(*g, k2, "",
              idem::async::on_loop([]() -> std::string { throw std::logic_error("loop"); }), f2);
  EXPECT_EQ("loop", what_of(f2.wait().error));
  this->start(*g, k2, "", idem::async::with_reply<std::string>([](auto reply) {
                reply.fail(std::make_exception_ptr(std::logic_error("reply")));
              }),
              f3);
  EXPECT_EQ("reply", what_of(f3.wait().error));
  Answer<> dropped;
  this->start(*g, k2, "", idem::async::with_reply<std::string>([](auto) {}), dropped);
  EXPECT_TRUE(holds<StorageError>(dropped.wait().error)) << what_of(dropped.wait().error);
  Answer<> ok;
  this->start(*g, k2, "", [] { return std::string("y"); }, ok);
  EXPECT_EQ(Outcome::kExecuted, ok.wait().result.outcome) << what_of(ok.wait().error);
  EXPECT_EQ(5u, g->stats().snapshot().handler_errors) << "tx, pooled, loop, reply, dropped";
}

TYPED_TEST_P(AsyncGuardSuite, ResponsesAreByteIdentical) {
  auto g = this->guard();
  std::string binary;
  for (int i = 0; i < 256; ++i) binary.push_back(static_cast<char>(i));
  std::string big(1 << 20, '\0');
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 131) ^ (i >> 7));
  for (const std::string& response : {std::string(), binary, big}) {
    auto k = this->key("bytes");
    Answer<> first, again;
    this->start(*g, k, "fp", [response](typename TestFixture::Tx&) { return response; }, first);
    ASSERT_FALSE(first.wait().error) << what_of(first.wait().error);
    this->start(*g, k, "fp", [](typename TestFixture::Tx&) { return std::string("no"); }, again);
    const auto& c = again.wait();
    ASSERT_EQ(Outcome::kReplayed, c.result.outcome) << what_of(c.error);
    EXPECT_EQ(response.size(), c.result.value->size());
    EXPECT_TRUE(response == *c.result.value);
  }
}

TYPED_TEST_P(AsyncGuardSuite, AFastStoreThatLostTheRecordIsRefilledFromTheDurableStore) {
  if (this->env_->fast() == nullptr) GTEST_SKIP() << "durable only: nothing to refill";
  auto g = this->guard();
  auto k = this->key();
  std::atomic<int> runs{0};
  Answer<> first;
  this->start(*g, k, "fp", this->effect_handler(k, runs), first);
  ASSERT_EQ(Outcome::kExecuted, first.wait().result.outcome) << what_of(first.wait().error);
  this->env_->forget_fast(k);  // a flush, an eviction, a failover
  Answer<> second, third;
  this->start(*g, k, "fp", this->effect_handler(k, runs), second);
  const auto& b = second.wait();
  ASSERT_FALSE(b.error) << what_of(b.error);
  EXPECT_EQ(Outcome::kReplayed, b.result.outcome);
  EXPECT_EQ(Source::kDurableStore, b.result.source);
  EXPECT_NE(0, idem::to_millis(b.result.first_seen)) << "the record's creation";
  this->start(*g, k, "fp", this->effect_handler(k, runs), third);
  EXPECT_EQ(Source::kFastStore, third.wait().result.source);
  EXPECT_EQ(idem::to_millis(b.result.first_seen), idem::to_millis(third.wait().result.first_seen))
      << "the write-back keeps when the first attempt began";
  EXPECT_EQ(1, runs.load());
  EXPECT_EQ(1, this->env_->count_effects(k.id()));
  auto s = g->stats().snapshot();
  EXPECT_EQ(1u, s.durable_conflicts);  // the replay came from the durable store, once
}

// A two-phase handler that answers later, from the loop (an external call on the same
// io_context), and one that runs on the loop at once.
TYPED_TEST_P(AsyncGuardSuite, AsynchronousAndOnLoopHandlersHoldNoThread) {
  idem::async::WorkerPool tiny{{1, 1}};  // too small to run 16 waiting handlers
  idem::async::AsyncGuardOptions o;
  o.pool = &tiny;
  auto g = this->guard(o);
  constexpr int kCalls = 16;
  std::vector<Key> keys;
  std::vector<Answer<>> answers(kCalls);
  std::vector<std::unique_ptr<anet::steady_timer>> timers;
  for (int i = 0; i < kCalls; ++i) {
    keys.push_back(this->key("reply" + std::to_string(i)));
    timers.push_back(std::make_unique<anet::steady_timer>(this->loop_.io()));
  }
  for (int i = 0; i < kCalls; ++i) {
    anet::steady_timer* t = timers[static_cast<std::size_t>(i)].get();
    this->start(*g, keys[i], "fp", idem::async::with_reply<std::string>([t, i](auto reply) {
                  t->expires_after(100ms);  // "the gateway answers in 100 ms"
                  t->async_wait([reply = std::move(reply), i](const auto&) mutable {
                    reply("charge_" + std::to_string(i));
                  });
                }),
                answers[i]);
  }
  for (int i = 0; i < kCalls; ++i) {
    const auto& c = answers[i].wait();
    ASSERT_FALSE(c.error) << what_of(c.error);
    EXPECT_EQ(Outcome::kExecuted, c.result.outcome);
    EXPECT_EQ("charge_" + std::to_string(i), c.result.value.value_or(""));
  }
  EXPECT_EQ(0u, tiny.stats().submitted) << "no handler took a worker";
  Answer<> loop_call;
  std::thread::id ran_on;
  this->start(*g, this->key("loop"), "fp", idem::async::on_loop([&] {
                ran_on = std::this_thread::get_id();
                return std::string("on the loop");
              }),
              loop_call);
  EXPECT_EQ("on the loop", loop_call.wait().result.value.value_or("")) << what_of(loop_call.wait().error);
  EXPECT_EQ(this->loop_.id(), ran_on);
}

TYPED_TEST_P(AsyncGuardSuite, ATwoPhaseAttemptThatLostItsLeaseIsRefused) {
  idem::async::AsyncGuardOptions o;
  o.guard.lease = 300ms;
  auto g = this->guard(o);
  auto k = this->key();
  std::shared_ptr<idem::async::Reply<std::string>> slow_reply;
  Answer<> slow, winner;
  this->start(*g, k, "fp", idem::async::with_reply<std::string>([&](auto reply) {
                slow_reply = std::make_shared<idem::async::Reply<std::string>>(std::move(reply));
              }),
              slow);
  std::this_thread::sleep_for(700ms);  // the lease ends
  this->start(*g, k, "fp", [] { return std::string("winner"); }, winner);
  ASSERT_EQ(Outcome::kExecuted, winner.wait().result.outcome) << what_of(winner.wait().error);
  this->loop_.run([&] { (*slow_reply)("late"); });
  const auto& s = slow.wait();
  EXPECT_TRUE(holds<LeaseLost>(s.error)) << what_of(s.error);
  Answer<> replay;
  this->start(*g, k, "fp", [] { return std::string("never"); }, replay);
  EXPECT_EQ("winner", replay.wait().result.value.value_or("")) << what_of(replay.wait().error);
  EXPECT_GE(g->stats().snapshot().leases_lost, 1u);
  this->loop_.run([&] { slow_reply.reset(); });
}

// Cancelled while the transaction runs: answered at once, nothing committed, the key free.
TYPED_TEST_P(AsyncGuardSuite, CancelledDuringTheTransactionCommitsNothingAndFreesTheKey) {
  // The caller's cancellation is not a store failure: no on_store_error for it.
  struct StoreErrors final : idem::Observer {
    std::atomic<int> count{0};
    void on_store_error(const idem::StoreErrorEvent&) noexcept override { ++count; }
  };
  auto store_errors = std::make_shared<StoreErrors>();
  idem::async::AsyncGuardOptions o;
  o.guard.observer = store_errors;
  auto g = this->guard(o);
  auto k = this->key();
  auto cancel = std::make_shared<idem::async::CancelSignal>();
  idem::test::Gate in_handler, release;
  Answer<> call;
  idem::async::CallOptions co;
  co.cancel = cancel;
  this->start(*g, k, "fp",
              [&, id = k.id()](typename TestFixture::Tx& tx) {
                this->env_->insert_effect(tx, id);
                in_handler.open();
                release.wait();
                return std::string("should not commit");
              },
              call, co);
  in_handler.wait();
  const auto t0 = std::chrono::steady_clock::now();
  cancel->emit();
  const auto& c = call.wait();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s) << "answered without waiting for it";
  EXPECT_TRUE(holds<Cancelled>(c.error)) << what_of(c.error);
  EXPECT_FALSE(c.result.value.has_value());
  release.open();
  // The key is free again once the rollback and release are done.
  std::atomic<int> runs{0};
  GuardResult<std::string> retry;
  for (int attempt = 0; attempt < 50; ++attempt) {
    Answer<> r;
    this->start(*g, k, "fp", this->effect_handler(k, runs), r);
    retry = r.wait().result;
    ASSERT_FALSE(r.wait().error) << what_of(r.wait().error);
    if (retry.outcome != Outcome::kInProgress) break;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(Outcome::kExecuted, retry.outcome);
  EXPECT_EQ(1, this->env_->count_effects(k.id()));
  EXPECT_EQ(1u, g->async_stats().cancelled.load());
  EXPECT_EQ(0, store_errors->count.load());
}

// A signal emitted before the call starts: answered Cancelled before any store I/O (no claim
// made, none to release), so a retry right after runs instead of meeting "in progress".
TYPED_TEST_P(AsyncGuardSuite, AnAlreadyEmittedSignalCancelsBeforeAnyClaim) {
  auto g = this->guard();
  auto k = this->key();
  auto cancel = std::make_shared<idem::async::CancelSignal>();
  cancel->emit();
  idem::async::CallOptions co;
  co.cancel = cancel;
  std::atomic<int> runs{0};
  Answer<> cancelled;
  this->start(*g, k, "fp", this->effect_handler(k, runs), cancelled, co);
  EXPECT_TRUE(holds<Cancelled>(cancelled.wait().error)) << what_of(cancelled.wait().error);
  EXPECT_EQ(0, runs.load());
  Answer<> retry;
  this->start(*g, k, "fp", this->effect_handler(k, runs), retry);
  ASSERT_FALSE(retry.wait().error) << what_of(retry.wait().error);
  EXPECT_EQ(Outcome::kExecuted, retry.wait().result.outcome);
  EXPECT_EQ(1, runs.load());
  EXPECT_EQ(1, this->env_->count_effects(k.id()));
  EXPECT_EQ(0u, g->async_stats().released_after_cancel.load());
  // The same for a deadline already past when the call starts: DeadlineExceeded, no claim.
  auto late = this->key();
  idem::async::CallOptions past;
  past.deadline = std::chrono::steady_clock::now() - 1ms;
  Answer<> expired;
  this->start(*g, late, "fp", this->effect_handler(late, runs), expired, past);
  EXPECT_TRUE(holds<idem::DeadlineExceeded>(expired.wait().error)) << what_of(expired.wait().error);
  Answer<> on_time;
  this->start(*g, late, "fp", this->effect_handler(late, runs), on_time);
  ASSERT_FALSE(on_time.wait().error) << what_of(on_time.wait().error);
  EXPECT_EQ(Outcome::kExecuted, on_time.wait().result.outcome);
  EXPECT_EQ(2, runs.load());
  EXPECT_EQ(0u, g->async_stats().released_after_cancel.load());
}

// Cancelled from inside the transaction (the signal emitted by the handler itself, on its
// worker thread): the body's check before COMMIT reads the signal itself, so nothing commits
// even when the loop has not yet run the cancellation it posted. The key is free again.
TYPED_TEST_P(AsyncGuardSuite, ASignalEmittedDuringTheTransactionCommitsNothing) {
  auto g = this->guard();
  auto k = this->key();
  auto cancel = std::make_shared<idem::async::CancelSignal>();
  idem::async::CallOptions co;
  co.cancel = cancel;
  std::atomic<int> runs{0};
  Answer<> call;
  this->start(
      *g, k, "fp",
      [&, id = k.id()](typename TestFixture::Tx& tx) {
        ++runs;
        this->env_->insert_effect(tx, id);
        cancel->emit();
        return std::string("should not commit");
      },
      call, co);
  EXPECT_TRUE(holds<Cancelled>(call.wait().error)) << what_of(call.wait().error);
  EXPECT_EQ(0, this->env_->count_effects(k.id()));
  GuardResult<std::string> retry;
  for (int attempt = 0; attempt < 50; ++attempt) {
    Answer<> r;
    this->start(*g, k, "fp", this->effect_handler(k, runs), r);
    ASSERT_FALSE(r.wait().error) << what_of(r.wait().error);
    retry = r.wait().result;
    if (retry.outcome != Outcome::kInProgress) break;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(Outcome::kExecuted, retry.outcome);
  EXPECT_EQ(1, this->env_->count_effects(k.id()));
}

// One signal given to several calls (all the calls of a client connection) cancels every one
// still running when it is emitted; a call that ended before leaves the others' listeners in
// place.
TYPED_TEST_P(AsyncGuardSuite, OneSignalCancelsEveryCallItWasGivenTo) {
  auto g = this->guard();
  auto cancel = std::make_shared<idem::async::CancelSignal>();
  idem::async::CallOptions co;
  co.cancel = cancel;
  std::vector<std::shared_ptr<idem::async::Reply<std::string>>> pending(3);
  std::vector<Answer<>> calls(3);
  std::vector<idem::Key> keys;
  keys.reserve(3);  // the calls keep references to their keys
  for (std::size_t i = 0; i < 3; ++i) {
    keys.push_back(this->key());
    this->start(*g, keys[i], "fp", idem::async::with_reply<std::string>([&, i](auto reply) {
      pending[i] = std::make_shared<idem::async::Reply<std::string>>(std::move(reply));
    }),
                calls[i], co);
  }
  for (int i = 0; i < 500; ++i) {
    bool all = false;
    this->loop_.run([&] { all = pending[0] && pending[1] && pending[2]; });
    if (all) break;
    std::this_thread::sleep_for(10ms);
  }
  this->loop_.run([&] { (*pending[0])("first"); });
  EXPECT_EQ("first", calls[0].wait().result.value.value_or("")) << what_of(calls[0].wait().error);
  cancel->emit();
  for (std::size_t i = 1; i < 3; ++i) {
    EXPECT_TRUE(holds<Cancelled>(calls[i].wait().error))
        << i << " " << what_of(calls[i].wait().error);
  }
  EXPECT_EQ(2u, g->async_stats().cancelled.load());
  this->loop_.run([&] {
    (*pending[1])("late 1");
    (*pending[2])("late 2");
    pending.clear();
  });
  // The late answers are recorded (and the guard outlives the calls that record them).
  for (std::size_t i = 1; i < 3; ++i) {
    GuardResult<std::string> replay;
    for (int attempt = 0; attempt < 100; ++attempt) {
      Answer<> r;
      this->start(
          *g, keys[i], "fp", [] { return std::string("never"); }, r);
      replay = r.wait().result;
      if (replay.outcome == Outcome::kReplayed) break;
      std::this_thread::sleep_for(20ms);
    }
    EXPECT_EQ("late " + std::to_string(i), replay.value.value_or("")) << i;
  }
}

// Past its deadline while the two-phase handler has not answered: answered at once; the record
// stays in progress (the handler's outcome is unknown); its late answer is recorded.
TYPED_TEST_P(AsyncGuardSuite, DeadlineDuringTheHandlerLeavesTheKeyToTheHandlersAnswer) {
  auto g = this->guard();
  auto k = this->key();
  std::shared_ptr<idem::async::Reply<std::string>> pending;
  Answer<> call;
  idem::async::CallOptions co;
  // Long enough for the claims to be granted on a loaded machine: the deadline must pass while
  // the handler holds its Reply.
  co.deadline = std::chrono::steady_clock::now() + 1000ms;
  this->start(*g, k, "fp", idem::async::with_reply<std::string>([&](auto reply) {
                pending = std::make_shared<idem::async::Reply<std::string>>(std::move(reply));
              }),
              call, co);
  const auto& c = call.wait();
  EXPECT_TRUE(holds<DeadlineExceeded>(c.error)) << what_of(c.error);
  bool cancelled = false, started = false;
  this->loop_.run([&] {
    started = pending != nullptr;
    cancelled = started && pending->cancelled();
  });
  ASSERT_TRUE(started) << "the deadline passed before the handler ran";
  EXPECT_TRUE(cancelled);
  Answer<> busy;
  this->start(*g, k, "fp", [] { return std::string("never"); }, busy);
  EXPECT_EQ(Outcome::kInProgress, busy.wait().result.outcome) << what_of(busy.wait().error);
  this->loop_.run([&] { (*pending)("charged after all"); });
  GuardResult<std::string> replay;
  for (int attempt = 0; attempt < 50; ++attempt) {
    Answer<> r;
    this->start(*g, k, "fp", [] { return std::string("never"); }, r);
    replay = r.wait().result;
    if (replay.outcome == Outcome::kReplayed) break;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ("charged after all", replay.value.value_or("")) << "the late answer is recorded";
  EXPECT_EQ(1u, g->async_stats().deadline_exceeded.load());
  // Counted on the loop once the completion is posted back, which may come after the record is
  // readable (a durable-only guard replays from the store at once).
  for (int i = 0; i < 200 && g->async_stats().recorded_after_cancel.load() == 0; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(1u, g->async_stats().recorded_after_cancel.load());
}

// A cancellation that arrives once the durable store has committed does not hide the result.
TYPED_TEST_P(AsyncGuardSuite, CancellationAfterTheCommitDeliversTheResult) {
  auto cancel = std::make_shared<idem::async::CancelSignal>();
  idem::async::AsyncGuardOptions o;
  o.guard.step_hook = [cancel](Step s, const Key&) {
    if (s == Step::kDurableCommitted) cancel->emit();
  };
  auto g = this->guard(o);
  auto k = this->key();
  std::atomic<int> runs{0};
  Answer<> call;
  idem::async::CallOptions co;
  co.cancel = cancel;
  this->start(*g, k, "fp", this->effect_handler(k, runs), call, co);
  const auto& c = call.wait();
  ASSERT_FALSE(c.error) << what_of(c.error);
  EXPECT_EQ(Outcome::kExecuted, c.result.outcome);
  EXPECT_EQ(0u, g->async_stats().cancelled.load());
}

// Cancelled at each step of the protocol (emitted from the step hook, so the cancellation is
// handled at the call's next suspension): the caller never gets a success for uncommitted
// work, at most one effect happens, and the key ends free or recorded, never stuck.
TYPED_TEST_P(AsyncGuardSuite, CancelledAtEachStepNeverLiesAndNeverSticks) {
  for (Step at : {Step::kFastClaimed, Step::kDurableClaimed, Step::kHandlerReturned}) {
    for (bool transactional : {true, false}) {
      if (at == Step::kFastClaimed && this->env_->fast() == nullptr) continue;
      auto cancel = std::make_shared<idem::async::CancelSignal>();
      idem::async::AsyncGuardOptions o;
      o.guard.lease = 2s;
      o.guard.step_hook = [cancel, at](Step s, const Key&) {
        if (s == at) cancel->emit();
      };
      auto g = this->guard(o);
      auto k = this->key(std::string(step_name(at)) + (transactional ? "_tx" : "_2p"));
      std::atomic<int> runs{0};
      Answer<> call;
      idem::async::CallOptions co;
      co.cancel = cancel;
      if (transactional) {
        this->start(*g, k, "fp", this->effect_handler(k, runs, 50ms), call, co);
      } else {
        this->start(*g, k, "fp",
                    [&runs, id = k.id()] {
                      ++runs;
                      std::this_thread::sleep_for(50ms);
                      return "pay_" + id;
                    },
                    call, co);
      }
      const auto& c = call.wait();
      SCOPED_TRACE(std::string(step_name(at)) + (transactional ? " transactional" : " two-phase"));
      if (c.error) {
        EXPECT_TRUE(holds<Cancelled>(c.error)) << what_of(c.error);
      } else {
        // The call got past its last cancellable point before the cancellation was handled.
        EXPECT_EQ(Outcome::kExecuted, c.result.outcome);
      }
      // Afterwards: within the lease the key replays the recorded answer or runs afresh.
      GuardResult<std::string> after;
      std::exception_ptr after_error;
      for (int attempt = 0; attempt < 150; ++attempt) {
        Answer<> r;
        this->start(*g, k, "fp", this->effect_handler(k, runs), r);
        after = r.wait().result;
        after_error = r.wait().error;
        if (after_error || after.outcome != Outcome::kInProgress) break;
        std::this_thread::sleep_for(20ms);
      }
      ASSERT_FALSE(after_error) << what_of(after_error);
      EXPECT_TRUE(after.outcome == Outcome::kReplayed || after.outcome == Outcome::kExecuted)
          << outcome_name(after.outcome);
      EXPECT_EQ("pay_" + k.id(), after.value.value_or(""));
      if (transactional) {
        EXPECT_EQ(1, this->env_->count_effects(k.id()));  // one committed effect, whoever
      }
      if (!c.error) {
        EXPECT_EQ(1, runs.load());
      }
      EXPECT_LE(runs.load(), 2);
    }
  }
}

TYPED_TEST_P(AsyncGuardSuite, FuturesAndThreadsOffTheLoop) {
  auto g = this->guard();
  auto k = this->key();
  std::atomic<int> runs{0};
  // Called from a thread that is not the loop; the future is fulfilled from the loop.
  std::future<GuardResult<std::string>> f =
      g->async_run(k, "fp", this->effect_handler(k, runs), anet::use_future);
  GuardResult<std::string> r = f.get();
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  auto again = g->async_run(k, "fp", this->effect_handler(k, runs), anet::use_future).get();
  EXPECT_EQ(Outcome::kReplayed, again.outcome);
  auto bad = g->async_run(k, "fp", [](typename TestFixture::Tx&) -> std::string {
    throw std::out_of_range("from the handler");
  }, anet::use_future);
  // A replay never runs the handler: the future holds the replay, not the exception.
  EXPECT_EQ(Outcome::kReplayed, bad.get().outcome);
  auto k2 = this->key("throws");
  auto bad2 = g->async_run(k2, "fp", [](typename TestFixture::Tx&) -> std::string {
    throw std::out_of_range("from the handler");
  }, anet::use_future);
  EXPECT_THROW((void)bad2.get(), std::out_of_range);
}

// One loop thread, 1,000 requests in flight at once over 700 keys (30 % duplicates) with slow
// transactional handlers: every request is answered; a request the bounded pool refuses gets a
// typed, retryable idem::StorageUnavailable and its retry runs or replays; in the end each key
// has exactly one effect and every later call replays it.
TYPED_TEST_P(AsyncGuardSuite, AThousandRequestsOnOneLoopLeaveOneEffectPerKey) {
  auto g = this->guard();
  constexpr int kKeys = 700, kCalls = 1000;
  std::vector<Key> keys;
  for (int i = 0; i < kKeys; ++i) keys.push_back(this->key("m" + std::to_string(i)));
  auto key_of = [&](int call) { return call < kKeys ? call : (call * 7) % kKeys; };
  std::atomic<int> runs{0};
  std::vector<int> pending(kCalls);
  for (int i = 0; i < kCalls; ++i) pending[i] = i;
  int executed = 0, duplicates = 0, refused = 0, rounds = 0;
  while (!pending.empty() && rounds++ < 20) {
    std::vector<Answer<>> answers(pending.size());
    for (std::size_t j = 0; j < pending.size(); ++j) {
      const Key& k = keys[static_cast<std::size_t>(key_of(pending[j]))];
      this->start(*g, k, "fp", this->effect_handler(k, runs, 2ms), answers[j]);
    }
    std::vector<int> again;
    for (std::size_t j = 0; j < pending.size(); ++j) {
      const auto& c = answers[j].wait(60s);
      ASSERT_TRUE(c.done) << "call " << pending[j] << " was never answered";
      const Key& k = keys[static_cast<std::size_t>(key_of(pending[j]))];
      if (c.error) {
        // Only the pool's bounded queue may refuse, typed and retryable.
        EXPECT_TRUE(holds<StorageUnavailable>(c.error)) << what_of(c.error);
        ++refused;
        again.push_back(pending[j]);
        continue;
      }
      if (c.result.outcome == Outcome::kExecuted) {
        ++executed;
      } else if (c.result.outcome == Outcome::kInProgress) {
        again.push_back(pending[j]);  // its twin is still running: ask again
        ++duplicates;
        continue;
      } else {
        EXPECT_EQ(Outcome::kReplayed, c.result.outcome);
        ++duplicates;
      }
      EXPECT_EQ("pay_" + k.id(), *c.result.value);
    }
    pending = std::move(again);
  }
  EXPECT_TRUE(pending.empty()) << pending.size() << " calls never completed";
  EXPECT_EQ(kKeys, executed);
  EXPECT_EQ(kKeys, runs.load()) << "a handler ran twice for one key";
  EXPECT_GE(duplicates, kCalls - kKeys);
  for (const Key& k : keys) ASSERT_EQ(1, this->env_->count_effects(k.id())) << k.str();
  Answer<> after;
  this->start(*g, keys[3], "fp", [] { return std::string("x"); }, after);
  EXPECT_EQ(Outcome::kReplayed, after.wait().result.outcome);
  ::testing::Test::RecordProperty("refused_by_the_pool", refused);
}


// One loop thread, 1,000 requests in flight over 700 keys (30 % duplicates) arriving 50 per loop
// turn, durable work on the pool: transactional handlers (an effect, 2 ms) and two-phase
// handlers on the pool (2 ms, the durable begin and completion on the pool too), two of them
// very slow (600 ms). A 1 ms timer on the same loop keeps firing while they run: the loop never
// waits for durable work. Every request is answered (refusals of the bounded pool typed and
// retried), each key ends with exactly one run (transactional: one effect) and replays.
//
// The target is a timer never late by more than 5 ms (bench/async measures it: `--only
// durable`). The assertion allows 300 ms: on a loaded 2-CPU machine (or under a sanitizer) the
// kernel alone can keep a woken thread off the CPU for tens of milliseconds, while a loop that
// ran, or waited for, one slow handler would be late by 600 ms, and a loop that ran the durable
// work would be late by seconds.
TYPED_TEST_P(AsyncGuardSuite, TheLoopNeverStallsWhileDurableWorkRuns) {
  auto g = this->guard();
  constexpr int kKeys = 700, kCalls = 1000, kPerTurn = 50;
  constexpr auto kSlow = 600ms;
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  // Under a sanitizer (several times slower, scripts/test.sh --sanitize) the margin is for
  // scheduling, not for the 600 ms handler: that is the optimised builds' check; races and
  // memory errors are the sanitizers'. A TSan run beside a busy machine read 303 ms.
  constexpr auto kAllowed = 1500ms;
#else
  constexpr auto kAllowed = 300ms;
#endif
  std::vector<Key> keys;
  for (int i = 0; i < kKeys; ++i) keys.push_back(this->key("s" + std::to_string(i)));
  auto key_of = [&](int call) { return call < kKeys ? call : (call * 7) % kKeys; };
  auto transactional = [](int k) { return k % 2 == 0; };
  auto slow = [](int k) { return k == 100 || k == 401; };  // one of each kind
  std::vector<std::atomic<int>> runs(kKeys);
  std::vector<int> pending(kCalls);
  for (int i = 0; i < kCalls; ++i) pending[i] = i;
  LoopTicker ticker(this->loop_.io());
  this->loop_.run([&] { ticker.start(); });
  int executed = 0, refused = 0, rounds = 0;
  while (!pending.empty() && rounds++ < 30) {
    std::vector<Answer<>> answers(pending.size());
    // The calls arrive kPerTurn per loop turn, as from many connections' reads. An answer may
    // come inline, so the loop reads its own copy of the round's calls.
    auto calls = std::make_shared<const std::vector<int>>(pending);
    auto arrive = std::make_shared<std::function<void(std::size_t)>>();
    *arrive = [&, calls, weak = std::weak_ptr<std::function<void(std::size_t)>>(arrive)](
                  std::size_t from) {
      const std::size_t to = std::min(calls->size(), from + kPerTurn);
      for (std::size_t j = from; j < to; ++j) {
        const int ki = key_of((*calls)[j]);
        const Key& k = keys[static_cast<std::size_t>(ki)];
        const auto sleep = slow(ki) ? std::chrono::milliseconds(kSlow) : 2ms;
        if (transactional(ki)) {
          g->async_run(k, "fp",
                       [this, id = k.id(), &r = runs[static_cast<std::size_t>(ki)],
                        sleep](typename TestFixture::Tx& tx) {
                         ++r;
                         this->env_->insert_effect(tx, id);
                         std::this_thread::sleep_for(sleep);
                         return "pay_" + id;
                       },
                       answers[j].callback());
        } else {
          g->async_run(k, "fp",
                       [id = k.id(), &r = runs[static_cast<std::size_t>(ki)], sleep] {
                         ++r;
                         std::this_thread::sleep_for(sleep);
                         return "pay_" + id;
                       },
                       answers[j].callback());
        }
      }
      if (to < calls->size()) {
        if (auto next = weak.lock()) anet::post(this->loop_.io(), [next, to] { (*next)(to); });
      }
    };
    anet::post(this->loop_.io(), [arrive] { (*arrive)(0); });
    std::vector<int> again;
    for (std::size_t j = 0; j < pending.size(); ++j) {
      const auto& c = answers[j].wait(60s);
      ASSERT_TRUE(c.done) << "call " << pending[j] << " was never answered";
      const Key& k = keys[static_cast<std::size_t>(key_of(pending[j]))];
      if (c.error) {
        EXPECT_TRUE(holds<StorageUnavailable>(c.error)) << what_of(c.error);
        ++refused;
        again.push_back(pending[j]);
      } else if (c.result.outcome == Outcome::kInProgress) {
        again.push_back(pending[j]);
      } else {
        if (c.result.outcome == Outcome::kExecuted) ++executed;
        EXPECT_TRUE(c.result.outcome == Outcome::kExecuted ||
                    c.result.outcome == Outcome::kReplayed)
            << outcome_name(c.result.outcome);
        EXPECT_EQ("pay_" + k.id(), c.result.value.value_or(""));
      }
    }
    pending = std::move(again);
    if (!pending.empty()) std::this_thread::sleep_for(20ms);  // a client's retry delay
  }
  std::chrono::microseconds worst{0};
  int ticks = 0;
  this->loop_.run([&] {
    ticker.stop();
    worst = ticker.worst();
    ticks = ticker.ticks();
  });
  EXPECT_TRUE(pending.empty()) << pending.size() << " calls never completed";
  EXPECT_EQ(kKeys, executed);
  for (int i = 0; i < kKeys; ++i) {
    const Key& k = keys[static_cast<std::size_t>(i)];
    if (transactional(i)) {
      // A transaction's body may run again after a rollback: its effect counts.
      ASSERT_EQ(1, this->env_->count_effects(k.id())) << k.str();
    } else {
      ASSERT_EQ(1, runs[static_cast<std::size_t>(i)].load()) << k.str();
    }
  }
  Answer<> after;
  this->start(*g, keys[100], "fp", [] { return std::string("x"); }, after);
  EXPECT_EQ(Outcome::kReplayed, after.wait().result.outcome) << what_of(after.wait().error);
  EXPECT_GT(ticks, 100) << "the timer hardly ran";
  EXPECT_LT(worst, kAllowed) << "the loop stalled for " << worst.count() << " us";
  ::testing::Test::RecordProperty("worst_lateness_us", static_cast<int>(worst.count()));
  ::testing::Test::RecordProperty("refused_by_the_pool", refused);
}

REGISTER_TYPED_TEST_SUITE_P(
    AsyncGuardSuite, TransactionalRunsOnAWorkerCommitsOnceAndReplays,
    StormOnOneKeyFromOneLoopRunsOnce, MismatchWinsOverReplayAndInProgress,
    HandlerFailuresRollBackReleaseAndPropagateUnchanged, ResponsesAreByteIdentical,
    AFastStoreThatLostTheRecordIsRefilledFromTheDurableStore,
    AsynchronousAndOnLoopHandlersHoldNoThread, ATwoPhaseAttemptThatLostItsLeaseIsRefused,
    CancelledDuringTheTransactionCommitsNothingAndFreesTheKey,
    OneSignalCancelsEveryCallItWasGivenTo, AnAlreadyEmittedSignalCancelsBeforeAnyClaim,
    ASignalEmittedDuringTheTransactionCommitsNothing,
    DeadlineDuringTheHandlerLeavesTheKeyToTheHandlersAnswer,
    CancellationAfterTheCommitDeliversTheResult, CancelledAtEachStepNeverLiesAndNeverSticks,
    FuturesAndThreadsOffTheLoop, AThousandRequestsOnOneLoopLeaveOneEffectPerKey,
    TheLoopNeverStallsWhileDurableWorkRuns);

}  // namespace idem::test
