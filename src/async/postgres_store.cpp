// SPDX-License-Identifier: MIT
// idem::async::AsyncPostgresStore: idem's two-phase statements on pipelined libpq connections
// driven by the loop (pg_connection.hpp), with the synchronous store's SQL (statements.hpp), its
// rulebook and its error kinds (error_rules.hpp).
#include "idem/async/postgres_store.hpp"

#include <libpq-fe.h>

#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "close_on_strand.hpp"
#include "idem/detail/record_rules.hpp"
#include "idem/errors.hpp"
#include "pg_connection.hpp"
#include "postgres/error_rules.hpp"
#include "postgres/statements.hpp"
#include "postgres/text_fingerprint.hpp"

namespace idem::async {
namespace {

namespace pgd = ::idem::postgres::detail;
using detail::PgConnection;
using detail::PgFailure;
using detail::PgParam;
using detail::PgResult;
using detail::PgSettings;
using detail::PgStatement;

constexpr std::string_view kStore = "postgres";

std::chrono::milliseconds positive_or(std::chrono::milliseconds v, std::chrono::milliseconds d,
                                      const char* field) {
  if (v.count() < 0) {
    throw UsageError(std::string("idem::async: AsyncPostgresStoreOptions::") + field +
                     " must not be negative");
  }
  return v.count() == 0 ? d : v;
}

std::string millis_setting(std::chrono::milliseconds d) { return std::to_string(d.count()) + "ms"; }

std::string trimmed(const char* s) {
  std::string out = s == nullptr ? std::string() : std::string(s);
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

// "postgres: <op> '<key>': <text>", passwords masked.
std::string describe(std::string_view op, const std::string& key, const std::string& text) {
  std::string s = "postgres: ";
  s.append(op);
  if (!key.empty()) s.append(" '").append(key).append("'");
  s.append(": ");
  s.append(pgd::scrub(text));
  return s;
}

template <class E>
std::exception_ptr error(std::string what) {
  return std::make_exception_ptr(E(std::move(what)));
}

std::exception_ptr of_kind(pgd::SqlstateKind kind, std::string what) {
  switch (kind) {
    case pgd::SqlstateKind::kUnavailable:
      return error<StorageUnavailable>(std::move(what));
    case pgd::SqlstateKind::kTimeout:
      return error<StorageTimeout>(std::move(what));
    case pgd::SqlstateKind::kUnknown:
      return error<OutcomeUnknown>(std::move(what));
    case pgd::SqlstateKind::kError:
      break;
  }
  return error<StorageError>(std::move(what));
}

// A batch that got no results, as the synchronous store would have thrown it.
std::exception_ptr failure_error(const PgFailure& f, std::string_view op, const std::string& key) {
  std::string what = describe(op, key, f.message);
  if (f.closed) return error<StorageUnavailable>(what + " (the store was closed)");
  if (!f.sqlstate.empty()) {
    if (f.sqlstate.rfind("28", 0) == 0 || f.sqlstate == "3D000" || f.sqlstate == "42501") {
      return error<UsageError>("[SQLSTATE " + f.sqlstate + "] " + what +
                               " (configuration error: check the conninfo)");
    }
    return of_kind(pgd::sqlstate_kind(f.sqlstate), "[SQLSTATE " + f.sqlstate + "] " + what);
  }
  if (f.timed_out) return error<StorageTimeout>(std::move(what));
  if (!f.sent && pgd::is_configuration_error(f.message)) {
    return error<UsageError>(what + " (configuration error: check the conninfo)");
  }
  if (!f.sent && pgd::refused_by_tls_checks(f.message)) return error<StorageError>(what);
  return error<StorageUnavailable>(std::move(what));
}

// The error of a statement's result (PGRES_FATAL_ERROR), typed by its SQLSTATE.
std::exception_ptr result_error(const PGresult* r, std::string_view op, const std::string& key) {
  const char* state = PQresultErrorField(r, PG_DIAG_SQLSTATE);
  const std::string s = state == nullptr ? std::string() : std::string(state);
  std::string what = describe(op, key, trimmed(PQresultErrorMessage(r)));
  if (!s.empty()) what = "[SQLSTATE " + s + "] " + what;
  return of_kind(pgd::sqlstate_kind(s), std::move(what));
}

std::string_view cell(const PGresult* r, int col) {
  return {PQgetvalue(r, 0, col), static_cast<std::size_t>(PQgetlength(r, 0, col))};
}

// A record row as kRecordColumns return it, in binary: text and bytea as their bytes, bigint
// as 8 bytes big-endian, bool as one byte. A value idem did not write is CorruptRecord.
struct Found {
  Record record;
  bool live = false;
  bool expired = false;
};

Found parse_found(const PGresult* r, const std::string& key) {
  if (PQnfields(r) != 10) {
    throw ::idem::detail::corrupt_record(kStore, key, "unexpected columns");
  }
  auto null = [&](int col) { return PQgetisnull(r, 0, col) != 0; };
  auto millis = [&](int col) -> TimePoint {
    if (null(col)) return TimePoint{};
    const std::string_view v = cell(r, col);
    if (v.size() != 8) throw ::idem::detail::corrupt_record(kStore, key, "a time is not a bigint");
    std::uint64_t u = 0;
    for (char c : v) u = (u << 8) | static_cast<unsigned char>(c);
    return from_millis(static_cast<long long>(u));
  };
  auto flag = [&](int col) {
    if (null(col)) return false;
    const std::string_view v = cell(r, col);
    if (v.size() != 1) throw ::idem::detail::corrupt_record(kStore, key, "not a boolean");
    return v[0] != 0;
  };
  Found f;
  if (null(0)) throw ::idem::detail::corrupt_record(kStore, key, "no status");
  f.record.status = ::idem::detail::record_status_or_throw(cell(r, 0), kStore, key);
  f.record.fingerprint.assign(cell(r, 1));
  f.record.owner.assign(cell(r, 2));
  if (!null(3)) f.record.response.assign(cell(r, 3));
  f.record.lease_until = millis(4);
  f.record.created_at = millis(5);
  f.record.updated_at = millis(6);
  f.record.expires_at = millis(7);
  f.live = flag(8);
  f.expired = flag(9);
  return f;
}

// Completes `done` on `ex`: a post, unless `ex` is the store's own strand.
template <class T>
void settle(const Executor& ex, Completion<T>& done, std::exception_ptr e, T value) {
  net::dispatch(ex, [done = std::move(done), e = std::move(e), v = std::move(value)]() mutable {
    done(std::move(e), std::move(v));
  });
}

// A batch's statements and the bytes of their parameters (alive until run() returns; libpq
// copies them). Parameters are text, as the synchronous store sends them (NUL-terminated
// std::strings), except a bytea, sent binary (its bytes as they are).
class Batch {
 public:
  /// Adds statement `name` with text parameters.
  Batch& add(const char* name, std::initializer_list<std::string> text) {
    Entry e;
    e.name = name;
    e.values.assign(text.begin(), text.end());
    entries_.push_back(std::move(e));
    return *this;
  }
  /// Adds statement `name` whose parameter `bytea` (0-based) is binary.
  Batch& add(const char* name, std::initializer_list<std::string> values, int bytea) {
    add(name, values);
    entries_.back().bytea = bytea;
    return *this;
  }
  std::vector<PgStatement> statements() const {
    std::vector<PgStatement> out;
    out.reserve(entries_.size());
    for (const Entry& e : entries_) {
      PgStatement st;
      st.name_or_sql = e.name;
      st.prepared = true;
      for (std::size_t i = 0; i < e.values.size(); ++i) {
        PgParam p;
        p.value = e.values[i];
        p.binary = static_cast<int>(i) == e.bytea;
        st.params.push_back(p);
      }
      out.push_back(std::move(st));
    }
    return out;
  }

 private:
  struct Entry {
    const char* name = nullptr;
    std::vector<std::string> values;
    int bytea = -1;
  };
  std::vector<Entry> entries_;
};

}  // namespace

class IDEM_LOCAL AsyncPostgresStore::Impl : public std::enable_shared_from_this<AsyncPostgresStore::Impl> {
 public:
  Impl(Executor executor, postgres::PostgresStore& store, AsyncPostgresStoreOptions o)
      : options_(normalise(std::move(o), store)), strand_(net::make_strand(executor)) {
    const auto& so = store.options();
    PgSettings s;
    s.conninfo = options_.conninfo;
    s.session = {"SET lock_timeout = '" + millis_setting(options_.lock_timeout) + "'",
                 "SET statement_timeout = '" + millis_setting(options_.statement_timeout) + "'"};
    // Only the statements of the two-phase protocol are prepared on the loop's connections.
    for (auto& [name, sql] : pgd::statements(store.qualified_table(), so.key_column, so.scope_column)) {
      for (const char* wanted : {pgd::kClaim, pgd::kRead, pgd::kTakeover, pgd::kRemoveExpired,
                                 pgd::kComplete, pgd::kFail, pgd::kRelease}) {
        if (name == wanted) s.prepared.emplace_back(name, sql);
      }
    }
    s.connect_timeout = options_.connect_timeout;
    s.batch_timeout = options_.statement_timeout + options_.client_grace;
    s.reconnect_backoff = options_.reconnect_backoff;
    for (std::size_t i = 0; i < options_.connections; ++i) {
      connections_.push_back(std::make_unique<PgConnection>(strand_, s));
    }
  }

