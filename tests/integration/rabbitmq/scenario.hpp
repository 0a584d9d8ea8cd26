// SPDX-License-Identifier: MIT
// The multi-process RabbitMQ scenarios' shared parts: the orders a producer publishes (with
// producer retries, poison messages and mismatches), the consumer processes' arguments, and
// the checks of what they left in the database and the side queues.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "idem/rabbitmq/client.hpp"
#include "idem/rabbitmq/consumer_loop.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "rabbit_support.hpp"
#include "support/processes.hpp"

namespace idem::test {

/// What the producer published.
struct Orders {
  std::vector<rabbitmq::OutgoingMessage> messages;  ///< in publish order; header x-seq unique
  std::set<std::string> ids;                        ///< distinct message ids
  std::set<std::string> poison;                     ///< ids whose handler always fails
  std::set<std::string> mismatched;                 ///< ids published again with another body
};

/// `n` orders for `queue`: every 10th id published again a little later (a producer retry: same
/// id, a new broker message), one poison message per 400, and three ids reused with another
/// body (a producer bug: parked, not applied). Each message has a unique `x-seq` header so the
/// test can tell broker messages apart across redeliveries.
inline Orders make_orders(const std::string& queue, int n) {
  Orders o;
  auto add = [&](const std::string& id, const std::string& body) {
    rabbitmq::OutgoingMessage m;
    m.routing_key = queue;
    m.message_id = id;
    m.body = body;
    m.headers = {{"x-seq", std::to_string(o.messages.size())}};
    o.messages.push_back(std::move(m));
  };
  auto body_of = [](int i) { return "{\"order\":" + std::to_string(i) + "}"; };
  for (int i = 0; i < n; ++i) {
    const std::string id = "order_" + std::to_string(i) + ":paid:v1";
    add(id, body_of(i));
    o.ids.insert(id);
    if (i % 10 == 9) add("order_" + std::to_string(i - 7) + ":paid:v1", body_of(i - 7));
    if (i % 600 == 550) {
      const std::string reused = "order_" + std::to_string(i - 50) + ":paid:v1";
      add(reused, "{\"order\":-1}");
      o.mismatched.insert(reused);
    }
    if (i % 400 == 123) {
      const std::string p = "poison_" + std::to_string(i);
      add(p, "poison " + std::to_string(i));
      o.ids.insert(p);
      o.poison.insert(p);
    }
  }
  return o;
}

/// The queue as the example declares it (its dead letters and parking too).
inline void declare_orders_queue(rabbitmq::Publisher& p, const std::string& queue) {
  rabbitmq::declare_dead_letters(p, queue);
  rabbitmq::declare_parking(p, queue);
  rabbitmq::QueueOptions q;
  q.name = queue;
  q.dead_letter_exchange = queue + ".dlx";
  p.declare_queue(q);
}

/// The example consumer's command line.
inline std::vector<std::string> consumer_args(const std::string& url, const std::string& queue,
                                              const std::string& group, const std::string& name,
                                              const std::string& db, const std::string& log,
                                              const std::vector<std::string>& extra) {
  std::vector<std::string> a{IDEM_RABBITMQ_CONSUMER_BIN,
                             "--amqp",
                             url,
                             "--queue",
                             queue,
                             "--group",
                             group,
                             "--consumer",
                             name,
                             "--db",
                             db,
                             "--log",
                             log,
                             "--max-attempts",
                             "3",
                             "--prefetch",
                             "32",
                             "--retry-delay-ms",
                             "100",
                             "--wait-ms",
                             "300",
                             "--heartbeat-s",
                             "5"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

/// One delivery as a consumer logged it.
struct LoggedDelivery {
  std::string tag, message_id, seq;
  bool redelivered = false;
  unsigned count = 1;
};

/// The deliveries logged in `path` (connection:tag redelivered count id seq).
inline std::vector<LoggedDelivery> read_log(const std::string& path) {
  std::vector<LoggedDelivery> out;
  std::istringstream in(slurp(path));
  LoggedDelivery d;
  int redelivered = 0;
  while (in >> d.tag >> redelivered >> d.count >> d.message_id >> d.seq) {
    d.redelivered = redelivered != 0;
    out.push_back(d);
  }
  return out;
}

/// Checks what the consumers left: exactly one effect row per consumed id, consumed and
/// dead-lettered disjoint and together the published ids, each poison message dead-lettered
/// once after 3 attempts, the mismatched ids parked, the queue empty.
inline void check_orders_outcome(
    rabbitmq::Publisher& p, const std::string& queue, const std::string& db, const Orders& orders,
    const std::function<std::vector<rabbitmq::Message>(const std::string&)>& drain) {
  EXPECT_EQ(0u, p.queue_info(queue).messages);
  EXPECT_EQ(0u, p.queue_info(queue).consumers);
  sqlite::Database database{db};
  std::map<std::string, long> effects;
  database.read([&](sqlite::Session& s) {
    auto st = s.prepare("SELECT message_id, count(*) FROM effect GROUP BY message_id");
    while (st.step()) effects[st.column_bytes(0)] = static_cast<long>(st.column_int64(1));
  });
  std::set<std::string> dead;
  std::size_t dead_messages = 0;
  for (const auto& m : drain(queue + ".dead")) {
    ++dead_messages;
    dead.insert(m.message_id);
    ASSERT_NE(nullptr, m.header("x-idem-attempts"));
    EXPECT_EQ("3", *m.header("x-idem-attempts")) << m.message_id;
  }
  EXPECT_EQ(orders.poison, dead);
  EXPECT_EQ(orders.poison.size(), dead_messages) << "each poison message dead-lettered once";
  std::set<std::string> consumed_or_dead = dead;
  for (const auto& [id, n] : effects) {
    EXPECT_EQ(1, n) << id << " has " << n << " effect rows";
    EXPECT_EQ(0u, dead.count(id)) << id << " both consumed and dead-lettered";
    consumed_or_dead.insert(id);
  }
  EXPECT_EQ(orders.ids, consumed_or_dead);
  EXPECT_EQ(orders.ids.size() - orders.poison.size(), effects.size());
  std::set<std::string> parked;
  for (const auto& m : drain(queue + ".parked")) parked.insert(m.message_id);
  EXPECT_EQ(orders.mismatched, parked);
}

}  // namespace idem::test
