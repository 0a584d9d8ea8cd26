// SPDX-License-Identifier: MIT
// The record encoding of the Redis fast store: one Redis string per key. Every writer and
// reader of records on the C++ side goes through this header (the Lua side, which only parses,
// is IDEM_REDIS_LUA_VALID in scripts.hpp).
//
// Format 2 (written since schema 2; binary: 40 bytes for a completed record with an idem
// fingerprint and an empty response, which Redis keeps as one embedded string):
//
//   in progress:          <tag> <owner> <created_ms: 6 bytes> <deadline_ms: 6 bytes> <fingerprint>
//   completed or failed:  <tag> <created_ms: 6 bytes> <fingerprint> <response bytes ...>
//
//   tag:         0xA0 | status (1 in progress, 2 completed, 3 failed) | 0x08 if the owner is
//                packed
//   owner:       packed: 12 bytes (a generated token: 15 base64url characters, 6 bits each)
//                | <length: 1 byte> + the bytes as given
//   fingerprint: 'H' + 32 bytes (idem::fingerprint's 64 lowercase hex characters, packed)
//                | 'R' + <length: 4 bytes> + the bytes as given
//
// Integers are big-endian. An in-progress record's PX TTL is the lease; `deadline_ms` (when the
// lease ends, the writer's clock) is kept to put it back exactly as it was
// (kCompleteFastScript). A completed or failed record's TTL is the retention. It keeps neither
// the owner token (which only matters while the lease is live: a duplicate answered by Redis
// reports an empty holder; the durable store keeps the token) nor a deadline (put back, it
// gets the retention of the write that displaced it): with them it would be 57 bytes, past
// Redis's 44-byte embedded strings, and cost 152 bytes of MEMORY USAGE instead of 136.
//
// Format 1 (written before schema 2; still read, and completed or released in its own format):
//
//   "I1" <P|C|F> <#owner> ":" <owner> <created_ms> ":" <deadline_ms> ":" <#fingerprint> ":"
//   <fingerprint> <response bytes ...>          (lengths and times in decimal)
//
// The owner comes right after the status in both, so "is this still my claim?" is one prefix
// comparison against the claim prefix (exact: the owner has a fixed or a prefixed length).
// Anything else under an idem key is a foreign value (idem::CorruptRecord).
#pragma once

#include <array>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "idem/clock.hpp"
#include "idem/detail/packed_fingerprint.hpp"
#include "idem/detail/record_rules.hpp"
#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/store.hpp"

namespace idem::redis::detail {

inline constexpr std::size_t kTimeBytes = 6;  // milliseconds since the epoch, 48 bits
inline constexpr std::size_t kPackedFingerprint = idem::detail::kPackedFingerprintSize;
inline constexpr std::size_t kPackedOwner = 12;  // 15 base64url characters, 6 bits each
inline constexpr std::size_t kMaxOwner = 255;    // an owner as given has a one-byte length
inline constexpr unsigned char kTagBase = 0xA0, kTagPackedOwner = 0x08;

inline unsigned char status_code(char letter) noexcept {
  return letter == 'P' ? 1 : letter == 'C' ? 2 : 3;
}

inline constexpr char kBase64url[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

// The 6-bit value of every base64url character (0xFF: not one).
struct Base64urlTable {
  unsigned char value[256];
  constexpr Base64urlTable() : value() {
    for (int c = 0; c < 256; ++c) value[c] = 0xFF;
    for (int i = 0; i < 64; ++i) {
      value[static_cast<unsigned char>(kBase64url[i])] = static_cast<unsigned char>(i);
    }
  }
};
inline constexpr Base64urlTable kBase64urlValue{};

// Packs `owner` into `out` (12 bytes) when it is a generated token's shape
// (OwnerToken::kLength base64url characters, 6 bits each, then 6 zero bits); false otherwise.
inline bool try_pack_owner(std::string_view owner, char* out) noexcept {
  if (owner.size() != OwnerToken::kLength) return false;
  unsigned bad = 0;
  for (std::size_t i = 0, o = 0; i < OwnerToken::kLength + 1; i += 4, o += 3) {
    unsigned v[4];
    for (std::size_t j = 0; j < 4; ++j) {
      v[j] = i + j < owner.size() ? kBase64urlValue.value[static_cast<unsigned char>(owner[i + j])]
                                  : 0;
      bad |= v[j];
    }
    const unsigned w = (v[0] << 18) | (v[1] << 12) | (v[2] << 6) | (v[3] & 0x3F);
    out[o] = static_cast<char>(w >> 16);
    out[o + 1] = static_cast<char>((w >> 8) & 0xFF);
    out[o + 2] = static_cast<char>(w & 0xFF);
  }
  return (bad & 0xC0) == 0;
}

// A buffer with append(std::string_view) (SmallBuf, std::string).
template <class Out>
void append_time(Out& out, long long ms) {
  std::array<char, kTimeBytes> b{};
  auto v = static_cast<unsigned long long>(ms < 0 ? 0 : ms);
  for (std::size_t i = kTimeBytes; i-- > 0;) {
    b[i] = static_cast<char>(v & 0xFF);
    v >>= 8;
  }
  out.append(std::string_view(b.data(), b.size()));
}

inline long long read_time(const char* p) noexcept {
  unsigned long long v = 0;
  for (std::size_t i = 0; i < kTimeBytes; ++i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return static_cast<long long>(v);
}

template <class Out>
void append_fingerprint(Out& out, std::string_view fp) {
  std::array<char, 1 + kPackedFingerprint> b;
  if (idem::detail::try_pack_fingerprint(fp, b.data() + 1)) {
    b[0] = 'H';
    out.append(std::string_view(b.data(), b.size()));
    return;
  }
  const auto n = static_cast<unsigned long long>(fp.size());
  if (n > 0xFFFFFFFFull) throw UsageError("idem::redis: a fingerprint must be below 4 GiB");
  const char len[] = {'R', static_cast<char>(n >> 24), static_cast<char>((n >> 16) & 0xFF),
                      static_cast<char>((n >> 8) & 0xFF), static_cast<char>(n & 0xFF)};
  out.append(std::string_view(len, sizeof len));
  out.append(fp);
}

// <tag> <owner>: the prefix of `owner`'s in-progress record.
template <class Out>
void append_claim_prefix(Out& out, std::string_view owner) {
  std::array<char, 1 + kPackedOwner> b;
  if (try_pack_owner(owner, b.data() + 1)) {
    b[0] = static_cast<char>(kTagBase | kTagPackedOwner | status_code('P'));
    out.append(std::string_view(b.data(), b.size()));
    return;
  }
  if (owner.size() > kMaxOwner) {
    throw UsageError("idem::redis: an owner token must be at most 255 bytes");
  }
  const char head[] = {static_cast<char>(kTagBase | status_code('P')),
                       static_cast<char>(owner.size())};
  out.append(std::string_view(head, sizeof head));
  out.append(owner);
}

// "I1P<#owner>:<owner>": the prefix of a format-1 claim of `owner` (scripts accept both).
template <class Out>
void append_v1_claim_prefix(Out& out, std::string_view owner) {
  std::array<char, 24> n{};
  auto res = std::to_chars(n.data(), n.data() + n.size(), owner.size());
  out.append(std::string_view("I1P"));
  out.append(std::string_view(n.data(), static_cast<std::size_t>(res.ptr - n.data())));
  out.append(std::string_view(":"));
  out.append(owner);
}

// An in-progress record. `owner_end` receives the offset of <created_ms>, which
// append_completed needs.
template <class Out>
void append_claim_record(Out& out, std::string_view owner, std::string_view fingerprint,
                         long long created_ms, long long deadline_ms, std::size_t& owner_end) {
  const std::size_t before = out.view().size();
  append_claim_prefix(out, owner);
  owner_end = out.view().size() - before;
  append_time(out, created_ms);
  append_time(out, deadline_ms);
  append_fingerprint(out, fingerprint);
}

/// The tag byte of a completed ('C') or failed ('F') record.
inline char final_tag(char letter) noexcept {
  return static_cast<char>(kTagBase | status_code(letter));
}

// The completed record of the in-progress `claim` (append_claim_record's, owner_end its
// offset): its creation time and fingerprint.
template <class Out>
void append_completed(Out& out, std::string_view claim, std::size_t owner_end,
                      std::string_view response) {
  const char tag = final_tag('C');
  out.append(std::string_view(&tag, 1));
  out.append(claim.substr(owner_end, kTimeBytes));
  out.append(claim.substr(owner_end + 2 * kTimeBytes));
  out.append(response);
}

// A completed record written without a claim (fill: the durable store decided).
template <class Out>
void append_filled(Out& out, std::string_view fingerprint, long long created_ms,
                   std::string_view response) {
  const char tag = final_tag('C');
  out.append(std::string_view(&tag, 1));
  append_time(out, created_ms);
  append_fingerprint(out, fingerprint);
  out.append(response);
}

/// A record as read back (either format). The views point into the decoded value, except a
/// packed owner or fingerprint, unpacked into `owner_chars` / `hex` (do not copy a Decoded).
struct Decoded {
  char status = 0;
  int format = 0;
  long long created = 0;
  long long deadline = 0;  // 0: none kept (format 2, completed or failed)
  // owner: empty in format-2 completed and failed records (not kept)
  std::string_view owner, fingerprint, response;
  std::array<char, OwnerToken::kLength> owner_chars{};
  std::array<char, 2 * kPackedFingerprint> hex{};
};

namespace codec {

inline bool decode_v1(std::string_view v, Decoded& out) {
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
  return true;
}

inline bool decode_v2(std::string_view v, Decoded& out) {
  const auto tag = static_cast<unsigned char>(v[0]);
  std::size_t p = 1;
  if (out.status != 'P') {
    if (tag & kTagPackedOwner) return false;
  } else if (tag & kTagPackedOwner) {
    if (kPackedOwner > v.size() - p) return false;
    unsigned acc = 0;
    int bits = 0;
    std::size_t n = 0;
    for (std::size_t i = 0; i < kPackedOwner && n < out.owner_chars.size(); ++i) {
      acc = (acc << 8) | static_cast<unsigned char>(v[p + i]);
      bits += 8;
      while (bits >= 6 && n < out.owner_chars.size()) {
        bits -= 6;
        out.owner_chars[n++] = kBase64url[(acc >> bits) & 0x3F];
      }
    }
    out.owner = std::string_view(out.owner_chars.data(), out.owner_chars.size());
    p += kPackedOwner;
  } else {
    if (p >= v.size()) return false;
    const std::size_t len = static_cast<unsigned char>(v[p++]);
    if (len > v.size() - p) return false;
    out.owner = v.substr(p, len);
    p += len;
  }
  const std::size_t times = (out.status == 'P' ? 2 : 1) * kTimeBytes;
  if (times + 1 > v.size() - p) return false;
  out.created = read_time(v.data() + p);
  out.deadline = out.status == 'P' ? read_time(v.data() + p + kTimeBytes) : 0;
  p += times;
  const char kind = v[p++];
  if (kind == 'H') {
    if (kPackedFingerprint > v.size() - p) return false;
    idem::detail::unpack_fingerprint(v.data() + p, out.hex.data());
    out.fingerprint = std::string_view(out.hex.data(), out.hex.size());
    p += kPackedFingerprint;
  } else if (kind == 'R') {
    if (4 > v.size() - p) return false;
    unsigned long long n = 0;
    for (std::size_t i = 0; i < 4; ++i) n = (n << 8) | static_cast<unsigned char>(v[p + i]);
    p += 4;
    if (n > v.size() - p) return false;
    out.fingerprint = v.substr(p, static_cast<std::size_t>(n));
    p += static_cast<std::size_t>(n);
  } else {
    return false;
  }
  out.response = v.substr(p);
  return true;
}

}  // namespace codec

/// Decodes `v` (format 1 or 2) into `out`; false for anything that is not an idem record.
inline bool decode(std::string_view v, Decoded& out) {
  if (v.empty()) return false;
  const auto tag = static_cast<unsigned char>(v[0]);
  if ((tag & 0xF0) == kTagBase && (tag & 0x04) == 0 && (tag & 0x03) != 0) {
    out.format = 2;
    out.status = "PCF"[(tag & 0x03) - 1];
    if (!codec::decode_v2(v, out)) return false;
  } else if (v.size() >= 4 && v[0] == 'I' && v[1] == '1' &&
             idem::detail::record_status_from_letter(v[2])) {
    out.format = 1;
    out.status = v[2];
    if (!codec::decode_v1(v, out)) return false;
  } else {
    return false;
  }
  return out.status != 'P' || out.response.empty();
}

/// The in-progress record a claim of `owner` writes now for `lease` (append_claim_record).
template <class Out>
void append_new_claim(Out& out, std::string_view owner, std::string_view fingerprint,
                      std::chrono::milliseconds lease, std::size_t& owner_end) {
  const long long now = to_millis(system_now());
  append_claim_record(out, owner, fingerprint, now, now + lease.count(), owner_end);
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

/// The Record of a decoded value and its PTTL (ms; negative: no TTL).
inline Record record_of(const Decoded& d, long long pttl) {
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

/// The Record of a lookup's encoded value and PTTL (ms; negative: no TTL). nullopt: not an
/// idem record.
inline std::optional<Record> record_of(std::string_view value, long long pttl) {
  Decoded d;
  if (!decode(value, d)) return std::nullopt;
  return record_of(d, pttl);
}

}  // namespace idem::redis::detail
