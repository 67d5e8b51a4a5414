// End-to-end HTTP tests (label integration): an in-process server on a free loopback port with the
// StubEngine and a real V4.1-style tokenizer, driven by cpp-httplib's client and raw sockets.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "server/connection_watch.h"
#include "server_test_support.h"

namespace uf::server::testing {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

json user_chat(const std::string& text, json extra = json::object()) {
  json body = {{"model", "deepseek-v4.1-flash"},
               {"messages", json::array({{{"role", "user"}, {"content", text}}})}};
  body.update(extra);
  return body;
}

httplib::Result post(httplib::Client& c, const json& body,
                     const std::string& path = "/v1/chat/completions") {
  return c.Post(path.c_str(), body.dump(), "application/json");
}

void expect_error(const httplib::Result& r, int status, const std::string& code = {}) {
  ASSERT_TRUE(r) << "no response";
  EXPECT_EQ(r->status, status) << r->body;
  json j = json::parse(r->body, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r->body;
  ASSERT_TRUE(j.contains("error")) << r->body;
  const auto& e = j["error"];
  EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty()) << r->body;
  EXPECT_TRUE(e["type"].is_string()) << r->body;
  EXPECT_TRUE(e.contains("param")) << r->body;
  EXPECT_TRUE(e.contains("code")) << r->body;
  if (!code.empty()) {
    EXPECT_EQ(e["code"], code) << r->body;
  }
}

std::string metrics(httplib::Client& c) {
  auto r = c.Get("/metrics");
  return r ? r->body : "";
}

bool wait_until(const std::function<bool()>& cond, std::chrono::milliseconds limit = 5000ms) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return cond();
}

TEST(ServerHttp, ReadinessAndHealth) {
  auto enc = v41_encoder();
  ASSERT_TRUE(enc);
  ServerConfig cfg;
  cfg.port = 0;
  HttpServer server(cfg);
  int port = server.start_background();
  httplib::Client c("127.0.0.1", port);
  EXPECT_EQ(c.Get("/healthz")->status, 200);
  expect_error(c.Get("/readyz"), 503, "model_loading");
  auto loading = post(c, user_chat("hi"));
  expect_error(loading, 503, "model_loading");
  EXPECT_EQ(loading->get_header_value("Retry-After"), "1");
  server.set_model(std::make_shared<StubEngine>(make_stub_config(*enc)), enc);
  server.set_ready(true);
  EXPECT_EQ(c.Get("/readyz")->status, 200);
  EXPECT_EQ(post(c, user_chat("hi"))->status, 200);
  server.stop();
}

TEST(ServerHttp, ChatCompletionShapeAndUsage) {
  auto ts = start_test_server();
  ASSERT_TRUE(ts);
  httplib::Client c("127.0.0.1", ts->port);
  auto r = post(c, user_chat("Hello there", {{"seed", 11}}));
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_TRUE(j["id"].get<std::string>().rfind("chatcmpl-", 0) == 0);
  EXPECT_EQ(r->get_header_value("X-Request-ID"), j["id"]);
  EXPECT_TRUE(j["created"].is_number_integer());
  EXPECT_EQ(j["model"], "deepseek-v4.1-flash");
  const auto& ch = j["choices"][0];
  EXPECT_EQ(ch["index"], 0);
  EXPECT_EQ(ch["finish_reason"], "stop");
  EXPECT_EQ(ch["message"]["role"], "assistant");
  EXPECT_FALSE(ch["message"]["content"].get<std::string>().empty());
  // Thinking is on by default: the reasoning part is returned separately.
  EXPECT_FALSE(ch["message"]["reasoning_content"].get<std::string>().empty());
  auto calls = ts->engine->calls();
  ASSERT_EQ(calls.size(), 1u);
  const auto& u = j["usage"];
  EXPECT_EQ(u["prompt_tokens"], calls[0].request.prompt_ids.size());
  EXPECT_EQ(u["completion_tokens"], calls[0].result.generated_tokens);
  EXPECT_EQ(u["total_tokens"], u["prompt_tokens"].get<int>() + u["completion_tokens"].get<int>());
  EXPECT_GT(u["completion_tokens_details"]["reasoning_tokens"].get<int>(), 0);
  EXPECT_LT(u["completion_tokens_details"]["reasoning_tokens"].get<int>(),
            u["completion_tokens"].get<int>());
  // The engine got the request's seed and EOS as its stop token.
  EXPECT_EQ(calls[0].request.sampling.seed, 11u);
  EXPECT_EQ(calls[0].request.stop_token_ids, std::vector<int32_t>{v41_encoder()->eos_id()});

  // Thinking disabled: no reasoning_content, no reasoning tokens.
  auto off = post(c, user_chat("Hello there", {{"thinking", {{"type", "disabled"}}}}));
  json jo = json::parse(off->body);
  EXPECT_FALSE(jo["choices"][0]["message"].contains("reasoning_content")) << off->body;
  EXPECT_EQ(jo["usage"]["completion_tokens_details"]["reasoning_tokens"], 0);
}

