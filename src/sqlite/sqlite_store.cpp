// SPDX-License-Identifier: MIT
// SQLite durable store: connection pool, writer lock, statements, migration, record protocol.
#include "idem/sqlite/sqlite_store.hpp"

#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "errors.hpp"
#include "idem/detail/packed_fingerprint.hpp"
#include "idem/detail/record_columns.hpp"
#include "idem/detail/record_rules.hpp"
#include "idem/sql.hpp"

namespace idem::sqlite {

namespace detail {

// The in-process writer lock, first come first served: unlock hands the lock straight to the
// longest waiter, so a thread that writes in a loop (the purge, a batch consumer) cannot take
// it back ahead of a writer already waiting (a plain mutex lets the unlocking thread win again
// and again: a waiting writer stalled for ~1 s behind a purge of 10^6 records). A mutex and a
// condition variable per waiter rather than std::timed_mutex: try_lock_for on GCC 12 uses
// pthread_mutex_clocklock, which ThreadSanitizer does not see, and a lock TSan cannot see
// makes every later unlock a false report.
class WriterLock {
 public:
  bool try_lock_for(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!held_) {  // free, so nobody waits (unlock hands over to a waiter)
      held_ = true;
      holder_ = std::this_thread::get_id();
      return true;
    }
    if (holder_ == std::this_thread::get_id()) {
      // Waiting would wait for itself until busy_timeout, then report a retryable timeout
      // that fails the same way every time.
      throw UsageError(
          "idem::sqlite: this thread already holds the database's write transaction: a write "
          "(or a guarded call) inside a transactional handler must use the handler's "
          "transaction, not the same Database again");
    }
    Waiter self;
    queue_.push_back(&self);
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (!self.granted) {
      if (self.wake.wait_until(lock, until) == std::cv_status::timeout && !self.granted) {
        queue_.erase(std::find(queue_.begin(), queue_.end(), &self));
        return false;
      }
    }
    holder_ = std::this_thread::get_id();
    return true;  // handed over: held_ stayed true
  }
  // Takes the lock only when it is free (then nobody waits for it): never queues.
  bool try_lock() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_) return false;
    held_ = true;
    holder_ = std::this_thread::get_id();
    return true;
  }
  void unlock() {
    std::lock_guard<std::mutex> lock(mutex_);
    holder_ = std::thread::id();
    if (queue_.empty()) {
      held_ = false;
      return;
    }
    Waiter* next = queue_.front();
    queue_.pop_front();
    next->granted = true;
    next->wake.notify_one();  // under the lock: `next` lives until it sees `granted`
  }

 private:
  struct Waiter {
    std::condition_variable wake;
    bool granted = false;
  };
  std::mutex mutex_;
  std::deque<Waiter*> queue_;  // oldest first
  bool held_ = false;
  std::thread::id holder_;  // the thread that holds it (none while handed over)
};

// One sqlite3 handle and its prepared-statement cache. Used by one thread at a time.
struct Connection {
  // A cached statement and its SQL text, which the cache's key views (a node-stable heap
  // string): a lookup hashes the caller's text without copying it.
  struct Cached {
    std::unique_ptr<const std::string> sql;
    sqlite3_stmt* stmt = nullptr;
  };
  sqlite3* db = nullptr;
  std::unordered_map<std::string_view, Cached> cache;
  // BEGIN IMMEDIATE, COMMIT and ROLLBACK, prepared once (sqlite3_exec parses its SQL again on
  // every call: ~9,000 instructions each, twice per transaction).
  sqlite3_stmt* begin = nullptr;
  sqlite3_stmt* commit = nullptr;
  sqlite3_stmt* rollback = nullptr;
  // A Transaction's BEGIN IMMEDIATE ran and it has not committed or rolled back. SQLite may end
  // the transaction by itself (a statement's ON CONFLICT ROLLBACK, SQLITE_FULL, an I/O error):
  // statements after that would each commit on their own (see Session::prepare).
  bool in_transaction = false;

  ~Connection() {
    for (auto& [sql, cached] : cache) sqlite3_finalize(cached.stmt);
    for (sqlite3_stmt* stmt : {begin, commit, rollback}) sqlite3_finalize(stmt);
    if (db != nullptr) sqlite3_close_v2(db);
  }

  // Runs one of the transaction statements above (prepared on first use). @return the result
  // code of the step, SQLITE_OK for success; the statement is reset either way.
  int control(sqlite3_stmt*& stmt, const char* sql) noexcept {
    if (stmt == nullptr) {
      int rc = sqlite3_prepare_v3(db, sql, -1, SQLITE_PREPARE_PERSISTENT, &stmt, nullptr);
      if (rc != SQLITE_OK) {
        sqlite3_finalize(stmt);
        stmt = nullptr;
        return rc;
      }
    }
    int rc = sqlite3_step(stmt);
    sqlite3_reset(stmt);
    return rc == SQLITE_DONE ? SQLITE_OK : rc;
  }
};

std::unique_ptr<Connection> open_connection(const std::string& path, const DatabaseOptions& o) {
  auto conn = std::make_unique<Connection>();
  int flags = (o.read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE) |
              SQLITE_OPEN_NOMUTEX;
  int rc = sqlite3_open_v2(path.c_str(), &conn->db, flags, nullptr);
  if (rc != SQLITE_OK) {
    // open_v2 leaves a handle to report the error with, even on failure.
    std::string msg = conn->db ? sqlite3_errmsg(conn->db) : sqlite3_errstr(rc);
    // Say why when the file system says (SQLite says only "unable to open database file").
    // A missing directory stays StorageUnavailable (a volume may be mounted later); a path that
    // is a directory, or a new file in a directory this process may not write, is a
    // configuration error that no retry mends: StorageError.
    const auto slash = path.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      msg += ": its directory '" + dir + "' does not exist";
    } else if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      throw StorageError("sqlite: cannot open '" + path + "': " + msg + ": it is a directory");
    } else if (!o.read_only && ::stat(path.c_str(), &st) != 0 && ::access(dir.c_str(), W_OK) != 0) {
      throw StorageError("sqlite: cannot open '" + path + "': " + msg + ": its directory '" + dir +
                         "' is not writable by this process (the file, its -wal and -shm "
                         "are created there)");
    }
    throw StorageUnavailable("sqlite: cannot open '" + path + "': " + msg);
  }
  sqlite3_extended_result_codes(conn->db, 1);
  sqlite3_busy_timeout(conn->db, static_cast<int>(o.busy_timeout.count()));
  std::string pragmas =
      std::string(o.read_only ? "" : "PRAGMA journal_mode=WAL; ") +
      "PRAGMA synchronous=" + o.synchronous +
      "; PRAGMA foreign_keys=ON; PRAGMA mmap_size=" + std::to_string(o.mmap_size) +
      "; PRAGMA journal_size_limit=" + std::to_string(o.journal_size_limit) + ";";
  if (o.cache_size_kib > 0) {
    pragmas += " PRAGMA cache_size=-" + std::to_string(o.cache_size_kib) + ";";
  }
  // Switching a new file to WAL takes an exclusive lock for a moment, and SQLite answers
  // SQLITE_BUSY at once there, without its busy handler: processes opening one new file
  // together would fail at start. Try again (the pragmas are idempotent) until busy_timeout.
  char* err = nullptr;
  const auto deadline = std::chrono::steady_clock::now() + o.busy_timeout;
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    rc = sqlite3_exec(conn->db, pragmas.c_str(), nullptr, nullptr, &err);
    if ((rc & 0xff) != SQLITE_BUSY || std::chrono::steady_clock::now() + pause > deadline) break;
    sqlite3_free(err);
    err = nullptr;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  if (rc != SQLITE_OK) {
    std::string msg = err ? err : "";
    sqlite3_free(err);
    throw_error(conn->db, rc, "opening '" + path + "': setting pragmas (" + msg + ")");
  }
  return conn;
}

}  // namespace detail

