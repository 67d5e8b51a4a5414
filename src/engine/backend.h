#pragma once
// The interface between the engine (and the server above it) and a compute backend (CPU reference,
// CUDA). A backend owns the weights and every session's state and runs whole steps. Nothing above
// the engine knows which backend runs (design.md §2-4).
//
// Step contract:
//  - prefill(s, tokens): appends the prompt (chunked inside the backend) and commits it.
//  - decode_rows(s, tokens): forwards 1..max_rows() rows at the next positions (anchor + drafts)
//    and returns one logits row per token WITHOUT committing. Row i's logits equal, bit for bit,
//    those of a plain single-row step on the same prefix ("spec == plain").
//  - commit(s, n): keeps the first n rows of the last decode_rows call (n may be 0); rejected rows
//    never corrupt committed state.
//  - draft(s, anchor, sampler): one DSpark round at the last committed position p, with `anchor`
//    (the token sampled at p) as slot 0. The Markov bias of slot i depends on the token chosen for
//    slot i-1, so the backend calls `sampler` slot by slot.
//  - draft_on_device (optional, device_draft()): the same round with the engine's sampler run by
//    the backend where the logits are; the q rows stay there for verify_last_rows.
//  - snapshot/restore: the session state as bytes (KV sharing between servers).

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/config.h"
#include "sampling/transform.h"
#include "sampling/verify.h"

namespace uf::engine {

// Per-session state owned by a backend; opaque to the engine.
class SessionState {
 public:
  virtual ~SessionState() = default;
  virtual int64_t length() const = 0;                      // committed positions
  virtual int64_t max_seq() const = 0;                     // capacity fixed at creation
  virtual const std::vector<int32_t>& tokens() const = 0;  // committed token ids
};

struct PrefillOptions {
  int chunk = 0;              // tokens per chunk; 0 = the backend's default
  bool all_logits = false;    // logits for every prompt position instead of the last only
  bool ced_shortcut = false;  // CED prefill: encoder + first decoder KV path on all tokens,
                              // decoder layers replayed on the last `replay` tokens only
  int replay = 0;             // CED replay length; 0 = the sliding window
};

// One DSpark round. Slot i drafts the token at position p + 2 + i.
struct DraftBlock {
  int64_t position = 0;            // p: the last committed position
  int32_t anchor = 0;              // the token at p + 1
  std::vector<int32_t> tokens;     // [block] drafted tokens
  std::vector<float> logits;       // [block, vocab]: head logits + Markov bias, fp32
  std::vector<float> markov_bias;  // [block, vocab]
  std::vector<float> confidence;   // [block] acceptance logits (before the sigmoid)
};

// Chooses slot `slot`'s draft token from its logits (fp32, vocab entries).
using DraftSampler = std::function<int32_t(int slot, std::span<const float> logits)>;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const model::ModelConfig& config() const = 0;
  virtual std::string name() const = 0;
  virtual int max_rows() const = 0;  // verify rows per decode step (anchor + drafts)

  virtual std::unique_ptr<SessionState> new_session(int64_t max_seq) = 0;

  // Appends and commits `tokens`; writes logits of the last position (or of all positions with
  // opts.all_logits) into `logits`, which must hold that many rows of vocab_size.
  virtual void prefill(SessionState& s, std::span<const int32_t> tokens, const PrefillOptions& opts,
                       std::span<float> logits) = 0;
  // Forwards tokens.size() <= max_rows() rows at positions length() .. length()+rows-1.
  virtual void decode_rows(SessionState& s, std::span<const int32_t> tokens,
                           std::span<float> logits) = 0;
  virtual void commit(SessionState& s, int n_accepted) = 0;
  virtual DraftBlock draft(SessionState& s, int32_t anchor, const DraftSampler& sampler) = 0;

  virtual std::vector<uint8_t> snapshot(const SessionState& s) const = 0;
  virtual void restore(SessionState& s, std::span<const uint8_t> bytes) const = 0;

  // Optional: verification where the target logits are (a GPU backend keeps them on the device).
  // When device_verify() is true the engine may call decode_rows with an EMPTY logits span (the
  // rows' logits stay in the backend) and then verify_last_rows, which must return exactly what
  // sampling::verify returns on logits_to_probs of those rows (same transform, same draws
  // make_verify_draws(seed, step)). draft_probs: the q rows [tokens.size(), vocab] the drafts were
  // sampled from; tokens: the drafts (rows 1.. of the last decode_rows call).
  virtual bool device_verify() const { return false; }
  virtual sampling::VerifyResult verify_last_rows(SessionState& s, sampling::VerifyMode mode,
                                                  const sampling::SamplingParams& params,
                                                  std::span<const float> draft_probs,
                                                  std::span<const int32_t> tokens, uint64_t seed,
                                                  uint64_t step);

  // Optional: drafting where the logits are. When device_draft() is true (it implies
  // device_verify()), the engine may call draft_on_device instead of draft: the backend runs the
  // round and samples slot i itself exactly as the engine's sampler would, i.e.
  //   token_i = sampling::sample_from_logits(logits_i, V, params, u_i, q_i, ...),
  //   u_i = sampling::stream_uniform(seed, step, RngPurpose::kDraft, i),
  // logits_i = head + Markov bias of slot i (the bias from token_{i-1}, token_{-1} = anchor), and
  // keeps the q rows q_i. The returned block has tokens and confidence; logits and markov_bias are
  // empty. A following verify_last_rows with an EMPTY draft_probs span verifies against those kept
  // q rows (tokens must be a prefix of the block's tokens); a non-empty span is used as given.
  // The engine must not mix: after draft(), pass the q rows.
  virtual bool device_draft() const { return false; }
  virtual DraftBlock draft_on_device(SessionState& s, int32_t anchor,
                                     const sampling::SamplingParams& params, uint64_t seed,
                                     uint64_t step);
};

inline DraftBlock Backend::draft_on_device(SessionState&, int32_t, const sampling::SamplingParams&,
                                           uint64_t, uint64_t) {
  core::fail("backend {} has no device drafting (device_draft() is false)", name());
}

inline sampling::VerifyResult Backend::verify_last_rows(SessionState&, sampling::VerifyMode,
                                                        const sampling::SamplingParams&,
                                                        std::span<const float>,
                                                        std::span<const int32_t>, uint64_t,
                                                        uint64_t) {
  core::fail("backend {} has no device verification (device_verify() is false)", name());
}

}  // namespace uf::engine
