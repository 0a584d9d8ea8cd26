// SPDX-License-Identifier: MIT
// Redis Streams commands over the Redis adapter's connection pool (hiredis 0.14).
#include "idem/redis/streams.hpp"

#include <hiredis/hiredis.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "idem/errors.hpp"
#include "errors.hpp"
#include "hiredis_handles.hpp"
#include "pool.hpp"
#include "uri.hpp"

namespace idem::mq {

namespace {

using idem::redis::detail::Failure;
using idem::redis::detail::Pool;
using idem::redis::detail::write_buffered;
using ReplyPtr = idem::redis::detail::ReplyUPtr;

timeval to_timeval(std::chrono::milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<decltype(tv.tv_sec)>(ms.count() / 1000);
  tv.tv_usec = static_cast<decltype(tv.tv_usec)>((ms.count() % 1000) * 1000);
  return tv;
}

std::string str(const redisReply* r) {
  if (r == nullptr || (r->type != REDIS_REPLY_STRING && r->type != REDIS_REPLY_STATUS)) {
    return {};
  }
  return std::string(r->str, r->len);
}

std::uint64_t to_u64(const redisReply* r) {
  if (r == nullptr) return 0;
  if (r->type == REDIS_REPLY_INTEGER) return static_cast<std::uint64_t>(r->integer);
  if (r->type == REDIS_REPLY_STRING) return std::strtoull(r->str, nullptr, 10);
  return 0;
}

void check_type(const redisReply* r, int type, std::string_view what) {
  if (r == nullptr || r->type != type) {
    idem::redis::detail::throw_error(
        Failure{Failure::Kind::kProtocol, what, "unexpected reply type"});
  }
}

// [id, [field, value, ...]] -> StreamEntry. A deleted entry may come back with nil fields.
StreamEntry parse_entry(const redisReply* r) {
  check_type(r, REDIS_REPLY_ARRAY, "stream entry");
  if (r->elements < 2) check_type(nullptr, REDIS_REPLY_ARRAY, "stream entry (short)");
  StreamEntry e;
  e.id = str(r->element[0]);
  const redisReply* f = r->element[1];
  if (f != nullptr && f->type == REDIS_REPLY_ARRAY) {
    for (std::size_t i = 0; i + 1 < f->elements; i += 2) {
      e.fields.emplace_back(str(f->element[i]), str(f->element[i + 1]));
    }
  }
  return e;
}

std::vector<StreamEntry> parse_entries(const redisReply* r) {
  std::vector<StreamEntry> out;
  if (r == nullptr || r->type == REDIS_REPLY_NIL) return out;
  check_type(r, REDIS_REPLY_ARRAY, "entry list");
  out.reserve(r->elements);
  for (std::size_t i = 0; i < r->elements; ++i) out.push_back(parse_entry(r->element[i]));
  return out;
}

idem::redis::detail::PoolSettings settings_of(const RedisStreamsOptions& o) {
  if (o.connect_timeout.count() <= 0 || o.command_timeout.count() <= 0) {
    throw UsageError("idem::mq::RedisStreams: timeouts must be positive");
  }
  if (o.pool_size == 0) throw UsageError("idem::mq::RedisStreams: pool_size must be positive");
  idem::redis::detail::PoolSettings s;
  s.endpoint = idem::redis::detail::parse_uri(o.uri);
  s.size = o.pool_size;
  s.connect_timeout = o.connect_timeout;
  s.command_timeout = o.command_timeout;
  s.wait_timeout = o.pool_wait_timeout;
  s.reconnect_backoff = std::chrono::milliseconds(100);
  s.tls = idem::redis::detail::make_tls(s.endpoint, o.tls, "RedisStreamsOptions");
  return s;
}

}  // namespace

// Commands over the Redis adapter's connection pool (idem::redis::detail::Pool): the same URI
// forms, connect/command timeouts, reconnect backoff and error mapping as RedisStore.
class IDEM_LOCAL RedisStreams::Impl {
 public:
  explicit Impl(const RedisStreamsOptions& options)
      : command_timeout_(options.command_timeout), pool_(settings_of(options)) {}

  // One command with binary-safe arguments. `write` marks commands whose effect may have been
  // applied when the answer is lost (XADD): they report OutcomeUnknown then. Error replies
  // throw (LOADING and similar as StorageUnavailable, others as StorageError).
  ReplyPtr command(const std::vector<std::string_view>& args, bool write = false,
                   std::chrono::milliseconds extra_timeout = std::chrono::milliseconds(0)) {
    Pool::Lease conn = pool_.acquire(args[0]);
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    fill(args, argv, lens);
    redisContext* c = conn.get();
    if (extra_timeout.count() > 0) redisSetTimeout(c, to_timeval(command_timeout_ + extra_timeout));
    errno = 0;
    if (redisAppendCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()) !=
        REDIS_OK) {
      fail(conn, args[0], false, false);
    }
    std::size_t sent = 0;
    if (write_buffered(c, &sent) != REDIS_OK) fail(conn, args[0], write && sent > 0, sent > 0);
    void* got = nullptr;
    if (redisGetReply(c, &got) != REDIS_OK || got == nullptr) fail(conn, args[0], write, true);
    auto* raw = static_cast<redisReply*>(got);
    if (extra_timeout.count() > 0) redisSetTimeout(c, to_timeval(command_timeout_));
    ReplyPtr reply(raw);
    throw_if_error(reply.get(), args[0]);
    return reply;
  }

