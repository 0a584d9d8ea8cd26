// SPDX-License-Identifier: MIT
// idem::rabbitmq: a small RabbitMQ (AMQP 0-9-1) client for idempotent consumer loops.
//
// File: rabbitmq/client.hpp
//
// What a consumer loop needs, on rabbitmq-c (never included here):
//
//   QueueConsumer  one connection and one channel subscribed to one queue: declare (or check)
//                  the queue, `basic.qos` prefetch, `basic.consume` with manual acks;
//                  `receive` a batch, `ack` / `nack` / `reject` deliveries.
//   Publisher      one connection with a channel in confirm mode: `publish` waits for the
//                  broker's confirm and publishes again, with the same `message_id`, what was not
//                  confirmed (nack, lost connection, timeout); queue and exchange declarations.
//
// RabbitMQ recommends separate connections for publishing and consuming (a publisher the broker
// throttles must not stall acks), hence two classes.
//
// Reconnecting. Both connect on first use and, after a failure, on the next call once the
// reconnect backoff has passed (`reconnect_backoff`, doubled after each failed attempt up to
// `reconnect_backoff_max`, reset by a success); the channel's setup (declare, qos, consume,
// confirm.select) runs again on every new connection. Deliveries carry the connection they came
// from (`Message::connection`): when it is gone, the broker has already returned its unacked
// messages to the queue, so settling such a delivery sends nothing and answers false. The
// message comes back, flagged `redelivered`, and idem's consume record answers it as a
// duplicate if it was consumed.
//
// Heartbeats. rabbitmq-c sends and checks heartbeats only while the application is inside one
// of its calls (waiting for a frame, publishing). A loop busy in a long handler calls nothing,
// and the broker drops a connection it has not heard from for about two heartbeat intervals.
// So each connection has a heartbeat thread (`ConnectionOptions::heartbeat_thread`, on by
// default): every interval / 4 it sends a heartbeat frame if the connection saw no call of ours
// for half an interval. Calls and the thread share one mutex; the thread never reads, so
// deliveries stay in order, and a thread blocked in `receive` is inside rabbitmq-c, which then
// heartbeats itself. Without the thread, keep every handler well under the interval or call
// `keep_alive()` from it.
//
// Errors are idem exceptions, translated in one place (src/rabbitmq/errors.cpp):
// StorageUnavailable (refused, reset, closed by the broker, heartbeat timeout, waiting for the
// reconnect backoff), StorageTimeout (an RPC without answer), OutcomeUnknown (a publish sent but
// never confirmed: it may be in the queue; publishing it again is safe because consumers
// de-duplicate by message id), StorageError (the broker refused: access refused, unknown queue,
// inequivalent queue arguments, an unroutable mandatory publish), UsageError (bad URL or option).
//
// @code
//   idem::rabbitmq::QueueConsumerOptions o;
//   o.connection.url = "amqp://guest:guest@127.0.0.1:5672";
//   o.queue.name = "orders";
//   o.prefetch = 32;
//   idem::rabbitmq::QueueConsumer broker{o};
//   for (;;) {
//     auto batch = broker.receive(32, std::chrono::seconds(1));
//     for (auto& m : batch) if (handle(m)) broker.ack(m); else broker.nack(m, true);
//   }
// @endcode
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/export.hpp"

