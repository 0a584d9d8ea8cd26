// SPDX-License-Identifier: MIT
// AsyncPostgresStore against the real PostgreSQL (IDEM_TEST_POSTGRES_DSN): records shared with
// the synchronous PostgresStore both ways, a thousand two-phase calls in flight on one loop
// thread, lock waits, deadlines (connect, server-side statement, client-side), a completion whose
// answer was lost, the store destroyed with calls in flight, and a row idem did not write. (The
// conformance and guard suites through it: pg_store_conformance_test.cpp, pg_store_guard_test.cpp.)
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "async_guard_suite.hpp"
#include "async_support.hpp"
#include "idem/async/postgres_store.hpp"
#include "pg_store_support.hpp"
#include "tcp_proxy.hpp"

namespace {

using namespace idem::test::async_pg;  // NOLINT(google-build-using-namespace)
using idem::ClaimStatus;
using idem::Key;
using idem::OwnerToken;
using idem::Record;
using namespace std::chrono_literals;

class AsyncPostgresStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { IDEM_REQUIRE_POSTGRES(); }
  static Key key(const std::string& tag) {
    return Key::make("async.pg", idem::test::unique_name(tag));
  }
  static Blocking blocking(Holder& h) { return Blocking(*h.async, h.sync, h.loop.executor()); }
  static void expect_same(const std::optional<Record>& a, const std::optional<Record>& b) {
    ASSERT_EQ(a.has_value(), b.has_value());
    if (!a) return;
    EXPECT_EQ(a->status, b->status);
    EXPECT_EQ(a->fingerprint, b->fingerprint);
    EXPECT_EQ(a->owner, b->owner);
    EXPECT_TRUE(a->response == b->response);
    EXPECT_EQ(a->lease_until, b->lease_until);
    EXPECT_EQ(a->created_at, b->created_at);
    EXPECT_EQ(a->updated_at, b->updated_at);
    EXPECT_EQ(a->expires_at, b->expires_at);
  }
};

std::string binary_bytes() {
  std::string s;
  for (int i = 0; i < 256; ++i) s.push_back(static_cast<char>(255 - i));
  return s;
}

