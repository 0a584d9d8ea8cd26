// SPDX-License-Identifier: MIT
// idem::StateMachine on PostgreSQL: competing transitions, rejected / not found, undeclared
// transitions refused before any statement, hostile ids bound.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "idem/postgres/state_machine.hpp"
#include "pg_test_support.hpp"

namespace {

namespace pg = idem::test::pg;
using idem::Transition;

class CountingObserver final : public idem::Observer {
 public:
  std::atomic<int> duplicates{0};
  void on_duplicate(const idem::DuplicateEvent& e) noexcept override {
    if (e.source == idem::DuplicateSource::kStateMachine) ++duplicates;
  }
};

class PgStateMachine : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_POSTGRES();
    auto o = pg::options();
    store_ = std::make_unique<idem::postgres::PostgresStore>(o);
    table_ = idem::test::unique_name("orders");
    pg::exec("CREATE TABLE " + pg::table(table_) +
             " (order_no text PRIMARY KEY, status text NOT NULL, paid_at timestamptz,"
             " paid_amount bigint)");
    observer_ = std::make_shared<CountingObserver>();
  }
  idem::StateMachine machine() const {
    return idem::StateMachine{
        table_,
        "order_no",
        "status",
        {{"WAIT_PAY", "PAID"}, {"PAID", "SHIPPED"}, {"WAIT_PAY", "CANCELLED"}},
        observer_};
  }
  void insert(const std::string& order_no, const std::string& status) {
    store_->with_transaction([&](pqxx::work& tx) {
      tx.exec_params("INSERT INTO " + pg::table(table_) + " (order_no, status) VALUES ($1, $2)",
                     order_no, status);
    });
  }
  std::string status(const std::string& order_no) {
    return store_->with_transaction([&](pqxx::work& tx) {
      return tx
          .exec_params1("SELECT status FROM " + pg::table(table_) + " WHERE order_no = $1",
                        order_no)[0]
          .as<std::string>();
    });
  }
  // The machine names the bare table; statements run with the test schema on the search path.
  template <class Fn>
  auto in_tx(Fn&& fn) {
    return store_->with_transaction([&](pqxx::work& tx) {
      tx.exec("SET LOCAL search_path = " + pg::Schema::name());
      return fn(tx);
    });
  }

  std::unique_ptr<idem::postgres::PostgresStore> store_;
  std::string table_;
  std::shared_ptr<CountingObserver> observer_;
};

TEST_F(PgStateMachine, ThirtyTwoCompetingTransitionsHaveExactlyOneWinner) {
  auto orders = machine();
  insert("o1", "WAIT_PAY");
  std::atomic<int> transitioned{0}, already{0}, other{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&, i] {
      while (!go.load()) std::this_thread::yield();
      try {
        auto r = in_tx([&](pqxx::work& tx) {
          return orders.transition(
              tx, "o1", "WAIT_PAY", "PAID",
              {{"paid_at", "2026-01-01T10:00:00Z"}, {"paid_amount", std::to_string(100 + i)}});
        });
        if (r.kind == Transition::kTransitioned)
          ++transitioned;
        else if (r.kind == Transition::kAlreadyThere)
          ++already;
        else
          ++other;
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    });
  }
  go = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(1, transitioned.load());
  EXPECT_EQ(31, already.load());
  EXPECT_EQ(0, other.load());
  EXPECT_EQ(31, observer_->duplicates.load());
  EXPECT_EQ("PAID", status("o1"));
  EXPECT_EQ(1, pg::scalar("SELECT count(*) FROM " + pg::table(table_) +
                          " WHERE paid_at IS NOT NULL AND paid_amount BETWEEN 100 AND 131"));
}

