// SPDX-License-Identifier: MIT
// The guard with the fast store alone (MemoryStore): outcomes, codecs, errors, concurrency.
#include "idem/guard.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "idem/memory_store.hpp"
#include "support/failing_store.hpp"
#include "support/reassigning_handler.hpp"

namespace {

struct Receipt {
  std::string payment_no;
  long long amount = 0;
};

}  // namespace

template <>
struct idem::Codec<Receipt> {
  static std::string encode(const Receipt& r) {
    return r.payment_no + "," + std::to_string(r.amount);
  }
  static Receipt decode(std::string_view bytes) {
    auto comma = bytes.find(',');
    if (comma == std::string_view::npos) throw std::runtime_error("no comma");
    return Receipt{std::string(bytes.substr(0, comma)),
                   std::stoll(std::string(bytes.substr(comma + 1)))};
  }
};

namespace {

class RecordingObserver : public idem::Observer {
 public:
  std::atomic<int> duplicates{0}, downs{0}, recoveries{0}, handler_errors{0}, calls{0};
  void on_call(const idem::CallEvent&) noexcept override { ++calls; }
  void on_duplicate(const idem::DuplicateEvent&) noexcept override { ++duplicates; }
  void on_fast_store_down(const idem::Key&, const idem::Error&) noexcept override { ++downs; }
  void on_fast_store_recovered(std::uint64_t) noexcept override { ++recoveries; }
  void on_handler_error(const idem::Key&) noexcept override { ++handler_errors; }
};

TEST(GuardFastOnly, EveryOutcome) {
  idem::MemoryStore fast;
  auto observer = std::make_shared<RecordingObserver>();
  idem::GuardOptions options;
  options.observer = observer;
  idem::IdempotencyGuard guard{fast, options};
  static_assert(std::is_same_v<decltype(guard), idem::IdempotencyGuard<idem::NoDurableStore>>);
  auto key = idem::Key::make("payment", "o1");
  int runs = 0;
  auto first = guard.run(key, "fp", [&] {
    ++runs;
    // While the first call runs, a duplicate sees in_progress.
    auto inner = guard.run(key, "fp", [&] { ++runs; return std::string("never"); });
    EXPECT_EQ(idem::Outcome::kInProgress, inner.outcome);
    EXPECT_FALSE(inner.value.has_value());
    EXPECT_EQ(idem::errc::kInProgress, inner.error());
    // And a different payload is a mismatch even while in progress.
    auto other = guard.run(key, "fp2", [&] { ++runs; return std::string("never"); });
    EXPECT_EQ(idem::Outcome::kFingerprintMismatch, other.outcome);
    return std::string("pay_1");
  });
  EXPECT_EQ(idem::Outcome::kExecuted, first.outcome);
  EXPECT_EQ("pay_1", first.value.value());
  auto second = guard.run(key, "fp", [&] { ++runs; return std::string("pay_2"); });
  EXPECT_EQ(idem::Outcome::kReplayed, second.outcome);
  EXPECT_EQ(idem::Source::kFastStore, second.source);
  EXPECT_EQ("pay_1", second.value.value());
  // A replay says when its record's retention ends (GuardOptions::retention from the first
  // call); the first execution has no record to report.
  const auto retention = idem::GuardOptions{}.retention;
  EXPECT_GE(second.expires_at, idem::system_now() + retention - std::chrono::seconds(60));
  EXPECT_LE(second.expires_at, idem::system_now() + retention);
  EXPECT_EQ(idem::TimePoint{}, first.expires_at);
  auto mismatch = guard.run(key, "fp2", [&] { ++runs; return std::string("pay_3"); });
  EXPECT_EQ(idem::Outcome::kFingerprintMismatch, mismatch.outcome);
  EXPECT_EQ(idem::errc::kFingerprintMismatch, mismatch.error());
  EXPECT_EQ(1, runs);
  auto s = guard.stats().snapshot();
  EXPECT_EQ(5u, s.calls);
  EXPECT_EQ(1u, s.executed);
  EXPECT_EQ(1u, s.replayed);
  EXPECT_EQ(1u, s.in_progress);
  EXPECT_EQ(2u, s.mismatched);
  EXPECT_EQ(4u, s.fast_hits);
  EXPECT_EQ(4, observer->duplicates.load());
  EXPECT_EQ(5, observer->calls.load());
}

TEST(GuardFastOnly, TypedResponsesGoThroughTheCodec) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  auto key = idem::Key::make("payment", "typed");
  auto a = guard.run(key, "", [] { return Receipt{"pay_9", 1250}; });
  auto b = guard.run(key, "", [] { return Receipt{"wrong", 0}; });
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(idem::Outcome::kReplayed, b.outcome);
  EXPECT_EQ("pay_9", b.value->payment_no);
  EXPECT_EQ(1250, b.value->amount);
  // void handlers store nothing and replay a Unit.
  int runs = 0;
  auto v1 = guard.run(idem::Key::make("payment", "void"), "", [&] { ++runs; });
  auto v2 = guard.run(idem::Key::make("payment", "void"), "", [&] { ++runs; });
  EXPECT_EQ(idem::Outcome::kExecuted, v1.outcome);
  EXPECT_EQ(idem::Outcome::kReplayed, v2.outcome);
  EXPECT_EQ(1, runs);
  (void)a;
}

