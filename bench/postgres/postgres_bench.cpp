// SPDX-License-Identifier: MIT
// PostgreSQL side by side, one thread, interleaved rounds (A B B A ...), medians:
//   1. first execution: the guard (fast store + PostgresStore, transactional, one business
//      INSERT) vs hand-written libpqxx issuing the minimum statements for the same guarantee
//      (BEGIN; INSERT record ON CONFLICT DO NOTHING; business INSERT; UPDATE record; COMMIT);
//      The same first execution against the hand-written record recipe of the seed tables: ONE
//      transaction inserting a record row (unique key on the business key, status, response)
//      and the business row (BEGIN; INSERT record; business INSERT; COMMIT), a duplicate caught
//      by the unique violation and answered by reading the stored response; in the seed's table
//      shape (bigserial id + unique key) and keyed by the unique key itself (primary key).
//   2. duplicate with the fast store down (replay from PostgreSQL; the guard skips the down
//      fast store for a second after each failure, GuardOptions::fast_store_retry_after; the
//      guard that tries it on every call is timed too) vs a raw SELECT by key.
//   3. (with IDEM_TEST_REDIS_URL) first execution with Redis + PostgreSQL: the guard
//      (RedisStore claim, the same PostgreSQL transaction, RedisStore complete) vs hand-written
//      hiredis + libpqxx (SET key owner NX PX; BEGIN; INSERT record ON CONFLICT DO NOTHING;
//      business INSERT; UPDATE record; COMMIT; SET key response PX).
// Prints per-call latencies, statements and round trips per guarded call (from a libpq trace,
// and Redis's command counter), fsync/synchronous_commit, and
// `ratio <name> = <ours over baseline, higher is better>`.
//
// Env: IDEM_TEST_POSTGRES_DSN (required), IDEM_TEST_REDIS_URL (optional: part 3),
// IDEM_BENCH_ROUNDS (default 21), IDEM_BENCH_CALLS (per round and side, default 200),
// IDEM_BENCH_DROP_EXPIRY_INDEX=1 (the guard's record table without its partial expiry index:
// what that index costs a first execution; README.md).
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "../common/per_call.hpp"
#include "idem/guard.hpp"
#include "idem/memory_store.hpp"
#include "idem/postgres/postgres_store.hpp"
#ifdef IDEM_BENCH_WITH_REDIS
#include "../common/raw_redis.hpp"
#include "idem/redis/redis_store.hpp"
#endif

namespace {

using Clock = std::chrono::steady_clock;
using idem::bench::cpu_now_us;
using idem::bench::DownFastStore;
using idem::bench::env_int;
using idem::bench::timed;
#ifdef IDEM_BENCH_WITH_REDIS
using idem::bench::RawRedis;
#endif

// The fast store in front of PostgreSQL: the in-process one, or RedisStore at `redis_url`
// (under a key prefix of this run).
std::unique_ptr<idem::FastStore> make_fast_store(const std::string& redis_url = {}) {
#ifdef IDEM_BENCH_WITH_REDIS
  if (!redis_url.empty()) {
    idem::redis::RedisStoreOptions o{redis_url};
    o.key_prefix = "idem_bench_" + std::to_string(::getpid()) + ":";
    return std::make_unique<idem::redis::RedisStore>(o);
  }
#endif
  (void)redis_url;
  return std::make_unique<idem::MemoryStore>();
}

struct Trace {
  int statements = 0;   // Query + Execute messages sent
  int round_trips = 0;  // ReadyForQuery messages received (one per Sync / simple Query)
  std::vector<std::string> sent;
};

// Runs fn() with libpq tracing on `conn` and counts what went over the wire.
Trace trace(pqxx::connection& conn, const std::function<void()>& fn) {
  char path[] = "/tmp/idem_bench_trace_XXXXXX";
  int fd = ::mkstemp(path);
  std::FILE* f = ::fdopen(fd, "w");
  conn.trace(f);
  fn();
  conn.trace(nullptr);
  std::fclose(f);
  Trace t;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    // PostgreSQL 14+ libpq trace lines: "<time>\tF\t<len>\tQuery\t..." /
    // "...\tB\t5\tReadyForQuery\tI"
    std::istringstream words(line);
    std::vector<std::string> w;
    for (std::string x; std::getline(words, x, '\t');) w.push_back(x);
    if (w.size() < 4) continue;
    const std::string& dir = w[1];
    const std::string& msg = w[3];
    if (dir == "F" && (msg == "Query" || msg == "Execute")) {
      ++t.statements;
      if (msg == "Query" && w.size() > 4) t.sent.push_back(w[4]);
    }
    if (dir == "F" && msg == "Bind" && w.size() > 4) {
      // ' "" "idem_claim" 6 ...': the portal, then the prepared statement's name.
      std::istringstream fields(w[4]);
      std::string portal, name;
      fields >> portal >> name;
      t.sent.push_back("execute " + name);
    }
    if (dir == "B" && msg == "ReadyForQuery") ++t.round_trips;
  }
  ::unlink(path);
  return t;
}


}  // namespace

