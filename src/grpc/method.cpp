// SPDX-License-Identifier: MIT
// idem::grpc: key and fingerprint of a call, the stored reply's encoding, idem's own answers.
#include "idem/grpc/method.hpp"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <grpcpp/security/auth_context.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>

#include "idem/fingerprint.hpp"
#include "idem/http/idempotency_key.hpp"
#include "idem/http/response.hpp"

namespace idem::grpc {

namespace {

using ::idem::http::detail::append_length_prefixed;

// First bytes of every stored reply (format name and version).
constexpr std::string_view kReplyMagic = "idem.grpc.reply/1\n";

// gRPC metadata names: 1*( 0-9 / a-z / "_" / "-" / "." ).
bool is_metadata_name(std::string_view name) noexcept {
  if (name.empty()) return false;
  for (char c : name) {
    bool ok = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || c == '_' || c == '-' || c == '.';
    if (!ok) return false;
  }
  return true;
}

bool ends_with(std::string_view s, std::string_view suffix) noexcept {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

void check_metadata_name(std::string_view what, std::string_view name) {
  if (!is_metadata_name(name)) {
    throw UsageError("idem::grpc::MethodOptions::" + std::string(what) + ": '" + std::string(name) +
                     "' is not a gRPC metadata name (lower-case [0-9a-z_.-], not empty)");
  }
}

std::string_view view(::grpc::string_ref s) noexcept { return {s.data(), s.size()}; }

// `method` must be "/<service>/<method>" with non-empty parts.
void check_method(const std::string& method) {
  auto slash = method.find('/', 1);
  if (method.size() < 4 || method[0] != '/' || slash == std::string::npos || slash == 1 ||
      slash + 1 == method.size() || method.find('/', slash + 1) != std::string::npos) {
    throw UsageError("idem::grpc::MethodOptions::method: '" + method +
                     "' is not a full method name \"/<package>.<Service>/<Method>\"");
  }
}

std::string derived_scope(const std::string& method) {
  std::string scope = method.substr(1);
  for (char& c : scope) {
    if (c == '/') c = '.';
  }
  return scope;
}

}  // namespace

bool is_final_status(::grpc::StatusCode code) noexcept {
  switch (code) {
    case ::grpc::StatusCode::OK:
    case ::grpc::StatusCode::INVALID_ARGUMENT:
    case ::grpc::StatusCode::NOT_FOUND:
    case ::grpc::StatusCode::ALREADY_EXISTS:
    case ::grpc::StatusCode::PERMISSION_DENIED:
    case ::grpc::StatusCode::FAILED_PRECONDITION:
    case ::grpc::StatusCode::OUT_OF_RANGE:
    case ::grpc::StatusCode::UNAUTHENTICATED:
      return true;
    default:
      return false;
  }
}

std::string peer_principal(const ::grpc::ServerContextBase& context) {
  std::shared_ptr<const ::grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return {};
  std::string principal = auth->GetPeerIdentityPropertyName();
  principal += '=';
  bool first = true;
  for (const auto& value : auth->GetPeerIdentity()) {
    if (!first) principal += ',';
    principal.append(value.data(), value.size());
    first = false;
  }
  return principal;
}

std::string deterministic_bytes(const google::protobuf::MessageLite& message) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    // Partial: a proto2 request missing a required field still has a fingerprint.
    if (!message.SerializePartialToCodedStream(&coded)) {
      throw UsageError("idem::grpc: the request message could not be serialized");
    }
  }
  return out;
}

