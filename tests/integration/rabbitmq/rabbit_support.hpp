// SPDX-License-Identifier: MIT
// Helpers of the RabbitMQ tests: the broker URL, unique queues removed afterwards, draining.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "idem/rabbitmq/client.hpp"
#include "support/test_env.hpp"

namespace idem::test {

/// Options for a connection to the test broker, failing fast when it is away.
inline rabbitmq::ConnectionOptions rabbit_connection(const std::string& url) {
  rabbitmq::ConnectionOptions c;
  c.url = url;
  c.heartbeat = std::chrono::seconds(10);
  c.connect_timeout = std::chrono::milliseconds(2000);
  c.rpc_timeout = std::chrono::milliseconds(5000);
  c.reconnect_backoff = std::chrono::milliseconds(50);
  c.reconnect_backoff_max = std::chrono::milliseconds(500);
  return c;
}

/// A fixture with the broker URL, a Publisher, and queues deleted at the end.
class RabbitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(url_, "IDEM_TEST_RABBITMQ_URL");
    rabbitmq::PublisherOptions po;
    po.connection = rabbit_connection(url_);
    publisher_ = std::make_unique<rabbitmq::Publisher>(po);
  }
  void TearDown() override {
    if (!publisher_) return;
    for (const auto& q : queues_) {
      try {
        publisher_->delete_queue(q);
      } catch (const std::exception&) {
      }
    }
    for (const auto& x : exchanges_) {
      try {
        publisher_->delete_exchange(x);
      } catch (const std::exception&) {
      }
    }
  }

  /// A unique queue name, deleted (with `<name>.dead`, `.parked` and `.dlx`) at the end.
  std::string queue_name(const std::string& prefix = "idem-test") {
    std::string q = unique_name(prefix);
    for (const char* suffix : {"", ".dead", ".parked"}) queues_.push_back(q + suffix);
    exchanges_.push_back(q + ".dlx");
    return q;
  }

  /// Consumer options for `queue` on the test broker.
  rabbitmq::QueueConsumerOptions consumer_options(const std::string& queue,
                                                  std::uint16_t prefetch = 32) {
    rabbitmq::QueueConsumerOptions o;
    o.connection = rabbit_connection(url_);
    o.queue.name = queue;
    o.prefetch = prefetch;
    return o;
  }

  /// Declares a durable classic queue `name`.
  void declare(const std::string& name) {
    rabbitmq::QueueOptions q;
    q.name = name;
    publisher_->declare_queue(q);
  }

  /// Publishes {id, body} pairs to `queue` through the default exchange.
  void publish(const std::string& queue,
               const std::vector<std::pair<std::string, std::string>>& messages) {
    std::vector<rabbitmq::OutgoingMessage> out;
    for (const auto& [id, body] : messages) {
      rabbitmq::OutgoingMessage m;
      m.routing_key = queue;
      m.message_id = id;
      m.body = body;
      out.push_back(std::move(m));
    }
    publisher_->publish(out);
  }

  /// Every message of `queue` (acked), until none comes for `quiet`.
  std::vector<rabbitmq::Message> drain(
      const std::string& queue, std::chrono::milliseconds quiet = std::chrono::milliseconds(300)) {
    rabbitmq::QueueConsumer c{consumer_options(queue, 200)};
    std::vector<rabbitmq::Message> all;
    for (;;) {
      auto batch = c.receive(200, quiet);
      if (batch.empty()) break;
      std::vector<const rabbitmq::Message*> acks;
      for (const auto& m : batch) acks.push_back(&m);
      c.ack(acks);
      all.insert(all.end(), batch.begin(), batch.end());
    }
    return all;
  }

  std::string url_;
  std::unique_ptr<rabbitmq::Publisher> publisher_;
  std::vector<std::string> queues_, exchanges_;
};

/// Polls `done` every 10 ms up to `limit`. @return its last answer.
inline bool eventually(const std::function<bool()>& done,
                       std::chrono::milliseconds limit = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

}  // namespace idem::test
