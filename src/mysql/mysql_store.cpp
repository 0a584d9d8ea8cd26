// SPDX-License-Identifier: MIT
// MySQL durable store: statements, migration, claim protocol, commit resolution.
#include "idem/mysql/mysql_store.hpp"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "connection.hpp"
#include "errors.hpp"
#include "idem/detail/record_columns.hpp"
#include "idem/detail/record_rules.hpp"
#include "idem/detail/rerun_pause.hpp"
#include "idem/detail/utf8.hpp"
#include "idem/sql.hpp"
#include "pool.hpp"

namespace idem::mysql {

namespace {

// 1: the seed table's columns plus idem's (fingerprint, owner, lease_until, expires_at,
// attempts), an index on expires_at for the purge.
constexpr int kSchemaVersion = 1;
// A claim that finds the row deleted under it (released, purged) tries again this many times
// before answering kBusy.
constexpr int kClaimRounds = 4;
// Fingerprints are stored in a varbinary(255).
constexpr std::size_t kMaxFingerprint = 255;
// Transactional mode's claim writes the record's expiry `retention` plus this margin from
// the claim (at most a tenth of the retention): a transaction shorter than the margin
// completes without moving it (see Impl::build).
constexpr std::chrono::microseconds kExpirySlack = std::chrono::seconds(60);
// Bytes of a statement packet that are not the response (keys, owner, fingerprint, header).
constexpr std::uint64_t kPacketHeadroom = 4096;
// Rows of one record_batch_in INSERT at most: 6 placeholders each, well inside the 65,535 a
// prepared statement may have.
constexpr std::size_t kBatchRowsPerStatement = 1000;
// Bytes of a batch row besides its key, scope, fingerprint, owner and response.
constexpr std::uint64_t kBatchRowOverhead = 64;

std::string q(const std::string& identifier) { return "`" + identifier + "`"; }

struct Found {
  Record record;
  bool live = false;     // in progress and its lease has not ended (database clock)
  bool expired = false;  // completed/failed and its retention has ended
};

// Days from 1970-01-01 to the proleptic Gregorian date y-m-d.
constexpr long long days_from_civil(long long y, unsigned m, unsigned d) noexcept {
  y -= m <= 2 ? 1 : 0;
  const long long era = (y >= 0 ? y : y - 399) / 400;
  const auto yoe = static_cast<unsigned>(y - era * 400);
  const unsigned doy = (153 * (m > 2 ? m - 3 : m + 9) + 2) / 5 + d - 1;
  const unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + static_cast<long long>(doe) - 719468;
}

// A time column as MySQL prints it, "YYYY-MM-DD hh:mm:ss[.f...]", read as UTC (idem writes
// UTC_TIMESTAMP(3)); epoch for NULL and for a zero date. The text is parsed here rather than
// converted by the server (TIMESTAMPDIFF from the epoch), which costs the server a function
// and a literal to resolve and evaluate per column and row. @throws StorageError for
// anything else.
TimePoint time_field(const Field& f) {
  if (f.is_null()) return TimePoint{};
  const std::string& t = f.bytes();
  bool ok = t.size() >= 19 && t[4] == '-' && t[7] == '-' && t[10] == ' ' && t[13] == ':' &&
            t[16] == ':' && (t.size() == 19 || (t[19] == '.' && t.size() > 20));
  auto number = [&](std::size_t at, std::size_t digits) {
    long long v = 0;
    for (std::size_t i = at; i < at + digits && i < t.size(); ++i) {
      if (t[i] < '0' || t[i] > '9') ok = false;
      v = v * 10 + (t[i] - '0');
    }
    return v;
  };
  const long long year = number(0, 4), month = number(5, 2), day = number(8, 2),
                  hour = number(11, 2), minute = number(14, 2), second = number(17, 2);
  long long ms = 0;
  for (std::size_t i = 20; i < t.size(); ++i) {
    if (t[i] < '0' || t[i] > '9') ok = false;
    if (i < 23) ms = ms * 10 + (t[i] - '0');
  }
  for (std::size_t i = t.size(); i < 23 && t.size() > 19; ++i) ms *= 10;  // ".5" is 500 ms
  if (!ok || month > 12 || day > 31 || hour > 23 || minute > 59 || second > 59) {
    throw StorageError("mysql: '" + t.substr(0, 40) + "' is not a datetime");
  }
  if (year == 0 && month == 0 && day == 0) return TimePoint{};  // a zero date
  if (month == 0 || day == 0) throw StorageError("mysql: '" + t + "' is not a datetime");
  const long long days =
      days_from_civil(year, static_cast<unsigned>(month), static_cast<unsigned>(day));
  return from_millis((((days * 24 + hour) * 60 + minute) * 60 + second) * 1000 + ms);
}

// Columns of a full record read (lookup), in this order (see parse_found). The expiry flag
// is `expires_at <= now` alone: it counts only for a record that is not in progress, which
// parse_found checks on the status it read.
constexpr const char* kRecordColumns =
    "status, fingerprint, owner, response_body, created_at, lease_until > UTC_TIMESTAMP(3),"
    " expires_at <= UTC_TIMESTAMP(3), lease_until, updated_at, expires_at";
constexpr std::size_t kFullColumns = 10;
// What a claim needs: the first seven of them, and the expiry (what a replay reports).
constexpr std::size_t kProbeColumns = 8;
constexpr const char* kProbeColumnsText =
    "status, fingerprint, owner, response_body, created_at, lease_until > UTC_TIMESTAMP(3),"
    " expires_at <= UTC_TIMESTAMP(3), expires_at";
// What the read before a claim needs (it answers only a replay or a mismatch, which no lease
// decides): the claim's columns without the lease flag. One column fewer for the server to
// evaluate and send, and for the client to unpack, on every durable replay.
constexpr std::size_t kPrecheckColumns = 7;
constexpr const char* kPrecheckColumnsText =
    "status, fingerprint, owner, response_body, created_at, expires_at <= UTC_TIMESTAMP(3),"
    " expires_at";

// A record from a read's row; the row's bytes are moved out. Every shape ends with the expiry
// time; reads of the full record have the lease and update times before it; the precheck's
// row has no lease flag (kPrecheckColumns: `live` stays false). A status or time value idem
// did not write (an adopted table may hold any) is CorruptRecord.
Found parse_found(Row& row, const Key& key) {
  Found f;
  if (row.size() < kPrecheckColumns || row[0].is_null()) {
    throw idem::detail::corrupt_record("mysql", key.str(), "no status");
  }
  f.record.status = idem::detail::record_status_or_throw(row[0].bytes(), "mysql", key);
  const bool with_lease = row.size() >= kProbeColumns;
  const std::size_t expired = with_lease ? 6 : 5;
  try {
    f.record.fingerprint = row[1].take();
    f.record.owner = row[2].take();
    f.record.response = row[3].take();
    f.record.created_at = time_field(row[4]);
    f.live = with_lease && !row[5].is_null() && row[5].as_int64() != 0;
    f.expired = f.record.status != Record::Status::kInProgress && !row[expired].is_null() &&
                row[expired].as_int64() != 0;
    if (row.size() >= kFullColumns) {
      f.record.lease_until = time_field(row[7]);
      f.record.updated_at = time_field(row[8]);
    }
    f.record.expires_at = time_field(row[row.size() - 1]);
  } catch (const StorageError& e) {
    throw idem::detail::corrupt_record("mysql", key.str(), e.what());
  }
  return f;
}

// Whether a column of `collation` compares bytes ("" or binary: a binary string type).
bool compares_bytes(const std::string& collation) {
  return collation.empty() || collation == "binary" ||
         (collation.size() > 4 && collation.compare(collation.size() - 4, 4, "_bin") == 0);
}

bool is_binary_type(const std::string& data_type) {
  return data_type == "tinyblob" || data_type == "blob" || data_type == "mediumblob" ||
         data_type == "longblob" || data_type == "varbinary" || data_type == "binary";
}

// The BLOB type holding what a TEXT type holds.
std::string blob_for(const std::string& data_type) {
  if (data_type == "tinytext") return "tinyblob";
  if (data_type == "mediumtext") return "mediumblob";
  if (data_type == "longtext") return "longblob";
  return "blob";
}

}  // namespace

struct IDEM_LOCAL MysqlStore::Impl {
  MysqlStoreOptions& options;
  std::unique_ptr<detail::Pool> pool;
  // Statements (built once from validated, backquoted identifiers; every value is bound).
  std::string claim, claim_final, claim_completed, read, probe, probe_locked, precheck, takeover,
      remove_expired, complete, rewrite_response, fail, release, extend, purge_select,
      purge_delete_head, resolve, batch_head, batch_row;
  std::atomic<std::uint64_t> retries{0}, lock_timeouts{0}, commits_resolved{0}, commits_unknown{0};
  // What the response column accepts (read from the table's definition on first use).
  std::mutex column_mutex;
  std::atomic<bool> column_known{false};
  std::atomic<bool> column_binary{true};
  // The response column's octets (its type's limit; 0 until read).
  std::atomic<std::uint64_t> column_octets{0};
  // The completion by the row's id, when the table's primary key is one AUTO_INCREMENT
  // column (empty otherwise). Written once, under column_mutex, before by_id_known is set
  // (idem's migration never changes a primary key); read only once by_id_known is.
  std::string complete_by_id;
  std::atomic<bool> by_id_known{false};

