// SPDX-License-Identifier: MIT
// The AI chat server of examples/ai_chat (cpp-httplib):
//
//   POST /chats                 behind Idempotency-Key (idem::http::Endpoint): creates a chat,
//                               201
//                               {"request_id":"chat_10001","events":"/chats/chat_10001/events"}; a
//                               retry with the same key gets the same answer and no second
//                               generation.
//   GET  /chats/{id}/events     server-sent events, one per chunk (`id: chat_10001_10`), from
//                               the durable chunk table; resumes after the chunk named by the
//                               Last-Event-ID header, in whichever process the client reaches.
//   GET  /chats/{id}            the chat's state (JSON); /original: the generator's answer
//                               computed straight (for checks); /stats: this process's counters.
//   GET  /                      the page; /chat_stream.js the browser module.
//
// Generation runs on a thread of the process that claimed it (see sqlite_chats.hpp: owner
// token, lease, fenced appends), through idem::stream::ProducerDedup, so a generator that
// retries ranges never stores or sends an offset twice. Events are sent only once committed.
// Another process streams the same chat by polling the table, and takes the generation over
// when the owner's lease ends (its ProducerDedup starts at the stored prefix's end).
//
// Fault switches (server defaults, or query parameters of the events URL): end the stream after
// every N fresh events (`drop_every`; with `abort=1` the connection is cut instead, and the
// client may lose events that were in flight), replay the last K chunks the client already has
// after a reconnect (`replay`), swap every M-th event with the next one (`reorder`). Every
// replayed chunk is counted (`/chats/{id}/stats`), so a client's duplicate counter can be
// checked. A swapped pair is never split by a drop.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "generator.hpp"
#include "idem/fingerprint.hpp"
#include "idem/guard.hpp"
#include "idem/http/httplib.hpp"
#include "idem/stream.hpp"
#include "sqlite_chats.hpp"
#include "sse.hpp"

namespace ai_chat {

/// Transport faults injected into the event streams (0: off).
struct Faults {
  /// Abort the connection after every N fresh chunk events.
  std::uint32_t drop_every = 0;
  /// Drop by cutting the connection (no end of the chunked body) instead of ending the stream.
  bool abort = false;
  /// After a reconnect (a Last-Event-ID), first resend the last K chunks the client has.
  std::uint32_t replay = 0;
  /// Send every M-th fresh event after the one that follows it.
  std::uint32_t reorder = 0;
};

/// Options of the server.
struct ServerOptions {
  /// Address to bind (loopback by default).
  std::string host = "127.0.0.1";
  /// Port; 0 picks a free one.
  int port = 0;
  /// Worker threads (each open event stream holds one).
  std::size_t threads = 32;
  /// Folder of the page and the browser module ("" serves no page).
  std::string web_dir;
  /// Default faults (a query parameter of the events URL overrides each).
  Faults faults;
  /// Pause of the simulated model after each piece.
  std::chrono::microseconds token_delay{2000};
  /// Generation lease: another process takes over a chat whose owner did not renew it.
  std::chrono::milliseconds lease{3000};
  /// How often a stream looks for chunks written by another process.
  std::chrono::milliseconds poll{20};
  /// Most chunks per commit of the generator.
  std::size_t batch = 64;
  /// Largest answer a chat may ask for (bytes).
  std::uint64_t max_length = 1 << 20;
  /// Bytes per generator piece, at most.
  std::size_t max_chunk = 12;
};

/// This process's counters of one chat.
struct ChatCounters {
  std::uint64_t connections = 0;             // event streams opened
  std::uint64_t fresh_events = 0;            // chunk events sent after the resume point
  std::uint64_t replayed = 0;                // chunk events resent that the client had (fault)
  std::uint64_t reordered = 0;               // event pairs swapped (fault)
  std::uint64_t dropped = 0;                 // streams ended early (fault)
  std::uint64_t broken = 0;                  // streams ended early otherwise (a write failed,
                                             // the client left, the server stopping)
  std::uint64_t live_remote = 0;             // fresh events sent while another process generated
  std::uint64_t generations = 0;             // generations run here
  std::uint64_t generator_retries = 0;       // times the generator went back
  std::uint64_t producer_dropped_bytes = 0;  // bytes ProducerDedup kept from being re-emitted
  std::uint64_t producer_trimmed = 0;        // pieces cut to their unseen suffix
  std::uint64_t split_characters = 0;        // chunks ending inside a multi-byte character

