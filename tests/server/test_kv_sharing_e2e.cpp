// End to end: KV sharing between real `ultrafast serve` processes (tiny-a fixture, CPU backend)
// through a real redis-server and UCX over loopback. A conversation moves between servers; the
// second server must fetch the first one's snapshot, verify it and continue with exactly the
// output one server would have produced, and every failure (corrupt transfer, incompatible
// server, Redis down or restarted) must fall back to recomputing with a log line saying why.
//
// Outputs are compared exactly: decoding is greedy (temperature 0, fixed seed) and a restored
// state is bit-identical to a recomputed one, so any difference is a bug, not noise.

#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../kv/test_support.h"
#include "kv_e2e_util.h"

namespace {

using json = nlohmann::json;
using uf::kv::testing::free_loopback_port;
using uf::kv::testing::have_program;
using uf::kv::testing::RedisServer;
using uf::kv::testing::TempDir;
using namespace std::chrono_literals;

const std::string kBinary = std::string(UF_BINARY_DIR) + "/ultrafast";
const std::string kModel = std::string(UF_SHARED_DIR) + "/fixtures/tiny-a";

// One `ultrafast serve` child process; stderr (JSON event lines) goes to a file. Always killed.
class ServerProc {
 public:
  ServerProc(const std::string& name, const TempDir& dir, std::vector<std::string> extra,
             std::vector<std::string> env = {})
      : log_(dir.path() + "/" + name + ".err"), port_(free_loopback_port()) {
    std::vector<std::string> args = {
        kBinary, "serve", "--model", kModel, "--port", std::to_string(port_), "--server-id", name};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // dies with the test, even on a ctest timeout
      FILE* f = std::freopen(log_.c_str(), "w", stderr);
      (void)f;
      std::freopen("/dev/null", "w", stdout);
      for (auto& e : env) ::putenv(e.data());
      ::execv(kBinary.c_str(), argv.data());
      ::_exit(127);
    }
  }
  ~ServerProc() { stop(); }
  void stop() { uf::server::testing::stop_child(pid_); }
  // A crash: no clean shutdown, the owner's UCX listener vanishes with it.
  void crash() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
  }
  ServerProc(const ServerProc&) = delete;
  ServerProc& operator=(const ServerProc&) = delete;

  int port() const { return port_; }

  bool wait_ready(std::chrono::seconds timeout = 30s) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    httplib::Client c("127.0.0.1", port_);
    c.set_connection_timeout(1);
    while (std::chrono::steady_clock::now() < deadline) {
      if (auto r = c.Get("/readyz"); r && r->status == 200) return true;
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }

  std::vector<json> events() const {
    std::vector<json> out;
    std::ifstream f(log_);
    std::string line;
    while (std::getline(f, line)) {
      if (line.empty() || line[0] != '{') continue;
      json j = json::parse(line, nullptr, false);
      if (!j.is_discarded()) out.push_back(std::move(j));
    }
    return out;
  }

  // The event `name` of request `id`; waits for it (logged around the response's end).
  std::optional<json> event(const std::string& name, const std::string& id) const {
    auto deadline = std::chrono::steady_clock::now() + 5s;
    do {
      for (auto& e : events())
        if (e.value("event", "") == name && e.value("request_id", "") == id) return e;
      std::this_thread::sleep_for(20ms);
    } while (std::chrono::steady_clock::now() < deadline);
    return std::nullopt;
  }

  std::string log_text() const {
    std::ifstream f(log_);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

 private:
  std::string log_;
  int port_;
  pid_t pid_ = -1;
};

struct Reply {
  std::string id;
  std::string content;
};

// One greedy chat completion (thinking off, so that the next turn's prompt extends this one's).
Reply chat(const ServerProc& s, const std::string& session, const json& messages) {
  httplib::Client c("127.0.0.1", s.port());
  c.set_read_timeout(60);
  json body = {{"messages", messages},
               {"max_tokens", 12},
               {"temperature", 0},
               {"seed", 7},
               {"thinking", {{"type", "disabled"}}}};
  httplib::Headers h;
  if (!session.empty()) h.emplace("X-Session-ID", session);
  auto r = c.Post("/v1/chat/completions", h, body.dump(), "application/json");
  EXPECT_TRUE(r) << "no HTTP response from port " << s.port();
  if (!r) return {};
  EXPECT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded() || !j.contains("choices")) return {};
  return {j["id"], j["choices"][0]["message"]["content"]};
}

