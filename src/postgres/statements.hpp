// SPDX-License-Identifier: MIT
// The statements of idem's PostgreSQL record table, written once for the synchronous store
// (src/postgres/postgres_store.cpp, on libpqxx) and the asynchronous one (src/async, on libpq's
// pipeline): both read and write exactly the same rows with exactly the same SQL.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace idem::postgres::detail {

// A claim that finds the row deleted under it (released, purged) tries again this many times
// before answering kBusy.
constexpr int kClaimRounds = 4;

// Prepared statement names (per connection).
constexpr const char* kClaim = "idem_claim";
constexpr const char* kRead = "idem_read";
constexpr const char* kReadFound = "idem_read_found";
constexpr const char* kTakeover = "idem_takeover";
constexpr const char* kRemoveExpired = "idem_remove_expired";
constexpr const char* kComplete = "idem_complete";
constexpr const char* kClaimCompleted = "idem_claim_completed";
constexpr const char* kClaimNew = "idem_claim_new";
constexpr const char* kClaimCompletedNew = "idem_claim_completed_new";
constexpr const char* kRewriteResponse = "idem_rewrite_response";
constexpr const char* kFail = "idem_fail";
constexpr const char* kRelease = "idem_release";
constexpr const char* kExtend = "idem_extend";
constexpr const char* kPurge = "idem_purge";
constexpr const char* kResolve = "idem_resolve";
constexpr const char* kInsertCompletedBatch = "idem_insert_completed_batch";
constexpr const char* kInsertNewCompletedBatch = "idem_insert_new_completed_batch";

// Columns every record read returns, in this order (see parse_found).
constexpr const char* kRecordColumns =
    "status, fingerprint, owner, response_body,"
    " (extract(epoch FROM lease_until) * 1000)::bigint,"
    " (extract(epoch FROM created_at) * 1000)::bigint,"
    " (extract(epoch FROM updated_at) * 1000)::bigint,"
    " (extract(epoch FROM expires_at) * 1000)::bigint,"
    " lease_until > clock_timestamp(),"
    " status <> 'in_progress' AND expires_at <= clock_timestamp()";

// Columns of the read before a claim (the precheck: the record rulebook's FoundRecord), in
// this order (see found_row): of the times, created_at and expires_at (what a replay reports)
// are converted (the retention is compared on the server, as in kRecordColumns). Each
// extract() is numeric arithmetic on the server: the precheck of every call without a granted
// fast claim (a replay while the fast store is down) reads this instead of kRecordColumns. No
// lease flag: the precheck answers only a replay or a mismatch, which no lease decides
// (decide_without_claim).
constexpr const char* kFoundColumns =
    "status, fingerprint, owner, response_body,"
    " (extract(epoch FROM created_at) * 1000)::bigint,"
    " status <> 'in_progress' AND expires_at <= clock_timestamp(),"
    " (extract(epoch FROM expires_at) * 1000)::bigint";

