// SPDX-License-Identifier: MIT
// Asynchronous routing: single server, Sentinel, Cluster (see redis_client.hpp).
#include "redis_client.hpp"

#include <deque>
#include <optional>
#include <utility>

#include "idem/errors.hpp"
#include "redis_errors.hpp"

namespace idem::async::detail {
namespace {

using Clock = std::chrono::steady_clock;
using redis::detail::Topology;

bool starts_with(std::string_view s, std::string_view p) noexcept {
  return s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}

std::string resp_of(std::initializer_list<std::string_view> args) {
  std::string out;
  append_resp(out, static_cast<int>(args.size()), args.begin());
  return out;
}

std::exception_ptr unavailable(const std::string& what) noexcept {
  try {
    throw StorageUnavailable(what);
  } catch (...) {
    return std::current_exception();
  }
}

constexpr int kMaxHops = 5;

}  // namespace

struct RedisClient::Core : std::enable_shared_from_this<RedisClient::Core> {
  struct Request {
    std::string key;
    std::string resp;
    CommandInfo info;
    RoutedCallback cb;
    int hops = 0;
    bool asking = false;
    Node* target = nullptr;  // ASK / MOVED: the node to send to next

    std::string what() const {
      std::string s = info.op;
      s.push_back(' ');
      s.append(key);
      return s;
    }
  };
  using RequestPtr = std::unique_ptr<Request>;

  Core(Executor ex, Topology t, ClientSettings s)
      : executor(std::move(ex)), topology(std::move(t)), settings(std::move(s)) {
    switch (topology.kind) {
      case Topology::Kind::kSingle:
        single = add_endpoint(topology.endpoints.front());
        break;
      case Topology::Kind::kSentinel:
        for (const auto& ep : topology.endpoints) {
          ConnectionSettings cs = settings.connection;
          cs.endpoint = ep;
          sentinels.push_back(std::make_unique<Node>(executor, std::move(cs)));
        }
        break;
      case Topology::Kind::kCluster:
        slots.fill(nullptr);
        for (const auto& ep : topology.endpoints) add_node(ep.host, ep.port);
        break;
    }
  }

  Node* add_endpoint(const redis::detail::Endpoint& ep) {
    ConnectionSettings cs = settings.connection;
    cs.endpoint = ep;
    nodes.push_back(std::make_unique<Node>(executor, std::move(cs)));
    return nodes.back().get();
  }

  Node* add_node(const std::string& host, int port) {
    for (auto& n : nodes) {
      const auto& ep = n->settings().endpoint;
      if (!ep.unix_socket && ep.port == port && ep.host == host) return n.get();
    }
    redis::detail::Endpoint ep = topology.node_template;
    ep.host = host;
    ep.port = port;
    ep.display = "redis://" + host + ":" + std::to_string(port);
    return add_endpoint(ep);
  }

  void shutdown() {
    // First: a command a failure callback sends while the nodes close fails too, instead of
    // opening a new connection on a client that is going away.
    closed = true;
    for (auto& n : nodes) n->close();
    for (auto& n : sentinels) n->close();
    std::deque<RequestPtr> waiting_now;
    waiting_now.swap(waiting);
    for (auto& r : waiting_now) {
      fail_later(std::move(r), unavailable("redis: the client was closed"));
    }
  }

  // --- routing ------------------------------------------------------------------------------

  void route(RequestPtr r) {
    if (closed) {
      fail_later(std::move(r), unavailable("redis: the client was closed"));
      return;
    }
    if (r->target != nullptr) {
      Node* n = r->target;
      r->target = nullptr;
      send(n, std::move(r));
      return;
    }
    if (topology.kind == Topology::Kind::kSingle) {
      send(single, std::move(r));
      return;
    }
    maybe_refresh();
    Node* n = nullptr;
    if (topology.kind == Topology::Kind::kSentinel) {
      n = master;
    } else {
      n = slots[redis::detail::key_slot(r->key)];
    }
    if (n != nullptr) {
      send(n, std::move(r));
      return;
    }
    // Nothing known yet: wait for the discovery (unless one failed moments ago).
    if (!refreshing && Clock::now() < next_refresh) {
      std::exception_ptr e = unavailable(no_route_message(r->key));
      fail_later(std::move(r), std::move(e));
      return;
    }
    waiting.push_back(std::move(r));
    refresh();
  }

  std::string no_route_message(std::string_view key) const {
    if (topology.kind == Topology::Kind::kSentinel) {
      return "redis: no sentinel named a reachable master for service '" + topology.service + "'";
    }
    return "redis: cluster: no known node serves hash slot " +
           std::to_string(redis::detail::key_slot(key)) +
           " (no seed answered CLUSTER SLOTS, or the slot is not assigned)";
  }

