// SPDX-License-Identifier: MIT
// idem/detail/libcrypto.hpp declares the libcrypto functions the core calls without including
// OpenSSL. Declared again by OpenSSL's own headers in the same translation unit, any difference
// (a parameter type, the linkage) fails to compile. IDEM_OPENSSL_FIRST picks the order.
#ifdef IDEM_OPENSSL_FIRST
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include "idem/fingerprint.hpp"
#else
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include "idem/fingerprint.hpp"
#endif

#include <type_traits>

// The incomplete types idem names are OpenSSL's own.
static_assert(std::is_same_v<evp_md_ctx_st, EVP_MD_CTX>);
static_assert(std::is_same_v<evp_md_st, EVP_MD>);
static_assert(std::is_same_v<engine_st, ENGINE>);
static_assert(std::is_same_v<ossl_lib_ctx_st, OSSL_LIB_CTX>);
static_assert(idem::detail::kSha256Size == SHA256_DIGEST_LENGTH);

#ifdef IDEM_OPENSSL_FIRST
std::string idem_header_check_fingerprint_openssl_first(std::string_view s) {
  return idem::fingerprint(s) + idem::OwnerToken::generate().str();
}
#else
std::string idem_header_check_fingerprint_idem_first(std::string_view s) {
  return idem::fingerprint(s) + idem::OwnerToken::generate().str();
}
#endif
