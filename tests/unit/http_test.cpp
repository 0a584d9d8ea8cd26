// SPDX-License-Identifier: MIT
// idem::http: Idempotency-Key parsing (RFC 8941 sf-string), key scoping, the response codec and
// every answer of Endpoint (400/409/422/replay/5xx not stored), with MemoryStore and SQLite.
#include <gtest/gtest.h>

#include <atomic>
#include <exception>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "idem/http/endpoint.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/failing_store.hpp"
#include "support/test_env.hpp"

namespace {

using idem::http::ParsedKey;
using idem::http::Response;
using idem::http::parse_idempotency_key;

ParsedKey::Status status_of(std::string_view field) { return parse_idempotency_key(field).status; }

TEST(IdempotencyKeyHeader, ParsesStructuredFieldStrings) {
  EXPECT_EQ("abc", parse_idempotency_key("\"abc\"").value);
  EXPECT_EQ("8e03978e-40d5-43e8-bc93-6894a57f9324",
            parse_idempotency_key("  \"8e03978e-40d5-43e8-bc93-6894a57f9324\"\t").value);
  EXPECT_EQ("a \"quoted\" \\ key", parse_idempotency_key(R"("a \"quoted\" \\ key")").value);
  EXPECT_EQ(std::string(255, 'k'), parse_idempotency_key("\"" + std::string(255, 'k') + "\"").value);
}

TEST(IdempotencyKeyHeader, RejectsMalformedValuesWithAReason) {
  EXPECT_EQ(ParsedKey::Status::kMalformed, status_of("abc"));           // a token, not a string
  EXPECT_EQ(ParsedKey::Status::kMalformed, status_of(""));
  EXPECT_EQ(ParsedKey::Status::kMalformed, status_of("\"\""));          // empty key
  EXPECT_EQ(ParsedKey::Status::kMalformed, status_of("\"abc"));         // not closed
  EXPECT_EQ(ParsedKey::Status::kMalformed, status_of(R"("a\nb")"));     // bad escape
  EXPECT_EQ(ParsedKey::Status::kMalformed, status_of("\"a\\"));         // '\' at the end
  EXPECT_EQ(ParsedKey::Status::kMalformed, status_of("\"a\x01\""));     // control byte
  EXPECT_EQ(ParsedKey::Status::kMalformed, status_of("\"caf\xC3\xA9\""));  // non-ASCII
  EXPECT_EQ(ParsedKey::Status::kMalformed, status_of("\"a\" \"b\""));   // text after
  EXPECT_EQ(ParsedKey::Status::kMalformed, status_of("\"a\", \"b\""));  // a list
  EXPECT_EQ(ParsedKey::Status::kMalformed, status_of("\"a\";p=1"));     // parameters
  EXPECT_EQ(ParsedKey::Status::kMalformed, status_of("\"" + std::string(256, 'k') + "\""));
  auto p = parse_idempotency_key("\"a\";p=1");
  EXPECT_NE(std::string::npos, p.detail.find("parameters are not accepted"));
  EXPECT_EQ(ParsedKey::Status::kMissing, parse_idempotency_key(std::vector<std::string_view>{}).status);
  EXPECT_EQ(ParsedKey::Status::kMultiple,
            parse_idempotency_key(std::vector<std::string_view>{"\"a\"", "\"a\""}).status);
}

TEST(IdempotencyKeyHeader, BareTokensOnlyWhenAllowed) {
  using idem::http::KeySyntax;
  const auto bare = KeySyntax::kAllowBareToken;
  EXPECT_EQ(ParsedKey::Status::kMalformed, status_of("7f7d6f9c-9b2a"));  // strict by default
  EXPECT_EQ("7f7d6f9c-9b2a", parse_idempotency_key(" 7f7d6f9c-9b2a\t", bare).value);
  EXPECT_EQ("a;b=c/d:e", parse_idempotency_key("a;b=c/d:e", bare).value);
  EXPECT_EQ("abc", parse_idempotency_key("\"abc\"", bare).value);  // quoted still works
  EXPECT_EQ(std::string(255, 'k'), parse_idempotency_key(std::string(255, 'k'), bare).value);
  for (std::string bad :
       {std::string("a b"), std::string("a,b"), std::string("a\"b"), std::string("caf\xC3\xA9"),
        std::string("a\x01"), std::string(256, 'k'), std::string("")}) {
    auto p = parse_idempotency_key(bad, bare);
    EXPECT_EQ(ParsedKey::Status::kMalformed, p.status) << bad;
    EXPECT_FALSE(p.detail.empty());
  }
  // A malformed quoted value is not re-read as a token.
  EXPECT_EQ(ParsedKey::Status::kMalformed, parse_idempotency_key("\"abc", bare).status);
  EXPECT_EQ(ParsedKey::Status::kMultiple,
            parse_idempotency_key(std::vector<std::string_view>{"a", "b"}, bare).status);
}

TEST(ScopedKey, SeparatesPrincipalsMethodsRoutesAndIsInjective) {
  auto k = idem::http::scoped_key("http.orders", "alice", "POST", "/orders", "abc");
  EXPECT_EQ("http.orders", k.scope());
  EXPECT_EQ(64u, k.id().size());
  EXPECT_EQ(k, idem::http::scoped_key("http.orders", "alice", "POST", "/orders", "abc"));
  std::set<std::string> ids = {
      k.id(),
      idem::http::scoped_key("http.orders", "bob", "POST", "/orders", "abc").id(),
      idem::http::scoped_key("http.orders", "alice", "PUT", "/orders", "abc").id(),
      idem::http::scoped_key("http.orders", "alice", "POST", "/payments", "abc").id(),
      idem::http::scoped_key("http.orders", "alice", "POST", "/orders", "abd").id(),
      // length prefixes: moving a byte between parts changes the id
      idem::http::scoped_key("http.orders", "alice:", "POST", "/orders", "abc").id(),
      idem::http::scoped_key("http.orders", "alice", "POST", "/orders:", "abc").id(),
  };
  EXPECT_EQ(7u, ids.size());
  EXPECT_NE(idem::http::scoped_key("s", "a:b", "POST", "/", "c"),
            idem::http::scoped_key("s", "a", "POST", "/", "b:c"));
  // Any bytes in the parts still give a valid key; a bad scope is refused.
  EXPECT_NO_THROW(idem::http::scoped_key("s", std::string(1000, '\xFF'), "POST", "/ ", "k"));
  EXPECT_THROW(idem::http::scoped_key("bad scope", "a", "POST", "/", "k"), idem::InvalidKey);
}

TEST(ResponseCodec, RoundTripsBinaryBodiesAndRefusesDamage) {
  Response r;
  r.status = 201;
  r.headers = {{"Content-Type", "application/octet-stream"}, {"X-Empty", ""}};
  r.body = std::string("\0\xFF\r\n\"body\"", 10);
  auto bytes = idem::Codec<Response>::encode(r);
  EXPECT_EQ(r, idem::Codec<Response>::decode(bytes));
  EXPECT_THROW(idem::Codec<Response>::decode(bytes.substr(0, bytes.size() - 1)),
               std::runtime_error);
  EXPECT_THROW(idem::Codec<Response>::decode(bytes + "x"), std::runtime_error);
  EXPECT_THROW(idem::Codec<Response>::decode("not a response"), std::runtime_error);
  EXPECT_THROW(idem::Codec<Response>::decode(""), std::runtime_error);
}

TEST(Problem, IsProblemJsonWithTheErrcVocabulary) {
  auto p = idem::http::problem(idem::errc::kFingerprintMismatch, "a \"quoted\"\ndetail");
  EXPECT_EQ(422, p.status);
  ASSERT_NE(nullptr, p.header("content-type"));
  EXPECT_EQ("application/problem+json", *p.header("Content-Type"));
  EXPECT_EQ("{\"type\":\"urn:idem:error:fingerprint_mismatch\","
            "\"title\":\"this key was used with a different request payload\",\"status\":422,"
            "\"detail\":\"a \\\"quoted\\\"\\ndetail\",\"code\":\"fingerprint_mismatch\"}",
            p.body);
}

// A request with the given Idempotency-Key field lines.
struct Req {
  std::string method = "POST";
  std::string route = "/orders";
  std::string principal = "alice";
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body = "{\"sku\":\"A1\",\"qty\":2}";

  static Req with_key(const std::string& field) {
    Req r;
    r.headers.emplace_back("Idempotency-Key", field);
    return r;
  }
  idem::http::RequestView view() const {
    idem::http::RequestView v;
    v.method = method;
    v.route = route;
    v.principal = principal;
    for (auto& [n, val] : headers) v.headers.emplace_back(n, val);
    v.body = body;
    return v;
  }
};

idem::http::EndpointOptions endpoint_options() {
  idem::http::EndpointOptions o;
  o.scope = "http.orders.create";
  return o;
}

class EndpointTest : public ::testing::Test {
 protected:
  idem::MemoryStore fast_;
  idem::IdempotencyGuard<idem::NoDurableStore> guard_{fast_};
  std::atomic<int> runs_{0};

  Response created(const std::string& body) {
    ++runs_;
    Response r;
    r.status = 201;
    r.headers = {{"Content-Type", "application/json"},
                 {"Location", "/orders/1"},
                 {"Set-Cookie", "session=secret"}};
    r.body = body;
    return r;
  }
};

TEST_F(EndpointTest, MissingKeyIs400UnlessOptional) {
  idem::http::Endpoint endpoint{guard_, endpoint_options()};
  Req req;
  auto r = endpoint.handle(req.view(), [&] { return created("x"); });
  EXPECT_EQ(400, r.status);
  EXPECT_NE(std::string::npos, r.body.find("\"code\":\"missing_key\""));
  EXPECT_EQ(0, runs_.load());

  auto options = endpoint_options();
  options.key_required = false;
  idem::http::Endpoint optional{guard_, options};
  EXPECT_EQ(201, optional.handle(req.view(), [&] { return created("x"); }).status);
  EXPECT_EQ(201, optional.handle(req.view(), [&] { return created("x"); }).status);
  EXPECT_EQ(2, runs_.load());  // no key: nothing to de-duplicate on
}

TEST_F(EndpointTest, MalformedOrRepeatedKeyIs400InvalidKey) {
  idem::http::Endpoint endpoint{guard_, endpoint_options()};
  auto bare = endpoint.handle(Req::with_key("abc").view(), [&] { return created("x"); });
  EXPECT_EQ(400, bare.status);
  EXPECT_NE(std::string::npos, bare.body.find("\"code\":\"invalid_key\""));
  Req twice = Req::with_key("\"abc\"");
  twice.headers.emplace_back("idempotency-key", "\"abc\"");
  auto multiple = endpoint.handle(twice.view(), [&] { return created("x"); });
  EXPECT_EQ(400, multiple.status);
  EXPECT_NE(std::string::npos, multiple.body.find("2 Idempotency-Key header fields"));
  EXPECT_EQ(0, runs_.load());
}

TEST_F(EndpointTest, ReplaysStatusChosenHeadersAndBodyByteForByte) {
  idem::http::Endpoint endpoint{guard_, endpoint_options()};
  auto req = Req::with_key("\"order-1\"");
  std::string binary("{\"order_no\":\"ORD-1\"}\0\xFF", 22);
  auto first = endpoint.handle(req.view(), [&] {
    Response r = created(binary);
    r.headers.push_back({"Content-Encoding", "identity"});  // the body's coding is replayed
    return r;
  });
  EXPECT_EQ(201, first.status);
  ASSERT_NE(nullptr, first.header("Set-Cookie"));  // the first caller gets everything
  EXPECT_EQ(nullptr, first.header("Idempotent-Replayed"));

  auto again = endpoint.handle(req.view(), [&] { return created("other"); });
  EXPECT_EQ(1, runs_.load());
  EXPECT_EQ(201, again.status);
  EXPECT_EQ(binary, again.body);
  std::vector<idem::http::Header> expected = {{"Content-Type", "application/json"},
                                              {"Location", "/orders/1"},
                                              {"Content-Encoding", "identity"},
                                              {"Idempotent-Replayed", "true"}};
  EXPECT_EQ(expected, again.headers);
}

TEST_F(EndpointTest, NegativeWaitsAndRetryAfterAreRefused) {
  for (auto spoil : std::initializer_list<void (*)(idem::http::EndpointOptions&)>{
           [](auto& o) { o.retry_after = std::chrono::seconds(-1); },
           [](auto& o) { o.wait_for_result = std::chrono::milliseconds(-1); },
           [](auto& o) { o.max_prefer_wait = std::chrono::milliseconds(-5); }}) {
    auto options = endpoint_options();
    spoil(options);
    EXPECT_THROW((idem::http::Endpoint<idem::NoDurableStore>{guard_, options}), idem::UsageError);
  }
}

TEST_F(EndpointTest, ChangedPayloadIs422AndInFlightIs409WithRetryAfter) {
  auto options = endpoint_options();
  options.retry_after = std::chrono::seconds(3);
  idem::http::Endpoint endpoint{guard_, options};
  auto req = Req::with_key("\"k\"");
  ASSERT_EQ(201, endpoint.handle(req.view(), [&] { return created("x"); }).status);
  auto changed = req;
  changed.body = "{\"sku\":\"A1\",\"qty\":3}";
  auto r = endpoint.handle(changed.view(), [&] { return created("x"); });
  EXPECT_EQ(422, r.status);
  EXPECT_NE(std::string::npos, r.body.find("\"code\":\"fingerprint_mismatch\""));
  EXPECT_EQ(nullptr, r.header("Retry-After"));

  // Another attempt holds the scoped key.
  auto busy = Req::with_key("\"busy\"");
  auto key = idem::http::scoped_key(options.scope, "alice", "POST", "/orders", "busy");
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            fast_.claim(key, endpoint.request_fingerprint(busy.view()),
                        idem::OwnerToken::generate(), std::chrono::seconds(30)).status);
  auto held = endpoint.handle(busy.view(), [&] { return created("x"); });
  EXPECT_EQ(409, held.status);
  ASSERT_NE(nullptr, held.header("Retry-After"));
  EXPECT_EQ("3", *held.header("Retry-After"));
  EXPECT_EQ("application/problem+json", *held.header("Content-Type"));
  EXPECT_NE(std::string::npos, held.body.find("\"code\":\"in_progress\""));
  EXPECT_EQ(1, runs_.load());
}

TEST_F(EndpointTest, PrincipalsAndRoutesNeverShareResponses) {
  idem::http::Endpoint endpoint{guard_, endpoint_options()};
  auto alice = Req::with_key("\"same\"");
  auto bob = alice;
  bob.principal = "bob";
  auto other_route = alice;
  other_route.route = "/orders/bulk";
  EXPECT_EQ("alice's", endpoint.handle(alice.view(), [&] { return created("alice's"); }).body);
  EXPECT_EQ("bob's", endpoint.handle(bob.view(), [&] { return created("bob's"); }).body);
  EXPECT_EQ("bulk", endpoint.handle(other_route.view(), [&] { return created("bulk"); }).body);
  EXPECT_EQ(3, runs_.load());
  EXPECT_EQ("bob's", endpoint.handle(bob.view(), [&] { return created("x"); }).body);
}

// The default material covers the concrete path and each query parameter (length-prefixed:
// no two splits collide); a request without them has the material of earlier versions.
TEST(FingerprintMaterial, CoversPathAndQueryAndKeepsTheOldMaterialWithout) {
  idem::http::RequestView v;
  v.method = "POST";
  v.route = "/accounts/:id/refund";
  v.body = "{}";
  const std::string without = idem::http::fingerprint_material(v, {}, v.body);
  EXPECT_EQ(std::string("idem.http.fp.v1") + "4:POST" + "20:/accounts/:id/refund" + "|2:{}",
            without);
  v.path = "/accounts/1/refund";
  const std::string one = idem::http::fingerprint_material(v, {}, v.body);
  v.path = "/accounts/2/refund";
  const std::string two = idem::http::fingerprint_material(v, {}, v.body);
  EXPECT_NE(one, two);
  EXPECT_NE(without, one);
  v.query = {{"a", "bc"}};
  const std::string q1 = idem::http::fingerprint_material(v, {}, v.body);
  v.query = {{"ab", "c"}};
  EXPECT_NE(q1, idem::http::fingerprint_material(v, {}, v.body));
  EXPECT_NE(two, q1);
}

TEST_F(EndpointTest, FingerprintCoversChosenHeaders) {
  auto options = endpoint_options();
  options.fingerprint_headers = {"Content-Type"};
  idem::http::Endpoint endpoint{guard_, options};
  auto json = Req::with_key("\"h\"");
  json.headers.emplace_back("content-type", "application/json");
  auto text = Req::with_key("\"h\"");
  text.headers.emplace_back("Content-Type", "text/plain");
  EXPECT_EQ(201, endpoint.handle(json.view(), [&] { return created("x"); }).status);
  EXPECT_EQ(422, endpoint.handle(text.view(), [&] { return created("x"); }).status);
  // Without the option the header is not part of the payload.
  idem::http::Endpoint plain{guard_, [] {
                               auto o = endpoint_options();
                               o.scope = "http.orders.plain";
                               return o;
                             }()};
  EXPECT_EQ(201, plain.handle(json.view(), [&] { return created("x"); }).status);
  EXPECT_EQ(201, plain.handle(text.view(), [&] { return created("x"); }).status);
  EXPECT_EQ(2, runs_.load());
}

TEST_F(EndpointTest, ServerErrorsAreNotStoredSoARetryRunsAgain) {
  idem::http::Endpoint endpoint{guard_, endpoint_options()};
  auto req = Req::with_key("\"flaky\"");
  auto failed = endpoint.handle(req.view(), [&] {
    Response r = created("unavailable");
    r.status = 503;
    return r;
  });
  EXPECT_EQ(503, failed.status);
  EXPECT_EQ("unavailable", failed.body);
  EXPECT_EQ(201, endpoint.handle(req.view(), [&] { return created("ok"); }).status);
  auto replay = endpoint.handle(req.view(), [&] { return created("x"); });
  EXPECT_EQ("ok", replay.body);
  EXPECT_EQ(2, runs_.load());
}

// An answer kept out of the store is told to the observer as the guard's handler error (its
// claim released), with a text that says which status was not stored (the "idem handler error"
// log line quotes it).
TEST(EndpointObserved, AnUnstoredAnswerIsAHandlerErrorThatNamesItsStatus) {
  struct Heard final : idem::Observer {
    std::vector<std::string> texts;
    void on_handler_exception(const idem::Key&, const std::exception_ptr& e) noexcept override {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        texts.emplace_back(x.what());
      } catch (...) {
        texts.emplace_back("not a std::exception");
      }
    }
  };
  auto heard = std::make_shared<Heard>();
  idem::MemoryStore fast;
  idem::GuardOptions o;
  o.observer = heard;
  idem::IdempotencyGuard guard{fast, o};
  idem::http::Endpoint endpoint{guard, endpoint_options()};
  auto req = Req::with_key("\"busy\"");
  auto answer = endpoint.handle(req.view(), [] {
    Response r;
    r.status = 429;
    return r;
  });
  EXPECT_EQ(429, answer.status);
  ASSERT_EQ(1u, heard->texts.size());
  EXPECT_NE(std::string::npos, heard->texts[0].find("(status 429) is not stored"))
      << heard->texts[0];
  EXPECT_EQ(1u, guard.stats().snapshot().handler_errors);
}

