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
// Time is linear in the text's size (plus sorting each object's names) at any nesting depth;
// memory is a few times the text, plus ~150 bytes per object or array.
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

// SAX events to canonical text in time linear in the body's size (plus sorting each object's
// names), whatever its nesting: every scalar's and name's canonical text is appended once to
// one buffer, containers keep only references to their members (an object sorts those when it
// closes), and result() writes the whole value out once, walking the containers with an
// explicit stack (a body nested a million levels deep needs no call stack).
class CanonicalSax : public nlohmann::json_sax<nlohmann::json> {
 public:
  bool null() override { return scalar("null"); }
  bool boolean(bool v) override { return scalar(v ? "true" : "false"); }
  // An integer no double holds exactly (beyond 2^53, e.g. 9007199254740993) is not I-JSON:
  // the body is then fingerprinted by its bytes, so two such amounts never compare equal.
  bool number_integer(number_integer_t v) override {
    const double d = static_cast<double>(v);
    if (d >= 9223372036854775808.0 || d < -9223372036854775808.0 ||
        static_cast<number_integer_t>(d) != v) {
      return false;
    }
    return scalar(es_number(d));
  }
  bool number_unsigned(number_unsigned_t v) override {
    const double d = static_cast<double>(v);
    if (d >= 18446744073709551616.0 || static_cast<number_unsigned_t>(d) != v) return false;
    return scalar(es_number(d));
  }
  bool number_float(number_float_t v, const string_t&) override {
    if (!std::isfinite(v)) return false;
    return scalar(es_number(v));
  }
  bool string(string_t& v) override {
    const std::size_t begin = text_.size();
    es_string(text_, v);
    return value(Value{begin, text_.size(), kScalar});
  }
  bool binary(binary_t&) override { return false; }  // not produced by the text parser
  bool start_object(std::size_t) override { return open(true); }
  // The member is added with its name; its value, which the parser reports next, fills it in.
  bool key(string_t& k) override {
    const std::size_t name_begin = text_.size();
    es_string(text_, k);
    containers_[open_.back()].members.push_back(
        Member{utf16(k), name_begin, text_.size(), Value{0, 0, kScalar}});
    return true;
  }
  bool end_object() override {
    Container& c = containers_[open_.back()];
    std::sort(c.members.begin(), c.members.end(),
              [](const Member& a, const Member& b) { return a.order < b.order; });
    for (std::size_t i = 1; i < c.members.size(); ++i) {
      if (c.members[i].order == c.members[i - 1].order) return false;  // duplicate name
    }
    return close();
  }
  bool start_array(std::size_t) override { return open(false); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

  /// The canonical text of the value parsed (call once, after a successful parse).
  std::optional<std::string> result() && {
    if (!root_) return std::nullopt;
    std::string out;
    out.reserve(text_.size() + 2 * containers_.size());
    struct Step {
      std::size_t container;
      std::size_t next;  // the member or item to write next
    };
    std::vector<Step> stack;
    auto write = [&](const Value& v) {
      if (v.container == kScalar) {
        out.append(text_, v.begin, v.end - v.begin);
        return;
      }
      out += containers_[v.container].object ? '{' : '[';
      stack.push_back(Step{v.container, 0});
    };
    write(*root_);
    while (!stack.empty()) {
      Step& step = stack.back();
      const Container& c = containers_[step.container];
      const std::size_t n = c.object ? c.members.size() : c.items.size();
      if (step.next == n) {
        out += c.object ? '}' : ']';
        stack.pop_back();
        continue;
      }
      if (step.next > 0) out += ',';
      const std::size_t i = step.next++;  // before write(): it may grow `stack`
      if (c.object) {
        const Member& m = c.members[i];
        out.append(text_, m.name_begin, m.name_end - m.name_begin);
        out += ':';
        write(m.value);
      } else {
        write(c.items[i]);
      }
    }
    return out;
  }

 private:
  static constexpr std::size_t kScalar = static_cast<std::size_t>(-1);
  // A value: text_[begin, end) for a scalar (container == kScalar), else containers_[container].
  struct Value {
    std::size_t begin;
    std::size_t end;
    std::size_t container;
  };
  struct Member {
    std::u16string order;              // the name in UTF-16 code units (RFC 8785's member order)
    std::size_t name_begin, name_end;  // the name's string literal in text_
    Value value;
  };
  struct Container {
    bool object;
    std::vector<Member> members;  // an object's
    std::vector<Value> items;     // an array's
  };

  bool scalar(std::string_view text) {
    const std::size_t begin = text_.size();
    text_ += text;
    return value(Value{begin, text_.size(), kScalar});
  }
  bool open(bool object) {
    containers_.push_back(Container{object, {}, {}});
    open_.push_back(containers_.size() - 1);
    return true;
  }
  bool close() {
    const std::size_t c = open_.back();
    open_.pop_back();
    return value(Value{0, 0, c});
  }
  bool value(Value v) {
    if (open_.empty()) {
      root_ = v;
      return true;
    }
    Container& c = containers_[open_.back()];
    if (c.object) {
      c.members.back().value = v;  // the member key() added
    } else {
      c.items.push_back(v);
    }
    return true;
  }

  std::string text_;                   // every scalar's and name's canonical text, in order
  std::vector<Container> containers_;  // every container opened, by index
  std::vector<std::size_t> open_;      // the containers still open, innermost last
  std::optional<Value> root_;
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
