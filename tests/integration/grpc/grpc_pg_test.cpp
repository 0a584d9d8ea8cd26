// SPDX-License-Identifier: MIT
// idem::grpc on PostgreSQL (real server, a schema of this process) with Redis (real server) in
// front: hedged traffic, a COMMIT whose answer is lost, PostgreSQL and Redis unreachable.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "grpc_test_support.hpp"
#include "idem/redis/redis_store.hpp"
#include "payment_pg.hpp"
#include "pg_test_support.hpp"
#include "tcp_proxy.hpp"

namespace {

using namespace idem::test::grpc_support;
namespace pg = idem::test::pg;
using grpc_payment::PostgresLedger;
using PgGuard = idem::IdempotencyGuard<idem::postgres::PostgresStore>;

class GrpcPostgres : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(dsn_, "IDEM_TEST_POSTGRES_DSN");
    IDEM_REQUIRE_ENV(redis_, "IDEM_TEST_REDIS_URL");
    schema_ = idem::test::unique_name("idem_grpc");
  }
  void TearDown() override {
    if (!schema_.empty() && !dsn_.empty())
      pg::exec("DROP SCHEMA IF EXISTS " + schema_ + " CASCADE");
  }
  idem::postgres::PostgresStoreOptions store_options() const {
    idem::postgres::PostgresStoreOptions o;
    o.conninfo = dsn_;
    o.schema = schema_;
    o.pool_size = 48;
    return o;
  }
  std::unique_ptr<idem::redis::RedisStore> redis(const std::string& uri = "") const {
    idem::redis::RedisStoreOptions o;
    o.uri = uri.empty() ? redis_ : uri;
    o.key_prefix = "idem-test:" + schema_ + ":";
    o.pool_size = 48;
    return std::make_unique<idem::redis::RedisStore>(o);
  }

  std::string dsn_, redis_, schema_;
};

TEST_F(GrpcPostgres, HedgedChargesWithRedisInFrontOneEffectEach) {
  idem::postgres::PostgresStore durable{store_options()};
  auto fast = redis();
  PgGuard guard{*fast, durable};
  PostgresLedger ledger{durable, schema_};
  ledger.open_accounts(4, 1'000'000);
  grpc_payment::ServiceOptions so;
  so.slow = 10ms;  // inside the PostgreSQL transaction; transactions of other keys run meanwhile
  grpc_payment::PaymentService<PostgresLedger> service{guard, ledger, so};
  Server server({&service});
  auto stub = pb::Payments::NewStub(grpc_payment::make_channel(server.address(), ""));

  const int keys = 1'000;
  std::vector<grpc_payment::Answer> answers(keys);
  std::atomic<int> next{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < 32; ++t) {
    clients.emplace_back([&] {
      for (int i; (i = next++) < keys;) {
        auto req = charge_request(grpc_payment::SqliteLedger::account(i % 4), 100 + i % 7);
        answers[static_cast<std::size_t>(i)] =
            grpc_payment::hedged_charge(*stub, req, "pg-" + std::to_string(i), 5);
      }
    });
  }
  for (auto& c : clients) c.join();
  auto totals = ledger.totals();
  int not_ok = 0, wrong = 0;
  for (int i = 0; i < keys; ++i) {
    const auto& a = answers[static_cast<std::size_t>(i)];
    if (!a.status.ok()) {
      if (++not_ok < 5) ADD_FAILURE() << i << ": " << a.status.error_message();
      continue;
    }
    auto row = totals.by_key.find("pg-" + std::to_string(i));
    if (row == totals.by_key.end() || row->second != a.reply.payment_no()) ++wrong;
  }
  EXPECT_EQ(0, not_ok);
  EXPECT_EQ(0, wrong);
  EXPECT_EQ(keys, totals.payments);
  EXPECT_EQ(4 * 1'000'000 - totals.charged_cents, totals.balance_cents);
  auto s = guard.stats().snapshot();
  EXPECT_EQ(static_cast<std::uint64_t>(keys), s.executed);
  EXPECT_GT(s.in_progress, 0u);
  EXPECT_GT(s.fast_hits, 0u);  // Redis stopped the copies at the entrance
  EXPECT_EQ(0u, s.degraded);
  EXPECT_EQ(static_cast<long>(keys), pg::scalar("SELECT count(*) FROM " + schema_ +
                                                ".api_idempotency WHERE status = 'completed'"));
}

