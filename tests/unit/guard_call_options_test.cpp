// SPDX-License-Identifier: MIT
// Per-call lease and retention, the kill switch (GuardOptions::bypass), waiting for the first
// result (wait_for_result), bounded retries of transient durable-store failures
// (store_attempts), the lease heartbeat of long handlers and the pause before a failed fast
// store is tried again (fast_store_retry_after), on the MemoryStore and SQLite.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/guard.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/failing_store.hpp"
#include "support/flaky_durable.hpp"
#include "support/test_env.hpp"

namespace {

using idem::test::FlakyDurable;

using namespace std::chrono_literals;
using idem::CallOptions;
using idem::GuardOptions;
using idem::Key;
using idem::Outcome;

// A clock the test moves by hand.
struct ManualClock {
  std::shared_ptr<std::atomic<std::int64_t>> ms = std::make_shared<std::atomic<std::int64_t>>(0);
  idem::Clock clock() const {
    auto t = ms;
    return [t] { return idem::TimePoint{} + std::chrono::milliseconds{t->load()} + 1000h; };
  }
  void advance(std::chrono::milliseconds d) { *ms += d.count(); }
};

idem::MemoryStore memory_with(const ManualClock& c) {
  idem::MemoryStoreOptions o;
  o.clock = c.clock();
  return idem::MemoryStore{o};
}

TEST(CallOptionsTest, PerCallRetentionOutlivesOrUndercutsTheGuardDefault) {
  ManualClock clock;
  idem::MemoryStore fast = memory_with(clock);
  GuardOptions o;
  o.retention = 3600s;
  idem::IdempotencyGuard guard{fast, o};
  int runs = 0;
  auto handler = [&] {
    ++runs;
    return std::string("r") + std::to_string(runs);
  };
  CallOptions cart;
  cart.retention = 600s;  // a cart: 10 minutes
  CallOptions refund;
  refund.retention = std::chrono::hours{24 * 30};  // a refund: 30 days
  EXPECT_EQ(Outcome::kExecuted, guard.run(Key::make("cart", "c1"), "", cart, handler).outcome);
  EXPECT_EQ(Outcome::kExecuted,
            guard.run(Key::make("refund", "r1"), "", refund, handler).outcome);
  clock.advance(std::chrono::minutes{11});
  // The cart's record is gone after 10 minutes: the same key runs again.
  EXPECT_EQ(Outcome::kExecuted, guard.run(Key::make("cart", "c1"), "", cart, handler).outcome);
  clock.advance(std::chrono::hours{24 * 29});
  auto again = guard.run(Key::make("refund", "r1"), "", refund, handler);
  EXPECT_EQ(Outcome::kReplayed, again.outcome);
  EXPECT_EQ("r2", *again.value);
  EXPECT_EQ(3, runs);
}

TEST(CallOptionsTest, PerCallLeaseDecidesWhenAnotherAttemptMayTakeOver) {
  ManualClock clock;
  idem::MemoryStore fast = memory_with(clock);
  idem::IdempotencyGuard guard{fast};  // default lease: 30 s
  const Key key = Key::make("export", "e1");
  CallOptions short_lease;
  short_lease.lease = 100ms;
  Outcome inner_early{}, inner_late{};
  EXPECT_THROW(guard.run(key, "", short_lease,
                         [&] {
                           inner_early =
                               guard.run(key, "", [] { return std::string("second"); }).outcome;
                           clock.advance(200ms);  // past the short lease, within the default
                           inner_late =
                               guard.run(key, "", [] { return std::string("second"); }).outcome;
                           return std::string("first");
                         }),
               idem::LeaseLost);
  EXPECT_EQ(Outcome::kInProgress, inner_early);
  EXPECT_EQ(Outcome::kExecuted, inner_late) << "the 100 ms lease ended: taken over";
  auto replay = guard.run(key, "", [] { return std::string("third"); });
  EXPECT_EQ(Outcome::kReplayed, replay.outcome);
  EXPECT_EQ("second", *replay.value) << "the fenced first attempt did not overwrite it";
}

TEST(CallOptionsTest, BadPerCallValuesAreUsageErrors) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  CallOptions zero_lease;
  zero_lease.lease = 0ms;
  CallOptions zero_retention;
  zero_retention.retention = 0s;
  CallOptions negative_wait;
  negative_wait.wait_for_result = -1ms;
  auto h = [] { return std::string("x"); };
  EXPECT_THROW(guard.run(Key::make("a", "b"), "", zero_lease, h), idem::UsageError);
  EXPECT_THROW(guard.run(Key::make("a", "b"), "", zero_retention, h), idem::UsageError);
  EXPECT_THROW(guard.run(Key::make("a", "b"), "", negative_wait, h), idem::UsageError);
}

// Counts the passthrough events the guard reports.
struct PassthroughCounter final : idem::Observer {
  std::atomic<int> disabled{0};
  void on_passthrough(const idem::PassthroughEvent& e) noexcept override {
    if (e.reason == idem::PassthroughReason::kDisabled) ++disabled;
  }
};

TEST(BypassTest, TheKillSwitchRunsEveryCallWithNoStoreIoAndWarnsOnce) {
  idem::MemoryStore fast;
  GuardOptions o;
  o.bypass = true;
  std::vector<std::string> warnings;
  o.warn = [&](std::string_view w) { warnings.emplace_back(w); };
  auto observer = std::make_shared<PassthroughCounter>();
  o.observer = observer;
  idem::IdempotencyGuard guard{fast, o};
  const Key key = Key::make("payment", "p1");
  int runs = 0;
  for (int i = 0; i < 3; ++i) {
    auto r = guard.run(key, "fp", [&] { return std::to_string(++runs); });
    EXPECT_EQ(Outcome::kExecuted, r.outcome);
    EXPECT_EQ(std::to_string(i + 1), *r.value);
  }
  EXPECT_EQ(3, runs);
  EXPECT_FALSE(fast.lookup(key)) << "no record was written";
  ASSERT_EQ(1u, warnings.size());
  EXPECT_NE(std::string::npos, warnings[0].find("NO idempotency"));
  EXPECT_EQ(3, observer->disabled.load());
  auto s = guard.stats().snapshot();
  EXPECT_EQ(3u, s.bypassed);
  EXPECT_EQ(0u, s.fast_claims);
}

