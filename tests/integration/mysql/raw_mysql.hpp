// SPDX-License-Identifier: MIT
// Tests' own MariaDB Connector/C connection, outside idem's client: setup, ground truth
// (counting rows, reading bytes back with HEX()), and killing sessions.
#pragma once

#include <mysql.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "idem/mysql/client.hpp"

namespace idem::test::my {

/// One plain text-protocol connection.
class RawConnection {
 public:
  explicit RawConnection(const mysql::ConnectionOptions& o, bool with_database = true)
      : options_(o), with_database_(with_database) {
    connect();
  }
  ~RawConnection() {
    if (m_ != nullptr) mysql_close(m_);
  }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;

  /// Runs `sql` (several statements allowed); the rows of the last result, as text (nullopt
  /// for NULL). A connection lost meanwhile (the server was restarted) is opened again once.
  std::vector<std::vector<std::optional<std::string>>> query(const std::string& sql) {
    if (mysql_real_query(m_, sql.data(), sql.size()) != 0) {
      const unsigned n = mysql_errno(m_);
      if (n != 2006 && n != 2013) {
        throw std::runtime_error("raw mysql: " + std::string(mysql_error(m_)) + " in: " + sql);
      }
      mysql_close(m_);
      m_ = nullptr;
      connect();
      if (mysql_real_query(m_, sql.data(), sql.size()) != 0) {
        throw std::runtime_error("raw mysql: " + std::string(mysql_error(m_)) + " in: " + sql);
      }
    }
    return results();
  }

  /// First column of the first row as a number.
  long scalar(const std::string& sql) {
    auto rows = query(sql);
    if (rows.empty() || !rows[0][0]) throw std::runtime_error("raw mysql: no value: " + sql);
    return std::stol(*rows[0][0]);
  }

  /// `value` as a quoted SQL string literal.
  std::string quote(const std::string& value) {
    std::string out(value.size() * 2 + 3, '\0');
    out[0] = '\'';
    unsigned long n = mysql_real_escape_string(m_, &out[1], value.data(), value.size());
    out.resize(n + 1);
    out.push_back('\'');
    return out;
  }

  /// This session's connection id (for KILL).
  unsigned long id() { return mysql_thread_id(m_); }

 private:
  void connect() {
    m_ = mysql_init(nullptr);
    const mysql::ConnectionOptions& o = options_;
    unsigned tcp = MYSQL_PROTOCOL_TCP;
    mysql_optionsv(m_, MYSQL_OPT_PROTOCOL, &tcp);
    mysql_optionsv(m_, MYSQL_SET_CHARSET_NAME, "utf8mb4");
    if (mysql_real_connect(m_, o.host.c_str(), o.user.c_str(), o.password.c_str(),
                           with_database_ ? o.database.c_str() : nullptr, o.port, nullptr,
                           CLIENT_MULTI_STATEMENTS) == nullptr) {
      std::string e = mysql_error(m_);
      mysql_close(m_);
      m_ = nullptr;
      throw std::runtime_error("raw mysql connect: " + e);
    }
  }

  std::vector<std::vector<std::optional<std::string>>> results() {
    std::vector<std::vector<std::optional<std::string>>> out;
    for (;;) {
      MYSQL_RES* r = mysql_store_result(m_);
      if (r != nullptr) {
        out.clear();
        unsigned n = mysql_num_fields(r);
        while (MYSQL_ROW row = mysql_fetch_row(r)) {
          unsigned long* len = mysql_fetch_lengths(r);
          std::vector<std::optional<std::string>> v;
          for (unsigned i = 0; i < n; ++i) {
            if (row[i] == nullptr) {
              v.emplace_back(std::nullopt);
            } else {
              v.emplace_back(std::string(row[i], len[i]));
            }
          }
          out.push_back(std::move(v));
        }
        mysql_free_result(r);
      } else if (mysql_field_count(m_) != 0) {
        throw std::runtime_error("raw mysql: " + std::string(mysql_error(m_)));
      }
      int next = mysql_next_result(m_);
      if (next == -1) break;
      if (next > 0) throw std::runtime_error("raw mysql: " + std::string(mysql_error(m_)));
    }
    return out;
  }

  mysql::ConnectionOptions options_;
  bool with_database_;
  MYSQL* m_ = nullptr;
};

}  // namespace idem::test::my
