// SPDX-License-Identifier: MIT
// Router: pools per node, layout discovery triggers, and the Sentinel master lookup (the slot map
// of a Redis Cluster is in cluster.cpp).
#include "router.hpp"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <utility>

#include "errors.hpp"
#include "idem/detail/redact.hpp"
#include "idem/errors.hpp"

namespace idem::redis::detail {
namespace {

std::int64_t steady_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

[[noreturn]] void bad(std::string_view shown, const std::string& why) {
  throw UsageError("idem::redis: invalid URI '" + idem::detail::mask_refused_uri(shown) +
                   "': " + why +
                   " (expected redis-cluster://[[user]:password@]host:port[,host:port...] or "
                   "redis-sentinel://[[user]:password@]host:port[,host:port...]/service[/db])");
}

}  // namespace

Topology parse_topology(std::string_view uri) {
  Topology t;
  const bool cluster = uri.compare(0, 16, "redis-cluster://") == 0;
  const bool sentinel = uri.compare(0, 17, "redis-sentinel://") == 0;
  if (!cluster && !sentinel) {
    t.endpoints.push_back(parse_uri(uri));
    return t;
  }
  t.kind = cluster ? Topology::Kind::kCluster : Topology::Kind::kSentinel;
  std::string_view rest = uri.substr(cluster ? 16 : 17);
  std::string userinfo;  // "user:password@" or empty
  std::string shown(uri);
  auto at = rest.rfind('@');
  if (at != std::string_view::npos) {
    userinfo = std::string(rest.substr(0, at + 1));
    rest = rest.substr(at + 1);
    shown = std::string(uri.substr(0, cluster ? 16 : 17)) + "***@" + std::string(rest);
  }
  auto slash = rest.find('/');
  std::string_view hosts = rest.substr(0, slash);
  std::string_view path =
      slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1);
  std::string db;
  if (sentinel) {
    auto s2 = path.find('/');
    t.service = std::string(path.substr(0, s2));
    if (s2 != std::string_view::npos) db = std::string(path.substr(s2 + 1));
    if (t.service.empty()) bad(shown, "no service name after the sentinel addresses");
  } else if (!path.empty()) {
    bad(shown, "a cluster has no database number (only db 0 exists)");
  }
  if (hosts.empty()) bad(shown, "no host");
  for (int position = 1; !hosts.empty(); ++position) {
    auto comma = hosts.find(',');
    std::string_view one = hosts.substr(0, comma);
    if (one.empty()) bad(shown, "empty address in the list");
    try {
      // Sentinels are asked without the master's credentials; cluster nodes with them.
      t.endpoints.push_back(
          parse_uri("redis://" + (cluster ? userinfo : std::string()) + std::string(one)));
    } catch (const UsageError&) {
      // Named by its place, not echoed: without an '@' it may hold a password.
      bad(shown, "bad address (number " + std::to_string(position) + " of the list)");
    }
    hosts = comma == std::string_view::npos ? std::string_view() : hosts.substr(comma + 1);
  }
  // The template: credentials and db, parsed by the one URI parser.
  try {
    t.node_template = parse_uri("redis://" + userinfo + "template" + (db.empty() ? "" : "/" + db));
  } catch (const UsageError&) {
    bad(shown, "bad credentials or database number");
  }
  return t;
}

ReplyUPtr run_command(Pool& pool, std::string_view what, int argc, const char** argv,
                      const std::size_t* lens) {
  Pool::Lease conn = pool.acquire(what);
  redisContext* c = conn.get();
  errno = 0;
  void* raw = command_argv(c, argc, argv, lens);
  if (raw == nullptr) {
    const int saved_errno = errno;
    const int err = c->err;
    const std::string errstr = c->errstr;
    conn.discard(server_gone(err, saved_errno));
    throw_error(Failure{Failure::Kind::kContext, what, errstr, err, saved_errno});
  }
  return ReplyUPtr(static_cast<redisReply*>(raw));
}

Router::Router(Topology topology, PoolSettings pool, std::chrono::milliseconds refresh_interval,
               std::chrono::milliseconds sentinel_check)
    : kind_(topology.kind),
      topology_(std::move(topology)),
      base_(std::move(pool)),
      refresh_interval_(refresh_interval),
      sentinel_check_(sentinel_check) {
  switch (kind_) {
    case Topology::Kind::kSingle: {
      PoolSettings s = base_;
      s.endpoint = topology_.endpoints.front();
      nodes_.push_back(std::make_unique<Pool>(std::move(s)));
      single_ = nodes_.front().get();
      break;
    }
    case Topology::Kind::kSentinel:
      for (const Endpoint& ep : topology_.endpoints) {
        PoolSettings s = base_;
        s.endpoint = ep;
        s.size = 1;  // discovery is serialised anyway
        s.auto_pipeline = false;
        sentinels_.push_back(std::make_unique<Pool>(std::move(s)));
      }
      break;
    case Topology::Kind::kCluster:
      slots_ = std::make_unique<std::array<std::atomic<Pool*>, kSlotCount>>();
      for (auto& s : *slots_) s.store(nullptr, std::memory_order_relaxed);
      for (const Endpoint& ep : topology_.endpoints) add_node(ep.host, ep.port);
      break;
  }
}

