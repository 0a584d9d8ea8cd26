// SPDX-License-Identifier: MIT
// One client connection: prepared-statement cache, numbered placeholders, binary-safe binds,
// fetches, transaction tracking.
#include "connection.hpp"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <string>

#include "errors.hpp"
#include "idem/detail/idle_socket.hpp"

namespace idem::mysql {

/// Fills Field's private members from fetched data (connection.cpp only).
struct FieldAccess {
  static void set_null(Field& f) noexcept {
    f.null_ = true;
    f.integer_ = false;
    f.bytes_.clear();
  }
  static void set_int(Field& f, std::int64_t v) {
    f.null_ = false;
    f.integer_ = true;
    f.int_ = v;
    char buf[24];
    auto r = std::to_chars(buf, buf + sizeof buf, v);
    f.bytes_.assign(buf, r.ptr);
  }
  static std::string& set_bytes(Field& f) noexcept {
    f.null_ = false;
    f.integer_ = false;
    return f.bytes_;
  }
};

std::int64_t Field::as_int64() const {
  if (null_) throw StorageError("mysql: a NULL column was read as an integer");
  if (integer_) return int_;
  std::int64_t v = 0;
  const char* end = bytes_.data() + bytes_.size();
  auto r = std::from_chars(bytes_.data(), end, v);
  if (r.ec != std::errc() || r.ptr != end) {
    throw StorageError("mysql: column value '" + bytes_.substr(0, 40) + "' is not an integer");
  }
  return v;
}

namespace detail {
namespace {

// MySQL's `?` placeholders are positional. idem's helpers also write numbered ones (`?1`,
// `?2`, ... as SQLite does), so one value can appear twice or out of order: they are
// rewritten to `?` and `arg_of` maps each position to its argument. Quotes, backquotes and
// comments are skipped, so a '?' inside a string literal is never taken for a placeholder.
struct Placeholders {
  std::string text;
  std::vector<int> arg_of;  // position -> argument index (0-based)
  std::size_t args = 0;     // arguments the statement takes
};

Placeholders rewrite_placeholders(std::string_view sql) {
  Placeholders out;
  out.text.reserve(sql.size());
  bool numbered = false, positional = false;
  std::size_t i = 0;
  const std::size_t n = sql.size();
  while (i < n) {
    const char c = sql[i];
    if (c == '\'' || c == '"' || c == '`') {
      // A quoted literal or identifier: a doubled quote stays inside; backslash escapes (not
      // in backquotes).
      std::size_t j = i + 1;
      while (j < n) {
        if (c != '`' && sql[j] == '\\' && j + 1 < n) {
          j += 2;
          continue;
        }
        if (sql[j] == c) {
          if (j + 1 < n && sql[j + 1] == c) {
            j += 2;
            continue;
          }
          break;
        }
        ++j;
      }
      j = j < n ? j + 1 : n;
      out.text.append(sql.substr(i, j - i));
      i = j;
      continue;
    }
    const bool line_comment =
        c == '#' || (c == '-' && i + 2 < n && sql[i + 1] == '-' &&
                     (sql[i + 2] == ' ' || sql[i + 2] == '\t' || sql[i + 2] == '\n'));
    if (line_comment) {
      std::size_t j = sql.find('\n', i);
      j = j == std::string_view::npos ? n : j;
      out.text.append(sql.substr(i, j - i));
      i = j;
      continue;
    }
    if (c == '/' && i + 1 < n && sql[i + 1] == '*' && !(i + 2 < n && sql[i + 2] == '!')) {
      std::size_t j = sql.find("*/", i + 2);
      j = j == std::string_view::npos ? n : j + 2;
      out.text.append(sql.substr(i, j - i));
      i = j;
      continue;
    }
    if (c == '?') {
      std::size_t j = i + 1;
      int number = 0;
      while (j < n && sql[j] >= '0' && sql[j] <= '9' && number < 100000) {
        number = number * 10 + (sql[j] - '0');
        ++j;
      }
      if (j > i + 1) {
        if (number == 0) throw UsageError("mysql: placeholder ?0 (numbered ones start at ?1)");
        numbered = true;
        out.arg_of.push_back(number - 1);
        out.args = std::max<std::size_t>(out.args, static_cast<std::size_t>(number));
      } else {
        positional = true;
        out.arg_of.push_back(static_cast<int>(out.arg_of.size()));
        out.args = out.arg_of.size();
      }
      out.text.push_back('?');
      i = j;
      continue;
    }
    out.text.push_back(c);
    ++i;
  }
  if (numbered && positional) {
    throw UsageError("mysql: a statement mixes numbered (?1) and positional (?) placeholders: '" +
                     std::string(sql.substr(0, 200)) + "'");
  }
  return out;
}

bool is_integer_type(enum_field_types t) noexcept {
  switch (t) {
    case MYSQL_TYPE_TINY:
    case MYSQL_TYPE_SHORT:
    case MYSQL_TYPE_INT24:
    case MYSQL_TYPE_LONG:
    case MYSQL_TYPE_LONGLONG:
    case MYSQL_TYPE_YEAR:
      return true;
    default:
      return false;
  }
}

const char kEmpty[] = "";

bool is_datetime_type(enum_field_types t) noexcept {
  return t == MYSQL_TYPE_DATETIME || t == MYSQL_TYPE_TIMESTAMP;
}

// A DATETIME / TIMESTAMP value as the client library prints it when it is fetched as text
// ("%04u-%02u-%02u %02u:%02u:%02u", then ".%06lu" cut to the column's 1..6 decimals), without
// its two sprintf calls per value.
void format_datetime(std::string& out, const MYSQL_TIME& t, unsigned decimals) {
  if (t.year > 9999 || t.month > 99 || t.day > 99 || t.hour > 99 || t.minute > 99 ||
      t.second > 99 || t.second_part > 999999) {
    char buf[96];
    int n = std::snprintf(buf, sizeof buf, "%04u-%02u-%02u %02u:%02u:%02u", t.year, t.month, t.day,
                          t.hour, t.minute, t.second);
    out.assign(buf, n > 0 ? static_cast<std::size_t>(n) : 0);
    if (decimals >= 1 && decimals <= 6) {
      char ms[16];
      std::snprintf(ms, sizeof ms, ".%06lu", t.second_part);
      out.append(ms, std::min<std::size_t>(std::strlen(ms), decimals + 1));
    }
    return;
  }
  char buf[26];
  auto put = [&](std::size_t at, unsigned long v, int digits) {
    for (int i = digits - 1; i >= 0; --i) {
      buf[at + static_cast<std::size_t>(i)] = static_cast<char>('0' + v % 10);
      v /= 10;
    }
  };
  put(0, t.year, 4);
  buf[4] = '-';
  put(5, t.month, 2);
  buf[7] = '-';
  put(8, t.day, 2);
  buf[10] = ' ';
  put(11, t.hour, 2);
  buf[13] = ':';
  put(14, t.minute, 2);
  buf[16] = ':';
  put(17, t.second, 2);
  std::size_t n = 19;
  if (decimals >= 1 && decimals <= 6) {
    buf[19] = '.';
    put(20, t.second_part, 6);
    n = 20 + decimals;
  }
  out.assign(buf, n);
}

}  // namespace

struct Connection::Statement {
  StatementPtr stmt;
  std::string key;  // the SQL as given (the cache key views it)
  std::list<Statement*>::iterator lru;
  std::vector<int> arg_of;
  std::size_t args = 0;
  unsigned fields = 0;
  std::vector<bool> integer;  // per result column: fetched as a 64-bit integer
  // Per result column: a DATETIME / TIMESTAMP, fetched into `times` and printed here (its
  // decimals kept in `decimals`).
  std::vector<bool> datetime;
  std::vector<unsigned> decimals;
  std::vector<MYSQL_TIME> times;
  // Result buffers, bound once: integers land in `ints`; other columns are fetched with a
  // zero-size buffer (their length only), then straight into the Field.
  std::vector<MYSQL_BIND> result;
  std::vector<std::int64_t> ints;
  std::vector<unsigned long> lengths;
  std::vector<my_bool> nulls, errors;
  bool result_bound = false;
};

Connection::Connection(const ConnectSettings& settings)
    : read_timeout_(settings.options.read_timeout) {
  const ConnectionOptions& o = settings.options;
  mysql_.reset(mysql_init(nullptr));
  if (!mysql_) throw StorageError("mysql: out of memory (mysql_init)");
  MYSQL* m = mysql_.get();
  auto seconds = [](std::chrono::seconds s) {
    return static_cast<unsigned>(s.count() > 0 ? s.count() : 1);
  };
  const unsigned connect_timeout = seconds(o.connect_timeout);
  const unsigned read_timeout = seconds(o.read_timeout);
  const unsigned write_timeout = seconds(o.write_timeout);
  mysql_optionsv(m, MYSQL_OPT_CONNECT_TIMEOUT, &connect_timeout);
  mysql_optionsv(m, MYSQL_OPT_READ_TIMEOUT, &read_timeout);
  mysql_optionsv(m, MYSQL_OPT_WRITE_TIMEOUT, &write_timeout);
  read_timeout_ = std::chrono::seconds(read_timeout);
  // Never reconnect behind idem's back: a silent reconnect would lose the open transaction.
  my_bool no = 0;
  mysql_optionsv(m, MYSQL_OPT_RECONNECT, &no);
  if (o.unix_socket.empty()) {
    // "localhost" would otherwise mean the Unix socket.
    unsigned tcp = MYSQL_PROTOCOL_TCP;
    mysql_optionsv(m, MYSQL_OPT_PROTOCOL, &tcp);
  }
  mysql_optionsv(m, MYSQL_SET_CHARSET_NAME, "utf8mb4");
  // Responses up to what the server accepts (the server's max_allowed_packet is the limit).
  unsigned long max_packet = 1024UL * 1024UL * 1024UL;
  mysql_optionsv(m, MYSQL_OPT_MAX_ALLOWED_PACKET, &max_packet);
  if (!settings.init_sql.empty()) mysql_optionsv(m, MYSQL_INIT_COMMAND, settings.init_sql.c_str());
  if (o.tls || !o.tls_ca.empty() || !o.tls_cert.empty()) {
    my_bool yes = 1;
    mysql_optionsv(m, MYSQL_OPT_SSL_ENFORCE, &yes);
  }
  if (!o.tls_cert.empty()) {
    mysql_optionsv(m, MYSQL_OPT_SSL_CERT, o.tls_cert.c_str());
    mysql_optionsv(m, MYSQL_OPT_SSL_KEY, o.tls_key.c_str());
  }
  if (!o.tls_ca.empty()) {
    // A CA given means the server is authenticated: its certificate chain and the host name
    // (the client library checks neither unless told to).
    mysql_optionsv(m, MYSQL_OPT_SSL_CA, o.tls_ca.c_str());
    my_bool verify = 1;
    mysql_optionsv(m, MYSQL_OPT_SSL_VERIFY_SERVER_CERT, &verify);
  }
  const auto started = std::chrono::steady_clock::now();
  if (mysql_real_connect(m, o.host.c_str(), o.user.c_str(), o.password.c_str(),
                         o.database.empty() ? nullptr : o.database.c_str(), o.port,
                         o.unix_socket.empty() ? nullptr : o.unix_socket.c_str(), 0) == nullptr) {
    fail_conn("connect to " + o.host + ":" + std::to_string(o.port), started);
  }
  // How a lock wait timeout ends: the statement only (the default) or the whole transaction;
  // whether the session starts in autocommit mode (a server's `autocommit = 0` or an
  // init_connect that sets it would otherwise leave every "autocommit" write of the pool
  // uncommitted, seen by no other connection); the largest packet this session accepts.
  Rows rows;
  execute("SELECT @@innodb_rollback_on_timeout, @@autocommit, @@max_allowed_packet", nullptr, 0,
          &rows, "connect");
  auto int_at = [&](std::size_t i, long long otherwise) {
    return rows.empty() || rows[0].size() <= i || rows[0][i].is_null() ? otherwise
                                                                       : rows[0][i].as_int64();
  };
  rollback_on_timeout_ = int_at(0, 0) != 0;
  autocommit_ = int_at(1, 1) != 0;
  max_allowed_packet_ = static_cast<std::uint64_t>(std::max(0LL, int_at(2, 0)));
}

Connection::~Connection() {
  // Statements are closed before the connection.
  lru_.clear();
  statements_.clear();
}

void Connection::fail(unsigned number, const char* sqlstate, const char* message,
                      std::string_view what, std::chrono::steady_clock::time_point started) {
  // Also a server that turned read-only (a failed-over primary): new connections may reach
  // the new primary, this one never will.
  constexpr unsigned kReadOnly = 1290, kReadOnlyTransaction = 1792;
  if (is_connection_failure(number) || number == kReadOnly || number == kReadOnlyTransaction) {
    broken_ = true;
  }
  if (watching_ && !ended_) {
    // Errors after which the server has rolled the whole transaction back.
    constexpr unsigned kLockTableFull = 1206;
    if (number == kDeadlock || number == kRecordChanged || number == kLockTableFull ||
        (number == kLockWaitTimeout && rollback_on_timeout_) || is_connection_failure(number)) {
      ended_ = true;
      ended_number_ = number;
    }
  }
  Context ctx;
  ctx.what = what;
  ctx.waited = std::chrono::steady_clock::now() - started;
  ctx.read_timeout = read_timeout_;
  throw_error(number, sqlstate == nullptr ? "" : sqlstate, message == nullptr ? "" : message, ctx);
}

bool Connection::closed_by_server() {
  if (broken_) return true;
  switch (idem::detail::peek_idle_socket(static_cast<int>(mysql_get_socket(mysql_.get())))) {
    case idem::detail::IdleSocket::kQuiet:
      return false;
    case idem::detail::IdleSocket::kClosed:
      return true;
    case idem::detail::IdleSocket::kUnread:
      break;
  }
  // Bytes no statement asked for: the server's last words before closing (a timeout error
  // packet), or something TLS keeps (a session ticket). A ping tells them apart.
  return mysql_ping(mysql_.get()) != 0;
}

void Connection::fail_stmt(MYSQL_STMT* stmt, std::string_view what,
                           std::chrono::steady_clock::time_point started) {
  if (mysql_stmt_errno(stmt) != 0) {
    fail(mysql_stmt_errno(stmt), mysql_stmt_sqlstate(stmt), mysql_stmt_error(stmt), what, started);
  }
  // Connector/C leaves some failures of a prepared statement on the connection, not on the
  // statement: a fetch interrupted by the server (KILL QUERY, max_statement_time: 1317, 1969).
  if (mysql_errno(mysql_.get()) != 0) fail_conn(what, started);
  // No error code anywhere: the connection's state is unknown, so it is not used again (nor
  // is its transaction), and the call may be retried on another.
  broken_ = true;
  if (watching_ && !ended_) {
    ended_ = true;
    ended_number_ = kServerLost;
  }
  throw StorageUnavailable("mysql: " + std::string(what) +
                           ": the statement failed and the client library gave no error code; "
                           "the connection is dropped");
}

void Connection::fail_conn(std::string_view what, std::chrono::steady_clock::time_point started) {
  MYSQL* m = mysql_.get();
  fail(mysql_errno(m), mysql_sqlstate(m), mysql_error(m), what, started);
}

void Connection::throw_ended() const {
  if (ended_number_ == 0) {
    throw UsageError(
        "mysql: the server committed this transaction implicitly (DDL, LOCK TABLES or another "
        "statement that ends a transaction ran inside it); nothing more runs in it");
  }
  Context ctx;
  ctx.what = "statement";
  throw_error(ended_number_, "",
              "the server rolled this transaction back (error " + std::to_string(ended_number_) +
                  " earlier in it); nothing more runs in it",
              ctx);
}

void Connection::check_watched(unsigned) {
  if (!watching_) return;
  if ((mysql_->server_status & SERVER_STATUS_IN_TRANS) != 0) {
    seen_open_ = true;
  } else if (seen_open_) {
    ended_ = true;
    ended_number_ = 0;
    // The statement may also have changed the session (SET autocommit = 1, LOCK TABLES): it
    // is not handed out again.
    broken_ = true;
    throw_ended();
  }
}

void Connection::watch_transaction() noexcept {
  watching_ = true;
  seen_open_ = (mysql_->server_status & SERVER_STATUS_IN_TRANS) != 0;
  ended_ = false;
  ended_number_ = 0;
}

void Connection::unwatch_transaction() noexcept {
  watching_ = false;
  seen_open_ = false;
  ended_ = false;
  ended_number_ = 0;
}

void Connection::close_oldest(std::size_t n) {
  for (; n > 0 && !lru_.empty(); --n) {
    Statement* oldest = lru_.back();
    lru_.pop_back();
    const std::string key = oldest->key;       // the map's key views *oldest
    statements_.erase(std::string_view(key));  // closes it on the server
  }
}

Connection::Statement& Connection::prepare(std::string_view sql, std::string_view what) {
  auto it = statements_.find(sql);
  if (it != statements_.end()) {
    Statement& s = *it->second;
    if (s.lru != lru_.begin()) lru_.splice(lru_.begin(), lru_, s.lru);
    return s;
  }
  Placeholders ph = rewrite_placeholders(sql);
  if (statements_.size() >= kMaxStatements) close_oldest(1);
  auto s = std::make_unique<Statement>();
  s->key = std::string(sql);
  const auto started = std::chrono::steady_clock::now();
  for (int attempt = 0;; ++attempt) {
    s->stmt.reset(mysql_stmt_init(mysql_.get()));
    if (!s->stmt) fail_conn(what, std::chrono::steady_clock::now());
    if (mysql_stmt_prepare(s->stmt.get(), ph.text.data(), ph.text.size()) == 0) break;
    // The server's max_prepared_stmt_count (over every client) is reached: the least
    // recently used half of this connection's statements makes room, once.
    if (attempt > 0 || mysql_stmt_errno(s->stmt.get()) != kTooManyPreparedStatements ||
        statements_.empty()) {
      fail_stmt(s->stmt.get(), what, started);
    }
    close_oldest((statements_.size() + 1) / 2);
  }
  if (mysql_stmt_param_count(s->stmt.get()) != ph.arg_of.size()) {
    throw UsageError("mysql: the server counts " +
                     std::to_string(mysql_stmt_param_count(s->stmt.get())) + " placeholders in '" +
                     std::string(sql.substr(0, 200)) + "', idem counted " +
                     std::to_string(ph.arg_of.size()));
  }
  s->arg_of = std::move(ph.arg_of);
  s->args = ph.args;
  s->fields = mysql_stmt_field_count(s->stmt.get());
  if (s->fields > 0) {
    ResultPtr meta(mysql_stmt_result_metadata(s->stmt.get()));
    if (!meta) fail_stmt(s->stmt.get(), what, started);
    MYSQL_FIELD* f = mysql_fetch_fields(meta.get());
    const unsigned n = s->fields;
    s->integer.resize(n);
    s->datetime.assign(n, false);
    s->decimals.assign(n, 0);
    s->times.assign(n, MYSQL_TIME{});
    s->result.assign(n, MYSQL_BIND{});
    s->ints.assign(n, 0);
    s->lengths.assign(n, 0);
    s->nulls.assign(n, 0);
    s->errors.assign(n, 0);
    for (unsigned c = 0; c < n; ++c) {
      // Unsigned BIGINT may not fit an int64: read it as text.
      s->integer[c] = is_integer_type(f[c].type) &&
                      !(f[c].type == MYSQL_TYPE_LONGLONG && (f[c].flags & UNSIGNED_FLAG) != 0);
      MYSQL_BIND& b = s->result[c];
      b.is_null = &s->nulls[c];
      b.error = &s->errors[c];
      b.length = &s->lengths[c];
      s->datetime[c] = is_datetime_type(f[c].type);
      s->decimals[c] = f[c].decimals;
      if (s->integer[c]) {
        b.buffer_type = MYSQL_TYPE_LONGLONG;
        b.buffer = &s->ints[c];
      } else if (s->datetime[c]) {
        b.buffer_type = MYSQL_TYPE_DATETIME;
        b.buffer = &s->times[c];
        b.buffer_length = sizeof(MYSQL_TIME);
      } else {
        b.buffer_type = MYSQL_TYPE_STRING;
        b.buffer = nullptr;
        b.buffer_length = 0;
      }
    }
  }
  lru_.push_front(s.get());
  s->lru = lru_.begin();
  Statement& ref = *s;
  statements_.emplace(std::string_view(ref.key), std::move(s));
  return ref;
}

Connection::Outcome Connection::execute(std::string_view sql, const Param* params,
                                        std::size_t count, Rows* rows, std::string_view what) {
  if (watching_ && ended_) throw_ended();
  if (broken_) {
    throw Failure<StorageUnavailable>("mysql: " + std::string(what) + ": the connection is broken",
                                      kServerGone, "HY000");
  }
  Statement* st = nullptr;
  try {
    st = &prepare(sql, what);
  } catch (const ServerError& e) {
    // A statement the server cannot prepare (MySQL refuses some, e.g. SAVEPOINT before 8.0):
    // without values it runs through the text protocol instead.
    constexpr unsigned kUnsupportedPrepared = 1295;
    if (e.error_number() != kUnsupportedPrepared || count != 0 || rows != nullptr) throw;
    text(sql, what);
    return Outcome{mysql_affected_rows(mysql_.get()), last_insert_id_};
  }
  if (count != st->args) {
    throw UsageError("mysql: statement takes " + std::to_string(st->args) + " values, got " +
                     std::to_string(count) + ": '" + std::string(sql.substr(0, 200)) + "'");
  }
  auto started = std::chrono::steady_clock::now();
  for (int attempt = 0;; ++attempt) {
    MYSQL_STMT* stmt = st->stmt.get();
    binds_.assign(st->arg_of.size(), MYSQL_BIND{});
    for (std::size_t pos = 0; pos < st->arg_of.size(); ++pos) {
      const Param& p = params[st->arg_of[pos]];
      MYSQL_BIND& b = binds_[pos];
      switch (p.kind) {
        case Param::Kind::kNull:
          b.buffer_type = MYSQL_TYPE_NULL;
          break;
        case Param::Kind::kInt:
          b.buffer_type = MYSQL_TYPE_LONGLONG;
          b.buffer = const_cast<std::int64_t*>(&p.i);
          break;
        case Param::Kind::kUnsigned:
          b.buffer_type = MYSQL_TYPE_LONGLONG;
          b.buffer = const_cast<std::uint64_t*>(&p.u);
          b.is_unsigned = 1;
          break;
        case Param::Kind::kDouble:
          b.buffer_type = MYSQL_TYPE_DOUBLE;
          b.buffer = const_cast<double*>(&p.d);
          break;
        case Param::Kind::kText:
        case Param::Kind::kBlob:
          // BLOB-typed values are taken as bytes (character set binary): no conversion, no
          // validation against the connection's utf8mb4.
          b.buffer_type = p.kind == Param::Kind::kText ? MYSQL_TYPE_STRING : MYSQL_TYPE_BLOB;
          b.buffer = const_cast<char*>(p.bytes.data() != nullptr ? p.bytes.data() : kEmpty);
          b.buffer_length = static_cast<unsigned long>(p.bytes.size());
          b.length_value = b.buffer_length;
          b.length = &b.length_value;
          break;
      }
    }
    if (!binds_.empty() && mysql_stmt_bind_param(stmt, binds_.data()) != 0) {
      fail_stmt(stmt, what, started);
    }
    if (mysql_stmt_execute(stmt) != 0) {
      // The table changed under a cached statement: prepare it again, once.
      if (mysql_stmt_errno(stmt) == kNeedReprepare && attempt == 0) {
        lru_.erase(st->lru);
        const std::string key = st->key;  // the map's key views *st, which erase destroys
        statements_.erase(std::string_view(key));
        st = &prepare(sql, what);
        continue;
      }
      fail_stmt(stmt, what, started);
    }
    break;
  }
  MYSQL_STMT* stmt = st->stmt.get();
  Outcome out;
  if (st->fields == 0) {
    out.affected = mysql_stmt_affected_rows(stmt);
    out.insert_id = mysql_stmt_insert_id(stmt);
    last_insert_id_ = out.insert_id;
  } else {
    const unsigned n = st->fields;
    std::vector<MYSQL_BIND>& result = st->result;
    if (!st->result_bound) {
      if (mysql_stmt_bind_result(stmt, result.data()) != 0) fail_stmt(stmt, what, started);
      st->result_bound = true;
    }
    const auto& ints = st->ints;
    const auto& lengths = st->lengths;
    const auto& nulls = st->nulls;
    for (;;) {
      int rc = mysql_stmt_fetch(stmt);
      if (rc == MYSQL_NO_DATA) break;
      if (rc == 1) fail_stmt(stmt, what, started);
      if (rows == nullptr) continue;
      Row& row = rows->emplace_back(n);
      for (unsigned c = 0; c < n; ++c) {
        if (nulls[c]) {
          FieldAccess::set_null(row[c]);
        } else if (st->integer[c]) {
          FieldAccess::set_int(row[c], ints[c]);
        } else if (st->datetime[c]) {
          format_datetime(FieldAccess::set_bytes(row[c]), st->times[c], st->decimals[c]);
        } else {
          std::string& bytes = FieldAccess::set_bytes(row[c]);
          bytes.resize(lengths[c]);
          if (lengths[c] > 0) {
            MYSQL_BIND col = result[c];
            col.buffer = bytes.data();
            col.buffer_length = lengths[c];
            if (mysql_stmt_fetch_column(stmt, &col, c, 0) != 0) fail_stmt(stmt, what, started);
          }
        }
      }
    }
    mysql_stmt_free_result(stmt);
    // A CALL answers more results: drain them (idem reads the first only).
    while (mysql_stmt_more_results(stmt)) {
      if (mysql_stmt_next_result(stmt) > 0) fail_stmt(stmt, what, started);
      mysql_stmt_free_result(stmt);
    }
  }
  check_watched(0);
  return out;
}

void Connection::text(std::string_view sql, std::string_view what) {
  if (watching_ && ended_) throw_ended();
  MYSQL* m = mysql_.get();
  const auto started = std::chrono::steady_clock::now();
  if (mysql_real_query(m, sql.data(), static_cast<unsigned long>(sql.size())) != 0) {
    fail_conn(what, started);
  }
  for (;;) {
    ResultPtr r(mysql_store_result(m));
    if (!r && mysql_field_count(m) != 0) fail_conn(what, started);
    last_insert_id_ = mysql_insert_id(m);
    int next = mysql_next_result(m);
    if (next == -1) break;
    if (next > 0) fail_conn(what, started);
  }
  check_watched(0);
}

void Connection::commit(std::string_view what) {
  if (watching_ && ended_) throw_ended();
  const auto started = std::chrono::steady_clock::now();
  if (mysql_commit(mysql_.get()) != 0) fail_conn(what, started);
  unwatch_transaction();
}

void Connection::rollback() noexcept {
  unwatch_transaction();
  if (broken_) return;
  if (mysql_rollback(mysql_.get()) != 0) broken_ = true;
}

void Connection::set_autocommit(bool on) {
  if (on == autocommit_) return;
  const auto started = std::chrono::steady_clock::now();
  if (mysql_autocommit(mysql_.get(), on ? 1 : 0) != 0) fail_conn("set autocommit", started);
  autocommit_ = on;
}

}  // namespace detail
}  // namespace idem::mysql
