// SPDX-License-Identifier: MIT
// The record encoding of the Redis store, and the Lua scripts that need server-side atomicity.
//
// A record is one Redis string:
//
//   "I1" <status P|C|F> <#owner> ":" <owner> <created_ms> ":" <deadline_ms> ":" <#fingerprint> ":"
//   <fingerprint> <response bytes ...>
//
// e.g. "I1C32:<32 hex>1700000000000:1700086400000:64:<64 hex>pay_1". Lengths are decimal byte
// counts, so any bytes may appear in the owner, fingerprint and response. An in-progress record
// (P) has no response bytes; its PX TTL is the lease. A completed one (C) has the response, a
// failed one (F, a dead-lettered message) the failure reason; their TTL is the retention. The
// letters are the rulebook's (idem/detail/record_rules.hpp, record_status_letter). `deadline_ms` is when the TTL ends (the writer's clock); it is only used
// to put a record back exactly as it was (see kCompleteFastScript). Anything else under an idem
// key (another type, a string without this header, a truncated one) is a foreign value:
// idem::CorruptRecord, and a script never raises on it.
//
// The owner comes first so that "is this still my claim?" is one prefix comparison against
// "I1P<#owner>:<owner>" (the length prefix makes it exact).
//
// claim is not a script on Redis >= 7.0: `SET key <in-progress record> NX PX <lease> GET` claims
// an absent key, or changes nothing and returns the existing record, in one command; the client
// decodes it (busy / done / mismatch). kClaimScript does the same for older servers, which
// reject NX together with GET.
#pragma once

namespace idem::redis::detail {

// parse(v): deadline_ms (a string) and the offset after the owner when v is a well-formed
// record, else nil.
// Only called on the rare paths that must tell a lost lease from a foreign value.
#define IDEM_REDIS_LUA_VALID                                            \
  "local function parse(v)\n"                                           \
  "  local st, ol, p = string.match(v, '^I1([PCF])(%d+):()')\n"         \
  "  if not st then return nil end\n"                                   \
  "  local q = p + tonumber(ol)\n"                                      \
  "  if q - 1 > #v then return nil end\n"                               \
  "  local c, d, fl, r = string.match(v, '^(%d+):(%d+):(%d+):()', q)\n" \
  "  if not c then return nil end\n"                                    \
  "  local e = r + tonumber(fl) - 1\n"                                  \
  "  if e > #v then return nil end\n"                                   \
  "  if st == 'P' and e ~= #v then return nil end\n"                    \
  "  return d, q\n"                                                     \
  "end\n"

/// claim (servers without SET NX GET): ARGV in-progress record, lease_ms.
/// -> nil (claimed) | the existing record | the WRONGTYPE error of a foreign type.
inline constexpr const char* kClaimScript =
    "local v = redis.pcall('GET', KEYS[1])\n"
    "if type(v) == 'table' then return v end\n"
    "if v then return v end\n"
    "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])\n"
    "return false\n";

/// complete, when the client knows its exact in-progress record (it claimed on this thread):
/// ARGV in-progress record, completed record, retention_ms. One write in the common case: the
/// completed record replaces whatever is there, and if that was not this claim (lease lost),
/// it is put back with its own deadline before the script ends (scripts are atomic: nobody
/// sees the swap). -> 1 | 0 (lease lost) | {9, reason} (foreign value).
inline constexpr const char* kCompleteFastScript = IDEM_REDIS_LUA_VALID
    "local old = redis.pcall('SET', KEYS[1], ARGV[2], 'XX', 'PX', ARGV[3], 'GET')\n"
    "if type(old) == 'table' then\n"
    "  if string.sub(tostring(old.err), 1, 9) == 'WRONGTYPE' then return {9, old.err} end\n"
    "  return old\n"
    "end\n"
    "if old == ARGV[1] then return 1 end\n"
    "if not old then return 0 end\n"
    "local d = parse(old)\n"
    "if d and #d <= 15 and tonumber(d) > 0 then\n"
    "  redis.call('SET', KEYS[1], old, 'PXAT', d)\n"
    "  return 0\n"
    "end\n"
    "redis.call('SET', KEYS[1], old)\n"
    "if d then return 0 end\n"
    "return {9, 'not an idem record'}\n";

/// complete (and fail), general form: ARGV "I1P<#owner>:<owner>", response, retention_ms,
/// deadline_ms, status letter ('C' completed, 'F' failed).
/// -> 1 | 0 (lease lost: absent, completed, or another owner) | {9, reason} (foreign value).
inline constexpr const char* kCompleteScript = IDEM_REDIS_LUA_VALID
    "local v = redis.pcall('GET', KEYS[1])\n"
    "if type(v) == 'table' then return {9, tostring(v.err)} end\n"
    "if not v then return 0 end\n"
    "if string.sub(v, 1, #ARGV[1]) == ARGV[1] then\n"
    "  local d, q = parse(v)\n"
    "  if not d then return {9, 'not an idem record'} end\n"
    "  local c, rest = string.match(v, '^(%d+):%d+:()', q)\n"
    "  redis.call('SET', KEYS[1], 'I1' .. ARGV[5] .. string.sub(v, 4, q - 1) .. c .. ':' ..\n"
    "             ARGV[4] ..\n"
    "             ':' .. string.sub(v, rest) .. ARGV[2], 'PX', ARGV[3])\n"
    "  return 1\n"
    "end\n"
    "if parse(v) then return 0 end\n"
    "return {9, 'not an idem record'}\n";

/// release: ARGV "I1P<#owner>:<owner>". -> 1 | 0 (not held) | {9, reason}.
inline constexpr const char* kReleaseScript = IDEM_REDIS_LUA_VALID
    "local v = redis.pcall('GET', KEYS[1])\n"
    "if type(v) == 'table' then return {9, tostring(v.err)} end\n"
    "if not v then return 0 end\n"
    "if string.sub(v, 1, #ARGV[1]) == ARGV[1] and parse(v) then\n"
    "  redis.call('DEL', KEYS[1])\n"
    "  return 1\n"
    "end\n"
    "if parse(v) then return 0 end\n"
    "return {9, 'not an idem record'}\n";

/// lookup: no ARGV. -> 0 absent | {record, pttl} | {9, reason} (the record is decoded in C++).
inline constexpr const char* kLookupScript =
    "local v = redis.pcall('GET', KEYS[1])\n"
    "if type(v) == 'table' then return {9, tostring(v.err)} end\n"
    "if not v then return 0 end\n"
    "return {v, redis.call('PTTL', KEYS[1])}\n";

#undef IDEM_REDIS_LUA_VALID

}  // namespace idem::redis::detail
