#pragma once
// The server's view of the engine: one request decodes at a time on the engine thread, and a
// preparation thread readies queued requests ahead of their turn (KV reuse lookup, later the
// directory lookup and the remote fetch). The real engine and the StubEngine both implement it;
// nothing in the HTTP layer knows which one runs.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace uf::server {

struct SamplingParams {
  double temperature = 1.0;
  double top_p = 1.0;
  int top_k = 0;                 // 0 = off
  std::optional<uint64_t> seed;  // absent: the engine picks a fresh seed
};

enum class KvSource { kNone, kLocal, kRemote };
const char* kv_source_name(KvSource s);

struct GenerationRequest {
  std::string request_id;
  std::string session_key;  // SHA-256 hex of X-Session-ID, empty when none
  std::vector<int32_t> prompt_ids;
  int max_new_tokens = 1;  // already clipped so that prompt + output <= --max-seq
  SamplingParams sampling;
  std::vector<int32_t> stop_token_ids;  // e.g. EOS; the stop token is delivered, then it ends
  // Set by the server (client gone, stop string matched, shutdown); the engine checks it before
  // every step and returns kCancelled at the next step boundary.
  const std::atomic<bool>* cancel = nullptr;
};

// What prepare() found; engines subclass it to carry their own state (host KV bytes, ...).
struct PreparedState {
  virtual ~PreparedState() = default;
  int reused_tokens = 0;  // prompt tokens whose KV state will not be recomputed
  uint64_t reused_bytes = 0;
  KvSource kv_source = KvSource::kNone;
};

// One engine step (a prefill chunk producing the first token, or one verify step).
struct StepEvent {
  std::span<const int32_t> tokens;  // committed this step, in order; may be empty for prefill
  double step_ms = 0;               // wall time of the step
  bool is_prefill = false;          // prefill steps are not counted in iteration/accept stats
};

// Receives steps on the engine thread; must return quickly and never throw.
class TokenSink {
 public:
  virtual ~TokenSink() = default;
  virtual void on_step(const StepEvent& step) = 0;
};

enum class EngineFinish { kStopToken, kLength, kCancelled, kError };

struct GenerationResult {
  EngineFinish finish = EngineFinish::kLength;
  int generated_tokens = 0;
  int decode_steps = 0;  // verify steps after the first token
  double decode_ms = 0;  // summed step time of those steps
  std::string error;     // set with kError: a sentence for the log and the client
};

class GenerationEngine {
 public:
  virtual ~GenerationEngine() = default;
  // Runs on the preparation thread; may block (directory lookup, remote fetch). Never throws:
  // failures fall back to a "none" state (recompute).
  virtual std::shared_ptr<PreparedState> prepare(const GenerationRequest& request) = 0;
  // Runs on the engine thread, one call at a time. `prepared` comes from prepare() of the same
  // request. Reports errors through GenerationResult, never throws.
  virtual GenerationResult generate(const GenerationRequest& request,
                                    const std::shared_ptr<PreparedState>& prepared,
                                    TokenSink& sink) = 0;
  // Model name for /v1/models and responses.
  virtual std::string model_name() const = 0;
};

}  // namespace uf::server
