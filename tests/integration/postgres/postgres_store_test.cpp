// SPDX-License-Identifier: MIT
// PostgresStore specifics against a real server: payments under contention (with and without
// a fast store), fast-store failure after commit, a two-phase process killed between the
// phases, lock_timeout, a COMMIT lost with its connection, deadlock retries, migrations
// racing, the pool. Every test counts business rows in the database.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/guard.hpp"
#include "idem/memory_store.hpp"
#include "pg_test_support.hpp"
#include "postgres/deadline.hpp"
#ifdef IDEM_TEST_WITH_REDIS
#include "idem/redis/redis_store.hpp"
#endif
#include "support/failing_store.hpp"
#include "tcp_proxy.hpp"

namespace {

using idem::ClaimStatus;
using idem::Key;
using idem::Outcome;
using idem::OwnerToken;
using idem::postgres::PostgresStore;
namespace pg = idem::test::pg;
using namespace std::chrono_literals;

Key unique_key(const std::string& scope = "payment") {
  return Key::make(scope, idem::test::unique_name(
                              ::testing::UnitTest::GetInstance()->current_test_info()->name()));
}

// ---------------------------------------------------------------------------------------------
// Payments: 32 threads, one key. The fast store in front is a factory: none, memory, and
// RedisStore (a real server, IDEM_TEST_REDIS_URL, with a key prefix private to the test).

struct FastStoreFactory {
  std::string name;
  std::function<std::unique_ptr<idem::FastStore>()> make;  // null: durable only
  const char* server_env = nullptr;  // an environment variable the factory needs, if any
};

void PrintTo(const FastStoreFactory& f, std::ostream* os) { *os << f.name; }

class PaymentStorm : public ::testing::TestWithParam<FastStoreFactory> {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_POSTGRES();
    if (GetParam().server_env != nullptr) {
      std::string value;
      IDEM_REQUIRE_ENV(value, GetParam().server_env);
    }
    store_ = std::make_unique<PostgresStore>(pg::options());
    if (GetParam().make) fast_ = GetParam().make();
  }
  std::unique_ptr<PostgresStore> store_;
  std::unique_ptr<idem::FastStore> fast_;
};

TEST_P(PaymentStorm, ThirtyTwoThreadsOneKeyOnePaymentOneDebit) {
  auto key = unique_key();
  const std::string account = key.id();
  pg::exec("INSERT INTO " + pg::table("account") + " VALUES ('" + account + "', 1000)");
  auto run = [&](auto& guard) {
    constexpr int kThreads = 32;
    std::atomic<int> handler_runs{0}, executed{0}, replayed{0}, in_progress{0}, errors{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&] {
        while (!go.load()) std::this_thread::yield();
        try {
          auto r = guard.run(key, "amount=100", [&](pqxx::work& tx) {
            ++handler_runs;
            tx.exec_params(
                "UPDATE " + pg::table("account") + " SET balance = balance - 100 WHERE id = $1",
                account);
            auto row = tx.exec_params1("INSERT INTO " + pg::table("payment") +
                                           " (order_no, amount) VALUES ($1, 100) RETURNING id",
                                       key.id());
            std::this_thread::sleep_for(std::chrono::milliseconds(30));
            return "pay_" + row[0].as<std::string>();
          });
          if (r.outcome == Outcome::kExecuted) ++executed;
          if (r.outcome == Outcome::kReplayed) ++replayed;
          if (r.outcome == Outcome::kInProgress) ++in_progress;
        } catch (const std::exception& e) {
          ADD_FAILURE() << e.what();
          ++errors;
        }
      });
    }
    go = true;
    for (auto& t : threads) t.join();
    EXPECT_EQ(1, executed.load());
    EXPECT_EQ(kThreads - 1, replayed.load() + in_progress.load());
    EXPECT_EQ(0, errors.load());
    EXPECT_EQ(1, handler_runs.load());
  };
  if (fast_) {
    idem::IdempotencyGuard guard{*fast_, *store_};
    run(guard);
  } else {
    idem::IdempotencyGuard guard{*store_};
    run(guard);
  }
  EXPECT_EQ(1, pg::count_where("payment", "order_no", key.id()));
  EXPECT_EQ(900, pg::scalar("SELECT balance FROM " + pg::table("account") + " WHERE id = '" +
                            account + "'"));
  auto rec = store_->lookup(key);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
}

std::vector<FastStoreFactory> fast_store_factories() {
  std::vector<FastStoreFactory> f{
      {"none", nullptr},
      {"memory", [] { return std::make_unique<idem::MemoryStore>(); }},
  };
#ifdef IDEM_TEST_WITH_REDIS
  f.push_back({"redis",
               [] {
                 idem::redis::RedisStoreOptions o{idem::test::server_env("IDEM_TEST_REDIS_URL")};
                 o.key_prefix = idem::test::unique_name("pg_storm") + ":";
                 return std::make_unique<idem::redis::RedisStore>(o);
               },
               "IDEM_TEST_REDIS_URL"});
#endif
  return f;
}

INSTANTIATE_TEST_SUITE_P(FastStores, PaymentStorm, ::testing::ValuesIn(fast_store_factories()),
                         [](const ::testing::TestParamInfo<FastStoreFactory>& p) {
                           return p.param.name;
                         });

// ---------------------------------------------------------------------------------------------

class PostgresStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_POSTGRES();
    store_ = std::make_unique<PostgresStore>(pg::options());
  }
  std::unique_ptr<PostgresStore> store_;
};

TEST_F(PostgresStoreTest, FastStoreCompleteFailingAfterCommitReplaysFromPostgresAndRefills) {
  idem::MemoryStore memory;
  idem::test::SwitchableFastStore fast(memory);
  idem::GuardOptions o;
  o.lease = std::chrono::milliseconds(300);
  idem::IdempotencyGuard guard{static_cast<idem::FastStore&>(fast), *store_, o};
  auto key = unique_key();
  int runs = 0;
  auto first = guard.run(key, "fp", [&](pqxx::work& tx) {
    ++runs;
    pg::insert_effect(tx, key.id());
    fast.failing = true;  // the fast store goes down while the transaction commits
    return std::string("first");
  });
  EXPECT_EQ(Outcome::kExecuted, first.outcome);
  // PostgreSQL decided with the fast claim granted: the call is not degraded (its completion's
  // failure is the fast store's, counted in its burst), in its result and the counters alike.
  EXPECT_FALSE(first.degraded);
  EXPECT_EQ(0u, guard.stats().snapshot().degraded);
  fast.failing = false;
  // The fast store still holds the first call's in-progress claim until its lease ends.
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  auto second = guard.run(key, "fp", [&](pqxx::work&) {
    ++runs;
    return std::string("second");
  });
  EXPECT_EQ(Outcome::kReplayed, second.outcome);
  EXPECT_EQ(idem::Source::kDurableStore, second.source);
  EXPECT_EQ("first", second.value.value_or(""));
  auto refilled = memory.lookup(key);
  ASSERT_TRUE(refilled.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, refilled->status);
  EXPECT_EQ("first", refilled->response);
  auto third = guard.run(key, "fp", [&](pqxx::work&) {
    ++runs;
    return std::string("third");
  });
  EXPECT_EQ(idem::Source::kFastStore, third.source);
  EXPECT_EQ("first", third.value.value_or(""));
  EXPECT_EQ(1, runs);
  EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", key.id()));
}

// A record is kept `retention` after its completion, not after its transaction began: a
// handler that runs longer than the retention still leaves a record its duplicates replay
// (now() in the completion made it expire before its COMMIT). Transactional and two-phase.
TEST_F(PostgresStoreTest, RetentionCountsFromTheCompletionNotTheTransactionsStart) {
  idem::GuardOptions go;
  go.retention = std::chrono::seconds(1);
  idem::IdempotencyGuard guard{*store_, go};
  for (bool transactional : {true, false}) {
    auto key = unique_key();
    int runs = 0;
    auto slow = [&] {
      ++runs;
      std::this_thread::sleep_for(std::chrono::milliseconds(1300));
      return std::string("r");
    };
    auto call = [&] {
      return transactional ? guard.run(key, "fp", [&](pqxx::work&) { return slow(); })
                           : guard.run(key, "fp", slow);
    };
    EXPECT_EQ(idem::Outcome::kExecuted, call().outcome);
    EXPECT_EQ(idem::Outcome::kReplayed, call().outcome) << transactional;
    EXPECT_EQ(1, runs) << transactional;
  }
}