  explicit Impl(MysqlStoreOptions& o) : options(o) {}

  void build(const std::string& t, const std::string& k, const std::string& s) {
    const std::string where = " WHERE " + k + " = ?1 AND " + s + " = ?2";
    // The claim: a plain INSERT. A duplicate raises 1062, which MySQL answers by rolling back
    // that statement only: the transaction stays open and usable (no savepoint needed).
    // Not INSERT IGNORE (it would turn other errors into warnings) and not ON DUPLICATE KEY
    // UPDATE (it burns an AUTO_INCREMENT value and takes an exclusive lock on every duplicate).
    claim = "INSERT INTO " + t + " (" + k + ", " + s +
            ", status, fingerprint, owner, lease_until, created_at, updated_at)"
            " VALUES (?1, ?2, 'in_progress', ?3, ?4,"
            " UTC_TIMESTAMP(3) + INTERVAL ?5 MICROSECOND, UTC_TIMESTAMP(3), UTC_TIMESTAMP(3))";
    // Transactional mode's claim also writes the record's expiry, with a margin (kExpirySlack)
    // for the transaction's own duration; the completion keeps it when it is at least
    // `retention` away, so the completion of a usual transaction leaves the expires_at index
    // alone (an indexed column changed by an UPDATE costs a delete-mark and an insert in that
    // index, and purge work later). The purge and every read ignore expires_at while the
    // record is in progress, and nobody else sees the row before it commits completed.
    claim_final =
        "INSERT INTO " + t + " (" + k + ", " + s +
        ", status, fingerprint, owner, lease_until, expires_at, created_at, updated_at)"
        " VALUES (?1, ?2, 'in_progress', ?3, ?4,"
        " UTC_TIMESTAMP(3) + INTERVAL ?5 MICROSECOND,"
        " UTC_TIMESTAMP(3) + INTERVAL ?6 MICROSECOND, UTC_TIMESTAMP(3), UTC_TIMESTAMP(3))";
    // Transactional mode's claim when the response is known before the handler
    // (DurableHint::expected_response): the record goes in completed, as the completion would
    // leave it, and no completion statement follows. Nobody sees the row before the COMMIT, so
    // a duplicate meets it exactly as it would meet an in-progress one: waiting on the key.
    claim_completed =
        "INSERT INTO " + t + " (" + k + ", " + s +
        ", status, fingerprint, owner, response_body, lease_until, expires_at, created_at,"
        " updated_at) VALUES (?1, ?2, 'completed', ?3, ?4, ?5, UTC_TIMESTAMP(3),"
        " UTC_TIMESTAMP(3) + INTERVAL ?6 SECOND, UTC_TIMESTAMP(3), UTC_TIMESTAMP(3))";
    // The handler's response was not the expected one: the row claim_completed inserted in
    // this transaction gets the actual response.
    rewrite_response = "UPDATE " + t +
                       " SET response_body = ?4, updated_at = UTC_TIMESTAMP(3)" + where +
                       " AND owner = ?3 AND status = 'completed'";
    read = std::string("SELECT ") + kRecordColumns + " FROM " + t + where;
    probe = std::string("SELECT ") + kProbeColumnsText + " FROM " + t + where;
    precheck = std::string("SELECT ") + kPrecheckColumnsText + " FROM " + t + where;
    // Inside a transaction, after a 1062: a locking read sees the latest committed row, where
    // REPEATABLE READ's snapshot could show an older one. The failed INSERT already holds a
    // shared lock on that index record, so this adds no wait, and shared locks of concurrent
    // duplicates do not conflict with each other.
    probe_locked = probe + " LOCK IN SHARE MODE";
    // Conditional takeover of an expired lease: of two concurrent takers the second re-checks
    // the row after the first commits and changes nothing.
    takeover = "UPDATE " + t +
               " SET owner = ?3, lease_until = UTC_TIMESTAMP(3) + INTERVAL ?4 MICROSECOND,"
               " attempts = attempts + 1, updated_at = UTC_TIMESTAMP(3)" +
               where +
               " AND status = 'in_progress' AND owner = ?5 AND lease_until <= UTC_TIMESTAMP(3)";
    remove_expired = "DELETE FROM " + t + where +
                     " AND status <> 'in_progress' AND expires_at <= UTC_TIMESTAMP(3)";
    // The record is kept at least `retention` (?5) from now: an expiry written by the claim
    // that is far enough stays (see claim_final), any other (NULL for a two-phase claim) is
    // set.
    complete = "UPDATE " + t +
               " SET status = 'completed', response_body = ?4,"
               " expires_at = IF(expires_at >= UTC_TIMESTAMP(3) + INTERVAL ?5 SECOND, expires_at,"
               " UTC_TIMESTAMP(3) + INTERVAL ?5 SECOND),"
               " updated_at = UTC_TIMESTAMP(3)" +
               where + " AND owner = ?3 AND status = 'in_progress'";
    fail = "UPDATE " + t +
           " SET status = 'failed', response_body = ?4,"
           " expires_at = UTC_TIMESTAMP(3) + INTERVAL ?5 SECOND, updated_at = UTC_TIMESTAMP(3)" +
           where + " AND owner = ?3 AND status = 'in_progress'";
    release = "DELETE FROM " + t + where + " AND owner = ?3 AND status = 'in_progress'";
    // MySQL reports rows changed, not rows matched: the new lease_until is always later than
    // the old one (by 1 ms at least, the column's precision), so a held row always counts.
    extend = "UPDATE " + t +
             " SET lease_until = GREATEST(UTC_TIMESTAMP(3) + INTERVAL ?4 MICROSECOND,"
             " lease_until + INTERVAL 1000 MICROSECOND), updated_at = UTC_TIMESTAMP(3)" +
             where + " AND owner = ?3 AND status = 'in_progress'";
    // The purge: a plain read finds a batch (no locks), then one DELETE by key removes it
    // (record locks on the unique key only: nothing blocks inserts of neighbouring keys).
    purge_select = "SELECT " + k + ", " + s + " FROM " + t +
                   " WHERE expires_at <= UTC_TIMESTAMP(3) AND status <> 'in_progress' LIMIT ?1";
    purge_delete_head = "DELETE FROM " + t +
                        " WHERE status <> 'in_progress' AND expires_at <= UTC_TIMESTAMP(3)"
                        " AND (" +
                        k + ", " + s + ") IN (";
    // Records written already completed (record_batch_in); "(...), (...)" per row.
    batch_head = "INSERT INTO " + t + " (" + k + ", " + s +
                 ", status, fingerprint, owner, response_body, lease_until, expires_at,"
                 " created_at, updated_at) VALUES ";
    batch_row =
        "(?, ?, 'completed', ?, ?, ?, UTC_TIMESTAMP(3), UTC_TIMESTAMP(3) + INTERVAL ? SECOND,"
        " UTC_TIMESTAMP(3), UTC_TIMESTAMP(3))";
    // Waits for a transaction still holding the row (its COMMIT may be in flight).
    resolve = "SELECT status, owner FROM " + t + where + " LOCK IN SHARE MODE";
  }

