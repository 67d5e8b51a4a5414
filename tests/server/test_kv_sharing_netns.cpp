// End to end: KV sharing between two `ultrafast serve` processes on two "hosts" -- Linux network
// namespaces joined by a veth pair -- instead of loopback (tests/server/test_kv_sharing_e2e.cpp).
// Redis and server A live in namespace A, server B in namespace B; the only path between them is
// the veth link on a private /30 that exists inside these namespaces alone, so a remote reuse
// proves that --redis / --kv-listen work across real interfaces, not just through 127.0.0.1.
//
// Needs root (network namespaces); skips otherwise. The test process stays in the root
// namespace and talks HTTP through `ip netns exec <ns> curl` to 127.0.0.1 inside the namespace.
// UCX lists network devices once, at startup, and skips links that are not yet running, so the
// servers start right away; each waits for its own veth end to come up (see NetnsPair).
// Outputs are compared exactly: decoding is greedy and a restored state is bit-identical to a
// recomputed one.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
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
using uf::kv::testing::have_program;
using uf::kv::testing::TempDir;
using namespace std::chrono_literals;

const std::string kBinary = std::string(UF_BINARY_DIR) + "/ultrafast";
const std::string kModel = std::string(UF_SHARED_DIR) + "/fixtures/tiny-a";
constexpr int kHttpPort = 8000;   // inside each namespace: nothing else listens there
constexpr int kRedisPort = 6379;  // inside namespace A
constexpr int kUcxPort = 7100;
// Both veth ends carry this name (each inside its own namespace, so no clash).
const std::string kVeth = "ufkv0";

// Runs a shell command quietly; true when it exits 0.
bool sh(const std::string& cmd) { return std::system((cmd + " > /dev/null 2>&1").c_str()) == 0; }

// Runs a shell command and returns its stdout.
std::string sh_out(const std::string& cmd) {
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[4096];
    size_t n = 0;
    while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    ::pclose(p);
  }
  return out;
}

// Namespaces uf-<pid>-a / uf-<pid>-b whose owning test process died (e.g. killed by a ctest
// timeout before its destructors ran); removed so that runs do not pile them up.
void remove_stale_namespaces() {
  std::error_code ec;
  for (auto& e : std::filesystem::directory_iterator("/var/run/netns", ec)) {
    const std::string name = e.path().filename().string();
    int pid = 0;
    char side = 0;
    if (std::sscanf(name.c_str(), "uf-%d-%c", &pid, &side) != 2 || (side != 'a' && side != 'b'))
      continue;
    if (name != "uf-" + std::to_string(pid) + "-" + side) continue;
    if (pid != ::getpid() && !std::filesystem::exists("/proc/" + std::to_string(pid)))
      sh("ip netns del " + name);
  }
}

// Two namespaces joined by a veth pair; deleted in the destructor (the veth ends go with them).
class NetnsPair {
 public:
  NetnsPair() {
    const std::string id = std::to_string(::getpid());
    a_ = "uf-" + id + "-a";
    b_ = "uf-" + id + "-b";
    // Any /30 works: the address space exists only inside the two namespaces.
    const std::string net = "10.213." + std::to_string(::getpid() % 250 + 1);
    addr_a_ = net + ".1";
    addr_b_ = net + ".2";
    remove_stale_namespaces();
    if (!sh("ip netns add " + a_)) {
      error_ = "`ip netns add` failed (needs root / CAP_SYS_ADMIN)";
      return;
    }
    created_a_ = true;
    if (!sh("ip netns add " + b_)) {
      error_ = "`ip netns add` failed for the second namespace";
      return;
    }
    created_b_ = true;
    // Both veth ends are created directly inside their namespaces: nothing appears in the root
    // namespace, not even for a moment.
    if (!sh("ip link add " + kVeth + " netns " + a_ + " type veth peer name " + kVeth + " netns " +
            b_)) {
      error_ = "cannot create a veth pair between the namespaces (veth module missing?)";
      return;
    }
    const bool ok = sh("ip -n " + a_ + " addr add " + addr_a_ + "/30 dev " + kVeth) &&
                    sh("ip -n " + b_ + " addr add " + addr_b_ + "/30 dev " + kVeth) &&
                    sh("ip -n " + a_ + " link set " + kVeth + " up") &&
                    sh("ip -n " + b_ + " link set " + kVeth + " up") &&
                    sh("ip -n " + a_ + " link set lo up") && sh("ip -n " + b_ + " link set lo up");
    if (!ok) {
      error_ = "cannot configure the veth pair / loopback inside the namespaces";
      return;
    }
    // No wait for the links here: the kernel reports a new link's carrier with a delay of up to
    // ~1 s, and UCX lists devices once at start, so `serve` itself waits for the interface of
    // its --kv-listen address before starting UCX (src/kv/ucx_transfer.cpp). Starting the
    // servers at once checks that.
  }
  ~NetnsPair() {
    if (created_b_) sh("ip netns del " + b_);
    if (created_a_) sh("ip netns del " + a_);
  }
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;