// A handler that catches the error of its own failed statement and returns leaves an aborted
// transaction: the call is a StorageError that says so (it was a LeaseLost, which tells the
// caller another attempt won), nothing commits, and a retry runs the handler again. With and
// without the response told in advance (the record then goes in completed at the claim, and
// the COMMIT is what refuses), twice each (statements prepared lazily, then already prepared).
TEST_F(PostgresStoreTest, HandlerThatSwallowsItsOwnSqlErrorGetsAStorageErrorNotLeaseLost) {
  idem::IdempotencyGuard guard{*store_};
  for (bool told : {false, true}) {
    for (int round = 0; round < 2; ++round) {
      auto key = unique_key();
      idem::CallOptions call;
      if (told) call.expected_response = std::string_view("done");
      int runs = 0;
      try {
        (void)guard.run(key, "fp", call, [&](pqxx::work& tx) {
          ++runs;
          pg::insert_effect(tx, key.id());
          try {
            tx.exec("SELECT 1 / 0");
          } catch (const pqxx::sql_error&) {
            // swallowed: the transaction is aborted
          }
          return std::string("done");
        });
        ADD_FAILURE() << "the aborted transaction was answered";
      } catch (const idem::LeaseLost& e) {
        ADD_FAILURE() << "LeaseLost: " << e.what();
      } catch (const idem::StorageError& e) {
        EXPECT_EQ(idem::errc::kStorageError, e.code());
        EXPECT_NE(std::string::npos, std::string(e.what()).find("handler went on")) << e.what();
      }
      EXPECT_EQ(1, runs);
      EXPECT_FALSE(store_->lookup(key).has_value());
      EXPECT_EQ(0, pg::count_where("idem_test_effects", "key_id", key.id()));
      auto retry = guard.run(key, "fp", call, [&](pqxx::work& tx) {
        ++runs;
        pg::insert_effect(tx, key.id());
        return std::string("done");
      });
      EXPECT_EQ(Outcome::kExecuted, retry.outcome);
      EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", key.id()));
    }
  }
}

// The connection parameters idem adds to bound its waits (client_timeout) are added only when
// the conninfo does not set them, read as libpq reads it: blanks around '=' and quoted values
// count, and a value that merely contains a keyword does not; an empty value at the end can
// no longer take the first added pair as its value (`password=keepalives=1`).
TEST(PostgresConninfo, ClientBoundsAreAddedOnlyWhereTheUserSetNone) {
  using idem::postgres::detail::with_client_bounds;
  const std::chrono::milliseconds limit{30'000};
  auto count = [](const std::string& s, const std::string& what) {
    std::size_t n = 0;
    for (auto at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
    return n;
  };
  auto spaced = with_client_bounds("host=db connect_timeout = 30", limit);
  EXPECT_EQ(1u, count(spaced, "connect_timeout")) << spaced;
  EXPECT_NE(std::string::npos, spaced.find("connect_timeout='30'")) << spaced;
  EXPECT_NE(std::string::npos, spaced.find("keepalives=1")) << spaced;
  auto quoted = with_client_bounds("host=db application_name='tcp_user_timeout=5'", limit);
  EXPECT_NE(std::string::npos, quoted.find("application_name='tcp_user_timeout=5'")) << quoted;
  EXPECT_NE(std::string::npos, quoted.find(" tcp_user_timeout=30000")) << quoted;
  auto empty = with_client_bounds("host= dbname=app password=", limit);
  EXPECT_EQ(0u, empty.find("host='dbname=app' password='' keepalives=1")) << empty;
  auto escaped = with_client_bounds("password='it\\'s' host=db", limit);
  EXPECT_EQ(0u, escaped.find("password='it\\'s' host='db'")) << escaped;
  // A backslash that ends the string: libpq drops it, and so does the rewrite.
  auto trailing = with_client_bounds("host=db password=abc\\", limit);
  EXPECT_EQ(0u, trailing.find("host='db' password='abc' ")) << trailing;
  auto uri = with_client_bounds("postgresql://u@db/app?connect_timeout=9&sslmode=disable", limit);
  EXPECT_EQ(1u, count(uri, "connect_timeout")) << uri;
  EXPECT_NE(std::string::npos, uri.find("&keepalives=1")) << uri;
  // Not well formed: left to libpq, which names the fault in the user's own text.
  EXPECT_EQ("host='db", with_client_bounds("host='db", limit));
  EXPECT_EQ("host=db", with_client_bounds("host=db", std::chrono::milliseconds(0)));
}

// A conninfo ending in an empty value connects: the parameters idem adds no longer become that
// value (`options=keepalives=1`, which the server refused as a command-line argument).
// Waits beyond what the server and libpq take are usage errors at construction (no server
// needed: nothing connects); they failed the first connection with a complaint about a setting
// the user never wrote (keepalives_idle) or as a StorageError.
TEST(PostgresOptions, WaitsBeyondADayAreUsageErrors) {
  for (auto field : {&idem::postgres::PostgresStoreOptions::pool_wait,
                     &idem::postgres::PostgresStoreOptions::lock_timeout,
                     &idem::postgres::PostgresStoreOptions::statement_timeout,
                     &idem::postgres::PostgresStoreOptions::client_timeout}) {
    idem::postgres::PostgresStoreOptions o;
    o.conninfo = "host=127.0.0.1 port=1 dbname=none connect_timeout=2";
    o.*field = std::chrono::milliseconds::max();
    EXPECT_THROW(PostgresStore{o}, idem::UsageError);
  }
}

TEST_F(PostgresStoreTest, AConninfoEndingInAnEmptyValueConnects) {
  auto o = pg::options();
  o.conninfo += " options=";
  o.migrate = true;
  idem::postgres::PostgresStore store(o);
  auto key = unique_key();
  EXPECT_EQ(idem::ClaimStatus::kClaimed,
            store.begin(key, "fp", idem::OwnerToken::generate(), std::chrono::seconds(30)).status);
}

TEST_F(PostgresStoreTest, TwoPhaseProcessKilledBetweenPhasesIsTakenOverAfterTheLease) {
  auto key = unique_key();
  int fds[2];
  ASSERT_EQ(0, ::pipe(fds));
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child: its own store (never the parent's connections), begin, then die.
    ::close(fds[0]);
    try {
      auto o = pg::options();
      o.migrate = false;
      o.pool_size = 1;
      PostgresStore s(o);
      auto owner = OwnerToken::generate();
      if (s.begin(key, "fp", owner, std::chrono::milliseconds(1000)).status ==
          ClaimStatus::kClaimed) {
        ssize_t n = ::write(fds[1], owner.str().data(), owner.str().size());
        (void)n;
      }
    } catch (...) {
    }
    ::_exit(0);  // between the phases: no complete, no release, no destructors
  }
  ::close(fds[1]);
  char buf[64] = {};
  ssize_t n = ::read(fds[0], buf, sizeof buf);
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_EQ(static_cast<ssize_t>(OwnerToken::kLength), n) << "the child did not claim";
  auto stale = OwnerToken::from_string(std::string(buf, static_cast<std::size_t>(n)));

  idem::GuardOptions o;
  o.lease = std::chrono::seconds(30);
  idem::IdempotencyGuard guard{*store_, o};
  int runs = 0;
  auto handler = [&] {
    ++runs;
    return std::string("charged");
  };
  auto during = guard.run(key, "fp", handler);
  EXPECT_EQ(Outcome::kInProgress, during.outcome);
  EXPECT_EQ(stale.str(), during.holder);
  auto rec = store_->lookup(key);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kInProgress, rec->status);

  // Retry until the lease (database clock) is over: in progress until then, then taken over.
  idem::GuardResult<std::string> after;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  do {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    after = guard.run(key, "fp", handler);
  } while (after.outcome == Outcome::kInProgress && std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(Outcome::kExecuted, after.outcome);
  EXPECT_EQ(1u, guard.stats().snapshot().takeovers);
  EXPECT_FALSE(store_->complete(key, stale, "stale", std::chrono::seconds(60)));
  EXPECT_FALSE(store_->release(key, stale));
  rec = store_->lookup(key);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
  EXPECT_EQ("charged", rec->response);
  EXPECT_EQ(1, runs);
  EXPECT_EQ(2, pg::scalar("SELECT attempts FROM " + pg::table("api_idempotency") +
                          " WHERE idem_key = '" + key.id() + "'"));
}

TEST_F(PostgresStoreTest, DuplicateWaitsAtMostLockTimeoutThenAnswersInProgress) {
  auto o = pg::options();
  o.lock_timeout = std::chrono::milliseconds(300);
  o.migrate = false;
  PostgresStore store(o);
  idem::IdempotencyGuard guard{store};
  auto key = unique_key();
  std::mutex m;
  std::condition_variable cv;
  bool holding = false, duplicate_done = false;
  std::thread first([&] {
    auto r = guard.run(key, "fp", [&](pqxx::work& tx) {
      pg::insert_effect(tx, key.id());
      std::unique_lock<std::mutex> lock(m);
      holding = true;
      cv.notify_all();
      // Hold the key until the duplicate has answered (bounded so a bug cannot hang the test).
      cv.wait_for(lock, std::chrono::seconds(20), [&] { return duplicate_done; });
      return std::string("first");
    });
    EXPECT_EQ(Outcome::kExecuted, r.outcome);
  });
  {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return holding; });
  }
  int runs = 0;
  auto dup = guard.run(key, "fp", [&](pqxx::work&) {
    ++runs;
    return std::string("dup");
  });
  bool first_still_holding;
  {
    std::lock_guard<std::mutex> lock(m);
    first_still_holding = !duplicate_done;
    duplicate_done = true;
  }
  cv.notify_all();
  first.join();
  EXPECT_TRUE(first_still_holding);  // the duplicate answered while the key was held
  EXPECT_EQ(Outcome::kInProgress, dup.outcome);
  EXPECT_EQ(0, runs);
  EXPECT_EQ(1u, store.stats().lock_timeouts);
  auto after = guard.run(key, "fp", [&](pqxx::work&) {
    ++runs;
    return std::string("dup");
  });
  EXPECT_EQ(Outcome::kReplayed, after.outcome);
  EXPECT_EQ("first", after.value.value_or(""));
  EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", key.id()));
}

