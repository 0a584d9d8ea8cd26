// SPDX-License-Identifier: MIT
// The cluster changing under guarded calls: a slot migrated (ASK, then MOVED) and a master
// killed (its replica promoted). These disturb the shared cluster, so ctest runs them alone, and
// each leaves it healthy (three masters, linked replicas, cluster_state:ok everywhere).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cluster_admin.hpp"
#include "idem/guard.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "local_tier_support.hpp"
#include "router.hpp"
#include "support/test_env.hpp"

namespace {

using idem::Key;
using idem::Outcome;
using idem::redis::RedisStore;
using idem::redis::RedisStoreOptions;
using namespace std::chrono_literals;

class CountingObserver : public idem::Observer {
 public:
  std::atomic<int> downs{0};
  void on_fast_store_down(const Key&, const idem::Error&) noexcept override { ++downs; }
};

// Guarded calls from background threads over a fixed key list, with a SQLite effect table.
class Traffic {
 public:
  Traffic(idem::IdempotencyGuard<idem::sqlite::SqliteStore>& guard, std::vector<Key> keys)
      : guard_(guard), keys_(std::move(keys)) {}
  ~Traffic() { stop(); }
  void call(const Key& k) {
    try {
      auto r = guard_.run(k, "fp", [&](idem::sqlite::Transaction& tx) {
        tx.exec("INSERT INTO effect (k) VALUES (?)", k.id());
        return "resp_" + k.id();
      });
      if (r.ok() && *r.value != "resp_" + k.id()) ++wrong;
      if (!r.ok() && r.outcome != Outcome::kInProgress) ++wrong;
    } catch (const std::exception& e) {
      ++errors;
      std::lock_guard<std::mutex> lock(mutex_);
      if (first_error.empty()) first_error = e.what();
    }
    ++calls;
  }
  void start(int threads) {
    for (int t = 0; t < threads; ++t) {
      threads_.emplace_back([this, t] {
        // Thread t starts 7*t keys further: every key is called by several threads, at
        // nearby moments.
        for (std::size_t i = static_cast<std::size_t>(7 * t); !stop_.load(); ++i) {
          call(keys_[i % keys_.size()]);
          std::this_thread::sleep_for(1ms);
        }
      });
    }
  }
  void stop() {
    stop_ = true;
    for (auto& t : threads_) t.join();
    threads_.clear();
  }
  void wait_calls(int n) {
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (calls.load() < n && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(5ms);
    }
  }
  std::atomic<int> calls{0}, wrong{0}, errors{0};
  std::string first_error;

 private:
  idem::IdempotencyGuard<idem::sqlite::SqliteStore>& guard_;
  std::vector<Key> keys_;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
  std::mutex mutex_;
};

class ClusterFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(url_, "IDEM_TEST_REDIS_CLUSTER_URL");
    IDEM_REQUIRE_ENV(servers_script_, "IDEM_SERVERS_SCRIPT");
    admin_ = std::make_unique<idem::test::ClusterAdmin>(url_);
    ASSERT_TRUE(admin_->wait_healthy(60s)) << "the cluster is not healthy before the test";
    durable_ = std::make_unique<idem::sqlite::SqliteStore>(dir_.file("effects.db"));
    durable_->database().write(
        [](idem::sqlite::Transaction& tx) { tx.exec("CREATE TABLE effect (k TEXT NOT NULL)"); });
  }
  void TearDown() override {
    if (admin_) {
      EXPECT_TRUE(admin_->wait_healthy(90s)) << "the test left the cluster unhealthy";
    }
  }
  void servers(const std::string& what) {
    const std::string cmd = "\"" + servers_script_ + "\" " + what + " >/dev/null 2>&1";
    ASSERT_EQ(0, std::system(cmd.c_str())) << cmd;
  }
  std::int64_t effect_rows(const char* sql) {
    return durable_->database()
        .read([&](idem::sqlite::Session& s) { return s.query_int64(sql); })
        .value_or(-1);
  }
  std::string url_, servers_script_;
  std::unique_ptr<idem::test::ClusterAdmin> admin_;
  idem::test::TempDir dir_;
  std::unique_ptr<idem::sqlite::SqliteStore> durable_;
};