namespace idem::rabbitmq {

/// Message headers, in order. Values are text: strings as they are, integers in decimal,
/// booleans as "true" / "false"; headers of other kinds (tables, arrays, floats) are left out.
using Headers = std::vector<std::pair<std::string, std::string>>;

/// How to reach the broker and keep the connection.
struct ConnectionOptions {
  /// `amqp://[user[:password]@]host[:port][/vhost]` (the AMQP URI scheme: percent-escapes
  /// decoded; port 5672, user and password "guest" by default; no path means vhost "/", the
  /// path "/" means the vhost "" and "/%2F" the vhost "/"). `amqps://` (port 5671 by default)
  /// connects over TLS 1.2 or later and authenticates the broker: its certificate must chain
  /// to `tls_ca` (else the system's trust store) and name the URL's host.
  std::string url = "amqp://guest:guest@127.0.0.1:5672";
  /// amqps://: the CA file (PEM) the broker's certificate must chain to; empty: the system's
  /// trust store. A certificate that does not chain or name the host is a non-retryable
  /// StorageError. Setting it with an amqp:// URL is a UsageError.
  std::string tls_ca;
  /// amqps://: a client certificate (PEM) and its key, for brokers that ask for one
  /// (`ssl_options.verify = verify_peer`); both or neither.
  std::string tls_cert;
  /// The key of `tls_cert` (PEM, unencrypted).
  std::string tls_key;
  /// Heartbeat interval requested of the broker (it may lower it); 0 disables heartbeats.
  std::chrono::seconds heartbeat{30};
  /// Send heartbeats from a thread while no call of ours runs (see the file comment).
  bool heartbeat_thread = true;
  /// TCP connect and AMQP handshake, each. Positive, at most a day (as rpc_timeout and
  /// reconnect_backoff_max; a UsageError otherwise).
  std::chrono::milliseconds connect_timeout{2000};
  /// Longest wait for the answer of a synchronous method (declare, qos, consume, channel.open).
  /// The connection is dropped when it passes. Positive, at most a day.
  std::chrono::milliseconds rpc_timeout{5000};
  /// Wait before the first reconnect after a failure; doubled after each failed attempt.
  std::chrono::milliseconds reconnect_backoff{100};
  /// Longest wait between reconnect attempts.
  std::chrono::milliseconds reconnect_backoff_max{5000};
  /// The `connection_name` the broker shows (rabbitmqctl list_connections); may be empty.
  std::string name;
};

/// Classic queues flag a redelivery (`redelivered`); quorum queues also count it
/// (`x-delivery-count`) and can dead-letter after a delivery limit.
enum class QueueType { kClassic, kQuorum };

/// A queue to declare (or, with `declare` false, to check).
struct QueueOptions {
  /// The queue name. Must not be empty.
  std::string name;
  /// `x-queue-type`.
  QueueType type = QueueType::kClassic;
  /// Declare the queue (creates it, or checks that an existing one has these arguments);
  /// false: only check that it exists (passive declare).
  bool declare = true;
  /// Survives a broker restart (quorum queues always do). Messages survive with it only when
  /// published persistent (OutgoingMessage::persistent).
  bool durable = true;
  /// `x-dead-letter-exchange`: where the *broker* sends messages rejected without requeue,
  /// expired, or over the delivery limit. idem's own dead letters go through
  /// ConsumerOptions::dead_letter instead (see consumer_loop.hpp). Empty: none.
  std::string dead_letter_exchange;
  /// `x-dead-letter-routing-key` (empty: the message's own routing key).
  std::string dead_letter_routing_key;
  /// Quorum queues: `x-delivery-limit`, deliveries after which the broker dead-letters (or
  /// drops) a message. Every requeue counts, a ConsumerLoop's kRetryLater ones too (a message
  /// busy under another consumer's claim is requeued every `retry_delay` until that claim ends:
  /// up to lease / retry_delay times, ~150 with the defaults), so keep it above
  /// ConsumerOptions::max_attempts plus that, or leave it 0, so idem decides first. 0: none.
  std::uint32_t delivery_limit = 0;
};

/// One delivery, as QueueConsumer::receive returns it.
struct Message {
  /// The payload.
  std::string body;
  /// The `message-id` property ("" when the publisher set none).
  std::string message_id;
  /// The `content-type` property ("" when unset).
  std::string content_type;
  /// The `headers` property.
  Headers headers;
  /// The exchange it was published to ("" for the default exchange).
  std::string exchange;
  /// The routing key it was published with.
  std::string routing_key;
  /// The broker's redelivery flag: it may have been delivered before (to this consumer or
  /// another) and was not acked. Classic queues say nothing more; see delivery_count().
  bool redelivered = false;
  /// Quorum queues: the `x-delivery-count` header (returns before this delivery), when set.
  std::optional<std::uint64_t> x_delivery_count;
  /// The delivery tag on its channel.
  std::uint64_t delivery_tag = 0;
  /// The connection (and channel) that delivered it; settling needs that one alive.
  std::uint64_t connection = 0;

