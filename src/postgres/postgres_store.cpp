// SPDX-License-Identifier: MIT
// PostgreSQL durable store: statements, migration, claim protocol, commit resolution.
#include "idem/postgres/postgres_store.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "deadline.hpp"
#include "errors.hpp"
#include "idem/detail/record_columns.hpp"
#include "idem/detail/record_rules.hpp"
#include "idem/detail/rerun_pause.hpp"
#include "idem/postgres/detail/pqxx_compat.hpp"
#include "idem/sql.hpp"
#include "identifiers.hpp"
#include "statements.hpp"
#include "text_fingerprint.hpp"

namespace idem::postgres {

namespace {

// 2: the unique key is the primary key (no surrogate `id`). Version-1 tables (with `id`) work
// unchanged: no statement uses `id`, and their version row is left at 1, so an older idem that
// still returns `id` keeps working on them and refuses version-2 tables.
constexpr int kSchemaVersion = 2;

// The schema version `versions` records for `table` (0: none, or no version table), after
// refusing one newer than this idem knows (its layout may have changed under these statements).
int check_not_newer(pqxx::transaction_base& tx, const std::string& versions,
                    const std::string& table) {
  if (detail::exec_params(tx, "SELECT to_regclass($1)::text", versions)[0][0].is_null()) return 0;
  const pqxx::result r =
      detail::exec_params(tx, "SELECT version FROM " + versions + " WHERE name = $1", table);
  const int version = r.empty() ? 0 : r[0][0].as<int>();
  if (version > kSchemaVersion) {
    // Named with its schema (`versions` is "<schema>.idem_schema_version"): one service may
    // keep tables of several schemas.
    const std::string schema = versions.substr(0, versions.find('.'));
    throw StorageError("postgres: table '" + schema + "." + table + "' has schema version " +
                       std::to_string(version) + ", newer than this idem (" +
                       std::to_string(kSchemaVersion) + ")");
  }
  return version;
}
// The schema version of an existing record table `t` that has no version row (1: it has an
// `id` column, 2: it does not), after checking what every statement relies on: a unique key on
// exactly (k, s) without a predicate (the claims' ON CONFLICT target) and no NOT NULL column
// without a default that idem does not write. @throws UsageError naming what is wrong.
int check_existing_table(pqxx::transaction_base& tx, const std::string& t, const std::string& k,
                         const std::string& s) {
  const bool unique =
      !detail::exec_params(
           tx,
           "SELECT 1 FROM pg_index i WHERE i.indrelid = $1::regclass AND i.indisunique"
           " AND i.indpred IS NULL AND i.indnkeyatts = 2 AND (SELECT count(*) FROM pg_attribute a"
           " WHERE a.attrelid = i.indrelid AND a.attnum IN (i.indkey[0], i.indkey[1])"
           " AND a.attname IN ($2, $3)) = 2",
           t, k, s)
           .empty();
  if (!unique) {
    throw UsageError("idem::postgres: table " + t + " exists without a version row and has no " +
                     "unique key on exactly (" + k + ", " + s +
                     "): idem's claims need one (docs/postgres.md), or use another table");
  }
  std::string extra;
  for (const auto& row : detail::exec_params(
           tx,
           "SELECT attname FROM pg_attribute WHERE attrelid = $1::regclass AND attnum > 0"
           " AND NOT attisdropped AND attnotnull AND NOT atthasdef AND attidentity = ''"
           " AND attgenerated = '' AND attname <> 'id' ORDER BY attnum",
           t)) {
    const std::string name = row[0].c_str();
    if (!idem::detail::is_record_column(name, k, s)) extra += (extra.empty() ? "" : ", ") + name;
  }
  if (!extra.empty()) {
    throw UsageError("idem::postgres: table " + t + " has NOT NULL columns without a default " +
                     "that idem does not write (" + extra + "): give them a default or let " +
                     "them be NULL");
  }
  const bool has_id = !detail::exec_params(tx,
                                           "SELECT 1 FROM pg_attribute WHERE attrelid = "
                                           "$1::regclass AND attname = 'id' AND NOT attisdropped",
                                           t)
                           .empty();
  return has_id ? 1 : 2;
}

// pg_advisory_xact_lock key of idem's migrations ("idem" + "mig" in ASCII).
constexpr const char* kMigrationLockKey = "7306086965236950125";
// The statements, their names, kRecordColumns and kClaimRounds (statements.hpp, shared with the
// asynchronous store).
using namespace idem::postgres::detail;  // NOLINT(google-build-using-namespace)

struct Found {
  Record record;
  bool live = false;     // in progress and its lease has not ended (database clock)
  bool expired = false;  // completed/failed and its retention has ended
};

TimePoint millis_field(const pqxx::field& f) {
  return f.is_null() ? TimePoint{} : from_millis(f.as<long long>());
}

// A record row as kRecordColumns return it. The table's types (timestamptz, a CHECK on status)
// keep foreign values out of idem's own table; an adopted table may not have them: a value
// idem did not write is CorruptRecord.
Found parse_found(const pqxx::row& row, pqxx::row::size_type at, const Key& key) {
  Found f;
  f.record.status = idem::detail::record_status_or_throw(row[at].c_str(), "postgres", key);
  try {
    f.record.fingerprint = row[at + 1].as<std::string>();
    f.record.owner = row[at + 2].as<std::string>();
    f.record.response = detail::read_bytea(row[at + 3]);
    f.record.lease_until = millis_field(row[at + 4]);
    f.record.created_at = millis_field(row[at + 5]);
    f.record.updated_at = millis_field(row[at + 6]);
    f.record.expires_at = millis_field(row[at + 7]);
    f.live = row[at + 8].as<bool>();
    f.expired = row[at + 9].as<bool>();
  } catch (const idem::Error&) {
    throw;
  } catch (const std::exception& e) {
    throw idem::detail::corrupt_record("postgres", key.str(), e.what());
  }
  return f;
}

// A row of kFoundColumns as the record rulebook reads it: views of the row's fields (valid while
// `row`'s result lives) and of `response` (the decoded bytea). Values idem did not write are
// CorruptRecord, as in parse_found.
idem::detail::FoundRecord found_row(const pqxx::row& row, const Key& key, std::string& response) {
  auto text = [&](const pqxx::field& f, const char* what) {
    if (f.is_null()) {
      throw idem::detail::corrupt_record("postgres", key.str(), std::string(what) + " is NULL");
    }
    return std::string_view(f.c_str(), f.size());
  };
  idem::detail::FoundRecord found;
  found.status = idem::detail::record_status_or_throw(text(row[0], "status"), "postgres", key);
  try {
    found.fingerprint = text(row[1], "fingerprint");
    found.owner = text(row[2], "owner");
    response = detail::read_bytea(row[3]);
    found.response = response;
    found.created_at = millis_field(row[4]);
    found.retention_over = row[5].as<bool>();  // lease_live stays false: not read (kFoundColumns)
    found.expires_at = millis_field(row[6]);
  } catch (const idem::Error&) {
    throw;
  } catch (const std::exception& e) {
    throw idem::detail::corrupt_record("postgres", key.str(), e.what());
  }
  return found;
}

bool is_retryable_rollback(const std::string& state) {
  return state == "40001" || state == "40P01";
}

// SQLSTATEs of a connection that failed or a server shutting down (FATAL for the session).
bool is_connection_failure(const std::string& state) {
  return state.rfind("08", 0) == 0 || state == "57P01" || state == "57P02" || state == "57P03";
}

std::string millis_setting(std::chrono::milliseconds d) { return std::to_string(d.count()) + "ms"; }

// A wait that outlived PostgresStoreOptions::client_timeout: the statement was cancelled or its
// socket shut down, so its connection must be dropped (whoever owns it catches this marker).
struct ConnectionCut {
  virtual ~ConnectionCut() = default;
};
// ... an idem statement or BEGIN: nothing of it committed (retryable).
class ClientTimeout : public StorageTimeout, public ConnectionCut {
 public:
  using StorageTimeout::StorageTimeout;
};
// ... a COMMIT: it may have committed.
class ClientCommitUnknown : public OutcomeUnknown, public ConnectionCut {
 public:
  using OutcomeUnknown::OutcomeUnknown;
};

// Inside a catch block the libpqxx error of the cut wait is nested as the cause.
[[noreturn]] void throw_client_timeout(std::string_view context, std::chrono::milliseconds limit,
                                       bool commit) {
  const std::string what =
      "postgres: " + std::string(context) + ": no answer from the server within client_timeout (" +
      std::to_string(limit.count()) + " ms); the statement was cancelled and its connection " +
      (commit ? "dropped: the transaction may have committed (retry with the same key)"
              : "dropped");
  const bool in_flight = static_cast<bool>(std::current_exception());
  if (commit) {
    if (in_flight) std::throw_with_nested(ClientCommitUnknown(what));
    throw ClientCommitUnknown(what);
  }
  if (in_flight) std::throw_with_nested(ClientTimeout(what));
  throw ClientTimeout(what);
}

}  // namespace

struct IDEM_LOCAL PostgresStore::Impl {
  PostgresStoreOptions& options;
  std::string lock_timeout;  // "2000ms": set on pooled connections, and by claim_in
  std::atomic<std::uint64_t> retries{0}, lock_timeouts{0}, commits_resolved{0}, commits_unknown{0};

