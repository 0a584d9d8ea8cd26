// SPDX-License-Identifier: MIT
// The flash sale's simulated Redis failover (hiredis here only; never in a header).
#include "redis_failover.hpp"

#include <hiredis/hiredis.h>

#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <vector>

#include "flash_sale.hpp"

namespace flash_sale {

namespace {

struct RedisReply {
  redisReply* r;
  ~RedisReply() {
    if (r != nullptr) freeReplyObject(r);
  }
};

}  // namespace

void clear_redis(const std::string& url, const std::string& prefix, bool flushall) {
  // redis://[[user]:password@]host[:port][/db]
  std::string rest = url;
  const std::string scheme = "redis://";
  if (rest.rfind(scheme, 0) != 0) throw std::runtime_error("flash_sale: expected redis:// URL");
  rest = rest.substr(scheme.size());
  std::string user, password, host = "127.0.0.1";
  int port = 6379, db = 0;
  if (auto at = rest.rfind('@'); at != std::string::npos) {
    std::string auth = rest.substr(0, at);
    rest = rest.substr(at + 1);
    auto colon = auth.find(':');
    user = colon == std::string::npos ? std::string() : auth.substr(0, colon);
    password = colon == std::string::npos ? auth : auth.substr(colon + 1);
  }
  if (auto slash = rest.find('/'); slash != std::string::npos) {
    if (slash + 1 < rest.size()) db = std::stoi(rest.substr(slash + 1));
    rest = rest.substr(0, slash);
  }
  if (auto colon = rest.rfind(':'); colon != std::string::npos) {
    port = std::stoi(rest.substr(colon + 1));
    rest = rest.substr(0, colon);
  }
  if (!rest.empty()) host = rest;

  timeval timeout{2, 0};
  std::unique_ptr<redisContext, void (*)(redisContext*)> c(
      redisConnectWithTimeout(host.c_str(), port, timeout), redisFree);
  if (!c || c->err != 0) {
    throw std::runtime_error("flash_sale: cannot reach Redis at " + host + ":" +
                             std::to_string(port) + (c ? std::string(": ") + c->errstr : ""));
  }
  redisSetTimeout(c.get(), timeout);
  auto command = [&](std::initializer_list<std::string> args) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (const auto& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    RedisReply r{static_cast<redisReply*>(
        redisCommandArgv(c.get(), static_cast<int>(argv.size()), argv.data(), lens.data()))};
    if (r.r == nullptr || r.r->type == REDIS_REPLY_ERROR) {
      throw std::runtime_error("flash_sale: Redis command failed: " +
                               std::string(r.r != nullptr ? r.r->str : c->errstr));
    }
    return r;
  };
  if (!password.empty()) {
    if (user.empty()) {
      command({"AUTH", password});
    } else {
      command({"AUTH", user, password});
    }
  }
  if (db != 0) command({"SELECT", std::to_string(db)});
  if (flushall) {
    command({"FLUSHALL"});
    return;
  }
  // Only this sale's keys: <prefix>{flash.order|...}.
  std::string cursor = "0";
  const std::string pattern = prefix + "{" + kScope + "|*";
  do {
    auto r = command({"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
    if (r.r->type != REDIS_REPLY_ARRAY || r.r->elements != 2) {
      throw std::runtime_error("flash_sale: unexpected SCAN reply");
    }
    cursor = std::string(r.r->element[0]->str, r.r->element[0]->len);
    const redisReply* keys = r.r->element[1];
    for (std::size_t i = 0; i < keys->elements; ++i) {
      command({"DEL", std::string(keys->element[i]->str, keys->element[i]->len)});
    }
  } while (cursor != "0");
}

}  // namespace flash_sale