TEST_F(PostgresStoreTest, ClaimInUsesASavepointSoALockTimeoutKeepsTheCallersTransaction) {
  auto o = pg::options();
  o.lock_timeout = std::chrono::milliseconds(200);
  o.migrate = false;
  PostgresStore store(o);
  auto key = unique_key();
  pqxx::connection holder_conn(pg::dsn());
  pqxx::work holder(holder_conn);
  ASSERT_EQ(ClaimStatus::kClaimed,
            store.claim_in(holder, key, "fp", OwnerToken::generate(), {}).status);
  store.with_transaction([&](pqxx::work& tx) {
    pg::insert_effect(tx, key.id());
    auto c = store.claim_in(tx, key, "fp", OwnerToken::generate(), {});
    EXPECT_EQ(ClaimStatus::kBusy, c.status);
    pg::insert_effect(tx, key.id());  // still usable: the savepoint absorbed the timeout
  });
  holder.abort();
  EXPECT_EQ(2, pg::count_where("idem_test_effects", "key_id", key.id()));
}

TEST_F(PostgresStoreTest, CommitLostWithItsConnectionIsResolvedNotRerun) {
  auto o = pg::options();
  o.migrate = false;
  std::atomic<bool> kill{true};
  o.before_commit = [&](pqxx::connection& c) {
    if (!kill.load()) return;
    // Terminate this transaction's backend (waiting until it is gone) right before COMMIT.
    pqxx::connection killer(pg::dsn());
    pqxx::nontransaction nt(killer);
    nt.exec("SELECT pg_terminate_backend(" + std::to_string(c.backendpid()) + ", 10000)");
  };
  PostgresStore store(o);
  idem::IdempotencyGuard guard{store};
  auto key = unique_key();
  int runs = 0;
  auto handler = [&](pqxx::work& tx) {
    ++runs;
    pg::insert_effect(tx, key.id());
    return std::string("ok");
  };
  try {
    (void)guard.run(key, "fp", handler);
    ADD_FAILURE() << "the lost commit was not reported";
  } catch (const idem::StorageUnavailable& e) {
    // The server says the transaction did not commit: retryable, nothing applied.
    EXPECT_TRUE(e.retryable());
    EXPECT_NE(std::string::npos, std::string(e.what()).find("did not commit")) << e.what();
  }
  EXPECT_EQ(1, runs);  // never re-run blindly
  EXPECT_EQ(1u, store.stats().commits_resolved);
  EXPECT_EQ(0, pg::count_where("idem_test_effects", "key_id", key.id()));
  EXPECT_FALSE(store.lookup(key).has_value());
  kill = false;
  auto retry = guard.run(key, "fp", handler);
  EXPECT_EQ(Outcome::kExecuted, retry.outcome);
  EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", key.id()));
}

