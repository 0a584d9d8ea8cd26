// SPDX-License-Identifier: MIT
// idemctl: look at and maintain idempotency records (see docs/idemctl.md).
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "idem/http/idempotency_key.hpp"
#include "idem/log.hpp"
#include "idem/version.hpp"
#include "idemctl.hpp"
#ifdef IDEMCTL_WITH_POSTGRES
#include "idemctl_postgres.hpp"
#endif
#ifdef IDEMCTL_WITH_MYSQL
#include "idemctl_mysql.hpp"
#endif

namespace {

constexpr const char* kUsage =
    "usage: idemctl [options] <command> [arguments]\n"
    "\n"
    "commands:\n"
    "  show <scope> <id>            print the record from each store, side by side\n"
    "                               (exit 1 when no store has it; `show -- <scope> <id>`,\n"
    "                               as for every per-key command, for a scope or id that\n"
    "                               starts with --)\n"
    "  stats                        count records by status\n"
    "  purge --older-than <dur>     delete completed/failed records last updated more than\n"
    "        [--dry-run]            <dur> ago (7d, 12h, 30m, 45s, 2w, 1d12h); in-progress\n"
    "                               records are never deleted\n"
    "  purge --expired              delete records whose retention ended\n"
    "  response <scope> <id> [--raw] print the stored response of a completed (or failed)\n"
    "                               record, non-printable bytes escaped (\\n, \\xHH);\n"
    "                               --raw: the bytes as stored\n"
    "  release <scope> <id> --owner T [--yes]\n"
    "                               remove a stuck in-progress record held by owner T (the\n"
    "                               owner `show` prints) with the store's owner-fenced release;\n"
    "                               without --yes: say what would be released, change nothing\n"
    "  duplicates <scope> <id>      what the stores count of a key's duplicates\n"
    "  duplicates [--top N]         records that more than one attempt held, most first\n"
    "  duplicates --log FILE [--top N]\n"
    "                               count `idem duplicate` log lines per key (FILE or -)\n"
    "  key --scope S --principal P --method M --route R --key K\n"
    "                               print the idem key an HTTP request is stored under\n"
    "\n"
    "options:\n"
    "  --db DB          SQLite file, or PostgreSQL: a postgresql:// URI or a libpq\n"
    "                   conninfo string (\"host=... dbname=...\"), or MySQL / MariaDB:\n"
    "                   a mysql:// URI (env IDEMCTL_DB)\n"
    "  --mysql URI      the same as --db mysql://user:pass@host:port/database\n"
    "  --table NAME     record table (default api_idempotency)\n"
    "  --schema NAME    PostgreSQL: the table's schema (default public)\n"
    "  --mq             the MQ consume record table (mq_consume_record)\n"
    "  --fast URL       also read the fast store at URL (redis://host:port[/db]) in the\n"
    "                   per-key commands (show, response, release, duplicates <scope> <id>)\n"
    "  --fast-prefix P  the fast store's key prefix (default idem:)\n"
    "  --version        print idem's version\n"
    "  -h, --help       this text\n"
    "\n"
    "exit status: 0 ok, 1 record not found, 2 bad arguments, 3 store unreachable or failing,\n"
    "             4 refused (the record's state or owner does not allow it), 5 release\n"
    "             without --yes (nothing changed)\n";

// Exit statuses (docs/idemctl.md).
constexpr int kNotFound = 1;
constexpr int kRefused = 4;
constexpr int kNeedsYes = 5;

struct Args {
  std::string db;
  std::string table;
  std::string schema;  // PostgreSQL only
  bool mq = false;
  std::string fast_url;
  std::string fast_prefix = "idem:";
  std::vector<std::string> rest;
  // The per-key command's `--` (taken out of `rest`): its scope and id are taken as they are,
  // even when they start with "--".
  bool key_after_dashes = false;
};

std::string take_value(const std::vector<std::string>& argv, std::size_t& i) {
  if (i + 1 >= argv.size()) throw idemctl::UsageError(argv[i] + " needs a value");
  return argv[++i];
}

Args parse_global(const std::vector<std::string>& argv) {
  Args a;
  if (const char* env = std::getenv("IDEMCTL_DB")) a.db = env;
  std::size_t i = 0;
  for (; i < argv.size(); ++i) {
    const std::string& s = argv[i];
    if (s == "--db") {
      a.db = take_value(argv, i);
    } else if (s == "--mysql") {
      a.db = take_value(argv, i);
      if (a.db.find("://") == std::string::npos) a.db = "mysql://" + a.db;
    } else if (s == "--table") {
      a.table = take_value(argv, i);
    } else if (s == "--schema") {
      a.schema = take_value(argv, i);
    } else if (s == "--mq") {
      a.mq = true;
    } else if (s == "--fast" || s == "--redis") {
      a.fast_url = take_value(argv, i);
    } else if (s == "--fast-prefix") {
      a.fast_prefix = take_value(argv, i);
    } else if (!s.empty() && s[0] == '-' && s != "-h" && s != "--help" && s != "--version") {
      throw idemctl::UsageError("unknown option '" + s + "'");
    } else {
      break;
    }
  }
  a.rest.assign(argv.begin() + static_cast<std::ptrdiff_t>(i), argv.end());
  return a;
}

idem::sqlite::SqliteStoreOptions store_options(const Args& a) {
  auto o = a.mq ? idem::sqlite::SqliteStoreOptions::mq_consume_record()
                : idem::sqlite::SqliteStoreOptions{};
  if (!a.table.empty()) o.table = a.table;
  return o;
}

// The durable store named by --db: MySQL for a mysql:// URI, PostgreSQL for a URI or
// conninfo, else an SQLite file. Each is a RecordSource and an Admin.
std::unique_ptr<idemctl::RecordSource> open_durable(const Args& a) {
  // First: a mysql:// URI may carry '=' in its query, which would look like a conninfo.
#ifdef IDEMCTL_WITH_MYSQL
  if (idemctl::is_mysql_uri(a.db)) {
    auto o = a.mq ? idem::mysql::MysqlStoreOptions::mq_consume_record(a.db)
                  : idem::mysql::MysqlStoreOptions{};
    o.uri = a.db;
    if (!a.table.empty()) o.table = a.table;
    if (!a.schema.empty()) {
      throw idemctl::UsageError(
          "--schema names a PostgreSQL schema; a MySQL table is in the "
          "URI's database");
    }
    return std::make_unique<idemctl::MysqlSource>(std::move(o));
  }
#else
  if (a.db.rfind("mysql://", 0) == 0 || a.db.rfind("mariadb://", 0) == 0) {
    throw idemctl::StoreError("cannot open " + idemctl::redact_refused_dsn(a.db) +
                              ": this idemctl was built without MySQL (idem::mysql)");
  }
#endif
#ifdef IDEMCTL_WITH_POSTGRES
  if (idemctl::is_postgres_dsn(a.db)) {
    auto o = a.mq ? idem::postgres::PostgresStoreOptions::mq_consume_record(a.db)
                  : idem::postgres::PostgresStoreOptions{};
    o.conninfo = a.db;
    if (!a.table.empty()) o.table = a.table;
    if (!a.schema.empty()) o.schema = a.schema;
    return std::make_unique<idemctl::PostgresSource>(std::move(o));
  }
#else
  if (a.db.rfind("postgresql://", 0) == 0 || a.db.rfind("postgres://", 0) == 0) {
    throw idemctl::StoreError("cannot open " + idemctl::redact_refused_dsn(a.db) +
                              ": this idemctl was built without PostgreSQL (idem::postgres)");
  }
#endif
  if (const std::string scheme = idemctl::uri_scheme(a.db);
      !scheme.empty() && std::isspace(static_cast<unsigned char>(a.db.front())) != 0) {
    throw idemctl::UsageError("--db '" + idemctl::redact_refused_dsn(a.db) +
                              "' starts with white space");
  }
  if (const std::string scheme = idemctl::uri_scheme(a.db); !scheme.empty() && scheme != "file") {
    throw idemctl::UsageError("--db '" + idemctl::redact_refused_dsn(a.db) +
                              "': no store for the scheme '" + scheme +
                              "' (idemctl opens postgresql://, postgres://, mysql:// and "
                              "mariadb:// URIs, a libpq conninfo, or a SQLite file)");
  }
  if (!a.schema.empty()) {
    throw idemctl::UsageError("--schema names a PostgreSQL schema; " + idemctl::redact_dsn(a.db) +
                              " is not a PostgreSQL database");
  }
  const bool writes = !a.rest.empty() && (a.rest[0] == "release" || a.rest[0] == "purge");
  return std::make_unique<idemctl::SqliteSource>(a.db, store_options(a), !writes);
}

// The record table as the headers print it: schema-qualified when --schema named one.
std::string table_name(const Args& a) {
  const std::string table = store_options(a).table;
  return a.schema.empty() ? table : a.schema + "." + table;
}

idemctl::Admin& admin_of(idemctl::RecordSource& src) { return dynamic_cast<idemctl::Admin&>(src); }

std::string when(idem::TimePoint t) { return idem::log::format_time(t); }

using Sources = std::vector<std::unique_ptr<idemctl::RecordSource>>;

// The key of a per-key command: `<command> <scope> <id>` at a.rest[0..2].
idem::Key key_argument(const Args& a) {
  auto option = [&](const std::string& s) { return !a.key_after_dashes && s.rfind("--", 0) == 0; };
  if (a.rest.size() < 3 || option(a.rest[1]) || option(a.rest[2])) {
    throw idemctl::UsageError(a.rest[0] + " needs <scope> <id>");
  }
  try {
    return idem::Key::make(a.rest[1], a.rest[2]);
  } catch (const idem::InvalidKey& e) {
    throw idemctl::UsageError(e.what());
  }
}

// The stores a per-key command reads, in column order: the durable store (--db), then the
// fast store (--fast).
// A service with a fast store only (IdempotencyGuard over a FastStore) is read with --fast alone.
Sources open_sources(const Args& a) {
  if (a.db.empty() && a.fast_url.empty()) {
    throw idemctl::UsageError("no store: pass --db DB (or set IDEMCTL_DB) and/or --fast URL");
  }
  Sources sources;
  if (!a.db.empty()) sources.push_back(open_durable(a));
  if (!a.fast_url.empty()) sources.push_back(idemctl::open_fast_source(a.fast_url, a.fast_prefix));
  return sources;
}

// "sqlite:a.sqlite, redis:redis://..." for messages.
std::string names_of(const Sources& sources) {
  std::string out;
  for (const auto& s : sources) out += (out.empty() ? "" : ", ") + s->name();
  return out;
}

// Prints `key`, then one row per field and one column per store (the last column unpadded).
void print_columns(const idem::Key& key, const Sources& sources,
                   const std::vector<std::string>& fields,
                   const std::vector<std::vector<std::string>>& columns) {
  std::size_t width = 34;
  for (auto& src : sources) width = std::max(width, src->name().size() + 2);
  for (auto& c : columns) {
    for (auto& v : c) width = std::max(width, v.size() + 2);
  }
  std::cout << "key " << key.str() << "\n";
  auto row = [&](const std::string& title, auto&& cell) {
    std::cout << std::left << std::setw(13) << title;
    for (std::size_t i = 0; i < sources.size(); ++i) {
      std::string v = cell(i);
      if (i + 1 < sources.size()) v.resize(std::max(v.size(), width), ' ');
      std::cout << v;
    }
    std::cout << "\n";
  };
  row("", [&](std::size_t i) { return sources[i]->name(); });
  for (std::size_t f = 0; f < fields.size(); ++f) {
    row(fields[f], [&](std::size_t i) { return f < columns[i].size() ? columns[i][f] : ""; });
  }
}

int cmd_show(const Args& a) {
  if (a.rest.size() != 3) throw idemctl::UsageError("show needs <scope> <id>");
  idem::Key key = key_argument(a);
  Sources sources = open_sources(a);

  std::vector<std::string> fields = {"status",    "owner",      "lease_until", "first_seen",
                                     "last_seen", "expires_at", "fingerprint", "response"};
  std::vector<std::vector<std::string>> columns;
  bool found = false;
  for (auto& src : sources) {
    std::vector<std::string> col;
    auto r = src->lookup(key);
    if (!r) {
      col.assign(fields.size(), "");
      col[0] = "(absent)";
    } else {
      found = true;
      col = {std::string(idem::record_status_name(r->status)),
             idemctl::escape_bytes(r->owner),
             r->status == idem::Record::Status::kInProgress ? when(r->lease_until) : "-",
             when(r->created_at),
             when(r->updated_at),
             r->status == idem::Record::Status::kInProgress
                 ? "-"
                 : when(r->expires_at) +
                       (r->expires_at != idem::TimePoint{} && r->expires_at <= idem::system_now()
                            ? " (expired)"
                            : ""),
             r->fingerprint.empty() ? "-" : idemctl::escape_bytes(r->fingerprint),
             std::to_string(r->response.size()) + " bytes"};
      for (auto& [name, value] : src->extra(key)) {
        if (columns.empty() && std::find(fields.begin(), fields.end(), name) == fields.end()) {
          fields.push_back(name);
        }
        col.push_back(value);
      }
    }
    columns.push_back(std::move(col));
  }
  print_columns(key, sources, fields, columns);
  return found ? 0 : kNotFound;
}

bool finished(const idem::Record& r) { return r.status != idem::Record::Status::kInProgress; }

// `response <scope> <id> [--raw]`: the response bytes of the first store (durable, then fast)
// that holds the record finished; escaped unless --raw.
int cmd_response(const Args& a) {
  idem::Key key = key_argument(a);
  bool raw = false;
  for (std::size_t i = 3; i < a.rest.size(); ++i) {
    if (a.rest[i] != "--raw") {
      throw idemctl::UsageError("unknown response argument '" + a.rest[i] + "'");
    }
    raw = true;
  }
  Sources sources = open_sources(a);
  std::optional<idem::Record> in_progress;
  std::string in_progress_at;
  for (auto& src : sources) {
    auto r = src->lookup(key);
    if (!r) continue;
    if (!finished(*r)) {
      if (!in_progress) in_progress_at = src->name();
      if (!in_progress) in_progress = std::move(r);
      continue;
    }
    if (r->status == idem::Record::Status::kFailed) {
      std::cerr << "idemctl: " << key.str() << " failed in " << src->name()
                << ": its stored response is the failure reason\n";
    }
    if (raw) {
      std::cout.write(r->response.data(), static_cast<std::streamsize>(r->response.size()));
    } else {
      std::cout << idemctl::escape_bytes(r->response) << "\n";
    }
    return std::cout.flush() ? 0 : 3;
  }
  if (in_progress) {
    std::cerr << "idemctl: " << key.str() << " is in progress in " << in_progress_at << " (owner "
              << in_progress->owner << ", lease until " << when(in_progress->lease_until)
              << "): no response is stored yet\n";
    return kRefused;
  }
  std::cerr << "idemctl: no record of " << key.str() << " in " << names_of(sources) << "\n";
  return kNotFound;
}

// `release <scope> <id> --owner T [--yes]`: the owner-fenced release of a stuck in-progress
// record in every store where owner T holds it. Refuses finished records and other owners.
int cmd_release(const Args& a) {
  idem::Key key = key_argument(a);
  std::string owner;
  bool yes = false;
  for (std::size_t i = 3; i < a.rest.size(); ++i) {
    const auto& s = a.rest[i];
    if (s == "--owner") {
      owner = take_value(a.rest, i);
      if (owner.empty()) throw idemctl::UsageError("--owner needs a token");
    } else if (s == "--yes") {
      yes = true;
    } else {
      throw idemctl::UsageError("unknown release argument '" + s + "'");
    }
  }
  Sources sources = open_sources(a);
  struct Found {
    idemctl::RecordSource* src;
    idem::Record record;
  };
  std::vector<Found> found;
  for (auto& src : sources) {
    if (auto r = src->lookup(key)) found.push_back({src.get(), std::move(*r)});
  }
  const std::string k = key.str();
  if (found.empty()) {
    std::cerr << "idemctl: no record of " << k << " in " << names_of(sources)
              << ": nothing to release\n";
    return kNotFound;
  }
  // Finished records are never released; an in-progress claim next to one (a fast claim whose
  // attempt committed the durable record, then died) may be: duplicates then replay the record.
  std::vector<const Found*> held;
  for (const auto& f : found) {
    if (!finished(f.record)) {
      held.push_back(&f);
      continue;
    }
    std::cout << k << " " << idem::record_status_name(f.record.status) << " in " << f.src->name()
              << ": left as it is (release never removes a finished record)\n";
  }
  if (held.empty()) {
    std::cerr << "idemctl: " << k << " is " << idem::record_status_name(found.front().record.status)
              << " in " << found.front().src->name()
              << ": refusing to release a finished record (release only removes a stuck "
                 "in-progress claim; finished records go with purge)\n";
    return kRefused;
  }
  const auto now = idem::system_now();
  for (const auto* f : held) {
    std::cout << k << " in progress in " << f->src->name() << ": owner " << f->record.owner
              << ", lease until " << when(f->record.lease_until)
              << (f->record.lease_until > now ? " (live)" : " (expired)") << "\n";
  }
  if (owner.empty()) {
    std::cerr << "idemctl: release needs --owner <token>: the owner of the attempt to release "
                 "(shown above), so that only that attempt's claim is removed\n";
    return kRefused;
  }
  std::vector<const Found*> mine;
  for (const auto* f : held) {
    if (f->record.owner == owner) {
      mine.push_back(f);
    } else {
      std::cout << "left as it is in " << f->src->name() << ": held by another owner ("
                << f->record.owner << ")\n";
    }
  }
  if (mine.empty()) {
    std::cerr << "idemctl: owner " << owner << " does not hold " << k << ": nothing released\n";
    return kRefused;
  }
  for (const auto* f : mine) {
    if (f->record.lease_until > now) {
      std::cout << "warning: the lease in " << f->src->name() << " is live until "
                << when(f->record.lease_until)
                << ": if that attempt is still running, releasing lets a retry run the "
                   "operation a second time\n";
    }
  }
  const auto token = idem::OwnerToken::from_string(owner);
  if (!yes) {
    for (const auto* f : mine) {
      std::cout << "would release " << k << " (owner " << owner << ") in " << f->src->name()
                << "\n";
    }
    std::cout << "nothing changed: run again with --yes to release\n";
    return kNeedsYes;
  }
  int status = 0;
  for (const auto* f : mine) {
    if (f->src->release(key, token)) {
      std::cout << "released " << k << " (owner " << owner << ") in " << f->src->name() << "\n";
    } else {
      std::cerr << "idemctl: not released in " << f->src->name()
                << ": the record changed since it was read (completed, taken over or released "
                   "by its attempt)\n";
      status = kRefused;
    }
  }
  return status;
}

constexpr const char* kNotCounted = "not recorded";

// "1 record", "2 records".
std::string counted(std::size_t n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

// `duplicates <scope> <id>`: what each store counts of the key's duplicates.
int duplicates_of_key(const Args& a) {
  idem::Key key = key_argument(a);
  if (a.rest.size() != 3) throw idemctl::UsageError("duplicates <scope> <id> takes no options");
  Sources sources = open_sources(a);
  std::vector<std::string> fields = {"status", "attempts", "takeovers", "replays"};
  std::vector<std::vector<std::string>> columns;
  bool found = false;
  for (auto& src : sources) {
    auto r = src->lookup(key);
    if (!r) {
      columns.push_back({"(absent)"});
      continue;
    }
    found = true;
    auto n = src->attempts(key);
    columns.push_back({std::string(idem::record_status_name(r->status)),
                       n ? std::to_string(*n) : kNotCounted,
                       n ? std::to_string(*n - 1) : kNotCounted, kNotCounted});
  }
  print_columns(key, sources, fields, columns);
  std::cout << "attempts: attempts that held the record (1 + takeovers of an expired lease);\n"
               "replays: no store keeps a per-key count of duplicates answered from the record\n"
               "(replayed, in progress, mismatch); count them from the service's log with\n"
               "idemctl duplicates --log FILE\n";
  return found ? 0 : kNotFound;
}

std::size_t parse_top(const std::string& text) {
  std::size_t n = 0;
  for (char c : text) {
    if (c < '0' || c > '9' || n > 1'000'000) {
      throw idemctl::UsageError("--top needs a count, e.g. 20");
    }
    n = n * 10 + static_cast<std::size_t>(c - '0');
  }
  if (text.empty() || n == 0) throw idemctl::UsageError("--top needs a positive count, e.g. 20");
  return n;
}

// `duplicates --log FILE [--top N]`: `idem duplicate` log lines counted per key.
int duplicates_in_log(const std::string& file, std::size_t top) {
  std::ifstream opened;
  if (file != "-") {
    opened.open(file, std::ios::binary);
    if (!opened) throw idemctl::StoreError("cannot read log '" + file + "'");
  }
  std::istream& in = file == "-" ? std::cin : opened;
  auto counts = idemctl::count_duplicate_lines(in);
  std::vector<std::pair<std::string, idemctl::DuplicateCount>> rows(counts.begin(), counts.end());
  std::stable_sort(rows.begin(), rows.end(),
                   [](const auto& x, const auto& y) { return x.second.total > y.second.total; });
  std::cout << "duplicates  replayed  in_progress  mismatch  key\n";
  for (std::size_t i = 0; i < rows.size() && i < top; ++i) {
    const auto& c = rows[i].second;
    std::cout << std::left << std::setw(12) << c.total << std::setw(10) << c.replayed
              << std::setw(13) << c.in_progress << std::setw(10) << c.fingerprint_mismatch
              << idem::log::quote_field(rows[i].first) << "\n";
  }
  std::cout << counted(rows.size(), "key") << " with duplicates in "
            << (file == "-" ? "stdin" : file) << "\n";
  return 0;
}

// `duplicates [--top N]` on the durable store: records more than one attempt held.
int duplicates_in_store(const Args& a, std::size_t top) {
  if (a.db.empty()) throw idemctl::UsageError("no database: pass --db DB (or set IDEMCTL_DB)");
  auto src = open_durable(a);
  auto rows = admin_of(*src).most_attempts(top);
  std::cout << "store " << src->name() << " table " << table_name(a) << "\n"
            << "attempts  takeovers  key\n";
  for (const auto& r : rows) {
    std::cout << std::left << std::setw(10) << r.attempts << std::setw(11) << r.attempts - 1
              << idem::log::quote_field(r.scope + "|" + r.id) << "\n";
  }
  std::cout << counted(rows.size(), "record") << " held by more than one attempt"
            << (rows.size() == top ? " (the first " + std::to_string(top) + ")" : std::string())
            << "\nreplays: not recorded per key by " << src->name()
            << "; count them with idemctl duplicates --log FILE\n";
  return 0;
}

int cmd_duplicates(const Args& a) {
  if (a.key_after_dashes || (a.rest.size() >= 3 && a.rest[1].rfind("--", 0) != 0)) {
    return duplicates_of_key(a);
  }
  std::string log;
  std::size_t top = 20;
  for (std::size_t i = 1; i < a.rest.size(); ++i) {
    const auto& s = a.rest[i];
    if (s == "--log") {
      log = take_value(a.rest, i);
    } else if (s == "--top") {
      top = parse_top(take_value(a.rest, i));
    } else {
      throw idemctl::UsageError("duplicates needs <scope> <id>, --top N or --log FILE (not '" + s +
                                "')");
    }
  }
  return log.empty() ? duplicates_in_store(a, top) : duplicates_in_log(log, top);
}

int cmd_stats(const Args& a) {
  if (a.rest.size() != 1) throw idemctl::UsageError("stats takes no arguments");
  if (a.db.empty()) throw idemctl::UsageError("no database: pass --db DB (or set IDEMCTL_DB)");
  auto src = open_durable(a);
  auto s = admin_of(*src).stats(idem::system_now());
  std::cout << "store " << src->name() << " table " << table_name(a) << "\n"
            << "in_progress  " << s.in_progress << "  (" << s.stale_in_progress
            << " with an expired lease)\n"
            << "completed    " << s.completed << "\n"
            << "failed       " << s.failed << "\n"
            << "total        " << s.in_progress + s.completed + s.failed << "  ("
            << s.past_retention << " past retention, purgeable with purge --expired)\n";
  return 0;
}

int cmd_purge(const Args& a) {
  std::optional<std::chrono::seconds> older;
  bool expired = false, dry_run = false;
  for (std::size_t i = 1; i < a.rest.size(); ++i) {
    const auto& s = a.rest[i];
    if (s == "--older-than") {
      older = idemctl::parse_duration(take_value(a.rest, i));
    } else if (s == "--expired") {
      expired = true;
    } else if (s == "--dry-run") {
      dry_run = true;
    } else {
      throw idemctl::UsageError("unknown purge argument '" + s + "'");
    }
  }
  if (older.has_value() == expired) {
    throw idemctl::UsageError("purge needs exactly one of --older-than <duration> or --expired");
  }
  if (expired && dry_run) throw idemctl::UsageError("--dry-run goes with --older-than");
  if (a.db.empty()) throw idemctl::UsageError("no database: pass --db DB (or set IDEMCTL_DB)");
  auto src = open_durable(a);
  auto& admin = admin_of(*src);
  if (expired) {
    std::cout << "purged " << admin.purge_expired() << " records past retention from "
              << src->name() << "\n";
    return 0;
  }
  auto cutoff = idem::system_now() - *older;
  auto n = admin.purge_older_than(cutoff, dry_run);
  std::cout << (dry_run ? "would purge " : "purged ") << n
            << " completed/failed records last updated before " << when(cutoff) << " from "
            << src->name() << "\n";
  return 0;
}

int cmd_key(const Args& a) {
  std::string scope, principal, method, route, client_key;
  bool have_key = false;
  for (std::size_t i = 1; i < a.rest.size(); ++i) {
    const auto& s = a.rest[i];
    if (s == "--scope") {
      scope = take_value(a.rest, i);
    } else if (s == "--principal") {
      principal = take_value(a.rest, i);
    } else if (s == "--method") {
      method = take_value(a.rest, i);
    } else if (s == "--route") {
      route = take_value(a.rest, i);
    } else if (s == "--key") {
      client_key = take_value(a.rest, i);
      have_key = true;
    } else {
      throw idemctl::UsageError("unknown key argument '" + s + "'");
    }
  }
  if (scope.empty() || method.empty() || route.empty() || !have_key) {
    throw idemctl::UsageError("key needs --scope, --method, --route and --key");
  }
  try {
    auto k = idem::http::scoped_key(scope, principal, method, route, client_key);
    std::cout << k.scope() << " " << k.id() << "\n";
  } catch (const idem::InvalidKey& e) {
    throw idemctl::UsageError(e.what());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    Args a = parse_global(args);
    if (a.rest.empty()) throw idemctl::UsageError("no command");
    const std::string cmd = a.rest[0];
    // `<command> -- <scope> <id>`: a key whose scope or id starts with "--".
    if ((cmd == "show" || cmd == "response" || cmd == "release" || cmd == "duplicates") &&
        a.rest.size() > 1 && a.rest[1] == "--") {
      a.rest.erase(a.rest.begin() + 1);
      a.key_after_dashes = true;
    }
    if (cmd == "-h" || cmd == "--help" || cmd == "help") {
      std::cout << kUsage;
      return 0;
    }
    if (cmd == "--version") {
      if (a.rest.size() != 1) throw idemctl::UsageError("--version takes no arguments");
      std::cout << "idemctl (idem) " << idem::version() << "\n";
      return 0;
    }
    if (cmd == "show") return cmd_show(a);
    if (cmd == "stats") return cmd_stats(a);
    if (cmd == "purge") return cmd_purge(a);
    if (cmd == "key") return cmd_key(a);
    if (cmd == "response") return cmd_response(a);
    if (cmd == "release") return cmd_release(a);
    if (cmd == "duplicates") return cmd_duplicates(a);
    throw idemctl::UsageError("unknown command '" + cmd + "'");
  } catch (const idemctl::UsageError& e) {
    std::cerr << "idemctl: " << e.what() << "\n\n" << kUsage;
    return 2;
  } catch (const idemctl::StoreError& e) {
    std::cerr << "idemctl: " << e.what() << "\n";
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "idemctl: " << e.what() << "\n";
    return 3;
  }
}
