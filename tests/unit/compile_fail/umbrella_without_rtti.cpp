// SPDX-License-Identifier: MIT
// Compiled with -fno-rtti by the NoRttiIsToldFirst test: must fail, first with idem/export.hpp's
// #error saying why.
#include "idem/idem.hpp"