// The server refuses more connections than a limit allows (the role's CONNECTION LIMIT here;
// max_connections alike: SQLSTATE 53300) while the pool holds some: a call waits for one of
// the pool's own connections instead of failing, and every key runs once. With none of its own
// open, the refusal reaches the caller typed and retryable, and the retry succeeds once a
// connection is free.
TEST_F(PostgresStoreTest, CallsBeyondTheServersConnectionLimitWaitForThePoolsOwnConnections) {
  const std::string role = "idem_cap_" + std::to_string(::getpid());
  pg::exec("CREATE ROLE " + role + " LOGIN CONNECTION LIMIT 2");
  struct DropRole {
    std::string role;
    ~DropRole() {
      try {
        pg::exec("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '" + role +
                 "'");
        pg::exec("DROP OWNED BY " + role);
        pg::exec("DROP ROLE IF EXISTS " + role);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "could not drop role " << role << ": " << e.what();
      }
    }
  } drop{role};
  pg::exec("GRANT USAGE, CREATE ON SCHEMA " + pg::Schema::name() + " TO " + role);
  pg::exec("GRANT ALL ON ALL TABLES IN SCHEMA " + pg::Schema::name() + " TO " + role);
  pg::exec("GRANT ALL ON ALL SEQUENCES IN SCHEMA " + pg::Schema::name() + " TO " + role);
  const std::string capped = pg::dsn() + " user=" + role;  // the last user= counts
  auto o = pg::options();
  o.conninfo = capped;
  o.table = "capped_idempotency";
  o.pool_size = 6;  // more than the server lets this role open
  o.pool_wait = 30s;
  constexpr int kThreads = 6, kCalls = 4;
  std::vector<Key> keys;
  for (int i = 0; i < kThreads * kCalls; ++i) keys.push_back(unique_key());
  std::atomic<int> executed{0};
  std::mutex errors_mutex;
  std::vector<std::string> errors;
  {
    PostgresStore store(o);
    idem::IdempotencyGuard guard{store};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kCalls; ++i) {
          const Key& k = keys[static_cast<std::size_t>(t * kCalls + i)];
          try {
            auto r = guard.run(k, "fp", [&](pqxx::work& tx) {
              pg::insert_effect(tx, k.id());
              tx.exec("SELECT pg_sleep(0.05)");
              return std::string("paid");
            });
            if (r.outcome == Outcome::kExecuted) ++executed;
          } catch (const std::exception& e) {
            std::lock_guard<std::mutex> lock(errors_mutex);
            errors.push_back(e.what());
          }
        }
      });
    }
    for (auto& th : threads) th.join();
  }
  EXPECT_TRUE(errors.empty()) << errors.size() << " calls failed, e.g. " << errors.front();
  EXPECT_EQ(kThreads * kCalls, executed.load());
  for (const auto& k : keys) EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", k.id()));

  // None of the pool's own: the role's two connections are held elsewhere.
  o.migrate = false;  // the table is there: no connection at construction
  o.pool_wait = 200ms;
  PostgresStore fresh(o);
  idem::IdempotencyGuard guard{fresh};
  auto k = unique_key();
  auto handler = [&](pqxx::work& tx) {
    pg::insert_effect(tx, k.id());
    return std::string("paid");
  };
  {
    pqxx::connection first(capped), second(capped);
    try {
      (void)guard.run(k, "fp", handler);
      ADD_FAILURE() << "a call ran beyond the role's connection limit";
    } catch (const idem::StorageError& e) {
      EXPECT_TRUE(e.retryable()) << e.what();
      EXPECT_EQ(idem::errc::kStoreUnavailable, e.code()) << e.what();
      EXPECT_NE(std::string(e.what()).find("too many connections for role"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(0, pg::count_where("idem_test_effects", "key_id", k.id()));
  EXPECT_EQ(Outcome::kExecuted, guard.run(k, "fp", handler).outcome);
  EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", k.id()));
}

TEST_F(PostgresStoreTest, CommitWhoseAnswerWasLostIsResolvedAsCommittedNotRerun) {
  idem::test::CommitDroppingProxy proxy(pg::dsn_port());
  auto o = pg::options();
  o.migrate = false;
  o.conninfo = pg::dsn_with_port(proxy.port());
  std::atomic<bool> arm{true};
  o.before_commit = [&](pqxx::connection&) {
    if (arm.exchange(false)) proxy.drop_next_commit = true;
  };
  PostgresStore store(o);
  idem::IdempotencyGuard guard{store};
  auto key = unique_key();
  int runs = 0;
  auto handler = [&](pqxx::work& tx) {
    ++runs;
    pg::insert_effect(tx, key.id());
    return std::string("paid");
  };
  auto r = guard.run(key, "fp", handler);
  EXPECT_EQ(1, proxy.dropped.load());
  EXPECT_EQ(Outcome::kExecuted, r.outcome);  // the server committed: the call succeeded
  EXPECT_EQ("paid", r.value.value_or(""));
  EXPECT_EQ(1u, store.stats().commits_resolved);
  EXPECT_EQ(1, runs);
  EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", key.id()));
  auto again = guard.run(key, "fp", handler);
  EXPECT_EQ(Outcome::kReplayed, again.outcome);
  EXPECT_EQ(1, runs);
}

TEST_F(PostgresStoreTest, DeadlockedTransactionIsRetriedAndEachEffectHappensOnce) {
  auto o = pg::options();
  o.migrate = false;
  o.max_retries = 10;
  std::atomic<int> retry_calls{0};
  o.on_retry = [&](const Key&, std::string_view state) {
    EXPECT_EQ("40P01", std::string(state));
    ++retry_calls;
  };
  PostgresStore store(o);
  idem::IdempotencyGuard guard{store};
  auto base = unique_key();
  const std::string a = base.id() + "_a", b = base.id() + "_b";
  pg::exec("INSERT INTO " + pg::table("account") + " VALUES ('" + a + "', 0), ('" + b + "', 0)");
  std::atomic<int> at_barrier{0};
  auto transfer = [&](const std::string& id, const std::string& first, const std::string& second) {
    std::atomic<bool> first_run{true};
    auto r = guard.run(Key::make("transfer", id), "", [&](pqxx::work& tx) {
      tx.exec_params("UPDATE " + pg::table("account") + " SET balance = balance + 1 WHERE id = $1",
                     first);
      if (first_run.exchange(false)) {
        ++at_barrier;  // both hold their first row, then each asks for the other's
        while (at_barrier.load() < 2) std::this_thread::yield();
      }
      tx.exec_params("UPDATE " + pg::table("account") + " SET balance = balance + 1 WHERE id = $1",
                     second);
      pg::insert_effect(tx, id);
      return std::string("done");
    });
    EXPECT_EQ(Outcome::kExecuted, r.outcome);
  };
  std::thread t1([&] { transfer(base.id() + "_t1", a, b); });
  std::thread t2([&] { transfer(base.id() + "_t2", b, a); });
  t1.join();
  t2.join();
  // At least one re-run; more if a re-run raced the survivor and deadlocked again (load).
  EXPECT_GE(retry_calls.load(), 1);
  EXPECT_EQ(static_cast<std::uint64_t>(retry_calls.load()), store.stats().retries);
  EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", base.id() + "_t1"));
  EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", base.id() + "_t2"));
  EXPECT_EQ(4, pg::scalar("SELECT sum(balance) FROM " + pg::table("account") + " WHERE id IN ('" +
                          a + "', '" + b + "')"));
}

TEST_F(PostgresStoreTest, HostileIdsAreBoundNeverInterpolated) {
  idem::IdempotencyGuard guard{*store_};
  for (std::string id : {"';DROP_TABLE_payment;--", "o'brien\\\"x", "\\x00\\'", "$1$2", "%s%n",
                         "--", "/*", "E'\\\\'"}) {
    id += idem::test::unique_name("_");
    auto key = Key::make("payment", id);
    auto r = guard.run(key, "", [&](pqxx::work& tx) {
      tx.exec_params("INSERT INTO " + pg::table("payment") + " (order_no, amount) VALUES ($1, 1)",
                     id);
      return id;
    });
    EXPECT_EQ(Outcome::kExecuted, r.outcome);
    EXPECT_EQ(1, pg::count_where("payment", "order_no", id)) << id;
    EXPECT_EQ(1, pg::count_where("api_idempotency", "idem_key", id)) << id;
    auto again = guard.run(key, "", [&](pqxx::work&) { return std::string("never"); });
    EXPECT_EQ(id, again.value.value_or("")) << id;
  }
}

TEST_F(PostgresStoreTest, MigrationTwiceIsANoOpAndConcurrentMigrationsAreSafe) {
  // A second store on the migrated schema: nothing changes, the version stays 2.
  { PostgresStore again(pg::options()); }
  EXPECT_EQ(2, pg::scalar("SELECT version FROM " + pg::table("idem_schema_version") +
                          " WHERE name = 'api_idempotency'"));
  // Version 2: the key is the primary key, no surrogate id column.
  EXPECT_EQ(1, pg::scalar("SELECT count(*) FROM pg_constraint WHERE conname ="
                          " 'api_idempotency_key_uq' AND contype = 'p' AND conrelid = '" +
                          pg::table("api_idempotency") + "'::regclass"));
  EXPECT_EQ(0, pg::scalar("SELECT count(*) FROM information_schema.columns WHERE table_schema = '" +
                          pg::Schema::name() +
                          "' AND table_name = 'api_idempotency' AND column_name = 'id'"));
  // Fresh schemas migrated by two connections at once, several times.
  for (int round = 0; round < 5; ++round) {
    const std::string schema = idem::test::unique_name("idem_mig");
    std::atomic<int> ok{0};
    std::atomic<bool> go{false};
    auto migrate = [&] {
      while (!go.load()) std::this_thread::yield();
      try {
        auto o = pg::options();
        o.schema = schema;
        o.pool_size = 1;
        PostgresStore s(o);
        ++ok;
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    };
    std::thread t1(migrate), t2(migrate);
    go = true;
    t1.join();
    t2.join();
    EXPECT_EQ(2, ok.load());
    EXPECT_EQ(1, pg::scalar("SELECT count(*) FROM " + schema + ".idem_schema_version"));
    EXPECT_EQ(0, pg::scalar("SELECT count(*) FROM " + schema + ".api_idempotency"));
    pg::exec("DROP SCHEMA " + schema + " CASCADE");
  }
}

// A table made by an earlier idem (schema version 1: a surrogate `id bigserial` primary key and
// the key as a separate unique constraint) keeps working with every statement and keeps its
// version; a table of a newer version than this idem is refused.
TEST_F(PostgresStoreTest, VersionOneTablesWithTheirIdColumnKeepWorking) {
  const std::string schema = idem::test::unique_name("idem_v1");
  pg::exec("CREATE SCHEMA " + schema);
  pg::exec("CREATE TABLE " + schema +
           ".idem_schema_version (name text PRIMARY KEY, version integer NOT NULL,"
           " applied_at timestamptz NOT NULL DEFAULT now())");
  pg::exec("CREATE TABLE " + schema +
           ".api_idempotency (id bigserial PRIMARY KEY, idem_key varchar(128) NOT NULL,"
           " biz_type varchar(64) NOT NULL, status varchar(16) NOT NULL"
           " CHECK (status IN ('in_progress', 'completed', 'failed')),"
           " fingerprint text NOT NULL DEFAULT '', owner varchar(64) NOT NULL,"
           " response_body bytea, lease_until timestamptz NOT NULL, expires_at timestamptz,"
           " attempts integer NOT NULL DEFAULT 1, created_at timestamptz NOT NULL DEFAULT now(),"
           " updated_at timestamptz NOT NULL DEFAULT now(),"
           " CONSTRAINT api_idempotency_key_uq UNIQUE (idem_key, biz_type))");
  pg::exec("CREATE INDEX api_idempotency_expires_idx ON " + schema +
           ".api_idempotency (expires_at) WHERE status <> 'in_progress'");
  pg::exec("INSERT INTO " + schema +
           ".idem_schema_version (name, version)"
           " VALUES ('api_idempotency', 1)");
  auto o = pg::options();
  o.schema = schema;
  {
    PostgresStore store(o);  // migrates: nothing to do for version 1
    EXPECT_EQ(1, pg::scalar("SELECT version FROM " + schema + ".idem_schema_version"));
    idem::IdempotencyGuard guard{store};
    auto key = unique_key();
    EXPECT_EQ(Outcome::kExecuted,
              guard.run(key, "fp", [](pqxx::work&) { return std::string("ok"); }).outcome);
    auto again = guard.run(key, "fp", [](pqxx::work&) { return std::string("no"); });
    EXPECT_EQ(Outcome::kReplayed, again.outcome);
    EXPECT_EQ("ok", again.value.value_or(""));
    // Two-phase: begin, release; begin, fail; begin, complete.
    auto two = unique_key();
    auto owner = OwnerToken::generate();
    EXPECT_EQ(idem::ClaimStatus::kClaimed,
              store.begin(two, "fp", owner, std::chrono::seconds(30)).status);
    EXPECT_TRUE(store.release(two, owner));
    EXPECT_EQ(idem::ClaimStatus::kClaimed,
              store.begin(two, "fp", owner, std::chrono::seconds(30)).status);
    EXPECT_TRUE(store.fail(two, owner, "no", std::chrono::seconds(1)));
    auto three = unique_key();
    EXPECT_EQ(idem::ClaimStatus::kClaimed,
              store.begin(three, "fp", owner, std::chrono::seconds(30)).status);
    EXPECT_TRUE(store.complete(three, owner, "done", std::chrono::seconds(1)));
    // Batches of records, both forms.
    auto b1 = unique_key(), b2 = unique_key();
    store.with_transaction([&](pqxx::work& tx) {
      EXPECT_TRUE(store.insert_new_completed_batch_in(tx, {idem::ClaimRequest{&b1, "fp", &owner}},
                                                      "b", std::chrono::seconds(1)));
      EXPECT_EQ(
          (std::vector<bool>{false, true}),
          store.insert_completed_batch_in(
              tx, {idem::ClaimRequest{&b1, "fp", &owner}, idem::ClaimRequest{&b2, "fp", &owner}},
              "b", std::chrono::seconds(1)));
    });
    // Purge by key: the four records with a 1 s retention go, the first one stays.
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    EXPECT_EQ(4u, store.purge_expired(2));
    EXPECT_TRUE(store.lookup(key).has_value());
    for (const Key* k : {&two, &three, &b1, &b2}) EXPECT_FALSE(store.lookup(*k).has_value());
  }
  EXPECT_EQ(1, pg::scalar("SELECT version FROM " + schema + ".idem_schema_version"));
  pg::exec("UPDATE " + schema + ".idem_schema_version SET version = 3");
  EXPECT_THROW(PostgresStore{o}, idem::StorageError);
  pg::exec("DROP SCHEMA " + schema + " CASCADE");
}

// A record table that exists without a version row (made by hand, restored without its row) is
// checked before use and recorded as the version its layout is; a table whose version row is
// newer is refused whether the store migrates or not.
TEST_F(PostgresStoreTest, TablesWithoutAVersionRowAreCheckedAndRecordedAsTheirLayout) {
  const std::string schema = idem::test::unique_name("idem_unver");
  pg::exec("CREATE SCHEMA " + schema);
  const std::string columns =
      " status varchar(16) NOT NULL, fingerprint text NOT NULL DEFAULT '',"
      " owner varchar(64) NOT NULL, response_body bytea, lease_until timestamptz NOT NULL,"
      " expires_at timestamptz, attempts integer NOT NULL DEFAULT 1,"
      " created_at timestamptz NOT NULL DEFAULT now(), updated_at timestamptz NOT NULL"
      " DEFAULT now()";
  auto o = pg::options();
  o.schema = schema;
  auto version_of = [&](const std::string& table) {
    return pg::scalar("SELECT coalesce((SELECT version FROM " + schema +
                      ".idem_schema_version WHERE name = '" + table + "'), 0)");
  };
  // A version-1 layout (bigserial id) restored without its row: recorded as 1, and it works.
  pg::exec("CREATE TABLE " + schema + ".api_idempotency (id bigserial PRIMARY KEY," +
           " idem_key varchar(128) NOT NULL, biz_type varchar(64) NOT NULL," + columns +
           ", UNIQUE (idem_key, biz_type))");
  {
    PostgresStore store(o);
    EXPECT_EQ(1, version_of("api_idempotency"));
    idem::IdempotencyGuard guard{store};
    auto key = unique_key();
    EXPECT_EQ(Outcome::kExecuted,
              guard.run(key, "fp", [](pqxx::work&) { return std::string("ok"); }).outcome);
    EXPECT_EQ(Outcome::kReplayed,
              guard.run(key, "fp", [](pqxx::work&) { return std::string("no"); }).outcome);
  }
  // No unique key on (key, scope), or a NOT NULL column idem does not write: refused by name,
  // nothing recorded.
  struct Case {
    std::string table, ddl, says;
  };
  const std::vector<Case> cases = {
      {"no_unique", "idem_key varchar(128) NOT NULL, biz_type varchar(64) NOT NULL," + columns,
       "unique key"},
      {"wider_unique",
       "idem_key varchar(128) NOT NULL, biz_type varchar(64) NOT NULL," + columns +
           ", UNIQUE (idem_key, biz_type, status)",
       "unique key"},
      {"extra_column",
       "idem_key varchar(128) NOT NULL, biz_type varchar(64) NOT NULL, tenant text NOT NULL," +
           columns + ", PRIMARY KEY (idem_key, biz_type)",
       "(tenant)"},
  };
  for (const auto& c : cases) {
    pg::exec("CREATE TABLE " + schema + "." + c.table + " (" + c.ddl + ")");
    auto oc = o;
    oc.table = c.table;
    try {
      PostgresStore store(oc);
      ADD_FAILURE() << c.table << " was used";
    } catch (const idem::UsageError& e) {
      EXPECT_NE(std::string::npos, std::string(e.what()).find(c.says)) << e.what();
    }
    EXPECT_EQ(0, version_of(c.table)) << c.table;
  }
  // Newer than this idem: refused by a store that does not migrate too, at its first use.
  pg::exec("UPDATE " + schema + ".idem_schema_version SET version = 3");
  auto plain = o;
  plain.migrate = false;
  PostgresStore store(plain);
  try {
    (void)store.lookup(unique_key());
    ADD_FAILURE() << "a newer table was read";
  } catch (const idem::StorageError& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("newer than this idem")) << e.what();
    // Named with its schema, as docs/versioning.md shows.
    EXPECT_NE(std::string::npos, std::string(e.what()).find("'" + schema + ".")) << e.what();
  }
  pg::exec("DROP SCHEMA " + schema + " CASCADE");
}

// Tables the store creates compare their key columns byte by byte (COLLATE "C"), plain and
// hash-partitioned, whatever the database's default collation; keys still round-trip exactly.
TEST_F(PostgresStoreTest, KeyColumnsOfNewTablesCompareBytes) {
  const std::string schema = idem::test::unique_name("idem_collate");
  auto api = pg::options();
  api.schema = schema;
  auto mq = idem::postgres::PostgresStoreOptions::mq_consume_record(pg::dsn());
  mq.schema = schema;
  auto parted = pg::options();
  parted.schema = schema;
  parted.table = "api_parted";
  parted.partitions = 4;
  for (const auto& o : {api, mq, parted}) {
    PostgresStore store(o);
    EXPECT_EQ(2, pg::scalar("SELECT count(*) FROM information_schema.columns"
                            " WHERE table_schema = '" + schema + "' AND table_name = '" +
                            o.table + "' AND column_name IN ('" + o.key_column + "', '" +
                            o.scope_column + "') AND collation_name = 'C'"))
        << o.table;
    idem::IdempotencyGuard guard{store};
    // Ids that sort differently under a locale than byte by byte, or differ only in case.
    for (const char* id : {"Order-1", "order-1", "order_1", "order~1"}) {
      auto key = Key::make("collate.test", id);
      EXPECT_EQ(Outcome::kExecuted,
                guard.run(key, "", [&](pqxx::work&) { return std::string(id); }).outcome);
      auto r = guard.run(key, "", [](pqxx::work&) { return std::string("again"); });
      EXPECT_EQ(Outcome::kReplayed, r.outcome);
      EXPECT_EQ(std::string(id), *r.value);
    }
  }
  pg::exec("DROP SCHEMA " + schema + " CASCADE");
}

TEST_F(PostgresStoreTest, ShippedSchemaSqlCreatesWhatTheStoreUses) {
  const std::string schema = idem::test::unique_name("idem_sql");
  const std::string cmd = "PGOPTIONS='-c client_min_messages=warning' psql \"" + pg::dsn() +
                          "\" -q -v ON_ERROR_STOP=1 -v schema=" + schema +
                          " -f " IDEM_SOURCE_DIR "/src/postgres/schema.sql >/dev/null";
  ASSERT_EQ(0, std::system(cmd.c_str())) << cmd;
  ASSERT_EQ(0, std::system(cmd.c_str())) << "second run: " << cmd;  // a no-op
  EXPECT_EQ(2, pg::scalar("SELECT count(*) FROM " + schema + ".idem_schema_version"));
  // The key columns compare bytes, as in the tables the store creates.
  EXPECT_EQ(4, pg::scalar("SELECT count(*) FROM information_schema.columns WHERE table_schema = '" +
                          schema + "' AND column_name IN ('idem_key', 'biz_type', 'message_id',"
                          " 'consumer_group') AND collation_name = 'C'"));
  for (auto o : {pg::options(), idem::postgres::PostgresStoreOptions::mq_consume_record()}) {
    o.conninfo = pg::dsn();
    o.schema = schema;
    o.migrate = false;
    PostgresStore store(o);
    idem::IdempotencyGuard guard{store};
    auto key = unique_key();
    EXPECT_EQ(Outcome::kExecuted,
              guard.run(key, "", [](pqxx::work&) { return std::string("ok"); }).outcome);
    EXPECT_EQ(Outcome::kReplayed,
              guard.run(key, "", [](pqxx::work&) { return std::string("no"); }).outcome);
  }
  {
    PostgresStore migrating([&] {  // the built-in migration sees version 2: nothing to do
      auto o = pg::options();
      o.schema = schema;
      return o;
    }());
  }
  EXPECT_EQ(2, pg::scalar("SELECT count(*) FROM " + schema + ".idem_schema_version"));
  pg::exec("DROP SCHEMA " + schema + " CASCADE");
}

TEST_F(PostgresStoreTest, PurgeSkipsRowsLockedByOthersInsteadOfWaiting) {
  std::vector<Key> keys;
  for (int i = 0; i < 3; ++i) {
    keys.push_back(unique_key());
    (void)store_->run_transactional(keys.back(), "", OwnerToken::generate(),
                                    std::chrono::seconds(1),
                                    [](pqxx::work&) { return std::string(); });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  pqxx::connection other(pg::dsn());
  pqxx::work locker(other);
  locker.exec_params(
      "SELECT 1 FROM " + pg::table("api_idempotency") + " WHERE idem_key = $1 FOR UPDATE",
      keys[0].id());
  store_->purge_expired(100);  // returns although keys[0] is locked
  EXPECT_TRUE(store_->lookup(keys[0]).has_value());
  EXPECT_FALSE(store_->lookup(keys[1]).has_value());
  EXPECT_FALSE(store_->lookup(keys[2]).has_value());
  locker.abort();
  store_->purge_expired(100);
  EXPECT_FALSE(store_->lookup(keys[0]).has_value());
}

TEST_F(PostgresStoreTest, MqConsumeRecordPresetUsesItsOwnTable) {
  auto o = idem::postgres::PostgresStoreOptions::mq_consume_record(pg::dsn());
  o.schema = pg::Schema::name();
  PostgresStore mq(o);
  auto key = Key::make("billing-consumer", idem::test::unique_name("msg"));
  auto owner = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, mq.begin(key, "", owner, std::chrono::seconds(30)).status);
  EXPECT_TRUE(mq.fail(key, owner, "poison", std::chrono::seconds(60)));
  auto r = mq.begin(key, "", OwnerToken::generate(), std::chrono::seconds(30));
  EXPECT_EQ(ClaimStatus::kDone, r.status);
  EXPECT_TRUE(r.failed);
  EXPECT_EQ("poison", r.response);
  EXPECT_EQ(1, pg::count_where("mq_consume_record", "message_id", key.id()));
}

TEST_F(PostgresStoreTest, RejectsBadIdentifiersBeforeConnecting) {
  auto o = pg::options();
  o.schema = "public; DROP SCHEMA x";
  EXPECT_THROW(PostgresStore{o}, idem::UsageError);
  o = pg::options();
  o.table = "1table";
  EXPECT_THROW(PostgresStore{o}, idem::UsageError);
  // What PostgreSQL itself refuses or changes in an unquoted name: a reserved word (a syntax
  // error at the first statement), upper case (folded, so its catalog lookups missed it), a
  // table name whose "_expires_idx" index name PostgreSQL would cut to the primary key's.
  for (auto set : std::initializer_list<void (*)(idem::postgres::PostgresStoreOptions&)>{
           [](auto& x) { x.schema = "select"; }, [](auto& x) { x.schema = "Public"; },
           [](auto& x) { x.table = "Orders"; }, [](auto& x) { x.table = "user"; },
           [](auto& x) { x.key_column = "order"; }, [](auto& x) { x.scope_column = "Scope"; },
           [](auto& x) { x.table = std::string(52, 't'); }}) {
    o = pg::options();
    set(o);
    EXPECT_THROW(PostgresStore{o}, idem::UsageError);
  }
  o = pg::options();
  o.table = std::string(51, 't');
  o.migrate = false;  // the longest table name is accepted
  EXPECT_NO_THROW(PostgresStore{o});
}

TEST_F(PostgresStoreTest, AUriPasswordWithARawAtIsRefusedWithoutShowingIt) {
  // libpq ends the user information at the first '@': the rest of the password would be the
  // host name that its "could not translate host name" quotes.
  auto o = pg::options();
  o.conninfo = "postgresql://idem:first@SecretTail@127.0.0.1:1/idem_test";
  try {
    PostgresStore store{o};
    ADD_FAILURE() << "accepted";
  } catch (const idem::UsageError& e) {
    EXPECT_EQ(std::string::npos, std::string(e.what()).find("SecretTail")) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("%40")) << e.what();
  }
  o.conninfo = "postgresql://idem:first%40SecretTail@127.0.0.1:1/idem_test?connect_timeout=2";
  EXPECT_THROW(PostgresStore{o}, idem::StorageUnavailable);  // encoded: parsed, then unreachable
}

TEST_F(PostgresStoreTest, UnreachableServerIsUnavailable) {
  auto o = pg::options();
  o.conninfo = "host=127.0.0.1 port=1 user=postgres dbname=idem_test connect_timeout=2";
  EXPECT_THROW(PostgresStore{o}, idem::StorageUnavailable);
  o.migrate = false;
  PostgresStore lazy(o);  // connects lazily
  EXPECT_THROW((void)lazy.lookup(unique_key()), idem::StorageUnavailable);
  idem::IdempotencyGuard guard{lazy};
  EXPECT_THROW((void)guard.run(unique_key(), "", [](pqxx::work&) { return std::string(); }),
               idem::StorageUnavailable);
}

TEST_F(PostgresStoreTest, MisconfigurationIsNotRetryable) {
  // What stays wrong is a UsageError (errc invalid_argument, not retryable) from the
  // constructor and, with migrate off, from the first call; the server's text is kept.
  // A later keyword of a conninfo string overrides an earlier one.
  const std::string dsn = pg::dsn() + " ";
  struct Case {
    std::string conninfo, says;
  };
  const std::vector<Case> cases = {
      {dsn + "dbname=idem_no_such_database", "does not exist"},
      {dsn + "user=idem_no_such_role", "does not exist"},
      {"postgresql://postgres@127.0.0.1/idem_test?no_such_option=1", "URI query parameter"},
      {dsn + "dbname", "missing \"=\""},
      {"postgresql://postgres@127.0.0.1:not_a_port/idem_test", "invalid integer value"},
  };
  for (const auto& c : cases) {
    auto o = pg::options();
    o.conninfo = c.conninfo;
    try {
      PostgresStore store{o};
      ADD_FAILURE() << c.conninfo << ": connected";
    } catch (const idem::UsageError& e) {
      EXPECT_EQ(idem::errc::kInvalidArgument, e.code()) << c.conninfo;
      EXPECT_FALSE(e.retryable());
      EXPECT_NE(std::string::npos, std::string(e.what()).find(c.says)) << e.what();
    }
    o.migrate = false;
    PostgresStore lazy{o};
    idem::IdempotencyGuard guard{lazy};
    EXPECT_THROW((void)guard.run(unique_key(), "", [](pqxx::work&) { return std::string(); }),
                 idem::UsageError)
        << c.conninfo;
  }
  // A server that is not there is still an outage (retryable), not a misconfiguration.
  auto o = pg::options();
  o.conninfo = "host=127.0.0.1 port=1 user=postgres dbname=idem_test connect_timeout=2";
  EXPECT_THROW(PostgresStore{o}, idem::StorageUnavailable);
}

TEST_F(PostgresStoreTest, PoolIsBoundedAndReplacesBrokenConnections) {
  auto o = pg::options();
  o.migrate = false;
  o.pool_size = 1;
  o.pool_wait = std::chrono::milliseconds(100);
  PostgresStore store(o);
  auto key = unique_key();
  int pid = 0;
  {
    auto held = store.pool().acquire();
    pid = held.get().backendpid();
    EXPECT_THROW((void)store.lookup(key), idem::StorageUnavailable);  // exhausted
  }
  EXPECT_FALSE(store.lookup(key).has_value());
  // Kill the idle pooled connection's backend: the next call replaces it and succeeds.
  pg::exec("SELECT pg_terminate_backend(" + std::to_string(pid) + ", 10000)");
  EXPECT_FALSE(store.lookup(key).has_value());
  idem::IdempotencyGuard guard{store};
  pid = 0;
  {
    auto held = store.pool().acquire();
    pid = held.get().backendpid();
  }
  pg::exec("SELECT pg_terminate_backend(" + std::to_string(pid) + ", 10000)");
  auto r = guard.run(key, "", [&](pqxx::work& tx) {
    pg::insert_effect(tx, key.id());
    return std::string("ok");
  });
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", key.id()));
  EXPECT_EQ(1u, store.pool().open_connections());
  // The same for a plain transaction (with_transaction): its BEGIN finds the connection dead
  // before the function ran, so it begins once more on a fresh one (a server restart left
  // every pooled connection so).
  {
    auto held = store.pool().acquire();
    pid = held.get().backendpid();
  }
  pg::exec("SELECT pg_terminate_backend(" + std::to_string(pid) + ", 10000)");
  int runs = 0;
  store.with_transaction([&](pqxx::work& tx) {
    ++runs;
    pg::insert_effect(tx, key.id());
  });
  EXPECT_EQ(1, runs);
  EXPECT_EQ(2, pg::count_where("idem_test_effects", "key_id", key.id()));
}

TEST_F(PostgresStoreTest, StatementTimeoutIsAStorageTimeout) {
  auto o = pg::options();
  o.migrate = false;
  o.statement_timeout = std::chrono::milliseconds(100);
  PostgresStore store(o);
  EXPECT_THROW(store.with_transaction([](pqxx::work& tx) { tx.exec("SELECT pg_sleep(1)"); }),
               idem::StorageTimeout);
}

// A server that ends a session whose transaction stayed idle too long
// (idle_in_transaction_session_timeout) while the handler works outside SQL: nothing commits,
// the error is retryable and says what the transaction was doing (libpqxx reports only a
// connection that is gone), and a quicker retry runs once.
TEST_F(PostgresStoreTest, ASessionEndedUnderASlowHandlerSaysSo) {
  auto o = pg::options();
  o.migrate = false;
  o.conninfo += " options='-c idle_in_transaction_session_timeout=200'";
  PostgresStore store(o);
  auto key = unique_key();
  int runs = 0;
  auto slow = [&](pqxx::work& tx) {
    ++runs;
    pg::insert_effect(tx, key.id());
    std::this_thread::sleep_for(std::chrono::milliseconds(700));
    return std::string("r");
  };
  try {
    (void)store.run_transactional(key, "fp", OwnerToken::generate(), std::chrono::seconds(60),
                                  slow);
    ADD_FAILURE() << "committed past idle_in_transaction_session_timeout";
  } catch (const idem::StorageUnavailable& e) {
    EXPECT_TRUE(e.retryable());
    EXPECT_NE(std::string::npos, std::string(e.what()).find("idle_in_transaction_session_timeout"))
        << e.what();
  }
  EXPECT_EQ(0, pg::count_where("idem_test_effects", "key_id", key.id()));
  EXPECT_FALSE(store.lookup(key).has_value());
  auto quick = store.run_transactional(key, "fp", OwnerToken::generate(), std::chrono::seconds(60),
                                       [&](pqxx::work& tx) {
                                         ++runs;
                                         pg::insert_effect(tx, key.id());
                                         return std::string("r");
                                       });
  EXPECT_EQ(idem::TransactionalStatus::kCommitted, quick.status);
  EXPECT_EQ(2, runs);
  EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", key.id()));
}

// An adopted table without idem's CHECK on status: a status idem did not write is CorruptRecord
// for every reader (never a busy key, never a takeover).
TEST_F(PostgresStoreTest, ForeignStatusInAnAdoptedTableIsACorruptRecord) {
  const std::string t = pg::table("adopted_no_check");
  pg::exec("CREATE TABLE IF NOT EXISTS " + t +
           " (idem_key varchar(128) NOT NULL, biz_type varchar(64) NOT NULL,"
           " status varchar(32) NOT NULL, fingerprint text NOT NULL DEFAULT '',"
           " owner varchar(64) NOT NULL, response_body bytea, lease_until timestamptz NOT NULL,"
           " expires_at timestamptz, attempts integer NOT NULL DEFAULT 1,"
           " created_at timestamptz NOT NULL DEFAULT now(),"
           " updated_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (idem_key, biz_type))");
  auto key = unique_key();
  pg::exec("INSERT INTO " + t + " (idem_key, biz_type, status, fingerprint, owner, lease_until)" +
           " VALUES ('" + key.id() + "', '" + key.scope() + "', 'PROCESSING', 'fp', 'x', now())");
  auto o = pg::options();
  o.table = "adopted_no_check";
  o.migrate = false;
  PostgresStore store(o);
  bool ran = false;
  EXPECT_THROW((void)store.begin(key, "fp", OwnerToken::generate(), std::chrono::seconds(30)),
               idem::CorruptRecord);
  EXPECT_THROW((void)store.run_transactional(key, "fp", OwnerToken::generate(),
                                             std::chrono::seconds(60),
                                             [&](pqxx::work&) {
                                               ran = true;
                                               return std::string("x");
                                             }),
               idem::CorruptRecord);
  EXPECT_THROW((void)store.lookup(key), idem::CorruptRecord);
  EXPECT_FALSE(ran);
}

// The guard's heartbeat: extend moves the lease on the server's clock, only for the holder.
TEST_F(PostgresStoreTest, ExtendIsOwnerCheckedAndKeepsAClaimFromBeingTakenOver) {
  auto key = Key::make("pg.extend", idem::test::unique_name("extend"));
  auto mine = idem::OwnerToken::generate();
  auto other = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed, store_->begin(key, "", mine, 100ms, {}).status);
  EXPECT_FALSE(store_->extend(key, other, 10s));
  EXPECT_TRUE(store_->extend(key, mine, 10s));
  std::this_thread::sleep_for(250ms);  // past the first lease, within the extended one
  auto c = store_->begin(key, "", other, 100ms, {});
  EXPECT_EQ(idem::ClaimStatus::kBusy, c.status);
  EXPECT_FALSE(c.took_over);
  ASSERT_TRUE(store_->complete(key, mine, "done", std::chrono::seconds(60)));
  EXPECT_FALSE(store_->extend(key, mine, 10s)) << "a completed record is not extended";
  EXPECT_THROW((void)store_->extend(key, mine, 0ms), idem::UsageError);
}

// ---------------------------------------------------------------------------------------------
// Database errors of a transactional handler's own statements are typed as idem's own are, the
// libpqxx exception nested as the cause; other handler exceptions propagate unchanged.

// The SQLSTATE of the libpqxx exception nested in `e` ("" when none is nested).
std::string nested_sqlstate(const std::exception& e) {
  try {
    std::rethrow_if_nested(e);
  } catch (const pqxx::sql_error& s) {  // libpqxx 7: every server error, rollbacks included
    return s.sqlstate();
  } catch (const pqxx::deadlock_detected&) {  // libpqxx 6: rollbacks carry no SQLSTATE
    return "40P01";
  } catch (const pqxx::serialization_failure&) {
    return "40001";
  } catch (const pqxx::broken_connection&) {
    return "broken_connection";
  } catch (const std::exception& other) {
    return std::string("not pqxx: ") + other.what();
  }
  return "";
}

TEST_F(PostgresStoreTest, HandlerDeadlockAfterTheRetriesIsStorageUnavailableWithItsCause) {
  auto o = pg::options();
  o.migrate = false;
  o.max_retries = 0;  // the first deadlock is final
  PostgresStore store(o);
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, store};
  auto base = unique_key();
  const std::string a = base.id() + "_a", b = base.id() + "_b";
  pg::exec("INSERT INTO " + pg::table("account") + " VALUES ('" + a + "', 0), ('" + b + "', 0)");
  std::atomic<int> at_barrier{0};
  auto body = [&](const std::string& id, const std::string& first, const std::string& second) {
    return [&, id, first, second](pqxx::work& tx) {
      tx.exec_params("UPDATE " + pg::table("account") + " SET balance = balance + 1 WHERE id = $1",
                     first);
      ++at_barrier;  // both hold their first row, then each asks for the other's
      while (at_barrier.load() < 2) std::this_thread::yield();
      tx.exec_params("UPDATE " + pg::table("account") + " SET balance = balance + 1 WHERE id = $1",
                     second);
      pg::insert_effect(tx, id);
      return std::string("done");
    };
  };
  const Key k1 = Key::make("transfer", base.id() + "_t1");
  const Key k2 = Key::make("transfer", base.id() + "_t2");
  std::atomic<int> executed{0}, unavailable{0}, other{0};
  std::string state, retry_key;
  std::mutex mutex;
  auto transfer = [&](const Key& k, const std::string& first, const std::string& second) {
    try {
      auto r = guard.run(k, "", body(k.id(), first, second));
      if (r.outcome == Outcome::kExecuted) ++executed;
    } catch (const idem::StorageUnavailable& e) {
      ++unavailable;
      EXPECT_TRUE(e.retryable());
      EXPECT_NE(std::string(e.what()).find("40P01"), std::string::npos) << e.what();
      std::lock_guard<std::mutex> lock(mutex);
      state = nested_sqlstate(e);
      retry_key = k.id();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "untyped: " << e.what();
      ++other;
    }
  };
  std::thread t1([&] { transfer(k1, a, b); });
  std::thread t2([&] { transfer(k2, b, a); });
  t1.join();
  t2.join();
  ASSERT_EQ(1, executed.load());
  ASSERT_EQ(1, unavailable.load());
  EXPECT_EQ(0, other.load());
  EXPECT_EQ("40P01", state);
  EXPECT_EQ(0u, store.stats().retries);
  // The failed call left no record and released its fast claim: the retry runs at once.
  const Key& failed = retry_key == k1.id() ? k1 : k2;
  EXPECT_FALSE(store.lookup(failed).has_value());
  EXPECT_EQ(0, pg::count_where("idem_test_effects", "key_id", failed.id()));
  at_barrier = 2;
  auto retry = guard.run(failed, "", body(failed.id(), failed == k1 ? a : b, failed == k1 ? b : a));
  EXPECT_EQ(Outcome::kExecuted, retry.outcome);
  EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", k1.id()));
  EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", k2.id()));
  EXPECT_EQ(4, pg::scalar("SELECT sum(balance) FROM " + pg::table("account") + " WHERE id IN ('" +
                          a + "', '" + b + "')"));
}

