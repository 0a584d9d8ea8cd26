// SPDX-License-Identifier: MIT
// A bounded, thread-safe pool of hiredis connections (see pool.hpp).
#include "pool.hpp"

#include <hiredis/sds.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

#include "errors.hpp"
#include "idem/detail/idle_socket.hpp"
#include "idem/errors.hpp"

namespace idem::redis::detail {

int send_all(int fd, std::string_view bytes, std::size_t& written) noexcept {
  written = 0;
  while (written < bytes.size()) {
    const ssize_t w = ::send(fd, bytes.data() + written, bytes.size() - written, MSG_NOSIGNAL);
    if (w > 0) {
      written += static_cast<std::size_t>(w);
    } else if (w < 0 && errno == EINTR) {
      continue;
    } else {
      return w < 0 ? errno : EPIPE;
    }
  }
  return 0;
}

const char* send_error_text(int err) noexcept {
  return err == EAGAIN || err == EWOULDBLOCK ? "write timed out" : std::strerror(err);
}

int write_buffered(redisContext* c, std::size_t* written) noexcept {
  std::size_t sent = 0;
  const int e = send_all(c->fd, std::string_view(c->obuf, sdslen(c->obuf)), sent);
  if (written != nullptr) *written = sent;
  if (e != 0) {
    c->err = REDIS_ERR_IO;
    std::snprintf(c->errstr, sizeof(c->errstr), "%s", send_error_text(e));
    errno = e;
    return REDIS_ERR;
  }
  sdssetlen(c->obuf, 0);  // sdsclear (sds.h, inline: libhiredis's sds symbols are C, undeclared)
  c->obuf[0] = '\0';
  return REDIS_OK;
}

redisReply* command_argv(redisContext* c, int argc, const char** argv,
                         const std::size_t* lens) noexcept {
  if (redisAppendCommandArgv(c, argc, argv, lens) != REDIS_OK) return nullptr;
  if (write_buffered(c) != REDIS_OK) return nullptr;
  void* raw = nullptr;
  if (redisGetReply(c, &raw) != REDIS_OK) return nullptr;
  return static_cast<redisReply*>(raw);
}

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
  ReplyUPtr reply(command_argv(c, argc, argv, lens));
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
  if (settings_.auto_pipeline) pipeline_ = std::make_unique<Pipeline>(*this);
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
  return Connection{std::move(ctx), 0, {}};
}