// CLUSTER SETSLOT IMPORTING / MIGRATING, MIGRATE of the slot's keys in two rounds, then SETSLOT
// NODE, all while 4 threads make guarded calls on 160 keys of that slot (40 existed before):
// the store follows ASK (keys already moved, and new keys) and then MOVED, and no call fails
// or degrades. The slot is moved back afterwards, without traffic.
TEST_F(ClusterFaultTest, SlotMigratedDuringARunFollowsAskAndMovedWithoutErrors) {
  RedisStore fast(url_);
  auto observer = std::make_shared<CountingObserver>();
  idem::GuardOptions go;
  go.observer = observer;
  idem::IdempotencyGuard guard{fast, *durable_, go};

  // A slot no earlier test has written to: the counts below are of the whole slot (the
  // cluster is shared with the tests that ran before, whose records live on).
  std::string scope;
  int slot = -1, source = 0;
  for (int attempt = 0; attempt < 100 && slot < 0; ++attempt) {
    scope = idem::test::unique_name("cluster.migrate");
    const int candidate =
        idem::redis::detail::key_slot(fast.redis_key(Key::make(scope, "seed")));
    source = admin_->slot_owner(candidate, admin_->ports().front());
    auto used = admin_->cmd(source, {"CLUSTER", "COUNTKEYSINSLOT", std::to_string(candidate)});
    if (used && used->type == REDIS_REPLY_INTEGER && used->integer == 0) slot = candidate;
  }
  ASSERT_GE(slot, 0) << "no empty slot found";
  std::vector<Key> keys;
  for (int i = 0; keys.size() < 160; ++i) {
    Key k = Key::make(scope, "m" + std::to_string(i));
    if (idem::redis::detail::key_slot(fast.redis_key(k)) == slot) keys.push_back(k);
  }
  int target = 0;
  for (int m : admin_->masters()) {
    if (m != source) target = m;
  }
  ASSERT_NE(0, source);
  ASSERT_NE(0, target);
  const std::string slot_s = std::to_string(slot);
  const std::string source_id = admin_->node_id(source), target_id = admin_->node_id(target);

  Traffic traffic(guard, keys);
  for (int i = 0; i < 40; ++i) traffic.call(keys[static_cast<std::size_t>(i)]);  // before
  ASSERT_EQ(40, admin_->count_keys(source, "idem:{" + scope + "|*"));
  traffic.start(4);
  traffic.wait_calls(traffic.calls.load() + 100);

  EXPECT_EQ("OK", idem::test::reply_text(
                      admin_->cmd(target, {"CLUSTER", "SETSLOT", slot_s, "IMPORTING", source_id})));
  EXPECT_EQ("OK", idem::test::reply_text(
                      admin_->cmd(source, {"CLUSTER", "SETSLOT", slot_s, "MIGRATING", target_id})));
  traffic.wait_calls(traffic.calls.load() + 100);
  EXPECT_GT(admin_->move_keys(slot, source, target), 0);
  traffic.wait_calls(traffic.calls.load() + 200);  // ASK: moved keys and new keys on target
  const auto ask_seen = fast.route_stats().ask;
  EXPECT_GE(admin_->move_keys(slot, source, target), 0);  // whatever was created meanwhile
  // SETSLOT NODE on the importing node first, then on the others.
  EXPECT_EQ("OK", idem::test::reply_text(
                      admin_->cmd(target, {"CLUSTER", "SETSLOT", slot_s, "NODE", target_id})));
  for (int m : admin_->masters()) {
    if (m == target) continue;
    EXPECT_EQ("OK", idem::test::reply_text(
                        admin_->cmd(m, {"CLUSTER", "SETSLOT", slot_s, "NODE", target_id})));
  }
  traffic.wait_calls(traffic.calls.load() + 200);  // MOVED, then the new owner directly
  traffic.stop();
  for (const Key& k : keys) traffic.call(k);  // every key, once more: all replay

  const auto routes = fast.route_stats();
  std::printf(
      "slot %d from %d to %d: %d calls, ask %llu (%llu before the last keys moved), "
      "moved %llu, refreshes %llu\n",
      slot, source, target, traffic.calls.load(), static_cast<unsigned long long>(routes.ask),
      static_cast<unsigned long long>(ask_seen), static_cast<unsigned long long>(routes.moved),
      static_cast<unsigned long long>(routes.refreshes));
  EXPECT_EQ(0, traffic.errors.load()) << traffic.first_error;
  EXPECT_EQ(0, traffic.wrong.load());
  EXPECT_EQ(0, observer->downs.load()) << "a fast-store error reached the guard";
  EXPECT_EQ(0u, guard.stats().snapshot().degraded);
  EXPECT_GT(ask_seen, 0u) << "no ASK redirect was followed";
  EXPECT_GT(routes.moved, 0u) << "no MOVED redirect was followed";
  EXPECT_EQ(160, effect_rows("SELECT COUNT(*) FROM effect"));  // exactly once
  EXPECT_EQ(160, effect_rows("SELECT COUNT(DISTINCT k) FROM effect"));
  EXPECT_EQ(160, admin_->count_keys(target, "idem:{" + scope + "|*"));
  EXPECT_EQ(0, admin_->count_keys(source, "idem:{" + scope + "|*"));

  // Put the slot back where it was (no traffic now).
  EXPECT_EQ("OK", idem::test::reply_text(
                      admin_->cmd(source, {"CLUSTER", "SETSLOT", slot_s, "IMPORTING", target_id})));
  EXPECT_EQ("OK", idem::test::reply_text(
                      admin_->cmd(target, {"CLUSTER", "SETSLOT", slot_s, "MIGRATING", source_id})));
  EXPECT_EQ(160, admin_->move_keys(slot, target, source));
  EXPECT_EQ("OK", idem::test::reply_text(
                      admin_->cmd(source, {"CLUSTER", "SETSLOT", slot_s, "NODE", source_id})));
  for (int m : admin_->masters()) {
    if (m == source) continue;
    EXPECT_EQ("OK", idem::test::reply_text(
                        admin_->cmd(m, {"CLUSTER", "SETSLOT", slot_s, "NODE", source_id})));
  }
  EXPECT_EQ(source, admin_->slot_owner(slot, target));
}

