// SPDX-License-Identifier: MIT
// idem::redis::RedisStore: claim / complete / release / fill / lookup over the pool.
#include "idem/redis/redis_store.hpp"

#include <hiredis/hiredis.h>
#include <openssl/evp.h>

#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <string>
#include <utility>

#include "errors.hpp"
#include "hiredis_handles.hpp"
#include "idem/errors.hpp"
#include "pool.hpp"
#include "scripts.hpp"
#include "uri.hpp"

namespace idem::redis {
namespace {

using detail::Failure;
using detail::ReplyUPtr;

// A decimal integer formatted on the stack (no allocation per call).
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

// prefix + "{" + scope + "|" + id + "}", on the stack when it fits (it always does with the
// default prefix: 5 + 1 + 64 + 1 + 128 + 1 = 200 bytes).
class RedisKey {
 public:
  RedisKey(const std::string& prefix, const Key& key) {
    size_ = prefix.size() + key.scope().size() + key.id().size() + 3;
    char* out = inline_.data();
    if (size_ > inline_.size()) {
      heap_.resize(size_);
      out = heap_.data();
    }
    data_ = out;
    std::memcpy(out, prefix.data(), prefix.size());
    out += prefix.size();
    *out++ = '{';
    std::memcpy(out, key.scope().data(), key.scope().size());
    out += key.scope().size();
    *out++ = kKeySeparator;
    std::memcpy(out, key.id().data(), key.id().size());
    out += key.id().size();
    *out = '}';
  }
  RedisKey(const RedisKey&) = delete;
  RedisKey& operator=(const RedisKey&) = delete;
  std::string_view view() const noexcept { return {data_, size_}; }

 private:
  std::array<char, 256> inline_;
  std::string heap_;
  const char* data_ = nullptr;
  std::size_t size_ = 0;
};

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
};

enum class Op { kClaim, kComplete, kRelease, kFill, kLookup };

const char* op_name(Op op) noexcept {
  switch (op) {
    case Op::kClaim: return "claim";
    case Op::kComplete: return "complete";
    case Op::kRelease: return "release";
    case Op::kFill: return "fill";
    case Op::kLookup: return "lookup";
  }
  return "call";
}

// Whether a timed-out reply leaves the write's outcome unknown (claims are decided by the
// durable store anyway, so a claim timeout stays a plain StorageTimeout).
bool write_may_apply(Op op) noexcept {
  return op == Op::kComplete || op == Op::kRelease || op == Op::kFill;
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

long long parse_millis(const redisReply* r, Op op, std::string_view key) {
  long long v = 0;
  if (r->type == REDIS_REPLY_INTEGER) return r->integer;
  if (!is_string(r)) protocol_error(op, key, "a timestamp is neither a string nor an integer");
  auto res = std::from_chars(r->str, r->str + r->len, v);
  if (res.ec != std::errc() || res.ptr != r->str + r->len) {
    corrupt(op, key, "the creation time is not a number");
  }
  return v;
}

// The C++ side of scripts.hpp's encoding (lookup decodes here).
struct Decoded {
  char status = 0;
  long long created = 0;
  std::string_view fingerprint, owner, response;
};

bool decode(std::string_view v, Decoded& out) {
  if (v.size() < 4 || v[0] != 'I' || v[1] != '1' || (v[2] != 'P' && v[2] != 'C')) return false;
  out.status = v[2];
  const char* p = v.data() + 3;
  const char* end = v.data() + v.size();
  auto field = [&](long long& n) {
    auto res = std::from_chars(p, end, n);
    if (res.ec != std::errc() || res.ptr == p || res.ptr == end || *res.ptr != ':' || n < 0) {
      return false;
    }
    p = res.ptr + 1;
    return true;
  };
  long long fl = 0, ol = 0;
  if (!field(out.created) || !field(fl) || !field(ol)) return false;
  auto left = static_cast<unsigned long long>(end - p);
  if (static_cast<unsigned long long>(fl) + static_cast<unsigned long long>(ol) > left) {
    return false;
  }
  out.fingerprint = std::string_view(p, static_cast<std::size_t>(fl));
  out.owner = std::string_view(p + fl, static_cast<std::size_t>(ol));
  out.response = std::string_view(p + fl + ol, static_cast<std::size_t>(end - (p + fl + ol)));
  return true;
}

template <class Duration>
std::chrono::milliseconds positive_ms(Duration d, std::chrono::milliseconds fallback) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(d);
  return ms.count() > 0 ? ms : fallback;
}

}  // namespace

class RedisStore::Impl {
 public:
  explicit Impl(RedisStoreOptions options)
      : options_(normalise(std::move(options))),
        pool_(settings(options_)),
        claim_(detail::kClaimScript),
        complete_(detail::kCompleteScript),
        release_(detail::kReleaseScript),
        lookup_(detail::kLookupScript) {}