  const std::string& error() const { return error_; }
  const std::string& a() const { return a_; }
  const std::string& b() const { return b_; }
  const std::string& addr_a() const { return addr_a_; }
  const std::string& addr_b() const { return addr_b_; }

 private:
  std::string a_, b_, addr_a_, addr_b_, error_;
  bool created_a_ = false, created_b_ = false;
};

// A child process run inside a namespace (`ip netns exec` execs the command in place, so the pid
// is the command's); stderr goes to a file. Killed in the destructor and when the test dies.
class NsProc {
 public:
  NsProc(const std::string& ns, std::vector<std::string> cmd, std::string log)
      : ns_(ns), log_(std::move(log)) {
    std::vector<std::string> args = {"ip", "netns", "exec", ns};
    args.insert(args.end(), cmd.begin(), cmd.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      FILE* f = std::freopen(log_.c_str(), "w", stderr);
      (void)f;
      f = std::freopen("/dev/null", "w", stdout);
      (void)f;
      ::execvp("ip", argv.data());
      ::_exit(127);
    }
  }
  ~NsProc() { stop(); }
  NsProc(const NsProc&) = delete;
  NsProc& operator=(const NsProc&) = delete;

  void stop() { uf::server::testing::stop_child(pid_); }

  // A crash: SIGKILL, no clean shutdown; the UCX listener and the published snapshots vanish.
  void crash() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
  }

  bool alive() {
    int st = 0;
    if (pid_ > 0 && ::waitpid(pid_, &st, WNOHANG) == pid_) pid_ = -1;
    return pid_ > 0;
  }

  // Polls `probe` (a shell command run inside namespace `ns`) until it succeeds; gives up early
  // when this process exits.
  bool wait_until(const std::string& ns, const std::string& probe, std::chrono::seconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (sh("ip netns exec " + ns + " " + probe)) return true;
      if (!alive()) return false;
      std::this_thread::sleep_for(100ms);
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

  // The first event `name` whose field `key` equals `value`; waits for it briefly (request
  // events are logged around the response's end).
  std::optional<json> event(const std::string& name, const std::string& key,
                            const std::string& value) const {
    auto deadline = std::chrono::steady_clock::now() + 5s;
    do {
      for (auto& e : events())
        if (e.value("event", "") == name && e.value(key, "") == value) return e;
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

  const std::string& ns() const { return ns_; }

 private:
  std::string ns_, log_;
  pid_t pid_ = -1;
};

struct Reply {
  std::string id;
  std::string content;
};

// One greedy chat completion (thinking off, so that turn 2's prompt extends turn 1's), sent
// with curl from inside the server's namespace.
Reply chat(const NsProc& s, const TempDir& dir, const std::string& session, const json& messages) {
  static int n = 0;
  const std::string body_file = dir.path() + "/body" + std::to_string(n++) + ".json";
  {
    json body = {{"messages", messages},
                 {"max_tokens", 12},
                 {"temperature", 0},
                 {"seed", 7},
                 {"thinking", {{"type", "disabled"}}}};
    std::ofstream(body_file) << body.dump();
  }
  const std::string cmd = "ip netns exec " + s.ns() + " curl -sS -m 60 -H 'Content-Type: " +
                          "application/json' -H 'X-Session-ID: " + session + "' --data-binary @" +
                          body_file +
                          " -w '\\n%{http_code}' http://127.0.0.1:" + std::to_string(kHttpPort) +
                          "/v1/chat/completions 2>&1";
  const std::string out = sh_out(cmd);
  const auto nl = out.rfind('\n');
  const std::string code = nl == std::string::npos ? "" : out.substr(nl + 1);
  EXPECT_EQ(code, "200") << "curl in " << s.ns() << ": " << out;
  json j = json::parse(out.substr(0, nl == std::string::npos ? 0 : nl), nullptr, false);
  if (j.is_discarded() || !j.contains("choices")) return {};
  return {j["id"], j["choices"][0]["message"]["content"]};
}

json turn1() { return uf::server::testing::conversation_turn1(); }
json turn2(const std::string& answer1) { return uf::server::testing::conversation_turn2(answer1); }

std::vector<std::string> serve_cmd(const std::string& id, const std::string& addr,
                                   const std::string& redis_addr,
                                   const std::vector<std::string>& env = {}) {
  std::vector<std::string> cmd;
  if (!env.empty()) {
    cmd.push_back("env");
    cmd.insert(cmd.end(), env.begin(), env.end());
  }
  std::vector<std::string> serve = {kBinary,       "serve",
                                    "--model",     kModel,
                                    "--host",      "127.0.0.1",
                                    "--port",      std::to_string(kHttpPort),
                                    "--max-seq",   "512",
                                    "--server-id", id,
                                    "--redis",     redis_addr + ":" + std::to_string(kRedisPort),
                                    "--kv-listen", addr + ":" + std::to_string(kUcxPort)};
  cmd.insert(cmd.end(), serve.begin(), serve.end());
  return cmd;
}

// Namespaces, Redis in namespace A (reachable from B over the veth), and helpers to start the
// servers. Skips where the machine cannot run these tests.
class KvSharingNetns : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces";
    if (!std::filesystem::exists(kBinary))
      GTEST_SKIP() << kBinary << " is not built (build the `ultrafast` target first)";
    for (const char* p : {"ip", "curl", "redis-server", "redis-cli"})
      if (!have_program(p)) GTEST_SKIP() << p << " is not installed";
    ASSERT_TRUE(std::filesystem::exists(kModel + "/config.json")) << kModel;
    net_ = std::make_unique<NetnsPair>();
    if (!net_->error().empty()) GTEST_SKIP() << "network namespaces unavailable: " << net_->error();
    redis_ = std::make_unique<NsProc>(
        net_->a(),
        std::vector<std::string>{"redis-server", "--port", std::to_string(kRedisPort), "--bind",
                                 net_->addr_a(), "--protected-mode", "no", "--save", "",
                                 "--appendonly", "no", "--dir", dir_.path(), "--logfile",
                                 dir_.path() + "/redis.log"},
        dir_.path() + "/redis.err");
    // Checked from namespace B: the directory must be reachable over the veth link.
    ASSERT_TRUE(redis_->wait_until(
        net_->b(), "redis-cli -h " + net_->addr_a() + " -p " + std::to_string(kRedisPort) + " ping",
        10s))
        << "redis-server in " << net_->a() << " not reachable from " << net_->b() << ": "
        << redis_->log_text();
  }

  // Server `id` in namespace A or B (its veth address is its --kv-listen address). Not yet
  // ready: call ready() after starting every server (they start at once, see NetnsPair).
  std::unique_ptr<NsProc> start(const std::string& id, bool in_a,
                                const std::vector<std::string>& env = {}) {
    const std::string& ns = in_a ? net_->a() : net_->b();
    const std::string& addr = in_a ? net_->addr_a() : net_->addr_b();
    return std::make_unique<NsProc>(ns, serve_cmd(id, addr, net_->addr_a(), env),
                                    dir_.path() + "/" + id + ".err");
  }

  static bool ready(NsProc& s) {
    return s.wait_until(
        s.ns(),
        "curl -sf -m 1 -o /dev/null http://127.0.0.1:" + std::to_string(kHttpPort) + "/readyz",
        30s);
  }

  // Declared first, destroyed last: the processes are gone before the namespaces are deleted
  // (servers are locals of the test body, destroyed before the fixture).
  std::unique_ptr<NetnsPair> net_;
  TempDir dir_{"netns"};
  std::unique_ptr<NsProc> redis_;
};

