// SPDX-License-Identifier: MIT
// The reliability suite's line protocol between the driver and the payment service, over a
// loopback TCP socket. One request line, one answer line:
//
//   PAY <hex key id> <account> <amount>   ->  OK executed <payment no> | OK replayed <payment no>
//                                             | BUSY | MISMATCH | ERR <errc_name> | UNTYPED <text>
//   STATS                                 ->  STATS name=value name=value ...
//
// The key id travels hex-encoded so hostile ids (spaces, control bytes, empty) reach the
// service intact and are judged by idem::Key, not by the protocol.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace idem::reliability {

/// Lower-case hex of every byte of `s`.
inline std::string hex_encode(std::string_view s) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(s.size() * 2);
  for (unsigned char c : s) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

/// Inverse of hex_encode; nullopt on a malformed string.
inline std::optional<std::string> hex_decode(std::string_view s) {
  if (s.size() % 2 != 0) return std::nullopt;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::string out;
  for (std::size_t i = 0; i < s.size(); i += 2) {
    int hi = nibble(s[i]), lo = nibble(s[i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out.push_back(static_cast<char>(hi * 16 + lo));
  }
  return out;
}

/// A connected socket reading and writing whole lines (buffered reads).
class LineSocket {
 public:
  explicit LineSocket(int fd) : fd_(fd) {}
  LineSocket(const LineSocket&) = delete;
  LineSocket& operator=(const LineSocket&) = delete;
  ~LineSocket() {
    if (fd_ >= 0) ::close(fd_);
  }

  /// Connects to 127.0.0.1:port; nullopt-like (fd < 0) on failure. `timeout_ms` bounds reads.
  static int connect_loopback(std::uint16_t port, int timeout_ms) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      ::close(fd);
      return -1;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
  }

  bool ok() const { return fd_ >= 0; }

  /// Writes `line` plus '\n'. false on failure.
  bool write_line(std::string line) {
    line.push_back('\n');
    std::size_t off = 0;
    while (off < line.size()) {
      ssize_t n = ::send(fd_, line.data() + off, line.size() - off, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      off += static_cast<std::size_t>(n);
    }
    return true;
  }

  /// Reads one line (without '\n'); nullopt on EOF, error or timeout.
  std::optional<std::string> read_line() {
    for (;;) {
      auto nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      char tmp[4096];
      ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return std::nullopt;
      buf_.append(tmp, static_cast<std::size_t>(n));
      if (buf_.size() > (1u << 20)) return std::nullopt;
    }
  }

 private:
  int fd_;
  std::string buf_;
};

}  // namespace idem::reliability
