// SPDX-License-Identifier: MIT
// examples/ai_chat: a streamed AI chat whose page never shows a chunk twice. Run two processes
// on one database file and let the page stream from both:
//
//   ai_chat --port 8080 --db /tmp/chat.sqlite &
//   ai_chat --port 8081 --db /tmp/chat.sqlite &
//   open
//   'http://127.0.0.1:8080/?servers=http://127.0.0.1:8080,http://127.0.0.1:8081&drop_every=20&replay=3&reorder=7'
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include "chat_server.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#ifdef AI_CHAT_WITH_POSTGRES
#include "postgres_chats.hpp"
#endif

#ifndef AI_CHAT_WEB_DIR
#define AI_CHAT_WEB_DIR ""
#endif

namespace {

volatile std::sig_atomic_t g_stop = 0;

// Serves until SIGINT/SIGTERM.
template <class Durable, class Chats>
void serve(Durable& durable, Chats& chats, const ai_chat::ServerOptions& options,
           const std::string& what) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard<Durable> guard{fast, durable};
  ai_chat::ChatServer<Durable, Chats> server{guard, chats, options};
  server.start();
  std::cout << "ai_chat listening on " << server.url() << " (" << what << ")" << std::endl;
  std::signal(SIGINT, [](int) { g_stop = 1; });
  std::signal(SIGTERM, [](int) { g_stop = 1; });
  while (g_stop == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  server.stop();
}

void usage(std::ostream& out) {
  out << "usage: ai_chat [--port N] [--db PATH | --postgres DSN [--pg-schema S]] [--web DIR]\n"
         "               [--token-delay-us N] [--lease-ms N] [--poll-ms N]\n"
         "               [--drop-every N] [--abort] [--replay K] [--reorder M]\n"
         "  --port N           port on 127.0.0.1 (default 8080; 0 = any free, printed)\n"
         "  --db PATH          SQLite file of chats, chunks and idempotency records, shared by\n"
         "                     every process serving the chats (default ai_chat.sqlite)\n"
         "  --postgres DSN     PostgreSQL (libpq conninfo or postgresql:// URI) instead of\n"
         "                     SQLite, shared the same way (needs a build with idem::postgres)\n"
         "  --pg-schema NAME   its schema (created if missing; default public)\n"
         "  --web DIR          folder of index.html and the browser module (default: the source)\n"
         "  --token-delay-us N pause of the simulated model after each piece (default 2000)\n"
         "  --lease-ms N       generation lease; another process takes over after it (3000)\n"
         "  --poll-ms N        how often a stream looks for another process's chunks (20)\n"
         "  --drop-every N     fault: end each event stream after N fresh events (0 = off)\n"
         "  --abort            fault: drop by cutting the connection instead of ending it\n"
         "  --replay K         fault: resend the last K chunks after a reconnect (0 = off)\n"
         "  --reorder M        fault: send every M-th event after the next one (0 = off)\n"
         "  (the events URL's query parameters drop_every, abort, replay, reorder override them)\n";
}

}  // namespace

int main(int argc, char** argv) {
  ai_chat::ServerOptions options;
  options.port = 8080;
  options.web_dir = AI_CHAT_WEB_DIR;
  std::string db = "ai_chat.sqlite";
  std::string dsn;
  std::string schema = "public";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      usage(std::cout);
      return 0;
    }
    if (a == "--abort") {
      options.faults.abort = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::cerr << "ai_chat: " << a << " needs a value (or is unknown)\n";
      usage(std::cerr);
      return 2;
    }
    std::string v = argv[++i];
    char* end = nullptr;
    unsigned long n = std::strtoul(v.c_str(), &end, 10);
    bool numeric = !v.empty() && *end == '\0';
    if (a == "--db") {
      db = v;
    } else if (a == "--postgres") {
      dsn = v;
    } else if (a == "--pg-schema") {
      schema = v;
    } else if (a == "--web") {
      options.web_dir = v;
    } else if (!numeric) {
      std::cerr << "ai_chat: " << a << " '" << v << "' is not a number (or is unknown)\n";
      return 2;
    } else if (a == "--port" && n <= 65535) {
      options.port = static_cast<int>(n);
    } else if (a == "--token-delay-us") {
      options.token_delay = std::chrono::microseconds(n);
    } else if (a == "--lease-ms" && n > 0) {
      options.lease = std::chrono::milliseconds(n);
    } else if (a == "--poll-ms" && n > 0) {
      options.poll = std::chrono::milliseconds(n);
    } else if (a == "--drop-every") {
      options.faults.drop_every = static_cast<std::uint32_t>(n);
    } else if (a == "--replay") {
      options.faults.replay = static_cast<std::uint32_t>(n);
    } else if (a == "--reorder") {
      options.faults.reorder = static_cast<std::uint32_t>(n);
    } else {
      std::cerr << "ai_chat: bad argument " << a << " " << v << "\n";
      usage(std::cerr);
      return 2;
    }
  }
#ifndef AI_CHAT_WITH_POSTGRES
  if (!dsn.empty()) {
    std::cerr << "ai_chat: this build has no PostgreSQL backend (idem::postgres)\n";
    return 2;
  }
#endif
  try {
#ifdef AI_CHAT_WITH_POSTGRES
    if (!dsn.empty()) {
      idem::postgres::PostgresStoreOptions o;
      o.conninfo = dsn;
      o.schema = schema;
      o.pool_size = options.threads + 8;         // every open stream may poll at once
      idem::postgres::PostgresStore durable{o};  // connects and migrates: fails fast
      ai_chat::PostgresChats chats{durable};
      serve(durable, chats, options, "postgres, schema " + schema);
      return 0;
    }
#endif
    auto database = std::make_shared<idem::sqlite::Database>(db);
    idem::sqlite::SqliteStore durable{database};
    ai_chat::SqliteChats chats{database};
    serve(durable, chats, options, "db " + db);
  } catch (const std::exception& e) {
    std::cerr << "ai_chat: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
