// SPDX-License-Identifier: MIT
// examples/flash_sale: 100 units, 2,000 users double-clicking and retrying after timeouts;
// checks from the database that nothing was oversold, doubled or answered inconsistently.
//
//   idem_flash_sale [--users N] [--stock N] [--threads N] [--db PATH] [--server-threads N]
//                   [--max-clicks N] [--timeout-ms N] [--slow-percent N]
//                   [--slow-handler-percent N] [--slow-ms N] [--reload-percent N]
//                   [--fast-loss-at-user N] [--seed N]
//                   [--postgres DSN [--redis URL] [--redis-prefix P] [--schema S]]
//                   [--mysql URI [--redis URL] [--redis-prefix P]]
//
// With --postgres the sale runs on PostgreSQL (records, orders and stock in one pqxx::work),
// with --mysql on MySQL / MariaDB (the seed table api_idempotency, orders and stock in one
// idem::mysql::Transaction), with Redis in front when --redis is given; the simulated failover
// is then a FLUSHALL of that Redis (use one of your own), or, with --redis-keep-others, a
// delete of this run's keys only.
//
// Exit status: 0 when every check passed, 1 on any violation, 2 on bad flags, 3 on an error.
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>

#include "sqlite_backend.hpp"
#ifdef FLASH_SALE_WITH_POSTGRES
#include "postgres_backend.hpp"
#endif
#ifdef FLASH_SALE_WITH_MYSQL
#include "mysql_backend.hpp"
#endif

namespace {

void usage(std::ostream& out) {
  out << "usage: idem_flash_sale [--users N] [--stock N] [--threads N] [--db PATH]\n"
         "       [--server-threads N] [--max-clicks N] [--timeout-ms N] [--slow-percent N]\n"
         "       [--slow-handler-percent N] [--slow-ms N] [--reload-percent N]\n"
         "       [--fast-loss-at-user N] [--seed N]\n"
         "       [--postgres DSN [--redis URL] [--redis-prefix P] [--redis-keep-others]\n"
         "        [--schema S]]\n"
         "       [--mysql URI [--redis URL] [--redis-prefix P] [--redis-keep-others]]\n"
         "defaults: 2000 users, 100 units, 8 client threads, db flash_sale.sqlite;\n"
         "the fast store loses its records when user stock/2 starts (-1: never);\n"
         "with --redis that is a FLUSHALL (--redis-keep-others: only this run's keys)\n";
}

long long parse_number(const std::string& flag, const char* text, long long min) {
  char* end = nullptr;
  long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || v < min) {
    throw std::invalid_argument(flag + " needs an integer >= " + std::to_string(min) +
                                ", got '" + text + "'");
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  flash_sale::Config cfg;
  std::string dsn, mysql_uri, redis, redis_prefix = "idem:", schema;
  bool keep_others = false;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string flag = argv[i];
      if (flag == "--help" || flag == "-h") {
        usage(std::cout);
        return 0;
      }
      if (flag == "--redis-keep-others") {
        keep_others = true;
        continue;
      }
      if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
      const char* v = argv[++i];
      if (flag == "--users") cfg.users = static_cast<int>(parse_number(flag, v, 1));
      else if (flag == "--stock") cfg.stock = parse_number(flag, v, 0);
      else if (flag == "--threads") cfg.threads = static_cast<int>(parse_number(flag, v, 1));
      else if (flag == "--db") cfg.db = v;
      else if (flag == "--server-threads")
        cfg.server_threads = static_cast<int>(parse_number(flag, v, 0));
      else if (flag == "--max-clicks") cfg.max_clicks = static_cast<int>(parse_number(flag, v, 1));
      else if (flag == "--timeout-ms")
        cfg.client_timeout = std::chrono::milliseconds(parse_number(flag, v, 1));
      else if (flag == "--slow-percent")
        cfg.slow_network_percent = static_cast<int>(parse_number(flag, v, 0));
      else if (flag == "--slow-handler-percent")
        cfg.slow_handler_percent = static_cast<int>(parse_number(flag, v, 0));
      else if (flag == "--slow-ms")
        cfg.slow_delay = std::chrono::milliseconds(parse_number(flag, v, 0));
      else if (flag == "--reload-percent")
        cfg.reload_percent = static_cast<int>(parse_number(flag, v, 0));
      else if (flag == "--fast-loss-at-user")
        cfg.fast_loss_at_user = static_cast<int>(parse_number(flag, v, -1));
      else if (flag == "--seed") cfg.seed = static_cast<std::uint64_t>(parse_number(flag, v, 0));
      else if (flag == "--postgres") dsn = v;
      else if (flag == "--mysql") mysql_uri = v;
      else if (flag == "--redis") redis = v;
      else if (flag == "--redis-prefix") redis_prefix = v;
      else if (flag == "--schema") schema = v;
      else throw std::invalid_argument("unknown flag " + flag);
    }
    if (!dsn.empty() && !mysql_uri.empty()) {
      throw std::invalid_argument("--postgres and --mysql: choose one");
    }
    if (dsn.empty() && !schema.empty()) throw std::invalid_argument("--schema goes with --postgres");
    if (dsn.empty() && mysql_uri.empty() && !redis.empty()) {
      throw std::invalid_argument("--redis goes with --postgres or --mysql");
    }
#ifndef FLASH_SALE_WITH_MYSQL
    if (!mysql_uri.empty()) {
      throw std::invalid_argument("--mysql needs a build with idem::mysql and idem::redis");
    }
#endif
#ifndef FLASH_SALE_WITH_POSTGRES
    if (!dsn.empty()) {
      throw std::invalid_argument("--postgres needs a build with idem::postgres and idem::redis");
    }
#endif
  } catch (const std::exception& e) {
    std::cerr << "idem_flash_sale: " << e.what() << "\n";
    usage(std::cerr);
    return 2;
  }
  try {
#ifdef FLASH_SALE_WITH_POSTGRES
    if (!dsn.empty()) {
      flash_sale::PostgresSaleOptions po;
      po.dsn = dsn;
      po.schema = schema;
      po.redis_url = redis;
      po.redis_prefix = redis_prefix;
      po.flushall = !keep_others;
      cfg.db = "postgres" + (schema.empty() ? std::string() : " schema " + schema);
      flash_sale::Report report = flash_sale::run_postgres_sale(cfg, po);
      flash_sale::print_report(report, std::cout);
      return report.ok() ? 0 : 1;
    }
#endif
#ifdef FLASH_SALE_WITH_MYSQL
    if (!mysql_uri.empty()) {
      flash_sale::MysqlSaleOptions mo;
      mo.uri = mysql_uri;
      mo.redis_url = redis;
      mo.redis_prefix = redis_prefix;
      mo.flushall = !keep_others;
      cfg.db = "mysql";
      flash_sale::Report report = flash_sale::run_mysql_sale(cfg, mo);
      flash_sale::print_report(report, std::cout);
      return report.ok() ? 0 : 1;
    }
#endif
    flash_sale::Report report = flash_sale::run_sqlite_sale(cfg);
    flash_sale::print_report(report, std::cout);
    return report.ok() ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "idem_flash_sale: " << e.what() << "\n";
    return 3;
  }
}
