// SPDX-License-Identifier: MIT
// One typed suite for idem::StateMachine on every database with a StateMachineDriver:
// competing transitions have one winner and every other caller sees "already there",
// rejected / not found answers, undeclared transitions refused before any statement, hostile
// ids and values bound.
//
// A Traits type provides:
//   using Tx = ...;                                        // a transaction type with a driver
//   static const char* env_var();                          // null: no server needed
//   static void exec(const std::string& sql);              // setup outside the helper
//   static long long scalar(const std::string& sql);
//   static std::string text(const std::string& sql);       // first column of the first row
//   template <class Fn> static auto in_tx(Fn&& fn);        // fn(Tx&) in a new, committed
//                                                          // transaction; many threads at once
//   static std::string orders_ddl(const std::string& t);   // (order_no text key, status text,
//                                                          //  paid_at, paid_amount bigint)
//   static std::string paid_at_value();                    // a value paid_at accepts, as text
//   static std::string quote(const std::string& v);        // v as an SQL string literal
//   static std::string status_in(Tx&, const std::string& table, const std::string& id);
//                                                          // a plain SELECT of the status in tx
//   static constexpr bool kConcurrentWriters;              // two write transactions can be
//                                                          // open at once (not SQLite)
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "idem/observer.hpp"
#include "idem/state_machine.hpp"
#include "support/test_env.hpp"

namespace idem::test {

/// Counts the state machine's duplicate events.
class StateMachineDuplicates final : public Observer {
 public:
  std::atomic<int> duplicates{0};
  void on_duplicate(const DuplicateEvent& e) noexcept override {
    if (e.source == DuplicateSource::kStateMachine) ++duplicates;
  }
};

template <class Traits>
class StateMachineConformance : public ::testing::Test {
 protected:
  using TxType = typename Traits::Tx;

  void SetUp() override {
    std::string value;
    if (Traits::env_var() != nullptr) IDEM_REQUIRE_ENV(value, Traits::env_var());
    table_ = unique_name("orders");
    Traits::exec(Traits::orders_ddl(table_));
    observer_ = std::make_shared<StateMachineDuplicates>();
  }
  void TearDown() override {
    if (!table_.empty()) Traits::exec("DROP TABLE IF EXISTS " + table_);
  }
  StateMachine machine() const {
    return StateMachine{table_,
                        "order_no",
                        "status",
                        {{"WAIT_PAY", "PAID"}, {"PAID", "SHIPPED"}, {"WAIT_PAY", "CANCELLED"}},
                        observer_};
  }
  void insert(const std::string& order_no, const std::string& status) {
    Traits::exec("INSERT INTO " + table_ + " (order_no, status) VALUES (" +
                 Traits::quote(order_no) + ", '" + status + "')");
  }
  std::string status(const std::string& order_no) {
    return Traits::text("SELECT status FROM " + table_ +
                        " WHERE order_no = " + Traits::quote(order_no));
  }

