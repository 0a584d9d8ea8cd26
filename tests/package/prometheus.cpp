// SPDX-License-Identifier: MIT
// Consumer of idem::prometheus: the observer registers its families.
#include <prometheus/registry.h>

#include <idem/prometheus/prometheus_observer.hpp>

#include "consumer.hpp"

int main() {
  check_version();
  prometheus::Registry registry;
  idem::PrometheusObserver observer{registry};
  observer.mq_redelivered(2);
  bool found = false;
  for (const auto& family : registry.Collect()) {
    if (family.name == "idem_mq_redeliveries_total") found = true;
  }
  CONSUMER_CHECK(found);
  std::printf("prometheus: families registered\n");
  return 0;
}
