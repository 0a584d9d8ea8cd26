// SPDX-License-Identifier: MIT
// idem::OwnerToken: the random token naming one attempt (one call of the guard).
//
// File: owner_token.hpp
//
// Stores complete and release a key only while the token still matches, so an attempt whose
// lease expired can never overwrite the attempt that took over (fencing). Tokens come from
// OpenSSL's CSPRNG (RAND_bytes, declared in idem/detail/libcrypto.hpp: no OpenSSL header is
// included).
#pragma once

#include <pthread.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <string>

#include "idem/detail/libcrypto.hpp"
#include "idem/errors.hpp"

namespace idem {

namespace detail {
// Bumped in a forked child, so buffered random bytes of the parent are never used twice.
inline std::atomic<unsigned>& fork_generation() noexcept {
  static std::atomic<unsigned> generation{0};
  return generation;
}

/// `n` (<= 4096) bytes from OpenSSL's CSPRNG, served from a per-thread 4 KiB buffer.
/// @throws idem::UsageError if RAND_bytes fails.
inline void random_bytes(unsigned char* out, std::size_t n) {
  static const bool registered = [] {
    pthread_atfork(nullptr, nullptr, [] { fork_generation().fetch_add(1); });
    return true;
  }();
  (void)registered;
  struct Buffer {
    std::array<unsigned char, 4096> bytes{};
    std::size_t used = 4096;
    unsigned generation = 0;
  };
  thread_local Buffer buf;
  const unsigned generation = fork_generation().load(std::memory_order_relaxed);
  if (buf.used + n > buf.bytes.size() || buf.generation != generation) {
    if (RAND_bytes(buf.bytes.data(), static_cast<int>(buf.bytes.size())) != 1) {
      throw UsageError("idem::OwnerToken: RAND_bytes failed");
    }
    buf.used = 0;
    buf.generation = generation;
  }
  std::memcpy(out, buf.bytes.data() + buf.used, n);
  // Bytes handed out are wiped from the buffer.
  std::memset(buf.bytes.data() + buf.used, 0, n);
  buf.used += n;
}
}  // namespace detail

/// A random token naming one attempt: 90 random bits as 15 base64url characters
/// ([A-Za-z0-9_-]). 15 characters fit std::string's inline buffer, so a token costs no heap
/// allocation per attempt; 90 bits keep two attempts from ever sharing a token in practice
/// (a token only has to differ from the other attempts on the same key during a lease).
class OwnerToken {
 public:
  /// Characters in a generated token.
  static constexpr std::size_t kLength = 15;

  /// A fresh random token (OpenSSL RAND_bytes, a CSPRNG: tokens never repeat in practice).
  /// RAND_bytes is asked for 4 KiB at a time per thread (one call per ~340 tokens: a call
  /// costs ~0.9 us with OpenSSL 3, a round trip to Redis ~20 us); a forked child never reuses
  /// its parent's buffered bytes.
  static OwnerToken generate() {
    static constexpr char kAlphabet[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    std::array<unsigned char, 12> raw{};  // 96 bits; the 15 characters carry 90 of them
    detail::random_bytes(raw.data(), raw.size());
    std::string token(kLength, '\0');
    std::size_t out = 0;
    for (std::size_t i = 0; i < raw.size(); i += 3) {
      const unsigned v = (unsigned{raw[i]} << 16) | (unsigned{raw[i + 1]} << 8) | raw[i + 2];
      for (int shift = 18; shift >= 0 && out < kLength; shift -= 6) {
        token[out++] = kAlphabet[(v >> shift) & 0x3F];
      }
    }
    return OwnerToken(std::move(token));
  }
  /// Wraps a token read back from a store.
  static OwnerToken from_string(std::string token) { return OwnerToken(std::move(token)); }

  /// The token's characters (kLength for generated tokens; a token read from a store is kept
  /// as stored, e.g. 32 hex characters in records written by earlier versions).
  const std::string& str() const noexcept { return token_; }
  /// Same characters.
  friend bool operator==(const OwnerToken& a, const OwnerToken& b) noexcept {
    return a.token_ == b.token_;
  }
  /// Different characters.
  friend bool operator!=(const OwnerToken& a, const OwnerToken& b) noexcept { return !(a == b); }

 private:
  explicit OwnerToken(std::string token) : token_(std::move(token)) {}
  std::string token_;
};

}  // namespace idem