TEST(BypassTest, TransactionalHandlersRunInAPlainTransactionOfTheDurableStore) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable{dir.file("bypass.sqlite")};
  durable.database().write([](idem::sqlite::Transaction& tx) {
    tx.exec("CREATE TABLE payment (n INTEGER NOT NULL)");
  });
  GuardOptions o;
  o.bypass = true;
  o.warn = [](std::string_view) {};
  idem::IdempotencyGuard guard{durable, o};
  const Key key = Key::make("payment", "p1");
  for (int i = 0; i < 2; ++i) {
    auto r = guard.run(key, "", [&](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT INTO payment (n) VALUES (?)", i);
      return std::string("ok");
    });
    EXPECT_EQ(Outcome::kExecuted, r.outcome);
  }
  EXPECT_EQ(2, durable.database().read([](idem::sqlite::Session& s) {
    return s.query_int64("SELECT count(*) FROM payment").value_or(-1);
  }));
  EXPECT_FALSE(durable.lookup(key));
}

// Lets a handler hold its key until the test opens the gate.
struct Gate {
  std::mutex m;
  std::condition_variable cv;
  bool open = false, entered = false;
  void enter_and_wait() {
    std::unique_lock<std::mutex> lock(m);
    entered = true;
    cv.notify_all();
    cv.wait(lock, [&] { return open; });
  }
  void wait_entered() {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return entered; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(m);
    open = true;
    cv.notify_all();
  }
};

// Blocks until `n` calls of `guard` are waiting for a first result (or fails after 20 s).
template <class G>
void wait_for_waits(G& guard, std::uint64_t n) {
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (guard.stats().snapshot().waits < n) {
    ASSERT_LT(std::chrono::steady_clock::now(), until) << "the waiters never started waiting";
    std::this_thread::sleep_for(1ms);
  }
}

TEST(WaitForResultTest, ManyWaitersGetTheFirstResultAndTheHandlerRunsOnce) {
  idem::MemoryStore fast;
  GuardOptions o;
  o.wait_for_result = 10s;
  idem::IdempotencyGuard guard{fast, o};
  const Key key = Key::make("order", "o1");
  std::atomic<int> runs{0};
  Gate gate;
  std::thread first([&] {
    auto r = guard.run(key, "fp", [&] {
      ++runs;
      gate.enter_and_wait();
      return std::string("order_no_1");
    });
    EXPECT_EQ(Outcome::kExecuted, r.outcome);
  });
  gate.wait_entered();
  constexpr int kWaiters = 8;
  std::vector<std::thread> waiters;
  std::atomic<int> replayed{0};
  for (int i = 0; i < kWaiters; ++i) {
    waiters.emplace_back([&] {
      auto r = guard.run(key, "fp", [&] {
        ++runs;
        return std::string("order_no_other");
      });
      if (r.outcome == Outcome::kReplayed && *r.value == "order_no_1") ++replayed;
    });
  }
  wait_for_waits(guard, kWaiters);
  gate.release();
  first.join();
  for (auto& t : waiters) t.join();
  EXPECT_EQ(1, runs.load());
  EXPECT_EQ(kWaiters, replayed.load()) << "every waiter replays the first result";
  auto s = guard.stats().snapshot();
  EXPECT_EQ(static_cast<std::uint64_t>(kWaiters), s.waits);
  EXPECT_EQ(1u, s.executed);
}

TEST(WaitForResultTest, TheBoundPassesAndTheAnswerIsInProgress) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  const Key key = Key::make("order", "o2");
  Gate gate;
  std::thread first([&] {
    auto r = guard.run(key, "", [&] {
      gate.enter_and_wait();
      return std::string("done");
    });
    EXPECT_EQ(Outcome::kExecuted, r.outcome);
  });
  gate.wait_entered();
  CallOptions wait;
  wait.wait_for_result = 60ms;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = guard.run(key, "", wait, [] { return std::string("never"); });
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(Outcome::kInProgress, r.outcome);
  EXPECT_GE(waited, 60ms) << "it waited for the bound before answering";
  // Without a wait, the answer is immediate.
  EXPECT_EQ(Outcome::kInProgress, guard.run(key, "", [] { return std::string("never"); }).outcome);
  gate.release();
  first.join();
  auto replay = guard.run(key, "", wait, [] { return std::string("never"); });
  EXPECT_EQ(Outcome::kReplayed, replay.outcome);
  EXPECT_EQ("done", *replay.value);
}

TEST(WaitForResultTest, AWaiterRunsTheHandlerWhenTheFirstAttemptFails) {
  idem::MemoryStore fast;
  GuardOptions o;
  o.wait_for_result = 10s;
  idem::IdempotencyGuard guard{fast, o};
  const Key key = Key::make("order", "o3");
  Gate gate;
  std::atomic<int> successes{0};
  std::thread first([&] {
    EXPECT_THROW(guard.run(key, "",
                           [&]() -> std::string {
                             gate.enter_and_wait();
                             throw std::runtime_error("card declined by a flaky gateway");
                           }),
                 std::runtime_error);
  });
  gate.wait_entered();
  std::thread waiter([&] {
    auto r = guard.run(key, "", [&] {
      ++successes;
      return std::string("second try");
    });
    EXPECT_EQ(Outcome::kExecuted, r.outcome);
  });
  wait_for_waits(guard, 1);
  gate.release();
  first.join();
  waiter.join();
  EXPECT_EQ(1, successes.load());
}

// Runs `key` on another thread, its handler held at `gate` (the key in progress meanwhile);
// returns once the handler runs. The call executes when the gate opens.
template <class G>
std::thread hold(G& guard, const Key& key, Gate& gate) {
  std::thread t([&guard, key, &gate] {
    auto r = guard.run(key, "fp", [&] {
      gate.enter_and_wait();
      return std::string("order_no_1");
    });
    EXPECT_EQ(Outcome::kExecuted, r.outcome);
  });
  gate.wait_entered();
  return t;
}

// What the observer hears of calls: on_call per outcome, on_duplicate, the total times.
struct CallCounter final : idem::Observer {
  std::atomic<int> executed{0}, replayed{0}, in_progress{0}, duplicates{0};
  std::atomic<std::int64_t> longest_total_ms{0};
  void on_call(const idem::CallEvent& e) noexcept override {
    if (e.outcome == Outcome::kExecuted) ++executed;
    if (e.outcome == Outcome::kReplayed) ++replayed;
    if (e.outcome == Outcome::kInProgress) ++in_progress;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(e.total).count();
    if (ms > longest_total_ms) longest_total_ms = ms;
  }
  void on_duplicate(const idem::DuplicateEvent&) noexcept override { ++duplicates; }
};