  static RedisStoreOptions normalise(RedisStoreOptions o) {
    if (o.pool_size == 0) o.pool_size = 8;
    o.connect_timeout = positive_ms(o.connect_timeout, std::chrono::milliseconds(500));
    o.command_timeout = positive_ms(o.command_timeout, std::chrono::milliseconds(1000));
    if (o.pool_wait_timeout.count() < 0) {
      throw UsageError("idem::redis: RedisStoreOptions::pool_wait_timeout must not be negative");
    }
    if (o.reconnect_backoff.count() < 0) {
      throw UsageError("idem::redis: RedisStoreOptions::reconnect_backoff must not be negative");
    }
    if (o.key_prefix.find_first_of("{}") != std::string::npos) {
      throw UsageError("idem::redis: RedisStoreOptions::key_prefix must not contain '{' or '}' "
                       "(they delimit the Redis Cluster hash tag)");
    }
    return o;
  }

  static detail::PoolSettings settings(const RedisStoreOptions& o) {
    detail::PoolSettings s;
    s.endpoint = detail::parse_uri(o.uri);
    s.size = o.pool_size;
    s.connect_timeout = o.connect_timeout;
    s.command_timeout = o.command_timeout;
    s.wait_timeout = o.pool_wait_timeout;
    s.reconnect_backoff = o.reconnect_backoff;
    return s;
  }

  // One command on a lent connection. A connection-level failure drops the connection and
  // throws; an error reply is returned (the caller decides).
  ReplyUPtr exec(detail::Pool::Lease& conn, int argc, const char** argv,
                 const std::size_t* lens, Op op, std::string_view key) {
    redisContext* c = conn.get();
    errno = 0;
    void* raw = redisCommandArgv(c, argc, argv, lens);
    if (raw == nullptr) {
      const int saved_errno = errno;
      const int err = c->err;
      const std::string errstr = c->errstr;
      conn.discard(detail::server_gone(err, saved_errno));
      const std::string what = describe(op, key);
      detail::throw_error(
          Failure{Failure::Kind::kContext, what, errstr, err, saved_errno, write_may_apply(op)});
    }
    return ReplyUPtr(static_cast<redisReply*>(raw));
  }

  [[noreturn]] static void server_error(const redisReply* r, Op op, std::string_view key) {
    const std::string what = describe(op, key);
    detail::throw_error(Failure{Failure::Kind::kServer, what, text_of(r)});
  }

  // EVALSHA with up to 4 arguments; on NOSCRIPT (a restarted or flushed server) loads the
  // script and retries once. Error replies throw.
  ReplyUPtr eval(const Script& script, Op op, std::string_view key,
                 std::initializer_list<std::string_view> args) {
    const char* argv[8];
    std::size_t lens[8];
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
    detail::Pool::Lease conn = pool_.acquire(op_name(op));
    ReplyUPtr reply = exec(conn, argc, argv, lens, op, key);
    if (reply->type == REDIS_REPLY_ERROR && text_of(reply.get()).substr(0, 8) == "NOSCRIPT") {
      load(conn, script, op, key);
      reply = exec(conn, argc, argv, lens, op, key);
    }
    if (reply->type == REDIS_REPLY_ERROR) server_error(reply.get(), op, key);
    return reply;
  }

  void load(detail::Pool::Lease& conn, const Script& script, Op op, std::string_view key) {
    const char* argv[] = {"SCRIPT", "LOAD", script.text.c_str()};
    const std::size_t lens[] = {6, 4, script.text.size()};
    ReplyUPtr r = exec(conn, 3, argv, lens, op, key);
    if (r->type == REDIS_REPLY_ERROR) server_error(r.get(), op, key);
    if (!is_string(r.get()) || text_of(r.get()) != std::string_view(script.sha.data(), 40)) {
      protocol_error(op, key, "SCRIPT LOAD answered another SHA-1");
    }
    pool_.count_script_load();
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
    if (lease.count() <= 0) throw UsageError("idem::redis: the lease must be positive");
    RedisKey rk(options_.key_prefix, key);
    Num lease_ms(lease.count());
    Num now_ms(to_millis(system_now()));
    ReplyUPtr r = eval(claim_, Op::kClaim, rk.view(),
                       {fingerprint, owner.str(), lease_ms.view(), now_ms.view()});
    ClaimResult result;
    if (r->type == REDIS_REPLY_INTEGER && r->integer == 0) {
      result.status = ClaimStatus::kClaimed;
      return result;
    }
    if (r->type != REDIS_REPLY_ARRAY || r->elements < 2 ||
        r->element[0]->type != REDIS_REPLY_INTEGER) {
      protocol_error(Op::kClaim, rk.view(), "expected 0 or an array");
    }
    const long long code = r->element[0]->integer;
    if (code == 9) corrupt(Op::kClaim, rk.view(), text_of(r->element[1]));
    const std::size_t want = code == 2 ? 4 : 3;
    if (code < 1 || code > 3 || r->elements != want || !is_string(r->element[1])) {
      protocol_error(Op::kClaim, rk.view(), "malformed claim answer");
    }
    result.holder.assign(r->element[1]->str, r->element[1]->len);
    result.first_seen = from_millis(parse_millis(r->element[2], Op::kClaim, rk.view()));
    switch (code) {
      case 1:
        result.status = ClaimStatus::kBusy;
        break;
      case 2:
        if (!is_string(r->element[3])) protocol_error(Op::kClaim, rk.view(), "no response");
        result.status = ClaimStatus::kDone;
        result.response.assign(r->element[3]->str, r->element[3]->len);
        break;
      default:
        result.status = ClaimStatus::kMismatch;
        break;
    }
    return result;
  }

