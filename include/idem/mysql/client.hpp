// SPDX-License-Identifier: MIT
// idem::mysql's client layer: connection settings (a mysql:// URI), bound statements on a
// pooled connection (`Session`), the transaction a transactional handler receives
// (`Transaction`), and the exceptions that keep the server's error number.
//
// File: mysql/client.hpp
//
// Statements are prepared once per connection and cached; every value is bound, never
// interpolated. Placeholders are MySQL's positional `?`, or numbered `?1, ?2, ...` (a value may
// then be used twice, in any order; idem's own helpers use these). Text binds as the
// connection's character set (utf8mb4), `Blob` binds as bytes: a BLOB column holds exactly the
// bytes given, whatever they are.
//
// @code
//   auto r = guard.run(key, idem::fingerprint(body), [&](idem::mysql::Transaction& tx) {
//     tx.exec("UPDATE account SET balance = balance - ? WHERE id = ?", amount, account);
//     tx.exec("INSERT INTO payment (order_no, amount) VALUES (?, ?)", order_no, amount);
//     return "pay_" + std::to_string(tx.last_insert_id());
//   });
// @endcode
//
// Failures are idem exceptions (errors.hpp) carrying the server's (or the client library's)
// error number and SQLSTATE: catch `idem::mysql::ServerError` to read them. A duplicate key
// (1062) of a business statement is `DuplicateKey`; the transaction stays usable (MySQL rolls
// back only the failed statement).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/errors.hpp"
#include "idem/export.hpp"

struct st_mysql;  // MYSQL of <mysql.h>

namespace idem::mysql {

/// Where and how to connect. Usually parsed from a URI (parse_uri).
struct ConnectionOptions {
  /// Host name or address. "localhost" still means TCP unless `unix_socket` is set.
  std::string host = "127.0.0.1";
  /// TCP port (at most 65535).
  unsigned port = 3306;
  /// User name.
  std::string user;
  /// Password (empty: none).
  std::string password;
  /// Database (schema) to use; required by MysqlStore.
  std::string database;
  /// Unix socket path; empty means TCP.
  std::string unix_socket;
  /// How long a connection attempt may take. The client library counts whole seconds: 1 to
  /// 3600 (a UsageError otherwise, where the store or client is made).
  std::chrono::seconds connect_timeout{2};
  /// How long one read from the server may wait (a statement's answer, a lock wait included):
  /// past it the connection is closed and the call fails with StorageTimeout. Keep it above
  /// the lock wait timeout and the slowest business statement. Whole seconds, 1 to 86400.
  std::chrono::seconds read_timeout{5};
  /// How long one write to the server may wait. Whole seconds, 1 to 86400.
  std::chrono::seconds write_timeout{5};
  /// Require TLS (the connection fails rather than fall back to plain text). Without tls_ca
  /// the traffic is encrypted but the server is not authenticated (anyone on the path can
  /// present a certificate): set tls_ca where that matters.
  bool tls = false;
  /// CA file (PEM) the server's certificate must chain to; its host name must also match
  /// `host` (the certificate's subjectAltName). Implies `tls`.
  std::string tls_ca;
  /// Client certificate file (PEM) presented to the server, for users created with
  /// `REQUIRE X509` / `REQUIRE SUBJECT` (or as their only credential). Set with `tls_key`;
  /// implies `tls`.
  std::string tls_cert;
  /// The private key of `tls_cert` (PEM, unencrypted).
  std::string tls_key;
};

/// Parses `mysql://[user[:password]@]host[:port]/database[?key=value&...]` (also
/// `mariadb://`). User, password and database are percent-decoded; IPv6 hosts go in brackets.
/// Keys: connect_timeout, read_timeout, write_timeout (seconds), socket (a Unix socket path),
/// tls (true/false), tls_ca, tls_cert, tls_key (files).
/// @throws idem::UsageError naming what is wrong (a bad URI is a configuration error: retrying
///         cannot help).
IDEM_EXPORT ConnectionOptions parse_uri(std::string_view uri);

/// The server's error number and SQLSTATE, carried by every idem exception the MySQL adapter
/// throws for a server or client-library error (catch `const idem::mysql::ServerError&`).
class IDEM_EXPORT ServerError {
 public:
  /// The error's number and SQLSTATE.
  ServerError(unsigned number, std::string sqlstate)
      : number_(number), sqlstate_(std::move(sqlstate)) {}
  virtual ~ServerError() = default;
  /// The error number: a server error (1062, 1213, ...) or a client one (2006, 2013, ...).
  unsigned error_number() const noexcept { return number_; }
  /// The SQLSTATE ("23000", "40001", "HY000", ...).
  const std::string& sqlstate() const noexcept { return sqlstate_; }