int main() {
  const char* dsn_env = std::getenv("IDEM_TEST_POSTGRES_DSN");
  if (dsn_env == nullptr) {
    std::cerr << "IDEM_TEST_POSTGRES_DSN is not set\n";
    return 2;
  }
  // IDEM_BENCH_ASYNC_COMMIT=1: both sides' sessions commit without waiting for the WAL flush,
  // which isolates the per-call overhead from the disk (first execution only).
  const bool async_commit = env_int("IDEM_BENCH_ASYNC_COMMIT", 0) == 1;
  const std::string dsn =
      std::string(dsn_env) + (async_commit ? " options='-c synchronous_commit=off'" : "");
  const int rounds = env_int("IDEM_BENCH_ROUNDS", 21);
  const int calls = env_int("IDEM_BENCH_CALLS", 200);
  const std::string schema = "idem_bench_" + std::to_string(::getpid());

  pqxx::connection admin(dsn);
  {
    pqxx::nontransaction nt(admin);
    std::cout << "postgres: " << nt.exec("SHOW server_version")[0][0].as<std::string>()
              << ", fsync=" << nt.exec("SHOW fsync")[0][0].as<std::string>()
              << ", synchronous_commit="
              << nt.exec("SHOW synchronous_commit")[0][0].as<std::string>() << "\n";
    nt.exec("CREATE SCHEMA " + schema);
    nt.exec("CREATE TABLE " + schema +
            ".payment (id bigserial PRIMARY KEY, order_no text NOT NULL, amount bigint NOT NULL)");
  }

  idem::postgres::PostgresStoreOptions o;
  o.conninfo = dsn;
  o.schema = schema;
  o.pool_size = 1;  // one thread; and every guarded call uses the traced connection
  idem::postgres::PostgresStore store(o);
  auto read_first_options = o;
  read_first_options.read_first = true;
  read_first_options.migrate = false;
  idem::postgres::PostgresStore store_read_first(read_first_options);
  // The baseline's record table: the same DDL, another name.
  auto raw_options = o;
  raw_options.table = "raw_idempotency";
  { idem::postgres::PostgresStore raw_table(raw_options); }

  if (env_int("IDEM_BENCH_DROP_EXPIRY_INDEX", 0) == 1) {
    pqxx::nontransaction nt(admin);
    nt.exec("DROP INDEX " + schema + ".api_idempotency_expires_idx");
    std::cout << "the record table's expiry index dropped (IDEM_BENCH_DROP_EXPIRY_INDEX=1)\n";
  }
  const std::string pay_sql =
      "INSERT INTO " + schema + ".payment (order_no, amount) VALUES ($1, $2)";
  {
    auto c = store.pool().acquire();  // the guard's connection: prepare the business statement
    c.get().prepare("bench_pay", pay_sql);
  }
  auto fast = make_fast_store();
  const char* redis_env = std::getenv("IDEM_TEST_REDIS_URL");
  const std::string redis_url = redis_env != nullptr ? redis_env : "";
  idem::IdempotencyGuard guard{*fast, store};
  DownFastStore down;
  // With the fast store down, the replay guards skip it for a second after each failure (what a
  // deployment with Redis in front sets, as bench/mysql: otherwise every call pays the failed
  // attempt, an exception here, a refused connection in production); the guard that tries it
  // on every call (the default) is timed alongside, for the record.
  idem::GuardOptions replay_options;
  replay_options.fast_store_retry_after = std::chrono::seconds(1);
  idem::IdempotencyGuard replay_guard{static_cast<idem::FastStore&>(down), store, replay_options};
  idem::IdempotencyGuard replay_guard_read_first{static_cast<idem::FastStore&>(down),
                                                 store_read_first, replay_options};
  idem::IdempotencyGuard every_call_guard{static_cast<idem::FastStore&>(down), store};

  // Hand-written baseline: the minimum statements for the same guarantee.
  pqxx::connection raw(dsn);
  const std::string rt = schema + ".raw_idempotency";
  raw.prepare("raw_claim", "INSERT INTO " + rt +
                               " (idem_key, biz_type, status, fingerprint, owner, lease_until)"
                               " VALUES ($1, $2, 'in_progress', $3, $4, now())"
                               " ON CONFLICT (idem_key, biz_type) DO NOTHING RETURNING true");
  raw.prepare("raw_pay", pay_sql);
  raw.prepare("raw_complete", "UPDATE " + rt +
                                  " SET status = 'completed', response_body = $3,"
                                  " expires_at = now() + interval '1 day', updated_at = now()"
                                  " WHERE idem_key = $1 AND biz_type = $2 AND owner = $4"
                                  " AND status = 'in_progress'");
  raw.prepare("raw_select", "SELECT status, fingerprint, response_body FROM " + rt +
                                " WHERE idem_key = $1 AND biz_type = $2");
  // The hand-written record recipe: the seed's api_idempotency with the columns the guarantee
  // needs (a surrogate id and a unique key; and, stronger, the unique key as primary key).
  pqxx::connection hw(dsn);
  {
    pqxx::nontransaction nt(admin);
    nt.exec("CREATE TABLE " + schema +
            ".hw_record (id bigserial PRIMARY KEY, idem_key text NOT NULL, biz_type text NOT NULL,"
            " status text NOT NULL, response_body bytea, UNIQUE (idem_key, biz_type))");
    nt.exec("CREATE TABLE " + schema +
            ".hw_record_pk (idem_key text NOT NULL, biz_type text NOT NULL, status text NOT NULL,"
            " response_body bytea, PRIMARY KEY (idem_key, biz_type))");
  }
  for (const char* table : {"hw_record", "hw_record_pk"}) {
    const std::string t = schema + "." + table;
    hw.prepare(std::string(table) + "_insert",
               "INSERT INTO " + t +
                   " (idem_key, biz_type, status, response_body) VALUES ($1, $2, 'COMPLETED', $3)");
    hw.prepare(std::string(table) + "_read",
               "SELECT status, response_body FROM " + t + " WHERE idem_key = $1 AND biz_type = $2");
  }
  hw.prepare("hw_pay", pay_sql);

  int seq = 0;
  std::vector<std::string> ours_keys, raw_keys;
  auto ours_first = [&](int) {
    auto key = idem::Key::make("payment", "o" + std::to_string(++seq));
    auto r = guard.run(key, "fp", [&](pqxx::work& tx) {
      tx.exec_prepared("bench_pay", key.id(), 100);
      return "pay_" + key.id();
    });
    if (r.outcome != idem::Outcome::kExecuted) throw std::runtime_error("not executed");
    ours_keys.push_back(key.id());
  };
  // The same call told its response before the handler runs (CallOptions::expected_response),
  // as the record recipe knows it: the record goes in completed at the claim. Keys "<prefix>N"
  // of `g`'s own; `likely_new`: CallOptions::likely_new too.
  auto told_first = [&](auto& g, const char* prefix, bool likely_new) {
    return [&g, &seq, prefix, likely_new](int) {
      auto key = idem::Key::make("payment", prefix + std::to_string(++seq));
      const std::string response = "pay_" + key.id();
      idem::CallOptions call;
      call.expected_response = response;
      call.likely_new = likely_new;
      auto r = g.run(key, "fp", call, [&](pqxx::work& tx) {
        tx.exec_prepared("bench_pay", key.id(), 100);
        return response;
      });
      if (r.outcome != idem::Outcome::kExecuted) throw std::runtime_error("not executed");
    };
  };
  auto known_first = told_first(guard, "k", false);
  // The recipe's own terms: the durable store alone (no fast store), told the response, and
  // told the key is likely new (CallOptions::likely_new: the recipe, too, inserts first and
  // reads only after a unique violation), so no read before the claim.
  idem::IdempotencyGuard alone_guard{store};
  auto alone_first = told_first(alone_guard, "a", true);
  auto raw_first = [&](int) {
    const std::string id = "r" + std::to_string(++seq);
    const std::string owner = idem::OwnerToken::generate().str();
    pqxx::work tx(raw);
    if (tx.exec_prepared("raw_claim", id, "payment", "fp", owner).empty()) {
      throw std::runtime_error("duplicate");
    }
    tx.exec_prepared("raw_pay", id, 100);
    tx.exec_prepared("raw_complete", id, "payment", pqxx::binarystring("pay_" + id), owner);
    tx.commit();
    raw_keys.push_back(id);
  };

  // The recipe for one request; @return the stored response of a duplicate, or nothing.
  auto hw_request = [&](const std::string& table, const std::string& id,
                        const std::string& response) -> std::optional<std::string> {
    try {
      pqxx::work tx(hw);
      tx.exec_prepared(table + "_insert", id, "payment", pqxx::binarystring(response));
      tx.exec_prepared("hw_pay", id, 100);
      tx.commit();
      return std::nullopt;
    } catch (const pqxx::unique_violation&) {
      pqxx::nontransaction nt(hw);
      auto r = nt.exec_prepared(table + "_read", id, "payment");
      if (r.empty()) throw std::runtime_error("duplicate without a record");
      return pqxx::binarystring(r[0][1]).str();
    }
  };
  auto hw_first = [&](const std::string& table) {
    return [&, table](int) {
      const std::string id = "h" + std::to_string(++seq);
      if (hw_request(table, id, "pay_" + id)) throw std::runtime_error("duplicate");
    };
  };
  auto hw_seed = hw_first("hw_record");
  auto hw_pk = hw_first("hw_record_pk");
  // Warm up (connections, prepared statements, caches); the recipe's duplicate path once.
  for (int i = 0; i < 50; ++i) {
    ours_first(i);
    known_first(i);
    alone_first(i);
    raw_first(i);
    hw_seed(i);
    hw_pk(i);
  }
  if (hw_request("hw_record", "hdup", "pay_hdup") ||
      hw_request("hw_record", "hdup", "other").value_or("") != "pay_hdup") {
    throw std::runtime_error("the recipe's duplicate did not replay");
  }
  // What one guarded first execution sends.
  // The pool has one connection; it stays open between calls, so it can be traced.
  auto pooled = [](idem::postgres::PostgresStore& s) -> pqxx::connection& {
    auto c = s.pool().acquire();
    return c.get();
  };
  Trace t = trace(pooled(store), [&] { ours_first(0); });
  Trace tk = trace(pooled(store), [&] { known_first(0); });
  Trace ta = trace(pooled(store), [&] { alone_first(0); });
  Trace traw = trace(raw, [&] { raw_first(0); });
  Trace thw = trace(hw, [&] { hw_seed(0); });

  // Rounds interleaved, the order reversed every other round; per-round ratios against the
  // recipe (their medians are the printed ratios).
  std::vector<double> ours_us, raw_us, ours_cpu, raw_cpu, hw_us, hw_pk_us, hw_cpu;
  std::vector<double> vs_hw, vs_hw_pk, untold_vs_hw, known_us, known_cpu;
  std::vector<double> alone_us, alone_cpu, alone_vs_hw, alone_vs_hw_pk;
  for (int r = 0; r < rounds; ++r) {
    double g = 0, k = 0, a = 0, h = 0, hp = 0;
    if (r % 2 == 0) {
      g = timed(calls, ours_first, &ours_cpu);
      k = timed(calls, known_first, &known_cpu);
      a = timed(calls, alone_first, &alone_cpu);
      raw_us.push_back(timed(calls, raw_first, &raw_cpu));
      h = timed(calls, hw_seed, &hw_cpu);
      hp = timed(calls, hw_pk);
    } else {
      hp = timed(calls, hw_pk);
      h = timed(calls, hw_seed, &hw_cpu);
      raw_us.push_back(timed(calls, raw_first, &raw_cpu));
      a = timed(calls, alone_first, &alone_cpu);
      k = timed(calls, known_first, &known_cpu);
      g = timed(calls, ours_first, &ours_cpu);
    }
    ours_us.push_back(g);
    known_us.push_back(k);
    alone_us.push_back(a);
    hw_us.push_back(h);
    hw_pk_us.push_back(hp);
    vs_hw.push_back(h / k);
    vs_hw_pk.push_back(hp / k);
    alone_vs_hw.push_back(h / a);
    alone_vs_hw_pk.push_back(hp / a);
    untold_vs_hw.push_back(h / g);
  }
  const double ours_first_us = idem::bench::median_of(ours_us), raw_first_us = idem::bench::median_of(raw_us);
  // The recipe inserts its record completed before the business row: it knows the response
  // beforehand. The guard is told it too (the named ratios); not told, it writes the record in
  // progress and completes it after the handler (printed as ..._response_after_handler). The
  // recipe has no fast store and assumes the key new: the guard on those terms too (the
  // durable store alone, told the response and likely_new) is printed as ..._durable_alone_....
  auto print_recipe = [&](const char* suffix) {
    std::printf(
        "first execution against the hand-written record recipe (synchronous_commit=%s):\n"
        "  guard, durable store alone, told the response and likely_new"
        " %8.1f us/call  (%d statements, %d round trips)\n"
        "  guard told the response (fast store '%s') %8.1f us/call  (%d statements, %d round"
        " trips)\n"
        "  guard not told the response              %8.1f us/call  (%d statements, %d round"
        " trips)\n"
        "  recipe, seed table (id + unique key)     %8.1f us/call  (%d statements, %d round"
        " trips)\n"
        "  recipe, unique key as primary key        %8.1f us/call\n"
        "  driver CPU per call: guard alone %.1f us, told %.1f us, not told %.1f us,"
        " recipe %.1f us\n",
        async_commit ? "off" : "on", idem::bench::median_of(alone_us), ta.statements,
        ta.round_trips, std::string(fast->name()).c_str(), idem::bench::median_of(known_us),
        tk.statements, tk.round_trips, ours_first_us, t.statements, t.round_trips,
        idem::bench::median_of(hw_us), thw.statements, thw.round_trips,
        idem::bench::median_of(hw_pk_us), idem::bench::median_of(alone_cpu),
        idem::bench::median_of(known_cpu), idem::bench::median_of(ours_cpu),
        idem::bench::median_of(hw_cpu));
    std::printf("ratio postgres_first_execution_vs_handwritten_record%s = %.3f\n", suffix,
                idem::bench::median_of(vs_hw));
    std::printf("ratio postgres_first_execution_vs_handwritten_record_primary_key%s = %.3f\n",
                suffix, idem::bench::median_of(vs_hw_pk));
    std::printf("ratio postgres_first_execution_durable_alone_vs_handwritten_record%s = %.3f\n",
                suffix, idem::bench::median_of(alone_vs_hw));
    std::printf(
        "ratio postgres_first_execution_durable_alone_vs_handwritten_record_primary_key%s = "
        "%.3f\n",
        suffix, idem::bench::median_of(alone_vs_hw_pk));
    std::printf(
        "ratio postgres_first_execution_response_after_handler_vs_handwritten_record%s = %.3f\n",
        suffix, idem::bench::median_of(untold_vs_hw));
  };

#ifdef IDEM_BENCH_WITH_REDIS
  // --- 3. first execution with Redis + PostgreSQL ---------------------------------------------
  if (!redis_url.empty()) {
    auto redis_fast = make_fast_store(redis_url);
    idem::IdempotencyGuard redis_guard{*redis_fast, store};
    RawRedis rr(redis_url), counter(redis_url);
    const std::string raw_prefix = "idem_bench_raw_" + std::to_string(::getpid()) + ":";
    auto ours_redis = [&](int) {
      auto key = idem::Key::make("payment", "q" + std::to_string(++seq));
      auto r = redis_guard.run(key, "fp", [&](pqxx::work& tx) {
        tx.exec_prepared("bench_pay", key.id(), 100);
        return "pay_" + key.id();
      });
      if (r.outcome != idem::Outcome::kExecuted) throw std::runtime_error("not executed");
    };
    auto raw_redis = [&](int) {
      const std::string id = "s" + std::to_string(++seq);
      const std::string owner = idem::OwnerToken::generate().str();
      const std::string rkey = raw_prefix + "{payment|" + id + "}";
      // Claim in Redis (an in-flight or completed duplicate stops here) ...
      if (!rr.command({"SET", rkey, "p:" + owner, "NX", "PX", "30000"})) {
        throw std::runtime_error("duplicate");
      }
      // ... the durable record and the business row in one transaction ...
      pqxx::work tx(raw);
      if (tx.exec_prepared("raw_claim", id, "payment", "fp", owner).empty()) {
        throw std::runtime_error("duplicate");
      }
      tx.exec_prepared("raw_pay", id, 100);
      tx.exec_prepared("raw_complete", id, "payment", pqxx::binarystring("pay_" + id), owner);
      tx.commit();
      // ... and the response in Redis for the duplicates (unconditional: PostgreSQL fences).
      rr.command({"SET", rkey, "d:pay_" + id, "PX", "86400000"});
    };
    for (int i = 0; i < 50; ++i) {
      ours_redis(i);
      raw_redis(i);
    }
    auto redis_commands = [&](const std::function<void(int)>& fn) {
      long long before = counter.commands_processed();
      fn(0);
      // The second INFO counts the first one: subtract it.
      return counter.commands_processed() - before - 1;
    };
    long long ours_cmds = redis_commands(ours_redis), raw_cmds = redis_commands(raw_redis);
    Trace tr = trace(pooled(store), [&] { ours_redis(0); });
    Trace trr = trace(raw, [&] { raw_redis(0); });
    std::vector<double> a_us, b_us, a_cpu, b_cpu;
    for (int r = 0; r < rounds; ++r) {
      if (r % 2 == 0) {
        a_us.push_back(timed(calls, ours_redis, &a_cpu));
        b_us.push_back(timed(calls, raw_redis, &b_cpu));
      } else {
        b_us.push_back(timed(calls, raw_redis, &b_cpu));
        a_us.push_back(timed(calls, ours_redis, &a_cpu));
      }
    }
    std::printf(
        "first execution with Redis + PostgreSQL (synchronous_commit=%s, rounds=%d, "
        "calls/round/side=%d):\n",
        async_commit ? "off" : "on", rounds, calls);
    std::printf("  guard (RedisStore + PostgresStore)  %8.1f us/call  %7.0f calls/s\n",
                idem::bench::median_of(a_us), 1e6 / idem::bench::median_of(a_us));
    std::printf("  hand-written hiredis + libpqxx      %8.1f us/call  %7.0f calls/s\n",
                idem::bench::median_of(b_us), 1e6 / idem::bench::median_of(b_us));
    std::printf("  driver CPU per call: guard %.1f us, hand-written %.1f us\n", idem::bench::median_of(a_cpu),
                idem::bench::median_of(b_cpu));
    // Redis's counter includes the commands a script runs: RedisStore's complete is one
    // EVALSHA round trip that runs one SET inside, so guard round trips = commands - 1.
    std::printf(
        "  per call: guard %lld Redis commands executed (2 round trips: SET NX GET, "
        "EVALSHA running SET XX) + %d PostgreSQL round trips (%d statements); "
        "hand-written %lld Redis round trips (SET NX, SET) + %d PostgreSQL round trips "
        "(%d statements)\n",
        ours_cmds, tr.round_trips, tr.statements, raw_cmds, trr.round_trips, trr.statements);
    std::printf("ratio postgres_redis_first_execution%s = %.3f\n",
                async_commit ? "_async_commit" : "", idem::bench::median_of(b_us) / idem::bench::median_of(a_us));
  }
#else
  if (!redis_url.empty()) std::printf("(Redis comparison skipped: built without idem::redis)\n");
#endif

  if (async_commit || env_int("IDEM_BENCH_ONLY_FIRST", 0) == 1) {
    std::printf(
        "first execution, synchronous_commit=%s: guard %.1f us/call, hand-written %.1f"
        " us/call; driver CPU %.1f vs %.1f us\n",
        async_commit ? "off" : "on", idem::bench::median_of(ours_us), idem::bench::median_of(raw_us), idem::bench::median_of(ours_cpu),
        idem::bench::median_of(raw_cpu));
    std::printf("ratio postgres_first_execution%s = %.3f\n", async_commit ? "_async_commit" : "",
                idem::bench::median_of(raw_us) / idem::bench::median_of(ours_us));
    print_recipe(async_commit ? "_async_commit" : "");
    pqxx::nontransaction nt(admin);
    nt.exec("DROP SCHEMA " + schema + " CASCADE");
    return 0;
  }
  // Replays: the fast store is down, every call goes to PostgreSQL for a completed key.
  auto ours_replay = [&](auto& g) {
    return [&g, &ours_keys](int i) {
      auto key =
          idem::Key::make("payment", ours_keys[static_cast<std::size_t>(i) % ours_keys.size()]);
      auto r =
          g.run(key, "fp", [](pqxx::work&) -> std::string { throw std::runtime_error("ran"); });
      if (r.outcome != idem::Outcome::kReplayed) throw std::runtime_error("not replayed");
    };
  };
  auto raw_replay = [&](int i) {
    pqxx::nontransaction nt(raw);
    auto res = nt.exec_prepared("raw_select",
                                raw_keys[static_cast<std::size_t>(i) % raw_keys.size()], "payment");
    if (res.empty()) throw std::runtime_error("missing");
  };
  auto replay_default = ours_replay(replay_guard);
  auto replay_read_first = ours_replay(replay_guard_read_first);
  auto replay_every_call = ours_replay(every_call_guard);
  replay_default(0);  // first use of the read statement on this connection (lazy prepare)
  Trace treplay = trace(pooled(store), [&] { replay_default(0); });
  replay_read_first(0);  // opens store_read_first's connection
  Trace treplay_rf = trace(pooled(store_read_first), [&] { replay_read_first(0); });
  std::vector<double> rep_us, rep_rf_us, rep_ec_us, sel_us;
  for (int r = 0; r < rounds; ++r) {
    if (r % 2 == 0) {
      rep_us.push_back(timed(calls, replay_default));
      rep_rf_us.push_back(timed(calls, replay_read_first));
      rep_ec_us.push_back(timed(calls, replay_every_call));
      sel_us.push_back(timed(calls, raw_replay));
    } else {
      sel_us.push_back(timed(calls, raw_replay));
      rep_ec_us.push_back(timed(calls, replay_every_call));
      rep_rf_us.push_back(timed(calls, replay_read_first));
      rep_us.push_back(timed(calls, replay_default));
    }
  }
  const double rep = idem::bench::median_of(rep_us), rep_rf = idem::bench::median_of(rep_rf_us),
               rep_ec = idem::bench::median_of(rep_ec_us), sel = idem::bench::median_of(sel_us);

  std::printf("rounds=%d calls/round/side=%d (medians of per-round means)\n", rounds, calls);
  std::printf("first execution, one business INSERT, fast store '%s' in front:\n",
              std::string(fast->name()).c_str());
  std::printf("  guard (transactional)     %8.1f us/call  %7.0f calls/s\n", ours_first_us,
              1e6 / ours_first_us);
  std::printf("  hand-written libpqxx      %8.1f us/call  %7.0f calls/s\n", raw_first_us,
              1e6 / raw_first_us);
  std::printf("  driver CPU per call: guard %.1f us, hand-written %.1f us\n", idem::bench::median_of(ours_cpu),
              idem::bench::median_of(raw_cpu));
  std::printf("  guarded call on the wire: %d statements, %d round trips (baseline: %d, %d)\n",
              t.statements, t.round_trips, traw.statements, traw.round_trips);
  for (const auto& s : t.sent) std::printf("    %s\n", s.c_str());
  std::printf("duplicate, fast store down (replay from PostgreSQL):\n");
  std::printf("  guard replay (default)    %8.1f us/call  (%d statements, %d round trips)\n", rep,
              treplay.statements, treplay.round_trips);
  std::printf("  guard replay (read_first) %8.1f us/call  (%d statements, %d round trips)\n",
              rep_rf, treplay_rf.statements, treplay_rf.round_trips);
  std::printf("  (guard trying the down fast store on every call, the default: %.1f us/call)\n",
              rep_ec);
  std::printf("  raw SELECT by key         %8.1f us/call  (1 statement, 1 round trip)\n", sel);
  std::printf("ratio postgres_first_execution = %.3f\n", raw_first_us / ours_first_us);
  print_recipe("");
  std::printf("ratio postgres_replay_vs_select = %.3f\n", sel / rep);
  std::printf("ratio postgres_replay_read_first_vs_select = %.3f\n", sel / rep_rf);
  std::printf("ratio postgres_replay_every_call_vs_select = %.3f\n", sel / rep_ec);

  pqxx::nontransaction nt(admin);
  nt.exec("DROP SCHEMA " + schema + " CASCADE");
  return 0;
}