  static AsyncPostgresStoreOptions normalise(AsyncPostgresStoreOptions o,
                                             const postgres::PostgresStore& store) {
    using std::chrono::milliseconds;
    if (o.conninfo.empty()) o.conninfo = store.options().conninfo;
    if (auto why = pgd::raw_at_in_uri_userinfo(o.conninfo); !why.empty()) {
      throw UsageError("idem::AsyncPostgresStore: " + why);
    }
    if (o.connections == 0) o.connections = 1;
    o.connect_timeout = positive_or(o.connect_timeout, milliseconds(2000), "connect_timeout");
    o.statement_timeout =
        positive_or(o.statement_timeout, milliseconds(1000), "statement_timeout");
    o.client_grace = positive_or(o.client_grace, milliseconds(1000), "client_grace");
    o.lock_timeout = positive_or(o.lock_timeout, milliseconds(100), "lock_timeout");
    if (o.reconnect_backoff.count() < 0) {
      throw UsageError(
          "idem::async: AsyncPostgresStoreOptions::reconnect_backoff must not be negative");
    }
    return o;
  }

  template <class Fn>
  void on_strand(Fn&& fn) {
    net::dispatch(strand_, std::forward<Fn>(fn));
  }

  // --- begin ----------------------------------------------------------------------------------

