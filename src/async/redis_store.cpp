// SPDX-License-Identifier: MIT
// idem::async::AsyncRedisStore: claim / complete / release / fill / lookup on the loop.
#include "idem/async/redis_store.hpp"

#include <hiredis/hiredis.h>

#include <atomic>
#include <initializer_list>
#include <utility>
#include <vector>

#include "close_on_strand.hpp"
#include "idem/errors.hpp"
#include "redis/command_parts.hpp"
#include "redis/record_codec.hpp"
#include "redis/router.hpp"
#include "redis/scripts.hpp"
#include "redis_client.hpp"
#include "redis_errors.hpp"

namespace idem::async {
namespace {

using redis::detail::ClaimPrefix;
using redis::detail::Num;
using redis::detail::RedisKey;
using redis::detail::Script;

template <class Duration>
std::chrono::milliseconds positive_ms(Duration d, std::chrono::milliseconds fallback) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(d);
  return ms.count() > 0 ? ms : fallback;
}

std::string describe(const char* op, std::string_view key) {
  std::string s = op;
  s.push_back(' ');
  s.append(key);
  return s;
}

std::string_view text_of(const redisReply* r) noexcept { return {r->str, r->len}; }

bool starts_with(std::string_view s, std::string_view p) noexcept {
  return s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}

// Completes `done` on `ex` (never inside the call that started it: the store's strand is not
// the caller's executor, so this is a post unless the caller runs on the store's strand).
template <class T>
void settle(const Executor& ex, Completion<T>& done, std::exception_ptr e, T value) {
  net::dispatch(ex, [done = std::move(done), e = std::move(e), v = std::move(value)]() mutable {
    done(std::move(e), std::move(v));
  });
}

// The asynchronous store speaks plain TCP only (hiredis' asynchronous API, without the TLS layer
// the synchronous RedisStore adds): a TLS address is refused, never connected to in cleartext.
redis::detail::Topology plain_topology(const std::string& uri) {
  redis::detail::Topology t = redis::detail::parse_topology(uri);
  bool tls = t.node_template.tls;
  for (const auto& e : t.endpoints) tls = tls || e.tls;
  if (tls) {
    throw UsageError(
        "idem::async::AsyncRedisStore: TLS (rediss://) is not supported by the asynchronous "
        "store, which would reach the server without it; use idem::redis::RedisStore, or a "
        "local TLS tunnel (stunnel) with a redis:// address");
  }
  return t;
}

}  // namespace

class IDEM_LOCAL AsyncRedisStore::Impl : public std::enable_shared_from_this<AsyncRedisStore::Impl> {
 public:
  Impl(Executor executor, AsyncRedisStoreOptions o)
      : options_(normalise(std::move(o))),
        strand_(net::make_strand(executor)),
        client_(strand_, plain_topology(options_.uri), settings(options_)),
        claim_(redis::detail::kClaimScript),
        complete_(redis::detail::kCompleteScript),
        release_(redis::detail::kReleaseScript),
        lookup_(redis::detail::kLookupScript),
        native_claim_(!options_.claim_script) {}

  static AsyncRedisStoreOptions normalise(AsyncRedisStoreOptions o) {
    o.connect_timeout = positive_ms(o.connect_timeout, std::chrono::milliseconds(500));
    o.command_timeout = positive_ms(o.command_timeout, std::chrono::milliseconds(1000));
    if (o.reconnect_backoff.count() < 0) {
      throw UsageError(
          "idem::async: AsyncRedisStoreOptions::reconnect_backoff must not be negative");
    }
    o.topology_refresh_interval =
        positive_ms(o.topology_refresh_interval, std::chrono::milliseconds(100));
    if (o.sentinel_check_interval.count() < 0) {
      throw UsageError(
          "idem::async: AsyncRedisStoreOptions::sentinel_check_interval must not be negative");
    }
    if (o.key_prefix.find_first_of("{}") != std::string::npos) {
      throw UsageError(
          "idem::async: AsyncRedisStoreOptions::key_prefix must not contain '{' or '}' "
          "(they delimit the Redis Cluster hash tag)");
    }
    return o;
  }

