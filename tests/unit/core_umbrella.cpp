// SPDX-License-Identifier: MIT
// The core's umbrella header, for CoreHeadersIncludeNoOpenSslHeader (tests/unit/CMakeLists.txt):
// its header dependencies (-M) must name no OpenSSL header.
#include "idem/idem.hpp"

int main() { return idem::fingerprint("").size() == 64 ? 0 : 1; }
