// SPDX-License-Identifier: MIT
// A private redis-server for tests that kill or reconfigure their server.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <utility>

#include "support/test_env.hpp"

namespace idem::test {

// A private redis-server on a Unix socket (no TCP port: nothing to clash with), with a
// password, reached through db 2. Stopped on destruction.
class PrivateRedis {
 public:
  explicit PrivateRedis(std::string extra = "")
      : extra_(std::move(extra)),
        sock_(dir_.file("r.sock")),
        pid_(dir_.file("r.pid")),
        ping_("redis-cli -s " + sock_ +
              " -a pw --no-auth-warning PING 2>/dev/null | grep -q PONG") {
    start();
  }
  ~PrivateRedis() { stop(); }
  PrivateRedis(const PrivateRedis&) = delete;
  PrivateRedis& operator=(const PrivateRedis&) = delete;

  void start() {
    const std::string cmd = "redis-server --port 0 --unixsocket " + sock_ + " --dir " +
                            dir_.file("") + " --save '' --appendonly no --daemonize yes" +
                            " --pidfile " + pid_ + " --logfile " + dir_.file("r.log") +
                            " --requirepass pw " + extra_;
    ASSERT_EQ(0, std::system(cmd.c_str())) << cmd;
    for (int i = 0; i < 200; ++i) {
      if (std::system(ping_.c_str()) == 0) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    FAIL() << "the private redis-server did not answer PING";
  }
  // kill -9, then waits until the process is gone.
  void kill9() {
    std::ifstream in(pid_);
    std::string pid;
    in >> pid;
    ASSERT_FALSE(pid.empty());
    const pid_t p = static_cast<pid_t>(std::stol(pid));
    ASSERT_EQ(0, ::kill(p, SIGKILL));
    // Gone when it no longer answers (a zombie nobody reaps would still pass kill(p, 0)).
    for (int i = 0; i < 400 && std::system(ping_.c_str()) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  // CLIENT KILL TYPE normal through redis-cli: closes every client connection of the server
  // (redis-cli's own is skipped). Returns how many were closed.
  int kill_clients() {
    const std::string cmd =
        "redis-cli -s " + sock_ + " -a pw --no-auth-warning CLIENT KILL TYPE normal";
    FILE* out = ::popen(cmd.c_str(), "r");
    if (out == nullptr) {
      ADD_FAILURE() << "cannot run " << cmd;
      return 0;
    }
    char line[64] = {};
    const bool read = std::fgets(line, sizeof line, out) != nullptr;
    EXPECT_EQ(0, ::pclose(out)) << cmd;
    EXPECT_TRUE(read) << cmd;
    return std::atoi(line);
  }
  void stop() { std::system(("kill -9 $(cat " + pid_ + ") 2>/dev/null").c_str()); }
  std::string uri() const { return "unix://:pw@" + sock_ + "?db=2"; }
  std::string raw_uri() const { return "unix://" + sock_; }

 private:
  TempDir dir_;
  std::string extra_, sock_, pid_, ping_;
};

}  // namespace idem::test
