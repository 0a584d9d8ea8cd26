// SPDX-License-Identifier: MIT
// examples/grpc_payment: Payments.Charge behind idem::grpc::Method, on a ledger (SQLite here,
// PostgreSQL in payment_pg.hpp). Shared by the example binary, its tests and bench/grpc.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "idem/grpc/method.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "payments.grpc.pb.h"

namespace grpc_payment {

namespace pb = ::idem::examples::payments::v1;

/// The full name of Payments.Charge (the scope of its keys:
/// idem.examples.payments.v1.Payments.Charge).
inline constexpr const char* kChargeMethod = "/idem.examples.payments.v1.Payments/Charge";
/// The trailer of a declined charge, stored and replayed with it.
inline constexpr const char* kDeclineTrailer = "payments-decline-code";

/// How the service runs Charge.
struct ServiceOptions {
  /// The handler sleeps this long first (inside the transaction in transactional mode), so
  /// duplicates overlap with the first attempt (tests, demo).
  std::chrono::milliseconds slow{0};
  /// >= 0: two-phase mode, the charge goes to a card gateway (simulated; it de-duplicates by
  /// the key passed to it) that takes this long, then into the books. < 0: transactional.
  std::chrono::milliseconds gateway{-1};
  /// grpc-retry-pushback-ms of "in progress" answers.
  std::chrono::milliseconds retry_pushback{100};
};

/// `authorization: Bearer <token>` as the principal (demo authentication), "" without it.
inline std::string bearer_principal(const ::grpc::ServerContextBase& context) {
  auto range = context.client_metadata().equal_range("authorization");
  for (auto it = range.first; it != range.second; ++it) {
    std::string_view v(it->second.data(), it->second.size());
    if (v.rfind("Bearer ", 0) == 0) return std::string(v.substr(7));
  }
  return {};
}

/// The call's idempotency-key (Method::handle has validated it; one entry).
inline std::string client_key(const ::grpc::ServerContextBase& context) {
  auto it = context.client_metadata().find("idempotency-key");
  return it == context.client_metadata().end() ? std::string()
                                               : std::string(it->second.data(), it->second.size());
}

/// "PAY-00000042".
inline std::string payment_no(std::int64_t seq) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "PAY-%08lld", static_cast<long long>(seq));
  return buf;
}

/// One booked payment, as a ledger reads it back.
struct Booked {
  std::int64_t seq = 0;
  std::int64_t balance_after = 0;
};

/// The reply of a booked charge.
inline void fill_reply(const pb::ChargeRequest& req, const Booked& b, pb::ChargeReply* reply) {
  reply->set_payment_no(payment_no(b.seq));
  reply->set_account(req.account());
  reply->set_amount_cents(req.amount_cents());
  reply->set_balance_cents(b.balance_after);
  reply->set_order_no(req.order_no());
  *reply->mutable_labels() = req.labels();
}

/// What a ledger holds, for the checks of the demo and the tests.
struct LedgerTotals {
  std::int64_t payments = 0;         ///< payment rows
  std::int64_t charged_cents = 0;    ///< sum of their amounts
  std::int64_t balance_cents = 0;    ///< sum of every account's balance
  std::int64_t gateway_charges = 0;  ///< charges the card gateway took (two-phase mode)
  /// client key -> payment number, every payment row.
  std::map<std::string, std::string> by_key;
  /// client key -> gateway charges under it (two-phase mode).
  std::map<std::string, std::int64_t> gateway_by_key;
};

/// The declined / unknown-account answers (final: stored and replayed).
inline idem::grpc::Reply decline(bool account_exists) {
  if (!account_exists) return ::grpc::Status(::grpc::StatusCode::NOT_FOUND, "no such account");
  return idem::grpc::Reply{
      ::grpc::Status(::grpc::StatusCode::FAILED_PRECONDITION, "insufficient funds"),
      {{kDeclineTrailer, "insufficient_funds"}}};
}

/// Accounts, payments and the simulated gateway in SQLite (the SqliteStore's database).
class SqliteLedger {
 public:
  using Durable = idem::sqlite::SqliteStore;
  using Tx = idem::sqlite::Transaction;

  explicit SqliteLedger(idem::sqlite::SqliteStore& store) : db_(store.database()) {
    db_.write([](Tx& tx) {
      tx.exec(
          "CREATE TABLE IF NOT EXISTS account (id TEXT PRIMARY KEY,"
          " balance_cents INTEGER NOT NULL)");
      tx.exec(
          "CREATE TABLE IF NOT EXISTS payment (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
          " principal TEXT NOT NULL, client_key TEXT NOT NULL, order_no TEXT NOT NULL,"
          " account TEXT NOT NULL, amount_cents INTEGER NOT NULL, currency TEXT NOT NULL,"
          " balance_after INTEGER NOT NULL, UNIQUE (principal, client_key))");
      tx.exec(
          "CREATE TABLE IF NOT EXISTS gateway_charge (gateway_key TEXT PRIMARY KEY,"
          " account TEXT NOT NULL, amount_cents INTEGER NOT NULL)");
    });
  }

  /// Opens accounts "acct-0000".."acct-<n-1>" with `balance` each (kept if they exist).
  void open_accounts(int n, std::int64_t balance) {
    db_.write([&](Tx& tx) {
      for (int i = 0; i < n; ++i) {
        tx.exec("INSERT OR IGNORE INTO account (id, balance_cents) VALUES (?, ?)", account(i),
                balance);
      }
    });
  }

