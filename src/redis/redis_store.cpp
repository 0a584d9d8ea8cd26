// SPDX-License-Identifier: MIT
// idem::redis::RedisStore: claim / complete / release / fill / lookup over the pool.
#include "idem/redis/redis_store.hpp"

#include <hiredis/hiredis.h>
#include <hiredis/sds.h>
#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "command_parts.hpp"
#include "errors.hpp"
#include "hiredis_handles.hpp"
#include "idem/detail/record_rules.hpp"
#include "idem/errors.hpp"
#include "local_tier.hpp"
#include "pool.hpp"
#include "record_codec.hpp"
#include "router.hpp"
#include "scripts.hpp"
#include "uri.hpp"

namespace idem::redis {
namespace {

using detail::ClaimPrefix;
using detail::Failure;
using detail::Num;
using detail::RedisKey;
using detail::ReplyUPtr;
using detail::Script;
using detail::SmallBuf;

// The byte strings of one batch call in one buffer: add() while building (the buffer may move,
// so slots are offsets), then view() once building is done. No allocation per message.
class BatchBuffer {
 public:
  BatchBuffer(std::size_t slots, std::size_t bytes) {
    slots_.reserve(slots);
    bytes_.reserve(bytes);
  }
  std::size_t add(std::string_view s) {
    slots_.emplace_back(bytes_.size(), s.size());
    bytes_.append(s);
    return slots_.size() - 1;
  }
  std::string_view view(std::size_t slot) const {
    return std::string_view(bytes_).substr(slots_[slot].first, slots_[slot].second);
  }

 private:
  std::string bytes_;
  std::vector<std::pair<std::size_t, std::size_t>> slots_;  // offset, length
};

// Formats one command as RESP ("*<argc>\r\n" then "$<len>\r\n<arg>\r\n" per argument) on the
// stack: hiredis's own argv formatting builds the command from several heap strings per call,
// a measurable share of a one-round-trip claim's client CPU.
void format_command(SmallBuf& cmd, int argc, const char** argv, const std::size_t* lens) {
  cmd.append('*').append(Num(argc).view()).append("\r\n");
  for (int i = 0; i < argc; ++i) {
    cmd.append('$').append(Num(static_cast<long long>(lens[i])).view()).append("\r\n");
    cmd.append(std::string_view(argv[i], lens[i])).append("\r\n");
  }
}

// Buffers one command on `c` (format_command).
int append_command(redisContext* c, int argc, const char** argv, const std::size_t* lens) {
  SmallBuf cmd;
  format_command(cmd, argc, argv, lens);
  const std::string_view v = cmd.view();
  return redisAppendFormattedCommand(c, v.data(), v.size());
}

// What a granted claim hands on to its completion (ClaimTicket::state): the Redis key and the
// in-progress record written (one buffer), where the record's owner token ends, and when the
// claim was sent. complete_claimed then knows the exact record it expects: within the lease
// margin it replaces it with one native SET ... XX, past it with one write in
// kCompleteFastScript. A ticket is checked against the key and the owner it completes for.
struct HeldClaim {
  std::string bytes;           // the Redis key, then the record (detail::append_claim_record)
  std::size_t key_size = 0;
  std::size_t owner_end = 0;   // where the record's creation time starts
  std::chrono::steady_clock::time_point sent_at{};  // just before the claim was sent
  std::chrono::milliseconds lease{0};
  std::string_view redis_key() const noexcept {
    return std::string_view(bytes).substr(0, key_size);
  }
  std::string_view record() const noexcept { return std::string_view(bytes).substr(key_size); }
};

enum class Op { kClaim, kComplete, kFail, kRelease, kExtend, kFill, kLookup };

const char* op_name(Op op) noexcept {
  switch (op) {
    case Op::kClaim:
      return "claim";
    case Op::kComplete:
      return "complete";
    case Op::kFail:
      return "fail";
    case Op::kRelease:
      return "release";
    case Op::kExtend:
      return "extend";
    case Op::kFill:
      return "fill";
    case Op::kLookup:
      return "lookup";
  }
  return "call";
}

// Whether a timed-out reply leaves the write's outcome unknown (claims are decided by the
// durable store anyway, so a claim timeout stays a plain StorageTimeout).
bool write_may_apply(Op op) noexcept {
  return op == Op::kComplete || op == Op::kFail || op == Op::kRelease || op == Op::kExtend ||
         op == Op::kFill;
}

std::string describe(Op op, std::string_view key) {
  std::string s = op_name(op);
  s.push_back(' ');
  s.append(key);
  return s;
}

bool is_string(const redisReply* r) noexcept {
  return r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS;
}
std::string_view text_of(const redisReply* r) noexcept { return {r->str, r->len}; }

[[noreturn]] void protocol_error(Op op, std::string_view key, std::string_view detail) {
  std::string what = describe(op, key);
  detail::throw_error(Failure{Failure::Kind::kProtocol, what, detail});
}

[[noreturn]] void corrupt(Op op, std::string_view key, std::string_view reason) {
  std::string what = describe(op, key);
  detail::throw_error(Failure{Failure::Kind::kCorrupt, what, reason});
}

using detail::decode;
using detail::Decoded;

// The largest pool_size and waits RedisStoreOptions takes (see normalise).
constexpr std::size_t kMaxPoolSize = 10000;
constexpr std::chrono::milliseconds kMaxWait = std::chrono::hours(24);

template <class Duration>
std::chrono::milliseconds positive_ms(Duration d, std::chrono::milliseconds fallback) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(d);
  return ms.count() > 0 ? ms : fallback;
}

}  // namespace

class IDEM_LOCAL RedisStore::Impl {
 public:
  explicit Impl(RedisStoreOptions options)
      : options_(normalise(std::move(options))),
        router_(detail::parse_topology(options_.uri), settings(options_),
                options_.topology_refresh_interval, options_.sentinel_check_interval),
        claim_(detail::kClaimScript),
        complete_(detail::kCompleteScript),
        complete_fast_(detail::kCompleteFastScript),
        release_(detail::kReleaseScript),
        extend_(detail::kExtendScript),
        lookup_(detail::kLookupScript),
        native_claim_(!options_.claim_script),
        tier_(make_tier()) {}