  static detail::ClientSettings settings(const AsyncRedisStoreOptions& o) {
    detail::ClientSettings s;
    s.connection.connect_timeout = o.connect_timeout;
    s.connection.command_timeout = o.command_timeout;
    s.connection.reconnect_backoff = o.reconnect_backoff;
    s.refresh_interval = o.topology_refresh_interval;
    s.sentinel_check = o.sentinel_check_interval;
    return s;
  }

  // Runs `fn` on the store's strand (inline when already there).
  template <class Fn>
  void on_strand(Fn&& fn) {
    net::dispatch(strand_, std::forward<Fn>(fn));
  }

  // --- claim --------------------------------------------------------------------------------

  void claim(const Key& key, std::string_view fingerprint, const OwnerToken& owner,
             std::chrono::milliseconds lease, const Executor& ex, Completion<ClaimResult> done) {
    try {
      idem::detail::check_term(lease, "idem::redis: the lease");
    } catch (const UsageError&) {
      return settle(ex, done, std::current_exception(), ClaimResult{});
    }
    auto call = std::make_unique<ClaimCall>();
    RedisKey rk(options_.key_prefix, key);
    call->key.assign(rk.view());
    call->fingerprint.assign(fingerprint);
    call->owner = owner;
    call->lease_ms = lease.count();
    redis::detail::SmallBuf record;
    std::size_t owner_end = 0;
    redis::detail::append_new_claim(record, owner.str(), fingerprint, lease, owner_end);
    call->record.assign(record.view());
    call->ex = ex;
    call->done = std::move(done);
    on_strand([self = shared_from_this(), call = std::move(call)]() mutable {
      self->send_claim(std::move(call));
    });
  }

  struct ClaimCall {
    std::string key, fingerprint, record;
    OwnerToken owner = OwnerToken::from_string("");
    long long lease_ms = 0;
    Executor ex;
    Completion<ClaimResult> done;
    bool scripted = false;
  };

  void send_claim(std::unique_ptr<ClaimCall> c) {
    const Num lease(c->lease_ms);
    std::string resp;
    if (native_claim_.load(std::memory_order_relaxed) && !c->scripted) {
      const std::string_view argv[] = {"SET", c->key, c->record, "NX", "PX", lease.view(), "GET"};
      detail::append_resp(resp, 7, argv);
      const std::string key = c->key;
      client_.command(key, std::move(resp), {"claim", false},
                      [self = shared_from_this(), c = std::move(c)](const redisReply* r,
                                                                    std::exception_ptr e) mutable {
                        self->claim_answered(std::move(c), r, std::move(e));
                      });
      return;
    }
    c->scripted = true;
    std::vector<std::string> args{c->record, std::string(lease.view())};
    const std::string key = c->key;
    eval(claim_, "claim", false, key, std::move(args),
         [self = shared_from_this(), c = std::move(c)](const redisReply* r,
                                                       std::exception_ptr e) mutable {
           self->claim_answered(std::move(c), r, std::move(e));
         });
  }

  void claim_answered(std::unique_ptr<ClaimCall> c, const redisReply* r, std::exception_ptr e) {
    if (e) return settle(c->ex, c->done, std::move(e), ClaimResult{});
    const std::string what = describe("claim", c->key);
    if (r->type == REDIS_REPLY_ERROR) {
      const std::string_view text = text_of(r);
      if (!c->scripted && (starts_with(text, "ERR syntax error") || starts_with(text, "OOM "))) {
        // Redis < 7.0 rejects NX with GET (claim with the script from now on); -OOM: the
        // script still answers busy / done / mismatch from a read.
        if (starts_with(text, "ERR syntax error")) {
          native_claim_.store(false, std::memory_order_relaxed);
        }
        c->scripted = true;
        return send_claim(std::move(c));
      }
      return settle(c->ex, c->done, detail::reply_error(what, text), ClaimResult{});
    }
    ClaimResult result;
    if (r->type == REDIS_REPLY_NIL) return settle(c->ex, c->done, nullptr, std::move(result));
    if (r->type != REDIS_REPLY_STRING) {
      return settle(c->ex, c->done,
                    detail::protocol_error(what, "expected nil or the existing record"),
                    ClaimResult{});
    }
    if (!redis::detail::answer_found(text_of(r), c->fingerprint, c->owner, result)) {
      return settle(c->ex, c->done, detail::corrupt_error(what, "not an idem record"),
                    ClaimResult{});
    }
    settle(c->ex, c->done, nullptr, std::move(result));
  }