  template <class... Args>
  detail::Connection::Outcome exec(detail::Connection& c, const std::string& sql,
                                   std::string_view what, Rows* rows, const Args&... args) {
    const std::array<Param, sizeof...(Args)> p{detail::to_param(args)...};
    return c.execute(sql, p.data(), p.size(), rows, what);
  }

  // Claims or finds the record on `c` (inside its transaction when `locked`, else
  // autocommit). A lock wait timeout (1205) or deadlock (1213) propagates.
  // `retention` > 0 (transactional mode): an inserted row carries its expiry already (see
  // claim_final), and *row_id is its AUTO_INCREMENT id (0: none, or the row was not inserted).
  // With `completed` (transactional mode, DurableHint::expected_response), a new row goes in
  // completed with that response (claim_completed) and *inserted_completed says so.
  ClaimResult claim_on(detail::Connection& c, const Key& key, std::string_view fingerprint,
                       const OwnerToken& owner, std::chrono::milliseconds lease, bool locked,
                       std::chrono::seconds retention = std::chrono::seconds(0),
                       std::uint64_t* row_id = nullptr,
                       std::optional<std::string_view> completed = std::nullopt,
                       bool* inserted_completed = nullptr) {
    if (row_id != nullptr) *row_id = 0;
    if (inserted_completed != nullptr) *inserted_completed = false;
    const long long lease_us = lease.count() * 1000;
    for (int round = 0; round < kClaimRounds; ++round) {
      try {
        if (completed && retention.count() > 0 && inserted_completed != nullptr) {
          exec(c, claim_completed, "claim", nullptr, key.id(), key.scope(), Blob{fingerprint},
               owner.str(), Blob{*completed}, static_cast<long long>(retention.count()));
          *inserted_completed = true;
        } else if (retention.count() > 0) {
          const std::chrono::microseconds r = retention;
          const std::chrono::microseconds keep = r + std::min(r / 10, kExpirySlack);
          auto out =
              exec(c, claim_final, "claim", nullptr, key.id(), key.scope(), Blob{fingerprint},
                   owner.str(), lease_us, static_cast<long long>(keep.count()));
          if (row_id != nullptr) *row_id = out.insert_id;
        } else {
          exec(c, claim, "claim", nullptr, key.id(), key.scope(), Blob{fingerprint}, owner.str(),
               lease_us);
        }
        return ClaimResult{};  // inserted: ours
      } catch (const DuplicateKey&) {
        // The key exists: decide from the row below.
      }
      Rows rows;
      exec(c, locked ? probe_locked : probe, "claim", &rows, key.id(), key.scope());
      if (rows.empty()) continue;  // deleted meanwhile (released, purged): claim again
      Found f = parse_found(rows[0], key);
      idem::detail::ClaimDecision d = idem::detail::decide_claim(
          idem::detail::found_by_store_clock(f.record, f.live, f.expired), fingerprint,
          owner.str());
      switch (d.action) {
        case idem::detail::ClaimAction::kAnswer:
        case idem::detail::ClaimAction::kKeep:
          return std::move(d.result);
        case idem::detail::ClaimAction::kReplace:
          exec(c, remove_expired, "claim", nullptr, key.id(), key.scope());
          continue;
        case idem::detail::ClaimAction::kTakeOver:
          break;
      }
      auto u = exec(c, takeover, "claim", nullptr, key.id(), key.scope(), owner.str(), lease_us,
                    f.record.owner);
      if (u.affected == 1) return std::move(d.result);
      // Another attempt took it over or completed it first: look again.
    }
    return idem::detail::busy_claim();
  }

  // The schema version `idem_schema_version` records for the table (0: none, or no version
  // table), after refusing one newer than this idem knows.
  long long check_not_newer(detail::Connection& c, std::string_view context) {
    Rows has_versions;
    exec(c,
         "SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()"
         " AND TABLE_NAME = 'idem_schema_version'",
         context, &has_versions);
    if (has_versions.empty()) return 0;
    Rows v;
    exec(c, "SELECT version FROM `idem_schema_version` WHERE name = ?1", context, &v,
         options.table);
    const long long version = v.empty() ? 0 : v[0][0].as_int64();
    if (version > kSchemaVersion) {
      throw StorageError("mysql: table '" + options.table + "' has schema version " +
                         std::to_string(version) + ", newer than this idem (" +
                         std::to_string(kSchemaVersion) + ")");
    }
    return version;
  }

  // Reads the response column's definition and the server's max_allowed_packet once (and
  // refuses a table of a newer schema version, whether or not this store migrated it).
  void load_column(detail::Connection& c) {
    std::lock_guard<std::mutex> lock(column_mutex);
    if (column_known.load()) return;
    (void)check_not_newer(c, "read the table definition");
    Rows rows;
    exec(c,
         "SELECT DATA_TYPE, CHARACTER_SET_NAME, CHARACTER_OCTET_LENGTH"
         " FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE()"
         " AND TABLE_NAME = ?1 AND COLUMN_NAME = 'response_body'",
         "read the table definition", &rows, options.table);
    if (rows.empty()) {
      throw UsageError("idem::mysql: table '" + options.table +
                       "' has no response_body column (run the migration)");
    }
    const std::string type = rows[0][0].bytes();
    const std::string charset = rows[0][1].bytes();
    std::uint64_t octets =
        rows[0][2].is_null() ? 0 : static_cast<std::uint64_t>(rows[0][2].as_int64());
    const bool binary = is_binary_type(type) || charset == "binary";
    if (!binary && charset != "utf8mb4" && charset != "utf8mb3" && charset != "utf8") {
      throw UsageError("idem::mysql: " + options.table + ".response_body is " + type +
                       " in character set " + charset +
                       ": use a BLOB type (binary-safe) or utf8mb4 text");
    }
    column_binary.store(binary);
    // The key columns compare bytes: under a case-insensitive collation (MySQL's defaults)
    // 'Order-1' and 'order-1' would be one record, and one key would replay another's answer.
    // idem's tables and adopted ones are made so; a table made by hand and used without the
    // migration (migrate = false) is checked here, before its first record.
    Rows keys;
    exec(c,
         "SELECT COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS"
         " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?1 AND COLUMN_NAME IN (?2, ?3)",
         "read the table definition", &keys, options.table, options.key_column,
         options.scope_column);
    for (const Row& r : keys) {
      const std::string collation = r[1].is_null() ? std::string() : r[1].bytes();
      if (compares_bytes(collation)) continue;
      throw UsageError("idem::mysql: " + options.table + "." + r[0].bytes() +
                       " compares under the collation " + collation +
                       ", not byte by byte: keys differing only in case would be one record; "
                       "give it a _bin collation (ALTER TABLE ... MODIFY ... COLLATE ..._bin), or "
                       "let the store adopt the table (MysqlStoreOptions::adopt_existing_table)");
    }
    // The primary key, when it is one AUTO_INCREMENT column (idem's tables and the seed's
    // `id`): a completion that finds the row by it reads the clustered index only, where one
    // by (key, scope) reads the unique key first (and the optimizer plans a range on it).
    if (!by_id_known.load()) {
      Rows pk;
      exec(c,
           "SELECT MAX(k.COLUMN_NAME), COUNT(*), MAX(c.EXTRA LIKE '%auto_increment%')"
           " FROM information_schema.KEY_COLUMN_USAGE k JOIN information_schema.COLUMNS c"
           " ON c.TABLE_SCHEMA = k.TABLE_SCHEMA AND c.TABLE_NAME = k.TABLE_NAME"
           " AND c.COLUMN_NAME = k.COLUMN_NAME"
           " WHERE k.TABLE_SCHEMA = DATABASE() AND k.TABLE_NAME = ?1"
           " AND k.CONSTRAINT_NAME = 'PRIMARY'",
           "read the table definition", &pk, options.table);
      if (!pk.empty() && !pk[0][1].is_null() && pk[0][1].as_int64() == 1 && !pk[0][2].is_null() &&
          pk[0][2].as_int64() == 1) {
        std::string quoted = "`";
        for (char ch : pk[0][0].bytes())
          quoted += ch == '`' ? std::string("``") : std::string(1, ch);
        quoted += "`";
        complete_by_id = complete.substr(0, complete.find(" WHERE ")) + " WHERE " + quoted +
                         " = ?6 AND owner = ?3 AND status = 'in_progress'";
      }
      column_octets.store(octets);
      by_id_known.store(true);
    }
    column_known.store(true);
  }