// A waiting call is one call however often it asks: counted, timed and reported once, with
// the answer its caller gets (its attempts' kInProgress answers are not duplicates of their
// own), on the fast store and on the durable store alike; a wait that runs out is reported
// once as kInProgress.
TEST(WaitForResultTest, AWaitingCallIsCountedAndReportedOnce) {
  for (const bool durable_only : {false, true}) {
    SCOPED_TRACE(durable_only ? "durable store alone" : "fast store");
    idem::MemoryStore fast;
    idem::test::TempDir dir;
    idem::sqlite::SqliteStore durable{dir.file("wait_once.sqlite")};
    auto observer = std::make_shared<CallCounter>();
    GuardOptions o;
    o.observer = observer;
    o.wait_for_result = 10s;
    auto check = [&](auto& guard) {
      const Key key = Key::make("order", "once");
      Gate gate;
      std::thread first = hold(guard, key, gate);
      std::thread waiter([&] {
        auto r = guard.run(key, "fp", [] { return std::string("never"); });
        EXPECT_EQ(Outcome::kReplayed, r.outcome);
      });
      wait_for_waits(guard, 1);
      std::this_thread::sleep_for(150ms);  // the waiter asks again several times meanwhile
      gate.release();
      first.join();
      waiter.join();
      CallOptions brief;
      brief.wait_for_result = 100ms;
      Gate second_gate;
      const Key busy = Key::make("order", "busy");
      std::thread holder = hold(guard, busy, second_gate);
      EXPECT_EQ(Outcome::kInProgress,
                guard.run(busy, "fp", brief, [] { return std::string("never"); }).outcome);
      second_gate.release();
      holder.join();

      auto s = guard.stats().snapshot();
      EXPECT_EQ(4u, s.calls) << "two holders, two waiting calls";
      EXPECT_EQ(2u, s.waits);
      EXPECT_EQ(2u, s.executed);
      EXPECT_EQ(1u, s.replayed);
      EXPECT_EQ(1u, s.in_progress) << "the wait that ran out, once";
      EXPECT_EQ(2u, s.fast_hits + s.durable_conflicts) << "one duplicate each";
      EXPECT_EQ(2, observer->executed.load());
      EXPECT_EQ(1, observer->replayed.load());
      EXPECT_EQ(1, observer->in_progress.load());
      EXPECT_EQ(2, observer->duplicates.load());
      EXPECT_GE(observer->longest_total_ms.load(), 150) << "timed from the call's start";
    };
    if (durable_only) {
      idem::IdempotencyGuard guard{durable, o};
      check(guard);
    } else {
      idem::IdempotencyGuard guard{fast, o};
      check(guard);
    }
  }
}

// A waiting call that finds the fast store down on every attempt is one degraded call.
TEST(WaitForResultTest, AWaitingCallWithTheFastStoreDownIsDegradedOnce) {
  idem::MemoryStore memory;
  idem::test::SwitchableFastStore fast{memory};
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable{dir.file("wait_degraded.sqlite")};
  GuardOptions o;
  o.wait_for_result = 10s;
  idem::IdempotencyGuard guard{fast, durable, o};
  const Key key = Key::make("order", "down");
  Gate gate;
  std::thread first = hold(guard, key, gate);
  fast.failing = true;
  std::thread waiter([&] {
    auto r = guard.run(key, "fp", [] { return std::string("never"); });
    EXPECT_EQ(Outcome::kReplayed, r.outcome);
    EXPECT_TRUE(r.degraded);
  });
  wait_for_waits(guard, 1);
  const int before = fast.calls.load();
  while (fast.calls.load() < before + 3) std::this_thread::sleep_for(1ms);  // attempts, all down
  gate.release();
  first.join();
  waiter.join();
  auto s = guard.stats().snapshot();
  EXPECT_EQ(2u, s.calls);
  EXPECT_EQ(1u, s.degraded) << "the waiter, once; the first call was decided with its claim";
}

class StoreRetryTest : public ::testing::Test {
 protected:
  StoreRetryTest() : sqlite_(dir_.file("retry.sqlite")), flaky_(sqlite_) {
    sqlite_.database().write([](idem::sqlite::Transaction& tx) {
      tx.exec("CREATE TABLE payment (order_no TEXT NOT NULL)");
    });
  }
  long payments() {
    return static_cast<long>(sqlite_.database().read([](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM payment").value_or(-1);
    }));
  }
  GuardOptions retrying(unsigned attempts) {
    GuardOptions o;
    o.store_attempts = attempts;
    o.store_retry_backoff = 1ms;
    return o;
  }
  idem::test::TempDir dir_;
  idem::sqlite::SqliteStore sqlite_;
  FlakyDurable flaky_;
};

// A two-phase completion that was applied but whose answer was lost (the connection broke and
// the store could not re-read: OutcomeUnknown), retried under store_attempts: the retry finds
// nothing left to complete, and the record says this call completed it. The call executed; it
// is not LeaseLost. A record completed by another attempt stays LeaseLost (next test).
TEST_F(StoreRetryTest, ACompletionAppliedThenLostIsExecutedWhenItsRetryFindsItDone) {
  flaky_.fail_complete = 1;
  flaky_.complete_applied_then_lost = true;
  idem::IdempotencyGuard<FlakyDurable> guard{flaky_, retrying(3)};
  const Key key = Key::make("order", "lost-completion");
  int runs = 0;
  auto r = guard.run(key, "fp", [&] {
    ++runs;
    return std::string("paid");
  });
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  EXPECT_EQ("paid", r.value.value_or(""));
  EXPECT_EQ(1u, guard.stats().snapshot().store_retries);
  EXPECT_EQ(0u, guard.stats().snapshot().leases_lost);
  auto again = guard.run(key, "fp", [&] {
    ++runs;
    return std::string("twice");
  });
  EXPECT_EQ(Outcome::kReplayed, again.outcome);
  EXPECT_EQ("paid", again.value.value_or(""));
  EXPECT_EQ(1, runs);
}