  std::vector<std::pair<std::string, std::string>> sql;  // name -> text
  // Bounds idem's waits on the server (null when client_timeout is 0).
  std::unique_ptr<detail::DeadlineWatch> watch;

  // Whether a pooled connection has read the table's version row (once per store, whatever
  // `migrate` says: a table a newer idem moved must not be used by this one).
  std::atomic<bool> version_checked{false};

  explicit Impl(PostgresStoreOptions& o) : options(o) {}

  // Runs `fn()` with its wait on connection `c` bounded by client_timeout: past it, throws
  // ClientTimeout (also when `fn` returned just after the cancel was sent: a cancel still on
  // its way could hit the next statement, so the connection's transaction must not go on).
  // `commit`: fn sends COMMIT (past the deadline: ClientCommitUnknown).
  template <class Connection, class Fn>
  auto bounded(Connection& c, std::string_view context, Fn&& fn, bool commit = false)
      -> decltype(fn()) {
    detail::DeadlineWatch::Armed armed(watch.get(), c);
    try {
      if constexpr (std::is_void_v<decltype(fn())>) {
        fn();
        if (armed.expired()) throw_client_timeout(context, watch->limit(), commit);
      } else {
        auto r = fn();
        if (armed.expired()) throw_client_timeout(context, watch->limit(), commit);
        return r;
      }
    } catch (const ConnectionCut&) {
      throw;
    } catch (...) {
      if (armed.expired()) throw_client_timeout(context, watch->limit(), commit);
      throw;
    }
  }

  // What transaction_base::conn() returns (pqxx::connection_base in libpqxx 6).
  using Connection = std::remove_reference_t<decltype(std::declval<pqxx::work&>().conn())>;
  // The pooled connections inside run_in_transaction right now: a transaction on one of them
  // has this store's prepared statements (the *_in calls use them then). Kept by connection,
  // not by thread, so a *_in call from any thread on such a transaction finds it.
  class OpenConnections {
   public:
    void add(const void* c) {
      std::lock_guard<std::mutex> lock(mutex_);
      open_.push_back(c);
    }
    void remove(const void* c) noexcept {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = std::find(open_.begin(), open_.end(), c);
      if (it != open_.end()) open_.erase(it);
    }
    bool contains(const void* c) const noexcept {
      std::lock_guard<std::mutex> lock(mutex_);
      return std::find(open_.begin(), open_.end(), c) != open_.end();
    }

   private:
    mutable std::mutex mutex_;
    std::vector<const void*> open_;  // at most the pool's size
  };
  OpenConnections open_connections;
  // Whether `t` runs on one of this store's pooled connections (prepared statements ready).
  bool pooled(const pqxx::transaction_base& t) const noexcept {
    return open_connections.contains(static_cast<const void*>(&t.conn()));
  }

  // Runs statement `name`: prepared on pooled connections (also inside with_transaction), or
  // as a one-off parameterised statement on a connection the caller owns (claim_in /
  // complete_in on the caller's transaction), which never gets idem's prepared statements.
  template <class... Args>
  pqxx::result run(pqxx::transaction_base& t, bool pooled, const char* name, Args&&... args) {
    if (pooled) return detail::exec_prepared(t, name, std::forward<Args>(args)...);
    for (const auto& [n, text] : sql) {
      if (n == name) return detail::exec_params(t, text, std::forward<Args>(args)...);
    }
    throw StorageError(std::string("postgres: internal error: no statement ") + name);
  }


  // A transactional claim that inserts the record completed (DurableHint::expected_response).
  struct CompletedInsert {
    std::string_view response;
    long long retention_s = 0;
    bool inserted = false;  // out: the row went in completed (not taken over)
    long long xid = 0;      // out: txid_current() of the transaction, when inserted
  };

