// SPDX-License-Identifier: MIT
// PostgreSQL over TLS with sslmode=verify-full (scripts/servers.sh tls: a second PostgreSQL with
// ssl=on, a certificate made at test time, TLS required by pg_hba.conf): the store works on a
// verified TLS connection; an untrusted CA and another host name fail at construction with a
// typed, non-retryable StorageError, a plain connection and a wrong password with a UsageError
// (configuration: retrying cannot help).
#include <gtest/gtest.h>

#include <pqxx/pqxx>
#include <string>

#include "idem/errors.hpp"
#include "idem/guard.hpp"
#include "idem/postgres/postgres_store.hpp"
#include "support/test_env.hpp"

namespace {

using idem::postgres::PostgresStore;
using idem::postgres::PostgresStoreOptions;

class PostgresTls : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(dsn_, "IDEM_TEST_POSTGRES_TLS_DSN");
    IDEM_REQUIRE_ENV(dir_, "IDEM_TEST_TLS_DIR");
    IDEM_REQUIRE_ENV(password_, "IDEM_TEST_POSTGRES_TLS_PASSWORD");
    IDEM_REQUIRE_ENV(port_, "IDEM_PG_TLS_PORT");
    table_ = idem::test::unique_name("idem_tls");
  }
  PostgresStoreOptions options(const std::string& conninfo) const {
    PostgresStoreOptions o;
    o.conninfo = conninfo;
    o.table = table_;
    o.pool_size = 4;
    return o;
  }
  // What the constructor threw (it connects to migrate).
  struct Refusal {
    idem::errc c;
    bool r;
    std::string w;
    idem::errc code() const { return c; }
    bool retryable() const { return r; }
    const char* what() const { return w.c_str(); }
  };
  static Refusal construct_error(const PostgresStoreOptions& o) {
    try {
      PostgresStore store{o};
    } catch (const idem::Error& e) {
      return Refusal{e.code(), e.retryable(), e.what()};
    }
    ADD_FAILURE() << "the store connected: " << o.conninfo;
    return Refusal{static_cast<idem::errc>(0), false, "none"};
  }
  static bool contains(const std::string& s, const std::string& needle) {
    return s.find(needle) != std::string::npos;
  }
  std::string dsn_, dir_, password_, port_, table_;
};

TEST_F(PostgresTls, VerifyFullRunsTheGuardOnATlsConnection) {
  PostgresStore durable{options(dsn_ + " user=postgres")};
  idem::IdempotencyGuard guard{durable};
  auto key = idem::Key::make("tls", idem::test::unique_name("pay"));
  int runs = 0;
  std::string ssl_version;
  for (int i = 0; i < 3; ++i) {
    auto r = guard.run(key, "", [&](pqxx::work& tx) {
      ++runs;
      // The connection the handler's writes go through is encrypted.
      pqxx::row row =
          tx.exec1("SELECT ssl::text, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()");
      EXPECT_EQ("true", row[0].as<std::string>());
      ssl_version = row[1].as<std::string>();
      return std::string("pay_1");
    });
    EXPECT_EQ("pay_1", *r.value);
  }
  EXPECT_EQ(1, runs);
  EXPECT_TRUE(ssl_version == "TLSv1.2" || ssl_version == "TLSv1.3") << ssl_version;
  durable.with_transaction([&](pqxx::work& tx) { tx.exec("DROP TABLE " + table_); });
}

TEST_F(PostgresTls, PasswordRoleOverVerifyFull) {
  PostgresStore durable{options(dsn_ + " user=idem_pw password=" + password_)};
  idem::IdempotencyGuard guard{durable};
  auto r = guard.run(idem::Key::make("tls", idem::test::unique_name("pw")), "", [](pqxx::work& tx) {
    return tx.exec1("SELECT current_user")[0].as<std::string>();
  });
  EXPECT_EQ("idem_pw", *r.value);
  durable.with_transaction([&](pqxx::work& tx) { tx.exec("DROP TABLE " + table_); });
}

TEST_F(PostgresTls, UntrustedCaIsATypedNonRetryableError) {
  auto e = construct_error(options("host=localhost port=" + port_ +
                                   " dbname=idem_test user=postgres sslmode=verify-full "
                                   "sslrootcert=" +
                                   dir_ + "/other-ca.pem"));
  EXPECT_EQ(idem::errc::kStorageError, e.code()) << e.what();
  EXPECT_FALSE(e.retryable());
  EXPECT_TRUE(contains(e.what(), "certificate verify failed")) << e.what();
}

TEST_F(PostgresTls, AnotherHostNameIsATypedNonRetryableError) {
  // Connects to 127.0.0.1 but expects the certificate of wrong.example.
  auto e = construct_error(options("host=wrong.example hostaddr=127.0.0.1 port=" + port_ +
                                   " dbname=idem_test user=postgres sslmode=verify-full "
                                   "sslrootcert=" +
                                   dir_ + "/ca.pem"));
  EXPECT_EQ(idem::errc::kStorageError, e.code()) << e.what();
  EXPECT_TRUE(contains(e.what(), "does not match host name")) << e.what();
}

TEST_F(PostgresTls, PlainConnectionsAreRefusedTyped) {
  auto e = construct_error(
      options("host=127.0.0.1 port=" + port_ + " dbname=idem_test user=postgres sslmode=disable"));
  EXPECT_EQ(idem::errc::kInvalidArgument, e.code()) << e.what();
  EXPECT_TRUE(contains(e.what(), "pg_hba.conf")) << e.what();
}

TEST_F(PostgresTls, WrongPasswordIsATypedNonRetryableError) {
  auto e = construct_error(options(dsn_ + " user=idem_pw password=not-the-password"));
  EXPECT_EQ(idem::errc::kInvalidArgument, e.code()) << e.what();
  EXPECT_FALSE(e.retryable());
  EXPECT_TRUE(contains(e.what(), "password authentication failed")) << e.what();
}

}  // namespace
