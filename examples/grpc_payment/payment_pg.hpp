// SPDX-License-Identifier: MIT
// examples/grpc_payment: the ledger of Payments.Charge on PostgreSQL (pqxx::work, the
// PostgresStore's transaction), in a schema of its own.
#pragma once

#include <cstdint>
#include <string>

#include "idem/postgres/postgres_store.hpp"
#include "payment_service.hpp"

namespace grpc_payment {

/// Accounts, payments and the simulated gateway in PostgreSQL, in schema `schema`.
class PostgresLedger {
 public:
  using Durable = idem::postgres::PostgresStore;
  using Tx = pqxx::work;

  /// @param schema an identifier of the caller's choosing (created if missing)
  PostgresLedger(idem::postgres::PostgresStore& store, std::string schema)
      : store_(store), schema_(std::move(schema)) {
    store_.with_transaction([&](pqxx::work& tx) {
      tx.exec("CREATE SCHEMA IF NOT EXISTS " + schema_);
      tx.exec("CREATE TABLE IF NOT EXISTS " + t("account") +
              " (id text PRIMARY KEY, balance_cents bigint NOT NULL)");
      tx.exec("CREATE TABLE IF NOT EXISTS " + t("payment") +
              " (seq bigserial PRIMARY KEY, principal text NOT NULL, client_key text NOT NULL,"
              " order_no text NOT NULL, account text NOT NULL, amount_cents bigint NOT NULL,"
              " currency text NOT NULL, balance_after bigint NOT NULL,"
              " UNIQUE (principal, client_key))");
      tx.exec(
          "CREATE TABLE IF NOT EXISTS " + t("gateway_charge") +
          " (gateway_key text PRIMARY KEY, account text NOT NULL, amount_cents bigint NOT NULL)");
    });
  }

  /// Opens accounts "acct-0000".."acct-<n-1>" with `balance` each (kept if they exist).
  void open_accounts(int n, std::int64_t balance) {
    store_.with_transaction([&](pqxx::work& tx) {
      for (int i = 0; i < n; ++i) {
        tx.exec_params("INSERT INTO " + t("account") +
                           " (id, balance_cents) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                       SqliteLedger::account(i), balance);
      }
    });
  }

  /// As SqliteLedger::charge.
  idem::grpc::Reply charge(pqxx::work& tx, const std::string& principal, const std::string& key,
                           const pb::ChargeRequest& req, pb::ChargeReply* reply) {
    pqxx::result found = tx.exec_params("SELECT seq, balance_after FROM " + t("payment") +
                                            " WHERE principal = $1 AND client_key = $2",
                                        principal, key);
    if (!found.empty()) {
      fill_reply(req, Booked{found[0][0].as<std::int64_t>(), found[0][1].as<std::int64_t>()},
                 reply);
      return ::grpc::Status::OK;
    }
    pqxx::result debited = tx.exec_params(
        "UPDATE " + t("account") +
            " SET balance_cents = balance_cents - $1 WHERE id = $2 AND balance_cents >= $1"
            " RETURNING balance_cents",
        req.amount_cents(), req.account());
    if (debited.empty()) {
      return decline(
          !tx.exec_params("SELECT 1 FROM " + t("account") + " WHERE id = $1", req.account())
               .empty());
    }
    Booked b;
    b.balance_after = debited[0][0].as<std::int64_t>();
    b.seq = tx.exec_params1("INSERT INTO " + t("payment") +
                                " (principal, client_key, order_no, account, amount_cents,"
                                " currency, balance_after) VALUES ($1, $2, $3, $4, $5, $6, $7)"
                                " RETURNING seq",
                            principal, key, req.order_no(), req.account(), req.amount_cents(),
                            req.currency(), b.balance_after)[0]
                .as<std::int64_t>();
    fill_reply(req, b, reply);
    return ::grpc::Status::OK;
  }

  /// As SqliteLedger::gateway_charge.
  void gateway_charge(const std::string& gateway_key, const pb::ChargeRequest& req) {
    store_.with_transaction([&](pqxx::work& tx) {
      tx.exec_params("INSERT INTO " + t("gateway_charge") +
                         " (gateway_key, account, amount_cents) VALUES ($1, $2, $3)"
                         " ON CONFLICT (gateway_key) DO NOTHING",
                     gateway_key, req.account(), req.amount_cents());
    });
  }

  /// As SqliteLedger::book.
  idem::grpc::Reply book(const std::string& principal, const std::string& key,
                         const pb::ChargeRequest& req, pb::ChargeReply* reply) {
    return store_.with_transaction(
        [&](pqxx::work& tx) { return charge(tx, principal, key, req, reply); });
  }

  /// As SqliteLedger::totals.
  LedgerTotals totals() {
    return store_.with_transaction([&](pqxx::work& tx) {
      LedgerTotals s;
      s.payments = tx.exec1("SELECT count(*) FROM " + t("payment"))[0].as<std::int64_t>();
      s.charged_cents = tx.exec1("SELECT coalesce(sum(amount_cents), 0) FROM " + t("payment"))[0]
                            .as<std::int64_t>();
      s.balance_cents = tx.exec1("SELECT coalesce(sum(balance_cents), 0) FROM " + t("account"))[0]
                            .as<std::int64_t>();
      s.gateway_charges =
          tx.exec1("SELECT count(*) FROM " + t("gateway_charge"))[0].as<std::int64_t>();
      for (const auto& row : tx.exec("SELECT client_key, seq FROM " + t("payment"))) {
        s.by_key[row[0].as<std::string>()] = payment_no(row[1].as<std::int64_t>());
      }
      for (const auto& row : tx.exec("SELECT gateway_key FROM " + t("gateway_charge"))) {
        auto k = row[0].as<std::string>();
        ++s.gateway_by_key[k.substr(k.find('/') + 1)];
      }
      return s;
    });
  }

 private:
  std::string t(const char* table) const { return schema_ + "." + table; }

  idem::postgres::PostgresStore& store_;
  std::string schema_;
};

}  // namespace grpc_payment