namespace detail {

MethodCore::MethodCore(MethodOptions options) : options_(std::move(options)) {
  check_method(options_.method);
  if (options_.scope.empty()) {
    std::string scope = derived_scope(options_.method);
    try {
      Key::validate_scope(scope);
    } catch (const InvalidKey& e) {
      throw InvalidKey(e.rule(), "the scope derived from '" + options_.method + "' (\"" + scope +
                                     "\") is not valid; set MethodOptions::scope (" + e.what() +
                                     ")");
    }
    options_.scope = std::move(scope);
  } else {
    Key::validate_scope(options_.scope);
  }
  check_metadata_name("key_metadata", options_.key_metadata);
  if (ends_with(options_.key_metadata, "-bin") || options_.key_metadata.rfind("grpc-", 0) == 0) {
    throw UsageError(
        "idem::grpc::MethodOptions::key_metadata: '" + options_.key_metadata +
        "' must be an ASCII entry (not \"-bin\") outside the reserved \"grpc-\" names");
  }
  for (const auto& name : options_.fingerprint_metadata) {
    check_metadata_name("fingerprint_metadata", name);
  }
  for (const auto& name : options_.replay_trailers) {
    check_metadata_name("replay_trailers", name);
    if (name.rfind("grpc-", 0) == 0 || name == kReplayedMetadata || name == kErrorMetadata) {
      throw UsageError("idem::grpc::MethodOptions::replay_trailers: '" + name +
                       "' is reserved (grpc-*, " + std::string(kReplayedMetadata) + ", " +
                       std::string(kErrorMetadata) + ")");
    }
  }
  if (options_.retry_pushback.count() < 0) {
    throw UsageError("idem::grpc::MethodOptions::retry_pushback must not be negative");
  }
  pushback_ = std::to_string(options_.retry_pushback.count());
}

Prepared MethodCore::prepare(::grpc::ServerContextBase& context,
                             const google::protobuf::MessageLite& request) const {
  Prepared p;
  const auto& metadata = context.client_metadata();
  auto range = metadata.equal_range(::grpc::string_ref(options_.key_metadata));
  std::string client_key;
  std::size_t count = 0;
  for (auto it = range.first; it != range.second; ++it) {
    if (++count == 1) client_key.assign(it->second.data(), it->second.size());
  }
  if (count > 1) {
    p.refusal = refuse(context, errc::kInvalidKey,
                       "the call has " + std::to_string(count) + " " + options_.key_metadata +
                           " metadata entries; send exactly one");
    return p;
  }
  if (count == 0) {
    if (options_.missing_key == MissingKey::kReject) {
      p.refusal = refuse(context, errc::kMissingKey,
                         "this method requires the " + options_.key_metadata + " metadata, e.g. " +
                             options_.key_metadata + ": 8e03978e-40d5-43e8-bc93-6894a57f9324");
      return p;
    }
    client_key = OwnerToken::generate().str();
  } else if (std::string why = ::idem::http::client_key_problem(client_key); !why.empty()) {
    p.refusal = refuse(context, errc::kInvalidKey,
                       "the " + options_.key_metadata +
                           " metadata must be 1-255 bytes of printable ASCII; " + why);
    return p;
  }

  std::string principal =
      options_.principal ? options_.principal(context) : peer_principal(context);
  std::string material = "idem.grpc.v1";
  append_length_prefixed(material, principal);
  append_length_prefixed(material, options_.method);
  append_length_prefixed(material, client_key);
  p.key = Key::make(options_.scope, fingerprint(material));

  std::string fp = "idem.grpc.fp.v1";
  append_length_prefixed(fp, options_.method);
  for (const auto& name : options_.fingerprint_metadata) {
    fp += '|';
    auto values = metadata.equal_range(::grpc::string_ref(name));
    for (auto it = values.first; it != values.second; ++it) {
      append_length_prefixed(fp, view(it->second));
    }
  }
  fp += '|';
  append_length_prefixed(fp, options_.fingerprint ? options_.fingerprint(context, request)
                                                  : deterministic_bytes(request));
  p.fingerprint = fingerprint(fp);
  return p;
}

bool MethodCore::stores(::grpc::StatusCode code) const {
  return options_.store_status ? options_.store_status(code) : is_final_status(code);
}

// magic, code (u32), message, details, trailer count (u32), each name and value, body: every
// string as a u32 big-endian length and its bytes (the helpers of idem::http's codec).
std::string MethodCore::encode(const Reply& reply,
                               const google::protobuf::MessageLite& response) const {
  using ::idem::http::detail::put_bytes;
  using ::idem::http::detail::put_u32;
  std::string out(kReplyMagic);
  put_u32(out, static_cast<std::uint32_t>(reply.status.error_code()));
  put_bytes(out, reply.status.error_message());
  put_bytes(out, reply.status.error_details());
  std::uint32_t kept = 0;
  for (const auto& [name, value] : reply.trailers) {
    for (const auto& r : options_.replay_trailers) kept += r == name ? 1 : 0;
  }
  put_u32(out, kept);
  for (const auto& [name, value] : reply.trailers) {
    for (const auto& r : options_.replay_trailers) {
      if (r == name) {
        put_bytes(out, name);
        put_bytes(out, value);
        break;
      }
    }
  }
  // A non-OK status carries no response message on the wire: none is stored.
  put_bytes(out, reply.status.ok() ? deterministic_bytes(response) : std::string());
  return out;
}

::grpc::Status MethodCore::executed(::grpc::ServerContextBase& context, Reply& reply) const {
  for (const auto& [name, value] : reply.trailers) context.AddTrailingMetadata(name, value);
  return std::move(reply.status);
}

::grpc::Status MethodCore::replay(::grpc::ServerContextBase& context, std::string_view stored,
                                  google::protobuf::MessageLite* response) const {
  int code = 0;
  std::string message, details, body;
  std::vector<Metadata> trailers;
  try {
    ::idem::http::detail::Reader in(stored);
    if (in.raw(kReplyMagic.size()) != kReplyMagic) {
      throw std::runtime_error("not an idem gRPC reply record");
    }
    std::uint32_t c = in.u32();
    if (c > 16) throw std::runtime_error("bad gRPC status code in record");
    code = static_cast<int>(c);
    message = in.bytes();
    details = in.bytes();
    std::uint32_t n = in.u32();
    if (n > 10'000) throw std::runtime_error("too many trailers in record");
    trailers.reserve(n);
    for (std::uint32_t i = 0; i < n; ++i) {
      std::string name = in.bytes();
      trailers.emplace_back(std::move(name), in.bytes());
    }
    body = in.bytes();
    if (!in.done()) throw std::runtime_error("trailing bytes after gRPC reply record");
    if (code == 0 && !response->ParseFromString(body)) {
      throw std::runtime_error("the stored response does not parse as " + response->GetTypeName());
    }
  } catch (const std::exception& e) {
    throw CorruptRecord(std::string("idem::grpc: the stored reply of ") + options_.method +
                        " cannot be decoded: " + e.what());
  }
  for (const auto& [name, value] : trailers) context.AddTrailingMetadata(name, value);
  context.AddTrailingMetadata(std::string(kReplayedMetadata), "true");
  return ::grpc::Status(static_cast<::grpc::StatusCode>(code), std::move(message),
                        std::move(details));
}

::grpc::Status MethodCore::refuse(::grpc::ServerContextBase& context, errc code) const {
  switch (code) {
    case errc::kInProgress:
      return refuse(context, code,
                    "a call with this " + options_.key_metadata +
                        " is still being processed; retry after " + pushback_ + " ms");
    case errc::kFingerprintMismatch:
      return refuse(context, code,
                    "this " + options_.key_metadata + " was already used with a different request");
    default:
      return refuse(context, code, std::string(errc_message(code)));
  }
}

::grpc::Status MethodCore::refuse(::grpc::ServerContextBase& context, errc code,
                                  std::string message) const {
  auto status = static_cast<::grpc::StatusCode>(grpc_status_code(code));
  context.AddTrailingMetadata(std::string(kErrorMetadata), std::string(errc_name(code)));
  if (status == ::grpc::StatusCode::ABORTED) {
    context.AddTrailingMetadata(std::string(kPushbackMetadata), pushback_);
  }
  return ::grpc::Status(status, std::move(message));
}

}  // namespace detail
}  // namespace idem::grpc
