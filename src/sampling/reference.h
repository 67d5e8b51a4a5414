#pragma once
// float64 reference of the transform, the sampler and both verification modes, written straight
// from the definitions in transform.h and verify.h (allocation allowed, O(V^2) transform): the
// yardstick for the float32 implementation and for the device kernel. Not for the hot path.
#include <array>
#include <cstdint>
#include <vector>

#include "sampling/rng.h"
#include "sampling/transform.h"
#include "sampling/verify.h"

namespace uf::sampling {

std::vector<double> reference_transform(const double* logits, int64_t vocab,
                                        const SamplingParams& params);

// Sequential inverse CDF over unnormalised weights, u in (0, 1]; -1 for an all-zero row.
int32_t reference_sample(const double* weights, int64_t vocab, double u);

struct ReferenceVerifyResult {
  int32_t accepted = 0;
  int32_t extra_token = -1;
  std::array<double, kMaxDraft + 1> weight{};         // w_i
  std::array<double, kMaxDraft + 1> threshold{};      // block h_i / token-wise a_i
  std::array<double, kMaxDraft + 1> residual_mass{};  // Z_i, every i < g, both modes
};

// p: [(g + 1) x V], q: [g x V], tokens: [g], eta: [g] (eta[i - 1] = eta_i).
ReferenceVerifyResult reference_verify(VerifyMode mode, int32_t g, int64_t vocab, const double* p,
                                       const double* q, const int32_t* tokens, const double* eta,
                                       double u_extra);

// The exact law of one verify step for fixed rows and drafts, with the eta integrated out:
// prob_accepted[i] = P(tau = i), extra[i] = law of the extra token given tau = i (empty when
// P(tau = i) = 0).
struct ReferenceStepLaw {
  std::vector<double> prob_accepted;
  std::vector<std::vector<double>> extra;
  double expected_accepted = 0.0;
};

ReferenceStepLaw reference_step_law(VerifyMode mode, int32_t g, int64_t vocab, const double* p,
                                    const double* q, const int32_t* tokens);

}  // namespace uf::sampling
