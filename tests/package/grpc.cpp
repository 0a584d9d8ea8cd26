// SPDX-License-Identifier: MIT
// Consumer of idem::grpc: a Method on a MemoryStore guard, and the deterministic request bytes
// of a protobuf message (a well-known type: no .proto to compile).
#include <google/protobuf/wrappers.pb.h>
#include <idem/grpc/method.hpp>
#include <idem/memory_store.hpp>

#include "consumer.hpp"

int main() {
  check_version();
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  idem::grpc::MethodOptions options;
  options.method = "/payments.v1.Payments/Charge";
  idem::grpc::Method charge{guard, options};
  google::protobuf::StringValue request;
  request.set_value("order_1");
  CONSUMER_CHECK(idem::grpc::deterministic_bytes(request) == request.SerializeAsString());
  options.method = "Charge";
  try {
    idem::grpc::Method bad{guard, options};
    CONSUMER_CHECK(false);
  } catch (const idem::UsageError& e) {
    check_typed(e, idem::errc::kInvalidArgument);
  }
  std::printf("grpc: method built, bad method name refused as invalid_argument\n");
  return 0;
}