  // Claims or finds the record inside `t` (a transaction, a subtransaction or autocommit).
  // With `completed`, a new row goes in completed with its response (kClaimCompleted).
  // Throws the libpqxx error of a lock timeout (55P03); callers turn it into kBusy.
  // With `plain_first`, the first INSERT has no ON CONFLICT (kClaimNew, kClaimCompletedNew):
  // an existing key raises 23505 (pqxx::unique_violation) and aborts `t`.
  ClaimResult claim(pqxx::transaction_base& t, const Key& key, std::string_view fingerprint,
                    const OwnerToken& owner, std::chrono::milliseconds lease, bool pooled = true,
                    CompletedInsert* completed = nullptr, bool plain_first = false) {
    // Bound and compared in the column's form (text_fingerprint.hpp).
    const detail::TextFingerprint text_fp(fingerprint);
    const std::string fp(text_fp.text());
    const long long lease_ms = lease.count();
    for (int round = 0; round < kClaimRounds; ++round) {
      const bool plain = plain_first && round == 0;  // inserts a row or throws
      pqxx::result r =
          completed ? run(t, pooled, plain ? kClaimCompletedNew : kClaimCompleted, key.id(),
                          key.scope(), fp, owner.str(), detail::bytea(completed->response),
                          completed->retention_s)
                    : run(t, pooled, plain ? kClaimNew : kClaim, key.id(), key.scope(), fp,
                          owner.str(), lease_ms);
      if (!r.empty()) {  // inserted: ours
        if (completed) {
          completed->inserted = true;
          completed->xid = r[0][0].as<long long>();
        }
        return ClaimResult{};
      }
      std::optional<Found> found;
      pqxx::result again = run(t, pooled, kRead, key.id(), key.scope());
      if (!again.empty()) found = parse_found(again[0], 0, key);
      if (!found) continue;  // deleted meanwhile (released, purged): claim again
      idem::detail::ClaimDecision d = idem::detail::decide_claim(
          idem::detail::found_by_store_clock(found->record, found->live, found->expired), fp,
          owner.str());
      switch (d.action) {
        case idem::detail::ClaimAction::kAnswer:
        case idem::detail::ClaimAction::kKeep:
          return std::move(d.result);
        case idem::detail::ClaimAction::kReplace:
          run(t, pooled, kRemoveExpired, key.id(), key.scope());
          continue;
        case idem::detail::ClaimAction::kTakeOver:
          break;
      }
      pqxx::result u = run(t, pooled, kTakeover, key.id(), key.scope(), owner.str(), lease_ms,
                           found->record.owner);
      if (!u.empty()) return std::move(d.result);
      // Another attempt took it over or completed it first: look again.
    }
    return idem::detail::busy_claim();
  }