  bool complete(const Key& key, const OwnerToken& owner, std::string_view response,
                std::chrono::seconds retention) {
    if (retention.count() <= 0) throw UsageError("idem::redis: the retention must be positive");
    RedisKey rk(options_.key_prefix, key);
    Num ms(std::chrono::duration_cast<std::chrono::milliseconds>(retention).count());
    ReplyUPtr r = eval(complete_, Op::kComplete, rk.view(), {owner.str(), response, ms.view()});
    return flag(r, Op::kComplete, rk.view());
  }

  bool release(const Key& key, const OwnerToken& owner) {
    RedisKey rk(options_.key_prefix, key);
    ReplyUPtr r = eval(release_, Op::kRelease, rk.view(), {owner.str()});
    return flag(r, Op::kRelease, rk.view());
  }

  void fill(const Key& key, std::string_view fingerprint, std::string_view response,
            std::chrono::seconds retention) {
    if (retention.count() <= 0) throw UsageError("idem::redis: the retention must be positive");
    RedisKey rk(options_.key_prefix, key);
    Num now_ms(to_millis(system_now()));
    Num fl(static_cast<long long>(fingerprint.size()));
    Num ms(std::chrono::duration_cast<std::chrono::milliseconds>(retention).count());
    std::string value;
    value.reserve(3 + 24 + 24 + 3 + fingerprint.size() + response.size());
    value.append("I1C").append(now_ms.view()).append(1, ':').append(fl.view()).append(":0:");
    value.append(fingerprint).append(response);
    const char* argv[] = {"SET", rk.view().data(), value.data(), "PX", ms.view().data()};
    const std::size_t lens[] = {3, rk.view().size(), value.size(), 2, ms.view().size()};
    detail::Pool::Lease conn = pool_.acquire(op_name(Op::kFill));
    ReplyUPtr r = exec(conn, 5, argv, lens, Op::kFill, rk.view());
    if (r->type == REDIS_REPLY_ERROR) server_error(r.get(), Op::kFill, rk.view());
  }

  std::optional<Record> lookup(const Key& key) {
    RedisKey rk(options_.key_prefix, key);
    ReplyUPtr r = eval(lookup_, Op::kLookup, rk.view(), {});
    if (r->type == REDIS_REPLY_INTEGER && r->integer == 0) return std::nullopt;
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 2) {
      protocol_error(Op::kLookup, rk.view(), "expected 0 or a pair");
    }
    if (r->element[0]->type == REDIS_REPLY_INTEGER && r->element[0]->integer == 9) {
      corrupt(Op::kLookup, rk.view(), text_of(r->element[1]));
    }
    if (!is_string(r->element[0]) || r->element[1]->type != REDIS_REPLY_INTEGER) {
      protocol_error(Op::kLookup, rk.view(), "malformed lookup answer");
    }
    Decoded d;
    if (!decode(text_of(r->element[0]), d)) corrupt(Op::kLookup, rk.view(), "not an idem record");
    const long long pttl = r->element[1]->integer;
    const TimePoint now = system_now();
    Record rec;
    rec.status = d.status == 'P' ? Record::Status::kInProgress : Record::Status::kCompleted;
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

  std::string redis_key(const Key& key) const {
    RedisKey rk(options_.key_prefix, key);
    return std::string(rk.view());
  }

  const RedisStoreOptions& options() const noexcept { return options_; }
  RedisPoolStats stats() const { return pool_.stats(); }

 private:
  const RedisStoreOptions options_;
  detail::Pool pool_;
  const Script claim_, complete_, release_, lookup_;
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

ClaimResult RedisStore::claim(const Key& key, std::string_view fingerprint,
                              const OwnerToken& owner, std::chrono::milliseconds lease) {
  return impl_->claim(key, fingerprint, owner, lease);
}

bool RedisStore::complete(const Key& key, const OwnerToken& owner, std::string_view response,
                          std::chrono::seconds retention) {
  return impl_->complete(key, owner, response, retention);
}

bool RedisStore::release(const Key& key, const OwnerToken& owner) {
  return impl_->release(key, owner);
}

void RedisStore::fill(const Key& key, std::string_view fingerprint, std::string_view response,
                      std::chrono::seconds retention) {
  impl_->fill(key, fingerprint, response, retention);
}

std::optional<Record> RedisStore::lookup(const Key& key) { return impl_->lookup(key); }

std::string RedisStore::redis_key(const Key& key) const { return impl_->redis_key(key); }

RedisPoolStats RedisStore::pool_stats() const { return impl_->stats(); }

const RedisStoreOptions& RedisStore::options() const noexcept { return impl_->options(); }

}  // namespace idem::redis