TEST_F(PostgresStoreTest, HandlerLockTimeoutOnABusinessRowIsStorageTimeoutWithItsCause) {
  auto o = pg::options();
  o.migrate = false;
  o.lock_timeout = std::chrono::milliseconds(200);
  PostgresStore store(o);
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, store};
  auto key = unique_key();
  const std::string account = key.id();
  pg::exec("INSERT INTO " + pg::table("account") + " VALUES ('" + account + "', 0)");
  int runs = 0;
  auto debit = [&](pqxx::work& tx) {
    ++runs;
    tx.exec_params("UPDATE " + pg::table("account") + " SET balance = balance - 1 WHERE id = $1",
                   account);
    pg::insert_effect(tx, key.id());
    return std::string("debited");
  };
  {
    // Another connection holds the business row for longer than lock_timeout.
    pqxx::connection holder(pg::dsn());
    pqxx::work lock(holder);
    lock.exec_params("SELECT 1 FROM " + pg::table("account") + " WHERE id = $1 FOR UPDATE",
                     account);
    try {
      (void)guard.run(key, "", debit);
      ADD_FAILURE() << "the handler's statement did not time out";
    } catch (const idem::StorageTimeout& e) {
      EXPECT_TRUE(e.retryable());
      EXPECT_EQ(idem::errc::kStoreTimeout, e.code());
      EXPECT_EQ("55P03", nested_sqlstate(e));
      EXPECT_NE(std::string(e.what()).find("55P03"), std::string::npos) << e.what();
    }
    lock.abort();
  }
  EXPECT_EQ(1, runs);
  EXPECT_FALSE(store.lookup(key).has_value());  // rolled back with the handler's writes
  EXPECT_EQ(0, pg::count_where("idem_test_effects", "key_id", key.id()));
  auto retry = guard.run(key, "", debit);  // the fast claim was released: runs at once
  EXPECT_EQ(Outcome::kExecuted, retry.outcome);
  EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", key.id()));
  EXPECT_EQ(-1, pg::scalar("SELECT balance FROM " + pg::table("account") + " WHERE id = '" +
                           account + "'"));
}