  /// Adds what one event stream counted.
  void add(const ChatCounters& o) {
    connections += o.connections;
    fresh_events += o.fresh_events;
    replayed += o.replayed;
    reordered += o.reordered;
    dropped += o.dropped;
    broken += o.broken;
    live_remote += o.live_remote;
  }

  nlohmann::json to_json() const {
    return {{"connections", connections},
            {"fresh_events", fresh_events},
            {"replayed", replayed},
            {"reordered", reordered},
            {"dropped", dropped},
            {"broken", broken},
            {"live_remote", live_remote},
            {"generations", generations},
            {"generator_retries", generator_retries},
            {"producer_dropped_bytes", producer_dropped_bytes},
            {"producer_trimmed", producer_trimmed},
            {"split_characters", split_characters}};
  }
};

/// The HTTP server (see the file comment). `Durable` is the guard's durable store, `Chats` the
/// chat repository (SqliteChats).
template <class Durable, class Chats>
class ChatServer {
 public:
  ChatServer(idem::IdempotencyGuard<Durable>& guard, Chats& chats, ServerOptions options)
      : chats_(chats),
        options_(std::move(options)),
        owner_(idem::OwnerToken::generate().str()),
        create_(guard, endpoint_options()) {
    load_web();
    server_.new_task_queue = [n = options_.threads] { return new httplib::ThreadPool(n); };
    server_.set_tcp_nodelay(true);
    // A store failure in a route (the database down) answers a typed problem, as POST /chats
    // does, not cpp-httplib's bare 500.
    server_.set_exception_handler(
        [](const httplib::Request&, httplib::Response& res, std::exception_ptr error) {
          int status = 500;
          std::string code = "internal";
          try {
            std::rethrow_exception(error);
          } catch (const idem::Error& e) {
            status = idem::http_status(e.code());
            code = std::string(idem::errc_name(e.code()));
          } catch (...) {
          }
          res.status = status;
          if (status == 503) res.set_header("Retry-After", "1");
          res.set_content(nlohmann::json{{"type", "urn:ai-chat:" + code},
                                         {"title", "the chat store failed"},
                                         {"status", status}}
                              .dump(),
                          "application/problem+json");
        });
    server_.set_post_routing_handler([](const httplib::Request&, httplib::Response& res) {
      // The page may stream from another process (another origin).
      res.set_header("Access-Control-Allow-Origin", "*");
      res.set_header("Access-Control-Expose-Headers", "Idempotent-Replayed, Location");
    });
    server_.Options(R"(/chats.*)", [](const httplib::Request&, httplib::Response& res) {
      res.status = 204;
      res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
      res.set_header("Access-Control-Allow-Headers",
                     "Content-Type, Idempotency-Key, Last-Event-ID, Authorization");
      res.set_header("Access-Control-Max-Age", "600");
    });
    auto create = idem::http::httplib_handler(
        create_, "/chats", principal_of,
        [this](const httplib::Request& req, typename Durable::Transaction& tx) {
          return create_chat(req, tx);
        });
    server_.Post("/chats", [this, create](const httplib::Request& req, httplib::Response& res) {
      create(req, res);
      if (res.status == 201) {  // first answer or a replay: start the generation if nobody has
        auto body = nlohmann::json::parse(res.body, nullptr, false);
        if (body.is_object() && body.contains("request_id")) {
          ensure_generating(body["request_id"].get<std::string>());
        }
      }
    });
    server_.Get(R"(/chats/([A-Za-z0-9_]{1,64})/events)",
                [this](const httplib::Request& req, httplib::Response& res) { events(req, res); });
    server_.Get(R"(/chats/([A-Za-z0-9_]{1,64}))",
                [this](const httplib::Request& req, httplib::Response& res) {
                  auto chat = chats_.find(req.matches[1].str());
                  if (!chat) return not_found(res);
                  res.set_content(nlohmann::json{{"request_id", chat->request_id},
                                                 {"status", chat->status},
                                                 {"length", chat->answer_length},
                                                 {"generations", chat->generations},
                                                 {"chunks", chats_.chunk_count(chat->request_id)}}
                                      .dump(),
                                  "application/json");
                });
    server_.Get(R"(/chats/([A-Za-z0-9_]{1,64})/original)",
                [this](const httplib::Request& req, httplib::Response& res) {
                  auto chat = chats_.find(req.matches[1].str());
                  if (!chat) return not_found(res);
                  res.set_content(answer(chat->prompt, chat->length), "text/plain; charset=utf-8");
                });
    server_.Get(R"(/chats/([A-Za-z0-9_]{1,64})/stats)",
                [this](const httplib::Request& req, httplib::Response& res) {
                  nlohmann::json j = counters_of(req.matches[1].str()).to_json();
                  j["owner"] = owner_;
                  res.set_content(j.dump(), "application/json");
                });
    for (const auto& [path, file] : web_) {
      server_.Get(path, [&file = file](const httplib::Request&, httplib::Response& res) {
        res.set_header("Cache-Control", "no-store");
        res.set_content(file.second, file.first.c_str());
      });
    }
  }