  struct BeginOp {
    std::string id, scope, key, fingerprint, owner, lease_ms;
    Executor ex;
    Completion<ClaimResult> done;
    int round = 0;
    bool retried = false;
    bool remove_first = false;  // the last read found an ended record: delete it first
  };

  void begin(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
             std::chrono::milliseconds lease, const Executor& ex, Completion<ClaimResult> done) {
    try {
      idem::detail::check_term(lease, "idem::postgres: the lease");
    } catch (const UsageError&) {
      return settle(ex, done, std::current_exception(), ClaimResult{});
    }
    auto op = std::make_shared<BeginOp>();
    op->id = key.id();
    op->scope = key.scope();
    op->key = key.str();
    op->fingerprint.assign(pgd::TextFingerprint(fingerprint).text());  // bound and compared
    op->owner = owner.str();
    op->lease_ms = std::to_string(lease.count());
    op->ex = ex;
    op->done = std::move(done);
    on_strand([self = shared_from_this(), op = std::move(op)]() mutable { self->claim_round(op); });
  }

  // One round: [remove the ended record,] insert if absent, read what is there; one round trip.
  void claim_round(std::shared_ptr<BeginOp> op) {
    if (op->round >= pgd::kClaimRounds) {
      return settle(op->ex, op->done, nullptr, ::idem::detail::busy_claim());
    }
    ++op->round;
    Batch b;
    const bool remove = op->remove_first;
    op->remove_first = false;
    if (remove) b.add(pgd::kRemoveExpired, {op->id, op->scope});
    b.add(pgd::kClaim, {op->id, op->scope, op->fingerprint, op->owner, op->lease_ms});
    b.add(pgd::kRead, {op->id, op->scope});
    run(b, [self = shared_from_this(), op, remove](std::vector<PgResult>& results,
                                                   const PgFailure* f) mutable {
      self->claim_answered(std::move(op), remove, results, f);
    });
  }