  // Resolves a COMMIT whose connection was lost: ask the server on a fresh connection whether
  // transaction `xid` committed, and re-read the record.
  TransactionalResult resolve_commit(ConnectionPool& pool, const Key& key, const OwnerToken& owner,
                                     long long xid, std::string response, bool took_over,
                                     const std::string& cause) {
    // At most ~1 s of asking, and never past client_timeout (the server may be unreachable).
    const auto give_up = std::chrono::steady_clock::now() + options.client_timeout;
    for (int i = 0; i < 50; ++i) {
      if (options.client_timeout.count() > 0 && i > 0 &&
          std::chrono::steady_clock::now() >= give_up) {
        break;
      }
      std::optional<std::string> status;
      std::optional<bool> ours;
      try {
        PooledConnection c = pool.acquire();
        try {
          detail::DeadlineWatch::Armed armed(watch.get(), c.get());
          pqxx::nontransaction nt(c.get());
          pqxx::result r =
              detail::exec_prepared(nt, kResolve, xid, key.id(), key.scope(), owner.str());
          if (!r[0][0].is_null()) status = r[0][0].as<std::string>();
          if (!r[0][1].is_null()) ours = r[0][1].as<bool>();
          if (armed.expired()) c.mark_broken();
        } catch (const std::exception&) {
          c.mark_broken();  // lost, or cut at the deadline
          throw;
        }
      } catch (const std::exception&) {
        // Unreachable for now: try again shortly, then give up with OutcomeUnknown.
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      if ((status && *status == "committed") || (ours && *ours)) {
        commits_resolved.fetch_add(1, std::memory_order_relaxed);
        return TransactionalResult::committed(std::move(response), took_over);
      }
      if (status && *status == "aborted") {
        commits_resolved.fetch_add(1, std::memory_order_relaxed);
        throw StorageUnavailable(
            "postgres: the connection was lost at COMMIT and the "
            "transaction did not commit (nothing was applied; retry): " +
            cause);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // still in progress
    }
    commits_unknown.fetch_add(1, std::memory_order_relaxed);
    throw OutcomeUnknown(
        "postgres: the connection was lost at COMMIT and the outcome could "
        "not be established (retry with the same key): " +
        cause);
  }
};

PostgresStore::PostgresStore(std::string conninfo)
    : PostgresStore([&] {
        PostgresStoreOptions o;
        o.conninfo = std::move(conninfo);
        return o;
      }()) {}

PostgresStore::PostgresStore(PostgresStoreOptions options) : options_(std::move(options)) {
  const auto& schema = detail::check_pg_identifier("schema", options_.schema);
  // The table names its constraint and index: "<table>_expires_idx" must fit in 63 bytes.
  const auto& t = detail::check_pg_identifier("table", options_.table, 63 - 12);
  const auto& k = detail::check_pg_identifier("key column", options_.key_column);
  const auto& s = detail::check_pg_identifier("scope column", options_.scope_column);
  if (k == s) throw UsageError("idem::postgres: key and scope columns must differ");
  if (options_.pool_size == 0) options_.pool_size = 16;
  if (options_.pool_wait.count() <= 0) options_.pool_wait = std::chrono::seconds(5);
  if (options_.lock_timeout.count() <= 0) options_.lock_timeout = std::chrono::seconds(2);
  if (options_.statement_timeout.count() < 0) {
    throw UsageError("idem::postgres: statement_timeout must not be negative");
  }
  if (options_.partitions > 1024) {
    throw UsageError("idem::postgres: at most 1024 partitions");
  }
  if (options_.partitions > 1) {  // the last partition's name must be a valid identifier too
    check_sql_identifier("partition", t + "_p" + std::to_string(options_.partitions - 1));
  }
  qualified_table_ = schema + "." + t;
  if (options_.client_timeout.count() < 0) {
    throw UsageError("idem::postgres: client_timeout must not be negative");
  }
  // At most a day each: the server takes lock_timeout and statement_timeout as an int of
  // milliseconds and libpq the keepalive settings client_timeout derives as an int of
  // seconds; beyond, the first connection failed with the server's (or libpq's) complaint
  // about a setting the user never wrote.
  const std::pair<const char*, std::chrono::milliseconds> waits[] = {
      {"pool_wait", options_.pool_wait},
      {"lock_timeout", options_.lock_timeout},
      {"statement_timeout", options_.statement_timeout},
      {"client_timeout", options_.client_timeout}};
  for (const auto& [name, wait] : waits) {
    if (wait > std::chrono::hours(24)) {
      throw UsageError("idem::postgres: PostgresStoreOptions::" + std::string(name) + " is " +
                       std::to_string(wait.count()) + " ms, above a day");
    }
  }
  if (auto why = detail::raw_at_in_uri_userinfo(options_.conninfo); !why.empty()) {
    throw UsageError("idem::postgres: " + why);
  }
  // keepalives, tcp_user_timeout and connect_timeout end a wait on a peer that stopped
  // answering on the TCP level; the deadline watch bounds every idem statement above it.
  connect_info_ = detail::with_client_bounds(options_.conninfo, options_.client_timeout);
  impl_ = std::make_unique<Impl>(options_);
  if (options_.client_timeout.count() > 0) {
    impl_->watch = std::make_unique<detail::DeadlineWatch>(options_.client_timeout, connect_info_);
  }
  impl_->lock_timeout = millis_setting(options_.lock_timeout);
  auto statements = detail::statements(qualified_table_, k, s);
  impl_->sql = statements;
  // Session settings of every pooled connection, sent once when it opens: lock_timeout bounds
  // a claim's wait on a concurrent holder of the same key (and the handler's lock waits).
  std::string session = "SET lock_timeout = '" + impl_->lock_timeout + "'";
  if (options_.statement_timeout.count() > 0) {
    session += "; SET statement_timeout = '" + millis_setting(options_.statement_timeout) + "'";
  }
  pool_ = std::make_unique<ConnectionPool>(
      connect_info_, options_.pool_size, options_.pool_wait,
      [impl = impl_.get(), statements, session, versions = schema + ".idem_schema_version",
       table = options_.table](pqxx::connection& c) {
        impl->bounded(c, "connect", [&] {
          {
            pqxx::nontransaction nt(c);
            nt.exec(session);
            if (!impl->version_checked.load(std::memory_order_acquire)) {
              check_not_newer(nt, versions, table);
              impl->version_checked.store(true, std::memory_order_release);
            }
          }
          for (const auto& [name, sql] : statements) detail::prepare(c, name, sql);
        });
      });
  if (options_.migrate) migrate();
}

PostgresStore::~PostgresStore() = default;

PostgresStoreStats PostgresStore::stats() const noexcept {
  PostgresStoreStats s;
  s.retries = impl_->retries.load(std::memory_order_relaxed);
  s.lock_timeouts = impl_->lock_timeouts.load(std::memory_order_relaxed);
  s.commits_resolved = impl_->commits_resolved.load(std::memory_order_relaxed);
  s.commits_unknown = impl_->commits_unknown.load(std::memory_order_relaxed);
  return s;
}

void PostgresStore::migrate() {
  const std::string& schema = options_.schema;
  const std::string& t = qualified_table_;
  const std::string& k = options_.key_column;
  const std::string& s = options_.scope_column;
  const std::string versions = schema + ".idem_schema_version";
  // A connection of its own, not a pooled one: pooled connections prepare idem's statements,
  // which libpqxx 7 does eagerly, before the table exists.
  std::unique_ptr<pqxx::connection> conn;
  try {
    conn = std::make_unique<pqxx::connection>(connect_info_);
  } catch (...) {
    detail::rethrow_translated("connect");
  }
  auto in_transaction = [&](auto&& fn) {
    try {
      pqxx::work tx(*conn);
      fn(tx);
      tx.commit();
    } catch (const std::exception& e) {
      if (detail::is_pqxx_exception(e)) detail::rethrow_translated("migrate");
      throw;
    }
  };
  in_transaction([&](pqxx::work& tx) {
    // One migrator at a time across every process; released at COMMIT/ROLLBACK. A concurrent
    // migrator may hold it (and catalog locks) for a while: wait, whatever lock_timeout says.
    tx.exec("SET LOCAL lock_timeout = '60s'");
    tx.exec(std::string("SELECT pg_advisory_xact_lock(") + kMigrationLockKey + ")");
    // CREATE SCHEMA IF NOT EXISTS still needs the CREATE privilege: only ask when missing.
    if (detail::exec_params(tx, "SELECT 1 FROM pg_namespace WHERE nspname = $1", schema).empty()) {
      tx.exec("CREATE SCHEMA " + schema);
    }
    tx.exec("CREATE TABLE IF NOT EXISTS " + versions +
            " (name text PRIMARY KEY, version integer NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())");
    if (check_not_newer(tx, versions, options_.table) != 0) return;  // 1 and 2 work as they are
    int version = kSchemaVersion;
    if (!detail::exec_params(tx, "SELECT to_regclass($1)::text", t)[0][0].is_null()) {
      // A table without a version row (made by hand, by schema.sql, or restored without its
      // row): used as it is when idem can, recorded as the version its layout is.
      version = check_existing_table(tx, t, k, s);
    }
    // Keep in step with src/postgres/schema.sql. The unique key is the primary key (it
    // contains the partition columns, so partitioned tables have it too). Version 1 and 2
    // tables need nothing: both work as they are. The key columns compare bytes (COLLATE
    // "C"): keys are identifiers, not words, so the database's locale has nothing to add but
    // cost (~25% more per record insert with an ICU collation) and a unique index that a
    // glibc or ICU upgrade changing the collation's order would silently corrupt.
    const bool partitioned = options_.partitions > 1;
    tx.exec("CREATE TABLE IF NOT EXISTS " + t + " (" + k +
            " varchar(128) COLLATE \"C\" NOT NULL,"
            " " +
            s +
            " varchar(64) COLLATE \"C\" NOT NULL,"
            " status varchar(16) NOT NULL"
            "  CHECK (status IN ('in_progress', 'completed', 'failed')),"
            " fingerprint text NOT NULL DEFAULT '',"
            " owner varchar(64) NOT NULL,"
            " response_body bytea,"
            " lease_until timestamptz NOT NULL,"
            " expires_at timestamptz,"
            " attempts integer NOT NULL DEFAULT 1,"
            " created_at timestamptz NOT NULL DEFAULT now(),"
            " updated_at timestamptz NOT NULL DEFAULT now(),"
            " CONSTRAINT " +
            options_.table + "_key_uq PRIMARY KEY (" + k + ", " + s + "))" +
            (partitioned ? " PARTITION BY HASH (" + s + ", " + k + ")" : std::string()));
    // A table that existed already (made by hand, without a version row) stays as it is.
    const bool now_partitioned =
        partitioned &&
        !detail::exec_params(tx,
                             "SELECT 1 FROM pg_partitioned_table WHERE partrelid = $1::regclass", t)
             .empty();
    for (std::size_t i = 0; now_partitioned && i < options_.partitions; ++i) {
      const std::string modulus = std::to_string(options_.partitions);
      const std::string remainder = std::to_string(i);
      tx.exec("CREATE TABLE IF NOT EXISTS " + t + "_p" + remainder + " PARTITION OF " + t +
              " FOR VALUES WITH (MODULUS " + modulus + ", REMAINDER " + remainder + ")");
    }
    tx.exec("CREATE INDEX IF NOT EXISTS " + options_.table + "_expires_idx ON " + t +
            " (expires_at) WHERE status <> 'in_progress'");
    detail::exec_params(tx,
                        "INSERT INTO " + versions +
                            " (name, version) VALUES ($1, $2) ON CONFLICT (name)"
                            " DO UPDATE SET version = EXCLUDED.version, applied_at = now()",
                        options_.table, version);
  });
}

void PostgresStore::run_in_transaction(const std::function<void(pqxx::work&)>& fn) {
  // A pooled connection that died while idle (a server restart) fails at BEGIN, before fn
  // ran: replaced, and the transaction begun once more on a fresh one.
  for (int attempt = 0;; ++attempt) {
    PooledConnection c = pool_->acquire();
    // While fn runs, the *_in calls on `tx` know it is one of ours (however fn ends).
    struct Mark {
      Impl::OpenConnections& open;
      const void* connection;
      Mark(Impl::OpenConnections& o, const void* c) : open(o), connection(c) { open.add(c); }
      ~Mark() { open.remove(connection); }
    } mark{impl_->open_connections, &static_cast<Impl::Connection&>(c.get())};
    bool began = false;
    try {
      std::optional<pqxx::work> tx;
      impl_->bounded(c.get(), "begin", [&] { tx.emplace(c.get()); });
      began = true;
      fn(*tx);
      impl_->bounded(
          c.get(), "commit", [&] { tx->commit(); }, true);
      return;
    } catch (const ConnectionCut&) {
      c.mark_broken();
      throw;
    } catch (const pqxx::broken_connection&) {
      c.mark_broken();
      if (!began && attempt == 0) continue;
      detail::rethrow_translated("transaction");
    } catch (const pqxx::in_doubt_error&) {
      c.mark_broken();
      detail::rethrow_translated("commit");
    } catch (const std::exception& e) {
      if (!detail::is_pqxx_exception(e)) throw;
      if (!c.get().is_open()) {
        c.mark_broken();
        if (!began && attempt == 0) continue;
      }
      detail::rethrow_translated("transaction");
    }
  }
}

TransactionalResult PostgresStore::run_transactional_impl(const Key& key,
                                                          std::string_view fingerprint,
                                                          const OwnerToken& owner,
                                                          std::chrono::seconds retention,
                                                          HandlerRef handler, DurableHint hint) {
  idem::detail::check_term(retention, "idem::postgres: the retention");
  const bool read_first = !hint.expects_absent();
  // A key expected new is claimed with a plain INSERT (no speculative insertion); the first
  // 23505 sends the run back to the ON CONFLICT claim.
  bool plain_claim = hint.expects_absent();
  unsigned retries = 0;
  bool reconnected = false;
  for (;;) {
    bool handler_ran = false;
    bool handler_threw = false;
    std::chrono::milliseconds handler_time{0};
    std::optional<PooledConnection> conn;
    try {
      conn.emplace(pool_->acquire());
      if (options_.read_first || read_first) {
        // A completed duplicate or a mismatch needs no transaction: answer from one read.
        std::optional<ClaimResult> early = impl_->bounded(conn->get(), "read", [&] {
          std::optional<ClaimResult> found;
          pqxx::nontransaction nt(conn->get());
          pqxx::result r = detail::exec_prepared(nt, kReadFound, key.id(), key.scope());
          if (!r.empty()) {
            std::string response;
            const detail::TextFingerprint fp(fingerprint);
            found = idem::detail::decide_without_claim(found_row(r[0], key, response), fp.text());
          }
          return found;
        });
        if (early) return TransactionalResult::found(std::move(*early));
      }
      std::optional<pqxx::work> work;
      std::optional<Impl::CompletedInsert> completed;
      if (hint.expected_response) {
        completed.emplace();
        completed->response = *hint.expected_response;
        completed->retention_s = static_cast<long long>(retention.count());
      }
      ClaimResult c = impl_->bounded(conn->get(), "claim", [&] {
        work.emplace(conn->get());
        return impl_->claim(*work, key, fingerprint, owner, std::chrono::milliseconds(0), true,
                            completed ? &*completed : nullptr, plain_claim);
      });
      pqxx::work& tx = *work;
      if (c.status != ClaimStatus::kClaimed) {
        impl_->bounded(conn->get(), "rollback", [&] { tx.abort(); });  // nothing was written
        return TransactionalResult::found(std::move(c));
      }
      handler_ran = true;
      std::string response;
      const auto handler_started = std::chrono::steady_clock::now();
      try {
        response = handler(tx);
      } catch (...) {
        handler_threw = true;
        throw;
      }
      handler_time = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - handler_started);
      // We inserted or took over the row in this transaction and hold its lock: nobody can
      // have taken it over. A completion that finds no row held by this attempt, or a statement
      // or COMMIT that libpqxx refuses to send, means the transaction itself is aborted: a
      // statement of the handler failed and the handler caught the error and returned
      // (libpqxx 6 then answers an empty result, or a usage_error).
      auto aborted = [&] {
        return StorageError("postgres: the transaction of record '" + key.str() +
                            "' cannot complete: a statement of the handler failed and the "
                            "handler went on (the transaction is aborted; nothing was "
                            "committed). Let the error propagate, or run such a statement in "
                            "a savepoint (pqxx::subtransaction)");
      };
      long long xid = 0;
      if (completed && completed->inserted && response == completed->response) {
        xid = completed->xid;  // the record went in completed, with this response
      } else {
        pqxx::result done;
        try {
          done = impl_->bounded(conn->get(), "complete", [&] {
            if (completed && completed->inserted) {
              return detail::exec_prepared(tx, kRewriteResponse, key.id(), key.scope(), owner.str(),
                                           detail::bytea(response));
            }
            return detail::exec_prepared(tx, kComplete, key.id(), key.scope(), owner.str(),
                                         detail::bytea(response),
                                         static_cast<long long>(retention.count()));
          });
        } catch (const pqxx::usage_error&) {
          throw aborted();
        }
        if (done.empty()) throw aborted();
        xid = done[0][0].as<long long>();
      }
      if (options_.before_commit) options_.before_commit(conn->get());
      try {
        // A COMMIT cut at the deadline surfaces as a lost connection: resolved below.
        detail::DeadlineWatch::Armed armed(impl_->watch.get(), conn->get());
        tx.commit();
        if (armed.expired()) conn->mark_broken();  // a cancel may still be on its way
      } catch (const pqxx::usage_error&) {
        throw aborted();
      } catch (const pqxx::in_doubt_error& e) {
        conn->mark_broken();
        return impl_->resolve_commit(*pool_, key, owner, xid, std::move(response), c.took_over,
                                     e.what());
      } catch (const pqxx::broken_connection& e) {
        conn->mark_broken();
        return impl_->resolve_commit(*pool_, key, owner, xid, std::move(response), c.took_over,
                                     e.what());
      }
      return TransactionalResult::committed(std::move(response), c.took_over);
    } catch (const ConnectionCut&) {
      if (conn) conn->mark_broken();
      throw;  // nothing committed: retryable, but not here (the server does not answer)
    } catch (const pqxx::broken_connection&) {
      if (conn) conn->mark_broken();
      // Also when the handler's own statement found the connection gone: that is a storage
      // failure (nothing committed), not the handler's.
      if (handler_threw) detail::rethrow_translated("transaction");
      // A pooled connection that died while idle (server restart): nothing ran yet, so one
      // more try on a fresh connection is safe.
      if (!handler_ran && !reconnected) {
        reconnected = true;
        continue;
      }
      if (handler_ran) {
        // The server may have ended the session over the handler's time (a FATAL that libpqxx
        // reports only as a connection that is gone): say what the transaction was doing.
        detail::rethrow_translated(
            "transaction (the connection ended after the handler had kept the transaction open "
            "for " +
            std::to_string(handler_time.count()) +
            " ms: a server restart, a network failure, or a server limit on an idle "
            "transaction such as idle_in_transaction_session_timeout; nothing was committed)");
      }
      detail::rethrow_translated("transaction");
    } catch (const std::exception& e) {
      // Serialization failures and deadlocks re-run the transaction, whoever raised them (the
      // handler's own statements included): the earlier attempt was rolled back entirely.
      const std::string state = detail::sqlstate_of(e);
      if (state == "23505" && plain_claim && !handler_ran) {
        // The plain claim met an existing key (the transaction's first statement: nothing else
        // ran, and the aborted transaction was rolled back). Claim again the usual way, which
        // reads the row and decides.
        plain_claim = false;
        continue;
      }
      if (is_retryable_rollback(state) && retries < options_.max_retries) {
        idem::detail::pause_before_rerun(retries);
        ++retries;
        impl_->retries.fetch_add(1, std::memory_order_relaxed);
        if (options_.on_retry) options_.on_retry(key, state);
        continue;
      }
      if (handler_threw) {
        if (is_connection_failure(state) || (conn && !conn->get().is_open())) {
          if (conn) conn->mark_broken();
          detail::rethrow_translated("transaction");  // the server went away under the handler
        }
        // A database error of the handler's own statements (40001/40P01 after the re-runs,
        // 55P03 on a business row, 57014, a constraint): typed as idem's own statements are,
        // the pqxx exception nested as the cause. Anything else is the handler's: unchanged.
        if (detail::is_pqxx_exception(e)) detail::rethrow_translated("handler statement");
        throw;
      }
      if (state == "55P03" && !handler_ran) {
        // The claim waited lock_timeout on a transaction holding the key. Only the claim ran in
        // this (now rolled back) transaction, so nothing is lost: answer "in progress".
        impl_->lock_timeouts.fetch_add(1, std::memory_order_relaxed);
        return TransactionalResult::found(idem::detail::busy_claim());
      }
      detail::rethrow_translated("transaction");
    } catch (...) {
      if (handler_threw) throw;
      detail::rethrow_translated("transaction");
    }
  }
}

ClaimResult PostgresStore::claim_in(pqxx::work& tx, const Key& key, std::string_view fingerprint,
                                    const OwnerToken& owner, std::chrono::milliseconds lease) {
  // 0: the claim of a transactional run, which holds no lease (its transaction is the lock).
  idem::detail::check_not_longer(lease, "idem::postgres: the lease");
  // Plain SAVEPOINT statements rather than pqxx::subtransaction: libpqxx 6 sends a
  // subtransaction's SAVEPOINT lazily, only before exec(), not before exec_params().
  return impl_->bounded(tx.conn(), "claim", [&]() -> ClaimResult {
    try {
      tx.exec("SAVEPOINT idem_claim");
      try {
        // The caller's connection has its own settings: bound this claim's wait (the setting
        // lasts until the caller's transaction ends, as SET LOCAL does).
        detail::exec_params(tx, "SELECT set_config('lock_timeout', $1, true)", impl_->lock_timeout);
        ClaimResult c = impl_->claim(tx, key, fingerprint, owner, lease, impl_->pooled(tx));
        tx.exec("RELEASE SAVEPOINT idem_claim");
        return c;
      } catch (const pqxx::sql_error& e) {
        if (e.sqlstate() != "55P03") throw;
        // The caller's transaction stays usable; the claim's lock_timeout setting is undone too.
        tx.exec("ROLLBACK TO SAVEPOINT idem_claim");
        tx.exec("RELEASE SAVEPOINT idem_claim");
        impl_->lock_timeouts.fetch_add(1, std::memory_order_relaxed);
        return idem::detail::busy_claim();
      }
    } catch (...) {
      detail::rethrow_translated("claim");
    }
  });
}

namespace {
// One element of a PostgreSQL text[] literal: quoted, with '"' and '\\' escaped. Keys, owners
// and hex fingerprints have neither, so the element is usually one append.
void append_array_element(std::string& out, std::string_view value) {
  if (out.size() > 1) out.push_back(',');
  out.push_back('"');
  // (memchr must not see the null pointer of an empty view)
  const bool escape = !value.empty() && (std::memchr(value.data(), '"', value.size()) != nullptr ||
                                         std::memchr(value.data(), '\\', value.size()) != nullptr);
  if (!escape) {
    out.append(value.begin(), value.end());
  } else {
    for (char c : value) {
      if (c == '"' || c == '\\') out.push_back('\\');
      out.push_back(c);
    }
  }
  out.push_back('"');
}

// The text[] parameters of a batch insert: ids, scopes, fingerprints, owners. Each key once.
// `order` lists the requests sorted by (scope, id): duplicates are neighbours there, and a row
// the statement returns is found by binary search (no per-request allocation).
struct BatchArrays {
  std::string ids = "{", scopes = "{", fingerprints = "{", owners = "{";
  const std::vector<ClaimRequest>& requests;
  std::vector<std::size_t> order;

