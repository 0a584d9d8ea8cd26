// SPDX-License-Identifier: MIT
// IdempotencyGuard::run_batch on SQLite with MemoryStore in front: one transaction for the
// batch, answers per call, failures per call, and the fast store kept in step.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "idem/guard.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/failing_store.hpp"
#include "support/test_env.hpp"

namespace {

using idem::BatchAnswer;
using idem::BatchCall;
using idem::BatchResult;
using idem::Key;
using idem::Outcome;
using idem::Source;
using idem::sqlite::SqliteStore;
using idem::sqlite::Transaction;

class GuardBatchTest : public ::testing::Test {
 protected:
  GuardBatchTest() : durable_(dir_.file("batch.sqlite")) {
    durable_.database().write(
        [](Transaction& tx) { tx.exec("CREATE TABLE effect (id TEXT NOT NULL)"); });
  }

  // A batch of `ids` (fingerprint: the id), each handler writing one effect row.
  std::vector<BatchCall> calls(const std::vector<std::string>& ids) {
    fingerprints_.clear();
    fingerprints_.reserve(ids.size());
    std::vector<BatchCall> out;
    for (const auto& id : ids) {
      fingerprints_.push_back(idem::fingerprint(id));
      out.push_back(BatchCall{Key::make("orders", id), fingerprints_.back()});
    }
    return out;
  }
  template <class Guard>
  BatchResult run(Guard& guard, const std::vector<std::string>& ids) {
    return guard.run_batch(calls(ids), "done", [&](Transaction& tx, std::size_t i) {
      tx.exec("INSERT INTO effect (id) VALUES (?)", ids[i]);
    });
  }
  long effects(const std::string& id) {
    return static_cast<long>(durable_.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM effect WHERE id = ?", id).value_or(-1);
    }));
  }

  idem::test::TempDir dir_;
  SqliteStore durable_;
  std::vector<std::string> fingerprints_;
};

TEST_F(GuardBatchTest, EachKeyRunsOnceAndEveryCallIsAnsweredInOrder) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, durable_};
  BatchResult r = run(guard, {"a", "b", "a", "c"});
  ASSERT_EQ(4u, r.answers.size());
  EXPECT_EQ(Outcome::kExecuted, r.answers[0].outcome);
  EXPECT_EQ(Outcome::kExecuted, r.answers[1].outcome);
  EXPECT_EQ(Outcome::kReplayed, r.answers[2].outcome) << "the repeat of a key inside the batch";
  EXPECT_EQ(Source::kDurableStore, r.answers[2].source);
  EXPECT_EQ("done", r.answers[2].response);
  EXPECT_EQ(Outcome::kExecuted, r.answers[3].outcome);
  EXPECT_FALSE(r.rerun);
  for (const char* id : {"a", "b", "c"}) EXPECT_EQ(1, effects(id)) << id;

  // The fast store holds the completed records: a second batch is answered there alone.
  BatchResult again = run(guard, {"a", "b", "c"});
  for (const BatchAnswer& a : again.answers) {
    EXPECT_EQ(Outcome::kReplayed, a.outcome);
    EXPECT_EQ(Source::kFastStore, a.source);
    EXPECT_EQ("done", a.response);
  }
  const auto s = guard.stats().snapshot();
  EXPECT_EQ(7u, s.calls);
  EXPECT_EQ(3u, s.executed);
  EXPECT_EQ(4u, s.replayed);
  EXPECT_EQ(3u, s.fast_hits);
  EXPECT_EQ(1u, s.durable_conflicts);
  for (const char* id : {"a", "b", "c"}) EXPECT_EQ(1, effects(id)) << id;
  EXPECT_TRUE(guard.run_batch({}, "done", [](Transaction&, std::size_t) {}).answers.empty());
}

TEST_F(GuardBatchTest, AFailingHandlerLosesOnlyItsOwnWritesAndItsKeyStaysFree) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, durable_};
  const std::vector<std::string> ids{"a", "bad", "c"};
  int runs = 0;
  BatchResult r = guard.run_batch(calls(ids), "done", [&](Transaction& tx, std::size_t i) {
    ++runs;
    tx.exec("INSERT INTO effect (id) VALUES (?)", ids[i]);
    if (ids[i] == "bad") throw std::runtime_error("cannot apply bad");
  });
  EXPECT_TRUE(r.rerun);
  EXPECT_EQ(Outcome::kExecuted, r.answers[0].outcome);
  ASSERT_TRUE(r.answers[1].error);
  EXPECT_THROW(std::rethrow_exception(r.answers[1].error), std::runtime_error);
  EXPECT_EQ(Outcome::kExecuted, r.answers[2].outcome);
  EXPECT_EQ(1, effects("a"));
  EXPECT_EQ(0, effects("bad"));
  EXPECT_EQ(1, effects("c"));
  EXPECT_EQ(1u, guard.stats().snapshot().handler_errors);
  // No record and no fast claim stay behind: the key runs again at once.
  EXPECT_FALSE(durable_.lookup(Key::make("orders", "bad")));
  EXPECT_FALSE(fast.lookup(Key::make("orders", "bad")));
  BatchResult retry = run(guard, {"bad"});
  EXPECT_EQ(Outcome::kExecuted, retry.answers[0].outcome);
  EXPECT_EQ(1, effects("bad"));
}

