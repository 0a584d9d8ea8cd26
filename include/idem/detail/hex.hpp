// SPDX-License-Identifier: MIT
// Internal: bytes as lowercase hex, one table lookup per byte (fingerprints, packed
// fingerprints spelled out, tokens, script digests).
#pragma once

#include <cstddef>
#include <cstring>

namespace idem::detail {

/// The two lowercase hex digits of every byte value.
struct HexPairTable {
  char pair[256][2];
  constexpr HexPairTable() : pair() {
    constexpr char digits[] = "0123456789abcdef";
    for (int b = 0; b < 256; ++b) {
      pair[b][0] = digits[b >> 4];
      pair[b][1] = digits[b & 0x0F];
    }
  }
};
inline constexpr HexPairTable kHexPairs{};

/// Writes the 2 * `size` hex characters of `in` to `out`.
inline void write_hex(const unsigned char* in, std::size_t size, char* out) noexcept {
  for (std::size_t i = 0; i < size; ++i) std::memcpy(out + 2 * i, kHexPairs.pair[in[i]], 2);
}

}  // namespace idem::detail