// "" is a fingerprint like any other (IdempotencyGuard::run): calls that all pass it never
// mismatch; a key used with and without a fingerprint is a mismatch, either way round.
TEST(GuardFastOnly, AnEmptyFingerprintIsComparedLikeAnyOther) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  auto run = [&](const char* id, const char* fp) {
    return guard.run(idem::Key::make("s", id), fp, [] { return std::string("r"); }).outcome;
  };
  EXPECT_EQ(idem::Outcome::kExecuted, run("none", ""));
  EXPECT_EQ(idem::Outcome::kReplayed, run("none", ""));
  EXPECT_EQ(idem::Outcome::kFingerprintMismatch, run("none", "fp"));
  EXPECT_EQ(idem::Outcome::kExecuted, run("some", "fp"));
  EXPECT_EQ(idem::Outcome::kFingerprintMismatch, run("some", ""));
}

// `return "ok";` and string views store a std::string (a pointer or view would dangle).
TEST(GuardFastOnly, CStringAndStringViewResponsesAreStoredAsStrings) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  auto key = idem::Key::make("payment", "c_string");
  int runs = 0;
  auto a = guard.run(key, "", [&] {
    ++runs;
    return "ok";
  });
  auto b = guard.run(key, "", [&] {
    ++runs;
    return "not this";
  });
  static_assert(std::is_same_v<decltype(a.value), std::optional<std::string>>);
  EXPECT_EQ(idem::Outcome::kExecuted, a.outcome);
  EXPECT_EQ(idem::Outcome::kReplayed, b.outcome);
  EXPECT_EQ("ok", *a.value);
  EXPECT_EQ("ok", *b.value);
  EXPECT_EQ(1, runs);

  std::string buffer = "pay_7";
  auto key2 = idem::Key::make("payment", "view");
  auto c = guard.run(key2, "", [&] { return std::string_view(buffer); });
  buffer = "changed";  // the stored copy does not follow
  auto d = guard.run(key2, "", [&] { return std::string_view(buffer); });
  static_assert(std::is_same_v<decltype(c.value), std::optional<std::string>>);
  EXPECT_EQ("pay_7", *c.value);
  EXPECT_EQ("pay_7", *d.value);
  EXPECT_EQ(idem::Outcome::kReplayed, d.outcome);
}

TEST(GuardFastOnly, UndecodableStoredResponseIsCorruptRecord) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  auto key = idem::Key::make("payment", "corrupt");
  fast.fill(key, "", "no-comma-here", std::chrono::seconds(60));
  EXPECT_THROW((void)guard.run(key, "", [] { return Receipt{"x", 1}; }), idem::CorruptRecord);
}

TEST(GuardFastOnly, HandlerThrowsReleasesSoARetryRuns) {
  idem::MemoryStore fast;
  auto observer = std::make_shared<RecordingObserver>();
  idem::GuardOptions options;
  options.observer = observer;
  idem::IdempotencyGuard guard{fast, options};
  auto key = idem::Key::make("payment", "throws");
  int runs = 0;
  EXPECT_THROW((void)guard.run(key, "", [&]() -> std::string {
    ++runs;
    throw std::runtime_error("gateway timeout");
  }),
               std::runtime_error);
  auto retry = guard.run(key, "", [&] { ++runs; return std::string("ok"); });
  EXPECT_EQ(idem::Outcome::kExecuted, retry.outcome);
  EXPECT_EQ(2, runs);
  EXPECT_EQ(1, observer->handler_errors.load());
}