// 408, 425 and 429 say "try again later": by default they are not stored, so the retry runs;
// a status outside 100..599 is never stored (its record could not be replayed), whatever
// store_response says.
TEST_F(EndpointTest, TryLaterAnswersAndImpossibleStatusesAreNotStored) {
  for (int status : {408, 425, 429, 0, 99, 600}) {
    SCOPED_TRACE(status);
    auto options = endpoint_options();
    if (status == 0 || status == 99 || status == 600) {
      options.store_response = [](int) { return true; };
    }
    idem::http::Endpoint endpoint{guard_, options};
    auto req = Req::with_key("\"later_" + std::to_string(status) + "\"");
    const int before = runs_.load();
    auto first = endpoint.handle(req.view(), [&] {
      Response r = created("later");
      r.status = status;
      return r;
    });
    EXPECT_EQ(status, first.status);
    auto retry = endpoint.handle(req.view(), [&] { return created("done"); });
    EXPECT_EQ(201, retry.status);
    EXPECT_EQ("done", retry.body);
    EXPECT_EQ(before + 2, runs_.load());
  }
  EXPECT_TRUE(idem::http::default_stored(201));
  EXPECT_TRUE(idem::http::default_stored(404));
  EXPECT_TRUE(idem::http::default_stored(409));
  EXPECT_FALSE(idem::http::default_stored(429));
  EXPECT_FALSE(idem::http::default_stored(500));
}

