// SPDX-License-Identifier: MIT
// libpq's asynchronous API on the loop, pipeline mode, against the real PostgreSQL
// (IDEM_TEST_POSTGRES_DSN), and sockets that refuse or never accept.
#include "async/pg_connection.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "async_support.hpp"
#include "support/test_env.hpp"

namespace {

using idem::async::detail::PgCallback;
using idem::async::detail::PgConnection;
using idem::async::detail::PgFailure;
using idem::async::detail::PgParam;
using idem::async::detail::PgResult;
using idem::async::detail::PgSettings;
using idem::async::detail::PgStatement;
using namespace std::chrono_literals;

struct Answer {
  bool done = false;
  std::vector<PgResult> results;
  std::optional<PgFailure> failure;
};

PgCallback record(Answer& a) {
  return [&a](std::vector<PgResult>& results, const PgFailure* f) {
    a.done = true;
    if (f != nullptr) a.failure = *f;
    a.results = std::move(results);
  };
}

PgStatement sql(std::string_view text, std::vector<PgParam> params = {}) {
  return PgStatement{text, false, std::move(params)};
}

std::string text_at(const PgResult& r, int row = 0, int col = 0) {
  return std::string(PQgetvalue(r.get(), row, col),
                     static_cast<std::size_t>(PQgetlength(r.get(), row, col)));
}

class PgConnectionTest : public ::testing::Test {
 protected:
  void SetUp() override { IDEM_REQUIRE_ENV(dsn_, "IDEM_TEST_POSTGRES_DSN"); }
  PgSettings settings() const {
    PgSettings s;
    s.conninfo = dsn_;
    s.connect_timeout = 2s;
    s.batch_timeout = 5s;
    return s;
  }
  std::string dsn_;
  idem::async::net::io_context io_;
};

TEST_F(PgConnectionTest, ManyBatchesInFlightOnOneConnectionAreAnsweredInOrder) {
  PgConnection conn(io_.get_executor(), settings());
  constexpr int kBatches = 2000;
  std::vector<std::string> values(kBatches);
  std::vector<Answer> answers(kBatches);
  for (int i = 0; i < kBatches; ++i) {
    values[i] = std::to_string(i);
    conn.run({sql("SELECT $1::text || '!'", {PgParam{values[i]}})}, record(answers[i]));
  }
  ASSERT_TRUE(idem::test::run_until(
      io_, [&] { return answers.back().done; }, 30s));
  for (int i = 0; i < kBatches; ++i) {
    ASSERT_TRUE(answers[i].done);
    ASSERT_FALSE(answers[i].failure) << answers[i].failure->message;
    ASSERT_EQ(1u, answers[i].results.size());
    ASSERT_EQ(PGRES_TUPLES_OK, PQresultStatus(answers[i].results[0].get()));
    ASSERT_EQ(values[i] + "!", text_at(answers[i].results[0]));
  }
  EXPECT_EQ(1u, conn.connects());
  EXPECT_EQ(0u, conn.in_flight());
}

TEST_F(PgConnectionTest, SessionSettingsAndPreparedStatementsComeFirst) {
  PgSettings s = settings();
  s.session = {"SET lock_timeout = '1234ms'"};
  s.prepared = {{"idem_test_echo", "SELECT $1::text"}};
  PgConnection conn(io_.get_executor(), s);
  Answer a;
  conn.run({sql("SHOW lock_timeout"), PgStatement{"idem_test_echo", true, {PgParam{"hi"}}}},
           record(a));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return a.done; }));
  ASSERT_FALSE(a.failure) << a.failure->message;
  ASSERT_EQ(2u, a.results.size());
  EXPECT_EQ("1234ms", text_at(a.results[0]));
  EXPECT_EQ("hi", text_at(a.results[1]));
}

TEST_F(PgConnectionTest, AFailedStatementAbortsOnlyTheRestOfItsBatch) {
  PgConnection conn(io_.get_executor(), settings());
  Answer bad, good;
  conn.run({sql("SELECT 1"), sql("SELECT 1/0"), sql("SELECT 2")}, record(bad));
  conn.run({sql("SELECT text '3'")}, record(good));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return good.done; }));
  ASSERT_FALSE(bad.failure);
  ASSERT_EQ(3u, bad.results.size());
  EXPECT_EQ(PGRES_TUPLES_OK, PQresultStatus(bad.results[0].get()));
  EXPECT_EQ(PGRES_FATAL_ERROR, PQresultStatus(bad.results[1].get()));
  EXPECT_STREQ("22012", PQresultErrorField(bad.results[1].get(), PG_DIAG_SQLSTATE));
  EXPECT_EQ(PGRES_PIPELINE_ABORTED, PQresultStatus(bad.results[2].get()));
  ASSERT_FALSE(good.failure);
  EXPECT_EQ("3", text_at(good.results[0]));
}

