// SPDX-License-Identifier: MIT
// The Lua scripts of the Redis store that need server-side atomicity.
//
// Records are encoded as record_codec.hpp says (format 2, and format 1 of earlier versions,
// which is still read, completed and released in its own format). The scripts only parse a
// record (IDEM_REDIS_LUA_VALID) to tell a lost lease from a foreign value, and to find its
// deadline; the client builds every record it writes, except the completed record of the general
// complete script, which splices the claim's creation time and fingerprint. Anything else
// under an idem key (another type, a string without a record header, a truncated one) is a
// foreign value: idem::CorruptRecord, and a script never raises on it. A heartbeat's extension
// changes a claim's TTL only: the TTL, not a deadline written in the record, is the live lease.
//
// claim is not a script on Redis >= 7.0: `SET key <in-progress record> NX PX <lease> GET` claims
// an absent key, or changes nothing and returns the existing record, in one command; the client
// decodes it (busy / done / mismatch). kClaimScript does the same for older servers, which
// reject NX together with GET.
#pragma once

namespace idem::redis::detail {

// parse(v): deadline_ms (a decimal string; '' for a completed or failed record of format 2,
// which keeps none) and the offset of the creation time (just after the owner) when v is a
// well-formed record of either format, else nil.
// Only called on the rare paths that must tell a lost lease from a foreign value.
#define IDEM_REDIS_LUA_VALID                                            \
  "local function parse(v)\n"                                           \
  "  local t = string.byte(v, 1)\n"                                     \
  "  if t and t >= 160 and t < 176 then\n"                              \
  "    local st, low = (t - 160) % 4, t - 160\n"                        \
  "    if st == 0 or low % 8 >= 4 then return nil end\n"                \
  "    local q = 2\n"                                                   \
  "    if st ~= 1 then\n"                                               \
  "      if low >= 8 then return nil end\n"                             \
  "    elseif low >= 8 then\n"                                          \
  "      q = 14\n"                                                      \
  "    else\n"                                                          \
  "      if #v < 2 then return nil end\n"                               \
  "      q = 3 + string.byte(v, 2)\n"                                   \
  "    end\n"                                                           \
  "    local k = q + 6\n"                                               \
  "    if st == 1 then k = k + 6 end\n"                                 \
  "    if k > #v then return nil end\n"                                 \
  "    local kind, e = string.sub(v, k, k), nil\n"                      \
  "    if kind == 'H' then\n"                                           \
  "      e = k + 32\n"                                                  \
  "    elseif kind == 'R' and k + 4 <= #v then\n"                       \
  "      local a, b, c, d = string.byte(v, k + 1, k + 4)\n"             \
  "      e = k + 4 + ((a * 256 + b) * 256 + c) * 256 + d\n"             \
  "    else\n"                                                          \
  "      return nil\n"                                                  \
  "    end\n"                                                           \
  "    if e > #v then return nil end\n"                                 \
  "    if st ~= 1 then return '', q end\n"                              \
  "    if e ~= #v then return nil end\n"                                \
  "    local d = 0\n"                                                   \
  "    for i = q + 6, q + 11 do d = d * 256 + string.byte(v, i) end\n"  \
  "    return string.format('%.0f', d), q\n"                            \
  "  end\n"                                                             \
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

/// complete, when the client knows its exact in-progress record (the claim's ticket):
/// ARGV in-progress record, completed record, retention_ms. One write in the common case: the
/// completed record replaces whatever is there, and if that was not this claim (lease lost),
/// it is put back before the script ends (scripts are atomic: nobody sees the swap) with the TTL
/// it had, read first (a heartbeat may have extended that claim past the deadline its record
/// names); without one, with its own deadline (a completed record of format 2, which keeps no
/// deadline, gets retention_ms).
/// -> 1 | 0 (lease lost) | {9, reason} (foreign value).
inline constexpr const char* kCompleteFastScript = IDEM_REDIS_LUA_VALID
    "local ttl = redis.call('PTTL', KEYS[1])\n"
    "local old = redis.pcall('SET', KEYS[1], ARGV[2], 'XX', 'PX', ARGV[3], 'GET')\n"
    "if type(old) == 'table' then\n"
    "  if string.sub(tostring(old.err), 1, 9) == 'WRONGTYPE' then return {9, old.err} end\n"
    "  return old\n"
    "end\n"
    "if old == ARGV[1] then return 1 end\n"
    "if not old then return 0 end\n"
    "local d = parse(old)\n"
    "if d and ttl > 0 then\n"
    "  redis.call('SET', KEYS[1], old, 'PX', ttl)\n"
    "  return 0\n"
    "end\n"
    "if d == '' then\n"
    "  redis.call('SET', KEYS[1], old, 'PX', ARGV[3])\n"
    "  return 0\n"
    "end\n"
    "if d and #d <= 15 and tonumber(d) > 0 then\n"
    "  redis.call('SET', KEYS[1], old, 'PXAT', d)\n"
    "  return 0\n"
    "end\n"
    "redis.call('SET', KEYS[1], old)\n"
    "if d then return 0 end\n"
    "return {9, 'not an idem record'}\n";

/// complete (and fail), general form: ARGV claim prefix (format 2: <tag> <owner>), response,
/// retention_ms, the tag of the record to write (format 2: no owner), its status letter ('C'
/// completed, 'F' failed), claim prefix in format 1 ("I1P<#owner>:<owner>"), deadline_ms (decimal,
/// for format 1).
/// -> 1 | 0 (lease lost: absent, completed, or another owner) | {9, reason} (foreign value).
inline constexpr const char* kCompleteScript = IDEM_REDIS_LUA_VALID
    "local v = redis.pcall('GET', KEYS[1])\n"
    "if type(v) == 'table' then return {9, tostring(v.err)} end\n"
    "if not v then return 0 end\n"
    "if string.sub(v, 1, #ARGV[1]) == ARGV[1] then\n"
    "  local d, q = parse(v)\n"
    "  if not d then return {9, 'not an idem record'} end\n"
    "  redis.call('SET', KEYS[1], ARGV[4] .. string.sub(v, q, q + 5) .. string.sub(v, q + 12) ..\n"
    "             ARGV[2], 'PX', ARGV[3])\n"
    "  return 1\n"
    "end\n"
    "if string.sub(v, 1, #ARGV[6]) == ARGV[6] then\n"
    "  local d, q = parse(v)\n"
    "  if not d then return {9, 'not an idem record'} end\n"
    "  local c, rest = string.match(v, '^(%d+):%d+:()', q)\n"
    "  redis.call('SET', KEYS[1], 'I1' .. ARGV[5] .. string.sub(v, 4, q - 1) .. c .. ':' ..\n"
    "             ARGV[7] .. ':' .. string.sub(v, rest) .. ARGV[2], 'PX', ARGV[3])\n"
    "  return 1\n"
    "end\n"
    "if parse(v) then return 0 end\n"
    "return {9, 'not an idem record'}\n";

// The body of an owner-checked single-key script: GET the record; when it is this claim's (its
// bytes start with ARGV[1], the claim prefix in format 2, or ARGV[2], in format 1) and well
// formed, run `call` (the arguments of one redis.call) and answer 1; another idem record: 0;
// anything else: {9, reason}.
#define IDEM_REDIS_LUA_IF_MINE(call)                             \
  IDEM_REDIS_LUA_VALID                                           \
  "local v = redis.pcall('GET', KEYS[1])\n"                      \
  "if type(v) == 'table' then return {9, tostring(v.err)} end\n" \
  "if not v then return 0 end\n"                                 \
  "local mine = string.sub(v, 1, #ARGV[1]) == ARGV[1] or\n"      \
  "             string.sub(v, 1, #ARGV[2]) == ARGV[2]\n"         \
  "if mine and parse(v) then\n"                                  \
  "  redis.call(" call                                           \
  ")\n"                                                          \
  "  return 1\n"                                                 \
  "end\n"                                                        \
  "if parse(v) then return 0 end\n"                              \
  "return {9, 'not an idem record'}\n"

/// release: ARGV claim prefix in format 2, in format 1 (as kCompleteScript).
/// -> 1 | 0 (not held) | {9, reason}.
inline constexpr const char* kReleaseScript = IDEM_REDIS_LUA_IF_MINE("'DEL', KEYS[1]");

/// extend (the guard's heartbeat): ARGV claim prefix in format 2, in format 1 (as
/// kCompleteScript), lease_ms. Only the TTL changes, so the bytes a native complete compares
/// stay this claim's. -> 1 | 0 (not held) | {9, reason}.
inline constexpr const char* kExtendScript = IDEM_REDIS_LUA_IF_MINE("'PEXPIRE', KEYS[1], ARGV[3]");

/// lookup: no ARGV. -> 0 absent | {record, pttl} | {9, reason} (the record is decoded in C++).
inline constexpr const char* kLookupScript =
    "local v = redis.pcall('GET', KEYS[1])\n"
    "if type(v) == 'table' then return {9, tostring(v.err)} end\n"
    "if not v then return 0 end\n"
    "return {v, redis.call('PTTL', KEYS[1])}\n";

#undef IDEM_REDIS_LUA_IF_MINE
#undef IDEM_REDIS_LUA_VALID

}  // namespace idem::redis::detail