TEST(ServerHttp, MaxTokensAndStopStrings) {
  auto ts = start_test_server();
  ASSERT_TRUE(ts);
  httplib::Client c("127.0.0.1", ts->port);
  auto r = post(c, user_chat("count", {{"max_tokens", 5}, {"seed", 3}}));
  json j = json::parse(r->body);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 5);

  auto s = post(c, user_chat(std::string("go ") + kStopMarker,
                             {{"stop", {"STOP"}}, {"thinking", {{"type", "disabled"}}}}));
  json js = json::parse(s->body);
  EXPECT_EQ(js["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(js["choices"][0]["message"]["content"], "alpha beta gamma ") << s->body;
  // Tokens after the stop string are not counted.
  auto full = v41_encoder()->tokenizer().encode(kStopScriptText);
  EXPECT_LT(js["usage"]["completion_tokens"].get<int>(), int(full.size()));
}

TEST(ServerHttp, CompletionsEndpointAndModels) {
  auto ts = start_test_server();
  ASSERT_TRUE(ts);
  httplib::Client c("127.0.0.1", ts->port);
  auto r =
      post(c, {{"prompt", "Once upon a time"}, {"max_tokens", 8}, {"seed", 1}}, "/v1/completions");
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 8);
  EXPECT_FALSE(j["choices"][0]["text"].get<std::string>().empty());
  auto m = c.Get("/v1/models");
  json jm = json::parse(m->body);
  EXPECT_EQ(jm["object"], "list");
  EXPECT_EQ(jm["data"][0]["id"], "deepseek-v4.1-flash");
  EXPECT_EQ(jm["data"][0]["object"], "model");
  EXPECT_EQ(c.Get("/v1/models/deepseek-v4.1-flash")->status, 200);
  expect_error(c.Get("/v1/models/other"), 404, "model_not_found");
}

TEST(ServerHttp, BadInputsGetOpenAIErrorsAndServerKeepsServing) {
  ServerConfig cfg;
  cfg.max_seq = 256;
  cfg.max_body_bytes = 16 * 1024;
  auto ts = start_test_server(cfg);
  ASSERT_TRUE(ts);
  httplib::Client c("127.0.0.1", ts->port);
  auto good = [&] {
    auto r = post(c, user_chat("still there?", {{"max_tokens", 4}}));
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
  };
  expect_error(c.Post("/v1/chat/completions", "{\"messages\": [", "application/json"), 400,
               "invalid_json");
  good();
  expect_error(post(c, user_chat("x", {{"max_tokens", "ten"}})), 400, "invalid_type");
  good();
  expect_error(post(c, user_chat("x", {{"frobnicate", true}})), 400, "unknown_parameter");
  good();
  expect_error(post(c, user_chat("x", {{"temperature", 7}})), 400, "invalid_value");
  good();
  expect_error(post(c, {{"messages", json::array()}}), 400, "invalid_value");
  good();
  std::string long_text;
  for (int i = 0; i < 400; ++i) long_text += "word ";
  expect_error(post(c, user_chat(long_text)), 400, "context_length_exceeded");
  good();
  expect_error(post(c, user_chat(std::string(20000, 'a'))), 413, "request_too_large");
  good();
  expect_error(c.Post("/v1/chat/completions", user_chat("x").dump(), "text/plain"), 415,
               "unsupported_media_type");
  good();
  auto wrong = c.Get("/v1/chat/completions");
  expect_error(wrong, 405, "method_not_allowed");
  EXPECT_EQ(wrong->get_header_value("Allow"), "POST");
  expect_error(c.Delete("/v1/models"), 405, "method_not_allowed");
  good();
  expect_error(c.Get("/v1/nothing"), 404, "not_found");
  expect_error(c.Post("/v1/nothing", "{}", "application/json"), 404, "not_found");
  good();
  // Multi-turn without X-Session-ID.
  json multi = {{"messages",
                 {{{"role", "user"}, {"content", "hi"}},
                  {{"role", "assistant"}, {"content", "hello"}},
                  {{"role", "user"}, {"content", "again"}}}}};
  auto r = post(c, multi);
  expect_error(r, 400, "missing_session_id");
  EXPECT_NE(r->body.find("X-Session-ID"), std::string::npos);
  httplib::Headers h = {{"X-Session-ID", "conv-1"}};
  EXPECT_EQ(c.Post("/v1/chat/completions", h, multi.dump(), "application/json")->status, 200);
  good();
  auto m = metrics(c);
  EXPECT_GE(metric_value(m, "uf_requests_total{outcome=\"invalid\"}"), 7.0) << m;
}