TEST_F(GrpcPostgres, CommitWhoseAnswerIsLostAnswersOnceOk) {
  idem::test::CommitDroppingProxy proxy(pg::dsn_port());
  auto o = store_options();
  {  // the tables, directly
    idem::postgres::PostgresStore setup{o};
    PostgresLedger{setup, schema_}.open_accounts(2, 10'000);
  }
  o.conninfo = pg::dsn_with_port(proxy.port());
  o.migrate = false;
  std::atomic<bool> arm{false};
  o.before_commit = [&](pqxx::connection&) {
    if (arm.exchange(false)) proxy.drop_next_commit = true;
  };
  idem::postgres::PostgresStore durable{o};
  PgGuard guard{durable};  // PostgreSQL alone decides
  PostgresLedger ledger{durable, schema_};
  grpc_payment::PaymentService<PostgresLedger> service{guard, ledger};
  Server server({&service});
  auto stub = pb::Payments::NewStub(grpc_payment::make_channel(server.address()));
  auto req = charge_request("acct-0001", 2'500);
  arm = true;
  auto a = grpc_payment::charge(*stub, req, "lost-commit");
  EXPECT_EQ(1, proxy.dropped.load());
  ASSERT_TRUE(a.status.ok()) << a.status.error_message() << " " << a.trailer("idempotency-error");
  EXPECT_FALSE(a.replayed());  // the store found its COMMIT applied: this call executed
  auto again = grpc_payment::charge(*stub, req, "lost-commit");
  EXPECT_TRUE(again.replayed());
  EXPECT_EQ(a.reply.payment_no(), again.reply.payment_no());
  auto totals = ledger.totals();
  EXPECT_EQ(1, totals.payments);
  EXPECT_EQ(2 * 10'000 - 2'500, totals.balance_cents);
}

TEST_F(GrpcPostgres, PostgresUnreachableIsUnavailable) {
  auto o = store_options();
  o.conninfo = pg::dsn_with_port(free_port()) + " connect_timeout=2";
  o.migrate = false;
  o.pool_wait = 200ms;
  idem::postgres::PostgresStore durable{o};
  PgGuard guard{durable};
  auto options = charge_options();
  ScriptedPayments<idem::postgres::PostgresStore> service{
      guard, options, [](pqxx::work*, int, const pb::ChargeRequest&, pb::ChargeReply*) {
        ADD_FAILURE() << "the handler ran without its store";
        return idem::grpc::Reply();
      }};
  Server server({&service});
  auto stub = pb::Payments::NewStub(grpc_payment::make_channel(server.address(), ""));
  auto a = grpc_payment::charge(*stub, charge_request("acct-0001", 1), "pg-down");
  EXPECT_EQ(grpc::StatusCode::UNAVAILABLE, a.status.error_code());
  EXPECT_EQ("store_unavailable", a.trailer("idempotency-error"));
  EXPECT_EQ(0, service.runs());
}

TEST_F(GrpcPostgres, RedisDownDegradesToPostgresExactlyOnce) {
  idem::postgres::PostgresStore durable{store_options()};
  auto fast = redis("redis://127.0.0.1:" + std::to_string(free_port()));
  PgGuard guard{*fast, durable};
  PostgresLedger ledger{durable, schema_};
  ledger.open_accounts(2, 10'000);
  grpc_payment::PaymentService<PostgresLedger> service{guard, ledger};
  Server server({&service});
  auto stub = pb::Payments::NewStub(grpc_payment::make_channel(server.address(), ""));
  auto req = charge_request("acct-0000", 100);
  auto first = grpc_payment::charge(*stub, req, "redis-down");
  auto second = grpc_payment::charge(*stub, req, "redis-down");
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_TRUE(second.replayed());  // from PostgreSQL's record
  EXPECT_EQ(first.reply.payment_no(), second.reply.payment_no());
  auto s = guard.stats().snapshot();
  EXPECT_EQ(2u, s.degraded);
  EXPECT_EQ(1u, s.durable_conflicts);
  EXPECT_EQ(1, ledger.totals().payments);
}

TEST_F(GrpcPostgres, FastOnlyGuardWithRedisDownIsUnavailable) {
  auto fast = redis("redis://127.0.0.1:" + std::to_string(free_port()));
  idem::IdempotencyGuard guard{*fast};
  ScriptedPayments<idem::NoDurableStore> service{
      guard, charge_options(),
      [](idem::detail::NoTransaction*, int, const pb::ChargeRequest&, pb::ChargeReply*) {
        ADD_FAILURE() << "the handler ran without its store";
        return idem::grpc::Reply();
      },
      /*transactional=*/false};
  Server server({&service});
  auto stub = pb::Payments::NewStub(grpc_payment::make_channel(server.address(), ""));
  auto a = grpc_payment::charge(*stub, charge_request("acct-0001", 1), "fast-down");
  EXPECT_EQ(grpc::StatusCode::UNAVAILABLE, a.status.error_code());
  EXPECT_EQ("store_unavailable", a.trailer("idempotency-error"));
}

}  // namespace