 private:
  unsigned number_;
  std::string sqlstate_;
};

/// An idem exception of type `Base` with the server's error number and SQLSTATE.
template <class Base>
class Failure final : public Base, public ServerError {
 public:
  /// The message of `Base`, the server's error number and SQLSTATE.
  Failure(const std::string& what, unsigned number, std::string sqlstate)
      : Base(what), ServerError(number, std::move(sqlstate)) {}
};

/// A business statement hit a unique key (error 1062): another row holds the value. Not
/// retryable as such; the transaction is still open and usable.
class IDEM_EXPORT DuplicateKey final : public StorageError, public ServerError {
 public:
  /// The message, the server's error number (1062) and SQLSTATE.
  DuplicateKey(const std::string& what, unsigned number, std::string sqlstate)
      : StorageError(what), ServerError(number, std::move(sqlstate)) {}
};

/// A value to bind as bytes (BLOB, VARBINARY): stored and read back exactly.
struct Blob {
  std::string_view bytes;  ///< the bytes (not copied: they must outlive the statement)
};

/// One bound value (built from the arguments of Session::exec and friends).
struct Param {
  /// Which member holds the value.
  enum class Kind : unsigned char { kNull, kInt, kUnsigned, kDouble, kText, kBlob };
  Kind kind = Kind::kNull;  ///< the value's kind
  std::int64_t i = 0;       ///< kInt
  std::uint64_t u = 0;      ///< kUnsigned
  double d = 0;             ///< kDouble
  std::string_view bytes;   ///< kText and kBlob (not copied)
};

/// One column of a result row.
class IDEM_EXPORT Field {
 public:
  /// True for SQL NULL.
  bool is_null() const noexcept { return null_; }
  /// The value as an integer (integer columns, or text holding a decimal integer).
  /// @throws idem::StorageError for NULL or a value that is not an integer.
  std::int64_t as_int64() const;
  /// The value's bytes (text and binary columns as stored; numbers and dates as MySQL prints
  /// them). Empty for NULL.
  const std::string& bytes() const noexcept { return bytes_; }
  /// Moves the bytes out (the field is then empty).
  std::string take() noexcept { return std::move(bytes_); }

 private:
  friend struct FieldAccess;
  bool null_ = true;
  bool integer_ = false;
  std::int64_t int_ = 0;
  std::string bytes_;
};

/// A result row: its columns in SELECT order.
using Row = std::vector<Field>;
/// Every row of a result.
using Rows = std::vector<Row>;

class Session;

namespace detail {
class Connection;  // src/mysql/connection.hpp

/// For idem's SQL helpers (SqlDriver): runs `sql`; answers the first column of the first row
/// when it returns rows, else the value LAST_INSERT_ID reports when it changed rows; nullopt
/// when there is no row, a NULL, no changed row, or a duplicate key (1062).
IDEM_EXPORT std::optional<std::int64_t> helper_value(Session& session, std::string_view sql,
                                                     const Param* params, std::size_t count);

/// The connection under a session (for idem's store, which runs its statements on it).
Connection& connection_of(Session& session) noexcept;

inline Param to_param(std::nullptr_t) { return Param{}; }
inline Param to_param(bool v) {
  Param p;
  p.kind = Param::Kind::kInt;
  p.i = v ? 1 : 0;
  return p;
}
template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
Param to_param(T v) {
  Param p;
  if constexpr (std::is_signed_v<T>) {
    p.kind = Param::Kind::kInt;
    p.i = static_cast<std::int64_t>(v);
  } else {
    p.kind = Param::Kind::kUnsigned;
    p.u = static_cast<std::uint64_t>(v);
  }
  return p;
}
template <class T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
Param to_param(T v) {
  Param p;
  p.kind = Param::Kind::kDouble;
  p.d = static_cast<double>(v);
  return p;
}
inline Param to_param(std::string_view v) {
  Param p;
  p.kind = Param::Kind::kText;
  p.bytes = v;
  return p;
}
inline Param to_param(const std::string& v) { return to_param(std::string_view(v)); }
inline Param to_param(const char* v) {
  return v == nullptr ? Param{} : to_param(std::string_view(v));
}
inline Param to_param(Blob v) {
  Param p;
  p.kind = Param::Kind::kBlob;
  p.bytes = v.bytes;
  return p;
}
template <class T>
Param to_param(const std::optional<T>& v) {
  return v ? to_param(*v) : Param{};
}
}  // namespace detail

/// A pooled connection lent for statements (autocommit outside a Transaction). Not
/// thread-safe; use it only inside the call that lent it. Made by MysqlStore.
class IDEM_EXPORT Session {
 public:
  /// A view of `connection` (src/mysql); users receive sessions, they do not make them.
  explicit Session(detail::Connection& connection) noexcept : conn_(&connection) {}
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  /// Runs a statement with bound arguments. @return rows changed (MySQL counts rows whose
  /// values changed, not rows matched). @throws idem::StorageError subclasses (DuplicateKey
  /// for 1062).
  template <class... Args>
  std::uint64_t exec(std::string_view sql, const Args&... args) {
    const std::array<Param, sizeof...(Args)> p{detail::to_param(args)...};
    return run(sql, p.data(), p.size(), nullptr);
  }