TEST(ServerHttp, SessionsReuseKvState) {
  auto ts = start_test_server();
  ASSERT_TRUE(ts);
  httplib::Client c("127.0.0.1", ts->port);
  httplib::Headers h = {{"X-Session-ID", "session-42"}};
  json first = user_chat("Tell me a story", {{"thinking", {{"type", "disabled"}}}, {"seed", 5}});
  auto r1 = c.Post("/v1/chat/completions", h, first.dump(), "application/json");
  json j1 = json::parse(r1->body);
  EXPECT_EQ(j1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  json second = first;
  second["messages"].push_back(
      {{"role", "assistant"}, {"content", j1["choices"][0]["message"]["content"]}});
  second["messages"].push_back({{"role", "user"}, {"content", "And then?"}});
  auto r2 = c.Post("/v1/chat/completions", h, second.dump(), "application/json");
  ASSERT_EQ(r2->status, 200) << r2->body;
  json j2 = json::parse(r2->body);
  // The stub reuses the common prefix with the session's previous prompt + output.
  EXPECT_GT(j2["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(),
            j1["usage"]["prompt_tokens"].get<int>() / 2)
      << r2->body;
  auto m = metrics(c);
  EXPECT_EQ(metric_value(m, "uf_kv_reuse_hits_total"), 1.0) << m;
  EXPECT_EQ(metric_value(m, "uf_kv_reuse_misses_total"), 1.0) << m;
  EXPECT_GT(metric_value(m, "uf_kv_reuse_bytes_total"), 0.0) << m;
  EXPECT_EQ(metric_value(m, "uf_kv_reuse_by_source_total{source=\"local\"}"), 1.0) << m;
  // The engine sees the SHA-256 of the session id, never the id itself.
  auto calls = ts->engine->calls();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].request.session_key.size(), 64u);
  EXPECT_EQ(calls[0].request.session_key, calls[1].request.session_key);
}

StubEngineConfig slow_stub(int step_delay_us) {
  StubEngineConfig s = make_stub_config(*v41_encoder());
  s.step_delay_us = step_delay_us;
  s.content_tokens_min = s.content_tokens_max = -1;  // until max_tokens
  s.tokens_per_step_min = s.tokens_per_step_max = 1;
  return s;
}

TEST(ServerHttp, QueueFullGets429) {
  ServerConfig cfg;
  cfg.max_queue = 1;
  // The first request runs ~3 s (600 tokens x 5 ms): the second must be seen queued while it still
  // runs, on a loaded 2-core CI machine too (a 0.3 s window once closed before the second request
  // was accepted, a 1.5 s one once closed too). The second is sent only once the first has left the
  // queue for the engine: sent while the first still waited there, it met a full queue itself.
  StubEngineConfig stub = slow_stub(5000);
  auto ts = start_test_server(cfg, &stub);
  ASSERT_TRUE(ts);
  auto& m = ts->server->metrics();
  std::atomic<int> ok{0};
  std::vector<std::jthread> bg;  // joined on every exit path, an assertion's included
  auto send = [&](int max_tokens) {
    bg.emplace_back([&ok, port = ts->port, max_tokens] {
      httplib::Client c("127.0.0.1", port);
      auto r = post(c, user_chat("long", {{"max_tokens", max_tokens}}));
      if (r && r->status == 200) ++ok;
    });
  };
  send(600);
  ASSERT_TRUE(wait_until(
      [&] { return m.running_requests.value() == 1.0 && m.queue_depth.value() == 0.0; }));
  send(20);
  ASSERT_TRUE(wait_until([&] { return m.queue_depth.value() == 1.0; }));
  httplib::Client c("127.0.0.1", ts->port);
  auto r = post(c, user_chat("one more"));
  expect_error(r, 429, "queue_full");
  EXPECT_EQ(r->get_header_value("Retry-After"), "1");
  bg.clear();  // joins
  EXPECT_EQ(ok.load(), 2);
}