  // The local tier (RedisStoreOptions::local_tier), or null.
  std::unique_ptr<detail::LocalTier> make_tier() {
    const LocalTierOptions& t = options_.local_tier;
    if (!t.enabled) return nullptr;
    detail::LocalTierSettings s;
    s.max_entries = t.max_entries;
    s.max_bytes = t.max_bytes;
    s.ttl_when_untracked = t.ttl_when_untracked;
    s.log = t.log;
    s.key_prefix = options_.key_prefix;
    s.retry = std::max(options_.reconnect_backoff, std::chrono::milliseconds(100));
    return std::make_unique<detail::LocalTier>(std::move(s), [this] { return serving_nodes(); });
  }

  // The nodes whose writes the local tier must hear (called from the tier's thread every
  // 100 ms): the one server, the Sentinel master now, every Cluster master owning slots.
  // pool_for drives discovery and the Sentinel's periodic master check.
  std::vector<detail::Pool*> serving_nodes() {
    if (router_.name() != "redis") {
      try {
        (void)router_.pool_for(std::string_view());
      } catch (const Error&) {
        // None known now: the router's last view stands.
      }
    }
    return router_.serving_nodes();
  }

  static RedisStoreOptions normalise(RedisStoreOptions o) {
    if (o.pool_size == 0) o.pool_size = 8;
    // Bounds a deployment never needs to pass, so that none overflows a deadline (now + a
    // huge wait read as "already passed") or reaches hiredis as an invalid timeout: a
    // configuration error, said at construction instead of as a retryable failure per call.
    if (o.pool_size > kMaxPoolSize) {
      throw UsageError("idem::redis: RedisStoreOptions::pool_size " + std::to_string(o.pool_size) +
                       " is above " + std::to_string(kMaxPoolSize) +
                       " (a Redis server's default maxclients)");
    }
    const std::pair<const char*, std::chrono::milliseconds> waits[] = {
        {"connect_timeout", o.connect_timeout},
        {"command_timeout", o.command_timeout},
        {"pool_wait_timeout", o.pool_wait_timeout},
        {"reconnect_backoff", o.reconnect_backoff},
        {"topology_refresh_interval", o.topology_refresh_interval},
        {"sentinel_check_interval", o.sentinel_check_interval}};
    for (const auto& [name, wait] : waits) {
      if (wait > kMaxWait) {
        throw UsageError("idem::redis: RedisStoreOptions::" + std::string(name) + " is " +
                         std::to_string(wait.count()) + " ms, above a day");
      }
    }
    o.connect_timeout = positive_ms(o.connect_timeout, std::chrono::milliseconds(500));
    o.command_timeout = positive_ms(o.command_timeout, std::chrono::milliseconds(1000));
    if (o.pool_wait_timeout.count() < 0) {
      throw UsageError("idem::redis: RedisStoreOptions::pool_wait_timeout must not be negative");
    }
    if (o.reconnect_backoff.count() < 0) {
      throw UsageError("idem::redis: RedisStoreOptions::reconnect_backoff must not be negative");
    }
    o.topology_refresh_interval =
        positive_ms(o.topology_refresh_interval, std::chrono::milliseconds(100));
    if (o.sentinel_check_interval.count() < 0) {
      throw UsageError(
          "idem::redis: RedisStoreOptions::sentinel_check_interval must not be negative");
    }
    if (!(o.native_complete_fraction >= 0.0 && o.native_complete_fraction <= 0.9)) {
      throw UsageError(
          "idem::redis: RedisStoreOptions::native_complete_fraction must be in [0, 0.9]");
    }
    if (o.local_tier.enabled) {
      if (o.local_tier.max_entries == 0) o.local_tier.max_entries = 10000;
      if (o.local_tier.max_bytes == 0) o.local_tier.max_bytes = std::size_t{16} << 20;
      if (o.local_tier.ttl_when_untracked.count() < 0) {
        throw UsageError(
            "idem::redis: RedisStoreOptions::local_tier.ttl_when_untracked must not be negative");
      }
    }
    if (o.key_prefix.find_first_of("{}") != std::string::npos) {
      throw UsageError(
          "idem::redis: RedisStoreOptions::key_prefix must not contain '{' or '}' "
          "(they delimit the Redis Cluster hash tag)");
    }
    return o;
  }

  static detail::PoolSettings settings(const RedisStoreOptions& o) {
    detail::PoolSettings s;
    s.size = o.pool_size;
    s.connect_timeout = o.connect_timeout;
    s.command_timeout = o.command_timeout;
    s.wait_timeout = o.pool_wait_timeout;
    s.reconnect_backoff = o.reconnect_backoff;
    s.auto_pipeline = o.auto_pipeline;
    // TLS for rediss:// (one server). Sentinel and Cluster parse their nodes as redis://.
    detail::Topology t = detail::parse_topology(o.uri);
    if (t.kind == detail::Topology::Kind::kSingle) {
      s.tls = detail::make_tls(t.endpoints.front(), o.tls, "RedisStoreOptions");
    } else if (o.tls.any()) {
      throw UsageError(
          "idem::redis: RedisStoreOptions::tls is set, but TLS is supported for "
          "rediss:// (one server) only, not for Sentinel or Cluster URIs");
    }
    return s;
  }

  // One command on a lent connection. A connection-level failure drops the connection and
  // throws; an error reply is returned (the caller decides).
  ReplyUPtr exec(detail::Pool::Lease& conn, int argc, const char** argv, const std::size_t* lens,
                 Op op, std::string_view key) {
    errno = 0;
    if (append_command(conn.get(), argc, argv, lens) != REDIS_OK) {
      context_failure(conn, op, key, false);
    }
    return read_reply(conn, op, key);
  }

