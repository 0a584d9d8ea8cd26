// SPDX-License-Identifier: MIT
// examples/grpc_payment as a separate server process on SQLite, many client threads with
// duplicates in flight, the server killed with SIGKILL mid-run and restarted on the same port:
// exactly one effect per key, every key answered with one payment number, no key left in
// progress.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "grpc_test_support.hpp"
#include "support/test_env.hpp"

extern char** environ;

namespace {

using namespace std::chrono_literals;
namespace pb = grpc_payment::pb;
using idem::test::grpc_support::free_port;
using Clock = std::chrono::steady_clock;

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The example server as a child process (posix_spawn: no fork of this multi-threaded process),
// stdout and stderr appended to `log`.
class ServerProcess {
 public:
  ServerProcess(std::vector<std::string> args, std::string log)
      : args_(std::move(args)), log_(std::move(log)) {}
  ~ServerProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  // Starts it and waits for its "listening" line (the n-th in the log).
  void start() {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    std::vector<char*> argv;
    for (auto& a : args_) argv.push_back(a.data());
    argv.push_back(nullptr);
    int rc = posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ASSERT_EQ(0, rc) << "cannot start " << args_[0];
    ++starts_;
    auto deadline = Clock::now() + 20s;
    while (Clock::now() < deadline) {
      std::string out = slurp(log_);
      std::size_t n = 0;
      for (auto at = out.find("listening on"); at != std::string::npos;
           at = out.find("listening on", at + 1)) {
        ++n;
      }
      if (n >= static_cast<std::size_t>(starts_)) return;
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        FAIL() << "the server exited at start:\n" << out;
      }
      std::this_thread::sleep_for(10ms);
    }
    FAIL() << "the server did not start:\n" << slurp(log_);
  }