// A two-phase begin applied whose answer was lost with its connection (the retry inside the
// store failed too: OutcomeUnknown): the call fails, retryable, and the record it left is
// released (owner-checked), so the caller's retry runs at once instead of hearing "in progress"
// for a whole lease while nothing runs.
TEST_F(StoreRetryTest, ABeginAppliedThenLostIsReleasedSoTheRetryRunsAtOnce) {
  flaky_.fail_begin = 1;
  flaky_.begin_applied_then_lost = true;
  idem::IdempotencyGuard<FlakyDurable> guard{flaky_};
  const Key key = Key::make("order", "lost-begin");
  int runs = 0;
  auto handler = [&] {
    ++runs;
    return std::string("paid");
  };
  EXPECT_THROW((void)guard.run(key, "fp", handler), idem::OutcomeUnknown);
  EXPECT_FALSE(sqlite_.lookup(key).has_value()) << "the applied begin's record was released";
  auto retry = guard.run(key, "fp", handler);
  EXPECT_EQ(Outcome::kExecuted, retry.outcome);
  EXPECT_EQ(1, runs);
}

// The retried completion finds the record completed by another attempt (this call's lease ended
// and a retry took the key over and finished first): that is a lost lease, as without a retry.
TEST_F(StoreRetryTest, ARetriedCompletionFindingAnotherAttemptsRecordIsLeaseLost) {
  idem::IdempotencyGuard<FlakyDurable> guard{flaky_, retrying(3)};
  const Key key = Key::make("order", "taken-over");
  flaky_.fail_complete = 1;
  EXPECT_THROW((void)guard.run(key, "fp",
                               [&] {
                                 // Meanwhile the key is taken over and completed by another.
                                 auto other = idem::OwnerToken::generate();
                                 EXPECT_TRUE(sqlite_.release(key, idem::OwnerToken::from_string(
                                                                      sqlite_.lookup(key)->owner)));
                                 EXPECT_EQ(idem::ClaimStatus::kClaimed,
                                           sqlite_.begin(key, "fp", other, 30s, {}).status);
                                 EXPECT_TRUE(sqlite_.complete(key, other, "theirs", 3600s));
                                 return std::string("mine");
                               }),
               idem::LeaseLost);
  EXPECT_EQ("theirs", sqlite_.lookup(key)->response);
}

// CallOptions::likely_new reaches the durable store as DurableHint::likely_new (SQLite then
// skips its read-only precheck) and changes no answer: a completed key still replays without
// running the handler, another payload is still a mismatch, in both modes.
TEST_F(StoreRetryTest, LikelyNewReachesTheDurableStoreAndChangesNoAnswer) {
  idem::IdempotencyGuard<FlakyDurable> guard{flaky_};
  idem::CallOptions likely_new;
  likely_new.likely_new = true;
  int runs = 0;
  auto pay = [&](idem::sqlite::Transaction& tx) {
    ++runs;
    tx.exec("INSERT INTO payment (order_no) VALUES ('o1')");
    return std::string("pay_o1");
  };
  const auto key = Key::make("payment", "o1");
  auto first = guard.run(key, "fp", pay);
  EXPECT_EQ(idem::Outcome::kExecuted, first.outcome);
  EXPECT_FALSE(flaky_.last_hint.likely_new);
  EXPECT_FALSE(flaky_.last_hint.expects_absent());
  auto again = guard.run(key, "fp", likely_new, pay);
  EXPECT_TRUE(flaky_.last_hint.likely_new);
  EXPECT_TRUE(flaky_.last_hint.expects_absent());
  EXPECT_EQ(idem::Outcome::kReplayed, again.outcome);
  EXPECT_EQ("pay_o1", again.value.value_or(""));
  EXPECT_EQ(idem::Outcome::kFingerprintMismatch, guard.run(key, "other", likely_new, pay).outcome);
  EXPECT_EQ(1, runs);
  EXPECT_EQ(1, payments());

  const auto two_phase = Key::make("payment", "o2");
  auto call = [&] {
    ++runs;
    return std::string("sent");
  };
  EXPECT_EQ(idem::Outcome::kExecuted, guard.run(two_phase, "fp", likely_new, call).outcome);
  EXPECT_TRUE(flaky_.last_hint.likely_new);
  auto replay = guard.run(two_phase, "fp", likely_new, call);
  EXPECT_EQ(idem::Outcome::kReplayed, replay.outcome);
  EXPECT_EQ("sent", replay.value.value_or(""));
  EXPECT_EQ(idem::Outcome::kFingerprintMismatch,
            guard.run(two_phase, "other", likely_new, call).outcome);
  EXPECT_EQ(2, runs);
}

TEST_F(StoreRetryTest, TwoPhaseBeginAndCompleteAreRetriedAndTheHandlerRunsOnce) {
  struct Retries final : idem::Observer {
    std::vector<std::string> reasons;  // one thread: the guard's call
    void on_durable_retry(const Key&, std::string_view reason) noexcept override {
      reasons.emplace_back(reason);
    }
  };
  auto observer = std::make_shared<Retries>();
  GuardOptions o = retrying(3);
  o.observer = observer;
  idem::IdempotencyGuard guard{flaky_, o};
  flaky_.fail_begin = 2;
  flaky_.fail_complete = 2;
  int runs = 0;
  auto r = guard.run(Key::make("payment", "p1"), "", [&] {
    ++runs;
    return std::string("pay_1");
  });
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  EXPECT_EQ(1, runs);
  EXPECT_EQ(4u, guard.stats().snapshot().store_retries);
  // Each retry told to the observer (idem_durable_retries_total), the reason its error's code.
  EXPECT_EQ((std::vector<std::string>{"store_timeout", "store_timeout", "store_unavailable",
                                      "store_unavailable"}),
            observer->reasons);
  auto rec = sqlite_.lookup(Key::make("payment", "p1"));
  ASSERT_TRUE(rec);
  EXPECT_EQ(idem::Record::Status::kCompleted, rec->status);
}

// A handler that fails while the database is briefly away: the release of its claim is tried
// again too, so a retry runs at once instead of waiting for the lease to end.
TEST_F(StoreRetryTest, TheReleaseAfterAFailedHandlerIsRetried) {
  idem::IdempotencyGuard guard{flaky_, retrying(3)};
  flaky_.fail_release = 2;
  const Key key = Key::make("payment", "released");
  EXPECT_THROW(
      guard.run(key, "", []() -> std::string { throw std::runtime_error("gateway timeout"); }),
      std::runtime_error);
  EXPECT_EQ(0, flaky_.fail_release);
  EXPECT_FALSE(sqlite_.lookup(key).has_value()) << "released: nothing in progress";
  EXPECT_EQ(2u, guard.stats().snapshot().store_retries);
  auto r = guard.run(key, "", [] { return std::string("paid"); });
  EXPECT_EQ(Outcome::kExecuted, r.outcome) << "the retry ran at once";
}

