// SPDX-License-Identifier: MIT
// idem::grpc against a real grpc++ server and client on loopback, SQLite (embedded) behind it:
// every answer (executed, replayed byte for byte, in progress, mismatch, invalid and missing
// key, store down), the storage policy of handler statuses, principals (hook and auth
// context), the callback API, client retry policies, hedged traffic and a lost answer.
#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/auth_metadata_processor.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "grpc_test_support.hpp"
#include "idem/log.hpp"
#include "idem/memory_store.hpp"
#include "support/test_env.hpp"

namespace {

using namespace idem::test::grpc_support;
using grpc_payment::SqliteLedger;
using Guard = idem::IdempotencyGuard<idem::sqlite::SqliteStore>;
using Tx = idem::sqlite::Transaction;

// Lines of a LoggingObserver.
struct Lines {
  std::mutex mu;
  std::vector<std::string> lines;
  std::shared_ptr<idem::LoggingObserver> observer() {
    return std::make_shared<idem::LoggingObserver>([this](idem::LogLevel, std::string_view l) {
      std::lock_guard<std::mutex> lock(mu);
      lines.emplace_back(l);
    });
  }
  int count(const std::string& needle) {
    std::lock_guard<std::mutex> lock(mu);
    int n = 0;
    for (const auto& l : lines) n += l.find(needle) != std::string::npos ? 1 : 0;
    return n;
  }
};

// Payments.Charge on SQLite with a MemoryStore in front, served on loopback port `port` (0: a
// free one).
class Bank {
 public:
  explicit Bank(grpc_payment::ServiceOptions so = {}, idem::GuardOptions go = {},
                idem::sqlite::SqliteStoreOptions store = {}, int port = 0)
      : durable_(dir_.file("bank.sqlite"), store),
        guard_(fast_, durable_, std::move(go)),
        ledger_(durable_),
        service_(guard_, ledger_, so) {
    ledger_.open_accounts(4, 1'000'000);
    server_ = std::make_unique<Server>(std::vector<grpc::Service*>{&service_},
                                       grpc::InsecureServerCredentials(), port);
  }

  std::string address() const { return server_->address(); }
  std::string path() const { return dir_.file("bank.sqlite"); }
  Guard& guard() { return guard_; }
  SqliteLedger& ledger() { return ledger_; }
  idem::GuardStatsSnapshot stats() const { return guard_.stats().snapshot(); }
  std::unique_ptr<pb::Payments::Stub> stub(const std::string& service_config = "") const {
    return pb::Payments::NewStub(grpc_payment::make_channel(address(), service_config));
  }

