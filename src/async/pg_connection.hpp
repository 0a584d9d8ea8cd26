// SPDX-License-Identifier: MIT
// One PostgreSQL connection driven by libpq's asynchronous API on an Asio executor, in pipeline
// mode: many callers' statement batches in flight on one connection, each batch its own
// implicit transaction (one Sync), answered in order; nothing ever blocks the loop.
//
//   connect      PQconnectStart + PQconnectPoll, each step waiting for socket readiness (the
//                socket may change between steps); then non-blocking + pipeline mode, the
//                session settings and the prepared statements as the first batch
//   a batch      PQsendQueryPrepared / PQsendQueryParams per statement, one PQpipelineSync,
//                PQflush until sent (waiting for writability when the socket buffer is full)
//   results      PQconsumeInput on readability; per statement its result then a NULL; a failed
//                statement aborts the rest of its batch (PGRES_PIPELINE_ABORTED) up to the Sync
//   deadlines    a batch not answered in time (counted from when it was sent, or from the
//                answer of the batch before it, whichever is later), or a connect not done in
//                time, closes the connection (its transaction is rolled back by the server);
//                every batch then in flight fails: timed out, and "may have applied" if it
//                wrote (the server may still run what it had received)
//
// libpq resolves host names with a blocking getaddrinfo during PQconnectStart: give `hostaddr`
// (or a numeric host) to keep the loop free while connecting.
#pragma once

#include <libpq-fe.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "idem/async/function.hpp"
#include "idem/async/net.hpp"

namespace idem::async::detail {

/// An owned PGresult.
struct PgResultDeleter {
  void operator()(PGresult* r) const noexcept { PQclear(r); }
};
using PgResult = std::unique_ptr<PGresult, PgResultDeleter>;

/// One bound parameter; the bytes must live until run() returns (libpq copies them).
struct PgParam {
  std::string_view value;
  bool null = false;
  bool binary = false;  ///< send as binary (bytea: raw bytes, no escaping)
};

/// One statement of a batch: a prepared statement's name (prepared on every connection at
/// connect) or SQL text.
struct PgStatement {
  std::string_view name_or_sql;
  bool prepared = true;
  std::vector<PgParam> params;
};

/// Why a batch got no results.
struct PgFailure {
  PgFailure() = default;
  explicit PgFailure(std::string why) : message(std::move(why)) {}
  std::string message;     ///< libpq's or ours
  std::string sqlstate;    ///< when the server refused the session's setup
  bool timed_out = false;  ///< the deadline passed (connect or results)
  bool sent = false;       ///< the batch may have reached the server (a write may apply)
  bool closed = false;     ///< closed by the client (shutdown), not by a fault
};

/// The answer of a batch: `failure` null and one result per statement (binary results), or a
/// failure. A statement that failed has its error result (PQresultErrorField works on it);
/// the statements after it have PGRES_PIPELINE_ABORTED results.
using PgCallback = Function<void(std::vector<PgResult>& results, const PgFailure* failure)>;

/// Settings of a connection.
struct PgSettings {
  std::string conninfo;
  /// Statements run once when a connection opens, before anything else (SET ...).
  std::vector<std::string> session;
  /// Prepared statements (name, SQL) made on every connection.
  std::vector<std::pair<std::string, std::string>> prepared;
  std::chrono::milliseconds connect_timeout{5000};
  /// Longest wait for a batch's results, from when it was sent or, when batches sent before it
  /// were still unanswered, from when the one before it was answered (the server answers in
  /// order: each batch has the whole time to itself). 0 means none.
  std::chrono::milliseconds batch_timeout{5000};
  /// After a failed connect, batches fail at once for this long. 0 means retry every time.
  std::chrono::milliseconds reconnect_backoff{100};
};

class PgSession;

/// A connection that keeps itself open: opened on first use, replaced when it breaks.
/// Not thread-safe: every call on the executor given at construction.
class PgConnection {
 public:
  PgConnection(Executor executor, PgSettings settings);
  ~PgConnection();  // closes: batches in flight fail (closed)
  PgConnection(const PgConnection&) = delete;
  PgConnection& operator=(const PgConnection&) = delete;

  /// Sends one batch. `callback` runs on the executor, never inside run().
  void run(const std::vector<PgStatement>& batch, PgCallback callback);

  /// Batches sent and not yet answered.
  std::size_t in_flight() const noexcept;
  /// Connections opened so far (a reconnect counts).
  std::uint64_t connects() const noexcept { return connects_; }
  /// Closes the current connection (its batches fail); the next run() reconnects.
  void close();

 private:
  friend class PgSession;
  void down(const std::string& why) {
    down_until_ = std::chrono::steady_clock::now() + settings_.reconnect_backoff;
    down_reason_ = why;
  }
  void up() noexcept { down_until_ = {}; }

  Executor executor_;
  PgSettings settings_;
  std::shared_ptr<PgSession> session_;
  std::uint64_t connects_ = 0;
  std::chrono::steady_clock::time_point down_until_{};
  std::string down_reason_;
};

}  // namespace idem::async::detail