  // --- complete / release / fill / lookup ---------------------------------------------------

  // complete ("C") and fail ("F"): the general, owner-checked script.
  void finish(const Key& key, const OwnerToken& owner, std::string_view response,
              std::chrono::seconds retention, const char* letter, const Executor& ex,
              Completion<bool> done) {
    try {
      idem::detail::check_term(retention, "idem::redis: the retention");
    } catch (const UsageError&) {
      return settle(ex, done, std::current_exception(), false);
    }
    const long long ret_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(retention).count();
    RedisKey rk(options_.key_prefix, key);
    ClaimPrefix mine(owner), mine_v1(owner, 1);
    const char status = letter[0];
    const char tag = redis::detail::final_tag(status);
    // kCompleteScript: the claim prefix (format 2), the response, the retention, the final
    // tag, the status letter, the claim prefix in format 1 and its deadline (format 1 keeps it).
    std::vector<std::string> args{std::string(mine.view()),
                                  std::string(response),
                                  std::string(Num(ret_ms).view()),
                                  std::string(1, tag),
                                  std::string(1, status),
                                  std::string(mine_v1.view()),
                                  std::string(Num(to_millis(system_now()) + ret_ms).view())};
    flagged(std::string(rk.view()), letter[0] == 'F' ? "fail" : "complete", complete_,
            std::move(args), ex, std::move(done));
  }

  void release(const Key& key, const OwnerToken& owner, const Executor& ex, Completion<bool> done) {
    RedisKey rk(options_.key_prefix, key);
    ClaimPrefix mine(owner), mine_v1(owner, 1);
    flagged(std::string(rk.view()), "release", release_,
            {std::string(mine.view()), std::string(mine_v1.view())}, ex, std::move(done));
  }

  // `first_seen` epoch: now.
  void fill(const Key& key, std::string_view fingerprint, std::string_view response,
            std::chrono::seconds retention, TimePoint first_seen, const Executor& ex,
            Completion<bool> done) {
    try {
      idem::detail::check_term(retention, "idem::redis: the retention");
    } catch (const UsageError&) {
      return settle(ex, done, std::current_exception(), false);
    }
    RedisKey rk(options_.key_prefix, key);
    const Num ms(std::chrono::duration_cast<std::chrono::milliseconds>(retention).count());
    // Owner unknown (the durable store decided): a completed record keeps none.
    std::string value;
    value.reserve(64 + fingerprint.size() + response.size());
    redis::detail::append_filled(value, fingerprint,
                                 to_millis(first_seen == TimePoint{} ? system_now() : first_seen),
                                 response);
    const std::string_view argv[] = {"SET", rk.view(), value, "PX", ms.view()};
    std::string resp;
    detail::append_resp(resp, 5, argv);
    std::string k(rk.view());
    on_strand([self = shared_from_this(), k = std::move(k), resp = std::move(resp), ex,
               done = std::move(done)]() mutable {
      const std::string rkey = k;
      self->client_.command(rkey, std::move(resp), {"fill", true},
                            [k = std::move(k), ex, done = std::move(done)](
                                const redisReply* r, std::exception_ptr e) mutable {
                              if (!e && r->type == REDIS_REPLY_ERROR) {
                                e = detail::reply_error(describe("fill", k), text_of(r));
                              }
                              settle(ex, done, std::move(e), e == nullptr);
                            });
    });
  }

