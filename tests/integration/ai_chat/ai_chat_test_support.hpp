// SPDX-License-Identifier: MIT
// Helpers of the examples/ai_chat HTTP tests (SQLite and PostgreSQL): an HTTP client for the
// chat API, an SSE decoder, and the scenarios both backends must pass with two servers on one
// database.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>
#include <openssl/evp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "chat_server.hpp"

namespace ai_chat_test {

/// A model pausing 2 ms per piece (streams run while the test acts).
inline ai_chat::ServerOptions slow_options() {
  ai_chat::ServerOptions o;
  o.token_delay = std::chrono::microseconds(2000);
  return o;
}

/// A model without pauses.
inline ai_chat::ServerOptions fast_options() {
  ai_chat::ServerOptions o;
  o.token_delay = std::chrono::microseconds(0);
  return o;
}

struct Posted {
  int status = 0;
  std::string body;
  std::string replayed;
};

inline Posted post(int port, const std::string& key, const std::string& body) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(30, 0);
  httplib::Headers h;
  if (!key.empty()) h.emplace("Idempotency-Key", key);
  auto r = c.Post("/chats", h, body, "application/json");
  if (!r) return {};
  return {r->status, r->body, r->get_header_value("Idempotent-Replayed")};
}

inline std::string request_id_of(const Posted& p) {
  auto j = nlohmann::json::parse(p.body, nullptr, false);
  return j.is_object() && j.contains("request_id") ? j["request_id"].get<std::string>() : "";
}

// Decodes the chunk events of an SSE body: (offset, bytes) in order, and whether `done` came.
struct Stream {
  std::vector<std::pair<std::uint64_t, std::string>> chunks;
  bool done = false;
  std::string text() const {
    std::string t;
    for (const auto& c : chunks) t += c.second;
    return t;
  }
};

inline std::string from_base64(const std::string& b64) {
  std::string out(b64.size(), '\0');
  int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(&out[0]),
                          reinterpret_cast<const unsigned char*>(b64.data()),
                          static_cast<int>(b64.size()));
  if (n < 0) return "<bad base64>";
  std::size_t pad = b64.size() >= 2 && b64[b64.size() - 1] == '=' ? 1 : 0;
  pad += b64.size() >= 2 && b64[b64.size() - 2] == '=' ? 1 : 0;
  out.resize(static_cast<std::size_t>(n) - pad);
  return out;
}

inline Stream parse_events(const std::string& id, const std::string& body) {
  Stream s;
  std::size_t at = 0;
  while (at < body.size()) {
    std::size_t end = body.find("\n\n", at);
    if (end == std::string::npos) break;
    std::string block = body.substr(at, end - at);
    at = end + 2;
    if (block.rfind("event: done", 0) == 0) s.done = true;
    auto idp = block.find("id: " + id + "_");
    auto dp = block.find("data: ");
    if (idp == std::string::npos || dp == std::string::npos) continue;
    std::uint64_t offset = std::stoull(block.substr(idp + 5 + id.size()));
    s.chunks.emplace_back(offset, from_base64(block.substr(dp + 6)));
  }
  return s;
}

inline Stream get_events(int port, const std::string& id, const std::string& last_event_id = "",
                         const std::function<void(std::size_t)>& on_bytes = nullptr) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(30, 0);
  httplib::Headers h;
  if (!last_event_id.empty()) h.emplace("Last-Event-ID", last_event_id);
  std::string body;
  auto r = c.Get(("/chats/" + id + "/events").c_str(), h, [&](const char* data, std::size_t n) {
    body.append(data, n);
    if (on_bytes) on_bytes(body.size());
    return true;
  });
  EXPECT_TRUE(r);
  return parse_events(id, body);
}

inline nlohmann::json get_json(int port, const std::string& path) {
  httplib::Client c("127.0.0.1", port);
  auto r = c.Get(path.c_str());
  if (!r || r->status != 200) return nullptr;
  return nlohmann::json::parse(r->body);
}

inline std::string original(int port, const std::string& id) {
  httplib::Client c("127.0.0.1", port);
  auto r = c.Get(("/chats/" + id + "/original").c_str());
  return r ? r->body : "";
}

