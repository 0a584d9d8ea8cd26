// SPDX-License-Identifier: MIT
// PostgresStore on a hash-partitioned api_idempotency (PostgresStoreOptions::partitions): the
// durable conformance suite on that layout, the layout itself (partition key, one unique key
// across partitions), rows spread over partitions, and the purge partition by partition.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>

#include "conformance/durable_store_conformance.hpp"
#include "pg_test_support.hpp"

namespace {

using idem::ClaimStatus;
using idem::Key;
using idem::OwnerToken;
using idem::postgres::PostgresStore;

constexpr std::size_t kPartitions = 8;

// A second throwaway schema, for the partitioned table (the process schema's api_idempotency
// is a plain table). Dropped when the process ends.
class PartitionedSchema final : public ::testing::Environment {
 public:
  static const std::string& name() {
    static const std::string n = [] {
      std::string s = idem::test::unique_name("idem_test_part");
      ::testing::AddGlobalTestEnvironment(new PartitionedSchema(s));
      idem::test::pg::exec("CREATE SCHEMA IF NOT EXISTS " + s);
      return s;
    }();
    return n;
  }
  void TearDown() override {
    try {
      idem::test::pg::exec("DROP SCHEMA IF EXISTS " + name_ + " CASCADE");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "could not drop schema %s: %s\n", name_.c_str(), e.what());
    }
  }

 private:
  explicit PartitionedSchema(std::string n) : name_(std::move(n)) {}
  std::string name_;
};

idem::postgres::PostgresStoreOptions partitioned_options() {
  auto o = idem::test::pg::options();
  o.schema = PartitionedSchema::name();
  o.partitions = kPartitions;
  return o;
}

std::string partitioned_table() { return PartitionedSchema::name() + ".api_idempotency"; }

struct PartitionedTraits {
  using Store = PostgresStore;
  static const char* env_var() { return "IDEM_TEST_POSTGRES_DSN"; }
  static std::unique_ptr<Store> make(const std::string&) {
    return std::make_unique<Store>(partitioned_options());
  }
  static void insert_effect(pqxx::work& tx, const std::string& key_id) {
    idem::test::pg::insert_effect(tx, key_id);
  }
  static long count_effects(Store&, const std::string& key_id) {
    return idem::test::pg::count_where("idem_test_effects", "key_id", key_id);
  }
  static long count_records(Store&) {
    return idem::test::pg::scalar("SELECT count(*) FROM " + partitioned_table());
  }
};

struct PartitionedReadFirstTraits : PartitionedTraits {
  static std::unique_ptr<Store> make(const std::string&) {
    auto o = partitioned_options();
    o.read_first = true;
    return std::make_unique<Store>(o);
  }
};

}  // namespace

namespace idem::test {
using PartitionedTypes = ::testing::Types<PartitionedTraits, PartitionedReadFirstTraits>;
INSTANTIATE_TYPED_TEST_SUITE_P(PostgresPartitioned, DurableStoreConformance, PartitionedTypes);
}  // namespace idem::test

namespace {

class PartitionedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_POSTGRES();
    store_ = std::make_unique<PostgresStore>(partitioned_options());
  }
  Key key(const std::string& tag) { return Key::make("part.test", idem::test::unique_name(tag)); }
  std::unique_ptr<PostgresStore> store_;
};

