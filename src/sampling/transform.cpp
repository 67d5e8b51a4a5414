#include "sampling/transform.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "core/error.h"
#include "sampling/row_ops.h"
#include "sampling/top_p_mass.h"

namespace uf::sampling {
namespace {

// The top-p cut over the n survivor values in v[] (reordered): the largest value x such that the
// survivors >= x have mass >= limit (top_p_mass.h's fixed point; integer sums, so the order of
// summation does not matter). Walks value groups in descending order; only the largest values are
// sorted (the top 1024, then 4x more while the walk runs out): the sorted prefix equals that of a
// full sort, so the result is the same, ~10x faster. limit >= 1 and the mass of all n values
// >= limit, so the walk always ends inside the row.
float top_p_cut(float* v, int64_t n, uint64_t limit) {
  int64_t k = std::min<int64_t>(n, 1024);
  for (;;) {
    std::nth_element(v, v + (k - 1), v + n, std::greater<float>());
    std::sort(v, v + k, std::greater<float>());
    uint64_t mass = 0;  // of the value groups walked so far
    int64_t i = 0;
    while (i < k) {
      const float value = v[i];
      while (i < k && v[i] == value) mass += top_p_mass(v[i++]);
      if (mass >= limit) return value;
    }
    if (k == n) return v[n - 1];  // not reached (cannot happen: see above)
    k = std::min(n, 4 * k);
  }
}

}  // namespace

void validate(const SamplingParams& params) {
  UF_CHECK(
      std::isfinite(params.temperature) && params.temperature >= 0.0f && params.temperature <= 2.0f,
      "sampling parameter temperature = {} is out of range: it must lie in [0, 2] "
      "(0 = greedy)",
      params.temperature);
  UF_CHECK(std::isfinite(params.top_p) && params.top_p > 0.0f && params.top_p <= 1.0f,
           "sampling parameter top_p = {} is out of range: it must lie in (0, 1]", params.top_p);
  UF_CHECK(params.top_k >= 0,
           "sampling parameter top_k = {} is out of range: it must be >= 0 "
           "(0 = off)",
           params.top_k);
}

void logits_to_probs(const float* logits, int64_t vocab, const SamplingParams& params, float* probs,
                     float* scratch) {
  if (params.greedy()) {
    const int32_t best = argmax_row(logits, vocab);
    for (int64_t x = 0; x < vocab; ++x) probs[x] = 0.0f;
    probs[best] = 1.0f;
    return;
  }
  float m = logits[0];
  for (int64_t x = 1; x < vocab; ++x) m = std::max(m, logits[x]);
  const float t = params.temperature;
  // exp in double, rounded once to float: (almost always) the correctly rounded expf, which the
  // CUDA verification kernel computes identically; glibc's expf is off by one ulp on ~6e-4 of
  // arguments and could differ between libc versions.
  for (int64_t x = 0; x < vocab; ++x)
    probs[x] = static_cast<float>(std::exp(static_cast<double>((logits[x] - m) / t)));

  const bool use_k = params.top_k > 0 && params.top_k < vocab;
  const bool use_p = params.top_p < 1.0f;
  float cut = 0.0f;  // survivors are the x with probs[x] >= cut
  if (use_k || use_p) {
    int64_t n = vocab;
    for (int64_t x = 0; x < vocab; ++x) scratch[x] = probs[x];
    if (use_k) {
      std::nth_element(scratch, scratch + (params.top_k - 1), scratch + vocab,
                       std::greater<float>());
      cut = scratch[params.top_k - 1];  // the k-th largest value, with multiplicity
      n = 0;
      for (int64_t x = 0; x < vocab; ++x) {
        if (probs[x] >= cut) scratch[n++] = probs[x];
      }
    }
    if (use_p) {
      UF_CHECK(vocab <= kTopPMaxVocab,
               "top_p: a vocabulary of {} exceeds the {} entries "
               "whose fixed-point mass fits in 64 bits",
               vocab, kTopPMaxVocab);
      uint64_t zk = 0;
      for (int64_t x = 0; x < n; ++x) zk += top_p_mass(scratch[x]);
      const uint64_t limit = top_p_limit(params.top_p, zk);
      // No measurable mass (a row of NaN or zeros): the filter keeps the survivors as they are.
      if (limit > 0) cut = top_p_cut(scratch, n, limit);
    }
    for (int64_t x = 0; x < vocab; ++x) {
      if (!(probs[x] >= cut)) probs[x] = 0.0f;
    }
  }
  const float z = fixed_order_sum([&](int64_t x) { return probs[x]; }, vocab);
  for (int64_t x = 0; x < vocab; ++x) probs[x] = probs[x] / z;
}

}  // namespace uf::sampling
