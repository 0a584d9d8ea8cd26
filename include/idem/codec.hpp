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
//
// A handler returning `const char*` (`return "ok";`) or `std::string_view` stores a
// `std::string` (the bytes are copied before the handler's frame is gone), and its result's
// value is a `std::string`. A type without a Codec fails to compile with a message that says
// what to write.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "idem/export.hpp"  // says first when the build cannot compile idem

namespace idem {

/// Primary template: left undefined so a missing specialisation is a compile error that names
/// the type. Specialise `encode(const T&) -> std::string` and `decode(std::string_view) -> T`.
template <class T, class Enable = void>
struct Codec;

/// Bytes pass through.
template <>
struct Codec<std::string> {
  /// The bytes themselves.
  static std::string encode(const std::string& value) { return value; }
  /// The bytes themselves.
  static std::string decode(std::string_view bytes) { return std::string(bytes); }
};

/// Unit response for handlers that return nothing: stored as zero bytes.
struct Unit {
  /// Every Unit equals every other.
  friend bool operator==(Unit, Unit) noexcept { return true; }
};

/// Unit is stored as zero bytes.
template <>
struct Codec<Unit> {
  /// Zero bytes.
  static std::string encode(Unit) { return {}; }
  /// A Unit, whatever was stored.
  static Unit decode(std::string_view) { return {}; }
};

namespace detail {
/// True when Codec<T> is specialised with encode(const T&) and decode(std::string_view).
template <class T, class = void>
struct has_codec : std::false_type {};
template <class T>
struct has_codec<T, std::void_t<decltype(Codec<T>::encode(std::declval<const T&>())),
                                decltype(Codec<T>::decode(std::string_view{}))>>
    : std::bool_constant<std::is_convertible_v<decltype(Codec<T>::decode(std::string_view{})), T>> {
};

/// The type a handler's return type R is stored and replayed as: void -> Unit; C strings and
/// string views -> std::string (a view would dangle in a replay); anything else as it is,
/// which must then have a Codec.
template <class R>
struct stored_type {
  using type =
      std::conditional_t<std::is_void_v<R>, Unit,
                         std::conditional_t<std::is_same_v<std::decay_t<R>, const char*> ||
                                                std::is_same_v<std::decay_t<R>, char*> ||
                                                std::is_same_v<std::decay_t<R>, std::string_view>,
                                            std::string, std::decay_t<R>>>;
  static_assert(has_codec<type>::value,
                "idem: the handler's return type has no idem::Codec. Return std::string, or "
                "teach idem to store it: template <> struct idem::Codec<T> { static std::string "
                "encode(const T&); static T decode(std::string_view); }; (see idem/codec.hpp)");
};
}  // namespace detail

}  // namespace idem