// The local tier across a slot migration: a record kept from the source master is removed when
// MIGRATE deletes it there (heard from the source); kept again from the target, it is removed
// when deleted on the target (heard from the target). The slot is moved back afterwards.
TEST_F(ClusterFaultTest, LocalTierAcrossASlotMigrationHearsSourceAndTarget) {
  RedisStoreOptions o{url_};
  o.local_tier.enabled = true;
  RedisStore fast(o);
  ASSERT_TRUE(idem::test::eventually([&] { return fast.local_tier_stats().tracking; }));
  const Key k = Key::make(idem::test::unique_name("cluster.tier"), "k");
  const int slot = idem::redis::detail::key_slot(fast.redis_key(k));
  const int source = admin_->slot_owner(slot, admin_->ports().front());
  int target = 0;
  for (int m : admin_->masters()) {
    if (m != source) target = m;
  }
  ASSERT_NE(0, source);
  ASSERT_NE(0, target);
  const std::string slot_s = std::to_string(slot);
  const std::string source_id = admin_->node_id(source), target_id = admin_->node_id(target);
  auto move_slot = [&](int from, const std::string& from_id, int to, const std::string& to_id) {
    EXPECT_EQ("OK", idem::test::reply_text(
                        admin_->cmd(to, {"CLUSTER", "SETSLOT", slot_s, "IMPORTING", from_id})));
    EXPECT_EQ("OK", idem::test::reply_text(
                        admin_->cmd(from, {"CLUSTER", "SETSLOT", slot_s, "MIGRATING", to_id})));
    EXPECT_GE(admin_->move_keys(slot, from, to), 0);
    EXPECT_EQ("OK", idem::test::reply_text(
                        admin_->cmd(to, {"CLUSTER", "SETSLOT", slot_s, "NODE", to_id})));
    for (int m : admin_->masters()) {
      if (m == to) continue;
      EXPECT_EQ("OK", idem::test::reply_text(
                          admin_->cmd(m, {"CLUSTER", "SETSLOT", slot_s, "NODE", to_id})));
    }
  };
  ASSERT_TRUE(idem::test::complete_first(fast, k, "fp", "v1"));
  ASSERT_TRUE(idem::test::warm(fast, k, "fp"));
  move_slot(source, source_id, target, target_id);
  // MIGRATE removed the key from the source: heard there.
  ASSERT_TRUE(idem::test::eventually([&] { return fast.local_tier_stats().entries == 0; }));
  // From the target now (MOVED followed), kept again, then deleted there.
  ASSERT_TRUE(idem::test::warm(fast, k, "fp"));
  auto del = admin_->cmd(target, {"DEL", fast.redis_key(k)});
  ASSERT_TRUE(del && del->type == REDIS_REPLY_INTEGER && del->integer == 1);
  ASSERT_TRUE(idem::test::eventually([&] { return fast.local_tier_stats().entries == 0; }));
  idem::OwnerToken owner = idem::OwnerToken::generate();
  EXPECT_EQ(idem::ClaimStatus::kClaimed, fast.claim(k, "fp", owner, 5000ms).status);
  EXPECT_TRUE(fast.release(k, owner));
  move_slot(target, target_id, source, source_id);
  EXPECT_EQ(source, admin_->slot_owner(slot, target));
}

