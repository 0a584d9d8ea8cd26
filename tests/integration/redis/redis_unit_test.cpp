// SPDX-License-Identifier: MIT
// No server needed: URI parsing and the mapping of hiredis/server failures to idem errors.
#include <gtest/gtest.h>
#include <hiredis/hiredis.h>

#include <cerrno>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "errors.hpp"
#include "idem/redis/redis_store.hpp"
#include "uri.hpp"

namespace {

using idem::redis::RedisStore;
using idem::redis::RedisStoreOptions;
using idem::redis::detail::Failure;
using namespace std::chrono_literals;

TEST(RedisStoreOptionsTest, MalformedUrisAreUsageErrors) {
  for (const char* uri : {"",
                          "127.0.0.1:6379",
                          "http://127.0.0.1:6379",
                          "rediss://",
                          "rediss://127.0.0.1:notaport",
                          "redis://",
                          "redis://:6379",
                          "redis://127.0.0.1:",
                          "redis://127.0.0.1:99999",
                          "redis://127.0.0.1:0",
                          "redis://127.0.0.1:63x9",
                          "redis://127.0.0.1:6379/abc",
                          "redis://127.0.0.1:6379/-1",
                          "redis://[::1",
                          "redis://[::1]x",
                          "redis://secret@127.0.0.1",
                          "redis://:@127.0.0.1",
                          "redis://:%zz@127.0.0.1",
                          "unix://relative.sock",
                          "unix:///tmp/r.sock?database=2",
                          "unix:///tmp/r.sock?db=x"}) {
    SCOPED_TRACE(uri);
    EXPECT_THROW(RedisStore{uri}, idem::UsageError);
  }
  // Refused schemes and scheme-less strings are masked too.
  for (const char* uri : {"redis-nope://u:hunter2@h", "u:hunter2@127.0.0.1:6379",
                          "redis-sentinel://u:hunter2@h:1/m"}) {
    try {
      idem::redis::detail::parse_uri(uri);
      ADD_FAILURE() << "no exception for " << uri;
    } catch (const idem::UsageError& e) {
      EXPECT_EQ(std::string::npos, std::string(e.what()).find("hunter2")) << e.what();
    }
  }
  try {
    RedisStore store{"redis://:hunter2@127.0.0.1:6379/notanumber"};
    ADD_FAILURE() << "no exception";
  } catch (const idem::UsageError& e) {
    EXPECT_EQ(std::string::npos, std::string(e.what()).find("hunter2")) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("notanumber")) << e.what();
  }
}

// rediss:// with nothing listening: the TCP connect fails before any TLS, typed as an outage.
TEST(RedisStoreOptionsTest, RedissToAClosedPortIsStorageUnavailable) {
  RedisStoreOptions o;
  o.uri = "rediss://127.0.0.1:1";
  RedisStore store{o};
  try {
    (void)store.claim(idem::Key::make("s", "i"), "", idem::OwnerToken::generate(), 1s);
    ADD_FAILURE() << "no exception";
  } catch (const idem::StorageUnavailable& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("rediss://127.0.0.1:1")) << e.what();
  }
  o.tls.ca_file = "/nonexistent/ca.pem";
  EXPECT_THROW(RedisStore{o}, idem::UsageError);
}

TEST(RedisStoreOptionsTest, WellFormedUrisParse) {
  using idem::redis::detail::parse_uri;
  auto tls = parse_uri("rediss://app:pw@cache.example:6380/2");
  EXPECT_TRUE(tls.tls);
  EXPECT_EQ("cache.example", tls.host);
  EXPECT_EQ(6380, tls.port);
  EXPECT_EQ(2, tls.db);
  EXPECT_EQ("pw", tls.password);
  EXPECT_EQ(std::string::npos, tls.display.find("pw"));
  EXPECT_FALSE(parse_uri("redis://127.0.0.1").tls);
  auto a = parse_uri("redis://127.0.0.1");
  EXPECT_EQ("127.0.0.1", a.host);
  EXPECT_EQ(6379, a.port);
  EXPECT_EQ(0, a.db);
  auto b = parse_uri("redis://:p%40ss@cache.internal:7000/3");
  EXPECT_EQ("cache.internal", b.host);
  EXPECT_EQ(7000, b.port);
  EXPECT_EQ(3, b.db);
  EXPECT_EQ("", b.user);
  EXPECT_EQ("p@ss", b.password);
  EXPECT_EQ(std::string::npos, b.display.find("p@ss"));
  auto c = parse_uri("redis://app:pw@[::1]:6380");
  EXPECT_EQ("::1", c.host);
  EXPECT_EQ(6380, c.port);
  EXPECT_EQ("app", c.user);
  auto d = parse_uri("unix:///var/run/redis.sock?db=2");
  EXPECT_TRUE(d.unix_socket);
  EXPECT_EQ("/var/run/redis.sock", d.path);
  EXPECT_EQ(2, d.db);
  auto e = parse_uri("tcp://127.0.0.1:16379");
  EXPECT_EQ(16379, e.port);
  EXPECT_THROW(RedisStore(RedisStoreOptions{"redis://h", 1, 0ms, 0ms, -1ms}), idem::UsageError);
}

