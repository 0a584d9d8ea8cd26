// SPDX-License-Identifier: MIT
// idem::async::WorkerPool: a bounded pool of threads for the work that must block (SQLite and
// MySQL statements, transactional handlers, synchronous two-phase handlers), with completions
// posted back to the caller's executor.
//
// File: async/worker_pool.hpp
//
// An event-loop thread never waits for a database: the guard hands such work to this pool and
// goes on serving other connections; when the work is done, its result is posted to the
// executor the caller named (the loop), where the call continues. Bounded twice:
//
//   * `threads` threads run jobs (blocking work in flight is at most that many);
//   * at most `max_queued` jobs wait for a thread; a job submitted beyond that is refused at
//     once with WorkerPoolFull (an idem::StorageUnavailable: "worker pool full"), so an
//     overload is answered (HTTP 503, retryable) instead of queueing without limit.
//
// The bound refuses new work only. The steps that end work already admitted (a durable
// completion, a release: `submit_follow_up`) are never refused, and run before the jobs that
// start new work: refusing them would leave a key in progress until its lease, or a response
// computed but never recorded.
//
// A pool being destroyed finishes the jobs running and every follow-up (one submitted after
// its last thread left runs on the submitting thread), and refuses the jobs still waiting to
// start, as it refuses new ones: it never starts a handler or a claim once its owner is shutting
// down, usually with the loop that would carry the work on already stopped (a two-phase
// handler started then would run with no completion to record it, and run again after its
// lease).
//
// While a job runs or waits, the caller's executor counts as having outstanding work, so an
// `io_context::run()` does not return under it.
//
// @code
//   idem::async::WorkerPool pool{{.threads = 4}};
//   idem::async::async_submit(pool, io.get_executor(), [] { return slow_query(); },
//       [](std::exception_ptr e, int rows) { ... });          // runs on io's thread
//   int rows = co_await idem::async::async_submit(pool, ex, work, net::use_awaitable);
// @endcode
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/async/function.hpp"
#include "idem/async/net.hpp"
#include "idem/errors.hpp"