Router::~Router() = default;

std::string_view Router::name() const noexcept { return topology_name(kind_); }

Pool& Router::add_node(const std::string& host, int port) {
  std::lock_guard<std::mutex> lock(nodes_mutex_);
  for (auto& p : nodes_) {
    const Endpoint& ep = p->settings().endpoint;
    if (ep.port == port && ep.host == host) return *p;
  }
  PoolSettings s = base_;
  s.endpoint = topology_.node_template;
  s.endpoint.host = host;
  s.endpoint.port = port;
  s.endpoint.display = "redis://" + host + ":" + std::to_string(port);
  nodes_.push_back(std::make_unique<Pool>(std::move(s)));
  return *nodes_.back();
}

std::vector<Pool*> Router::serving_nodes() const {
  std::vector<Pool*> out;
  if (kind_ == Topology::Kind::kSingle) {
    out.push_back(single_);
  } else if (kind_ == Topology::Kind::kSentinel) {
    if (Pool* m = master_.load(std::memory_order_acquire)) out.push_back(m);
  } else {
    for (const auto& slot : *slots_) {
      Pool* p = slot.load(std::memory_order_acquire);
      if (p != nullptr && (out.empty() || out.back() != p) &&
          std::find(out.begin(), out.end(), p) == out.end()) {
        out.push_back(p);
      }
    }
  }
  return out;
}

Pool& Router::node(const Redirect& r, const Pool& answered_by) {
  return add_node(r.host.empty() ? answered_by.settings().endpoint.host : r.host, r.port);
}

void Router::moved(const Redirect& r, const Pool& answered_by) {
  moved_.fetch_add(1, std::memory_order_relaxed);
  if (slots_ && r.slot >= 0 && static_cast<std::size_t>(r.slot) < kSlotCount) {
    (*slots_)[static_cast<std::size_t>(r.slot)].store(&node(r, answered_by),
                                                      std::memory_order_release);
  }
  stale_.store(true, std::memory_order_relaxed);
}

void Router::failed() noexcept {
  if (kind_ != Topology::Kind::kSingle) stale_.store(true, std::memory_order_relaxed);
}

void Router::maybe_refresh(bool block) {
  const std::int64_t now = steady_ns();
  const bool periodic = kind_ == Topology::Kind::kSentinel && sentinel_check_.count() > 0 &&
                        now >= next_check_ns_.load(std::memory_order_relaxed);
  const bool due = stale_.load(std::memory_order_relaxed) &&
                   now >= next_refresh_ns_.load(std::memory_order_relaxed);
  if (!block && !periodic && !due) return;
  std::unique_lock<std::mutex> lock(refresh_mutex_, std::defer_lock);
  if (block) {
    lock.lock();  // the first discovery: nothing to route with until it ends
    if (!stale_.load(std::memory_order_relaxed)) return;  // another thread just did it
    if (steady_ns() < next_refresh_ns_.load(std::memory_order_relaxed)) return;  // failed lately
  } else if (!lock.try_lock()) {
    return;  // another thread is at it; route with what is known
  }
  const bool ok = kind_ == Topology::Kind::kCluster ? refresh_slots() : discover_master();
  const std::int64_t after = steady_ns();
  next_refresh_ns_.store(
      after + std::chrono::duration_cast<std::chrono::nanoseconds>(refresh_interval_).count(),
      std::memory_order_relaxed);
  next_check_ns_.store(
      after + std::chrono::duration_cast<std::chrono::nanoseconds>(sentinel_check_).count(),
      std::memory_order_relaxed);
  if (ok) {
    stale_.store(false, std::memory_order_relaxed);
    refreshes_.fetch_add(1, std::memory_order_relaxed);
  } else {
    refresh_failures_.fetch_add(1, std::memory_order_relaxed);
  }
}

