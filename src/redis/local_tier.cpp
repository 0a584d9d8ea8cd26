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
  // command_argv: written with send(MSG_NOSIGNAL), so a connection the server closed meanwhile
  // fails typed instead of raising SIGPIPE.
  return ReplyUPtr(command_argv(c, argc, argv, lens));
}

std::string_view text(const redisReply* r) noexcept { return {r->str, r->len}; }

}  // namespace

struct LocalTier::Conn {
  Pool* server = nullptr;
  std::unique_ptr<Pool> pool;        // of this connection alone (the node's settings, size 1)
  std::optional<Pool::Lease> lease;  // open
  std::optional<NodeState> state;    // set while established (tracking) or refused (untracked)
  std::chrono::steady_clock::time_point next_try{};
};

LocalTier::LocalTier(LocalTierSettings settings, std::function<std::vector<Pool*>()> servers)
    : settings_(std::move(settings)), servers_(std::move(servers)) {
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

void LocalTier::fill(std::string_view redis_key, const Ticket& t, const Pool* server,
                     std::string_view fingerprint, std::string_view owner,
                     std::string_view response, long long created_ms, long long pttl_ms,
                     std::chrono::steady_clock::time_point sent_at, TimePoint sent_at_system) {
  const std::size_t bytes = cost(redis_key, fingerprint, owner, response);
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
  auto node = nodes_.find(server);
  bool keep = node != nodes_.end() && generation_.load(std::memory_order_relaxed) == t.generation &&
              stripes_[stripe_of(redis_key)].load(std::memory_order_relaxed) == t.stripe;
  if (keep && node->second == NodeState::kUntracked) {
    // No invalidations from that node: kept at most ttl_when_untracked.
    keep = settings_.ttl_when_untracked.count() > 0;
    const auto cap = std::chrono::steady_clock::now() + settings_.ttl_when_untracked;
    if (cap < expires) {
      expires = cap;
      expires_system = std::min(expires_system, system_now() + settings_.ttl_when_untracked);
    }
  }
  if (!keep) {
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

void LocalTier::drop_all() {
  List gone;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    gone.swap(lru_);
    index_.clear();
    bytes_ = 0;
    generation_.fetch_add(1, std::memory_order_acq_rel);  // every ticket taken before is stale
  }
  drops_.fetch_add(1, std::memory_order_relaxed);
  // `gone` is freed here, outside the lock.
}

void LocalTier::set_node(const Pool* server, std::optional<NodeState> state) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state) {
    nodes_[server] = *state;
    // Reads sent before this node was heard may have missed its invalidations.
    generation_.fetch_add(1, std::memory_order_acq_rel);
  } else {
    nodes_.erase(server);
  }
  bool any = false;
  for (const auto& n : nodes_) {
    any = any || n.second == NodeState::kTracking || settings_.ttl_when_untracked.count() > 0;
  }
  filling_.store(any, std::memory_order_relaxed);
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
  s.tracking = all_tracked_.load(std::memory_order_relaxed);
  s.untracked = any_untracked_.load(std::memory_order_relaxed);
  return s;
}

void LocalTier::log(LogLevel level, const std::string& line) const {
  if (settings_.log) settings_.log(level, line);
}

void LocalTier::run() {
  using Clock = std::chrono::steady_clock;
  std::vector<std::unique_ptr<Conn>> conns;
  Clock::time_point next_recheck = Clock::now();
  while (!stop_.load()) {
    Clock::time_point now = Clock::now();
    if (now >= next_recheck) {
      next_recheck = now + settings_.recheck;
      try {
        const std::vector<Pool*> want = servers_();
        // A node that no longer serves (failover, new slot map): its keys are served where this
        // process may not have heard every write yet.
        bool removed = false;
        for (auto it = conns.begin(); it != conns.end();) {
          if (std::find(want.begin(), want.end(), (*it)->server) == want.end()) {
            removed = removed || (*it)->state == NodeState::kTracking;
            close(**it, false);
            it = conns.erase(it);
          } else {
            ++it;
          }
        }
        if (removed) drop_all();
        for (Pool* p : want) {
          auto same = [p](const std::unique_ptr<Conn>& c) { return c->server == p; };
          if (std::none_of(conns.begin(), conns.end(), same)) {
            conns.push_back(std::make_unique<Conn>());
            conns.back()->server = p;
            conns.back()->next_try = now;
          }
        }
      } catch (...) {
        // Nothing known now (no master, no slot map): the connections stay as they are.
      }
    }
    for (auto& c : conns) {
      if (!c->lease && Clock::now() >= c->next_try && !stop_.load()) open(*c);
    }
    bool all = !conns.empty(), untracked = false;
    for (const auto& c : conns) {
      all = all && c->state == NodeState::kTracking;
      untracked = untracked || c->state == NodeState::kUntracked;
    }
    all_tracked_.store(all, std::memory_order_relaxed);
    any_untracked_.store(untracked, std::memory_order_relaxed);

    std::vector<pollfd> fds;
    std::vector<Conn*> polled;
    Clock::time_point until = next_recheck;
    for (auto& c : conns) {
      if (c->lease) {
        fds.push_back(pollfd{c->lease->get()->fd, POLLIN, 0});
        polled.push_back(c.get());
      } else {
        until = std::min(until, c->next_try);
      }
    }
    fds.push_back(pollfd{wake_fd_, POLLIN, 0});
    now = Clock::now();
    const auto wait =
        until > now ? std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count() + 1
                    : 0;
    const int n = ::poll(fds.data(), fds.size(), static_cast<int>(wait));
    if (stop_.load()) break;
    if (n <= 0) continue;  // timeout, EINTR
    for (std::size_t i = 0; i < polled.size(); ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) != 0 && !read(*polled[i])) {
        close(*polled[i], true);
      }
    }
  }
  for (auto& c : conns) close(*c, false);
}