// A record begun by one store is completed, failed, released, taken over or replayed by the
// other, in both directions, and both read it the same, byte for byte.
TEST_F(AsyncPostgresStoreTest, RecordsAreSharedWithPostgresStoreBothWays) {
  Holder h;
  Blocking a = blocking(h);
  PostgresStore& s = h.sync;
  const auto lease = 30s;
  const auto retention = std::chrono::seconds(600);
  const std::string bytes = binary_bytes();

  // async begin -> sync complete -> async replay
  auto k1 = key("a2s");
  auto o1 = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, a.begin(k1, "fp", o1, lease).status);
  auto seen = s.lookup(k1);
  ASSERT_TRUE(seen);
  EXPECT_EQ(Record::Status::kInProgress, seen->status);
  EXPECT_EQ(o1.str(), seen->owner);
  EXPECT_EQ(ClaimStatus::kBusy, s.begin(k1, "fp", OwnerToken::generate(), lease).status);
  EXPECT_EQ(ClaimStatus::kMismatch, s.begin(k1, "other", OwnerToken::generate(), lease).status);
  EXPECT_TRUE(s.complete(k1, o1, bytes, retention));
  auto r1 = a.begin(k1, "fp", OwnerToken::generate(), lease);
  EXPECT_EQ(ClaimStatus::kDone, r1.status);
  EXPECT_TRUE(bytes == r1.response);
  expect_same(s.lookup(k1), a.lookup(k1));

  // sync begin -> async complete -> sync replay
  auto k2 = key("s2a");
  auto o2 = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, s.begin(k2, "fp", o2, lease).status);
  auto busy = a.begin(k2, "fp", OwnerToken::generate(), lease);
  EXPECT_EQ(ClaimStatus::kBusy, busy.status);
  EXPECT_EQ(o2.str(), busy.holder);
  EXPECT_FALSE(a.complete(k2, OwnerToken::generate(), "not mine", retention));
  EXPECT_TRUE(a.complete(k2, o2, bytes, retention));
  auto r2 = s.begin(k2, "fp", OwnerToken::generate(), lease);
  EXPECT_EQ(ClaimStatus::kDone, r2.status);
  EXPECT_TRUE(bytes == r2.response);
  expect_same(s.lookup(k2), a.lookup(k2));

  // a transaction on the synchronous store, replayed and refused (mismatch) by the async one
  auto k3 = key("tx");
  auto t = s.run_transactional(k3, "fp", OwnerToken::generate(), retention,
                               [&](pqxx::work&) { return bytes; });
  ASSERT_EQ(idem::TransactionalStatus::kCommitted, t.status);
  EXPECT_TRUE(bytes == a.begin(k3, "fp", OwnerToken::generate(), lease).response);
  EXPECT_EQ(ClaimStatus::kMismatch, a.begin(k3, "fp2", OwnerToken::generate(), lease).status);

  // async fail -> replayed as failed by the sync store; async release of a sync claim
  auto k4 = key("fail");
  auto o4 = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, a.begin(k4, "", o4, lease).status);
  EXPECT_TRUE(a.fail(k4, o4, "poison", retention));
  auto r4 = s.begin(k4, "", OwnerToken::generate(), lease);
  EXPECT_EQ(ClaimStatus::kDone, r4.status);
  EXPECT_TRUE(r4.failed);
  EXPECT_EQ("poison", r4.response);
  auto k5 = key("release");
  auto o5 = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, s.begin(k5, "", o5, lease).status);
  EXPECT_FALSE(a.release(k5, OwnerToken::generate()));
  EXPECT_TRUE(a.release(k5, o5));
  EXPECT_FALSE(s.lookup(k5).has_value());

  // an expired lease of one store taken over by the other; the stale owner is fenced
  auto k6 = key("takeover");
  auto stale = OwnerToken::generate();
  auto fresh = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, s.begin(k6, "fp", stale, 100ms).status);
  std::this_thread::sleep_for(300ms);
  auto took = a.begin(k6, "fp", fresh, lease);
  EXPECT_EQ(ClaimStatus::kClaimed, took.status);
  EXPECT_TRUE(took.took_over);
  EXPECT_FALSE(s.complete(k6, stale, "stale", retention));
  EXPECT_FALSE(a.complete(k6, stale, "stale", retention));
  EXPECT_TRUE(s.complete(k6, fresh, "fresh", retention));
  EXPECT_EQ("fresh", a.begin(k6, "fp", OwnerToken::generate(), lease).response);
  auto k7 = key("takeover_back");
  ASSERT_EQ(ClaimStatus::kClaimed, a.begin(k7, "fp", stale, 100ms).status);
  std::this_thread::sleep_for(300ms);
  EXPECT_TRUE(s.begin(k7, "fp", fresh, lease).took_over);
  EXPECT_FALSE(a.complete(k7, stale, "stale", retention));
  EXPECT_TRUE(a.complete(k7, fresh, "fresh", retention));
  expect_same(s.lookup(k7), a.lookup(k7));
}

// A record whose retention ended is replaced (a fresh claim, not a takeover); a begin retried by
// the attempt that holds the record keeps its claim.
TEST_F(AsyncPostgresStoreTest, AnEndedRecordIsReplacedAndARetriedBeginKeepsItsClaim) {
  Holder h;
  Blocking a = blocking(h);
  auto k = key("ended");
  auto o = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, a.begin(k, "fp", o, 30s).status);
  ASSERT_TRUE(a.complete(k, o, "old", std::chrono::seconds(600)));
  pg::exec("UPDATE " + pg::table("api_idempotency") +
           " SET expires_at = now() - interval '1 second' WHERE idem_key = '" + k.id() + "'");
  auto o2 = OwnerToken::generate();
  auto c = a.begin(k, "another payload", o2, 30s);
  EXPECT_EQ(ClaimStatus::kClaimed, c.status);
  EXPECT_FALSE(c.took_over);
  auto again = a.begin(k, "another payload", o2, 30s);
  EXPECT_EQ(ClaimStatus::kClaimed, again.status);
  EXPECT_TRUE(again.kept);
  EXPECT_THROW((void)a.begin(k, "fp", o2, 0ms), idem::UsageError);
}