  void send(Node* n, RequestPtr r) {
    if (closed) {
      fail_later(std::move(r), unavailable("redis: the client was closed"));
      return;
    }
    if (r->asking) {
      r->asking = false;
      n->send(resp_of({"ASKING"}), [](const redisReply*, const ConnectionFailure*) {
        // Its failure (or refusal) shows in the command's own answer right behind it.
      });
    }
    std::string_view bytes = r->resp;
    n->send(bytes, [self = shared_from_this(), n, r = std::move(r)](
                       const redisReply* reply, const ConnectionFailure* f) mutable {
      self->answered(n, std::move(r), reply, f);
    });
  }

  void answered(Node* n, RequestPtr r, const redisReply* reply, const ConnectionFailure* f) {
    if (f != nullptr) {
      failed();
      std::exception_ptr e = connection_error(*f, r->what(), r->info.write);
      fail(std::move(r), std::move(e));
      return;
    }
    if (reply->type == REDIS_REPLY_ERROR) {
      const std::string_view text(reply->str, reply->len);
      if (topology.kind == Topology::Kind::kCluster && r->hops < kMaxHops) {
        if (auto redirect = redis::detail::parse_redirect(text)) {
          ++r->hops;
          const std::string host =
              redirect->host.empty() ? n->settings().endpoint.host : redirect->host;
          Node* next = add_node(host, redirect->port);
          if (redirect->ask) {
            ++stats.ask;
            r->asking = true;
          } else {
            ++stats.moved;
            slots[static_cast<std::size_t>(redirect->slot)] = next;
            stale = true;
          }
          r->target = next;
          route(std::move(r));
          return;
        }
      }
      if (starts_with(text, "READONLY") || starts_with(text, "MASTERDOWN") ||
          starts_with(text, "CLUSTERDOWN") || starts_with(text, "LOADING")) {
        failed();
      }
    }
    RoutedCallback cb = std::move(r->cb);
    cb(reply, nullptr);
  }

  void fail(RequestPtr r, std::exception_ptr e) {
    RoutedCallback cb = std::move(r->cb);
    cb(nullptr, std::move(e));
  }

  // From inside command(): the callback must not run before command() returns.
  void fail_later(RequestPtr r, std::exception_ptr e) {
    net::post(executor, [cb = std::move(r->cb), e = std::move(e)]() mutable { cb(nullptr, e); });
  }

  void failed() {
    if (topology.kind != Topology::Kind::kSingle) stale = true;
  }

  // --- discovery ----------------------------------------------------------------------------

  void maybe_refresh() {
    const auto now = Clock::now();
    const bool periodic = topology.kind == Topology::Kind::kSentinel &&
                          settings.sentinel_check.count() > 0 && now >= next_check;
    const bool due = stale && now >= next_refresh;
    if (periodic || due) refresh();
  }

  void refresh() {
    if (refreshing) return;
    refreshing = true;
    if (topology.kind == Topology::Kind::kSentinel) {
      ask_sentinel(0);
    } else {
      candidates.clear();
      for (auto& node : nodes) candidates.push_back(node.get());
      ask_slots(0);
    }
  }

  // Asks sentinel i for the master, and trusts it only when that server says ROLE master.
  void ask_sentinel(std::size_t i) {
    if (i >= sentinels.size() || closed) {
      refreshed(false);
      return;
    }
    sentinels[i]->send(
        resp_of({"SENTINEL", "get-master-addr-by-name", topology.service}),
        [self = shared_from_this(), i](const redisReply* r, const ConnectionFailure* f) {
          if (f != nullptr || r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
              r->element[0]->type != REDIS_REPLY_STRING ||
              r->element[1]->type != REDIS_REPLY_STRING) {
            self->ask_sentinel(i + 1);  // unreachable, or does not know the service
            return;
          }
          const std::string host(r->element[0]->str, r->element[0]->len);
          int port = 0;
          try {
            port = std::stoi(std::string(r->element[1]->str, r->element[1]->len));
          } catch (const std::exception&) {
            self->ask_sentinel(i + 1);
            return;
          }
          Node* candidate = self->add_node(host, port);
          candidate->send(resp_of({"ROLE"}), [self, i, candidate](const redisReply* role,
                                                                  const ConnectionFailure* rf) {
            const bool is_master =
                rf == nullptr && role->type == REDIS_REPLY_ARRAY && role->elements > 0 &&
                role->element[0]->type == REDIS_REPLY_STRING &&
                std::string_view(role->element[0]->str, role->element[0]->len) == "master";
            if (!is_master) {
              self->ask_sentinel(i + 1);
              return;
            }
            if (self->master != nullptr && self->master != candidate) ++self->stats.master_changes;
            self->master = candidate;
            self->refreshed(true);
          });
        });
  }

