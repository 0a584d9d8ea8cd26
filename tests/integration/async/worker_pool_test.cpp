// SPDX-License-Identifier: MIT
// idem::async::WorkerPool: bounded threads and queue, completions on the caller's executor,
// typed refusals, and the completion-token entry point (callbacks, futures).
#include "idem/async/worker_pool.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using idem::async::WorkerPool;
using idem::async::WorkerPoolOptions;
namespace net = idem::async::net;
using namespace std::chrono_literals;

WorkerPoolOptions sized(std::size_t threads, std::size_t queued) {
  WorkerPoolOptions o;
  o.threads = threads;
  o.max_queued = queued;
  return o;
}

TEST(WorkerPoolTest, NeverRunsMoreJobsThanThreadsAndAnswersOnTheCallersThread) {
  WorkerPool pool(sized(3, 100));
  net::io_context io;
  std::atomic<int> running{0}, peak{0};
  int answered = 0;
  bool all_on_loop = true;
  std::thread::id loop_thread;
  for (int i = 0; i < 30; ++i) {
    pool.submit(
        io.get_executor(),
        [&, i] {
          int now = ++running;
          int p = peak.load();
          while (now > p && !peak.compare_exchange_weak(p, now)) {
          }
          std::this_thread::sleep_for(5ms);
          --running;
          return i * 2;
        },
        [&, i](std::exception_ptr e, std::optional<int> v) {
          EXPECT_FALSE(e);
          EXPECT_EQ(i * 2, v.value_or(-1));
          if (std::this_thread::get_id() != loop_thread) all_on_loop = false;
          ++answered;
        });
  }
  loop_thread = std::this_thread::get_id();
  io.run();  // returns only once every completion ran (outstanding work is tracked)
  EXPECT_EQ(30, answered);
  EXPECT_TRUE(all_on_loop);
  EXPECT_LE(peak.load(), 3);
  EXPECT_GE(peak.load(), 2) << "the jobs should overlap";
  auto s = pool.stats();
  EXPECT_EQ(30u, s.submitted);
  EXPECT_EQ(30u, s.completed);
  EXPECT_EQ(0u, s.rejected);
}

TEST(WorkerPoolTest, AFullQueueRefusesWithATypedRetryableError) {
  WorkerPool pool(sized(1, 2));
  net::io_context io;
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::atomic<bool> started{false};
  int ok = 0, refused = 0;
  auto done = [&](std::exception_ptr e) {
    if (!e) {
      ++ok;
      return;
    }
    try {
      std::rethrow_exception(e);
    } catch (const idem::async::WorkerPoolFull& x) {  // a StorageUnavailable
      const idem::StorageUnavailable& unavailable = x;
      EXPECT_TRUE(unavailable.retryable());
      EXPECT_NE(std::string::npos, std::string(x.what()).find("worker pool full"));
      ++refused;
    }
  };
  pool.submit(
      io.get_executor(),
      [&] {
        started = true;
        gate.wait();
      },
      done);  // running
  while (!started) std::this_thread::sleep_for(1ms);
  pool.submit(
      io.get_executor(), [&] { gate.wait(); }, done);  // queued 1
  pool.submit(
      io.get_executor(), [&] { gate.wait(); }, done);  // queued 2
  pool.submit(
      io.get_executor(), [&] {}, done);  // refused
  io.poll();
  EXPECT_EQ(1, refused);
  EXPECT_EQ(0, ok);
  release.set_value();
  io.restart();
  io.run();
  EXPECT_EQ(3, ok);
  EXPECT_EQ(1u, pool.stats().rejected);
  EXPECT_EQ(2u, pool.stats().max_queued_seen);
}

// The bound refuses new work, never the steps that end admitted work: a follow-up submitted to
// a full pool is queued, and runs before the jobs that waited longer in the bounded queue.
TEST(WorkerPoolTest, FollowUpsAreNeverRefusedAndRunFirst) {
  WorkerPool pool(sized(1, 1));
  net::io_context io;
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::atomic<bool> started{false};
  std::vector<std::string> order;  // appended on the one worker thread
  int refused = 0, ok = 0;
  auto done = [&](std::exception_ptr e) { e ? ++refused : ++ok; };
  pool.submit(
      io.get_executor(),
      [&] {
        started = true;
        gate.wait();
      },
      done);  // running
  while (!started) std::this_thread::sleep_for(1ms);
  pool.submit(
      io.get_executor(), [&] { order.push_back("new"); }, done);  // queued: the bound is reached
  pool.submit(
      io.get_executor(), [&] { order.push_back("refused"); }, done);
  for (int i = 0; i < 3; ++i) {
    pool.submit_follow_up(
        io.get_executor(), [&, i] { order.push_back("follow_up" + std::to_string(i)); }, done);
  }
  EXPECT_EQ(4u, pool.stats().queued);
  release.set_value();
  io.run();
  EXPECT_EQ(1, refused);
  EXPECT_EQ(5, ok);
  EXPECT_EQ((std::vector<std::string>{"follow_up0", "follow_up1", "follow_up2", "new"}), order);
  EXPECT_EQ(1u, pool.stats().rejected);
}