// An idem::Error the handler throws itself (here an InvalidKey of a key it built) is the
// handler's failure: it propagates unchanged, never answered as if the client's header broke a
// rule; the claim is released, so a retry runs. A storage failure of the handler's own work is
// answered as a store failure.
TEST_F(EndpointTest, HandlersOwnIdemErrorsPropagateAndStorageFailuresAreAnswered) {
  idem::http::Endpoint endpoint{guard_, endpoint_options()};
  auto req = Req::with_key("\"own_error\"");
  EXPECT_THROW(endpoint.handle(req.view(),
                               [&]() -> Response {
                                 ++runs_;
                                 (void)idem::Key::make("scope", "bad key with spaces");
                                 return created("x");
                               }),
               idem::InvalidKey);
  EXPECT_THROW(endpoint.handle(req.view(),
                               [&]() -> Response {
                                 ++runs_;
                                 throw idem::UsageError("handler misuse");
                               }),
               idem::UsageError);
  auto timeout = endpoint.handle(req.view(), [&]() -> Response {
    ++runs_;
    throw idem::StorageTimeout("the handler's own database");
  });
  EXPECT_EQ(503, timeout.status);
  EXPECT_NE(std::string::npos, timeout.body.find("\"code\":\"store_timeout\""));
  EXPECT_EQ(201, endpoint.handle(req.view(), [&] { return created("ok"); }).status);
  EXPECT_EQ(4, runs_.load());
}