TEST(RedisStoreOptionsTest, ZerosMeanDefaults) {
  RedisStoreOptions o{"redis://127.0.0.1:1"};
  o.pool_size = 0;
  o.connect_timeout = 0ms;
  o.command_timeout = 0ms;
  RedisStore store(o);
  EXPECT_EQ(8u, store.options().pool_size);
  EXPECT_EQ(500ms, store.options().connect_timeout);
  EXPECT_EQ(1000ms, store.options().command_timeout);
  EXPECT_EQ("redis", store.name());
}

template <class E>
void expect_thrown(const Failure& f, idem::errc code, const std::string& needle) {
  try {
    idem::redis::detail::throw_error(f);
  } catch (const E& e) {
    EXPECT_EQ(code, e.code()) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find(needle)) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find(f.context)) << e.what();
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return;
  }
}

TEST(RedisErrorMapping, ServerErrorRepliesBecomeTypedErrors) {
  using K = Failure::Kind;
  auto server = [](const char* msg) { return Failure{K::kServer, "claim idem:{a|b}", msg}; };
  expect_thrown<idem::StorageUnavailable>(server("LOADING Redis is loading the dataset in memory"),
                                          idem::errc::kStoreUnavailable, "LOADING");
  expect_thrown<idem::StorageUnavailable>(server("BUSY Redis is busy running a script."),
                                          idem::errc::kStoreUnavailable, "BUSY");
  expect_thrown<idem::StorageUnavailable>(
      server("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
      idem::errc::kStoreUnavailable, "MASTERDOWN");
  expect_thrown<idem::StorageUnavailable>(
      server("READONLY You can't write against a read only replica."),
      idem::errc::kStoreUnavailable, "READONLY");
  expect_thrown<idem::StorageUnavailable>(
      server("ERR Error running script (call to f_x): @user_script:1: -READONLY You can't write"),
      idem::errc::kStoreUnavailable, "READONLY");
  expect_thrown<idem::StorageUnavailable>(
      server("OOM command not allowed when used memory > 'maxmemory'."),
      idem::errc::kStoreUnavailable, "OOM");
  expect_thrown<idem::CorruptRecord>(
      server("WRONGTYPE Operation against a key holding the wrong kind of value"),
      idem::errc::kCorruptRecord, "WRONGTYPE");
  expect_thrown<idem::StorageError>(server("NOAUTH Authentication required."),
                                    idem::errc::kStorageError, "NOAUTH");
  expect_thrown<idem::StorageError>(server("ERR unknown command"), idem::errc::kStorageError,
                                    "unknown command");
  // A word that merely starts like a code is not that code.
  expect_thrown<idem::StorageError>(server("BUSYKEY Target key name already exists."),
                                    idem::errc::kStorageError, "BUSYKEY");
}

TEST(RedisErrorMapping, ConnectionFailuresBecomeTypedErrors) {
  using K = Failure::Kind;
  auto ctx = [](int err, int sys, const char* msg, bool write = false) {
    return Failure{K::kContext, "complete idem:{a|b}", msg, err, sys, write};
  };
  expect_thrown<idem::StorageUnavailable>(ctx(REDIS_ERR_IO, ECONNREFUSED, "Connection refused"),
                                          idem::errc::kStoreUnavailable, "Connection refused");
  expect_thrown<idem::StorageUnavailable>(ctx(REDIS_ERR_IO, ECONNRESET, "Connection reset by peer"),
                                          idem::errc::kStoreUnavailable, "reset");
  expect_thrown<idem::StorageUnavailable>(ctx(REDIS_ERR_EOF, 0, "Server closed the connection"),
                                          idem::errc::kStoreUnavailable, "closed");
  expect_thrown<idem::StorageTimeout>(ctx(REDIS_ERR_IO, EAGAIN, "Resource temporarily unavailable"),
                                      idem::errc::kStoreTimeout, "timed out");
  expect_thrown<idem::StorageTimeout>(ctx(REDIS_ERR_IO, ETIMEDOUT, "Connection timed out"),
                                      idem::errc::kStoreTimeout, "timed out");
  // errno overwritten after hiredis formatted its message: the message still tells.
  expect_thrown<idem::StorageTimeout>(ctx(REDIS_ERR_IO, 0, "Resource temporarily unavailable"),
                                      idem::errc::kStoreTimeout, "timed out");
  expect_thrown<idem::OutcomeUnknown>(
      ctx(REDIS_ERR_IO, EAGAIN, "Resource temporarily unavailable", true),
      idem::errc::kOutcomeUnknown, "may have been applied");
  // The connection lost after a write went out whole: the server may have applied it. Not
  // sent (refused at the write), or not a write that matters (a claim, a read): unavailable.
  auto sent = [](int err, int sys, const char* msg, bool write) {
    return Failure{K::kContext, "complete idem:{a|b}", msg, err, sys, write, true};
  };
  expect_thrown<idem::OutcomeUnknown>(sent(REDIS_ERR_EOF, 0, "Server closed the connection", true),
                                      idem::errc::kOutcomeUnknown, "may have been applied");
  expect_thrown<idem::OutcomeUnknown>(sent(REDIS_ERR_IO, ECONNRESET, "Connection reset", true),
                                      idem::errc::kOutcomeUnknown, "may have been applied");
  expect_thrown<idem::StorageUnavailable>(
      sent(REDIS_ERR_EOF, 0, "Server closed the connection", false), idem::errc::kStoreUnavailable,
      "closed");
  expect_thrown<idem::StorageUnavailable>(ctx(REDIS_ERR_IO, EPIPE, "Broken pipe", true),
                                          idem::errc::kStoreUnavailable, "I/O error");
  expect_thrown<idem::StorageError>(ctx(REDIS_ERR_PROTOCOL, 0, "Protocol error"),
                                    idem::errc::kStorageError, "protocol");
  expect_thrown<idem::StorageUnavailable>(
      Failure{K::kPoolExhausted, "claim", "all 1 connections stayed busy"},
      idem::errc::kStoreUnavailable, "exhausted");
  expect_thrown<idem::CorruptRecord>(Failure{K::kCorrupt, "claim", "not an idem record"},
                                     idem::errc::kCorruptRecord, "not an idem record");
  EXPECT_TRUE(idem::redis::detail::server_gone(REDIS_ERR_EOF, 0));
  EXPECT_TRUE(idem::redis::detail::server_gone(REDIS_ERR_IO, ECONNRESET));
  EXPECT_FALSE(idem::redis::detail::server_gone(REDIS_ERR_IO, EAGAIN));
}

}  // namespace

