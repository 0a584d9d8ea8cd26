// SPDX-License-Identifier: MIT
// PrometheusObserver: metric families, lazily created label series, event mapping.
#include "idem/prometheus/prometheus_observer.hpp"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <mutex>
#include <set>
#include <utility>

namespace idem {

namespace {
constexpr std::size_t kOutcomes = 4;
constexpr std::size_t kModes = 3;
constexpr std::size_t kSources = 3;
constexpr std::size_t kDupSources = 4;

constexpr std::string_view kPhases[] = {"fast_claim", "durable", "handler", "total"};

double seconds(std::chrono::nanoseconds d) {
  return std::chrono::duration<double>(d).count();
}

// The label value of a store name; anything unexpected is folded into "other" so a caller
// cannot create unbounded series.
std::size_t store_index(std::string_view store) {
  if (store == "fast") return 0;
  if (store == "durable") return 1;
  return 2;
}
constexpr const char* kStores[] = {"fast", "durable", "other"};

// A label series created on first use (Family::Add takes a lock; later uses do not).
template <class T, std::size_t N>
class LazySeries {
 public:
  template <class MakeLabels>
  T& get(::prometheus::Family<T>& family, std::size_t i, MakeLabels&& labels) {
    T* p = series_[i].load(std::memory_order_acquire);
    if (p == nullptr) {
      p = &family.Add(labels());  // returns the existing series for equal labels
      series_[i].store(p, std::memory_order_release);
    }
    return *p;
  }

 private:
  std::array<std::atomic<T*>, N> series_{};
};

// Series keyed by (store name, errc): store names come from store implementations, so the set
// is bounded in practice; past kMaxStores distinct names the rest count as "other".
class StoreErrorSeries {
 public:
  ::prometheus::Counter& get(::prometheus::Family<::prometheus::Counter>& family,
                             std::string_view store, errc code) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string name(store);
    if (stores_.count(name) == 0) {
      if (stores_.size() >= kMaxStores) name = "other";
      stores_.insert(name);
    }
    auto key = std::make_pair(name, static_cast<int>(code));
    auto it = series_.find(key);
    if (it == series_.end()) {
      auto* c = &family.Add({{"store", name}, {"code", std::string(errc_name(code))}});
      it = series_.emplace(key, c).first;
    }
    return *it->second;
  }

 private:
  static constexpr std::size_t kMaxStores = 16;
  std::mutex mutex_;
  std::set<std::string> stores_;
  std::map<std::pair<std::string, int>, ::prometheus::Counter*> series_;
};

constexpr std::size_t kRejectReasons = 4;
constexpr std::size_t kPassthroughReasons = 3;
}  // namespace