  std::string table_;
  std::shared_ptr<StateMachineDuplicates> observer_;
};

TYPED_TEST_SUITE_P(StateMachineConformance);

TYPED_TEST_P(StateMachineConformance, ThirtyTwoCompetingTransitionsHaveExactlyOneWinner) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto orders = this->machine();
  this->insert("o1", "WAIT_PAY");
  std::atomic<int> transitioned{0}, already{0}, other{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&, i] {
      while (!go.load()) std::this_thread::yield();
      try {
        TransitionResult r = TypeParam::in_tx([&](Tx& tx) {
          return orders.transition(
              tx, "o1", "WAIT_PAY", "PAID",
              {{"paid_at", TypeParam::paid_at_value()}, {"paid_amount", std::to_string(100 + i)}});
        });
        if (r.kind == Transition::kTransitioned) {
          ++transitioned;
        } else if (r.kind == Transition::kAlreadyThere) {
          ++already;
        } else {
          ++other;
        }
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
  EXPECT_EQ(31, this->observer_->duplicates.load());
  EXPECT_EQ("PAID", this->status("o1"));
  EXPECT_EQ(1, TypeParam::scalar("SELECT count(*) FROM " + this->table_ +
                                 " WHERE paid_at IS NOT NULL AND paid_amount BETWEEN 100 AND 131"));
}

// A caller whose transaction read the row before a concurrent transition committed still
// learns the current state (REPEATABLE READ snapshots must not hide it).
TYPED_TEST_P(StateMachineConformance, DuplicateAfterAnEarlierReadSeesTheCommittedState) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  if constexpr (!TypeParam::kConcurrentWriters) {
    GTEST_SKIP() << "one write transaction at a time: no transition can commit meanwhile";
  }
  auto orders = this->machine();
  this->insert("o9", "WAIT_PAY");
  std::atomic<bool> read{false}, done{false};
  std::thread late([&] {
    TransitionResult r = TypeParam::in_tx([&](Tx& tx) {
      EXPECT_EQ("WAIT_PAY", TypeParam::status_in(tx, this->table_, "o9"));  // snapshot taken
      read = true;
      while (!done.load()) std::this_thread::yield();
      return orders.transition(tx, "o9", "WAIT_PAY", "PAID");
    });
    EXPECT_EQ(Transition::kAlreadyThere, r.kind);
    EXPECT_EQ("PAID", r.current);
  });
  while (!read.load()) std::this_thread::yield();
  auto first =
      TypeParam::in_tx([&](Tx& tx) { return orders.transition(tx, "o9", "WAIT_PAY", "PAID"); });
  EXPECT_EQ(Transition::kTransitioned, first.kind);
  done = true;
  late.join();
}

TYPED_TEST_P(StateMachineConformance, RejectedNotFoundAndAlreadyThere) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto orders = this->machine();
  this->insert("o2", "CANCELLED");
  auto r =
      TypeParam::in_tx([&](Tx& tx) { return orders.transition(tx, "o2", "WAIT_PAY", "PAID"); });
  EXPECT_EQ(Transition::kRejected, r.kind);
  EXPECT_EQ("CANCELLED", r.current);
  EXPECT_FALSE(r.ok());
  auto missing =
      TypeParam::in_tx([&](Tx& tx) { return orders.transition(tx, "nope", "WAIT_PAY", "PAID"); });
  EXPECT_EQ(Transition::kNotFound, missing.kind);
  this->insert("o3", "WAIT_PAY");
  auto a =
      TypeParam::in_tx([&](Tx& tx) { return orders.transition(tx, "o3", "WAIT_PAY", "PAID"); });
  auto b = TypeParam::in_tx([&](Tx& tx) { return orders.transition(tx, "o3", "PAID", "SHIPPED"); });
  auto c = TypeParam::in_tx([&](Tx& tx) { return orders.transition(tx, "o3", "PAID", "SHIPPED"); });
  EXPECT_EQ(Transition::kTransitioned, a.kind);
  EXPECT_EQ(Transition::kTransitioned, b.kind);
  EXPECT_EQ(Transition::kAlreadyThere, c.kind);
  EXPECT_EQ("SHIPPED", this->status("o3"));
}

TYPED_TEST_P(StateMachineConformance, UndeclaredTransitionsAndBadColumnsAreRefused) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto orders = this->machine();
  this->insert("o4", "PAID");
  EXPECT_THROW(
      TypeParam::in_tx([&](Tx& tx) { return orders.transition(tx, "o4", "PAID", "WAIT_PAY"); }),
      UsageError);
  EXPECT_THROW(
      TypeParam::in_tx([&](Tx& tx) {
        return orders.transition(tx, "o4", "PAID", "SHIPPED", {{"paid_at; DROP TABLE x", "1"}});
      }),
      UsageError);
  EXPECT_EQ("PAID", this->status("o4"));
}

TYPED_TEST_P(StateMachineConformance, HostileIdsAndValuesAreBound) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto orders = this->machine();
  const std::vector<std::string> ids = {
      "';DROP_TABLE_orders;--", "o'brien", "back\\slash\\", "$1", "?1", "'; DROP TABLE x; --"};
  for (const std::string& id : ids) {
    this->insert(id, "WAIT_PAY");
    auto r = TypeParam::in_tx([&](Tx& tx) {
      return orders.transition(tx, id, "WAIT_PAY", "PAID", {{"paid_at", std::nullopt}});
    });
    EXPECT_EQ(Transition::kTransitioned, r.kind) << id;
    EXPECT_EQ("PAID", this->status(id)) << id;
  }
  EXPECT_EQ(static_cast<long long>(ids.size()),
            TypeParam::scalar("SELECT count(*) FROM " + this->table_));
}

REGISTER_TYPED_TEST_SUITE_P(StateMachineConformance,
                            ThirtyTwoCompetingTransitionsHaveExactlyOneWinner,
                            DuplicateAfterAnEarlierReadSeesTheCommittedState,
                            RejectedNotFoundAndAlreadyThere,
                            UndeclaredTransitionsAndBadColumnsAreRefused,
                            HostileIdsAndValuesAreBound);

}  // namespace idem::test
