// SPDX-License-Identifier: MIT
// The one place libpqxx version differences live (6.4 on Debian 12, 7.x elsewhere): the
// adapter's sources and its public templates (sql_driver.hpp) use these functions only.
// libpqxx 7.10 introduced exec(pqxx::prepped / query, pqxx::params) and deprecated
// exec_prepared / exec_params, which 6.x and 7.0-7.9 have; bytea maps to std::byte strings
// from 7.0 on (pqxx::binarystring before).
#pragma once

#include <cstddef>
#include <optional>
#include <pqxx/pqxx>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/errors.hpp"

#if PQXX_VERSION_MAJOR > 7 || (PQXX_VERSION_MAJOR == 7 && PQXX_VERSION_MINOR >= 10)
#define IDEM_PQXX_EXEC_PARAMS 1  // exec(query, pqxx::params), exec(pqxx::prepped, ...)
#else
#define IDEM_PQXX_EXEC_PARAMS 0  // exec_params / exec_prepared
#endif

namespace idem::postgres::detail {

#if PQXX_VERSION_MAJOR >= 7
/// A bytea parameter (7.x: binary std::byte views).
inline std::basic_string_view<std::byte> bytea(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
/// A bytea column as raw bytes ("" for NULL).
inline std::string read_bytea(const pqxx::field& f) {
  if (f.is_null()) return {};
  auto b = f.as<std::basic_string<std::byte>>();
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}
#else
/// A bytea parameter (6.x: pqxx::binarystring travels in binary format).
inline pqxx::binarystring bytea(std::string_view s) {
  return pqxx::binarystring(s.data(), s.size());
}
/// A bytea column as raw bytes ("" for NULL).
inline std::string read_bytea(const pqxx::field& f) {
  if (f.is_null()) return {};
  return pqxx::binarystring(f).str();
}
#endif

/// Refuses a text value holding a NUL byte: libpq sends text parameters as C strings, so
/// "a\0b" would reach the server as "a" and match (or write) another row. The business helpers
/// (StateMachine, UniqueInsert, StockTable) check every text value they bind.
/// @throws idem::UsageError naming `who`.
inline void refuse_nul(std::string_view who, std::string_view text) {
  if (text.find('\0') != std::string_view::npos) {
    throw UsageError(std::string(who) +
                     ": a text value holds a NUL byte, which PostgreSQL text cannot store "
                     "(libpq would cut the value there)");
  }
}
template <class T>
void refuse_nul_in(std::string_view who, const T& value) {
  using V = std::decay_t<T>;
  if constexpr (std::is_convertible_v<const V&, std::string_view> &&
                !std::is_same_v<V, std::nullptr_t>) {
    if constexpr (std::is_pointer_v<T>) {  // a C string (an array never is null)
      if (value == nullptr) return;
    }
    refuse_nul(who, std::string_view(value));
  } else if constexpr (std::is_same_v<V, std::optional<std::string>>) {
    if (value) refuse_nul(who, *value);
  }
}

#if IDEM_PQXX_EXEC_PARAMS
/// Runs a prepared statement.
template <class... Args>
pqxx::result exec_prepared(pqxx::transaction_base& t, const std::string& name, Args&&... args) {
  return t.exec(pqxx::prepped{name}, pqxx::params{std::forward<Args>(args)...});
}
/// Runs a parameterised statement.
template <class... Args>
pqxx::result exec_params(pqxx::transaction_base& t, const std::string& sql, Args&&... args) {
  return t.exec(sql, pqxx::params{std::forward<Args>(args)...});
}
/// Runs a statement with a run-time list of text parameters (nullopt binds NULL).
inline pqxx::result exec_dynamic(pqxx::transaction_base& t, const std::string& sql,
                                 const std::vector<std::optional<std::string>>& values) {
  pqxx::params p;
  for (const auto& v : values) {
    if (v) {
      p.append(*v);
    } else {
      p.append();
    }
  }
  return t.exec(sql, p);
}
/// Registers a prepared statement on a connection.
inline void prepare(pqxx::connection& c, const std::string& name, const std::string& sql) {
  c.prepare(name, sql);
}
#else
/// Runs a prepared statement.
template <class... Args>
pqxx::result exec_prepared(pqxx::transaction_base& t, const std::string& name, Args&&... args) {
  return t.exec_prepared(name, std::forward<Args>(args)...);
}
/// Runs a parameterised statement.
template <class... Args>
pqxx::result exec_params(pqxx::transaction_base& t, const std::string& sql, Args&&... args) {
  return t.exec_params(sql, std::forward<Args>(args)...);
}
/// Runs a statement with a run-time list of text parameters (nullopt binds NULL).
inline pqxx::result exec_dynamic(pqxx::transaction_base& t, const std::string& sql,
                                 const std::vector<std::optional<std::string>>& values) {
  std::vector<const char*> raw;
  raw.reserve(values.size());
  for (const auto& v : values) raw.push_back(v ? v->c_str() : nullptr);
  return t.exec_params(sql, pqxx::prepare::make_dynamic_params(raw));
}
/// Registers a prepared statement on a connection (6.x prepares lazily, at first use).
inline void prepare(pqxx::connection& c, const std::string& name, const std::string& sql) {
  c.prepare(name, sql);
}
#endif

}  // namespace idem::postgres::detail