TEST_F(PgConnectionTest, BinaryParametersAndResultsAreByteExact) {
  PgConnection conn(io_.get_executor(), settings());
  std::string bytes;
  for (int i = 0; i < 256; ++i) bytes.push_back(static_cast<char>(i));
  bytes += std::string(100000, '\0');
  Answer a;
  conn.run({sql("SELECT $1::bytea", {PgParam{bytes, false, true}})}, record(a));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return a.done; }));
  ASSERT_FALSE(a.failure) << a.failure->message;
  EXPECT_TRUE(bytes == text_at(a.results[0]));  // binary result format: the raw bytes
}

TEST_F(PgConnectionTest, ABatchPastItsDeadlineClosesTheConnectionThenItReconnects) {
  PgSettings s = settings();
  s.batch_timeout = 200ms;
  PgConnection conn(io_.get_executor(), s);
  Answer slow, behind;
  const auto t0 = std::chrono::steady_clock::now();
  conn.run({sql("SELECT pg_sleep(3)")}, record(slow));
  conn.run({sql("SELECT 1")}, record(behind));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return slow.done && behind.done; }));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  ASSERT_TRUE(slow.failure);
  EXPECT_TRUE(slow.failure->timed_out);
  EXPECT_TRUE(slow.failure->sent);
  ASSERT_TRUE(behind.failure);  // behind it on the same connection
  Answer again;
  conn.run({sql("SELECT text '7'")}, record(again));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return again.done; }));
  ASSERT_FALSE(again.failure) << again.failure->message;
  EXPECT_EQ("7", text_at(again.results[0]));
  EXPECT_EQ(2u, conn.connects());
}

TEST_F(PgConnectionTest, ATerminatedBackendFailsItsBatchAndTheNextOneReconnects) {
  PgConnection victim(io_.get_executor(), settings());
  PgConnection killer(io_.get_executor(), settings());
  Answer pid;
  victim.run({sql("SELECT pg_backend_pid()::text")}, record(pid));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return pid.done; }));
  ASSERT_FALSE(pid.failure);
  const std::string backend = text_at(pid.results[0]);
  Answer sleeping, kill;
  victim.run({sql("SELECT pg_sleep(5)")}, record(sleeping));
  killer.run({sql("SELECT pg_sleep(0.2)"),
              sql("SELECT pg_terminate_backend($1::int)", {PgParam{backend}})},
             record(kill));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return sleeping.done && kill.done; }));
  ASSERT_TRUE(sleeping.failure) << "the terminated backend's batch must fail";
  EXPECT_FALSE(sleeping.failure->timed_out);
  Answer again;
  victim.run({sql("SELECT 1")}, record(again));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return again.done; }));
  EXPECT_FALSE(again.failure) << again.failure->message;
  EXPECT_EQ(2u, victim.connects());
}

TEST_F(PgConnectionTest, ARefusedConnectFailsAndFailsFastDuringTheBackoff) {
  PgSettings s = settings();
  s.conninfo = "host=127.0.0.1 port=" + std::to_string(idem::test::closed_port()) +
               " user=postgres dbname=idem_test";
  s.reconnect_backoff = 500ms;
  PgConnection conn(io_.get_executor(), s);
  Answer first, second;
  conn.run({sql("SELECT 1")}, record(first));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return first.done; }));
  ASSERT_TRUE(first.failure);
  EXPECT_FALSE(first.failure->sent);
  conn.run({sql("SELECT 1")}, record(second));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return second.done; }));
  ASSERT_TRUE(second.failure);
  EXPECT_NE(std::string::npos, second.failure->message.find("moments ago"))
      << second.failure->message;
}

TEST_F(PgConnectionTest, AConnectThatNeverCompletesTimesOut) {
  idem::test::UnacceptingServer full;
  PgSettings s = settings();
  s.conninfo =
      "host=127.0.0.1 port=" + std::to_string(full.port()) + " user=postgres dbname=idem_test";
  s.connect_timeout = 300ms;
  PgConnection conn(io_.get_executor(), s);
  Answer a;
  conn.run({sql("INSERT INTO nowhere VALUES (1)")}, record(a));
  ASSERT_TRUE(idem::test::run_until(io_, [&] { return a.done; }));
  ASSERT_TRUE(a.failure);
  EXPECT_TRUE(a.failure->timed_out);
  EXPECT_FALSE(a.failure->sent);
}

}  // namespace