// A key repeated in the batch runs once even when its first call fails: the repeat is not run
// again in the savepoint pass (it could commit the effect the first call's error refused, and
// leave the first call's failure counted against a key now done). It answers in progress.
TEST_F(GuardBatchTest, TheRepeatOfAFailingKeyIsNotRunAgain) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, durable_};
  const std::vector<std::string> ids{"a", "bad", "c", "bad"};
  std::vector<int> runs(ids.size(), 0);
  BatchResult r = guard.run_batch(calls(ids), "done", [&](Transaction& tx, std::size_t i) {
    ++runs[i];
    tx.exec("INSERT INTO effect (id) VALUES (?)", ids[i]);
    // The first call of "bad" fails; a run of its repeat would succeed (a flaky dependency).
    if (i == 1) throw std::runtime_error("cannot apply bad");
  });
  EXPECT_TRUE(r.rerun);
  EXPECT_EQ(Outcome::kExecuted, r.answers[0].outcome);
  ASSERT_TRUE(r.answers[1].error);
  EXPECT_EQ(Outcome::kExecuted, r.answers[2].outcome);
  EXPECT_FALSE(r.answers[3].error);
  EXPECT_EQ(Outcome::kInProgress, r.answers[3].outcome);
  EXPECT_EQ(0, runs[3]) << "the repeat ran the failing key again";
  EXPECT_EQ(0, effects("bad"));
  EXPECT_EQ(1, effects("a"));
  EXPECT_EQ(1, effects("c"));
  EXPECT_FALSE(durable_.lookup(Key::make("orders", "bad")));
  EXPECT_FALSE(fast.lookup(Key::make("orders", "bad")));
  const auto s = guard.stats().snapshot();
  EXPECT_EQ(1u, s.handler_errors);
  EXPECT_EQ(1u, s.in_progress);
}

TEST_F(GuardBatchTest, ARetryableHandlerErrorRollsTheWholeBatchBackAndReleasesItsClaims) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, durable_};
  const std::vector<std::string> ids{"a", "b"};
  EXPECT_THROW(guard.run_batch(calls(ids), "done",
                               [&](Transaction& tx, std::size_t i) {
                                 tx.exec("INSERT INTO effect (id) VALUES (?)", ids[i]);
                                 if (i == 1) throw idem::StorageTimeout("business row locked");
                               }),
               idem::StorageTimeout);
  EXPECT_EQ(0, effects("a"));
  EXPECT_FALSE(fast.lookup(Key::make("orders", "a"))) << "the fast claims are released";
  BatchResult r = run(guard, ids);
  EXPECT_EQ(Outcome::kExecuted, r.answers[0].outcome);
  EXPECT_EQ(Outcome::kExecuted, r.answers[1].outcome);
  EXPECT_EQ(1, effects("a"));
  EXPECT_EQ(1, effects("b"));
}

