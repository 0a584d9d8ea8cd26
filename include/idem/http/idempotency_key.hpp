// SPDX-License-Identifier: MIT
// The `Idempotency-Key` request header: parsing (an RFC 8941 sf-string) and server-side scoping.
//
// File: http/idempotency_key.hpp
//
// Parsing follows the IETF httpapi draft "The Idempotency-Key HTTP Header Field": the field
// value is a Structured Field *String* item:
//
//     Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"
//
// * the value is a double-quoted string of printable ASCII (0x20-0x7E); inside it `\"` and
//   `\\` are the only escapes; leading and trailing spaces/tabs around the item are ignored;
// * an empty string, a bare token (`abc` without quotes), any other escape, a control or
//   non-ASCII byte, text after the closing quote, and parameters (`"abc";p=1`) are malformed;
// * the unescaped value is at most kMaxClientKeyLength (255) bytes;
// * more than one `Idempotency-Key` field line is malformed (an Item cannot be a list).
//
// That strict form is the default (KeySyntax::kStructuredField). Many clients (Stripe-style
// SDKs) send the key bare, `Idempotency-Key: 7f7d6f9c-9b2a-4c1e-8f00-2b1d3c4e5f60`;
// KeySyntax::kAllowBareToken accepts that too: a value that does not start with `"` is taken
// as it is (after trimming spaces/tabs) when it is 1..255 bytes of visible ASCII (0x21-0x7E)
// without `"` or `,` (a comma would make it indistinguishable from two keys a proxy folded
// into one line). `abc` and `"abc"` are then the same key.
//
// Scoping (`scoped_key`): the client's string is NOT used as the idem::Key directly. Two clients
// may pick the same string, and one route's key must not replay another route's response, so
// the key the store sees is
//
//     scope = the endpoint's configured scope (validated: 1..64 of [A-Za-z0-9._:-]),
//             e.g. "http.orders.create"
//     id    = lower-case hex SHA-256 (64 characters) of
//             "idem.http.v1" + for each of principal, method, route, client key:
//             <decimal byte length> ":" <bytes>
//
// The length prefixes make the encoding injective (principal "a:b" + key "c" never hashes like
// principal "a" + key "b:c"), and hashing satisfies the key rules (id 1..128 printable bytes)
// whatever the principal, route or client key contain. The cost: an operator cannot read the
// client's key back from a stored record; `scoped_key()` (and `idemctl key`) recompute the id
// from the four parts.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"

namespace idem::http {

/// Longest accepted client key (unescaped), in bytes.
inline constexpr std::size_t kMaxClientKeyLength = 255;

/// The header's name (matched case-insensitively).
inline constexpr std::string_view kIdempotencyKeyHeader = "Idempotency-Key";

/// Which spellings of the header value an endpoint accepts (see the file comment).
enum class KeySyntax {
  kStructuredField,  ///< only an RFC 8941 sf-string, `"abc"` (the IETF draft; the default)
  kAllowBareToken,   ///< an sf-string, or a bare token of visible ASCII, `abc` (Stripe-style)
};

/// The result of parsing the Idempotency-Key field lines of one request.
struct ParsedKey {
  /// What was found.
  enum class Status {
    kOk,         ///< exactly one well-formed field; `value` holds the unescaped key
    kMissing,    ///< no field line
    kMalformed,  ///< one field line that is not a valid sf-string (see `detail`)
    kMultiple,   ///< more than one field line
  };
  /// What the header held.
  Status status = Status::kMissing;
  /// kOk: the client's key, unescaped.
  std::string value;
  /// kMalformed / kMultiple: why, for the problem+json `detail`.
  std::string detail;

  /// True for kOk.
  bool ok() const noexcept { return status == Status::kOk; }
};

namespace detail {
inline bool is_ows(char c) noexcept { return c == ' ' || c == '\t'; }

inline ParsedKey malformed(std::string why) {
  ParsedKey p;
  p.status = ParsedKey::Status::kMalformed;
  p.detail = "the Idempotency-Key header must be a quoted string (RFC 8941), e.g. "
             "Idempotency-Key: \"8e03978e\"; " +
             std::move(why);
  return p;
}

inline void append_length_prefixed(std::string& out, std::string_view part) {
  out += std::to_string(part.size());
  out += ':';
  out.append(part.data(), part.size());
}
}  // namespace detail

/// Why `key`, a client's idempotency key as received (HTTP: after unquoting), is refused, or ""
/// when it is accepted: 1..kMaxClientKeyLength bytes of printable ASCII (0x20-0x7E). The rules
/// of the HTTP header's value and of gRPC's `idempotency-key` metadata (idem::grpc).
inline std::string client_key_problem(std::string_view key) {
  if (key.empty()) return "the key is empty";
  if (key.size() > kMaxClientKeyLength) {
    return "the key has " + std::to_string(key.size()) + " bytes, at most " +
           std::to_string(kMaxClientKeyLength) + " are accepted";
  }
  for (char ch : key) {
    auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c > 0x7E) {
      return "byte " + ::idem::detail::describe_byte(c) + " is not printable ASCII";
    }
  }
  return {};
}

