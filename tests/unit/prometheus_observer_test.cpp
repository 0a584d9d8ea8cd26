// SPDX-License-Identifier: MIT
// PrometheusObserver: each metric counts what the guard did, checked through the text format.
#include "idem/prometheus/prometheus_observer.hpp"

#include <gtest/gtest.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <string>
#include <vector>

#include "idem/consumer.hpp"
#include "idem/guard.hpp"
#include "idem/log.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/failing_store.hpp"
#include "support/prometheus_text.hpp"
#include "support/test_env.hpp"

namespace {

using idem::test::metric_value;
using Labels = std::map<std::string, std::string>;

std::string scrape(prometheus::Registry& registry) {
  return prometheus::TextSerializer().Serialize(registry.Collect());
}

double value(const std::string& text, const std::string& name, const Labels& labels = {}) {
  return metric_value(text, name, labels).value_or(-1.0);
}

idem::GuardOptions with(std::shared_ptr<idem::Observer> o) {
  idem::GuardOptions options;
  options.observer = std::move(o);
  return options;
}

TEST(PrometheusObserver, FastStoreFrontCountsOutcomesHitsClaimsAndPhases) {
  prometheus::Registry registry;
  auto metrics = std::make_shared<idem::PrometheusObserver>(registry);
  idem::test::TempDir dir;
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable{dir.file("m.sqlite")};
  idem::IdempotencyGuard guard{fast, durable, with(metrics)};
  auto h = [](idem::sqlite::Transaction&) { return std::string("r"); };
  auto key = idem::Key::make("order.create", "m1");

  ASSERT_EQ(idem::Outcome::kExecuted, guard.run(key, "fp", h).outcome);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(idem::Outcome::kReplayed, guard.run(key, "fp", h).outcome);
  ASSERT_EQ(idem::Outcome::kFingerprintMismatch, guard.run(key, "other", h).outcome);
  auto busy = idem::Key::make("order.create", "m_busy");
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            fast.claim(busy, "fp", idem::OwnerToken::generate(), std::chrono::seconds(30)).status);
  ASSERT_EQ(idem::Outcome::kInProgress, guard.run(busy, "fp", h).outcome);
  auto failing = idem::Key::make("order.create", "m_throw");
  EXPECT_THROW((void)guard.run(failing, "fp",
                               [](idem::sqlite::Transaction&) -> std::string {
                                 throw std::runtime_error("handler failed");
                               }),
               std::runtime_error);

  auto text = scrape(registry);
  Labels tx{{"mode", "transactional"}};
  EXPECT_EQ(1, value(text, "idem_calls_total",
                     {{"outcome", "executed"}, {"mode", "transactional"}, {"source", "handler"}}));
  EXPECT_EQ(3, value(text, "idem_calls_total",
                     {{"outcome", "replayed"}, {"mode", "transactional"}, {"source", "fast_store"}}));
  EXPECT_EQ(1, value(text, "idem_calls_total", {{"outcome", "fingerprint_mismatch"}}));
  EXPECT_EQ(1, value(text, "idem_calls_total", {{"outcome", "in_progress"}}));
  EXPECT_EQ(6, value(text, "idem_calls_total", tx));
  EXPECT_EQ(5, value(text, "idem_fast_store_hits_total"));
  EXPECT_EQ(1, value(text, "idem_fast_store_claims_total"));
  EXPECT_EQ(0, value(text, "idem_unique_conflicts_total"));
  EXPECT_EQ(5, value(text, "idem_duplicates_total", {{"source", "fast_store"}}));
  EXPECT_EQ(1, value(text, "idem_handler_errors_total"));
  EXPECT_EQ(0, value(text, "idem_degraded_calls_total"));
  EXPECT_EQ(6, value(text, "idem_phase_duration_seconds_count", {{"phase", "total"}}));
  EXPECT_EQ(6, value(text, "idem_phase_duration_seconds_count", {{"phase", "fast_claim"}}));
  EXPECT_EQ(1, value(text, "idem_phase_duration_seconds_count", {{"phase", "handler"}}));
  EXPECT_EQ(1, value(text, "idem_phase_duration_seconds_count", {{"phase", "durable"}}));
  EXPECT_EQ(6, value(text, "idem_phase_duration_seconds_bucket",
                     {{"phase", "total"}, {"le", "+Inf"}}));
  EXPECT_GT(value(text, "idem_phase_duration_seconds_sum", {{"phase", "total"}}), 0.0);
  // Impossible combinations are never exported as zero series.
  EXPECT_FALSE(metric_value(text, "idem_calls_total",
                            {{"outcome", "executed"}, {"source", "fast_store"}}));
}