TEST_F(PartitionedTest, HashPartitionedByScopeAndKeyWithOneUniqueKey) {
  auto leaves = store_->partitions();
  ASSERT_EQ(kPartitions, leaves.size());
  EXPECT_EQ(PartitionedSchema::name() + ".api_idempotency_p0", leaves.front());
  // Strategy 'h' (hash) on (biz_type, idem_key), in that order.
  auto r = idem::test::pg::exec(
      "SELECT p.partstrat, pg_get_partkeydef(p.partrelid) FROM pg_partitioned_table p"
      " WHERE p.partrelid = '" +
      partitioned_table() + "'::regclass");
  ASSERT_EQ(1u, r.size());
  EXPECT_EQ("h", r[0][0].as<std::string>());
  EXPECT_EQ("HASH (biz_type, idem_key)", r[0][1].as<std::string>());
  // The unique key (the primary key) is one constraint of the parent, enforced whatever the
  // partition.
  EXPECT_EQ(1, idem::test::pg::scalar(
                   "SELECT count(*) FROM pg_constraint WHERE conname = 'api_idempotency_key_uq'"
                   " AND contype = 'p' AND conrelid = '" +
                   partitioned_table() + "'::regclass"));
  const std::string insert = "INSERT INTO " + partitioned_table() +
                             " (idem_key, biz_type, status, owner, lease_until)"
                             " VALUES ('dup', 'part.raw', 'in_progress', 'o', now())";
  idem::test::pg::exec(insert);
  EXPECT_THROW(idem::test::pg::exec(insert), pqxx::unique_violation);
  idem::test::pg::exec("DELETE FROM " + partitioned_table() + " WHERE biz_type = 'part.raw'");
  // A second store (another process starting): the migration is a no-op.
  PostgresStore again(partitioned_options());
  EXPECT_EQ(leaves, again.partitions());
}

TEST_F(PartitionedTest, RecordsSpreadOverEveryPartition) {
  const std::string scope = idem::test::unique_name("part_spread");
  for (int i = 0; i < 200; ++i) {
    Key k = Key::make(scope, "k" + std::to_string(i));
    ASSERT_EQ(idem::TransactionalStatus::kCommitted,
              store_
                  ->run_transactional(k, "fp", OwnerToken::generate(), std::chrono::seconds(60),
                                      [](pqxx::work&) { return std::string("r"); })
                  .status);
  }
  std::set<std::string> used;
  for (const std::string& leaf : store_->partitions()) {
    const long n = idem::test::pg::scalar("SELECT count(*) FROM " + leaf + " WHERE biz_type = '" +
                                          scope + "'");
    EXPECT_GT(n, 0) << leaf;
    if (n > 0) used.insert(leaf);
  }
  EXPECT_EQ(kPartitions, used.size());
  EXPECT_EQ(200, idem::test::pg::scalar("SELECT count(*) FROM " + partitioned_table() +
                                        " WHERE biz_type = '" + scope + "'"));
}

// Expired completed rows in every partition are purged (batches smaller than a partition's
// share, so each partition takes several); in-progress and unexpired rows stay.
TEST_F(PartitionedTest, PurgeEmptiesEveryPartitionOfExpiredRowsOnly) {
  const std::string scope = idem::test::unique_name("part_purge");
  std::vector<Key> expired, kept;
  for (int i = 0; i < 80; ++i) {
    expired.push_back(Key::make(scope, "e" + std::to_string(i)));
    (void)store_->run_transactional(expired.back(), "", OwnerToken::generate(),
                                    std::chrono::seconds(1),
                                    [](pqxx::work&) { return std::string(); });
  }
  for (int i = 0; i < 16; ++i) {
    kept.push_back(Key::make(scope, "k" + std::to_string(i)));
    (void)store_->run_transactional(kept.back(), "", OwnerToken::generate(),
                                    std::chrono::seconds(600),
                                    [](pqxx::work&) { return std::string(); });
  }
  Key live = Key::make(scope, "live");
  ASSERT_EQ(ClaimStatus::kClaimed,
            store_->begin(live, "", OwnerToken::generate(), std::chrono::milliseconds(100)).status);
  std::set<std::string> holding_expired;
  for (const std::string& leaf : store_->partitions()) {
    if (idem::test::pg::scalar("SELECT count(*) FROM " + leaf + " WHERE biz_type = '" + scope +
                               "' AND idem_key LIKE 'e%'") > 0) {
      holding_expired.insert(leaf);
    }
  }
  EXPECT_EQ(kPartitions, holding_expired.size());
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_GE(store_->purge_expired(3), 80u);
  for (const Key& k : expired) EXPECT_FALSE(store_->lookup(k).has_value()) << k.id();
  for (const Key& k : kept) EXPECT_TRUE(store_->lookup(k).has_value()) << k.id();
  EXPECT_TRUE(store_->lookup(live).has_value());
  EXPECT_EQ(0, idem::test::pg::scalar("SELECT count(*) FROM " + partitioned_table() +
                                      " WHERE status <> 'in_progress' AND expires_at <= now()"));
}