// One loop thread, 1,000 two-phase calls in flight at once over 700 keys (30 % duplicates),
// durable-only: every begin, completion and duplicate goes through the loop's one pipelined
// connection; handlers answer on the loop (on_loop) or later (with_reply). Every call is
// answered, each key's handler runs exactly once, every later call replays, nothing uses a
// worker thread.
TEST_F(AsyncPostgresStoreTest, AThousandTwoPhaseCallsInFlightOnOneLoopLeaveOneEffectPerKey) {
  AsyncPostgresStoreOptions one;
  one.connections = 1;
  Holder h(one);
  idem::async::AsyncGuardOptions go;
  go.pool = &h.workers;
  idem::async::AsyncGuard<AsyncPostgresStore> guard{h.loop.executor(), *h.async, go};
  constexpr int kKeys = 700, kCalls = 1000;
  std::vector<Key> keys;
  for (int i = 0; i < kKeys; ++i) keys.push_back(key("m" + std::to_string(i)));
  auto key_of = [&](int call) { return call < kKeys ? call : (call * 7) % kKeys; };
  std::vector<int> runs(kKeys, 0);  // touched on the loop only
  std::vector<int> pending(kCalls);
  for (int i = 0; i < kCalls; ++i) pending[static_cast<std::size_t>(i)] = i;
  int executed = 0, rounds = 0;
  while (!pending.empty() && rounds++ < 30) {
    std::vector<idem::test::Answer<>> answers(pending.size());
    anet::post(h.loop.io(), [&] {
      for (std::size_t j = 0; j < pending.size(); ++j) {
        const int ki = key_of(pending[j]);
        const Key& k = keys[static_cast<std::size_t>(ki)];
        if (ki % 2 == 0) {
          guard.async_run(k, "fp", idem::async::on_loop([&runs, ki, id = k.id()] {
                            ++runs[static_cast<std::size_t>(ki)];
                            return "pay_" + id;
                          }),
                          answers[j].callback());
        } else {
          guard.async_run(k, "fp",
                          idem::async::with_reply<std::string>(
                              [&runs, ki, id = k.id(), &io = h.loop.io()](auto reply) {
                                ++runs[static_cast<std::size_t>(ki)];
                                anet::post(io, [reply = std::move(reply), id]() mutable {
                                  reply("pay_" + id);
                                });
                              }),
                          answers[j].callback());
        }
      }
    });
    std::vector<int> again;
    for (std::size_t j = 0; j < pending.size(); ++j) {
      const auto& c = answers[j].wait(60s);
      ASSERT_TRUE(c.done) << "call " << pending[j] << " was never answered";
      ASSERT_FALSE(c.error) << idem::test::what_of(c.error);
      const Key& k = keys[static_cast<std::size_t>(key_of(pending[j]))];
      if (c.result.outcome == idem::Outcome::kInProgress) {
        again.push_back(pending[j]);
        continue;
      }
      if (c.result.outcome == idem::Outcome::kExecuted) ++executed;
      EXPECT_TRUE(c.result.outcome == idem::Outcome::kExecuted ||
                  c.result.outcome == idem::Outcome::kReplayed);
      EXPECT_EQ("pay_" + k.id(), c.result.value.value_or(""));
    }
    pending = std::move(again);
  }
  EXPECT_TRUE(pending.empty()) << pending.size() << " calls never completed";
  EXPECT_EQ(kKeys, executed);
  std::promise<std::vector<int>> copy;
  anet::post(h.loop.io(), [&] { copy.set_value(runs); });
  const std::vector<int> ran = copy.get_future().get();
  for (int i = 0; i < kKeys; ++i) ASSERT_EQ(1, ran[static_cast<std::size_t>(i)]) << i;
  EXPECT_EQ(kKeys, pg::scalar("SELECT count(*) FROM " + pg::table("api_idempotency") +
                              " WHERE status = 'completed' AND idem_key IN (" +
                              [&] {
                                std::string in;
                                for (const Key& k : keys) {
                                  in += (in.empty() ? "'" : ",'") + k.id() + "'";
                                }
                                return in;
                              }() +
                              ")"));
  const auto st = h.stats();
  EXPECT_EQ(1u, st.connects) << "everything went through one pipelined connection";
  EXPECT_EQ(0u, st.failed_batches);
  EXPECT_EQ(0u, h.workers.stats().submitted) << "no durable statement took a worker";
}