  /// The value of header `name`, or nullptr.
  const std::string* header(std::string_view name) const noexcept {
    for (const auto& [k, v] : headers) {
      if (k == name) return &v;
    }
    return nullptr;
  }
};

/// Options of a QueueConsumer.
struct QueueConsumerOptions {
  /// The broker and the connection's behaviour.
  ConnectionOptions connection;
  /// The queue to consume (declared, or checked, on every new connection).
  QueueOptions queue;
  /// `basic.qos` prefetch count: most unacked deliveries the broker hands this consumer.
  /// Must be positive.
  std::uint16_t prefetch = 32;
  /// The consumer tag; empty: the broker makes one.
  std::string consumer_tag;
};

/// Counters of a QueueConsumer or Publisher connection.
struct ConnectionStats {
  std::uint64_t connects = 0;  ///< connections opened (the first one included)
  std::uint64_t connection_losses =
      0;                              ///< live connections that failed or were closed by the broker
  std::uint64_t failed_connects = 0;  ///< connect attempts that failed
  std::uint64_t thread_heartbeats = 0;  ///< heartbeat frames the heartbeat thread sent
};

/// Counters of a QueueConsumer.
struct QueueConsumerStats {
  ConnectionStats connection;       ///< connects, losses, heartbeats
  std::uint64_t deliveries = 0;     ///< messages received
  std::uint64_t redelivered = 0;    ///< of which flagged redelivered
  std::uint64_t acked = 0;          ///< deliveries acked (a multiple ack counts each)
  std::uint64_t nacked = 0;         ///< deliveries nacked (requeued or not)
  std::uint64_t rejected = 0;       ///< deliveries rejected
  std::uint64_t stale_settles = 0;  ///< settles of deliveries whose connection was gone
};

/// A consumer of one queue (see the file comment). Not copyable, movable. Calls are serialised
/// by a mutex (acks may come from worker threads), but receive from one thread.
class IDEM_EXPORT QueueConsumer {
 public:
  /// Checks the options; connects on first use.
  /// @throws idem::UsageError for a bad URL, an empty queue name, prefetch 0, a bad timeout.
  explicit QueueConsumer(QueueConsumerOptions options);
  /// Closes the connection (unacked deliveries return to the queue).
  ~QueueConsumer();
  /// Takes over `other`'s connection (`other` is left without one).
  QueueConsumer(QueueConsumer&& other) noexcept;
  /// Takes over `other`'s connection, closing this one's.
  QueueConsumer& operator=(QueueConsumer&& other) noexcept;
  QueueConsumer(const QueueConsumer&) = delete;
  QueueConsumer& operator=(const QueueConsumer&) = delete;

  /// Connects now if not connected (declare, qos, consume).
  /// @throws idem::StorageUnavailable, idem::StorageTimeout, idem::StorageError.
  void connect();

  /// Waits up to `wait` for a first delivery, then goes on collecting until `max` deliveries,
  /// or until `linger` has passed since the first, or, with `linger` 0, until none is already
  /// waiting. Connects (after the reconnect backoff, within `wait`) if needed.
  /// @return the deliveries, in order (empty when none came).
  /// @throws idem::StorageUnavailable when the connection is lost or cannot be made (its
  ///         unacked deliveries return to the queue; the next call reconnects), StorageTimeout,
  ///         StorageError (the broker refused the setup, or cancelled the consumer).
  std::vector<Message> receive(std::size_t max, std::chrono::milliseconds wait,
                               std::chrono::milliseconds linger = std::chrono::milliseconds(0));

  /// basic.ack of one delivery. @return false when its connection is gone (nothing sent: the
  /// broker requeued it) or the send failed (the connection is dropped: same).
  bool ack(const Message& m);
  /// Acks several deliveries: one `basic.ack` with `multiple` when they are every unsettled
  /// delivery up to the last of them, else one each. @return deliveries acked.
  std::size_t ack(const std::vector<const Message*>& messages);
  /// basic.nack (`requeue`: back to the queue, flagged redelivered; else dead-lettered by the
  /// broker if the queue has a dead-letter exchange, or dropped). @return as ack.
  bool nack(const Message& m, bool requeue = true);
  /// basic.reject (as nack). @return as ack.
  bool reject(const Message& m, bool requeue = false);