  void kill9() {
    ASSERT_EQ(0, ::kill(pid_, SIGKILL));
    int status = 0;
    ::waitpid(pid_, &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    pid_ = -1;
  }

  // SIGTERM: a clean Shutdown, exit 0.
  int stop() {
    ::kill(pid_, SIGTERM);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

 private:
  std::vector<std::string> args_;
  std::string log_;
  pid_t pid_ = -1;
  int starts_ = 0;
};

// Charges `keys` keys from 8 client threads, every key as 3 copies at once (duplicates in
// flight), each retried with the same key until it gets a final answer; the server is killed
// with SIGKILL when a third of the keys are answered and restarted 300 ms later.
void kill_nine_mid_run(const std::vector<std::string>& extra, int keys, bool two_phase) {
  idem::test::TempDir dir;
  const std::string db = dir.file("payments.sqlite");
  const int port = free_port();
  std::vector<std::string> args = {
      GRPC_PAYMENT_PATH, "--serve", "--port",    std::to_string(port), "--db", db,
      "--accounts",      "8",       "--balance", "100000000"};
  args.insert(args.end(), extra.begin(), extra.end());
  ServerProcess server(args, dir.file("server.log"));
  server.start();
  if (::testing::Test::HasFatalFailure()) return;

  const std::string address = "127.0.0.1:" + std::to_string(port);
  std::vector<std::vector<grpc_payment::Answer>> answers(static_cast<std::size_t>(keys));
  std::atomic<int> next{0}, answered{0}, retries{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < 8; ++t) {
    clients.emplace_back([&] {
      auto stub = pb::Payments::NewStub(grpc_payment::make_channel(address));
      for (int i; (i = next++) < keys;) {
        pb::ChargeRequest req;
        req.set_account(grpc_payment::SqliteLedger::account(i % 8));
        req.set_amount_cents(100 + i % 50);
        req.set_currency("EUR");
        req.set_order_no("ORD-" + std::to_string(i));
        const std::string key = "kill-" + std::to_string(i);
        auto deadline = Clock::now() + 60s;
        while (Clock::now() < deadline) {
          auto a = grpc_payment::hedged_charge(*stub, req, key, 3, 5s);
          auto code = a.status.error_code();
          if (code == grpc::StatusCode::OK) {
            answers[static_cast<std::size_t>(i)].push_back(a);
            break;
          }
          // Only what a retry with the same key is meant for: the server away, in progress.
          if (code != grpc::StatusCode::UNAVAILABLE && code != grpc::StatusCode::ABORTED &&
              code != grpc::StatusCode::DEADLINE_EXCEEDED && code != grpc::StatusCode::CANCELLED) {
            answers[static_cast<std::size_t>(i)].push_back(a);
            break;
          }
          ++retries;
          std::this_thread::sleep_for(20ms);
        }
        ++answered;
      }
    });
  }
  while (answered.load() < keys / 3) std::this_thread::sleep_for(2ms);
  server.kill9();
  // What the crash left behind, straight from the file.
  long in_progress_at_kill = 0;
  {
    idem::sqlite::Database file{db};
    in_progress_at_kill = file.read([](idem::sqlite::Session& s) {
      // The server made a version-3 table: status 0 is in progress.
      return *s.query_int64("SELECT count(*) FROM api_idempotency WHERE status = 0");
    });
  }
  std::this_thread::sleep_for(300ms);
  server.start();
  for (auto& c : clients) c.join();
  EXPECT_EQ(0, server.stop());

  idem::sqlite::SqliteStore store{db};
  grpc_payment::SqliteLedger ledger{store};
  auto totals = ledger.totals();
  int unanswered = 0, wrong = 0;
  std::int64_t charged = 0;
  for (int i = 0; i < keys; ++i) {
    const auto& got = answers[static_cast<std::size_t>(i)];
    if (got.empty() || !got.front().status.ok()) {
      if (++unanswered < 5) {
        ADD_FAILURE() << "key " << i << ": "
                      << (got.empty() ? std::string("no final answer in 60 s")
                                      : got.front().status.error_message());
      }
      continue;
    }
    charged += 100 + i % 50;
    auto row = totals.by_key.find("kill-" + std::to_string(i));
    if (row == totals.by_key.end() || row->second != got.front().reply.payment_no()) ++wrong;
  }
  EXPECT_EQ(0, unanswered);
  EXPECT_EQ(0, wrong);
  EXPECT_EQ(keys, totals.payments);  // exactly one effect per key
  EXPECT_EQ(charged, totals.charged_cents);
  EXPECT_EQ(8 * 100'000'000LL - charged, totals.balance_cents);
  ASSERT_EQ(3, store.schema_version());
  long stuck = store.database().read([&](idem::sqlite::Session& s) {
    return *s.query_int64("SELECT count(*) FROM api_idempotency WHERE status <> " +
                          store.status_literal(idem::Record::Status::kCompleted));
  });
  EXPECT_EQ(0, stuck);  // no key left in progress
  if (two_phase) {
    EXPECT_EQ(keys, totals.gateway_charges);
    for (const auto& [k, n] : totals.gateway_by_key) EXPECT_EQ(1, n) << k;
    // The kill caught attempts between their two phases; their records outlived the process
    // and were taken over once their lease ended.
    EXPECT_GT(in_progress_at_kill, 0);
    // ... each exactly once, by the restarted server (its exit line counts them).
    std::smatch m;
    std::string log = slurp(dir.file("server.log"));
    ASSERT_TRUE(std::regex_search(log, m, std::regex("stopped: .* takeovers=([0-9]+)"))) << log;
    EXPECT_EQ(in_progress_at_kill, std::stol(m[1]));
  } else {
    EXPECT_EQ(0, in_progress_at_kill);  // a transaction dies with the process
  }
  std::printf(
      "kill -9 mid-run: %d keys, %d retried attempts, %ld records in progress at the "
      "kill\n%s",
      keys, retries.load(), in_progress_at_kill, slurp(dir.file("server.log")).c_str());
}

// SIGTERM while handlers still run (their calls' deadlines already passed): the server exits
// cleanly, synchronous service or callback service (which stops its loop and finishes its
// worker pool's work before the guard, the stores and the ledger go), and after a restart each
// key ends with exactly one charge.
TEST(GrpcPaymentProcess, SigtermWhileHandlersStillRunExitsCleanlyAndChargesOnce) {
  std::vector<bool> modes = {false};
#ifdef GRPC_PAYMENT_WITH_ASYNC
  modes.push_back(true);
#endif
  for (bool callback : modes) {
    SCOPED_TRACE(callback ? "--callback" : "synchronous");
    idem::test::TempDir dir;
    const std::string db = dir.file("payments.sqlite");
    const int port = free_port();
    std::vector<std::string> args = {GRPC_PAYMENT_PATH,
                                     "--serve",
                                     "--port",
                                     std::to_string(port),
                                     "--db",
                                     db,
                                     "--accounts",
                                     "2",
                                     "--balance",
                                     "1000000",
                                     "--slow-ms",
                                     "1500"};
    if (callback) args.emplace_back("--callback");
    ServerProcess server(args, dir.file("server.log"));
    server.start();
    if (::testing::Test::HasFatalFailure()) return;
    const std::string address = "127.0.0.1:" + std::to_string(port);
    constexpr int kKeys = 3;
    auto request = [](int i) {
      pb::ChargeRequest req;
      req.set_account(grpc_payment::SqliteLedger::account(i % 2));
      req.set_amount_cents(100 + i);
      req.set_currency("EUR");
      req.set_order_no("ORD-TERM-" + std::to_string(i));
      return req;
    };
    auto key = [](int i) { return "term-" + std::to_string(i); };
    {
      auto stub = pb::Payments::NewStub(grpc_payment::make_channel(address));
      std::vector<std::thread> calls;
      for (int i = 0; i < kKeys; ++i) {
        calls.emplace_back(
            [&, i] { (void)grpc_payment::charge(*stub, request(i), key(i), 300ms); });
      }
      for (auto& t : calls) t.join();  // each gave up at 300 ms; the handlers run for 1.5 s
    }
    EXPECT_EQ(0, server.stop()) << slurp(dir.file("server.log"));
    server.start();
    if (::testing::Test::HasFatalFailure()) return;
    {
      auto stub = pb::Payments::NewStub(grpc_payment::make_channel(address));
      for (int i = 0; i < kKeys; ++i) {
        grpc_payment::Answer a;
        const auto deadline = Clock::now() + 60s;  // a key left in progress waits for its lease
        do {
          a = grpc_payment::charge(*stub, request(i), key(i), 10s);
          if (a.status.ok()) break;
          std::this_thread::sleep_for(100ms);
        } while (Clock::now() < deadline);
        EXPECT_TRUE(a.status.ok()) << key(i) << ": " << a.status.error_message();
      }
    }
    EXPECT_EQ(0, server.stop()) << slurp(dir.file("server.log"));
    idem::sqlite::SqliteStore store{db};
    grpc_payment::SqliteLedger ledger{store};
    auto totals = ledger.totals();
    EXPECT_EQ(kKeys, totals.payments);  // exactly one effect per key
    for (int i = 0; i < kKeys; ++i) EXPECT_EQ(1u, totals.by_key.count(key(i))) << key(i);
  }
}

TEST(GrpcPaymentProcess, KillNineMidRunTransactionalOneEffectPerKey) {
  kill_nine_mid_run({"--slow-ms", "2"}, 300, false);
}

TEST(GrpcPaymentProcess, KillNineMidRunTwoPhaseNoStuckKey) {
  kill_nine_mid_run({"--gateway-ms", "20", "--lease-ms", "1000"}, 300, true);
}

}  // namespace