  BatchArrays(const std::vector<ClaimRequest>& reqs, const char* call) : requests(reqs) {
    std::size_t id_bytes = 0, scope_bytes = 0, fp_bytes = 0, owner_bytes = 0;
    order.reserve(requests.size());
    for (std::size_t i = 0; i < requests.size(); ++i) {
      const ClaimRequest& r = requests[i];
      if (r.key == nullptr || r.owner == nullptr) {
        throw UsageError(std::string("idem::postgres: ") + call + " needs a key and an owner");
      }
      id_bytes += r.key->id().size() + 3;
      scope_bytes += r.key->scope().size() + 3;
      fp_bytes += r.fingerprint.size() + 3;  // (one stored in hex grows the string once)
      owner_bytes += r.owner->str().size() + 3;
      order.push_back(i);
    }
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return less(a, b); });
    for (std::size_t j = 1; j < order.size(); ++j) {
      if (!less(order[j - 1], order[j])) {
        throw UsageError(std::string("idem::postgres: ") + call + " got key '" +
                         requests[order[j]].key->str() + "' twice");
      }
    }
    ids.reserve(id_bytes + 2);
    scopes.reserve(scope_bytes + 2);
    fingerprints.reserve(fp_bytes + 2);
    owners.reserve(owner_bytes + 2);
    for (const ClaimRequest& r : requests) {
      append_array_element(ids, r.key->id());
      append_array_element(scopes, r.key->scope());
      append_array_element(fingerprints, detail::TextFingerprint(r.fingerprint).text());
      append_array_element(owners, r.owner->str());
    }
    for (std::string* a : {&ids, &scopes, &fingerprints, &owners}) a->push_back('}');
  }

