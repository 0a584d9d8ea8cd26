// SPDX-License-Identifier: MIT
// libpq's asynchronous API on an Asio executor, in pipeline mode (see pg_connection.hpp).
#include "pg_connection.hpp"

#include <optional>
#include <utility>

namespace idem::async::detail {
namespace {

using Clock = std::chrono::steady_clock;

std::string trimmed(const char* s) {
  std::string out = s == nullptr ? std::string() : std::string(s);
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

// A batch whose bytes must outlive run(): kept while the connection is being opened.
struct OwnedBatch {
  struct Statement {
    std::string name_or_sql;
    bool prepared = true;
    std::vector<std::string> values;
    std::vector<PgParam> flags;  // null / binary (values viewed after copying)
  };
  std::vector<Statement> statements;

  explicit OwnedBatch(const std::vector<PgStatement>& batch) {
    statements.reserve(batch.size());
    for (const PgStatement& st : batch) {
      Statement s;
      s.name_or_sql.assign(st.name_or_sql.data(), st.name_or_sql.size());
      s.prepared = st.prepared;
      for (const PgParam& p : st.params) {
        s.values.emplace_back(p.value.data(), p.value.size());
        s.flags.push_back(p);
      }
      statements.push_back(std::move(s));
    }
  }
  std::vector<PgStatement> views() const {
    std::vector<PgStatement> out;
    for (const Statement& s : statements) {
      PgStatement st;
      st.name_or_sql = s.name_or_sql;
      st.prepared = s.prepared;
      for (std::size_t i = 0; i < s.values.size(); ++i) {
        PgParam p = s.flags[i];
        p.value = s.values[i];
        st.params.push_back(p);
      }
      out.push_back(std::move(st));
    }
    return out;
  }
};

}  // namespace

class PgSession : public std::enable_shared_from_this<PgSession> {
 public:
  PgSession(PgConnection* owner, Executor executor, const PgSettings& settings)
      : owner_(owner),
        executor_(executor),
        settings_(settings),
        socket_(executor),
        timer_(executor) {}

  ~PgSession() { finish(); }

  bool start(std::string& why) {
    conn_ = PQconnectStart(settings_.conninfo.c_str());
    if (conn_ == nullptr) {
      why = "cannot allocate a libpq connection";
      return false;
    }
    if (PQstatus(conn_) == CONNECTION_BAD) {
      why = trimmed(PQerrorMessage(conn_));
      PQfinish(conn_);
      conn_ = nullptr;
      return false;
    }
    PQsetNoticeProcessor(
        conn_, [](void*, const char*) {}, nullptr);  // notices are not errors
    self_ = shared_from_this();
    connect_deadline_ = Clock::now() + settings_.connect_timeout;
    arm_timer(connect_deadline_);
    connect_wait(PGRES_POLLING_WRITING);
    return true;
  }

  bool dead() const noexcept { return conn_ == nullptr; }
  std::size_t in_flight() const noexcept { return pending_.size() + queued_.size(); }
  void detach() noexcept { owner_ = nullptr; }

  void run(const std::vector<PgStatement>& batch, PgCallback cb, bool internal = false) {
    if (conn_ == nullptr) {
      PgFailure f = failure_.value_or(PgFailure{"the connection is closed"});
      f.sent = false;
      net::post(executor_, [cb = std::move(cb), f = std::move(f)]() mutable {
        std::vector<PgResult> none;
        cb(none, &f);
      });
      return;
    }
    if (!ready_) {
      queued_.push_back(Queued{OwnedBatch(batch), std::move(cb), internal});
      return;
    }
    send(batch, std::move(cb), internal);
  }

  void close(PgFailure why) { fail_all(std::move(why)); }

 private:
  struct Pending {
    PgCallback cb;
    std::size_t statements = 0;
    std::vector<PgResult> results;
    bool have_current = false;  // the current statement's result came (its NULL is next)
    Clock::time_point deadline{};
    bool internal = false;
  };
  struct Queued {
    OwnedBatch batch;
    PgCallback cb;
    bool internal;
  };

  // --- connect ------------------------------------------------------------------------------

