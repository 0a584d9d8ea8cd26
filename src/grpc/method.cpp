// SPDX-License-Identifier: MIT
// idem::grpc: key and fingerprint of a call, the stored reply's encoding, idem's own answers.
#include "idem/grpc/method.hpp"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <grpcpp/security/auth_context.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <stdexcept>

#include "idem/fingerprint.hpp"
#include "idem/http/idempotency_key.hpp"
#include "idem/http/response.hpp"

namespace idem::grpc {

namespace {

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

// Whether grpc++ sends this entry (it aborts the process on one it refuses): a metadata name,
// and, unless the name ends in "-bin", a value of printable ASCII.
bool sendable(std::string_view name, std::string_view value) noexcept {
  if (!is_metadata_name(name)) return false;
  if (ends_with(name, "-bin")) return true;
  for (char ch : value) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
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

// "<decimal size>:" (append_length_prefixed's prefix, without a temporary string).
void append_size_prefix(std::string& out, std::size_t size) {
  char digits[24];
  char* end = digits + sizeof digits;
  char* p = end - 1;
  *p = ':';
  do {
    *--p = static_cast<char>('0' + size % 10);
    size /= 10;
  } while (size != 0);
  out.append(p, static_cast<std::size_t>(end - p));
}

void append_prefixed(std::string& out, std::string_view part) {
  append_size_prefix(out, part.size());
  out.append(part.data(), part.size());
}

// Appends `message`'s deterministic serialization (deterministic_bytes) to `out`, after
// `prefix` (called with its size), serialized in place.
template <class Prefix>
void append_deterministic(std::string& out, const google::protobuf::MessageLite& message,
                          Prefix&& prefix) {
  const std::size_t size = message.ByteSizeLong();
  if (size > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    throw UsageError("idem::grpc: the message exceeds 2 GiB");
  }
  prefix(size);
  const std::size_t at = out.size();
  out.resize(at + size);
  bool ok = false;
  {
    google::protobuf::io::ArrayOutputStream array(out.data() + at, static_cast<int>(size));
    google::protobuf::io::CodedOutputStream coded(&array);
    coded.SetSerializationDeterministic(true);
    // Partial: a proto2 request missing a required field still has a fingerprint.
    ok = message.SerializePartialToCodedStream(&coded) && !coded.HadError() &&
         static_cast<std::size_t>(coded.ByteCount()) == size;
  }
  if (!ok) throw UsageError("idem::grpc: the message could not be serialized");
}

// prepare's buffers, one pair per thread: no allocation per call once they have grown.
struct Scratch {
  std::string key;
  std::string fingerprint;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// Trailing metadata names as grpc++ takes them (const std::string&), built once.
const std::string& replayed_name() {
  static const std::string name(kReplayedMetadata);
  return name;
}
const std::string& replayed_value() {
  static const std::string value("true");
  return value;
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
  append_deterministic(out, message, [](std::size_t) {});
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
  if (options_.wait_for_result.count() < 0) {
    throw UsageError("idem::grpc::MethodOptions::wait_for_result must not be negative");
  }
  pushback_ = std::to_string(options_.retry_pushback.count());
}

Prepared MethodCore::prepare(::grpc::ServerContextBase& context,
                             const google::protobuf::MessageLite& request) const {
  Prepared p;
  const auto& metadata = context.client_metadata();
  auto range = metadata.equal_range(::grpc::string_ref(options_.key_metadata));
  std::string_view client_key;  // into the call's metadata, alive for the whole call
  std::size_t count = 0;
  for (auto it = range.first; it != range.second; ++it) {
    if (++count == 1) client_key = view(it->second);
  }
  if (count > 1) {
    p.refusal = refuse(context, errc::kInvalidKey,
                       "the call has " + std::to_string(count) + " " + options_.key_metadata +
                           " metadata entries; send exactly one");
    return p;
  }
  std::string generated;
  if (count == 0) {
    if (options_.missing_key == MissingKey::kReject) {
      p.refusal = refuse(context, errc::kMissingKey,
                         "this method requires the " + options_.key_metadata + " metadata, e.g. " +
                             options_.key_metadata + ": 8e03978e-40d5-43e8-bc93-6894a57f9324");
      return p;
    }
    generated = OwnerToken::generate().str();
    client_key = generated;
  } else if (std::string why = ::idem::http::client_key_problem(client_key); !why.empty()) {
    p.refusal = refuse(context, errc::kInvalidKey,
                       "the " + options_.key_metadata +
                           " metadata must be 1-255 bytes of printable ASCII; " + why);
    return p;
  }

  // The hooks run first, so that nothing they do can reach this thread's buffers half-filled.
  const std::string principal =
      options_.principal ? options_.principal(context) : peer_principal(context);
  std::string hooked;  // MethodOptions::fingerprint's bytes, when set
  if (options_.fingerprint) hooked = options_.fingerprint(context, request);

  // The key: SHA-256 of (principal, method, client key), length-prefixed.
  Scratch& buf = scratch();
  std::string& material = buf.key;
  material.assign("idem.grpc.v1");
  append_prefixed(material, principal);
  append_prefixed(material, options_.method);
  append_prefixed(material, client_key);
  char id[::idem::detail::kSha256HexSize];
  ::idem::detail::sha256_hex(material, id);
  p.key = Key::make(options_.scope, std::string_view(id, sizeof id));

  // The fingerprint: SHA-256 of (method, the fingerprint metadata, the request bytes).
  std::string& fp = buf.fingerprint;
  fp.assign("idem.grpc.fp.v1");
  append_prefixed(fp, options_.method);
  for (const auto& name : options_.fingerprint_metadata) {
    fp += '|';
    auto values = metadata.equal_range(::grpc::string_ref(name));
    for (auto it = values.first; it != values.second; ++it) {
      append_prefixed(fp, view(it->second));
    }
  }
  fp += '|';
  if (options_.fingerprint) {
    append_prefixed(fp, hooked);
  } else {
    append_deterministic(fp, request, [&](std::size_t size) { append_size_prefix(fp, size); });
  }
  ::idem::detail::sha256_hex(fp, p.fingerprint_hex);
  return p;
}

bool MethodCore::stores(::grpc::StatusCode code) const {
  return options_.store_status ? options_.store_status(code) : is_final_status(code);
}

std::size_t MethodCore::drop_unsendable(Reply& reply) {
  const auto before = reply.trailers.size();
  reply.trailers.erase(
      std::remove_if(reply.trailers.begin(), reply.trailers.end(),
                     [](const Metadata& m) { return !sendable(m.first, m.second); }),
      reply.trailers.end());
  return before - reply.trailers.size();
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
  if (reply.status.ok()) {
    append_deterministic(out, response,
                         [&](std::size_t size) { put_u32(out, static_cast<std::uint32_t>(size)); });
  } else {
    put_u32(out, 0);
  }
  return out;
}

::grpc::Status MethodCore::executed(::grpc::ServerContextBase& context, Reply& reply) const {
  for (const auto& [name, value] : reply.trailers) context.AddTrailingMetadata(name, value);
  return std::move(reply.status);
}

::grpc::Status MethodCore::replay(::grpc::ServerContextBase& context, std::string_view stored,
                                  google::protobuf::MessageLite* response) const {
  // Decoded in place (views into `stored`); nothing reaches the context before the whole record
  // was read and the response parsed.
  int code = 0;
  std::string_view message, details, trailers;
  std::uint32_t trailer_count = 0;
  try {
    ::idem::http::detail::Reader in(stored);
    if (in.raw(kReplyMagic.size()) != kReplyMagic) {
      throw std::runtime_error("not an idem gRPC reply record");
    }
    std::uint32_t c = in.u32();
    if (c > 16) throw std::runtime_error("bad gRPC status code in record");
    code = static_cast<int>(c);
    message = in.raw(in.u32());
    details = in.raw(in.u32());
    trailer_count = in.u32();
    if (trailer_count > 10'000) throw std::runtime_error("too many trailers in record");
    const std::size_t trailers_at = in.position();
    for (std::uint32_t i = 0; i < 2 * trailer_count; ++i) in.raw(in.u32());
    trailers = stored.substr(trailers_at, in.position() - trailers_at);
    std::string_view body = in.raw(in.u32());
    if (!in.done()) throw std::runtime_error("trailing bytes after gRPC reply record");
    if (body.size() > static_cast<std::size_t>(std::numeric_limits<int>::max()) ||
        (code == 0 && !response->ParseFromArray(body.data(), static_cast<int>(body.size())))) {
      throw std::runtime_error("the stored response does not parse as " + response->GetTypeName());
    }
  } catch (const std::exception& e) {
    throw CorruptRecord(std::string("idem::grpc: the stored reply of ") + options_.method +
                        " cannot be decoded: " + e.what());
  }
  ::idem::http::detail::Reader in(trailers);  // read once above: cannot fail
  for (std::uint32_t i = 0; i < trailer_count; ++i) {
    std::string_view name = in.raw(in.u32());
    std::string_view value = in.raw(in.u32());
    // A record stored before such entries were dropped: skipped, not sent (see Reply).
    if (sendable(name, value)) context.AddTrailingMetadata(std::string(name), std::string(value));
  }
  context.AddTrailingMetadata(replayed_name(), replayed_value());
  return ::grpc::Status(static_cast<::grpc::StatusCode>(code), std::string(message),
                        std::string(details));
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