namespace idem::async {

/// Sizes of a WorkerPool.
struct WorkerPoolOptions {
  /// Threads running jobs. 0 means 4.
  std::size_t threads = 4;
  /// Most jobs waiting for a thread; one more is refused (StorageUnavailable). 0 means 1024.
  std::size_t max_queued = 1024;
};

/// What a WorkerPool answers a job it refuses: `max_queued` jobs already wait (an overload), or
/// the pool is being destroyed. A StorageUnavailable (retryable: HTTP 503, gRPC UNAVAILABLE);
/// its own type so that the asynchronous guard reports it as the pool's refusal (store
/// "worker_pool" in the observer's on_store_error), not as a failure of the durable store.
class WorkerPoolFull : public StorageUnavailable {
 public:
  using StorageUnavailable::StorageUnavailable;
};

/// Counters of a WorkerPool.
struct WorkerPoolStats {
  std::uint64_t submitted = 0;      ///< jobs accepted
  std::uint64_t rejected = 0;       ///< jobs refused because the queue was full
  std::uint64_t completed = 0;      ///< jobs that ran (returned or threw)
  std::size_t queued = 0;           ///< jobs waiting now
  std::size_t running = 0;          ///< jobs running now
  std::size_t max_queued_seen = 0;  ///< the longest the queue has been
};

/// A bounded pool of worker threads (see the file comment). Thread-safe.
class WorkerPool {
 public:
  /// Starts the threads.
  explicit WorkerPool(WorkerPoolOptions options = {}) : options_(normalise(options)) {
    threads_.reserve(options_.threads);
    for (std::size_t i = 0; i < options_.threads; ++i) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++alive_;
      }
      threads_.emplace_back([this] { loop(); });
    }
  }

  /// Refuses the jobs still waiting to start (their `done` gets WorkerPoolFull, "worker pool
  /// stopping", posted; a try_post job is dropped unrun), finishes the jobs running and every
  /// follow-up, then joins the threads. A follow-up submitted after the last thread left runs
  /// on the submitting thread.
  ~WorkerPool() {
    std::deque<Job> refused;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      refused.swap(queue_);
      stats_.rejected += refused.size();
    }
    wake_.notify_all();
    for (auto& job : refused) job(false);
    for (auto& t : threads_) t.join();
  }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  /// Queues `job` for a thread. @return false (nothing queued, `job` not run) when
  /// `max_queued` jobs wait.
  bool try_post(Function<void()> job) {
    if (admit() != Admission::kAdmitted) return false;
    enqueue([job = std::move(job)](bool run) mutable {
      if (run) job();
    });
    return true;
  }

  /// Runs `work()` on a thread of the pool, then `done(error, value)` on `executor`:
  /// `done(std::exception_ptr, std::optional<R>)` (value set when work returned) for a work
  /// returning R, `done(std::exception_ptr)` for a void one. A full queue (or a pool being
  /// destroyed) calls done with WorkerPoolFull (posted, never inline). `executor` is any Asio
  /// executor.
  template <class Ex, class Work, class Done>
  void submit(const Ex& executor, Work work, Done done) {
    submit_job(executor, std::move(work), std::move(done), false);
  }

  /// As submit(), for a step that ends work already admitted (a durable completion or
  /// release): never refused, and run before the jobs waiting in the bounded queue.
  template <class Ex, class Work, class Done>
  void submit_follow_up(const Ex& executor, Work work, Done done) {
    submit_job(executor, std::move(work), std::move(done), true);
  }

  /// The options in force (zeros replaced).
  const WorkerPoolOptions& options() const noexcept { return options_; }

  /// A snapshot of the counters.
  WorkerPoolStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    WorkerPoolStats s = stats_;
    s.queued = queue_.size() + follow_ups_.size();
    s.running = running_;
    return s;
  }

 private:
  template <class Ex, class Work, class Done>
  void submit_job(const Ex& executor, Work work, Done done, bool follow_up) {
    using R = std::invoke_result_t<Work&>;
    // Outstanding work on the caller's executor until `done` has run there.
    auto tracked = net::prefer(executor, net::execution::outstanding_work.tracked);
    // Answers `done` with WorkerPoolFull (posted): the job is refused.
    auto refuse = [](auto& tracked_executor, Done& refused_done, std::exception_ptr full) {
      net::post(tracked_executor, [done = std::move(refused_done), full]() mutable {
        if constexpr (std::is_void_v<R>) {
          done(full);
        } else {
          done(full, std::optional<R>());
        }
      });
    };
    const Admission admission = follow_up ? Admission::kAdmitted : admit();
    if (admission != Admission::kAdmitted) {
      refuse(tracked, done,
             admission == Admission::kStopping
                 ? stopping_error()
                 : std::make_exception_ptr(WorkerPoolFull(
                       "idem::async: worker pool full (" + std::to_string(options_.max_queued) +
                       " jobs waiting for " + std::to_string(options_.threads) + " threads)")));
      return;
    }
    Job job = [tracked, work = std::move(work), done = std::move(done), refuse](bool run) mutable {
      if (!run) return refuse(tracked, done, stopping_error());
      std::exception_ptr error;
      if constexpr (std::is_void_v<R>) {
        try {
          work();
        } catch (...) {
          error = std::current_exception();
        }
        net::post(tracked, [done = std::move(done), error]() mutable { done(error); });
      } else {
        std::optional<R> value;
        try {
          value.emplace(work());
        } catch (...) {
          error = std::current_exception();
        }
        net::post(tracked, [done = std::move(done), error, value = std::move(value)]() mutable {
          done(error, std::move(value));
        });
      }
    };
    if (follow_up) {
      enqueue_follow_up(std::move(job));
    } else {
      enqueue(std::move(job));
    }
  }

  // What a job refused by a pool being destroyed gets.
  static std::exception_ptr stopping_error() {
    return std::make_exception_ptr(
        WorkerPoolFull("idem::async: worker pool stopping (being destroyed)"));
  }

  static WorkerPoolOptions normalise(WorkerPoolOptions o) noexcept {
    if (o.threads == 0) o.threads = 4;
    if (o.max_queued == 0) o.max_queued = 1024;
    return o;
  }

  enum class Admission { kAdmitted, kFull, kStopping };
  // A queued job: job(true) runs it; job(false) refuses it (a pool being destroyed).
  using Job = Function<void(bool run)>;

  // Reserves a place in the queue.
  Admission admit() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ || queue_.size() + reserved_ >= options_.max_queued) {
      ++stats_.rejected;
      return stopping_ ? Admission::kStopping : Admission::kFull;
    }
    ++reserved_;
    return Admission::kAdmitted;
  }

  // Takes the place admit() reserved; refuses the job if the pool began stopping meanwhile.
  void enqueue(Job job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --reserved_;
      if (stopping_) {
        ++stats_.rejected;
      } else {
        queue_.push_back(std::move(job));
        ++stats_.submitted;
        if (queue_.size() > stats_.max_queued_seen) stats_.max_queued_seen = queue_.size();
        job = nullptr;
      }
    }
    if (job) return job(false);
    wake_.notify_one();
  }

  // Queues a follow-up (never refused; taken before queue_), or runs it here when no thread
  // is left to take it (the pool is being destroyed).
  void enqueue_follow_up(Job job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++stats_.submitted;
      if (alive_ > 0) {
        follow_ups_.push_back(std::move(job));
        job = nullptr;
      }
    }
    if (!job) return wake_.notify_one();
    job(true);
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.completed;
  }

  void loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty() || !follow_ups_.empty(); });
        std::deque<Job>& from = !follow_ups_.empty() ? follow_ups_ : queue_;
        if (from.empty()) {  // stopping, and nothing left
          --alive_;
          return;
        }
        job = std::move(from.front());
        from.pop_front();
        ++running_;
      }
      job(true);  // never throws: the submitted wrappers catch
      std::lock_guard<std::mutex> lock(mutex_);
      --running_;
      ++stats_.completed;
    }
  }

  const WorkerPoolOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Job> queue_;
  std::deque<Job> follow_ups_;  // never refused, taken first
  std::size_t alive_ = 0;       // threads that have not left loop()
  std::size_t running_ = 0;
  std::size_t reserved_ = 0;
  bool stopping_ = false;
  WorkerPoolStats stats_;
  std::vector<std::thread> threads_;
};