  void lookup(const Key& key, const Executor& ex, Completion<std::optional<Record>> done) {
    RedisKey rk(options_.key_prefix, key);
    std::string k(rk.view());
    on_strand([self = shared_from_this(), k = std::move(k), ex, done = std::move(done)]() mutable {
      const std::string rkey = k;
      self->eval(
          self->lookup_, "lookup", false, rkey, {},
          [k = std::move(k), ex, done = std::move(done)](const redisReply* r,
                                                         std::exception_ptr e) mutable {
            if (e) return settle(ex, done, std::move(e), std::optional<Record>());
            const std::string what = describe("lookup", k);
            if (r->type == REDIS_REPLY_INTEGER && r->integer == 0) {
              return settle(ex, done, nullptr, std::optional<Record>());
            }
            if (r->type != REDIS_REPLY_ARRAY || r->elements != 2) {
              return settle(ex, done, detail::protocol_error(what, "expected 0 or a pair"),
                            std::optional<Record>());
            }
            if (r->element[0]->type == REDIS_REPLY_INTEGER && r->element[0]->integer == 9) {
              return settle(ex, done, detail::corrupt_error(what, text_of(r->element[1])),
                            std::optional<Record>());
            }
            if ((r->element[0]->type != REDIS_REPLY_STRING &&
                 r->element[0]->type != REDIS_REPLY_STATUS) ||
                r->element[1]->type != REDIS_REPLY_INTEGER) {
              return settle(ex, done, detail::protocol_error(what, "malformed lookup answer"),
                            std::optional<Record>());
            }
            auto rec = redis::detail::record_of(text_of(r->element[0]), r->element[1]->integer);
            if (!rec) {
              return settle(ex, done, detail::corrupt_error(what, "not an idem record"),
                            std::optional<Record>());
            }
            settle(ex, done, nullptr, std::move(rec));
          });
    });
  }

  // A script answering 1 / 0 / {9, reason} (complete, release).
  void flagged(std::string key, const char* op, const Script& script, std::vector<std::string> args,
               const Executor& ex, Completion<bool> done) {
    on_strand([self = shared_from_this(), key = std::move(key), op, &script, args = std::move(args),
               ex, done = std::move(done)]() mutable {
      const std::string k = key;
      self->eval(
          script, op, true, k, std::move(args),
          [key = std::move(key), op, ex, done = std::move(done)](const redisReply* r,
                                                                 std::exception_ptr e) mutable {
            if (e) return settle(ex, done, std::move(e), false);
            if (r->type == REDIS_REPLY_INTEGER) {
              return settle(ex, done, nullptr, r->integer == 1);
            }
            const std::string what = describe(op, key);
            if (r->type == REDIS_REPLY_ARRAY && r->elements == 2 &&
                r->element[0]->type == REDIS_REPLY_INTEGER && r->element[0]->integer == 9) {
              return settle(ex, done, detail::corrupt_error(what, text_of(r->element[1])), false);
            }
            settle(ex, done, detail::protocol_error(what, "expected 0, 1 or {9, reason}"), false);
          });
    });
  }

  // EVALSHA; on NOSCRIPT (a restarted, flushed or other node) once EVAL with the text, which
  // also loads it. Error replies become the typed error. Runs on the strand.
  void eval(const Script& script, const char* op, bool write, const std::string& key,
            std::vector<std::string> args, detail::RoutedCallback then) {
    std::string resp = eval_resp("EVALSHA", script.sha_view(), key, args);
    client_.command(
        key, std::move(resp), {op, write},
        [self = shared_from_this(), &script, op, write, key, args = std::move(args),
         then = std::move(then)](const redisReply* r, std::exception_ptr e) mutable {
          if (!e && r->type == REDIS_REPLY_ERROR && starts_with(text_of(r), "NOSCRIPT")) {
            ++self->script_loads_;
            std::string full = eval_resp("EVAL", script.text, key, args);
            self->client_.command(key, std::move(full), {op, write},
                                  [key, op, then = std::move(then)](const redisReply* r2,
                                                                    std::exception_ptr e2) mutable {
                                    if (!e2 && r2->type == REDIS_REPLY_ERROR) {
                                      e2 = detail::reply_error(describe(op, key), text_of(r2));
                                      return then(nullptr, std::move(e2));
                                    }
                                    then(r2, std::move(e2));
                                  });
            return;
          }
          if (!e && r->type == REDIS_REPLY_ERROR) {
            return then(nullptr, detail::reply_error(describe(op, key), text_of(r)));
          }
          then(r, std::move(e));
        });
  }

  static std::string eval_resp(std::string_view verb, std::string_view script, std::string_view key,
                               const std::vector<std::string>& args) {
    std::vector<std::string_view> argv{verb, script, "1", key};
    for (const std::string& a : args) argv.push_back(a);
    std::string resp;
    detail::append_resp(resp, static_cast<int>(argv.size()), argv.data());
    return resp;
  }

  std::string redis_key(const Key& key) const {
    RedisKey rk(options_.key_prefix, key);
    return std::string(rk.view());
  }

