// SPDX-License-Identifier: MIT
// idem::StateMachine: declared state transitions applied with one conditional UPDATE, so a
// repeated transition (a duplicate callback, a redelivered message) is harmless.
//
// File: state_machine.hpp
//
//     UPDATE <table> SET <status> = <to> [, <extra column> = <value> ...]
//      WHERE <id column> = <id> AND <status> = <from>
//
// One row changed: kTransitioned (this call did it). No row changed: the row is read once
// (in a new statement, so a transition committed by a concurrent transaction is seen) and the
// answer is kAlreadyThere (it is already in `to`: a duplicate), kRejected (it is in another
// state, returned in `current`), or kNotFound. A transition that is not in the declared graph
// is refused with idem::UsageError before any statement runs. Table and column names are
// validated identifiers; the id, the states and every extra value are bound parameters.
//
// The helper works on the transaction of any store that provides a StateMachineDriver:
// include <idem/postgres/state_machine.hpp> for pqxx transactions, or
// <idem/sqlite/state_machine.hpp> for idem::sqlite transactions and sessions.
//
// @code
//   idem::StateMachine orders{"orders", "order_no", "status",
//                             {{"WAIT_PAY", "PAID"}, {"PAID", "SHIPPED"},
//                              {"WAIT_PAY", "CANCELLED"}}};
//   switch (orders.transition(tx, order_no, "WAIT_PAY", "PAID", {{"paid_at", now}}).kind) {
//     case idem::Transition::kTransitioned:                  // first callback: do the work
//     case idem::Transition::kAlreadyThere: return success(); // duplicate callback
//     case idem::Transition::kRejected:     return conflict(); // e.g. already CANCELLED
//     case idem::Transition::kNotFound:     return not_found();
//   }
// @endcode
#pragma once

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/errors.hpp"
#include "idem/key.hpp"
#include "idem/observer.hpp"
#include "idem/sql.hpp"

namespace idem {

/// What a transition did.
enum class Transition {
  kTransitioned,  ///< the row was in `from` and is now in `to` (this call changed it)
  kAlreadyThere,  ///< the row was already in `to`: a repeated transition, nothing changed
  kRejected,      ///< the row is in another state (`current`); nothing changed
  kNotFound,      ///< no row has this id
};

/// Stable name: transitioned, already_there, rejected, not_found.
constexpr std::string_view transition_name(Transition t) noexcept {
  switch (t) {
    case Transition::kTransitioned:
      return "transitioned";
    case Transition::kAlreadyThere:
      return "already_there";
    case Transition::kRejected:
      return "rejected";
    case Transition::kNotFound:
      return "not_found";
  }
  return "unknown";
}

/// The answer of StateMachine::transition.
struct TransitionResult {
  /// transitioned, already there, rejected or not found.
  Transition kind = Transition::kTransitioned;
  /// The row's state as found: `from` for kTransitioned, `to` for kAlreadyThere, the other
  /// state for kRejected, empty for kNotFound.
  std::string current;
  /// True for kTransitioned and kAlreadyThere (the row is in the target state).
  bool ok() const noexcept {
    return kind == Transition::kTransitioned || kind == Transition::kAlreadyThere;
  }
};

/// One extra column set together with the state (e.g. {"paid_at", "2026-01-01T10:00:00Z"}).
/// The value is bound as text (the database converts it to the column's type); nullopt
/// binds NULL.
struct Assignment {
  std::string column;                ///< the column (a validated identifier)
  std::optional<std::string> value;  ///< its new value, bound as text; nullopt: NULL
};

/// Executes a state machine's statements on a transaction type `Tx`. Adapters specialise it:
///   static std::string placeholder(int n);   // "$1" (PostgreSQL), "?1" (SQLite)
///   static long long update(Tx&, const std::string& sql,
///                           const std::vector<std::optional<std::string>>& params);
///   static std::optional<std::string> current(Tx&, const std::string& sql,
///                                             const std::string& id);  // nullopt: no row
template <class Tx, class Enable = void>
struct StateMachineDriver;

/// Declared transitions over one table (see the file comment). Immutable and thread-safe.
class StateMachine {
 public:
  /// One allowed transition, from -> to.
  using Edge = std::pair<std::string, std::string>;