using detail::Connection;

// ---------------------------------------------------------------------------------------------
// Statement

Statement::Statement(Statement&& other) noexcept
    : db_(other.db_), stmt_(other.stmt_), cached_(other.cached_), borrow_(other.borrow_) {
  other.stmt_ = nullptr;
}

Statement::~Statement() {
  if (stmt_ == nullptr) return;
  if (cached_) {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  } else {
    sqlite3_finalize(stmt_);
  }
}

Statement& Statement::bind(int index, std::int64_t value) {
  int rc = sqlite3_bind_int64(stmt_, index, value);
  if (rc != SQLITE_OK) detail::throw_error(db_, rc, "bind");
  return *this;
}
Statement& Statement::bind(int index, double value) {
  int rc = sqlite3_bind_double(stmt_, index, value);
  if (rc != SQLITE_OK) detail::throw_error(db_, rc, "bind");
  return *this;
}
Statement& Statement::bind(int index, std::string_view text) {
  // A non-null pointer keeps an empty string from binding as NULL.
  int rc = sqlite3_bind_text64(stmt_, index, text.empty() ? "" : text.data(), text.size(),
                               borrow_ ? SQLITE_STATIC : SQLITE_TRANSIENT, SQLITE_UTF8);
  if (rc != SQLITE_OK) detail::throw_error(db_, rc, "bind");
  return *this;
}
Statement& Statement::bind(int index, Blob blob) {
  int rc = sqlite3_bind_blob64(stmt_, index, blob.bytes.empty() ? "" : blob.bytes.data(),
                               blob.bytes.size(), borrow_ ? SQLITE_STATIC : SQLITE_TRANSIENT);
  if (rc != SQLITE_OK) detail::throw_error(db_, rc, "bind");
  return *this;
}
Statement& Statement::bind(int index, std::nullptr_t) {
  int rc = sqlite3_bind_null(stmt_, index);
  if (rc != SQLITE_OK) detail::throw_error(db_, rc, "bind");
  return *this;
}

