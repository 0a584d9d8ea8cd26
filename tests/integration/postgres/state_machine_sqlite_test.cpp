// SPDX-License-Identifier: MIT
// idem::StateMachine on SQLite: transitions, duplicates, rejections, bound hostile ids, and an
// undeclared transition refused before any statement.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "idem/sqlite/state_machine.hpp"
#include "support/test_env.hpp"

namespace {

using idem::Transition;

// A transaction type whose driver only counts statements (to prove none was issued).
struct CountingTx {
  int statements = 0;
};

}  // namespace

namespace idem {
template <>
struct StateMachineDriver<CountingTx> {
  static std::string placeholder(int n) { return "?" + std::to_string(n); }
  static long long update(CountingTx& tx, const std::string&,
                          const std::vector<std::optional<std::string>>&) {
    ++tx.statements;
    return 1;
  }
  static std::optional<std::string> current(CountingTx& tx, const std::string&,
                                            const std::string&) {
    ++tx.statements;
    return std::nullopt;
  }
};
}  // namespace idem

namespace {

class SqliteStateMachine : public ::testing::Test {
 protected:
  void SetUp() override {
    db_ = std::make_shared<idem::sqlite::Database>(dir_.file("orders.sqlite"));
    db_->write([](idem::sqlite::Transaction& tx) {
      tx.exec(
          "CREATE TABLE orders (order_no TEXT PRIMARY KEY, status TEXT NOT NULL,"
          " paid_at TEXT)");
    });
  }
  idem::StateMachine orders{"orders",
                            "order_no",
                            "status",
                            {{"WAIT_PAY", "PAID"}, {"PAID", "SHIPPED"}, {"WAIT_PAY", "CANCELLED"}}};
  idem::test::TempDir dir_;
  std::shared_ptr<idem::sqlite::Database> db_;

  void insert(const std::string& id, const std::string& status) {
    db_->write([&](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT INTO orders (order_no, status) VALUES (?, ?)", id, status);
    });
  }
  idem::TransitionResult move(const std::string& id, const std::string& from, const std::string& to,
                              const std::vector<idem::Assignment>& extra = {}) {
    return db_->write(
        [&](idem::sqlite::Transaction& tx) { return orders.transition(tx, id, from, to, extra); });
  }
  std::string status(const std::string& id) {
    return db_->read([&](idem::sqlite::Session& s) {
      return s.query_text("SELECT status FROM orders WHERE order_no = ?", id).value_or("");
    });
  }
};

TEST_F(SqliteStateMachine, TransitionsAndRepeats) {
  insert("o1", "WAIT_PAY");
  auto a = move("o1", "WAIT_PAY", "PAID", {{"paid_at", "2026-01-01"}});
  EXPECT_EQ(Transition::kTransitioned, a.kind);
  EXPECT_EQ("WAIT_PAY", a.current);
  auto b = move("o1", "WAIT_PAY", "PAID");
  EXPECT_EQ(Transition::kAlreadyThere, b.kind);
  EXPECT_TRUE(b.ok());
  auto c = move("o1", "WAIT_PAY", "CANCELLED");
  EXPECT_EQ(Transition::kRejected, c.kind);
  EXPECT_EQ("PAID", c.current);
  EXPECT_EQ(Transition::kNotFound, move("nope", "WAIT_PAY", "PAID").kind);
  EXPECT_EQ("PAID", status("o1"));
  auto paid_at = db_->read([](idem::sqlite::Session& s) {
    return s.query_text("SELECT paid_at FROM orders WHERE order_no = 'o1'");
  });
  EXPECT_EQ("2026-01-01", paid_at.value_or(""));
}

TEST_F(SqliteStateMachine, CompetingThreadsHaveExactlyOneWinner) {
  insert("o2", "WAIT_PAY");
  std::atomic<int> transitioned{0}, already{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&] {
      auto r = move("o2", "WAIT_PAY", "PAID");
      if (r.kind == Transition::kTransitioned) ++transitioned;
      if (r.kind == Transition::kAlreadyThere) ++already;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(1, transitioned.load());
  EXPECT_EQ(31, already.load());
}

TEST_F(SqliteStateMachine, HostileIdsAreBound) {
  for (std::string id :
       {"';DROP_TABLE_orders;--", "o'brien", "back\\slash", "?1", "'; DROP TABLE orders; --"}) {
    insert(id, "WAIT_PAY");
    EXPECT_EQ(Transition::kTransitioned, move(id, "WAIT_PAY", "PAID").kind) << id;
    EXPECT_EQ("PAID", status(id)) << id;
  }
  auto n = db_->read(
      [](idem::sqlite::Session& s) { return s.query_int64("SELECT count(*) FROM orders"); });
  EXPECT_EQ(5, n.value_or(0));
}

TEST(StateMachineUndeclared, IsRefusedWithoutAnyStatement) {
  idem::StateMachine orders{"orders", "order_no", "status", {{"WAIT_PAY", "PAID"}}};
  CountingTx tx;
  EXPECT_THROW(orders.transition(tx, "o1", "PAID", "WAIT_PAY"), idem::UsageError);
  EXPECT_THROW(orders.transition(tx, "o1", "WAIT_PAY", "SHIPPED"), idem::UsageError);
  EXPECT_THROW(orders.transition(tx, "o1", "WAIT_PAY", "PAID", {{"bad col", "1"}}),
               idem::UsageError);
  // Unquoted names ignore case: "STATUS" is the status column, "ORDER_NO" the id (they set
  // a state outside the graph, or moved the row's key); a column assigned twice is refused.
  EXPECT_THROW(orders.transition(tx, "o1", "WAIT_PAY", "PAID", {{"STATUS", "REFUNDED"}}),
               idem::UsageError);
  EXPECT_THROW(orders.transition(tx, "o1", "WAIT_PAY", "PAID", {{"Order_No", "HIJACK"}}),
               idem::UsageError);
  EXPECT_THROW(orders.transition(tx, "o1", "WAIT_PAY", "PAID", {{"note", "a"}, {"NOTE", "b"}}),
               idem::UsageError);
  EXPECT_THROW((idem::StateMachine{"orders", "id", "ID", {{"A", "B"}}}), idem::UsageError);
  EXPECT_EQ(0, tx.statements);
  EXPECT_EQ(Transition::kTransitioned, orders.transition(tx, "o1", "WAIT_PAY", "PAID").kind);
  EXPECT_EQ(1, tx.statements);
}

}  // namespace
