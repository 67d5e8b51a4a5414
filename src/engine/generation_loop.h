#pragma once
// The generation loop: prefill, then either plain decoding (one row per step) or speculative
// decoding with the model's DSpark stages:
//
//   draft (anchor + noise slots, Markov head slot by slot)  ->  confidence schedule cuts the block
//   -> one verify forward over anchor + surviving drafts (<= 8 rows)  ->  block verification
//   (token-wise as the reference mode)  ->  commit anchor + accepted drafts  ->  the extra token is
//   the next anchor.
//
// The output distribution equals plain sampling for every temperature/top-p/top-k setting: the
// same transform is applied to the target rows p and to the draft rows q, and the draft tokens are
// sampled from exactly the q rows handed to the verifier. A backend with device_draft() runs that
// same draft sampler itself (same uniforms, backend.h) and keeps the q rows for its device
// verification; the loop only branches on these capability hooks, never on the backend type. Random
// draws come from the request's Philox streams (sampling/rng.h) indexed by (seed, step, purpose,
// slot), so a seeded request is reproducible on the same build and hardware.
//
// The hot loop reuses buffers sized at construction (8 verify rows x vocab) and never throws on a
// well-formed request; stop strings and client disconnects come back through the callback.

#include <atomic>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "engine/backend.h"
#include "engine/hardware_profile.h"
#include "sampling/transform.h"
#include "sampling/verify.h"

namespace uf::engine {

enum class DecodeMode { kPlain, kSpeculative };
enum class FinishReason { kStop, kLength, kCancelled };
const char* finish_reason_name(FinishReason r);

struct GenerationParams {
  sampling::SamplingParams sampling;
  uint64_t seed = 0;
  int max_new_tokens = 256;
  std::vector<int32_t> stop_token_ids;  // generation ends after emitting one of these
  DecodeMode mode = DecodeMode::kSpeculative;
  sampling::VerifyMode verify = sampling::VerifyMode::kBlock;
  int draft_tokens = 0;    // 0 = the hardware profile's value
  PrefillOptions prefill;  // chunking and the CED shortcut
};

struct StepStats {
  int emitted = 0;   // tokens this step produced (accepted drafts + the extra token)
  int drafted = 0;   // drafts verified this step (0 in plain mode)
  int accepted = 0;  // drafts accepted
  double ms = 0;     // wall time of the step (draft + verify + sampling)
};

// Receives each step's new tokens in order. Returning false stops generation (a stop string
// matched, the client went away); the loop then reports FinishReason::kCancelled unless the
// callback's owner says otherwise.
using TokenCallback = std::function<bool(std::span<const int32_t> tokens, const StepStats& step)>;
// Called once the prompt is committed, before the first token is sampled (e.g. to snapshot the
// prompt's state for the next turn of the conversation).
using PrefillCallback = std::function<void(SessionState& session)>;

struct GenerationResult {
  std::vector<int32_t> tokens;  // everything emitted, the stop token included
  FinishReason finish = FinishReason::kLength;
  int64_t prompt_tokens = 0;
  double prefill_ms = 0;
  int steps = 0;         // decode steps after the first token
  double step_ms = 0;    // their total time
  int64_t drafted = 0;   // drafts verified
  int64_t accepted = 0;  // drafts accepted
  double average_iteration_ms() const { return steps ? step_ms / steps : 0.0; }
  // Tokens per verify step, the extra token included (as vLLM and SGLang count it).
  double average_accept_length() const { return steps ? double(accepted + steps) / steps : 0.0; }
};

class GenerationLoop {
 public:
  GenerationLoop(Backend& backend, const HardwareProfile& profile);

  // Appends `prompt` to the session (prefill), samples the first token from the last prompt
  // position and decodes until a stop token, max_new_tokens, the session's capacity, a false
  // from `on_tokens` or `cancel`. The session's committed state then holds the prompt and every
  // emitted token but the last.
  GenerationResult run(SessionState& session, std::span<const int32_t> prompt,
                       const GenerationParams& params, const TokenCallback& on_tokens,
                       const std::atomic<bool>* cancel = nullptr,
                       const PrefillCallback& after_prefill = nullptr);

  const HardwareProfile& profile() const { return profile_; }

 private:
  int32_t sample_plain(const float* logits, const GenerationParams& p, uint64_t step, int index);
  // One speculative step from `anchor`; fills emitted_ and returns stats.
  StepStats speculative_step(SessionState& s, int32_t anchor, const GenerationParams& p,
                             uint64_t step, int max_emit);
  StepStats plain_step(SessionState& s, int32_t anchor, const GenerationParams& p, uint64_t step);

  Backend& backend_;
  HardwareProfile profile_;
  int64_t vocab_ = 0;
  std::vector<float> logits_;   // [kMaxVerifyRows x vocab]
  std::vector<float> target_;   // p rows
  std::vector<float> draft_;    // q rows
  std::vector<float> scratch_;  // transform scratch [kMaxVerifyRows, V]: one row per target row
  std::vector<int32_t> rows_;   // anchor + drafts
  std::vector<int32_t> emitted_;
};

}  // namespace uf::engine
