// SPDX-License-Identifier: MIT
// The Redis record encoding (scripts.hpp describes the format) on the C++ side, shared by the
// synchronous RedisStore and idem::async's AsyncRedisStore: keys, claim records, completed and
// refilled records, decoding and what a found record means (through the record rulebook), and
// the scripts' SHA-1. Both stores read and write exactly the same records.
#pragma once

#include <openssl/evp.h>

#include <array>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "idem/clock.hpp"
#include "idem/detail/record_rules.hpp"
#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/store.hpp"

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

/// "I1P<#owner>:<owner>": the prefix of `owner`'s in-progress record.
class ClaimPrefix : public SmallBuf {
 public:
  explicit ClaimPrefix(const OwnerToken& owner) {
    append("I1P").append(Num(static_cast<long long>(owner.str().size())).view()).append(':');
    append(owner.str());
  }
};

/// The fields of a record (views into the encoded value).
struct Decoded {
  char status = 0;
  long long created = 0;
  long long deadline = 0;
  std::string_view owner, fingerprint, response;
};

/// Decodes an idem record; false for anything idem did not write.
inline bool decode(std::string_view v, Decoded& out) {
  if (v.size() < 4 || v[0] != 'I' || v[1] != '1' ||
      !idem::detail::record_status_from_letter(v[2])) {
    return false;
  }
  out.status = v[2];
  const char* p = v.data() + 3;
  const char* const end = v.data() + v.size();
  auto number = [&](long long& n) {
    auto res = std::from_chars(p, end, n);
    if (res.ec != std::errc() || res.ptr == p || res.ptr == end || *res.ptr != ':' || n < 0) {
      return false;
    }
    p = res.ptr + 1;
    return true;
  };
  auto bytes = [&](long long n, std::string_view& field) {
    if (static_cast<unsigned long long>(n) > static_cast<unsigned long long>(end - p)) {
      return false;
    }
    field = std::string_view(p, static_cast<std::size_t>(n));
    p += n;
    return true;
  };
  long long ol = 0, fl = 0;
  if (!number(ol) || !bytes(ol, out.owner) || !number(out.created) || !number(out.deadline) ||
      !number(fl) || !bytes(fl, out.fingerprint)) {
    return false;
  }
  out.response = std::string_view(p, static_cast<std::size_t>(end - p));
  return out.status != 'P' || out.response.empty();
}

/// The in-progress record a claim by `owner` writes if the key is absent:
/// "I1P<#owner>:<owner><created>:<deadline>:<#fp>:<fp>". `head_end` and `tail_begin` mark
/// "<#owner>:<owner><created>" (from 3) and "<#fp>:<fp>" for completed_record().
inline void build_claim_record(SmallBuf& record, const OwnerToken& owner,
                               std::string_view fingerprint, std::chrono::milliseconds lease,
                               std::size_t& head_end, std::size_t& tail_begin) {
  const long long now = to_millis(system_now());
  record.append(ClaimPrefix(owner).view());
  record.append(Num(now).view());
  head_end = record.view().size();
  record.append(':').append(Num(now + lease.count()).view()).append(':');
  tail_begin = record.view().size();
  record.append(Num(static_cast<long long>(fingerprint.size())).view()).append(':');
  record.append(fingerprint);
}

/// "I1C<#owner>:<owner><created>:<deadline>:<#fp>:<fp><response>" from the in-progress
/// `record` a claim wrote (with its head_end / tail_begin).
inline void completed_record(SmallBuf& out, std::string_view record, std::size_t head_end,
                             std::size_t tail_begin, std::string_view deadline,
                             std::string_view response) {
  out.append("I1C").append(record.substr(3, head_end - 3)).append(':');
  out.append(deadline).append(':').append(record.substr(tail_begin));
  out.append(response);
}

/// The completed record `fill` writes (the owner is unknown: stored empty).
inline std::string filled_record(std::string_view fingerprint, std::string_view response,
                                 std::chrono::seconds retention) {
  std::string value;
  value.reserve(40 + fingerprint.size() + response.size());
  const long long now = to_millis(system_now());
  value.append("I1C0:").append(Num(now).view()).append(1, ':');
  value
      .append(Num(now + std::chrono::duration_cast<std::chrono::milliseconds>(retention).count())
                  .view())
      .append(1, ':');
  value.append(Num(static_cast<long long>(fingerprint.size())).view()).append(1, ':');
  value.append(fingerprint).append(response);
  return value;
}

/// What an existing record a claim found means to `owner`'s claim with `fingerprint`, by the
/// rulebook: mismatch / done / busy, or `owner`'s own claim (kept). A key that exists holds a
/// live lease (its TTL is the lease) or a record within its retention. false: not an idem
/// record (the caller reports CorruptRecord).
inline bool answer_found(std::string_view existing, std::string_view fingerprint,
                         const OwnerToken& owner, ClaimResult& result) {
  Decoded d;
  if (!decode(existing, d)) return false;
  idem::detail::FoundRecord f;
  f.status = *idem::detail::record_status_from_letter(d.status);
  f.fingerprint = d.fingerprint;
  f.owner = d.owner;
  f.response = d.response;
  f.created_at = from_millis(d.created);
  f.lease_live = f.status == Record::Status::kInProgress;
  result = std::move(idem::detail::decide_claim(f, fingerprint, owner.str()).result);
  return true;
}

/// The Record of a lookup's encoded value and PTTL (ms; negative: no TTL). nullopt: not an
/// idem record.
inline std::optional<Record> record_of(std::string_view value, long long pttl) {
  Decoded d;
  if (!decode(value, d)) return std::nullopt;
  const TimePoint now = system_now();
  Record rec;
  rec.status = *idem::detail::record_status_from_letter(d.status);
  rec.fingerprint = std::string(d.fingerprint);
  rec.owner = std::string(d.owner);
  rec.response = std::string(d.response);
  rec.created_at = from_millis(d.created);
  rec.updated_at = rec.created_at;
  const TimePoint until = pttl >= 0 ? now + std::chrono::milliseconds(pttl) : TimePoint::max();
  if (rec.status == Record::Status::kInProgress) {
    rec.lease_until = until;
  } else {
    rec.expires_at = until;
  }
  return rec;
}

/// A Lua script and its SHA-1 (for EVALSHA).
struct Script {
  explicit Script(const char* source) : text(source) {
    std::array<unsigned char, EVP_MAX_MD_SIZE> md{};
    unsigned int len = 0;
    if (EVP_Digest(text.data(), text.size(), md.data(), &len, EVP_sha1(), nullptr) != 1 ||
        len != 20) {
      throw StorageError("idem::redis: cannot compute the SHA-1 of a script");
    }
    static constexpr char kHex[] = "0123456789abcdef";
    for (unsigned i = 0; i < 20; ++i) {
      sha[2 * i] = kHex[md[i] >> 4];
      sha[2 * i + 1] = kHex[md[i] & 0x0F];
    }
  }
  std::string text;
  std::array<char, 40> sha{};
  std::string_view sha_view() const noexcept { return {sha.data(), sha.size()}; }
};

}  // namespace idem::redis::detail