  // libpq may switch sockets between connect steps (another address, SSL retry): watch the
  // current one afresh each step (released, never closed: libpq owns it).
  void watch_socket() {
    if (socket_.is_open()) socket_.release();
    const int fd = PQsocket(conn_);
    if (fd >= 0) socket_.assign(fd);
  }

  void connect_wait(PostgresPollingStatusType want) {
    watch_socket();
    if (!socket_.is_open()) {
      fail_all(PgFailure{"connect: no socket: " + trimmed(PQerrorMessage(conn_))});
      return;
    }
    auto w = want == PGRES_POLLING_READING ? net::posix::stream_descriptor::wait_read
                                           : net::posix::stream_descriptor::wait_write;
    socket_.async_wait(w, [self = shared_from_this()](const error_code& ec) {
      if (ec == net::error::operation_aborted || self->conn_ == nullptr) return;
      self->connect_step();
    });
  }

  void connect_step() {
    switch (PQconnectPoll(conn_)) {
      case PGRES_POLLING_READING:
        connect_wait(PGRES_POLLING_READING);
        return;
      case PGRES_POLLING_WRITING:
        connect_wait(PGRES_POLLING_WRITING);
        return;
      case PGRES_POLLING_OK:
        connected();
        return;
      case PGRES_POLLING_FAILED:
      default: {
        PgFailure f{"connect: " + trimmed(PQerrorMessage(conn_))};
        if (owner_ != nullptr) owner_->down(f.message);
        fail_all(std::move(f));
        return;
      }
    }
  }

  void connected() {
    watch_socket();
    if (PQsetnonblocking(conn_, 1) != 0 || PQenterPipelineMode(conn_) != 1) {
      fail_all(PgFailure{"cannot enter pipeline mode: " + trimmed(PQerrorMessage(conn_))});
      return;
    }
    if (owner_ != nullptr) owner_->up();
    ready_ = true;
    arm_read();
    // The session's settings and prepared statements, then whatever waited for the connect.
    if (!settings_.session.empty() || !settings_.prepared.empty()) setup();
    std::deque<Queued> queued;
    queued.swap(queued_);
    for (Queued& q : queued) {
      if (conn_ == nullptr) {
        PgFailure f = failure_.value_or(PgFailure{"the connection is closed"});
        std::vector<PgResult> none;
        q.cb(none, &f);
        continue;
      }
      send(q.batch.views(), std::move(q.cb), q.internal);
    }
    if (conn_ != nullptr) arm_timer(next_deadline());
  }

  void setup() {
    std::vector<PgStatement> batch;
    for (const std::string& sql : settings_.session) batch.push_back(PgStatement{sql, false, {}});
    // Prepared statements are sent as PQsendPrepare (not a PgStatement): one result each.
    send(
        batch, [this](std::vector<PgResult>& results, const PgFailure*) { check_setup(results); },
        true, true);
  }

  void check_setup(std::vector<PgResult>& results) {
    for (const PgResult& r : results) {
      const auto st = PQresultStatus(r.get());
      if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK) continue;
      PgFailure f;
      const char* state = PQresultErrorField(r.get(), PG_DIAG_SQLSTATE);
      f.sqlstate = state == nullptr ? "" : state;
      f.message = "session setup failed: " + trimmed(PQresultErrorMessage(r.get()));
      fail_all(std::move(f));
      return;
    }
  }

  // --- batches ------------------------------------------------------------------------------

  void send(const std::vector<PgStatement>& batch, PgCallback cb, bool internal,
            bool with_prepares = false) {
    std::vector<const char*> values;
    std::vector<int> lengths, formats;
    std::size_t statements = batch.size();
    for (const PgStatement& st : batch) {
      values.clear();
      lengths.clear();
      formats.clear();
      for (const PgParam& p : st.params) {
        values.push_back(p.null ? nullptr : p.value.data());
        lengths.push_back(static_cast<int>(p.value.size()));
        formats.push_back(p.binary ? 1 : 0);
      }
      const int n = static_cast<int>(st.params.size());
      // Views are not NUL-terminated: names and SQL get their own string.
      const std::string text(st.name_or_sql);
      const int ok = st.prepared ? PQsendQueryPrepared(conn_, text.c_str(), n, values.data(),
                                                       lengths.data(), formats.data(), 1)
                                 : PQsendQueryParams(conn_, text.c_str(), n, nullptr, values.data(),
                                                     lengths.data(), formats.data(), 1);
      if (ok != 1) return broken(std::move(cb));
    }
    if (with_prepares) {
      for (const auto& [name, sql] : settings_.prepared) {
        if (PQsendPrepare(conn_, name.c_str(), sql.c_str(), 0, nullptr) != 1) {
          return broken(std::move(cb));
        }
        ++statements;
      }
    }
    if (PQpipelineSync(conn_) != 1) return broken(std::move(cb));
    Pending p;
    p.cb = std::move(cb);
    p.statements = statements;
    p.results.reserve(statements);
    p.deadline = settings_.batch_timeout.count() > 0 ? Clock::now() + settings_.batch_timeout
                                                     : Clock::time_point::max();
    p.internal = internal;
    pending_.push_back(std::move(p));
    if (!timer_armed_) arm_timer(next_deadline());
    flush();
  }

