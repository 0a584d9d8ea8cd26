// SPDX-License-Identifier: MIT
// Canonical JSON (RFC 8785, the JSON Canonicalization Scheme) and a fingerprint hook for
// idem::http::Endpoint that compares JSON bodies by meaning, not by bytes (target idem::http,
// which brings nlohmann-json).
//
// File: http/json.hpp
//
// A client that retries with the same key may re-serialise its JSON: keys in another order,
// other whitespace, `1.0` for `1`, `"\u00e9"` for `"é"`. With the default fingerprint (the body's
// bytes) that retry is a 422 fingerprint_mismatch; with json_fingerprint() it replays.
//
// canonical_json() parses with nlohmann-json (strict RFC 8259: no comments, no trailing commas,
// valid UTF-8, no lone surrogates) and writes RFC 8785's form:
//
//   * no whitespace between tokens;
//   * object members sorted by their names' UTF-16 code units (RFC 8785 3.2.3), recursively;
//     a name twice in one object is refused (I-JSON, RFC 7493), since parsers disagree on which
//     one wins;
//   * strings with only `\"`, `\\`, `\b \f \n \r \t` and `\u00xx` (lower-case hex, other
//     control characters) escaped; everything else, non-ASCII included, as UTF-8;
//   * every number as an IEEE 754 double printed as ECMAScript's Number.prototype.toString
//     does (shortest round-trip digits: `1.0` -> `1`, `1e2` -> `100`, `-0` -> `0`,
//     `1e21` -> `1e+21`, `0.000001` -> `0.000001`, `1e-7` -> `1e-7`). An integer written
//     without fraction or exponent that no double holds exactly (beyond 2^53, e.g.
//     9007199254740993) makes the text not I-JSON (refused: such a body is fingerprinted by its
//     bytes, so two amounts that would round to one double never compare equal);
//   * true, false, null as they are. A number too large for a double (`1e400`) is refused.
//
// @code
//   idem::http::EndpointOptions options;
//   options.scope = "http.orders.create";
//   options.fingerprint = idem::http::json_fingerprint({"Content-Type"});
// @endcode
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/http/endpoint.hpp"

namespace idem::http {

namespace detail {

// `x` (finite) as ECMAScript Number.prototype.toString writes it (ECMA-262 Number::toString).
inline std::string es_number(double x) {
  if (x == 0) return "0";  // +0 and -0
  std::string out;
  if (x < 0) {
    out += '-';
    x = -x;
  }
  // Shortest round-trip digits in scientific form: d[.ddd]e[+-]XX.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<std::size_t>(res.ptr - buf));
  auto e_pos = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e_pos)) {
    if (c != '.') digits += c;
  }
  int exp10 = std::atoi(std::string(sci.substr(e_pos + 1)).c_str());
  const int k = static_cast<int>(digits.size());
  const int n = exp10 + 1;  // x = 0.d1d2...dk * 10^n
  if (k <= n && n <= 21) {
    out += digits;
    out.append(static_cast<std::size_t>(n - k), '0');
  } else if (0 < n && n <= 21) {
    out += digits.substr(0, static_cast<std::size_t>(n));
    out += '.';
    out += digits.substr(static_cast<std::size_t>(n));
  } else if (-6 < n && n <= 0) {
    out += "0.";
    out.append(static_cast<std::size_t>(-n), '0');
    out += digits;
  } else {
    out += digits[0];
    if (k > 1) {
      out += '.';
      out += digits.substr(1);
    }
    out += 'e';
    out += (n - 1 >= 0) ? '+' : '-';
    out += std::to_string(std::abs(n - 1));
  }
  return out;
}