json turn1() { return uf::server::testing::conversation_turn1(); }
json turn2(const std::string& answer1) { return uf::server::testing::conversation_turn2(answer1); }
json turn3(const std::string& answer1, const std::string& answer2) {
  json m = turn2(answer1);
  m.push_back({{"role", "assistant"}, {"content", answer2}});
  m.push_back({{"role", "user"}, {"content", "and again"}});
  return m;
}

class KvSharingE2E : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(kBinary))
      GTEST_SKIP() << kBinary << " is not built (build the `ultrafast` target first)";
    if (!have_program("redis-server")) GTEST_SKIP() << "redis-server is not installed";
    ASSERT_TRUE(std::filesystem::exists(kModel + "/config.json")) << kModel;
    ASSERT_TRUE(redis_.start()) << "redis-server did not start on port " << redis_.port();
  }

  std::vector<std::string> shared_flags(int max_seq = 512) const {
    return {"--max-seq",   std::to_string(max_seq),
            "--redis",     "127.0.0.1:" + std::to_string(redis_.port()),
            "--kv-listen", "127.0.0.1:0"};
  }

  // Reference outputs: both turns recomputed from scratch on one server (each turn under a new
  // session, so nothing is reused).
  void compute_reference(const ServerProc& s) {
    ref1_ = chat(s, "reference-1", turn1()).content;
    ref2_ = chat(s, "reference-2", turn2(ref1_)).content;
    ASSERT_FALSE(ref1_.empty());
    ASSERT_FALSE(ref2_.empty());
  }

  TempDir dir_{"kv_e2e"};
  RedisServer redis_;
  std::string ref1_, ref2_;
};

// Skips (with the reason) when UCX cannot connect two processes here: the directory answered
// (the event has an epoch) but the fetch from the owner could not reach it.
#define SKIP_IF_UCX_CANNOT_CONNECT(fetch_event)                                      \
  do {                                                                               \
    if ((fetch_event) && (fetch_event)->contains("epoch") &&                         \
        (fetch_event)->value("reason", "").find("UNAVAILABLE") == 0)                 \
      GTEST_SKIP() << "UCX could not connect two server processes in this sandbox: " \
                   << (fetch_event)->dump();                                         \
  } while (0)