TEST_F(GuardBatchTest, RecordsTheFastStoreLostAreReplayedFromTheDatabaseAndWrittenBack) {
  idem::MemoryStore first_fast;
  idem::IdempotencyGuard first{first_fast, durable_};
  BatchResult r = run(first, {"a", "b"});
  ASSERT_EQ(Outcome::kExecuted, r.answers[0].outcome);
  // A dead-lettered key, failed in the durable store.
  const auto owner = idem::OwnerToken::generate();
  const Key dead = Key::make("orders", "dead");
  const std::string dead_fp = idem::fingerprint("dead");
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            durable_.begin(dead, dead_fp, owner, std::chrono::seconds{30}).status);
  ASSERT_TRUE(durable_.fail(dead, owner, "poison", std::chrono::hours{1}));

  idem::MemoryStore empty_fast;  // another process's fast store, or a flushed one
  idem::IdempotencyGuard guard{empty_fast, durable_};
  BatchResult again = run(guard, {"a", "b", "dead"});
  for (const BatchAnswer& a : again.answers) {
    EXPECT_EQ(Outcome::kReplayed, a.outcome);
    EXPECT_EQ(Source::kDurableStore, a.source);
  }
  EXPECT_EQ("done", again.answers[0].response);
  EXPECT_FALSE(again.answers[0].failed);
  EXPECT_TRUE(again.answers[2].failed);
  EXPECT_EQ("poison", again.answers[2].response);
  EXPECT_EQ(1, effects("a"));
  EXPECT_EQ(0, effects("dead"));
  auto refilled = empty_fast.lookup(Key::make("orders", "a"));
  ASSERT_TRUE(refilled);
  EXPECT_EQ(idem::Record::Status::kCompleted, refilled->status);
  EXPECT_EQ("done", refilled->response);
  auto failed = empty_fast.lookup(dead);
  ASSERT_TRUE(failed);
  EXPECT_EQ(idem::Record::Status::kFailed, failed->status) << "a failed record stays failed";
}

TEST_F(GuardBatchTest, AnotherPayloadUnderAKeyIsAMismatchAndRunsNothing) {
  idem::IdempotencyGuard guard{durable_};
  ASSERT_EQ(Outcome::kExecuted, run(guard, {"a"}).answers[0].outcome);
  const std::string other = idem::fingerprint("another body");
  std::vector<BatchCall> c;
  c.push_back(BatchCall{Key::make("orders", "a"), other});
  int runs = 0;
  BatchResult r = guard.run_batch(std::move(c), "done", [&](Transaction&, std::size_t) { ++runs; });
  EXPECT_EQ(Outcome::kFingerprintMismatch, r.answers[0].outcome);
  EXPECT_EQ(0, runs);
  EXPECT_EQ(1, effects("a"));
}

// What the observer hears of a batch's takeovers and store failures.
struct BatchObserver final : idem::Observer {
  std::atomic<int> takeovers{0}, store_errors{0};
  void on_takeover(const Key&, std::string_view) noexcept override { ++takeovers; }
  void on_store_error(const idem::StoreErrorEvent&) noexcept override { ++store_errors; }
};

idem::GuardOptions observed_by(std::shared_ptr<idem::Observer> observer) {
  idem::GuardOptions o;
  o.observer = std::move(observer);
  return o;
}

// A fast claim of the batch that takes an expired lease over (a consumer that died) is
// counted and reported as run() reports it.
TEST_F(GuardBatchTest, AFastTakeoverIsReportedAsRunReportsIt) {
  idem::MemoryStore fast;
  auto observer = std::make_shared<BatchObserver>();
  idem::IdempotencyGuard guard{fast, durable_, observed_by(observer)};
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            fast.claim(Key::make("orders", "x"), idem::fingerprint("x"),
                       idem::OwnerToken::generate(), std::chrono::milliseconds(50))
                .status);
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  BatchResult r = run(guard, {"x"});
  EXPECT_EQ(Outcome::kExecuted, r.answers[0].outcome);
  EXPECT_EQ(1u, guard.stats().snapshot().takeovers);
  EXPECT_EQ(1, observer->takeovers.load());
  EXPECT_EQ(1, effects("x"));
}

// A batch whose transaction fails (here a handler's retryable store error, which fails the
// whole batch): every call is counted, the failure told to the observer once, the fast claims
// released (the next delivery runs at once).
TEST_F(GuardBatchTest, AFailedTransactionIsCountedAndReportedOnce) {
  idem::MemoryStore fast;
  auto observer = std::make_shared<BatchObserver>();
  idem::IdempotencyGuard guard{fast, durable_, observed_by(observer)};
  EXPECT_THROW(guard.run_batch(calls({"a", "b"}), "done",
                               [](Transaction&, std::size_t) -> void {
                                 throw idem::StorageTimeout("test: a lock wait ran out");
                               }),
               idem::StorageTimeout);
  EXPECT_EQ(2u, guard.stats().snapshot().calls);
  EXPECT_EQ(1, observer->store_errors.load());
  BatchResult r = run(guard, {"a", "b"});
  EXPECT_EQ(Outcome::kExecuted, r.answers[0].outcome);
  EXPECT_EQ(Outcome::kExecuted, r.answers[1].outcome);
  EXPECT_EQ(1, effects("a"));
}

