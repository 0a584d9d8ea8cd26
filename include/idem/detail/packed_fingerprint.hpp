// SPDX-License-Identifier: MIT
// Internal: a fingerprint in idem::fingerprint's form (64 lowercase hex characters, SHA-256)
// stored as its 32 bytes, by the stores whose record layouts keep fingerprints packed (Redis
// format 2, SQLite layout 2). Any other fingerprint is stored as given, so every string
// round-trips.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace idem::detail {

/// Bytes of a packed fingerprint.
inline constexpr std::size_t kPackedFingerprintSize = 32;

/// The value of a lowercase hex digit, or -1.
constexpr int lower_hex_value(char c) noexcept {
  return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/// Whether `fp` packs into 32 bytes and unpacks to the same characters.
inline bool packable_fingerprint(std::string_view fp) noexcept {
  if (fp.size() != 2 * kPackedFingerprintSize) return false;
  for (char c : fp) {
    if (lower_hex_value(c) < 0) return false;
  }
  return true;
}

/// Writes the 32 bytes of a packable `fp` to `out`.
inline void pack_fingerprint(std::string_view fp, char* out) noexcept {
  for (std::size_t i = 0; i < kPackedFingerprintSize; ++i) {
    out[i] = static_cast<char>((lower_hex_value(fp[2 * i]) << 4) | lower_hex_value(fp[2 * i + 1]));
  }
}

/// Writes the 64 hex characters of the packed fingerprint `in` (32 bytes) to `out`.
inline void unpack_fingerprint(const char* in, char* out) noexcept {
  static constexpr char kDigits[] = "0123456789abcdef";
  for (std::size_t i = 0; i < kPackedFingerprintSize; ++i) {
    const auto b = static_cast<unsigned char>(in[i]);
    out[2 * i] = kDigits[b >> 4];
    out[2 * i + 1] = kDigits[b & 0x0F];
  }
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
