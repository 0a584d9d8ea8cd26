// SPDX-License-Identifier: MIT
// A loopback TCP proxy that delays every byte by a fixed one-way latency in each direction, to
// run a benchmark as if its servers were on another host (where round trips, not server CPU,
// bound a request loop). tc netem is not available on these machines.
//
// Each direction of a connection is a delay line: a reader thread stamps each chunk it reads
// with "due = now + latency" and queues it; a writer thread writes chunks in order once due.
// Pipelined traffic is not serialised (many chunks can be in flight), so a round trip costs
// 2 x latency plus the servers' and client's own work. The proxy's threads run on `cpu`
// (the benchmarks pin servers and driver to another one).
//
// It also counts round trips: a chunk from the client that follows a reply chunk (or opens the
// connection) starts one; chunks the client pipelines before any reply belong to the same one.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace idem::bench {

class LatencyProxy {
 public:
  /// Forwards 127.0.0.1:<port()> to 127.0.0.1:<upstream_port>, `one_way` each direction.
  LatencyProxy(int upstream_port, std::chrono::microseconds one_way, int cpu)
      : upstream_port_(upstream_port), one_way_(one_way), cpu_(cpu) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(listen_fd_, 64) != 0) {
      throw std::runtime_error("latency proxy: bind/listen failed");
    }
    socklen_t len = sizeof a;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] {
      pin();
      accept_loop();
    });
  }
  ~LatencyProxy() {
    stop_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);
    acceptor_.join();
    ::close(listen_fd_);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& l : lines_) l->close();
    for (auto& t : threads_) t.join();
  }
  LatencyProxy(const LatencyProxy&) = delete;
  LatencyProxy& operator=(const LatencyProxy&) = delete;

  int port() const noexcept { return port_; }

  /// Round trips the clients of all connections started so far (see above).
  std::uint64_t round_trips() const noexcept {
    return round_trips_.load(std::memory_order_relaxed);
  }

 private:
  using Clock = std::chrono::steady_clock;

  // What the two directions of one connection share to count its round trips.
  struct Turns {
    std::atomic<std::uint64_t> replies{0};   // chunks read from the server so far
    std::uint64_t seen = ~std::uint64_t{0};  // `replies` at the client's last chunk (up reader)
    std::atomic<std::uint64_t>* total = nullptr;
  };

  // One direction of one connection: from `in` to `out`, each chunk `latency` later.
  struct Line {
    int in, out;
    std::chrono::microseconds latency;
    std::shared_ptr<Turns> turns;
    bool upstream = false;  // client -> server
    std::mutex m;
    std::condition_variable cv;
    std::deque<std::pair<Clock::time_point, std::string>> queue;
    bool eof = false, closed = false;

    void read_loop() {
      char buf[65536];
      for (;;) {
        ssize_t n = ::recv(in, buf, sizeof buf, 0);
        std::lock_guard<std::mutex> lock(m);
        if (n <= 0 || closed) {
          eof = true;
          cv.notify_one();
          return;
        }
        // A reply is counted before it is forwarded, so before the client can answer it.
        if (!upstream) {
          turns->replies.fetch_add(1, std::memory_order_release);
        } else if (const auto r = turns->replies.load(std::memory_order_acquire);
                   r != turns->seen) {
          turns->seen = r;
          turns->total->fetch_add(1, std::memory_order_relaxed);
        }
        queue.emplace_back(Clock::now() + latency, std::string(buf, static_cast<std::size_t>(n)));
        cv.notify_one();
      }
    }
    void write_loop() {
      for (;;) {
        std::pair<Clock::time_point, std::string> chunk;
        {
          std::unique_lock<std::mutex> lock(m);
          cv.wait(lock, [&] { return !queue.empty() || eof || closed; });
          if (queue.empty()) break;  // eof or closed, everything delivered
          chunk = std::move(queue.front());
          queue.pop_front();
        }
        std::this_thread::sleep_until(chunk.first);
        std::size_t off = 0;
        while (off < chunk.second.size()) {
          ssize_t w =
              ::send(out, chunk.second.data() + off, chunk.second.size() - off, MSG_NOSIGNAL);
          if (w <= 0) {
            close();
            return;
          }
          off += static_cast<std::size_t>(w);
        }
      }
      ::shutdown(out, SHUT_WR);
    }
    void close() {
      std::lock_guard<std::mutex> lock(m);
      closed = true;
      ::shutdown(in, SHUT_RDWR);
      cv.notify_one();
    }
  };

  void pin() {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu_, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  }

  void accept_loop() {
    while (!stop_) {
      int client = ::accept(listen_fd_, nullptr, nullptr);
      if (client < 0) return;
      int server = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<std::uint16_t>(upstream_port_));
      if (::connect(server, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
        ::close(client);
        ::close(server);
        continue;
      }
      int one = 1;
      ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      ::setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      auto turns = std::make_shared<Turns>();
      turns->total = &round_trips_;
      auto up = std::make_shared<Line>();
      up->in = client;
      up->out = server;
      up->latency = one_way_;
      up->turns = turns;
      up->upstream = true;
      auto down = std::make_shared<Line>();
      down->in = server;
      down->out = client;
      down->latency = one_way_;
      down->turns = turns;
      std::lock_guard<std::mutex> lock(mutex_);
      lines_.push_back(up);
      lines_.push_back(down);
      // One thread per connection runs its four loops and closes both sockets after them.
      threads_.emplace_back([this, up, down, client, server] {
        std::vector<std::thread> loops;
        for (const auto& l : {up, down}) {
          loops.emplace_back([this, l] {
            pin();
            l->read_loop();
          });
          loops.emplace_back([this, l] {
            pin();
            l->write_loop();
          });
        }
        for (auto& t : loops) t.join();
        ::close(client);
        ::close(server);
      });
    }
  }

  int upstream_port_;
  std::chrono::microseconds one_way_;
  int cpu_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> round_trips_{0};
  std::thread acceptor_;
  std::mutex mutex_;
  std::vector<std::shared_ptr<Line>> lines_;
  std::vector<std::thread> threads_;
};

}  // namespace idem::bench
