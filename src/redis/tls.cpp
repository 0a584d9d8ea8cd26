// SPDX-License-Identifier: MIT
// TLS connections and their relay thread for rediss:// (see tls.hpp).
#include "tls.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "errors.hpp"
#include "idem/errors.hpp"

namespace idem::redis::detail {
namespace {

using Clock = std::chrono::steady_clock;

struct SslDeleter {
  void operator()(SSL* s) const noexcept { SSL_free(s); }
};
using SslPtr = std::unique_ptr<SSL, SslDeleter>;

// A file descriptor closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const noexcept { return fd_; }
  int release() noexcept { return std::exchange(fd_, -1); }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// The OpenSSL error queue as one line (emptied).
std::string ssl_errors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out;
}

[[noreturn]] void fail_io(const std::string& what, int err) {
  throw_error(Failure{Failure::Kind::kContext, what, std::strerror(err), REDIS_ERR_IO, err});
}

[[noreturn]] void fail_tls(const std::string& what, const std::string& why) {
  throw_error(Failure{Failure::Kind::kTls, what, why});
}

[[noreturn]] void fail_timeout(const std::string& what, const char* during) {
  throw_error(Failure{Failure::Kind::kContext, what, std::string(during) + ": timed out",
                      REDIS_ERR_IO, ETIMEDOUT});
}

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(left.count());
}

// Waits until `fd` is ready for `events` or the deadline passes. false: timed out.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, remaining_ms(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return true;  // let the next call report the error
  }
}

// Keeps a write to a connection the server reset from raising SIGPIPE in this thread (the
// write then fails with EPIPE, reported as the server gone); a SIGPIPE it left pending is
// consumed. OpenSSL writes with write(2), which has no MSG_NOSIGNAL.
class SigpipeBlock {
 public:
  SigpipeBlock() noexcept {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    blocked_ = pthread_sigmask(SIG_BLOCK, &pipe_, &old_) == 0;
  }
  ~SigpipeBlock() {
    if (!blocked_) return;
    sigset_t pending;
    sigpending(&pending);
    if (!was_pending_ && sigismember(&pending, SIGPIPE) == 1) {
      timespec zero{0, 0};
      (void)sigtimedwait(&pipe_, nullptr, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeBlock(const SigpipeBlock&) = delete;
  SigpipeBlock& operator=(const SigpipeBlock&) = delete;

 private:
  sigset_t pipe_{};
  sigset_t old_{};
  bool was_pending_ = false;
  bool blocked_ = false;
};

bool set_nonblocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

// A non-blocking TCP connection to host:port within the deadline (every address tried).
Fd tcp_connect(const Endpoint& ep, Clock::time_point deadline, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(ep.port);
  int rc = ::getaddrinfo(ep.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    throw_error(Failure{Failure::Kind::kContext, what,
                        std::string("cannot resolve '") + ep.host + "': " + gai_strerror(rc),
                        REDIS_ERR_OTHER, 0});
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owned(res, ::freeaddrinfo);
  int last = ECONNREFUSED;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
    if (fd.get() < 0) {
      last = errno;
      continue;
    }
    if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last = errno;
        continue;
      }
      if (!wait_fd(fd.get(), POLLOUT, deadline)) fail_timeout(what, "TCP connect");
      int err = 0;
      socklen_t len = sizeof err;
      if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      if (err != 0) {
        last = err;
        continue;
      }
    }
    int one = 1;
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // as hiredis does
    return fd;
  }
  fail_io(what, last);
}

bool is_ip_literal(const std::string& host) {
  in6_addr a6{};
  in_addr a4{};
  return ::inet_pton(AF_INET, host.c_str(), &a4) == 1 ||
         ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}

// Runs an SSL operation until it completes or the deadline passes (non-blocking socket).
// Returns the operation's positive result; throws on failure.
template <class Op>
int drive(SSL* ssl, int fd, Clock::time_point deadline, const std::string& what, const char* during,
          Op op) {
  for (;;) {
    ERR_clear_error();
    errno = 0;
    int r = op();
    if (r > 0) return r;
    int e = SSL_get_error(ssl, r);
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
      if (!wait_fd(fd, e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline)) {
        fail_timeout(what, during);
      }
      continue;
    }
    long verify = SSL_get_verify_result(ssl);
    if (verify != X509_V_OK) {
      fail_tls(what, std::string("certificate verification failed: ") +
                         X509_verify_cert_error_string(verify));
    }
    std::string lib = ssl_errors();
    if (e == SSL_ERROR_ZERO_RETURN || (e == SSL_ERROR_SYSCALL && lib.empty())) {
      if (errno != 0 && errno != ECONNRESET && errno != EPIPE) fail_io(what, errno);
      // The server hung up: during the handshake or the first reply, that is its refusal of
      // this client (no or an unknown client certificate) or a server that speaks no TLS.
      fail_tls(what, std::string("the server closed the connection during the ") + during +
                         " (does it require a client certificate, or not speak TLS here?)");
    }
    fail_tls(what, std::string(during) + " failed: " + (lib.empty() ? "unknown error" : lib));
  }
}

