// SPDX-License-Identifier: MIT
// The non-template parts of consumer_loop.hpp: ids, delivery counts, dead-letter and parking
// destinations.
#include "idem/rabbitmq/consumer_loop.hpp"

#include <limits>

#include "idem/key.hpp"

namespace idem::rabbitmq {

std::function<std::string(const Message&)> business_id_from_headers(std::string biz_no,
                                                                    std::string event,
                                                                    std::string version) {
  return [biz_no = std::move(biz_no), event = std::move(event),
          version = std::move(version)](const Message& m) -> std::string {
    const std::string* b = m.header(biz_no);
    const std::string* e = m.header(event);
    const std::string* v = m.header(version);
    if (b == nullptr || e == nullptr || v == nullptr || v->empty()) return {};
    if (v->find_first_not_of("0123456789") != std::string::npos) return {};
    try {
      return make_message_id(*b, *e, std::stoull(*v));
    } catch (const std::exception&) {
      return {};  // a part breaks a key rule, or the version overflows
    }
  };
}

std::string message_id_of(const Message& m, const MessageIdRule& rule) {
  if (!m.message_id.empty()) return m.message_id;
  if (!rule.header.empty()) {
    if (const std::string* h = m.header(rule.header); h != nullptr && !h->empty()) return *h;
  }
  if (rule.build) return rule.build(m);
  return {};
}

std::uint32_t delivery_count_of(const Message& m) noexcept {
  if (m.x_delivery_count) {
    const std::uint64_t limit = std::numeric_limits<std::uint32_t>::max() - 1;
    return static_cast<std::uint32_t>(std::min(*m.x_delivery_count, limit) + 1);
  }
  return m.redelivered ? 2 : 1;
}

Deliveries::Deliveries(const std::vector<Message>& batch, const MessageIdRule& rule) {
  const std::size_t n = batch.size();
  ids_.reserve(n);
  fingerprints_.reserve(n);
  deliveries_.reserve(n);
  for (const Message& m : batch) {
    ids_.push_back(message_id_of(m, rule));
    fingerprints_.push_back(fingerprint(m.body));
  }
  for (std::size_t i = 0; i < n; ++i) {
    deliveries_.push_back(
        Delivery{ids_[i], fingerprints_[i], batch[i].body, delivery_count_of(batch[i])});
  }
}

Destination declare_dead_letters(Publisher& publisher, std::string_view queue) {
  const std::string q(queue);
  publisher.declare_exchange(q + ".dlx", "direct", true);
  QueueOptions dead;
  dead.name = q + ".dead";
  publisher.declare_queue(dead);
  publisher.bind_queue(dead.name, q + ".dlx", q);
  return Destination{q + ".dlx", q};
}

Destination declare_parking(Publisher& publisher, std::string_view queue) {
  QueueOptions parked;
  parked.name = std::string(queue) + ".parked";
  publisher.declare_queue(parked);
  return Destination{"", parked.name};
}

std::function<void(const DeadLetter&)> dead_letter_sink(Publisher& publisher, Destination to) {
  return [&publisher, to = std::move(to)](const DeadLetter& d) {
    OutgoingMessage m;
    m.exchange = to.exchange;
    m.routing_key = to.routing_key;
    // The message-id property is a short string (255 bytes); an id that cannot be a key may
    // be anything, so its full text travels in a header.
    m.message_id =
        d.message_id.empty() || d.message_id.size() > 255 ? "(invalid message id)" : d.message_id;
    m.body = d.payload;
    m.headers = {{"x-idem-error", d.error},
                 {"x-idem-attempts", std::to_string(d.attempts)},
                 {"x-idem-group", d.group},
                 {"x-idem-message-id", d.message_id}};
    publisher.publish(m);
  };
}

}  // namespace idem::rabbitmq
