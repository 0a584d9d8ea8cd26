// SPDX-License-Identifier: MIT
// Runs the idemctl binary (IDEMCTL_PATH) from tests and captures what it prints.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace idemctl_test {

/// Exit status and combined stdout + stderr of one run.
struct Run {
  int status = -1;
  std::string out;
};

/// `s` single-quoted for /bin/sh.
inline std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') {
      q += "'\\''";
    } else {
      q += c;
    }
  }
  return q + "'";
}

/// Runs `idemctl <args>` with IDEMCTL_DB unset, so only the arguments choose the store.
/// `out` holds stdout and stderr, or stdout alone when `with_stderr` is false.
inline Run idemctl(const std::string& args, bool with_stderr = true) {
  std::string cmd = std::string("env -u IDEMCTL_DB ") + IDEMCTL_PATH + " " + args +
                    (with_stderr ? " 2>&1" : " 2>/dev/null");
  Run r;
  std::FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf{};
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int raw = pclose(p);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  return r;
}

inline bool contains(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

}  // namespace idemctl_test