  // The request of key (id, scope), or requests.size() when none.
  std::size_t find(std::string_view id, std::string_view scope) const {
    auto it = std::lower_bound(order.begin(), order.end(), 0, [&](std::size_t i, int) {
      const Key& k = *requests[i].key;
      return before(k.scope(), k.id(), scope, id);
    });
    if (it == order.end()) return requests.size();
    const Key& k = *requests[*it].key;
    return k.scope() == scope && k.id() == id ? *it : requests.size();
  }

 private:
  static bool before(std::string_view scope_a, std::string_view id_a, std::string_view scope_b,
                     std::string_view id_b) noexcept {
    const int c = scope_a.compare(scope_b);
    return c < 0 || (c == 0 && id_a < id_b);
  }
  bool less(std::size_t a, std::size_t b) const noexcept {
    const Key& x = *requests[a].key;
    const Key& y = *requests[b].key;
    return before(x.scope(), x.id(), y.scope(), y.id());
  }
};
}  // namespace

std::vector<bool> PostgresStore::insert_completed_batch_in(
    pqxx::work& tx, const std::vector<ClaimRequest>& requests, std::string_view response,
    std::chrono::seconds retention) {
  std::vector<bool> out(requests.size(), false);
  if (requests.empty()) return out;
  idem::detail::check_term(retention, "idem::postgres: the retention");
  BatchArrays a(requests, "insert_completed_batch_in");
  pqxx::result rows;
  try {
    rows = impl_->bounded(tx.conn(), "insert records", [&] {
      return impl_->run(tx, impl_->pooled(tx), kInsertCompletedBatch, a.ids, a.scopes,
                        a.fingerprints, a.owners, detail::bytea(response),
                        static_cast<long long>(retention.count()));
    });
  } catch (...) {
    detail::rethrow_translated("insert records");
  }
  for (const auto& row : rows) {
    const std::size_t i = a.find(row[0].c_str(), row[1].c_str());
    if (i < out.size()) out[i] = true;
  }
  return out;
}

