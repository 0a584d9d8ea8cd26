// SPDX-License-Identifier: MIT
// The examples that run as several processes (refund, scheduled_job) start copies of their own
// binary with this: fork + exec of /proc/self/exe, stdout to a pipe or a file, kill, wait.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace examples {

/// A child process running this program with other arguments. Killed (SIGKILL) and reaped on
/// destruction if still running.
class ChildProcess {
 public:
  /// Where the child's stdout goes.
  enum class Output { kPipe, kFile, kInherit };

  /// Starts /proc/self/exe with `args` (argv[1..]). `file`: the path for Output::kFile.
  /// @throws std::runtime_error when fork or the pipe fails.
  ChildProcess(const std::vector<std::string>& args, Output output, const std::string& file = {}) {
    int fds[2] = {-1, -1};
    if (output == Output::kPipe && ::pipe(fds) != 0) {
      throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
    }
    std::fflush(nullptr);  // nothing buffered is written twice
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid_ == 0) {
      if (output == Output::kPipe) {
        ::dup2(fds[1], STDOUT_FILENO);
        ::close(fds[0]);
        ::close(fds[1]);
      } else if (output == Output::kFile) {
        int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0) ::_exit(126);
        ::dup2(fd, STDOUT_FILENO);
        ::close(fd);
      }
      std::vector<std::string> argv_storage;
      argv_storage.push_back(self_path());
      argv_storage.insert(argv_storage.end(), args.begin(), args.end());
      std::vector<char*> argv;
      for (auto& a : argv_storage) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    if (output == Output::kPipe) {
      ::close(fds[1]);
      out_ = ::fdopen(fds[0], "r");
    }
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_ != nullptr) std::fclose(out_);
  }

  /// The running binary's path.
  static std::string self_path() {
    char buf[4096];
    ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (n <= 0) return "/proc/self/exe";
    return std::string(buf, static_cast<std::size_t>(n));
  }

  /// The child's pid (-1 once reaped).
  pid_t pid() const noexcept { return pid_; }

  /// The next line of a piped stdout (without the newline); nullopt at end of file.
  std::optional<std::string> read_line() {
    if (out_ == nullptr) return std::nullopt;
    std::string line;
    int c;
    while ((c = std::fgetc(out_)) != EOF) {
      if (c == '\n') return line;
      line += static_cast<char>(c);
    }
    if (line.empty()) return std::nullopt;
    return line;
  }

  /// Sends `sig` (SIGKILL for a kill -9).
  void kill(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }

  /// True while the child runs (reaps it, without waiting, once it has ended).
  bool running() {
    if (pid_ <= 0) return false;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) != pid_) return true;
    pid_ = -1;
    status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return false;
  }

  /// Waits for the child. @return its exit status, or 128 + the signal that ended it.
  int wait() {
    if (pid_ <= 0) return status_;
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return status_;
  }

 private:
  pid_t pid_ = -1;
  int status_ = -1;
  std::FILE* out_ = nullptr;
};

/// A temporary directory (mkdtemp under /tmp), removed with everything in it on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix) {
    std::string templ = "/tmp/" + prefix + ".XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) {
      throw std::runtime_error(std::string("mkdtemp: ") + std::strerror(errno));
    }
    path_ = templ;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  /// The path of a file in the directory (removed with it).
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  /// The directory.
  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
};

}  // namespace examples
