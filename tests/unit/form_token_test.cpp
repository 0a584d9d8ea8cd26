// SPDX-License-Identifier: MIT
// idem::http::FormTokens: issue and check (scope, principal, expiry, forgery), and an Endpoint
// that accepts only issued tokens: first submit runs, resubmits replay (even after the token
// expired), unknown and expired tokens get 403 unknown_token with nothing stored, a failed
// handler leaves the token usable, sixteen concurrent submits of one token run once.
#include "idem/http/form_token.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/failing_store.hpp"
#include "support/test_env.hpp"

namespace {

using idem::http::FormTokenOptions;
using idem::http::FormTokens;
using idem::http::Response;
using idem::http::TokenStatus;

// A store and a token issuer on one manual clock.
struct Fixture {
  idem::ManualClock clock;
  idem::MemoryStore store{[this] {
    idem::MemoryStoreOptions o;
    o.clock = clock.as_clock();
    return o;
  }()};
  FormTokens tokens{store, [this] {
                      FormTokenOptions o;
                      o.scope = "form.checkout";
                      o.ttl = std::chrono::seconds(60);
                      o.clock = clock.as_clock();
                      return o;
                    }()};
};

TEST(FormTokens, IssuedTokenIsValidForItsPrincipalAndScopeOnly) {
  Fixture f;
  auto t = f.tokens.issue("alice");
  EXPECT_EQ(0u, t.value.rfind("ft1.", 0));
  EXPECT_EQ("\"" + t.value + "\"", t.header_value());
  EXPECT_EQ(f.clock.now() + std::chrono::seconds(60), t.expires_at);
  EXPECT_EQ(TokenStatus::kValid, f.tokens.check("alice", t.value));
  EXPECT_EQ(TokenStatus::kUnknown, f.tokens.check("bob", t.value));  // bound to alice
  EXPECT_EQ(TokenStatus::kUnknown, f.tokens.check("", t.value));
  FormTokens other{f.store, [&] {
                     FormTokenOptions o;
                     o.scope = "form.transfer";
                     o.clock = f.clock.as_clock();
                     return o;
                   }()};
  EXPECT_EQ(TokenStatus::kUnknown, other.check("alice", t.value));  // another form's scope
  // Tokens never repeat.
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) EXPECT_TRUE(seen.insert(f.tokens.issue("alice").value).second);
}

TEST(FormTokens, MadeUpAndEditedTokensAreUnknown) {
  Fixture f;
  auto t = f.tokens.issue("alice");
  for (std::string bad :
       {std::string("abc"), std::string("ft1."), std::string("ft1.123"), std::string("ft1..x"),
        std::string("ft2") + t.value.substr(3), t.value + "0",
        t.value.substr(0, t.value.size() - 1),
        t.value.substr(0, t.value.size() - 1) + (t.value.back() == 'a' ? "b" : "a")}) {
    EXPECT_EQ(TokenStatus::kUnknown, f.tokens.check("alice", bad)) << bad;
  }
  // A well-formed token with a later expiry that was never issued (an edited expiry).
  auto dot = t.value.find('.', 4);
  long long expiry = std::stoll(t.value.substr(4, dot - 4));
  std::string later = "ft1." + std::to_string(expiry + 3600) + t.value.substr(dot);
  EXPECT_EQ(TokenStatus::kUnknown, f.tokens.check("alice", later));
  std::string upper = t.value;
  for (auto& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  EXPECT_EQ(TokenStatus::kUnknown, f.tokens.check("alice", upper));
}

TEST(FormTokens, ExpiresAfterItsTtlAndSaysSoEvenOnceTheStoreDroppedIt) {
  Fixture f;
  auto t = f.tokens.issue("alice");
  f.clock.advance(std::chrono::seconds(59));
  EXPECT_EQ(TokenStatus::kValid, f.tokens.check("alice", t.value));
  f.clock.advance(std::chrono::seconds(1));
  EXPECT_EQ(TokenStatus::kExpired, f.tokens.check("alice", t.value));
  EXPECT_GT(f.store.purge_expired(), 0u);  // the store dropped the record
  EXPECT_EQ(TokenStatus::kExpired, f.tokens.check("alice", t.value));
  f.clock.advance(std::chrono::hours(1));
  EXPECT_EQ(TokenStatus::kExpired, f.tokens.check("alice", t.value));
}

TEST(FormTokens, RefusesBadOptions) {
  idem::MemoryStore store;
  EXPECT_THROW((FormTokens{store, FormTokenOptions{"bad scope", std::chrono::seconds(1), {}}}),
               idem::InvalidKey);
  EXPECT_THROW((FormTokens{store, FormTokenOptions{"form.x", std::chrono::seconds(0), {}}}),
               idem::UsageError);
  FormTokens tokens{store, FormTokenOptions{"form.x", std::chrono::hours(2), {}}};
  idem::http::EndpointOptions options;
  options.scope = "http.x";
  idem::GuardOptions guard_options;
  guard_options.retention = std::chrono::hours(1);
  EXPECT_THROW(tokens.require_issued(options, guard_options), idem::UsageError);
  EXPECT_FALSE(options.admit_key);
  guard_options.retention = std::chrono::hours(2);
  options.key_required = false;
  tokens.require_issued(options, guard_options);
  EXPECT_TRUE(options.admit_key);
  EXPECT_TRUE(options.key_required);
}

// A request carrying `key` as its Idempotency-Key.
struct Submit {
  std::string principal = "alice";
  std::string field;
  std::string body = "{\"sku\":\"A1\",\"qty\":1}";
  idem::http::RequestView view() const {
    idem::http::RequestView v;
    v.method = "POST";
    v.route = "/checkout";
    v.principal = principal;
    v.headers.emplace_back("Idempotency-Key", field);
    v.body = body;
    return v;
  }
};

// The checkout endpoint on SQLite (transactional handler) with tokens in the memory store.
class CheckoutTest : public ::testing::Test {
 protected:
  void SetUp() override {
    durable_ = std::make_unique<idem::sqlite::SqliteStore>(dir_.file("checkout.sqlite"));
    durable_->database().write([](idem::sqlite::Transaction& tx) {
      tx.exec("CREATE TABLE orders (id INTEGER PRIMARY KEY, principal TEXT, body TEXT)");
    });
    guard_ =
        std::make_unique<idem::IdempotencyGuard<idem::sqlite::SqliteStore>>(f_.store, *durable_);
    idem::http::EndpointOptions options;
    options.scope = "http.checkout";
    f_.tokens.require_issued(options, guard_->options());
    endpoint_ = std::make_unique<idem::http::Endpoint<idem::sqlite::SqliteStore>>(*guard_, options);
  }

  Response submit(const Submit& s) {
    return endpoint_->handle(s.view(), [&](idem::sqlite::Transaction& tx) {
      ++runs_;
      tx.exec("INSERT INTO orders (principal, body) VALUES (?, ?)", s.principal, s.body);
      auto id = tx.query_int64("SELECT last_insert_rowid()").value_or(0);
      return Response{
          201, {{"Content-Type", "application/json"}}, "{\"order\":" + std::to_string(id) + "}"};
    });
  }
  std::int64_t count(const std::string& sql) {
    return durable_->database().read(
        [&](idem::sqlite::Session& s) { return s.query_int64(sql).value_or(-1); });
  }
  std::int64_t orders() { return count("SELECT count(*) FROM orders"); }
  std::int64_t records() { return count("SELECT count(*) FROM " + durable_->table()); }

  idem::test::TempDir dir_;
  Fixture f_;
  std::unique_ptr<idem::sqlite::SqliteStore> durable_;
  std::unique_ptr<idem::IdempotencyGuard<idem::sqlite::SqliteStore>> guard_;
  std::unique_ptr<idem::http::Endpoint<idem::sqlite::SqliteStore>> endpoint_;
  std::atomic<int> runs_{0};
};

TEST_F(CheckoutTest, FirstSubmitRunsResubmitsReplayEvenAfterTheTokenExpired) {
  Submit s;
  s.field = f_.tokens.issue("alice").header_value();
  auto first = submit(s);
  ASSERT_EQ(201, first.status) << first.body;
  EXPECT_EQ(nullptr, first.header("Idempotent-Replayed"));
  for (int i = 0; i < 3; ++i) {
    auto again = submit(s);
    EXPECT_EQ(201, again.status);
    EXPECT_EQ(first.body, again.body);
    ASSERT_NE(nullptr, again.header("Idempotent-Replayed"));
  }
  f_.clock.advance(std::chrono::hours(1));  // the token expired; its record still answers
  EXPECT_EQ(first.body, submit(s).body);
  EXPECT_EQ(1, runs_.load());
  EXPECT_EQ(1, orders());
  EXPECT_EQ(1, records());
}

TEST_F(CheckoutTest, UnknownTokensAre403UnknownTokenAndStoreNothing) {
  auto issued = f_.tokens.issue("alice");
  std::vector<Submit> refused(3);
  refused[0].field = "\"made-up-by-the-client\"";
  refused[1].field = issued.header_value();
  refused[1].principal = "bob";  // alice's token in bob's session
  refused[2].field = "\"ft1.99999999999.0123456789abcdef0123456789abcdef\"";
  for (const auto& s : refused) {
    auto r = submit(s);
    EXPECT_EQ(403, r.status) << s.field;
    EXPECT_EQ("application/problem+json", *r.header("Content-Type"));
    EXPECT_NE(std::string::npos, r.body.find("\"code\":\"unknown_token\"")) << r.body;
    EXPECT_NE(std::string::npos, r.body.find("not a form token this server issued"));
    EXPECT_EQ(nullptr, r.header("Retry-After"));
    // Refused again the same way: the refusal was not stored.
    EXPECT_EQ(403, submit(s).status);
  }
  EXPECT_EQ(0, runs_.load());
  EXPECT_EQ(0, orders());
  EXPECT_EQ(0, records());
  // The refusals released their claims: the issued token still works for alice.
  Submit ok;
  ok.field = issued.header_value();
  EXPECT_EQ(201, submit(ok).status);
  // A malformed field stays 400 invalid_key, a missing one 400 missing_key.
  Submit bare;
  bare.field = issued.value;  // not an sf-string
  auto r = submit(bare);
  EXPECT_EQ(400, r.status);
  EXPECT_NE(std::string::npos, r.body.find("\"code\":\"invalid_key\""));
}

TEST_F(CheckoutTest, ExpiredTokenIs403WithAnExpiredDetail) {
  Submit s;
  s.field = f_.tokens.issue("alice").header_value();
  f_.clock.advance(std::chrono::seconds(61));
  auto r = submit(s);
  EXPECT_EQ(403, r.status);
  EXPECT_NE(std::string::npos, r.body.find("\"code\":\"unknown_token\""));
  EXPECT_NE(std::string::npos, r.body.find("expired"));
  EXPECT_EQ(0, runs_.load());
  EXPECT_EQ(0, records());
}

TEST_F(CheckoutTest, AFailedHandlerLeavesTheTokenUsableForTheRetry) {
  Submit s;
  s.field = f_.tokens.issue("alice").header_value();
  EXPECT_THROW(endpoint_->handle(s.view(),
                                 [&](idem::sqlite::Transaction& tx) -> Response {
                                   tx.exec("INSERT INTO orders (principal) VALUES ('x')");
                                   throw std::runtime_error("payment gateway down");
                                 }),
               std::runtime_error);
  auto unavailable = endpoint_->handle(s.view(), [&](idem::sqlite::Transaction&) {
    return Response{503, {}, "try later"};
  });
  EXPECT_EQ(503, unavailable.status);
  EXPECT_EQ(0, orders());
  auto r = submit(s);
  EXPECT_EQ(201, r.status);
  EXPECT_EQ(1, orders());
  EXPECT_EQ(1, runs_.load());
}

TEST_F(CheckoutTest, SixteenConcurrentSubmitsOfOneTokenRunOnce) {
  Submit s;
  s.field = f_.tokens.issue("alice").header_value();
  std::vector<Response> answers(16);
  std::vector<std::thread> threads;
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back([&, i] {
      answers[static_cast<std::size_t>(i)] =
          endpoint_->handle(s.view(), [&](idem::sqlite::Transaction& tx) {
            ++runs_;
            std::this_thread::sleep_for(std::chrono::milliseconds(30));
            tx.exec("INSERT INTO orders (principal, body) VALUES (?, ?)", s.principal, s.body);
            return Response{201, {}, "the order"};
          });
    });
  }
  for (auto& t : threads) t.join();
  int created = 0, in_progress = 0;
  for (const auto& a : answers) {
    if (a.status == 201) {
      ++created;
      EXPECT_EQ("the order", a.body);
    } else {
      EXPECT_EQ(409, a.status) << a.body;
      ++in_progress;
    }
  }
  EXPECT_GE(created, 1);
  EXPECT_EQ(16, created + in_progress);
  EXPECT_EQ(1, runs_.load());
  EXPECT_EQ(1, orders());
}

