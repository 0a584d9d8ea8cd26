// SPDX-License-Identifier: MIT
// Internal: a fingerprint in idem::fingerprint's form (64 lowercase hex characters, SHA-256)
// stored as its 32 bytes, by the stores whose record layouts keep fingerprints packed (Redis
// format 2, SQLite layout 2). Any other fingerprint is stored as given, so every string
// round-trips.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "idem/detail/hex.hpp"

namespace idem::detail {

/// Bytes of a packed fingerprint.
inline constexpr std::size_t kPackedFingerprintSize = 32;

/// The value of a lowercase hex digit, or -1.
constexpr int lower_hex_value(char c) noexcept {
  return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/// lower_hex_value of every byte, as a table (0xFF: not a lowercase hex digit).
struct LowerHexTable {
  unsigned char value[256];
  constexpr LowerHexTable() : value() {
    for (int c = 0; c < 256; ++c) {
      const int v = lower_hex_value(static_cast<char>(c));
      value[c] = static_cast<unsigned char>(v < 0 ? 0xFF : v);
    }
  }
};
inline constexpr LowerHexTable kLowerHex{};

/// Packs `fp` into `out` (32 bytes) when it is 64 lowercase hex characters; false otherwise
/// (`out` then holds garbage). One pass: a packed fingerprint unpacks to the same characters.
inline bool try_pack_fingerprint(std::string_view fp, char* out) noexcept {
  if (fp.size() != 2 * kPackedFingerprintSize) return false;
  unsigned bad = 0;
  for (std::size_t i = 0; i < kPackedFingerprintSize; ++i) {
    const unsigned hi = kLowerHex.value[static_cast<unsigned char>(fp[2 * i])];
    const unsigned lo = kLowerHex.value[static_cast<unsigned char>(fp[2 * i + 1])];
    bad |= hi | lo;
    out[i] = static_cast<char>((hi << 4) | (lo & 0x0F));
  }
  return (bad & 0xF0) == 0;
}

/// Writes the 64 hex characters of the packed fingerprint `in` (32 bytes) to `out`.
inline void unpack_fingerprint(const char* in, char* out) noexcept {
  write_hex(reinterpret_cast<const unsigned char*>(in), kPackedFingerprintSize, out);
}

/// Unpacks `fp` in place; false (unchanged) when it is not 32 bytes.
inline bool unpack_hex_fingerprint(std::string& fp) {
  if (fp.size() != kPackedFingerprintSize) return false;
  std::string hex(2 * kPackedFingerprintSize, '0');
  unpack_fingerprint(fp.data(), hex.data());
  fp.swap(hex);
  return true;
}

}  // namespace idem::detail