  /// Sends a heartbeat now if one is due (for long handlers without the heartbeat thread).
  void keep_alive();
  /// The current connection's id (Message::connection of its deliveries); 0 when none.
  std::uint64_t connection() const;
  /// Unsettled deliveries of the current connection.
  std::size_t unsettled() const;
  /// Closes the connection now (unacked deliveries return to the queue); a later call
  /// reconnects.
  void close();
  /// A snapshot of the counters.
  QueueConsumerStats stats() const;
  /// The options in force.
  const QueueConsumerOptions& options() const noexcept;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

/// A message to publish.
struct OutgoingMessage {
  /// The exchange; "" is the default exchange (routing key = queue name).
  std::string exchange;
  /// The routing key.
  std::string routing_key;
  /// The `message-id` property: the message's global id, the same on every publish of it.
  std::string message_id;
  /// The payload.
  std::string body;
  /// The `headers` property (string values).
  Headers headers;
  /// The `content-type` property ("" leaves it unset).
  std::string content_type;
  /// delivery-mode 2 (persistent: survives a broker restart in a durable queue) or 1.
  bool persistent = true;
};

/// Options of a Publisher.
struct PublisherOptions {
  /// The broker and the connection's behaviour.
  ConnectionOptions connection;
  /// Longest wait for the confirms of one publish round. Must be positive.
  std::chrono::milliseconds confirm_timeout{5000};
  /// Publish rounds for the messages of one call (the first included) before giving up:
  /// a round publishes what is not yet confirmed, on a new connection if needed. Positive.
  std::uint32_t max_attempts = 5;
  /// `mandatory`: a message no queue is bound to receive comes back (basic.return) and the
  /// call throws StorageError instead of the broker dropping it silently.
  bool mandatory = true;
};

/// Counters of a Publisher.
struct PublisherStats {
  ConnectionStats connection;     ///< connects, losses, heartbeats
  std::uint64_t published = 0;    ///< basic.publish frames sent (republishes included)
  std::uint64_t confirmed = 0;    ///< messages the broker confirmed
  std::uint64_t republished = 0;  ///< publishes of a message after an unconfirmed one
  std::uint64_t nacked = 0;       ///< broker nacks (the message was published again)
  std::uint64_t returned = 0;     ///< unroutable messages returned by the broker
};

/// What a passive queue declare tells.
struct QueueInfo {
  std::uint32_t messages = 0;   ///< messages ready (not counting delivered, unacked ones)
  std::uint32_t consumers = 0;  ///< consumers subscribed
};

/// A publisher with confirms (see the file comment). Not copyable, movable; calls are
/// serialised by a mutex.
class IDEM_EXPORT Publisher {
 public:
  /// Checks the options; connects on first use. @throws idem::UsageError.
  explicit Publisher(PublisherOptions options);
  /// Closes the connection.
  ~Publisher();
  /// Takes over `other`'s connection (`other` is left without one).
  Publisher(Publisher&& other) noexcept;
  /// Takes over `other`'s connection, closing this one's.
  Publisher& operator=(Publisher&& other) noexcept;
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  /// Publishes one message and waits for its confirm (see publish(vector)).
  void publish(const OutgoingMessage& message);
  /// Publishes the messages back to back, then waits for their confirms; publishes again (same
  /// message ids) those not confirmed, up to `max_attempts` rounds. A message may therefore
  /// reach the queue more than once: consumers de-duplicate by message id.
  /// @throws idem::OutcomeUnknown when some were sent but never confirmed (they may be in the
  ///         queue: publish them again), idem::StorageUnavailable when none could be sent,
  ///         idem::StorageError for an unroutable mandatory message (after the others were
  ///         confirmed), idem::UsageError for an empty message id or a message id, content
  ///         type, exchange, routing key or header name over 255 bytes (before anything is sent).
  void publish(const std::vector<OutgoingMessage>& messages);

  /// Declares a queue (see QueueOptions).
  void declare_queue(const QueueOptions& queue);
  /// Declares an exchange (`type`: direct, fanout, topic, headers).
  void declare_exchange(std::string_view name, std::string_view type = "direct",
                        bool durable = true);
  /// Binds `queue` to `exchange` with `routing_key`.
  void bind_queue(std::string_view queue, std::string_view exchange, std::string_view routing_key);
  /// Passive declare. @throws idem::StorageError when the queue does not exist.
  QueueInfo queue_info(std::string_view queue);
  /// Drops the ready messages of `queue`. @return how many.
  std::uint32_t purge_queue(std::string_view queue);
  /// Deletes a queue (and its messages); nothing when it does not exist.
  void delete_queue(std::string_view queue);
  /// Deletes an exchange; nothing when it does not exist.
  void delete_exchange(std::string_view exchange);

  /// Sends a heartbeat now if one is due (for a publisher idle between publishes without the
  /// heartbeat thread).
  void keep_alive();
  /// Closes the connection now; a later call reconnects.
  void close();
  /// A snapshot of the counters.
  PublisherStats stats() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::rabbitmq
