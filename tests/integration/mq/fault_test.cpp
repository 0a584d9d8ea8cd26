// SPDX-License-Identifier: MIT
// idem::mq::RedisStreams when the server dies and comes back: typed errors, then recovery.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "idem/errors.hpp"
#include "idem/mq/redis_streams.hpp"
#include "support/test_env.hpp"

namespace {

void servers(const std::string& script, const std::string& what) {
  std::string cmd = "\"" + script + "\" " + what + " >/dev/null 2>&1";
  ASSERT_EQ(0, std::system(cmd.c_str())) << cmd;
}

TEST(RedisStreamsFault, ServerKilledThenRestarted) {
  std::string url, script;
  IDEM_REQUIRE_ENV(url, "IDEM_TEST_REDIS_URL");
  IDEM_REQUIRE_ENV(script, "IDEM_SERVERS_SCRIPT");
  idem::mq::RedisStreamsOptions o{url};
  o.command_timeout = std::chrono::milliseconds(500);
  idem::mq::RedisStreams redis{o};
  const std::string stream = idem::test::unique_name("idem-test:mq:fault");
  redis.create_group(stream, "g");
  redis.add(stream, {{"message_id", "m1"}});
  auto batch = redis.read_group(stream, "g", "c", 10, std::nullopt);
  ASSERT_EQ(1u, batch.size());

  servers(script, "redis-kill");
  // A dead server is a typed, retryable error on every call, never a hang or a crash.
  try {
    redis.ack(stream, "g", {batch[0].id});
    FAIL() << "expected a failure with the server down";
  } catch (const idem::StorageError& e) {
    EXPECT_TRUE(e.retryable()) << e.what();
  }
  EXPECT_THROW(redis.read_group(stream, "g", "c", 10, std::nullopt), idem::StorageUnavailable);
  try {
    redis.add(stream, {{"message_id", "m2"}});
    FAIL() << "expected a failure with the server down";
  } catch (const idem::StorageError& e) {
    // Refused before sending: unavailable; lost after sending: outcome unknown. Both retryable.
    EXPECT_TRUE(e.retryable()) << e.what();
  }

  servers(script, "redis-start");
  // The same object recovers (new connections after the reconnect backoff). The restarted
  // server has no persistence: the stream and its group are gone and are created again.
  bool recovered = false;
  for (int i = 0; i < 50 && !recovered; ++i) {
    try {
      redis.ping();
      recovered = true;
    } catch (const idem::StorageError&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ASSERT_TRUE(recovered);
  EXPECT_TRUE(redis.create_group(stream, "g"));
  redis.add(stream, {{"message_id", "m3"}});
  auto again = redis.read_group(stream, "g", "c", 10, std::nullopt);
  ASSERT_EQ(1u, again.size());
  EXPECT_EQ("m3", *again[0].find("message_id"));
  EXPECT_EQ(1u, redis.ack(stream, "g", {again[0].id}));
  redis.del(stream);
}

}  // namespace