TEST_F(KvSharingNetns, ConversationMovesBetweenNamespacesWithExactOutput) {
  auto pa = start("A", true), pb = start("B", false);
  NsProc &a = *pa, &b = *pb;
  ASSERT_TRUE(ready(a)) << a.log_text();
  ASSERT_TRUE(ready(b)) << b.log_text();

  // Both turns on A (local reuse) vs turn 1 on A, turn 2 on B (remote reuse over the veth).
  Reply l1 = chat(a, dir_, "local", turn1());
  Reply l2 = chat(a, dir_, "local", turn2(l1.content));
  Reply s1 = chat(a, dir_, "moving", turn1());
  Reply s2 = chat(b, dir_, "moving", turn2(s1.content));
  ASSERT_FALSE(l1.content.empty()) << a.log_text();
  ASSERT_FALSE(l2.content.empty()) << a.log_text();
  EXPECT_EQ(s1.content, l1.content);
  EXPECT_EQ(s2.content, l2.content) << "remote reuse across namespaces changed the output";

  auto fetch_b = b.event("kv_fetch", "request_id", s2.id);
  ASSERT_TRUE(fetch_b) << b.log_text();
  EXPECT_FALSE(fetch_b->contains("reason")) << fetch_b->dump();
  auto end_a = a.event("request_end", "request_id", l2.id);
  auto end_b = b.event("request_end", "request_id", s2.id);
  ASSERT_TRUE(end_a && end_b) << b.log_text();
  EXPECT_EQ((*end_a)["kv_source"], "local");
  EXPECT_EQ((*end_b)["kv_source"], "remote") << fetch_b->dump() << "\n" << b.log_text();
  EXPECT_GT(end_b->value("reused_tokens", 0), 0);
  EXPECT_EQ((*end_b)["reused_tokens"], (*end_a)["reused_tokens"]);

  // The bytes came from A's veth address, the only way out of namespace B.
  auto transfer = b.event("kv_transfer", "status", "OK");
  ASSERT_TRUE(transfer) << b.log_text();
  EXPECT_EQ(transfer->value("direction", ""), "fetch");
  EXPECT_EQ(transfer->value("owner", ""), net_->addr_a() + ":" + std::to_string(kUcxPort))
      << transfer->dump();
}