void LocalTier::open(Conn& conn) {
  using Clock = std::chrono::steady_clock;
  PoolSettings ps = conn.server->settings();  // same address, TLS, credentials and db
  ps.size = 1;
  ps.auto_pipeline = false;
  ps.wait_timeout = std::chrono::milliseconds(0);
  conn.pool = std::make_unique<Pool>(ps);
  try {
    conn.lease.emplace(conn.pool->acquire("local tier invalidation connection"));
  } catch (const std::exception&) {
    conn.pool.reset();
    conn.next_try = Clock::now() + settings_.retry;
    return;
  }
  redisContext* c = conn.lease->get();
  // CLIENT ID, tracking in broadcast mode redirected to this very connection, then the
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
    close(conn, true);
    conn.next_try = Clock::now() + settings_.retry;
    return;
  }
  if (!refused.empty()) {
    // No invalidations from this node: its records live at most ttl_when_untracked. Asked
    // again now and then (an ACL may change), the bound in force meanwhile.
    conn.lease.reset();
    conn.pool.reset();
    conn.state = NodeState::kUntracked;
    set_node(conn.server, NodeState::kUntracked);
    if (!untracked_logged_) {
      untracked_logged_ = true;
      log(LogLevel::kWarn,
          "idem redis local tier untracked error=" + idem::log::quote_field(refused) +
              " ttl_ms=" + std::to_string(settings_.ttl_when_untracked.count()));
    }
    conn.next_try = Clock::now() + std::max(settings_.retry, std::chrono::milliseconds(10000));
    return;
  }
  // Tracking established: every record of this node kept from now on is heard of when it
  // changes (tickets taken before are stale).
  conn.state = NodeState::kTracking;
  set_node(conn.server, NodeState::kTracking);
  tracking_starts_.fetch_add(1, std::memory_order_relaxed);
  if (untracked_logged_) log(LogLevel::kInfo, "idem redis local tier tracking established");
  if (!read(conn)) close(conn, true);  // whatever arrived with the subscription's reply
}

// Reads what the socket has (when `conn` was polled readable; a no-op read otherwise is not
// made) and handles every complete message. false: the connection broke.
bool LocalTier::read(Conn& conn) {
  redisContext* c = conn.lease->get();
  pollfd p{c->fd, POLLIN, 0};
  if (::poll(&p, 1, 0) > 0 && redisBufferRead(c) != REDIS_OK) return false;
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
      drop_all();  // nil: FLUSHDB / FLUSHALL (every key changed); tracking stays on
    }
  }
  return c->reader->err == 0;
}

void LocalTier::close(Conn& conn, bool broken) {
  const bool was_tracking = conn.state == NodeState::kTracking;
  if (conn.lease) {
    if (broken) {
      conn.lease->discard(true);
    }
    conn.lease.reset();
  }
  conn.pool.reset();
  if (conn.state) set_node(conn.server, std::nullopt);
  conn.state.reset();
  // Broken: invalidations may have been missed, so nothing kept can be trusted. Reconnected
  // at once (a restarting server makes that connect fail, then `retry` paces the attempts).
  if (broken && was_tracking) drop_all();
  conn.next_try = std::chrono::steady_clock::now();
}

}  // namespace idem::redis::detail
