// SPDX-License-Identifier: MIT
// Test helpers: server lookup (skip or fail), unique names, temp files.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>

namespace idem::test {

/// True when scripts/test.sh runs us: a missing server is then a failure, never a skip.
inline bool servers_required() {
  const char* v = std::getenv("IDEM_REQUIRE_SERVERS");
  return v != nullptr && std::string(v) == "1";
}

/// The value of `var`, or "" (the caller then skips, or fails under IDEM_REQUIRE_SERVERS).
inline std::string server_env(const char* var) {
  const char* v = std::getenv(var);
  return v == nullptr ? std::string() : std::string(v);
}

/// A name unique to this process and call: "<prefix>_<pid>_<n>_<random>".
inline std::string unique_name(const std::string& prefix) {
  static std::atomic<int> counter{0};
  static const unsigned seed = std::random_device{}();
  return prefix + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + "_" +
         std::to_string(seed % 100000);
}

/// A temporary directory removed on destruction.
class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() / unique_name("idem_test");
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace idem::test

/// Skips the test when `var` is unset, or fails it when scripts/test.sh requires servers.
#define IDEM_REQUIRE_ENV(out, var)                                                   \
  do {                                                                               \
    out = ::idem::test::server_env(var);                                             \
    if (out.empty()) {                                                               \
      if (::idem::test::servers_required()) {                                        \
        FAIL() << (var) << " is not set (required under scripts/test.sh)";           \
      }                                                                              \
      GTEST_SKIP() << (var) << " is not set (scripts/test.sh starts the servers)";   \
    }                                                                                \
  } while (0)