// Calls `key` `times` times more: each must throw the non-retryable StorageError of a record
// whose response could not be stored, naming `reason` (never run the handler: a UsageError
// would say it did).
template <class Guard, class Fn>
void expect_unstored_answers(Guard& guard, const Key& key, const idem::CallOptions& options,
                             Fn& handler, int times, const std::string& reason) {
  for (int i = 0; i < times; ++i) {
    try {
      (void)guard.run(key, "fp", options, handler);
      ADD_FAILURE() << "answered";
    } catch (const idem::UsageError&) {
      ADD_FAILURE() << "ran again";
    } catch (const idem::StorageError& e) {
      EXPECT_FALSE(e.retryable());
      EXPECT_NE(std::string::npos, std::string(e.what()).find("could not be stored")) << e.what();
      EXPECT_NE(std::string::npos, std::string(e.what()).find(reason)) << e.what();
    }
  }
}

// A two-phase handler ran (its effect happened) but the store refused its response for good
// (too large): the record is marked failed, so no retry runs the handler again, during the
// lease or after it; later calls get a non-retryable StorageError that says why. With and
// without a fast store in front.
TEST_F(StoreRetryTest, AResponseRefusedForGoodIsNeverRunAgain) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard durable_only{flaky_, retrying(3)};
  idem::IdempotencyGuard with_fast{fast, flaky_, retrying(3)};
  flaky_.max_response = 8;
  int effects = 0;
  auto charge = [&] {
    ++effects;  // the external effect (a card charged)
    return std::string("a response longer than the store takes");
  };
  idem::CallOptions short_lease;
  short_lease.lease = 30ms;
  for (auto* guard : {&durable_only, &with_fast}) {
    effects = 0;
    const Key key = Key::make("payment", guard == &durable_only ? "big-1" : "big-2");
    EXPECT_THROW(guard->run(key, "fp", short_lease, charge), idem::UsageError);
    EXPECT_EQ(1, effects);
    auto record = sqlite_.lookup(key);
    ASSERT_TRUE(record.has_value());
    EXPECT_EQ(idem::Record::Status::kFailed, record->status);
    std::this_thread::sleep_for(60ms);  // past the lease
    expect_unstored_answers(*guard, key, short_lease, charge, 3, "larger than the store takes");
    EXPECT_EQ(1, effects) << "the handler never ran again";
    // A transactional handler on the key is not run either (it would be rolled back, but its
    // answer would be a replay of a reason, not a response).
    EXPECT_THROW(guard->run(key, "fp", [&](idem::sqlite::Transaction&) { return charge(); }),
                 idem::StorageError);
    EXPECT_EQ(1, effects);
  }
  EXPECT_EQ(0u, durable_only.stats().snapshot().store_retries) << "a refusal is not retried";
}

// The response refused for good and the failure mark refused too (a disk I/O error under
// both): the caller is told the handler ran (OutcomeUnknown), not a plain StorageError that
// says nothing of it; the record stays in progress for its lease.
TEST_F(StoreRetryTest, ACompletionAndItsMarkBothRefusedSayTheHandlerRan) {
  idem::IdempotencyGuard guard{flaky_, retrying(3)};
  flaky_.max_response = 8;
  flaky_.refuse_fail = true;
  int effects = 0;
  const Key key = Key::make("payment", "unmarked");
  try {
    (void)guard.run(key, "fp", [&] {
      ++effects;
      return std::string("a response longer than the store takes");
    });
    ADD_FAILURE() << "answered";
  } catch (const idem::OutcomeUnknown& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("the handler ran")) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("could not be marked failed"))
        << e.what();
  }
  EXPECT_EQ(1, effects);
  auto record = sqlite_.lookup(key);
  ASSERT_TRUE(record.has_value());
  EXPECT_EQ(idem::Record::Status::kInProgress, record->status);
}

// A completion that fails for a moment after the handler ran (a failover under it) is tried
// again under store_attempts, in a fast-only guard as in a durable one; past them the caller
// gets OutcomeUnknown (the handler ran), not StorageUnavailable ("nothing happened"), in both.
TEST(CompletionAfterTheHandler, IsRetriedAndOtherwiseOutcomeUnknown) {
  idem::MemoryStore memory;
  idem::test::SwitchableFastStore fast{memory};
  GuardOptions o;
  o.store_attempts = 3;
  o.store_retry_backoff = 1ms;
  idem::IdempotencyGuard guard{fast, o};
  int effects = 0;
  auto charge = [&] {
    ++effects;
    return std::string("charged");
  };
  fast.fail_complete = 2;
  auto r = guard.run(Key::make("payment", "failover-1"), "fp", charge);
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  EXPECT_EQ(2u, guard.stats().snapshot().store_retries);
  EXPECT_EQ(idem::Record::Status::kCompleted,
            memory.lookup(Key::make("payment", "failover-1"))->status);

  fast.fail_complete = 5;
  const Key lost = Key::make("payment", "failover-2");
  try {
    (void)guard.run(lost, "fp", charge);
    ADD_FAILURE() << "answered";
  } catch (const idem::OutcomeUnknown& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("the handler ran")) << e.what();
  }
  EXPECT_EQ(2, effects);
  EXPECT_EQ(idem::Record::Status::kInProgress, memory.lookup(lost)->status);
  fast.fail_complete = 0;
  EXPECT_EQ(Outcome::kInProgress, guard.run(lost, "fp", charge).outcome) << "within the lease";
  EXPECT_EQ(2, effects);
}

TEST_F(StoreRetryTest, ATwoPhaseCompletionFailingPastItsRetriesIsOutcomeUnknown) {
  idem::IdempotencyGuard guard{flaky_, retrying(2)};
  flaky_.fail_complete = 5;
  int runs = 0;
  EXPECT_THROW(guard.run(Key::make("payment", "p-lost"), "",
                         [&] {
                           ++runs;
                           return std::string("sent");
                         }),
               idem::OutcomeUnknown);
  EXPECT_EQ(1, runs);
  EXPECT_EQ(1u, guard.stats().snapshot().store_retries);
}

