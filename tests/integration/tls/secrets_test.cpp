// SPDX-License-Identifier: MIT
// Passwords never appear in what idem says: exception messages, log lines (LoggingObserver),
// metrics (PrometheusObserver's exposition, labels included) and idemctl's output. Every
// scenario puts a fresh secret in a Redis URI, a Redis TLS URI, a libpq conninfo string or a
// PostgreSQL URI, makes idem fail (wrong password, unreachable server, malformed URI, untrusted
// certificate) and succeed (the right password), and scans all of it for the secret.
#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <pqxx/pqxx>
#include <random>
#include <string>
#include <vector>

#include "idem/errors.hpp"
#include "idem/guard.hpp"
#include "idem/log.hpp"
#include "idem/mq/redis_streams.hpp"
#include "idem/postgres/postgres_store.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "raw_redis.hpp"
#include "support/test_env.hpp"
#ifdef IDEM_SECRETS_WITH_PROMETHEUS
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "idem/prometheus/prometheus_observer.hpp"
#endif
#ifdef IDEMCTL_PATH
#include "idemctl_test_support.hpp"
#endif

namespace {

std::string fresh_secret() {
  std::random_device rd;
  std::string s = "Sx";
  for (int i = 0; i < 20; ++i) s += "0123456789abcdef"[rd() % 16];
  return s;
}

// Everything idem said during a test, scanned at the end.
class Said {
 public:
  void add(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex_);
    text_ += what;
    text_ += '\n';
  }
  idem::LogSink sink() {
    return [this](idem::LogLevel, std::string_view line) { add(std::string(line)); };
  }
  // Runs fn; whatever idem::Error or std::exception it throws is recorded. true: it threw.
  template <class Fn>
  bool error_of(Fn&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      add(e.what());
      return true;
    }
    return false;
  }
  void expect_clean(const std::vector<std::string>& secrets) const {
    ASSERT_FALSE(text_.empty());
    for (const auto& s : secrets) {
      EXPECT_EQ(std::string::npos, text_.find(s)) << "a password appears in:\n" << text_;
    }
  }
  const std::string& text() const { return text_; }

 private:
  std::mutex mutex_;
  std::string text_;
};

class Secrets : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(redis_url_, "IDEM_TEST_REDIS_URL");
    IDEM_REQUIRE_ENV(tls_url_, "IDEM_TEST_REDIS_TLS_URL");
    IDEM_REQUIRE_ENV(tls_dir_, "IDEM_TEST_TLS_DIR");
    IDEM_REQUIRE_ENV(pg_dsn_, "IDEM_TEST_POSTGRES_TLS_DSN");
    IDEM_REQUIRE_ENV(pg_password_, "IDEM_TEST_POSTGRES_TLS_PASSWORD");
    IDEM_REQUIRE_ENV(pg_port_, "IDEM_PG_TLS_PORT");
    host_port_ = redis_url_.substr(redis_url_.find("://") + 3);
    user_ = idem::test::unique_name("idem_secret");
    secret_ = fresh_secret();
    wrong_ = fresh_secret();
    // A Redis ACL user whose password is the secret (removed in TearDown).
    idem::test::RawRedis admin(redis_url_);
    EXPECT_EQ("OK",
              admin.text({"ACL", "SETUSER", user_, "on", ">" + secret_, "~*", "&*", "+@all"}));
  }
  void TearDown() override {
    if (user_.empty() || redis_url_.empty()) return;
    idem::test::RawRedis admin(redis_url_);
    (void)admin.integer({"ACL", "DELUSER", user_});
  }
  std::string redis_uri(const std::string& password, const std::string& where) const {
    return "redis://" + user_ + ":" + password + "@" + where;
  }
  std::vector<std::string> secrets() const { return {secret_, wrong_, pg_password_}; }

  std::string redis_url_, tls_url_, tls_dir_, pg_dsn_, pg_password_, pg_port_, host_port_;
  std::string user_, secret_, wrong_;
};

