// SPDX-License-Identifier: MIT
// Runs a program (an example binary) to completion and captures its output, for tests that
// check an example's exit status and its printed summary.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

namespace idem::test {

/// What a finished command left.
struct CommandResult {
  /// Exit status, or 128 + the signal that ended it, or -1 if it could not be started.
  int status = -1;
  /// stdout and stderr, interleaved as written.
  std::string output;

  /// Lines of the output that start with `prefix`.
  std::vector<std::string> lines_starting(const std::string& prefix) const {
    std::vector<std::string> out;
    std::size_t pos = 0;
    while (pos < output.size()) {
      std::size_t end = output.find('\n', pos);
      if (end == std::string::npos) end = output.size();
      std::string line = output.substr(pos, end - pos);
      std::size_t first = line.find_first_not_of(' ');
      if (first != std::string::npos && line.compare(first, prefix.size(), prefix) == 0) {
        out.push_back(line.substr(first));
      }
      pos = end + 1;
    }
    return out;
  }
};

/// Runs `argv[0]` with `argv` and waits for it.
inline CommandResult run_command(const std::vector<std::string>& argv) {
  CommandResult r;
  int fds[2];
  if (::pipe(fds) != 0) return r;
  pid_t pid = ::fork();
  if (pid < 0) return r;
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[0]);
    ::close(fds[1]);
    std::vector<std::string> copy = argv;
    std::vector<char*> args;
    for (auto& a : copy) args.push_back(a.data());
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0)
    r.output.append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

}  // namespace idem::test
