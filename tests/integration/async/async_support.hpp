// SPDX-License-Identifier: MIT
// Helpers of the asynchronous tests: run a loop until a condition holds, servers that never
// answer or never accept (timeouts without a mock of Redis or PostgreSQL), a closed port, and
// the pid of the shared redis-server (kill -9, SIGSTOP).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/async/net.hpp"

namespace idem::test {

/// Runs `io` until `done()` or `limit` passed. @return done().
inline bool run_until(idem::async::net::io_context& io, const std::function<bool()>& done,
                      std::chrono::milliseconds limit = std::chrono::milliseconds(10'000)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!done() && std::chrono::steady_clock::now() < end) {
    io.restart();
    io.run_for(std::chrono::milliseconds(5));
  }
  return done();
}

/// A loopback listening socket; port() is where it listens.
class Listener {
 public:
  explicit Listener(int backlog) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(fd_, backlog) != 0) {
      throw std::runtime_error("listener: bind/listen failed");
    }
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
  }
  ~Listener() {
    if (fd_ >= 0) ::close(fd_);
  }
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  int port() const noexcept { return port_; }
  int fd() const noexcept { return fd_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

/// A port nothing listens on (bound, then closed: connects are refused).
inline int closed_port() {
  Listener l(1);
  return l.port();
}

/// Accepts connections and reads what they send, never answering (a server that hangs).
class SilentServer {
 public:
  SilentServer() : listener_(16) {
    thread_ = std::thread([this] {
      while (!stop_) {
        int c = ::accept(listener_.fd(), nullptr, nullptr);
        if (c < 0) break;
        clients_.push_back(c);
      }
    });
  }
  ~SilentServer() {
    stop_ = true;
    ::shutdown(listener_.fd(), SHUT_RDWR);
    thread_.join();
    for (int c : clients_) ::close(c);
  }
  SilentServer(const SilentServer&) = delete;
  SilentServer& operator=(const SilentServer&) = delete;
  int port() const noexcept { return listener_.port(); }
  /// Connections accepted so far (read on this thread after the loop stopped).
  std::size_t accepted() const noexcept { return clients_.size(); }

 private:
  Listener listener_;
  std::atomic<bool> stop_{false};
  std::vector<int> clients_;
  std::thread thread_;
};

/// A listener whose accept queue is full (backlog 0, filled by one connection it never
/// accepts): further connects hang in SYN-SENT, so a connect can only time out.
class UnacceptingServer {
 public:
  UnacceptingServer() : listener_(0) {
    for (int i = 0; i < 2; ++i) {
      int s = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<std::uint16_t>(listener_.port()));
      (void)::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
      fillers_.push_back(s);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ~UnacceptingServer() {
    for (int s : fillers_) ::close(s);
  }
  UnacceptingServer(const UnacceptingServer&) = delete;
  UnacceptingServer& operator=(const UnacceptingServer&) = delete;
  int port() const noexcept { return listener_.port(); }

 private:
  Listener listener_;
  std::vector<int> fillers_;
};

/// The pid of scripts/servers.sh's redis-server ($IDEM_SERVERS_DIR/redis.pid), or 0.
inline int redis_server_pid() {
  const char* dir = std::getenv("IDEM_SERVERS_DIR");
  if (dir == nullptr) return 0;
  std::ifstream in(std::string(dir) + "/redis.pid");
  int pid = 0;
  in >> pid;
  return pid;
}

}  // namespace idem::test