// The same in a fast-only guard: the fast store refuses the response for good, the record is
// marked failed there, and every later call (past the lease) gets the StorageError.
TEST(UnstoredResponse, AFastOnlyGuardNeverRunsItAgainEither) {
  idem::MemoryStore memory;
  idem::test::SwitchableFastStore fast{memory};
  fast.max_response = 8;
  struct Downs final : idem::Observer {
    std::atomic<int> count{0};
    void on_fast_store_down(const Key&, const idem::Error&) noexcept override { ++count; }
  };
  auto downs = std::make_shared<Downs>();
  GuardOptions o;
  o.observer = downs;
  idem::IdempotencyGuard guard{fast, o};
  idem::CallOptions short_lease;
  short_lease.lease = 30ms;
  int effects = 0;
  auto charge = [&] {
    ++effects;
    return std::string("a response longer than the store takes");
  };
  const Key key = Key::make("payment", "fast-big");
  EXPECT_THROW(guard.run(key, "fp", short_lease, charge), idem::UsageError);
  ASSERT_TRUE(memory.lookup(key).has_value());
  EXPECT_EQ(idem::Record::Status::kFailed, memory.lookup(key)->status);
  std::this_thread::sleep_for(60ms);
  expect_unstored_answers(guard, key, short_lease, charge, 2, "larger than the store takes");
  EXPECT_EQ(1, effects);
  EXPECT_EQ(0, downs->count.load()) << "not a fast-store outage";
}

TEST_F(StoreRetryTest, WithoutRetriesTheFirstTransientFailureIsThrownTyped) {
  idem::IdempotencyGuard guard{flaky_, retrying(1)};
  flaky_.fail_begin = 1;
  int runs = 0;
  EXPECT_THROW(guard.run(Key::make("payment", "p2"), "",
                         [&] {
                           ++runs;
                           return std::string("x");
                         }),
               idem::StorageTimeout);
  EXPECT_EQ(0, runs);
  EXPECT_EQ(0u, guard.stats().snapshot().store_retries);
}

TEST_F(StoreRetryTest, ExhaustedRetriesThrowTheLastErrorTyped) {
  idem::IdempotencyGuard guard{flaky_, retrying(2)};
  flaky_.fail_transactional = 5;
  EXPECT_THROW(guard.run(Key::make("payment", "p3"), "",
                         [&](idem::sqlite::Transaction&) { return std::string("x"); }),
               idem::StorageUnavailable);
  EXPECT_EQ(1u, guard.stats().snapshot().store_retries);
}

TEST_F(StoreRetryTest, ACommitThatWasAppliedIsRecognisedOnTheRetryNotRunTwice) {
  idem::IdempotencyGuard guard{flaky_, retrying(3)};
  flaky_.fail_transactional = 1;
  flaky_.applied_then_lost = true;
  int runs = 0;
  auto r = guard.run(Key::make("payment", "p4"), "", [&](idem::sqlite::Transaction& tx) {
    ++runs;
    tx.exec("INSERT INTO payment (order_no) VALUES ('p4')");
    return std::string("pay_4");
  });
  EXPECT_EQ(1, runs) << "the retry found the committed record";
  EXPECT_EQ(1, payments());
  ASSERT_TRUE(r.value);
  EXPECT_EQ("pay_4", *r.value);
}

TEST_F(StoreRetryTest, TheHandlersOwnTransientErrorIsNotRetried) {
  idem::IdempotencyGuard guard{flaky_, retrying(5)};
  int runs = 0;
  EXPECT_THROW(guard.run(Key::make("payment", "p5"), "",
                         [&](idem::sqlite::Transaction&) -> std::string {
                           ++runs;
                           throw idem::StorageTimeout("the business table is locked");
                         }),
               idem::StorageTimeout);
  EXPECT_EQ(1, runs);
  EXPECT_EQ(0u, guard.stats().snapshot().store_retries);
}

// A handler running five leases long, with duplicates arriving all the time: `heartbeat` on,
// every duplicate is in progress and the handler completes once; off (the control), a duplicate
// takes the expired claim over and the first attempt is fenced.
struct LongHandlerRun {
  int runs = 0;
  int duplicates_executed = 0, duplicates_in_progress = 0;
  bool first_lease_lost = false;
  idem::GuardStatsSnapshot stats;
};

LongHandlerRun run_long_handler(bool heartbeat) {
  idem::MemoryStore fast;
  GuardOptions o;
  o.lease = 300ms;  // beats every 100 ms: 200 ms of slack for a loaded machine
  o.heartbeat = heartbeat;
  idem::IdempotencyGuard guard{fast, o};
  const Key key = Key::make("report", "r1");
  LongHandlerRun out;
  std::atomic<bool> running{false}, done{false};
  std::atomic<int> runs{0};
  std::thread first([&] {
    try {
      auto r = guard.run(key, "", [&] {
        ++runs;
        running = true;
        std::this_thread::sleep_for(1500ms);  // five leases
        return std::string("report ready");
      });
      EXPECT_EQ(Outcome::kExecuted, r.outcome);
    } catch (const idem::LeaseLost&) {
      out.first_lease_lost = true;
    }
    done = true;
  });
  while (!running) std::this_thread::sleep_for(1ms);
  while (!done) {
    auto r = guard.run(key, "", [&] {
      ++runs;
      return std::string("duplicate ran");
    });
    if (r.outcome == Outcome::kExecuted) ++out.duplicates_executed;
    if (r.outcome == Outcome::kInProgress) ++out.duplicates_in_progress;
    std::this_thread::sleep_for(15ms);
  }
  first.join();
  out.runs = runs.load();
  out.stats = guard.stats().snapshot();
  return out;
}

TEST(HeartbeatTest, AHandlerRunningFiveLeasesCompletesOnceWithNoTakeover) {
  LongHandlerRun with = run_long_handler(true);
  EXPECT_EQ(1, with.runs);
  EXPECT_FALSE(with.first_lease_lost);
  EXPECT_EQ(0, with.duplicates_executed);
  EXPECT_GT(with.duplicates_in_progress, 5);
  EXPECT_EQ(0u, with.stats.leases_lost);
  EXPECT_EQ(0u, with.stats.takeovers);

  LongHandlerRun without = run_long_handler(false);  // the control: the test can tell
  EXPECT_GE(without.duplicates_executed, 1);
  EXPECT_TRUE(without.first_lease_lost);
}