  AsyncRedisStats stats() const {
    detail::ConnectionStats c = client_.connection_stats();
    AsyncRedisStats s;
    s.connects = c.connects;
    s.connect_failures = c.connect_failures;
    s.dropped = c.dropped;
    s.fast_failures = c.fast_failures;
    s.timeouts = c.timeouts;
    s.commands = c.commands;
    s.script_loads = script_loads_;
    return s;
  }
  redis::RedisRouteStats route_stats() const { return client_.route_stats(); }
  // On the strand: fails what is in flight and every later call.
  void close() { client_.close(); }
  std::string_view name() const noexcept { return client_.name(); }
  const AsyncRedisStoreOptions& options() const noexcept { return options_; }

 private:
  const AsyncRedisStoreOptions options_;
  net::strand<Executor> strand_;
  detail::RedisClient client_;
  const Script claim_, complete_, release_, lookup_;
  std::atomic<bool> native_claim_;
  std::uint64_t script_loads_ = 0;
};

AsyncRedisStore::AsyncRedisStore(Executor executor, AsyncRedisStoreOptions options)
    : impl_(std::make_shared<Impl>(std::move(executor), std::move(options))) {}

AsyncRedisStore::AsyncRedisStore(Executor executor, std::string_view uri)
    : AsyncRedisStore(std::move(executor), [&] {
        AsyncRedisStoreOptions o;
        o.uri = std::string(uri);
        return o;
      }()) {}

AsyncRedisStore::~AsyncRedisStore() {
  // The connections are closed on the store's strand, whichever thread destroys the store
  // (at once when that is the strand's thread): the loop may be running the store's handlers
  // right now. Calls in flight then complete with StorageUnavailable. A loop that never runs
  // again closes them when its io_context is destroyed (detail::CloseOnStrand).
  std::shared_ptr<Impl> impl = std::move(impl_);
  if (!impl) return;
  Impl* raw = impl.get();
  raw->on_strand(detail::CloseOnStrand<Impl>(std::move(impl)));
}

void AsyncRedisStore::async_claim(const Key& key, std::string_view fingerprint,
                                  const OwnerToken& owner, std::chrono::milliseconds lease,
                                  const Executor& ex, Completion<ClaimResult> done) {
  impl_->claim(key, fingerprint, owner, lease, ex, std::move(done));
}

void AsyncRedisStore::async_complete(const Key& key, const OwnerToken& owner,
                                     std::string_view response, std::chrono::seconds retention,
                                     const Executor& ex, Completion<bool> done) {
  impl_->finish(key, owner, response, retention, "C", ex, std::move(done));
}

void AsyncRedisStore::async_fail(const Key& key, const OwnerToken& owner, std::string_view reason,
                                 std::chrono::seconds retention, const Executor& ex,
                                 Completion<bool> done) {
  impl_->finish(key, owner, reason, retention, "F", ex, std::move(done));
}

void AsyncRedisStore::async_release(const Key& key, const OwnerToken& owner, const Executor& ex,
                                    Completion<bool> done) {
  impl_->release(key, owner, ex, std::move(done));
}

void AsyncRedisStore::async_fill(const Key& key, std::string_view fingerprint,
                                 std::string_view response, std::chrono::seconds retention,
                                 const Executor& ex, Completion<bool> done) {
  impl_->fill(key, fingerprint, response, retention, TimePoint{}, ex, std::move(done));
}

void AsyncRedisStore::async_refill(const Key& key, std::string_view fingerprint,
                                   std::string_view response, std::chrono::seconds retention,
                                   const RecordOrigin& origin, const Executor& ex,
                                   Completion<bool> done) {
  impl_->fill(key, fingerprint, response, retention, origin.first_seen, ex, std::move(done));
}

void AsyncRedisStore::async_lookup(const Key& key, const Executor& ex,
                                   Completion<std::optional<Record>> done) {
  impl_->lookup(key, ex, std::move(done));
}

std::string_view AsyncRedisStore::name() const noexcept { return impl_->name(); }
std::string AsyncRedisStore::redis_key(const Key& key) const { return impl_->redis_key(key); }
AsyncRedisStats AsyncRedisStore::stats() const { return impl_->stats(); }
redis::RedisRouteStats AsyncRedisStore::route_stats() const { return impl_->route_stats(); }
const AsyncRedisStoreOptions& AsyncRedisStore::options() const noexcept { return impl_->options(); }

}  // namespace idem::async