  // Reads CLUSTER SLOTS from candidate i (then the next on failure) and installs it; slots no
  // range names keep their owner.
  void ask_slots(std::size_t i) {
    if (i >= candidates.size() || closed) {
      refreshed(false);
      return;
    }
    Node* node = candidates[i];
    node->send(resp_of({"CLUSTER", "SLOTS"}), [self = shared_from_this(), i, node](
                                                  const redisReply* r, const ConnectionFailure* f) {
      if (f != nullptr || r->type != REDIS_REPLY_ARRAY || r->elements == 0) {
        self->ask_slots(i + 1);
        return;
      }
      struct Range {
        long long first, last;
        std::string host;
        int port;
      };
      std::vector<Range> ranges;
      for (std::size_t k = 0; k < r->elements; ++k) {
        const redisReply* e = r->element[k];
        const bool ok = e->type == REDIS_REPLY_ARRAY && e->elements >= 3 &&
                        e->element[0]->type == REDIS_REPLY_INTEGER &&
                        e->element[1]->type == REDIS_REPLY_INTEGER &&
                        e->element[2]->type == REDIS_REPLY_ARRAY && e->element[2]->elements >= 2 &&
                        e->element[2]->element[0]->type == REDIS_REPLY_STRING &&
                        e->element[2]->element[1]->type == REDIS_REPLY_INTEGER;
        if (!ok) {
          self->ask_slots(i + 1);
          return;
        }
        const redisReply* m = e->element[2];
        std::string host(m->element[0]->str, m->element[0]->len);
        if (host.empty() || host == "?") host = node->settings().endpoint.host;
        ranges.push_back(Range{e->element[0]->integer, e->element[1]->integer, std::move(host),
                               static_cast<int>(m->element[1]->integer)});
      }
      for (const Range& range : ranges) {
        if (range.first < 0 || range.last >= static_cast<long long>(redis::detail::kSlotCount)) {
          continue;
        }
        Node* owner = self->add_node(range.host, range.port);
        for (long long s = range.first; s <= range.last; ++s) {
          self->slots[static_cast<std::size_t>(s)] = owner;
        }
      }
      self->refreshed(true);
    });
  }

  void refreshed(bool ok) {
    refreshing = false;
    const auto now = Clock::now();
    next_refresh = now + settings.refresh_interval;
    next_check = now + settings.sentinel_check;
    if (ok) {
      stale = false;
      ++stats.refreshes;
    } else {
      ++stats.refresh_failures;
    }
    std::deque<RequestPtr> ready;
    ready.swap(waiting);
    for (auto& r : ready) {
      Node* n = topology.kind == Topology::Kind::kSentinel ? master
                                                           : slots[redis::detail::key_slot(r->key)];
      if (n == nullptr) {
        const std::string why = no_route_message(r->key);
        fail(std::move(r), unavailable(why));
      } else {
        send(n, std::move(r));
      }
    }
  }

  Executor executor;
  const Topology topology;
  const ClientSettings settings;
  std::vector<std::unique_ptr<Node>> nodes;  // data nodes (append-only: Node* stay valid)
  std::vector<std::unique_ptr<Node>> sentinels;
  Node* single = nullptr;
  Node* master = nullptr;
  std::array<Node*, redis::detail::kSlotCount> slots{};
  std::vector<Node*> candidates;   // of the CLUSTER SLOTS refresh in progress
  std::deque<RequestPtr> waiting;  // for the first discovery
  bool refreshing = false;
  bool stale = true;
  bool closed = false;  // close() or the destructor: every command fails
  Clock::time_point next_refresh{}, next_check{};
  redis::RedisRouteStats stats;
};

RedisClient::RedisClient(Executor executor, redis::detail::Topology topology,
                         ClientSettings settings)
    : core_(std::make_shared<Core>(std::move(executor), std::move(topology), std::move(settings))) {
}

RedisClient::~RedisClient() { core_->shutdown(); }

void RedisClient::close() { core_->shutdown(); }

void RedisClient::command(std::string_view key, std::string resp, CommandInfo info,
                          RoutedCallback callback) {
  auto r = std::make_unique<Core::Request>();
  r->key.assign(key.data(), key.size());
  r->resp = std::move(resp);
  r->info = info;
  r->cb = std::move(callback);
  core_->route(std::move(r));
}

bool RedisClient::clustered() const noexcept {
  return core_->topology.kind == Topology::Kind::kCluster;
}

std::string_view RedisClient::name() const noexcept {
  return redis::detail::topology_name(core_->topology.kind);
}

redis::RedisRouteStats RedisClient::route_stats() const {
  redis::RedisRouteStats s = core_->stats;
  s.nodes = core_->nodes.size();
  return s;
}

ConnectionStats RedisClient::connection_stats() const {
  ConnectionStats sum;
  for (const auto& n : core_->nodes) {
    const ConnectionStats& s = n->stats();
    sum.connects += s.connects;
    sum.connect_failures += s.connect_failures;
    sum.dropped += s.dropped;
    sum.fast_failures += s.fast_failures;
    sum.timeouts += s.timeouts;
    sum.commands += s.commands;
  }
  return sum;
}

std::size_t RedisClient::in_flight() const {
  std::size_t n = 0;
  for (const auto& node : core_->nodes) n += node->in_flight();
  return n;
}

}  // namespace idem::async::detail
