// SPDX-License-Identifier: MIT
// A move-only std::function (C++17 has none): callbacks that own move-only state (a completion
// handler, a promise) cross the compiled stores' boundary as idem::async::Function.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

namespace idem::async {

template <class Signature>
class Function;

/// A move-only, type-erased callable. Small callables (up to 3 pointers) are stored inline.
/// Calling an empty Function is undefined; test it with `explicit operator bool`.
template <class R, class... Args>
class Function<R(Args...)> {
 public:
  Function() noexcept = default;
  /// An empty Function.
  Function(std::nullptr_t) noexcept {}  // NOLINT(google-explicit-constructor)

  /// Wraps `f` (moved in).
  template <class F, class D = std::decay_t<F>,
            std::enable_if_t<!std::is_same_v<D, Function> && std::is_invocable_r_v<R, D&, Args...>,
                             int> = 0>
  Function(F&& f) {  // NOLINT(google-explicit-constructor)
    if constexpr (sizeof(D) <= sizeof(buf_) && alignof(D) <= alignof(Buf) &&
                  std::is_nothrow_move_constructible_v<D>) {
      ::new (static_cast<void*>(&buf_)) D(std::forward<F>(f));
      ops_ = &kInline<D>;
    } else {
      *reinterpret_cast<D**>(&buf_) = new D(std::forward<F>(f));
      ops_ = &kHeap<D>;
    }
  }

  /// Takes `other`'s callable (`other` is left empty).
  Function(Function&& other) noexcept : ops_(other.ops_) {
    if (ops_ != nullptr) ops_->move(&other.buf_, &buf_);
    other.ops_ = nullptr;
  }
  /// Destroys the held callable, then takes `other`'s (`other` is left empty).
  Function& operator=(Function&& other) noexcept {
    if (this != &other) {
      reset();
      ops_ = other.ops_;
      if (ops_ != nullptr) ops_->move(&other.buf_, &buf_);
      other.ops_ = nullptr;
    }
    return *this;
  }
  Function(const Function&) = delete;
  Function& operator=(const Function&) = delete;
  ~Function() { reset(); }

  /// Calls the wrapped callable.
  R operator()(Args... args) { return ops_->call(&buf_, std::forward<Args>(args)...); }

  /// True when a callable is held.
  explicit operator bool() const noexcept { return ops_ != nullptr; }

  /// Destroys the held callable (if any).
  void reset() noexcept {
    if (ops_ != nullptr) ops_->destroy(&buf_);
    ops_ = nullptr;
  }

 private:
  struct Buf {
    alignas(std::max_align_t) unsigned char bytes[3 * sizeof(void*)];
  };
  struct Ops {
    R (*call)(void*, Args&&...);
    void (*move)(void* from, void* to) noexcept;
    void (*destroy)(void*) noexcept;
  };
  template <class D>
  static constexpr Ops kInline{
      [](void* p, Args&&... a) -> R {
        return (*std::launder(static_cast<D*>(p)))(std::forward<Args>(a)...);
      },
      [](void* from, void* to) noexcept {
        D* f = std::launder(static_cast<D*>(from));
        ::new (to) D(std::move(*f));
        f->~D();
      },
      [](void* p) noexcept { std::launder(static_cast<D*>(p))->~D(); }};
  template <class D>
  static constexpr Ops kHeap{
      [](void* p, Args&&... a) -> R { return (**static_cast<D**>(p))(std::forward<Args>(a)...); },
      [](void* from, void* to) noexcept {
        *static_cast<D**>(to) = *static_cast<D**>(from);
        *static_cast<D**>(from) = nullptr;
      },
      [](void* p) noexcept { delete *static_cast<D**>(p); }};

  Buf buf_;
  const Ops* ops_ = nullptr;
};

}  // namespace idem::async