TEST(GuardFastOnly, LeaseLostIsReportedAndTheWinnerKept) {
  idem::ManualClock clock;
  idem::MemoryStoreOptions mo;
  mo.clock = clock.as_clock();
  idem::MemoryStore fast(mo);
  idem::GuardOptions options;
  options.lease = std::chrono::seconds(5);
  idem::IdempotencyGuard guard{fast, options};
  auto key = idem::Key::make("payment", "slow");
  int runs = 0;
  EXPECT_THROW((void)guard.run(key, "", [&] {
    ++runs;
    clock.advance(std::chrono::seconds(6));  // the handler outlives its lease...
    auto takeover = guard.run(key, "", [&] { ++runs; return std::string("winner"); });
    EXPECT_EQ(idem::Outcome::kExecuted, takeover.outcome);  // ...and is taken over
    return std::string("stale");
  }),
               idem::LeaseLost);
  auto after = guard.run(key, "", [&] { ++runs; return std::string("never"); });
  EXPECT_EQ("winner", after.value.value());
  EXPECT_EQ(2, runs);
  EXPECT_EQ(1u, guard.stats().snapshot().takeovers);
  EXPECT_EQ(1u, guard.stats().snapshot().leases_lost);
}

// The fast store lost the call's record while the handler ran (an eviction, a flush, a restart
// without persistence): nobody holds the key, so the response is written back and the call
// answers executed. It was LeaseLost, "retry replays the winner", and with no winner the
// retry ran the handler again.
TEST(GuardFastOnly, ARecordTheStoreLostIsWrittenBackAndReplayed) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  auto key = idem::Key::make("payment", "evicted");
  int runs = 0;
  auto first = guard.run(key, "fp", [&] {
    ++runs;
    fast.clear();  // the store forgets every record
    return std::string("charged");
  });
  EXPECT_EQ(idem::Outcome::kExecuted, first.outcome);
  auto retry = guard.run(key, "fp", [&] {
    ++runs;
    return std::string("charged again");
  });
  EXPECT_EQ(idem::Outcome::kReplayed, retry.outcome);
  EXPECT_EQ("charged", retry.value.value());
  EXPECT_EQ(1, runs);
  EXPECT_EQ(0u, guard.stats().snapshot().leases_lost);
  EXPECT_EQ(1u, guard.stats().snapshot().fast_refills);
}

TEST(GuardFastOnly, FastStoreDownIsAnErrorWithoutADurableStore) {
  idem::MemoryStore memory;
  idem::test::SwitchableFastStore fast(memory);
  idem::IdempotencyGuard guard{static_cast<idem::FastStore&>(fast)};
  fast.failing = true;
  int runs = 0;
  try {
    (void)guard.run(idem::Key::make("p", "1"), "", [&] { ++runs; return std::string(); });
    FAIL() << "no exception";
  } catch (const idem::StorageUnavailable& e) {
    EXPECT_TRUE(e.retryable());
    EXPECT_EQ(503, e.http_status());
  }
  EXPECT_EQ(0, runs);
}

// The handler reassigns the Key and fingerprint it was passed: the fast-only call completes
// the key it claimed (no LeaseLost, no record under the other key) and the replay works.
TEST(GuardFastOnly, HandlerReassigningItsKeyAndFingerprintCompletesTheAcquiredKey) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  auto acquired = idem::Key::make("payment", "reassigned_1");
  auto other = idem::Key::make("payment", "reassigned_2");
  const std::string fp = idem::test::heap_fingerprint(acquired.id());
  int runs = 0, effects = 0;
  auto r = idem::test::run_reassigning<void>(guard, acquired, other, fp, runs, [&] { ++effects; });
  EXPECT_EQ(idem::Outcome::kExecuted, r.outcome);
  EXPECT_EQ(1, effects);
  idem::test::expect_acquired_key_completed(fast, acquired, other, fp);
  idem::test::expect_replay<void>(guard, acquired, fp, runs);
  EXPECT_EQ(1, runs);
  EXPECT_EQ(0u, guard.stats().snapshot().leases_lost);
}

