// SPDX-License-Identifier: MIT
// The pieces of a Redis command that the synchronous RedisStore and idem::async's
// AsyncRedisStore build alike: decimal numbers and bytes on the stack, the record's Redis key,
// the claim prefix that fences an owner's writes, and a script with its SHA-1 (EVALSHA).
// Internal to the Redis adapters (src/redis, src/async).
#pragma once

#include <openssl/evp.h>

#include <array>
#include <charconv>
#include <cstddef>
#include <cstring>
#include <string>
#include <string_view>

#include "idem/detail/hex.hpp"
#include "idem/errors.hpp"
#include "idem/key.hpp"
#include "idem/store.hpp"
#include "record_codec.hpp"

namespace idem::redis::detail {

/// A decimal integer formatted on the stack (no allocation per call).
class Num {
 public:
  explicit Num(long long value) noexcept {
    auto res = std::to_chars(buf_.data(), buf_.data() + buf_.size(), value);
    len_ = static_cast<std::size_t>(res.ptr - buf_.data());
  }
  std::string_view view() const noexcept { return {buf_.data(), len_}; }

 private:
  std::array<char, 24> buf_{};
  std::size_t len_ = 0;
};

/// Bytes built on the stack when they fit (keys and claim records of ordinary size do), else
/// on the heap: no allocation per call on the hot path.
class SmallBuf {
 public:
  SmallBuf() = default;
  SmallBuf(const SmallBuf&) = delete;
  SmallBuf& operator=(const SmallBuf&) = delete;
  SmallBuf& append(std::string_view s) {
    if (heap_.empty() && size_ + s.size() <= inline_.size()) {
      if (!s.empty()) std::memcpy(inline_.data() + size_, s.data(), s.size());
    } else {
      if (heap_.empty()) heap_.assign(inline_.data(), size_);
      heap_.append(s.data(), s.size());
    }
    size_ += s.size();
    return *this;
  }
  SmallBuf& append(char c) { return append(std::string_view(&c, 1)); }
  std::string_view view() const noexcept {
    return heap_.empty() ? std::string_view(inline_.data(), size_) : std::string_view(heap_);
  }

 private:
  std::array<char, 320> inline_;
  std::string heap_;
  std::size_t size_ = 0;
};

/// prefix + "{" + scope + "|" + id + "}" (always inline with the default prefix: at most
/// 5 + 1 + 64 + 1 + 128 + 1 = 200 bytes).
class RedisKey : public SmallBuf {
 public:
  RedisKey(const std::string& prefix, const Key& key) {
    append(prefix).append('{').append(key.scope()).append(kKeySeparator).append(key.id());
    append('}');
  }
};

/// The prefix of `owner`'s in-progress record (record_codec.hpp), in format 2 or format 1.
class ClaimPrefix : public SmallBuf {
 public:
  explicit ClaimPrefix(const OwnerToken& owner, int format = 2) {
    if (format == 2) {
      append_claim_prefix(*this, owner.str());
    } else {
      append_v1_claim_prefix(*this, owner.str());
    }
  }
};

/// A Lua script and its SHA-1 (for EVALSHA).
struct Script {
  explicit Script(const char* source) : text(source) {
    std::array<unsigned char, EVP_MAX_MD_SIZE> md{};
    unsigned int len = 0;
    if (EVP_Digest(text.data(), text.size(), md.data(), &len, EVP_sha1(), nullptr) != 1 ||
        len != 20) {
      throw StorageError("idem::redis: cannot compute the SHA-1 of a script");
    }
    idem::detail::write_hex(md.data(), 20, sha.data());
  }
  std::string text;
  std::array<char, 40> sha{};
  std::string_view sha_view() const noexcept { return {sha.data(), sha.size()}; }
};

}  // namespace idem::redis::detail