struct IDEM_LOCAL PrometheusObserver::Impl {
  Impl(::prometheus::Registry& registry, const PrometheusObserverOptions& options)
      : labels(options.const_labels),
        calls(counter(registry, "idem_calls_total",
                      "Guarded calls that ended with an outcome, by outcome, mode and the layer "
                      "that answered")),
        fast_hits(counter(registry, "idem_fast_store_hits_total",
                          "Duplicates the fast store stopped at the entrance")
                      .Add({})),
        fast_claims(
            counter(registry, "idem_fast_store_claims_total", "Claims the fast store granted")
                .Add({})),
        unique_conflicts(counter(registry, "idem_unique_conflicts_total",
                                 "Duplicates caught by the durable store's unique key")
                             .Add({})),
        duplicates(counter(registry, "idem_duplicates_total", "Duplicate detections by source")),
        mq_redeliveries(counter(registry, "idem_mq_redeliveries_total",
                                "Messages their broker delivered again (delivery count above 1)")
                            .Add({})),
        degraded(counter(registry, "idem_degraded_calls_total",
                         "Calls decided without the fast store because it failed")
                     .Add({})),
        outages(counter(registry, "idem_fast_store_outages_total", "Bursts of fast-store failures")
                    .Add({})),
        takeovers(counter(registry, "idem_lease_takeovers_total",
                          "Expired leases of other attempts taken over, by store")),
        leases_lost(counter(registry, "idem_leases_lost_total",
                            "Attempts whose lease was taken over before they completed")),
        handler_errors(counter(registry, "idem_handler_errors_total",
                               "Handlers that threw (claim released, exception rethrown)")
                           .Add({})),
        durable_retries(counter(registry, "idem_durable_retries_total",
                                "Durable transactions retried (serialization failure, deadlock)")
                            .Add({})),
        store_errors(counter(registry, "idem_store_errors_total",
                             "Store failures by store and idem error code (every failure)")),
        rejected(counter(registry, "idem_rejected_requests_total",
                         "Requests an endpoint refused with a client error, by reason")),
        passthrough(counter(registry, "idem_passthrough_requests_total",
                            "Requests or calls that ran the handler with no idempotency store "
                            "I/O, by reason")),
        phases(::prometheus::BuildHistogram()
                   .Name("idem_phase_duration_seconds")
                   .Help("Time spent per phase of a guarded call")
                   .Labels(labels)
                   .Register(registry)) {
    ::prometheus::Histogram::BucketBoundaries buckets = options.latency_buckets;
    if (buckets.empty()) {
      buckets = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                 0.05,   0.1,     0.25,   0.5,   1.0,    2.5,   5.0,  10.0};
    }
    for (std::size_t i = 0; i < 4; ++i) {
      phase[i] = &phases.Add({{"phase", std::string(kPhases[i])}}, buckets);
    }
    // "fast" and "durable" exist from the start (a zero is information); "other" only if used.
    for (std::size_t i = 0; i < 2; ++i) {
      (void)takeover.get(takeovers, i, [&] { return ::prometheus::Labels{{"store", kStores[i]}}; });
      (void)lost.get(leases_lost, i, [&] { return ::prometheus::Labels{{"store", kStores[i]}}; });
    }
    for (std::size_t i = 0; i < kRejectReasons; ++i) (void)reject_series(i);
    for (std::size_t i = 0; i < kPassthroughReasons; ++i) (void)passthrough_series(i);
  }

  ::prometheus::Counter& reject_series(std::size_t i) {
    return rejected_series.get(rejected, i, [&] {
      return ::prometheus::Labels{
          {"reason", std::string(reject_reason_name(static_cast<RejectReason>(i)))}};
    });
  }
  ::prometheus::Counter& passthrough_series(std::size_t i) {
    return passthrough_by_reason.get(passthrough, i, [&] {
      return ::prometheus::Labels{
          {"reason", std::string(passthrough_reason_name(static_cast<PassthroughReason>(i)))}};
    });
  }

  ::prometheus::Family<::prometheus::Counter>& counter(::prometheus::Registry& registry,
                                                       const std::string& name,
                                                       const std::string& help) {
    return ::prometheus::BuildCounter().Name(name).Help(help).Labels(labels).Register(registry);
  }

  std::map<std::string, std::string> labels;
  ::prometheus::Family<::prometheus::Counter>& calls;
  ::prometheus::Counter& fast_hits;
  ::prometheus::Counter& fast_claims;
  ::prometheus::Counter& unique_conflicts;
  ::prometheus::Family<::prometheus::Counter>& duplicates;
  ::prometheus::Counter& mq_redeliveries;
  ::prometheus::Counter& degraded;
  ::prometheus::Counter& outages;
  ::prometheus::Family<::prometheus::Counter>& takeovers;
  ::prometheus::Family<::prometheus::Counter>& leases_lost;
  ::prometheus::Counter& handler_errors;
  ::prometheus::Counter& durable_retries;
  ::prometheus::Family<::prometheus::Counter>& store_errors;
  ::prometheus::Family<::prometheus::Counter>& rejected;
  ::prometheus::Family<::prometheus::Counter>& passthrough;
  ::prometheus::Family<::prometheus::Histogram>& phases;
  std::array<::prometheus::Histogram*, 4> phase{};
  LazySeries<::prometheus::Counter, 3> takeover;
  LazySeries<::prometheus::Counter, 3> lost;
  LazySeries<::prometheus::Counter, kOutcomes * kModes * kSources> call_series;
  LazySeries<::prometheus::Counter, kDupSources> duplicate_series;
  StoreErrorSeries store_error_series;
  LazySeries<::prometheus::Counter, kRejectReasons> rejected_series;
  LazySeries<::prometheus::Counter, kPassthroughReasons> passthrough_by_reason;
};