TEST(FormTokenEndpoint, TwoPhaseHandlersAreCheckedTooAndAStoreFailureIs503) {
  Fixture f;
  idem::test::SwitchableFastStore tokens_store{f.store};
  FormTokens tokens{tokens_store,
                    FormTokenOptions{"form.pay", std::chrono::seconds(60), f.clock.as_clock()}};
  idem::MemoryStore fast;
  idem::IdempotencyGuard<idem::NoDurableStore> guard{fast};
  idem::http::EndpointOptions options;
  options.scope = "http.pay";
  options.problem_type_prefix = "urn:shop:";
  tokens.require_issued(options, guard.options());
  idem::http::Endpoint endpoint{guard, options};
  int runs = 0;
  auto pay = [&] {
    ++runs;
    return Response{200, {}, "paid"};
  };
  Submit made_up;
  made_up.field = "\"abc\"";
  auto refused = endpoint.handle(made_up.view(), pay);
  EXPECT_EQ(403, refused.status);
  EXPECT_NE(std::string::npos, refused.body.find("\"type\":\"urn:shop:unknown_token\""));
  Submit s;
  s.field = tokens.issue("alice").header_value();
  tokens_store.failing = true;  // the token store is down: the check cannot be made
  auto down = endpoint.handle(s.view(), pay);
  EXPECT_EQ(503, down.status);
  EXPECT_NE(std::string::npos, down.body.find("\"code\":\"store_unavailable\""));
  tokens_store.failing = false;
  EXPECT_EQ(200, endpoint.handle(s.view(), pay).status);
  EXPECT_EQ("paid", endpoint.handle(s.view(), pay).body);
  EXPECT_EQ(1, runs);
}

}  // namespace