TEST_F(GuardBatchTest, AFastStoreThatFailsLeavesTheBatchToTheDatabase) {
  idem::MemoryStore inner;
  idem::test::SwitchableFastStore fast{inner};
  fast.failing = true;
  idem::IdempotencyGuard guard{fast, durable_};
  BatchResult r = run(guard, {"a", "b"});
  EXPECT_EQ(Outcome::kExecuted, r.answers[0].outcome);
  EXPECT_EQ(Outcome::kExecuted, r.answers[1].outcome);
  EXPECT_EQ(2u, guard.stats().snapshot().degraded);
  BatchResult again = run(guard, {"a", "b"});
  EXPECT_EQ(Outcome::kReplayed, again.answers[0].outcome);
  EXPECT_EQ(Source::kDurableStore, again.answers[0].source);
  EXPECT_EQ(1, effects("a"));
  EXPECT_EQ(1, effects("b"));
}

// A handler that rewrites the bytes its call's fingerprint views: the record keeps what the
// batch was given.
TEST_F(GuardBatchTest, TheBatchOwnsItsFingerprints) {
  idem::IdempotencyGuard guard{durable_};
  std::string fp = idem::fingerprint("body");
  const std::string original = fp;
  std::vector<BatchCall> c;
  c.push_back(BatchCall{Key::make("orders", "own"), fp});
  BatchResult r = guard.run_batch(std::move(c), "done",
                                  [&](Transaction&, std::size_t) { fp.assign(fp.size(), 'x'); });
  ASSERT_EQ(Outcome::kExecuted, r.answers[0].outcome);
  auto rec = durable_.lookup(Key::make("orders", "own"));
  ASSERT_TRUE(rec);
  EXPECT_EQ(original, rec->fingerprint);
}

// A SQLite store that keeps the hint of every record_batch_in and, when the hint expects the
// keys absent, answers as a store whose insert assumes fresh keys does (PostgresStore's plain
// insert): nullopt when a key of the batch has a record.
class HintRecordingStore : public SqliteStore {
 public:
  using SqliteStore::SqliteStore;
  std::optional<std::vector<bool>> record_batch_in(Transaction& tx,
                                                   const std::vector<idem::ClaimRequest>& requests,
                                                   std::string_view response,
                                                   std::chrono::seconds retention,
                                                   idem::DurableHint hint) {
    hints.push_back(hint);
    if (hint.expects_absent()) {
      for (const idem::ClaimRequest& r : requests) {
        if (lookup(*r.key)) return std::nullopt;
      }
    }
    return SqliteStore::record_batch_in(tx, requests, response, retention, hint);
  }
  std::vector<idem::DurableHint> hints;
};