 private:
  idem::test::TempDir dir_;
  idem::sqlite::SqliteStore durable_;
  idem::MemoryStore fast_;
  Guard guard_;
  SqliteLedger ledger_;
  grpc_payment::PaymentService<SqliteLedger> service_;
  std::unique_ptr<Server> server_;
};

using KeyMetadata = std::vector<std::pair<std::string, std::string>>;
KeyMetadata key(const std::string& k) { return {{"idempotency-key", k}}; }

// --- the basic answers ----------------------------------------------------------------------

TEST(GrpcMethod, ExecutedThenReplayedByteForByte) {
  Lines log;
  idem::GuardOptions go;
  go.observer = log.observer();
  Bank bank({}, go);
  auto channel = grpc_payment::make_channel(bank.address(), "");
  auto req = charge_request("acct-0001", 1'250);
  (*req.mutable_labels())["cart"] = "c-17";

  RawAnswer first = raw_call(channel, grpc_payment::kChargeMethod, req, key("k-1"));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ("", first.trailer("idempotent-replayed"));
  RawAnswer second = raw_call(channel, grpc_payment::kChargeMethod, req, key("k-1"));
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ("true", second.trailer("idempotent-replayed"));
  EXPECT_EQ(first.bytes, second.bytes);  // the response message, byte for byte on the wire
  EXPECT_EQ(first.status.error_message(), second.status.error_message());

  pb::ChargeReply reply;
  ASSERT_TRUE(reply.ParseFromString(first.bytes));
  EXPECT_EQ("PAY-00000001", reply.payment_no());
  EXPECT_EQ(1'000'000 - 1'250, reply.balance_cents());
  EXPECT_EQ("c-17", reply.labels().at("cart"));

  auto totals = bank.ledger().totals();
  EXPECT_EQ(1, totals.payments);
  EXPECT_EQ(1'250, totals.charged_cents);
  auto s = bank.stats();
  EXPECT_EQ(1u, s.executed);
  EXPECT_EQ(1u, s.replayed);
  // Logs and metrics see the method as the key's scope.
  EXPECT_EQ(1, log.count("idem duplicate key=idem.examples.payments.v1.Payments.Charge|"));
  EXPECT_EQ(1, log.count("outcome=replayed"));
}

// The key id and the fingerprint as docs/grpc.md defines them (version 1), built here from the
// documented layout: records stored by an earlier idem must stay found after an upgrade (a key
// derived otherwise would run a retried request again).
std::string length_prefixed(std::string_view s) {
  return std::to_string(s.size()) + ":" + std::string(s);
}
std::string v1_key_id(std::string_view principal, std::string_view method, std::string_view k) {
  return idem::fingerprint("idem.grpc.v1" + length_prefixed(principal) + length_prefixed(method) +
                           length_prefixed(k));
}
std::string v1_fingerprint(std::string_view method, const std::string& request_bytes) {
  return idem::fingerprint("idem.grpc.fp.v1" + length_prefixed(method) + "|" +
                           length_prefixed(request_bytes));
}

TEST(GrpcMethod, KeyAndFingerprintAreTheDocumentedVersion1Derivation) {
  Bank bank;
  auto channel = grpc_payment::make_channel(bank.address(), "");
  auto req = charge_request("acct-0002", 4'321, "ORD-77");  // no map: plain bytes are deterministic
  RawAnswer a = raw_call(channel, grpc_payment::kChargeMethod, req, key("derive-1"));
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();

  idem::sqlite::Database db(bank.path());
  auto row = db.read([](idem::sqlite::Session& s) {
    auto st = s.prepare("SELECT idem_key, lower(hex(fingerprint)), biz_type FROM api_idempotency");
    EXPECT_TRUE(st.step());
    std::vector<std::string> r{st.column_bytes(0), st.column_bytes(1), st.column_bytes(2)};
    EXPECT_FALSE(st.step());
    return r;
  });
  const std::string method = grpc_payment::kChargeMethod;
  EXPECT_EQ(v1_key_id("", method, "derive-1"), row[0]);  // insecure: the principal is ""
  EXPECT_EQ(v1_fingerprint(method, req.SerializeAsString()), row[1]);
  EXPECT_EQ("idem.examples.payments.v1.Payments.Charge", row[2]);
  // One fixed value, so that the layout above cannot drift together with the code.
  EXPECT_EQ("097663e18e22ee9b08421459149260e1c1c84c9445e44257cb0d0f940a50fe1b",
            v1_key_id("", "/a.B/C", "k"));
}

TEST(GrpcMethod, MapEntriesReplayWithTheSameContent) {
  Bank bank;
  auto channel = grpc_payment::make_channel(bank.address(), "");
  auto req = charge_request("acct-0001", 300);
  for (int i = 0; i < 20; ++i) (*req.mutable_labels())["l" + std::to_string(i)] = std::to_string(i);
  RawAnswer first = raw_call(channel, grpc_payment::kChargeMethod, req, key("maps"));
  RawAnswer second = raw_call(channel, grpc_payment::kChargeMethod, req, key("maps"));
  ASSERT_TRUE(first.status.ok());
  ASSERT_TRUE(second.status.ok());
  EXPECT_EQ("true", second.trailer("idempotent-replayed"));
  pb::ChargeReply a, b;
  ASSERT_TRUE(a.ParseFromString(first.bytes));
  ASSERT_TRUE(b.ParseFromString(second.bytes));
  // protobuf serializes map entries in no stable order (not even one message twice), so only
  // the content is compared here; docs/grpc.md says so.
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(a, b));
  EXPECT_EQ(idem::grpc::deterministic_bytes(a), idem::grpc::deterministic_bytes(b));
  EXPECT_EQ(20, b.labels_size());
}

TEST(GrpcMethod, InProgressIsAbortedWithPushback) {
  grpc_payment::ServiceOptions so;
  so.slow = 400ms;
  so.retry_pushback = 150ms;
  Bank bank(so);
  auto stub = bank.stub();
  auto req = charge_request("acct-0002", 500);
  grpc_payment::Answer first;
  std::thread t([&] { first = grpc_payment::charge(*stub, req, "slow-1"); });
  ASSERT_TRUE(eventually([&] { return bank.stats().fast_claims == 1; }));
  grpc_payment::Answer second = grpc_payment::charge(*stub, req, "slow-1");
  t.join();
  EXPECT_EQ(grpc::StatusCode::ABORTED, second.status.error_code());
  EXPECT_EQ("in_progress", second.trailer("idempotency-error"));
  EXPECT_EQ("150", second.trailer("grpc-retry-pushback-ms"));
  EXPECT_NE(std::string::npos, second.status.error_message().find("retry after 150 ms"));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(1, bank.ledger().totals().payments);
  EXPECT_EQ(1u, bank.stats().in_progress);
}

TEST(GrpcMethod, MismatchIsFailedPrecondition) {
  Bank bank;
  auto stub = bank.stub();
  ASSERT_TRUE(grpc_payment::charge(*stub, charge_request("acct-0001", 700), "mm").status.ok());
  auto other = grpc_payment::charge(*stub, charge_request("acct-0001", 701), "mm");
  EXPECT_EQ(grpc::StatusCode::FAILED_PRECONDITION, other.status.error_code());
  EXPECT_EQ("fingerprint_mismatch", other.trailer("idempotency-error"));
  EXPECT_EQ("", other.trailer("idempotent-replayed"));
  // Every field is covered, the map's entries too, whatever order they were added in.
  auto a = charge_request("acct-0001", 700);
  (*a.mutable_labels())["x"] = "1";
  (*a.mutable_labels())["y"] = "2";
  auto b = charge_request("acct-0001", 700);
  (*b.mutable_labels())["y"] = "2";
  (*b.mutable_labels())["x"] = "1";
  ASSERT_TRUE(grpc_payment::charge(*stub, a, "mm-map").status.ok());
  auto again = grpc_payment::charge(*stub, b, "mm-map");
  EXPECT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_TRUE(again.replayed());
  EXPECT_EQ(2, bank.ledger().totals().payments);
}

TEST(GrpcMethod, MissingAndInvalidKeysAreInvalidArgument) {
  Bank bank;
  auto channel = grpc_payment::make_channel(bank.address(), "");
  auto req = charge_request("acct-0001", 100);
  auto expect_refused = [&](const KeyMetadata& md, const char* code, const char* detail) {
    RawAnswer a = raw_call(channel, grpc_payment::kChargeMethod, req, md);
    EXPECT_EQ(grpc::StatusCode::INVALID_ARGUMENT, a.status.error_code()) << detail;
    EXPECT_EQ(code, a.trailer("idempotency-error")) << detail;
    EXPECT_NE(std::string::npos, a.status.error_message().find(detail)) << a.status.error_message();
  };
  expect_refused({}, "missing_key", "requires the idempotency-key metadata");
  expect_refused({{"idempotency-key", "a"}, {"idempotency-key", "b"}}, "invalid_key",
                 "2 idempotency-key metadata entries");
  expect_refused(key(""), "invalid_key", "the key is empty");
  expect_refused(key(std::string(256, 'k')), "invalid_key", "256 bytes, at most 255");
  EXPECT_EQ(0u, bank.stats().calls);  // refused before the guard: nothing stored
  EXPECT_EQ(0, bank.ledger().totals().payments);

  // The longest key, and keys that differ only in spaces, are accepted as they are.
  EXPECT_TRUE(
      raw_call(channel, grpc_payment::kChargeMethod, req, key(std::string(255, 'k'))).status.ok());
  EXPECT_TRUE(raw_call(channel, grpc_payment::kChargeMethod, req, key("sp")).status.ok());
  RawAnswer spaced = raw_call(channel, grpc_payment::kChargeMethod, req, key(" sp "));
  EXPECT_TRUE(spaced.status.ok());
  EXPECT_EQ("", spaced.trailer("idempotent-replayed"));  // never trimmed: another key
  EXPECT_EQ(3, bank.ledger().totals().payments);
}

TEST(GrpcMethod, DeclineIsStoredAndReplayedWithItsTrailer) {
  Bank bank;
  auto channel = grpc_payment::make_channel(bank.address(), "");
  auto overdraft = charge_request("acct-0003", 5'000'000);
  RawAnswer first = raw_call(channel, grpc_payment::kChargeMethod, overdraft, key("od"));
  RawAnswer second = raw_call(channel, grpc_payment::kChargeMethod, overdraft, key("od"));
  for (const auto* a : {&first, &second}) {
    EXPECT_EQ(grpc::StatusCode::FAILED_PRECONDITION, a->status.error_code());
    EXPECT_EQ("insufficient funds", a->status.error_message());
    EXPECT_EQ("insufficient_funds", a->trailer(grpc_payment::kDeclineTrailer));
    EXPECT_EQ("", a->trailer("idempotency-error"));  // the handler's answer, not idem's
  }
  EXPECT_EQ("", first.trailer("idempotent-replayed"));
  EXPECT_EQ("true", second.trailer("idempotent-replayed"));
  RawAnswer unknown =
      raw_call(channel, grpc_payment::kChargeMethod, charge_request("acct-9999", 10), key("nf"));
  EXPECT_EQ(grpc::StatusCode::NOT_FOUND, unknown.status.error_code());
  auto s = bank.stats();
  EXPECT_EQ(2u, s.executed);
  EXPECT_EQ(1u, s.replayed);
  EXPECT_EQ(0, bank.ledger().totals().payments);
}

// --- handler statuses, trailers, exceptions (a scripted handler) ------------------------------

class Scripted : public ::testing::Test {
 protected:
  using Service = ScriptedPayments<idem::sqlite::SqliteStore>;
  void start(idem::grpc::MethodOptions options, Service::Handler h, bool transactional = true) {
    durable_ = std::make_unique<idem::sqlite::SqliteStore>(dir_.file("s.sqlite"));
    durable_->database().write([](Tx& tx) {
      tx.exec("CREATE TABLE IF NOT EXISTS effect (id INTEGER PRIMARY KEY, note TEXT)");
    });
    guard_ = std::make_unique<Guard>(fast_, *durable_, guard_options_);
    service_ = std::make_unique<Service>(*guard_, std::move(options), std::move(h), transactional);
    server_ = std::make_unique<Server>(std::vector<grpc::Service*>{service_.get()});
    stub_ = pb::Payments::NewStub(grpc_payment::make_channel(server_->address(), ""));
  }
  void TearDown() override {
    server_.reset();
    service_.reset();
  }
  long effects() {
    return durable_->database().read(
        [](idem::sqlite::Session& s) { return *s.query_int64("SELECT count(*) FROM effect"); });
  }
  grpc_payment::Answer call(const std::string& k) {
    return grpc_payment::charge(*stub_, charge_request("acct-0001", 10), k);
  }
  grpc_payment::Answer call_without_key() {
    grpc::ClientContext ctx;
    grpc_payment::Answer a;
    a.status = stub_->Charge(&ctx, charge_request("acct-0001", 10), &a.reply);
    grpc_payment::copy_trailers(ctx, a);
    return a;
  }

  idem::test::TempDir dir_;
  idem::GuardOptions guard_options_;
  idem::MemoryStore fast_;
  std::unique_ptr<idem::sqlite::SqliteStore> durable_;
  std::unique_ptr<Guard> guard_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<Server> server_;
  std::unique_ptr<pb::Payments::Stub> stub_;
};

TEST_F(Scripted, TransientStatusIsNotStoredAndRollsBack) {
  start(charge_options(), [](Tx* tx, int run, const pb::ChargeRequest&, pb::ChargeReply* reply) {
    tx->exec("INSERT INTO effect (note) VALUES (?)", "run " + std::to_string(run));
    if (run == 1)
      return idem::grpc::Reply(grpc::Status(grpc::StatusCode::UNAVAILABLE, "gateway down"));
    reply->set_payment_no("PAY-" + std::to_string(run));
    return idem::grpc::Reply();
  });
  auto first = call("t-1");
  EXPECT_EQ(grpc::StatusCode::UNAVAILABLE, first.status.error_code());
  EXPECT_EQ("gateway down", first.status.error_message());
  EXPECT_EQ("", first.trailer("idempotency-error"));
  EXPECT_EQ(0, effects());  // rolled back with the record that was not written
  auto second = call("t-1");
  ASSERT_TRUE(second.status.ok());
  EXPECT_FALSE(second.replayed());
  EXPECT_EQ("PAY-2", second.reply.payment_no());
  auto third = call("t-1");
  EXPECT_TRUE(third.replayed());
  EXPECT_EQ("PAY-2", third.reply.payment_no());
  EXPECT_EQ(1, effects());
  EXPECT_EQ(2, service_->runs());
}

// A duplicate waits for the first call's result (MethodOptions::wait_for_result), but never
// past its own deadline: a client that gave up is not waited for, its server thread is free.
TEST_F(Scripted, ADuplicateWaitsForTheFirstResultButNotPastItsDeadline) {
  auto o = charge_options();
  o.wait_for_result = 60s;
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  start(o, [gate](Tx*, int run, const pb::ChargeRequest&, pb::ChargeReply* reply) {
    if (run == 1) gate.wait();
    reply->set_payment_no("PAY-" + std::to_string(run));
    return idem::grpc::Reply();
  });
  grpc_payment::Answer first, patient;
  std::thread t1([&] { first = call("w-1"); });
  ASSERT_TRUE(eventually([&] { return service_->runs() == 1; }));
  auto hasty = grpc_payment::charge(*stub_, charge_request("acct-0001", 10), "w-1", 300ms);
  // The server stops waiting at the deadline: its ABORTED (in progress) may beat the client's
  // own timer to the client, or arrive after it gave up (DEADLINE_EXCEEDED).
  const auto hasty_code = hasty.status.error_code();
  EXPECT_TRUE(hasty_code == grpc::StatusCode::DEADLINE_EXCEEDED ||
              hasty_code == grpc::StatusCode::ABORTED)
      << hasty_code << " " << hasty.status.error_message();
  // Its server call ends at its deadline, while the first one still runs (60 s otherwise).
  EXPECT_TRUE(eventually([&] { return service_->answered() == 1; }, 20s));
  EXPECT_EQ(1, service_->runs());
  EXPECT_EQ(1u, guard_->stats().snapshot().waits);
  // A duplicate with time left waits for the first result and gets its replay.
  std::thread t2([&] { patient = call("w-1"); });
  EXPECT_TRUE(eventually([&] { return guard_->stats().snapshot().waits == 2; }));
  release.set_value();
  t1.join();
  t2.join();
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_TRUE(patient.status.ok()) << patient.status.error_message();
  EXPECT_TRUE(patient.replayed());
  EXPECT_EQ("PAY-1", patient.reply.payment_no());
  EXPECT_EQ(1, service_->runs());
}

// Store failures the observer hears of (a log line, idem_store_errors_total).
struct StoreErrors final : idem::Observer {
  void on_store_error(const idem::StoreErrorEvent& e) noexcept override {
    std::lock_guard<std::mutex> lock(mutex);
    codes.push_back(std::string(idem::errc_name(e.error.code())) + "@" + std::string(e.store));
  }
  std::vector<std::string> seen() {
    std::lock_guard<std::mutex> lock(mutex);
    return codes;
  }
  std::mutex mutex;
  std::vector<std::string> codes;
};

TEST_F(Scripted, DamagedStoredReplyIsInternalAndSendsNoneOfItsTrailers) {
  auto observer = std::make_shared<StoreErrors>();
  guard_options_.observer = observer;
  idem::grpc::MethodOptions o;
  o.method = grpc_payment::kChargeMethod;
  o.replay_trailers = {"x-stored"};
  start(o, [](Tx*, int, const pb::ChargeRequest&, pb::ChargeReply* reply) -> idem::grpc::Reply {
    reply->set_payment_no("PAY-1");
    return {grpc::Status::OK, {{"x-stored", "v"}}};
  });
  // A record under the call's key and fingerprint: its trailers decode, its body does not parse.
  const std::string method = grpc_payment::kChargeMethod;
  auto k =
      idem::Key::make("idem.examples.payments.v1.Payments.Charge", v1_key_id("", method, "broken"));
  const std::string fp =
      v1_fingerprint(method, charge_request("acct-0001", 10).SerializeAsString());
  auto record = [](std::string_view body, std::string_view tail) {
    std::string r = "idem.grpc.reply/1\n";
    auto u32 = [&](std::uint32_t v) {
      for (int shift = 24; shift >= 0; shift -= 8) r += static_cast<char>((v >> shift) & 0xFF);
    };
    auto bytes = [&](std::string_view b) {
      u32(static_cast<std::uint32_t>(b.size()));
      r.append(b);
    };
    u32(0);     // OK
    bytes("");  // message
    bytes("");  // details
    u32(1);     // one trailer
    bytes("x-stored");
    bytes("v");
    bytes(body);
    r.append(tail);
    return r;
  };
  for (const std::string& damaged :
       {record("\x0a\xff\xff", ""),       // a length past the end: does not parse
        record("", "!"),                  // trailing bytes
        record("", "").substr(0, 40)}) {  // truncated inside the trailer's name
    fast_.fill(k, fp, damaged, std::chrono::seconds(60));
    auto a = call("broken");
    EXPECT_EQ(grpc::StatusCode::INTERNAL, a.status.error_code());
    EXPECT_EQ("corrupt_record", a.trailer("idempotency-error"));
    EXPECT_EQ("", a.trailer("x-stored"));  // nothing of the record reached the answer
    EXPECT_EQ("", a.trailer("idempotent-replayed"));
  }
  // Each is told to the observer as the store's failure (as the HTTP layer's are), not only
  // counted as a replay.
  EXPECT_EQ(std::vector<std::string>(3, "corrupt_record@memory"), observer->seen());
  // The same record intact replays with its trailer (the test's encoding is the stored one).
  fast_.fill(k, fp, record("", ""), std::chrono::seconds(60));
  auto ok = call("broken");
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ("v", ok.trailer("x-stored"));
  EXPECT_EQ("true", ok.trailer("idempotent-replayed"));
  EXPECT_EQ(0, service_->runs());
}

TEST_F(Scripted, StorePolicyCanKeepTransientStatuses) {
  auto o = charge_options();
  o.store_status = [](grpc::StatusCode) { return true; };
  start(o, [](Tx*, int, const pb::ChargeRequest&, pb::ChargeReply*) {
    return idem::grpc::Reply(
        grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "quota", "\x01\x02"));
  });
  auto first = call("q");
  auto second = call("q");
  EXPECT_EQ(grpc::StatusCode::RESOURCE_EXHAUSTED, second.status.error_code());
  EXPECT_EQ("quota", second.status.error_message());
  EXPECT_EQ(std::string("\x01\x02"), second.status.error_details());
  EXPECT_TRUE(second.replayed());
  EXPECT_EQ(1, service_->runs());
  EXPECT_EQ(first.status.error_details(), second.status.error_details());
}

TEST_F(Scripted, OnlyTheChosenTrailersAreReplayed) {
  auto o = charge_options();
  o.replay_trailers = {"x-kept", "x-kept-bin"};
  start(o, [](Tx*, int, const pb::ChargeRequest&, pb::ChargeReply* reply) {
    reply->set_payment_no("PAY-T");
    return idem::grpc::Reply{
        grpc::Status::OK,
        {{"x-kept", "1"}, {"x-dropped", "2"}, {"x-kept-bin", std::string("\0\xff", 2)}}};
  });
  auto first = call("tr");
  auto second = call("tr");
  EXPECT_EQ("1", first.trailer("x-kept"));
  EXPECT_EQ("2", first.trailer("x-dropped"));
  EXPECT_EQ("1", second.trailer("x-kept"));
  EXPECT_EQ(std::string("\0\xff", 2), second.trailer("x-kept-bin"));
  EXPECT_EQ(0u, second.trailers.count("x-dropped"));
  EXPECT_EQ("true", second.trailer("idempotent-replayed"));
  EXPECT_EQ("PAY-T", second.reply.payment_no());
}

// A trailer grpc++ would refuse (it aborts the process on one: a non-ASCII value, a line break,
// an upper-case name) is dropped, neither sent nor stored, so neither the call nor any replay
// of its key takes the server down; a record stored with one replays without it.
TEST_F(Scripted, UnsendableTrailersAreDroppedNeitherSentNorStored) {
  auto o = charge_options();
  o.replay_trailers = {"x-name", "x-note", "x-ok", "x-bin"};
  start(o, [](Tx*, int, const pb::ChargeRequest&, pb::ChargeReply* reply) {
    reply->set_payment_no("PAY-U");
    return idem::grpc::Reply{grpc::Status::OK,
                             {{"x-name", "Jos\xc3\xa9"},
                              {"x-note", "line1\nline2"},
                              {"X-Upper", "v"},
                              {"x-ok", "fine"},
                              {"x-bin", "Jos\xc3\xa9\n"}}};
  });
  auto first = call("u-1");
  auto second = call("u-1");
  for (const auto* a : {&first, &second}) {
    ASSERT_TRUE(a->status.ok()) << a->status.error_message();
    EXPECT_EQ("PAY-U", a->reply.payment_no());
    EXPECT_EQ("fine", a->trailer("x-ok"));
    EXPECT_EQ("Jos\xc3\xa9\n", a->trailer("x-bin"));
    EXPECT_EQ(0u, a->trailers.count("x-name"));
    EXPECT_EQ(0u, a->trailers.count("x-note"));
    EXPECT_EQ(0u, a->trailers.count("x-upper"));
  }
  EXPECT_TRUE(second.replayed());
  EXPECT_EQ(1, service_->runs());
}

TEST_F(Scripted, HandlerThatThrowsIsUnknownAndTheRetryRuns) {
  start(charge_options(), [](Tx* tx, int run, const pb::ChargeRequest&, pb::ChargeReply*) {
    tx->exec("INSERT INTO effect (note) VALUES ('x')");
    if (run == 1) throw std::runtime_error("boom");
    return idem::grpc::Reply();
  });
  EXPECT_EQ(grpc::StatusCode::UNKNOWN, call("th").status.error_code());
  EXPECT_TRUE(call("th").status.ok());
  EXPECT_EQ(2, service_->runs());
  EXPECT_EQ(1, effects());
  EXPECT_EQ(1u, guard_->stats().snapshot().handler_errors);
}


// An idem::Error the handler throws itself (an InvalidKey of a key it built) propagates like
// any exception (UNKNOWN, no idempotency-error trailer), not answered as the client's
// INVALID_ARGUMENT; the claim is released and the retry runs.
TEST_F(Scripted, HandlersOwnIdemErrorIsUnknownNotTheClientsFault) {
  start(charge_options(), [](Tx* tx, int run, const pb::ChargeRequest&, pb::ChargeReply*) {
    tx->exec("INSERT INTO effect (note) VALUES ('x')");
    if (run == 1) (void)idem::Key::make("scope", "a key with spaces");
    return idem::grpc::Reply();
  });
  auto first = call("own");
  EXPECT_EQ(grpc::StatusCode::UNKNOWN, first.status.error_code());
  EXPECT_EQ(0u, first.trailers.count("idempotency-error"));
  EXPECT_TRUE(call("own").status.ok());
  EXPECT_EQ(2, service_->runs());
  EXPECT_EQ(1, effects());
}
TEST_F(Scripted, MissingKeyCanPassThrough) {
  auto o = charge_options();
  o.missing_key = idem::grpc::MissingKey::kPassThrough;
  start(o, [](Tx* tx, int, const pb::ChargeRequest&, pb::ChargeReply*) {
    tx->exec("INSERT INTO effect (note) VALUES ('p')");
    return idem::grpc::Reply();
  });
  EXPECT_TRUE(call_without_key().status.ok());
  EXPECT_TRUE(call_without_key().status.ok());
  EXPECT_EQ(2, effects());  // run every time, each under a fresh key
  EXPECT_TRUE(call("pt").status.ok());
  EXPECT_TRUE(call("pt").replayed());  // a key still de-duplicates
  EXPECT_EQ(3, effects());
}

TEST_F(Scripted, TwoPhaseHandlerRunsOutsideTheTransaction) {
  std::atomic<int> gateway{0};
  start(
      charge_options(),
      [&](Tx* tx, int, const pb::ChargeRequest&, pb::ChargeReply* reply) {
        EXPECT_EQ(nullptr, tx);
        ++gateway;
        reply->set_payment_no("PAY-2P");
        return idem::grpc::Reply();
      },
      /*transactional=*/false);
  EXPECT_TRUE(call("2p").status.ok());
  auto again = call("2p");
  EXPECT_TRUE(again.replayed());
  EXPECT_EQ("PAY-2P", again.reply.payment_no());
  EXPECT_EQ(1, gateway.load());
}

TEST_F(Scripted, FingerprintHookAndMetadata) {
  auto o = charge_options();
  o.fingerprint_metadata = {"x-tenant"};
  // The order number is the client's own retry counter here: left out of the fingerprint.
  o.fingerprint = [](const grpc::ServerContextBase&, const google::protobuf::MessageLite& m) {
    pb::ChargeRequest copy = static_cast<const pb::ChargeRequest&>(m);
    copy.clear_order_no();
    return idem::grpc::deterministic_bytes(copy);
  };
  start(o,
        [](Tx*, int, const pb::ChargeRequest&, pb::ChargeReply*) { return idem::grpc::Reply(); });
  auto with = [&](const std::string& order, const std::string& tenant) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("idempotency-key", "fp");
    ctx.AddMetadata("x-tenant", tenant);
    grpc_payment::Answer a;
    a.status = stub_->Charge(&ctx, charge_request("acct-0001", 10, order), &a.reply);
    grpc_payment::copy_trailers(ctx, a);
    return a;
  };
  EXPECT_TRUE(with("ORD-1", "t1").status.ok());
  EXPECT_TRUE(with("ORD-2", "t1").replayed());  // the order number is not covered
  EXPECT_EQ(grpc::StatusCode::FAILED_PRECONDITION, with("ORD-1", "t2").status.error_code());
}

// --- principals --------------------------------------------------------------------------

TEST(GrpcMethod, PrincipalHookScopesKeys) {
  Bank bank;  // PaymentService: `authorization: Bearer <who>` is the principal
  auto stub = bank.stub();
  auto req = charge_request("acct-0001", 100);
  auto alice = grpc_payment::charge(*stub, req, "same", 10s, "alice");
  auto bob = grpc_payment::charge(*stub, req, "same", 10s, "bob");
  auto alice_again = grpc_payment::charge(*stub, req, "same", 10s, "alice");
  ASSERT_TRUE(alice.status.ok());
  ASSERT_TRUE(bob.status.ok());
  EXPECT_NE(alice.reply.payment_no(), bob.reply.payment_no());
  EXPECT_FALSE(bob.replayed());
  EXPECT_TRUE(alice_again.replayed());
  EXPECT_EQ(alice.reply.payment_no(), alice_again.reply.payment_no());
  EXPECT_EQ(2, bank.ledger().totals().payments);
}

// Sets the peer identity from `x-user` metadata, as a token-checking processor would. grpc++'s
// AuthContext is per connection (grpc/grpc#28809): what Process adds stays for every later call
// on that connection, so each user gets a connection of its own here, like a client
// certificate would give.
class UserProcessor : public grpc::AuthMetadataProcessor {
 public:
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& md, grpc::AuthContext* ctx, OutputMetadata*,
                       OutputMetadata*) override {
    auto it = md.find("x-user");
    if (it != md.end() && ctx->FindPropertyValues("x-user").empty()) {
      ctx->AddProperty("x-user", std::string(it->second.data(), it->second.size()));
      ctx->SetPeerIdentityPropertyName("x-user");
    }
    return grpc::Status::OK;
  }
};

TEST(GrpcMethod, AuthContextPrincipalScopesKeys) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable{dir.file("auth.sqlite")};
  idem::MemoryStore fast;
  Guard guard{fast, durable};
  std::mutex mu;
  std::vector<std::string> seen;
  auto o = charge_options();
  o.principal = [&](const grpc::ServerContextBase& ctx) {  // the default, recorded
    std::string p = idem::grpc::peer_principal(ctx);
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(p);
    return p;
  };
  std::atomic<int> next{0};
  ScriptedPayments<idem::sqlite::SqliteStore> service{
      guard, o, [&](Tx*, int, const pb::ChargeRequest&, pb::ChargeReply* reply) {
        reply->set_payment_no("PAY-" + std::to_string(++next));
        return idem::grpc::Reply();
      }};
  auto creds = grpc::experimental::LocalServerCredentials(LOCAL_TCP);
  creds->SetAuthMetadataProcessor(std::make_shared<UserProcessor>());
  Server server({&service}, creds);
  auto connect = [&] {  // a connection of its own
    grpc::ChannelArguments args;
    args.SetInt("grpc.use_local_subchannel_pool", 1);
    return pb::Payments::NewStub(grpc::CreateCustomChannel(
        server.address(), grpc::experimental::LocalCredentials(LOCAL_TCP), args));
  };
  auto as = [&](pb::Payments::Stub& stub, const std::string& user) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("idempotency-key", "shared-key");
    if (!user.empty()) ctx.AddMetadata("x-user", user);
    pb::ChargeReply reply;
    grpc::Status s = stub.Charge(&ctx, charge_request("acct-0001", 10), &reply);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return reply.payment_no();
  };
  auto alice = connect(), bob = connect(), anonymous = connect(), anonymous2 = connect();
  std::string a = as(*alice, "alice"), b = as(*bob, "bob"), anon = as(*anonymous, "");
  std::string a2 = as(*alice, ""), anon2 = as(*anonymous2, "");
  EXPECT_NE(a, b);
  EXPECT_NE(a, anon);
  EXPECT_EQ(a, a2);        // the connection's identity, whatever this call sent
  EXPECT_EQ(anon, anon2);  // callers without a user identity share one namespace
  EXPECT_EQ(3, next.load());
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(5u, seen.size());
  EXPECT_EQ("x-user=alice", seen[0]);
  EXPECT_EQ("x-user=bob", seen[1]);
  // Local credentials authenticate the transport, not a user: their peer identity is
  // transport_security_type=local for every local caller.
  EXPECT_EQ("transport_security_type=local", seen[2]);
  EXPECT_EQ("x-user=alice", seen[3]);
}

