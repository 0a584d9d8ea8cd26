// SPDX-License-Identifier: MIT
// A bounded, thread-safe pool of hiredis connections (see pool.hpp).
#include "pool.hpp"

#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <exception>
#include <string>
#include <utility>

#include "errors.hpp"
#include "idem/errors.hpp"

namespace idem::redis::detail {
namespace {

timeval to_timeval(std::chrono::milliseconds ms) noexcept {
  timeval tv{};
  tv.tv_sec = static_cast<decltype(tv.tv_sec)>(ms.count() / 1000);
  tv.tv_usec = static_cast<decltype(tv.tv_usec)>((ms.count() % 1000) * 1000);
  return tv;
}

// Runs one setup command (AUTH, SELECT) on a fresh connection; throws on any failure.
void setup_command(redisContext* c, int argc, const char** argv, const std::size_t* lens,
                   const std::string& what) {
  errno = 0;
  ReplyUPtr reply(static_cast<redisReply*>(redisCommandArgv(c, argc, argv, lens)));
  int saved_errno = errno;
  if (!reply) {
    throw_error(Failure{Failure::Kind::kContext, what, c->errstr, c->err, saved_errno});
  }
  if (reply->type == REDIS_REPLY_ERROR) {
    throw_error(Failure{Failure::Kind::kServer, what, std::string_view(reply->str, reply->len)});
  }
}

}  // namespace

Pool::Pool(PoolSettings settings) : settings_(std::move(settings)) {
  idle_.reserve(settings_.size);
}

Pool::~Pool() = default;

Pool::Connection Pool::connect() {
  const Endpoint& ep = settings_.endpoint;
  const std::string what = "connect to " + ep.display;
  const timeval connect_tv = to_timeval(settings_.connect_timeout);
  errno = 0;
  ContextUPtr ctx;
  if (settings_.tls) {
    // TCP, handshake and one PING over TLS (typed failures), then hiredis on the relay's end.
    const int fd = settings_.tls->open(ep, settings_.connect_timeout, what);
    ctx.reset(redisConnectFd(fd));
    if (!ctx) ::close(fd);
  } else {
    ctx.reset(ep.unix_socket ? redisConnectUnixWithTimeout(ep.path.c_str(), connect_tv)
                             : redisConnectWithTimeout(ep.host.c_str(), ep.port, connect_tv));
  }
  int saved_errno = errno;
  if (!ctx) {
    throw_error(
        Failure{Failure::Kind::kContext, what, "cannot allocate a context", REDIS_ERR_OOM, 0});
  }
  if (ctx->err != 0) {
    throw_error(Failure{Failure::Kind::kContext, what, ctx->errstr, ctx->err, saved_errno});
  }
  // AUTH and SELECT answer within the connect timeout; then every command gets its own.
  if (redisSetTimeout(ctx.get(), connect_tv) != REDIS_OK) {
    throw_error(Failure{Failure::Kind::kContext, what, ctx->errstr, ctx->err, errno});
  }
  if (!ep.password.empty()) {
    if (ep.user.empty()) {
      const char* argv[] = {"AUTH", ep.password.c_str()};
      const std::size_t lens[] = {4, ep.password.size()};
      setup_command(ctx.get(), 2, argv, lens, what + ": AUTH");
    } else {
      const char* argv[] = {"AUTH", ep.user.c_str(), ep.password.c_str()};
      const std::size_t lens[] = {4, ep.user.size(), ep.password.size()};
      setup_command(ctx.get(), 3, argv, lens, what + ": AUTH");
    }
  }
  if (ep.db != 0) {
    std::string db = std::to_string(ep.db);
    const char* argv[] = {"SELECT", db.c_str()};
    const std::size_t lens[] = {6, db.size()};
    setup_command(ctx.get(), 2, argv, lens, what + ": SELECT");
  }
  if (redisSetTimeout(ctx.get(), to_timeval(settings_.command_timeout)) != REDIS_OK) {
    throw_error(Failure{Failure::Kind::kContext, what, ctx->errstr, ctx->err, errno});
  }
  return Connection{std::move(ctx), 0};
}

Pool::Lease Pool::acquire(std::string_view what) {
  using Clock = std::chrono::steady_clock;
  std::unique_lock<std::mutex> lock(mutex_);
  bool have_deadline = false;
  Clock::time_point deadline{};
  for (;;) {
    while (!idle_.empty()) {
      Connection c = std::move(idle_.back());
      idle_.pop_back();
      if (c.epoch == epoch_) return Lease(this, std::move(c));
      // Opened before the server went away: stale. Dropped (closed) here, under the lock,
      // which only happens once per connection after an outage.
      --open_;
      ++stats_.dropped;
    }
    if (open_ < settings_.size) {
      auto now = Clock::now();
      if (down_ && (probing_ || now < next_probe_)) {
        ++stats_.fast_failures;
        std::string last = last_error_;
        const bool tls = last_error_tls_;
        lock.unlock();
        throw_error(
            Failure{tls ? Failure::Kind::kTlsDown : Failure::Kind::kServerDown, what, last});
      }
      const bool probe = down_;
      if (probe) probing_ = true;
      ++open_;
      lock.unlock();
      try {
        Connection c = connect();
        lock.lock();
        c.epoch = epoch_;
        down_ = false;
        if (probe) probing_ = false;
        ++stats_.connects;
        return Lease(this, std::move(c));
      } catch (const std::exception& e) {
        if (!lock.owns_lock()) lock.lock();
        --open_;
        if (probe) probing_ = false;
        ++stats_.connect_failures;
        down_ = true;
        next_probe_ = Clock::now() + settings_.reconnect_backoff;
        last_error_ = e.what();
        const auto* error = dynamic_cast<const Error*>(&e);
        last_error_tls_ = settings_.tls && error != nullptr && error->code() == errc::kStorageError;
        lock.unlock();
        freed_.notify_one();
        throw;
      }
    }
    auto now = Clock::now();
    if (!have_deadline) {
      deadline = now + settings_.wait_timeout;
      have_deadline = true;
    }
    if (now >= deadline) {
      ++stats_.exhausted;
      lock.unlock();
      std::string detail = "all " + std::to_string(settings_.size) +
                           " connections stayed busy for " +
                           std::to_string(settings_.wait_timeout.count()) +
                           " ms (RedisStoreOptions::pool_size, pool_wait_timeout)";
      throw_error(Failure{Failure::Kind::kPoolExhausted, what, detail});
    }
    freed_.wait_until(lock, deadline);
  }
}

void Pool::give_back(Connection conn) noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (conn.epoch == epoch_) {
      idle_.push_back(std::move(conn));
    } else {
      --open_;
      ++stats_.dropped;
    }
  }
  freed_.notify_one();
  // A stale `conn` (if not moved into idle_) is closed here, outside the lock.
}

void Pool::drop(Connection conn, bool server_gone) noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --open_;
    ++stats_.dropped;
    if (server_gone) ++epoch_;
  }
  freed_.notify_one();
  conn.context.reset();
}

void Pool::count_script_load() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.script_loads;
}

RedisPoolStats Pool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  RedisPoolStats s = stats_;
  s.open = open_;
  s.idle = idle_.size();
  return s;
}

}  // namespace idem::redis::detail
