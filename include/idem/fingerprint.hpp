// SPDX-License-Identifier: MIT
// Request fingerprints (SHA-256 of the payload, OpenSSL libcrypto) and per-attempt owner tokens.
//
// A fingerprint lets idem tell "the same request again" (replay) from "the same key with a
// different payload" (a client error, `Outcome::kFingerprintMismatch`). It is optional: pass an
// empty fingerprint everywhere and every payload matches. Fingerprints are compared exactly.
//
// An owner token names one attempt (one call of the guard). Stores complete and release a key
// only while the token still matches, so an attempt whose lease expired can never overwrite the
// attempt that took over (fencing).
#pragma once

#include <openssl/evp.h>
#include <openssl/rand.h>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "idem/errors.hpp"

namespace idem {

namespace detail {
inline std::string to_hex(const unsigned char* data, std::size_t size) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(size * 2, '0');
  for (std::size_t i = 0; i < size; ++i) {
    out[2 * i] = kDigits[data[i] >> 4];
    out[2 * i + 1] = kDigits[data[i] & 0x0F];
  }
  return out;
}
}  // namespace detail

/// Lower-case hex SHA-256 of `payload` (64 characters).
/// @code
///   auto fp = idem::fingerprint(request.body);
/// @endcode
/// @throws idem::UsageError only if libcrypto itself fails (it does not for SHA-256).
inline std::string fingerprint(std::string_view payload) {
  std::array<unsigned char, EVP_MAX_MD_SIZE> md{};
  unsigned int len = 0;
  if (EVP_Digest(payload.data(), payload.size(), md.data(), &len, EVP_sha256(), nullptr) != 1) {
    throw UsageError("idem::fingerprint: EVP_Digest(SHA-256) failed");
  }
  return detail::to_hex(md.data(), len);
}

/// A random 128-bit token naming one attempt, as 32 lower-case hex characters.
class OwnerToken {
 public:
  /// A fresh random token (OpenSSL RAND_bytes, a CSPRNG: tokens never repeat in practice).
  static OwnerToken generate() {
    std::array<unsigned char, 16> raw{};
    if (RAND_bytes(raw.data(), static_cast<int>(raw.size())) != 1) {
      throw UsageError("idem::OwnerToken: RAND_bytes failed");
    }
    return OwnerToken(detail::to_hex(raw.data(), raw.size()));
  }
  /// Wraps a token read back from a store.
  static OwnerToken from_string(std::string token) { return OwnerToken(std::move(token)); }

  /// The 32-character hex form.
  const std::string& str() const noexcept { return token_; }
  friend bool operator==(const OwnerToken& a, const OwnerToken& b) noexcept {
    return a.token_ == b.token_;
  }
  friend bool operator!=(const OwnerToken& a, const OwnerToken& b) noexcept { return !(a == b); }

 private:
  explicit OwnerToken(std::string token) : token_(std::move(token)) {}
  std::string token_;
};

}  // namespace idem