// One PING through the fresh session, answered by any reply line: proves the server accepted
// this client (a TLS 1.3 server rejects a client certificate only after the handshake).
void ping(SSL* ssl, int fd, Clock::time_point deadline, const std::string& what) {
  static constexpr char kPing[] = "*1\r\n$4\r\nPING\r\n";
  drive(ssl, fd, deadline, what, "first round trip",
        [&] { return SSL_write(ssl, kPing, static_cast<int>(sizeof kPing - 1)); });
  std::string reply;
  while (reply.find("\r\n") == std::string::npos) {
    char buf[256];
    int n = drive(ssl, fd, deadline, what, "first round trip",
                  [&] { return SSL_read(ssl, buf, static_cast<int>(sizeof buf)); });
    reply.append(buf, static_cast<std::size_t>(n));
    if (reply.size() > 4096) fail_tls(what, "unexpected answer to PING");
  }
  // +PONG, or an error such as -NOAUTH (AUTH follows through hiredis): either is a Redis
  // server talking through the session.
  if (reply[0] != '+' && reply[0] != '-') fail_tls(what, "the server's answer is not Redis");
}

// One TLS session and the local socket hiredis holds the other end of.
struct Tunnel {
  Fd plain;  // our end of the socketpair (non-blocking)
  Fd net;    // the TCP connection (non-blocking)
  SslPtr ssl;
  std::vector<char> up;  // read from hiredis, not yet written to TLS
  std::size_t up_off = 0;
  std::vector<char> down;  // read from TLS, not yet written to hiredis
  std::size_t down_off = 0;
  bool write_wants_read = false;
  bool write_wants_write = false;
  bool read_wants_write = false;
};

constexpr std::size_t kChunk = 16 * 1024;