// A two-phase begin meeting a transaction that holds the key (a transactional call in flight):
// after lock_timeout it answers busy, without waiting for the transaction; once it commits, the
// begin replays it.
TEST_F(AsyncPostgresStoreTest, ABeginMeetingATransactionHoldingTheKeyAnswersBusy) {
  Holder h;
  Blocking a = blocking(h);
  auto k = key("held");
  idem::test::Gate in_tx, release;
  auto tx = std::async(std::launch::async, [&] {
    return h.sync.run_transactional(k, "fp", OwnerToken::generate(), std::chrono::seconds(600),
                                    [&](pqxx::work&) {
                                      in_tx.open();
                                      release.wait();
                                      return std::string("committed");
                                    });
  });
  in_tx.wait();
  const auto c = a.begin(k, "fp", OwnerToken::generate(), 30s);
  EXPECT_EQ(ClaimStatus::kBusy, c.status);
  EXPECT_GE(h.stats().lock_timeouts, 1u);
  release.open();
  ASSERT_EQ(idem::TransactionalStatus::kCommitted, tx.get().status);
  const auto r = a.begin(k, "fp", OwnerToken::generate(), 30s);
  EXPECT_EQ(ClaimStatus::kDone, r.status);
  EXPECT_EQ("committed", r.response);
}

// Per-statement deadlines on the server: a completion waiting on a row lock ends at
// lock_timeout, or, with a long lock_timeout, at statement_timeout (the server cancels it);
// both StorageTimeout, nothing applied, and the connection goes on serving.
TEST_F(AsyncPostgresStoreTest, AStatementPastItsDeadlineIsCancelledByTheServerTyped) {
  for (bool statement : {false, true}) {
    SCOPED_TRACE(statement ? "statement_timeout" : "lock_timeout");
    AsyncPostgresStoreOptions ao;
    if (statement) {
      ao.lock_timeout = 10s;
      ao.statement_timeout = 300ms;
    }
    Holder h(ao);
    Blocking a = blocking(h);
    auto k = key(statement ? "stmt" : "lock");
    auto o = OwnerToken::generate();
    ASSERT_EQ(ClaimStatus::kClaimed, a.begin(k, "fp", o, 30s).status);
    pqxx::connection holder(pg::dsn());
    pqxx::work lock(holder);
    lock.exec("SELECT 1 FROM " + pg::table("api_idempotency") + " WHERE idem_key = '" + k.id() +
              "' FOR UPDATE");
    const auto t0 = std::chrono::steady_clock::now();
    try {
      (void)a.complete(k, o, "late", std::chrono::seconds(60));
      ADD_FAILURE() << "the completion did not time out";
    } catch (const idem::StorageTimeout& e) {
      EXPECT_NE(std::string::npos, std::string(e.what()).find(statement ? "57014" : "55P03"))
          << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 8s) << "bounded well before lock_timeout";
    lock.abort();
    EXPECT_EQ(Record::Status::kInProgress, a.lookup(k)->status) << "nothing applied";
    EXPECT_TRUE(a.complete(k, o, "done", std::chrono::seconds(60)));
    EXPECT_EQ(1u, h.stats().connects) << "the connection survived the cancelled statement";
  }
}

