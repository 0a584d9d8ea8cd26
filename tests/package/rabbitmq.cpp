// SPDX-License-Identifier: MIT
// Consumer of idem::rabbitmq (RabbitMQ client); nothing listens on port 1.
#include <idem/rabbitmq/client.hpp>

#include "consumer.hpp"

int main() {
  check_version();
  idem::rabbitmq::PublisherOptions o;
  o.connection.url = "amqp://guest:guest@127.0.0.1:1/";
  o.max_attempts = 1;
  idem::rabbitmq::Publisher publisher{o};
  idem::rabbitmq::OutgoingMessage m;
  m.routing_key = "orders";
  m.message_id = "order_1";
  try {
    publisher.publish(m);
    CONSUMER_CHECK(false);
  } catch (const idem::StorageUnavailable& e) {
    check_typed(e, idem::errc::kStoreUnavailable);
  }
  std::printf("rabbitmq: unreachable broker reported as store_unavailable\n");
  return 0;
}
