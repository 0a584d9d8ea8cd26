// SPDX-License-Identifier: MIT
// A fixed pool of "server" threads for the examples that simulate clients and a server in one
// process (flash_sale, coupon_claim): a client submits an attempt and may stop waiting for it
// (a timeout) while the attempt keeps running, as a real server would.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace examples {

/// `n` worker threads running submitted tasks in order. The destructor lets every queued or
/// running task finish (abandoned attempts still run), then joins.
template <class Reply>
class ServerPool {
 public:
  explicit ServerPool(int n) {
    for (int i = 0; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }
  ServerPool(const ServerPool&) = delete;
  ServerPool& operator=(const ServerPool&) = delete;
  ~ServerPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }

  /// Queues `fn`; its reply arrives through the future.
  std::future<Reply> submit(std::function<Reply()> fn) {
    std::packaged_task<Reply()> task(std::move(fn));
    auto f = task.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
    return f;
  }

 private:
  void loop() {
    for (;;) {
      std::packaged_task<Reply()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<Reply()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace examples