// Moves whatever can move without blocking. false: the tunnel is finished (either side closed
// or failed); it is then closed, which hiredis reads as EOF.
bool pump(Tunnel& t) {
  char buf[kChunk];
  for (bool progress = true; progress;) {
    progress = false;
    if (t.up_off == t.up.size()) {
      ssize_t n = ::read(t.plain.get(), buf, sizeof buf);
      if (n > 0) {
        t.up.assign(buf, buf + n);
        t.up_off = 0;
        progress = true;
      } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        return false;  // hiredis closed its end (redisFree)
      }
    }
    if (t.up_off < t.up.size()) {
      t.write_wants_read = t.write_wants_write = false;
      ERR_clear_error();
      int r =
          SSL_write(t.ssl.get(), t.up.data() + t.up_off, static_cast<int>(t.up.size() - t.up_off));
      if (r > 0) {
        t.up_off += static_cast<std::size_t>(r);
        progress = true;
      } else {
        int e = SSL_get_error(t.ssl.get(), r);
        if (e == SSL_ERROR_WANT_READ) {
          t.write_wants_read = true;
        } else if (e == SSL_ERROR_WANT_WRITE) {
          t.write_wants_write = true;
        } else {
          return false;
        }
      }
    }
    if (t.down_off == t.down.size()) {
      t.read_wants_write = false;
      ERR_clear_error();
      int r = SSL_read(t.ssl.get(), buf, static_cast<int>(sizeof buf));
      if (r > 0) {
        t.down.assign(buf, buf + r);
        t.down_off = 0;
        progress = true;
      } else {
        int e = SSL_get_error(t.ssl.get(), r);
        if (e == SSL_ERROR_WANT_WRITE) {
          t.read_wants_write = true;
        } else if (e != SSL_ERROR_WANT_READ) {
          return false;  // close_notify, reset, or a TLS error
        }
      }
    }
    if (t.down_off < t.down.size()) {
      ssize_t n = ::send(t.plain.get(), t.down.data() + t.down_off, t.down.size() - t.down_off,
                         MSG_NOSIGNAL);
      if (n > 0) {
        t.down_off += static_cast<std::size_t>(n);
        progress = true;
      } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

class IDEM_LOCAL TlsConnector::Impl {
 public:
  Impl(const TlsOptions& o, const std::string& who) : options_(o) {
    ctx_ = SSL_CTX_new(TLS_client_method());
    if (ctx_ == nullptr) throw UsageError("idem::redis: TLS: " + ssl_errors());
    SSL_CTX_set_min_proto_version(ctx_, TLS1_2_VERSION);
    SSL_CTX_set_verify(ctx_, SSL_VERIFY_PEER, nullptr);
    SSL_CTX_set_mode(ctx_, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    try {
      if (!o.ca_file.empty()) {
        if (SSL_CTX_load_verify_locations(ctx_, o.ca_file.c_str(), nullptr) != 1) {
          throw UsageError("idem::redis: " + who + "::tls.ca_file '" + o.ca_file +
                           "' cannot be read as PEM certificates: " + ssl_errors());
        }
      } else if (SSL_CTX_set_default_verify_paths(ctx_) != 1) {
        throw UsageError("idem::redis: TLS: the system's CA certificates: " + ssl_errors());
      }
      if (o.cert_file.empty() != o.key_file.empty()) {
        throw UsageError("idem::redis: " + who +
                         "::tls.cert_file and tls.key_file go together (one is empty)");
      }
      if (!o.cert_file.empty()) {
        if (SSL_CTX_use_certificate_chain_file(ctx_, o.cert_file.c_str()) != 1) {
          throw UsageError("idem::redis: " + who + "::tls.cert_file '" + o.cert_file +
                           "' cannot be read: " + ssl_errors());
        }
        if (SSL_CTX_use_PrivateKey_file(ctx_, o.key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
            SSL_CTX_check_private_key(ctx_) != 1) {
          throw UsageError("idem::redis: " + who + "::tls.key_file '" + o.key_file +
                           "' cannot be read or does not match the certificate: " + ssl_errors());
        }
      }
    } catch (...) {
      SSL_CTX_free(ctx_);
      throw;
    }
  }

  ~Impl() {
    if (thread_.joinable()) {
      stop_.store(true);
      wake();
      thread_.join();
    }
    SSL_CTX_free(ctx_);
  }

  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  int open(const Endpoint& ep, std::chrono::milliseconds timeout, const std::string& what) {
    const auto deadline = Clock::now() + timeout;
    SigpipeBlock no_sigpipe;
    Tunnel t;
    t.net = tcp_connect(ep, deadline, what);
    t.ssl.reset(SSL_new(ctx_));
    if (!t.ssl) fail_tls(what, ssl_errors());
    SSL* ssl = t.ssl.get();
    const std::string& name = options_.server_name.empty() ? ep.host : options_.server_name;
    if (is_ip_literal(name)) {
      // An address is matched against the certificate's IP entries; SNI carries names only.
      if (X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), name.c_str()) != 1) {
        fail_tls(what, "cannot check the server's address '" + name + "'");
      }
    } else {
      SSL_set_hostflags(ssl, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
      if (SSL_set1_host(ssl, name.c_str()) != 1 ||
          // SSL_set_tlsext_host_name, whose macro casts the C way
          SSL_ctrl(ssl, SSL_CTRL_SET_TLSEXT_HOSTNAME, TLSEXT_NAMETYPE_host_name,
                   const_cast<char*>(name.c_str())) != 1) {
        fail_tls(what, "cannot check the server's name '" + name + "'");
      }
    }
    if (SSL_set_fd(ssl, t.net.get()) != 1) fail_tls(what, ssl_errors());
    try {
      drive(ssl, t.net.get(), deadline, what,
            "TLS handshake (does the server speak TLS on this port?)",
            [&] { return SSL_connect(ssl); });
      ping(ssl, t.net.get(), deadline, what);
    } catch (const StorageError& e) {
      if (e.code() != errc::kStorageError) throw;
      // Certificate and handshake failures say what was checked.
      throw StorageError(std::string(e.what()) + " (server name '" + name + "', CAs: " +
                         (options_.ca_file.empty() ? "the system's" : options_.ca_file) + ")");
    }
    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) fail_io(what, errno);
    Fd theirs(pair[0]);
    t.plain = Fd(pair[1]);
    if (!set_nonblocking(t.plain.get())) fail_io(what, errno);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!thread_.joinable()) {
        wake_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
        if (wake_.get() < 0) fail_io(what, errno);
        thread_ = std::thread([this] { relay(); });
      }
      incoming_.push_back(std::move(t));
    }
    wake();
    return theirs.release();
  }

  std::size_t tunnels() const { return count_.load(); }

 private:
  void wake() noexcept {
    std::uint64_t one = 1;
    if (wake_.get() >= 0) (void)!::write(wake_.get(), &one, sizeof one);
  }

  // The relay thread: every tunnel of this connector, one poll() over all of them.
  void relay() {
    // This thread never takes SIGPIPE: a write to a reset connection fails with EPIPE.
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    std::vector<Tunnel> tunnels;
    std::vector<pollfd> fds;
    while (!stop_.load()) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto& t : incoming_) tunnels.push_back(std::move(t));
        incoming_.clear();
      }
      for (std::size_t i = 0; i < tunnels.size();) {
        if (pump(tunnels[i])) {
          ++i;
          continue;
        }
        SSL_shutdown(tunnels[i].ssl.get());  // best effort close_notify; never waits
        tunnels[i] = std::move(tunnels.back());
        tunnels.pop_back();
      }
      count_.store(tunnels.size());
      fds.clear();
      fds.push_back(pollfd{wake_.get(), POLLIN, 0});
      for (const Tunnel& t : tunnels) {
        const bool up_empty = t.up_off == t.up.size();
        const bool down_empty = t.down_off == t.down.size();
        short plain = static_cast<short>((up_empty ? POLLIN : 0) | (down_empty ? 0 : POLLOUT));
        short net = static_cast<short>(((down_empty || t.write_wants_read) ? POLLIN : 0) |
                                       ((t.read_wants_write || t.write_wants_write) ? POLLOUT : 0));
        fds.push_back(pollfd{t.plain.get(), plain, 0});
        fds.push_back(pollfd{t.net.get(), net, 0});
      }
      if (::poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) break;
      if (fds[0].revents & POLLIN) {
        std::uint64_t n;
        (void)!::read(wake_.get(), &n, sizeof n);
      }
    }
    count_.store(0);
    // Closing the tunnels closes our ends: hiredis contexts still open read EOF.
  }

  TlsOptions options_;
  SSL_CTX* ctx_ = nullptr;
  std::mutex mutex_;
  std::vector<Tunnel> incoming_;
  Fd wake_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> count_{0};
};

TlsConnector::TlsConnector(const TlsOptions& options, const std::string& who)
    : impl_(std::make_unique<Impl>(options, who)) {}
TlsConnector::~TlsConnector() = default;

int TlsConnector::open(const Endpoint& ep, std::chrono::milliseconds timeout,
                       const std::string& what) {
  return impl_->open(ep, timeout, what);
}

std::size_t TlsConnector::tunnels() const { return impl_->tunnels(); }

std::shared_ptr<TlsConnector> make_tls(const Endpoint& ep, const TlsOptions& options,
                                       const std::string& who) {
  if (!ep.tls) {
    if (options.any()) {
      throw UsageError("idem::redis: " + who + "::tls is set but the URI '" + ep.display +
                       "' is not rediss:// (it would connect without TLS)");
    }
    return nullptr;
  }
  return std::make_shared<TlsConnector>(options, who);
}

}  // namespace idem::redis::detail
