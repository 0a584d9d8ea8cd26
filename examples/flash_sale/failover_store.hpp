// SPDX-License-Identifier: MIT
// A fast store that can "fail over to an empty replica" mid-run: every record it held is gone,
// as after a Redis failover that lost unreplicated writes, or a FLUSHALL. The durable record
// then catches the duplicates the fast store no longer knows.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>

#include "idem/memory_store.hpp"
#include "idem/store.hpp"

namespace flash_sale {

/// MemoryStore behind a switch: failover() replaces it with an empty one.
class FailoverStore final : public idem::FastStore {
 public:
  FailoverStore() : current_(std::make_shared<idem::MemoryStore>()) {}

  /// Forgets every record (calls in flight finish on the old store).
  void failover() {
    auto fresh = std::make_shared<idem::MemoryStore>();
    std::lock_guard<std::mutex> lock(mu_);
    current_ = std::move(fresh);
  }

  idem::ClaimResult claim(const idem::Key& key, std::string_view fingerprint,
                          const idem::OwnerToken& owner,
                          std::chrono::milliseconds lease) override {
    return store()->claim(key, fingerprint, owner, lease);
  }
  bool complete(const idem::Key& key, const idem::OwnerToken& owner, std::string_view response,
                std::chrono::seconds retention) override {
    return store()->complete(key, owner, response, retention);
  }
  bool fail(const idem::Key& key, const idem::OwnerToken& owner, std::string_view reason,
            std::chrono::seconds retention) override {
    return store()->fail(key, owner, reason, retention);
  }
  bool release(const idem::Key& key, const idem::OwnerToken& owner) override {
    return store()->release(key, owner);
  }
  void fill(const idem::Key& key, std::string_view fingerprint, std::string_view response,
            std::chrono::seconds retention) override {
    store()->fill(key, fingerprint, response, retention);
  }
  void refill(const idem::Key& key, std::string_view fingerprint, std::string_view response,
              std::chrono::seconds retention, const idem::RecordOrigin& origin) override {
    store()->refill(key, fingerprint, response, retention, origin);
  }
  std::optional<idem::Record> lookup(const idem::Key& key) override {
    return store()->lookup(key);
  }
  std::string_view name() const noexcept override { return "memory"; }

 private:
  std::shared_ptr<idem::MemoryStore> store() const {
    std::lock_guard<std::mutex> lock(mu_);
    return current_;
  }
  mutable std::mutex mu_;
  std::shared_ptr<idem::MemoryStore> current_;
};

}  // namespace flash_sale
