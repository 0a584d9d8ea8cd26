// SPDX-License-Identifier: MIT
// AsyncGuard on the embedded stores: MemoryStore in front of SQLite on a worker pool, and SQLite
// alone (no server needed).
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "async_guard_suite.hpp"
#include "idem/async/pooled_durable.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/failing_store.hpp"
#include "support/flaky_durable.hpp"

namespace {

using idem::async::PooledDurable;
using idem::sqlite::SqliteStore;

struct SqliteBase {
  using Durable = PooledDurable<SqliteStore>;
  static const char* env_var() { return nullptr; }
  explicit SqliteBase(const std::string&)
      : sqlite(dir.file("async.db")), workers({4, 256}), pooled(sqlite, workers) {
    sqlite.database().write([](idem::sqlite::Transaction& tx) {
      tx.exec("CREATE TABLE idem_test_effects (key_id TEXT NOT NULL)");
    });
  }
  Durable& durable() { return pooled; }
  idem::async::WorkerPool& pool() { return workers; }
  void insert_effect(idem::sqlite::Transaction& tx, const std::string& id) {
    tx.exec("INSERT INTO idem_test_effects (key_id) VALUES (?)", id);
  }
  long count_effects(const std::string& id) {
    return static_cast<long>(sqlite.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM idem_test_effects WHERE key_id = ?", id)
          .value_or(-1);
    }));
  }
  idem::test::TempDir dir;
  SqliteStore sqlite;
  idem::async::WorkerPool workers;
  Durable pooled;
};

struct MemorySqlite : SqliteBase {
  explicit MemorySqlite(const std::string& v) : SqliteBase(v), fast_adapter(memory) {}
  idem::async::AsyncFastStore* fast() { return &fast_adapter; }
  void forget_fast(const idem::Key&) { memory.clear(); }
  idem::MemoryStore memory;
  idem::async::InlineFastStore fast_adapter;
};

struct SqliteOnly : SqliteBase {
  using SqliteBase::SqliteBase;
  idem::async::AsyncFastStore* fast() { return nullptr; }
  void forget_fast(const idem::Key&) {}
};

}  // namespace

namespace idem::test {
using SqliteEnvs = ::testing::Types<MemorySqlite, SqliteOnly>;
INSTANTIATE_TYPED_TEST_SUITE_P(Embedded, AsyncGuardSuite, SqliteEnvs);
}  // namespace idem::test