  // Many commands in one round trip on one connection; replies in order (error replies are
  // returned, not thrown).
  std::vector<ReplyPtr> pipeline(const std::vector<std::vector<std::string_view>>& commands,
                                 bool write) {
    std::string_view what = commands.front()[0];
    Pool::Lease conn = pool_.acquire(what);
    redisContext* c = conn.get();
    for (const auto& args : commands) {
      std::vector<const char*> argv;
      std::vector<std::size_t> lens;
      fill(args, argv, lens);
      if (redisAppendCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()) !=
          REDIS_OK) {
        fail(conn, what, false, false);
      }
    }
    errno = 0;
    std::size_t sent = 0;
    if (write_buffered(c, &sent) != REDIS_OK) fail(conn, what, write && sent > 0, sent > 0);
    std::vector<ReplyPtr> replies;
    replies.reserve(commands.size());
    for (std::size_t i = 0; i < commands.size(); ++i) {
      void* raw = nullptr;
      errno = 0;
      if (redisGetReply(c, &raw) != REDIS_OK) fail(conn, what, write, true);
      replies.emplace_back(static_cast<redisReply*>(raw));
    }
    return replies;
  }

  static void throw_if_error(const redisReply* r, std::string_view cmd) {
    if (r->type != REDIS_REPLY_ERROR) return;
    idem::redis::detail::throw_error(
        Failure{Failure::Kind::kServer, cmd, std::string_view(r->str, r->len)});
  }

 private:
  static void fill(const std::vector<std::string_view>& args, std::vector<const char*>& argv,
                   std::vector<std::size_t>& lens) {
    argv.reserve(args.size());
    lens.reserve(args.size());
    for (auto a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
  }

  // The connection's state is unknown after a failure: drop it, then throw the mapped error.
  // `write`: a write that may have been applied (OutcomeUnknown on a timeout, or on a lost
  // connection once `sent`: written, whole or, for a pipeline, in part).
  [[noreturn]] static void fail(Pool::Lease& conn, std::string_view cmd, bool write, bool sent) {
    const int saved_errno = errno;
    redisContext* c = conn.get();
    const int err = c->err;
    const std::string errstr = c->errstr;
    conn.discard(idem::redis::detail::server_gone(err, saved_errno));
    const std::string what = "redis " + std::string(cmd);
    idem::redis::detail::throw_error(
        Failure{Failure::Kind::kContext, what, errstr, err, saved_errno, write, sent});
  }

  std::chrono::milliseconds command_timeout_;
  Pool pool_;
};

RedisStreams::RedisStreams(RedisStreamsOptions options) : impl_(std::make_unique<Impl>(options)) {}
RedisStreams::RedisStreams(std::string_view uri)
    : RedisStreams(RedisStreamsOptions{std::string(uri)}) {}
RedisStreams::~RedisStreams() = default;
RedisStreams::RedisStreams(RedisStreams&&) noexcept = default;
RedisStreams& RedisStreams::operator=(RedisStreams&&) noexcept = default;

bool RedisStreams::create_group(std::string_view stream, std::string_view group,
                                std::string_view start_id) {
  try {
    impl_->command({"XGROUP", "CREATE", stream, group, start_id, "MKSTREAM"});
    return true;
  } catch (const StorageError& e) {
    if (std::strstr(e.what(), "BUSYGROUP") != nullptr) return false;
    throw;
  }
}

namespace {
std::vector<std::string_view> xadd_args(std::string_view stream, const Fields& fields) {
  if (fields.empty()) throw UsageError("idem::mq::RedisStreams: an entry needs a field");
  std::vector<std::string_view> args{"XADD", stream, "*"};
  for (const auto& [k, v] : fields) {
    args.emplace_back(k);
    args.emplace_back(v);
  }
  return args;
}
}  // namespace

std::string RedisStreams::add(std::string_view stream, const Fields& fields) {
  auto r = impl_->command(xadd_args(stream, fields), /*write=*/true);
  return str(r.get());
}

std::vector<std::string> RedisStreams::add_many(std::string_view stream,
                                                const std::vector<Fields>& entries) {
  std::vector<std::vector<std::string_view>> cmds;
  cmds.reserve(entries.size());
  for (const auto& f : entries) cmds.push_back(xadd_args(stream, f));
  std::vector<std::string> ids;
  if (cmds.empty()) return ids;
  auto replies = impl_->pipeline(cmds, /*write=*/true);
  for (auto& r : replies) {
    impl_->throw_if_error(r.get(), "XADD");
    ids.push_back(str(r.get()));
  }
  return ids;
}

