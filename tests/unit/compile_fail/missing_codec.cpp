// SPDX-License-Identifier: MIT
// Must NOT compile: a handler returning a type without an idem::Codec. The test
// (tests/unit/CMakeLists.txt, MissingCodecIsAStaticAssert) expects the static_assert's text.
#include "idem/guard.hpp"
#include "idem/memory_store.hpp"

struct NoCodec {
  int x = 0;
};

int main() {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  auto r = guard.run(idem::Key::make("s", "i"), "", [] { return NoCodec{}; });
  return r.ok() ? 0 : 1;
}
