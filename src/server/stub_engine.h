#pragma once
// StubEngine: a GenerationEngine that needs no model. It emits tokens at once (or after a set
// per-step delay) from a sequence that depends only on the seed, so that the whole HTTP path can
// be tested and benchmarked before the real engine exists. It mimics the real engine's shape:
// a prefill step yielding the first token, then verify steps of 1..k tokens, reasoning tokens
// ending with </think> when the prompt asks for thinking, EOS at the end, and per-session KV reuse
// (the common prefix with the session's previous prompt + output).

#include <functional>
#include <map>
#include <mutex>
#include <optional>

#include "server/generation_engine.h"

namespace uf::server {

struct StubEngineConfig {
  std::string model_name = "deepseek-v4.1-flash";
  std::vector<int32_t> vocabulary;  // ids the stub draws from (must be non-empty)
  int32_t think_start_id = -1;      // prompt ends with it: emit reasoning, then think_end_id
  int32_t think_end_id = -1;
  int32_t eos_id = -1;  // emitted at the end when it is a stop token of the request
  int reasoning_tokens_min = 8, reasoning_tokens_max = 32;
  int content_tokens_min = 16, content_tokens_max = 256;  // -1/-1: until max_new_tokens
  int tokens_per_step_min = 1, tokens_per_step_max = 6;   // simulated accepted length
  int step_delay_us = 0;     // delay per verify step (cancellation and latency tests)
  bool spin_delay = false;   // busy-wait (yielding) instead of sleeping: exact at microseconds
  int prefill_delay_us = 0;  // sleep before the first token
  // Overrides the drawn sequence when it returns a value: the full output for a request (stop
  // tokens included). Tests use it for tool calls and stop strings.
  std::function<std::optional<std::vector<int32_t>>(const GenerationRequest&)> script;
};

class StubEngine : public GenerationEngine {
 public:
  explicit StubEngine(StubEngineConfig config);
  std::shared_ptr<PreparedState> prepare(const GenerationRequest& request) override;
  GenerationResult generate(const GenerationRequest& request,
                            const std::shared_ptr<PreparedState>& prepared,
                            TokenSink& sink) override;
  std::string model_name() const override { return config_.model_name; }

  // The sequence generate() would emit for `request` when nothing stops it early.
  std::vector<int32_t> planned_output(const GenerationRequest& request) const;

 private:
  StubEngineConfig config_;
  std::mutex mu_;
  uint64_t next_seed_ = 0x5eed;
  std::map<std::string, std::vector<int32_t>> sessions_;  // session key -> prompt + output
};

}  // namespace uf::server