namespace {

// Takes the one thread and the one queue place of `pool` (sized {1, 1}) until the returned
// promise is set.
std::promise<void> fill(idem::async::WorkerPool& pool, idem::async::net::io_context& io) {
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  auto started = std::make_shared<std::atomic<bool>>(false);
  auto ignore = [](std::exception_ptr) {};
  pool.submit(
      io.get_executor(),
      [gate, started] {
        *started = true;
        gate.wait();
      },
      ignore);
  while (!*started) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  pool.submit(
      io.get_executor(), [gate] { gate.wait(); }, ignore);
  return release;
}

// Runs one call of `handler` on `key` until `io` has nothing left: its error and result.
template <class Guard, class Handler>
std::pair<std::exception_ptr, idem::GuardResult<std::string>> run_to_end(
    idem::async::net::io_context& io, Guard& guard, const idem::Key& key, Handler& handler) {
  std::pair<std::exception_ptr, idem::GuardResult<std::string>> out;
  guard.async_run(key, "fp", handler, [&](std::exception_ptr e, idem::GuardResult<std::string> r) {
    out.first = e;
    out.second = std::move(r);
  });
  io.restart();
  io.run();
  return out;
}

// A record the fast store lost is written back for what is left of its retention (the
// replaying call asks for 30 days), and not at all once that is over by the system clock while
// the durable store, whose clock is behind, still replays it (as IdempotencyGuard does).
TEST(AsyncGuardRefillTest, ARecordWrittenBackKeepsWhatIsLeftOfItsRetention) {
  idem::async::net::io_context io;
  idem::test::TempDir dir;
  idem::ManualClock behind(idem::system_now() - std::chrono::minutes(5));
  idem::sqlite::SqliteStoreOptions late;
  late.clock = behind.as_clock();
  SqliteStore on_time{dir.file("refill.db")};
  SqliteStore slow{std::make_shared<idem::sqlite::Database>(dir.file("refill.db")), late};
  idem::async::WorkerPool pool{{2, 16}};
  PooledDurable<SqliteStore> durable{on_time, pool};
  PooledDurable<SqliteStore> late_durable{slow, pool};
  idem::MemoryStore memory;
  idem::async::InlineFastStore fast{memory};
  using Guard = idem::async::AsyncGuard<PooledDurable<SqliteStore>>;
  idem::async::AsyncGuardOptions minute;
  minute.guard.retention = std::chrono::seconds(60);
  idem::async::AsyncGuardOptions month;
  month.guard.retention = std::chrono::hours(24 * 30);
  Guard writer{io.get_executor(), fast, durable, minute};
  Guard late_writer{io.get_executor(), fast, late_durable, minute};
  Guard guard{io.get_executor(), fast, durable, month};
  Guard late_guard{io.get_executor(), fast, late_durable, month};
  auto handler = [](idem::sqlite::Transaction&) { return std::string("paid"); };
  auto call = [&](Guard& g, const idem::Key& k) {
    auto out = run_to_end(io, g, k, handler);
    if (out.first) std::rethrow_exception(out.first);
    return out.second;
  };
  const auto k = idem::Key::make("pay", "refill");
  const auto over = idem::Key::make("pay", "refill-over");
  ASSERT_EQ(idem::Outcome::kExecuted, call(writer, k).outcome);
  ASSERT_EQ(idem::Outcome::kExecuted, call(late_writer, over).outcome);
  memory.clear();  // the fast store lost its records

  const auto before = idem::system_now();
  auto r = call(guard, k);
  ASSERT_EQ(idem::Outcome::kReplayed, r.outcome);
  EXPECT_EQ(idem::Source::kDurableStore, r.source);
  auto kept = memory.lookup(k);
  ASSERT_TRUE(kept.has_value());
  EXPECT_LE(kept->expires_at, r.expires_at) << "never past the durable record's expiry";
  EXPECT_GT(kept->expires_at, before + std::chrono::seconds(30));

  for (int round = 0; round < 2; ++round) {
    auto o = call(late_guard, over);
    EXPECT_EQ(idem::Outcome::kReplayed, o.outcome);
    EXPECT_EQ(idem::Source::kDurableStore, o.source);
    EXPECT_FALSE(memory.lookup(over).has_value());
  }
}

// The durable replay writes the record back created when its first attempt began: the
// duplicates the fast store answers afterwards report that time (as IdempotencyGuard's).
TEST(AsyncGuardRefillTest, DuplicatesAfterTheWriteBackReportWhenTheFirstAttemptBegan) {
  idem::async::net::io_context io;
  idem::test::TempDir dir;
  idem::ManualClock hour_ago(idem::system_now() - std::chrono::hours(1));
  idem::sqlite::SqliteStoreOptions earlier;
  earlier.clock = hour_ago.as_clock();
  auto db = std::make_shared<idem::sqlite::Database>(dir.file("first-seen.db"));
  SqliteStore then{db, earlier};
  SqliteStore now{db};
  idem::async::WorkerPool pool{{2, 16}};
  PooledDurable<SqliteStore> first_durable{then, pool};
  PooledDurable<SqliteStore> durable{now, pool};
  idem::MemoryStore memory;
  idem::async::InlineFastStore fast{memory};
  using Guard = idem::async::AsyncGuard<PooledDurable<SqliteStore>>;
  Guard first{io.get_executor(), fast, first_durable};
  Guard guard{io.get_executor(), fast, durable};
  auto handler = [](idem::sqlite::Transaction&) { return std::string("paid"); };
  auto call = [&](Guard& g, const idem::Key& k) {
    auto out = run_to_end(io, g, k, handler);
    if (out.first) std::rethrow_exception(out.first);
    return out.second;
  };
  const auto k = idem::Key::make("pay", "first-seen");
  ASSERT_EQ(idem::Outcome::kExecuted, call(first, k).outcome);
  const idem::TimePoint created = now.lookup(k).value().created_at;
  ASSERT_LT(created, idem::system_now() - std::chrono::minutes(30));
  memory.clear();  // the fast store lost its records

  auto r = call(guard, k);
  ASSERT_EQ(idem::Outcome::kReplayed, r.outcome);
  EXPECT_EQ(idem::Source::kDurableStore, r.source);
  EXPECT_EQ(created, r.first_seen);
  EXPECT_EQ(created, memory.lookup(k).value().created_at);
  auto again = call(guard, k);
  ASSERT_EQ(idem::Outcome::kReplayed, again.outcome);
  EXPECT_EQ(idem::Source::kFastStore, again.source);
  EXPECT_EQ(created, again.first_seen) << "not the time it was written back";
  ASSERT_FALSE(r.holder.empty());
  EXPECT_EQ(r.holder, again.holder) << "the first attempt's owner, not the replaying call's";
}

// A stalled fast store applies the claims whose answers timed out once it runs again; the
// guard releases them (owner-checked) at its first claim the store answers, so a completed
// key replays instead of answering "in progress" for a lease (as IdempotencyGuard does).
// An AsyncGuard on SQLite behind a MemoryStore that can stall (SwitchableFastStore).
struct StallingAsyncGuard {
  idem::async::net::io_context io;
  idem::test::TempDir dir;
  SqliteStore sqlite{dir.file("lost.db")};
  idem::async::WorkerPool pool{{2, 16}};
  PooledDurable<SqliteStore> durable{sqlite, pool};
  idem::MemoryStore memory;
  idem::test::SwitchableFastStore stalling{memory};
  idem::async::InlineFastStore fast{stalling};
  idem::async::AsyncGuard<PooledDurable<SqliteStore>> guard{io.get_executor(), fast, durable};
};

// Calls left unanswered by a stopped loop, each given a CancelSignal that outlives the
// io_context (owned by a client connection, say): the documented shutdown order (loop stopped,
// pool, guard, io_context), then the signals emitted and destroyed. Nothing is answered after
// the loop is gone and nothing of it is touched (the signal's listener held a copy of the
// call's strand: emitting or destroying it afterwards used the freed loop; ASan reported it).
TEST(AsyncGuardLifetime, CancelSignalsMayOutliveTheLoop) {
  std::vector<std::shared_ptr<idem::async::CancelSignal>> signals;
  std::atomic<int> answered{0};
  int answered_before_the_end = 0;
  {
    auto io = std::make_unique<idem::async::net::io_context>();
    idem::test::TempDir dir;
    SqliteStore sqlite{dir.file("outlive.db")};
    std::optional<idem::async::WorkerPool> pool;
    pool.emplace(idem::async::WorkerPoolOptions{2, 64});
    PooledDurable<SqliteStore> durable{sqlite, *pool};
    std::optional<idem::async::AsyncGuard<PooledDurable<SqliteStore>>> guard;
    guard.emplace(io->get_executor(), durable);
    for (int i = 0; i < 20; ++i) {
      signals.push_back(std::make_shared<idem::async::CancelSignal>());
      idem::async::CallOptions co;
      co.cancel = signals.back();
      guard->async_run(
          idem::Key::make("outlive", std::to_string(i)), "fp", co,
          [](idem::sqlite::Transaction&) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            return std::string("x");
          },
          [&](std::exception_ptr, idem::GuardResult<std::string>) { ++answered; });
    }
    io->run_for(std::chrono::milliseconds(15));  // some calls start, none can finish
    io->stop();
    pool.reset();
    guard.reset();
    io.reset();
    answered_before_the_end = answered.load();
  }
  for (auto& s : signals) s->emit();
  signals.clear();
  EXPECT_EQ(answered_before_the_end, answered.load()) << "answered after the loop was gone";
}

