// SPDX-License-Identifier: MIT
// idem::rabbitmq::Publisher on rabbitmq-c: publisher confirms, republishing what was not
// confirmed with the same message id (client.hpp).
#include <amqp.h>
#include <amqp_framing.h>
#include <sys/time.h>

#include <map>

#include "connection.hpp"
#include "errors.hpp"
#include "idem/errors.hpp"
#include "idem/rabbitmq/client.hpp"

namespace idem::rabbitmq {
namespace {

using detail::bytes_of;
using detail::str;
using detail::timeout_until;
using Clock = std::chrono::steady_clock;

}  // namespace

class IDEM_LOCAL Publisher::Impl {
 public:
  explicit Impl(PublisherOptions options)
      : options_(std::move(options)), conn_(options_.connection, "Publisher") {
    if (options_.confirm_timeout.count() <= 0) {
      throw UsageError("idem::rabbitmq::Publisher: confirm_timeout must be positive");
    }
    if (options_.max_attempts == 0) {
      throw UsageError("idem::rabbitmq::Publisher: max_attempts must be positive");
    }
    conn_.set_setup([this] {
      amqp_confirm_select(conn_.state(), conn_.channel());
      conn_.check_last("confirm.select");
      next_seq_ = 1;
    });
  }

  // Refuses, before anything of the call is sent, what the broker would refuse after the
  // messages before it went out: AMQP's short strings (the message id, the content type, the
  // exchange, the routing key, header names) hold at most 255 bytes; a longer one made the
  // broker close the connection with the earlier messages of the call sent but unconfirmed.
  static void check(const OutgoingMessage& m, std::size_t index) {
    const std::string which = "idem::rabbitmq::Publisher: message " + std::to_string(index);
    if (m.message_id.empty()) {
      throw UsageError(which +
                       " needs a message_id (its global id, the same on every publish of it)");
    }
    auto short_string = [&](std::string_view what, std::string_view value) {
      if (value.size() > 255) {
        throw UsageError(which + ": its " + std::string(what) + " has " +
                         std::to_string(value.size()) +
                         " bytes, at most 255 (an AMQP short string)");
      }
    };
    short_string("message_id", m.message_id);
    short_string("content_type", m.content_type);
    short_string("exchange", m.exchange);
    short_string("routing_key", m.routing_key);
    for (const auto& header : m.headers) short_string("header name", header.first);
  }

  void publish(const std::vector<OutgoingMessage>& messages) {
    for (std::size_t i = 0; i < messages.size(); ++i) check(messages[i], i);
    if (messages.empty()) return;
    auto lock = conn_.lock();
    const std::size_t n = messages.size();
    // 0: to publish, 1: confirmed, 2: returned (unroutable).
    std::vector<char> state(n, 0);
    std::string returned_text;
    int returned_code = 0;
    bool any_sent = false;
    std::string last_error;
    for (std::uint32_t attempt = 1; attempt <= options_.max_attempts; ++attempt) {
      std::vector<std::size_t> todo;
      for (std::size_t i = 0; i < n; ++i) {
        if (state[i] == 0) todo.push_back(i);
      }
      if (todo.empty()) break;
      if (attempt > 1) stats_.republished += todo.size();
      try {
        conn_.ensure(lock, options_.connection.reconnect_backoff_max);
        round(messages, todo, state, any_sent, returned_code, returned_text);
      } catch (const StorageError& e) {
        // A lost connection, a timeout, the reconnect backoff: publish what is left again. The
        // broker refusing (unknown exchange, access refused) is not a matter of trying again.
        if (!e.retryable()) throw;
        last_error = e.what();
      }
    }
    conn_.touched();
    std::size_t unconfirmed = 0;
    for (char s : state) unconfirmed += s == 0 ? 1 : 0;
    if (unconfirmed > 0) {
      const std::string what = "publish of " + std::to_string(unconfirmed) + " of " +
                               std::to_string(n) + " messages after " +
                               std::to_string(options_.max_attempts) + " attempts";
      if (any_sent) {
        detail::throw_error(detail::Failure{detail::Failure::Kind::kUnconfirmed, what, last_error});
      }
      throw StorageUnavailable("rabbitmq: " + what + ": nothing could be sent: " + last_error);
    }
    if (returned_code != 0) {
      detail::throw_error(detail::Failure{detail::Failure::Kind::kUnroutable, "basic.publish",
                                          returned_text, 0, returned_code});
    }
  }

  template <class Fn>
  auto admin(Fn&& fn) {
    auto lock = conn_.lock();
    conn_.ensure(lock, options_.connection.reconnect_backoff_max);
    struct Touch {
      detail::Connection& c;
      ~Touch() { c.touched(); }
    } touch{conn_};
    return fn();
  }