  /// "acct-0007".
  static std::string account(int i) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "acct-%04d", i);
    return buf;
  }

  /// Debits and books the charge in `tx`, once per (principal, client key): a second booking
  /// under the same key returns the first (the business unique key behind the record).
  idem::grpc::Reply charge(Tx& tx, const std::string& principal, const std::string& key,
                           const pb::ChargeRequest& req, pb::ChargeReply* reply) {
    if (auto seq = tx.query_int64("SELECT seq FROM payment WHERE principal = ? AND client_key = ?",
                                  principal, key)) {
      Booked b{*seq, *tx.query_int64("SELECT balance_after FROM payment WHERE seq = ?", *seq)};
      fill_reply(req, b, reply);
      return ::grpc::Status::OK;
    }
    int changed = tx.exec(
        "UPDATE account SET balance_cents = balance_cents - ? WHERE id = ? AND balance_cents >= ?",
        req.amount_cents(), req.account(), req.amount_cents());
    if (changed == 0) {
      return decline(
          tx.query_int64("SELECT 1 FROM account WHERE id = ?", req.account()).has_value());
    }
    Booked b;
    b.balance_after =
        *tx.query_int64("SELECT balance_cents FROM account WHERE id = ?", req.account());
    tx.exec(
        "INSERT INTO payment (principal, client_key, order_no, account, amount_cents, currency,"
        " balance_after) VALUES (?, ?, ?, ?, ?, ?, ?)",
        principal, key, req.order_no(), req.account(), req.amount_cents(), req.currency(),
        b.balance_after);
    b.seq = *tx.query_int64("SELECT last_insert_rowid()");
    fill_reply(req, b, reply);
    return ::grpc::Status::OK;
  }

  /// The card gateway (simulated): takes the charge once per `gateway_key`.
  void gateway_charge(const std::string& gateway_key, const pb::ChargeRequest& req) {
    db_.write([&](Tx& tx) {
      tx.exec(
          "INSERT INTO gateway_charge (gateway_key, account, amount_cents) VALUES (?, ?, ?)"
          " ON CONFLICT (gateway_key) DO NOTHING",
          gateway_key, req.account(), req.amount_cents());
    });
  }

  /// charge() in a transaction of its own (two-phase mode).
  idem::grpc::Reply book(const std::string& principal, const std::string& key,
                         const pb::ChargeRequest& req, pb::ChargeReply* reply) {
    return db_.write([&](Tx& tx) { return charge(tx, principal, key, req, reply); });
  }

  /// Everything the checks need.
  LedgerTotals totals() {
    return db_.read([](idem::sqlite::Session& s) {
      LedgerTotals t;
      t.payments = s.query_int64("SELECT count(*) FROM payment").value_or(0);
      t.charged_cents =
          s.query_int64("SELECT coalesce(sum(amount_cents), 0) FROM payment").value_or(0);
      t.balance_cents =
          s.query_int64("SELECT coalesce(sum(balance_cents), 0) FROM account").value_or(0);
      t.gateway_charges = s.query_int64("SELECT count(*) FROM gateway_charge").value_or(0);
      auto st = s.prepare("SELECT client_key, seq FROM payment");
      while (st.step()) t.by_key[st.column_bytes(0)] = payment_no(st.column_int64(1));
      auto gw = s.prepare("SELECT gateway_key FROM gateway_charge");
      while (gw.step()) {
        std::string k = gw.column_bytes(0);
        ++t.gateway_by_key[k.substr(k.find('/') + 1)];  // "<principal>/<client key>"
      }
      return t;
    });
  }

 private:
  idem::sqlite::Database& db_;
};

/// Payments.Charge: validates the request, then runs the charge through idem::grpc::Method.
/// @tparam Ledger SqliteLedger or PostgresLedger (payment_pg.hpp)
template <class Ledger>
class PaymentService final : public pb::Payments::Service {
 public:
  using Durable = typename Ledger::Durable;

  /// The Method options Charge uses (with `pushback` as grpc-retry-pushback-ms).
  static idem::grpc::MethodOptions method_options(std::chrono::milliseconds pushback) {
    idem::grpc::MethodOptions o;
    o.method = kChargeMethod;
    o.principal = bearer_principal;
    o.replay_trailers = {kDeclineTrailer};
    o.retry_pushback = pushback;
    return o;
  }

  PaymentService(idem::IdempotencyGuard<Durable>& guard, Ledger& ledger,
                 ServiceOptions options = {})
      : ledger_(ledger),
        options_(options),
        charge_(guard, method_options(options.retry_pushback)) {}

  ::grpc::Status Charge(::grpc::ServerContext* ctx, const pb::ChargeRequest* req,
                        pb::ChargeReply* reply) override {
    // A malformed request is refused before idem sees it: nothing is stored for it.
    if (req->account().empty() || req->amount_cents() <= 0) {
      return ::grpc::Status(::grpc::StatusCode::INVALID_ARGUMENT,
                            "account and a positive amount_cents are required");
    }
    std::string principal = bearer_principal(*ctx);
    std::string key = client_key(*ctx);
    if (options_.gateway.count() >= 0) {
      // Two-phase: the gateway call runs outside any transaction; the key goes downstream so
      // the gateway de-duplicates a retry that took over after a crash.
      return charge_.handle(*ctx, *req, reply, [&]() -> idem::grpc::Reply {
        pause(options_.slow);
        pause(options_.gateway);
        ledger_.gateway_charge(principal + "/" + key, *req);
        return ledger_.book(principal, key, *req, reply);
      });
    }
    return charge_.handle(*ctx, *req, reply, [&](typename Ledger::Tx& tx) {
      pause(options_.slow);
      return ledger_.charge(tx, principal, key, *req, reply);
    });
  }

 private:
  static void pause(std::chrono::milliseconds d) {
    if (d.count() > 0) std::this_thread::sleep_for(d);
  }

  Ledger& ledger_;
  ServiceOptions options_;
  idem::grpc::Method<Durable> charge_;
};

}  // namespace grpc_payment