// A fast-only call whose record the store lost while its handler ran (an eviction, a flush):
// the response is written back and the call answers executed, so the retry replays it (it was
// LeaseLost, and the retry ran the handler again), as IdempotencyGuard does.
TEST(AsyncGuardFastOnly, ARecordTheStoreLostIsWrittenBackAndReplayed) {
  idem::async::net::io_context io;
  idem::MemoryStore memory;
  idem::async::InlineFastStore fast{memory};
  idem::async::AsyncGuard guard{io.get_executor(), fast};
  const auto key = idem::Key::make("payment", "evicted");
  int runs = 0;
  std::vector<idem::GuardResult<std::string>> answers;
  std::vector<std::exception_ptr> errors;
  auto call = [&](const char* response) {
    guard.async_run(key, "fp", idem::async::on_loop([&, response] {
                      ++runs;
                      memory.clear();  // the store forgets every record
                      return std::string(response);
                    }),
                    [&](std::exception_ptr e, idem::GuardResult<std::string> r) {
                      errors.push_back(e);
                      answers.push_back(std::move(r));
                    });
    io.restart();
    io.run();
  };
  call("charged");
  ASSERT_EQ(1u, answers.size());
  EXPECT_FALSE(errors[0]) << "LeaseLost: nobody else held the key";
  EXPECT_EQ(idem::Outcome::kExecuted, answers[0].outcome);
  call("charged again");
  ASSERT_EQ(2u, answers.size());
  EXPECT_FALSE(errors[1]);
  EXPECT_EQ(idem::Outcome::kReplayed, answers[1].outcome);
  EXPECT_EQ("charged", answers[1].value.value_or(""));
  EXPECT_EQ(1, runs);
  EXPECT_EQ(1u, guard.stats().snapshot().fast_refills);
}