  void declare_queue(const QueueOptions& q) {
    detail::validate(q);
    admin([&] { detail::declare_queue(conn_, q); });
  }

  void declare_exchange(std::string_view name, std::string_view type, bool durable) {
    if (name.empty()) throw UsageError("idem::rabbitmq: an exchange needs a name");
    admin([&] {
      amqp_exchange_declare(conn_.state(), conn_.channel(), bytes_of(name), bytes_of(type), 0,
                            durable ? 1 : 0, 0, 0, amqp_empty_table);
      conn_.check_last("exchange.declare " + std::string(name));
    });
  }

  void bind_queue(std::string_view queue, std::string_view exchange, std::string_view key) {
    admin([&] {
      amqp_queue_bind(conn_.state(), conn_.channel(), bytes_of(queue), bytes_of(exchange),
                      bytes_of(key), amqp_empty_table);
      conn_.check_last("queue.bind " + std::string(queue));
    });
  }

  QueueInfo queue_info(std::string_view queue) {
    return admin([&] {
      auto* ok = amqp_queue_declare(conn_.state(), conn_.channel(), bytes_of(queue), 1, 0, 0, 0,
                                    amqp_empty_table);
      conn_.check_last("queue.declare (passive) " + std::string(queue));
      return QueueInfo{ok->message_count, ok->consumer_count};
    });
  }

  std::uint32_t purge_queue(std::string_view queue) {
    return admin([&] {
      auto* ok = amqp_queue_purge(conn_.state(), conn_.channel(), bytes_of(queue));
      conn_.check_last("queue.purge " + std::string(queue));
      return ok->message_count;
    });
  }

  void delete_queue(std::string_view queue) {
    admin([&] {
      amqp_queue_delete(conn_.state(), conn_.channel(), bytes_of(queue), 0, 0);
      conn_.check_last("queue.delete " + std::string(queue));
    });
  }

  void delete_exchange(std::string_view exchange) {
    admin([&] {
      amqp_exchange_delete(conn_.state(), conn_.channel(), bytes_of(exchange), 0);
      conn_.check_last("exchange.delete " + std::string(exchange));
    });
  }

  void keep_alive() {
    auto lock = conn_.lock();
    conn_.heartbeat_if_due();
  }

  void close() {
    auto lock = conn_.lock();
    conn_.close();
  }

  PublisherStats stats() {
    auto lock = conn_.lock();
    PublisherStats s = stats_;
    s.connection = conn_.stats();
    return s;
  }