/// A POST retried while its stream runs, from 16 threads on both servers: the first answer
/// byte for byte, one chat row (`chat_rows`), one generation; another body with the key: 422.
template <class Server>
void retried_post_during_stream(Server& a, Server& b, const std::function<long()>& chat_rows) {
  const std::string body = R"({"prompt":"retry me","length":3000,"retries":true})";
  const std::string key = "\"7d0e5c1a-retry\"";
  Posted first = post(a.port(), key, body);
  ASSERT_EQ(201, first.status) << first.body;
  const std::string id = request_id_of(first);
  ASSERT_FALSE(id.empty());

  // Retries arrive while the stream is running: the same answer from both servers, and from
  // 16 threads at once (a 409 in_progress is allowed while a twin is inside the guard).
  std::atomic<bool> streaming{false};
  std::vector<Posted> retries;
  std::mutex m;
  std::thread client([&] {
    Stream s = get_events(b.port(), id, "", [&](std::size_t n) {
      if (n > 200) streaming = true;
    });
    EXPECT_TRUE(s.done);
    EXPECT_EQ(original(a.port(), id), s.text());
  });
  while (!streaming) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ("generating", get_json(a.port(), "/chats/" + id)["status"]);
  std::vector<std::thread> storm;
  for (int t = 0; t < 16; ++t) {
    storm.emplace_back([&, t] {
      int port = (t % 2 == 0 ? a : b).port();
      Posted p;
      for (int attempt = 0; attempt < 50; ++attempt) {
        p = post(port, key, body);
        if (p.status != 409) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      std::lock_guard<std::mutex> lock(m);
      retries.push_back(p);
    });
  }
  for (auto& t : storm) t.join();
  client.join();

  ASSERT_EQ(16u, retries.size());
  for (const auto& p : retries) {
    EXPECT_EQ(201, p.status) << p.body;
    EXPECT_EQ(first.body, p.body);  // byte for byte the first answer
    EXPECT_EQ("true", p.replayed);
  }
  nlohmann::json state = get_json(b.port(), "/chats/" + id);
  EXPECT_EQ("done", state["status"]);
  EXPECT_EQ(1, state["generations"].get<int>());
  EXPECT_EQ(1u, a.counters_of(id).generations + b.counters_of(id).generations);
  // One chat row in the shared database.
  EXPECT_EQ(1, chat_rows());
  // The same key with another body is a client error, not a second chat.
  EXPECT_EQ(422, post(b.port(), key, R"({"prompt":"another"})").status);
}

/// Resuming after a Last-Event-ID, on the other server: exactly the chunks after it.
template <class Server>
void resume_on_either_server(Server& a, Server& b) {
  Posted p = post(a.port(), "\"resume\"", R"({"prompt":"resume","length":2000})");
  ASSERT_EQ(201, p.status);
  const std::string id = request_id_of(p);
  Stream all = get_events(a.port(), id);
  ASSERT_TRUE(all.done);
  const std::string text = original(b.port(), id);
  ASSERT_EQ(text, all.text());
  ASSERT_GT(all.chunks.size(), 100u);
  // Chunks are contiguous: each starts where the previous ended.
  std::uint64_t end = 0;
  for (const auto& [offset, bytes] : all.chunks) {
    ASSERT_EQ(end, offset);
    end += bytes.size();
  }
  // Resume after chunk k on the other server: exactly the chunks after it.
  const std::size_t k = all.chunks.size() / 3;
  Stream rest = get_events(b.port(), id, id + "_" + std::to_string(all.chunks[k].first));
  ASSERT_TRUE(rest.done);
  ASSERT_EQ(all.chunks.size() - k - 1, rest.chunks.size());
  EXPECT_EQ(all.chunks[k + 1].first, rest.chunks.front().first);
  EXPECT_EQ(text.substr(all.chunks[k + 1].first), rest.text());
  // After the last chunk: nothing but `done`.
  Stream none = get_events(a.port(), id, id + "_" + std::to_string(all.chunks.back().first));
  EXPECT_TRUE(none.done);
  EXPECT_TRUE(none.chunks.empty());
}

}  // namespace ai_chat_test
