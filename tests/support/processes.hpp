// SPDX-License-Identifier: MIT
// Test helpers for multi-process tests: start a program, wait for it, read its output.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace idem::test {

/// fork + exec of `args` (args[0] is the program), stdout and stderr to the file `out`.
inline pid_t spawn(const std::vector<std::string>& args, const std::string& out) {
  pid_t pid = ::fork();
  if (pid == 0) {
    int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

/// Waits for `pid` up to `limit`. @return its exit status (128 + signal when killed), or -1
/// after killing it on timeout.
inline int wait_for(pid_t pid, std::chrono::seconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

/// The whole content of a file ("" when it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// The value of `name=<n>` on the line starting with "summary " in `out` (all ones when
/// absent, so a comparison with it fails visibly).
inline std::uint64_t summary_value(const std::string& out, const std::string& name) {
  std::smatch m;
  std::regex re("summary .*\\b" + name + "=([0-9]+)");
  if (!std::regex_search(out, m, re)) return ~std::uint64_t{0};
  return std::stoull(m[1]);
}

}  // namespace idem::test