TEST(PrometheusObserver, DurableOnlyDuplicatesAreUniqueConflicts) {
  prometheus::Registry registry;
  auto metrics = std::make_shared<idem::PrometheusObserver>(registry);
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable{dir.file("m.sqlite")};
  idem::IdempotencyGuard guard{durable, with(metrics)};
  auto key = idem::Key::make("payment", "u1");
  ASSERT_TRUE(guard.run(key, "", [] { return std::string("two-phase"); }).ok());
  ASSERT_TRUE(guard.run(key, "", [] { return std::string("two-phase"); }).ok());
  ASSERT_TRUE(guard.run(key, "", [] { return std::string("two-phase"); }).ok());
  auto text = scrape(registry);
  EXPECT_EQ(2, value(text, "idem_unique_conflicts_total"));
  EXPECT_EQ(2, value(text, "idem_duplicates_total", {{"source", "unique_index"}}));
  EXPECT_EQ(0, value(text, "idem_fast_store_hits_total"));
  EXPECT_EQ(0, value(text, "idem_fast_store_claims_total"));
  EXPECT_EQ(2, value(text, "idem_calls_total",
                     {{"outcome", "replayed"}, {"mode", "two_phase"}, {"source", "durable_store"}}));
  EXPECT_EQ(0, value(text, "idem_phase_duration_seconds_count", {{"phase", "fast_claim"}}));
}

TEST(PrometheusObserver, DegradedCallsAndOutageBursts) {
  prometheus::Registry registry;
  auto metrics = std::make_shared<idem::PrometheusObserver>(registry);
  idem::test::TempDir dir;
  idem::MemoryStore inner;
  idem::test::SwitchableFastStore fast{inner};
  idem::sqlite::SqliteStore durable{dir.file("m.sqlite")};
  idem::IdempotencyGuard guard{fast, durable, with(metrics)};
  auto h = [](idem::sqlite::Transaction&) { return std::string("r"); };
  fast.failing = true;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(guard.run(idem::Key::make("s", "d" + std::to_string(i)), "", h).ok());
  }
  ASSERT_EQ(idem::Outcome::kReplayed, guard.run(idem::Key::make("s", "d0"), "", h).outcome);
  auto text = scrape(registry);
  EXPECT_EQ(5, value(text, "idem_degraded_calls_total"));
  EXPECT_EQ(1, value(text, "idem_fast_store_outages_total"));
  EXPECT_EQ(1, value(text, "idem_unique_conflicts_total"));
}

TEST(PrometheusObserver, TakeoversLostLeasesAndRedeliveries) {
  prometheus::Registry registry;
  idem::PrometheusObserverOptions options;
  options.const_labels = {{"service", "orders"}};
  auto metrics = std::make_shared<idem::PrometheusObserver>(registry, options);
  idem::ManualClock clock;
  idem::MemoryStoreOptions mo;
  mo.clock = clock.as_clock();
  idem::MemoryStore fast{mo};
  idem::GuardOptions go = with(metrics);
  go.lease = std::chrono::seconds(5);
  idem::IdempotencyGuard guard{fast, go};

  // A crashed attempt's claim expires; the next call takes it over.
  auto key = idem::Key::make("s", "takeover");
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            fast.claim(key, "", idem::OwnerToken::generate(), std::chrono::seconds(5)).status);
  clock.advance(std::chrono::seconds(6));
  ASSERT_TRUE(guard.run(key, "", [] { return std::string("x"); }).ok());

  // This attempt's lease expires during the handler and another attempt takes over.
  auto slow = idem::Key::make("s", "lost");
  EXPECT_THROW((void)guard.run(slow, "",
                               [&] {
                                 clock.advance(std::chrono::seconds(6));
                                 (void)fast.claim(slow, "", idem::OwnerToken::generate(),
                                                  std::chrono::seconds(5));
                                 return std::string("late");
                               }),
               idem::LeaseLost);
  metrics->mq_redelivered();
  metrics->mq_redelivered(2);

  auto text = scrape(registry);
  EXPECT_EQ(1, value(text, "idem_lease_takeovers_total", {{"store", "fast"}}));
  EXPECT_EQ(0, value(text, "idem_lease_takeovers_total", {{"store", "durable"}}));
  EXPECT_EQ(1, value(text, "idem_leases_lost_total", {{"store", "fast"}, {"service", "orders"}}));
  EXPECT_EQ(3, value(text, "idem_mq_redeliveries_total", {{"service", "orders"}}));
  EXPECT_EQ(1, value(text, "idem_calls_total", {{"mode", "fast_only"}, {"service", "orders"}}));
}