TEST_F(PostgresStoreTest, HandlerStatementErrorsAreTypedAndOtherExceptionsUnchanged) {
  idem::IdempotencyGuard guard{*store_};
  // A constraint violation of the handler's own statement: StorageError (not retryable), the
  // pqxx::unique_violation nested.
  auto key = unique_key();
  pg::exec("INSERT INTO " + pg::table("account") + " VALUES ('" + key.id() + "', 0)");
  try {
    (void)guard.run(key, "", [&](pqxx::work& tx) {
      tx.exec_params("INSERT INTO " + pg::table("account") + " VALUES ($1, 0)", key.id());
      return std::string("never");
    });
    ADD_FAILURE() << "no exception";
  } catch (const idem::StorageError& e) {
    EXPECT_FALSE(e.retryable());
    EXPECT_EQ("23505", nested_sqlstate(e));
    bool unique = false;
    try {
      std::rethrow_if_nested(e);
    } catch (const pqxx::unique_violation&) {
      unique = true;
    } catch (...) {
    }
    EXPECT_TRUE(unique);
  }
  EXPECT_FALSE(store_->lookup(key).has_value());
  // The handler's own connection killed under it: StorageUnavailable, cause nested.
  auto killed = unique_key();
  try {
    (void)guard.run(killed, "", [&](pqxx::work& tx) {
      tx.exec("SELECT pg_terminate_backend(pg_backend_pid())");
      return std::string("never");
    });
    ADD_FAILURE() << "no exception";
  } catch (const idem::StorageUnavailable& e) {
    EXPECT_TRUE(e.retryable());
    EXPECT_FALSE(nested_sqlstate(e).empty());
    EXPECT_EQ(std::string::npos, nested_sqlstate(e).find("not pqxx")) << nested_sqlstate(e);
  }
  EXPECT_EQ(Outcome::kExecuted,
            guard.run(killed, "", [](pqxx::work&) { return std::string("ok"); }).outcome);
  // Exceptions that are not database errors propagate as they were thrown.
  struct NotADatabaseError {
    int code;
  };
  try {
    (void)guard.run(unique_key(), "",
                    [](pqxx::work&) -> std::string { throw NotADatabaseError{7}; });
    ADD_FAILURE() << "no exception";
  } catch (const NotADatabaseError& e) {
    EXPECT_EQ(7, e.code);
  }
  EXPECT_THROW((void)guard.run(
                   unique_key(), "",
                   [](pqxx::work&) -> std::string { throw std::invalid_argument("bad amount"); }),
               std::invalid_argument);
  // An idem error the handler throws itself is not re-wrapped either.
  EXPECT_THROW((void)guard.run(
                   unique_key(), "",
                   [](pqxx::work&) -> std::string { throw idem::UsageError("from the handler"); }),
               idem::UsageError);
}