TEST_F(Secrets, RedisErrorsAndLogsNeverShowThePassword) {
  Said said;
  // The right password works (so the secret really is one).
  idem::redis::RedisStore good{redis_uri(secret_, host_port_)};
  EXPECT_EQ(idem::ClaimStatus::kClaimed,
            good.claim(idem::Key::make("s", idem::test::unique_name("k")), "",
                       idem::OwnerToken::generate(), std::chrono::seconds(5))
                .status);
  // Wrong password, unreachable server, malformed URIs, TLS refused.
  for (const std::string& uri :
       {redis_uri(wrong_, host_port_), redis_uri(secret_, "127.0.0.1:1"),
        redis_uri(secret_, "127.0.0.1:notaport"), redis_uri(secret_, ""),
        "redis://:" + secret_ + "@127.0.0.1:1/notadb", "redis://" + secret_ + "@127.0.0.1",
        "rediss://" + user_ + ":" + secret_ + "@" + tls_url_.substr(tls_url_.find("://") + 3),
        "redis-sentinel://" + user_ + ":" + secret_ + "@127.0.0.1:1/master",
        "redis-cluster://" + user_ + ":" + secret_ + "@127.0.0.1:1",
        "unix://" + user_ + ":" + secret_ + "@/nonexistent.sock",
        // No '@' (forgotten host): the password reads as a port, or a raw '/' in it as a db.
        "redis://" + user_ + ":" + secret_, "redis://" + user_ + ":pw/" + secret_,
        "redis-sentinel://:" + secret_, "redis-cluster://:" + secret_,
        "redis-cluster://127.0.0.1:1,:" + secret_}) {
    bool threw = said.error_of([&] {
      idem::redis::RedisStoreOptions o;
      o.uri = uri;
      o.connect_timeout = std::chrono::milliseconds(300);
      idem::redis::RedisStore store{o};
      (void)store.claim(idem::Key::make("s", "k"), "", idem::OwnerToken::generate(),
                        std::chrono::seconds(5));
    });
    EXPECT_TRUE(threw) << uri;
    said.error_of([&] {
      idem::mq::RedisStreamsOptions o;
      o.uri = uri;
      o.connect_timeout = std::chrono::milliseconds(300);
      idem::mq::RedisStreams streams{o};
      streams.ping();
    });
  }
  // The guard's log lines of a fast store refusing the password (it runs degraded).
  auto logger = std::make_shared<idem::LoggingObserver>(
      said.sink(), idem::LoggingObserverOptions{idem::LogLevel::kDebug});
  idem::redis::RedisStore refused{redis_uri(wrong_, host_port_)};
  idem::sqlite::SqliteStore durable{":memory:"};
  idem::GuardOptions go;
  go.observer = logger;
  idem::IdempotencyGuard guard{refused, durable, go};
  for (int i = 0; i < 3; ++i) {
    auto r = guard.run(idem::Key::make("s", "degraded"), "",
                       [](idem::sqlite::Transaction&) { return std::string("x"); });
    EXPECT_TRUE(r.degraded);
  }
  EXPECT_NE(std::string::npos, said.text().find("authentication failed")) << said.text();
  EXPECT_NE(std::string::npos, said.text().find("idem fast store down")) << said.text();
  said.expect_clean(secrets());
}

