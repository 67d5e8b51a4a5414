#pragma once
// Logits -> sampling distribution under a request's SamplingParams. The same transform is applied
// to the target rows p and to the draft rows q, so speculative decoding samples exactly from the
// transformed target distribution for every setting.
//
// Definition (order matters and is fixed):
//   1. temperature T in (0, 2]: p(x) = softmax(logits / T). T = 0 means greedy: p is one-hot on
//      the argmax of the logits (lowest index on ties) and top_k / top_p are irrelevant.
//   2. top_k > 0: keep x iff fewer than k tokens have a strictly larger p(x) (ties at the boundary
//      are all kept, so more than k tokens may survive); top_k = 0 or >= vocab keeps everything.
//   3. top_p < 1: over the top-k survivors with mass Z_k, keep x iff the mass of survivors with a
//      strictly larger p is < top_p * Z_k (the most probable token always survives; ties at the
//      boundary are all kept). Masses are top_p_mass.h's fixed point floor(p * 2^42), summed
//      exactly in 64-bit integers, and top_p * Z_k is compared exactly (vocab <= 2^21).
//   4. renormalise the survivors.
// Both filters depend on probability values only, never on token order, and the top-p masses are
// integers, so a GPU finds both cuts with radix selects over the float bits (histograms of counts
// and of masses), with no sort. The renormalisation sums in the fixed order of row_ops.h.
#include <cstdint>

namespace uf::sampling {

struct SamplingParams {
  float temperature = 1.0f;  // [0, 2]; 0 = greedy
  float top_p = 1.0f;        // (0, 1]
  int32_t top_k = 0;         // >= 0; 0 = off

  bool greedy() const { return temperature == 0.0f; }
};

// Throws uf::core::Error naming the field and the allowed range when a value is out of range.
void validate(const SamplingParams& params);

// probs[vocab] = transform(logits[vocab]). `scratch` must hold `vocab` floats; it is used only when
// a top-k / top-p filter is active (pass nullptr otherwise). Never allocates. probs may not alias
// logits.
void logits_to_probs(const float* logits, int64_t vocab, const SamplingParams& params, float* probs,
                     float* scratch);

}  // namespace uf::sampling