// ---------------------------------------------------------------------------------------------
// Every wait is bounded on the client (client_timeout): a proxy that stops forwarding without
// closing anything (the TCP connection stays up, the client's bytes are acknowledged).

// A store that reaches the server through `proxy`, with client_timeout 500 ms.
idem::postgres::PostgresStoreOptions behind(const idem::test::CommitDroppingProxy& proxy) {
  auto o = pg::options();
  o.migrate = false;
  o.conninfo = pg::dsn_with_port(proxy.port());
  o.client_timeout = std::chrono::milliseconds(500);
  return o;
}

TEST_F(PostgresStoreTest, StalledServerAnswersATypedErrorWithinTheClientTimeout) {
  idem::test::CommitDroppingProxy proxy(pg::dsn_port());
  PostgresStore store(behind(proxy));
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, store};
  int runs = 0;
  auto transactional = [&](const Key& k) {
    return [&runs, k](pqxx::work& tx) {
      ++runs;
      pg::insert_effect(tx, k.id());
      return std::string("paid");
    };
  };
  auto warm = unique_key();
  ASSERT_EQ(Outcome::kExecuted, guard.run(warm, "", transactional(warm)).outcome);
  ASSERT_EQ(1u, store.pool().open_connections());
  proxy.stalled = true;
  // Transactional, on the pooled connection: its claim waits; the deadline cancels it and cuts
  // the connection. Typed and retryable, well before the 30 s lease.
  auto k1 = unique_key();
  auto t0 = std::chrono::steady_clock::now();
  try {
    (void)guard.run(k1, "", transactional(k1));
    ADD_FAILURE() << "a stalled claim answered";
  } catch (const idem::StorageTimeout& e) {
    EXPECT_TRUE(e.retryable());
    EXPECT_NE(std::string::npos, std::string(e.what()).find("client_timeout")) << e.what();
  }
  auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(waited, std::chrono::seconds(3));
  EXPECT_EQ(1, runs);                              // only the warm-up ran
  EXPECT_EQ(0u, store.pool().open_connections());  // the cut connection was dropped
  // Two-phase, on a new connection: its start-up waits; connect_timeout (libpq's minimum is
  // 2 s) ends it: StorageUnavailable, retryable.
  auto k2 = unique_key();
  t0 = std::chrono::steady_clock::now();
  int external = 0;
  try {
    (void)guard.run(k2, "", [&] {
      ++external;
      return std::string("sent");
    });
    ADD_FAILURE() << "a stalled begin answered";
  } catch (const idem::StorageError& e) {
    EXPECT_TRUE(e.retryable()) << e.what();
    EXPECT_TRUE(e.code() == idem::errc::kStoreTimeout || e.code() == idem::errc::kStoreUnavailable)
        << e.what();
  }
  waited = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(waited, std::chrono::seconds(6));
  EXPECT_EQ(0, external);
  // Forwarding again: both retries run at once (the fast claims were released), each effect
  // once, and nothing of the cut attempts committed.
  proxy.stalled = false;
  EXPECT_EQ(Outcome::kExecuted, guard.run(k1, "", transactional(k1)).outcome);
  EXPECT_EQ(Outcome::kExecuted, guard
                                    .run(k2, "",
                                         [&] {
                                           ++external;
                                           return std::string("sent");
                                         })
                                    .outcome);
  EXPECT_EQ(1, external);
  EXPECT_EQ(1, pg::count_where("idem_test_effects", "key_id", k1.id()));
  EXPECT_EQ(Outcome::kReplayed, guard.run(k1, "", transactional(k1)).outcome);
  EXPECT_EQ(2, runs);
}

