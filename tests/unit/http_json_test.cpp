// SPDX-License-Identifier: MIT
// idem::http::canonical_json (RFC 8785): the RFC's own vectors (number serialisation, member
// order by UTF-16 code units, string escapes), what is refused, and json_fingerprint() as an
// Endpoint hook (the same meaning replays, another meaning is 422).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "idem/http/json.hpp"
#include "idem/memory_store.hpp"

namespace {

using idem::http::canonical_json;

double from_bits(std::uint64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

TEST(CanonicalJson, NumbersAsEcmaScriptPrintsThemRfc8785AppendixB) {
  const std::pair<std::uint64_t, const char*> cases[] = {
      {0x0000000000000000, "0"},
      {0x8000000000000000, "0"},
      {0x0000000000000001, "5e-324"},
      {0x8000000000000001, "-5e-324"},
      {0x7fefffffffffffff, "1.7976931348623157e+308"},
      {0xffefffffffffffff, "-1.7976931348623157e+308"},
      {0x4340000000000000, "9007199254740992"},
      {0xc340000000000000, "-9007199254740992"},
      {0x4430000000000000, "295147905179352830000"},
      {0x44b52d02c7e14af5, "9.999999999999997e+22"},
      {0x44b52d02c7e14af6, "1e+23"},
      {0x44b52d02c7e14af7, "1.0000000000000001e+23"},
      {0x444b1ae4d6e2ef4e, "999999999999999700000"},
      {0x444b1ae4d6e2ef4f, "999999999999999900000"},
      {0x444b1ae4d6e2ef50, "1e+21"},
      {0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"},
      {0x3eb0c6f7a0b5ed8d, "0.000001"},
      {0x41b3de4355555553, "333333333.3333332"},
      {0x41b3de4355555554, "333333333.33333325"},
      {0x41b3de4355555555, "333333333.3333333"},
      {0x41b3de4355555556, "333333333.3333334"},
      {0x41b3de4355555557, "333333333.33333343"},
      {0xbecbf647612f3696, "-0.0000033333333333333333"},
      {0x43143ff3c1cb0959, "1424953923781206.2"},
  };
  for (const auto& [bits, text] : cases) {
    EXPECT_EQ(text, idem::http::detail::es_number(from_bits(bits))) << std::hex << bits;
  }
  // The same numbers written differently in a document are the same text.
  EXPECT_EQ("[1,1,100,0.5,-0.002,1e-7,1e+21,0]",
            *canonical_json("[1.0, 1E0, 1e2, 5e-1, -2e-3, 0.0000001, 1000000000000000000000, -0]"));
}

TEST(CanonicalJson, TheRfc8785Example) {
  const char* input = R"({
    "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
    "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
    "literals": [null, true, false]
  })";
  EXPECT_EQ(
      "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],"
      "\"string\":\"\xE2\x82\xAC$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}",
      *canonical_json(input));
}

TEST(CanonicalJson, MembersSortByUtf16CodeUnitsRecursively) {
  // RFC 8785 3.2.3: U+1F600 (surrogates D83D DE00) sorts before U+FB33, although its UTF-8
  // bytes (F0 ...) sort after (EF ...).
  const char* input = R"({
    "\u20ac": "Euro Sign",
    "\r": "Carriage Return",
    "\ufb33": "Hebrew Letter Dalet With Dagesh",
    "1": "One",
    "\ud83d\ude00": "Emoji: Grinning Face",
    "\u0080": "Control",
    "\u00f6": "Latin Small Letter O With Diaeresis"
  })";
  auto out = canonical_json(input);
  ASSERT_TRUE(out.has_value());
  std::vector<std::string> order = {"Carriage Return",
                                    "One",
                                    "Control",
                                    "Latin Small Letter O With Diaeresis",
                                    "Euro Sign",
                                    "Emoji: Grinning Face",
                                    "Hebrew Letter Dalet With Dagesh"};
  std::size_t pos = 0;
  for (const auto& name : order) {
    auto at = out->find(name);
    ASSERT_NE(std::string::npos, at) << name;
    EXPECT_GT(at, pos) << name << " in " << *out;
    pos = at;
  }
  EXPECT_EQ(R"({"a":{"b":[{"c":1,"d":2}],"e":null},"z":true})",
            *canonical_json(
                R"( { "z" : true , "a" : { "e" : null, "b" : [ { "d" : 2, "c" : 1 } ] } } )"));
}