TEST(HeartbeatTest, TwoPhaseExtendsTheDurableRecordThatAnotherProcessSees) {
  idem::test::TempDir dir;
  const std::string file = dir.file("beat.sqlite");
  idem::sqlite::SqliteStore durable_a{file}, durable_b{file};
  idem::MemoryStore fast_a, fast_b;  // two processes: their fast stores do not share claims
  GuardOptions oa;
  oa.lease = 300ms;
  oa.heartbeat = true;
  idem::IdempotencyGuard a{fast_a, durable_a, oa};
  idem::IdempotencyGuard b{fast_b, durable_b};
  const Key key = Key::make("export", "x1");
  std::atomic<bool> running{false}, done{false};
  std::atomic<int> runs{0};
  std::thread first([&] {
    auto r = a.run(key, "", [&] {  // two-phase: the durable record is in progress meanwhile
      ++runs;
      running = true;
      std::this_thread::sleep_for(1500ms);
      return std::string("exported");
    });
    EXPECT_EQ(Outcome::kExecuted, r.outcome);
    done = true;
  });
  while (!running) std::this_thread::sleep_for(1ms);
  int in_progress = 0;
  while (!done) {
    auto r = b.run(key, "", [&] {
      ++runs;
      return std::string("again");
    });
    EXPECT_NE(Outcome::kExecuted, r.outcome) << "taken over although the owner is alive";
    if (r.outcome == Outcome::kInProgress) ++in_progress;
    std::this_thread::sleep_for(20ms);
  }
  first.join();
  EXPECT_EQ(1, runs.load());
  EXPECT_GT(in_progress, 5);
  auto replay = b.run(key, "", [] { return std::string("again"); });
  EXPECT_EQ(Outcome::kReplayed, replay.outcome);
  EXPECT_EQ("exported", *replay.value);
  EXPECT_EQ(0u, a.stats().snapshot().leases_lost);
}

TEST(HeartbeatTest, ExtendIsOwnerCheckedOnEveryStore) {
  idem::MemoryStore memory;
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore sqlite{dir.file("extend.sqlite")};
  const Key key = Key::make("k", "1");
  auto mine = idem::OwnerToken::generate();
  auto other = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed, memory.claim(key, "", mine, 50ms).status);
  ASSERT_EQ(idem::ClaimStatus::kClaimed, sqlite.begin(key, "", mine, 50ms, {}).status);
  EXPECT_TRUE(memory.extend(key, mine, 10s));
  EXPECT_TRUE(sqlite.extend(key, mine, 10s));
  EXPECT_FALSE(memory.extend(key, other, 10s));
  EXPECT_FALSE(sqlite.extend(key, other, 10s));
  std::this_thread::sleep_for(100ms);  // past the first lease, within the extended one
  EXPECT_EQ(idem::ClaimStatus::kBusy, memory.claim(key, "", other, 50ms).status);
  EXPECT_EQ(idem::ClaimStatus::kBusy, sqlite.begin(key, "", other, 50ms, {}).status);
  ASSERT_TRUE(memory.complete(key, mine, "r", 60s));
  ASSERT_TRUE(sqlite.complete(key, mine, "r", 60s));
  EXPECT_FALSE(memory.extend(key, mine, 10s)) << "a completed record is not extended";
  EXPECT_FALSE(sqlite.extend(key, mine, 10s));
  EXPECT_FALSE(memory.extend(Key::make("k", "absent"), mine, 10s));
  EXPECT_THROW(memory.extend(key, mine, 0ms), idem::UsageError);
}

// A failed fast store is skipped for fast_store_retry_after: the calls meanwhile go to the
// durable store alone (degraded, every answer right), then one tries it again.
// What the observer hears of leases.
struct LeaseCounter final : idem::Observer {
  std::atomic<int> lost{0}, takeovers{0};
  void on_lease_lost(const Key&, std::string_view) noexcept override { ++lost; }
  void on_takeover(const Key&, std::string_view) noexcept override { ++takeovers; }
};

// A heartbeat whose extension is refused stops extending and reports nothing itself: the
// completion that the lost claim refuses reports the loss, once (LeaseLost); a call whose
// answer stands without that claim (a transactional call's fast claim) lost nothing.
TEST(HeartbeatTest, ALostClaimIsReportedOnceByTheRefusedCompletion) {
  idem::MemoryStore memory;
  idem::test::SwitchableFastStore fast{memory};
  fast.refuse_extend = true;
  auto observer = std::make_shared<LeaseCounter>();
  GuardOptions o;
  o.lease = 100ms;
  o.heartbeat = true;
  o.observer = observer;
  idem::IdempotencyGuard guard{fast, o};
  const Key key = Key::make("report", "beat-lost");
  std::atomic<bool> running{false};
  std::thread first([&] {
    EXPECT_THROW(guard.run(key, "",
                           [&] {
                             running = true;
                             std::this_thread::sleep_for(400ms);  // four leases, none extended
                             return std::string("late");
                           }),
                 idem::LeaseLost);
  });
  while (!running) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(200ms);  // the lease ended: the next call takes the key over
  EXPECT_EQ(Outcome::kExecuted, guard.run(key, "", [] { return std::string("second"); }).outcome);
  first.join();
  auto s = guard.stats().snapshot();
  EXPECT_EQ(1u, s.leases_lost);
  EXPECT_EQ(1, observer->lost.load());
  EXPECT_EQ(1u, s.takeovers);
  EXPECT_EQ(1, observer->takeovers.load());

  // Transactional: the fast claim's extension is refused, the durable transaction decides.
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable{dir.file("beat_lost.sqlite")};
  auto tx_observer = std::make_shared<LeaseCounter>();
  o.observer = tx_observer;
  idem::IdempotencyGuard tx_guard{fast, durable, o};
  auto r = tx_guard.run(Key::make("report", "beat-tx"), "", [](idem::sqlite::Transaction&) {
    std::this_thread::sleep_for(300ms);
    return std::string("committed");
  });
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  EXPECT_EQ(0u, tx_guard.stats().snapshot().leases_lost);
  EXPECT_EQ(0, tx_observer->lost.load());
}

class DownObserver : public idem::Observer {
 public:
  std::atomic<int> downs{0}, recoveries{0}, errors{0};
  std::atomic<std::uint64_t> failed_calls{0};
  void on_fast_store_down(const Key&, const idem::Error&) noexcept override { ++downs; }
  void on_fast_store_recovered(std::uint64_t n) noexcept override {
    ++recoveries;
    failed_calls = n;
  }
  void on_store_error(const idem::StoreErrorEvent&) noexcept override { ++errors; }
};