// kill -9 of a master while 4 threads make guarded calls on 400 keys spread over the cluster:
// calls on its slots degrade to SQLite (StorageUnavailable) until its replica is promoted, then
// the store re-reads the slot map and writes to the new master. One effect per key throughout.
// The killed node is restarted and rejoins as a replica.
TEST_F(ClusterFaultTest, MasterKilledReplicaPromotedDegradesThenUsesTheNewMaster) {
  RedisStoreOptions o{url_};
  o.connect_timeout = 300ms;
  o.command_timeout = 300ms;
  RedisStore fast(o);
  idem::IdempotencyGuard guard{fast, *durable_};

  const auto masters = admin_->masters();
  ASSERT_EQ(3u, masters.size());
  const int victim = masters.front();
  const int heir = admin_->replica_of(victim);
  ASSERT_NE(0, heir) << "master " << victim << " has no replica";
  const auto owners = admin_->slot_map(heir);

  const std::string scope = idem::test::unique_name("cluster.failover");
  std::vector<Key> keys;
  for (int i = 0; i < 400; ++i) keys.push_back(Key::make(scope, "k" + std::to_string(i)));
  Traffic traffic(guard, keys);
  traffic.start(4);
  traffic.wait_calls(400);
  const auto before = guard.stats().snapshot();
  EXPECT_EQ(0u, before.degraded);

  servers("cluster-node-kill " + std::to_string(victim));
  const auto killed_at = std::chrono::steady_clock::now();
  bool promoted = false;
  while (!promoted && std::chrono::steady_clock::now() < killed_at + 60s) {
    promoted = admin_->role(heir) == "master";
    if (!promoted) std::this_thread::sleep_for(50ms);
  }
  ASSERT_TRUE(promoted) << "replica " << heir << " was not promoted";
  const auto at_promotion = guard.stats().snapshot();

  // Fresh keys on the victim's former slots: once the store has re-read the map they are
  // claimed on the new master (the fast path), and their records live there.
  bool on_new_master = false;
  int fresh_in_victim_slots = 0;
  for (int i = 0; !on_new_master && std::chrono::steady_clock::now() < killed_at + 60s; ++i) {
    Key k = Key::make(scope, "fresh" + std::to_string(i));
    const int slot = idem::redis::detail::key_slot(fast.redis_key(k));
    if (owners[static_cast<std::size_t>(slot)] != victim) continue;
    ++fresh_in_victim_slots;
    auto r = guard.run(k, "fp", [&](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT INTO effect (k) VALUES (?)", k.id());
      return "resp_" + k.id();
    });
    EXPECT_TRUE(r.ok());
    on_new_master = !r.degraded && admin_->count_keys(heir, fast.redis_key(k)) == 1;
    if (!on_new_master) std::this_thread::sleep_for(20ms);
  }
  const auto fast_again_after = std::chrono::steady_clock::now() - killed_at;
  traffic.wait_calls(traffic.calls.load() + 200);
  traffic.stop();
  for (const Key& k : keys) traffic.call(k);  // every key at least once
  const auto end = guard.stats().snapshot();
  servers("cluster-node-start " + std::to_string(victim));

  std::printf(
      "killed %d, %d promoted; degraded calls %llu (%llu by promotion); fast path on the "
      "new master after %lld ms (%d fresh keys); refreshes %llu, failures %llu\n",
      victim, heir, static_cast<unsigned long long>(end.degraded),
      static_cast<unsigned long long>(at_promotion.degraded),
      static_cast<long long>(
          std::chrono::duration_cast<std::chrono::milliseconds>(fast_again_after).count()),
      fresh_in_victim_slots, static_cast<unsigned long long>(fast.route_stats().refreshes),
      static_cast<unsigned long long>(fast.route_stats().refresh_failures));
  EXPECT_TRUE(on_new_master) << "the store never wrote to the promoted master";
  EXPECT_GT(at_promotion.degraded, 0u) << "no call degraded while the master was down";
  EXPECT_GT(end.fast_claims, at_promotion.fast_claims);
  EXPECT_EQ(0, traffic.errors.load()) << traffic.first_error;
  EXPECT_EQ(0, traffic.wrong.load());
  // Exactly once: one effect row per executed key, never two.
  EXPECT_EQ(0, effect_rows("SELECT COUNT(*) FROM (SELECT k FROM effect GROUP BY k "
                           "HAVING COUNT(*) > 1)"));
  EXPECT_EQ(static_cast<std::int64_t>(end.executed), effect_rows("SELECT COUNT(*) FROM effect"));
  EXPECT_EQ(400 + fresh_in_victim_slots, effect_rows("SELECT COUNT(*) FROM effect"));
}

}  // namespace