TEST_F(PgStateMachine, RejectedNotFoundAndAlreadyThere) {
  auto orders = machine();
  insert("o2", "CANCELLED");
  auto r = in_tx([&](pqxx::work& tx) { return orders.transition(tx, "o2", "WAIT_PAY", "PAID"); });
  EXPECT_EQ(Transition::kRejected, r.kind);
  EXPECT_EQ("CANCELLED", r.current);
  EXPECT_FALSE(r.ok());
  auto missing =
      in_tx([&](pqxx::work& tx) { return orders.transition(tx, "nope", "WAIT_PAY", "PAID"); });
  EXPECT_EQ(Transition::kNotFound, missing.kind);
  insert("o3", "WAIT_PAY");
  auto a = in_tx([&](pqxx::work& tx) { return orders.transition(tx, "o3", "WAIT_PAY", "PAID"); });
  auto b = in_tx([&](pqxx::work& tx) { return orders.transition(tx, "o3", "PAID", "SHIPPED"); });
  auto c = in_tx([&](pqxx::work& tx) { return orders.transition(tx, "o3", "PAID", "SHIPPED"); });
  EXPECT_EQ(Transition::kTransitioned, a.kind);
  EXPECT_EQ(Transition::kTransitioned, b.kind);
  EXPECT_EQ(Transition::kAlreadyThere, c.kind);
  EXPECT_EQ("SHIPPED", status("o3"));
}

TEST_F(PgStateMachine, UndeclaredTransitionIsRefusedBeforeAnyStatement) {
  auto orders = machine();
  insert("o4", "PAID");
  // Sanity: in a transaction aborted server-side, a declared transition's statement fails.
  EXPECT_THROW(in_tx([&](pqxx::work& tx) {
                 try {
                   tx.exec("SELECT 1/0");
                 } catch (const std::exception&) {
                 }
                 return orders.transition(tx, "o4", "PAID", "SHIPPED");
               }),
               idem::StorageError);
  bool usage = false;
  try {
    in_tx([&](pqxx::work& tx) {
      try {
        tx.exec("SELECT 1/0");
      } catch (const std::exception&) {
      }
      // tx is aborted server-side now: a statement would raise 25P02 (a StorageError).
      return orders.transition(tx, "o4", "PAID", "WAIT_PAY");
    });
  } catch (const idem::UsageError&) {
    usage = true;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "a statement was sent: " << e.what();
  }
  EXPECT_TRUE(usage);
  EXPECT_EQ("PAID", status("o4"));
  EXPECT_THROW(
      in_tx([&](pqxx::work& tx) {
        return orders.transition(tx, "o4", "PAID", "SHIPPED", {{"paid_at; DROP TABLE x", "1"}});
      }),
      idem::UsageError);
}

TEST_F(PgStateMachine, HostileIdsAndValuesAreBound) {
  auto orders = machine();
  for (std::string id :
       {"';DROP_TABLE_orders;--", "o'brien", "back\\slash\\", "$1", "'; DROP TABLE x; --"}) {
    insert(id, "WAIT_PAY");
    auto r = in_tx([&](pqxx::work& tx) {
      return orders.transition(tx, id, "WAIT_PAY", "PAID", {{"paid_at", std::nullopt}});
    });
    EXPECT_EQ(Transition::kTransitioned, r.kind) << id;
    EXPECT_EQ("PAID", status(id)) << id;
  }
  EXPECT_EQ(5, pg::scalar("SELECT count(*) FROM " + pg::table(table_)));
  // libpq sends text as C strings: "a\0evil" would have matched (and moved) row "a".
  insert("a", "WAIT_PAY");
  EXPECT_THROW(in_tx([&](pqxx::work& tx) {
                 return orders.transition(tx, std::string("a\0evil", 6), "WAIT_PAY", "PAID");
               }),
               idem::UsageError);
  EXPECT_EQ("WAIT_PAY", status("a"));
}

TEST(StateMachineDecl, RejectsBadIdentifiersAndGraphs) {
  EXPECT_THROW((idem::StateMachine{"orders; DROP", "id", "status", {{"A", "B"}}}),
               idem::UsageError);
  EXPECT_THROW((idem::StateMachine{"orders", "id", "id", {{"A", "B"}}}), idem::UsageError);
  EXPECT_THROW((idem::StateMachine{"orders", "id", "status", {}}), idem::UsageError);
  EXPECT_THROW((idem::StateMachine{"orders", "id", "status", {{"A", ""}}}), idem::UsageError);
  idem::StateMachine ok{"orders", "id", "status", {{"A", "B"}}};
  EXPECT_TRUE(ok.allows("A", "B"));
  EXPECT_FALSE(ok.allows("B", "A"));
}

}  // namespace