  // A connection-level failure (c->err set): drops the connection and throws the typed error.
  // `sent`: the command had gone out whole (the reply was being read).
  [[noreturn]] static void context_failure(detail::Pool::Lease& conn, Op op, std::string_view key,
                                           bool sent) {
    redisContext* c = conn.get();
    const int saved_errno = errno;
    const int err = c->err;
    const std::string errstr = c->errstr;
    conn.discard(detail::server_gone(err, saved_errno));
    const std::string what = describe(op, key);
    detail::throw_error(Failure{Failure::Kind::kContext, what, errstr, err, saved_errno,
                                write_may_apply(op), sent});
  }

  // One command on `pool`: queued on its auto-pipeline when it has one, else on a lent
  // connection. A connection-level failure throws; an error reply is returned.
  ReplyUPtr send(detail::Pool& pool, Op op, std::string_view key, int argc, const char** argv,
                 const std::size_t* lens) {
    if (detail::Pipeline* pipeline = pool.pipeline()) {
      SmallBuf cmd;
      format_command(cmd, argc, argv, lens);
      return pipeline->call(cmd.view(), op_name(op), key, write_may_apply(op));
    }
    detail::Pool::Lease conn = pool.acquire(op_name(op));
    return exec(conn, argc, argv, lens, op, key);
  }

  // One command for `key`, sent to the node that serves it. In a cluster, MOVED (slot moved:
  // the map is re-read) and ASK (slot being migrated: ASKING, then this one command on the
  // importing node) are followed, a few hops at most. Connection failures and replies saying
  // the node is no longer a writable master make the router re-discover the layout.
  ReplyUPtr command(Op op, std::string_view key, int argc, const char** argv,
                    const std::size_t* lens) {
    try {
      detail::Pool* pool = &router_.pool_for(key);
      bool asking = false;
      for (int hop = 0;; ++hop) {
        ReplyUPtr r;
        if (asking) {
          // ASKING and the command on one connection, back to back: never pipelined.
          detail::Pool::Lease conn = pool->acquire(op_name(op));
          const char* ask_argv[] = {"ASKING"};
          const std::size_t ask_lens[] = {6};
          ReplyUPtr ok = exec(conn, 1, ask_argv, ask_lens, op, key);
          if (ok->type == REDIS_REPLY_ERROR) server_error(ok.get(), op, key);
          r = exec(conn, argc, argv, lens, op, key);
        } else {
          r = send(*pool, op, key, argc, argv, lens);
        }
        if (r->type != REDIS_REPLY_ERROR) return r;
        const std::string_view text = text_of(r.get());
        if (router_.clustered() && hop < kMaxHops) {
          if (auto redirect = detail::parse_redirect(text)) {
            detail::Pool* next = &router_.node(*redirect, *pool);
            if (redirect->ask) {
              router_.asked();
            } else {
              router_.moved(*redirect, *pool);
            }
            asking = redirect->ask;
            pool = next;
            continue;
          }
        }
        if (text.compare(0, 8, "READONLY") == 0 || text.compare(0, 10, "MASTERDOWN") == 0 ||
            text.compare(0, 11, "CLUSTERDOWN") == 0 || text.compare(0, 7, "LOADING") == 0) {
          router_.failed();
        }
        return r;
      }
    } catch (const StorageError&) {
      router_.failed();
      throw;
    }
  }

  [[noreturn]] static void server_error(const redisReply* r, Op op, std::string_view key) {
    const std::string what = describe(op, key);
    detail::throw_error(Failure{Failure::Kind::kServer, what, text_of(r)});
  }

  // EVALSHA with up to 7 arguments; on NOSCRIPT (a restarted or flushed server) runs the
  // script once with EVAL, which also loads it. Error replies throw.
  ReplyUPtr eval(const Script& script, Op op, std::string_view key,
                 std::initializer_list<std::string_view> args) {
    const char* argv[11];
    std::size_t lens[11];
    argv[0] = "EVALSHA";
    lens[0] = 7;
    argv[1] = script.sha.data();
    lens[1] = script.sha.size();
    argv[2] = "1";
    lens[2] = 1;
    argv[3] = key.data();
    lens[3] = key.size();
    int argc = 4;
    for (std::string_view a : args) {
      argv[argc] = a.data();
      lens[argc] = a.size();
      ++argc;
    }
    ReplyUPtr reply = command(op, key, argc, argv, lens);
    if (reply->type == REDIS_REPLY_ERROR && text_of(reply.get()).substr(0, 8) == "NOSCRIPT") {
      // A restarted, flushed or new (failover, another cluster node) server: EVAL sends the
      // text, runs it, and caches it there for the next EVALSHA.
      argv[0] = "EVAL";
      lens[0] = 4;
      argv[1] = script.text.data();
      lens[1] = script.text.size();
      router_.count_script_load();
      reply = command(op, key, argc, argv, lens);
    }
    if (reply->type == REDIS_REPLY_ERROR) server_error(reply.get(), op, key);
    return reply;
  }

  // Integer replies 0/1 of complete and release; {9, reason} is a foreign value.
  bool flag(const ReplyUPtr& r, Op op, std::string_view key) {
    if (r->type == REDIS_REPLY_INTEGER) return r->integer == 1;
    if (r->type == REDIS_REPLY_ARRAY && r->elements == 2 &&
        r->element[0]->type == REDIS_REPLY_INTEGER && r->element[0]->integer == 9) {
      corrupt(op, key, text_of(r->element[1]));
    }
    protocol_error(op, key, "expected 0, 1 or {9, reason}");
  }