  void claim_answered(std::shared_ptr<BeginOp> op, bool removed, std::vector<PgResult>& results,
                      const PgFailure* f) {
    if (f != nullptr) {
      if (retryable(*f) && !op->retried) {
        // The connection broke under the batch (an idle connection the server dropped): once
        // more on a fresh one. A claim that did apply is found as our own (kKeep).
        op->retried = true;
        retries_.fetch_add(1, std::memory_order_relaxed);
        --op->round;
        op->remove_first = removed;
        return claim_round(std::move(op));
      }
      return settle(op->ex, op->done, failure_error(*f, "begin", op->key), ClaimResult{});
    }
    for (const PgResult& r : results) {
      if (PQresultStatus(r.get()) == PGRES_FATAL_ERROR) return claim_failed(*op, r.get());
    }
    const std::size_t at = removed ? 1 : 0;
    if (results.size() != at + 2) {
      return settle(op->ex, op->done,
                    error<StorageError>(describe("begin", op->key, "unexpected results")),
                    ClaimResult{});
    }
    if (PQntuples(results[at].get()) > 0) {
      return settle(op->ex, op->done, nullptr, ClaimResult{});  // inserted: ours
    }
    const PGresult* read = results[at + 1].get();
    if (PQntuples(read) == 0) return claim_round(std::move(op));  // deleted meanwhile: again
    std::exception_ptr bad;
    ::idem::detail::ClaimDecision d;
    std::string found_owner;
    try {
      Found found = parse_found(read, op->key);
      d = ::idem::detail::decide_claim(
          ::idem::detail::found_by_store_clock(found.record, found.live, found.expired),
          op->fingerprint, op->owner);
      found_owner = std::move(found.record.owner);
    } catch (...) {
      bad = std::current_exception();
    }
    if (bad) return settle(op->ex, op->done, std::move(bad), ClaimResult{});
    switch (d.action) {
      case ::idem::detail::ClaimAction::kAnswer:
      case ::idem::detail::ClaimAction::kKeep:
        return settle(op->ex, op->done, nullptr, std::move(d.result));
      case ::idem::detail::ClaimAction::kReplace:
        op->remove_first = true;
        return claim_round(std::move(op));
      case ::idem::detail::ClaimAction::kTakeOver:
        break;
    }
    // The lease ended: take it over where the record still has the old owner (of two takers
    // the second re-checks the row after the first commits and updates nothing).
    Batch b;
    b.add(pgd::kTakeover, {op->id, op->scope, op->owner, op->lease_ms, found_owner});
    run(b, [self = shared_from_this(), op, result = std::move(d.result)](
               std::vector<PgResult>& rs, const PgFailure* tf) mutable {
      if (tf != nullptr) {
        if (self->retryable(*tf) && !op->retried) {
          // Whether it applied or not, the next round's read tells (ours: kKeep).
          op->retried = true;
          self->retries_.fetch_add(1, std::memory_order_relaxed);
          return self->claim_round(std::move(op));
        }
        return settle(op->ex, op->done, failure_error(*tf, "begin", op->key), ClaimResult{});
      }
      if (rs.size() != 1) {
        return settle(op->ex, op->done,
                      error<StorageError>(describe("begin", op->key, "unexpected results")),
                      ClaimResult{});
      }
      if (PQresultStatus(rs[0].get()) == PGRES_FATAL_ERROR) {
        return self->claim_failed(*op, rs[0].get());
      }
      if (PQntuples(rs[0].get()) > 0) return settle(op->ex, op->done, nullptr, std::move(result));
      self->claim_round(std::move(op));  // another attempt took it over or finished it first
    });
  }

  // A statement of the claim failed: a lock wait past lock_timeout is another transaction
  // holding the key (kBusy); anything else is typed.
  void claim_failed(BeginOp& op, const PGresult* r) {
    const char* state = PQresultErrorField(r, PG_DIAG_SQLSTATE);
    if (state != nullptr && std::strcmp(state, "55P03") == 0) {
      lock_timeouts_.fetch_add(1, std::memory_order_relaxed);
      return settle(op.ex, op.done, nullptr, ::idem::detail::busy_claim());
    }
    settle(op.ex, op.done, result_error(r, "begin", op.key), ClaimResult{});
  }

  // --- complete / fail ------------------------------------------------------------------------

  struct FinishOp {
    const char* statement = nullptr;  // kComplete or kFail
    const char* op = nullptr;         // "complete" or "fail"
    Record::Status target = Record::Status::kCompleted;
    std::string id, scope, key, owner, response, retention_s;
    Executor ex;
    Completion<bool> done;
    bool rewritten = false;  // the resolution wrote it once more
    int reads = 0;
  };

