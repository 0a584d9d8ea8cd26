// SPDX-License-Identifier: MIT
// The record rulebook (idem/detail/record_rules.hpp): the order of the claim rules, finishing,
// and status values, decided once for every store.
#include "idem/detail/record_rules.hpp"

#include <gtest/gtest.h>

namespace {

using idem::ClaimStatus;
using idem::Record;
using idem::detail::ClaimAction;
using idem::detail::decide_claim;
using idem::detail::FoundRecord;

FoundRecord in_progress(bool live) {
  FoundRecord f;
  f.status = Record::Status::kInProgress;
  f.fingerprint = "fp";
  f.owner = "holder";
  f.created_at = idem::from_millis(1000);
  f.lease_live = live;
  return f;
}

TEST(RecordRules, RetentionOverIsAbsentWhateverElseHolds) {
  FoundRecord f = in_progress(true);
  f.status = Record::Status::kCompleted;
  f.retention_over = true;
  EXPECT_EQ(ClaimAction::kReplace, decide_claim(f, "another fingerprint", "me").action);
}

TEST(RecordRules, MismatchWinsOverDoneBusyAndOwnClaim) {
  for (auto status :
       {Record::Status::kInProgress, Record::Status::kCompleted, Record::Status::kFailed}) {
    FoundRecord f = in_progress(true);
    f.status = status;
    auto d = decide_claim(f, "other", "holder");
    EXPECT_EQ(ClaimAction::kAnswer, d.action);
    EXPECT_EQ(ClaimStatus::kMismatch, d.result.status);
    EXPECT_EQ("holder", d.result.holder);
    EXPECT_EQ(1000, idem::to_millis(d.result.first_seen));
  }
}

TEST(RecordRules, CompletedAndFailedReplayEvenForTheirOwnOwner) {
  FoundRecord f = in_progress(false);
  f.status = Record::Status::kCompleted;
  f.response = "pay_1";
  f.expires_at = idem::from_millis(5000);
  auto d = decide_claim(f, "fp", "holder");
  EXPECT_EQ(ClaimStatus::kDone, d.result.status);
  EXPECT_FALSE(d.result.failed);
  EXPECT_EQ("pay_1", d.result.response);
  EXPECT_EQ(5000, idem::to_millis(d.result.expires_at));
  f.status = Record::Status::kFailed;
  d = decide_claim(f, "fp", "someone");
  EXPECT_EQ(ClaimStatus::kDone, d.result.status);
  EXPECT_TRUE(d.result.failed);
}

TEST(RecordRules, OwnInProgressClaimIsKeptLiveOrNot) {
  for (bool live : {true, false}) {
    auto d = decide_claim(in_progress(live), "fp", "holder");
    EXPECT_EQ(ClaimAction::kKeep, d.action);
    EXPECT_EQ(ClaimStatus::kClaimed, d.result.status);
    EXPECT_TRUE(d.result.kept);
    EXPECT_FALSE(d.result.took_over);
  }
}

TEST(RecordRules, LiveLeaseIsBusyExpiredLeaseIsTakenOver) {
  auto busy = decide_claim(in_progress(true), "fp", "me");
  EXPECT_EQ(ClaimAction::kAnswer, busy.action);
  EXPECT_EQ(ClaimStatus::kBusy, busy.result.status);
  EXPECT_EQ("holder", busy.result.holder);
  auto takeover = decide_claim(in_progress(false), "fp", "me");
  EXPECT_EQ(ClaimAction::kTakeOver, takeover.action);
  EXPECT_EQ(ClaimStatus::kClaimed, takeover.result.status);
  EXPECT_TRUE(takeover.result.took_over);
  // A record without an owner (refilled) is never "own" for an empty token.
  FoundRecord anonymous = in_progress(true);
  anonymous.owner = "";
  EXPECT_EQ(ClaimStatus::kBusy, decide_claim(anonymous, "fp", "").result.status);
}

TEST(RecordRules, OnlyTheOwnerFinishesAnInProgressRecord) {
  using idem::detail::may_finish;
  EXPECT_TRUE(may_finish(Record::Status::kInProgress, "a", "a"));
  EXPECT_FALSE(may_finish(Record::Status::kInProgress, "a", "b"));
  EXPECT_FALSE(may_finish(Record::Status::kCompleted, "a", "a"));
  EXPECT_FALSE(may_finish(Record::Status::kFailed, "a", "a"));
}

TEST(RecordRules, StatusValuesOtherThanIdemsAreCorrupt) {
  using idem::detail::parse_record_status;
  using idem::detail::record_status_from_letter;
  using idem::detail::record_status_letter;
  for (auto s :
       {Record::Status::kInProgress, Record::Status::kCompleted, Record::Status::kFailed}) {
    EXPECT_EQ(s, parse_record_status(idem::record_status_name(s)));
    EXPECT_EQ(s, record_status_from_letter(record_status_letter(s)));
  }
  EXPECT_FALSE(parse_record_status("PROCESSING"));
  EXPECT_FALSE(parse_record_status("Completed"));
  EXPECT_FALSE(record_status_from_letter('X'));
  try {
    (void)idem::detail::record_status_or_throw("done", "mysql", "pay|1");
    FAIL() << "no exception";
  } catch (const idem::CorruptRecord& e) {
    EXPECT_EQ(idem::errc::kCorruptRecord, e.code());
    EXPECT_NE(std::string(e.what()).find("mysql: record 'pay|1'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("'done'"), std::string::npos);
  }
}

}  // namespace
