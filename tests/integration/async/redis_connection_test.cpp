// SPDX-License-Identifier: MIT
// The hiredis <-> Asio adapter and the asynchronous Redis connection, against the real
// redis-server (IDEM_TEST_REDIS_URL) and sockets that refuse, hang or never accept.
#include "async/redis_connection.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <hiredis/async.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "async/hiredis_asio.hpp"
#include "async/redis_errors.hpp"
#include "async_support.hpp"
#include "idem/errors.hpp"
#include "redis/uri.hpp"
#include "support/private_redis.hpp"
#include "support/test_env.hpp"

namespace {

using idem::async::detail::ConnectionFailure;
using idem::async::detail::ConnectionSettings;
using idem::async::detail::Node;
using idem::async::net::io_context;
using namespace std::chrono_literals;

std::string resp(std::initializer_list<std::string_view> args) {
  std::vector<std::string_view> v(args);
  std::string out;
  idem::async::detail::append_resp(out, static_cast<int>(v.size()), v.data());
  return out;
}

ConnectionSettings settings_for(const std::string& uri) {
  ConnectionSettings s;
  s.endpoint = idem::redis::detail::parse_uri(uri);
  s.connect_timeout = 300ms;
  s.command_timeout = 300ms;
  s.reconnect_backoff = 200ms;
  return s;
}

// What one command got back.
struct Answer {
  bool done = false;
  int type = 0;
  std::string text;
  long long integer = 0;
  std::exception_ptr error;
};

idem::async::detail::ReplyCallback record(Answer& a, bool write = false) {
  return [&a, write](const redisReply* r, const ConnectionFailure* f) {
    a.done = true;
    if (f != nullptr) {
      a.error = idem::async::detail::connection_error(*f, "test command", write);
      return;
    }
    a.type = r->type;
    if (r->type == REDIS_REPLY_INTEGER) a.integer = r->integer;
    if (r->str != nullptr) a.text.assign(r->str, r->len);
  };
}

template <class E>
bool holds(const std::exception_ptr& e) {
  if (!e) return false;
  try {
    std::rethrow_exception(e);
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
}

std::string what(const std::exception_ptr& e) {
  if (!e) return "<none>";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

class RedisConnectionTest : public ::testing::Test {
 protected:
  void SetUp() override { IDEM_REQUIRE_ENV(url_, "IDEM_TEST_REDIS_URL"); }
  std::string url_;
  io_context io_;
};

TEST_F(RedisConnectionTest, PipelinedCommandsAreAnsweredInOrderOnOneConnection) {
  Node node(io_.get_executor(), settings_for(url_));
  const std::string key = idem::test::unique_name("idem-test:async:incr");
  constexpr int kCommands = 5000;
  std::vector<Answer> answers(kCommands);
  for (int i = 0; i < kCommands; ++i) node.send(resp({"INCR", key}), record(answers[i]));
  EXPECT_EQ(static_cast<std::size_t>(kCommands), node.in_flight());
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return answers.back().done; }));
  for (int i = 0; i < kCommands; ++i) {
    ASSERT_TRUE(answers[i].done);
    ASSERT_FALSE(answers[i].error) << what(answers[i].error);
    ASSERT_EQ(REDIS_REPLY_INTEGER, answers[i].type);
    ASSERT_EQ(i + 1, answers[i].integer);  // in order
  }
  EXPECT_EQ(1u, node.stats().connects);
  EXPECT_EQ(0u, node.in_flight());
  Answer del;
  node.send(resp({"DEL", key}), record(del));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return del.done; }));
}

TEST_F(RedisConnectionTest, BinaryArgumentsAndBulkRepliesSurviveTheRoundTrip) {
  Node node(io_.get_executor(), settings_for(url_));
  const std::string key = idem::test::unique_name("idem-test:async:bin");
  std::string value;
  for (int i = 0; i < 256; ++i) value.push_back(static_cast<char>(i));
  value += std::string(1 << 20, '\r');
  Answer set, get, del;
  node.send(resp({"SET", key, value}), record(set));
  node.send(resp({"GET", key}), record(get));
  node.send(resp({"DEL", key}), record(del));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return del.done; }));
  ASSERT_FALSE(get.error) << what(get.error);
  EXPECT_EQ("OK", set.text);
  EXPECT_TRUE(value == get.text);
}