TEST(ServerHttp, DisconnectStopsGenerationAndLeavesQueue) {
  StubEngineConfig stub = slow_stub(1000);
  auto ts = start_test_server({}, &stub);
  ASSERT_TRUE(ts);
  auto& metrics_ref = ts->server->metrics();
  // A long request keeps the engine busy (~1 ms per token).
  std::thread blocker([&] {
    httplib::Client c("127.0.0.1", ts->port);
    auto r = post(c, user_chat("block", {{"max_tokens", 500}}));
    EXPECT_TRUE(r && r->status == 200);
  });
  ASSERT_TRUE(wait_until([&] { return metrics_ref.running_requests.value() == 1.0; }));
  // A client that gives up while its request waits in the queue.
  {
    httplib::Client c("127.0.0.1", ts->port);
    c.set_read_timeout(0, 150000);
    EXPECT_FALSE(post(c, user_chat("never mind", {{"max_tokens", 5}})));
  }
  ASSERT_TRUE(wait_until([&] { return metrics_ref.queue_depth.value() == 0.0; }, 2000ms))
      << "the abandoned request should leave the queue before its turn";
  blocker.join();
  // A streaming client that reads a few chunks and hangs up.
  {
    httplib::Client c("127.0.0.1", ts->port);
    int chunks = 0;
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/chat/completions";
    req.body = user_chat("stream forever", {{"stream", true}, {"max_tokens", 100000}}).dump();
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 20; };
    c.send(req);
  }
  httplib::Client c("127.0.0.1", ts->port);
  ASSERT_TRUE(wait_until([&] {
    return metric_value(metrics(c), "uf_requests_total{outcome=\"cancelled\"}") == 2.0;
  })) << metrics(c);
  auto calls = ts->engine->calls();
  // The quitter never reached the engine; the stream stopped early.
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].result.finish, EngineFinish::kLength);
  EXPECT_EQ(calls[1].result.finish, EngineFinish::kCancelled);
  EXPECT_LT(calls[1].result.generated_tokens, 2000);  // 1 ms per token; stopped within ~1 s
  auto m = metrics(c);
  EXPECT_EQ(metric_value(m, "uf_queue_depth"), 0.0);
  EXPECT_EQ(metric_value(m, "uf_running_requests"), 0.0);
  EXPECT_EQ(post(c, user_chat("ok?", {{"max_tokens", 3}}))->status, 200);
}

// Sends `bytes` and stalls; returns {seconds until the server answered or closed, what it sent}.
std::pair<double, std::string> stall_with(int port, const std::string& bytes) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return {-1, ""};
  send(fd, bytes.data(), bytes.size(), 0);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  auto t0 = std::chrono::steady_clock::now();
  char buf[512];
  ssize_t n = recv(fd, buf, sizeof buf, 0);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  close(fd);
  return {waited, n > 0 ? std::string(buf, size_t(n)) : std::string()};
}