TEST_F(Secrets, PostgresErrorsAndLogsNeverShowThePassword) {
  Said said;
  const std::string uri_base = "postgresql://idem_pw:";
  const std::string uri_rest = "@localhost:" + pg_port_ +
                               "/idem_test?sslmode=verify-full&sslrootcert=" + tls_dir_ + "/ca.pem";
  const std::string table = idem::test::unique_name("idem_secret");
  auto opts = [&](const std::string& conninfo) {
    idem::postgres::PostgresStoreOptions o;
    o.conninfo = conninfo;
    o.table = table;
    o.pool_size = 2;
    return o;
  };
  // The right password works, in both forms.
  for (const std::string& ok :
       {pg_dsn_ + " user=idem_pw password=" + pg_password_, uri_base + pg_password_ + uri_rest}) {
    auto logger = std::make_shared<idem::LoggingObserver>(
        said.sink(), idem::LoggingObserverOptions{idem::LogLevel::kDebug});
    idem::postgres::PostgresStore durable{opts(ok)};
    idem::GuardOptions go;
    go.observer = logger;
    idem::IdempotencyGuard guard{durable, go};
    auto key = idem::Key::make("s", idem::test::unique_name("pg"));
    for (int i = 0; i < 2; ++i) {
      auto r = guard.run(key, "", [](pqxx::work&) { return std::string("x"); });
      EXPECT_TRUE(r.ok());
    }
  }
  // Wrong passwords, unreachable servers, malformed strings: constructor errors.
  for (const std::string& bad :
       {pg_dsn_ + " user=idem_pw password=" + wrong_, uri_base + wrong_ + uri_rest,
        "host=127.0.0.1 port=1 dbname=idem_test user=idem_pw password=" + secret_ +
            " connect_timeout=2",
        "postgresql://idem_pw:" + secret_ + "@127.0.0.1:1/idem_test?connect_timeout=2",
        "host=127.0.0.1 password=" + secret_ + " port=notaport",
        "password='" + secret_ + "' nosuchoption=1", "postgresql://idem_pw:" + secret_ + "@[bad",
        // A malformed URI's password holding '#', '?', '/' or a blank (libpq quotes the URI
        // whole): masked all the same. (libpq takes a raw '@' as the end of the userinfo.)
        "postgresql://idem_pw:x#" + secret_ + "@[bad",
        "postgresql://idem_pw:a b?" + secret_ + "@[bad",
        "postgresql://idem_pw:p/" + secret_ + "@[bad",
        // Messages that quote only a token of the string: a raw '%' (an invalid
        // percent-encoding), %00, a raw '/' read as the end of the host, a blank in a
        // conninfo password, a bad percent-encoding in a URI query.
        "postgresql://idem_pw:Pa%ss-" + secret_ + "@127.0.0.1:1/idem_test",
        "postgresql://idem_pw:%00" + secret_ + "@127.0.0.1:1/idem_test",
        "postgresql://idem_pw:" + secret_ + "/x@127.0.0.1:1/idem_test",
        "host=127.0.0.1 port=1 password=my " + secret_ + " dbname=idem_test",
        "postgresql://idem_pw@127.0.0.1:1/idem_test?password=%zz" + secret_,
        // A raw '@' in the password: libpq would make its rest the host name.
        "postgresql://idem_pw:x@" + secret_ + "@127.0.0.1:1/idem_test"}) {
    EXPECT_TRUE(said.error_of([&] { idem::postgres::PostgresStore store{opts(bad)}; })) << bad;
  }
  {
    idem::postgres::PostgresStore durable{opts(pg_dsn_ + " user=postgres")};
    durable.with_transaction([&](pqxx::work& tx) { tx.exec("DROP TABLE " + table); });
  }
  said.expect_clean(secrets());
}

#ifdef IDEM_SECRETS_WITH_PROMETHEUS
TEST_F(Secrets, MetricsNeverShowThePassword) {
  prometheus::Registry registry;
  idem::PrometheusObserverOptions po;
  po.const_labels = {{"service", "secrets"}};
  auto metrics = std::make_shared<idem::PrometheusObserver>(registry, po);
  idem::GuardOptions go;
  go.observer = metrics;
  // A fast store refusing the password, and one that works, in front of PostgreSQL with one.
  idem::redis::RedisStore refused{redis_uri(wrong_, host_port_)};
  idem::redis::RedisStore good{redis_uri(secret_, host_port_)};
  idem::postgres::PostgresStoreOptions o;
  o.conninfo = pg_dsn_ + " user=idem_pw password=" + pg_password_;
  o.table = idem::test::unique_name("idem_secret");
  idem::postgres::PostgresStore durable{o};
  idem::IdempotencyGuard degraded{refused, durable, go};
  idem::IdempotencyGuard normal{good, durable, go};
  for (int i = 0; i < 3; ++i) {
    auto key = idem::Key::make("s", "m" + std::to_string(i % 2));
    (void)degraded.run(key, "", [](pqxx::work&) { return std::string("x"); });
    (void)normal.run(key, "", [](pqxx::work&) { return std::string("x"); });
  }
  Said said;
  said.add(prometheus::TextSerializer().Serialize(registry.Collect()));
  EXPECT_NE(std::string::npos, said.text().find("idem_fast_store_outages_total")) << said.text();
  said.expect_clean(secrets());
  durable.with_transaction([&](pqxx::work& tx) { tx.exec("DROP TABLE " + o.table); });
}
#endif

