// SPDX-License-Identifier: MIT
// The local tier of a RedisStore (see local_tier.hpp).
#include "local_tier.hpp"

#include <hiredis/hiredis.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <string>
#include <utility>

#include "hiredis_handles.hpp"
#include "idem/detail/record_rules.hpp"
#include "idem/errors.hpp"

namespace idem::redis::detail {
namespace {

// Counted per entry on top of its strings (list node, index slot, allocator headers).
constexpr std::size_t kEntryOverhead = 128;

constexpr std::string_view kChannel = "__redis__:invalidate";

ReplyUPtr setup(redisContext* c, std::initializer_list<std::string_view> args) {
  const char* argv[8];
  std::size_t lens[8];
  int argc = 0;
  for (std::string_view a : args) {
    argv[argc] = a.data();
    lens[argc] = a.size();
    ++argc;
  }
  return ReplyUPtr(static_cast<redisReply*>(redisCommandArgv(c, argc, argv, lens)));
}

std::string_view text(const redisReply* r) noexcept { return {r->str, r->len}; }

}  // namespace

LocalTier::LocalTier(LocalTierSettings settings, std::function<Pool&()> server)
    : settings_(std::move(settings)), server_(std::move(server)) {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) throw StorageError("idem::redis: local tier: cannot create an eventfd");
  index_.reserve(std::min<std::size_t>(settings_.max_entries, 1 << 16));
  thread_ = std::thread([this] { run(); });
}

LocalTier::~LocalTier() {
  stop_.store(true);
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t w = ::write(wake_fd_, &one, sizeof one);
  thread_.join();
  ::close(wake_fd_);
}

std::size_t LocalTier::stripe_of(std::string_view redis_key) noexcept {
  return std::hash<std::string_view>{}(redis_key) % kStripes;
}

LocalTier::Ticket LocalTier::ticket(std::string_view redis_key) const noexcept {
  Ticket t;
  t.generation = generation_.load(std::memory_order_acquire);
  t.stripe = stripes_[stripe_of(redis_key)].load(std::memory_order_acquire);
  return t;
}

bool LocalTier::filling() const noexcept {
  const State s = state_.load(std::memory_order_relaxed);
  return s == State::kTracking ||
         (s == State::kUntracked && settings_.ttl_when_untracked.count() > 0);
}

LocalTier::List::iterator LocalTier::find_fresh(std::string_view redis_key) {
  auto at = index_.find(redis_key);
  if (at == index_.end()) return lru_.end();
  List::iterator it = at->second;
  if (it->expires <= std::chrono::steady_clock::now()) {
    erase(it);
    return lru_.end();
  }
  lru_.splice(lru_.begin(), lru_, it);  // most recently used
  return it;
}

void LocalTier::erase(List::iterator it) {
  index_.erase(std::string_view(it->key));
  bytes_ -= it->bytes;
  lru_.erase(it);
}

LocalTier::Answer LocalTier::claim(std::string_view redis_key, std::string_view fingerprint,
                                   std::string_view owner, ClaimResult& out) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = find_fresh(redis_key);
    if (it != lru_.end()) {
      if (it->fingerprint == fingerprint) {
        idem::detail::FoundRecord f;
        f.status = Record::Status::kCompleted;
        f.fingerprint = it->fingerprint;
        f.owner = it->owner;
        f.response = it->response;
        f.created_at = from_millis(it->created_ms);
        out = std::move(idem::detail::decide_claim(f, fingerprint, owner).result);
        hits_.fetch_add(1, std::memory_order_relaxed);
        return Answer::kHit;
      }
      // Never a mismatch from here: Redis answers it through the ordinary path.
      fingerprint_misses_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  misses_.fetch_add(1, std::memory_order_relaxed);
  return Answer::kMiss;
}

LocalTier::Answer LocalTier::lookup(std::string_view redis_key, Record& out) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = find_fresh(redis_key);
    if (it != lru_.end()) {
      out.status = Record::Status::kCompleted;
      out.fingerprint = it->fingerprint;
      out.owner = it->owner;
      out.response = it->response;
      out.created_at = from_millis(it->created_ms);
      out.updated_at = out.created_at;
      out.expires_at = it->expires_system;
      hits_.fetch_add(1, std::memory_order_relaxed);
      return Answer::kHit;
    }
  }
  misses_.fetch_add(1, std::memory_order_relaxed);
  return Answer::kMiss;
}