  ~ChatServer() { stop(); }
  ChatServer(const ChatServer&) = delete;
  ChatServer& operator=(const ChatServer&) = delete;

  /// Binds and serves on a background thread. @throws std::runtime_error if the port is taken.
  void start() {
    server_.set_socket_options([this](socket_t sock) {
      int yes = 1;
      ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
      listen_socket_ = sock;
    });
    port_ = options_.port == 0
                ? server_.bind_to_any_port(options_.host)
                : (server_.bind_to_port(options_.host, options_.port) ? options_.port : -1);
    if (port_ <= 0) {
      throw std::runtime_error("cannot bind " + options_.host + ":" +
                               std::to_string(options_.port));
    }
    // cpp-httplib's backlog is 5; a page opening streams and posts at once needs more.
    if (listen_socket_ >= 0) ::listen(listen_socket_, SOMAXCONN);
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }

  /// Stops the generators and the server; joins every thread.
  void stop() {
    stopping_ = true;
    wake();
    server_.stop();
    if (thread_.joinable()) thread_.join();
    std::vector<Worker> workers;
    {
      std::lock_guard<std::mutex> lock(workers_mutex_);
      workers.swap(workers_);
    }
    for (auto& w : workers) w.thread.join();
  }

  /// The bound port.
  int port() const noexcept { return port_; }
  /// "http://host:port".
  std::string url() const { return "http://" + options_.host + ":" + std::to_string(port_); }
  /// This process's owner token (as stored in the chat row while it generates).
  const std::string& owner() const noexcept { return owner_; }
  /// A copy of this process's counters of `request_id`.
  ChatCounters counters_of(const std::string& request_id) {
    std::lock_guard<std::mutex> lock(counters_mutex_);
    auto it = counters_.find(request_id);
    return it == counters_.end() ? ChatCounters{} : it->second;
  }