 private:
  // One round: publish `todo` back to back, then wait for their confirms. Confirmed messages
  // are marked 1, returned ones 2; nacked ones stay 0 (the next round publishes them again).
  // Throws when the connection fails or the confirms do not come in time.
  void round(const std::vector<OutgoingMessage>& messages, const std::vector<std::size_t>& todo,
             std::vector<char>& state, bool& any_sent, int& returned_code,
             std::string& returned_text) {
    amqp_connection_state_t st = conn_.state();
    std::map<std::uint64_t, std::size_t> waiting;  // confirm sequence number -> message
    for (std::size_t i : todo) {
      const OutgoingMessage& m = messages[i];
      amqp_basic_properties_t props{};
      props._flags = AMQP_BASIC_MESSAGE_ID_FLAG | AMQP_BASIC_DELIVERY_MODE_FLAG;
      props.message_id = bytes_of(m.message_id);
      props.delivery_mode = m.persistent ? 2 : 1;
      if (!m.content_type.empty()) {
        props._flags |= AMQP_BASIC_CONTENT_TYPE_FLAG;
        props.content_type = bytes_of(m.content_type);
      }
      std::vector<amqp_table_entry_t> headers;
      if (!m.headers.empty()) {
        for (const auto& [k, v] : m.headers) {
          amqp_table_entry_t e{};
          e.key = bytes_of(k);
          e.value.kind = AMQP_FIELD_KIND_UTF8;
          e.value.value.bytes = bytes_of(v);
          headers.push_back(e);
        }
        props._flags |= AMQP_BASIC_HEADERS_FLAG;
        props.headers = amqp_table_t{static_cast<int>(headers.size()), headers.data()};
      }
      const int rc =
          amqp_basic_publish(st, conn_.channel(), bytes_of(m.exchange), bytes_of(m.routing_key),
                             options_.mandatory ? 1 : 0, 0, &props, bytes_of(m.body));
      if (rc != AMQP_STATUS_OK) conn_.fail_status(rc, "basic.publish", any_sent);
      waiting.emplace(next_seq_++, i);
      any_sent = true;
      ++stats_.published;
    }
    const auto deadline = Clock::now() + options_.confirm_timeout;
    while (!waiting.empty()) {
      if (Clock::now() >= deadline) {
        conn_.fail_status(AMQP_STATUS_TIMEOUT, "waiting for publisher confirms", true);
      }
      timeval tv = timeout_until(deadline);
      amqp_frame_t frame;
      const int rc = amqp_simple_wait_frame_noblock(st, &frame, &tv);
      if (rc == AMQP_STATUS_TIMEOUT) continue;
      if (rc != AMQP_STATUS_OK) conn_.fail_status(rc, "waiting for publisher confirms", true);
      if (frame.frame_type != AMQP_FRAME_METHOD) continue;
      const amqp_method_t& method = frame.payload.method;
      conn_.fail_if_closed(method, "basic.publish", true);
      if (method.id == AMQP_BASIC_ACK_METHOD || method.id == AMQP_BASIC_NACK_METHOD) {
        const bool ack = method.id == AMQP_BASIC_ACK_METHOD;
        std::uint64_t tag = 0;
        bool multiple = false;
        if (ack) {
          const auto* a = static_cast<const amqp_basic_ack_t*>(method.decoded);
          tag = a->delivery_tag;
          multiple = a->multiple != 0;
        } else {
          const auto* a = static_cast<const amqp_basic_nack_t*>(method.decoded);
          tag = a->delivery_tag;
          multiple = a->multiple != 0;
        }
        auto first = multiple ? waiting.begin() : waiting.find(tag);
        auto last =
            multiple ? waiting.upper_bound(tag) : std::next(first, first == waiting.end() ? 0 : 1);
        for (auto it = first; it != last; ++it) {
          if (ack) {
            if (state[it->second] == 0) state[it->second] = 1;
            ++stats_.confirmed;
          } else {
            ++stats_.nacked;  // stays 0: the next round publishes it again
          }
        }
        waiting.erase(first, last);
      } else if (method.id == AMQP_BASIC_RETURN_METHOD) {
        // An unroutable mandatory message; its basic.ack follows. The content frames come
        // first: read them, and find the message by its id.
        const auto* ret = static_cast<const amqp_basic_return_t*>(method.decoded);
        const int code = ret->reply_code;
        const std::string text = str(ret->reply_text) + " (exchange '" + str(ret->exchange) +
                                 "', routing key '" + str(ret->routing_key) + "')";
        amqp_message_t returned;
        amqp_rpc_reply_t r = amqp_read_message(st, frame.channel, &returned, 0);
        conn_.check(r, "basic.return");
        const std::string id = (returned.properties._flags & AMQP_BASIC_MESSAGE_ID_FLAG)
                                   ? str(returned.properties.message_id)
                                   : std::string();
        amqp_destroy_message(&returned);
        for (const auto& [seq, i] : waiting) {
          if (messages[i].message_id == id && state[i] != 2) {
            state[i] = 2;
            ++stats_.returned;
            returned_code = code;
            returned_text = text;
            break;
          }
        }
      }
      if (!amqp_frames_enqueued(st)) amqp_maybe_release_buffers(st);
    }
  }

  PublisherOptions options_;
  detail::Connection conn_;
  std::uint64_t next_seq_ = 1;
  PublisherStats stats_;
};

Publisher::Publisher(PublisherOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
Publisher::~Publisher() = default;
Publisher::Publisher(Publisher&&) noexcept = default;
Publisher& Publisher::operator=(Publisher&&) noexcept = default;

void Publisher::publish(const OutgoingMessage& message) { impl_->publish({message}); }
void Publisher::publish(const std::vector<OutgoingMessage>& messages) { impl_->publish(messages); }
void Publisher::declare_queue(const QueueOptions& queue) { impl_->declare_queue(queue); }
void Publisher::declare_exchange(std::string_view name, std::string_view type, bool durable) {
  impl_->declare_exchange(name, type, durable);
}
void Publisher::bind_queue(std::string_view queue, std::string_view exchange,
                           std::string_view routing_key) {
  impl_->bind_queue(queue, exchange, routing_key);
}
QueueInfo Publisher::queue_info(std::string_view queue) { return impl_->queue_info(queue); }
std::uint32_t Publisher::purge_queue(std::string_view queue) { return impl_->purge_queue(queue); }
void Publisher::delete_queue(std::string_view queue) { impl_->delete_queue(queue); }
void Publisher::delete_exchange(std::string_view exchange) { impl_->delete_exchange(exchange); }
void Publisher::keep_alive() { impl_->keep_alive(); }
void Publisher::close() { impl_->close(); }
PublisherStats Publisher::stats() const { return impl_->stats(); }

}  // namespace idem::rabbitmq
