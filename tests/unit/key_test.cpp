// SPDX-License-Identifier: MIT
#include <gtest/gtest.h>

#include <string>

#include "idem/key.hpp"

namespace {

std::string rule_of(std::string_view scope, std::string_view id) {
  try {
    (void)idem::Key::make(scope, id);
  } catch (const idem::InvalidKey& e) {
    EXPECT_EQ(idem::errc::kInvalidKey, e.code());
    EXPECT_EQ(400, e.http_status());
    EXPECT_FALSE(e.retryable());
    return e.rule();
  }
  return "valid";
}

TEST(Key, ValidKeysKeepTheirBytes) {
  auto k = idem::Key::make("payment", "order_20001_msg_30001");
  EXPECT_EQ("payment", k.scope());
  EXPECT_EQ("order_20001_msg_30001", k.id());
  EXPECT_EQ("payment|order_20001_msg_30001", k.str());
  EXPECT_EQ(k, idem::Key::parse(k.str()));
  EXPECT_EQ("valid", rule_of(std::string(64, 's'), std::string(128, 'i')));
  EXPECT_EQ("valid", rule_of("a.b_c:d-e", "!~"));
}

// A moved-from key is still the key it was: two operations whose keys were moved from must not
// meet on an empty one (the guard and the stores take every Key as valid).
TEST(Key, AMovedFromKeyStaysValid) {
  auto a = idem::Key::make("payment", "order_1_with_a_long_id_past_small_strings");
  idem::Key moved(std::move(a));
  EXPECT_EQ("payment|order_1_with_a_long_id_past_small_strings",
            a.str());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(moved, a);
  auto b = idem::Key::make("refund", "r2");
  moved = std::move(b);
  EXPECT_EQ("refund|r2", b.str());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ("refund|r2", moved.str());
  EXPECT_NE(a, b);
}

TEST(Key, HostileInputIsRejectedNamingTheRule) {
  EXPECT_EQ("scope.empty", rule_of("", "x"));
  EXPECT_EQ("id.empty", rule_of("payment", ""));
  EXPECT_EQ("scope.too_long", rule_of(std::string(65, 's'), "x"));
  EXPECT_EQ("id.too_long", rule_of("payment", std::string(129, 'i')));
  EXPECT_EQ("id.charset", rule_of("payment", "has space"));
  EXPECT_EQ("id.charset", rule_of("payment", "line\r\nbreak"));
  EXPECT_EQ("id.charset", rule_of("payment", std::string("nul\0byte", 8)));
  EXPECT_EQ("id.charset", rule_of("payment", "\xFF"));
  EXPECT_EQ("scope.charset", rule_of("pay ment", "x"));
  EXPECT_EQ("scope.charset", rule_of("pay|ment", "x"));
  EXPECT_EQ("scope.charset", rule_of("pay\xFF", "x"));
  // SQL in an id is just bytes: valid, stored verbatim.
  EXPECT_EQ("valid", rule_of("payment", "';DROP_TABLE_api_idempotency;--"));
}

TEST(Key, ErrorMessagesNeverEchoControlBytes) {
  try {
    (void)idem::Key::make("payment", "a\r\nb");
    FAIL() << "accepted a CR LF";
  } catch (const idem::InvalidKey& e) {
    std::string what = e.what();
    EXPECT_EQ(std::string::npos, what.find('\r'));
    EXPECT_NE(std::string::npos, what.find("0x0D"));
    EXPECT_NE(std::string::npos, what.find("offset 1"));
  }
}

TEST(Key, CompositionIsUnambiguous) {
  auto a = idem::Key::make("a:b", "c");
  auto b = idem::Key::make("a", "b:c");
  EXPECT_NE(a, b);
  EXPECT_NE(a.str(), b.str());
  EXPECT_EQ(a, idem::Key::parse(a.str()));
  EXPECT_EQ(b, idem::Key::parse(b.str()));
  // '|' may appear in an id; the first '|' still splits correctly.
  auto c = idem::Key::make("s", "x|y");
  EXPECT_EQ(c, idem::Key::parse(c.str()));
}

TEST(Key, MessageIdsFromBusinessNumbers) {
  EXPECT_EQ("order_20001:paid:v3", idem::make_message_id("order_20001", "paid", 3));
  // biz_no may contain ':' but the event type may not, so the split is unambiguous.
  EXPECT_EQ("a:b:c:v1", idem::make_message_id("a:b", "c", 1));
  EXPECT_THROW(idem::make_message_id("a", "b:c", 1), idem::InvalidKey);
  EXPECT_THROW(idem::make_message_id("", "paid", 1), idem::InvalidKey);
  EXPECT_THROW(idem::make_message_id("order 1", "paid", 1), idem::InvalidKey);
}

}  // namespace