// A pass-through answers the handler's own storage failure as the guarded path does (503 with
// Retry-After, told to the observer without a key), and lets its other idem errors propagate
// unchanged.
TEST_F(EndpointTest, PassThroughHandlersStorageFailuresAreAnsweredAsGuardedOnes) {
  struct Heard final : idem::Observer {
    std::vector<std::string> errors;
    void on_store_error(const idem::StoreErrorEvent& e) noexcept override {
      errors.push_back(std::string(e.store) + ":" + (e.key == nullptr ? "keyless" : "keyed") + ":" +
                       std::string(idem::errc_name(e.error.code())));
    }
  };
  auto heard = std::make_shared<Heard>();
  idem::GuardOptions go;
  go.observer = heard;
  idem::IdempotencyGuard<idem::NoDurableStore> guard{fast_, go};
  auto options = endpoint_options();
  options.key_required = false;
  idem::http::Endpoint endpoint{guard, options};
  Req no_key;  // an absent optional key
  Req put = Req::with_key("\"pass_put\"");
  put.method = "PUT";  // a method that is not guarded
  for (Req* req : {&no_key, &put}) {
    auto timeout = endpoint.handle(req->view(), [&]() -> Response {
      ++runs_;
      throw idem::StorageTimeout("the handler's own database");
    });
    EXPECT_EQ(503, timeout.status);
    EXPECT_NE(std::string::npos, timeout.body.find("\"code\":\"store_timeout\""));
    EXPECT_EQ(std::string::npos, timeout.body.find("own database"));
    EXPECT_NE(nullptr, timeout.header("Retry-After"));
    auto lost = endpoint.handle(req->view(), [&]() -> Response {
      ++runs_;
      throw idem::LeaseLost("the handler's own lease");
    });
    EXPECT_EQ(409, lost.status);
    EXPECT_THROW(endpoint.handle(req->view(),
                                 [&]() -> Response {
                                   ++runs_;
                                   throw idem::UsageError("handler misuse");
                                 }),
                 idem::UsageError);
  }
  EXPECT_EQ(6, runs_.load());
  // The two 503s, and nothing for the 409 or the rethrown misuse.
  EXPECT_EQ(
      (std::vector<std::string>{"handler:keyless:store_timeout", "handler:keyless:store_timeout"}),
      heard->errors);
}

