// SPDX-License-Identifier: MIT
// AsyncGuard from C++20 coroutines (compiled with -std=c++20): `net::use_awaitable` as the
// completion token, handlers that are coroutines themselves (`() -> net::awaitable<R>`, on the
// loop) and transactional handlers (on the pool) awaited from a coroutine, on one loop thread.
// MemoryStore in front of SQLite on a WorkerPool (PooledDurable).
#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "idem/async/guard.hpp"
#include "idem/async/pooled_durable.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/test_env.hpp"

#if !defined(__cpp_impl_coroutine)
#error "this test is compiled with -std=c++20 (tests/integration/async/CMakeLists.txt)"
#endif

namespace {

namespace net = idem::async::net;
using idem::Outcome;
using idem::async::PooledDurable;
using idem::sqlite::SqliteStore;
using namespace std::chrono_literals;

struct Stack {
  Stack() : sqlite(dir.file("coro.db")), pool({2, 64}), durable(sqlite, pool), fast(memory) {
    sqlite.database().write([](idem::sqlite::Transaction& tx) {
      tx.exec("CREATE TABLE coro_orders (key_id TEXT NOT NULL)");
    });
  }
  long orders(const std::string& id) {
    return static_cast<long>(sqlite.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM coro_orders WHERE key_id = ?", id).value_or(-1);
    }));
  }
  idem::test::TempDir dir;
  SqliteStore sqlite;
  idem::async::WorkerPool pool;
  PooledDurable<SqliteStore> durable;
  idem::MemoryStore memory;
  idem::async::InlineFastStore fast;
};

using Guard = idem::async::AsyncGuard<PooledDurable<SqliteStore>>;

TEST(AsyncGuardCoroutine, ConcurrentDuplicatesRunACoroutineHandlerOnceAndTheLaterOneReplays) {
  net::io_context io;
  Stack s;
  idem::async::AsyncGuardOptions options;
  options.pool = &s.pool;
  Guard guard{io.get_executor(), s.fast, s.durable, options};
  const auto key = idem::Key::make("orders", "coro-1");
  int runs = 0;
  std::vector<idem::GuardResult<std::string>> answers;

  // The handler is a coroutine on the loop: it waits 50 ms on a timer without holding a thread,
  // while the duplicates below arrive on the same loop.
  auto request = [&]() -> net::awaitable<void> {
    auto r = co_await guard.async_run(
        key, "order:42",
        [&]() -> net::awaitable<std::string> {
          ++runs;
          net::steady_timer t{co_await net::this_coro::executor, 50ms};
          co_await t.async_wait(net::use_awaitable);
          co_return std::string("order-1001");
        },
        net::use_awaitable);
    answers.push_back(std::move(r));
  };
  for (int i = 0; i < 3; ++i) net::co_spawn(io, request(), net::detached);
  io.run();

  ASSERT_EQ(3u, answers.size());
  EXPECT_EQ(1, runs);
  int executed = 0, in_progress = 0;
  for (const auto& a : answers) {
    if (a.outcome == Outcome::kExecuted) {
      ++executed;
      EXPECT_EQ("order-1001", a.value.value());
    } else {
      EXPECT_EQ(Outcome::kInProgress, a.outcome);
      ++in_progress;
    }
  }
  EXPECT_EQ(1, executed);
  EXPECT_EQ(2, in_progress);

  // Later, the same request replays the first answer; another payload is a mismatch.
  io.restart();
  answers.clear();
  net::co_spawn(io, request(), net::detached);
  net::co_spawn(
      io,
      [&]() -> net::awaitable<void> {
        auto r = co_await guard.async_run(
            key, "order:43", [&]() -> net::awaitable<std::string> {
              ++runs;
              co_return std::string("never");
            },
            net::use_awaitable);
        answers.push_back(std::move(r));
      },
      net::detached);
  io.run();
  ASSERT_EQ(2u, answers.size());
  EXPECT_EQ(Outcome::kReplayed, answers[0].outcome);
  EXPECT_EQ("order-1001", answers[0].value.value());
  EXPECT_EQ(Outcome::kFingerprintMismatch, answers[1].outcome);
  EXPECT_FALSE(answers[1].value.has_value());
  EXPECT_EQ(1, runs);
}

TEST(AsyncGuardCoroutine, AHandlerCoroutineThatThrowsRethrowsAtTheAwaitAndTheRetryRuns) {
  net::io_context io;
  Stack s;
  Guard guard{io.get_executor(), s.fast, s.durable};
  const auto key = idem::Key::make("orders", "coro-fail");
  int runs = 0;
  std::vector<std::string> seen;
  net::co_spawn(
      io,
      [&]() -> net::awaitable<void> {
        for (int attempt = 0; attempt < 2; ++attempt) {
          try {
            auto r = co_await guard.async_run(
                key, "p",
                [&]() -> net::awaitable<std::string> {
                  if (++runs == 1) throw std::runtime_error("gateway declined");
                  co_return std::string("paid");
                },
                net::use_awaitable);
            seen.push_back(std::string(idem::outcome_name(r.outcome)) + ":" +
                           r.value.value_or(""));
          } catch (const std::runtime_error& e) {
            seen.push_back(std::string("threw:") + e.what());
          }
        }
      },
      net::detached);
  io.run();
  ASSERT_EQ(2u, seen.size());
  EXPECT_EQ("threw:gateway declined", seen[0]);
  EXPECT_EQ("executed:paid", seen[1]);
  EXPECT_EQ(2, runs);
}

TEST(AsyncGuardCoroutine, ATransactionalHandlerAwaitedFromACoroutineCommitsOnce) {
  net::io_context io;
  Stack s;
  Guard guard{io.get_executor(), s.fast, s.durable};
  const auto key = idem::Key::make("orders", "coro-tx");
  std::vector<idem::GuardResult<std::string>> answers;
  net::co_spawn(
      io,
      [&]() -> net::awaitable<void> {
        for (int i = 0; i < 2; ++i) {
          auto r = co_await guard.async_run(
              key, "tx",
              [](idem::sqlite::Transaction& tx) {
                tx.exec("INSERT INTO coro_orders (key_id) VALUES (?)", std::string("coro-tx"));
                return std::string("order-7");
              },
              net::use_awaitable);
          answers.push_back(std::move(r));
        }
      },
      net::detached);
  io.run();
  ASSERT_EQ(2u, answers.size());
  EXPECT_EQ(Outcome::kExecuted, answers[0].outcome);
  EXPECT_EQ(Outcome::kReplayed, answers[1].outcome);
  EXPECT_EQ("order-7", answers[1].value.value());
  EXPECT_EQ(1, s.orders("coro-tx"));
}

}  // namespace