// BatchCall::likely_new: without granted fast claims, a batch whose every call says its key is
// likely new (and none is a retry) passes DurableHint::likely_new to record_batch_in; any other
// batch passes no hint, and granted fast claims pass fast_claimed instead. A record met anyway
// costs one rerun with the tolerant insert and changes no answer.
TEST_F(GuardBatchTest, CallsSayingTheirKeysAreLikelyNewLetTheStoreAssumeFreshKeys) {
  HintRecordingStore store{dir_.file("hints.sqlite")};
  store.database().write(
      [](Transaction& tx) { tx.exec("CREATE TABLE effect (id TEXT NOT NULL)"); });
  auto effects_of = [&](const std::string& id) {
    return store.database().read([&](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM effect WHERE id = ?", id).value_or(-1);
    });
  };
  // ids[i] is likely new unless `not_new` names it; `retried` marks one as a retry.
  auto batch = [&](auto& guard, const std::vector<std::string>& ids, const std::string& not_new,
                   const std::string& retried = "") {
    std::vector<BatchCall> cs = calls(ids);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      cs[i].likely_new = ids[i] != not_new;
      cs[i].retried = ids[i] == retried;
    }
    return guard.run_batch(std::move(cs), "done", [&](Transaction& tx, std::size_t i) {
      tx.exec("INSERT INTO effect (id) VALUES (?)", ids[i]);
    });
  };
  idem::IdempotencyGuard<HintRecordingStore> alone{store};

  BatchResult r = batch(alone, {"a", "b"}, "");
  ASSERT_EQ(1u, store.hints.size());
  EXPECT_TRUE(store.hints.back().likely_new);
  EXPECT_FALSE(store.hints.back().fast_claimed);
  EXPECT_FALSE(r.records_existed);
  EXPECT_EQ(Outcome::kExecuted, r.answers[0].outcome);
  EXPECT_EQ(Outcome::kExecuted, r.answers[1].outcome);

  // "a" has a record: the insert assuming fresh keys meets it, the batch runs again tolerantly.
  store.hints.clear();
  r = batch(alone, {"c", "a"}, "");
  ASSERT_EQ(2u, store.hints.size());
  EXPECT_TRUE(store.hints[0].likely_new);
  EXPECT_FALSE(store.hints[1].expects_absent());
  EXPECT_TRUE(r.records_existed);
  EXPECT_FALSE(r.rerun);
  EXPECT_EQ(Outcome::kExecuted, r.answers[0].outcome);
  EXPECT_EQ(Outcome::kReplayed, r.answers[1].outcome);
  EXPECT_EQ("done", r.answers[1].response);

  // One call not likely new, or one retry: no hint.
  store.hints.clear();
  r = batch(alone, {"d", "e"}, "e");
  EXPECT_EQ(Outcome::kExecuted, r.answers[1].outcome);
  r = batch(alone, {"f", "g"}, "", "g");
  EXPECT_EQ(Outcome::kExecuted, r.answers[1].outcome);
  ASSERT_EQ(2u, store.hints.size());
  for (const idem::DurableHint& h : store.hints) EXPECT_FALSE(h.expects_absent());

  // Fast claims granted: they are the evidence (fast_claimed). A failing fast store grants
  // none: the calls' word counts again.
  idem::MemoryStore inner;
  idem::test::SwitchableFastStore fast{inner};
  idem::IdempotencyGuard<HintRecordingStore> fronted{fast, store};
  store.hints.clear();
  r = batch(fronted, {"h"}, "");
  ASSERT_EQ(1u, store.hints.size());
  EXPECT_TRUE(store.hints[0].fast_claimed);
  EXPECT_FALSE(store.hints[0].likely_new);
  fast.failing = true;
  r = batch(fronted, {"i", "b"}, "");
  ASSERT_EQ(3u, store.hints.size());
  EXPECT_TRUE(store.hints[1].likely_new);
  EXPECT_FALSE(store.hints[1].fast_claimed);
  EXPECT_FALSE(store.hints[2].expects_absent());
  EXPECT_EQ(Outcome::kExecuted, r.answers[0].outcome);
  EXPECT_EQ(Outcome::kReplayed, r.answers[1].outcome);

  for (const char* id : {"a", "b", "c", "d", "e", "f", "g", "h", "i"}) {
    EXPECT_EQ(1, effects_of(id)) << id;
  }
}