TEST_F(EndpointTest, StoreFailureIs503ProblemWithRetryAfter) {
  idem::test::SwitchableFastStore failing{fast_};
  idem::IdempotencyGuard<idem::NoDurableStore> guard{failing};
  idem::http::Endpoint endpoint{guard, endpoint_options()};
  failing.failing = true;
  auto r = endpoint.handle(Req::with_key("\"down\"").view(), [&] { return created("x"); });
  EXPECT_EQ(503, r.status);
  EXPECT_NE(std::string::npos, r.body.find("\"code\":\"store_unavailable\""));
  EXPECT_EQ(std::string::npos, r.body.find("switched off"));  // backend detail stays inside
  EXPECT_NE(nullptr, r.header("Retry-After"));
  EXPECT_EQ(0, runs_.load());
}

TEST(EndpointLease, LostLeaseIs409WithoutInternalDetail) {
  idem::ManualClock clock;
  idem::MemoryStoreOptions mo;
  mo.clock = clock.as_clock();
  idem::MemoryStore fast{mo};
  idem::GuardOptions go;
  go.lease = std::chrono::seconds(5);
  idem::IdempotencyGuard<idem::NoDurableStore> guard{fast, go};
  idem::http::EndpointOptions options;
  options.scope = "http.slow";
  idem::http::Endpoint endpoint{guard, options};
  auto req = Req::with_key("\"slow\"");
  auto key = idem::http::scoped_key("http.slow", "alice", "POST", "/orders", "slow");
  auto r = endpoint.handle(req.view(), [&] {
    clock.advance(std::chrono::seconds(6));  // the lease ends; another attempt takes over
    (void)fast.claim(key, endpoint.request_fingerprint(req.view()), idem::OwnerToken::generate(),
                     std::chrono::seconds(5));
    return Response{201, {}, "late"};
  });
  EXPECT_EQ(409, r.status);
  EXPECT_NE(std::string::npos, r.body.find("\"code\":\"lease_lost\""));
  EXPECT_EQ(std::string::npos, r.body.find("GuardOptions"));  // tuning advice stays in logs
  EXPECT_NE(nullptr, r.header("Retry-After"));
}