  // The bytes of a statement's values `c` may send: its session's max_allowed_packet (read at
  // connect: a global lowered since reaches new connections, which read it again) less
  // kPacketHeadroom. Beyond it the server drops the connection, which reads as a lost server.
  static std::uint64_t packet_limit(const detail::Connection& c) {
    const std::uint64_t packet = c.max_allowed_packet();
    return packet > kPacketHeadroom ? packet - kPacketHeadroom : 0;
  }
  // The longest response `c` can store: the column's type and the session's packet.
  std::uint64_t response_max(detail::Connection& c) {
    if (!column_known) load_column(c);
    return std::min(column_octets.load(), packet_limit(c));
  }

  // Whether the response column holds `response` exactly (check_response would accept it).
  bool fits_response(detail::Connection& c, std::string_view response) {
    return response.size() <= response_max(c) &&
           (column_binary || idem::detail::valid_utf8(response));
  }

  // Refuses what the response column cannot hold exactly, before anything is written.
  void check_response(detail::Connection& c, std::string_view response) {
    if (fits_response(c, response)) return;
    const std::uint64_t max = response_max(c);
    if (response.size() > max) {
      throw UsageError("idem::mysql: a response of " + std::to_string(response.size()) +
                       " bytes does not fit " + options.table + ".response_body (at most " +
                       std::to_string(max) +
                       " bytes, from the column type and the server's max_allowed_packet);"
                       " the response was not written");
    }
    throw UsageError(
        "idem::mysql: " + options.table +
        ".response_body is a text column and the response is not valid UTF-8;"
        " the response was not written (make the column a BLOB type to store any bytes)");
  }

  // Resolves a COMMIT whose connection was lost: on a fresh connection, a locking read of the
  // record waits until the lost transaction has ended, then tells whether it committed.
  // The lost connection must be closed (its pool slot free) before: the read needs one.
  TransactionalResult resolve_commit(const Key& key, const OwnerToken& owner, std::string response,
                                     bool took_over, unsigned cause_number,
                                     const std::string& cause_sqlstate,
                                     const std::string& message) {
    for (int attempt = 0; attempt < 12; ++attempt) {
      std::optional<bool> committed;
      try {
        auto lease = pool->acquire(true);
        Rows rows;
        exec(*lease, resolve, "resolve commit", &rows, key.id(), key.scope());
        committed =
            !rows.empty() && rows[0][0].bytes() == "completed" && rows[0][1].bytes() == owner.str();
      } catch (const ServerError& e) {
        // 1205: the lost transaction still holds the row. Otherwise: unreachable for now.
        if (e.error_number() != detail::kLockWaitTimeout) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        continue;
      } catch (const StorageError&) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      commits_resolved.fetch_add(1, std::memory_order_relaxed);
      if (*committed) return TransactionalResult::committed(std::move(response), took_over);
      throw Failure<StorageUnavailable>(
          "mysql: the connection was lost at COMMIT and the transaction did not commit "
          "(nothing was applied; retry): " +
              message,
          cause_number, cause_sqlstate);
    }
    commits_unknown.fetch_add(1, std::memory_order_relaxed);
    detail::throw_outcome_unknown(cause_number, cause_sqlstate,
                                  message +
                                      " (the outcome could not be established: retry with "
                                      "the same key)",
                                  "commit");
  }

  // A connection for the store's own statements. The store's first one reads the table's
  // definition first (load_column, on an autocommit connection of its own), so a table the
  // store cannot use is refused before any record is written.
  detail::Pool::Lease lend(bool autocommit_mode) {
    if (!column_known.load()) {
      auto first = pool->acquire(true);
      load_column(*first);
    }
    return pool->acquire(autocommit_mode);
  }