TEST_F(RedisConnectionTest, TheAdapterReleasesTheSocketHiredisCloses) {
  // Raw hiredis + adapter: the adapter never closes hiredis's fd, and dies with the context.
  auto ep = idem::redis::detail::parse_uri(url_);
  redisAsyncContext* ac = redisAsyncConnect(ep.host.c_str(), ep.port);
  ASSERT_NE(nullptr, ac);
  ASSERT_EQ(0, ac->err);
  const int fd = ac->c.fd;
  std::weak_ptr<idem::async::detail::HiredisAsio> weak;
  {
    auto adapter = idem::async::detail::HiredisAsio::attach(ac, io_.get_executor());
    ASSERT_NE(nullptr, adapter);
    EXPECT_EQ(nullptr, idem::async::detail::HiredisAsio::attach(ac, io_.get_executor()))
        << "a second attach must be refused";
    weak = adapter;
  }
  bool got = false;
  redisAsyncCommand(
      ac, [](redisAsyncContext*, void* r, void* p) { *static_cast<bool*>(p) = r != nullptr; }, &got,
      "PING");
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return got; }));
  EXPECT_FALSE(weak.expired());
  const unsigned long waits = weak.lock()->waits_started();
  EXPECT_LE(waits, 8u) << "one PING must not spin the reactor";
  redisAsyncFree(ac);  // hiredis closes fd; the adapter releases it and its waits end
  io_.restart();
  io_.poll();
  EXPECT_TRUE(weak.expired());
  EXPECT_EQ(-1, ::fcntl(fd, F_GETFD)) << "hiredis closed the socket exactly once";
}

TEST_F(RedisConnectionTest, TheServerClosingTheConnectionFailsPendingCommandsThenReconnects) {
  Node node(io_.get_executor(), settings_for(url_));
  Answer id;
  node.send(resp({"CLIENT", "ID"}), record(id));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return id.done; }));
  ASSERT_EQ(REDIS_REPLY_INTEGER, id.type);
  // Another connection kills this one while it waits in a blocking command.
  Node killer(io_.get_executor(), settings_for(url_));
  Answer blocked, kill;
  node.send(resp({"BLPOP", idem::test::unique_name("idem-test:async:never"), "0.25"}),
            record(blocked));
  killer.send(resp({"CLIENT", "KILL", "ID", std::to_string(id.integer)}), record(kill));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return blocked.done && kill.done; }));
  EXPECT_EQ(1, kill.integer);
  EXPECT_TRUE(holds<idem::StorageUnavailable>(blocked.error)) << what(blocked.error);
  EXPECT_EQ(1u, node.stats().dropped);
  Answer again;
  node.send(resp({"PING"}), record(again));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return again.done; }));
  EXPECT_EQ("PONG", again.text) << what(again.error);
  EXPECT_EQ(2u, node.stats().connects);
}

// The server closes the connection while it is idle (CLIENT KILL), and the next command is
// written before the close is read: over a Unix socket that write fails at once with EPIPE. It
// must fail the command typed (or go on a new connection), never raise SIGPIPE, which would end
// the process (Asio runs a descriptor's write-ready before its read-ready, so the write comes
// first here).
TEST(RedisConnectionFaults, AWriteToAConnectionTheServerClosedFailsTypedWithoutSigpipe) {
  idem::test::PrivateRedis server;
  io_context io;
  Node node(io.get_executor(), settings_for(server.uri()));
  Answer first;
  node.send(resp({"PING"}), record(first));
  ASSERT_TRUE(idem::test::run_until(io, [&] { return first.done; }));
  ASSERT_EQ("PONG", first.text) << what(first.error);
  int failed = 0;
  for (int round = 0; round < 3; ++round) {
    EXPECT_GE(server.kill_clients(), 1);
    Answer after_kill;
    node.send(resp({"PING"}), record(after_kill));
    ASSERT_TRUE(idem::test::run_until(io, [&] { return after_kill.done; }));
    if (after_kill.error) {
      EXPECT_TRUE(holds<idem::StorageUnavailable>(after_kill.error)) << what(after_kill.error);
      ++failed;
    } else {
      EXPECT_EQ("PONG", after_kill.text);
    }
    Answer again;
    node.send(resp({"PING"}), record(again));
    ASSERT_TRUE(idem::test::run_until(io, [&] { return again.done; }));
    EXPECT_EQ("PONG", again.text) << what(again.error);
  }
  std::printf("commands failed typed after a kill: %d of 3\n", failed);
}