  void finish(const char* statement, Record::Status target, const Key& key,
              const OwnerToken& owner, std::string_view response, std::chrono::seconds retention,
              const Executor& ex, Completion<bool> done) {
    try {
      idem::detail::check_term(retention, "idem::postgres: the retention");
    } catch (const UsageError&) {
      return settle(ex, done, std::current_exception(), false);
    }
    auto op = std::make_shared<FinishOp>();
    op->statement = statement;
    op->op = target == Record::Status::kCompleted ? "complete" : "fail";
    op->target = target;
    op->id = key.id();
    op->scope = key.scope();
    op->key = key.str();
    op->owner = owner.str();
    op->response.assign(response);
    op->retention_s = std::to_string(retention.count());
    op->ex = ex;
    op->done = std::move(done);
    on_strand([self = shared_from_this(), op = std::move(op)]() mutable { self->write(op); });
  }

  void write(std::shared_ptr<FinishOp> op) {
    // $1 id, $2 scope, $3 owner, $4 the response (bytea), $5 the retention in seconds.
    Batch b;
    b.add(op->statement, {op->id, op->scope, op->owner, op->response, op->retention_s}, 3);
    run(b, [self = shared_from_this(), op](std::vector<PgResult>& rs,
                                           const PgFailure* f) mutable {
      self->written(std::move(op), rs, f);
    });
  }

  void written(std::shared_ptr<FinishOp> op, std::vector<PgResult>& rs, const PgFailure* f) {
    if (f != nullptr) {
      // Not sent: nothing can have applied. Sent: the answer is lost, not the write perhaps.
      if (!f->sent) return settle(op->ex, op->done, failure_error(*f, op->op, op->key), false);
      return resolve(std::move(op));
    }
    if (rs.size() != 1) {
      return settle(op->ex, op->done,
                    error<StorageError>(describe(op->op, op->key, "unexpected results")), false);
    }
    if (PQresultStatus(rs[0].get()) == PGRES_FATAL_ERROR) {
      const char* state = PQresultErrorField(rs[0].get(), PG_DIAG_SQLSTATE);
      if (op->rewritten && state != nullptr && std::strcmp(state, "55P03") == 0) {
        // The write sent again waited on the row: the first one, still running, holds it.
        return resolve(std::move(op));
      }
      return settle(op->ex, op->done, result_error(rs[0].get(), op->op, op->key), false);
    }
    if (PQntuples(rs[0].get()) > 0) {
      // Written once more after a read found it still in progress: the lost answer is settled.
      if (op->rewritten) outcomes_resolved_.fetch_add(1, std::memory_order_relaxed);
      return settle(op->ex, op->done, nullptr, true);
    }
    if (op->rewritten) return resolve(std::move(op));  // a late first write, perhaps
    settle(op->ex, op->done, nullptr, false);
  }

  // The write's answer was lost: read the record (a fresh connection if need be). Ours and
  // finished as asked: true. Ours and still in progress: written once more. Anything else:
  // false (the lease was lost). No answer from the read either: OutcomeUnknown.
  void resolve(std::shared_ptr<FinishOp> op) {
    if (++op->reads > 2) {
      outcomes_unknown_.fetch_add(1, std::memory_order_relaxed);
      return settle(op->ex, op->done,
                    error<OutcomeUnknown>(describe(op->op, op->key,
                                                   "the record did not settle after a lost answer "
                                                   "(retry with the same key)")),
                    false);
    }
    Batch b;
    b.add(pgd::kRead, {op->id, op->scope});
    run(b, [self = shared_from_this(), op](std::vector<PgResult>& rs, const PgFailure* f) mutable {
      auto unknown = [&](const std::string& why) {
        self->outcomes_unknown_.fetch_add(1, std::memory_order_relaxed);
        std::string what = describe(op->op, op->key,
                                    "the answer was lost and the record could not be re-read (" +
                                        why + "); the write may have applied (retry with the "
                                              "same key)");
        settle(op->ex, op->done, error<OutcomeUnknown>(std::move(what)), false);
      };
      if (f != nullptr) return unknown(f->message);
      if (rs.size() != 1 || PQresultStatus(rs[0].get()) != PGRES_TUPLES_OK) {
        return unknown(rs.empty() ? std::string("no result")
                                  : trimmed(PQresultErrorMessage(rs[0].get())));
      }
      std::optional<Found> found;
      if (PQntuples(rs[0].get()) > 0) {
        try {
          found = parse_found(rs[0].get(), op->key);
        } catch (...) {
          return settle(op->ex, op->done, std::current_exception(), false);
        }
      }
      const bool ours = found && found->record.owner == op->owner;
      if (ours && found->record.status == op->target) {
        self->outcomes_resolved_.fetch_add(1, std::memory_order_relaxed);
        return settle(op->ex, op->done, nullptr, true);
      }
      if (ours && found->record.status == Record::Status::kInProgress) {
        // Not applied (yet): write it once more. Still in progress after that second write
        // was lost too: a write of ours may yet apply (the server runs what it received).
        if (op->rewritten) return unknown("still in progress after the write was sent again");
        op->rewritten = true;
        return self->write(std::move(op));
      }
      self->outcomes_resolved_.fetch_add(1, std::memory_order_relaxed);
      settle(op->ex, op->done, nullptr, false);
    });
  }

