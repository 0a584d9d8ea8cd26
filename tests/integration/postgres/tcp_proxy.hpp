// SPDX-License-Identifier: MIT
// A loopback TCP proxy in front of PostgreSQL that can lose the connection right after
// forwarding a COMMIT (or another statement): the server commits, the client never hears back (a network failure at
// the worst moment, without a mock of PostgreSQL). It can also stall: stop forwarding in both
// directions without closing anything, as a hung middlebox or a partition behind a live TCP
// peer does (the client's kernel still sees its bytes acknowledged).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace idem::test {

class CommitDroppingProxy {
 public:
  /// Forwards <listen_address>:<port()> to 127.0.0.1:<upstream_port>. `listen_address` is
  /// host order: another loopback address (127.0.0.2) makes the server another host name.
  explicit CommitDroppingProxy(int upstream_port, std::uint32_t listen_address = INADDR_LOOPBACK)
      : upstream_port_(upstream_port) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(listen_address);
    a.sin_port = 0;
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(listen_fd_, 64) != 0) {
      throw std::runtime_error("proxy: bind/listen failed");
    }
    socklen_t len = sizeof a;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  ~CommitDroppingProxy() {
    stop_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);
    acceptor_.join();
    ::close(listen_fd_);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& t : workers_) t.join();
  }
  CommitDroppingProxy(const CommitDroppingProxy&) = delete;
  CommitDroppingProxy& operator=(const CommitDroppingProxy&) = delete;

  int port() const noexcept { return port_; }
  /// The next client chunk containing `drop_pattern` is forwarded, then both sides are closed.
  std::atomic<bool> drop_next_commit{false};
  /// What drop_next_commit looks for (set it before setting drop_next_commit): "COMMIT", or
  /// e.g. the name of a prepared statement its Bind message carries.
  std::string drop_pattern = "COMMIT";
  /// With drop_next_commit: the chunk is not forwarded either (the request is lost on its way,
  /// not its answer; the server never runs it).
  std::atomic<bool> lose_request{false};
  /// Connections dropped that way.
  std::atomic<int> dropped{0};
  /// While true nothing is forwarded, on open connections and new ones; nothing is closed.
  std::atomic<bool> stalled{false};

 private:
  void accept_loop() {
    while (!stop_) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      int client = ::accept(listen_fd_, nullptr, nullptr);
      if (client < 0) continue;
      std::lock_guard<std::mutex> lock(mutex_);
      workers_.emplace_back([this, client] { serve(client); });
    }
  }

  void serve(int client) {
    int server = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(upstream_port_));
    if (::connect(server, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(server);
      ::close(client);
      return;
    }
    char buf[65536];
    while (!stop_) {
      if (stalled.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      pollfd p[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
      if (::poll(p, 2, 100) <= 0) continue;
      if (p[0].revents != 0) {
        ssize_t n = ::recv(client, buf, sizeof buf, 0);
        if (n <= 0) break;
        if (drop_next_commit.load() &&
            std::string(buf, static_cast<std::size_t>(n)).find(drop_pattern) != std::string::npos) {
          drop_next_commit = false;
          ++dropped;
          // The server got COMMIT; the client never gets the answer (or, losing the request,
          // neither gets anything).
          if (!lose_request.load()) (void)send_all(server, buf, n);
          break;
        }
        if (!send_all(server, buf, n)) break;
      }
      if (p[1].revents != 0) {
        ssize_t n = ::recv(server, buf, sizeof buf, 0);
        if (n <= 0 || !send_all(client, buf, n)) break;
      }
    }
    ::close(client);
    ::close(server);
  }

  static bool send_all(int fd, const char* data, ssize_t n) {
    while (n > 0) {
      ssize_t w = ::send(fd, data, static_cast<std::size_t>(n), MSG_NOSIGNAL);
      if (w <= 0) return false;
      data += w;
      n -= w;
    }
    return true;
  }

  int upstream_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  std::mutex mutex_;
  std::vector<std::thread> workers_;
};

}  // namespace idem::test
