// SPDX-License-Identifier: MIT
// AsyncGuard's outcome suite on PooledDurable<MysqlStore> (the real server:
// IDEM_TEST_MYSQL_URI): MySQL alone, and MemoryStore in front of it. The transactions and
// idem's statements run on the worker pool, never on the loop.
#include <memory>
#include <string>

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
}  // namespace idem::test