TEST(ServerHttp, StalledClientsTimeOut) {
  ServerConfig cfg;
  cfg.read_timeout_s = 1;
  auto ts = start_test_server(cfg);
  ASSERT_TRUE(ts);
  // Stalls inside the headers: the connection is dropped after the read timeout.
  auto [t1, r1] = stall_with(ts->port, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nCont");
  EXPECT_LT(t1, 3.0);
  // Stalls inside the body: answered with an error after the read timeout.
  auto [t2, r2] = stall_with(ts->port,
                             "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                             "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{");
  EXPECT_LT(t2, 3.0);
  EXPECT_TRUE(r2.empty() || r2.rfind("HTTP/1.1 4", 0) == 0) << r2;
  httplib::Client c("127.0.0.1", ts->port);
  EXPECT_EQ(post(c, user_chat("hello", {{"max_tokens", 3}}))->status, 200);
}

TEST(ServerHttp, ClientThatStopsReadingIsCancelled) {
  ServerConfig cfg;
  cfg.write_timeout_s = 1;
  StubEngineConfig stub = slow_stub(20);  // ~10k tokens/s (one SSE event each), without end
  auto ts = start_test_server(cfg, &stub);
  ASSERT_TRUE(ts);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  int small = 4096;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(ts->port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  const std::string body = user_chat("flood", {{"stream", true}, {"max_tokens", 10000000}}).dump();
  const std::string req =
      "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
      "Content-Type: application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(send(fd, req.data(), req.size(), 0), ssize_t(req.size()));
  // Never read. The server's writes stall once the socket buffers fill; after the write
  // timeout it gives up and the generation is cancelled.
  httplib::Client c("127.0.0.1", ts->port);
  EXPECT_TRUE(wait_until(
      [&] { return metric_value(metrics(c), "uf_requests_total{outcome=\"cancelled\"}") == 1.0; },
      15000ms))
      << metrics(c);
  close(fd);
  auto calls = ts->engine->calls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].result.finish, EngineFinish::kCancelled);
  EXPECT_EQ(post(c, user_chat("next", {{"max_tokens", 3}}))->status, 200);
}

TEST(ServerHttp, RequestEndLogLine) {
  auto ts = start_test_server();
  ASSERT_TRUE(ts);
  httplib::Client c("127.0.0.1", ts->port);
  httplib::Headers h = {{"X-Session-ID", "log-session"}};
  ::testing::internal::CaptureStderr();
  auto r = c.Post("/v1/chat/completions", h, user_chat("Hello", {{"seed", 2}}).dump(),
                  "application/json");
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(r->status, 200);
  json resp = json::parse(r->body);
  json ev;
  std::istringstream lines(err);
  for (std::string line; std::getline(lines, line);) {
    json j = json::parse(line, nullptr, false);
    if (j.is_object() && j.value("event", "") == "request_end") {
      EXPECT_TRUE(ev.is_null()) << "one request_end line per request";
      ev = j;
    }
  }
  ASSERT_FALSE(ev.is_null()) << err;
  EXPECT_EQ(ev["request_id"], resp["id"]);
  EXPECT_EQ(ev["session"], sha256_hex("log-session"));
  EXPECT_EQ(ev["prompt_tokens"], resp["usage"]["prompt_tokens"]);
  EXPECT_EQ(ev["completion_tokens"], resp["usage"]["completion_tokens"]);
  EXPECT_EQ(ev["reused_tokens"], 0);
  EXPECT_EQ(ev["kv_source"], "none");
  EXPECT_EQ(ev["finish_reason"], "stop");
  for (const char* k :
       {"queue_ms", "ttft_ms", "total_ms", "average_iteration_ms", "average_accept_length"}) {
    ASSERT_TRUE(ev[k].is_number()) << k << " in " << ev.dump();
  }
  EXPECT_LE(ev["ttft_ms"].get<double>(), ev["total_ms"].get<double>());
  // Accept length = tokens per verify step (bonus included); the stub's steps carry 1..6 tokens.
  auto calls = ts->engine->calls();
  ASSERT_EQ(calls.size(), 1u);
  const auto& res = calls[0].result;
  EXPECT_NEAR(ev["average_accept_length"].get<double>(),
              double(res.generated_tokens - 1) / res.decode_steps, 1e-9);
  EXPECT_GE(ev["average_accept_length"].get<double>(), 1.0);
  EXPECT_LE(ev["average_accept_length"].get<double>(), 6.0);
}

// An engine that fails: the client gets a 500 (or an error event in the stream), and the server
// keeps serving.
class FailingEngine : public GenerationEngine {
 public:
  std::shared_ptr<PreparedState> prepare(const GenerationRequest&) override {
    throw std::runtime_error("directory unreachable");  // must fall back, not fail the request
  }
  GenerationResult generate(const GenerationRequest&, const std::shared_ptr<PreparedState>& p,
                            TokenSink&) override {
    EXPECT_TRUE(p);  // prepare() threw: the scheduler substituted a "recompute" state
    GenerationResult r;
    r.finish = EngineFinish::kError;
    r.error = "device lost";
    return r;
  }
  std::string model_name() const override { return "failing"; }
};

TEST(ServerHttp, EngineErrors) {
  auto enc = v41_encoder();
  ASSERT_TRUE(enc);
  ServerConfig cfg;
  cfg.port = 0;
  HttpServer server(cfg);
  server.set_model(std::make_shared<FailingEngine>(), enc);
  server.set_ready(true);
  int port = server.start_background();
  httplib::Client c("127.0.0.1", port);
  auto r = post(c, user_chat("hi"));
  expect_error(r, 500);
  EXPECT_NE(r->body.find("device lost"), std::string::npos);
  auto s = post(c, user_chat("hi", {{"stream", true}}));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->status, 200);
  EXPECT_NE(s->body.find("\"error\""), std::string::npos) << s->body;
  EXPECT_NE(s->body.find("data: [DONE]"), std::string::npos) << s->body;
  EXPECT_EQ(c.Get("/healthz")->status, 200);
  server.stop();
}

// Every field of a rich valid body replaced by values of every JSON type, through the whole
// HTTP path (parser, chat encoder, engine): 200 or a 4xx in OpenAI's shape, never a 5xx.
TEST(ServerHttp, MutatedRequestsNeverFailTheServer) {
  auto ts = start_test_server();
  ASSERT_TRUE(ts);
  httplib::Client c("127.0.0.1", ts->port);
  const std::vector<json> values = {nullptr,
                                    true,
                                    0,
                                    -1,
                                    3.5,
                                    1e300,
                                    "",
                                    "x",
                                    "none",
                                    json::array(),
                                    json::array({1, "a"}),
                                    json::object(),
                                    json{{"type", "text"}}};
  const json base = json::parse(R"({"model":"m","messages":[{"role":"system","content":"s"},
    {"role":"user","content":"hi"},{"role":"assistant","content":"","reasoning_content":"r",
    "tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},
    {"role":"tool","tool_call_id":"c","content":[{"type":"text","text":"r"}]}],"max_tokens":4,
    "stop":["a"],"temperature":1,"seed":1,"thinking":{"type":"enabled"},
    "reasoning_effort":"high","tools":[{"type":"function","function":{"name":"f",
    "description":"d","parameters":{"type":"object"}}}],"tool_choice":"auto",
    "response_format":{"type":"json_object"}})");
  httplib::Headers h = {{"X-Session-ID", "fuzz"}};
  const json flat = base.flatten();
  int ok = 0, rejected = 0;
  for (auto it = flat.begin(); it != flat.end(); ++it) {
    for (const auto& v : values) {
      json m = base;
      m[json::json_pointer(it.key())] = v;
      auto r = c.Post("/v1/chat/completions", h, m.dump(), "application/json");
      ASSERT_TRUE(r) << m.dump();
      if (r->status == 200) {
        ++ok;
      } else {
        ++rejected;
        EXPECT_GE(r->status, 400) << m.dump();
        EXPECT_LT(r->status, 500) << m.dump() << " -> " << r->body;
        json e = json::parse(r->body, nullptr, false);
        EXPECT_TRUE(e.contains("error")) << r->body;
      }
    }
  }
  EXPECT_GT(ok, 10);
  EXPECT_GT(rejected, 50);
}

