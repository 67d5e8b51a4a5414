// Load test (label slow): wrk against an in-process server on loopback (StubEngine, real
// tokenizer), mixing streamed and whole responses. Passes when wrk sees no socket errors and no
// non-2xx responses, thousands of requests complete, and resident memory does not keep growing
// (a warm-up run first, so that allocator arenas and thread stacks are already in place).
// UF_SLOW_REDUCED=1 (CI) shortens every run to 2 s.
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <thread>

#include "server_test_support.h"

namespace uf::server::testing {
namespace {

long rss_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

struct WrkResult {
  long requests = -1;
  long non2xx = 0;
  bool socket_errors = false;
  std::string output;
};

WrkResult run_wrk(const std::string& url, const std::string& script, int seconds, int conns) {
  std::string cmd = "timeout " + std::to_string(seconds + 30) + " wrk -t2 -c" +
                    std::to_string(conns) + " -d" + std::to_string(seconds) +
                    "s --timeout 10s -s " + script + " " + url + " 2>&1";
  WrkResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  pclose(p);
  std::smatch m;
  if (std::regex_search(r.output, m, std::regex(R"((\d+) requests in)"))) {
    r.requests = std::stol(m[1]);
  }
  if (std::regex_search(r.output, m, std::regex(R"(Non-2xx or 3xx responses: (\d+))"))) {
    r.non2xx = std::stol(m[1]);
  }
  r.socket_errors = r.output.find("Socket errors") != std::string::npos;
  return r;
}

TEST(ServerLoad, WrkNoErrorsNoMemoryGrowth) {
  const bool reduced = std::getenv("UF_SLOW_REDUCED") != nullptr;
  const int seconds = reduced ? 2 : 8;
  ASSERT_EQ(std::system("command -v wrk > /dev/null"), 0) << "wrk is not installed";
  auto ts = start_test_server();
  ASSERT_TRUE(ts);
  ts->engine->set_recording(false);
  const auto dir = v41_tokenizer_path().parent_path();
  const std::string script = (dir / "load.lua").string();
  // Alternates a streamed and a whole response, with different seeds and lengths.
  std::ofstream(script) << R"(
local n = 0
request = function()
  n = n + 1
  local stream = (n % 2 == 0) and "true" or "false"
  local body = '{"messages":[{"role":"user","content":"load test ' .. n .. '"}],' ..
    '"max_tokens":' .. (16 + n % 48) .. ',"seed":' .. n .. ',"stream":' .. stream .. '}'
  return wrk.format("POST", "/v1/chat/completions", {["Content-Type"]="application/json"}, body)
end
)";
  const std::string url = ts->base_url();
  auto warm = run_wrk(url, script, seconds, 16);
  ASSERT_GT(warm.requests, 0) << warm.output;
  const long rss_warm = rss_kib();
  long total = 0;
  for (int round = 0; round < 2; ++round) {
    auto r = run_wrk(url, script, seconds, 16);
    EXPECT_FALSE(r.socket_errors) << r.output;
    EXPECT_EQ(r.non2xx, 0) << r.output;
    total += r.requests;
  }
  const long rss_end = rss_kib();
  EXPECT_GE(total, reduced ? 500 : 3000) << "requests completed after warm-up";
  // Growth bound: 32 MiB, far below what a per-request leak of even 10 KiB would add over
  // thousands of requests, and above allocator noise.
  EXPECT_LT(rss_end - rss_warm, 32 * 1024) << "RSS " << rss_warm << " -> " << rss_end << " KiB";
  // Nothing is left queued or running. wrk drops its connections when its time is up, so the
  // requests it abandoned leave the queue (or stop at their next step) just after: give them a
  // bounded moment, then require an empty server.
  const auto drained_by = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((ts->server->metrics().queue_depth.value() != 0.0 ||
          ts->server->metrics().running_requests.value() != 0.0) &&
         std::chrono::steady_clock::now() < drained_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(ts->server->metrics().queue_depth.value(), 0.0);
  EXPECT_EQ(ts->server->metrics().running_requests.value(), 0.0);
  std::printf("load: %ld requests after warm-up in %d s; RSS %ld -> %ld KiB\n", total, 2 * seconds,
              rss_warm, rss_end);
}

}  // namespace
}  // namespace uf::server::testing
