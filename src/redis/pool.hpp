// SPDX-License-Identifier: MIT
// A bounded, thread-safe pool of hiredis connections with RAII checkout.
#pragma once

#include <hiredis/hiredis.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "hiredis_handles.hpp"
#include "idem/errors.hpp"
#include "idem/export.hpp"
#include "idem/redis/redis_store.hpp"
#include "tls.hpp"
#include "uri.hpp"

namespace idem::redis::detail {

/// Pool settings (zeros already replaced by defaults).
struct PoolSettings {
  Endpoint endpoint;
  std::size_t size = 8;
  std::chrono::milliseconds connect_timeout{500};
  std::chrono::milliseconds command_timeout{1000};
  std::chrono::milliseconds wait_timeout{100};
  std::chrono::milliseconds reconnect_backoff{100};
  /// rediss://: opens the connections over TLS (shared by every pool of one store); null: TCP.
  std::shared_ptr<TlsConnector> tls;
  /// Commands of concurrent callers share one connection of the pool (Pool::pipeline()).
  bool auto_pipeline = false;
};

class Pipeline;

/// Writes all of `bytes` to `fd` with send(2) and MSG_NOSIGNAL (hiredis writes with write(2),
/// which raises SIGPIPE on a connection the server closed); EINTR is retried, the socket's send
/// timeout bounds it. Returns 0, or the errno of the failure (EPIPE for a zero-byte write);
/// `written` says how much went out (0: nothing of it reached the server).
int send_all(int fd, std::string_view bytes, std::size_t& written) noexcept;

/// The error text of a failed send_all ("write timed out" for the send timeout).
const char* send_error_text(int err) noexcept;

/// Writes what `c` has buffered with send_all. On failure sets c->err / c->errstr like hiredis,
/// leaves errno set and returns REDIS_ERR; `written` (if given) says how many bytes went out
/// (0: the server got nothing, so no command of the buffer was applied). Every write to a Redis
/// connection goes through it (hiredis' own write(2) would raise SIGPIPE on a connection the
/// server closed).
int write_buffered(redisContext* c, std::size_t* written = nullptr) noexcept;

/// redisCommandArgv without SIGPIPE: buffers the command, writes it (write_buffered), reads
/// its reply. Null on a connection failure (c->err set), as redisCommandArgv.
redisReply* command_argv(redisContext* c, int argc, const char** argv,
                         const std::size_t* lens) noexcept;

/// Connections are made on demand up to `size`, kept idle between calls, and dropped when
/// they break. When one breaks because the server went away (EOF, reset, refused), every
/// connection opened before is stale too: the pool's epoch moves on and idle connections of
/// older epochs are dropped at checkout instead of failing one call each. After a failed
/// connect, callers fail at once for `reconnect_backoff` (one caller probes per period), so a
/// dead server costs microseconds per call, and a server that comes back is found within a
/// backoff period.
/// Exported from a shared libidem_redis for libidem_mq, which runs on it (not API).
class IDEM_EXPORT Pool {
 public:
  explicit Pool(PoolSettings settings);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  struct Connection {
    ContextUPtr context;
    std::uint64_t epoch = 0;
    std::chrono::steady_clock::time_point idle_since{};  ///< when it was last given back
  };

  /// A lent connection; given back on destruction unless discarded.
  class Lease {
   public:
    Lease(Lease&& other) noexcept : pool_(other.pool_), conn_(std::move(other.conn_)) {
      other.pool_ = nullptr;
    }
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    ~Lease() {
      if (pool_ != nullptr) pool_->give_back(std::move(conn_));
    }
    /// The hiredis context (valid until discard or destruction).
    redisContext* get() const noexcept { return conn_.context.get(); }
    /// Drops the connection (it failed). `server_gone`: older connections are stale too.
    void discard(bool server_gone) noexcept {
      if (pool_ != nullptr) pool_->drop(std::move(conn_), server_gone);
      pool_ = nullptr;
    }

   private:
    friend class Pool;
    Lease(Pool* pool, Connection conn) noexcept : pool_(pool), conn_(std::move(conn)) {}
    Pool* pool_;
    Connection conn_;
  };

  /// Lends a connection: idle, new, or freed within wait_timeout.
  /// @param what names the call for error messages (only read on failure).
  /// @throws StorageUnavailable (exhausted, server down), StorageTimeout (connect timed out),
  ///         StorageError (AUTH/SELECT refused).
  Lease acquire(std::string_view what);

  /// The pool's auto-pipeline (PoolSettings::auto_pipeline), else null.
  Pipeline* pipeline() noexcept { return pipeline_.get(); }

  /// False when `lease`'s connection was opened before the server went away (stale).
  bool current(const Lease& lease) const;

  /// Counts a NOSCRIPT reload (for stats).
  void count_script_load() noexcept;

  /// Counters.
  RedisPoolStats stats() const;

  /// Settings in force.
  const PoolSettings& settings() const noexcept { return settings_; }