PrometheusObserver::PrometheusObserver(::prometheus::Registry& registry,
                                       PrometheusObserverOptions options)
    : impl_(std::make_unique<Impl>(registry, options)) {}

PrometheusObserver::~PrometheusObserver() = default;

void PrometheusObserver::on_call(const CallEvent& e) noexcept {
  try {
    auto o = static_cast<std::size_t>(e.outcome);
    auto m = static_cast<std::size_t>(e.mode);
    auto s = static_cast<std::size_t>(e.source);
    if (o < kOutcomes && m < kModes && s < kSources) {
      impl_->call_series
          .get(impl_->calls, (o * kModes + m) * kSources + s,
               [&] {
                 return ::prometheus::Labels{{"outcome", std::string(outcome_name(e.outcome))},
                                             {"mode", std::string(mode_name(e.mode))},
                                             {"source", std::string(source_name(e.source))}};
               })
          .Increment();
    }
    if (e.source == Source::kFastStore) impl_->fast_hits.Increment();
    if (e.source == Source::kDurableStore) impl_->unique_conflicts.Increment();
    if (e.fast_claimed) impl_->fast_claims.Increment();
    if (e.degraded) impl_->degraded.Increment();
    // A phase is observed only when the call went through it.
    if (e.fast_claim.count() > 0) impl_->phase[0]->Observe(seconds(e.fast_claim));
    if (e.mode != Mode::kFastOnly && e.source != Source::kFastStore) {
      impl_->phase[1]->Observe(seconds(e.durable));
    }
    if (e.outcome == Outcome::kExecuted) impl_->phase[2]->Observe(seconds(e.handler));
    impl_->phase[3]->Observe(seconds(e.total));
  } catch (...) {
    // Metrics must never break the guarded call.
  }
}

void PrometheusObserver::on_duplicate(const DuplicateEvent& e) noexcept {
  try {
    auto s = static_cast<std::size_t>(e.source);
    if (s >= kDupSources) return;
    impl_->duplicate_series
        .get(impl_->duplicates, s,
             [&] {
               return ::prometheus::Labels{
                   {"source", std::string(duplicate_source_name(e.source))}};
             })
        .Increment();
  } catch (...) {
  }
}

void PrometheusObserver::on_fast_store_down(const Key&, const Error&) noexcept {
  impl_->outages.Increment();
}

void PrometheusObserver::on_takeover(const Key&, std::string_view store) noexcept {
  try {
    auto i = store_index(store);
    impl_->takeover
        .get(impl_->takeovers, i, [&] { return ::prometheus::Labels{{"store", kStores[i]}}; })
        .Increment();
  } catch (...) {
  }
}

void PrometheusObserver::on_lease_lost(const Key&, std::string_view store) noexcept {
  try {
    auto i = store_index(store);
    impl_->lost
        .get(impl_->leases_lost, i, [&] { return ::prometheus::Labels{{"store", kStores[i]}}; })
        .Increment();
  } catch (...) {
  }
}

void PrometheusObserver::on_handler_error(const Key&) noexcept {
  impl_->handler_errors.Increment();
}

void PrometheusObserver::on_durable_retry(const Key&, std::string_view) noexcept {
  impl_->durable_retries.Increment();
}

void PrometheusObserver::on_store_error(const StoreErrorEvent& e) noexcept {
  try {
    impl_->store_error_series.get(impl_->store_errors, e.store, e.error.code()).Increment();
  } catch (...) {
  }
}

void PrometheusObserver::on_rejected_request(const RejectedRequestEvent& e) noexcept {
  try {
    auto i = static_cast<std::size_t>(e.reason);
    if (i < kRejectReasons) impl_->reject_series(i).Increment();
  } catch (...) {
  }
}

void PrometheusObserver::on_passthrough(const PassthroughEvent& e) noexcept {
  try {
    auto i = static_cast<std::size_t>(e.reason);
    if (i < kPassthroughReasons) impl_->passthrough_series(i).Increment();
  } catch (...) {
  }
}

void PrometheusObserver::on_redelivery(const RedeliveryEvent&) noexcept {
  impl_->mq_redeliveries.Increment();
}

void PrometheusObserver::mq_redelivered(std::uint64_t n) noexcept {
  impl_->mq_redeliveries.Increment(static_cast<double>(n));
}

}  // namespace idem
