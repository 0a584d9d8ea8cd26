// SPDX-License-Identifier: MIT
// idem::PrometheusObserver: the guard's events as Prometheus metrics (target idem::prometheus).
//
// File: prometheus/prometheus_observer.hpp
//
// Registers, in a prometheus::Registry you own and expose (prometheus::Exposer, or your HTTP
// server's /metrics serialising registry.Collect() with prometheus::TextSerializer):
//
//   idem_calls_total{outcome,mode,source}    guarded calls that ended with an outcome
//                                            (outcome: executed|replayed|in_progress|
//                                            fingerprint_mismatch; mode: transactional|
//                                            two_phase|fast_only; source: handler|fast_store|
//                                            durable_store)
//   idem_fast_store_hits_total               duplicates the fast store stopped at the entrance
//   idem_fast_store_claims_total             claims the fast store granted (first attempts)
//   idem_unique_conflicts_total              duplicates the durable store's unique key caught
//                                            (the fast store let them through: lost record,
//                                            fast store down, or none configured)
//   idem_duplicates_total{source}            every duplicate detection by source (fast_store,
//                                            unique_index, state_machine, mq_record)
//   idem_mq_redeliveries_total               MQ redeliveries IdempotentConsumers received
//                                            (on_redelivery; mq_redelivered() for others)
//   idem_degraded_calls_total                calls decided without the fast store (it failed)
//   idem_fast_store_outages_total            bursts of fast-store failures (down events)
//   idem_lease_takeovers_total{store}        expired leases taken over (store: fast|durable)
//   idem_leases_lost_total{store}            attempts whose lease was taken over before they
//                                            completed
//   idem_handler_errors_total                handlers that threw (claim released, rethrown)
//   idem_durable_retries_total               durable transactions retried (serialization)
//   idem_store_errors_total{store,code}      every store failure (store: the store's name(),
//                                            e.g. redis|postgres|sqlite|memory; code: the
//                                            idem::errc name, e.g. store_unavailable)
//   idem_rejected_requests_total{reason}     requests an endpoint refused (missing_key|
//                                            invalid_key: 400, payload_too_large: 413,
//                                            fingerprint_mismatch: 422)
//   idem_passthrough_requests_total{reason}  handlers run with no store I/O (no_key: optional
//                                            key absent; method: not a guarded method;
//                                            disabled: the kill switch)
//   idem_phase_duration_seconds{phase}       histogram, phase: fast_claim|durable|handler|total
//
// Fast-store hit rate (share of detected duplicates stopped by the fast store):
//   sum(rate(idem_fast_store_hits_total[5m]))
//     / (sum(rate(idem_fast_store_hits_total[5m])) + sum(rate(idem_unique_conflicts_total[5m])))
//
// One observer per registry: prometheus-cpp refuses a second family of the same name with other
// constant labels. Share one observer between guards (it is thread-safe), or give each guard
// its own registry. Combine with logging through idem::ObserverList.
//
// @code
//   prometheus::Registry registry;
//   auto metrics = std::make_shared<idem::PrometheusObserver>(registry);
//   idem::GuardOptions options;
//   options.observer = metrics;
//   idem::IdempotencyGuard guard{fast, durable, options};
// @endcode
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "idem/export.hpp"
#include "idem/observer.hpp"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace idem {

/// Options of a PrometheusObserver.
struct PrometheusObserverOptions {
  /// Constant labels added to every series (e.g. {{"service", "orders"}}). Empty: none.
  std::map<std::string, std::string> const_labels;
  /// Upper bounds (seconds) of the phase histograms' buckets, ascending. Empty: 100 µs to 10 s
  /// (0.0001, 0.00025, 0.0005, 0.001, ... 5, 10).
  std::vector<double> latency_buckets;
};

/// Counts the guard's events in Prometheus metrics (see the file comment). Thread-safe; never
/// throws from an event. The registry must outlive the observer.
class IDEM_EXPORT PrometheusObserver final : public Observer {
 public:
  /// Registers the metric families in `registry`.
  /// @throws std::invalid_argument (from prometheus-cpp) when a family of the same name exists
  ///         in `registry` with other constant labels.
  explicit PrometheusObserver(::prometheus::Registry& registry,
                              PrometheusObserverOptions options = {});
  ~PrometheusObserver() override;
  PrometheusObserver(const PrometheusObserver&) = delete;
  PrometheusObserver& operator=(const PrometheusObserver&) = delete;

  /// idem_calls_total, hits, claims, unique conflicts, degraded calls, phase histograms.
  void on_call(const CallEvent& e) noexcept override;
  /// idem_duplicates_total{source}.
  void on_duplicate(const DuplicateEvent& e) noexcept override;
  /// idem_fast_store_outages_total.
  void on_fast_store_down(const Key& key, const Error& error) noexcept override;
  /// idem_lease_takeovers_total{store}.
  void on_takeover(const Key& key, std::string_view store) noexcept override;
  /// idem_leases_lost_total{store}.
  void on_lease_lost(const Key& key, std::string_view store) noexcept override;
  /// idem_handler_errors_total.
  void on_handler_error(const Key& key) noexcept override;
  /// idem_durable_retries_total.
  void on_durable_retry(const Key& key, std::string_view reason) noexcept override;
  /// idem_store_errors_total{store,code}.
  void on_store_error(const StoreErrorEvent& e) noexcept override;
  /// idem_rejected_requests_total{reason}.
  void on_rejected_request(const RejectedRequestEvent& e) noexcept override;
  /// idem_passthrough_requests_total{reason}.
  void on_passthrough(const PassthroughEvent& e) noexcept override;

  /// idem_mq_redeliveries_total: one per redelivery an IdempotentConsumer of a guard observed
  /// by this observer receives (the counter equals the sum of their
  /// ConsumerStats::redeliveries).
  void on_redelivery(const RedeliveryEvent& e) noexcept override;

  /// Counts `n` MQ redeliveries in idem_mq_redeliveries_total, for a consumer loop that does
  /// not go through an IdempotentConsumer (one that does is counted by on_redelivery: do not
  /// call this for it too).
  void mq_redelivered(std::uint64_t n = 1) noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem
