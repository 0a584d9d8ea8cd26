// SPDX-License-Identifier: MIT
// What examples/scheduled_job reads back from the database to check a run.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace scheduled_job {

/// A seeded payment: stuck in PAYING, due for closing at `due_tick`.
struct PaymentSeed {
  std::string payment_no;
  int due_tick = 0;
};

/// A payment as the database holds it.
struct PaymentRow {
  std::string status;
  int due_tick = 0;
};

/// An applied effect.
struct EffectRow {
  std::string payment_no, kind, actor;
  int tick = 0;
};

/// A started tick run.
struct RunRow {
  int tick = 0;
  std::string instance;
  int fire = 0;  ///< the tick at which the instance fired it (later than `tick`: caught up)
  bool finished = false;
  int items = 0;
};

/// The database after a run.
struct State {
  std::map<std::string, PaymentRow> payments;
  std::vector<EffectRow> effects;
  std::vector<RunRow> runs;
  std::int64_t records_in_progress = 0;  ///< idempotency records of both scopes
  std::int64_t ticks_completed = 0;      ///< completed records of the job's scope
};

}  // namespace scheduled_job
