// SPDX-License-Identifier: MIT
// examples/ai_chat over real HTTP (httplib::Client), two servers on one SQLite file (each with
// its own Database, fast store and guard, as two processes have): a POST retried while its
// stream runs (same key, either server, 16 threads at once) gets the one request_id and starts
// no second generation; resuming after a Last-Event-ID sends only the chunks after it; bad
// input gets typed answers.
#include <gtest/gtest.h>
#include <httplib.h>

#include <memory>
#include <string>

#include "ai_chat_test_support.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/test_env.hpp"

namespace {

using namespace ai_chat_test;
using Server = ai_chat::ChatServer<idem::sqlite::SqliteStore, ai_chat::SqliteChats>;

// One "process": its own database handle, stores, guard and server.
struct Node {
  explicit Node(const std::string& path, ai_chat::ServerOptions options = {})
      : db(std::make_shared<idem::sqlite::Database>(path)),
        durable(db),
        chats(db),
        guard(fast, durable),
        server(guard, chats, options) {
    server.start();
  }
  std::shared_ptr<idem::sqlite::Database> db;
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable;
  ai_chat::SqliteChats chats;
  idem::IdempotencyGuard<idem::sqlite::SqliteStore> guard;
  Server server;
};

TEST(AiChatHttp, RetriedPostWhileStreamingStartsOneGeneration) {
  idem::test::TempDir dir;
  Node a{dir.file("chat.sqlite"), slow_options()};
  Node b{dir.file("chat.sqlite"), slow_options()};
  retried_post_during_stream(a.server, b.server, [&] {
    return static_cast<long>(a.db->read([](idem::sqlite::Session& s) {
      return s.query_int64("SELECT count(*) FROM ai_chat").value_or(-1);
    }));
  });
}

TEST(AiChatHttp, ResumesAfterTheLastEventIdOnEitherServer) {
  idem::test::TempDir dir;
  Node a{dir.file("chat.sqlite"), fast_options()};
  Node b{dir.file("chat.sqlite"), fast_options()};
  resume_on_either_server(a.server, b.server);
}

TEST(AiChatHttp, BadInputGetsTypedAnswers) {
  idem::test::TempDir dir;
  Node a{dir.file("chat.sqlite")};
  const int port = a.server.port();
  EXPECT_EQ(400, post(port, "", R"({"prompt":"no key"})").status);  // missing_key
  EXPECT_EQ(400, post(port, "\"k1\"", R"({"prompt":""})").status);
  EXPECT_EQ(400, post(port, "\"k2\"", R"({"prompt":"x","length":0})").status);
  EXPECT_EQ(400, post(port, "\"k3\"", R"({"prompt":"x","length":99999999})").status);
  EXPECT_EQ(400, post(port, "\"k4\"", R"({"prompt":"x","retries":"yes"})").status);
  EXPECT_EQ(400, post(port, "\"k5\"", "not json").status);
  httplib::Client c("127.0.0.1", port);
  auto missing = c.Get("/chats/chat_999999/events");
  ASSERT_TRUE(missing);
  EXPECT_EQ(404, missing->status);
  Posted p = post(port, "\"ok\"", R"({"prompt":"fine","length":50})");
  ASSERT_EQ(201, p.status);
  const std::string id = request_id_of(p);
  for (const char* bad : {"chat_1_5", "garbage", "_5"}) {
    auto r = c.Get(("/chats/" + id + "/events").c_str(), {{"Last-Event-ID", bad}});
    ASSERT_TRUE(r);
    EXPECT_EQ(400, r->status) << bad;
  }
  auto r = c.Get(("/chats/" + id + "/events").c_str(), {{"Last-Event-ID", id + "_x"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(400, r->status);
  // A preflight from another origin may send Last-Event-ID and Idempotency-Key.
  auto pre = c.Options(("/chats/" + id + "/events").c_str());
  ASSERT_TRUE(pre);
  EXPECT_EQ(204, pre->status);
  EXPECT_NE(std::string::npos,
            pre->get_header_value("Access-Control-Allow-Headers").find("Last-Event-ID"));
}

}  // namespace