  /// Starts the generation of `request_id` here unless another process holds it under a live
  /// lease or it is done. @return true when this call started it.
  bool ensure_generating(const std::string& request_id) {
    if (stopping_ || !chats_.claim(request_id, owner_, options_.lease)) return false;
    std::lock_guard<std::mutex> lock(workers_mutex_);
    // Join the generations that ended, so a long-running server keeps no finished threads.
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (*it->done) {
        it->thread.join();
        it = workers_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    workers_.push_back({std::thread([this, request_id, done] {
                          try {
                            generate(request_id);
                          } catch (const std::exception& e) {
                            // The store failed (the database restarted): this generation
                            // stops; its lease ends and a stream takes the chat over once
                            // the store answers again.
                            std::fprintf(stderr, "ai_chat: generation of %s stopped: %s\n",
                                         request_id.c_str(), e.what());
                            abandon_tail(request_id);
                          }
                          *done = true;
                        }),
                        done});
    return true;
  }

 private:
  static idem::http::EndpointOptions endpoint_options() {
    idem::http::EndpointOptions o;
    o.scope = "http.chats.create";
    return o;
  }

  static std::string principal_of(const httplib::Request& req) {
    auto auth = req.get_header_value("Authorization");
    const std::string bearer = "Bearer ";
    if (auth.compare(0, bearer.size(), bearer) == 0) return auth.substr(bearer.size());
    return "anonymous";
  }

  static void not_found(httplib::Response& res) {
    res.status = 404;
    res.set_content(R"({"type":"urn:ai-chat:not-found","title":"no such chat","status":404})",
                    "application/problem+json");
  }

  static void bad_request(httplib::Response& res, const std::string& detail) {
    res.status = 400;
    res.set_content(nlohmann::json{{"type", "urn:ai-chat:bad-request"},
                                   {"title", "bad request"},
                                   {"status", 400},
                                   {"detail", detail}}
                        .dump(),
                    "application/problem+json");
  }

  void load_web() {
    if (options_.web_dir.empty()) return;
    const std::pair<const char*, const char*> files[] = {
        {"index.html", "text/html; charset=utf-8"},
        {"chat_page.js", "text/javascript; charset=utf-8"},
        {"chat_stream.js", "text/javascript; charset=utf-8"},
        {"chat_stream.d.ts", "text/plain; charset=utf-8"}};
    for (const auto& [name, type] : files) {
      std::ifstream in(options_.web_dir + "/" + name, std::ios::binary);
      if (!in) throw std::runtime_error("ai_chat: cannot read " + options_.web_dir + "/" + name);
      std::ostringstream body;
      body << in.rdbuf();
      std::string path = std::string("/") + (std::string(name) == "index.html" ? "" : name);
      web_[path] = {type, body.str()};
    }
  }

  idem::http::Response create_chat(const httplib::Request& req, typename Durable::Transaction& tx) {
    auto body = nlohmann::json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    std::string problem;
    if (body.is_discarded() || !body.is_object() || !body.contains("prompt") ||
        !body["prompt"].is_string() || body["prompt"].get<std::string>().empty() ||
        body["prompt"].get<std::string>().size() > 4000) {
      problem =
          "expected {\"prompt\": string of 1..4000 bytes, \"length\": bytes, "
          "\"retries\": bool}";
    } else if (body.contains("length") &&
               (!body["length"].is_number_unsigned() || body["length"].get<std::uint64_t>() == 0 ||
                body["length"].get<std::uint64_t>() > options_.max_length)) {
      problem = "length must be 1.." + std::to_string(options_.max_length);
    } else if (body.contains("retries") && !body["retries"].is_boolean()) {
      problem = "retries must be a boolean";
    }
    if (!problem.empty()) {
      return idem::http::Response{400,
                                  {{"Content-Type", "application/problem+json"}},
                                  nlohmann::json{{"type", "urn:ai-chat:bad-request"},
                                                 {"title", "invalid chat"},
                                                 {"status", 400},
                                                 {"detail", problem}}
                                      .dump()};
    }
    ChatRecord chat =
        chats_.create(tx, principal_of(req), body["prompt"].get<std::string>(),
                      body.value("length", std::uint64_t{1200}), body.value("retries", false));
    std::string events = "/chats/" + chat.request_id + "/events";
    return idem::http::Response{
        201,
        {{"Content-Type", "application/json"}, {"Location", "/chats/" + chat.request_id}},
        nlohmann::json{{"request_id", chat.request_id}, {"events", events}}.dump()};
  }

  template <class Fn>
  void count(const std::string& request_id, Fn&& fn) {
    std::lock_guard<std::mutex> lock(counters_mutex_);
    fn(counters_[request_id]);
  }

  void wake() {
    {
      std::lock_guard<std::mutex> lock(hub_mutex_);
      ++version_;
    }
    hub_.notify_all();
  }

  // Waits until a local commit (or the poll interval, for other processes' commits).
  void wait_for_chunks(std::uint64_t seen_version) {
    std::unique_lock<std::mutex> lock(hub_mutex_);
    hub_.wait_for(lock, options_.poll, [&] { return version_ != seen_version || stopping_; });
  }

  std::uint64_t version() {
    std::lock_guard<std::mutex> lock(hub_mutex_);
    return version_;
  }

  // The committed chunks of a chat generated here, so that this process's streams need not
  // read back from the table what this process just wrote to it. Only chunks already committed
  // are in it; it starts at the offset the generation resumed at (earlier chunks: the table).
  struct LiveTail {
    std::vector<StoredChunk> chunks;  // contiguous, in offset order
    bool lost = false;                // the lease was lost: another owner writes from here on
  };

  std::shared_ptr<LiveTail> open_tail(const std::string& request_id) {
    auto tail = std::make_shared<LiveTail>();
    std::lock_guard<std::mutex> lock(hub_mutex_);
    tails_[request_id] = tail;
    return tail;
  }

  std::shared_ptr<LiveTail> find_tail(const std::string& request_id) {
    std::lock_guard<std::mutex> lock(hub_mutex_);
    auto it = tails_.find(request_id);
    return it == tails_.end() ? nullptr : it->second;
  }

  // Chunks after `after` from the live tail; nullopt when the tail cannot tell (it starts
  // later, is empty, or another process took the generation over): then read the table.
  std::optional<std::vector<StoredChunk>> tail_after(const LiveTail& tail,
                                                     std::optional<std::uint64_t> after,
                                                     std::size_t limit) {
    std::lock_guard<std::mutex> lock(hub_mutex_);
    const auto& c = tail.chunks;
    if (tail.lost || c.empty() || (after ? *after < c.front().offset : c.front().offset != 0)) {
      return std::nullopt;
    }
    auto it =
        after ? std::upper_bound(c.begin(), c.end(), *after,
                                 [](std::uint64_t v, const StoredChunk& x) { return v < x.offset; })
              : c.begin();
    std::vector<StoredChunk> out;
    for (; it != c.end() && out.size() < limit; ++it) out.push_back(*it);
    return out;
  }

  // After a failed generation: streams holding its tail go back to the table.
  void abandon_tail(const std::string& request_id) {
    {
      std::lock_guard<std::mutex> lock(hub_mutex_);
      auto it = tails_.find(request_id);
      if (it != tails_.end()) {
        it->second->lost = true;
        tails_.erase(it);
      }
    }
    wake();
  }

  // The generation thread: the model's pieces through ProducerDedup into the chunk table.
  void generate(const std::string& request_id) {
    auto chat = chats_.find(request_id);
    if (!chat) return;
    auto tail = open_tail(request_id);
    const std::string text = answer(chat->prompt, chat->length);
    idem::stream::ProducerDedup producer{request_id, chats_.resume_offset(request_id)};
    GeneratorOptions g;
    g.max_chunk = options_.max_chunk;
    g.retries = chat->retries;
    g.seed = stable_hash(owner_ + request_id);
    Generator gen{text, g};
    std::vector<StoredChunk> batch;
    std::uint64_t split = 0;
    auto last_renew = std::chrono::steady_clock::now();
    auto flush = [&] {
      if (!chats_.append(request_id, owner_, options_.lease, batch)) {
        std::lock_guard<std::mutex> lock(hub_mutex_);
        tail->lost = true;
        return false;
      }
      {
        std::lock_guard<std::mutex> lock(hub_mutex_);  // committed: visible to local streams
        for (auto& c : batch) tail->chunks.push_back(std::move(c));
        ++version_;
      }
      hub_.notify_all();
      batch.clear();
      last_renew = std::chrono::steady_clock::now();
      return true;
    };
    bool owned = true;
    while (owned && !stopping_) {
      auto piece = gen.next();
      if (!piece) break;
      auto c = producer.admit(piece->offset, piece->bytes);
      if (c) {
        batch.push_back({c->offset, std::string(c->body)});
        if (splits_character(text, c->end())) ++split;
      }
      // Commit before each pause of the model (what was produced is sent at once), when the
      // batch is full, and often enough to renew the lease while a takeover skips the prefix.
      bool renew = std::chrono::steady_clock::now() - last_renew > options_.lease / 3;
      bool pause = c && options_.token_delay.count() > 0;
      if (batch.size() >= options_.batch || pause || renew) owned = flush();
      if (pause && owned) std::this_thread::sleep_for(options_.token_delay);
    }
    // Counted before the finish: a stream that sees the chat done finds this generation's
    // counters already in (a flush below adds no piece).
    count(request_id, [&](ChatCounters& k) {
      ++k.generations;
      k.generator_retries += gen.retries();
      k.producer_dropped_bytes += producer.duplicate_bytes();
      k.producer_trimmed += producer.trimmed_chunks();
      k.split_characters += split;
    });
    if (owned && !stopping_ && (batch.empty() || flush())) {
      if (!chats_.finish(request_id, owner_, text.size())) {
        std::lock_guard<std::mutex> lock(hub_mutex_);
        tail->lost = true;
      }
    } else {
      std::lock_guard<std::mutex> lock(hub_mutex_);
      tail->lost = true;
    }
    {
      // Streams that hold the tail finish from it; new streams read the table.
      std::lock_guard<std::mutex> lock(hub_mutex_);
      tails_.erase(request_id);
    }
    wake();
  }

  Faults faults_of(const httplib::Request& req) const {
    Faults f = options_.faults;
    auto number = [&](const char* name, std::uint32_t& out) {
      if (!req.has_param(name)) return;
      out =
          static_cast<std::uint32_t>(std::strtoul(req.get_param_value(name).c_str(), nullptr, 10));
    };
    number("drop_every", f.drop_every);
    number("replay", f.replay);
    number("reorder", f.reorder);
    if (req.has_param("abort")) f.abort = req.get_param_value("abort") == "1";
    return f;
  }

  // One event stream (see the file comment).
  void events(const httplib::Request& req, httplib::Response& res) {
    const std::string request_id = req.matches[1].str();
    auto chat = chats_.find(request_id);
    if (!chat) return not_found(res);
    std::optional<std::uint64_t> after;
    if (req.has_header("Last-Event-ID")) {
      after = parse_last_event_id(request_id, req.get_header_value("Last-Event-ID"));
      if (!after) {
        return bad_request(res, "Last-Event-ID must be " + request_id + "_<offset>, got '" +
                                    req.get_header_value("Last-Event-ID") + "'");
      }
    }
    const Faults faults = faults_of(req);
    count(request_id, [](ChatCounters& k) { ++k.connections; });
    res.set_header("Cache-Control", "no-store");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, request_id, after, faults](std::size_t, httplib::DataSink& sink) mutable {
          return stream(request_id, after, faults, sink);
        });
  }

