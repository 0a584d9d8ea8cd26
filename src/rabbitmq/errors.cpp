// SPDX-License-Identifier: MIT
// The one place where rabbitmq-c and broker failures become idem exceptions (see errors.hpp).
#include "errors.hpp"

#include <amqp.h>

#include <string>

#include "idem/errors.hpp"

namespace idem::rabbitmq::detail {
namespace {

std::string compose(const Failure& f, std::string_view label) {
  std::string what = "rabbitmq: ";
  what.append(f.context);
  what.append(": ");
  what.append(label);
  if (!f.message.empty()) {
    what.append(": ");
    what.append(f.message);
  }
  return what;
}

// AMQP 0-9-1 reply codes by name, for messages.
std::string_view reply_name(int code) noexcept {
  switch (code) {
    case 311:
      return "CONTENT_TOO_LARGE";
    case 312:
      return "NO_ROUTE";
    case 313:
      return "NO_CONSUMERS";
    case 320:
      return "CONNECTION_FORCED";
    case 402:
      return "INVALID_PATH";
    case 403:
      return "ACCESS_REFUSED";
    case 404:
      return "NOT_FOUND";
    case 405:
      return "RESOURCE_LOCKED";
    case 406:
      return "PRECONDITION_FAILED";
    case 501:
      return "FRAME_ERROR";
    case 502:
      return "SYNTAX_ERROR";
    case 503:
      return "COMMAND_INVALID";
    case 504:
      return "CHANNEL_ERROR";
    case 505:
      return "UNEXPECTED_FRAME";
    case 506:
      return "RESOURCE_ERROR";
    case 530:
      return "NOT_ALLOWED";
    case 540:
      return "NOT_IMPLEMENTED";
    case 541:
      return "INTERNAL_ERROR";
  }
  return "reply";
}

}  // namespace

bool transient_reply(int reply_code, std::string_view reply_text) noexcept {
  if (reply_code == 320) return true;
  if (reply_code != 406) return false;
  return reply_text.find("delivery acknowledgement") != std::string_view::npos ||
         reply_text.find("unknown delivery tag") != std::string_view::npos;
}

void throw_error(const Failure& f) {
  using Kind = Failure::Kind;
  switch (f.kind) {
    case Kind::kLibrary: {
      const std::string label = amqp_error_string2(f.status);
      switch (f.status) {
        case AMQP_STATUS_TIMEOUT:
          if (f.write_may_apply) {
            throw OutcomeUnknown(compose(f, label + "; the publish may have reached the queue"));
          }
          throw StorageTimeout(compose(f, label));
        case AMQP_STATUS_CONNECTION_CLOSED:
        case AMQP_STATUS_SOCKET_ERROR:
        case AMQP_STATUS_SOCKET_CLOSED:
        case AMQP_STATUS_HEARTBEAT_TIMEOUT:
        case AMQP_STATUS_HOSTNAME_RESOLUTION_FAILED:
        case AMQP_STATUS_TCP_ERROR:
        case AMQP_STATUS_TCP_SOCKETLIB_INIT_ERROR:
        case AMQP_STATUS_SSL_ERROR:
        case AMQP_STATUS_SSL_CONNECTION_FAILED:
          if (f.write_may_apply) {
            throw OutcomeUnknown(compose(f, label + "; the publish may have reached the queue"));
          }
          throw StorageUnavailable(compose(f, label));
        default:
          // Corrupt data, unknown methods, bad parameters, no memory: not a matter of waiting.
          throw StorageError(compose(f, label));
      }
    }
    case Kind::kServer: {
      const std::string label = "broker closed with " + std::to_string(f.reply_code) + " " +
                                std::string(reply_name(f.reply_code));
      if (transient_reply(f.reply_code, f.message)) {
        if (f.write_may_apply) {
          throw OutcomeUnknown(compose(f, label + "; the publish may have reached the queue"));
        }
        throw StorageUnavailable(compose(f, label));
      }
      throw StorageError(compose(f, label));
    }
    case Kind::kBackoff:
      throw StorageUnavailable(compose(f, "not connected (waiting for the reconnect backoff)"));
    case Kind::kUnroutable:
      throw StorageError(compose(f, "unroutable: no queue is bound for it (" +
                                        std::to_string(f.reply_code) + " " +
                                        std::string(reply_name(f.reply_code)) + ")"));
    case Kind::kUnconfirmed:
      throw OutcomeUnknown(
          compose(f, "not confirmed by the broker; it may be in the queue: publish it again"));
    case Kind::kProtocol:
      throw StorageError(compose(f, "unexpected reply"));
  }
  throw StorageError(compose(f, "failure"));
}

}  // namespace idem::rabbitmq::detail
