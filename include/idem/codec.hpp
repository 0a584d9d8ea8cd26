// SPDX-License-Identifier: MIT
// How a handler's typed response becomes the bytes a store keeps, and back.
//
// `std::string` passes through unchanged (any bytes, including NUL and non-UTF-8).
// A user type plugs in by specialising one template:
//
// @code
//   struct PaymentReceipt { std::string payment_no; long long amount; };
//   template <> struct idem::Codec<PaymentReceipt> {
//     static std::string encode(const PaymentReceipt& r) {
//       return r.payment_no + "," + std::to_string(r.amount);
//     }
//     static PaymentReceipt decode(std::string_view bytes) { ... }
//   };
// @endcode
//
// decode() may throw anything; the guard reports it as idem::CorruptRecord.
#pragma once

#include <string>
#include <string_view>

namespace idem {

/// Primary template: left undefined so a missing specialisation is a compile error that names
/// the type. Specialise `encode(const T&) -> std::string` and `decode(std::string_view) -> T`.
template <class T, class Enable = void>
struct Codec;

/// Bytes pass through.
template <>
struct Codec<std::string> {
  static std::string encode(const std::string& value) { return value; }
  static std::string decode(std::string_view bytes) { return std::string(bytes); }
};

/// Unit response for handlers that return nothing: stored as zero bytes.
struct Unit {
  friend bool operator==(Unit, Unit) noexcept { return true; }
};

template <>
struct Codec<Unit> {
  static std::string encode(Unit) { return {}; }
  static Unit decode(std::string_view) { return {}; }
};

}  // namespace idem