TEST_F(RedisConnectionTest, RefusedConnectIsUnavailableAndFailsFastDuringTheBackoff) {
  Node node(io_.get_executor(),
            settings_for("redis://127.0.0.1:" + std::to_string(idem::test::closed_port())));
  Answer first, during;
  node.send(resp({"PING"}), record(first));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return first.done; }));
  EXPECT_TRUE(holds<idem::StorageUnavailable>(first.error)) << what(first.error);
  node.send(resp({"PING"}), record(during));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return during.done; }));
  EXPECT_TRUE(holds<idem::StorageUnavailable>(during.error)) << what(during.error);
  EXPECT_NE(std::string::npos, what(during.error).find("last connect failed"));
  EXPECT_EQ(1u, node.stats().connect_failures);
  EXPECT_EQ(1u, node.stats().fast_failures);
}

TEST_F(RedisConnectionTest, AReplyThatNeverComesIsATimeoutOrAnUnknownWrite) {
  idem::test::SilentServer silent;
  Node node(io_.get_executor(), settings_for("redis://127.0.0.1:" + std::to_string(silent.port())));
  Answer read, write;
  const auto t0 = std::chrono::steady_clock::now();
  node.send(resp({"GET", "k"}), record(read, false));
  node.send(resp({"SET", "k", "v"}), record(write, true));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return read.done && write.done; }));
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(holds<idem::StorageTimeout>(read.error)) << what(read.error);
  EXPECT_TRUE(holds<idem::OutcomeUnknown>(write.error)) << what(write.error);
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 3s);
  EXPECT_EQ(1u, node.stats().timeouts);
}

TEST_F(RedisConnectionTest, AConnectThatNeverCompletesTimesOutAndNothingWasWritten) {
  idem::test::UnacceptingServer full;
  Node node(io_.get_executor(), settings_for("redis://127.0.0.1:" + std::to_string(full.port())));
  Answer write;
  node.send(resp({"SET", "k", "v"}), record(write, true));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return write.done; }));
  // Never connected: the write cannot have applied, so it is a plain timeout.
  EXPECT_TRUE(holds<idem::StorageTimeout>(write.error)) << what(write.error);
  EXPECT_EQ(1u, node.stats().connect_failures);
}

TEST_F(RedisConnectionTest, ARefusedAuthIsAStorageError) {
  auto s = settings_for(url_);
  s.endpoint.password = "wrong-password";
  Node node(io_.get_executor(), s);
  Answer ping;
  node.send(resp({"PING"}), record(ping));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return ping.done; }));
  // The server has no password: AUTH is refused, and the command behind it never runs on an
  // unauthenticated connection.
  EXPECT_TRUE(ping.error) << "PING answered " << ping.text;
  EXPECT_TRUE(holds<idem::StorageError>(ping.error));
  EXPECT_FALSE(holds<idem::StorageUnavailable>(ping.error)) << what(ping.error);
  EXPECT_NE(std::string::npos, what(ping.error).find("AUTH"));
}

TEST_F(RedisConnectionTest, DestroyingANodeFailsItsPendingCommands) {
  Answer a;
  {
    Node node(io_.get_executor(), settings_for(url_));
    node.send(resp({"PING"}), record(a));
  }
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return a.done; }));
  EXPECT_TRUE(holds<idem::StorageUnavailable>(a.error)) << what(a.error);
}

}  // namespace