bool Statement::step() {
  int rc = sqlite3_step(stmt_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  detail::throw_error(db_, rc, sqlite3_sql(stmt_));
}

int Statement::changes() const noexcept { return sqlite3_changes(db_); }
bool Statement::column_is_null(int col) const noexcept {
  return sqlite3_column_type(stmt_, col) == SQLITE_NULL;
}
bool Statement::column_is_integer(int col) const noexcept {
  return sqlite3_column_type(stmt_, col) == SQLITE_INTEGER;
}
bool Statement::column_is_blob(int col) const noexcept {
  return sqlite3_column_type(stmt_, col) == SQLITE_BLOB;
}
std::int64_t Statement::column_int64(int col) const noexcept {
  return sqlite3_column_int64(stmt_, col);
}
double Statement::column_double(int col) const noexcept {
  return sqlite3_column_double(stmt_, col);
}
std::string Statement::column_bytes(int col) const {
  const void* data = sqlite3_column_blob(stmt_, col);
  int size = sqlite3_column_bytes(stmt_, col);
  if (data == nullptr || size <= 0) return {};
  return std::string(static_cast<const char*>(data), static_cast<std::size_t>(size));
}

std::string_view Statement::column_view(int col) const noexcept {
  const void* data = sqlite3_column_blob(stmt_, col);
  int size = sqlite3_column_bytes(stmt_, col);
  if (data == nullptr || size <= 0) return {};
  return std::string_view(static_cast<const char*>(data), static_cast<std::size_t>(size));
}

Statement::Column Statement::column(int col) const noexcept {
  // The value object of a result column is "unprotected" (no mutex held while it is read):
  // every connection here is opened SQLITE_OPEN_NOMUTEX and used by one thread at a time, so
  // the column_* functions hold none either.
  sqlite3_value* v = sqlite3_column_value(stmt_, col);
  Column c;
  const int type = sqlite3_value_type(v);
  switch (type) {
    case SQLITE_INTEGER:
      c.type = Type::kInteger;
      c.integer = sqlite3_value_int64(v);
      break;
    case SQLITE_FLOAT:
      c.type = Type::kFloat;
      break;
    case SQLITE_TEXT:
    case SQLITE_BLOB: {
      c.type = type == SQLITE_TEXT ? Type::kText : Type::kBlob;
      const void* data = sqlite3_value_blob(v);
      const int size = sqlite3_value_bytes(v);
      if (data != nullptr && size > 0) {
        c.bytes = std::string_view(static_cast<const char*>(data), static_cast<std::size_t>(size));
      }
      break;
    }
    default:
      break;
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// Session / Transaction

// A transaction SQLite rolled back by itself under a handler that caught the error: every
// later statement would commit on its own (the handler's, and idem's record as completed: a
// replayed answer with no effect behind it). Refused instead, as PostgreSQL refuses statements
// in an aborted transaction: nothing of the transaction is kept, and a retry runs it again.
namespace {
[[noreturn]] void throw_transaction_ended() {
  throw StorageUnavailable(
      "sqlite: the transaction was rolled back by SQLite during the handler (a statement's "
      "ON CONFLICT ROLLBACK, a full disk, an I/O error; the handler caught the error): nothing "
      "of it was kept, and its later statements are refused; retry");
}
}  // namespace

Statement Session::prepare(std::string_view sql) {
  auto* conn = static_cast<Connection*>(conn_);
  if (conn->in_transaction && sqlite3_get_autocommit(conn->db) != 0) throw_transaction_ended();
  auto it = conn->cache.find(sql);
  if (it != conn->cache.end()) return Statement(conn->db, it->second.stmt, true);
  auto text = std::make_unique<const std::string>(sql);
  sqlite3_stmt* stmt = nullptr;
  int rc = sqlite3_prepare_v3(conn->db, text->c_str(), static_cast<int>(text->size()),
                              SQLITE_PREPARE_PERSISTENT, &stmt, nullptr);
  if (rc != SQLITE_OK) detail::throw_error(conn->db, rc, "prepare: " + *text);
  if (stmt == nullptr) throw UsageError("idem::sqlite: empty statement: '" + *text + "'");
  // Bounded cache: user SQL built per call (it should not be) cannot grow it without limit.
  if (conn->cache.size() >= 256) return Statement(conn->db, stmt, false);
  const std::string_view key = *text;
  conn->cache.emplace(key, Connection::Cached{std::move(text), stmt});
  return Statement(conn->db, stmt, true);
}

void Session::exec_script(const std::string& sql) {
  auto* conn = static_cast<Connection*>(conn_);
  if (conn->in_transaction && sqlite3_get_autocommit(conn->db) != 0) throw_transaction_ended();
  char* err = nullptr;
  int rc = sqlite3_exec(conn->db, sql.c_str(), nullptr, nullptr, &err);
  if (rc != SQLITE_OK) {
    std::string msg = err ? err : "";
    sqlite3_free(err);
    detail::throw_error(conn->db, rc, "exec: " + msg);
  }
}

sqlite3* Session::native_handle() const noexcept { return static_cast<Connection*>(conn_)->db; }

struct IDEM_LOCAL Transaction::Lease {
  detail::WriterLock* writer = nullptr;  // held while `open`
  Connection* conn = nullptr;
  bool open = false;

  void unlock_writer() noexcept {
    if (writer != nullptr) {
      writer->unlock();
      writer = nullptr;
    }
  }
  ~Lease() { unlock_writer(); }
};

Transaction::Transaction(std::unique_ptr<Lease> lease)
    : Session(lease->conn), lease_(std::move(lease)) {}

Transaction::Transaction(Transaction&& other) noexcept
    : Session(other.conn_), lease_(std::move(other.lease_)) {}

Transaction::~Transaction() { rollback(); }

void Transaction::commit() {
  if (!lease_ || !lease_->open) throw UsageError("idem::sqlite: commit without a transaction");
  auto* conn = lease_->conn;
  if (sqlite3_get_autocommit(conn->db) != 0) {
    rollback();
    throw_transaction_ended();
  }
  int rc = conn->control(conn->commit, "COMMIT");
  if (rc != SQLITE_OK) {
    try {
      detail::throw_error(conn->db, rc, "COMMIT");  // its message, before ROLLBACK's replaces it
    } catch (...) {
      rollback();
      throw;
    }
  }
  lease_->open = false;
  conn->in_transaction = false;
  lease_->unlock_writer();
}

void Transaction::rollback() noexcept {
  if (!lease_ || !lease_->open) return;
  // Reset cached statements first: an unfinished SELECT would keep ROLLBACK from completing.
  for (auto& [sql, cached] : lease_->conn->cache) sqlite3_reset(cached.stmt);
  if (sqlite3_get_autocommit(lease_->conn->db) == 0) {  // not ended by SQLite already
    lease_->conn->control(lease_->conn->rollback, "ROLLBACK");
  }
  lease_->open = false;
  lease_->conn->in_transaction = false;
  lease_->unlock_writer();
}

// ---------------------------------------------------------------------------------------------
// Database

class IDEM_LOCAL Database::Impl {
 public:
  Impl(std::string path, DatabaseOptions options) : path_(std::move(path)), options_(options) {
    if (options_.pool_size == 0) options_.pool_size = 8;
    // Every reader is opened now, each a file descriptor and a page cache: a size no machine
    // runs opened descriptors until it ran out, then blamed the file.
    constexpr std::size_t kMaxPoolSize = 1024;
    if (options_.pool_size > kMaxPoolSize) {
      throw UsageError("idem::sqlite: DatabaseOptions::pool_size " +
                       std::to_string(options_.pool_size) + " is above " +
                       std::to_string(kMaxPoolSize) + " (each reader is opened at once)");
    }
    if (options_.busy_timeout.count() <= 0) options_.busy_timeout = std::chrono::seconds(10);
    if (options_.synchronous != "NORMAL" && options_.synchronous != "FULL" &&
        options_.synchronous != "OFF" && options_.synchronous != "EXTRA") {
      throw UsageError("idem::sqlite: DatabaseOptions::synchronous must be OFF, NORMAL, FULL "
                       "or EXTRA");
    }
    if (options_.mmap_size < 0 || options_.cache_size_kib < 0) {
      throw UsageError("idem::sqlite: DatabaseOptions::mmap_size and cache_size_kib must not "
                       "be negative");
    }
    if (options_.journal_size_limit < -1) {
      throw UsageError(
          "idem::sqlite: DatabaseOptions::journal_size_limit must be -1 (no limit) "
          "or a size in bytes");
    }
    // SQLite opens "" as a private temporary file, gone at close: an unset setting would lose
    // every record at a restart without a word.
    if (path_.empty()) {
      throw UsageError(
          "idem::sqlite: the database path is empty (a file path, or \":memory:\" for a "
          "database that lives only as long as this Database)");
    }
    memory_ = path_ == ":memory:";
    writer_ = detail::open_connection(path_, options_);
    if (!memory_) {
      for (std::size_t i = 0; i < options_.pool_size; ++i) {
        readers_.push_back(detail::open_connection(path_, options_));
        free_.push_back(readers_.back().get());
      }
    }
  }

  std::unique_ptr<Transaction::Lease> begin_write() {
    auto lease = std::make_unique<Transaction::Lease>();
    if (!writer_mutex_.try_lock_for(options_.busy_timeout)) {
      throw StorageTimeout("sqlite: no write lock on '" + path_ + "' within " +
                           std::to_string(options_.busy_timeout.count()) + " ms");
    }
    lease->writer = &writer_mutex_;
    lease->conn = writer_.get();
    int rc = writer_->control(writer_->begin, "BEGIN IMMEDIATE");
    if (rc != SQLITE_OK) detail::throw_error(writer_->db, rc, "BEGIN IMMEDIATE");
    lease->open = true;
    writer_->in_transaction = true;
    check_not_moved(*lease);
    return lease;
  }

  // A database file deleted or replaced under an open connection still takes its commits, into
  // a file no other process opens again (a new process would start from an empty or another
  // file, and run every key again): at most once a second (one stat of the path), a write
  // transaction asks SQLite whether the file has moved, and refuses to go on if so.
  void check_not_moved(Transaction::Lease& lease) {
    if (memory_) return;
    // Once moved, every later write is refused (the file does not come back under this
    // connection), not one a second.
    if (!moved_) {
      const auto now = std::chrono::steady_clock::now();
      if (now - moved_checked_ < std::chrono::seconds(1)) return;
      moved_checked_ = now;
      int moved = 0;
      if (sqlite3_file_control(writer_->db, "main", SQLITE_FCNTL_HAS_MOVED, &moved) != SQLITE_OK ||
          moved == 0) {
        return;
      }
      moved_ = true;
    }
    writer_->control(writer_->rollback, "ROLLBACK");
    writer_->in_transaction = false;
    lease.open = false;
    throw StorageError("sqlite: the database file '" + path_ +
                       "' was deleted or replaced while this process had it open: its writes "
                       "would be lost to every other process; restart to open the file again");
  }

  Connection* acquire_reader(bool short_read) {
    // The writer's connection when it is idle: its page cache survives this process's commits
    // (a pooled connection drops its whole cache at its first read after another connection's
    // commit, SQLite's WAL rule).
    if (short_read && !memory_ && writer_mutex_.try_lock()) return writer_.get();
    if (memory_) {
      // One connection: readers share the writer's lock, and wait for it as long as a writer.
      if (!writer_mutex_.try_lock_for(options_.busy_timeout)) {
        throw StorageTimeout("sqlite: no lock on '" + path_ + "' for a read within " +
                             std::to_string(options_.busy_timeout.count()) + " ms");
      }
      return writer_.get();
    }
    std::unique_lock<std::mutex> lock(pool_mutex_);
    if (!pool_cv_.wait_for(lock, options_.busy_timeout, [&] { return !free_.empty(); })) {
      throw StorageUnavailable("sqlite: connection pool of '" + path_ + "' exhausted for " +
                               std::to_string(options_.busy_timeout.count()) + " ms");
    }
    Connection* c = free_.back();
    free_.pop_back();
    return c;
  }

  void release_reader(Connection* c) noexcept {
    // A statement left stepping would keep the connection's read snapshot open (sqlite3_reset
    // takes the connection's mutex: only the busy ones).
    for (auto& [sql, cached] : c->cache) {
      if (sqlite3_stmt_busy(cached.stmt) != 0) sqlite3_reset(cached.stmt);
    }
    if (memory_ || c == writer_.get()) {
      writer_mutex_.unlock();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(pool_mutex_);
      free_.push_back(c);
    }
    pool_cv_.notify_one();
  }

  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
  DatabaseOptions options_;
  bool memory_ = false;
  detail::WriterLock writer_mutex_;
  std::unique_ptr<Connection> writer_;
  std::chrono::steady_clock::time_point moved_checked_{};  // under writer_mutex_
  bool moved_ = false;  // under writer_mutex_: the file was found deleted or replaced, for good
  std::mutex pool_mutex_;
  std::condition_variable pool_cv_;
  std::vector<std::unique_ptr<Connection>> readers_;
  std::vector<Connection*> free_;
};

Database::Database(std::string path, DatabaseOptions options)
    : impl_(std::make_unique<Impl>(std::move(path), std::move(options))) {}
Database::~Database() = default;

Transaction Database::begin() { return Transaction(impl_->begin_write()); }

Database::ReadLease Database::acquire_reader(bool short_read) {
  return ReadLease(impl_.get(), impl_->acquire_reader(short_read));
}

Database::ReadLease::~ReadLease() {
  if (impl_ != nullptr) impl_->release_reader(static_cast<Connection*>(conn_));
}

const std::string& Database::path() const noexcept { return impl_->path(); }

// ---------------------------------------------------------------------------------------------
// SqliteStore

// The store's statements, built once from the validated table and column names.
struct IDEM_LOCAL SqliteStore::Sql {
  std::string select, select_precheck, select_found, insert, insert_completed,
      insert_completed_if_absent, takeover, takeover_completed, remove_expired, complete, fail,
      release, extend, purge, purge_expired_where, purge_older_where;
  // The table's layout: 1 (a rowid table with a unique index on (key, scope), fingerprints as
  // text; tables created before schema 2 and tables adopted by name), 2 (WITHOUT ROWID keyed
  // by (key, scope), idem fingerprints as 32 raw bytes, status as text, an expiry index) or 3
  // (layout 2 with the status as an integer and no expiry index: the purge walks the key).
  int layout = 3;
};

namespace {
// Schema versions of the record table: 1, 2 and 3 (layouts of the same numbers; 3 is created
// since). A table of an older version is used as it is: idem never rebuilds a table by itself.
constexpr int kSchemaVersion = 3;
// The status check of version-3 tables: the status as an integer (0 in progress, 1 completed, 2
// failed); SQLite stores 0 and 1 in the record header alone (no payload byte) and reads them
// without copying a text. Not `status IN (0, 1, 2)`: SQLite (3.40) evaluates an IN list in a
// CHECK by building an ephemeral b-tree of the list on every INSERT and every UPDATE that sets
// status, ~40,000 instructions, several times the cost of the row write itself. Three
// comparisons accept exactly the same values (version 2 checks its three texts the same way).
constexpr const char* kStatusCheck = "status = 0 OR status = 1 OR status = 2";

// How the statements of `layout` spell `status` in SQL.
std::string status_sql(int layout, Record::Status status) {
  if (layout >= 3) {
    switch (status) {
      case Record::Status::kInProgress:
        return "0";
      case Record::Status::kCompleted:
        return "1";
      case Record::Status::kFailed:
        return "2";
    }
  }
  return "'" + std::string(record_status_name(status)) + "'";
}

// A time column of the record: an integer (milliseconds since the epoch). Anything else was not
// written by idem (SQLite would read a text value as 0, and a claim would take the key over).
TimePoint time_column(const Statement& st, int col, const char* name, const Key& key,
                      bool nullable) {
  const Statement::Column c = st.column(col);
  if (c.type == Statement::Type::kInteger) return from_millis(c.integer);
  if (nullable && c.type == Statement::Type::kNull) return TimePoint{};
  throw idem::detail::corrupt_record("sqlite", key.str(),
                                     std::string(name) + " is not an integer (milliseconds)");
}

// A TEXT or BLOB column of the record, in place (empty for NULL), from the `c` already read
// of column `col`. A number (not written by idem) is read as its text, as SQLite spells it.
std::string_view bytes_of(const Statement& st, int col, const Statement::Column& c) {
  if (c.type == Statement::Type::kInteger || c.type == Statement::Type::kFloat) {
    return st.column_view(col);
  }
  return c.bytes;
}

// Column `col` of the current row, as bytes_of reads it.
std::string_view bytes_column(const Statement& st, int col) {
  return bytes_of(st, col, st.column(col));
}

// The status column `col` of the current row, as `layout` stores it.
Record::Status status_column(const Statement& st, int col, const Key& key, int layout) {
  const Statement::Column c = st.column(col);
  if (layout < 3) return idem::detail::record_status_or_throw(bytes_of(st, col, c), "sqlite", key);
  if (c.type == Statement::Type::kInteger) {
    switch (c.integer) {
      case 0:
        return Record::Status::kInProgress;
      case 1:
        return Record::Status::kCompleted;
      case 2:
        return Record::Status::kFailed;
      default:
        break;
    }
  }
  throw idem::detail::corrupt_record(
      "sqlite", key.str(),
      "unknown status '" + std::string(st.column_view(col)).substr(0, 32) + "'");
}

// Calls `fn` with the fingerprint as a table of `layout` stores it: in layout 2, 32 raw bytes (a
// BLOB) when it packs (idem::fingerprint's form), else its text as given.
template <class Fn>
decltype(auto) with_stored_fingerprint(int layout, std::string_view fp, Fn&& fn) {
  std::array<char, idem::detail::kPackedFingerprintSize> packed;
  if (layout >= 2 && idem::detail::try_pack_fingerprint(fp, packed.data())) {
    return fn(Blob{std::string_view(packed.data(), packed.size())});
  }
  return fn(fp);
}

// A fingerprint stored packed, spelled out again as its 64 hex characters.
using HexFingerprint = std::array<char, 2 * idem::detail::kPackedFingerprintSize>;

// Column `col` of the current row: the fingerprint as stored (layout 2: a BLOB when packed),
// in its text form; a packed one is spelled out in `hex`.
std::string_view fingerprint_column(const Statement& st, int col, const Key& key, int layout,
                                    HexFingerprint& hex) {
  const Statement::Column c = st.column(col);
  if (layout < 2 || c.type != Statement::Type::kBlob) return bytes_of(st, col, c);
  const std::string_view fp = c.bytes;
  if (fp.size() != idem::detail::kPackedFingerprintSize) {
    throw idem::detail::corrupt_record("sqlite", key.str(), "a packed fingerprint is not 32 bytes");
  }
  idem::detail::unpack_fingerprint(fp.data(), hex.data());
  return std::string_view(hex.data(), hex.size());
}

// `sql` (a record read: WHERE key = ?1 AND scope = ?2) prepared on `s` with `key` bound. The
// key is bound without SQLite copying it: every caller holds the key past the statement's use.
// When a lease or retention (`what`) that starts at `t` ends, in the table's milliseconds.
// @throws UsageError for a term that is not positive or longer than kMaxTerm (its end would
// overflow).
template <class Rep, class Period>
std::int64_t ends(TimePoint t, std::chrono::duration<Rep, Period> term, std::string_view what) {
  idem::detail::check_term(term, what);
  return to_millis(t + term);
}

Statement keyed(Session& s, const std::string& sql, const Key& key) {
  Statement st = s.prepare(sql);
  st.borrow_values().bind_all(key.id(), key.scope());
  return st;
}

// `Sql::select` (lookup): every column of the record.
Record read_record(const Statement& st, const Key& key, int layout) {
  Record r;
  r.status = status_column(st, 0, key, layout);
  HexFingerprint hex;
  r.fingerprint = fingerprint_column(st, 1, key, layout, hex);
  r.owner = bytes_column(st, 2);
  r.response = bytes_column(st, 3);
  r.lease_until = time_column(st, 4, "lease_until", key, false);
  r.created_at = time_column(st, 5, "created_at", key, false);
  r.updated_at = time_column(st, 6, "updated_at", key, false);
  r.expires_at = time_column(st, 7, "expires_at", key, true);
  return r;
}

// `Sql::select_found` (every claim) and `Sql::select_precheck` (a replay's read snapshot,
// without lease_until: the precheck answers only a replay or a mismatch, which no lease
// decides): the record as the rulebook decides on it, read in place. The views point into the
// statement's column buffers (and `hex`): valid until the statement steps again or is reset.
// No allocation: a replay copies only what it answers with.
idem::detail::FoundRecord found_row(const Statement& st, const Key& key, int layout, TimePoint now,
                                    HexFingerprint& hex, bool with_lease = true) {
  const Record::Status status = status_column(st, 0, key, layout);
  idem::detail::FoundRecord f;
  f.status = status;
  f.fingerprint = fingerprint_column(st, 1, key, layout, hex);
  f.owner = bytes_column(st, 2);
  f.response = bytes_column(st, 3);
  f.created_at = time_column(st, 4, "created_at", key, false);
  const TimePoint expires_at = time_column(st, 5, "expires_at", key, true);
  if (with_lease && status == Record::Status::kInProgress) {
    f.lease_live = time_column(st, 6, "lease_until", key, false) > now;
  }
  f.expires_at = expires_at;
  f.retention_over = status != Record::Status::kInProgress && expires_at <= now;
  return f;
}
}  // namespace

namespace {
std::shared_ptr<Database> open_database(std::string path, const SqliteStoreOptions& options) {
  return std::make_shared<Database>(std::move(path), options.database);
}
}  // namespace

// Takes options by const reference first: the database is opened before the options move.
SqliteStore::SqliteStore(std::string path, SqliteStoreOptions options)
    : database_(open_database(std::move(path), options)), options_(std::move(options)) {
  init();
}

SqliteStore::SqliteStore(std::shared_ptr<Database> database, SqliteStoreOptions options)
    : database_(std::move(database)), options_(std::move(options)) {
  init();
}

void SqliteStore::init() {
  if (!database_) throw UsageError("idem::sqlite::SqliteStore: null database");
  const auto& t = check_sql_identifier("table", options_.table);
  const auto& k = check_sql_identifier("key column", options_.key_column);
  const auto& s = check_sql_identifier("scope column", options_.scope_column);
  if (k == s) throw UsageError("idem::sqlite: key and scope columns must differ");
  if (!options_.clock) options_.clock = system_now;
  sql_ = std::make_unique<Sql>();
  migrate();
  std::string where = " WHERE " + k + " = ?1 AND " + s + " = ?2";
  sql_->select = "SELECT status, fingerprint, owner, response_body, lease_until, created_at, "
                 "updated_at, expires_at FROM " + t + where;
  // found_row's columns; the claim's read adds lease_until.
  const std::string found = "status, fingerprint, owner, response_body, created_at, expires_at";
  sql_->select_precheck = "SELECT " + found + " FROM " + t + where;
  sql_->select_found = "SELECT " + found + ", lease_until FROM " + t + where;
  const int layout = sql_->layout;
  const std::string in_progress = status_sql(layout, Record::Status::kInProgress);
  const std::string completed = status_sql(layout, Record::Status::kCompleted);
  const std::string failed = status_sql(layout, Record::Status::kFailed);
  const std::string held = " AND status = " + in_progress;
  sql_->insert = "INSERT INTO " + t + " (" + k + ", " + s +
                 ", status, fingerprint, owner, lease_until, created_at, updated_at) "
                 "VALUES (?1, ?2, " +
                 in_progress + ", ?3, ?4, ?5, ?6, ?6)";
  sql_->insert_completed = "INSERT INTO " + t + " (" + k + ", " + s +
                           ", status, fingerprint, owner, response_body, lease_until, "
                           "expires_at, created_at, updated_at) "
                           "VALUES (?1, ?2, " +
                           completed + ", ?3, ?4, ?5, ?6, ?7, ?6, ?6)";
  sql_->insert_completed_if_absent =
      sql_->insert_completed + " ON CONFLICT (" + k + ", " + s + ") DO NOTHING";
  sql_->takeover_completed = "UPDATE " + t + " SET status = " + completed +
                             ", owner = ?3, response_body = ?4, lease_until = ?6, "
                             "expires_at = ?5, updated_at = ?6, attempts = attempts + 1" +
                             where + held;
  sql_->takeover = "UPDATE " + t +
                   " SET owner = ?3, lease_until = ?4, updated_at = ?5, attempts = attempts + 1" +
                   where + held;
  sql_->remove_expired = "DELETE FROM " + t + where + " AND status <> " + in_progress;
  sql_->complete = "UPDATE " + t + " SET status = " + completed +
                   ", response_body = ?4, expires_at = ?5, updated_at = ?6" + where +
                   " AND owner = ?3" + held;
  sql_->fail = "UPDATE " + t + " SET status = " + failed +
               ", response_body = ?4, expires_at = ?5, updated_at = ?6" + where +
               " AND owner = ?3" + held;
  sql_->release = "DELETE FROM " + t + where + " AND owner = ?3" + held;
  sql_->extend =
      "UPDATE " + t + " SET lease_until = ?4, updated_at = ?5" + where + " AND owner = ?3" + held;
  // The finished rows each purge deletes (`?1` its bound). A version-3 table has no expiry
  // index: its expiry purge walks the key (purge_walking_key), as the age purge does on every
  // version (none indexes updated_at).
  sql_->purge_expired_where = "status <> " + in_progress + " AND expires_at <= ?1";
  sql_->purge_older_where = "status <> " + in_progress + " AND updated_at < ?1";
  if (layout >= 3) return;
  // Rows are named by their key: every layout has a unique key on it (a table adopted by
  // name need not have an `id` column).
  const std::string cols = k + ", " + s;
  sql_->purge = "DELETE FROM " + t + " WHERE (" + cols + ") IN (SELECT " + cols + " FROM " + t +
                " WHERE status <> " + in_progress + " AND expires_at <= ?1 LIMIT ?2)";
}

SqliteStore::~SqliteStore() = default;

int SqliteStore::schema_version() const noexcept { return sql_->layout; }

std::string SqliteStore::status_literal(Record::Status status) const {
  return status_sql(sql_->layout, status);
}

namespace {
// The layout of an existing record table without a version row, read off the table itself:
// one idem made (version 2 or 3) whose version row was lost on the way (a `.dump` of the table
// alone, a copy into another file) is `WITHOUT ROWID`, has no `id` column and declares its
// fingerprint BLOB, and version 3 declares its status INTEGER; any other table is version 1
// (a table adopted by name keeps its layout). Reads only.
int layout_of_unversioned(Session& session, const std::string& table) {
  const std::string ddl =
      session.query_text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", table)
          .value_or("");
  std::string upper = ddl;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  auto declared = [&](const char* column) {
    return session
        .query_text("SELECT upper(type) FROM pragma_table_info(?1) WHERE name = ?2", table, column)
        .value_or("");
  };
  const bool has_id =
      session.query_int64("SELECT count(*) FROM pragma_table_info(?1) WHERE name = 'id'", table)
          .value_or(0) > 0;
  if (upper.find("WITHOUT ROWID") == std::string::npos || has_id ||
      declared("fingerprint") != "BLOB") {
    return 1;
  }
  return declared("status") == "INTEGER" ? 3 : 2;
}
}  // namespace

// Whether table `t` has a unique key on exactly (k, s) that compares bytes: the claims'
// conflict target, and what makes 'Abc' and 'aBC' two keys (a NOCASE or RTRIM collation on
// the columns, or on the index, would make one replay the other's answer).
bool keys_compare_bytes(Session& session, const std::string& t, const std::string& k,
                        const std::string& s) {
  return session
             .query_int64(
                 "SELECT count(*) FROM pragma_index_list(?1) l WHERE l.\"unique\" = 1 AND "
                 "l.partial = 0"
                 " AND (SELECT count(*) FROM pragma_index_xinfo(l.name) x WHERE x.key = 1) = 2"
                 " AND (SELECT count(*) FROM pragma_index_xinfo(l.name) x WHERE x.key = 1"
                 " AND x.name IN (?2, ?3) AND x.coll = 'BINARY') = 2",
                 t, k, s)
             .value_or(0) > 0;
}

// What idem needs of a table it adopts by name (version 1 without a version row): the
// columns its statements name, key columns that keep text as text (an INTEGER or NUMERIC
// column turns '007' and '7.0' into 7: one record for three keys), and a unique index on
// exactly (k, s) that compares bytes (the claims' conflict target; NOCASE or RTRIM would make
// 'Abc' replay 'aBC''s answer), and no NOT NULL column without a default that idem does not
// write (every claim would fail). @throws UsageError naming what is wrong.
void check_adoptable(Session& session, const std::string& t, const std::string& k,
                     const std::string& s) {
  auto refuse = [&](const std::string& why) {
    throw UsageError("idem::sqlite: cannot use the existing table '" + t + "': " + why +
                     " (docs/versioning.md)");
  };
  std::vector<std::string> columns{k, s};
  for (std::string_view c : idem::detail::kRecordColumnNames) columns.emplace_back(c);
  for (const std::string& column : columns) {
    const auto type = session.query_text(
        "SELECT upper(type) FROM pragma_table_info(?1) WHERE name = ?2", t, column);
    if (!type) refuse("it has no column '" + column + "'");
    if ((column == k || column == s) &&
        (type->find("INT") != std::string::npos ||
         (type->find("CHAR") == std::string::npos && type->find("CLOB") == std::string::npos &&
          type->find("TEXT") == std::string::npos && type->find("BLOB") == std::string::npos &&
          !type->empty()))) {
      refuse("its key column '" + column + "' is declared " + *type +
             ", which turns some keys into numbers; declare it TEXT");
    }
  }
  std::string extra;
  {
    Statement st = session.prepare(
        "SELECT name FROM pragma_table_info(?1) WHERE \"notnull\" = 1 AND dflt_value IS NULL"
        " AND pk = 0");
    st.bind(1, t);
    while (st.step()) {
      const std::string name = st.column_bytes(0);
      if (!idem::detail::is_record_column(name, k, s)) extra += (extra.empty() ? "" : ", ") + name;
    }
  }
  if (!extra.empty()) {
    refuse("it has NOT NULL columns without a default that idem does not write (" + extra +
           "): give them a default or let them be NULL");
  }
  if (!keys_compare_bytes(session, t, k, s)) {
    refuse("it needs a unique key on exactly (" + k + ", " + s +
           ") that compares bytes (no NOCASE or RTRIM collation)");
  }
}

void SqliteStore::migrate() {
  const auto& t = options_.table;
  const auto& k = options_.key_column;
  const auto& s = options_.scope_column;
  auto check_newer = [&](std::int64_t version) {
    if (version > kSchemaVersion) {
      throw StorageError("sqlite: table '" + t + "' has schema version " + std::to_string(version) +
                         ", newer than this idem (" + std::to_string(kSchemaVersion) + ")");
    }
  };
  // A version row of a layout idem made (2, 3) must match the table: one that does not (a
  // hand-edited row, a table replaced under it) would have every write stored in a form its
  // reads then refuse as corrupt, after the first caller was answered.
  auto check_layout = [&](Session& session, std::int64_t version) {
    // A table remade by hand under its version row (a DBA's DDL with COLLATE NOCASE keys)
    // keeps the row's promise only if its keys still compare bytes.
    if (version > 0 && !keys_compare_bytes(session, t, k, s) &&
        session.query_int64("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
                            t)
                .value_or(0) > 0) {
      throw UsageError("idem::sqlite: table '" + t + "' has no unique key on exactly (" + k + ", " +
                       s +
                       ") that compares bytes (a NOCASE or RTRIM collation makes keys differing "
                       "in case or trailing spaces one record): declare the key columns without "
                       "a collation (docs/versioning.md)");
    }
    if (version < 2) return;
    const int seen = layout_of_unversioned(session, t);
    if (seen != version) {
      throw StorageError("sqlite: table '" + t + "' has schema version " + std::to_string(version) +
                         " in idem_schema_version, but its layout is " + "version " +
                         std::to_string(seen) +
                         "'s: correct the version row or the table (docs/versioning.md)");
    }
  };
  if (!options_.migrate) {
    // Reads only (no write lock, nothing created): the version row, or the table itself.
    sql_->layout = database_->read([&](Session& session) {
      const bool has_versions =
          session
              .query_int64(
                  "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = "
                  "'idem_schema_version'")
              .value_or(0) > 0;
      std::int64_t version =
          has_versions
              ? session.query_int64("SELECT version FROM idem_schema_version WHERE name = ?", t)
                    .value_or(0)
              : 0;
      check_newer(version);
      check_layout(session, version);
      if (version == 0) {
        if (session
                .query_int64("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND "
                             "name = ?",
                             t)
                .value_or(0) == 0) {
          throw StorageError("sqlite: " + database_->path() + " has no table '" + t +
                             "' (SqliteStoreOptions::migrate is false: nothing is created)");
        }
        version = layout_of_unversioned(session, t);
        if (version == 1) check_adoptable(session, t, options_.key_column, options_.scope_column);
      }
      return static_cast<int>(version);
    });
    return;
  }
  database_->write([&](Transaction& tx) {
    tx.exec_script(
        "CREATE TABLE IF NOT EXISTS idem_schema_version ("
        " name TEXT PRIMARY KEY, version INTEGER NOT NULL, applied_at INTEGER NOT NULL)");
    auto version = tx.query_int64("SELECT version FROM idem_schema_version WHERE name = ?", t)
                       .value_or(0);
    check_newer(version);
    check_layout(tx, version);
    if (version == 0) {
      const bool exists =
          tx.query_int64("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
                         t)
              .value_or(0) > 0;
      if (exists) {
        // A table idem made whose version row is gone is recognised by its layout; any other
        // (adopted by name, e.g. the seed's api_idempotency) keeps its own: version 1.
        version = layout_of_unversioned(tx, t);
        if (version == 1) check_adoptable(tx, t, k, s);
        if (version < 3) {  // versions 1 and 2 purge through the expiry index
          tx.exec_script("CREATE INDEX IF NOT EXISTS " + t + "_expires_idx ON " + t +
                         " (expires_at) WHERE status <> " +
                         status_sql(static_cast<int>(version), Record::Status::kInProgress) + ";");
        }
      } else {
        // clang-format off
        tx.exec_script("CREATE TABLE " + t + " (" +
                       " " + k + " VARCHAR(128) NOT NULL," +
                       " " + s + " VARCHAR(64) NOT NULL," +
                       " status INTEGER NOT NULL CHECK (" + kStatusCheck + "),"
                       " fingerprint BLOB NOT NULL DEFAULT '',"
                       " owner VARCHAR(32) NOT NULL,"
                       " response_body BLOB,"
                       " lease_until INTEGER NOT NULL,"
                       " expires_at INTEGER,"
                       " attempts INTEGER NOT NULL DEFAULT 1,"
                       " created_at INTEGER NOT NULL,"
                       " updated_at INTEGER NOT NULL,"
                       " PRIMARY KEY (" + k + ", " + s + ")) WITHOUT ROWID");
        // clang-format on
        version = 3;
      }
      tx.exec("INSERT OR REPLACE INTO idem_schema_version (name, version, applied_at) "
              "VALUES (?, ?, ?)",
              t, version, to_millis(now()));
    }
    sql_->layout = static_cast<int>(version);
  });
}

std::optional<ClaimResult> SqliteStore::precheck(const Key& key, std::string_view fingerprint) {
  auto t = now();
  return database_->read_short([&](Session& session) -> std::optional<ClaimResult> {
    Statement st = keyed(session, sql_->select_precheck, key);
    if (!st.step()) return std::nullopt;
    HexFingerprint hex;
    // Only the answers that need no write lock: a replay or a mismatch.
    return idem::detail::decide_without_claim(found_row(st, key, sql_->layout, t, hex, false),
                                              fingerprint);
  });
}

ClaimResult SqliteStore::claim_in(Transaction& tx, const Key& key, std::string_view fingerprint,
                                  const OwnerToken& owner, std::chrono::milliseconds lease) {
  ClaimResult c = find_in(tx, key, fingerprint, owner);
  if (c.status != ClaimStatus::kClaimed || c.kept) return c;
  auto t = now();
  auto lease_until = ends(t, lease, "idem::sqlite: the lease");
  if (!c.took_over) {  // absent (or its retention had ended): a new in-progress record
    with_stored_fingerprint(sql_->layout, fingerprint, [&](const auto& fp) {
      return tx.exec(sql_->insert, key.id(), key.scope(), fp, owner.str(), lease_until,
                     to_millis(t));
    });
    return c;
  }
  tx.exec(sql_->takeover, key.id(), key.scope(), owner.str(), lease_until, to_millis(t));
  return c;
}

ClaimResult SqliteStore::find_in(Transaction& tx, const Key& key, std::string_view fingerprint,
                                 const OwnerToken& owner) {
  auto t = now();
  idem::detail::ClaimDecision d;
  {
    Statement st = keyed(tx, sql_->select_found, key);
    if (!st.step()) return ClaimResult{};
    HexFingerprint hex;
    d = idem::detail::decide_claim(found_row(st, key, sql_->layout, t, hex), fingerprint,
                                   owner.str());
  }  // the statement is reset: the views it lent are gone, only `d` is read below
  if (d.action == idem::detail::ClaimAction::kReplace) {
    tx.exec(sql_->remove_expired, key.id(), key.scope());
    return ClaimResult{};
  }
  return std::move(d.result);
}

void SqliteStore::insert_completed_in(Transaction& tx, const Key& key,
                                      std::string_view fingerprint, const OwnerToken& owner,
                                      std::string_view response, std::chrono::seconds retention,
                                      bool took_over) {
  auto t = now();
  if (!took_over) {
    with_stored_fingerprint(sql_->layout, fingerprint, [&](const auto& fp) {
      return tx.exec(sql_->insert_completed, key.id(), key.scope(), fp, owner.str(), Blob{response},
                     to_millis(t), ends(t, retention, "idem::sqlite: the retention"));
    });
    return;
  }
  int n = tx.exec(sql_->takeover_completed, key.id(), key.scope(), owner.str(), Blob{response},
                  ends(t, retention, "idem::sqlite: the retention"), to_millis(t));
  if (n != 1) {
    throw LeaseLost("sqlite: record '" + key.str() + "' changed before it could be completed");
  }
}

std::vector<bool> SqliteStore::insert_completed_batch_in(Transaction& tx,
                                                         const std::vector<ClaimRequest>& requests,
                                                         std::string_view response,
                                                         std::chrono::seconds retention) {
  auto t = now();
  std::vector<bool> out(requests.size(), false);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const ClaimRequest& r = requests[i];
    if (r.key == nullptr || r.owner == nullptr) {
      throw UsageError("idem::sqlite: insert_completed_batch_in needs a key and an owner");
    }
    out[i] = with_stored_fingerprint(sql_->layout, r.fingerprint, [&](const auto& fp) {
               return tx.exec(sql_->insert_completed_if_absent, r.key->id(), r.key->scope(), fp,
                              r.owner->str(), Blob{response}, to_millis(t),
                              ends(t, retention, "idem::sqlite: the retention"));
             }) == 1;
  }
  return out;
}

void SqliteStore::complete_in(Transaction& tx, const Key& key, const OwnerToken& owner,
                              std::string_view response, std::chrono::seconds retention) {
  auto t = now();
  int n = tx.exec(sql_->complete, key.id(), key.scope(), owner.str(), Blob{response},
                  ends(t, retention, "idem::sqlite: the retention"), to_millis(t));
  if (n != 1) {
    throw LeaseLost("sqlite: record '" + key.str() + "' is no longer held by this attempt");
  }
}

ClaimResult SqliteStore::begin(const Key& key, std::string_view fingerprint,
                               const OwnerToken& owner, std::chrono::milliseconds lease,
                               DurableHint hint) {
  idem::detail::check_term(lease, "idem::sqlite: the lease");
  if (!hint.expects_absent()) {
    if (auto early = precheck(key, fingerprint)) return std::move(*early);
  }
  return database_->write(
      [&](Transaction& tx) { return claim_in(tx, key, fingerprint, owner, lease); });
}

bool SqliteStore::complete(const Key& key, const OwnerToken& owner, std::string_view response,
                           std::chrono::seconds retention) {
  auto t = now();
  return database_->write([&](Transaction& tx) {
    return tx.exec(sql_->complete, key.id(), key.scope(), owner.str(), Blob{response},
                   ends(t, retention, "idem::sqlite: the retention"), to_millis(t)) == 1;
  });
}

bool SqliteStore::fail(const Key& key, const OwnerToken& owner, std::string_view reason,
                       std::chrono::seconds retention) {
  auto t = now();
  return database_->write([&](Transaction& tx) {
    return tx.exec(sql_->fail, key.id(), key.scope(), owner.str(), Blob{reason},
                   ends(t, retention, "idem::sqlite: the retention"), to_millis(t)) == 1;
  });
}

bool SqliteStore::release(const Key& key, const OwnerToken& owner) {
  return database_->write([&](Transaction& tx) {
    return tx.exec(sql_->release, key.id(), key.scope(), owner.str()) == 1;
  });
}

bool SqliteStore::extend(const Key& key, const OwnerToken& owner,
                         std::chrono::milliseconds lease) {
  idem::detail::check_term(lease, "idem::sqlite: the lease");
  return database_->write([&](Transaction& tx) {
    auto t = now();
    return tx.exec(sql_->extend, key.id(), key.scope(), owner.str(),
                   ends(t, lease, "idem::sqlite: the lease"), to_millis(t)) == 1;
  });
}

std::optional<Record> SqliteStore::lookup(const Key& key) {
  return database_->read([&](Session& session) -> std::optional<Record> {
    Statement st = keyed(session, sql_->select, key);
    if (!st.step()) return std::nullopt;
    return read_record(st, key, sql_->layout);
  });
}

void SqliteStore::savepoint(Transaction& tx) { tx.exec("SAVEPOINT idem_batch"); }

void SqliteStore::rollback_to_savepoint(Transaction& tx) {
  tx.exec("ROLLBACK TO SAVEPOINT idem_batch");
}

void SqliteStore::release_savepoint(Transaction& tx) {
  tx.exec("RELEASE SAVEPOINT idem_batch");
}

std::size_t SqliteStore::purge_expired(std::size_t batch_size) {
  if (batch_size == 0) throw UsageError("idem::sqlite: purge batch size must be positive");
  const auto t = to_millis(now());
  if (sql_->layout >= 3) return purge_walking_key(sql_->purge_expired_where, t, batch_size);
  std::size_t total = 0;
  for (;;) {
    // One short write transaction per batch: writers are never blocked for long.
    int n = database_->write([&](Transaction& tx) {
      return tx.exec(sql_->purge, t, static_cast<std::int64_t>(batch_size));
    });
    total += static_cast<std::size_t>(n);
    if (static_cast<std::size_t>(n) < batch_size) return total;
  }
}

std::size_t SqliteStore::purge_older_than(TimePoint cutoff, std::size_t batch_size) {
  if (batch_size == 0) throw UsageError("idem::sqlite: purge batch size must be positive");
  // No table version indexes updated_at: a DELETE ... LIMIT would read from the start of the
  // table again at every batch.
  return purge_walking_key(sql_->purge_older_where, to_millis(cutoff), batch_size);
}

// Short write transactions that walk the key: each finds where the next `batch_size` rows (any
// status) end and deletes, in one range DELETE, the rows of that range that `finished` (an SQL
// condition, `?1` bound to `bound`) selects. A writer waits at most for one batch, and no batch
// reads again what an earlier one kept: one pass reads the table once. The walk is why version
// 3 needs no expiry index (it would cost every first execution a second b-tree write and a WAL
// page at commit, bench/sqlite/README.md).
std::size_t SqliteStore::purge_walking_key(const std::string& finished, std::int64_t bound,
                                           std::size_t batch_size) {
  const auto& t = options_.table;
  const std::string cols = options_.key_column + ", " + options_.scope_column;
  const std::string key = "(" + cols + ")";
  const std::string order = " ORDER BY " + cols + " LIMIT 1 OFFSET ";
  // The last key of the batch: the `batch_size`-th row after the last committed batch.
  const std::string end_first = "SELECT " + cols + " FROM " + t + order + "?1";
  const std::string end_next =
      "SELECT " + cols + " FROM " + t + " WHERE " + key + " > (?1, ?2)" + order + "?3";
  // The batch's range: up to its end (the first batch), past the last one (the last batch),
  // or both; the whole table when one batch holds it.
  const std::string remove = "DELETE FROM " + t + " WHERE " + finished;
  const std::string remove_to = remove + " AND " + key + " <= (?2, ?3)";
  const std::string remove_past = remove + " AND " + key + " > (?2, ?3)";
  const std::string remove_between = remove_past + " AND " + key + " <= (?4, ?5)";
  const auto offset = static_cast<std::int64_t>(batch_size - 1);
  std::optional<std::pair<std::string, std::string>> after;  // the end of the committed batches
  std::size_t total = 0;
  for (;;) {
    std::optional<std::pair<std::string, std::string>> end;
    // Everything the transaction sets is reset when it starts: a batch that is run again reads
    // from the last committed position.
    total += static_cast<std::size_t>(database_->write([&](Transaction& tx) {
      end.reset();
      {
        Statement st = tx.prepare(after ? end_next : end_first);
        if (after) {
          st.bind(1, after->first).bind(2, after->second).bind(3, offset);
        } else {
          st.bind(1, offset);
        }
        if (st.step()) end.emplace(st.column_bytes(0), st.column_bytes(1));
      }
      if (after && end) {
        return tx.exec(remove_between, bound, after->first, after->second, end->first, end->second);
      }
      if (after) return tx.exec(remove_past, bound, after->first, after->second);
      if (end) return tx.exec(remove_to, bound, end->first, end->second);
      return tx.exec(remove, bound);
    }));
    if (!end) return total;
    after = std::move(end);
  }
}

}  // namespace idem::sqlite