bool PostgresStore::insert_new_completed_batch_in(pqxx::work& tx,
                                                  const std::vector<ClaimRequest>& requests,
                                                  std::string_view response,
                                                  std::chrono::seconds retention) {
  if (requests.empty()) return true;
  idem::detail::check_term(retention, "idem::postgres: the retention");
  BatchArrays a(requests, "insert_new_completed_batch_in");
  try {
    impl_->bounded(tx.conn(), "insert records", [&] {
      impl_->run(tx, impl_->pooled(tx), kInsertNewCompletedBatch, a.ids, a.scopes, a.fingerprints,
                 a.owners, detail::bytea(response), static_cast<long long>(retention.count()));
    });
    return true;
  } catch (const pqxx::sql_error& e) {
    if (e.sqlstate() == "23505") return false;  // a record exists: `tx` is aborted
    detail::rethrow_translated("insert records");
  } catch (...) {
    detail::rethrow_translated("insert records");
  }
}

std::optional<std::vector<bool>> PostgresStore::record_batch_in(
    pqxx::work& tx, const std::vector<ClaimRequest>& requests, std::string_view response,
    std::chrono::seconds retention, DurableHint hint) {
  if (hint.expects_absent()) {
    if (!insert_new_completed_batch_in(tx, requests, response, retention)) return std::nullopt;
    return std::vector<bool>(requests.size(), true);
  }
  return insert_completed_batch_in(tx, requests, response, retention);
}

// Plain SAVEPOINT statements rather than pqxx::subtransaction (see claim_in).
void PostgresStore::savepoint(pqxx::work& tx) {
  try {
    impl_->bounded(tx.conn(), "savepoint", [&] { tx.exec("SAVEPOINT idem_batch"); });
  } catch (...) {
    detail::rethrow_translated("savepoint");
  }
}

void PostgresStore::rollback_to_savepoint(pqxx::work& tx) {
  try {
    impl_->bounded(tx.conn(), "savepoint", [&] { tx.exec("ROLLBACK TO SAVEPOINT idem_batch"); });
  } catch (...) {
    detail::rethrow_translated("rollback to savepoint");
  }
}

std::exception_ptr PostgresStore::typed_error(std::exception_ptr e) const noexcept {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    if (!detail::is_pqxx_exception(x)) return e;
    try {
      detail::rethrow_translated("transaction");
    } catch (...) {
      return std::current_exception();
    }
  } catch (...) {
  }
  return e;
}

void PostgresStore::release_savepoint(pqxx::work& tx) {
  try {
    impl_->bounded(tx.conn(), "savepoint", [&] { tx.exec("RELEASE SAVEPOINT idem_batch"); });
  } catch (...) {
    detail::rethrow_translated("release savepoint");
  }
}

void PostgresStore::complete_in(pqxx::work& tx, const Key& key, const OwnerToken& owner,
                                std::string_view response, std::chrono::seconds retention) {
  idem::detail::check_term(retention, "idem::postgres: the retention");
  pqxx::result done;
  try {
    done = impl_->bounded(tx.conn(), "complete", [&] {
      return impl_->run(tx, impl_->pooled(tx), kComplete, key.id(), key.scope(), owner.str(),
                        detail::bytea(response), static_cast<long long>(retention.count()));
    });
  } catch (...) {
    detail::rethrow_translated("complete");
  }
  if (done.empty()) {
    throw LeaseLost("postgres: record '" + key.str() + "' is no longer held by this attempt");
  }
}

namespace {
// Runs `fn(pqxx::nontransaction&)` (autocommit statements) on a pooled connection. When
// `idempotent`, a connection found broken is replaced and `fn` tried once more.
// Each attempt's wait is bounded by client_timeout (`watch`, may be null).
template <class Fn>
auto autocommit(ConnectionPool& pool, detail::DeadlineWatch* watch, std::string_view context,
                bool idempotent, Fn&& fn) {
  for (int attempt = 0;; ++attempt) {
    PooledConnection c = pool.acquire();
    try {
      detail::DeadlineWatch::Armed armed(watch, c.get());
      try {
        pqxx::nontransaction nt(c.get());
        auto r = fn(nt);
        if (armed.expired()) c.mark_broken();  // answered after all; a cancel may be on its way
        return r;
      } catch (...) {
        if (armed.expired()) throw_client_timeout(context, watch->limit(), false);
        throw;
      }
    } catch (const ConnectionCut&) {
      c.mark_broken();
      throw;
    } catch (const pqxx::broken_connection&) {
      c.mark_broken();
      if (idempotent && attempt == 0) continue;
      detail::rethrow_translated(context);
    } catch (...) {
      detail::rethrow_translated(context);
    }
  }
}
}  // namespace

