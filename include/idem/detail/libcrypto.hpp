// SPDX-License-Identifier: MIT
// The libcrypto (OpenSSL 3) functions idem's header-only core calls, declared here so that no
// public header of idem includes an OpenSSL header (internal).
//
// File: detail/libcrypto.hpp (internal: fingerprint.hpp and owner_token.hpp include it)
//
// The core hashes fingerprints (SHA-256) and draws owner tokens (RAND_bytes) inline, on the
// hot path of a guarded call, and links libcrypto (idem::core links OpenSSL::Crypto, >= 3.0).
// Including <openssl/evp.h> for that would put OpenSSL's macros and declarations into every
// translation unit that includes idem. These declarations are exactly OpenSSL 3's (same names,
// same parameter types through the same incomplete struct types), so a translation unit may
// include both, in either order: tests/headers/libcrypto_matches_openssl.cpp compiles them
// together (against <openssl/evp.h> and <openssl/rand.h>) and fails if one ever differs.
#pragma once

#include <cstddef>

extern "C" {
struct evp_md_ctx_st;    // EVP_MD_CTX
struct evp_md_st;        // EVP_MD
struct engine_st;        // ENGINE
struct ossl_lib_ctx_st;  // OSSL_LIB_CTX

evp_md_ctx_st* EVP_MD_CTX_new(void);
void EVP_MD_CTX_free(evp_md_ctx_st* ctx);
evp_md_st* EVP_MD_fetch(ossl_lib_ctx_st* ctx, const char* algorithm, const char* properties);
int EVP_DigestInit_ex(evp_md_ctx_st* ctx, const evp_md_st* type, engine_st* impl);
int EVP_DigestUpdate(evp_md_ctx_st* ctx, const void* d, std::size_t cnt);
int EVP_DigestFinal_ex(evp_md_ctx_st* ctx, unsigned char* md, unsigned int* s);
int RAND_bytes(unsigned char* buf, int num);
}

namespace idem::detail {
/// Bytes of a SHA-256 digest.
inline constexpr std::size_t kSha256Size = 32;
}  // namespace idem::detail
