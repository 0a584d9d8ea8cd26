// SPDX-License-Identifier: MIT
// Plain hiredis access to each node of the test cluster (roles, slot owners, key counts,
// migrations, health), for tests and the benchmark. Nothing here imitates Redis.
#pragma once

#include <hiredis/hiredis.h>

#include <chrono>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "router.hpp"

namespace idem::test {

/// A reply tree, freed on destruction (null: the node did not answer).
using AdminReply = std::unique_ptr<redisReply, void (*)(void*)>;

/// One command on a fresh connection to host:`port` (null when unreachable).
inline AdminReply node_cmd(const std::string& host, int port,
                           const std::vector<std::string_view>& args) {
  redisContext* c = redisConnectWithTimeout(host.c_str(), port, timeval{1, 0});
  if (c == nullptr || c->err != 0) {
    if (c != nullptr) redisFree(c);
    return AdminReply(nullptr, freeReplyObject);
  }
  redisSetTimeout(c, timeval{10, 0});
  std::vector<const char*> argv;
  std::vector<std::size_t> lens;
  for (auto a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  void* r = redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data());
  redisFree(c);
  return AdminReply(static_cast<redisReply*>(r), freeReplyObject);
}

/// Text of a string/status/error reply ("" otherwise).
inline std::string reply_text(const AdminReply& r) {
  if (!r || r->str == nullptr) return std::string();
  return std::string(r->str, r->len);
}

/// The six nodes named by IDEM_TEST_REDIS_CLUSTER_URL.
class ClusterAdmin {
 public:
  explicit ClusterAdmin(const std::string& cluster_url) {
    for (const auto& ep : idem::redis::detail::parse_topology(cluster_url).endpoints) {
      host_ = ep.host;
      ports_.push_back(ep.port);
    }
  }
  const std::vector<int>& ports() const noexcept { return ports_; }
  const std::string& host() const noexcept { return host_; }

  AdminReply cmd(int port, std::initializer_list<std::string_view> args) const {
    return node_cmd(host_, port, std::vector<std::string_view>(args));
  }
  AdminReply cmd(int port, const std::vector<std::string_view>& args) const {
    return node_cmd(host_, port, args);
  }
  /// "master", "slave", or "" when the node does not answer.
  std::string role(int port) const {
    auto r = cmd(port, {"ROLE"});
    if (!r || r->type != REDIS_REPLY_ARRAY || r->elements == 0) return std::string();
    return std::string(r->element[0]->str, r->element[0]->len);
  }
  /// Ports of the nodes that answer ROLE master.
  std::vector<int> masters() const {
    std::vector<int> out;
    for (int p : ports_) {
      if (role(p) == "master") out.push_back(p);
    }
    return out;
  }
  std::string node_id(int port) const { return reply_text(cmd(port, {"CLUSTER", "MYID"})); }
  /// The port of the master serving `slot`, as `asked` sees it (0 if unknown).
  int slot_owner(int slot, int asked) const {
    auto r = cmd(asked, {"CLUSTER", "SLOTS"});
    if (!r || r->type != REDIS_REPLY_ARRAY) return 0;
    for (std::size_t i = 0; i < r->elements; ++i) {
      const redisReply* e = r->element[i];
      if (e->element[0]->integer <= slot && slot <= e->element[1]->integer) {
        return static_cast<int>(e->element[2]->element[1]->integer);
      }
    }
    return 0;
  }
  /// The owner port of every slot, as `asked` sees it (0: unassigned or unknown).
  std::vector<int> slot_map(int asked) const {
    std::vector<int> owners(idem::redis::detail::kSlotCount, 0);
    auto r = cmd(asked, {"CLUSTER", "SLOTS"});
    if (!r || r->type != REDIS_REPLY_ARRAY) return owners;
    for (std::size_t i = 0; i < r->elements; ++i) {
      const redisReply* e = r->element[i];
      for (long long s = e->element[0]->integer; s <= e->element[1]->integer; ++s) {
        owners[static_cast<std::size_t>(s)] = static_cast<int>(e->element[2]->element[1]->integer);
      }
    }
    return owners;
  }
  /// The port of the replica of master `port` (0 if none answers).
  int replica_of(int port) const {
    for (int p : ports_) {
      if (p == port || role(p) != "slave") continue;
      const std::string info = reply_text(cmd(p, {"INFO", "replication"}));
      if (info.find("master_port:" + std::to_string(port) + "\r") != std::string::npos) return p;
    }
    return 0;
  }
  /// Moves every key of `slot` from `from` to `to` with MIGRATE (the slot must be migrating).
  /// @return keys moved, or -1 on an error reply.
  long long move_keys(int slot, int from, int to) const {
    long long moved = 0;
    const std::string slot_s = std::to_string(slot), to_s = std::to_string(to);
    for (;;) {
      auto keys = cmd(from, {"CLUSTER", "GETKEYSINSLOT", slot_s, "50"});
      if (!keys || keys->type != REDIS_REPLY_ARRAY) return -1;
      if (keys->elements == 0) return moved;
      std::vector<std::string_view> argv = {"MIGRATE", host_, to_s, "", "0", "5000", "KEYS"};
      for (std::size_t i = 0; i < keys->elements; ++i) {
        argv.emplace_back(keys->element[i]->str, keys->element[i]->len);
      }
      auto r = cmd(from, argv);
      if (!r || r->type == REDIS_REPLY_ERROR) return -1;
      moved += static_cast<long long>(keys->elements);
    }
  }
  /// Keys matching `pattern` on one node.
  long long count_keys(int port, const std::string& pattern) const {
    auto r = cmd(port, {"KEYS", pattern});
    return r && r->type == REDIS_REPLY_ARRAY ? static_cast<long long>(r->elements) : -1;
  }
  /// Every node answers, says cluster_state:ok, three answer ROLE master and every replica's
  /// link to its master is up.
  bool healthy() const {
    int masters = 0;
    for (int p : ports_) {
      if (reply_text(cmd(p, {"CLUSTER", "INFO"})).find("cluster_state:ok") == std::string::npos) {
        return false;
      }
      const std::string role_now = role(p);
      if (role_now == "master") {
        ++masters;
      } else if (reply_text(cmd(p, {"INFO", "replication"})).find("master_link_status:up") ==
                 std::string::npos) {
        return false;
      }
    }
    return masters == 3;
  }
  /// Waits until healthy() (false after `limit`).
  bool wait_healthy(std::chrono::seconds limit) const {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      if (healthy()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return healthy();
  }

 private:
  std::string host_;
  std::vector<int> ports_;
};

}  // namespace idem::test
