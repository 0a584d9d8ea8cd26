// SPDX-License-Identifier: MIT
// examples/ai_chat on PostgreSQL through an outage: the shared server is stopped while a chat is
// generated and streamed in this process. The store's failures end the stream (the client
// resumes) and the generation (its lease ends), never the process (they terminated it: an
// exception out of the generation thread or cpp-httplib's content provider); once the
// database is back, a stream takes the chat over and the answer is stored exactly once.
// Restarts the shared server: runs alone (SERIAL).
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "ai_chat_test_support.hpp"
#include "idem/memory_store.hpp"
#include "idem/postgres/postgres_store.hpp"
#include "postgres/pg_test_support.hpp"
#include "postgres_chats.hpp"
#include "support/test_env.hpp"

namespace {

using namespace ai_chat_test;
using Server = ai_chat::ChatServer<idem::postgres::PostgresStore, ai_chat::PostgresChats>;

TEST(AiChatPgRestart, AnOutageEndsStreamsAndGenerationsNotTheServer) {
  IDEM_REQUIRE_POSTGRES();
  std::string script;
  IDEM_REQUIRE_ENV(script, "IDEM_SERVERS_SCRIPT");
  ai_chat::ServerOptions o = slow_options();
  o.lease = std::chrono::milliseconds(500);
  idem::MemoryStore fast;
  idem::postgres::PostgresStore durable{idem::test::pg::options()};
  ai_chat::PostgresChats chats{durable};
  idem::IdempotencyGuard<idem::postgres::PostgresStore> guard{fast, durable};
  Server server{guard, chats, o};
  server.start();

  Posted p = post(server.port(), "\"outage\"", R"({"prompt":"outage","length":4000})");
  ASSERT_EQ(201, p.status) << p.body;
  const std::string id = request_id_of(p);
  for (int i = 0; i < 500; ++i) {
    auto state = get_json(server.port(), "/chats/" + id);
    if (state.is_object() && state["chunks"].get<int>() >= 20) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::atomic<int> ended{0};
  std::thread reader([&] {
    httplib::Client c("127.0.0.1", server.port());
    c.set_read_timeout(30, 0);
    (void)c.Get(("/chats/" + id + "/events").c_str(),
                [](const char*, std::size_t) { return true; });
    ended = 1;  // the stream ended (on the outage: it could not finish before)
  });
  EXPECT_EQ(0, idem::test::pg::stop_until_observed_then_start(script, ended));
  reader.join();
  EXPECT_EQ(1, ended.load());

  // The process is alive, and the chat completes: a stream takes the generation over once the
  // lease has ended. The first requests after the restart may meet the outage's stale
  // connections (a typed 503).
  Stream s;
  for (int attempt = 0; attempt < 100 && !s.done; ++attempt) {
    s = get_events(server.port(), id);
    if (!s.done) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(s.done);
  EXPECT_EQ(original(server.port(), id), s.text());
  std::uint64_t end = 0;
  for (const auto& [offset, bytes] : s.chunks) {
    ASSERT_EQ(end, offset);  // stored once: contiguous, no overlap
    end += bytes.size();
  }
}

}  // namespace