// OwnerToken::generate buffers RAND_bytes per thread (for the Redis hot path): a forked child
// must not hand out the bytes its parent will use.
#include <sys/wait.h>
#include <unistd.h>

#include <set>

namespace {

TEST(OwnerTokenBuffer, ForkedChildNeverRepeatsTheParentsTokens) {
  (void)idem::OwnerToken::generate();  // the buffer is filled now
  int fds[2];
  ASSERT_EQ(0, pipe(fds));
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::string t = idem::OwnerToken::generate().str();
    ssize_t w = write(fds[1], t.data(), t.size());
    _exit(w == static_cast<ssize_t>(t.size()) ? 0 : 1);
  }
  close(fds[1]);
  char buf[64] = {};
  ssize_t n = read(fds[0], buf, sizeof buf);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_EQ(static_cast<ssize_t>(idem::OwnerToken::kLength), n);
  std::string child(buf, static_cast<std::size_t>(n));
  std::set<std::string> parent;
  for (int i = 0; i < 300; ++i) parent.insert(idem::OwnerToken::generate().str());
  EXPECT_EQ(0u, parent.count(child));
  EXPECT_EQ(300u, parent.size());
}

TEST(OwnerTokenBuffer, ThreadsNeverShareTokens) {
  std::vector<std::vector<std::string>> per(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 1000; ++i)
        per[static_cast<std::size_t>(t)].push_back(idem::OwnerToken::generate().str());
    });
  }
  for (auto& th : threads) th.join();
  std::set<std::string> all;
  for (auto& v : per) all.insert(v.begin(), v.end());
  EXPECT_EQ(4000u, all.size());
}

}  // namespace
