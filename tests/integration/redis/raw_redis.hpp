// SPDX-License-Identifier: MIT
// A plain hiredis connection for tests: writes foreign values, reads TTLs, changes config.
// (Tests talk to the real server; nothing here imitates Redis.)
#pragma once

#include <gtest/gtest.h>
#include <hiredis/hiredis.h>

#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "uri.hpp"

namespace idem::test {

/// A reply tree, freed on destruction.
using RawReply = std::unique_ptr<redisReply, void (*)(void*)>;

class RawRedis {
 public:
  explicit RawRedis(const std::string& uri) {
    auto ep = idem::redis::detail::parse_uri(uri);
    timeval tv{2, 0};
    ctx_ = ep.unix_socket ? redisConnectUnixWithTimeout(ep.path.c_str(), tv)
                          : redisConnectWithTimeout(ep.host.c_str(), ep.port, tv);
    if (ctx_ == nullptr || ctx_->err != 0) {
      ADD_FAILURE() << "raw connect failed: " << (ctx_ ? ctx_->errstr : "no context");
    } else {
      redisSetTimeout(ctx_, timeval{10, 0});
    }
  }
  ~RawRedis() {
    if (ctx_ != nullptr) redisFree(ctx_);
  }
  RawRedis(const RawRedis&) = delete;
  RawRedis& operator=(const RawRedis&) = delete;

  /// Runs a command; the reply (an error reply too), or null on a connection failure.
  RawReply cmd(std::initializer_list<std::string_view> args) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (auto a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    void* r = redisCommandArgv(ctx_, static_cast<int>(argv.size()), argv.data(), lens.data());
    return RawReply(static_cast<redisReply*>(r), freeReplyObject);
  }
  /// Integer reply of a command (-999 when not an integer).
  long long integer(std::initializer_list<std::string_view> args) {
    auto r = cmd(args);
    return r && r->type == REDIS_REPLY_INTEGER ? r->integer : -999;
  }
  /// String/status reply of a command ("" otherwise).
  std::string text(std::initializer_list<std::string_view> args) {
    auto r = cmd(args);
    if (!r) return "<no reply>";
    if (r->type == REDIS_REPLY_NIL) return "<nil>";
    return r->str != nullptr ? std::string(r->str, r->len) : std::string();
  }
  /// Sends a command without reading its reply (to block the server from this connection).
  void send(std::initializer_list<std::string_view> args) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (auto a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    redisAppendCommandArgv(ctx_, static_cast<int>(argv.size()), argv.data(), lens.data());
    int done = 0;
    while (!done) redisBufferWrite(ctx_, &done);
  }
  /// Reads the reply of a command sent with send().
  RawReply receive() {
    void* r = nullptr;
    redisGetReply(ctx_, &r);
    return RawReply(static_cast<redisReply*>(r), freeReplyObject);
  }

 private:
  redisContext* ctx_ = nullptr;
};

}  // namespace idem::test