// A connection idle for a while may have been closed by the server (its `timeout` setting, CLIENT
// KILL, a restart nobody noticed yet): one non-blocking peek at its socket tells, with no round
// trip. An idle connection has nothing to read; end of file means closed. (Bytes are not taken
// as closed: a TLS connection may hold a record of its own.) Connections reused within
// kIdleCheckAfter are not looked at: that path costs no system call.
bool Pool::closed_while_idle(const Connection& c) noexcept {
  constexpr auto kIdleCheckAfter = std::chrono::milliseconds(100);
  if (std::chrono::steady_clock::now() - c.idle_since < kIdleCheckAfter) return false;
  return idem::detail::peek_idle_socket(c.context->fd) == idem::detail::IdleSocket::kClosed;
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
      if (c.epoch == epoch_ && !closed_while_idle(c)) return Lease(this, std::move(c));
      // Opened before the server went away, or closed by the server while idle: dropped
      // (closed) here, under the lock, which happens once per connection after an outage.
      --open_;
      ++stats_.dropped;
    }
    if (open_ < settings_.size) {
      auto now = Clock::now();
      if (down_ && (probing_ || now < next_probe_)) {
        ++stats_.fast_failures;
        std::string last = last_error_;
        const bool refused = last_error_refused_;
        lock.unlock();
        throw_error(Failure{refused ? Failure::Kind::kRefusedDown : Failure::Kind::kServerDown,
                            what, last});
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
        last_error_refused_ = error != nullptr && error->code() == errc::kStorageError;
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
      conn.idle_since = std::chrono::steady_clock::now();
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

bool Pool::current(const Lease& lease) const {
  return lease.conn_.epoch == epoch_.load(std::memory_order_relaxed);
}

RedisPoolStats Pool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  RedisPoolStats s = stats_;
  s.open = open_;
  s.idle = idle_.size();
  if (pipeline_) {
    s.pipelined_flushes = pipeline_->flushes();
    s.pipelined_commands = pipeline_->commands();
  }
  return s;
}

// One caller of Pipeline::call, on its own stack. Every field but `command` is guarded by the
// pipeline's mutex.
struct Pipeline::Waiter {
  std::string_view command;
  const char* op = "call";
  ReplyUPtr reply;
  // The connect failed: Pool::acquire's error, as code and message (each caller throws its
  // own exception object: none is shared between threads).
  bool refused = false;
  errc code = errc::kStorageError;
  std::string message;
  bool failed = false;  // the connection failed: err, sys_errno, errstr
  bool lost_after_send = false;  // ...after (part of) its batch went out: it may have applied
  int err = 0;
  int sys_errno = 0;
  std::string errstr;
  bool done = false;     // reply, error or failure set
  bool flusher = false;  // this caller writes the next batch
  bool sent = false;
  std::chrono::steady_clock::time_point sent_at{};
  std::condition_variable wake;
};

Pipeline::Pipeline(Pool& pool) : pool_(pool) {
  pending_.reserve(64);
  inflight_.reserve(64);
}

Pipeline::~Pipeline() = default;

ReplyUPtr Pipeline::call(std::string_view formatted, const char* op, std::string_view key,
                         bool write_may_apply) {
  using Clock = std::chrono::steady_clock;
  const PoolSettings& s = pool_.settings();
  std::unique_lock<std::mutex> lock(mutex_);
  if (!busy_) {  // nothing on the wire (and so nothing queued): no queue, no copy
    busy_ = true;
    lock.unlock();
    return call_alone(formatted, op, key, write_may_apply);
  }
  Waiter self;
  self.command = formatted;
  self.op = op;
  pending_.push_back(&self);
  {
    // Queued behind a batch on the wire: at most a connect, a batch and the pool's wait before
    // it is written, then command_timeout for its reply.
    const Clock::time_point queued_until =
        Clock::now() + s.connect_timeout + s.command_timeout + s.wait_timeout;
    while (!self.done && !self.flusher) {
      const Clock::time_point until = self.sent ? self.sent_at + s.command_timeout : queued_until;
      if (self.wake.wait_until(lock, until) != std::cv_status::timeout) continue;
      if (self.done || self.flusher) break;
      if (Clock::now() < (self.sent ? self.sent_at + s.command_timeout : queued_until)) continue;
      // Gives up alone: unqueued (never written), or its reply will be dropped on arrival.
      const bool sent = self.sent;
      if (sent) {
        std::replace(inflight_.begin(), inflight_.end(), &self, static_cast<Waiter*>(nullptr));
      } else {
        pending_.erase(std::find(pending_.begin(), pending_.end(), &self));
      }
      lock.unlock();
      std::string what = op;
      what.push_back(' ');
      what.append(key);
      if (sent) {
        throw_error(Failure{Failure::Kind::kContext, what, "pipelined reply timed out",
                            REDIS_ERR_IO, EAGAIN, write_may_apply});
      }
      throw_error(Failure{Failure::Kind::kPoolExhausted, what,
                          "not sent: the pipelined connection stayed busy (command_timeout)"});
    }
  }
  if (self.flusher && !self.done) flush(lock, self);
  lock.unlock();
  if (self.refused) {
    switch (self.code) {
      case errc::kStoreUnavailable:
        throw StorageUnavailable(self.message);
      case errc::kStoreTimeout:
        throw StorageTimeout(self.message);
      default:
        throw StorageError(self.message);
    }
  }
  if (self.failed) {
    std::string what = op;
    what.push_back(' ');
    what.append(key);
    throw_error(Failure{Failure::Kind::kContext, what, self.errstr, self.err, self.sys_errno,
                        write_may_apply, self.lost_after_send});
  }
  return std::move(self.reply);
}

void Pipeline::refuse(Waiter& w, const Refusal& why) {
  w.refused = true;
  w.code = why.code;
  w.message = why.message;
  w.done = true;
  w.wake.notify_one();
}

Pipeline::Refusal Pipeline::refusal() {
  try {
    throw;
  } catch (const Error& e) {
    return Refusal{e.code(), e.what()};
  } catch (const std::exception& e) {
    return Refusal{errc::kStorageError, e.what()};
  } catch (...) {
    return Refusal{errc::kStorageError, "redis: connect failed"};
  }
}

void Pipeline::refuse_all(std::unique_lock<std::mutex>& lock, std::vector<Waiter*>& callers) {
  const Refusal why = refusal();
  lock.lock();
  for (Waiter* w : callers) {
    if (w != nullptr) refuse(*w, why);
  }
  callers.clear();
}

bool Pipeline::open(std::unique_lock<std::mutex>& lock, const char* op,
                    std::vector<Waiter*>& callers) {
  try {
    conn_.emplace(pool_.acquire(op));
    return true;
  } catch (...) {
    refuse_all(lock, callers);
    return false;
  }
}

int Pipeline::send_on(std::optional<Pool::Lease>& lease, std::string_view bytes, const char* op,
                      std::size_t& written) {
  written = 0;
  const int err = send_all(lease->get()->fd, bytes, written);
  if (err == 0 || written != 0 || (err != EPIPE && err != ECONNRESET)) return err;
  // The server closed this idle connection (CLIENT KILL, timeout, restart): nothing reached
  // it, so the bytes go once more on a new connection.
  lease->discard(true);
  lease.reset();
  lease.emplace(pool_.acquire(op));
  return send_all(lease->get()->fd, bytes, written);
}

ReplyUPtr Pipeline::call_alone(std::string_view formatted, const char* op, std::string_view key,
                               bool write_may_apply) {
  std::optional<Pool::Lease> lease;
  int sys_errno = 0;
  std::size_t written = 0;
  try {
    lease.emplace(pool_.acquire(op));
    sys_errno = send_on(lease, formatted, op, written);
  } catch (...) {
    std::unique_lock<std::mutex> lock(mutex_);
    hand_off(lock, std::nullopt);
    throw;
  }
  flushes_.fetch_add(1, std::memory_order_relaxed);
  commands_.fetch_add(1, std::memory_order_relaxed);
  redisContext* c = lease->get();
  int err = REDIS_ERR_IO;
  std::string errstr;
  const bool sent = sys_errno == 0;  // whole: the reply was being read when the failure came
  if (sys_errno == 0) {
    errno = 0;
    void* raw = nullptr;
    if (redisGetReply(c, &raw) == REDIS_OK && raw != nullptr) {
      ReplyUPtr reply(static_cast<redisReply*>(raw));
      std::unique_lock<std::mutex> lock(mutex_);
      hand_off(lock, std::move(lease));
      return reply;
    }
    sys_errno = errno;
    err = c->err;
    errstr = c->errstr;
  } else {
    errstr = send_error_text(sys_errno);
  }
  lease->discard(server_gone(err, sys_errno));
  lease.reset();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    hand_off(lock, std::nullopt);
  }
  std::string what = op;
  what.push_back(' ');
  what.append(key);
  throw_error(
      Failure{Failure::Kind::kContext, what, errstr, err, sys_errno, write_may_apply, sent});
}