TEST_F(KvSharingE2E, ConversationMovesAcrossThreeServersWithExactOutput) {
  ServerProc a("A", dir_, shared_flags()), b("B", dir_, shared_flags()),
      c("C", dir_, shared_flags());
  ASSERT_TRUE(a.wait_ready()) << a.log_text();
  ASSERT_TRUE(b.wait_ready()) << b.log_text();
  ASSERT_TRUE(c.wait_ready()) << c.log_text();
  compute_reference(a);

  // Both turns on A (local reuse) vs turn 1 on A, turn 2 on B (remote reuse).
  Reply l1 = chat(a, "local", turn1());
  Reply l2 = chat(a, "local", turn2(l1.content));
  Reply s1 = chat(a, "moving", turn1());
  Reply s2 = chat(b, "moving", turn2(s1.content));
  EXPECT_EQ(l1.content, ref1_);
  EXPECT_EQ(s1.content, ref1_);
  EXPECT_EQ(l2.content, ref2_);

  auto fetch_b = b.event("kv_fetch", s2.id);
  ASSERT_TRUE(fetch_b) << b.log_text();
  SKIP_IF_UCX_CANNOT_CONNECT(fetch_b);
  EXPECT_EQ(s2.content, ref2_) << "remote reuse changed the output";
  auto end_a = a.event("request_end", l2.id);
  auto end_b = b.event("request_end", s2.id);
  ASSERT_TRUE(end_a && end_b);
  EXPECT_EQ((*end_a)["kv_source"], "local");
  EXPECT_EQ((*end_b)["kv_source"], "remote") << fetch_b->dump();
  EXPECT_GT((*end_b)["reused_tokens"].get<int>(), 0);
  EXPECT_EQ((*end_b)["reused_tokens"], (*end_a)["reused_tokens"]);

  // A learns that B took the session over and drops its copy.
  bool dropped = false;
  for (int i = 0; i < 100 && !dropped; ++i) {
    for (auto& e : a.events()) dropped |= e.value("event", "") == "kv_drop_local";
    if (!dropped) std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(dropped) << a.log_text();

  // Turn 3 on C continues from B's snapshot (B's prompt state covers turn 2's prompt).
  Reply l3 = chat(a, "local", turn3(l1.content, l2.content));
  Reply s3 = chat(c, "moving", turn3(s1.content, s2.content));
  EXPECT_EQ(s3.content, l3.content);
  auto end_c = c.event("request_end", s3.id);
  ASSERT_TRUE(end_c);
  EXPECT_EQ((*end_c)["kv_source"], "remote") << c.log_text();
  EXPECT_GT((*end_c)["reused_tokens"].get<int>(), (*end_b)["reused_tokens"].get<int>());
}

// Without --redis / --kv-listen nothing of KV sharing runs: local reuse only, no sharing events.
TEST_F(KvSharingE2E, DefaultPathStaysSingleServer) {
  ServerProc a("A", dir_, {"--max-seq", "512"});
  ASSERT_TRUE(a.wait_ready()) << a.log_text();
  compute_reference(a);
  Reply l1 = chat(a, "plain", turn1());
  Reply l2 = chat(a, "plain", turn2(l1.content));
  EXPECT_EQ(l2.content, ref2_);
  auto end = a.event("request_end", l2.id);
  ASSERT_TRUE(end);
  EXPECT_EQ((*end)["kv_source"], "local");
  EXPECT_GT((*end)["reused_tokens"].get<int>(), 0);
  for (auto& e : a.events())
    EXPECT_EQ(e.value("event", "").rfind("kv_", 0), std::string::npos) << e.dump();
  EXPECT_EQ(a.log_text().find("KV sharing"), std::string::npos);
}

TEST_F(KvSharingE2E, CorruptTransferIsCaughtAndRecomputed) {
  ServerProc a("A", dir_, shared_flags());
  ServerProc b("B", dir_, shared_flags(), {"UF_TEST_CORRUPT_KV_FETCH=1"});
  ASSERT_TRUE(a.wait_ready()) << a.log_text();
  ASSERT_TRUE(b.wait_ready()) << b.log_text();
  compute_reference(a);

  Reply s1 = chat(a, "corrupt", turn1());
  Reply s2 = chat(b, "corrupt", turn2(s1.content));
  EXPECT_EQ(s2.content, ref2_);
  auto fetch_b = b.event("kv_fetch", s2.id);
  ASSERT_TRUE(fetch_b) << b.log_text();
  SKIP_IF_UCX_CANNOT_CONNECT(fetch_b);
  EXPECT_NE(fetch_b->value("reason", "").find("BLAKE3"), std::string::npos) << fetch_b->dump();
  EXPECT_EQ(fetch_b->value("fallback", ""), "recompute");
  auto end_b = b.event("request_end", s2.id);
  ASSERT_TRUE(end_b);
  EXPECT_EQ((*end_b)["kv_source"], "none");
  EXPECT_EQ((*end_b)["reused_tokens"], 0);
}

TEST_F(KvSharingE2E, VanishedOwnerIsRecomputed) {
  ServerProc a("A", dir_, shared_flags()), b("B", dir_, shared_flags());
  ASSERT_TRUE(a.wait_ready()) << a.log_text();
  ASSERT_TRUE(b.wait_ready()) << b.log_text();
  compute_reference(a);
  Reply s1 = chat(a, "orphan", turn1());
  a.crash();  // the directory still names A as the owner
  const auto t0 = std::chrono::steady_clock::now();
  Reply s2 = chat(b, "orphan", turn2(s1.content));
  // Connection refused is immediate; well under the 10 s fetch deadline even on loaded cores.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 8s);
  EXPECT_EQ(s2.content, ref2_);
  auto fetch_b = b.event("kv_fetch", s2.id);
  ASSERT_TRUE(fetch_b) << b.log_text();
  EXPECT_FALSE(fetch_b->value("reason", "").empty()) << fetch_b->dump();
  EXPECT_EQ(fetch_b->value("fallback", ""), "recompute");
  auto end_b = b.event("request_end", s2.id);
  ASSERT_TRUE(end_b);
  EXPECT_EQ((*end_b)["kv_source"], "none");
}

TEST_F(KvSharingE2E, FingerprintMismatchRefusesReuse) {
  ServerProc a("A", dir_, shared_flags(512));
  ServerProc b("B", dir_, shared_flags(1024));
  ASSERT_TRUE(a.wait_ready()) << a.log_text();
  ASSERT_TRUE(b.wait_ready()) << b.log_text();
  compute_reference(a);

  Reply s1 = chat(a, "mismatch", turn1());
  Reply s2 = chat(b, "mismatch", turn2(s1.content));
  EXPECT_EQ(s2.content, ref2_);
  auto fetch_b = b.event("kv_fetch", s2.id);
  ASSERT_TRUE(fetch_b) << b.log_text();
  SKIP_IF_UCX_CANNOT_CONNECT(fetch_b);
  EXPECT_NE(fetch_b->value("reason", "").find("fingerprint"), std::string::npos) << fetch_b->dump();
  auto end_b = b.event("request_end", s2.id);
  ASSERT_TRUE(end_b);
  EXPECT_EQ((*end_b)["kv_source"], "none");
}

TEST_F(KvSharingE2E, RedisDownThenRestartedWithNewEpoch) {
  ServerProc a("A", dir_, shared_flags()), b("B", dir_, shared_flags());
  ASSERT_TRUE(a.wait_ready()) << a.log_text();
  ASSERT_TRUE(b.wait_ready()) << b.log_text();
  compute_reference(a);

  Reply s1 = chat(a, "outage", turn1());
  auto before = a.event("kv_fetch", s1.id);
  ASSERT_TRUE(before && before->contains("epoch")) << a.log_text();
  const std::string epoch1 = (*before)["epoch"];

  // Redis gone: still served, recomputed on B, and the log says why.
  redis_.stop();
  Reply d2 = chat(b, "outage", turn2(s1.content));
  EXPECT_EQ(d2.content, ref2_);
  auto fetch_down = b.event("kv_fetch", d2.id);
  ASSERT_TRUE(fetch_down) << b.log_text();
  EXPECT_NE(fetch_down->value("reason", "").find("UNAVAILABLE"), std::string::npos)
      << fetch_down->dump();
  auto end_down = b.event("request_end", d2.id);
  ASSERT_TRUE(end_down);
  EXPECT_EQ((*end_down)["kv_source"], "none");

  // Redis back, empty: a new epoch. The servers reconnect after their backoff (<= 5 s); until
  // then requests keep being recomputed. Each attempt uses a fresh session so that a
  // recomputed attempt leaves no local copy behind.
  ASSERT_TRUE(redis_.start());
  std::optional<json> fetch_r1, end_r2;
  auto deadline = std::chrono::steady_clock::now() + 25s;
  for (int i = 0; std::chrono::steady_clock::now() < deadline; ++i) {
    const std::string session = "after-restart-" + std::to_string(i);
    Reply r1 = chat(a, session, turn1());
    Reply r2 = chat(b, session, turn2(r1.content));
    ASSERT_EQ(r1.content, ref1_);
    ASSERT_EQ(r2.content, ref2_);
    fetch_r1 = a.event("kv_fetch", r1.id);
    end_r2 = b.event("request_end", r2.id);
    if (end_r2 && (*end_r2)["kv_source"] == "remote") break;
    std::this_thread::sleep_for(200ms);
  }
  ASSERT_TRUE(end_r2 && (*end_r2)["kv_source"] == "remote") << b.log_text();
  EXPECT_GT((*end_r2)["reused_tokens"].get<int>(), 0);
  ASSERT_TRUE(fetch_r1 && fetch_r1->contains("epoch")) << a.log_text();
  EXPECT_NE((*fetch_r1)["epoch"], epoch1) << "a restarted Redis must start a new epoch";
}

}  // namespace
