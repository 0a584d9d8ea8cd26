// SPDX-License-Identifier: MIT
// examples/ai_chat on PostgreSQL (real server): two servers on one database (each with its own
// PostgresStore pool, fast store and guard, as two processes have), the scenarios of the SQLite
// tests: a POST retried while its stream runs starts one generation; a Last-Event-ID resumes on
// the other server; and a server whose lease ended (stopped mid-answer) is taken over.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "ai_chat_test_support.hpp"
#include "idem/memory_store.hpp"
#include "idem/postgres/postgres_store.hpp"
#include "postgres/pg_test_support.hpp"
#include "postgres_chats.hpp"

namespace {

using namespace ai_chat_test;
using Server = ai_chat::ChatServer<idem::postgres::PostgresStore, ai_chat::PostgresChats>;

// One "process" on the test process's schema.
struct PgNode {
  explicit PgNode(ai_chat::ServerOptions options)
      : durable(idem::test::pg::options()),
        chats(durable),
        guard(fast, durable),
        server(guard, chats, options) {
    server.start();
  }
  idem::MemoryStore fast;
  idem::postgres::PostgresStore durable;
  ai_chat::PostgresChats chats;
  idem::IdempotencyGuard<idem::postgres::PostgresStore> guard;
  Server server;
};

long chat_rows() {
  return idem::test::pg::scalar("SELECT count(*) FROM " + idem::test::pg::table("ai_chat"));
}

TEST(AiChatPg, RetriedPostWhileStreamingStartsOneGeneration) {
  IDEM_REQUIRE_POSTGRES();
  PgNode a{slow_options()};
  PgNode b{slow_options()};
  retried_post_during_stream(a.server, b.server, chat_rows);
}

TEST(AiChatPg, ResumesAfterTheLastEventIdOnEitherServer) {
  IDEM_REQUIRE_POSTGRES();
  PgNode a{fast_options()};
  PgNode b{fast_options()};
  resume_on_either_server(a.server, b.server);
}

TEST(AiChatPg, AStoppedOwnerIsTakenOverAndTheAnswerStoredOnce) {
  IDEM_REQUIRE_POSTGRES();
  ai_chat::ServerOptions o = slow_options();
  o.lease = std::chrono::milliseconds(300);
  auto a = std::make_unique<PgNode>(o);
  PgNode b{o};
  Posted p = post(a->server.port(), "\"takeover\"",
                  R"({"prompt":"take over","length":2500,"retries":true})");
  ASSERT_EQ(201, p.status) << p.body;
  const std::string id = request_id_of(p);
  // Stop the owner once some chunks are stored (its lease is then not renewed).
  for (int i = 0; i < 500 && get_json(b.server.port(), "/chats/" + id)["chunks"].get<int>() < 30;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  a.reset();
  Stream s = get_events(b.server.port(), id);  // b finds the lease ended and takes over
  ASSERT_TRUE(s.done);
  EXPECT_EQ(original(b.server.port(), id), s.text());
  std::uint64_t end = 0;
  for (const auto& [offset, bytes] : s.chunks) {
    ASSERT_EQ(end, offset);  // contiguous, no overlap: the new owner resumed at the stored end
    end += bytes.size();
  }
  auto state = get_json(b.server.port(), "/chats/" + id);
  EXPECT_EQ("done", state["status"]);
  EXPECT_EQ(2, state["generations"].get<int>());
  EXPECT_GT(b.server.counters_of(id).producer_dropped_bytes, 0u);
}

}  // namespace
