// SPDX-License-Identifier: MIT
// The benchmarks' delay line (bench/common/latency_proxy.hpp): it forwards bytes both ways, and
// counts round trips the way bench/mq reports them (a client chunk after a reply starts one;
// chunks pipelined before a reply belong to it). Loopback only; no timing is asserted.
#include "../../bench/common/latency_proxy.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace {

// A server that answers, on every connection, "ok" each time a '!' arrives, so a request the client
// sends in several chunks gets one reply.
class BangServer {
 public:
  BangServer() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::listen(fd_, 4), 0);
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] {
      for (;;) {
        int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) return;
        connections_.emplace_back([c] {
          char buf[256];
          for (;;) {
            ssize_t n = ::recv(c, buf, sizeof buf, 0);
            if (n <= 0) break;
            for (ssize_t i = 0; i < n; ++i) {
              if (buf[i] == '!') ::send(c, "ok", 2, MSG_NOSIGNAL);
            }
          }
          ::close(c);
        });
      }
    });
  }
  // The test closes its client sockets first, so every connection thread ends.
  ~BangServer() {
    ::shutdown(fd_, SHUT_RDWR);
    acceptor_.join();
    for (auto& t : connections_) t.join();
    ::close(fd_);
  }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::thread acceptor_;
  std::vector<std::thread> connections_;  // touched by acceptor_ only until it is joined
};

int connect_to(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

void send_all(int fd, const std::string& s) {
  ASSERT_EQ(::send(fd, s.data(), s.size(), MSG_NOSIGNAL), static_cast<ssize_t>(s.size()));
}

std::string recv_exactly(int fd, std::size_t n) {
  std::string out;
  char buf[64];
  while (out.size() < n) {
    ssize_t r = ::recv(fd, buf, std::min(sizeof buf, n - out.size()), 0);
    if (r <= 0) break;
    out.append(buf, static_cast<std::size_t>(r));
  }
  return out;
}

// The up direction counts a round trip when it reads a chunk; waits until it has read `n`.
bool wait_for_trips(const idem::bench::LatencyProxy& p, std::uint64_t n) {
  for (int i = 0; i < 2000 && p.round_trips() < n; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return p.round_trips() == n;
}

TEST(LatencyProxy, CountsEachPingPongAsOneRoundTrip) {
  BangServer server;
  idem::bench::LatencyProxy proxy(server.port(), std::chrono::microseconds(50), 0);
  int c = connect_to(proxy.port());
  EXPECT_EQ(proxy.round_trips(), 0u);  // connecting sends no data
  for (int i = 0; i < 5; ++i) {
    send_all(c, "ping!");
    EXPECT_EQ(recv_exactly(c, 2), "ok");
  }
  EXPECT_TRUE(wait_for_trips(proxy, 5)) << proxy.round_trips();
  ::close(c);
}

TEST(LatencyProxy, CountsChunksPipelinedBeforeAReplyAsOneRoundTrip) {
  BangServer server;
  idem::bench::LatencyProxy proxy(server.port(), std::chrono::microseconds(50), 0);
  int c = connect_to(proxy.port());
  // Three separate sends, one request: the server answers only at the '!'.
  send_all(c, "a");
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  send_all(c, "b");
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  send_all(c, "c!");
  EXPECT_EQ(recv_exactly(c, 2), "ok");
  EXPECT_TRUE(wait_for_trips(proxy, 1)) << proxy.round_trips();
  // After the reply, the next chunk is a new round trip; two requests pipelined in one send
  // are one round trip with two replies.
  send_all(c, "x!y!");
  EXPECT_EQ(recv_exactly(c, 4), "okok");
  EXPECT_TRUE(wait_for_trips(proxy, 2)) << proxy.round_trips();
  ::close(c);
}

TEST(LatencyProxy, SumsRoundTripsOverConnections) {
  BangServer server;
  idem::bench::LatencyProxy proxy(server.port(), std::chrono::microseconds(0), 0);
  int c1 = connect_to(proxy.port());
  int c2 = connect_to(proxy.port());
  send_all(c1, "1!");
  EXPECT_EQ(recv_exactly(c1, 2), "ok");
  send_all(c2, "2!");
  EXPECT_EQ(recv_exactly(c2, 2), "ok");
  send_all(c1, "3!");
  EXPECT_EQ(recv_exactly(c1, 2), "ok");
  EXPECT_TRUE(wait_for_trips(proxy, 3)) << proxy.round_trips();
  ::close(c1);
  ::close(c2);
}

}  // namespace