TEST_F(EndpointTest, PassThroughsAndRejectionsReachTheObserver) {
  struct Recorder : idem::Observer {
    std::vector<std::string> events;
    void on_rejected_request(const idem::RejectedRequestEvent& e) noexcept override {
      events.push_back(std::string(idem::reject_reason_name(e.reason)) + ":" +
                       std::to_string(e.status));
    }
    void on_passthrough(const idem::PassthroughEvent& e) noexcept override {
      events.push_back(std::string(idem::passthrough_reason_name(e.reason)));
    }
  };
  auto recorder = std::make_shared<Recorder>();
  idem::GuardOptions go;
  go.observer = recorder;
  idem::IdempotencyGuard<idem::NoDurableStore> guard{fast_, go};
  auto options = endpoint_options();
  options.max_body_bytes = 10;
  idem::http::Endpoint endpoint{guard, options};
  auto handler = [&] { return created("x"); };
  Req small = Req::with_key("\"k\"");
  small.body = "0123456789";
  Req big = small;
  big.body += "!";
  Req get = small;
  get.method = "GET";
  Req no_key = small;
  no_key.headers.clear();
  Req changed = small;
  changed.body = "9876543210";
  EXPECT_EQ(201, endpoint.handle(small.view(), handler).status);
  EXPECT_EQ(413, endpoint.handle(big.view(), handler).status);
  EXPECT_EQ(201, endpoint.handle(get.view(), handler).status);
  EXPECT_EQ(400, endpoint.handle(no_key.view(), handler).status);
  EXPECT_EQ(422, endpoint.handle(changed.view(), handler).status);
  Req bare = Req::with_key("bare");
  bare.body = small.body;
  EXPECT_EQ(400, endpoint.handle(bare.view(), handler).status);
  std::vector<std::string> expected = {"payload_too_large:413", "method", "missing_key:400",
                                       "fingerprint_mismatch:422", "invalid_key:400"};
  EXPECT_EQ(expected, recorder->events);
  EXPECT_EQ(2, runs_.load());
  // An empty method list guards nothing; the methods are compared exactly.
  options.guarded_methods = {};
  idem::http::Endpoint none{guard, options};
  EXPECT_FALSE(none.guards("POST"));
  EXPECT_TRUE(endpoint.guards("PATCH"));
  EXPECT_FALSE(endpoint.guards("post"));
}