// Failures across the veth end with the output of a recomputation and a log line saying why:
// a transfer corrupted in flight (B's test hook flips fetched bytes) is caught by BLAKE3, and an
// owner killed after its turn (the directory still names it) is answered at once by the kernel
// of its namespace (connection refused), well before the fetch deadline.
TEST_F(KvSharingNetns, CorruptTransferAndDeadOwnerAcrossVethAreRecomputed) {
  auto pa = start("A", true), pb = start("B", false, {"UF_TEST_CORRUPT_KV_FETCH=1"});
  NsProc &a = *pa, &b = *pb;
  ASSERT_TRUE(ready(a)) << a.log_text();
  ASSERT_TRUE(ready(b)) << b.log_text();
  const Reply r1 = chat(a, dir_, "reference", turn1());
  const Reply r2 = chat(a, dir_, "reference", turn2(r1.content));
  ASSERT_FALSE(r2.content.empty()) << a.log_text();

  // Checks B's answer and log for one failed fetch; returns the logged reason.
  auto expect_recomputed = [&](const Reply& reply, const char* what) -> std::string {
    EXPECT_EQ(reply.content, r2.content) << what;
    auto end = b.event("request_end", "request_id", reply.id);
    if (!end)
      ADD_FAILURE() << what << ": no request_end event\n" << b.log_text();
    else
      EXPECT_EQ((*end)["kv_source"], "none") << what << ": " << end->dump();
    auto fetch = b.event("kv_fetch", "request_id", reply.id);
    if (!fetch) {
      ADD_FAILURE() << what << ": no kv_fetch event\n" << b.log_text();
      return {};
    }
    EXPECT_EQ(fetch->value("fallback", ""), "recompute") << what << ": " << fetch->dump();
    return fetch->value("reason", "");
  };

  const Reply c1 = chat(a, dir_, "corrupt", turn1());
  const Reply c2 = chat(b, dir_, "corrupt", turn2(c1.content));
  const std::string corrupt_reason = expect_recomputed(c2, "corrupt transfer");
  EXPECT_NE(corrupt_reason.find("BLAKE3"), std::string::npos) << corrupt_reason;
  // The bytes did cross the veth (then failed verification): not a connection problem.
  EXPECT_EQ(corrupt_reason.find("UNAVAILABLE"), std::string::npos) << corrupt_reason;

  const Reply o1 = chat(a, dir_, "orphan", turn1());
  ASSERT_FALSE(o1.content.empty()) << a.log_text();
  a.crash();
  const auto t0 = std::chrono::steady_clock::now();
  const Reply o2 = chat(b, dir_, "orphan", turn2(o1.content));
  // Connection refused is immediate; well under the 10 s fetch deadline even on loaded cores.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 8s);
  const std::string orphan_reason = expect_recomputed(o2, "dead owner");
  EXPECT_FALSE(orphan_reason.empty());
  EXPECT_NE(orphan_reason.find(net_->addr_a()), std::string::npos)
      << "the log line should name the owner it could not reach: " << orphan_reason;
}

}  // namespace
