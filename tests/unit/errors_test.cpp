// SPDX-License-Identifier: MIT
#include "idem/errors.hpp"

#include <gtest/gtest.h>

#include <cctype>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "idem/detail/redact.hpp"
#include "idem/fingerprint.hpp"
#include "idem/outcome.hpp"

namespace {

TEST(Errors, EveryCodeHasAStableNameStatusAndMessage) {
  std::set<std::string> names;
  for (int i = 1; i <= 15; ++i) {
    auto e = static_cast<idem::errc>(i);
    std::string name(idem::errc_name(e));
    EXPECT_NE("unknown", name);
    EXPECT_TRUE(names.insert(name).second) << "duplicate name " << name;
    EXPECT_GE(idem::http_status(e), 400);
    std::error_code ec = e;
    EXPECT_EQ(std::string("idem"), ec.category().name());
    EXPECT_EQ(std::string(idem::errc_message(e)), ec.message());
  }
  EXPECT_EQ(400, idem::http_status(idem::errc::kInvalidKey));
  EXPECT_EQ(400, idem::http_status(idem::errc::kMissingKey));
  EXPECT_EQ(409, idem::http_status(idem::errc::kInProgress));
  EXPECT_EQ(422, idem::http_status(idem::errc::kFingerprintMismatch));
  EXPECT_EQ(503, idem::http_status(idem::errc::kStoreUnavailable));
  EXPECT_EQ(403, idem::http_status(idem::errc::kUnknownToken));
  EXPECT_FALSE(idem::is_retryable(idem::errc::kUnknownToken));
  EXPECT_EQ(413, idem::http_status(idem::errc::kPayloadTooLarge));
  EXPECT_EQ(8, idem::grpc_status_code(idem::errc::kPayloadTooLarge));
  EXPECT_FALSE(idem::is_retryable(idem::errc::kPayloadTooLarge));
  EXPECT_EQ("unknown", idem::errc_name(static_cast<idem::errc>(16)));  // 15 is the last code
}

TEST(Errors, HierarchyAnswersRetryable) {
  EXPECT_TRUE(idem::StorageUnavailable("x").retryable());
  EXPECT_TRUE(idem::StorageTimeout("x").retryable());
  EXPECT_TRUE(idem::OutcomeUnknown("x").retryable());
  EXPECT_TRUE(idem::LeaseLost("x").retryable());
  EXPECT_FALSE(idem::StorageError("x").retryable());
  EXPECT_FALSE(idem::CorruptRecord("x").retryable());
  EXPECT_FALSE(idem::UsageError("x").retryable());
  try {
    throw idem::StorageTimeout("redis: timeout");
  } catch (const idem::StorageError& e) {
    EXPECT_EQ(idem::errc::kStoreTimeout, e.code());
    EXPECT_EQ(std::string("redis: timeout"), e.what());
  }
}

TEST(Fingerprint, IsSha256Hex) {
  EXPECT_EQ("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            idem::fingerprint(""));
  EXPECT_EQ("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
            idem::fingerprint("abc"));
  EXPECT_NE(idem::fingerprint(std::string("a\0b", 3)), idem::fingerprint("a"));
}

TEST(OwnerToken, IsFifteenRandomBase64UrlCharacters) {
  std::set<std::string> seen;
  std::set<char> chars;
  for (int i = 0; i < 1000; ++i) {
    auto t = idem::OwnerToken::generate();
    ASSERT_EQ(idem::OwnerToken::kLength, t.str().size());
    for (char c : t.str()) {
      EXPECT_TRUE(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_') << t.str();
      chars.insert(c);
    }
    EXPECT_TRUE(seen.insert(t.str()).second);
  }
  // 15,000 random characters use the whole 64-character alphabet.
  EXPECT_EQ(64u, chars.size());
  // Inline in std::string: no heap allocation per token.
  EXPECT_LE(idem::OwnerToken::kLength, std::string().capacity());
}

TEST(Outcome, NamesAndStatuses) {
  EXPECT_EQ("executed", idem::outcome_name(idem::Outcome::kExecuted));
  EXPECT_EQ("in_progress", idem::outcome_name(idem::Outcome::kInProgress));
  EXPECT_EQ(409, idem::http_status(idem::Outcome::kInProgress));
  EXPECT_EQ(422, idem::http_status(idem::Outcome::kFingerprintMismatch));
}

// Every form libpq reads a password in, and URIs: the secret never survives, the rest does.
TEST(MaskPasswords, HidesEveryFormOfAPassword) {
  struct Case {
    std::string text;
    std::string masked;
  };
  const std::vector<Case> cases = {
      {"host=h password=S3cret user=u", "host=h password=*** user=u"},
      {"host=h password='Top S3cret' user=u", "host=h password=*** user=u"},
      {"password = S3cret user=u", "password = *** user=u"},
      {"password\t=\tS3cret", "password\t=\t***"},
      {"sslpassword=K3y host=h password=S3cret", "sslpassword=*** host=h password=***"},
      {R"(password='it\'s S3cret' user=u)", "password=*** user=u"},
      {R"(password=a\ S3cret user=u)", "password=*** user=u"},
      {"password='unterminated S3cret", "password=***"},
      {"postgresql://u:S3cret@h/db?sslmode=require", "postgresql://u:***@h/db?sslmode=require"},
      {"postgresql://u@h/db?password=S3cret&sslmode=require",
       "postgresql://u@h/db?password=***&sslmode=require"},
      {"mysql://u:S3c@ret#x@h:1/db", "mysql://u:***@h:1/db"},
      {R"(invalid URI: "postgresql://u:S3 cret@[bad" in connection)",
       R"(invalid URI: "postgresql://u:***@[bad" in connection)"},
      // A raw '"' in a URI password: only a quote that opens the URI closes it.
      {"redis:redis://:pa\"S3cret@cache:6379: refused", "redis:redis://:***@cache:6379: refused"},
      {R"(in URI: "postgresql://u:pa"S3@[bad")", R"(in URI: "postgresql://u:***@[bad")"},
      // A conninfo password may hold '&' (only a URI query ends a value there).
      {"host=h password=S3&cret", "host=h password=***"},
  };
  for (const auto& c : cases) {
    const std::string masked = idem::detail::mask_passwords(c.text);
    EXPECT_EQ(c.masked, masked) << c.text;
    EXPECT_EQ(std::string::npos, masked.find("S3")) << masked;
  }
  EXPECT_EQ("host=h user=u", idem::detail::mask_passwords("host=h user=u"));
  EXPECT_EQ("a password is needed", idem::detail::mask_passwords("a password is needed"));
}

// A URI its parser refused: besides mask_passwords, a URI without '@' after "://" (a forgotten
// host: the password reads as a port) and one without "://" (a typo in the scheme) hide all
// after their first ':'.
TEST(MaskPasswords, ARefusedUriHidesWhatCouldBeAPassword) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"amqp://guest:S3cret@h:5672", "amqp://guest:***@h:5672"},
      {"amqp://guest:S3cret", "amqp://guest:***"},
      {"redis-cluster://:S3cret", "redis-cluster://:***"},
      {"amqp:/guest:S3cret@127.0.0.1", "amqp:***"},
      {"amqp:guest:S3cret@127.0.0.1", "amqp:***"},
      {"mysql://idem:S3cret/db", "mysql://idem:***"},
  };
  for (const auto& [uri, masked] : cases) {
    EXPECT_EQ(masked, idem::detail::mask_refused_uri(uri)) << uri;
  }
  EXPECT_EQ("redis://cache/2", idem::detail::mask_refused_uri("redis://cache/2"));
}

}  // namespace