TEST(ServerHttp, MetricsExposition) {
  auto ts = start_test_server();
  ASSERT_TRUE(ts);
  httplib::Client c("127.0.0.1", ts->port);
  for (int i = 0; i < 3; ++i) post(c, user_chat("hi", {{"seed", i}}));
  auto r = c.Get("/metrics");
  ASSERT_EQ(r->status, 200);
  EXPECT_NE(r->get_header_value("Content-Type").find("text/plain"), std::string::npos);
  const auto& m = r->body;
  for (const char* name :
       {"uf_queue_depth", "uf_prepared_requests", "uf_time_to_first_token_seconds_count",
        "uf_inter_token_latency_seconds_count", "uf_step_time_seconds_count",
        "uf_accepted_length_count", "uf_prompt_tokens_total", "uf_generation_tokens_total",
        "uf_kv_reuse_hits_total", "uf_kv_reuse_misses_total", "uf_kv_reuse_bytes_total"}) {
    EXPECT_GE(metric_value(m, name), 0.0) << name << "\n" << m;
  }
  EXPECT_EQ(metric_value(m, "uf_time_to_first_token_seconds_count"), 3.0);
  EXPECT_EQ(metric_value(m, "uf_requests_total{outcome=\"stop\"}"), 3.0);
  double gen = 0;
  for (const auto& call : ts->engine->calls()) gen += call.result.generated_tokens;
  EXPECT_EQ(metric_value(m, "uf_generation_tokens_total"), gen);
  EXPECT_EQ(metric_value(m, "uf_inter_token_latency_seconds_count"), gen - 3);
}

}  // namespace
}  // namespace uf::server::testing