  void broken(PgCallback cb) {
    PgFailure f{"cannot send: " + trimmed(PQerrorMessage(conn_))};
    f.sent = true;  // earlier statements of the batch may be on their way
    net::post(executor_, [cb = std::move(cb), f]() mutable {
      std::vector<PgResult> none;
      cb(none, &f);
    });
    fail_all(std::move(f));
  }

  void flush() {
    const int r = PQflush(conn_);
    if (r < 0) {
      PgFailure f{"send failed: " + trimmed(PQerrorMessage(conn_))};
      f.sent = true;
      fail_all(std::move(f));
      return;
    }
    if (r == 1 && !writing_) {
      writing_ = true;
      socket_.async_wait(net::posix::stream_descriptor::wait_write,
                         [self = shared_from_this()](const error_code& ec) {
                           self->writing_ = false;
                           if (ec == net::error::operation_aborted || self->conn_ == nullptr) {
                             return;
                           }
                           self->flush();
                         });
    }
  }

  void arm_read() {
    if (reading_ || conn_ == nullptr) return;
    reading_ = true;
    socket_.async_wait(net::posix::stream_descriptor::wait_read,
                       [self = shared_from_this()](const error_code& ec) {
                         self->reading_ = false;
                         if (ec == net::error::operation_aborted || self->conn_ == nullptr) {
                           return;
                         }
                         self->on_readable();
                       });
  }

  void on_readable() {
    if (PQconsumeInput(conn_) == 0) {
      PgFailure f{"connection lost: " + trimmed(PQerrorMessage(conn_))};
      f.sent = true;
      fail_all(std::move(f));
      return;
    }
    collect();
    if (conn_ == nullptr) return;
    if (PQstatus(conn_) == CONNECTION_BAD) {
      PgFailure f{"connection lost: " + trimmed(PQerrorMessage(conn_))};
      f.sent = true;
      fail_all(std::move(f));
      return;
    }
    // Reading may have made room to send more (PQflush waits on both directions).
    if (!pending_.empty()) flush();
    if (conn_ != nullptr) arm_read();
  }

  void collect() {
    while (conn_ != nullptr && !pending_.empty()) {
      if (PQisBusy(conn_) != 0) return;
      PGresult* raw = PQgetResult(conn_);
      Pending& head = pending_.front();
      if (raw == nullptr) {
        if (head.have_current) {
          head.have_current = false;
          continue;
        }
        return;  // nothing more for now
      }
      PgResult r(raw);
      if (PQresultStatus(raw) == PGRES_PIPELINE_SYNC) {
        Pending done = std::move(pending_.front());
        pending_.pop_front();
        if (!pending_.empty()) {
          // The server answers a connection's batches in order: the next one's time starts
          // now, not when it was sent behind the others (a long pipeline is not a slow server).
          if (settings_.batch_timeout.count() > 0) {
            const auto from_now = Clock::now() + settings_.batch_timeout;
            if (pending_.front().deadline < from_now) pending_.front().deadline = from_now;
          }
          arm_timer(next_deadline());
        } else {
          timer_.cancel();
        }
        done.cb(done.results, nullptr);
        continue;
      }
      if (!head.have_current && head.results.size() < head.statements) {
        head.results.push_back(std::move(r));
        head.have_current = true;
      }
    }
  }

  // --- deadlines and failure ----------------------------------------------------------------