std::vector<StreamEntry> RedisStreams::read_group(std::string_view stream, std::string_view group,
                                                  std::string_view consumer, std::size_t count,
                                                  std::optional<std::chrono::milliseconds> block,
                                                  std::string_view id) {
  if (count == 0) throw UsageError("idem::mq::RedisStreams: read count must be positive");
  std::string n = std::to_string(count);
  std::string b = block ? std::to_string(block->count()) : std::string();
  std::vector<std::string_view> args{"XREADGROUP", "GROUP", group, consumer, "COUNT", n};
  if (block) {
    args.emplace_back("BLOCK");
    args.emplace_back(b);
  }
  args.emplace_back("STREAMS");
  args.emplace_back(stream);
  args.emplace_back(id);
  auto r = impl_->command(args, false, block.value_or(std::chrono::milliseconds(0)));
  std::vector<StreamEntry> out;
  if (r->type == REDIS_REPLY_NIL) return out;
  check_type(r.get(), REDIS_REPLY_ARRAY, "XREADGROUP");
  // [[stream, [entries...]]]
  for (std::size_t i = 0; i < r->elements; ++i) {
    const redisReply* s = r->element[i];
    check_type(s, REDIS_REPLY_ARRAY, "XREADGROUP stream");
    if (s->elements < 2) continue;
    auto entries = parse_entries(s->element[1]);
    bool own_pending = id != ">";
    for (auto& e : entries) {
      if (own_pending) e.delivery_count = 2;
      out.push_back(std::move(e));
    }
  }
  return out;
}

std::uint64_t RedisStreams::ack(std::string_view stream, std::string_view group,
                                const std::vector<std::string>& ids) {
  if (ids.empty()) return 0;
  std::vector<std::string_view> args{"XACK", stream, group};
  for (const auto& id : ids) args.emplace_back(id);
  return to_u64(impl_->command(args).get());
}

AutoClaimResult RedisStreams::auto_claim(std::string_view stream, std::string_view group,
                                         std::string_view consumer,
                                         std::chrono::milliseconds min_idle, std::string_view start,
                                         std::size_t count) {
  if (count == 0) throw UsageError("idem::mq::RedisStreams: claim count must be positive");
  std::string idle = std::to_string(min_idle.count());
  std::string n = std::to_string(count);
  auto r = impl_->command({"XAUTOCLAIM", stream, group, consumer, idle, start, "COUNT", n});
  check_type(r.get(), REDIS_REPLY_ARRAY, "XAUTOCLAIM");
  AutoClaimResult out;
  if (r->elements >= 1) out.next_start = str(r->element[0]);
  if (r->elements >= 2) {
    for (auto& e : parse_entries(r->element[1])) {
      if (e.fields.empty()) continue;  // deleted meanwhile (Redis 6.2 reports them this way)
      out.entries.push_back(std::move(e));
    }
  }
  if (r->elements >= 3 && r->element[2]->type == REDIS_REPLY_ARRAY) {
    for (std::size_t i = 0; i < r->element[2]->elements; ++i) {
      out.deleted.push_back(str(r->element[2]->element[i]));
    }
  }
  if (out.entries.empty()) return out;
  // Exact delivery counts: one XPENDING over the claimed id range, for this consumer.
  std::string m = std::to_string(out.entries.size() * 2 + 16);
  auto p = impl_->command(
      {"XPENDING", stream, group, out.entries.front().id, out.entries.back().id, m, consumer});
  std::unordered_map<std::string, std::uint32_t> counts;
  if (p->type == REDIS_REPLY_ARRAY) {
    for (std::size_t i = 0; i < p->elements; ++i) {
      const redisReply* row = p->element[i];
      if (row->type == REDIS_REPLY_ARRAY && row->elements >= 4) {
        counts[str(row->element[0])] = static_cast<std::uint32_t>(to_u64(row->element[3]));
      }
    }
  }
  for (auto& e : out.entries) {
    auto it = counts.find(e.id);
    e.delivery_count = it == counts.end() ? 2 : std::max<std::uint32_t>(2, it->second);
  }
  return out;
}

PendingSummary RedisStreams::pending(std::string_view stream, std::string_view group) {
  auto r = impl_->command({"XPENDING", stream, group});
  check_type(r.get(), REDIS_REPLY_ARRAY, "XPENDING");
  PendingSummary s;
  if (r->elements >= 1) s.count = to_u64(r->element[0]);
  if (r->elements >= 4 && r->element[3]->type == REDIS_REPLY_ARRAY) {
    for (std::size_t i = 0; i < r->element[3]->elements; ++i) {
      const redisReply* c = r->element[3]->element[i];
      if (c->type == REDIS_REPLY_ARRAY && c->elements >= 2) {
        s.consumers.emplace_back(str(c->element[0]), to_u64(c->element[1]));
      }
    }
  }
  return s;
}

std::uint64_t RedisStreams::length(std::string_view stream) {
  return to_u64(impl_->command({"XLEN", stream}).get());
}

std::vector<StreamEntry> RedisStreams::range(std::string_view stream) {
  auto r = impl_->command({"XRANGE", stream, "-", "+"});
  return parse_entries(r.get());
}

std::uint64_t RedisStreams::del(std::string_view key) {
  return to_u64(impl_->command({"DEL", key}).get());
}

void RedisStreams::ping() { impl_->command({"PING"}); }

}  // namespace idem::mq