  // Every stream that ends before its done event is counted: `dropped` when the fault asked
  // for it, `broken` otherwise, so that each of a client's reconnects is explained by one. The
  // events are counted as each is written, so a broken stream's counts hold too.
  bool stream(const std::string& request_id, std::optional<std::uint64_t> after,
              const Faults& faults, httplib::DataSink& sink) {
    ChatCounters delta;  // this stream's counts not yet added to the chat's
    auto flush = [&] {
      count(request_id, [&](ChatCounters& k) { k.add(delta); });
      delta = ChatCounters{};
    };
    bool ended = false;  // the done event was written, or the drop counted
    bool complete = false;
    try {
      complete = stream(request_id, after, faults, sink, delta, flush, ended);
    } catch (const std::exception&) {
      // The store failed mid-stream: the connection ends, the client resumes from its
      // Last-Event-ID (counted as a broken stream).
      complete = false;
    }
    if (!ended) ++delta.broken;
    flush();
    return complete;
  }

  template <typename Flush>
  bool stream(const std::string& request_id, std::optional<std::uint64_t> after,
              const Faults& faults, httplib::DataSink& sink, ChatCounters& delta, Flush& flush,
              bool& ended) {
    std::string out;
    std::uint64_t fresh = 0;          // fresh events on this connection
    std::optional<StoredChunk> held;  // an event sent after the next one (reorder)
    bool remote_generating = false;
    auto last_write = std::chrono::steady_clock::now();
    auto write = [&](const StoredChunk& c) {
      out.clear();
      append_chunk_event(out, request_id, c.offset, c.body);
      if (!sink.write(out.data(), out.size())) return false;
      last_write = std::chrono::steady_clock::now();
      return true;
    };
    auto send = [&](const StoredChunk& c) {
      if (!write(c)) return false;
      ++delta.fresh_events;
      if (remote_generating) ++delta.live_remote;
      return true;
    };
    if (after && faults.replay > 0) {
      for (const auto& c : chats_.last_until(request_id, *after, faults.replay)) {
        if (!write(c)) return false;
        ++delta.replayed;
      }
    }
    std::shared_ptr<LiveTail> tail;
    bool done_seen = false;  // the chat was found done once: its rows are read once more
    while (!stopping_) {
      const std::uint64_t seen = version();
      if (!tail) tail = find_tail(request_id);
      std::optional<std::vector<StoredChunk>> local;
      if (tail) local = tail_after(*tail, after, 256);
      auto rows = local ? std::move(*local) : chats_.after(request_id, after, 256);
      for (auto& c : rows) {
        after = c.offset;
        ++fresh;
        if (held) {  // the pair's second event goes first
          if (!send(c)) return false;
          ++delta.reordered;
          if (!send(*held)) return false;
          held.reset();
        } else if (faults.reorder > 0 && fresh % faults.reorder == 0) {
          held = std::move(c);
        } else if (!send(c)) {
          return false;
        }
        if (faults.drop_every > 0 && fresh >= faults.drop_every && !held) break;
      }
      if (faults.drop_every > 0 && fresh >= faults.drop_every && !held) {
        ++delta.dropped;
        ended = true;
        if (faults.abort) return false;  // cpp-httplib closes without ending the chunked body
        flush();                         // counted before the client can see the end
        sink.done();                     // the stream ends early, every event delivered
        return true;
      }
      if (!rows.empty()) continue;
      auto chat = chats_.find(request_id);
      if (!chat) return false;
      if (chat->status == "done" && !done_seen) {
        // The rows were read before the status: the generator may have committed its last
        // rows and finished in between. Read them once more before the done event.
        done_seen = true;
        continue;
      }
      if (chat->status == "done") {
        if (held && !send(*held)) return false;
        out.clear();
        append_done_event(out, chat->answer_length);
        ended = true;
        flush();  // counted before the client can see the done event
        if (!sink.write(out.data(), out.size())) {
          ended = false;
          return false;
        }
        sink.done();
        return true;
      }
      remote_generating = chat->status == "generating" && chat->owner != owner_;
      if (chat->status == "pending" ||
          (chat->status == "generating" && chat->lease_until_ms < now_ms())) {
        ensure_generating(request_id);  // the owner died (or never started): take over
      }
      if (!sink.is_writable()) return false;
      if (std::chrono::steady_clock::now() - last_write > std::chrono::seconds(10)) {
        if (!sink.write(": keepalive\n\n", 13)) return false;
        last_write = std::chrono::steady_clock::now();
      }
      wait_for_chunks(seen);
    }
    return false;
  }

  Chats& chats_;
  ServerOptions options_;
  const std::string owner_;
  idem::http::Endpoint<Durable> create_;
  httplib::Server server_;
  std::thread thread_;
  int port_ = -1;
  socket_t listen_socket_ = -1;
  std::atomic<bool> stopping_{false};
  std::map<std::string, std::pair<std::string, std::string>> web_;  // path -> (type, body)

  std::mutex hub_mutex_;
  std::condition_variable hub_;
  std::uint64_t version_ = 0;
  std::map<std::string, std::shared_ptr<LiveTail>> tails_;  // chats generated here

  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::mutex workers_mutex_;
  std::vector<Worker> workers_;

  std::mutex counters_mutex_;
  std::map<std::string, ChatCounters> counters_;
};

}  // namespace ai_chat