// The guard's type is deduced as IdempotencyGuard's is: a durable store alone (with or without
// options), a fast store alone, both.
TEST(AsyncGuardDeduction, TheStoresGivenDecideTheGuardsType) {
  StallingAsyncGuard t;
  idem::async::AsyncGuard durable_only{t.io.get_executor(), t.durable};
  static_assert(
      std::is_same_v<decltype(durable_only), idem::async::AsyncGuard<PooledDurable<SqliteStore>>>);
  idem::async::AsyncGuard with_options{t.io.get_executor(), t.durable,
                                       idem::async::AsyncGuardOptions{}};
  static_assert(
      std::is_same_v<decltype(with_options), idem::async::AsyncGuard<PooledDurable<SqliteStore>>>);
  idem::async::AsyncGuard fast_only{t.io.get_executor(), t.fast};
  static_assert(std::is_same_v<decltype(fast_only), idem::async::AsyncGuard<>>);
  idem::async::AsyncGuard both{t.io.get_executor(), t.fast, t.durable};
  static_assert(
      std::is_same_v<decltype(both), idem::async::AsyncGuard<PooledDurable<SqliteStore>>>);
  EXPECT_EQ(0u, durable_only.stats().snapshot().calls);
}

TEST(AsyncGuardLostClaimsTest, ClaimsAppliedAfterTheirTimeoutAreReleasedOnceTheStoreAnswers) {
  StallingAsyncGuard t;
  auto& io = t.io;
  auto& guard = t.guard;
  auto& memory = t.memory;
  auto& stalling = t.stalling;
  auto handler = [](idem::sqlite::Transaction&) { return std::string("paid"); };
  const auto b = idem::Key::make("pay", "lost-b");
  stalling.stalled = true;
  auto [e1, first] = run_to_end(io, guard, b, handler);
  ASSERT_FALSE(e1);
  EXPECT_EQ(idem::Outcome::kExecuted, first.outcome);  // the durable store alone
  ASSERT_TRUE(memory.lookup(b).has_value()) << "the stalled store applied the lost claim";
  stalling.stalled = false;
  auto [e2, other] = run_to_end(io, guard, idem::Key::make("pay", "lost-c"), handler);
  ASSERT_FALSE(e2);
  EXPECT_EQ(idem::Outcome::kExecuted, other.outcome);
  auto [e3, again] = run_to_end(io, guard, b, handler);
  ASSERT_FALSE(e3);
  EXPECT_EQ(idem::Outcome::kReplayed, again.outcome) << "not the lost claim's in progress";
  EXPECT_EQ("paid", again.value.value_or(""));
}

