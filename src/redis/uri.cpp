// SPDX-License-Identifier: MIT
// Parsing of RedisStoreOptions::uri (see uri.hpp).
#include "uri.hpp"

#include <charconv>

#include "idem/detail/redact.hpp"
#include "idem/errors.hpp"

namespace idem::redis::detail {
namespace {

[[noreturn]] void bad(std::string_view shown, const std::string& why) {
  throw UsageError("idem::redis: invalid URI '" + idem::detail::mask_refused_uri(shown) +
                   "': " + why +
                   " (expected redis://[[user]:password@]host[:port][/db], rediss://... (TLS) "
                   "or unix:///path[?db=N])");
}

int hex_value(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string percent_decode(std::string_view s, std::string_view shown) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out.push_back(s[i]);
      continue;
    }
    if (i + 2 >= s.size()) bad(shown, "truncated %-escape in user or password");
    int hi = hex_value(s[i + 1]);
    int lo = hex_value(s[i + 2]);
    if (hi < 0 || lo < 0) bad(shown, "bad %-escape in user or password");
    out.push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  return out;
}

int parse_number(std::string_view s, int max, std::string_view shown, const char* what) {
  int value = 0;
  if (s.empty()) bad(shown, std::string("empty ") + what);
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || ptr != s.data() + s.size() || value < 0 || value > max) {
    // The value is not echoed: in a URI without '@' it may be a password ("redis://u:secret").
    bad(shown,
        std::string("the ") + what + " is not a number between 0 and " + std::to_string(max));
  }
  return value;
}

}  // namespace

Endpoint parse_uri(std::string_view uri) {
  Endpoint ep;
  std::string_view rest;
  bool is_unix = false;
  // A masked copy for messages: the userinfo part never appears in an exception, whatever the
  // scheme (even one this parser refuses).
  std::string shown(uri);
  if (auto last_at = uri.rfind('@'); last_at != std::string_view::npos) {
    auto sep = uri.find("://");
    std::size_t from = sep == std::string_view::npos ? 0 : sep + 3;
    if (from <= last_at)
      shown = std::string(uri.substr(0, from)) + "***" + std::string(uri.substr(last_at));
  }
  auto scheme_end = uri.find("://");
  if (scheme_end == std::string_view::npos) bad(shown, "no scheme");
  std::string_view scheme = uri.substr(0, scheme_end);
  rest = uri.substr(scheme_end + 3);
  if (scheme == "unix") {
    is_unix = true;
  } else if (scheme == "rediss") {
    ep.tls = true;
  } else if (scheme != "redis" && scheme != "tcp") {
    bad(shown, "unknown scheme '" + std::string(scheme) + "'");
  }
  // userinfo: everything before the last '@' (a password may contain '@' only %-escaped, but
  // the last '@' is the safe split either way).
  auto at = rest.rfind('@');
  if (at != std::string_view::npos) {
    std::string_view userinfo = rest.substr(0, at);
    shown = std::string(scheme) + "://***@" + std::string(rest.substr(at + 1));
    auto colon = userinfo.find(':');
    if (colon == std::string_view::npos) {
      bad(shown, "the userinfo has no ':' (write redis://:password@host)");
    }
    ep.user = percent_decode(userinfo.substr(0, colon), shown);
    ep.password = percent_decode(userinfo.substr(colon + 1), shown);
    if (ep.password.empty()) bad(shown, "empty password");
    rest = rest.substr(at + 1);
  }
  ep.display = shown;

  if (is_unix) {
    ep.unix_socket = true;
    auto q = rest.find('?');
    std::string_view path = rest.substr(0, q);
    if (path.empty() || path.front() != '/') bad(shown, "a Unix socket path must be absolute");
    ep.path = std::string(path);
    if (q != std::string_view::npos) {
      std::string_view query = rest.substr(q + 1);
      if (query.compare(0, 3, "db=") != 0) bad(shown, "the only query parameter is db=N");
      ep.db = parse_number(query.substr(3), 1 << 20, shown, "database number");
    }
    return ep;
  }

  auto slash = rest.find('/');
  std::string_view hostport = rest.substr(0, slash);
  if (slash != std::string_view::npos) {
    std::string_view db = rest.substr(slash + 1);
    if (!db.empty()) ep.db = parse_number(db, 1 << 20, shown, "database number");
  }
  if (hostport.empty()) bad(shown, "no host");
  std::string_view host = hostport;
  std::string_view port;
  if (hostport.front() == '[') {
    auto close = hostport.find(']');
    if (close == std::string_view::npos) bad(shown, "unclosed '[' in an IPv6 address");
    host = hostport.substr(1, close - 1);
    std::string_view after = hostport.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') bad(shown, "garbage after ']'");
      port = after.substr(1);
      if (port.empty()) bad(shown, "empty port");
    }
  } else {
    auto colon = hostport.find(':');
    if (colon != std::string_view::npos) {
      host = hostport.substr(0, colon);
      port = hostport.substr(colon + 1);
      if (port.empty()) bad(shown, "empty port");
    }
  }
  if (host.empty()) bad(shown, "no host");
  if (host.find_first_of("?#/ ") != std::string_view::npos) bad(shown, "bad host");
  ep.host = std::string(host);
  if (!port.empty()) {
    ep.port = parse_number(port, 65535, shown, "port");
    if (ep.port == 0) bad(shown, "port 0");
  }
  return ep;
}

}  // namespace idem::redis::detail
