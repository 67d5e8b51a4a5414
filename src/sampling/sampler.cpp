#include "sampling/sampler.h"

#include "sampling/row_ops.h"

namespace uf::sampling {

int32_t sample_from_probs(const float* probs, int64_t vocab, float u) {
  return inverse_cdf_pick([probs](int64_t x) { return probs[x]; }, vocab, u);
}

int32_t sample_from_logits(const float* logits, int64_t vocab, const SamplingParams& params,
                           float u, float* probs, float* scratch) {
  logits_to_probs(logits, vocab, params, probs, scratch);
  if (params.greedy()) return argmax_row(probs, vocab);
  return sample_from_probs(probs, vocab, u);
}

}  // namespace uf::sampling