// Connecting has its own deadline; after a failed connect the calls fail at once for the
// backoff; a refused port and a database that does not exist are typed.
TEST_F(AsyncPostgresStoreTest, ConnectFailuresAreTypedAndBounded) {
  idem::test::UnacceptingServer hung;
  AsyncPostgresStoreOptions ao;
  ao.conninfo = "host=127.0.0.1 port=" + std::to_string(hung.port()) +
                " user=postgres dbname=idem_test";
  ao.connect_timeout = 300ms;
  ao.reconnect_backoff = 30s;
  Holder h(ao);
  Blocking a = blocking(h);
  auto k = key("connect");
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW((void)a.begin(k, "", OwnerToken::generate(), 30s), idem::StorageTimeout);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  try {
    (void)a.lookup(k);
    ADD_FAILURE() << "no failure during the backoff";
  } catch (const idem::StorageUnavailable& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("moments ago")) << e.what();
  }
  EXPECT_EQ(1u, h.stats().connects) << "one connect tried, none during the backoff";

  AsyncPostgresStoreOptions refused;
  refused.conninfo = "host=127.0.0.1 port=" + std::to_string(idem::test::closed_port()) +
                     " user=postgres dbname=idem_test";
  Holder r(refused);
  EXPECT_THROW((void)blocking(r).begin(k, "", OwnerToken::generate(), 30s),
               idem::StorageUnavailable);

  AsyncPostgresStoreOptions wrong_db;
  wrong_db.conninfo = pg::dsn() + " dbname=idem_no_such_database";
  Holder w(wrong_db);
  EXPECT_THROW((void)blocking(w).lookup(k), idem::UsageError);

  AsyncPostgresStoreOptions negative;
  negative.statement_timeout = -1ms;
  EXPECT_THROW(Holder{negative}, idem::UsageError);
}