// Eight threads run overlapping batches of the same keys: exactly one effect per key, and
// across all batches exactly one executed answer per key.
TEST_F(GuardBatchTest, ConcurrentOverlappingBatchesRunEachKeyOnce) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, durable_};
  constexpr int kThreads = 8;
  constexpr int kKeys = 40;
  std::atomic<int> executed{0};
  std::atomic<int> answered{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        std::vector<std::string> ids;
        std::vector<std::string> fps;
        for (int k = (t + round) % 4; k < kKeys; k += 3) ids.push_back("k" + std::to_string(k));
        for (const auto& id : ids) fps.push_back(idem::fingerprint(id));
        std::vector<BatchCall> c;
        for (std::size_t i = 0; i < ids.size(); ++i) {
          c.push_back(BatchCall{Key::make("orders", ids[i]), fps[i]});
        }
        try {
          BatchResult r =
              guard.run_batch(std::move(c), "done", [&](Transaction& tx, std::size_t i) {
                tx.exec("INSERT INTO effect (id) VALUES (?)", ids[i]);
              });
          for (const BatchAnswer& a : r.answers) {
            ++answered;
            if (a.outcome == Outcome::kExecuted) ++executed;
          }
        } catch (const idem::StorageError&) {
          // A busy database is typed; the batch committed nothing and is retried below.
          --round;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  int keys_run = 0;
  for (int k = 0; k < kKeys; ++k) {
    const long n = effects("k" + std::to_string(k));
    EXPECT_EQ(1, n) << "k" << k;
    keys_run += static_cast<int>(n);
  }
  EXPECT_EQ(keys_run, executed.load());
  EXPECT_GT(answered.load(), 0);
}

// A record the fast store lost is written back from the durable store for what is left of its
// retention, never for a whole new one (the replaying call's retention is 30 days here), and not
// at all when its retention is over by the system clock while the durable store, whose clock is
// behind, still replays it: run() and run_batch() alike.
TEST(GuardRefill, ARecordWrittenBackKeepsWhatIsLeftOfItsRetention) {
  using std::chrono::seconds;
  idem::test::TempDir dir;
  idem::ManualClock behind(idem::system_now() - std::chrono::minutes(5));
  idem::sqlite::SqliteStoreOptions late;
  late.clock = behind.as_clock();
  SqliteStore on_time(dir.file("refill.sqlite"));
  SqliteStore slow(std::make_shared<idem::sqlite::Database>(dir.file("refill.sqlite")), late);
  idem::GuardOptions minute;
  minute.retention = seconds(60);
  idem::GuardOptions month;
  month.retention = std::chrono::hours(24 * 30);
  const std::string fp = idem::fingerprint("p");
  auto handler = [](Transaction&) { return std::string("first"); };
  const std::vector<std::string> ids = {"run", "batch", "over-run", "over-batch"};
  {
    idem::MemoryStore fast;
    idem::IdempotencyGuard guard{fast, on_time, minute};
    idem::IdempotencyGuard late_guard{fast, slow, minute};
    for (std::size_t i = 0; i < ids.size(); ++i) {
      auto& g = i < 2 ? guard : late_guard;  // the last two end 4 minutes ago by the system clock
      ASSERT_EQ(Outcome::kExecuted, g.run(Key::make("orders", ids[i]), fp, handler).outcome);
    }
  }
  const auto before = idem::system_now();
  idem::MemoryStore fresh;  // a fast store that lost its records
  idem::IdempotencyGuard guard{fresh, on_time, month};
  idem::IdempotencyGuard late_guard{fresh, slow, month};
  auto kept_until = [&](const std::string& id) {
    auto r = fresh.lookup(Key::make("orders", id));
    return r ? std::optional<idem::TimePoint>(r->expires_at) : std::nullopt;
  };

  auto r = guard.run(Key::make("orders", "run"), fp, handler);
  ASSERT_EQ(Outcome::kReplayed, r.outcome);
  EXPECT_EQ(Source::kDurableStore, r.source);
  ASSERT_TRUE(kept_until("run").has_value());
  EXPECT_LE(*kept_until("run"), r.expires_at) << "never past the durable record's expiry";
  EXPECT_GT(*kept_until("run"), before + seconds(30));
  std::vector<BatchCall> one{BatchCall{Key::make("orders", "batch"), fp}};
  auto b = guard.run_batch(std::move(one), "done", [](Transaction&, std::size_t) {});
  ASSERT_EQ(Outcome::kReplayed, b.answers.at(0).outcome);
  ASSERT_TRUE(kept_until("batch").has_value());
  EXPECT_LE(*kept_until("batch"), b.answers[0].expires_at);
  EXPECT_GT(*kept_until("batch"), before + seconds(30));

  // Over by the system clock: replayed by the durable store, not written back, the fast
  // claim released (the next call asks the durable store again).
  for (int round = 0; round < 2; ++round) {
    auto over = late_guard.run(Key::make("orders", "over-run"), fp, handler);
    EXPECT_EQ(Outcome::kReplayed, over.outcome);
    EXPECT_EQ(Source::kDurableStore, over.source);
    EXPECT_FALSE(kept_until("over-run").has_value());
    std::vector<BatchCall> c{BatchCall{Key::make("orders", "over-batch"), fp}};
    auto ob = late_guard.run_batch(std::move(c), "done", [](Transaction&, std::size_t) {});
    EXPECT_EQ(Outcome::kReplayed, ob.answers.at(0).outcome);
    EXPECT_EQ(Source::kDurableStore, ob.answers[0].source);
    EXPECT_FALSE(kept_until("over-batch").has_value());
  }
}

// The fast store lost the records; the durable replay writes each back (over the replaying
// call's fast claim) created when its first attempt began, so the duplicates the fast store
// answers afterwards report that time, as the durable store's answer did.
TEST(GuardRefill, DuplicatesAfterTheWriteBackReportWhenTheFirstAttemptBegan) {
  idem::test::TempDir dir;
  idem::ManualClock hour_ago(idem::system_now() - std::chrono::hours(1));
  idem::sqlite::SqliteStoreOptions earlier;
  earlier.clock = hour_ago.as_clock();
  auto db = std::make_shared<idem::sqlite::Database>(dir.file("first-seen.sqlite"));
  SqliteStore then(db, earlier);
  SqliteStore now(db);
  const std::string fp = idem::fingerprint("p");
  auto handler = [](Transaction&) { return std::string("order_1"); };
  {
    idem::MemoryStore lost;
    idem::IdempotencyGuard first{lost, then};
    for (const char* id : {"run", "batch"}) {
      ASSERT_EQ(Outcome::kExecuted, first.run(Key::make("orders", id), fp, handler).outcome);
    }
  }
  const auto created = [&](const char* id) {
    return now.lookup(Key::make("orders", id)).value().created_at;
  };
  ASSERT_LT(created("run"), idem::system_now() - std::chrono::minutes(30));
  idem::MemoryStore fresh;
  idem::IdempotencyGuard guard{fresh, now};

  auto replay = guard.run(Key::make("orders", "run"), fp, handler);
  ASSERT_EQ(Outcome::kReplayed, replay.outcome);
  EXPECT_EQ(Source::kDurableStore, replay.source);
  EXPECT_EQ(created("run"), replay.first_seen);
  auto again = guard.run(Key::make("orders", "run"), fp, handler);
  ASSERT_EQ(Outcome::kReplayed, again.outcome);
  EXPECT_EQ(Source::kFastStore, again.source);
  EXPECT_EQ(created("run"), again.first_seen) << "not the time it was written back";
  ASSERT_FALSE(replay.holder.empty());
  EXPECT_EQ(replay.holder, again.holder) << "the first attempt's owner, not the replaying call's";
  EXPECT_EQ(created("run"), fresh.lookup(Key::make("orders", "run")).value().created_at);

  for (int round = 0; round < 2; ++round) {
    std::vector<BatchCall> one{BatchCall{Key::make("orders", "batch"), fp}};
    auto b = guard.run_batch(std::move(one), "done", [](Transaction&, std::size_t) {});
    ASSERT_EQ(Outcome::kReplayed, b.answers.at(0).outcome);
    EXPECT_EQ(round == 0 ? Source::kDurableStore : Source::kFastStore, b.answers[0].source);
    EXPECT_EQ(created("batch"), b.answers[0].first_seen) << "round " << round;
    EXPECT_EQ(now.lookup(Key::make("orders", "batch")).value().owner, b.answers[0].holder);
  }
  EXPECT_EQ(2u, guard.stats().snapshot().fast_refills)
      << "one write-back each, run's and run_batch's";
}

// A stalled fast store (a paused Redis) applies the claims whose answers timed out once it runs
// again: records no attempt owns, which answered "in progress" for a whole lease, or "mismatch"
// to the right payload where the lost claim carried another. The guard releases them
// (owner-checked) at its first claim the fast store answers: run(), run_batch() and a fast-only
// guard alike.
TEST(GuardLostClaims, ClaimsAppliedAfterTheirTimeoutAreReleasedOnceTheStoreAnswers) {
  idem::test::TempDir dir;
  SqliteStore durable(dir.file("lost.sqlite"));
  idem::MemoryStore memory;
  idem::test::SwitchableFastStore fast{memory};
  idem::IdempotencyGuard guard{static_cast<idem::FastStore&>(fast), durable};
  const std::string fa = idem::fingerprint("a");
  const std::string fb = idem::fingerprint("b");
  auto paid = [](Transaction&) { return std::string("paid"); };
  const Key a = Key::make("orders", "a");
  const Key b = Key::make("orders", "b");
  const Key c = Key::make("orders", "c");
  ASSERT_EQ(Outcome::kExecuted, guard.run(a, fa, paid).outcome);
  memory.clear();  // the fast store lost a's record (a restart)

  fast.stalled = true;
  EXPECT_EQ(Outcome::kFingerprintMismatch, guard.run(a, fb, paid).outcome);  // the durable store
  EXPECT_EQ(Outcome::kExecuted, guard.run(b, fa, paid).outcome);
  std::vector<BatchCall> batch{BatchCall{c, fa}};
  EXPECT_EQ(Outcome::kExecuted,
            guard.run_batch(std::move(batch), "done", [](Transaction&, std::size_t) {})
                .answers.at(0)
                .outcome);
  ASSERT_TRUE(memory.lookup(b).has_value()) << "the stalled store applied the lost claims";
  fast.stalled = false;

  // The first claim answered releases them all, its own key's among them (asked again).
  auto rb = guard.run(b, fa, paid);
  EXPECT_EQ(Outcome::kReplayed, rb.outcome) << "not the lost claim's in progress";
  auto ra = guard.run(a, fa, paid);
  EXPECT_EQ(Outcome::kReplayed, ra.outcome) << "not the lost claim's mismatch";
  EXPECT_EQ("paid", ra.value.value_or(""));
  EXPECT_EQ(Outcome::kExecuted, guard.run(Key::make("orders", "d"), fa, paid).outcome);
  std::vector<BatchCall> again{BatchCall{c, fa}};
  auto rc = guard.run_batch(std::move(again), "done", [](Transaction&, std::size_t) {});
  EXPECT_EQ(Outcome::kReplayed, rc.answers.at(0).outcome);

  // A fast-only guard: the caller heard a timeout, nothing ran; its retry runs at once.
  idem::MemoryStore alone;
  idem::test::SwitchableFastStore stalling{alone};
  idem::IdempotencyGuard fast_only{static_cast<idem::FastStore&>(stalling)};
  int runs = 0;
  auto charge = [&] {
    ++runs;
    return std::string("charged");
  };
  stalling.stalled = true;
  EXPECT_THROW((void)fast_only.run(a, fa, charge), idem::StorageTimeout);
  stalling.stalled = false;
  EXPECT_EQ(Outcome::kExecuted, fast_only.run(a, fa, charge).outcome);
  EXPECT_EQ(1, runs);
}

// A stalled store may apply a lost claim long after it was sent: after a pause longer than the
// claim's lease (its record then lives a lease from the resume), or just after the guard's
// release of it found nothing (the store works through each connection's input in its own
// order). Either way the claim's record answers for the key it claims, and the guard, which
// knows it as its own (the holder of the answer), releases it and asks again: a completed key
// replays instead of answering "in progress", or "mismatch" to the right payload.
TEST(GuardLostClaims, AClaimAppliedAfterALongPauseOrAfterItsReleaseIsReleasedWhenItAnswers) {
  using std::chrono::milliseconds;
  idem::test::TempDir dir;
  SqliteStore durable(dir.file("late.sqlite"));
  idem::ManualClock frozen;  // the stale claims' leases do not end during the test
  idem::MemoryStoreOptions mo;
  mo.clock = frozen.as_clock();
  idem::MemoryStore memory{mo};
  idem::test::SwitchableFastStore fast{memory};
  fast.defer_stalled = true;
  idem::GuardOptions options;
  options.lease = milliseconds(100);
  idem::IdempotencyGuard guard{static_cast<idem::FastStore&>(fast), durable, options};
  const std::string fa = idem::fingerprint("a");
  const std::string fb = idem::fingerprint("b");
  auto paid = [](Transaction&) { return std::string("paid"); };
  auto batch = [&](const Key& k) {
    std::vector<BatchCall> one{BatchCall{k, fa}};
    return guard.run_batch(std::move(one), "done", [](Transaction&, std::size_t) {})
        .answers.at(0)
        .outcome;
  };
  const Key run_key = Key::make("orders", "paused-run");
  const Key batch_key = Key::make("orders", "paused-batch");

  // A pause longer than the lease: the claims reach the store after their lease would have
  // ended, counted from when they were sent.
  fast.stalled = true;
  ASSERT_EQ(Outcome::kExecuted, guard.run(run_key, fa, paid).outcome);
  ASSERT_EQ(Outcome::kExecuted, batch(batch_key));
  std::this_thread::sleep_for(milliseconds(150));
  fast.stalled = false;
  fast.apply_stalled();
  ASSERT_TRUE(memory.lookup(run_key).has_value());
  EXPECT_EQ(Outcome::kReplayed, guard.run(run_key, fa, paid).outcome);
  EXPECT_EQ(Outcome::kReplayed, batch(batch_key));

  // Applied after the guard released them (the release found nothing), a run, a batch, and a
  // lost claim with another payload on a completed key.
  const Key late_run = Key::make("orders", "late-run");
  const Key late_batch = Key::make("orders", "late-batch");
  const Key done = Key::make("orders", "done");
  ASSERT_EQ(Outcome::kExecuted, guard.run(done, fa, paid).outcome);
  memory.clear();  // the fast store lost done's record
  fast.stalled = true;
  ASSERT_EQ(Outcome::kExecuted, guard.run(late_run, fa, paid).outcome);
  ASSERT_EQ(Outcome::kExecuted, batch(late_batch));
  ASSERT_EQ(Outcome::kFingerprintMismatch, guard.run(done, fb, paid).outcome);
  fast.stalled = false;
  ASSERT_EQ(Outcome::kExecuted, guard.run(Key::make("orders", "other"), fa, paid).outcome);
  fast.apply_stalled();
  ASSERT_TRUE(memory.lookup(late_run).has_value());
  auto r = guard.run(late_run, fa, paid);
  EXPECT_EQ(Outcome::kReplayed, r.outcome) << "not the lost claim's in progress";
  EXPECT_EQ(Outcome::kReplayed, batch(late_batch));
  auto d = guard.run(done, fa, paid);
  EXPECT_EQ(Outcome::kReplayed, d.outcome) << "not the lost claim's mismatch";
  EXPECT_EQ("paid", d.value.value_or(""));
}

}  // namespace