ClaimResult PostgresStore::begin(const Key& key, std::string_view fingerprint,
                                 const OwnerToken& owner, std::chrono::milliseconds lease,
                                 DurableHint) {
  idem::detail::check_term(lease, "idem::postgres: the lease");
  // Idempotent: a retried begin finds its own claim and keeps it (the rulebook's kKeep).
  return autocommit(*pool_, impl_->watch.get(), "begin", true, [&](pqxx::nontransaction& nt) {
    try {
      return impl_->claim(nt, key, fingerprint, owner, lease);
    } catch (const pqxx::sql_error& e) {
      if (e.sqlstate() != "55P03") throw;
      impl_->lock_timeouts.fetch_add(1, std::memory_order_relaxed);
      return idem::detail::busy_claim();
    }
  });
}

bool PostgresStore::complete(const Key& key, const OwnerToken& owner, std::string_view response,
                             std::chrono::seconds retention) {
  idem::detail::check_term(retention, "idem::postgres: the retention");
  try {
    return autocommit(*pool_, impl_->watch.get(), "complete", false, [&](pqxx::nontransaction& nt) {
      return !detail::exec_prepared(nt, kComplete, key.id(), key.scope(), owner.str(),
                                    detail::bytea(response),
                                    static_cast<long long>(retention.count()))
                  .empty();
    });
  } catch (const StorageUnavailable& e) {
    // The UPDATE may or may not have been applied before the connection broke: re-read.
    std::optional<Record> r;
    try {
      r = lookup(key);
    } catch (const Error&) {
      // e.what() already names the operation ("postgres: complete: ...").
      throw OutcomeUnknown(std::string(e.what()) +
                           " (the completion may have been applied; reading the record back "
                           "failed too)");
    }
    if (r && r->owner == owner.str()) {
      if (r->status == Record::Status::kCompleted) return true;
      if (r->status == Record::Status::kInProgress) {
        return autocommit(*pool_, impl_->watch.get(), "complete", false,
                          [&](pqxx::nontransaction& nt) {
                            return !detail::exec_prepared(nt, kComplete, key.id(), key.scope(),
                                                          owner.str(), detail::bytea(response),
                                                          static_cast<long long>(retention.count()))
                                        .empty();
                          });
      }
    }
    return false;
  }
}

bool PostgresStore::fail(const Key& key, const OwnerToken& owner, std::string_view reason,
                         std::chrono::seconds retention) {
  idem::detail::check_term(retention, "idem::postgres: the retention");
  return autocommit(*pool_, impl_->watch.get(), "fail", false, [&](pqxx::nontransaction& nt) {
    return !detail::exec_prepared(nt, kFail, key.id(), key.scope(), owner.str(),
                                  detail::bytea(reason), static_cast<long long>(retention.count()))
                .empty();
  });
}

bool PostgresStore::release(const Key& key, const OwnerToken& owner) {
  return autocommit(*pool_, impl_->watch.get(), "release", true, [&](pqxx::nontransaction& nt) {
    return !detail::exec_prepared(nt, kRelease, key.id(), key.scope(), owner.str()).empty();
  });
}

bool PostgresStore::extend(const Key& key, const OwnerToken& owner,
                           std::chrono::milliseconds lease) {
  idem::detail::check_term(lease, "idem::postgres: the lease");
  return autocommit(*pool_, impl_->watch.get(), "extend", true, [&](pqxx::nontransaction& nt) {
    return !detail::exec_prepared(nt, kExtend, key.id(), key.scope(), owner.str(),
                                  static_cast<long long>(lease.count()))
                .empty();
  });
}

std::optional<Record> PostgresStore::lookup(const Key& key) {
  return autocommit(*pool_, impl_->watch.get(), "lookup", true,
                    [&](pqxx::nontransaction& nt) -> std::optional<Record> {
                      pqxx::result r = detail::exec_prepared(nt, kRead, key.id(), key.scope());
                      if (r.empty()) return std::nullopt;
                      Record record = parse_found(r[0], 0, key).record;
                      record.fingerprint =
                          detail::fingerprint_from_text(std::move(record.fingerprint));
                      return record;
                    });
}

std::vector<std::string> PostgresStore::partitions() {
  return autocommit(*pool_, impl_->watch.get(), "partitions", true, [&](pqxx::nontransaction& nt) {
    std::vector<std::string> out;
    // regclass::text quotes as needed; qualify with the schema whatever the search_path.
    pqxx::result r = detail::exec_params(
        nt,
        "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname)"
        " FROM pg_partition_tree($1::regclass) p JOIN pg_class c ON c.oid = p.relid"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE p.isleaf AND p.level > 0 ORDER BY p.relid",
        qualified_table_);
    for (const auto& row : r) out.push_back(row[0].as<std::string>());
    return out;
  });
}

std::size_t PostgresStore::purge_expired(std::size_t batch_size) {
  if (batch_size == 0) throw UsageError("idem::postgres: purge batch size must be positive");
  std::size_t total = 0;
  // A partitioned table: one leaf at a time, each batch a short statement on that leaf alone
  // (rows found by ctid: a partition is a plain table, and `id` has no index there).
  const std::vector<std::string> leaves = partitions();
  for (const std::string& leaf : leaves) {
    const std::string sql = "DELETE FROM " + leaf + " WHERE ctid = ANY (ARRAY(SELECT ctid FROM " +
                            leaf +
                            " WHERE status <> 'in_progress' AND expires_at <= clock_timestamp()"
                            " LIMIT $1 FOR UPDATE SKIP LOCKED))";
    for (;;) {
      auto n = autocommit(*pool_, impl_->watch.get(), "purge", true, [&](pqxx::nontransaction& nt) {
        return detail::exec_params(nt, sql, static_cast<long long>(batch_size)).affected_rows();
      });
      total += static_cast<std::size_t>(n);
      if (static_cast<std::size_t>(n) < batch_size) break;
    }
  }
  if (!leaves.empty()) return total;
  for (;;) {
    // Each batch is its own short autocommit statement: no lock is held between batches.
    auto n = autocommit(*pool_, impl_->watch.get(), "purge", true, [&](pqxx::nontransaction& nt) {
      return detail::exec_prepared(nt, kPurge, static_cast<long long>(batch_size)).affected_rows();
    });
    total += static_cast<std::size_t>(n);
    if (static_cast<std::size_t>(n) < batch_size) return total;
  }
}

}  // namespace idem::postgres
