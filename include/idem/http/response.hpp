// SPDX-License-Identifier: MIT
// The HTTP response idem stores and replays, its binary-safe idem::Codec, and problem+json.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/codec.hpp"
#include "idem/errors.hpp"

namespace idem::http {

/// True when `a` and `b` are equal ignoring ASCII case (header names).
inline bool iequals(std::string_view a, std::string_view b) noexcept {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = static_cast<char>(x - 'A' + 'a');
    if (y >= 'A' && y <= 'Z') y = static_cast<char>(y - 'A' + 'a');
    if (x != y) return false;
  }
  return true;
}

/// One header field.
struct Header {
  /// Field name, case kept as given (compared case-insensitively by idem).
  std::string name;
  /// Field value.
  std::string value;
  /// Exact comparison (name case included).
  friend bool operator==(const Header& a, const Header& b) {
    return a.name == b.name && a.value == b.value;
  }
};

/// An HTTP response: what a handler returns, what idem stores (status, the endpoint's chosen
/// headers, body) and replays byte for byte.
struct Response {
  /// Status code (100..599).
  int status = 200;
  /// Header fields in order; names keep their case.
  std::vector<Header> headers;
  /// Body bytes (any bytes).
  std::string body;

  /// The first value of header `name` (case-insensitive), or null.
  const std::string* header(std::string_view name) const noexcept {
    for (const auto& h : headers) {
      if (iequals(h.name, name)) return &h.value;
    }
    return nullptr;
  }
  /// Replaces every `name` field by one with `value`.
  Response& set_header(std::string_view name, std::string value) {
    std::vector<Header> kept;
    for (auto& h : headers) {
      if (!iequals(h.name, name)) kept.push_back(std::move(h));
    }
    kept.push_back(Header{std::string(name), std::move(value)});
    headers = std::move(kept);
    return *this;
  }
  /// Exact comparison of status, headers (in order) and body.
  friend bool operator==(const Response& a, const Response& b) {
    return a.status == b.status && a.headers == b.headers && a.body == b.body;
  }
};

namespace detail {
inline void put_u32(std::string& out, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) {
    out += static_cast<char>((v >> shift) & 0xFF);
  }
}
inline void put_bytes(std::string& out, std::string_view bytes) {
  if (bytes.size() > 0xFFFFFFFFu) throw UsageError("idem::http: a field exceeds 4 GiB");
  put_u32(out, static_cast<std::uint32_t>(bytes.size()));
  out.append(bytes.data(), bytes.size());
}

// Reads the encoding back, refusing anything truncated or trailing (also used by idem::grpc).
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  std::uint32_t u32() {
    need(4);
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(in_[pos_++]);
    return v;
  }
  std::string bytes() {
    std::uint32_t n = u32();
    need(n);
    std::string s(in_.substr(pos_, n));
    pos_ += n;
    return s;
  }
  std::string_view raw(std::size_t n) {
    need(n);
    auto s = in_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  bool done() const noexcept { return pos_ == in_.size(); }
  std::size_t position() const noexcept { return pos_; }

 private:
  void need(std::size_t n) const {
    if (in_.size() - pos_ < n) throw std::runtime_error("truncated record");
  }
  std::string_view in_;
  std::size_t pos_ = 0;
};

/// First bytes of every stored response (format name and version).
inline constexpr std::string_view kResponseMagic = "idem.http.response/1\n";
}  // namespace detail

/// The Content-Type of problem details.
inline constexpr std::string_view kProblemJson = "application/problem+json";

/// `s` as a JSON string literal (quotes included; control bytes as \u00XX; bytes >= 0x80 are
/// copied as they are, so UTF-8 stays UTF-8).
inline std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7F) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  out += '"';
  return out;
}

/// An RFC 9457 problem details response for `code`:
/// `{"type":"<type_prefix><name>","title":"<errc_message>","status":<http_status>,
///   "detail":"<detail>","code":"<errc_name>"}` with Content-Type application/problem+json.
/// @param code        the error
/// @param detail      what happened in this request (no secrets: it goes to the client)
/// @param type_prefix prepended to errc_name to form the `type` URI
inline Response problem(errc code, std::string_view detail,
                        std::string_view type_prefix = "urn:idem:error:") {
  Response r;
  r.status = http_status(code);
  std::string name(errc_name(code));
  r.headers.push_back(Header{"Content-Type", std::string(kProblemJson)});
  r.body = "{\"type\":" + json_string(std::string(type_prefix) + name) +
           ",\"title\":" + json_string(errc_message(code)) +
           ",\"status\":" + std::to_string(r.status) + ",\"detail\":" + json_string(detail) +
           ",\"code\":" + json_string(name) + "}";
  return r;
}

}  // namespace idem::http

namespace idem {

/// Binary-safe encoding of a stored HTTP response:
/// magic "idem.http.response/1\n", status (u32 big-endian), header count (u32), each header as
/// length-prefixed name and value (u32 + bytes), then the length-prefixed body.
/// decode() throws on a wrong magic, truncation or trailing bytes (the guard reports
/// idem::CorruptRecord).
template <>
struct Codec<http::Response> {
  /// The record bytes of `r` (status, headers in order, body; length-prefixed).
  static std::string encode(const http::Response& r) {
    std::string out(http::detail::kResponseMagic);
    out.reserve(out.size() + 12 + r.body.size());
    http::detail::put_u32(out, static_cast<std::uint32_t>(r.status));
    http::detail::put_u32(out, static_cast<std::uint32_t>(r.headers.size()));
    for (const auto& h : r.headers) {
      http::detail::put_bytes(out, h.name);
      http::detail::put_bytes(out, h.value);
    }
    http::detail::put_bytes(out, r.body);
    return out;
  }
  /// The response encode() wrote. @throws std::runtime_error for bytes it did not write.
  static http::Response decode(std::string_view bytes) {
    http::detail::Reader in(bytes);
    if (in.raw(http::detail::kResponseMagic.size()) != http::detail::kResponseMagic) {
      throw std::runtime_error("not an idem HTTP response record");
    }
    http::Response r;
    std::uint32_t status = in.u32();
    if (status < 100 || status > 599) throw std::runtime_error("bad HTTP status in record");
    r.status = static_cast<int>(status);
    std::uint32_t n = in.u32();
    if (n > 10'000) throw std::runtime_error("too many headers in record");
    for (std::uint32_t i = 0; i < n; ++i) {
      http::Header h;
      h.name = in.bytes();
      h.value = in.bytes();
      r.headers.push_back(std::move(h));
    }
    r.body = in.bytes();
    if (!in.done()) throw std::runtime_error("trailing bytes after HTTP response record");
    return r;
  }
};

}  // namespace idem