TEST_F(PostgresStoreTest, StalledTwoPhaseCompletionIsBoundedAndTheRecordStaysHeld) {
  idem::test::CommitDroppingProxy proxy(pg::dsn_port());
  PostgresStore store(behind(proxy));
  idem::IdempotencyGuard guard{store};
  auto key = unique_key();
  auto t0 = std::chrono::steady_clock::now();
  try {
    (void)guard.run(key, "", [&] {
      proxy.stalled = true;  // the gateway answered; then the database path hangs
      return std::string("sent");
    });
    ADD_FAILURE() << "a stalled completion answered";
  } catch (const idem::OutcomeUnknown& e) {
    // The handler ran; its completion timed out (the store's StorageTimeout, named inside).
    EXPECT_TRUE(e.retryable());
    EXPECT_NE(std::string::npos, std::string(e.what()).find("client_timeout")) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  proxy.stalled = false;
  // The record is still this attempt's, in progress: a duplicate is told "in progress" (the
  // lease decides, as after a crash between the phases), never run twice.
  auto rec = store.lookup(key);
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(idem::Record::Status::kInProgress, rec->status);
  int again = 0;
  auto dup = guard.run(key, "", [&] {
    ++again;
    return std::string("twice");
  });
  EXPECT_EQ(Outcome::kInProgress, dup.outcome);
  EXPECT_EQ(0, again);
}

TEST_F(PostgresStoreTest, ClientTimeoutIsValidated) {
  auto o = pg::options();
  o.migrate = false;
  o.client_timeout = std::chrono::milliseconds(-1);
  EXPECT_THROW(PostgresStore{o}, idem::UsageError);
  o.client_timeout = std::chrono::milliseconds(0);  // no bound: allowed
  PostgresStore unbounded(o);
  idem::IdempotencyGuard guard{unbounded};
  auto key = unique_key();
  EXPECT_EQ(Outcome::kExecuted,
            guard.run(key, "", [](pqxx::work&) { return std::string("ok"); }).outcome);
}

}  // namespace

// DurableHint::expected_response: the claim inserts the record completed and, when the
// handler's response is the expected one, nothing updates it (the row is still its first
// version: ctid (0,1) in a fresh table); another response is written over it, and without the
// hint the completion UPDATE writes a second version. The records read back the same.
TEST_F(PostgresStoreTest, ExpectedResponseInsertsTheRecordCompletedAndSkipsTheUpdate) {
  auto ctid_after = [](const std::string& table, const char* response, bool hinted) {
    pg::exec("DROP TABLE IF EXISTS " + pg::table(table));
    auto o = pg::options();
    o.table = table;
    PostgresStore store(o);
    idem::DurableHint hint;
    if (hinted) hint.expected_response = "consumed";
    auto key = Key::make("billing", idem::test::unique_name("msg"));
    auto r = store.run_transactional(
        key, "fp", OwnerToken::generate(), std::chrono::seconds(600),
        [&](pqxx::work&) { return std::string(response); }, hint);
    EXPECT_EQ(idem::TransactionalStatus::kCommitted, r.status);
    EXPECT_EQ(response, r.response);
    auto rec = store.lookup(key);
    EXPECT_TRUE(rec.has_value() && rec->status == idem::Record::Status::kCompleted &&
                rec->response == response && rec->fingerprint == "fp");
    auto again = store.run_transactional(key, "fp", OwnerToken::generate(),
                                         std::chrono::seconds(600),
                                         [&](pqxx::work&) { return std::string("x"); }, hint);
    EXPECT_EQ(idem::TransactionalStatus::kReplayed, again.status);
    EXPECT_EQ(response, again.response);
    const std::string ctid = pg::exec("SELECT ctid::text FROM " + pg::table(table))[0][0].c_str();
    pg::exec("DROP TABLE " + pg::table(table));
    return ctid;
  };
  EXPECT_EQ("(0,1)", ctid_after("idem_hint_expected", "consumed", true));
  EXPECT_EQ("(0,2)", ctid_after("idem_hint_other", "another response", true));
  EXPECT_EQ("(0,2)", ctid_after("idem_hint_none", "consumed", false));
}
