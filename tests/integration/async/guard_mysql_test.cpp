// SPDX-License-Identifier: MIT
// AsyncGuard's outcome suite on PooledDurable<MysqlStore> (the real server:
// IDEM_TEST_MYSQL_URI): MySQL alone, and MemoryStore in front of it. The transactions and
// idem's statements run on the worker pool, never on the loop.
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "async_guard_suite.hpp"
#include "idem/async/pooled_durable.hpp"
#include "idem/memory_store.hpp"
#include "mysql_test_support.hpp"

namespace {

namespace my = idem::test::my;
using idem::async::PooledDurable;
using idem::mysql::MysqlStore;

// The worker pool's 4 threads hold at most 4 connections.
idem::mysql::MysqlStoreOptions store_options() {
  auto o = my::options();
  o.pool_size = 8;
  return o;
}

struct MysqlBase {
  using Durable = PooledDurable<MysqlStore>;
  static const char* env_var() { return "IDEM_TEST_MYSQL_URI"; }
  explicit MysqlBase(const std::string&)
      : store(store_options()), workers({4, 256}), pooled(store, workers) {}
  Durable& durable() { return pooled; }
  idem::async::WorkerPool& pool() { return workers; }
  void insert_effect(idem::mysql::Transaction& tx, const std::string& id) {
    my::insert_effect(tx, id);
  }
  long count_effects(const std::string& id) {
    return my::count_where("idem_test_effects", "key_id", id);
  }
  MysqlStore store;
  idem::async::WorkerPool workers;
  Durable pooled;
};

struct MysqlOnly : MysqlBase {
  using MysqlBase::MysqlBase;
  idem::async::AsyncFastStore* fast() { return nullptr; }
  void forget_fast(const idem::Key&) {}
};

struct MemoryMysql : MysqlBase {
  explicit MemoryMysql(const std::string& v) : MysqlBase(v), fast_adapter(memory) {}
  idem::async::AsyncFastStore* fast() { return &fast_adapter; }
  void forget_fast(const idem::Key&) { memory.clear(); }
  idem::MemoryStore memory;
  idem::async::InlineFastStore fast_adapter;
};

}  // namespace

namespace idem::test {
using MysqlEnvs = ::testing::Types<MysqlOnly, MemoryMysql>;
INSTANTIATE_TYPED_TEST_SUITE_P(Mysql, AsyncGuardSuite, MysqlEnvs);

// A two-phase handler ran (its effect happened) and MySQL refused its response for good
// (over max_allowed_packet): the record is marked failed, so no retry runs the handler again,
// during the lease or after it; later calls get a non-retryable StorageError.
class AsyncMysqlRefusedResponse : public AsyncGuardSuite<MemoryMysql> {};

TEST_F(AsyncMysqlRefusedResponse, IsNeverRunAgain) {
  idem::async::AsyncGuardOptions o;
  o.guard.lease = std::chrono::milliseconds(300);
  auto g = this->guard(o);
  auto k = this->key();
  const std::string big(static_cast<std::size_t>(env_->store.max_response_bytes()) + 1, 'x');
  std::atomic<int> external{0};
  auto charge = [&] {
    ++external;
    return big;
  };
  Answer<> first;
  this->start(*g, k, "fp", charge, first);
  EXPECT_TRUE(holds<idem::UsageError>(first.wait().error)) << what_of(first.wait().error);
  auto record = env_->store.lookup(k);
  ASSERT_TRUE(record.has_value());
  EXPECT_EQ(idem::Record::Status::kFailed, record->status);
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // past the lease
  Answer<> again;
  this->start(*g, k, "fp", charge, again);
  const auto& a = again.wait();
  EXPECT_TRUE(holds<idem::StorageError>(a.error)) << what_of(a.error);
  EXPECT_FALSE(holds<idem::UsageError>(a.error)) << what_of(a.error);
  EXPECT_NE(std::string::npos, what_of(a.error).find("could not be stored")) << what_of(a.error);
  EXPECT_EQ(1, external.load());
}
}  // namespace idem::test