  // Runs `fn(Connection&)` on an autocommit connection (lend). When `idempotent`, a
  // connection found broken is replaced and fn tried once more.
  template <class Fn>
  auto autocommit(bool idempotent, Fn&& fn, bool checked = true) {
    for (int attempt = 0;; ++attempt) {
      auto lease = checked ? lend(true) : pool->acquire(true);
      try {
        return fn(*lease);
      } catch (const ServerError& e) {
        if (idempotent && attempt == 0 && detail::is_connection_failure(e.error_number())) {
          continue;
        }
        throw;
      }
    }
  }
  // autocommit on the pool's connection as it is: for the migration, which makes the table.
  template <class Fn>
  auto autocommit_unchecked(bool idempotent, Fn&& fn) {
    return autocommit(idempotent, std::forward<Fn>(fn), false);
  }
};

MysqlStore::MysqlStore(std::string uri)
    : MysqlStore([&] {
        MysqlStoreOptions o;
        o.uri = std::move(uri);
        return o;
      }()) {}

MysqlStore::MysqlStore(MysqlStoreOptions options) : options_(std::move(options)) {
  if (!options_.uri.empty()) options_.connection = parse_uri(options_.uri);
  const std::string t = q(check_sql_identifier("table", options_.table));
  const std::string k = q(check_sql_identifier("key column", options_.key_column));
  const std::string s = q(check_sql_identifier("scope column", options_.scope_column));
  if (options_.key_column == options_.scope_column) {
    throw UsageError("idem::mysql: key and scope columns must differ");
  }
  if (options_.connection.database.empty()) {
    throw UsageError("idem::mysql: the connection names no database (mysql://.../<database>)");
  }
  if (options_.pool_size == 0) options_.pool_size = 16;
  if (options_.pool_wait.count() <= 0) options_.pool_wait = std::chrono::seconds(5);
  if (options_.lock_wait_timeout.count() <= 0) options_.lock_wait_timeout = std::chrono::seconds(1);
  impl_ = std::make_unique<Impl>(options_);
  impl_->build(t, k, s);
  detail::ConnectSettings settings;
  settings.options = options_.connection;
  settings.init_sql = "SET SESSION innodb_lock_wait_timeout = " +
                      std::to_string(options_.lock_wait_timeout.count());
  impl_->pool =
      std::make_unique<detail::Pool>(std::move(settings), options_.pool_size, options_.pool_wait);
  if (options_.migrate) migrate();
}

MysqlStore::~MysqlStore() = default;

MysqlStoreStats MysqlStore::stats() const noexcept {
  MysqlStoreStats s;
  s.retries = impl_->retries.load(std::memory_order_relaxed);
  s.lock_timeouts = impl_->lock_timeouts.load(std::memory_order_relaxed);
  s.commits_resolved = impl_->commits_resolved.load(std::memory_order_relaxed);
  s.commits_unknown = impl_->commits_unknown.load(std::memory_order_relaxed);
  return s;
}

std::size_t MysqlStore::open_connections() const { return impl_->pool->open_connections(); }

std::uint64_t MysqlStore::max_response_bytes() {
  return impl_->autocommit(true, [&](detail::Connection& c) { return impl_->response_max(c); });
}

void MysqlStore::run_in_transaction(const std::function<void(Transaction&)>& fn) {
  for (unsigned retries = 0;; ++retries) {
    // The pool's as it is: with_transaction serves business work too, on a store whose record
    // table may not exist; the record writes in it (claim_in, record_batch_in) read the
    // table's definition first.
    auto lease = impl_->pool->acquire(false);
    Transaction tx(*lease);
    lease->watch_transaction();
    try {
      fn(tx);
      try {
        lease->commit();
      } catch (const ServerError& e) {
        if (!detail::is_connection_failure(e.error_number())) throw;
        // The COMMIT may have reached the server: never "nothing was applied".
        lease->mark_broken();
        detail::throw_outcome_unknown(
            e.error_number(), e.sqlstate(),
            std::string(dynamic_cast<const std::exception&>(e).what()) +
                " (the connection was lost at COMMIT: the transaction may have committed)",
            "commit");
      }
      return;
    } catch (const ServerError& e) {
      lease->rollback();
      // A deadlock or lock wait timeout rolled the work back: run it again (bounded), as
      // InnoDB asks ("try restarting transaction").
      if (!detail::is_lock_conflict(e.error_number()) || retries >= options_.max_retries) throw;
      impl_->retries.fetch_add(1, std::memory_order_relaxed);
      idem::detail::pause_before_rerun(retries);
    } catch (...) {
      lease->rollback();
      throw;
    }
  }
}

void MysqlStore::run_in_session(const std::function<void(Session&)>& fn) {
  auto lease = impl_->pool->acquire(true);
  Session session(*lease);
  fn(session);
}

TransactionalResult MysqlStore::run_transactional_impl(const Key& key, std::string_view fingerprint,
                                                       const OwnerToken& owner,
                                                       std::chrono::seconds retention,
                                                       HandlerRef handler, DurableHint hint) {
  idem::detail::check_term(retention, "idem::mysql: the retention");
  const bool read_first = !hint.expects_absent();
  if (fingerprint.size() > kMaxFingerprint) {
    throw UsageError("idem::mysql: fingerprints are at most 255 bytes");
  }
  unsigned retries = 0;
  bool reconnected = false;
  for (;;) {
    if (options_.read_first || read_first) {
      // A completed duplicate or a mismatch needs no transaction: answer from one read.
      std::optional<ClaimResult> early = impl_->autocommit(true, [&](detail::Connection& c) {
        std::optional<ClaimResult> out;
        Rows rows;
        impl_->exec(c, impl_->precheck, "read", &rows, key.id(), key.scope());
        if (!rows.empty()) {
          Found f = parse_found(rows[0], key);
          out = idem::detail::decide_without_claim(
              idem::detail::found_by_store_clock(f.record, f.live, f.expired), fingerprint);
        }
        return out;
      });
      if (early) return TransactionalResult::found(std::move(*early));
    }
    // A COMMIT whose connection was lost: resolved once the connection is closed.
    struct LostCommit {
      unsigned number;
      std::string sqlstate, message, response;
      bool took_over;
    };
    std::optional<LostCommit> lost;
    {
      auto lease = impl_->lend(false);
      detail::Connection& c = *lease;
      Transaction tx(c);
      c.watch_transaction();
      bool handler_ran = false;
      try {
        std::uint64_t row_id = 0;
        bool inserted_completed = false;
        // An expected response the column cannot hold is written the usual way (and refused
        // there, if the handler's response is the same), never inserted.
        const bool expect =
            hint.expected_response && impl_->fits_response(c, *hint.expected_response);
        ClaimResult claim = impl_->claim_on(
            c, key, fingerprint, owner, std::chrono::milliseconds(0), true, retention, &row_id,
            expect ? hint.expected_response : std::nullopt, &inserted_completed);
        if (claim.status != ClaimStatus::kClaimed) {
          c.rollback();  // nothing was written
          return TransactionalResult::found(std::move(claim));
        }
        handler_ran = true;
        std::string response = handler(tx);
        impl_->check_response(c, response);
        // The row this transaction inserted is found by its id where the primary key allows it
        // (see load_column); a row it took over, by its key.
        const auto seconds = static_cast<long long>(retention.count());
        detail::Connection::Outcome done;
        done.affected = 1;
        if (inserted_completed) {
          // Inserted completed with the expected response: nothing to write when it is that.
          if (response != *hint.expected_response) {
            // (MySQL counts changed rows: the row holds other bytes, so it changes.)
            done = impl_->exec(c, impl_->rewrite_response, "complete", nullptr, key.id(),
                               key.scope(), owner.str(), Blob{response});
          }
        } else if (row_id != 0 && impl_->by_id_known.load() && !impl_->complete_by_id.empty()) {
          done = impl_->exec(c, impl_->complete_by_id, "complete", nullptr, key.id(), key.scope(),
                             owner.str(), Blob{response}, seconds, row_id);
        } else {
          done = impl_->exec(c, impl_->complete, "complete", nullptr, key.id(), key.scope(),
                             owner.str(), Blob{response}, seconds);
        }
        if (done.affected != 1) {
          // We inserted or took over the row in this transaction and hold its lock.
          throw LeaseLost("mysql: record '" + key.str() + "' is no longer held by this attempt");
        }
        if (options_.before_commit) options_.before_commit(tx);
        try {
          c.commit();
        } catch (const ServerError& e) {
          if (!detail::is_connection_failure(e.error_number())) throw;
          c.mark_broken();
          lost = LostCommit{e.error_number(), e.sqlstate(),
                            dynamic_cast<const std::exception&>(e).what(), std::move(response),
                            claim.took_over};
        }
        if (!lost) return TransactionalResult::committed(std::move(response), claim.took_over);
      } catch (const ServerError& e) {
        c.rollback();
        const unsigned n = e.error_number();
        if (n == detail::kLockWaitTimeout && !handler_ran) {
          // The claim waited lock_wait_timeout on a transaction holding the key. Only the claim
          // ran in this (now rolled back) transaction: answer "in progress".
          impl_->lock_timeouts.fetch_add(1, std::memory_order_relaxed);
          return TransactionalResult::found(idem::detail::busy_claim());
        }
        // Deadlocks and lock wait timeouts re-run the transaction, whoever raised them (the
        // handler's own statements included): the earlier attempt was rolled back entirely.
        if (detail::is_lock_conflict(n) && retries < options_.max_retries) {
          idem::detail::pause_before_rerun(retries);
          ++retries;
          impl_->retries.fetch_add(1, std::memory_order_relaxed);
          if (options_.on_retry) options_.on_retry(key, n);
          continue;
        }
        // A pooled connection that died while idle (server restart): nothing ran yet, so one
        // more try on a fresh connection is safe.
        if (detail::is_connection_failure(n) && !handler_ran && !reconnected) {
          reconnected = true;
          continue;
        }
        throw;
      } catch (...) {
        c.rollback();
        throw;
      }
    }  // the lost connection is closed here, its pool slot free for the resolving read
    return impl_->resolve_commit(key, owner, std::move(lost->response), lost->took_over,
                                 lost->number, lost->sqlstate, lost->message);
  }
}

ClaimResult MysqlStore::begin(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                              std::chrono::milliseconds lease, DurableHint) {
  idem::detail::check_term(lease, "idem::mysql: the lease");
  if (fingerprint.size() > kMaxFingerprint) {
    throw UsageError("idem::mysql: fingerprints are at most 255 bytes");
  }
  // Idempotent: a retried begin finds its own claim and keeps it (the rulebook's kKeep).
  bool sent = false;  // a claim statement went out: it may have been applied
  try {
    return impl_->autocommit(true, [&](detail::Connection& c) {
      try {
        sent = true;
        return impl_->claim_on(c, key, fingerprint, owner, lease, false);
      } catch (const ServerError& e) {
        if (e.error_number() != detail::kLockWaitTimeout) throw;
        impl_->lock_timeouts.fetch_add(1, std::memory_order_relaxed);
        return idem::detail::busy_claim();
      }
    });
  } catch (const ServerError& e) {
    // The connection broke under a claim and the retry could not settle it (its connect or its
    // statement failed too): the claim may stand. OutcomeUnknown, so that the caller (the
    // guard) releases it, owner-checked, rather than leave it in progress for its lease.
    if (!sent || !detail::is_connection_failure(e.error_number())) throw;
    detail::throw_outcome_unknown(e.error_number(), e.sqlstate(),
                                  dynamic_cast<const std::exception&>(e).what(), "claim");
  }
}

bool MysqlStore::complete(const Key& key, const OwnerToken& owner, std::string_view response,
                          std::chrono::seconds retention) {
  idem::detail::check_term(retention, "idem::mysql: the retention");
  auto update = [&](detail::Connection& c) {
    impl_->check_response(c, response);
    return impl_
               ->exec(c, impl_->complete, "complete", nullptr, key.id(), key.scope(), owner.str(),
                      Blob{response}, static_cast<long long>(retention.count()))
               .affected == 1;
  };
  try {
    return impl_->autocommit(false, update);
  } catch (const ServerError& e) {
    if (!detail::is_connection_failure(e.error_number())) throw;
    // The UPDATE may or may not have been applied before the connection broke: re-read (a
    // locking read waits for it if it is still running).
    const std::string message = dynamic_cast<const std::exception&>(e).what();
    std::optional<std::pair<std::string, std::string>> row;
    try {
      row = impl_->autocommit(true, [&](detail::Connection& c) {
        Rows rows;
        impl_->exec(c, impl_->resolve, "complete", &rows, key.id(), key.scope());
        std::optional<std::pair<std::string, std::string>> r;
        if (!rows.empty()) r.emplace(rows[0][0].bytes(), rows[0][1].bytes());
        return r;
      });
    } catch (const Error&) {
      detail::throw_outcome_unknown(e.error_number(), e.sqlstate(), message, "complete");
    }
    if (!row || row->second != owner.str()) return false;
    if (row->first == "completed") return true;
    if (row->first == "in_progress") return impl_->autocommit(false, update);
    return false;
  }
}

bool MysqlStore::fail(const Key& key, const OwnerToken& owner, std::string_view reason,
                      std::chrono::seconds retention) {
  idem::detail::check_term(retention, "idem::mysql: the retention");
  return impl_->autocommit(false, [&](detail::Connection& c) {
    impl_->check_response(c, reason);
    return impl_
               ->exec(c, impl_->fail, "fail", nullptr, key.id(), key.scope(), owner.str(),
                      Blob{reason}, static_cast<long long>(retention.count()))
               .affected == 1;
  });
}

bool MysqlStore::release(const Key& key, const OwnerToken& owner) {
  return impl_->autocommit(true, [&](detail::Connection& c) {
    return impl_->exec(c, impl_->release, "release", nullptr, key.id(), key.scope(), owner.str())
               .affected == 1;
  });
}

bool MysqlStore::extend(const Key& key, const OwnerToken& owner, std::chrono::milliseconds lease) {
  idem::detail::check_term(lease, "idem::mysql: the lease");
  const long long lease_us = lease.count() * 1000;
  return impl_->autocommit(true, [&](detail::Connection& c) {
    return impl_
               ->exec(c, impl_->extend, "extend", nullptr, key.id(), key.scope(), owner.str(),
                      lease_us)
               .affected == 1;
  });
}

ClaimResult MysqlStore::claim_in(Transaction& tx, const Key& key, std::string_view fingerprint,
                                 const OwnerToken& owner, std::chrono::milliseconds lease) {
  // 0: the claim of a transactional run, which holds no lease (its transaction is the lock).
  idem::detail::check_not_longer(lease, "idem::mysql: the lease");
  if (fingerprint.size() > kMaxFingerprint) {
    throw UsageError("idem::mysql: fingerprints are at most 255 bytes");
  }
  try {
    detail::Connection& c = detail::connection_of(tx);
    if (!impl_->column_known.load()) impl_->load_column(c);  // before the first record
    return impl_->claim_on(c, key, fingerprint, owner, lease, true);
  } catch (const ServerError& e) {
    // The key is held by another transaction beyond lock_wait_timeout: MySQL rolled back the
    // waiting statement only (unless innodb_rollback_on_timeout, which ends `tx`: its next
    // statement says so).
    if (e.error_number() != detail::kLockWaitTimeout) throw;
    impl_->lock_timeouts.fetch_add(1, std::memory_order_relaxed);
    return idem::detail::busy_claim();
  }
}

void MysqlStore::complete_in(Transaction& tx, const Key& key, const OwnerToken& owner,
                             std::string_view response, std::chrono::seconds retention) {
  idem::detail::check_term(retention, "idem::mysql: the retention");
  detail::Connection& c = detail::connection_of(tx);
  impl_->check_response(c, response);
  auto done = impl_->exec(c, impl_->complete, "complete", nullptr, key.id(), key.scope(),
                          owner.str(), Blob{response}, static_cast<long long>(retention.count()));
  if (done.affected != 1) {
    throw LeaseLost("mysql: record '" + key.str() + "' is no longer held by this attempt");
  }
}

std::optional<std::vector<bool>> MysqlStore::record_batch_in(
    Transaction& tx, const std::vector<ClaimRequest>& requests, std::string_view response,
    std::chrono::seconds retention, DurableHint) {
  std::vector<bool> out(requests.size(), false);
  if (requests.empty()) return out;
  if (retention.count() <= 0) throw UsageError("idem::mysql: the retention must be positive");
  if (!impl_->column_known.load()) impl_->load_column(detail::connection_of(tx));
  std::vector<std::size_t> order(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const ClaimRequest& r = requests[i];
    if (r.key == nullptr || r.owner == nullptr) {
      throw UsageError("idem::mysql: record_batch_in needs a key and an owner");
    }
    if (r.fingerprint.size() > kMaxFingerprint) {
      throw UsageError("idem::mysql: fingerprints are at most 255 bytes");
    }
    order[i] = i;
  }
  auto before = [&](std::size_t a, std::size_t b) {
    const Key& x = *requests[a].key;
    const Key& y = *requests[b].key;
    return x.scope() != y.scope() ? x.scope() < y.scope() : x.id() < y.id();
  };
  std::sort(order.begin(), order.end(), before);
  for (std::size_t j = 1; j < order.size(); ++j) {
    if (!before(order[j - 1], order[j])) {
      throw UsageError("idem::mysql: record_batch_in got key '" + requests[order[j]].key->str() +
                       "' twice");
    }
  }
  detail::Connection& c = detail::connection_of(tx);
  impl_->check_response(c, response);
  const auto seconds = static_cast<long long>(retention.count());
  auto params_of = [&](const ClaimRequest& r, std::vector<Param>& p) {
    p.push_back(detail::to_param(r.key->id()));
    p.push_back(detail::to_param(r.key->scope()));
    p.push_back(detail::to_param(Blob{r.fingerprint}));
    p.push_back(detail::to_param(r.owner->str()));
    p.push_back(detail::to_param(Blob{response}));
    p.push_back(detail::to_param(seconds));
  };
  // Rows per INSERT: every row carries the response, and a statement must stay within the
  // server's max_allowed_packet (beyond it the server drops the connection, which would read
  // as a lost server) and within a prepared statement's placeholders.
  std::uint64_t widest = 0;
  for (const ClaimRequest& r : requests) {
    widest = std::max<std::uint64_t>(widest, r.key->id().size() + r.key->scope().size() +
                                                 r.fingerprint.size() + r.owner->str().size());
  }
  const std::uint64_t row_bytes = response.size() + widest + kBatchRowOverhead;
  const std::uint64_t packet = Impl::packet_limit(c);
  const std::size_t per_statement = packet == 0
                                        ? kBatchRowsPerStatement
                                        : static_cast<std::size_t>(std::clamp<std::uint64_t>(
                                              packet / row_bytes, 1, kBatchRowsPerStatement));
  std::vector<Param> params;
  const std::string one = impl_->batch_head + impl_->batch_row;
  for (std::size_t from = 0; from < order.size(); from += per_statement) {
    const std::size_t to = std::min(order.size(), from + per_statement);
    // The rows of this slice in one statement: the usual case (the keys are new).
    std::string sql = impl_->batch_head;
    params.clear();
    params.reserve((to - from) * 6);
    for (std::size_t j = from; j < to; ++j) {
      if (j > from) sql += ", ";
      sql += impl_->batch_row;
      params_of(requests[order[j]], params);
    }
    try {
      c.execute(sql, params.data(), params.size(), nullptr, "insert records");
      for (std::size_t j = from; j < to; ++j) out[order[j]] = true;
      continue;
    } catch (const DuplicateKey&) {
      // A record exists: MySQL rolled back that statement only. One row at a time, in the
      // same order, tells which.
    }
    for (std::size_t j = from; j < to; ++j) {
      params.clear();
      params_of(requests[order[j]], params);
      try {
        c.execute(one, params.data(), params.size(), nullptr, "insert records");
        out[order[j]] = true;
      } catch (const DuplicateKey&) {
        out[order[j]] = false;
      }
    }
  }
  return out;
}

ClaimResult MysqlStore::decide_in(Transaction& tx, const Key& key, std::string_view fingerprint,
                                  const OwnerToken& owner) {
  return claim_in(tx, key, fingerprint, owner, std::chrono::milliseconds(0));
}

void MysqlStore::record_in(Transaction& tx, const Key& key, std::string_view,
                           const OwnerToken& owner, std::string_view response,
                           std::chrono::seconds retention, const ClaimResult&) {
  complete_in(tx, key, owner, response, retention);
}

// MySQL prepares these (MariaDB and MySQL 8); where a server refuses, the client runs them
// through the text protocol.
void MysqlStore::savepoint(Transaction& tx) { tx.exec("SAVEPOINT idem_batch"); }
void MysqlStore::rollback_to_savepoint(Transaction& tx) {
  tx.exec("ROLLBACK TO SAVEPOINT idem_batch");
}
void MysqlStore::release_savepoint(Transaction& tx) { tx.exec("RELEASE SAVEPOINT idem_batch"); }

std::optional<Record> MysqlStore::lookup(const Key& key) {
  return impl_->autocommit(true, [&](detail::Connection& c) -> std::optional<Record> {
    Rows rows;
    impl_->exec(c, impl_->read, "lookup", &rows, key.id(), key.scope());
    if (rows.empty()) return std::nullopt;
    return parse_found(rows[0], key).record;
  });
}

std::size_t MysqlStore::purge_expired(std::size_t batch_size) {
  if (batch_size == 0) throw UsageError("idem::mysql: purge batch size must be positive");
  if (batch_size > 10000) batch_size = 10000;  // placeholders per statement stay well bounded
  std::size_t total = 0;
  for (;;) {
    // Rows found, rows this call deleted (a concurrent purge may have taken some).
    const auto [found, deleted] =
        impl_->autocommit(true, [&](detail::Connection& c) -> std::pair<std::size_t, std::size_t> {
          Rows keys;
          impl_->exec(c, impl_->purge_select, "purge", &keys, static_cast<long long>(batch_size));
          if (keys.empty()) return {0, 0};
          std::string sql = impl_->purge_delete_head;
          std::vector<Param> params;
          params.reserve(keys.size() * 2);
          for (std::size_t i = 0; i < keys.size(); ++i) {
            sql += i == 0 ? "(?, ?)" : ", (?, ?)";
            params.push_back(detail::to_param(std::string_view(keys[i][0].bytes())));
            params.push_back(detail::to_param(std::string_view(keys[i][1].bytes())));
          }
          sql += ")";
          try {
            auto out = c.execute(sql, params.data(), params.size(), nullptr, "purge");
            return {keys.size(), static_cast<std::size_t>(out.affected)};
          } catch (const ServerError& e) {
            // A row of the batch is held by a claim or a completion: leave the rest to the
            // next purge rather than wait again on the same rows.
            if (e.error_number() == detail::kLockWaitTimeout) return {0, 0};
            throw;
          }
        });
    total += deleted;
    if (found < batch_size) return total;
  }
}

namespace {
// The seed tables' unique keys keep their names; other tables get idem's.
std::string unique_key_name(const std::string& table) {
  if (table == "api_idempotency") return "uk_idem_key_biz_type";
  if (table == "mq_consume_record") return "uk_msg_group";
  return "uk_idem_key";
}

struct ColumnInfo {
  std::string data_type, column_type, charset, collation;
  std::int64_t max_chars = 0;
};
}  // namespace

void MysqlStore::migrate() {
  const std::string& table = options_.table;
  const std::string t = q(table), k = q(options_.key_column), s = q(options_.scope_column);
  impl_->autocommit_unchecked(false, [&](detail::Connection& c) {
    // One migrator at a time across every process (a session-level named lock, released
    // below or when the connection closes).
    Rows got;
    impl_->exec(c, "SELECT GET_LOCK(CONCAT('idem_migrate:', LEFT(SHA1(DATABASE()), 32)), 60)",
                "migrate", &got);
    if (got.empty() || got[0][0].is_null() || got[0][0].as_int64() != 1) {
      throw StorageTimeout("mysql: migrate: another process held the migration lock for 60 s");
    }
    struct Unlock {
      Impl& impl;
      detail::Connection& c;
      ~Unlock() {
        try {
          Rows r;
          impl.exec(c, "SELECT RELEASE_LOCK(CONCAT('idem_migrate:', LEFT(SHA1(DATABASE()), 32)))",
                    "migrate", &r);
        } catch (...) {
          c.mark_broken();  // closing the session releases the lock
        }
      }
    } unlock{*impl_, c};
    c.text(
        "CREATE TABLE IF NOT EXISTS `idem_schema_version` ("
        "`name` varchar(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,"
        " `version` int NOT NULL, `applied_at` datetime(3) NOT NULL"
        ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
        "migrate");
    const long long version = impl_->check_not_newer(c, "migrate");
    if (version == kSchemaVersion) return;
    // The table's columns, if it exists.
    Rows cols;
    impl_->exec(c,
                "SELECT COLUMN_NAME, DATA_TYPE, COLUMN_TYPE, CHARACTER_SET_NAME, COLLATION_NAME,"
                " CHARACTER_MAXIMUM_LENGTH FROM information_schema.COLUMNS"
                " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?1",
                "migrate", &cols, table);
    if (cols.empty()) {
      // Keep in step with src/mysql/schema.sql. Key columns compare bytes (ascii_bin): keys
      // are identifiers, and a case-insensitive collation would make 'A1' and 'a1' one key.
      c.text("CREATE TABLE IF NOT EXISTS " + t + " (`id` bigint NOT NULL AUTO_INCREMENT, " + k +
                 " varchar(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, " + s +
                 " varchar(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
                 " `status` varchar(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
                 " `response_body` longblob,"
                 " `created_at` datetime(3) NOT NULL,"
                 " `updated_at` datetime(3) NOT NULL,"
                 " `fingerprint` varbinary(255) NOT NULL DEFAULT '',"
                 " `owner` varchar(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT '',"
                 " `lease_until` datetime(3) NULL,"
                 " `expires_at` datetime(3) NULL,"
                 " `attempts` int NOT NULL DEFAULT 1,"
                 " PRIMARY KEY (`id`),"
                 " UNIQUE KEY " +
                 q(unique_key_name(table)) + " (" + k + ", " + s +
                 "),"
                 " KEY `idx_idem_expires_at` (`expires_at`)"
                 ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
             "migrate");
    } else {
      if (!options_.adopt_existing_table) {
        throw UsageError("idem::mysql: table '" + table +
                         "' exists and was not created by idem; set "
                         "MysqlStoreOptions::adopt_existing_table to add idem's columns to it "
                         "(see docs/mysql.md), or use another table");
      }
      std::vector<std::pair<std::string, ColumnInfo>> info;
      for (const Row& r : cols) {
        ColumnInfo ci;
        ci.data_type = r[1].bytes();
        ci.column_type = r[2].bytes();
        ci.charset = r[3].bytes();
        ci.collation = r[4].bytes();
        ci.max_chars = r[5].is_null() ? 0 : r[5].as_int64();
        info.emplace_back(r[0].bytes(), ci);
      }
      auto find = [&](const std::string& name) -> const ColumnInfo* {
        for (const auto& [n, ci] : info) {
          if (n == name) return &ci;
        }
        return nullptr;
      };
      auto require = [&](const std::string& name) -> const ColumnInfo& {
        const ColumnInfo* ci = find(name);
        if (ci == nullptr) {
          throw UsageError("idem::mysql: cannot adopt table '" + table + "': it has no column '" +
                           name + "'");
        }
        return *ci;
      };
      const ColumnInfo& key_col = require(options_.key_column);
      const ColumnInfo& scope_col = require(options_.scope_column);
      const ColumnInfo& status_col = require("status");
      require("created_at");
      if ((status_col.data_type != "varchar" && status_col.data_type != "char") ||
          status_col.max_chars < 11) {
        throw UsageError("idem::mysql: cannot adopt table '" + table +
                         "': its status column must be varchar(11) or longer");
      }
      // No NOT NULL column without a default that idem does not write: every claim would fail.
      std::string extra;
      Rows required;
      impl_->exec(c,
                  "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA ="
                  " DATABASE() AND TABLE_NAME = ?1 AND IS_NULLABLE = 'NO' AND COLUMN_DEFAULT IS"
                  " NULL AND EXTRA NOT LIKE '%auto_increment%' AND EXTRA NOT LIKE '%GENERATED%'",
                  "migrate", &required, table);
      for (const Row& r : required) {
        const std::string name = r[0].bytes();
        if (!idem::detail::is_record_column(name, options_.key_column, options_.scope_column)) {
          extra += (extra.empty() ? "" : ", ") + name;
        }
      }
      if (!extra.empty()) {
        throw UsageError("idem::mysql: cannot adopt table '" + table +
                         "': it has NOT NULL columns without a default that idem does not write (" +
                         extra + "): give them a default or let them be NULL");
      }
      // A unique index on exactly (key, scope).
      Rows idx;
      impl_->exec(c,
                  "SELECT INDEX_NAME, GROUP_CONCAT(COLUMN_NAME ORDER BY COLUMN_NAME SEPARATOR ',')"
                  " FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE()"
                  " AND TABLE_NAME = ?1 AND NON_UNIQUE = 0 GROUP BY INDEX_NAME",
                  "migrate", &idx, table);
      const std::string want = std::min(options_.key_column, options_.scope_column) + "," +
                               std::max(options_.key_column, options_.scope_column);
      bool unique = false;
      for (const Row& r : idx) unique = unique || r[1].bytes() == want;
      if (!unique) {
        throw UsageError("idem::mysql: cannot adopt table '" + table +
                         "': it needs a unique key on exactly (" + options_.key_column + ", " +
                         options_.scope_column + ")");
      }
      std::vector<std::string> changes;
      auto binary = [](const ColumnInfo& ci) { return compares_bytes(ci.collation); };
      // The key columns compare bytes and hold idem's longest key (Key: 128-byte ids, 64-byte
      // scopes): a narrower column would refuse longer keys (strict mode) or, with sql_mode
      // '', cut them, and two keys sharing their first bytes would become one record.
      const std::pair<const ColumnInfo*, long long> widths[] = {
          {&key_col, static_cast<long long>(kMaxIdLength)},
          {&scope_col, static_cast<long long>(kMaxScopeLength)}};
      for (const auto& [ci, width] : widths) {
        const std::string& col = ci == &key_col ? options_.key_column : options_.scope_column;
        const bool text = ci->data_type == "varchar" || ci->data_type == "char";
        const bool bytes = ci->data_type == "varbinary" || ci->data_type == "binary";
        if (!text && !bytes) {
          throw UsageError("idem::mysql: cannot adopt table '" + table + "': its column '" + col +
                           "' is " + ci->column_type + "; idem's keys need varchar or varbinary");
        }
        const bool narrow = ci->max_chars < width;
        if (!narrow && binary(*ci)) continue;
        std::string type =
            narrow ? std::string(text ? "varchar" : "varbinary") + "(" + std::to_string(width) + ")"
                   : ci->column_type;
        if (text) type += " CHARACTER SET " + ci->charset + " COLLATE " + ci->charset + "_bin";
        changes.push_back("MODIFY " + q(col) + " " + type + " NOT NULL");
      }
      if (const ColumnInfo* r = find("response_body")) {
        if (!is_binary_type(r->data_type) && r->charset != "binary") {
          changes.push_back("MODIFY `response_body` " + blob_for(r->data_type));
        }
      } else {
        changes.push_back("ADD COLUMN `response_body` longblob");
      }
      if (find("updated_at") == nullptr)
        changes.push_back("ADD COLUMN `updated_at` datetime(3) NULL");
      if (find("fingerprint") == nullptr) {
        changes.push_back("ADD COLUMN `fingerprint` varbinary(255) NOT NULL DEFAULT ''");
      }
      if (find("owner") == nullptr) {
        changes.push_back(
            "ADD COLUMN `owner` varchar(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL "
            "DEFAULT ''");
      }
      if (find("lease_until") == nullptr)
        changes.push_back("ADD COLUMN `lease_until` datetime(3) NULL");
      if (find("expires_at") == nullptr)
        changes.push_back("ADD COLUMN `expires_at` datetime(3) NULL");
      if (find("attempts") == nullptr)
        changes.push_back("ADD COLUMN `attempts` int NOT NULL DEFAULT 1");
      Rows has_index;
      impl_->exec(c,
                  "SELECT 1 FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE()"
                  " AND TABLE_NAME = ?1 AND COLUMN_NAME = 'expires_at' AND SEQ_IN_INDEX = 1",
                  "migrate", &has_index, table);
      if (has_index.empty()) changes.push_back("ADD INDEX `idx_idem_expires_at` (`expires_at`)");
      if (!changes.empty()) {
        std::string alter = "ALTER TABLE " + t;
        for (std::size_t i = 0; i < changes.size(); ++i)
          alter += (i == 0 ? " " : ", ") + changes[i];
        c.text(alter, "migrate");
      }
    }
    impl_->exec(
        c,
        "INSERT INTO `idem_schema_version` (name, version, applied_at)"
        " VALUES (?1, ?2, UTC_TIMESTAMP(3))"
        " ON DUPLICATE KEY UPDATE version = VALUES(version), applied_at = VALUES(applied_at)",
        "migrate", nullptr, table, kSchemaVersion);
  });
  // What the response column takes, read now rather than inside the first transaction.
  impl_->column_known.store(false);  // the migration may have changed it
  (void)max_response_bytes();
}

}  // namespace idem::mysql

// The contract, checked where the store is built (the guard checks it again where it is used).
static_assert(idem::detail::check_durable_store<idem::mysql::MysqlStore>());
static_assert(idem::detail::check_batch_store<idem::mysql::MysqlStore>());