void Pipeline::hand_off(std::unique_lock<std::mutex>& lock, std::optional<Pool::Lease> lease) {
  if (pending_.empty() && lease) {
    // Idle: the connection goes back to the pool (claim_batch, complete_batch and ASK
    // redirects take pooled connections, even with pool_size 1).
    lock.unlock();
    lease.reset();
    lock.lock();
  }
  if (pending_.empty()) {
    busy_ = false;
    return;
  }
  // Callers queued meanwhile: the first writes their batch, on this connection if it is good.
  conn_.reset();
  if (lease) conn_.emplace(std::move(*lease));
  pending_.front()->flusher = true;
  pending_.front()->wake.notify_one();
}

// Runs batches while holding the flusher role (`lock` held on entry and exit), until `self`
// is answered; then hands the role to a caller queued meanwhile, if any.
void Pipeline::flush(std::unique_lock<std::mutex>& lock, Waiter& self) {
  while (!self.done) {
    if (conn_ && !pool_.current(*conn_)) {
      // Opened before the server went away (another connection of the pool saw it): a batch
      // on it would fail whole, so it is dropped unused.
      conn_->discard(false);
      conn_.reset();
    }
    if (!conn_) {
      lock.unlock();
      // Nothing was written: every queued caller gets the connect's error.
      if (!open(lock, self.op, pending_)) break;
      lock.lock();
    }
    // Copied while the lock keeps every queued caller (and its command bytes) in place.
    const auto now = std::chrono::steady_clock::now();
    out_.clear();
    for (Waiter* w : pending_) {
      out_.append(w->command.data(), w->command.size());
      w->sent = true;
      w->sent_at = now;
    }
    // `self` is in this batch (queued, not yet written): its reply needs no lock.
    const std::size_t mine = static_cast<std::size_t>(
        std::find(pending_.begin(), pending_.end(), &self) - pending_.begin());
    inflight_.swap(pending_);
    pending_.clear();
    const std::size_t n = inflight_.size();
    flushes_.fetch_add(1, std::memory_order_relaxed);
    commands_.fetch_add(n, std::memory_order_relaxed);
    lock.unlock();
    // One write for the batch (send_on: no SIGPIPE, bounded by the socket's send timeout,
    // command_timeout). Then the replies: one read (blocking), every
    // further reply already parsed, handed over under one lock.
    std::array<redisReply*, 64> got{};
    std::size_t answered = 0;
    bool broken = false;
    int saved_errno = 0;
    int err = 0;
    std::string errstr;
    std::size_t written = 0;
    try {
      saved_errno = send_on(conn_, out_, self.op, written);
    } catch (...) {
      // No new connection: every caller of the batch gets its error (`self` too).
      refuse_all(lock, inflight_);
      continue;
    }
    redisContext* c = conn_->get();
    // A batch cut while being written may have reached the server in part: the commands
    // before the cut may have been applied (each caller is then told its write may have).
    const bool lost_after_send = saved_errno == 0 || written > 0;
    if (saved_errno != 0) {
      err = REDIS_ERR_IO;
      errstr = send_error_text(saved_errno);
      broken = true;
    }
    while (answered < n && !broken) {
      std::size_t count = 0;
      errno = 0;
      void* raw = nullptr;
      if (redisGetReply(c, &raw) != REDIS_OK || raw == nullptr) {
        saved_errno = errno;
        err = c->err;
        errstr = c->errstr;
        broken = true;
      } else {
        got[count++] = static_cast<redisReply*>(raw);
        while (answered + count < n && count < got.size()) {
          raw = nullptr;
          if (redisReaderGetReply(c->reader, &raw) != REDIS_OK || raw == nullptr) break;
          got[count++] = static_cast<redisReply*>(raw);
        }
      }
      std::size_t dropped = 0;
      const std::size_t first = answered;
      if (first <= mine && mine < first + count) {
        self.reply.reset(got[mine - first]);
        got[mine - first] = nullptr;
      }
      if (count > (first <= mine && mine < first + count ? 1U : 0U)) {
        lock.lock();
        for (std::size_t k = 0; k < count; ++k) {
          if (got[k] == nullptr) continue;
          if (Waiter* w = inflight_[first + k]) {
            w->reply.reset(got[k]);
            w->done = true;
            w->wake.notify_one();
            got[k] = nullptr;
          } else {
            ++dropped;  // its caller gave up: freed below, outside the lock
          }
        }
        lock.unlock();
      }
      if (first <= mine && mine < first + count) self.done = true;  // read by this thread only
      if (dropped > 0) {
        for (std::size_t k = 0; k < count; ++k) {
          if (got[k] != nullptr) freeReplyObject(got[k]);
        }
      }
      answered += count;
    }
    if (broken) {
      // The connection broke: every caller still on the wire gets its error.
      conn_->discard(server_gone(err, saved_errno));
      conn_.reset();
      lock.lock();
      for (std::size_t i = answered; i < n; ++i) {
        Waiter* w = i == mine ? &self : inflight_[i];
        if (w == nullptr) continue;
        w->failed = true;
        w->lost_after_send = lost_after_send;
        w->err = err;
        w->sys_errno = saved_errno;
        w->errstr = errstr;
        w->done = true;
        if (w != &self) w->wake.notify_one();
      }
    } else {
      lock.lock();
    }
    inflight_.clear();
  }
  // Answered: the next batch is written by a caller that queued meanwhile, on this
  // connection; nothing queued, the connection goes back to the pool.
  std::optional<Pool::Lease> lease;
  if (conn_) lease.emplace(std::move(*conn_));
  conn_.reset();
  hand_off(lock, std::move(lease));
}

}  // namespace idem::redis::detail
