// SPDX-License-Identifier: MIT
// Internal: whether bytes are well-formed UTF-8 (MySQL's text response columns, PostgreSQL's
// text fingerprint column).
#pragma once

#include <cstddef>
#include <string_view>

namespace idem::detail {

/// Whether `s` is well-formed UTF-8: shortest forms only, no surrogates, nothing beyond
/// U+10FFFF (what MySQL's utf8mb4 and PostgreSQL's UTF8 accept). NUL bytes are well-formed.
inline bool valid_utf8(std::string_view s) noexcept {
  std::size_t i = 0;
  const std::size_t n = s.size();
  while (i < n) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t len = c < 0x80           ? 1
                      : (c >> 5) == 0x6  ? 2
                      : (c >> 4) == 0xE  ? 3
                      : (c >> 3) == 0x1E ? 4
                                         : 0;
    if (len == 0 || i + len > n || (len == 2 && c < 0xC2)) return false;
    for (std::size_t k = 1; k < len; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    if (len == 3) {
      const auto c1 = static_cast<unsigned char>(s[i + 1]);
      if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 >= 0xA0)) return false;
    } else if (len == 4) {
      const auto c1 = static_cast<unsigned char>(s[i + 1]);
      if ((c == 0xF0 && c1 < 0x90) || (c == 0xF4 && c1 >= 0x90) || c > 0xF4) return false;
    }
    i += len;
  }
  return true;
}

}  // namespace idem::detail