// `s` (valid UTF-8) as an RFC 8785 string literal.
inline void es_string(std::string& out, std::string_view s) {
  out += '"';
  for (char ch : s) {
    auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char esc[8];
          std::snprintf(esc, sizeof esc, "\\u%04x", static_cast<unsigned>(c));
          out += esc;
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

// UTF-8 (validated by the parser) to UTF-16 code units, for RFC 8785's member order.
inline std::u16string utf16(std::string_view s) {
  std::u16string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    std::uint32_t cp = 0;
    int extra = 0;
    if (c < 0x80) {
      cp = c;
    } else if ((c >> 5) == 0x6) {
      cp = c & 0x1F;
      extra = 1;
    } else if ((c >> 4) == 0xE) {
      cp = c & 0x0F;
      extra = 2;
    } else {
      cp = c & 0x07;
      extra = 3;
    }
    ++i;
    for (int j = 0; j < extra && i < s.size(); ++j, ++i) {
      cp = (cp << 6) | (static_cast<unsigned char>(s[i]) & 0x3F);
    }
    if (cp >= 0x10000) {
      cp -= 0x10000;
      out += static_cast<char16_t>(0xD800 + (cp >> 10));
      out += static_cast<char16_t>(0xDC00 + (cp & 0x3FF));
    } else {
      out += static_cast<char16_t>(cp);
    }
  }
  return out;
}

// SAX events to canonical text: a stack of open containers, each collecting its members'
// canonical text; an object sorts and checks its members when it closes.
class CanonicalSax : public nlohmann::json_sax<nlohmann::json> {
 public:
  bool null() override { return value("null"); }
  bool boolean(bool v) override { return value(v ? "true" : "false"); }
  // An integer no double holds exactly (beyond 2^53, e.g. 9007199254740993) is not I-JSON:
  // the body is then fingerprinted by its bytes, so two such amounts never compare equal.
  bool number_integer(number_integer_t v) override {
    const double d = static_cast<double>(v);
    if (d >= 9223372036854775808.0 || d < -9223372036854775808.0 ||
        static_cast<number_integer_t>(d) != v) {
      return false;
    }
    return value(es_number(d));
  }
  bool number_unsigned(number_unsigned_t v) override {
    const double d = static_cast<double>(v);
    if (d >= 18446744073709551616.0 || static_cast<number_unsigned_t>(d) != v) return false;
    return value(es_number(d));
  }
  bool number_float(number_float_t v, const string_t&) override {
    if (!std::isfinite(v)) return false;
    return value(es_number(v));
  }
  bool string(string_t& v) override {
    std::string s;
    es_string(s, v);
    return value(std::move(s));
  }
  bool binary(binary_t&) override { return false; }  // not produced by the text parser
  bool start_object(std::size_t) override {
    stack_.push_back(Frame{true, {}, {}, {}});
    return true;
  }
  bool key(string_t& k) override {
    stack_.back().pending_key = k;
    return true;
  }
  bool end_object() override {
    Frame f = std::move(stack_.back());
    stack_.pop_back();
    std::sort(f.members.begin(), f.members.end(),
              [](const Member& a, const Member& b) { return a.order < b.order; });
    std::string out = "{";
    for (std::size_t i = 0; i < f.members.size(); ++i) {
      if (i > 0) {
        if (f.members[i].order == f.members[i - 1].order) return false;  // duplicate name
        out += ',';
      }
      es_string(out, f.members[i].name);
      out += ':';
      out += f.members[i].value;
    }
    out += '}';
    return value(std::move(out));
  }
  bool start_array(std::size_t) override {
    stack_.push_back(Frame{false, {}, {}, {}});
    return true;
  }
  bool end_array() override {
    Frame f = std::move(stack_.back());
    stack_.pop_back();
    std::string out = "[";
    for (std::size_t i = 0; i < f.items.size(); ++i) {
      if (i > 0) out += ',';
      out += f.items[i];
    }
    out += ']';
    return value(std::move(out));
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

  std::optional<std::string> result() && { return std::move(result_); }

 private:
  struct Member {
    std::u16string order;
    std::string name;
    std::string value;
  };
  struct Frame {
    bool object;
    std::string pending_key;
    std::vector<Member> members;
    std::vector<std::string> items;
  };

  bool value(std::string text) {
    if (stack_.empty()) {
      result_ = std::move(text);
    } else if (stack_.back().object) {
      Frame& f = stack_.back();
      f.members.push_back(Member{utf16(f.pending_key), std::move(f.pending_key), std::move(text)});
    } else {
      stack_.back().items.push_back(std::move(text));
    }
    return true;
  }

  std::vector<Frame> stack_;
  std::optional<std::string> result_;
};

}  // namespace detail

/// `text` in RFC 8785 canonical form (see the file comment), or nullopt when it is not one
/// JSON value: a syntax error, invalid UTF-8, a lone surrogate escape, a name twice in one
/// object, or a number beyond a double's range.
inline std::optional<std::string> canonical_json(std::string_view text) {
  detail::CanonicalSax sax;
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(text.begin(), text.end(), &sax,
                                   nlohmann::json::input_format_t::json, /*strict=*/true);
  } catch (const nlohmann::json::exception&) {
    ok = false;
  }
  if (!ok) return std::nullopt;
  return std::move(sax).result();
}

/// An EndpointOptions::fingerprint hook that covers the method, the route, the values of
/// `headers` and the body compared as canonical JSON: a body that is valid JSON is
/// fingerprinted by canonical_json(body), so the same meaning re-serialised replays; any
/// other body by its bytes (as the default does), so the handler can answer it 400 itself.
/// @param headers request headers the fingerprint also covers (e.g. {"Content-Type"})
inline std::function<std::string(const RequestView&)> json_fingerprint(
    std::vector<std::string> headers = {}) {
  return [headers = std::move(headers)](const RequestView& request) {
    if (auto canonical = canonical_json(request.body)) {
      return "json|" + fingerprint_material(request, headers, *canonical);
    }
    return "raw|" + fingerprint_material(request, headers, request.body);
  };
}

}  // namespace idem::http
