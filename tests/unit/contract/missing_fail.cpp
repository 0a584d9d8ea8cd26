// SPDX-License-Identifier: MIT
// Does NOT compile, on purpose: a durable store without `fail`. The ctest idem_contract_names_*
// compiles it and expects the static_assert of idem/durable_store.hpp naming the missing member.
#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "idem/guard.hpp"

namespace {

struct Tx {};

class IncompleteStore {
 public:
  using Transaction = Tx;
  std::string_view name() const noexcept { return "incomplete"; }
  template <class Handler>
  idem::TransactionalResult run_transactional(const idem::Key&, std::string_view,
                                              const idem::OwnerToken&, std::chrono::seconds,
                                              Handler&& handler, idem::DurableHint = {}) {
    Tx tx;
    return idem::TransactionalResult::committed(handler(tx));
  }
  idem::ClaimResult begin(const idem::Key&, std::string_view, const idem::OwnerToken&,
                          std::chrono::milliseconds, idem::DurableHint = {}) {
    return {};
  }
  bool complete(const idem::Key&, const idem::OwnerToken&, std::string_view,
                std::chrono::seconds) {
    return true;
  }
  bool release(const idem::Key&, const idem::OwnerToken&) { return true; }
  // bool fail(...) is missing.
  std::optional<idem::Record> lookup(const idem::Key&) { return std::nullopt; }
  std::size_t purge_expired(std::size_t) { return 0; }
};

}  // namespace

int main() {
  IncompleteStore store;
  idem::IdempotencyGuard<IncompleteStore> guard{store};
  return guard.stats().snapshot().calls == 0 ? 0 : 1;
}