TEST_F(PartitionedTest, PlainTableHasNoPartitionsAndOptionsAreChecked) {
  auto o = idem::test::pg::options();  // the process schema: a plain table
  PostgresStore plain(o);
  EXPECT_TRUE(plain.partitions().empty());
  o.partitions = 4;  // the table exists: left as it is
  PostgresStore still_plain(o);
  EXPECT_TRUE(still_plain.partitions().empty());
  o.partitions = 2000;
  EXPECT_THROW(PostgresStore{o}, idem::UsageError);
  o.partitions = 10;
  o.table = std::string(61, 't');  // "<61 t>_p9" is longer than 63 bytes
  o.migrate = false;
  EXPECT_THROW(PostgresStore{o}, idem::UsageError);
}

// schema.sql with -v partitions=4 gives the same layout, which the store then uses as it is
// (migrate = false); run twice it is a no-op.
TEST_F(PartitionedTest, ShippedSchemaSqlCreatesThePartitionedLayout) {
  const std::string schema = idem::test::unique_name("idem_sql_part");
  const std::string cmd = "PGOPTIONS='-c client_min_messages=warning' psql \"" +
                          idem::test::pg::dsn() + "\" -q -v ON_ERROR_STOP=1 -v schema=" + schema +
                          " -v partitions=4 -f " IDEM_SOURCE_DIR
                          "/src/postgres/schema.sql >/dev/null";
  ASSERT_EQ(0, std::system(cmd.c_str())) << cmd;
  ASSERT_EQ(0, std::system(cmd.c_str())) << "second run: " << cmd;
  {
    auto o = idem::test::pg::options();
    o.schema = schema;
    o.migrate = false;
    PostgresStore store(o);
    EXPECT_EQ(4u, store.partitions().size());
    EXPECT_EQ("HASH (biz_type, idem_key)",
              idem::test::pg::exec("SELECT pg_get_partkeydef('" + schema +
                                   ".api_idempotency'::regclass)")[0][0]
                  .as<std::string>());
    idem::IdempotencyGuard guard{store};
    auto k = key("sql");
    EXPECT_EQ(idem::Outcome::kExecuted,
              guard.run(k, "", [](pqxx::work&) { return std::string("ok"); }).outcome);
    EXPECT_EQ(idem::Outcome::kReplayed,
              guard.run(k, "", [](pqxx::work&) { return std::string("no"); }).outcome);
  }
  idem::test::pg::exec("DROP SCHEMA " + schema + " CASCADE");
}

// A plain table made by hand (no version row): the partitions option leaves it alone.
TEST_F(PartitionedTest, PlainTableMadeByHandIsLeftAlone) {
  const std::string schema = idem::test::unique_name("idem_sql_plain");
  const std::string cmd = "PGOPTIONS='-c client_min_messages=warning' psql \"" +
                          idem::test::pg::dsn() + "\" -q -v ON_ERROR_STOP=1 -v schema=" + schema +
                          " -f " IDEM_SOURCE_DIR "/src/postgres/schema.sql >/dev/null";
  ASSERT_EQ(0, std::system(cmd.c_str())) << cmd;
  idem::test::pg::exec("DELETE FROM " + schema + ".idem_schema_version");
  {
    auto o = idem::test::pg::options();
    o.schema = schema;
    o.partitions = 4;
    PostgresStore store(o);
    EXPECT_TRUE(store.partitions().empty());
  }
  idem::test::pg::exec("DROP SCHEMA " + schema + " CASCADE");
}

}  // namespace