TEST(FastStoreRetryAfterTest, ADownFastStoreIsSkippedWhileThePauseLasts) {
  idem::MemoryStore memory;
  idem::test::SwitchableFastStore fast{memory};
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable{dir.file("retry_after.sqlite")};
  auto observer = std::make_shared<DownObserver>();
  GuardOptions o;
  o.fast_store_retry_after = std::chrono::hours{1};
  o.observer = observer;
  idem::IdempotencyGuard guard{fast, durable, o};
  int runs = 0;
  auto handler = [&] {
    ++runs;
    return std::string("r") + std::to_string(runs);
  };
  fast.failing = true;
  auto first = guard.run(Key::make("pay", "a"), "", handler);  // tries it: fails, degraded
  EXPECT_EQ(Outcome::kExecuted, first.outcome);
  EXPECT_TRUE(first.degraded);
  EXPECT_EQ(1, fast.calls.load()) << "the claim only: no follow-up on a degraded call";
  // Within the pause: the fast store is not called; the durable store answers everything.
  fast.failing = false;  // back already: still skipped until the pause ends
  auto replay = guard.run(Key::make("pay", "a"), "", handler);
  auto second = guard.run(Key::make("pay", "b"), "", handler);
  auto mismatch = guard.run(Key::make("pay", "b"), "other", handler);
  EXPECT_EQ(1, fast.calls.load()) << "skipped while the pause lasts";
  EXPECT_EQ(Outcome::kReplayed, replay.outcome);
  EXPECT_EQ("r1", *replay.value);
  EXPECT_EQ(idem::Source::kDurableStore, replay.source);
  EXPECT_TRUE(replay.degraded);
  EXPECT_EQ(Outcome::kExecuted, second.outcome);
  EXPECT_TRUE(second.degraded);
  EXPECT_EQ(Outcome::kFingerprintMismatch, mismatch.outcome);
  EXPECT_EQ(2, runs);
  EXPECT_EQ(4u, guard.stats().snapshot().degraded);
  EXPECT_EQ(1, observer->downs.load());
  EXPECT_EQ(1, observer->errors.load()) << "a skipped call reports no store error";
  EXPECT_EQ(0, observer->recoveries.load());
}

TEST(FastStoreRetryAfterTest, AfterThePauseTheNextCallTriesTheFastStoreAgain) {
  idem::MemoryStore memory;
  idem::test::SwitchableFastStore fast{memory};
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable{dir.file("retry_again.sqlite")};
  auto observer = std::make_shared<DownObserver>();
  GuardOptions o;
  o.fast_store_retry_after = 20ms;
  o.observer = observer;
  idem::IdempotencyGuard guard{fast, durable, o};
  fast.failing = true;
  EXPECT_TRUE(guard.run(Key::make("pay", "a"), "", [] { return std::string("r"); }).degraded);
  std::this_thread::sleep_for(60ms);  // past the pause: the next call tries it, and it fails
  EXPECT_TRUE(guard.run(Key::make("pay", "b"), "", [] { return std::string("r"); }).degraded);
  EXPECT_EQ(2, fast.calls.load());
  fast.failing = false;
  std::this_thread::sleep_for(60ms);
  auto r = guard.run(Key::make("pay", "c"), "", [] { return std::string("r"); });
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  EXPECT_FALSE(r.degraded);
  EXPECT_EQ(1, observer->downs.load());
  EXPECT_EQ(1, observer->recoveries.load());
  EXPECT_EQ(2u, observer->failed_calls.load());
  auto replay = guard.run(Key::make("pay", "c"), "", [] { return std::string("never"); });
  EXPECT_EQ(idem::Source::kFastStore, replay.source);
}

TEST(FastStoreRetryAfterTest, WithoutAPauseEveryCallTriesTheFastStore) {
  idem::MemoryStore memory;
  idem::test::SwitchableFastStore fast{memory};
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable{dir.file("no_pause.sqlite")};
  idem::IdempotencyGuard guard{fast, durable};  // fast_store_retry_after = 0
  fast.failing = true;
  for (int i = 0; i < 3; ++i) {
    auto r = guard.run(Key::make("pay", "a"), "", [] { return std::string("r"); });
    EXPECT_TRUE(r.degraded);
    EXPECT_EQ(i + 1, fast.calls.load());
  }
}

TEST(FastStoreRetryAfterTest, AFastOnlyGuardNeverSkipsItsStore) {
  idem::MemoryStore memory;
  idem::test::SwitchableFastStore fast{memory};
  GuardOptions o;
  o.fast_store_retry_after = std::chrono::hours{1};
  idem::IdempotencyGuard guard{fast, o};
  fast.failing = true;
  EXPECT_THROW(guard.run(Key::make("pay", "a"), "", [] { return std::string("r"); }),
               idem::StorageUnavailable);
  EXPECT_EQ(0u, guard.stats().snapshot().degraded) << "it failed: no store decided it";
  fast.failing = false;
  auto r = guard.run(Key::make("pay", "a"), "", [] { return std::string("r"); });
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
}

// The fast store fails after the durable store decided (its completion): a failure of the
// burst, told to the observer; the call is not degraded, in its result, its CallEvent and the
// guard's counters alike.
TEST(FastStoreRetryAfterTest, AFailedFollowUpDoesNotMakeADecidedCallDegraded) {
  idem::MemoryStore memory;
  idem::test::SwitchableFastStore fast{memory};
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable{dir.file("follow_up.sqlite")};
  struct Degraded final : idem::Observer {
    std::atomic<int> degraded_calls{0}, calls{0}, downs{0};
    void on_call(const idem::CallEvent& e) noexcept override {
      ++calls;
      if (e.degraded) ++degraded_calls;
    }
    void on_fast_store_down(const Key&, const idem::Error&) noexcept override { ++downs; }
  };
  auto observer = std::make_shared<Degraded>();
  GuardOptions o;
  o.observer = observer;
  idem::IdempotencyGuard guard{fast, durable, o};
  auto r = guard.run(Key::make("pay", "follow"), "", [&] {
    fast.failing = true;  // the fast complete after the durable one fails
    return std::string("paid");
  });
  EXPECT_EQ(Outcome::kExecuted, r.outcome);
  EXPECT_FALSE(r.degraded);
  EXPECT_EQ(0u, guard.stats().snapshot().degraded);
  EXPECT_EQ(1, observer->calls.load());
  EXPECT_EQ(0, observer->degraded_calls.load());
  EXPECT_EQ(1, observer->downs.load()) << "the failure is the burst's";
}

}  // namespace
