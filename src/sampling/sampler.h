#pragma once
// Sampling one token: plain (non-speculative) decoding and DSpark draft slots.
// Method: inverse CDF with one uniform u in (0, 1] from the request's Philox stream (rng.h), over
// the row in the fixed chunk order of row_ops.h. Chosen over Gumbel-max because it needs one
// random number per token instead of one per vocabulary entry, and the device kernel does the same
// two passes (chunk sums, then a walk inside one chunk).
// A draft slot must keep the exact probability row it sampled from (the q row), because
// verification needs that row; hence sampling is split into transform (transform.h) and draw.
#include <cstdint>

#include "sampling/transform.h"

namespace uf::sampling {

// Draw from probabilities (need not be normalised; zeros are never drawn). Returns -1 only for an
// all-zero row.
int32_t sample_from_probs(const float* probs, int64_t vocab, float u);

// Transform then draw: probs[vocab] receives the distribution sampled from (the draft's q row);
// scratch holds vocab floats (see logits_to_probs). Greedy (T = 0) returns the argmax and ignores
// u.
int32_t sample_from_logits(const float* logits, int64_t vocab, const SamplingParams& params,
                           float u, float* probs, float* scratch);

}  // namespace uf::sampling
