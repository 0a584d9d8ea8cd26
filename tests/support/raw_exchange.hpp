// SPDX-License-Identifier: MIT
// A raw TCP exchange with a loopback server: for requests an HTTP client library would not
// send as they are (over-long header lines, a request split across a pause).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace idem::test {

/// Connects to `host`:`port`, sends each of `parts` with `pause` between them, closes the
/// sending side and returns everything the server sent until it closed the connection (or
/// sent nothing for 10 s). Throws std::runtime_error when it cannot connect or send.
inline std::string exchange_raw(const std::string& host, int port,
                                const std::vector<std::string>& parts,
                                std::chrono::milliseconds pause) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("exchange_raw: socket failed");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    throw std::runtime_error("exchange_raw: cannot connect to " + host + ":" +
                             std::to_string(port));
  }
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (std::size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) std::this_thread::sleep_for(pause);
    std::size_t sent = 0;
    while (sent < parts[i].size()) {
      const ssize_t n = ::send(fd, parts[i].data() + sent, parts[i].size() - sent, MSG_NOSIGNAL);
      if (n <= 0) throw std::runtime_error("exchange_raw: send failed");
      sent += static_cast<std::size_t>(n);
    }
  }
  ::shutdown(fd, SHUT_WR);
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

}  // namespace idem::test