// The statements (name, SQL) of table `t` with key column `k` and scope column `s`, built once
// from validated identifiers; every value is a bound parameter.
inline std::vector<std::pair<std::string, std::string>> statements(const std::string& t,
                                                                   const std::string& k,
                                                                   const std::string& s) {
  const std::string where = " WHERE " + k + " = $1 AND " + s + " = $2";
  std::vector<std::pair<std::string, std::string>> v;
  // INSERT ... ON CONFLICT DO NOTHING never raises a unique violation, so it never aborts the
  // caller's transaction; it waits for a concurrent transaction holding the same key at most
  // lock_timeout (set on every pooled connection). When it inserted nothing, kRead (a new
  // statement, so a row committed while we waited is visible) tells what is there. A single
  // statement returning the existing row too (WITH ins AS (INSERT ...) ... UNION ALL SELECT)
  // saves that round trip for duplicates but measured ~10-20% slower for first executions.
  v.emplace_back(kClaim, "INSERT INTO " + t + " (" + k + ", " + s +
                             ", status, fingerprint, owner, lease_until)"
                             " VALUES ($1, $2, 'in_progress', $3, $4,"
                             " clock_timestamp() + $5::bigint * interval '1 millisecond')"
                             " ON CONFLICT (" +
                             k + ", " + s + ") DO NOTHING RETURNING true");
  // The claim of a transactional run whose response is known before its handler
  // (DurableHint::expected_response): the record goes in completed, as the completion would
  // leave it, and no completion statement follows: its retention counts from this insert (the
  // completion's from the completion: clock_timestamp(), not now(), the transaction's start).
  // Nobody sees the row before the COMMIT, so a duplicate meets it exactly as it would meet an
  // in-progress one: waiting on the unique index. txid_current() as in kComplete.
  const std::string claim_completed =
      "INSERT INTO " + t + " (" + k + ", " + s +
      ", status, fingerprint, owner, response_body, lease_until,"
      " expires_at) VALUES ($1, $2, 'completed', $3, $4, $5,"
      " now(), clock_timestamp() + $6::bigint * interval '1 second')";
  v.emplace_back(kClaimCompleted, claim_completed + " ON CONFLICT (" + k + ", " + s +
                                      ") DO NOTHING RETURNING txid_current()");
  // The claims of a transactional run whose key is expected new (DurableHint::expects_absent):
  // plain INSERTs, without ON CONFLICT's speculative insertion (as kInsertNewCompletedBatch).
  // An existing key raises 23505, which aborts the transaction: nothing else ran in it yet,
  // so the run starts over with kClaim / kClaimCompleted.
  v.emplace_back(kClaimNew, "INSERT INTO " + t + " (" + k + ", " + s +
                                ", status, fingerprint, owner, lease_until)"
                                " VALUES ($1, $2, 'in_progress', $3, $4,"
                                " clock_timestamp() + $5::bigint * interval '1 millisecond')"
                                " RETURNING true");
  v.emplace_back(kClaimCompletedNew, claim_completed + " RETURNING txid_current()");
  // The handler's response was not the expected one: the record inserted completed by
  // kClaimCompleted in this transaction gets the actual response.
  v.emplace_back(kRewriteResponse, "UPDATE " + t +
                                       " SET response_body = $4, updated_at = now()" + where +
                                       " AND owner = $3 AND status = 'completed'"
                                       " RETURNING txid_current()");
  v.emplace_back(kRead, std::string("SELECT ") + kRecordColumns + " FROM " + t + where);
  v.emplace_back(kReadFound, std::string("SELECT ") + kFoundColumns + " FROM " + t + where);
  // Records written already completed, many in one statement (insert_completed_batch_in):
  // $1..$4 are text[] of ids, scopes, fingerprints and owners. Rows go in key order, so two
  // batches waiting on each other's uncommitted keys always wait in the same direction (no
  // deadlock between batch inserts).
  const std::string insert_batch =
      "INSERT INTO " + t + " (" + k + ", " + s +
      ", status, fingerprint, owner, response_body, lease_until, expires_at)"
      " SELECT u.k, u.s, 'completed', u.f, u.o, $5, now(),"
      " clock_timestamp() + $6::bigint * interval '1 second'"
      " FROM unnest($1::text[], $2::text[], $3::text[], $4::text[])"
      " AS u(k, s, f, o) ORDER BY u.s, u.k";
  v.emplace_back(kInsertCompletedBatch, insert_batch + " ON CONFLICT (" + k + ", " + s +
                                            ") DO NOTHING RETURNING " + k + ", " + s);
  // The same without ON CONFLICT (insert_new_completed_batch_in): a plain insert skips the
  // speculative-insertion protocol and returns no rows, ~1/3 cheaper per record; an existing
  // key raises 23505 and aborts the transaction.
  v.emplace_back(kInsertNewCompletedBatch, insert_batch);
  // Conditional takeover of an expired lease: of two concurrent takers the second re-checks
  // the row after the first commits and updates nothing.
  v.emplace_back(kTakeover,
                 "UPDATE " + t +
                     " SET owner = $3,"
                     " lease_until = clock_timestamp() + $4::bigint * interval '1 millisecond',"
                     " attempts = attempts + 1, updated_at = now()" +
                     where +
                     " AND status = 'in_progress' AND owner = $5"
                     " AND lease_until <= clock_timestamp() RETURNING true");
  v.emplace_back(kRemoveExpired, "DELETE FROM " + t + where +
                                     " AND status <> 'in_progress'"
                                     " AND expires_at <= clock_timestamp()");
  // txid_current() identifies the transaction, so a COMMIT lost with its connection can be
  // resolved with txid_status() on another connection.
  v.emplace_back(kComplete,
                 "UPDATE " + t +
                     " SET status = 'completed', response_body = $4,"
                     " expires_at = clock_timestamp() + $5::bigint * interval '1 second',"
                     " updated_at = now()" +
                     where +
                     " AND owner = $3 AND status = 'in_progress'"
                     " RETURNING txid_current()");
  v.emplace_back(kFail, "UPDATE " + t +
                            " SET status = 'failed', response_body = $4,"
                            " expires_at = clock_timestamp() + $5::bigint * interval '1 second',"
                            " updated_at = now()" +
                            where + " AND owner = $3 AND status = 'in_progress' RETURNING true");
  v.emplace_back(kRelease, "DELETE FROM " + t + where +
                               " AND owner = $3 AND status = 'in_progress' RETURNING true");
  v.emplace_back(kExtend, "UPDATE " + t +
                              " SET lease_until = clock_timestamp() + $4::bigint * interval"
                              " '1 millisecond', updated_at = now()" +
                              where +
                              " AND owner = $3 AND status = 'in_progress' RETURNING true");
  // Short batches; SKIP LOCKED never waits on a row a claim or completion is touching.
  // Rows by their key (tables of either schema version; unique across partitions too).
  v.emplace_back(kPurge, "DELETE FROM " + t + " WHERE (" + k + ", " + s + ") IN (SELECT " + k +
                             ", " + s + " FROM " + t +
                             " WHERE status <> 'in_progress'"
                             " AND expires_at <= clock_timestamp()"
                             " LIMIT $1 FOR UPDATE SKIP LOCKED)");
  v.emplace_back(kResolve,
                 "SELECT txid_status($1::bigint), (SELECT status = 'completed'"
                 " AND owner = $4 FROM " +
                     t + " WHERE " + k + " = $2 AND " + s + " = $3)");
  return v;
}

}  // namespace idem::postgres::detail
