// SPDX-License-Identifier: MIT
// Internal: fingerprints in PostgreSQL's `fingerprint text` column (PostgresStore and
// AsyncPostgresStore).
//
// idem takes any bytes as a fingerprint (a raw 32-byte digest, say), and the other stores keep
// them as given. A text value holds neither NUL bytes nor invalid UTF-8 (in a UTF8 database):
// bound as text, the first was cut at the NUL (the same fingerprint then read as a mismatch) and
// the second refused by the server on every call (SQLSTATE 22021). So a fingerprint that is not
// NUL-free, valid UTF-8, or that begins with the marker byte 0x01, is stored as the marker
// followed by its bytes in lowercase hex; every other fingerprint (idem::fingerprint's hex,
// anything printable) as it is, the form every earlier record has. The mapping is one-to-one:
// comparing stored forms compares fingerprints, and lookup() gives the bytes back.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "idem/detail/hex.hpp"
#include "idem/detail/packed_fingerprint.hpp"
#include "idem/detail/utf8.hpp"

namespace idem::postgres::detail {

/// First byte of a fingerprint stored in hex (never the first byte of one stored as given).
inline constexpr char kHexFingerprintMarker = '\x01';

/// True when `s` is well-formed UTF-8 without NUL bytes: what a text value of a UTF8 database
/// holds.
inline bool text_holds(std::string_view s) noexcept {
  return s.find('\0') == std::string_view::npos && idem::detail::valid_utf8(s);
}

/// A caller's fingerprint in the form the column stores (see the file comment). Holds a view
/// of `fingerprint` when it is stored as given: keep that alive while text() is used.
class TextFingerprint {
 public:
  explicit TextFingerprint(std::string_view fingerprint) : given_(fingerprint) {
    if (fingerprint.empty() ||
        (fingerprint.front() != kHexFingerprintMarker && text_holds(fingerprint))) {
      return;
    }
    hex_.assign(1 + 2 * fingerprint.size(), kHexFingerprintMarker);
    idem::detail::write_hex(reinterpret_cast<const unsigned char*>(fingerprint.data()),
                            fingerprint.size(), hex_.data() + 1);
  }
  TextFingerprint(const TextFingerprint&) = delete;
  TextFingerprint& operator=(const TextFingerprint&) = delete;

  /// The stored form.
  std::string_view text() const noexcept { return hex_.empty() ? given_ : hex_; }

 private:
  std::string_view given_;
  std::string hex_;  // the marker and the hex, when not stored as given
};

/// The fingerprint a stored form stands for (a value without the marker, or not in its form,
/// as it is).
inline std::string fingerprint_from_text(std::string text) {
  if (text.empty() || text.front() != kHexFingerprintMarker || text.size() % 2 == 0) return text;
  std::string bytes((text.size() - 1) / 2, '\0');
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    const int hi = idem::detail::lower_hex_value(text[1 + 2 * i]);
    const int lo = idem::detail::lower_hex_value(text[2 + 2 * i]);
    if (hi < 0 || lo < 0) return text;
    bytes[i] = static_cast<char>((hi << 4) | lo);
  }
  return bytes;
}

}  // namespace idem::postgres::detail