void LocalTier::fill(std::string_view redis_key, const Ticket& t, std::string_view fingerprint,
                     std::string_view owner, std::string_view response, long long created_ms,
                     long long pttl_ms, std::chrono::steady_clock::time_point sent_at,
                     TimePoint sent_at_system) {
  const std::size_t bytes =
      redis_key.size() + fingerprint.size() + owner.size() + response.size() + kEntryOverhead;
  if (pttl_ms <= 0 || bytes > settings_.max_bytes) {
    fills_skipped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // The record lives pttl_ms from when Redis answered, which is after the read was sent.
  auto expires = sent_at + std::chrono::milliseconds(pttl_ms);
  TimePoint expires_system = sent_at_system + std::chrono::milliseconds(pttl_ms);
  Entry e;
  e.key.assign(redis_key);
  e.fingerprint.assign(fingerprint);
  e.owner.assign(owner);
  e.response.assign(response);
  e.created_ms = created_ms;
  e.bytes = bytes;
  std::lock_guard<std::mutex> lock(mutex_);
  const State s = state_.load(std::memory_order_relaxed);
  if (s == State::kUntracked) {
    const auto cap = std::chrono::steady_clock::now() + settings_.ttl_when_untracked;
    if (cap < expires) {
      expires = cap;
      expires_system = std::min(expires_system, system_now() + settings_.ttl_when_untracked);
    }
  }
  if (!filling() || generation_.load(std::memory_order_relaxed) != t.generation ||
      stripes_[stripe_of(redis_key)].load(std::memory_order_relaxed) != t.stripe) {
    fills_skipped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  e.expires = expires;
  e.expires_system = expires_system;
  if (auto at = index_.find(redis_key); at != index_.end()) erase(at->second);
  lru_.push_front(std::move(e));
  index_.emplace(std::string_view(lru_.front().key), lru_.begin());
  bytes_ += bytes;
  fills_.fetch_add(1, std::memory_order_relaxed);
  while (lru_.size() > settings_.max_entries || bytes_ > settings_.max_bytes) {
    erase(std::prev(lru_.end()));
    evictions_.fetch_add(1, std::memory_order_relaxed);
  }
}

void LocalTier::forget(std::string_view redis_key) {
  std::lock_guard<std::mutex> lock(mutex_);
  stripes_[stripe_of(redis_key)].fetch_add(1, std::memory_order_acq_rel);
  if (auto at = index_.find(redis_key); at != index_.end()) erase(at->second);
}

void LocalTier::invalidate(std::string_view redis_key) {
  invalidations_.fetch_add(1, std::memory_order_relaxed);
  forget(redis_key);
}

void LocalTier::drop_all(State next) {
  List gone;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    gone.swap(lru_);
    index_.clear();
    bytes_ = 0;
    generation_.fetch_add(1, std::memory_order_acq_rel);  // every ticket taken before is stale
    state_.store(next, std::memory_order_relaxed);
  }
  // `gone` is freed here, outside the lock.
}

void LocalTier::set_state(State next) {
  std::lock_guard<std::mutex> lock(mutex_);
  state_.store(next, std::memory_order_relaxed);
}

RedisLocalTierStats LocalTier::stats() const {
  RedisLocalTierStats s;
  s.hits = hits_.load(std::memory_order_relaxed);
  s.misses = misses_.load(std::memory_order_relaxed);
  s.fingerprint_misses = fingerprint_misses_.load(std::memory_order_relaxed);
  s.fills = fills_.load(std::memory_order_relaxed);
  s.fills_skipped = fills_skipped_.load(std::memory_order_relaxed);
  s.invalidations = invalidations_.load(std::memory_order_relaxed);
  s.evictions = evictions_.load(std::memory_order_relaxed);
  s.drops = drops_.load(std::memory_order_relaxed);
  s.tracking_starts = tracking_starts_.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mutex_);
  s.entries = lru_.size();
  s.bytes = bytes_;
  s.tracking = state_.load(std::memory_order_relaxed) == State::kTracking;
  s.untracked = state_.load(std::memory_order_relaxed) == State::kUntracked;
  return s;
}

void LocalTier::log(LogLevel level, const std::string& line) const {
  if (settings_.log) settings_.log(level, line);
}

bool LocalTier::sleep_for(std::chrono::milliseconds d) {
  pollfd p{wake_fd_, POLLIN, 0};
  if (!stop_.load()) ::poll(&p, 1, static_cast<int>(std::max<long long>(d.count(), 1)));
  return stop_.load();
}

void LocalTier::run() {
  while (!stop_.load()) {
    Pool* server = nullptr;
    try {
      server = &server_();
    } catch (...) {
      // No server known yet (Sentinel without an answer): nothing kept, asked again later.
      if (sleep_for(settings_.retry)) return;
      continue;
    }
    if (serve(*server)) return;
  }
}