TEST(EndpointSqlite, TransactionalPassThroughGetsAPlainTransaction) {
  idem::test::TempDir dir;
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable{dir.file("pass.sqlite")};
  durable.database().write(
      [](idem::sqlite::Transaction& tx) { tx.exec("CREATE TABLE t (v TEXT)"); });
  idem::IdempotencyGuard guard{fast, durable};
  idem::http::EndpointOptions options;
  options.scope = "http.pass";
  options.key_required = false;
  idem::http::Endpoint endpoint{guard, options};
  Req req;  // no key
  auto write = [&](idem::sqlite::Transaction& tx) {
    tx.exec("INSERT INTO t (v) VALUES ('x')");
    return Response{201, {}, "ok"};
  };
  EXPECT_EQ(201, endpoint.handle(req.view(), write).status);
  EXPECT_EQ(201, endpoint.handle(req.view(), write).status);
  // The handler's writes committed; a throwing handler's rolled back and propagate.
  EXPECT_THROW((void)endpoint.handle(req.view(),
                                     [](idem::sqlite::Transaction& tx) -> Response {
                                       tx.exec("INSERT INTO t (v) VALUES ('rolled back')");
                                       throw std::runtime_error("handler");
                                     }),
               std::runtime_error);
  // The handler's own storage failure is answered as on the guarded path (and rolled back).
  auto timeout = endpoint.handle(req.view(), [](idem::sqlite::Transaction& tx) -> Response {
    tx.exec("INSERT INTO t (v) VALUES ('rolled back too')");
    throw idem::StorageTimeout("the handler's own statement");
  });
  EXPECT_EQ(503, timeout.status);
  EXPECT_NE(std::string::npos, timeout.body.find("\"code\":\"store_timeout\""));
  EXPECT_NE(nullptr, timeout.header("Retry-After"));
  auto rows = durable.database().read([](idem::sqlite::Session& s) {
    return s.query_int64("SELECT count(*) FROM t").value_or(-1);
  });
  EXPECT_EQ(2, rows);
  auto records = durable.database().read([](idem::sqlite::Session& s) {
    return s.query_int64("SELECT count(*) FROM api_idempotency").value_or(-1);
  });
  EXPECT_EQ(0, records);
}