namespace detail {
inline ParsedKey parse_bare_token(std::string_view s) {
  ParsedKey p;
  p.status = ParsedKey::Status::kMalformed;
  for (char ch : s) {
    auto c = static_cast<unsigned char>(ch);
    if (c < 0x21 || c > 0x7E || c == '"' || c == ',') {
      p.detail =
          "the Idempotency-Key header must be a quoted string (\"8e03978e\") or a bare "
          "token of visible ASCII without '\"' or ','; byte " +
          ::idem::detail::describe_byte(c) + " is not accepted";
      return p;
    }
  }
  if (s.size() > kMaxClientKeyLength) {
    p.detail = "the key has " + std::to_string(s.size()) + " bytes, at most " +
               std::to_string(kMaxClientKeyLength) + " are accepted";
    return p;
  }
  p.status = ParsedKey::Status::kOk;
  p.value = std::string(s);
  return p;
}
}  // namespace detail

/// Parses one Idempotency-Key field value (see the file comment).
/// @param field  the field value as received
/// @param syntax kStructuredField (default): an RFC 8941 sf-string only; kAllowBareToken: a
///               bare token as well
/// @return kOk with the unescaped value, or kMalformed with the reason.
inline ParsedKey parse_idempotency_key(std::string_view field,
                                       KeySyntax syntax = KeySyntax::kStructuredField) {
  std::size_t b = 0, e = field.size();
  while (b < e && detail::is_ows(field[b])) ++b;
  while (e > b && detail::is_ows(field[e - 1])) --e;
  std::string_view s = field.substr(b, e - b);
  if (s.empty()) return detail::malformed("the value is empty");
  if (s[0] != '"') {
    if (syntax == KeySyntax::kAllowBareToken) return detail::parse_bare_token(s);
    return detail::malformed("the value does not start with '\"'");
  }
  std::string value;
  std::size_t i = 1;
  bool closed = false;
  while (i < s.size()) {
    auto c = static_cast<unsigned char>(s[i++]);
    if (c == '\\') {
      if (i >= s.size()) return detail::malformed("a '\\' ends the value");
      char next = s[i++];
      if (next != '"' && next != '\\') {
        return detail::malformed("only \\\" and \\\\ may be escaped");
      }
      value += next;
    } else if (c == '"') {
      closed = true;
      break;
    } else if (c < 0x20 || c > 0x7E) {
      return detail::malformed("byte " + ::idem::detail::describe_byte(c) +
                               " is not printable ASCII");
    } else {
      value += static_cast<char>(c);
    }
  }
  if (!closed) return detail::malformed("the closing '\"' is missing");
  if (i != s.size()) {
    return detail::malformed(s[i] == ';' ? "parameters are not accepted"
                                         : "there is text after the closing '\"'");
  }
  if (std::string why = client_key_problem(value); !why.empty()) {
    return detail::malformed(std::move(why));
  }
  ParsedKey p;
  p.status = ParsedKey::Status::kOk;
  p.value = std::move(value);
  return p;
}

/// Parses all Idempotency-Key field lines of a request: none is kMissing, more than one is
/// kMultiple, one is parse_idempotency_key(field, syntax).
inline ParsedKey parse_idempotency_key(const std::vector<std::string_view>& fields,
                                       KeySyntax syntax = KeySyntax::kStructuredField) {
  if (fields.empty()) return ParsedKey{};
  if (fields.size() > 1) {
    ParsedKey p;
    p.status = ParsedKey::Status::kMultiple;
    p.detail = "the request has " + std::to_string(fields.size()) +
               " Idempotency-Key header fields; send exactly one";
    return p;
  }
  return parse_idempotency_key(fields.front(), syntax);
}

/// The idem::Key a request is stored under (see the file comment for the derivation).
/// @param scope      the endpoint's scope; @throws idem::InvalidKey when it breaks a scope rule
/// @param principal  the authenticated principal or tenant ("" for anonymous callers, who then
///                   share one namespace: avoid on endpoints that return private data)
/// @param method     the request method as sent ("POST")
/// @param route      the route pattern or name ("/orders"), not the concrete path
/// @param client_key the unescaped Idempotency-Key value
inline Key scoped_key(std::string_view scope, std::string_view principal, std::string_view method,
                      std::string_view route, std::string_view client_key) {
  std::string material = "idem.http.v1";
  detail::append_length_prefixed(material, principal);
  detail::append_length_prefixed(material, method);
  detail::append_length_prefixed(material, route);
  detail::append_length_prefixed(material, client_key);
  return Key::make(scope, fingerprint(material));
}

}  // namespace idem::http