  /// Runs a query: every row. @throws as exec.
  template <class... Args>
  Rows query(std::string_view sql, const Args&... args) {
    const std::array<Param, sizeof...(Args)> p{detail::to_param(args)...};
    Rows rows;
    run(sql, p.data(), p.size(), &rows);
    return rows;
  }

  /// First column of the first row as an integer; nullopt when there is no row or it is NULL.
  template <class... Args>
  std::optional<std::int64_t> query_int64(std::string_view sql, const Args&... args) {
    Rows rows = query(sql, args...);
    if (rows.empty() || rows[0].empty() || rows[0][0].is_null()) return std::nullopt;
    return rows[0][0].as_int64();
  }

  /// First column of the first row as bytes; nullopt when there is no row or it is NULL.
  template <class... Args>
  std::optional<std::string> query_text(std::string_view sql, const Args&... args) {
    Rows rows = query(sql, args...);
    if (rows.empty() || rows[0].empty() || rows[0][0].is_null()) return std::nullopt;
    return rows[0][0].bytes();
  }

  /// Runs one statement without parameters through the text protocol (DDL, SET, statements
  /// the binary protocol cannot prepare). @throws as exec.
  void exec_text(std::string_view sql);

  /// The AUTO_INCREMENT id of the last INSERT run on this session (or the value given to
  /// LAST_INSERT_ID(expr)); 0 when none.
  std::uint64_t last_insert_id() const noexcept;

  /// The raw MYSQL handle, for what this wrapper lacks. Do not close it, change its settings
  /// or end its transaction.
  st_mysql* native_handle() const noexcept;

  /// Runs `sql` with `count` bound values; fills `rows` when not null (the non-template core
  /// of exec and query). @return rows changed.
  std::uint64_t run(std::string_view sql, const Param* params, std::size_t count, Rows* rows);

 protected:
  friend std::optional<std::int64_t> detail::helper_value(Session&, std::string_view, const Param*,
                                                          std::size_t);
  friend detail::Connection& detail::connection_of(Session&) noexcept;
  /// The pooled connection this session runs on.
  detail::Connection* conn_;
};

/// The open transaction a transactional handler (or MysqlStore::with_transaction) receives:
/// every statement runs in it, on one connection, and commits or rolls back with it. Whoever
/// opened it commits; the handler only runs statements.
///
/// If the server ends the transaction on its own (a deadlock, 1213, rolls it back; a DDL
/// statement commits it implicitly) the statement that saw it throws, and so does every later
/// statement of this object, without being sent: nothing the handler does afterwards runs
/// outside the transaction.
class IDEM_EXPORT Transaction : public Session {
 public:
  using Session::Session;
  /// True while the transaction is open (false once the server ended it, see above).
  bool open() const noexcept;
};

}  // namespace idem::mysql
