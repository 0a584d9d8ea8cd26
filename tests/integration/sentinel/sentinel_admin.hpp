// SPDX-License-Identifier: MIT
// Plain hiredis access to the sentinels and the two data nodes of scripts/servers.sh sentinel.
#pragma once

#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cluster_admin.hpp"  // node_cmd, reply_text
#include "router.hpp"

namespace idem::test {

/// The sentinels named by IDEM_TEST_REDIS_SENTINEL_URL and the master they watch.
class SentinelAdmin {
 public:
  explicit SentinelAdmin(const std::string& url) {
    auto t = idem::redis::detail::parse_topology(url);
    service_ = t.service;
    for (const auto& ep : t.endpoints) sentinels_.emplace_back(ep.host, ep.port);
  }
  const std::string& service() const noexcept { return service_; }
  const std::vector<std::pair<std::string, int>>& sentinels() const noexcept { return sentinels_; }
  /// The master port one sentinel reports (0 if it does not answer).
  int master_port(std::size_t sentinel) const {
    const auto& [host, port] = sentinels_.at(sentinel);
    auto r = node_cmd(host, port, {"SENTINEL", "get-master-addr-by-name", service_});
    if (!r || r->type != REDIS_REPLY_ARRAY || r->elements != 2) return 0;
    return std::stoi(reply_text_of(r->element[1]));
  }
  /// "master", "slave" or "".
  std::string role(int port) const {
    auto r = node_cmd(host(), port, {"ROLE"});
    if (!r || r->type != REDIS_REPLY_ARRAY || r->elements == 0) return std::string();
    return reply_text_of(r->element[0]);
  }
  const std::string& host() const { return sentinels_.front().first; }
  /// Every sentinel names the same master, which says ROLE master, and `replica` follows it
  /// with its link up.
  bool healthy(int* master_out = nullptr) const {
    const int m = master_port(0);
    if (m == 0) return false;
    for (std::size_t i = 1; i < sentinels_.size(); ++i) {
      if (master_port(i) != m) return false;
    }
    if (role(m) != "master") return false;
    const int replica = other_node(m);
    const std::string info = reply_text(node_cmd(host(), replica, {"INFO", "replication"}));
    if (info.find("master_link_status:up") == std::string::npos ||
        info.find("master_port:" + std::to_string(m) + "\r") == std::string::npos) {
      return false;
    }
    if (master_out != nullptr) *master_out = m;
    return true;
  }
  bool wait_healthy(std::chrono::seconds limit, int* master_out = nullptr) const {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      if (healthy(master_out)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return healthy(master_out);
  }
  /// The data node that is not `port` (servers.sh puts them on IDEM_SENTINEL_PORT and +1).
  int other_node(int port) const {
    const int base = sentinels_.front().second - 10;
    return port == base ? base + 1 : base;
  }

 private:
  static std::string reply_text_of(const redisReply* r) {
    return r->str != nullptr ? std::string(r->str, r->len) : std::string();
  }
  std::string service_;
  std::vector<std::pair<std::string, int>> sentinels_;
};

}  // namespace idem::test
