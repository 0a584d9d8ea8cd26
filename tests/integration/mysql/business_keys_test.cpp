// SPDX-License-Identifier: MIT
// UniqueInsert and StockTable on MariaDB through the MySQL SqlDriver: the shared business-key
// suite, then the coupon claim on the seed table `user_coupon` (uk_user_coupon: a duplicate is
// a success) inside a guarded transaction, and the MySQL traps of these helpers.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "conformance/business_keys_conformance.hpp"
#include "idem/guard.hpp"
#include "idem/memory_store.hpp"
#include "idem/mysql/sql_driver.hpp"
#include "idem/mysql/state_machine.hpp"
#include "idem/state_machine.hpp"
#include "mysql_test_support.hpp"

namespace {

namespace my = idem::test::my;

// One store (pool) for every transaction of the suite, created on first use.
idem::mysql::MysqlStore& shared_store() {
  static idem::mysql::MysqlStore store{my::options()};
  return store;
}

struct MysqlBusinessTraits {
  using Tx = idem::mysql::Transaction;
  static const char* env_var() { return "IDEM_TEST_MYSQL_URI"; }
  static void exec(const std::string& sql) { my::raw().query(sql); }
  static long long scalar(const std::string& sql) { return my::raw().scalar(sql); }
  template <class Fn>
  static void in_tx(Fn&& fn) {
    shared_store().with_transaction([&](Tx& tx) { fn(tx); });
  }
  static std::string coupon_ddl(const std::string& t) {
    return "CREATE TABLE " + t +
           " (id bigint PRIMARY KEY AUTO_INCREMENT, user_id bigint NOT NULL,"
           " coupon_id varchar(64) COLLATE utf8mb4_bin NOT NULL,"
           " channel varchar(64) COLLATE utf8mb4_bin NOT NULL,"
           " UNIQUE KEY uk_user_coupon (user_id, coupon_id)) ENGINE=InnoDB";
  }
  static std::string stock_ddl(const std::string& t) {
    return "CREATE TABLE " + t +
           " (sku varchar(64) COLLATE utf8mb4_bin PRIMARY KEY, qty int NOT NULL) ENGINE=InnoDB";
  }
};

}  // namespace

namespace idem::test {
using MysqlBusinessTypes = ::testing::Types<MysqlBusinessTraits>;
INSTANTIATE_TYPED_TEST_SUITE_P(Mysql, BusinessKeysConformance, MysqlBusinessTypes);
}  // namespace idem::test

namespace {

// The seed table exactly as payment services write it.
class MysqlCouponSeed : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_MYSQL();
    table_ = idem::test::unique_name("user_coupon");
    my::raw().query("CREATE TABLE " + table_ +
                    " (id bigint primary key auto_increment, user_id bigint not null,"
                    " coupon_id bigint not null, created_at datetime not null,"
                    " unique key uk_user_coupon (user_id, coupon_id))");
  }
  void TearDown() override {
    if (!table_.empty()) my::raw().query("DROP TABLE IF EXISTS " + table_);
  }
  std::string table_;
};

// Many requests with *different* idempotency keys claim the same coupon: the guard runs each
// (no idempotency record matches), and the business unique key makes the claim once: one row,
// every caller told "you have it" with the same id.
TEST_F(MysqlCouponSeed, GuardedClaimsWithDistinctKeysMakeOneRowOneId) {
  idem::mysql::MysqlStore store{my::options()};
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, store};
  idem::UniqueInsert user_coupon{table_, {"user_id", "coupon_id"}, {"created_at"}};
  constexpr int kThreads = 24;
  std::atomic<bool> go{false};
  std::atomic<int> inserted{0}, existing{0}, errors{0};
  std::mutex mu;
  std::set<std::string> answers;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      while (!go.load()) std::this_thread::yield();
      try {
        auto key =
            idem::Key::make("coupon.claim", idem::test::unique_name("req" + std::to_string(i)));
        auto r = guard.run(key, "", [&](idem::mysql::Transaction& tx) {
          auto c = user_coupon.insert(tx, 20001, 501, "2026-12-01 10:00:00");
          (c.inserted() ? inserted : existing).fetch_add(1);
          return "coupon_" + std::to_string(c.id);
        });
        std::lock_guard<std::mutex> lock(mu);
        answers.insert(*r.value);
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        errors.fetch_add(1);
      }
    });
  }
  go = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(0, errors.load());
  EXPECT_EQ(1, inserted.load());
  EXPECT_EQ(kThreads - 1, existing.load());
  EXPECT_EQ(1u, answers.size());
  EXPECT_EQ(1, my::raw().scalar("SELECT count(*) FROM " + table_));
  EXPECT_EQ("coupon_" + std::to_string(my::raw().scalar("SELECT id FROM " + table_)),
            *answers.begin());
}