  // --- release / lookup -----------------------------------------------------------------------

  void release(const Key& key, const OwnerToken& owner, const Executor& ex, Completion<bool> done) {
    auto b = std::make_shared<Batch>();
    b->add(pgd::kRelease, {key.id(), key.scope(), owner.str()});
    on_strand([self = shared_from_this(), b, k = key.str(), ex, done = std::move(done)]() mutable {
      self->run_idempotent(b, "release", std::move(k), false,
                           [ex, done = std::move(done)](std::exception_ptr e,
                                                        const PGresult* r) mutable {
                             settle(ex, done, std::move(e), r != nullptr && PQntuples(r) > 0);
                           });
    });
  }

  void lookup(const Key& key, const Executor& ex, Completion<std::optional<Record>> done) {
    auto b = std::make_shared<Batch>();
    b->add(pgd::kRead, {key.id(), key.scope()});
    on_strand([self = shared_from_this(), b, k = key.str(), ex, done = std::move(done)]() mutable {
      std::string kk = k;
      self->run_idempotent(
          b, "lookup", std::move(kk), false,
          [k = std::move(k), ex, done = std::move(done)](std::exception_ptr e,
                                                         const PGresult* r) mutable {
            std::optional<Record> out;
            if (!e && r != nullptr && PQntuples(r) > 0) {
              try {
                out = parse_found(r, k).record;
                out->fingerprint = pgd::fingerprint_from_text(std::move(out->fingerprint));
              } catch (...) {
                e = std::current_exception();
              }
            }
            settle(ex, done, std::move(e), std::move(out));
          });
    });
  }

  // Runs a one-statement batch safe to repeat, once more if the connection broke under it.
  // `then(error, result)`: the result of the statement (error null), or the typed error.
  void run_idempotent(std::shared_ptr<Batch> b, const char* what, std::string key, bool retried,
                      Function<void(std::exception_ptr, const PGresult*)> then) {
    run(*b, [self = shared_from_this(), b, what, key = std::move(key), retried,
             then = std::move(then)](std::vector<PgResult>& rs, const PgFailure* f) mutable {
      if (f != nullptr) {
        if (!retried && self->retryable(*f)) {
          self->retries_.fetch_add(1, std::memory_order_relaxed);
          return self->run_idempotent(std::move(b), what, std::move(key), true, std::move(then));
        }
        return then(failure_error(*f, what, key), nullptr);
      }
      if (rs.size() != 1) {
        return then(error<StorageError>(describe(what, key, "unexpected results")), nullptr);
      }
      if (PQresultStatus(rs[0].get()) == PGRES_FATAL_ERROR) {
        return then(result_error(rs[0].get(), what, key), nullptr);
      }
      then(nullptr, rs[0].get());
    });
  }

  // --- the connections ------------------------------------------------------------------------

  // A connection broke under a batch (not a deadline, not our own close): worth one more try.
  static bool retryable(const PgFailure& f) noexcept {
    return f.sent && !f.timed_out && !f.closed && f.sqlstate.empty();
  }

