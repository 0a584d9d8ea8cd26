// SPDX-License-Identifier: MIT
// rediss:// against redis-server's own TLS port (scripts/servers.sh tls: --port 0, so nothing
// but TLS is served), with a CA and certificates made at test time: the guard over TLS, many
// threads on one key, host-name and CA verification failing typed, client certificates, the
// pool's connections and file descriptors.
#include <dirent.h>
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "idem/errors.hpp"
#include "idem/guard.hpp"
#include "idem/mq/redis_streams.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/test_env.hpp"

namespace {

using idem::redis::RedisStore;
using idem::redis::RedisStoreOptions;

struct TlsEnv {
  std::string url;  // rediss://localhost:<port>
  std::string dir;  // certificates
  std::string port;
  std::string file(const char* name) const { return dir + "/" + name; }
};

class RedisTls : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(env_.url, "IDEM_TEST_REDIS_TLS_URL");
    IDEM_REQUIRE_ENV(env_.dir, "IDEM_TEST_TLS_DIR");
    env_.port = env_.url.substr(env_.url.rfind(':') + 1);
  }
  RedisStoreOptions options(const std::string& uri) const {
    RedisStoreOptions o;
    o.uri = uri;
    o.tls.ca_file = env_.file("ca.pem");
    o.connect_timeout = std::chrono::milliseconds(2000);
    o.reconnect_backoff = std::chrono::milliseconds(0);  // every call tries again
    return o;
  }
  static idem::Key key(const std::string& id) {
    return idem::Key::make("tls", idem::test::unique_name(id));
  }
  // The claim's failure, as the guard's fast store reports it.
  static idem::StorageError claim_error(RedisStore& store) {
    try {
      (void)store.claim(key("fail"), "", idem::OwnerToken::generate(), std::chrono::seconds(5));
    } catch (const idem::StorageError& e) {
      return e;
    }
    ADD_FAILURE() << "the claim succeeded";
    return idem::StorageError("none");
  }
  TlsEnv env_;
};

std::size_t open_fds() {
  std::size_t n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n;
}

