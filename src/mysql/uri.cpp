// SPDX-License-Identifier: MIT
// mysql:// URIs: parse_uri.
#include <charconv>
#include <string>

#include "idem/detail/redact.hpp"
#include "idem/errors.hpp"
#include "idem/mysql/client.hpp"

namespace idem::mysql {
namespace {

[[noreturn]] void bad(std::string_view uri, const std::string& why) {
  // The password is never echoed: a URI with an '@' not at all, one without with everything
  // after its first ':' masked ("mysql://idem:secret" reads as a host and a port).
  std::string shown =
      uri.find('@') == std::string_view::npos ? idem::detail::mask_refused_uri(uri) : "";
  throw UsageError("idem::mysql: bad connection URI" +
                   (shown.empty() ? std::string() : " '" + shown + "'") + ": " + why +
                   " (expected mysql://user:password@host:port/database?key=value)");
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string decode(std::string_view uri, std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%') {
      if (i + 2 >= s.size()) bad(uri, "truncated %-escape");
      int hi = hex_value(s[i + 1]), lo = hex_value(s[i + 2]);
      if (hi < 0 || lo < 0) bad(uri, "bad %-escape");
      out.push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

unsigned long number(std::string_view uri, std::string_view what, std::string_view v,
                     unsigned long max) {
  unsigned long n = 0;
  auto r = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || r.ec != std::errc() || r.ptr != v.data() + v.size() || n > max) {
    bad(uri, std::string(what) + " is not a number up to " + std::to_string(max));
  }
  return n;
}

}  // namespace

ConnectionOptions parse_uri(std::string_view uri) {
  ConnectionOptions o;
  std::string_view rest = uri;
  if (rest.substr(0, 8) == "mysql://") {
    rest.remove_prefix(8);
  } else if (rest.substr(0, 10) == "mariadb://") {
    rest.remove_prefix(10);
  } else {
    bad(uri, "the scheme must be mysql:// or mariadb://");
  }
  std::string_view query;
  if (auto q = rest.find('?'); q != std::string_view::npos) {
    // A '?' before the '@' is in the user or password (never echoed): they must encode it.
    if (rest.find('@', q) != std::string_view::npos) {
      bad(uri, "a '?', '/' or '#' in the user or password must be percent-encoded (%3F, %2F, %23)");
    }
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  // The user information ends at the last '@' (as Redis's parser and libpq read it), before
  // the path is split off: a raw '/' in a password must not end the host there (the password
  // would be read as a port, echoed in the error, or sent as the database name).
  if (auto at = rest.rfind('@'); at != std::string_view::npos) {
    std::string_view userinfo = rest.substr(0, at);
    rest = rest.substr(at + 1);
    if (auto colon = userinfo.find(':'); colon != std::string_view::npos) {
      o.user = decode(uri, userinfo.substr(0, colon));
      o.password = decode(uri, userinfo.substr(colon + 1));
    } else {
      o.user = decode(uri, userinfo);
    }
  }
  std::string_view path;
  if (auto slash = rest.find('/'); slash != std::string_view::npos) {
    path = rest.substr(slash + 1);
    rest = rest.substr(0, slash);
  }
  std::string_view port;
  if (!rest.empty() && rest.front() == '[') {
    auto close = rest.find(']');
    if (close == std::string_view::npos) bad(uri, "unclosed '[' in the host");
    o.host = std::string(rest.substr(1, close - 1));
    rest = rest.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') bad(uri, "unexpected text after the host");
      port = rest.substr(1);
    }
  } else if (auto colon = rest.rfind(':'); colon != std::string_view::npos) {
    o.host = std::string(rest.substr(0, colon));
    port = rest.substr(colon + 1);
    if (o.host.find(':') != std::string::npos) {
      bad(uri, "an IPv6 address as host goes in brackets: mysql://user@[::1]:3306/db");
    }
  } else {
    o.host = std::string(rest);
  }
  if (o.host.empty()) bad(uri, "no host");
  if (!port.empty() || rest.find(':') != std::string_view::npos) {
    o.port = static_cast<unsigned>(number(uri, "port", port, 65535));
    if (o.port == 0) bad(uri, "port 0");
  }
  o.database = decode(uri, path);
  if (o.database.find('/') != std::string::npos) bad(uri, "the database name has a '/'");
  while (!query.empty()) {
    auto amp = query.find('&');
    std::string_view item = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (item.empty()) continue;
    auto eq = item.find('=');
    if (eq == std::string_view::npos) bad(uri, "option '" + std::string(item) + "' has no value");
    std::string_view key = item.substr(0, eq);
    std::string value = decode(uri, item.substr(eq + 1));
    if (key == "connect_timeout") {
      o.connect_timeout = std::chrono::seconds(number(uri, key, value, 3600));
    } else if (key == "read_timeout") {
      o.read_timeout = std::chrono::seconds(number(uri, key, value, 86400));
    } else if (key == "write_timeout") {
      o.write_timeout = std::chrono::seconds(number(uri, key, value, 86400));
    } else if (key == "socket") {
      o.unix_socket = value;
    } else if (key == "tls") {
      if (value != "true" && value != "false") bad(uri, "tls must be true or false");
      o.tls = value == "true";
    } else if (key == "tls_ca") {
      o.tls_ca = value;
    } else if (key == "tls_cert") {
      o.tls_cert = value;
    } else if (key == "tls_key") {
      o.tls_key = value;
    } else {
      bad(uri, "unknown option '" + std::string(key) +
                   "' (known: connect_timeout, read_timeout, write_timeout, socket, tls, tls_ca,"
                   " tls_cert, tls_key)");
    }
  }
  for (auto t : {o.connect_timeout, o.read_timeout, o.write_timeout}) {
    if (t.count() == 0) bad(uri, "timeouts must be at least 1 second");
  }
  return o;
}

}  // namespace idem::mysql