// A server that stops answering (a stalled network): the client's deadline closes the
// connection, a begin is StorageTimeout and a completion OutcomeUnknown (its write may apply);
// once the network is back, the store reconnects. A completion whose answer was lost with its
// connection is resolved by reading the record: applied, so true.
TEST_F(AsyncPostgresStoreTest, LostAnswersAreResolvedAndASilentServerTimesOut) {
  idem::test::CommitDroppingProxy proxy(pg::dsn_port());
  AsyncPostgresStoreOptions ao;
  ao.conninfo = pg::dsn_with_port(proxy.port());
  // Short enough for a quick stall, long enough for a loaded machine's backend start.
  ao.statement_timeout = 500ms;
  ao.client_grace = 500ms;
  ao.connect_timeout = 2s;
  ao.reconnect_backoff = 0ms;
  Holder h(ao);
  Blocking a = blocking(h);
  PostgresStore& s = h.sync;

  // A completion whose connection the proxy cuts at it: its answer lost (the server ran it) or,
  // with `lose_request`, the request itself (the server never saw it; the read finds the record
  // still ours and in progress, and the completion is written once more). Settled either way:
  // true, counted as resolved (the read may also come before the server ran the first write,
  // on a loaded machine), never as unknown.
  auto cut_completion = [&](const std::string& tag, bool lose_request, int nth) {
    auto k = key(tag);
    auto o = OwnerToken::generate();
    ASSERT_EQ(ClaimStatus::kClaimed, a.begin(k, "fp", o, 30s).status);
    proxy.lose_request = lose_request;
    proxy.drop_next_commit = true;
    EXPECT_TRUE(a.complete(k, o, tag, std::chrono::seconds(60)));
    EXPECT_EQ(nth, proxy.dropped.load());
    EXPECT_EQ(static_cast<std::uint64_t>(nth), h.stats().outcomes_resolved);
    EXPECT_EQ(0u, h.stats().outcomes_unknown);
    auto rec = s.lookup(k);
    ASSERT_TRUE(rec);
    EXPECT_EQ(Record::Status::kCompleted, rec->status);
    EXPECT_EQ(tag, rec->response);
  };
  proxy.drop_pattern = "idem_complete";
  cut_completion("lost_answer", false, 1);
  cut_completion("lost_request", true, 2);
  proxy.lose_request = false;

  auto k2 = key("silent");
  auto o2 = OwnerToken::generate();
  ASSERT_EQ(ClaimStatus::kClaimed, a.begin(k2, "fp", o2, 30s).status);
  // Both sent on the open connection, which then stops answering: the begin times out (it
  // wrote nothing the caller relies on), the completion's outcome is unknown (its re-read
  // cannot connect either).
  proxy.stalled = true;
  const auto sent_before = h.stats().batches;
  auto completing = std::async(std::launch::async, [&] {
    return a.complete(k2, o2, "maybe", std::chrono::seconds(60));
  });
  // The completion goes first (a begin sent alone could time the connection out before it).
  for (int i = 0; i < 1000 && h.stats().batches == sent_before; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_GT(h.stats().batches, sent_before);
  EXPECT_THROW((void)a.begin(key("silent_begin"), "fp", OwnerToken::generate(), 30s),
               idem::StorageTimeout);
  EXPECT_THROW((void)completing.get(), idem::OutcomeUnknown);
  EXPECT_GE(h.stats().outcomes_unknown, 1u);
  proxy.stalled = false;
  std::optional<Record> after;
  const auto reconnect_by = std::chrono::steady_clock::now() + 20s;
  while (!after && std::chrono::steady_clock::now() < reconnect_by) {
    try {
      after = a.lookup(k2);
    } catch (const idem::StorageError&) {
      std::this_thread::sleep_for(50ms);
    }
  }
  ASSERT_TRUE(after) << "the store never reconnected";
  // The stalled completion may reach the server after all (the proxy forwards what it held
  // once the stall ends, at any moment): it is ours either way, and the retry's completion and
  // the late one apply once between them.
  EXPECT_EQ(o2.str(), after->owner);
  if (after->status == Record::Status::kInProgress &&
      !a.complete(k2, o2, "maybe", std::chrono::seconds(60))) {
    auto late = s.lookup(k2);
    ASSERT_TRUE(late);
    EXPECT_EQ(Record::Status::kCompleted, late->status) << "refused, yet not completed by the "
                                                           "late write";
    EXPECT_EQ(o2.str(), late->owner);
  }
  auto replay = s.begin(k2, "fp", OwnerToken::generate(), 30s);
  EXPECT_EQ(ClaimStatus::kDone, replay.status);
  EXPECT_EQ("maybe", replay.response);
}

// Destroyed from another thread while 200 calls are in flight: every call is answered (a
// result, or StorageUnavailable / OutcomeUnknown), none hangs.
TEST_F(AsyncPostgresStoreTest, DestroyedWithCallsInFlightAnswersEveryCall) {
  Holder h;
  constexpr int kCalls = 200;
  std::vector<std::promise<std::exception_ptr>> answered(kCalls);
  std::vector<std::future<std::exception_ptr>> futures;
  for (auto& p : answered) futures.push_back(p.get_future());
  std::vector<Key> keys;
  for (int i = 0; i < kCalls; ++i) keys.push_back(key("destroy" + std::to_string(i)));
  for (int i = 0; i < kCalls; ++i) {
    auto* p = &answered[static_cast<std::size_t>(i)];
    const OwnerToken owner = OwnerToken::generate();
    if (i % 2 == 0) {
      h.async->async_begin(keys[static_cast<std::size_t>(i)], "", owner, 30s, {},
                           h.loop.executor(),
                           [p](std::exception_ptr e, idem::ClaimResult) { p->set_value(e); });
    } else {
      h.async->async_lookup(keys[static_cast<std::size_t>(i)], h.loop.executor(),
                            [p](std::exception_ptr e, std::optional<Record>) { p->set_value(e); });
    }
  }
  h.async.reset();  // from this thread, not the loop's
  int failed = 0;
  for (auto& f : futures) {
    ASSERT_EQ(std::future_status::ready, f.wait_for(20s)) << "a call was never answered";
    std::exception_ptr e = f.get();
    if (e) {
      ++failed;
      EXPECT_TRUE(idem::test::holds<idem::StorageUnavailable>(e) ||
                  idem::test::holds<idem::OutcomeUnknown>(e))
          << idem::test::what_of(e);
    }
  }
  drain(h.loop.io());
  std::printf("  %d of %d calls failed with the store closed under them\n", failed, kCalls);
}

// The order docs/async.md gives for shutting down, with calls still in flight: the loop
// stopped, the store destroyed from another thread, then the io_context destroyed. The store's
// close job never runs on the stopped loop and the calls' state waits inside its connection;
// once the io_context is gone, the connection must be closed anyway (its backend goes away),
// and the calls' completions, posted to the stopped loop, are destroyed uncalled.
TEST_F(AsyncPostgresStoreTest, DestroyedBesideAStoppedLoopClosesItsConnectionWhenTheLoopGoes) {
  const std::string app = idem::test::unique_name("idem_async_stopped");
  auto backends = [&app](const char* condition) {
    pqxx::connection c(pg::dsn());
    pqxx::nontransaction n(c);
    return n
        .exec1("SELECT count(*) FROM pg_stat_activity WHERE application_name = " + n.quote(app) +
               " AND " + condition)[0]
        .as<int>();
  };
  PostgresStore sync(sync_options());
  idem::async::WorkerPool workers({1, 16});
  const auto k = key("stopped");
  idem::test::Gate in_tx, release;
  auto tx = std::async(std::launch::async, [&] {
    return sync.run_transactional(k, "fp", OwnerToken::generate(), std::chrono::seconds(600),
                                  [&](pqxx::work&) {
                                    in_tx.open();
                                    release.wait();
                                    return std::string("committed");
                                  });
  });
  in_tx.wait();
  std::atomic<int> called{0};
  {
    anet::io_context io;
    AsyncPostgresStoreOptions ao;
    ao.conninfo = pg::dsn() + " application_name=" + app;
    ao.lock_timeout = 20s;  // the begins wait on the transaction holding the key
    ao.statement_timeout = 30s;
    auto store = std::make_unique<AsyncPostgresStore>(io.get_executor(), sync, workers, ao);
    for (int i = 0; i < 20; ++i) {
      store->async_begin(k, "fp", OwnerToken::generate(), 30s, {}, io.get_executor(),
                         [&called](std::exception_ptr, idem::ClaimResult) { ++called; });
    }
    const auto until = std::chrono::steady_clock::now() + 15s;
    while (backends("wait_event_type = 'Lock'") == 0 && std::chrono::steady_clock::now() < until) {
      io.run_for(20ms);
    }
    ASSERT_EQ(1, backends("wait_event_type = 'Lock'")) << "the begins never reached the server";
    io.stop();
    store.reset();  // from this thread, the loop stopped: its close job stays queued
  }                 // the io_context destroyed
  release.open();
  ASSERT_EQ(idem::TransactionalStatus::kCommitted, tx.get().status);
  const auto until = std::chrono::steady_clock::now() + 15s;
  while (backends("true") > 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(0, backends("true")) << "the store's connection outlived the store and its loop";
  EXPECT_EQ(0, called.load()) << "completions posted to a stopped loop are not called";
}

// An adopted table without idem's CHECK on status: a status idem did not write is CorruptRecord
// (never a busy key, never a takeover), for a begin and a lookup alike.
TEST_F(AsyncPostgresStoreTest, ARowIdemDidNotWriteIsACorruptRecord) {
  const std::string t = pg::table("adopted_async");
  pg::exec("CREATE TABLE IF NOT EXISTS " + t +
           " (idem_key varchar(128) NOT NULL, biz_type varchar(64) NOT NULL,"
           " status varchar(32) NOT NULL, fingerprint text NOT NULL DEFAULT '',"
           " owner varchar(64) NOT NULL, response_body bytea, lease_until timestamptz NOT NULL,"
           " expires_at timestamptz, attempts integer NOT NULL DEFAULT 1,"
           " created_at timestamptz NOT NULL DEFAULT now(),"
           " updated_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (idem_key, biz_type))");
  auto k = key("foreign");
  pg::exec("INSERT INTO " + t + " (idem_key, biz_type, status, fingerprint, owner, lease_until)" +
           " VALUES ('" + k.id() + "', '" + k.scope() + "', 'PROCESSING', 'fp', 'x', now())");
  auto so = sync_options();
  so.table = "adopted_async";
  so.migrate = false;
  Holder h({}, so);
  Blocking a = blocking(h);
  EXPECT_THROW((void)a.begin(k, "fp", OwnerToken::generate(), 30s), idem::CorruptRecord);
  EXPECT_THROW((void)a.lookup(k), idem::CorruptRecord);
}

}  // namespace

namespace idem::test {
// The suite header brings helpers only here (its typed suite is instantiated elsewhere).
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(AsyncGuardSuite);
}  // namespace idem::test
