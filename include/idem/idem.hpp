// SPDX-License-Identifier: MIT
// Umbrella header of idem's core (header-only): keys, errors, outcomes, codecs, stores, guard,
// MQ consumer, stream de-duplication.
// Adapters have their own headers: idem/sqlite/sqlite_store.hpp, idem/redis/redis_store.hpp,
// idem/postgres/postgres_store.hpp.
#pragma once

#include "idem/clock.hpp"
#include "idem/codec.hpp"
#include "idem/consumer.hpp"
#include "idem/errors.hpp"
#include "idem/export.hpp"  // says first when the build cannot compile idem
#include "idem/fingerprint.hpp"
#include "idem/guard.hpp"
#include "idem/key.hpp"
#include "idem/memory_store.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"
#include "idem/sql.hpp"
#include "idem/store.hpp"
#include "idem/stream.hpp"
#include "idem/version.hpp"