namespace detail {
template <class R>
struct SubmitSignature {
  using type = void(std::exception_ptr, R);
};
template <>
struct SubmitSignature<void> {
  using type = void(std::exception_ptr);
};
}  // namespace detail

/// Runs `work()` on `pool` and completes `token` with its result, Asio style: signature
/// `void(std::exception_ptr, R)` (R must be default-constructible: it is passed empty with an
/// error), or `void(std::exception_ptr)` for a void work. The completion runs on the token's
/// associated executor, else on `executor`. Works with callbacks, `net::use_future` and, in
/// C++20, `net::use_awaitable`.
template <class Work, class Token>
auto async_submit(WorkerPool& pool, const Executor& executor, Work work, Token&& token) {
  using R = std::invoke_result_t<Work&>;
  using Signature = typename detail::SubmitSignature<R>::type;
  return net::async_initiate<Token, Signature>(
      [&pool, executor](auto handler, Work w) {
        auto ex = net::get_associated_executor(handler, executor);
        if constexpr (std::is_void_v<R>) {
          pool.submit(ex, std::move(w),
                      [h = std::move(handler)](std::exception_ptr e) mutable { h(e); });
        } else {
          pool.submit(ex, std::move(w),
                      [h = std::move(handler)](std::exception_ptr e, std::optional<R> v) mutable {
                        h(e, v ? std::move(*v) : R{});
                      });
        }
      },
      token, std::move(work));
}

}  // namespace idem::async