// Another unique key than the named one conflicting is an error, never "already exists".
TEST_F(MysqlCouponSeed, ConflictOnAnotherUniqueKeyIsATypedError) {
  my::raw().query("ALTER TABLE " + table_ +
                  " ADD COLUMN ref varchar(32) NOT NULL DEFAULT '',"
                  " ADD UNIQUE KEY uk_ref (ref)");
  idem::mysql::MysqlStore store{my::options()};
  idem::UniqueInsert claim{table_, {"user_id", "coupon_id"}, {"created_at", "ref"}};
  store.with_transaction([&](idem::mysql::Transaction& tx) {
    EXPECT_TRUE(claim.insert(tx, 1, 1, "2026-12-01 10:00:00", "R1").inserted());
    EXPECT_THROW((void)claim.insert(tx, 2, 2, "2026-12-01 10:00:00", "R1"), idem::StorageError);
    // Still usable: the failed statement alone was rolled back.
    EXPECT_TRUE(claim.insert(tx, 3, 3, "2026-12-01 10:00:00", "R3").inserted());
  });
  EXPECT_EQ(2, my::raw().scalar("SELECT count(*) FROM " + table_));
}

// "The same key" is the column's collation on MySQL / MariaDB, as docs/flash-sale.md and
// docs/state-machine.md say: under utf8mb4_bin (PAD SPACE) a trailing space names the same
// coupon and the same order; under a _nopad_bin collation it does not.
TEST(MysqlBusinessSql, PadSpaceCollationDecidesWhatIsAlreadyThere) {
  IDEM_REQUIRE_MYSQL();
  idem::mysql::MysqlStore store{my::options()};
  for (const char* collation : {"utf8mb4_bin", "utf8mb4_nopad_bin"}) {
    const bool pads = std::string(collation) == "utf8mb4_bin";
    const std::string coupons = idem::test::unique_name("coupon_pad");
    const std::string orders = idem::test::unique_name("order_pad");
    my::raw().query("CREATE TABLE " + coupons +
                    " (id bigint PRIMARY KEY AUTO_INCREMENT, user_id bigint NOT NULL,"
                    " code varchar(32) COLLATE " +
                    collation +
                    " NOT NULL,"
                    " UNIQUE KEY uk (user_id, code)) ENGINE=InnoDB");
    my::raw().query("CREATE TABLE " + orders + " (order_no varchar(32) COLLATE " + collation +
                    " PRIMARY KEY, status varchar(16) NOT NULL) ENGINE=InnoDB");
    my::raw().query("INSERT INTO " + orders + " VALUES ('ORD-2', 'WAIT_PAY')");
    idem::UniqueInsert claim{coupons, {"user_id", "code"}, {}};
    idem::StateMachine sm{orders, "order_no", "status", {{"WAIT_PAY", "PAID"}}};
    store.with_transaction([&](idem::mysql::Transaction& tx) {
      auto first = claim.insert(tx, 1, "C1");
      EXPECT_TRUE(first.inserted());
      auto spaced = claim.insert(tx, 1, "C1 ");
      EXPECT_EQ(pads, !spaced.inserted()) << collation;
      if (pads) {
        EXPECT_EQ(first.id, spaced.id);
      }
      auto t = sm.transition(tx, "ORD-2 ", "WAIT_PAY", "PAID");
      EXPECT_EQ(pads ? idem::Transition::kTransitioned : idem::Transition::kNotFound, t.kind)
          << collation;
    });
    EXPECT_EQ(pads ? 1 : 2, my::raw().scalar("SELECT count(*) FROM " + coupons));
    my::raw().query("DROP TABLE " + coupons);
    my::raw().query("DROP TABLE " + orders);
  }
}

// The MySQL statements: no ON CONFLICT, no RETURNING, a locking read after a duplicate.
TEST(MysqlBusinessSql, StatementsAvoidWhatMysqlLacks) {
  idem::UniqueInsert claim{"user_coupon", {"user_id", "coupon_id"}, {"created_at"}};
  EXPECT_EQ("INSERT INTO user_coupon (user_id, coupon_id, created_at) VALUES (?1, ?2, ?3)",
            claim.insert_sql(idem::SqlDialect::kMysql));
  EXPECT_EQ("SELECT id FROM user_coupon WHERE user_id = ?1 AND coupon_id = ?2 LOCK IN SHARE MODE",
            claim.select_sql(idem::SqlDialect::kMysql));
  idem::StockTable stock{"stock", "sku", "qty"};
  EXPECT_EQ("UPDATE stock SET qty = LAST_INSERT_ID(qty - ?2) WHERE sku = ?1 AND qty >= ?2",
            stock.deduct_sql(idem::SqlDialect::kMysql));
}

}  // namespace