TEST(GuardFastOnly, ThirtyTwoThreadsOneKeyRunOnce) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  auto key = idem::Key::make("payment", "storm");
  std::atomic<int> runs{0}, executed{0}, replayed{0}, in_progress{0}, wrong{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&] {
      while (!go.load()) std::this_thread::yield();
      auto r = guard.run(key, "fp", [&] {
        ++runs;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        return std::string("pay_storm");
      });
      switch (r.outcome) {
        case idem::Outcome::kExecuted: ++executed; break;
        case idem::Outcome::kReplayed: ++replayed; break;
        case idem::Outcome::kInProgress: ++in_progress; break;
        default: ++wrong;
      }
      if (r.ok() && *r.value != "pay_storm") ++wrong;
    });
  }
  go = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(1, runs.load());
  EXPECT_EQ(1, executed.load());
  EXPECT_EQ(31, replayed.load() + in_progress.load());
  EXPECT_EQ(0, wrong.load());
  for (int i = 0; i < 32; ++i) {
    auto r = guard.run(key, "fp", [&] { ++runs; return std::string("again"); });
    EXPECT_EQ("pay_storm", r.value.value());
  }
  EXPECT_EQ(1, runs.load());
}

TEST(GuardOptions, RejectsNonPositiveDurations) {
  idem::MemoryStore fast;
  idem::GuardOptions o;
  o.lease = std::chrono::milliseconds(0);
  EXPECT_THROW(idem::IdempotencyGuard(fast, o), idem::UsageError);
  o.lease = std::chrono::seconds(1);
  o.retention = std::chrono::seconds(0);
  EXPECT_THROW(idem::IdempotencyGuard(fast, o), idem::UsageError);
}

// Options that would misbehave only at the first call (a negative backoff hung the first
// retried store failure: its jitter range was empty) are refused when the guard is made.
TEST(GuardOptions, RejectsNegativeWaitsAndNoAttempts) {
  idem::MemoryStore fast;
  auto refused = [&](auto change, const std::string& name) {
    idem::GuardOptions o;
    change(o);
    try {
      idem::IdempotencyGuard guard(fast, o);
      ADD_FAILURE() << name << " was accepted";
    } catch (const idem::UsageError& e) {
      EXPECT_NE(std::string::npos, std::string(e.what()).find("GuardOptions::" + name)) << e.what();
    }
  };
  refused([](idem::GuardOptions& o) { o.store_retry_backoff = std::chrono::milliseconds(-20); },
          "store_retry_backoff");
  refused([](idem::GuardOptions& o) { o.wait_for_result = std::chrono::milliseconds(-1); },
          "wait_for_result");
  refused([](idem::GuardOptions& o) { o.fast_store_retry_after = std::chrono::milliseconds(-1); },
          "fast_store_retry_after");
  refused([](idem::GuardOptions& o) { o.store_attempts = 0; }, "store_attempts");
  idem::GuardOptions zero;  // zero waits are valid (no wait, no pause)
  zero.store_retry_backoff = std::chrono::milliseconds(0);
  zero.store_attempts = 3;
  idem::IdempotencyGuard guard(fast, zero);
  EXPECT_EQ(
      idem::Outcome::kExecuted,
      guard.run(idem::Key::make("payment", "zero-backoff"), "fp", [] { return std::string("ok"); })
          .outcome);
}

}  // namespace

namespace {

class TimingObserver : public idem::Observer {
 public:
  std::vector<idem::CallEvent> events;
  void on_call(const idem::CallEvent& e) noexcept override { events.push_back(e); }
};

// The guard reads the clock only for an observer; with one, every phase is timed.
TEST(GuardObserver, CallEventsCarryPhaseTimings) {
  idem::MemoryStore fast;
  auto observer = std::make_shared<TimingObserver>();
  idem::GuardOptions options;
  options.observer = observer;
  idem::IdempotencyGuard guard{fast, options};
  auto key = idem::Key::make("payment", "timed");
  auto first = guard.run(key, "fp", [] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return std::string("ok");
  });
  auto again = guard.run(key, "fp", [] { return std::string("never"); });
  ASSERT_EQ(idem::Outcome::kExecuted, first.outcome);
  ASSERT_EQ(idem::Outcome::kReplayed, again.outcome);
  ASSERT_EQ(2u, observer->events.size());
  const auto& run = observer->events[0];
  EXPECT_GE(run.handler, std::chrono::milliseconds(5));
  EXPECT_GT(run.fast_claim.count(), 0);
  EXPECT_GE(run.total, run.handler + run.fast_claim);
  const auto& replay = observer->events[1];
  EXPECT_EQ(0, replay.handler.count());
  EXPECT_GT(replay.fast_claim.count(), 0);
  EXPECT_GE(replay.total, replay.fast_claim);
}

}  // namespace