// The call whose claim the lost claim's record answers is the first after the stall, or the
// store applies the lost claim only after the guard's release of it found nothing: the guard
// knows the record's holder as its own lost claim, releases it and asks again (as
// IdempotencyGuard does), so a completed key replays.
TEST(AsyncGuardLostClaimsTest, TheCallALostClaimAnswersReleasesItAndAsksAgain) {
  StallingAsyncGuard t;
  auto& io = t.io;
  auto& guard = t.guard;
  auto& memory = t.memory;
  auto& stalling = t.stalling;
  stalling.defer_stalled = true;
  auto handler = [](idem::sqlite::Transaction&) { return std::string("paid"); };
  auto outcome = [&](const idem::Key& k) {
    auto [e, r] = run_to_end(io, guard, k, handler);
    EXPECT_FALSE(e);
    return r.outcome;
  };
  const auto first = idem::Key::make("pay", "first-after");
  const auto late = idem::Key::make("pay", "applied-late");
  stalling.stalled = true;
  ASSERT_EQ(idem::Outcome::kExecuted, outcome(first));  // the durable store alone
  stalling.stalled = false;
  stalling.apply_stalled();
  ASSERT_TRUE(memory.lookup(first).has_value()) << "the stalled store applied the lost claim";
  EXPECT_EQ(idem::Outcome::kReplayed, outcome(first)) << "not the lost claim's in progress";

  stalling.stalled = true;
  ASSERT_EQ(idem::Outcome::kExecuted, outcome(late));
  stalling.stalled = false;
  ASSERT_EQ(idem::Outcome::kExecuted, outcome(idem::Key::make("pay", "other")));
  stalling.apply_stalled();  // after the guard's release of it
  ASSERT_TRUE(memory.lookup(late).has_value());
  EXPECT_EQ(idem::Outcome::kReplayed, outcome(late)) << "not the lost claim's in progress";
}

// A worker pool with no room refuses the call's transaction: the caller gets WorkerPoolFull
// (retryable), nothing runs, and the observer hears of it as the pool's refusal
// ("worker_pool"), not as a failure of the durable store. Once the pool has room, the retry
// runs once.
// A two-phase begin applied whose answer was lost with its connection (OutcomeUnknown): the
// asynchronous guard, as the synchronous one, releases the record it may have left
// (owner-checked) before answering, so the caller's retry runs at once instead of hearing
// "in progress" for a whole lease while nothing runs.
TEST(AsyncGuardOutcomeUnknownTest, ABeginAppliedThenLostIsReleasedSoTheRetryRunsAtOnce) {
  idem::async::net::io_context io;
  idem::test::TempDir dir;
  SqliteStore sqlite{dir.file("lost-begin.db")};
  idem::test::FlakyDurable flaky{sqlite};
  flaky.fail_begin = 1;
  flaky.begin_applied_then_lost = true;
  idem::async::WorkerPool pool{{2, 16}};
  PooledDurable<idem::test::FlakyDurable> durable{flaky, pool};
  idem::async::AsyncGuardOptions options;
  options.pool = &pool;
  idem::async::AsyncGuard<PooledDurable<idem::test::FlakyDurable>> guard{io.get_executor(), durable,
                                                                         options};
  const auto key = idem::Key::make("pay", "lost-begin");
  int runs = 0;
  auto handler = [&runs] {
    ++runs;
    return std::string("paid");
  };
  auto first = run_to_end(io, guard, key, handler);
  ASSERT_TRUE(first.first);
  EXPECT_THROW(std::rethrow_exception(first.first), idem::OutcomeUnknown);
  EXPECT_FALSE(sqlite.lookup(key).has_value()) << "the applied begin's record was released";
  auto retry = run_to_end(io, guard, key, handler);
  ASSERT_FALSE(retry.first);
  EXPECT_EQ(idem::Outcome::kExecuted, retry.second.outcome);
  EXPECT_EQ(1, runs);
}