  ClaimResult claim(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                    std::chrono::milliseconds lease) {
    idem::detail::check_term(lease, "idem::redis: the lease");
    RedisKey rk(options_.key_prefix, key);
    detail::LocalTier::Ticket ticket;
    if (tier_) {
      ClaimResult local;
      if (tier_->claim(rk.view(), fingerprint, owner.str(), local) ==
          detail::LocalTier::Answer::kHit) {
        return local;
      }
      ticket = tier_->ticket(rk.view());
    }
    Num lease_ms(lease.count());
    SmallBuf record;  // the in-progress record this claim writes if the key is absent
    std::size_t owner_end = 0;
    build_claim_record(record, owner, fingerprint, lease, owner_end);
    const auto sent_at = std::chrono::steady_clock::now();
    ReplyUPtr r;
    if (native_claim_.load(std::memory_order_relaxed)) {
      const char* argv[] = {
          "SET", rk.view().data(), record.view().data(), "NX", "PX", lease_ms.view().data(), "GET"};
      const std::size_t lens[] = {
          3, rk.view().size(), record.view().size(), 2, 2, lease_ms.view().size(), 3};
      r = command(Op::kClaim, rk.view(), 7, argv, lens);
      if (r->type == REDIS_REPLY_ERROR && text_of(r.get()).substr(0, 16) == "ERR syntax error") {
        // Redis < 7.0 rejects NX together with GET: claim with the script from now on.
        native_claim_.store(false, std::memory_order_relaxed);
        r.reset();
      } else if (r->type == REDIS_REPLY_ERROR && text_of(r.get()).substr(0, 4) == "OOM ") {
        // maxmemory reached (noeviction): SET is refused even when it would write nothing.
        // The script still answers busy / done / mismatch from a read, and reports OOM only
        // when it has to write a new claim.
        r.reset();
      } else if (r->type == REDIS_REPLY_ERROR) {
        server_error(r.get(), Op::kClaim, rk.view());
      }
    }
    if (!r) r = eval(claim_, Op::kClaim, rk.view(), {record.view(), lease_ms.view()});

    ClaimResult result;
    if (r->type == REDIS_REPLY_NIL) {
      result.status = ClaimStatus::kClaimed;
      result.ticket = claim_ticket(rk.view(), record.view(), owner_end, sent_at, lease);
      return result;
    }
    if (r->type != REDIS_REPLY_STRING) {
      protocol_error(Op::kClaim, rk.view(), "expected nil or the existing record");
    }
    answer(text_of(r.get()), fingerprint, owner, rk.view(), result);
    if (tier_ && result.status == ClaimStatus::kDone && !result.failed &&
        tier_->fits(rk.view(), fingerprint, result.holder, result.response)) {
      fill_tier(rk.view(), ticket);
    }
    return result;
  }

  // A claim answered done: the record (with its TTL, which the claim's reply lacks) is read
  // once more with the lookup script and kept in the local tier. Best effort: the claim has its
  // answer whatever happens here.
  void fill_tier(std::string_view rk, const detail::LocalTier::Ticket& ticket) {
    if (!tier_->filling()) return;
    try {
      read_record(rk, &ticket);
    } catch (const Error&) {
      // The claim's answer stands; the tier stays without the record.
    }
  }

