// SPDX-License-Identifier: MIT
// Internal: passwords masked in text that names a server (a URI, a libpq conninfo string, a
// driver's message quoting either). Used by the PostgreSQL stores' messages and by idemctl's
// store names, so both mask the same forms.
#pragma once

#include <cctype>
#include <cstddef>
#include <string>
#include <string_view>

namespace idem::detail {

/// `s` with every password replaced by "***":
/// - URI userinfo ("scheme://user:secret@host"): everything from the user name's ':' to the
///   last '@' of the line (of the quoted URI when a quote opens it: a message's closing quote
///   is the line's last one), since URI parsers split the userinfo at the last '@', so a
///   password may hold a raw '@', '#', '?', '/', '"' or a blank: more than the password is
///   masked, never less;
/// - every `password` keyword of a conninfo string or URI query, `sslpassword` too, with blanks
///   around '=' as libpq allows; a quoted value ('...', with libpq's backslash escapes) is
///   masked to its closing quote, an unquoted one to the next blank not escaped by a backslash
///   (or '&' in a URI query, whose values are percent-encoded). A message that quotes the
///   conninfo may lose its closing quote to the mask; the password is never shown.
inline std::string mask_passwords(std::string s) {
  const auto is_blank = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  for (std::size_t p = s.find("://"); p != std::string::npos; p = s.find("://", p + 3)) {
    const std::size_t start = p + 3;
    std::size_t end = s.find('\n', start);
    if (end == std::string::npos) end = s.size();
    // A URI a message quotes ("... in URI: \"postgresql://u:pw@[bad\"") ends at the line's last
    // quote; any other runs to the line's end (a password may hold a raw '"').
    std::size_t scheme = p;
    while (scheme > 0 && (std::isalnum(static_cast<unsigned char>(s[scheme - 1])) != 0 ||
                          s[scheme - 1] == '+' || s[scheme - 1] == '-' || s[scheme - 1] == '.')) {
      --scheme;
    }
    if (scheme > 0 && s[scheme - 1] == '"') {
      const std::size_t close = s.rfind('"', end - 1);
      if (close != std::string::npos && close >= start) end = close;
    }
    const std::size_t at = end == start ? std::string::npos : s.rfind('@', end - 1);
    if (at == std::string::npos || at < start) continue;
    const std::size_t colon = s.find(':', start);
    if (colon != std::string::npos && colon < at) s.replace(colon + 1, at - colon - 1, "***");
  }
  for (std::size_t p = s.find("password"); p != std::string::npos; p = s.find("password", p + 8)) {
    std::size_t v = p + 8;
    while (v < s.size() && is_blank(s[v])) ++v;
    if (v >= s.size() || s[v] != '=') continue;
    ++v;
    while (v < s.size() && is_blank(s[v])) ++v;
    std::size_t end = v;
    if (v < s.size() && s[v] == '\'') {
      for (end = v + 1; end < s.size() && s[end] != '\''; ++end) {
        if (s[end] == '\\' && end + 1 < s.size()) ++end;  // libpq: \' and \\ inside quotes
      }
      if (end < s.size()) ++end;  // the closing quote; unterminated: to the end
    } else {
      const std::size_t scheme = s.rfind("://", p);
      const std::size_t query = scheme == std::string::npos ? scheme : s.find('?', scheme);
      const bool in_query = query != std::string::npos && query < p;
      for (; end < s.size() && !is_blank(s[end]) && !(in_query && s[end] == '&'); ++end) {
        if (s[end] == '\\' && end + 1 < s.size()) ++end;  // libpq: "\ " is a blank of the value
      }
    }
    s.replace(v, end - v, "***");
  }
  return s;
}

/// A URI quoted in the message of an error about the URI itself (one its parser refused):
/// `mask_passwords`, and, when no '@' follows the "://", everything from the first ':' after it
/// to the end as well. Without an '@' a parser reads "scheme://user:secret" as a host and a
/// port, so the part after that ':' may be a password (with a raw '/' or '?' in it too); a
/// refused URI's port is shown as "***" rather than risk it. Without "://" at all (a typo:
/// "amqp:/user:secret@host"), nothing of it can be told apart: everything after its first ':'
/// is masked.
inline std::string mask_refused_uri(std::string_view uri) {
  std::string s = mask_passwords(std::string(uri));
  const std::size_t sep = s.find("://");
  if (sep != std::string::npos && s.find('@', sep + 3) != std::string::npos) return s;
  const std::size_t colon = s.find(':', sep == std::string::npos ? 0 : sep + 3);
  if (colon != std::string::npos && colon + 1 < s.size()) s.replace(colon + 1, s.npos, "***");
  return s;
}

}  // namespace idem::detail
