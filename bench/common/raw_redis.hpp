// SPDX-License-Identifier: MIT
// A plain hiredis connection for the hand-written baselines of bench/postgres and bench/mysql
// (redis://host[:port] only).
#pragma once

#include <hiredis/hiredis.h>

#include <cstddef>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace idem::bench {

class RawRedis {
 public:
  explicit RawRedis(const std::string& url) {
    std::string rest = url.substr(url.find("://") == std::string::npos ? 0 : url.find("://") + 3);
    rest = rest.substr(0, rest.find('/'));
    std::string host = rest;
    int port = 6379;
    if (auto colon = rest.rfind(':'); colon != std::string::npos) {
      host = rest.substr(0, colon);
      port = std::atoi(rest.c_str() + colon + 1);
    }
    c_ = redisConnect(host.c_str(), port);
    if (c_ == nullptr || c_->err != 0) throw std::runtime_error("bench: cannot connect to Redis");
    redisEnableKeepAlive(c_);
  }
  ~RawRedis() {
    if (c_ != nullptr) redisFree(c_);
  }
  RawRedis(const RawRedis&) = delete;
  RawRedis& operator=(const RawRedis&) = delete;

  /// One command; @return true for a non-nil, non-error reply.
  bool command(const std::vector<std::string>& args) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (const auto& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    auto* r = static_cast<redisReply*>(
        redisCommandArgv(c_, static_cast<int>(argv.size()), argv.data(), lens.data()));
    if (r == nullptr) throw std::runtime_error("bench: Redis connection lost");
    bool ok = r->type != REDIS_REPLY_NIL && r->type != REDIS_REPLY_ERROR;
    freeReplyObject(r);
    return ok;
  }

  /// INFO stats' total_commands_processed.
  long long commands_processed() {
    auto* r = static_cast<redisReply*>(redisCommand(c_, "INFO stats"));
    if (r == nullptr || r->type != REDIS_REPLY_STRING) throw std::runtime_error("bench: INFO");
    std::string text(r->str, r->len);
    freeReplyObject(r);
    auto at = text.find("total_commands_processed:");
    return std::atoll(text.c_str() + at + std::string("total_commands_processed:").size());
  }

 private:
  redisContext* c_ = nullptr;
};

}  // namespace idem::bench