  /// @param table, id_column, status_column plain SQL identifiers (validated)
  /// @param transitions the allowed (from, to) pairs; states are non-empty
  /// @param observer optional: told of every kAlreadyThere as a duplicate
  ///        (DuplicateSource::kStateMachine)
  /// @throws idem::UsageError for a bad identifier, an empty state or an empty graph.
  StateMachine(std::string table, std::string id_column, std::string status_column,
               std::vector<Edge> transitions, std::shared_ptr<Observer> observer = nullptr)
      : table_(std::move(table)),
        id_column_(std::move(id_column)),
        status_column_(std::move(status_column)),
        edges_(std::move(transitions)),
        observer_(std::move(observer)) {
    check_sql_identifier("table", table_);
    check_sql_identifier("id column", id_column_);
    check_sql_identifier("status column", status_column_);
    if (same_sql_identifier(id_column_, status_column_)) {
      throw UsageError("idem::StateMachine: id and status columns must differ");
    }
    if (edges_.empty()) throw UsageError("idem::StateMachine: no transitions declared");
    for (const auto& [from, to] : edges_) {
      if (from.empty() || to.empty()) {
        throw UsageError("idem::StateMachine: states must not be empty");
      }
      if (from == to) {
        throw UsageError("idem::StateMachine: transition '" + from + "' -> '" + to +
                         "' does not change the state");
      }
    }
  }

  /// True if from -> to is declared.
  bool allows(std::string_view from, std::string_view to) const noexcept {
    return std::any_of(edges_.begin(), edges_.end(),
                       [&](const Edge& e) { return e.first == from && e.second == to; });
  }

  /// Moves row `id` from `from` to `to` with one conditional UPDATE (see the file comment).
  /// @param tx the caller's open transaction (its commit makes the change visible)
  /// @param id the row's id (bound, compared with the id column)
  /// @param from the state the row must be in
  /// @param to the state it moves to (from -> to must be declared)
  /// @param extra columns set together with the state (validated names, bound values)
  /// @throws idem::UsageError for an undeclared transition or a bad extra column (before any
  ///         statement runs); the driver's errors (idem::StorageError subclasses).
  template <class Tx>
  TransitionResult transition(Tx& tx, std::string_view id, std::string_view from,
                              std::string_view to,
                              const std::vector<Assignment>& extra = {}) const {
    using Driver = StateMachineDriver<Tx>;
    if (!allows(from, to)) {
      throw UsageError("idem::StateMachine: transition '" + std::string(from) + "' -> '" +
                       std::string(to) + "' is not declared for table '" + table_ + "'");
    }
    std::vector<std::optional<std::string>> params{std::string(id), std::string(from),
                                                   std::string(to)};
    std::string sql =
        "UPDATE " + table_ + " SET " + status_column_ + " = " + Driver::placeholder(3);
    for (std::size_t i = 0; i < extra.size(); ++i) {
      const auto& a = extra[i];
      check_sql_identifier("column", a.column);
      if (same_sql_identifier(a.column, status_column_) ||
          same_sql_identifier(a.column, id_column_)) {
        throw UsageError("idem::StateMachine: extra assignment to '" + a.column +
                         "' is not allowed");
      }
      for (std::size_t j = 0; j < i; ++j) {
        if (same_sql_identifier(a.column, extra[j].column)) {
          throw UsageError("idem::StateMachine: extra assignment to '" + a.column + "' twice");
        }
      }
      params.push_back(a.value);
      sql += ", " + a.column + " = " + Driver::placeholder(static_cast<int>(params.size()));
    }
    sql += " WHERE " + id_column_ + " = " + Driver::placeholder(1) + " AND " + status_column_ +
           " = " + Driver::placeholder(2);
    TransitionResult r;
    if (Driver::update(tx, sql, params) > 0) {
      r.kind = Transition::kTransitioned;
      r.current = std::string(from);
      return r;
    }
    auto found = Driver::current(tx,
                                 "SELECT " + status_column_ + " FROM " + table_ + " WHERE " +
                                     id_column_ + " = " + Driver::placeholder(1),
                                 std::string(id));
    if (!found) {
      r.kind = Transition::kNotFound;
      return r;
    }
    r.current = std::move(*found);
    r.kind = r.current == to ? Transition::kAlreadyThere : Transition::kRejected;
    if (r.kind == Transition::kAlreadyThere) report_duplicate(id);
    return r;
  }

  /// The table name.
  const std::string& table() const noexcept { return table_; }
  /// The declared transitions.
  const std::vector<Edge>& transitions() const noexcept { return edges_; }

 private:
  void report_duplicate(std::string_view id) const noexcept {
    if (!observer_) return;
    try {
      // The table names the scope; ids that are not valid key ids are not reported.
      Key key = Key::make(table_, id);
      observer_->on_duplicate(
          DuplicateEvent{key, Outcome::kReplayed, DuplicateSource::kStateMachine, {}, {}});
    } catch (...) {
    }
  }

  std::string table_;
  std::string id_column_;
  std::string status_column_;
  std::vector<Edge> edges_;
  std::shared_ptr<Observer> observer_;
};

}  // namespace idem