#ifdef IDEMCTL_PATH
TEST_F(Secrets, IdemctlOutputNeverShowsThePassword) {
  using idemctl_test::quote;
  Said said;
  // Prepare a record table idemctl can read (idemctl never creates one).
  idem::postgres::PostgresStoreOptions o;
  o.conninfo = pg_dsn_ + " user=postgres";
  o.table = idem::test::unique_name("idem_secret");
  {
    idem::postgres::PostgresStore durable{o};
    idem::IdempotencyGuard guard{durable};
    (void)guard.run(idem::Key::make("s", "ctl"), "", [](pqxx::work&) { return std::string("x"); });
  }
  const std::string table = " --table " + o.table;
  const std::string good_dsn = pg_dsn_ + " user=idem_pw password=" + pg_password_;
  const std::string good_uri = "postgresql://idem_pw:" + pg_password_ + "@localhost:" + pg_port_ +
                               "/idem_test?sslmode=verify-full&sslrootcert=" + tls_dir_ + "/ca.pem";
  struct Case {
    std::string args;
    int status;
  };
  const std::vector<Case> cases = {
      {"--db " + quote(good_dsn) + table + " --fast " + quote(redis_uri(secret_, host_port_)) +
           " show s ctl",
       0},
      {"--db " + quote(good_uri) + table + " stats", 0},
      {"--db " + quote(pg_dsn_ + " user=idem_pw password=" + wrong_) + table + " stats", 3},
      {"--db " + quote(good_dsn) + table + " --fast " + quote(redis_uri(wrong_, host_port_)) +
           " show s ctl",
       -1},
      {"--db " + quote(good_dsn) + table + " --fast " + quote(redis_uri(secret_, "127.0.0.1:1")) +
           " show s ctl",
       -1},
      {"--db " + quote("postgresql://idem_pw:" + secret_ + "@127.0.0.1:1/x") + " stats", 3},
      // A raw '@' in the password: the URI parsers split at the last '@', and so does the mask.
      {"--db " + quote(good_dsn) + table + " --fast " +
           quote(redis_uri("Top@" + secret_, "127.0.0.1:1")) + " show s ctl",
       -1},
      // Refused fast-store URLs without '@' (a forgotten host, an unknown scheme).
      {"--db " + quote(good_dsn) + table + " --fast " + quote("redis://u:" + secret_) +
           " show s ctl",
       -1},
      {"--db " + quote(good_dsn) + table + " --fast " + quote("redis-cluster://:" + secret_) +
           " show s ctl",
       -1},
      // The per-key commands name the stores they read in every message.
      {"--db " + quote(good_dsn) + table + " --fast " + quote(redis_uri(secret_, host_port_)) +
           " response s ctl",
       0},
      {"--db " + quote(good_dsn) + table + " --fast " + quote(redis_uri(secret_, host_port_)) +
           " response s absent",
       1},
      {"--db " + quote(good_dsn) + table + " --fast " + quote(redis_uri(secret_, host_port_)) +
           " release s ctl --owner x --yes",
       4},
      {"--db " + quote(good_uri) + table + " release s absent --owner x", 1},
      {"--db " + quote(good_dsn) + table + " --fast " + quote(redis_uri(secret_, host_port_)) +
           " duplicates s ctl",
       0},
      {"--db " + quote(good_uri) + table + " duplicates --top 5", 0},
      {"--db " + quote("postgresql://idem_pw:" + secret_ + "@127.0.0.1:1/x") + " response s ctl",
       3},
      // Every form libpq reads a password in: quoted, blanks around '=', after sslpassword.
      {"--db " + quote(pg_dsn_ + " user=idem_pw password='" + pg_password_ + "'") + table +
           " stats",
       0},
      {"--db " + quote(pg_dsn_ + " user=idem_pw password = " + pg_password_) + table + " stats", 0},
      {"--db " +
           quote(pg_dsn_ + " user=idem_pw sslpassword=" + secret_ + " password=" + pg_password_) +
           table + " stats",
       0},
      {"--db " + quote(pg_dsn_ + " user=idem_pw password='" + wrong_ + " " + secret_ + "'") +
           table + " stats",
       3},
  };
  for (const auto& c : cases) {
    auto r = idemctl_test::idemctl(c.args);
    if (c.status >= 0) {
      EXPECT_EQ(c.status, r.status) << c.args << "\n" << r.out;
    }
    said.add(r.out);
  }
  EXPECT_NE(std::string::npos, said.text().find("***")) << said.text();  // masked, not dropped
  said.expect_clean(secrets());
  idem::postgres::PostgresStore durable{o};
  durable.with_transaction([&](pqxx::work& tx) { tx.exec("DROP TABLE " + o.table); });
}
#endif

}  // namespace