TEST_F(EndpointTest, BadScopeIsRefusedAtConstruction) {
  auto options = endpoint_options();
  options.scope = "orders create";
  EXPECT_THROW((idem::http::Endpoint{guard_, options}), idem::InvalidKey);
}

TEST(EndpointSqlite, TransactionalHandlerWritesOnceUnderSixteenThreads) {
  idem::test::TempDir dir;
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable{dir.file("http.sqlite")};
  durable.database().write([](idem::sqlite::Transaction& tx) {
    tx.exec("CREATE TABLE orders (order_no TEXT PRIMARY KEY, body TEXT)");
  });
  idem::IdempotencyGuard guard{fast, durable};
  idem::http::Endpoint endpoint{guard, endpoint_options()};
  auto req = Req::with_key("\"concurrent\"");
  std::atomic<int> runs{0};
  std::vector<Response> answers(16);
  std::vector<std::thread> threads;
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back([&, i] {
      answers[static_cast<std::size_t>(i)] =
          endpoint.handle(req.view(), [&](idem::sqlite::Transaction& tx) {
            int n = ++runs;
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            std::string no = "ORD-" + std::to_string(n);
            tx.exec("INSERT INTO orders (order_no, body) VALUES (?, ?)", no, req.body);
            return Response{201, {{"Content-Type", "application/json"}}, no};
          });
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(1, runs.load());
  int ok = 0, in_progress = 0;
  for (auto& a : answers) {
    if (a.status == 201) {
      ++ok;
      EXPECT_EQ("ORD-1", a.body);
    } else {
      EXPECT_EQ(409, a.status);
      ++in_progress;
    }
  }
  EXPECT_EQ(16, ok + in_progress);
  EXPECT_GE(ok, 1);
  auto rows = durable.database().read([](idem::sqlite::Session& s) {
    return s.query_int64("SELECT count(*) FROM orders").value_or(-1);
  });
  EXPECT_EQ(1, rows);
}

}  // namespace