bool contains(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

TEST_F(RedisTls, GuardRunsOnceAndReplaysOverVerifiedTls) {
  RedisStore fast{options(env_.url)};
  idem::sqlite::SqliteStore durable{":memory:"};
  idem::IdempotencyGuard guard{fast, durable};
  auto k = key("once");
  int runs = 0;
  auto first = guard.run(k, idem::fingerprint("body"), [&](idem::sqlite::Transaction&) {
    ++runs;
    return std::string("pay_1");
  });
  auto again = guard.run(k, idem::fingerprint("body"), [&](idem::sqlite::Transaction&) {
    ++runs;
    return std::string("other");
  });
  EXPECT_EQ(idem::Outcome::kExecuted, first.outcome);
  EXPECT_EQ(idem::Outcome::kReplayed, again.outcome);
  EXPECT_EQ("pay_1", *again.value);
  EXPECT_EQ(1, runs);
  EXPECT_FALSE(first.degraded);
  EXPECT_FALSE(again.degraded);  // answered by Redis over TLS, not by the durable store
  auto record = fast.lookup(k);
  ASSERT_TRUE(record.has_value());
  EXPECT_EQ("pay_1", record->response);
  EXPECT_EQ("redis", fast.name());
}

TEST_F(RedisTls, ManyThreadsOneKeyOneEffectEveryCallerAnswered) {
  RedisStoreOptions o = options(env_.url);
  o.pool_size = 8;
  o.pool_wait_timeout = std::chrono::milliseconds(2000);
  RedisStore fast{o};
  idem::IdempotencyGuard guard{fast};
  auto k = key("storm");
  constexpr int kThreads = 32;
  std::atomic<int> effects{0}, executed{0}, replayed{0}, in_progress{0}, errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      try {
        auto r = guard.run(k, "", [&] {
          effects.fetch_add(1);
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          return std::string("done");
        });
        if (r.outcome == idem::Outcome::kExecuted) executed.fetch_add(1);
        if (r.outcome == idem::Outcome::kReplayed) replayed.fetch_add(1);
        if (r.outcome == idem::Outcome::kInProgress) in_progress.fetch_add(1);
      } catch (const idem::Error&) {
        errors.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(1, effects.load());
  EXPECT_EQ(1, executed.load());
  EXPECT_EQ(0, errors.load());
  EXPECT_EQ(kThreads, executed.load() + replayed.load() + in_progress.load());
  auto stats = fast.pool_stats();
  EXPECT_LE(stats.connects, 8u);  // one TLS session per pooled connection, reused
  EXPECT_GE(stats.connects, 1u);
  EXPECT_EQ(0u, stats.dropped);
  // Afterwards every caller sees the one response.
  auto r = guard.run(k, "", [] { return std::string("never"); });
  EXPECT_EQ("done", *r.value);
}

TEST_F(RedisTls, AnAddressIsCheckedAgainstTheCertificatesIpEntry) {
  RedisStore fast{options("rediss://127.0.0.1:" + env_.port)};
  auto k = key("ip");
  auto c = fast.claim(k, "", idem::OwnerToken::generate(), std::chrono::seconds(5));
  EXPECT_EQ(idem::ClaimStatus::kClaimed, c.status);
}

TEST_F(RedisTls, WrongHostNameFailsTypedAndIsNotRetryable) {
  RedisStoreOptions o = options(env_.url);
  o.tls.server_name = "wrong.example";  // the certificate names localhost and 127.0.0.1
  RedisStore fast{o};
  idem::StorageError e = claim_error(fast);
  EXPECT_EQ(idem::errc::kStorageError, e.code());
  EXPECT_FALSE(e.retryable());
  EXPECT_TRUE(contains(e.what(), "certificate verification failed")) << e.what();
  EXPECT_TRUE(contains(e.what(), "hostname mismatch")) << e.what();
  EXPECT_TRUE(contains(e.what(), "wrong.example")) << e.what();
  // Every later call fails the same way (the pool does not report an outage instead).
  idem::StorageError again = claim_error(fast);
  EXPECT_EQ(idem::errc::kStorageError, again.code());
  EXPECT_EQ(0u, fast.pool_stats().connects);
  EXPECT_GE(fast.pool_stats().connect_failures, 2u);
}

TEST_F(RedisTls, UntrustedCaFailsTyped) {
  RedisStoreOptions o = options(env_.url);
  o.tls.ca_file = env_.file("other-ca.pem");  // a CA that did not sign the server's certificate
  RedisStore fast{o};
  idem::StorageError e = claim_error(fast);
  EXPECT_EQ(idem::errc::kStorageError, e.code());
  EXPECT_TRUE(contains(e.what(), "certificate verification failed")) << e.what();
  EXPECT_TRUE(contains(e.what(), "other-ca.pem")) << e.what();
  // Without ca_file the system's CAs are used: they do not know the test CA either.
  o.tls.ca_file.clear();
  RedisStore system{o};
  idem::StorageError s = claim_error(system);
  EXPECT_EQ(idem::errc::kStorageError, s.code());
  EXPECT_TRUE(contains(s.what(), "certificate verification failed")) << s.what();
  EXPECT_TRUE(contains(s.what(), "the system's")) << s.what();
}

TEST_F(RedisTls, GuardGoesOnDegradedWhenTheFastStoreCertificateIsRefused) {
  RedisStoreOptions o = options(env_.url);
  o.tls.server_name = "wrong.example";
  RedisStore fast{o};
  idem::sqlite::SqliteStore durable{":memory:"};
  idem::IdempotencyGuard guard{fast, durable};
  auto k = key("degraded");
  int runs = 0;
  for (int i = 0; i < 3; ++i) {
    auto r = guard.run(k, "", [&](idem::sqlite::Transaction&) {
      ++runs;
      return std::string("x");
    });
    EXPECT_TRUE(r.ok());
    EXPECT_TRUE(r.degraded);
  }
  EXPECT_EQ(1, runs);  // the durable store still decides
}

TEST_F(RedisTls, ClientCertificates) {
  // A certificate of the trusted CA is accepted (the server verifies what clients send).
  RedisStoreOptions o = options(env_.url);
  o.tls.cert_file = env_.file("client.pem");
  o.tls.key_file = env_.file("client-key.pem");
  RedisStore good{o};
  EXPECT_EQ(
      idem::ClaimStatus::kClaimed,
      good.claim(key("cert"), "", idem::OwnerToken::generate(), std::chrono::seconds(5)).status);
  // One the server does not trust: refused by the server, reported at connect, typed.
  o.tls.cert_file = env_.file("other-client.pem");
  o.tls.key_file = env_.file("other-client-key.pem");
  RedisStore refused{o};
  idem::StorageError e = claim_error(refused);
  EXPECT_EQ(idem::errc::kStorageError, e.code());
  EXPECT_TRUE(contains(e.what(), "TLS")) << e.what();
}

TEST_F(RedisTls, BadTlsOptionsAreUsageErrorsAtConstruction) {
  RedisStoreOptions o = options(env_.url);
  o.tls.ca_file = env_.file("no-such-file.pem");
  EXPECT_THROW(RedisStore{o}, idem::UsageError);
  o = options(env_.url);
  o.tls.cert_file = env_.file("client.pem");  // no key
  EXPECT_THROW(RedisStore{o}, idem::UsageError);
  o.tls.key_file = env_.file("other-client-key.pem");  // not the certificate's key
  EXPECT_THROW(RedisStore{o}, idem::UsageError);
  // TLS options with a URI that is not rediss:// would silently not be used.
  o = options("redis://127.0.0.1:" + env_.port);
  try {
    RedisStore plain{o};
    FAIL() << "redis:// with tls options constructed";
  } catch (const idem::UsageError& e) {
    EXPECT_TRUE(contains(e.what(), "not rediss://")) << e.what();
  }
  o = options("redis-sentinel://127.0.0.1:1/master");
  EXPECT_THROW(RedisStore{o}, idem::UsageError);
}

// A plain server reads the ClientHello as the start of a command and never answers it: the
// handshake ends with connect_timeout, a typed StorageTimeout that says what to check.
TEST_F(RedisTls, PlainServerOnARedissUriFailsTyped) {
  std::string plain;
  IDEM_REQUIRE_ENV(plain, "IDEM_TEST_REDIS_URL");
  RedisStoreOptions o = options("rediss://localhost:" + plain.substr(plain.rfind(':') + 1));
  o.connect_timeout = std::chrono::milliseconds(300);
  RedisStore fast{o};
  idem::StorageError e = claim_error(fast);
  EXPECT_EQ(idem::errc::kStoreTimeout, e.code()) << e.what();
  EXPECT_TRUE(contains(e.what(), "does the server speak TLS on this port?")) << e.what();
}

TEST_F(RedisTls, RedisStreamsOverTls) {
  idem::mq::RedisStreamsOptions o;
  o.uri = env_.url;
  o.tls.ca_file = env_.file("ca.pem");
  idem::mq::RedisStreams streams{o};
  const std::string stream = idem::test::unique_name("tls_stream");
  ASSERT_TRUE(streams.create_group(stream, "g"));
  auto id = streams.add(stream, {{"order", "o1"}});
  auto batch = streams.read_group(stream, "g", "c1", 10, std::nullopt);
  ASSERT_EQ(1u, batch.size());
  EXPECT_EQ(id, batch[0].id);
  EXPECT_EQ(1u, streams.ack(stream, "g", {id}));
  EXPECT_EQ(1u, streams.del(stream));
  idem::mq::RedisStreamsOptions untrusted = o;
  untrusted.tls.ca_file = env_.file("other-ca.pem");
  idem::mq::RedisStreams bad{untrusted};
  try {
    bad.ping();
    FAIL() << "ping over an untrusted certificate";
  } catch (const idem::StorageError& e) {
    EXPECT_EQ(idem::errc::kStorageError, e.code());
  }
}

TEST_F(RedisTls, LargeValuesCrossTheRelayIntact) {
  RedisStore fast{options(env_.url)};
  idem::IdempotencyGuard guard{fast};
  std::string big(3 * 1024 * 1024 + 17, '\0');  // several TLS records and relay chunks
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 % 251);
  auto k = key("big");
  auto first = guard.run(k, "", [&] { return big; });
  auto again = guard.run(k, "", [&] { return std::string(); });
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(idem::Outcome::kReplayed, again.outcome);
  EXPECT_TRUE(*again.value == big);
  (void)first;
}

TEST_F(RedisTls, ClosingTheStoreClosesEveryConnection) {
  // Warm up whatever the process opens once (OpenSSL's configuration, the CA file).
  {
    RedisStore warm{options(env_.url)};
    (void)warm.lookup(key("warm"));
  }
  const std::size_t before = open_fds();
  {
    RedisStoreOptions o = options(env_.url);
    o.pool_size = 4;
    RedisStore fast{o};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        for (int i = 0; i < 20; ++i) (void)fast.lookup(key("fd"));
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_GT(open_fds(), before);  // TCP sockets, socketpairs and the relay's eventfd
  }
  EXPECT_EQ(before, open_fds());
}

}  // namespace
