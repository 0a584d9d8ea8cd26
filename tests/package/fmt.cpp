// SPDX-License-Identifier: MIT
// Consumer of idem::fmt: the stderr sink formats one line.
#include <idem/log/fmt_sink.hpp>

#include "consumer.hpp"

int main() {
  check_version();
  std::FILE* f = std::tmpfile();
  CONSUMER_CHECK(f != nullptr);
  idem::log::stderr_sink(f)(idem::LogLevel::kInfo, "hello");
  CONSUMER_CHECK(std::ftell(f) > 5);
  std::fclose(f);
  std::printf("fmt: sink wrote a line\n");
  return 0;
}
