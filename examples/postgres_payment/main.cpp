// SPDX-License-Identifier: MIT
// A payment and its order's state change, exactly once, with PostgreSQL as the backstop.
//
//   idem_example_postgres_payment "host=127.0.0.1 port=15432 user=postgres dbname=idem_test"
//
// Pays order_20001 three times (a double click and a client retry): the account is debited
// once, every call answers the same payment number, and the order moves WAIT_PAY -> PAID once.
#include <cstdio>
#include <idem/guard.hpp>
#include <idem/memory_store.hpp>
#include <idem/postgres/postgres_store.hpp>
#include <idem/postgres/state_machine.hpp>
#include <string_view>

int main(int argc, char** argv) {
  if (argc == 2 && (std::string_view(argv[1]) == "--help" || std::string_view(argv[1]) == "-h")) {
    std::printf("usage: %s <postgres conninfo or URI>\n", argv[0]);
    return 0;
  }
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <postgres conninfo or URI>\n", argv[0]);
    return 2;
  }
  try {
    idem::postgres::PostgresStore durable{argv[1]};
    durable.with_transaction([](pqxx::work& tx) {
      tx.exec("CREATE TABLE IF NOT EXISTS example_account (id text PRIMARY KEY, balance bigint)");
      tx.exec(
          "CREATE TABLE IF NOT EXISTS example_orders (order_no text PRIMARY KEY,"
          " status text NOT NULL, payment_no text)");
      tx.exec(
          "CREATE TABLE IF NOT EXISTS example_payment (id bigserial PRIMARY KEY,"
          " order_no text NOT NULL, amount bigint NOT NULL)");
      tx.exec("INSERT INTO example_account VALUES ('alice', 1000) ON CONFLICT DO NOTHING");
      tx.exec(
          "INSERT INTO example_orders VALUES ('order_20001', 'WAIT_PAY')"
          " ON CONFLICT DO NOTHING");
    });
    idem::MemoryStore fast;  // the Redis store in production
    idem::IdempotencyGuard guard{fast, durable};
    idem::StateMachine orders{
        "example_orders",
        "order_no",
        "status",
        {{"WAIT_PAY", "PAID"}, {"PAID", "SHIPPED"}, {"WAIT_PAY", "CANCELLED"}}};

    auto key = idem::Key::make("payment", "order_20001");
    for (int attempt = 1; attempt <= 3; ++attempt) {
      auto r = guard.run(key, idem::fingerprint("alice:100"), [&](pqxx::work& tx) {
        tx.exec_params("UPDATE example_account SET balance = balance - $1 WHERE id = $2", 100,
                       "alice");
        auto payment_no = tx.exec_params1(
                                "INSERT INTO example_payment (order_no, amount)"
                                " VALUES ($1, $2) RETURNING id",
                                key.id(), 100)[0]
                              .as<std::string>();
        auto t = orders.transition(tx, key.id(), "WAIT_PAY", "PAID", {{"payment_no", payment_no}});
        std::printf("  state machine: %s\n", std::string(idem::transition_name(t.kind)).c_str());
        return "pay_" + payment_no;
      });
      std::printf("attempt %d: %s %s\n", attempt,
                  std::string(idem::outcome_name(r.outcome)).c_str(),
                  r.value.value_or("-").c_str());
    }
    auto balance = durable.with_transaction([](pqxx::work& tx) {
      return tx.exec1("SELECT balance FROM example_account WHERE id = 'alice'")[0].as<long>();
    });
    std::printf("alice's balance: %ld\n", balance);
  } catch (const idem::Error& e) {
    std::fprintf(stderr, "%s (%s, retryable: %s)\n", e.what(),
                 std::string(idem::errc_name(e.code())).c_str(), e.retryable() ? "yes" : "no");
    return 1;
  }
  return 0;
}
