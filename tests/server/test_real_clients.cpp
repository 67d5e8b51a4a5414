// Real clients against an in-process server (label integration): the official `openai` npm client
// (openai_driver.cjs) and curl.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "server_test_support.h"

namespace uf::server::testing {
namespace {

using nlohmann::json;

std::string npm_dir() {
  if (const char* d = std::getenv("UF_NPM_DIR")) return d;
  return std::string(UF_SOURCE_DIR) + "/build/npm";
}

// Runs a shell command; returns {exit status, stdout}.
std::pair<int, std::string> run(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {-1, out};
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

TEST(ServerRealClients, OpenAINodeClient) {
  if (!std::filesystem::exists(npm_dir() + "/node_modules/openai")) {
    FAIL() << "the openai npm package is missing in " << npm_dir() << "; run scripts/setup.sh";
  }
  auto fast = start_test_server();
  ASSERT_TRUE(fast);
  StubEngineConfig slow_cfg = make_stub_config(*v41_encoder());
  slow_cfg.step_delay_us = 1000;
  slow_cfg.content_tokens_min = slow_cfg.content_tokens_max = -1;
  slow_cfg.tokens_per_step_min = slow_cfg.tokens_per_step_max = 1;
  auto slow = start_test_server({}, &slow_cfg);
  ASSERT_TRUE(slow);
  const std::string cmd =
      "timeout 180 node " + quote(std::string(UF_SOURCE_DIR) + "/tests/server/openai_driver.cjs") +
      " " + fast->base_url() + " " + slow->base_url() + " " + quote(npm_dir()) + " 2>&1";
  auto [status, out] = run(cmd);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("all scenarios passed"), std::string::npos) << out;
  // The cancelled stream stopped early (the slow stub never ends by itself).
  bool saw_cancel = false;
  for (const auto& c : slow->engine->calls()) {
    if (c.result.finish == EngineFinish::kCancelled) {
      saw_cancel = true;
      EXPECT_LT(c.result.generated_tokens, 5000);
    }
  }
  EXPECT_TRUE(saw_cancel);
}

TEST(ServerRealClients, Curl) {
  auto ts = start_test_server();
  ASSERT_TRUE(ts);
  const std::string url = ts->base_url() + "/v1/chat/completions";
  const std::string body =
      R"({"model":"deepseek-v4.1-flash","messages":[{"role":"user","content":"hi"}],"seed":9,)"
      R"("thinking":{"type":"disabled"})";
  // Non-streaming.
  auto [s1, whole] =
      run("curl -sS -H 'Content-Type: application/json' -d " + quote(body + "}") + " " + url);
  ASSERT_EQ(s1, 0) << whole;
  json j = json::parse(whole);
  const std::string content = j["choices"][0]["message"]["content"];
  EXPECT_FALSE(content.empty());
  // Streaming: SSE events, the same text, usage, then [DONE].
  auto [s2, sse] =
      run("curl -sSN -H 'Content-Type: application/json' -d " +
          quote(body + R"(,"stream":true,"stream_options":{"include_usage":true}})") + " " + url);
  ASSERT_EQ(s2, 0) << sse;
  std::string streamed;
  json usage;
  size_t events = 0, pos = 0;
  bool done = false;
  while ((pos = sse.find("data: ", pos)) != std::string::npos) {
    size_t end = sse.find("\n\n", pos);
    ASSERT_NE(end, std::string::npos) << "unterminated event";
    std::string data = sse.substr(pos + 6, end - pos - 6);
    pos = end + 2;
    ++events;
    if (data == "[DONE]") {
      done = true;
      EXPECT_EQ(pos, sse.size()) << "[DONE] must be the last event";
      break;
    }
    json ev = json::parse(data);
    if (!ev["choices"].empty() && ev["choices"][0]["delta"].contains("content")) {
      streamed += ev["choices"][0]["delta"]["content"].get<std::string>();
    }
    if (!ev["usage"].is_null()) usage = ev["usage"];
  }
  EXPECT_TRUE(done);
  EXPECT_GT(events, 3u);
  EXPECT_EQ(streamed, content);
  EXPECT_EQ(usage, j["usage"]);
  // An error through curl: status and shape.
  auto [s3, err] =
      run("curl -sS -o /dev/stdout -w '\\n%{http_code}' -H 'Content-Type: "
          "application/json' -d '{\"messages\":[]}' " +
          url);
  ASSERT_EQ(s3, 0);
  EXPECT_EQ(err.substr(err.rfind('\n') + 1), "400");
  json e = json::parse(err.substr(0, err.rfind('\n')));
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
}

}  // namespace
}  // namespace uf::server::testing