// A two-phase call cancelled while its handler's job waits in the worker pool's queue: the
// job checks the signal itself before the handler starts, so the handler never runs, even when
// the loop has not yet run the cancellation it posted. The key is free again for the retry.
TEST(AsyncGuardPoolTest, AHandlerStillQueuedWhenItsCallIsCancelledNeverRuns) {
  idem::async::net::io_context io;
  idem::test::TempDir dir;
  SqliteStore sqlite{dir.file("queued.db")};
  idem::async::WorkerPool durable_pool{{2, 16}};
  idem::async::WorkerPool handler_pool{{1, 8}};
  PooledDurable<SqliteStore> durable{sqlite, durable_pool};
  idem::async::AsyncGuardOptions options;
  options.pool = &handler_pool;
  idem::async::AsyncGuard guard{io.get_executor(), durable, options};
  std::promise<void> gate_open;
  std::shared_future<void> gate = gate_open.get_future().share();
  auto busy = std::make_shared<std::atomic<bool>>(false);
  handler_pool.submit(
      io.get_executor(),
      [gate, busy] {
        *busy = true;
        gate.wait();
      },
      [](std::exception_ptr) {});
  while (!*busy) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto key = idem::Key::make("pay", "queued");
  auto cancel = std::make_shared<idem::async::CancelSignal>();
  idem::async::CallOptions co;
  co.cancel = cancel;
  int runs = 0;
  std::exception_ptr error;
  guard.async_run(
      key, "fp", co,
      [&runs] {
        ++runs;
        return std::string("paid");
      },
      [&](std::exception_ptr e, idem::GuardResult<std::string>) { error = e; });
  // The durable claim is made and the handler's job queued behind the busy thread.
  for (int i = 0; i < 200 && !sqlite.lookup(key); ++i) {
    io.run_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(sqlite.lookup(key).has_value()) << "the claim was not made";
  for (int i = 0; i < 200 && handler_pool.stats().queued == 0; ++i) {
    io.run_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(1u, handler_pool.stats().queued) << "the handler's job is not queued";
  cancel->emit();         // its cancellation is posted to the loop, not run yet
  gate_open.set_value();  // the queued job starts first
  while (handler_pool.stats().completed < 2) {  // the gate's job and the call's
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  io.restart();
  io.run();
  EXPECT_EQ(0, runs) << "the handler ran after its call was cancelled";
  ASSERT_TRUE(error);
  EXPECT_THROW(std::rethrow_exception(error), idem::Cancelled);
  int retry_runs = 0;
  auto handler = [&retry_runs] {
    ++retry_runs;
    return std::string("paid");
  };
  auto retry = run_to_end(io, guard, key, handler);
  ASSERT_FALSE(retry.first);
  EXPECT_EQ(idem::Outcome::kExecuted, retry.second.outcome);
  EXPECT_EQ(1, retry_runs);
}

TEST(AsyncGuardPoolTest, AFullWorkerPoolIsReportedAsThePoolNotAsTheStore) {
  struct Seen : idem::Observer {
    std::vector<std::string> stores;
    void on_store_error(const idem::StoreErrorEvent& e) noexcept override {
      stores.emplace_back(e.store);
    }
  };
  idem::async::net::io_context io;
  idem::test::TempDir dir;
  SqliteStore sqlite{dir.file("full.db")};
  idem::async::WorkerPool pool{{1, 1}};
  PooledDurable<SqliteStore> durable{sqlite, pool};
  auto seen = std::make_shared<Seen>();
  idem::async::AsyncGuardOptions options;
  options.guard.observer = seen;
  idem::async::AsyncGuard<PooledDurable<SqliteStore>> guard{io.get_executor(), durable, options};

  std::promise<void> release = fill(pool, io);

  int runs = 0;
  auto handler = [&runs](idem::sqlite::Transaction&) {
    ++runs;
    return std::string("paid");
  };
  const auto key = idem::Key::make("pay", "full-pool");
  std::exception_ptr error;
  bool answered = false;
  guard.async_run(key, "fp", handler, [&](std::exception_ptr e, idem::GuardResult<std::string>) {
    error = e;
    answered = true;
  });
  for (int i = 0; i < 500 && !answered; ++i) io.run_one_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(answered);
  ASSERT_TRUE(error);
  EXPECT_THROW(std::rethrow_exception(error), idem::async::WorkerPoolFull);
  EXPECT_EQ(0, runs);
  EXPECT_EQ(std::vector<std::string>{"worker_pool"}, seen->stores);

  release.set_value();
  io.restart();
  io.run();  // the two held jobs end
  auto [retry_error, retried] = run_to_end(io, guard, key, handler);
  ASSERT_FALSE(retry_error);
  EXPECT_EQ(idem::Outcome::kExecuted, retried.outcome);
  EXPECT_EQ(1, runs);
  EXPECT_EQ(1u, seen->stores.size());
}

// The same for a two-phase handler the handlers' pool (AsyncGuardOptions::pool) has no room
// for: the pool's refusal, not a handler error; the key is free at once.
TEST(AsyncGuardPoolTest, ATwoPhaseHandlerRefusedByAFullPoolIsNotAHandlerError) {
  struct Seen : idem::Observer {
    std::vector<std::string> stores;
    int handler_errors = 0;
    void on_store_error(const idem::StoreErrorEvent& e) noexcept override {
      stores.emplace_back(e.store);
    }
    void on_handler_error(const idem::Key&) noexcept override { ++handler_errors; }
  };
  idem::async::net::io_context io;
  idem::MemoryStore memory;
  idem::async::InlineFastStore fast{memory};
  SqliteStore sqlite{":memory:"};
  idem::async::WorkerPool durable_pool{{1, 8}};
  idem::async::WorkerPool handler_pool{{1, 1}};
  PooledDurable<SqliteStore> durable{sqlite, durable_pool};
  auto seen = std::make_shared<Seen>();
  idem::async::AsyncGuardOptions options;
  options.pool = &handler_pool;
  options.guard.observer = seen;
  idem::async::AsyncGuard<PooledDurable<SqliteStore>> guard{io.get_executor(), fast, durable,
                                                            options};
  std::promise<void> release = fill(handler_pool, io);

  const auto key = idem::Key::make("pay", "full-handler-pool");
  std::exception_ptr error;
  bool answered = false;
  int runs = 0;
  auto handler = [&runs] {
    ++runs;
    return std::string("sent");
  };
  guard.async_run(key, "fp", handler, [&](std::exception_ptr e, idem::GuardResult<std::string>) {
    error = e;
    answered = true;
  });
  for (int i = 0; i < 500 && !answered; ++i) io.run_one_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(answered);
  EXPECT_THROW(std::rethrow_exception(error), idem::async::WorkerPoolFull);
  EXPECT_EQ(0, runs);
  EXPECT_EQ(0, seen->handler_errors);
  EXPECT_EQ(0u, guard.stats().snapshot().handler_errors);
  EXPECT_EQ(std::vector<std::string>{"worker_pool"}, seen->stores);
  release.set_value();
  io.restart();
  io.run();  // the two held jobs end
  auto [retry_error, retried] = run_to_end(io, guard, key, handler);
  ASSERT_FALSE(retry_error);
  EXPECT_EQ(idem::Outcome::kExecuted, retried.outcome);
  EXPECT_EQ(1, runs);
}

// GuardOptions the asynchronous guard does not implement are refused at construction, typed,
// on every constructor; the options it does implement construct.
TEST(AsyncGuardOptionsTest, UnsupportedGuardOptionsAreRefusedAtConstruction) {
  idem::async::net::io_context io;
  idem::MemoryStore memory;
  idem::async::InlineFastStore fast{memory};
  SqliteStore sqlite{":memory:"};
  idem::async::WorkerPool pool;
  PooledDurable<SqliteStore> durable{sqlite, pool};
  using Guard = idem::async::AsyncGuard<PooledDurable<SqliteStore>>;
  using FastOnly = idem::async::AsyncGuard<>;
  std::vector<std::pair<std::string, std::function<void(idem::async::AsyncGuardOptions&)>>> bad = {
      {"bypass", [](auto& o) { o.guard.bypass = true; }},
      {"wait_for_result", [](auto& o) { o.guard.wait_for_result = std::chrono::milliseconds(5); }},
      {"store_attempts", [](auto& o) { o.guard.store_attempts = 3; }},
      {"heartbeat", [](auto& o) { o.guard.heartbeat = true; }},
      {"fast_store_retry_after",
       [](auto& o) { o.guard.fast_store_retry_after = std::chrono::seconds(1); }},
      {"timeout", [](auto& o) { o.timeout = std::chrono::milliseconds(-1); }}};
  for (const auto& [field, set] : bad) {
    idem::async::AsyncGuardOptions o;
    set(o);
    auto names_it = [&](const idem::UsageError& e) {
      EXPECT_EQ(idem::errc::kInvalidArgument, e.code());
      EXPECT_NE(std::string::npos, std::string(e.what()).find(field)) << e.what();
    };
    try {
      Guard g{io.get_executor(), fast, durable, o};
      ADD_FAILURE() << field << " was accepted";
    } catch (const idem::UsageError& e) {
      names_it(e);
    }
    try {
      Guard g{io.get_executor(), durable, o};
      ADD_FAILURE() << field << " was accepted (durable only)";
    } catch (const idem::UsageError& e) {
      names_it(e);
    }
    try {
      FastOnly g{io.get_executor(), fast, o};
      ADD_FAILURE() << field << " was accepted (fast only)";
    } catch (const idem::UsageError& e) {
      names_it(e);
    }
  }
  idem::async::AsyncGuardOptions fine;
  fine.guard.store_attempts = 1;
  fine.guard.lease = std::chrono::seconds(5);
  fine.timeout = std::chrono::seconds(1);
  EXPECT_NO_THROW((Guard{io.get_executor(), fast, durable, fine}));
}

}  // namespace
