// SPDX-License-Identifier: MIT
// The TLS redis-server killed (-9) under a pool of TLS connections, then started again: calls
// fail typed while it is down (never hang, never an untyped error), and the pool opens new TLS
// sessions by itself once it is back. Runs alone (SERIAL): it stops a shared server.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "idem/errors.hpp"
#include "idem/redis/redis_store.hpp"
#include "support/test_env.hpp"

namespace {

TEST(RedisTlsFault, ServerKilledThenRestartedReconnectsOverTls) {
  std::string url, dir, script, servers;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_TLS_URL");
  IDEM_REQUIRE_ENV(dir, "IDEM_TEST_TLS_DIR");
  IDEM_REQUIRE_ENV(script, "IDEM_SERVERS_SCRIPT");
  IDEM_REQUIRE_ENV(servers, "IDEM_SERVERS_DIR");
  idem::redis::RedisStoreOptions o;
  o.uri = url;
  o.tls.ca_file = dir + "/ca.pem";
  o.pool_size = 4;
  o.reconnect_backoff = std::chrono::milliseconds(50);
  idem::redis::RedisStore fast{o};
  auto key = [](int i) { return idem::Key::make("tls_fault", "k" + std::to_string(i)); };

  // Four threads keep the pool's connections busy.
  std::atomic<bool> stop{false};
  std::atomic<long> ok{0}, typed{0}, untyped{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; !stop.load(); ++i) {
        try {
          (void)fast.lookup(key(t * 100000 + i));
          ok.fetch_add(1);
        } catch (const idem::StorageError&) {
          typed.fetch_add(1);
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        } catch (...) {
          untyped.fetch_add(1);
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const long ok_before = ok.load();
  EXPECT_GT(ok_before, 0);
  // (With auto-pipelining the four threads share one connection: count sessions, not threads.)
  const auto connects_before = fast.pool_stats().connects;
  EXPECT_GE(connects_before, 1u);

  std::ifstream pidfile(servers + "/redis-tls.pid");
  long pid = 0;
  pidfile >> pid;
  ASSERT_GT(pid, 0);
  ASSERT_EQ(0, ::kill(static_cast<pid_t>(pid), SIGKILL));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const long typed_while_down = typed.load();
  EXPECT_GT(typed_while_down, 0);  // failures, each an idem::StorageError

  ASSERT_EQ(0, std::system((script + " tls >/dev/null 2>&1").c_str()));
  const long ok_at_restart = ok.load();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (ok.load() < ok_at_restart + 100 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stop.store(true);
  for (auto& t : threads) t.join();
  EXPECT_GE(ok.load(), ok_at_restart + 100) << "no reconnect over TLS after the restart";
  EXPECT_EQ(0, untyped.load());
  auto stats = fast.pool_stats();
  EXPECT_GT(stats.connects, connects_before);  // new TLS sessions after the restart
  EXPECT_GT(stats.dropped, 0u);
  // And a plain call works again.
  EXPECT_EQ(idem::ClaimStatus::kClaimed,
            fast.claim(idem::Key::make("tls_fault", idem::test::unique_name("after")), "",
                       idem::OwnerToken::generate(), std::chrono::seconds(5))
                .status);
}

}  // namespace