  // One lookup script: the record under `rk` and its PTTL, decoded; nullopt when absent. With a
  // ticket (taken before the read was sent), a completed record fills the local tier.
  std::optional<Record> read_record(std::string_view rk, const detail::LocalTier::Ticket* ticket) {
    const auto sent_at = std::chrono::steady_clock::now();
    const TimePoint sent_at_system = system_now();
    ReplyUPtr r = eval(lookup_, Op::kLookup, rk, {});
    if (r->type == REDIS_REPLY_INTEGER && r->integer == 0) return std::nullopt;
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 2) {
      protocol_error(Op::kLookup, rk, "expected 0 or a pair");
    }
    if (r->element[0]->type == REDIS_REPLY_INTEGER && r->element[0]->integer == 9) {
      corrupt(Op::kLookup, rk, text_of(r->element[1]));
    }
    if (!is_string(r->element[0]) || r->element[1]->type != REDIS_REPLY_INTEGER) {
      protocol_error(Op::kLookup, rk, "malformed lookup answer");
    }
    Decoded d;
    if (!decode(text_of(r->element[0]), d)) corrupt(Op::kLookup, rk, "not an idem record");
    const long long pttl = r->element[1]->integer;
    Record rec = detail::record_of(d, pttl);
    if (ticket != nullptr && rec.status == Record::Status::kCompleted) {
      // Kept only if the node serving the key now is heard (tracked by the tier).
      try {
        const detail::Pool* server = &router_.pool_for(rk);
        tier_->fill(rk, *ticket, server, d.fingerprint, d.owner, d.response, d.created, pttl,
                    sent_at, sent_at_system);
      } catch (const Error&) {
        // No node known for the key now: not kept.
      }
    }
    return rec;
  }

  static void build_claim_record(SmallBuf& record, const OwnerToken& owner,
                                 std::string_view fingerprint, std::chrono::milliseconds lease,
                                 std::size_t& owner_end) {
    detail::append_new_claim(record, owner.str(), fingerprint, lease, owner_end);
  }

  ClaimTicket claim_ticket(std::string_view rk, std::string_view record,
                           std::size_t owner_end, std::chrono::steady_clock::time_point sent_at,
                           std::chrono::milliseconds lease) const {
    auto h = std::make_shared<HeldClaim>();
    h->bytes.reserve(rk.size() + record.size());
    h->bytes.append(rk.data(), rk.size()).append(record.data(), record.size());
    h->key_size = rk.size();
    h->owner_end = owner_end;
    h->sent_at = sent_at;
    h->lease = lease;
    ClaimTicket t;
    t.issuer = this;
    t.state = std::move(h);
    return t;
  }

  // Decodes the existing record a claim found and asks the rulebook what it means: mismatch /
  // done / busy, or `owner`'s own claim (kept). A key that exists holds a live lease (its TTL
  // is the lease) or a record within its retention.
  static void answer(std::string_view existing, std::string_view fingerprint,
                     const OwnerToken& owner, std::string_view rk, ClaimResult& result) {
    if (!detail::answer_found(existing, fingerprint, owner, result)) {
      corrupt(Op::kClaim, rk, "not an idem record");
    }
  }

  // The claim `t` stands for, when this store issued it for `owner` on `rk`; else null.
  const HeldClaim* held(const ClaimTicket* t, const OwnerToken& owner, std::string_view rk) const {
    if (t == nullptr || t->issuer != this || !t->state) return nullptr;
    const auto* h = static_cast<const HeldClaim*>(t->state.get());
    if (h->redis_key() != rk) return nullptr;
    const ClaimPrefix mine(owner);
    if (h->record().substr(0, h->owner_end) != mine.view()) return nullptr;
    return h;
  }

  // Whether a native SET ... XX may complete `h` now (see RedisStoreOptions).
  bool within_margin(const HeldClaim& h) const noexcept {
    if (options_.native_complete_fraction <= 0.0) return false;
    const auto age = std::chrono::steady_clock::now() - h.sent_at;
    const auto margin = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double, std::milli>(static_cast<double>(h.lease.count()) *
                                                  options_.native_complete_fraction));
    return age < margin;
  }

  // The completed record of the held claim (detail::append_completed).
  static void completed_record(SmallBuf& out, const HeldClaim& h, std::string_view response) {
    detail::append_completed(out, h.record(), h.owner_end, response);
  }

  // Reads one pipelined reply. A connection-level failure drops the connection and throws.
  ReplyUPtr read_reply(detail::Pool::Lease& conn, Op op, std::string_view key) {
    errno = 0;
    void* raw = nullptr;
    if (sdslen(conn.get()->obuf) > 0 && detail::write_buffered(conn.get()) != REDIS_OK) {
      context_failure(conn, op, key, false);
    }
    if (redisGetReply(conn.get(), &raw) != REDIS_OK || raw == nullptr) {
      context_failure(conn, op, key, true);
    }
    return ReplyUPtr(static_cast<redisReply*>(raw));
  }

  // A connection to the one server of a single-node or Sentinel store, for pipelines and the
  // native complete (never used in a cluster, where every command is routed by command()).
  // A failure makes the router re-discover the master, as in command().
  detail::Pool::Lease acquire_unrouted(Op op, std::string_view key) {
    try {
      return router_.pool_for(key).acquire(op_name(op));
    } catch (const StorageError&) {
      router_.failed();
      throw;
    }
  }

  // The pool of the one server (as acquire_unrouted; a failure to find it re-discovers).
  detail::Pool& unrouted_pool(Op, std::string_view key) {
    try {
      return router_.pool_for(key);
    } catch (const StorageError&) {
      router_.failed();
      throw;
    }
  }

  void append(detail::Pool::Lease& conn, int argc, const char** argv, const std::size_t* lens,
              Op op, std::string_view key) {
    if (append_command(conn.get(), argc, argv, lens) != REDIS_OK) {
      const std::string what = describe(op, key);
      conn.discard(false);
      detail::throw_error(Failure{Failure::Kind::kProtocol, what, "cannot buffer a command"});
    }
  }

  // nullopt: the caller claims one by one (server without SET NX GET).
  std::optional<std::vector<ClaimResult>> claim_batch(const std::vector<ClaimRequest>& requests,
                                                      std::chrono::milliseconds lease) {
    idem::detail::check_term(lease, "idem::redis: the lease");
    // A cluster spreads a batch over nodes: claim one by one there (each call routed).
    if (!native_claim_.load(std::memory_order_relaxed) || router_.clustered()) return std::nullopt;
    std::vector<ClaimResult> out(requests.size());
    if (requests.empty()) return out;
    struct Pending {
      std::size_t owner_end = 0;
      std::string_view key, record;
    };
    std::vector<Pending> pending(requests.size());
    BatchBuffer buffer(2 * requests.size(), requests.size() * 224);  // 2i: key i, 2i+1: record
    Num lease_ms(lease.count());
    for (std::size_t i = 0; i < requests.size(); ++i) {
      RedisKey rk(options_.key_prefix, *requests[i].key);
      SmallBuf record;
      build_claim_record(record, *requests[i].owner, requests[i].fingerprint, lease,
                         pending[i].owner_end);
      buffer.add(rk.view());
      buffer.add(record.view());
    }
    for (std::size_t i = 0; i < pending.size(); ++i) {
      pending[i].key = buffer.view(2 * i);
      pending[i].record = buffer.view(2 * i + 1);
    }
    std::vector<ReplyUPtr> replies;
    replies.reserve(pending.size());
    std::chrono::steady_clock::time_point sent_at;
    {
      detail::Pool::Lease conn = acquire_unrouted(Op::kClaim, pending.front().key);
      sent_at = std::chrono::steady_clock::now();
      for (const Pending& p : pending) {
        const char* argv[] = {
            "SET", p.key.data(), p.record.data(), "NX", "PX", lease_ms.view().data(), "GET"};
        const std::size_t lens[] = {3, p.key.size(), p.record.size(), 2, 2, lease_ms.view().size(),
                                    3};
        append(conn, 7, argv, lens, Op::kClaim, p.key);
      }
      for (std::size_t i = 0; i < pending.size(); ++i) {
        replies.push_back(read_reply(conn, Op::kClaim, pending[i].key));
      }
    }
    pipelined_claims_.fetch_add(1, std::memory_order_relaxed);
    std::vector<std::size_t> redo;  // answered "syntax error" (Redis < 7.0) or -OOM
    std::optional<std::size_t> failed;
    for (std::size_t i = 0; i < pending.size(); ++i) {
      const redisReply* r = replies[i].get();
      if (r->type == REDIS_REPLY_NIL) {
        out[i].status = ClaimStatus::kClaimed;
        out[i].ticket = claim_ticket(pending[i].key, pending[i].record, pending[i].owner_end,
                                     sent_at, lease);
      } else if (r->type == REDIS_REPLY_STRING) {
        answer(text_of(r), requests[i].fingerprint, *requests[i].owner, pending[i].key, out[i]);
      } else if (r->type == REDIS_REPLY_ERROR && text_of(r).substr(0, 16) == "ERR syntax error") {
        native_claim_.store(false, std::memory_order_relaxed);
        redo.push_back(i);
      } else if (r->type == REDIS_REPLY_ERROR && text_of(r).substr(0, 4) == "OOM ") {
        redo.push_back(i);
      } else if (!failed) {
        failed = i;
      }
    }
    if (failed) {
      const redisReply* r = replies[*failed].get();
      if (r->type == REDIS_REPLY_ERROR) server_error(r, Op::kClaim, pending[*failed].key);
      protocol_error(Op::kClaim, pending[*failed].key, "expected nil or the existing record");
    }
    // Rare: claim() takes the script (older server, or -OOM, where a read still answers).
    for (std::size_t i : redo) {
      out[i] = claim(*requests[i].key, requests[i].fingerprint, *requests[i].owner, lease);
    }
    return out;
  }

  std::vector<bool> complete_batch(const std::vector<CompleteRequest>& requests,
                                   std::chrono::seconds retention) {
    idem::detail::check_term(retention, "idem::redis: the retention");
    std::vector<bool> out(requests.size(), false);
    const long long ret_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(retention).count();
    Num ms(ret_ms);
    std::vector<std::size_t> native, scripted;
    // keys[i] and expected[i] view the claim's ticket; the completed records go into one
    // buffer.
    std::vector<std::string_view> keys(requests.size()), values(requests.size()),
        expected(requests.size());
    std::vector<std::chrono::milliseconds> leases(requests.size());
    std::vector<std::size_t> value_slot(requests.size());
    BatchBuffer buffer(requests.size(), requests.size() * 192);
    for (std::size_t i = 0; i < requests.size(); ++i) {
      RedisKey rk(options_.key_prefix, *requests[i].key);
      const HeldClaim* h = held(requests[i].ticket, *requests[i].owner, rk.view());
      if (h != nullptr && native_claim_.load(std::memory_order_relaxed) && within_margin(*h) &&
          !router_.clustered()) {
        SmallBuf completed;
        completed_record(completed, *h, requests[i].response);
        keys[i] = h->redis_key();
        leases[i] = h->lease;
        value_slot[i] = buffer.add(completed.view());
        expected[i] = h->record();
        native.push_back(i);
      } else {
        scripted.push_back(i);
      }
    }
    for (std::size_t i : native) values[i] = buffer.view(value_slot[i]);
    if (!native.empty()) {
      std::vector<ReplyUPtr> replies;
      replies.reserve(native.size());
      detail::Pool::Lease conn = acquire_unrouted(Op::kComplete, keys[native.front()]);
      for (std::size_t i : native) {
        const char* argv[] = {"SET", keys[i].data(), values[i].data(), "XX", "PX", ms.view().data(),
                              "GET"};
        const std::size_t lens[] = {3, keys[i].size(), values[i].size(), 2, 2, ms.view().size(), 3};
        append(conn, 7, argv, lens, Op::kComplete, keys[i]);
      }
      for (std::size_t i : native) replies.push_back(read_reply(conn, Op::kComplete, keys[i]));
      pipelined_completes_.fetch_add(1, std::memory_order_relaxed);
      native_completes_.fetch_add(native.size(), std::memory_order_relaxed);
      // Every reply is settled (values put back where needed) before a foreign value is
      // reported; a connection failure stops at once (the connection is gone).
      std::exception_ptr first_error;
      for (std::size_t j = 0; j < native.size(); ++j) {
        const std::size_t i = native[j];
        try {
          auto run = [&](int argc, const char** argv, const std::size_t* lens) {
            return exec(conn, argc, argv, lens, Op::kComplete, keys[i]);
          };
          out[i] = settle_native(run, replies[j].get(), expected[i], keys[i], ms.view(), leases[i]);
        } catch (const CorruptRecord&) {
          if (!first_error) first_error = std::current_exception();
        }
      }
      if (first_error) std::rethrow_exception(first_error);
    }
    for (std::size_t i : scripted) {
      out[i] = complete(*requests[i].key, *requests[i].owner, requests[i].response, retention,
                        requests[i].ticket);
    }
    return out;
  }

  // The reply of a native complete, `SET key <completed> XX PX <retention> GET`: nil (the key
  // is gone: lease lost, nothing written), our own in-progress record (completed), or anything
  // else: the margin's assumption failed (a pause longer than the margin, a foreign writer),
  // so the previous value is put back at once (an idem record with its own deadline) and the
  // lease counts as lost, or the value is reported as foreign.
  // `run(argc, argv, lens)` sends the put-back command.
  template <class Run>
  bool settle_native(Run&& run, const redisReply* r, std::string_view expected,
                     std::string_view key, std::string_view retention_ms,
                     std::chrono::milliseconds own_lease) {
    if (r->type == REDIS_REPLY_NIL) return false;
    if (r->type == REDIS_REPLY_STRING && text_of(r) == expected) return true;
    if (r->type == REDIS_REPLY_ERROR) {
      if (text_of(r).substr(0, 9) == "WRONGTYPE") corrupt(Op::kComplete, key, text_of(r));
      server_error(r, Op::kComplete, key);
    }
    if (r->type != REDIS_REPLY_STRING) protocol_error(Op::kComplete, key, "expected a record");
    const std::string_view old = text_of(r);
    Decoded d;
    const bool ours = decode(old, d);
    ReplyUPtr back;
    if (ours && d.deadline > 0) {
      // Another attempt's claim: its time to live went with the SET and cannot be read back.
      // The deadline it keeps is not that: a heartbeat (extend) moved only the time to live,
      // and it is of its claimant's clock, not this host's nor the server's. Put back for the
      // longest it may have had left: its whole lease (deadline - created, one clock), this
      // claim's lease (a guard's attempts share one), or the rest by the deadline on this
      // host's clock, whichever is longest. A live claim is never cut short; a crashed
      // claimant is taken over at most a lease later.
      const long long now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count();
      const long long keep =
          std::max({d.deadline - d.created, static_cast<long long>(own_lease.count()),
                    d.deadline - now_ms, 1LL});
      Num px(keep);
      const char* argv[] = {"SET", key.data(), old.data(), "PX", px.view().data()};
      const std::size_t lens[] = {3, key.size(), old.size(), 2, px.view().size()};
      back = run(5, argv, lens);
    } else if (ours) {  // a completed record of format 2 keeps no deadline: the retention
      const char* argv[] = {"SET", key.data(), old.data(), "PX", retention_ms.data()};
      const std::size_t lens[] = {3, key.size(), old.size(), 2, retention_ms.size()};
      back = run(5, argv, lens);
    } else {
      const char* argv[] = {"SET", key.data(), old.data()};
      const std::size_t lens[] = {3, key.size(), old.size()};
      back = run(3, argv, lens);
    }
    if (back->type == REDIS_REPLY_ERROR) server_error(back.get(), Op::kComplete, key);
    if (!ours) corrupt(Op::kComplete, key, "not an idem record");
    return false;
  }

  // `t`: the claim's ticket (complete_claimed), or null.
  bool complete(const Key& key, const OwnerToken& owner, std::string_view response,
                std::chrono::seconds retention, const ClaimTicket* t) {
    idem::detail::check_term(retention, "idem::redis: the retention");
    RedisKey rk(options_.key_prefix, key);
    const long long ret_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(retention).count();
    Num ms(ret_ms);
    // The one-write script needs SET ... GET and PXAT (Redis >= 6.2); native_claim_ is false
    // on servers older than 7.0 (and with claim_script), which then take the general script.
    const HeldClaim* h = held(t, owner, rk.view());
    if (h != nullptr && native_claim_.load(std::memory_order_relaxed)) {
      SmallBuf completed;
      completed_record(completed, *h, response);
      if (within_margin(*h) && !router_.clustered()) {
        // Nobody else can hold the key yet (see RedisStoreOptions::native_complete_fraction):
        // one native SET, no script. (In a cluster the routed script path follows redirects.)
        const char* argv[] = {
            "SET", rk.view().data(), completed.view().data(), "XX", "PX", ms.view().data(), "GET"};
        const std::size_t lens[] = {
            3, rk.view().size(), completed.view().size(), 2, 2, ms.view().size(), 3};
        detail::Pool& pool = unrouted_pool(Op::kComplete, rk.view());
        auto run = [&](int argc, const char** av, const std::size_t* ls) {
          try {
            return send(pool, Op::kComplete, rk.view(), argc, av, ls);
          } catch (const StorageError&) {
            router_.failed();
            throw;
          }
        };
        ReplyUPtr r = run(7, argv, lens);
        native_completes_.fetch_add(1, std::memory_order_relaxed);
        return settle_native(run, r.get(), h->record(), rk.view(), ms.view(), h->lease);
      }
      script_completes_.fetch_add(1, std::memory_order_relaxed);
      ReplyUPtr r =
          eval(complete_fast_, Op::kComplete, rk.view(),
               {h->record(), completed.view(), ms.view()});
      return flag(r, Op::kComplete, rk.view());
    }
    script_completes_.fetch_add(1, std::memory_order_relaxed);
    return complete_script(Op::kComplete, rk.view(), owner, response, ms.view(),
                           to_millis(system_now()) + ret_ms, 'C');
  }

  // The general complete script writing a failed record ('F'): always owner-checked.
  bool fail(const Key& key, const OwnerToken& owner, std::string_view reason,
            std::chrono::seconds retention) {
    idem::detail::check_term(retention, "idem::redis: the retention");
    RedisKey rk(options_.key_prefix, key);
    const long long ret_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(retention).count();
    Num ms(ret_ms);
    return complete_script(Op::kFail, rk.view(), owner, reason, ms.view(),
                           to_millis(system_now()) + ret_ms, 'F');
  }

  // kCompleteScript: writes a completed ('C') or failed ('F') record over `owner`'s claim, in
  // the claim's own format (a format-1 claim of an earlier version stays format 1).
  bool complete_script(Op op, std::string_view rk, const OwnerToken& owner,
                       std::string_view response, std::string_view retention_ms, long long deadline,
                       char status) {
    ClaimPrefix mine(owner), mine_v1(owner, 1);
    const char tag = detail::final_tag(status);
    Num decimal(deadline);  // format 1 keeps the deadline
    ReplyUPtr r = eval(complete_, op, rk,
                       {mine.view(), response, retention_ms, std::string_view(&tag, 1),
                        std::string_view(&status, 1), mine_v1.view(), decimal.view()});
    return flag(r, op, rk);
  }

  bool release(const Key& key, const OwnerToken& owner) {
    RedisKey rk(options_.key_prefix, key);
    if (tier_) tier_->forget(rk.view());
    ClaimPrefix mine(owner), mine_v1(owner, 1);
    ReplyUPtr r = eval(release_, Op::kRelease, rk.view(), {mine.view(), mine_v1.view()});
    return flag(r, Op::kRelease, rk.view());
  }

  bool extend(const Key& key, const OwnerToken& owner, std::chrono::milliseconds lease) {
    idem::detail::check_term(lease, "idem::redis: the lease");
    RedisKey rk(options_.key_prefix, key);
    ClaimPrefix mine(owner), mine_v1(owner, 1);
    Num ms(lease.count());
    ReplyUPtr r = eval(extend_, Op::kExtend, rk.view(), {mine.view(), mine_v1.view(), ms.view()});
    return flag(r, Op::kExtend, rk.view());
  }

  // `first_seen` epoch: now.
  void fill(const Key& key, std::string_view fingerprint, std::string_view response,
            std::chrono::seconds retention, TimePoint first_seen) {
    idem::detail::check_term(retention, "idem::redis: the retention");
    RedisKey rk(options_.key_prefix, key);
    if (tier_) tier_->forget(rk.view());  // this process's own write is seen at once
    Num ms(std::chrono::duration_cast<std::chrono::milliseconds>(retention).count());
    // Owner unknown (the durable store decided): stored empty.
    std::string value;
    value.reserve(64 + fingerprint.size() + response.size());
    const long long created = to_millis(first_seen == TimePoint{} ? system_now() : first_seen);
    detail::append_filled(value, fingerprint, created, response);
    const char* argv[] = {"SET", rk.view().data(), value.data(), "PX", ms.view().data()};
    const std::size_t lens[] = {3, rk.view().size(), value.size(), 2, ms.view().size()};
    ReplyUPtr r = command(Op::kFill, rk.view(), 5, argv, lens);
    if (r->type == REDIS_REPLY_ERROR) server_error(r.get(), Op::kFill, rk.view());
  }

  std::optional<Record> lookup(const Key& key) {
    RedisKey rk(options_.key_prefix, key);
    if (!tier_) return read_record(rk.view(), nullptr);
    Record local;
    if (tier_->lookup(rk.view(), local) == detail::LocalTier::Answer::kHit) return local;
    const detail::LocalTier::Ticket ticket = tier_->ticket(rk.view());
    return read_record(rk.view(), tier_->filling() ? &ticket : nullptr);
  }

  std::string redis_key(const Key& key) const {
    RedisKey rk(options_.key_prefix, key);
    return std::string(rk.view());
  }

  const RedisStoreOptions& options() const noexcept { return options_; }
  RedisPoolStats stats() const { return router_.pool_stats(); }
  RedisLocalTierStats tier_stats() const { return tier_ ? tier_->stats() : RedisLocalTierStats{}; }
  RedisRouteStats route_stats() const { return router_.route_stats(); }
  std::string_view name() const noexcept { return router_.name(); }
  RedisCommandStats command_stats() const {
    RedisCommandStats s;
    s.native_completes = native_completes_.load(std::memory_order_relaxed);
    s.script_completes = script_completes_.load(std::memory_order_relaxed);
    s.pipelined_claim_batches = pipelined_claims_.load(std::memory_order_relaxed);
    s.pipelined_complete_batches = pipelined_completes_.load(std::memory_order_relaxed);
    return s;
  }

 private:
  const RedisStoreOptions options_;
  static constexpr int kMaxHops = 5;
  detail::Router router_;
  const Script claim_, complete_, complete_fast_, release_, extend_, lookup_;
  // SET NX ... GET works (Redis >= 7.0); cleared for good on the first "syntax error".
  std::atomic<bool> native_claim_;
  std::atomic<std::uint64_t> native_completes_{0}, script_completes_{0}, pipelined_claims_{0},
      pipelined_completes_{0};
  // Last: its thread stops (and its connection closes) before the router goes.
  std::unique_ptr<detail::LocalTier> tier_;
};