Pool& Router::pool_for(std::string_view key) {
  if (kind_ == Topology::Kind::kSingle) return *single_;
  maybe_refresh(false);
  if (kind_ == Topology::Kind::kSentinel) {
    Pool* m = master_.load(std::memory_order_acquire);
    if (m == nullptr) {
      maybe_refresh(true);
      m = master_.load(std::memory_order_acquire);
    }
    if (m == nullptr) {
      throw StorageUnavailable("redis: no sentinel named a reachable master for service '" +
                               topology_.service + "'" + last_refresh_failure());
    }
    return *m;
  }
  const std::uint16_t slot = key_slot(key);
  Pool* p = (*slots_)[slot].load(std::memory_order_acquire);
  if (p == nullptr) {
    maybe_refresh(true);
    p = (*slots_)[slot].load(std::memory_order_acquire);
  }
  if (p == nullptr) {
    throw StorageUnavailable("redis: cluster: no known node serves hash slot " +
                             std::to_string(slot) +
                             " (no seed answered CLUSTER SLOTS, or the "
                             "slot is not assigned)" +
                             last_refresh_failure());
  }
  return *p;
}

// Asks each sentinel in turn for the service's master, and trusts the answer only when that
// server says ROLE master (a sentinel may not have seen the failover yet).
bool Router::discover_master() {
  const std::string& svc = topology_.service;
  std::string why;  // what each sentinel answered, when none named a master
  auto note = [&](const std::string& what) { why += (why.empty() ? "" : "; ") + what; };
  for (auto& sentinel : sentinels_) {
    const std::string where = sentinel->settings().endpoint.display;
    try {
      const char* argv[] = {"SENTINEL", "get-master-addr-by-name", svc.c_str()};
      const std::size_t lens[] = {8, 23, svc.size()};
      ReplyUPtr r = run_command(*sentinel, "SENTINEL get-master-addr-by-name", 3, argv, lens);
      if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
          r->element[0]->type != REDIS_REPLY_STRING || r->element[1]->type != REDIS_REPLY_STRING) {
        // nil: this sentinel does not know the service; an error: not a sentinel
        note(where + (r->type == REDIS_REPLY_ERROR ? ": " + std::string(r->str, r->len)
                                                   : std::string(" does not know the service")));
        continue;
      }
      const std::string host(r->element[0]->str, r->element[0]->len);
      const int port = std::stoi(std::string(r->element[1]->str, r->element[1]->len));
      Pool& candidate = add_node(host, port);
      const char* role_argv[] = {"ROLE"};
      const std::size_t role_lens[] = {4};
      ReplyUPtr role = run_command(candidate, "ROLE", 1, role_argv, role_lens);
      if (role->type != REDIS_REPLY_ARRAY || role->elements == 0 ||
          role->element[0]->type != REDIS_REPLY_STRING ||
          std::string_view(role->element[0]->str, role->element[0]->len) != "master") {
        note(where + " named " + host + ":" + std::to_string(port) + ", which is not a master");
        continue;
      }
      Pool* before = master_.exchange(&candidate, std::memory_order_acq_rel);
      if (before != nullptr && before != &candidate) {
        master_changes_.fetch_add(1, std::memory_order_relaxed);
      }
      return true;
    } catch (const std::exception& e) {
      // This sentinel (or the master it named) is unreachable: ask the next one.
      note(e.what());
    }
  }
  note_refresh_failure(std::move(why));
  return false;
}

void Router::note_refresh_failure(std::string why) {
  std::lock_guard<std::mutex> lock(failure_mutex_);
  last_failure_ = std::move(why);
}

std::string Router::last_refresh_failure() const {
  std::lock_guard<std::mutex> lock(failure_mutex_);
  return last_failure_.empty() ? std::string() : " (last: " + last_failure_ + ")";
}

RedisPoolStats Router::pool_stats() const {
  RedisPoolStats sum;
  std::lock_guard<std::mutex> lock(nodes_mutex_);
  for (const auto& p : nodes_) {
    RedisPoolStats s = p->stats();
    sum.connects += s.connects;
    sum.connect_failures += s.connect_failures;
    sum.dropped += s.dropped;
    sum.fast_failures += s.fast_failures;
    sum.exhausted += s.exhausted;
    sum.script_loads += s.script_loads;
    sum.open += s.open;
    sum.idle += s.idle;
    sum.pipelined_flushes += s.pipelined_flushes;
    sum.pipelined_commands += s.pipelined_commands;
  }
  sum.script_loads += script_loads_.load(std::memory_order_relaxed);
  return sum;
}

RedisRouteStats Router::route_stats() const {
  RedisRouteStats s;
  s.moved = moved_.load(std::memory_order_relaxed);
  s.ask = ask_.load(std::memory_order_relaxed);
  s.refreshes = refreshes_.load(std::memory_order_relaxed);
  s.refresh_failures = refresh_failures_.load(std::memory_order_relaxed);
  s.master_changes = master_changes_.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(nodes_mutex_);
  s.nodes = nodes_.size();
  return s;
}

}  // namespace idem::redis::detail