 private:
  Connection connect();  // no lock held; throws
  void give_back(Connection conn) noexcept;
  static bool closed_while_idle(const Connection& c) noexcept;
  void drop(Connection conn, bool server_gone) noexcept;

  const PoolSettings settings_;
  mutable std::mutex mutex_;
  std::condition_variable freed_;
  std::vector<Connection> idle_;
  std::size_t open_ = 0;                 // idle + lent + being connected
  std::atomic<std::uint64_t> epoch_{0};  // written under mutex_; read without by current()
  // Server-down state: set by a failed connect, cleared by a successful one.
  bool down_ = false;
  bool probing_ = false;
  std::chrono::steady_clock::time_point next_probe_{};
  std::string last_error_;
  // The last connect was refused for good (TLS checks, credentials): not a server outage, so
  // the calls failed fast until the next try are not retryable either.
  bool last_error_refused_ = false;
  RedisPoolStats stats_;
  std::unique_ptr<Pipeline> pipeline_;  // last: gives its connection back before the rest goes
};

/// Auto-pipelining: concurrent callers' commands share one connection of a Pool. A caller
/// queues its formatted command; when no batch is on the wire it becomes the flusher: it takes
/// every queued command, writes them in one write, reads the replies in order and hands each
/// to its caller as it arrives, then hands the flusher role to a caller that queued meanwhile.
/// A lone caller is never delayed (no timer): it flushes its own command at once. A broken
/// connection fails every command on the wire with the connection's error (typed per caller,
/// by throw_error); a caller that waits longer than its deadline gives up alone (its reply, if
/// it comes, is dropped).
class Pipeline {
 public:
  explicit Pipeline(Pool& pool);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// Sends one RESP-formatted command (`formatted` stays valid until this returns) and returns
  /// its reply (an error reply too). `op` and `key` name the call in error messages;
  /// `write_may_apply`: a timeout after sending is OutcomeUnknown rather than StorageTimeout.
  /// @throws as Pool::acquire, and the connection's failure as the pool's commands throw it.
  ReplyUPtr call(std::string_view formatted, const char* op, std::string_view key,
                 bool write_may_apply);

  /// Batches written and commands sent through them (for stats).
  std::uint64_t flushes() const noexcept { return flushes_.load(std::memory_order_relaxed); }
  std::uint64_t commands() const noexcept { return commands_.load(std::memory_order_relaxed); }

 private:
  struct Waiter;
  struct Refusal {
    errc code;
    std::string message;
  };
  void flush(std::unique_lock<std::mutex>& lock, Waiter& self);
  // The lone caller (nothing on the wire, nothing queued): writes its command straight from
  // `formatted` on a lent connection and reads its reply, with no queue and no copy; callers
  // that queue meanwhile are written by the next flusher (hand_off).
  ReplyUPtr call_alone(std::string_view formatted, const char* op, std::string_view key,
                       bool write_may_apply);
  // Ends a flusher's turn (`lock` held on entry and exit): nothing queued, `lease` goes back
  // to the pool (claim_batch, complete_batch and ASK redirects take pooled connections, even
  // with pool_size 1); else it stays for the caller queued first, which becomes the flusher.
  void hand_off(std::unique_lock<std::mutex>& lock, std::optional<Pool::Lease> lease);
  static void refuse(Waiter& w, const Refusal& why);  // lock held
  static Refusal refusal();                           // of the exception being handled
  // Opens conn_ (`lock` released). If the connect fails, every caller of `callers` (null
  // entries skipped) gets its error, `callers` is emptied, `lock` is held again: false.
  bool open(std::unique_lock<std::mutex>& lock, const char* op, std::vector<Waiter*>& callers);
  // Gives every caller of `callers` the error of the exception being handled (`lock` released
  // on entry, held on exit) and empties `callers`.
  static void refuse_all(std::unique_lock<std::mutex>& lock, std::vector<Waiter*>& callers);
  // Sends `bytes` on `lease` (send_all). A connection the server closed while it was idle
  // (EPIPE / ECONNRESET with nothing written) is replaced once by a new one from the pool and
  // the bytes go again. Returns 0 or the errno of the failure; `written`: the bytes that went
  // out on the last connection tried.
  // @throws as Pool::acquire (the lease is then empty).
  int send_on(std::optional<Pool::Lease>& lease, std::string_view bytes, const char* op,
              std::size_t& written);

  Pool& pool_;
  std::mutex mutex_;
  std::vector<Waiter*> pending_;     // queued, not yet written
  std::vector<Waiter*> inflight_;    // the batch on the wire, in order; null: its caller gave up
  bool busy_ = false;                // a flusher is at work
  std::optional<Pool::Lease> conn_;  // touched by the flusher only
  std::string out_;                  // the batch being written (flusher only)
  std::atomic<std::uint64_t> flushes_{0}, commands_{0};
};

}  // namespace idem::redis::detail