// --- the callback API ----------------------------------------------------------------------

// Charge on grpc++'s callback API. The guard blocks on its stores, so the call runs on a
// thread of its own and finishes the reactor from there.
class CallbackPayments final : public pb::Payments::CallbackService {
 public:
  CallbackPayments(Guard& guard, SqliteLedger& ledger)
      : ledger_(ledger), method_(guard, charge_options()) {}
  ~CallbackPayments() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& t : threads_) t.join();
  }
  grpc::ServerUnaryReactor* Charge(grpc::CallbackServerContext* ctx, const pb::ChargeRequest* req,
                                   pb::ChargeReply* reply) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    std::lock_guard<std::mutex> lock(mu_);
    threads_.emplace_back([this, ctx, req, reply, reactor] {
      reactor->Finish(method_.handle(*ctx, *req, reply, [&](Tx& tx) {
        std::this_thread::sleep_for(slow);
        return ledger_.charge(tx, "", grpc_payment::client_key(*ctx), *req, reply);
      }));
    });
    return reactor;
  }
  std::chrono::milliseconds slow{0};

 private:
  SqliteLedger& ledger_;
  idem::grpc::Method<idem::sqlite::SqliteStore> method_;
  std::mutex mu_;
  std::vector<std::thread> threads_;
};

TEST(GrpcMethod, CallbackApi) {
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable{dir.file("cb.sqlite")};
  idem::MemoryStore fast;
  Guard guard{fast, durable};
  SqliteLedger ledger{durable};
  ledger.open_accounts(2, 10'000);
  CallbackPayments service{guard, ledger};
  service.slow = 300ms;
  {
    Server server({&service});
    auto stub = pb::Payments::NewStub(grpc_payment::make_channel(server.address(), ""));
    auto req = charge_request("acct-0000", 250);
    grpc_payment::Answer first;
    std::thread t([&] { first = grpc_payment::charge(*stub, req, "cb"); });
    ASSERT_TRUE(eventually([&] { return guard.stats().snapshot().fast_claims == 1; }));
    auto busy = grpc_payment::charge(*stub, req, "cb");
    t.join();
    EXPECT_EQ(grpc::StatusCode::ABORTED, busy.status.error_code());
    EXPECT_EQ("in_progress", busy.trailer("idempotency-error"));
    ASSERT_TRUE(first.status.ok()) << first.status.error_message();
    auto replay = grpc_payment::charge(*stub, req, "cb");
    EXPECT_TRUE(replay.replayed());
    EXPECT_EQ(first.reply.payment_no(), replay.reply.payment_no());
    EXPECT_EQ(
        grpc::StatusCode::FAILED_PRECONDITION,
        grpc_payment::charge(*stub, charge_request("acct-0000", 251), "cb").status.error_code());
  }
  EXPECT_EQ(1, ledger.totals().payments);
}

// --- store down, client retry policies ---------------------------------------------------------

TEST(GrpcMethod, DurableStoreTimeoutIsUnavailableAndThePolicyRetries) {
  idem::sqlite::SqliteStoreOptions store;
  store.database.busy_timeout = 100ms;
  Bank bank({}, {}, store);
  auto req = charge_request("acct-0001", 900);
  idem::sqlite::Database other{bank.path()};  // another process would hold the same file lock
  {
    idem::sqlite::Transaction lock = other.begin();
    auto a = grpc_payment::charge(*bank.stub(), req, "locked");
    EXPECT_EQ(grpc::StatusCode::UNAVAILABLE, a.status.error_code());
    EXPECT_EQ("store_timeout", a.trailer("idempotency-error"));
    EXPECT_EQ("", a.trailer("grpc-retry-pushback-ms"));  // the client's backoff decides
  }
  EXPECT_EQ(0, bank.ledger().totals().payments);

  // With the retry policy (UNAVAILABLE retryable), the same call rides out the lock.
  auto lock = std::make_unique<idem::sqlite::Transaction>(other.begin());
  std::thread release([&] {
    std::this_thread::sleep_for(250ms);
    lock->rollback();
  });
  auto retried = grpc_payment::charge(*bank.stub(grpc_payment::kRetryServiceConfig), req, "locked");
  release.join();
  ASSERT_TRUE(retried.status.ok()) << retried.status.error_message();
  EXPECT_FALSE(retried.replayed());
  EXPECT_EQ(1, bank.ledger().totals().payments);
  EXPECT_EQ(1u, bank.stats().executed);
}

TEST(GrpcMethod, RetryPolicyWaitsOutInProgressAndGetsTheReplay) {
  grpc_payment::ServiceOptions so;
  so.slow = 250ms;
  so.retry_pushback = 100ms;
  Bank bank(so);
  auto stub = bank.stub(grpc_payment::kRetryServiceConfig);
  auto req = charge_request("acct-0002", 400);
  grpc_payment::Answer first;
  std::thread t([&] { first = grpc_payment::charge(*stub, req, "rp"); });
  ASSERT_TRUE(eventually([&] { return bank.stats().fast_claims == 1; }));
  auto t0 = std::chrono::steady_clock::now();
  auto second = grpc_payment::charge(*stub, req, "rp");
  auto waited = std::chrono::steady_clock::now() - t0;
  t.join();
  ASSERT_TRUE(first.status.ok());
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_TRUE(second.replayed());
  EXPECT_EQ(first.reply.payment_no(), second.reply.payment_no());
  EXPECT_GE(waited, 100ms);  // at least one pushback waited out by grpc++'s retry
  auto s = bank.stats();
  EXPECT_GE(s.in_progress, 1u);
  EXPECT_EQ(1u, s.executed);
  EXPECT_EQ(1, bank.ledger().totals().payments);
}

TEST(GrpcRetry, LostAnswerIsReplayedToTheRetry) {
  grpc_payment::ServiceOptions so;
  so.slow = 300ms;
  Bank bank(so);
  auto stub = bank.stub();
  auto req = charge_request("acct-0003", 4'200);
  // The server completes, but the client's deadline ends before the answer arrives.
  auto lost = grpc_payment::charge(*stub, req, "lost-1", 100ms);
  EXPECT_EQ(grpc::StatusCode::DEADLINE_EXCEEDED, lost.status.error_code());
  ASSERT_TRUE(eventually([&] { return bank.stats().executed == 1; }));
  auto retry = grpc_payment::charge(*stub, req, "lost-1");
  ASSERT_TRUE(retry.status.ok()) << retry.status.error_message();
  EXPECT_TRUE(retry.replayed());
  auto totals = bank.ledger().totals();
  EXPECT_EQ(1, totals.payments);
  EXPECT_EQ(totals.by_key.at("lost-1"), retry.reply.payment_no());
  EXPECT_EQ(1'000'000 - 4'200, retry.reply.balance_cents());
}

// A charge sent while the server cannot be reached yet: a fail-fast call on that channel ends
// with UNAVAILABLE, every retry of the policy too (the channel backs off ~1 s between connection
// attempts); the example client's call waits for the channel within its deadline, reaches the
// server once it listens and charges once.
TEST(GrpcRetry, AChargeWaitsForTheChannelWhileTheServerIsAway) {
  const int port = free_port();
  auto channel = grpc_payment::make_channel("127.0.0.1:" + std::to_string(port));
  auto req = charge_request("acct-0002", 700);
  RawAnswer fail_fast = raw_call(channel, grpc_payment::kChargeMethod, req, key("away-0"));
  EXPECT_EQ(grpc::StatusCode::UNAVAILABLE, fail_fast.status.error_code());

  auto stub = pb::Payments::NewStub(channel);
  auto waiting = std::async(std::launch::async,
                            [&] { return grpc_payment::charge(*stub, req, "away-1", 20s); });
  // Nothing listens yet: the call cannot have an answer. A fail-fast call would have ended by
  // now: its policy's five attempts are at most 50 + 100 + 200 + 400 ms of backoff apart.
  EXPECT_EQ(std::future_status::timeout, waiting.wait_for(1500ms));
  Bank bank({}, {}, {}, port);
  auto a = waiting.get();
  ASSERT_TRUE(a.status.ok()) << a.status.error_code() << " " << a.status.error_message();
  EXPECT_FALSE(a.replayed());
  auto totals = bank.ledger().totals();
  EXPECT_EQ(1, totals.payments);
  EXPECT_EQ(totals.by_key.at("away-1"), a.reply.payment_no());
  EXPECT_EQ(0u, totals.by_key.count("away-0"));
}

// --- hedging ---------------------------------------------------------------------------------

// A fact docs/grpc.md relies on: grpc++ 1.51 (C-core) parses a hedgingPolicy and sends ONE
// attempt. If this fails, grpc++ hedges now: update docs/grpc.md and the tests below.
TEST(GrpcHedging, CoreClientSendsOneAttemptUnderAHedgingPolicy) {
  grpc_payment::ServiceOptions so;
  so.slow = 200ms;
  Bank bank(so);
  auto stub = bank.stub(grpc_payment::kHedgingServiceConfig);
  auto a = grpc_payment::charge(*stub, charge_request("acct-0001", 10), "hedge-policy");
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  std::this_thread::sleep_for(100ms);  // late copies would have arrived by now
  EXPECT_EQ(1u, bank.stats().calls);
}

// What a hedging client (Java, .NET: hedgingPolicy maxAttempts 5, hedgingDelay 0) puts on the
// wire, sent explicitly: 1,000 fresh keys, each as 5 copies at once on one channel while the
// handler is slow, first OK answer taken. One effect row per key, every call answered OK.
void hedged_storm(grpc_payment::ServiceOptions so, int keys, int in_flight) {
  Bank bank(so);
  auto channel = grpc_payment::make_channel(bank.address(), "");
  auto stub = pb::Payments::NewStub(channel);
  std::vector<grpc_payment::Answer> answers(static_cast<std::size_t>(keys));
  std::atomic<int> next{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < in_flight; ++t) {
    clients.emplace_back([&] {
      for (int i; (i = next++) < keys;) {
        auto req =
            charge_request(SqliteLedger::account(i % 4), 1 + i % 97, "ORD-" + std::to_string(i));
        answers[static_cast<std::size_t>(i)] =
            grpc_payment::hedged_charge(*stub, req, "h-" + std::to_string(i), 5);
      }
    });
  }
  for (auto& c : clients) c.join();
  auto totals = bank.ledger().totals();
  auto s = bank.stats();
  int not_ok = 0, wrong = 0;
  std::int64_t charged = 0;
  for (int i = 0; i < keys; ++i) {
    const auto& a = answers[static_cast<std::size_t>(i)];
    if (!a.status.ok()) {
      if (++not_ok < 5) ADD_FAILURE() << "key " << i << ": " << a.status.error_message();
      continue;
    }
    charged += 1 + i % 97;
    auto row = totals.by_key.find("h-" + std::to_string(i));
    if (row == totals.by_key.end() || row->second != a.reply.payment_no()) ++wrong;
  }
  EXPECT_EQ(0, not_ok);
  EXPECT_EQ(0, wrong);  // the first answer is the payment that was booked
  EXPECT_EQ(keys, totals.payments);
  EXPECT_EQ(charged, totals.charged_cents);
  EXPECT_EQ(4 * 1'000'000 - charged, totals.balance_cents);
  if (so.gateway.count() >= 0) {
    EXPECT_EQ(keys, totals.gateway_charges);
    for (const auto& [k, n] : totals.gateway_by_key) EXPECT_EQ(1, n) << k;
  }
  EXPECT_EQ(static_cast<std::uint64_t>(keys), s.executed);
  // Copies still unanswered when the first OK came were cancelled (a hedging client does
  // that), so a few may never have reached the guard. The overlap really happened.
  EXPECT_LE(s.calls, static_cast<std::uint64_t>(5 * keys));
  EXPECT_GT(s.in_progress, 0u);
  EXPECT_EQ(s.calls, s.executed + s.replayed + s.in_progress);
  std::printf("hedged storm: %d keys x 5 copies: %llu executed, %llu in progress, %llu replayed\n",
              keys, static_cast<unsigned long long>(s.executed),
              static_cast<unsigned long long>(s.in_progress),
              static_cast<unsigned long long>(s.replayed));
}

TEST(GrpcHedging, ThousandHedgedChargesOneEffectEachTransactional) {
  grpc_payment::ServiceOptions so;
  so.slow = 2ms;  // inside the SQLite write transaction: the copies overlap it
  hedged_storm(so, 1'000, 16);
}

TEST(GrpcHedging, ThousandHedgedChargesOneEffectEachTwoPhaseGateway) {
  grpc_payment::ServiceOptions so;
  so.gateway = 10ms;  // a slow card gateway outside any transaction
  hedged_storm(so, 1'000, 32);
}

// --- options ------------------------------------------------------------------------------

TEST(GrpcMethod, OptionsAreValidated) {
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast};
  auto make = [&](idem::grpc::MethodOptions o) { idem::grpc::Method m{guard, std::move(o)}; };
  auto with = [](auto edit) {
    auto o = charge_options();
    edit(o);
    return o;
  };
  EXPECT_NO_THROW(make(charge_options()));
  EXPECT_EQ("idem.examples.payments.v1.Payments.Charge",
            idem::grpc::Method(guard, charge_options()).options().scope);
  for (const char* bad : {"", "Charge", "/Payments", "/a/b/c", "//Charge", "/svc/"}) {
    EXPECT_THROW(make(with([&](auto& o) { o.method = bad; })), idem::UsageError) << bad;
  }
  EXPECT_THROW(make(with([](auto& o) { o.method = "/" + std::string(70, 'a') + "/M"; })),
               idem::InvalidKey);  // derived scope too long: set one
  EXPECT_NO_THROW(make(with([](auto& o) {
    o.method = "/" + std::string(70, 'a') + "/M";
    o.scope = "long.service.charge";
  })));
  EXPECT_THROW(make(with([](auto& o) { o.scope = "has space"; })), idem::InvalidKey);
  EXPECT_THROW(make(with([](auto& o) { o.key_metadata = "Idempotency-Key"; })), idem::UsageError);
  EXPECT_THROW(make(with([](auto& o) { o.key_metadata = "key-bin"; })), idem::UsageError);
  EXPECT_THROW(make(with([](auto& o) { o.key_metadata = "grpc-key"; })), idem::UsageError);
  EXPECT_THROW(make(with([](auto& o) { o.replay_trailers = {"grpc-status"}; })), idem::UsageError);
  EXPECT_THROW(make(with([](auto& o) { o.replay_trailers = {"idempotent-replayed"}; })),
               idem::UsageError);
  EXPECT_THROW(make(with([](auto& o) { o.fingerprint_metadata = {"X-Tenant"}; })),
               idem::UsageError);
  EXPECT_THROW(make(with([](auto& o) { o.retry_pushback = -1ms; })), idem::UsageError);
  EXPECT_THROW(make(with([](auto& o) { o.wait_for_result = -1ms; })), idem::UsageError);
}

TEST(GrpcMethod, StatusCodesFollowTheErrcTable) {
  EXPECT_EQ(grpc::StatusCode::INVALID_ARGUMENT, idem::grpc_status_code(idem::errc::kMissingKey));
  EXPECT_EQ(grpc::StatusCode::ABORTED, idem::grpc_status_code(idem::errc::kInProgress));
  EXPECT_EQ(grpc::StatusCode::FAILED_PRECONDITION,
            idem::grpc_status_code(idem::errc::kFingerprintMismatch));
  EXPECT_EQ(grpc::StatusCode::UNAVAILABLE, idem::grpc_status_code(idem::errc::kOutcomeUnknown));
  EXPECT_EQ(grpc::StatusCode::INTERNAL, idem::grpc_status_code(idem::errc::kCorruptRecord));
  EXPECT_TRUE(idem::grpc::is_final_status(grpc::StatusCode::FAILED_PRECONDITION));
  EXPECT_FALSE(idem::grpc::is_final_status(grpc::StatusCode::UNAVAILABLE));
  EXPECT_FALSE(idem::grpc::is_final_status(grpc::StatusCode::ABORTED));
}

}  // namespace