bool LocalTier::serve(Pool& server) {
  PoolSettings ps = server.settings();  // same address, TLS, credentials and db as the store
  ps.size = 1;
  ps.auto_pipeline = false;
  ps.wait_timeout = std::chrono::milliseconds(0);
  Pool pool(ps);
  std::optional<Pool::Lease> conn;
  try {
    conn.emplace(pool.acquire("local tier invalidation connection"));
  } catch (const std::exception&) {
    if (state_.load() != State::kDown) {
      drop_all(State::kDown);
      drops_.fetch_add(1, std::memory_order_relaxed);
    }
    return sleep_for(settings_.retry);
  }
  redisContext* c = conn->get();
  // Setup: CLIENT ID, tracking in broadcast mode redirected to this very connection, then the
  // subscription (RESP2: the invalidations arrive as messages of __redis__:invalidate).
  std::string refused;
  ReplyUPtr id = setup(c, {"CLIENT", "ID"});
  bool broken = !id;
  if (!broken && id->type != REDIS_REPLY_INTEGER) {
    refused = id->type == REDIS_REPLY_ERROR ? std::string(text(id.get())) : "CLIENT ID: no id";
  }
  if (!broken && refused.empty()) {
    const std::string me = std::to_string(id->integer);
    ReplyUPtr r = settings_.key_prefix.empty()
                      ? setup(c, {"CLIENT", "TRACKING", "ON", "REDIRECT", me, "BCAST"})
                      : setup(c, {"CLIENT", "TRACKING", "ON", "REDIRECT", me, "BCAST", "PREFIX",
                                  settings_.key_prefix});
    broken = !r;
    if (!broken && r->type == REDIS_REPLY_ERROR) refused = text(r.get());
  }
  if (!broken && refused.empty()) {
    ReplyUPtr r = setup(c, {"SUBSCRIBE", kChannel});
    broken = !r;
    if (!broken && r->type == REDIS_REPLY_ERROR) refused = text(r.get());
  }
  if (broken) {
    conn->discard(true);
    if (state_.load() != State::kDown) {
      drop_all(State::kDown);
      drops_.fetch_add(1, std::memory_order_relaxed);
    }
    return sleep_for(settings_.retry);
  }
  if (!refused.empty()) {
    // No invalidations: entries live at most ttl_when_untracked. Asked again now and then (an
    // ACL may change), the bound in force meanwhile.
    if (state_.load() != State::kUntracked) drop_all(State::kUntracked);
    if (!untracked_logged_) {
      untracked_logged_ = true;
      log(LogLevel::kWarn,
          "idem redis local tier untracked error=" + idem::log::quote_field(refused) +
              " ttl_ms=" + std::to_string(settings_.ttl_when_untracked.count()));
    }
    conn.reset();
    return sleep_for(std::max(settings_.retry, std::chrono::milliseconds(10000)));
  }
  // Tracking established: every record kept from now on is heard of when it changes. Tickets
  // taken before (reads that may have missed an invalidation) are stale.
  drop_all(State::kTracking);
  tracking_starts_.fetch_add(1, std::memory_order_relaxed);
  if (untracked_logged_) log(LogLevel::kInfo, "idem redis local tier tracking established");
  const int timeout_ms =
      settings_.recheck.count() > 0 ? static_cast<int>(settings_.recheck.count()) : -1;
  for (;;) {
    // Every message hiredis has buffered, then wait for more.
    void* raw = nullptr;
    while (redisReaderGetReply(c->reader, &raw) == REDIS_OK && raw != nullptr) {
      ReplyUPtr m(static_cast<redisReply*>(raw));
      raw = nullptr;
      if (m->type != REDIS_REPLY_ARRAY || m->elements != 3 ||
          m->element[0]->type != REDIS_REPLY_STRING || text(m->element[0]) != "message") {
        continue;  // the subscription's confirmation
      }
      const redisReply* keys = m->element[2];
      if (keys->type == REDIS_REPLY_ARRAY) {
        for (std::size_t i = 0; i < keys->elements; ++i) {
          if (keys->element[i]->type == REDIS_REPLY_STRING) invalidate(text(keys->element[i]));
        }
      } else if (keys->type == REDIS_REPLY_STRING) {
        invalidate(text(keys));
      } else {
        // nil: FLUSHDB / FLUSHALL (every key changed). Tracking stays on.
        drop_all(State::kTracking);
        drops_.fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (c->reader->err != 0) break;
    pollfd fds[2] = {{c->fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    const int n = ::poll(fds, 2, timeout_ms);
    if (stop_.load()) return true;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    if (n == 0) {
      // Sentinel: a failover moved the master; this connection no longer hears its writes.
      Pool* now = nullptr;
      try {
        now = &server_();
      } catch (...) {
        now = &server;  // none known now: keep listening where we are
      }
      if (now != &server) break;
      continue;
    }
    if ((fds[0].revents & (POLLIN | POLLHUP | POLLERR)) != 0 && redisBufferRead(c) != REDIS_OK) {
      break;
    }
  }
  // Broken (EOF, CLIENT KILL, restart) or replaced: invalidations may have been missed.
  drop_all(State::kDown);
  drops_.fetch_add(1, std::memory_order_relaxed);
  conn->discard(true);
  return stop_.load();
}

}  // namespace idem::redis::detail
