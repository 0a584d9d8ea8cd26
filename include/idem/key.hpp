// SPDX-License-Identifier: MIT
// idem::Key: the name of one business operation (scope + id), validated, never normalised.
//
// A key is a *scope* (the business name: "payment", "order.create", an MQ consumer group) plus
// an *id* (business primary key, client request id, message id).
//
//   scope: 1..64 characters of [A-Za-z0-9._:-]
//   id:    1..128 bytes of printable ASCII without space (0x21..0x7E)
//
// Anything else throws `idem::InvalidKey` naming the rule that failed, before any store is
// touched. Keys are never truncated, trimmed or case-folded, so two distinct keys never collide.
//
// `Key::str()` composes the two as `<scope>|<id>`. '|' is not allowed in a scope, so the first
// '|' always splits the string back into the pair: scope "a:b" + id "c" ("a:b|c") can never be
// scope "a" + id "b:c" ("a|b:c"). Relational stores keep scope and id in separate columns.
#pragma once

#include <array>
#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>

#include "idem/errors.hpp"

namespace idem {

/// Longest scope, in characters.
inline constexpr std::size_t kMaxScopeLength = 64;
/// Longest id, in bytes.
inline constexpr std::size_t kMaxIdLength = 128;
/// Separator between scope and id in `Key::str()`; never valid inside a scope.
inline constexpr char kKeySeparator = '|';

namespace detail {
// The scope characters as a table (a key is validated on every call that makes one).
inline constexpr auto kScopeChars = [] {
  std::array<bool, 256> t{};
  for (int c = 0; c < 256; ++c) {
    t[static_cast<std::size_t>(c)] = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
                                     (c >= '0' && c <= '9') || c == '.' || c == '_' ||
                                     c == ':' || c == '-';
  }
  return t;
}();
inline bool is_scope_char(unsigned char c) noexcept { return kScopeChars[c]; }
inline bool is_id_char(unsigned char c) noexcept { return c >= 0x21 && c <= 0x7E; }

/// Printable description of a byte for error messages (never echoes control bytes raw).
inline std::string describe_byte(unsigned char c) {
  char buf[16];
  if (c >= 0x21 && c <= 0x7E) {
    std::snprintf(buf, sizeof buf, "'%c'", static_cast<char>(c));
  } else {
    std::snprintf(buf, sizeof buf, "0x%02X", static_cast<unsigned>(c));
  }
  return buf;
}
}  // namespace detail

/// A validated idempotency key. Cheap to copy; immutable. Moving copies: a moved-from Key is
/// still the valid key it was (a Key is never empty, so no two operations can meet on an
/// emptied one).
///
/// @code
///   auto key = idem::Key::make("payment", "order_20001_msg_30001");
///   key.scope();  // "payment"
///   key.str();    // "payment|order_20001_msg_30001"
/// @endcode
class Key {
 public:
  /// Validates and builds a key.
  /// @throws idem::InvalidKey naming the failed rule (scope.empty, scope.too_long,
  ///         scope.charset, id.empty, id.too_long, id.charset).
  static Key make(std::string_view scope, std::string_view id) {
    validate_scope(scope);
    validate_id(id);
    return Key(std::string(scope), std::string(id));
  }

  /// Parses `Key::str()` output back into a key. @throws idem::InvalidKey.
  static Key parse(std::string_view composed) {
    auto sep = composed.find(kKeySeparator);
    if (sep == std::string_view::npos) {
      throw InvalidKey("key.separator", "no '|' between scope and id");
    }
    return make(composed.substr(0, sep), composed.substr(sep + 1));
  }

  /// Throws InvalidKey if `scope` breaks a scope rule.
  static void validate_scope(std::string_view scope) {
    if (scope.empty()) throw InvalidKey("scope.empty", "the scope must not be empty");
    if (scope.size() > kMaxScopeLength) {
      throw InvalidKey("scope.too_long", "the scope has " + std::to_string(scope.size()) +
                                             " characters, at most " +
                                             std::to_string(kMaxScopeLength) + " are allowed");
    }
    for (std::size_t i = 0; i < scope.size(); ++i) {
      auto c = static_cast<unsigned char>(scope[i]);
      if (!detail::is_scope_char(c)) {
        throw InvalidKey("scope.charset", "byte " + detail::describe_byte(c) + " at offset " +
                                              std::to_string(i) +
                                              " is not one of [A-Za-z0-9._:-]");
      }
    }
  }

  /// Throws InvalidKey if `id` breaks an id rule.
  static void validate_id(std::string_view id) {
    if (id.empty()) throw InvalidKey("id.empty", "the id must not be empty");
    if (id.size() > kMaxIdLength) {
      throw InvalidKey("id.too_long", "the id has " + std::to_string(id.size()) +
                                          " bytes, at most " + std::to_string(kMaxIdLength) +
                                          " are allowed");
    }
    for (std::size_t i = 0; i < id.size(); ++i) {
      auto c = static_cast<unsigned char>(id[i]);
      if (!detail::is_id_char(c)) {
        throw InvalidKey("id.charset", "byte " + detail::describe_byte(c) + " at offset " +
                                           std::to_string(i) +
                                           " is not printable ASCII without space (0x21-0x7E)");
      }
    }
  }

  /// Copies.
  Key(const Key&) = default;
  /// Copies.
  Key& operator=(const Key&) = default;
  /// Copies `other`, which stays valid and unchanged.
  Key(Key&& other) : Key(static_cast<const Key&>(other)) {}
  /// Copies `other`, which stays valid and unchanged.
  Key& operator=(Key&& other) { return *this = static_cast<const Key&>(other); }
  ~Key() = default;

  /// Business scope, e.g. "payment".
  const std::string& scope() const noexcept { return scope_; }
  /// Business id, e.g. "order_20001".
  const std::string& id() const noexcept { return id_; }
  /// Unambiguous composition `<scope>|<id>`.
  std::string str() const {
    std::string out;
    out.reserve(scope_.size() + 1 + id_.size());  // one allocation
    out.append(scope_).append(1, kKeySeparator).append(id_);
    return out;
  }

  /// Same scope and id.
  friend bool operator==(const Key& a, const Key& b) noexcept {
    return a.scope_ == b.scope_ && a.id_ == b.id_;
  }
  /// Another scope or id.
  friend bool operator!=(const Key& a, const Key& b) noexcept { return !(a == b); }

 private:
  Key(std::string scope, std::string id) : scope_(std::move(scope)), id_(std::move(id)) {}
  std::string scope_;
  std::string id_;
};

/// Builds a message id for an MQ message that has none: `<biz_no>:<event_type>:v<version>`.
/// Each part must be non-empty printable ASCII without space; the result is a valid key id.
/// @throws idem::InvalidKey if a part is empty or the result breaks an id rule.
inline std::string make_message_id(std::string_view biz_no, std::string_view event_type,
                                   unsigned long long version) {
  if (biz_no.empty()) throw InvalidKey("id.empty", "the business number must not be empty");
  if (event_type.empty()) throw InvalidKey("id.empty", "the event type must not be empty");
  if (event_type.find(':') != std::string_view::npos) {
    throw InvalidKey("id.charset", "the event type must not contain ':'");
  }
  std::string id;
  id.reserve(biz_no.size() + event_type.size() + 24);
  id.append(biz_no).append(1, ':').append(event_type).append(":v").append(
      std::to_string(version));
  Key::validate_id(id);
  return id;
}

}  // namespace idem