TEST(WorkerPoolTest, ExceptionsOfTheWorkReachTheCompletionUnchanged) {
  WorkerPool pool(sized(1, 4));
  net::io_context io;
  std::string caught;
  pool.submit(
      io.get_executor(), []() -> int { throw std::runtime_error("boom"); },
      [&](std::exception_ptr e, std::optional<int> v) {
        EXPECT_FALSE(v.has_value());
        try {
          std::rethrow_exception(e);
        } catch (const std::runtime_error& x) {
          caught = x.what();
        }
      });
  io.run();
  EXPECT_EQ("boom", caught);
}

TEST(WorkerPoolTest, CompletionTokensCallbacksAndFutures) {
  WorkerPool pool(sized(2, 16));
  net::io_context io;
  int got = 0;
  idem::async::async_submit(
      pool, io.get_executor(), [] { return 41; },
      [&](std::exception_ptr e, int v) {
        EXPECT_FALSE(e);
        got = v + 1;
      });
  io.run();
  EXPECT_EQ(42, got);

  // use_future: the loop runs on another thread; the future rethrows the work's exception.
  io.restart();
  auto guard = net::make_work_guard(io);
  std::thread loop([&] { io.run(); });
  std::future<std::string> f = idem::async::async_submit(
      pool, io.get_executor(), [] { return std::string("from the pool"); }, net::use_future);
  EXPECT_EQ("from the pool", f.get());
  std::future<int> bad = idem::async::async_submit(
      pool, io.get_executor(), []() -> int { throw idem::StorageTimeout("slow"); },
      net::use_future);
  EXPECT_THROW(bad.get(), idem::StorageTimeout);
  std::future<void> v = idem::async::async_submit(
      pool, io.get_executor(), [] {}, net::use_future);
  v.get();
  guard.reset();
  loop.join();
}

// A pool being destroyed (its owner shutting down, the loop usually stopped already) finishes
// the job running and every follow-up, those queued before and those submitted while it stops,
// and refuses the jobs still waiting to start: none of them runs, each is answered "worker pool
// stopping" (a WorkerPoolFull) on its executor.
TEST(WorkerPoolTest, DestroyingThePoolRefusesWhatWaitsAndFinishesWhatRunsAndEveryFollowUp) {
  net::io_context io;
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::atomic<bool> started{false};
  std::atomic<int> ran{0}, followed{0};
  int ok = 0, stopping = 0, other = 0;
  auto done = [&](std::exception_ptr e) {
    if (!e) return void(++ok);
    try {
      std::rethrow_exception(e);
    } catch (const idem::async::WorkerPoolFull& full) {
      ++stopping;
      EXPECT_NE(std::string::npos, std::string(full.what()).find("stopping")) << full.what();
    } catch (...) {
      ++other;
    }
  };
  auto pool = std::make_unique<WorkerPool>(sized(1, 64));
  pool->submit(
      io.get_executor(),
      [&] {
        started = true;
        gate.wait();
        ++ran;
      },
      done);
  while (!started) std::this_thread::sleep_for(1ms);
  for (int i = 0; i < 20; ++i)
    pool->submit(
        io.get_executor(), [&] { ++ran; }, done);
  pool->submit_follow_up(
      io.get_executor(), [&] { ++followed; }, done);
  WorkerPool* stopping_pool = pool.get();  // alive until the running job is released
  std::thread destroying([&] { pool.reset(); });
  // Stopping: a new job is refused at once.
  while (stopping_pool->try_post([] {})) std::this_thread::sleep_for(1ms);
  for (int i = 0; i < 10; ++i) {
    stopping_pool->submit_follow_up(
        io.get_executor(), [&] { ++followed; }, done);
  }
  release.set_value();
  destroying.join();
  io.run();
  EXPECT_EQ(1, ran.load()) << "only the job that was running when the pool began stopping";
  EXPECT_EQ(11, followed.load()) << "every follow-up ran";
  EXPECT_EQ(12, ok);
  EXPECT_EQ(20, stopping);
  EXPECT_EQ(0, other);
}

}  // namespace