  // On the strand: the batch goes to the next connection in turn.
  void run(const Batch& b, detail::PgCallback cb) {
    batches_.fetch_add(1, std::memory_order_relaxed);
    detail::PgCallback counted = [self = shared_from_this(), cb = std::move(cb)](
                                     std::vector<PgResult>& rs, const PgFailure* f) mutable {
      if (f != nullptr) self->failed_batches_.fetch_add(1, std::memory_order_relaxed);
      cb(rs, f);
    };
    if (closed_) {
      PgFailure f{"the store was closed"};
      f.closed = true;
      net::post(strand_, [counted = std::move(counted), f]() mutable {
        std::vector<PgResult> none;
        counted(none, &f);
      });
      return;
    }
    PgConnection& c = *connections_[next_];
    next_ = (next_ + 1) % connections_.size();
    c.run(b.statements(), std::move(counted));
  }

  // On the strand: fails what is in flight and every later call.
  void close() {
    closed_ = true;
    for (auto& c : connections_) c->close();
  }

  AsyncPostgresStats stats() const {
    AsyncPostgresStats s;
    for (const auto& c : connections_) s.connects += c->connects();
    s.batches = batches_.load(std::memory_order_relaxed);
    s.failed_batches = failed_batches_.load(std::memory_order_relaxed);
    s.lock_timeouts = lock_timeouts_.load(std::memory_order_relaxed);
    s.retries = retries_.load(std::memory_order_relaxed);
    s.outcomes_resolved = outcomes_resolved_.load(std::memory_order_relaxed);
    s.outcomes_unknown = outcomes_unknown_.load(std::memory_order_relaxed);
    return s;
  }

  const AsyncPostgresStoreOptions& options() const noexcept { return options_; }

 private:
  const AsyncPostgresStoreOptions options_;
  net::strand<Executor> strand_;
  std::vector<std::unique_ptr<PgConnection>> connections_;
  std::size_t next_ = 0;
  bool closed_ = false;
  std::atomic<std::uint64_t> batches_{0}, failed_batches_{0}, lock_timeouts_{0}, retries_{0},
      outcomes_resolved_{0}, outcomes_unknown_{0};
};

AsyncPostgresStore::AsyncPostgresStore(Executor executor, postgres::PostgresStore& store,
                                       WorkerPool& pool, AsyncPostgresStoreOptions options)
    : pooled_(store, pool),
      impl_(std::make_shared<Impl>(std::move(executor), store, std::move(options))) {}

AsyncPostgresStore::~AsyncPostgresStore() {
  // Closed on the store's strand, whichever thread destroys the store (at once when that is
  // the strand's thread): the loop may be running the store's handlers right now. A loop that
  // never runs again closes them when its io_context is destroyed (detail::CloseOnStrand).
  std::shared_ptr<Impl> impl = std::move(impl_);
  if (!impl) return;
  Impl* raw = impl.get();
  raw->on_strand(detail::CloseOnStrand<Impl>(std::move(impl)));
}

void AsyncPostgresStore::async_begin(const Key& key, std::string_view fingerprint,
                                     const OwnerToken& owner, std::chrono::milliseconds lease,
                                     DurableHint, const Executor& ex,
                                     Completion<ClaimResult> done) {
  impl_->begin(key, fingerprint, owner, lease, ex, std::move(done));
}

void AsyncPostgresStore::async_complete(const Key& key, const OwnerToken& owner,
                                        std::string_view response, std::chrono::seconds retention,
                                        const Executor& ex, Completion<bool> done) {
  impl_->finish(postgres::detail::kComplete, Record::Status::kCompleted, key, owner, response,
                retention, ex, std::move(done));
}

void AsyncPostgresStore::async_fail(const Key& key, const OwnerToken& owner,
                                    std::string_view reason, std::chrono::seconds retention,
                                    const Executor& ex, Completion<bool> done) {
  impl_->finish(postgres::detail::kFail, Record::Status::kFailed, key, owner, reason, retention,
                ex, std::move(done));
}

void AsyncPostgresStore::async_release(const Key& key, const OwnerToken& owner,
                                       const Executor& ex, Completion<bool> done) {
  impl_->release(key, owner, ex, std::move(done));
}

void AsyncPostgresStore::async_lookup(const Key& key, const Executor& ex,
                                      Completion<std::optional<Record>> done) {
  impl_->lookup(key, ex, std::move(done));
}

const AsyncPostgresStoreOptions& AsyncPostgresStore::options() const noexcept {
  return impl_->options();
}

AsyncPostgresStats AsyncPostgresStore::stats() const { return impl_->stats(); }

}  // namespace idem::async