RedisStore::RedisStore(RedisStoreOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

RedisStore::RedisStore(std::string_view uri)
    : RedisStore([&] {
        RedisStoreOptions o;
        o.uri = std::string(uri);
        return o;
      }()) {}

RedisStore::~RedisStore() = default;

ClaimResult RedisStore::claim(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
                              std::chrono::milliseconds lease) {
  return impl_->claim(key, fingerprint, owner, lease);
}

bool RedisStore::complete(const Key& key, const OwnerToken& owner, std::string_view response,
                          std::chrono::seconds retention) {
  return impl_->complete(key, owner, response, retention, nullptr);
}

bool RedisStore::complete_claimed(const Key& key, const OwnerToken& owner,
                                  const ClaimTicket& ticket, std::string_view response,
                                  std::chrono::seconds retention) {
  return impl_->complete(key, owner, response, retention, &ticket);
}

bool RedisStore::fail(const Key& key, const OwnerToken& owner, std::string_view reason,
                      std::chrono::seconds retention) {
  return impl_->fail(key, owner, reason, retention);
}

bool RedisStore::release(const Key& key, const OwnerToken& owner) {
  return impl_->release(key, owner);
}

bool RedisStore::extend(const Key& key, const OwnerToken& owner, std::chrono::milliseconds lease) {
  return impl_->extend(key, owner, lease);
}

void RedisStore::fill(const Key& key, std::string_view fingerprint, std::string_view response,
                      std::chrono::seconds retention) {
  impl_->fill(key, fingerprint, response, retention, TimePoint{});
}

void RedisStore::refill(const Key& key, std::string_view fingerprint, std::string_view response,
                        std::chrono::seconds retention, const RecordOrigin& origin) {
  impl_->fill(key, fingerprint, response, retention, origin.first_seen);
}

std::optional<Record> RedisStore::lookup(const Key& key) { return impl_->lookup(key); }

std::string RedisStore::redis_key(const Key& key) const { return impl_->redis_key(key); }

RedisPoolStats RedisStore::pool_stats() const { return impl_->stats(); }

RedisRouteStats RedisStore::route_stats() const { return impl_->route_stats(); }

std::string_view RedisStore::name() const noexcept { return impl_->name(); }

RedisCommandStats RedisStore::command_stats() const { return impl_->command_stats(); }

RedisLocalTierStats RedisStore::local_tier_stats() const { return impl_->tier_stats(); }

std::vector<ClaimResult> RedisStore::claim_batch(const std::vector<ClaimRequest>& requests,
                                                 std::chrono::milliseconds lease) {
  if (auto out = impl_->claim_batch(requests, lease)) return std::move(*out);
  return FastStore::claim_batch(requests, lease);
}

std::vector<bool> RedisStore::complete_batch(const std::vector<CompleteRequest>& requests,
                                             std::chrono::seconds retention) {
  return impl_->complete_batch(requests, retention);
}

const RedisStoreOptions& RedisStore::options() const noexcept { return impl_->options(); }

}  // namespace idem::redis