TEST(CanonicalJson, RefusesWhatIsNotOneIJsonValue) {
  EXPECT_FALSE(canonical_json("").has_value());
  EXPECT_FALSE(canonical_json("{").has_value());
  EXPECT_FALSE(canonical_json("{\"a\":1,}").has_value());           // trailing comma
  EXPECT_FALSE(canonical_json("{\"a\":1} {\"b\":2}").has_value());  // two values
  EXPECT_FALSE(canonical_json("// c\n1").has_value());              // comments
  EXPECT_FALSE(canonical_json("{\"a\":1,\"a\":2}").has_value());    // a name twice
  EXPECT_FALSE(canonical_json("{\"x\":{\"a\":1,\"a\":1}}").has_value());
  EXPECT_FALSE(canonical_json("\"\\ud800\"").has_value());   // lone surrogate
  EXPECT_FALSE(canonical_json("\"\xC3\x28\"").has_value());  // invalid UTF-8
  EXPECT_FALSE(canonical_json("1e400").has_value());         // beyond a double
  // An integer no double holds (2^53 + 1): not I-JSON, so amounts that differ never compare
  // equal; an exact one beyond 2^53 is kept.
  EXPECT_FALSE(canonical_json("{\"amount\":9007199254740993}").has_value());
  EXPECT_FALSE(canonical_json("-9007199254740993").has_value());
  EXPECT_FALSE(canonical_json("18446744073709551615").has_value());
  EXPECT_EQ("9007199254740992", *canonical_json("9007199254740992"));
  // 2^60, printed as ECMAScript prints it (shortest round-trip digits)
  EXPECT_EQ("1152921504606847000", *canonical_json("1152921504606846976"));
  EXPECT_FALSE(canonical_json("NaN").has_value());
  // Scalars at the top level are JSON texts (RFC 8259).
  EXPECT_EQ("\"x\"", *canonical_json(" \"x\" "));
  EXPECT_EQ("null", *canonical_json("null"));
  // The same name in two objects is fine.
  EXPECT_EQ("[{\"a\":1},{\"a\":2}]", *canonical_json("[{\"a\":1},{\"a\":2}]"));
}

TEST(CanonicalJson, StringsKeepUtf8AndEscapeOnlyWhatRfc8785Escapes) {
  EXPECT_EQ("\"caf\xC3\xA9\"", *canonical_json("\"caf\\u00e9\""));
  EXPECT_EQ("\"caf\xC3\xA9\"", *canonical_json("\"caf\xC3\xA9\""));
  EXPECT_EQ("\"\\b\\f\\n\\r\\t\\u0001\\u001f\x7F/\"",
            *canonical_json("\"\\b\\f\\n\\r\\t\\u0001\\u001F\\u007f\\/\""));
}

// A body nested hundreds of thousands of levels deep (what a 1 MiB body, the Endpoint's default
// limit, can hold) is canonicalised like any other: members sorted at every level, arrays kept
// in order. Each level's text used to be copied into its parent's, quadratic in the depth: a
// 1 MiB body of nested arrays took 21 s of CPU per request, and this test minutes (its binary
// has a 60 s timeout, tests/unit/CMakeLists.txt); now ~2 s here, all of it in the parser.
TEST(CanonicalJson, DeeplyNestedBodiesAreCanonicalisedWhole) {
  const std::size_t depth = 500000;
  std::string arrays(depth, '[');
  arrays += "1";
  arrays.append(depth, ']');
  EXPECT_EQ(arrays, *canonical_json(arrays));
  // {"z":0,"a":{"z":0,"a":{... 1 ...}}} -> {"a":{"a":{... 1 ...},"z":0},"z":0}
  std::string objects, expected;
  for (std::size_t i = 0; i < depth; ++i) objects += "{ \"z\": 0, \"a\": ";
  for (std::size_t i = 0; i < depth; ++i) expected += "{\"a\":";
  objects += "1";
  expected += "1";
  for (std::size_t i = 0; i < depth; ++i) {
    objects += " }";
    expected += ",\"z\":0}";
  }
  EXPECT_EQ(expected, *canonical_json(objects));
  // A name twice deep inside is still refused.
  std::string twice(depth, '[');
  twice += "{\"a\":1,\"a\":2}";
  twice.append(depth, ']');
  EXPECT_FALSE(canonical_json(twice).has_value());
}

idem::http::RequestView json_request(std::string_view body) {
  idem::http::RequestView v;
  v.method = "POST";
  v.route = "/orders";
  v.principal = "alice";
  v.headers = {{"Idempotency-Key", "\"json-1\""}, {"Content-Type", "application/json"}};
  v.body = body;
  return v;
}

TEST(JsonFingerprint, SameMeaningReplaysOtherMeaningIs422) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard<idem::NoDurableStore> guard{fast};
  idem::http::EndpointOptions options;
  options.scope = "http.orders.json";
  options.fingerprint = idem::http::json_fingerprint({"Content-Type"});
  idem::http::Endpoint endpoint{guard, options};
  int runs = 0;
  auto handler = [&] {
    ++runs;
    return idem::http::Response{201, {{"Content-Type", "application/json"}}, "{\"order\":1}"};
  };
  EXPECT_EQ(201, endpoint.handle(json_request(R"({"sku":"A1","qty":2})"), handler).status);
  auto again =
      endpoint.handle(json_request("{ \"qty\" : 2.0,\n  \"sku\" : \"\\u0041\\u0031\" }"), handler);
  EXPECT_EQ(201, again.status);
  ASSERT_NE(nullptr, again.header("Idempotent-Replayed"));
  EXPECT_EQ(1, runs);
  EXPECT_EQ(422, endpoint.handle(json_request(R"({"sku":"A1","qty":3})"), handler).status);
  // A body that is not JSON is fingerprinted by its bytes: the handler decides what it means.
  auto raw = json_request("not json");
  raw.headers[0].second = "\"json-2\"";
  EXPECT_EQ(201, endpoint.handle(raw, handler).status);
  auto raw_again = raw;
  raw_again.body = "not  json";
  EXPECT_EQ(422, endpoint.handle(raw_again, handler).status);
  // The header stays covered.
  auto text = json_request(R"({"qty":2,"sku":"A1"})");
  text.headers[1].second = "text/plain";
  EXPECT_EQ(422, endpoint.handle(text, handler).status);
  EXPECT_EQ(2, runs);
}

}  // namespace