// An IdempotentConsumer tells its guard's observer of every redelivery: the counter moves with
// no call from the application and equals ConsumerStats::redeliveries; the log has a line each.
TEST(PrometheusObserver, ConsumerRedeliveriesAreCountedWithoutTheApplication) {
  prometheus::Registry registry;
  auto metrics = std::make_shared<idem::PrometheusObserver>(registry);
  std::vector<std::string> lines;
  idem::LoggingObserverOptions lo;
  lo.min_level = idem::LogLevel::kDebug;
  auto observers = std::make_shared<idem::ObserverList>();
  observers->add(metrics);
  observers->add(std::make_shared<idem::LoggingObserver>(
      [&](idem::LogLevel, std::string_view l) { lines.emplace_back(l); }, lo));
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, with(observers)};
  idem::IdempotentConsumer consumer{guard, "billing"};
  int runs = 0;
  auto apply = [&] { ++runs; };
  EXPECT_EQ(idem::Verdict::kAck, consumer.consume(idem::Delivery{"m1", "", "", 1}, apply));
  EXPECT_EQ(idem::Verdict::kAckDuplicate, consumer.consume(idem::Delivery{"m1", "", "", 2}, apply));
  EXPECT_EQ(idem::Verdict::kAck, consumer.consume(idem::Delivery{"m2", "", "", 3}, apply));
  EXPECT_EQ(idem::Verdict::kDeadLetter,
            consumer.consume(idem::Delivery{"bad id", "", "", 2}, apply));  // no key: counted too
  EXPECT_EQ(2, runs);
  EXPECT_EQ(3u, consumer.stats().snapshot().redeliveries);
  EXPECT_EQ(3, value(scrape(registry), "idem_mq_redeliveries_total"));
  int logged = 0;
  for (const auto& l : lines) logged += l.rfind("idem redelivery group=billing ", 0) == 0 ? 1 : 0;
  EXPECT_EQ(3, logged);
  EXPECT_NE(lines.end(), std::find(lines.begin(), lines.end(),
                                   "idem redelivery group=billing message_id=m2 delivery_count=3"));
}

TEST(PrometheusObserver, StoreErrorsByStoreAndCodeRejectionsAndPassthroughs) {
  prometheus::Registry registry;
  auto metrics = std::make_shared<idem::PrometheusObserver>(registry);
  // Every reason exists from the start (a zero is information).
  auto text = scrape(registry);
  for (const char* reason :
       {"missing_key", "invalid_key", "payload_too_large", "fingerprint_mismatch"}) {
    EXPECT_EQ(0, value(text, "idem_rejected_requests_total", {{"reason", reason}})) << reason;
  }
  for (const char* reason : {"no_key", "method", "disabled"}) {
    EXPECT_EQ(0, value(text, "idem_passthrough_requests_total", {{"reason", reason}})) << reason;
  }

  idem::test::TempDir dir;
  idem::MemoryStore inner;
  idem::test::SwitchableFastStore fast{inner};
  idem::sqlite::SqliteStore durable{dir.file("e.sqlite")};
  idem::IdempotencyGuard guard{fast, durable, with(metrics)};
  auto h = [](idem::sqlite::Transaction&) { return std::string("r"); };
  fast.failing = true;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(guard.run(idem::Key::make("s", "e" + std::to_string(i)), "", h).ok());
  }
  fast.failing = false;
  durable.database().write(
      [](idem::sqlite::Transaction& tx) { tx.exec("DROP TABLE api_idempotency"); });
  EXPECT_THROW((void)guard.run(idem::Key::make("s", "gone"), "", h), idem::StorageError);
  metrics->on_rejected_request(
      idem::RejectedRequestEvent{"http.x", idem::RejectReason::kFingerprintMismatch, 422});
  metrics->on_passthrough(idem::PassthroughEvent{"http.x", idem::PassthroughReason::kNoKey});
  metrics->on_passthrough(idem::PassthroughEvent{"http.x", idem::PassthroughReason::kNoKey});

  text = scrape(registry);
  EXPECT_EQ(4, value(text, "idem_store_errors_total",
                     {{"store", "switchable"}, {"code", "store_unavailable"}}));
  EXPECT_EQ(
      1, value(text, "idem_store_errors_total", {{"store", "sqlite"}, {"code", "storage_error"}}));
  EXPECT_EQ(5, value(text, "idem_store_errors_total"));
  EXPECT_EQ(1, value(text, "idem_rejected_requests_total", {{"reason", "fingerprint_mismatch"}}));
  EXPECT_EQ(2, value(text, "idem_passthrough_requests_total", {{"reason", "no_key"}}));
  EXPECT_EQ(0, value(text, "idem_passthrough_requests_total", {{"reason", "method"}}));
}

}  // namespace
