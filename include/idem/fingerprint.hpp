// SPDX-License-Identifier: MIT
// Request fingerprints: SHA-256 of the payload (OpenSSL libcrypto, declared in
// idem/detail/libcrypto.hpp: no OpenSSL header is included). Owner tokens are
// idem/owner_token.hpp (included here too).
//
// A fingerprint lets idem tell "the same request again" (replay) from "the same key with a
// different payload" (a client error, `Outcome::kFingerprintMismatch`). It is optional: pass an
// empty fingerprint everywhere and every payload matches. Fingerprints are compared exactly.
#pragma once

#include <array>
#include <string>
#include <string_view>

#include "idem/detail/hex.hpp"
#include "idem/detail/libcrypto.hpp"
#include "idem/errors.hpp"
#include "idem/owner_token.hpp"

namespace idem {

namespace detail {
inline std::string to_hex(const unsigned char* data, std::size_t size) {
  std::string out(size * 2, '0');
  write_hex(data, size, out.data());
  return out;
}

// SHA-256, fetched once. (EVP_sha256() hands out a placeholder that every EVP_DigestInit_ex
// resolves again, a provider fetch of ~3,000 instructions, more than hashing a short payload;
// an explicitly fetched EVP_MD skips that.) Null if the default provider has no SHA-256.
inline const evp_md_st* sha256() noexcept {
  static evp_md_st* const fetched = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  return fetched;
}

// One digest context per thread, reused by every fingerprint() of that thread (no allocation
// per call).
struct DigestContext {
  evp_md_ctx_st* ctx = EVP_MD_CTX_new();
  DigestContext() = default;
  DigestContext(const DigestContext&) = delete;
  DigestContext& operator=(const DigestContext&) = delete;
  ~DigestContext() { EVP_MD_CTX_free(ctx); }
};
}  // namespace detail

namespace detail {
/// Characters of a hex SHA-256 (fingerprint()'s length).
inline constexpr std::size_t kSha256HexSize = 2 * kSha256Size;

/// Writes the lower-case hex SHA-256 of `payload` to `out` (no allocation): what fingerprint()
/// returns, for callers that keep it in a buffer of their own.
/// @throws idem::UsageError only if libcrypto itself fails (it does not for SHA-256).
inline void sha256_hex(std::string_view payload, char (&out)[kSha256HexSize]) {
  std::array<unsigned char, kSha256Size> md{};
  unsigned int len = 0;
  thread_local DigestContext digest;
  if (digest.ctx == nullptr || sha256() == nullptr ||
      EVP_DigestInit_ex(digest.ctx, sha256(), nullptr) != 1 ||
      EVP_DigestUpdate(digest.ctx, payload.data(), payload.size()) != 1 ||
      EVP_DigestFinal_ex(digest.ctx, md.data(), &len) != 1 || len != kSha256Size) {
    throw UsageError("idem::fingerprint: SHA-256 failed");
  }
  write_hex(md.data(), kSha256Size, out);
}
}  // namespace detail

/// Lower-case hex SHA-256 of `payload` (64 characters).
/// @code
///   auto fp = idem::fingerprint(request.body);
/// @endcode
/// @throws idem::UsageError only if libcrypto itself fails (it does not for SHA-256).
inline std::string fingerprint(std::string_view payload) {
  char hex[detail::kSha256HexSize];
  detail::sha256_hex(payload, hex);
  return std::string(hex, sizeof hex);
}

}  // namespace idem