  Clock::time_point next_deadline() const noexcept {
    Clock::time_point t = ready_ ? Clock::time_point::max() : connect_deadline_;
    if (!pending_.empty() && pending_.front().deadline < t) t = pending_.front().deadline;
    return t;
  }

  void arm_timer(Clock::time_point at) {
    if (at == Clock::time_point::max()) return;
    timer_armed_ = true;
    const std::uint64_t gen = ++timer_gen_;
    timer_.expires_at(at);
    timer_.async_wait([self = shared_from_this(), gen](const error_code& ec) {
      if (gen != self->timer_gen_) return;
      self->timer_armed_ = false;
      if (ec == net::error::operation_aborted || self->conn_ == nullptr) return;
      self->on_timer();
    });
  }

  void on_timer() {
    const auto now = Clock::now();
    if (!ready_ && now >= connect_deadline_) {
      PgFailure f{"connect timed out"};
      f.timed_out = true;
      if (owner_ != nullptr) owner_->down(f.message);
      fail_all(std::move(f));
      return;
    }
    if (!pending_.empty() && pending_.front().deadline <= now) {
      PgFailure f{"no result in time"};
      f.timed_out = true;
      f.sent = true;
      fail_all(std::move(f));
      return;
    }
    arm_timer(next_deadline());
  }

  // Ends the connection: every batch sent fails with `why` (sent), every batch queued for the
  // connect fails with sent = false.
  void fail_all(PgFailure why) {
    if (conn_ == nullptr) return;
    failure_ = why;
    finish();
    timer_.cancel();
    std::deque<Pending> pending;
    pending.swap(pending_);
    std::deque<Queued> queued;
    queued.swap(queued_);
    std::vector<PgResult> none;
    for (Pending& p : pending) {
      PgFailure f = why;
      f.sent = f.sent || ready_;
      p.cb(none, &f);
    }
    for (Queued& q : queued) {
      PgFailure f = why;
      f.sent = false;
      q.cb(none, &f);
    }
    if (self_) net::post(executor_, [keep = std::move(self_)] {});
  }

  void finish() noexcept {
    if (socket_.is_open()) socket_.release();  // libpq closes its socket in PQfinish
    if (conn_ != nullptr) PQfinish(conn_);
    conn_ = nullptr;
  }

  PgConnection* owner_;
  Executor executor_;
  const PgSettings settings_;
  PGconn* conn_ = nullptr;
  net::posix::stream_descriptor socket_;
  net::steady_timer timer_;
  bool timer_armed_ = false;
  std::uint64_t timer_gen_ = 0;
  bool ready_ = false, reading_ = false, writing_ = false;
  Clock::time_point connect_deadline_{};
  std::deque<Pending> pending_;
  std::deque<Queued> queued_;
  std::optional<PgFailure> failure_;
  std::shared_ptr<PgSession> self_;
};

PgConnection::PgConnection(Executor executor, PgSettings settings)
    : executor_(std::move(executor)), settings_(std::move(settings)) {}

PgConnection::~PgConnection() { close(); }

void PgConnection::close() {
  if (!session_) return;
  session_->detach();
  PgFailure f{"the connection was closed by the client"};
  f.closed = true;
  session_->close(std::move(f));
  session_.reset();
}

std::size_t PgConnection::in_flight() const noexcept {
  return session_ ? session_->in_flight() : 0;
}

void PgConnection::run(const std::vector<PgStatement>& batch, PgCallback callback) {
  if (!session_ || session_->dead()) {
    if (session_) session_->detach();
    session_.reset();
    std::string why;
    if (std::chrono::steady_clock::now() < down_until_) {
      why = down_reason_ + " (a connect failed moments ago)";
    } else {
      auto s = std::make_shared<PgSession>(this, executor_, settings_);
      if (s->start(why)) {
        session_ = std::move(s);
        ++connects_;
      } else {
        down(why);
      }
    }
    if (!session_) {
      net::post(executor_, [cb = std::move(callback), why = std::move(why)]() mutable {
        PgFailure f{std::move(why)};
        std::vector<PgResult> none;
        cb(none, &f);
      });
      return;
    }
  }
  session_->run(batch, std::move(callback));
}

}  // namespace idem::async::detail
