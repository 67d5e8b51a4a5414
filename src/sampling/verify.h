#pragma once
// Verification of a draft block (speculative decoding), float32, the implementation the backends
// use (the CUDA kernel ports this file: plain loops, no allocation, fixed reduction order of
// row_ops.h, explicit draws from rng.h). reference.h holds the float64 reference of the same maths.
//
// Notation (serving-anchors.md §B; Sun et al. 2024, arXiv:2403.10444, Algorithm 2):
//   drafts X_1..X_g (0 <= g <= kMaxDraft), X_i sampled from q_i = draft row i - 1;
//   target rows p_0..p_g, p_i = target distribution after X^i (p_g follows the last draft);
//   p(X_i) means p_{i-1}(X_i); q_{i+1} is the draft row of the next slot.
// Both p and q must already be transformed with the request's SamplingParams (transform.h), and q
// must be exactly the row each draft was sampled from (Markov bias included).
//
// Token-wise (Algorithm 1): a_i = min(1, p_{i-1}(X_i) / q_i(X_i)); accept in order while
//   eta_i <= a_i; at the first rejection (tau = i - 1) draw from norm(max(p_tau - q_{tau+1}, 0));
//   if all g are accepted draw from p_g.
// Block (Algorithm 2): w_0 = 1, w_i = min(1, w_{i-1} p_{i-1}(X_i) / q_i(X_i));
//   Z_i = sum_x max(w_i p_i(x) - q_{i+1}(x), 0) for i < g;
//   h_i = Z_i / (Z_i + 1 - w_i) for i < g (h_i = 1 when the denominator is 0), h_g = w_g;
//   tau = the largest i with eta_i <= h_i (0 if none; no early break);
//   extra token from norm(max(w_tau p_tau - q_{tau+1}, 0)) if tau < g (from p_tau if that mass is
//   0), from p_g if tau = g.
// A draft with q_i(X_i) = 0 cannot have been sampled; it is treated as ratio +inf (w_i = 1).
#include <cstdint>

#include "sampling/rng.h"

namespace uf::sampling {

enum class VerifyMode : uint8_t { kTokenWise, kBlock };

struct VerifyRows {
  int32_t num_drafts = 0;           // g
  int64_t vocab = 0;                // V
  const float* target = nullptr;    // [(g + 1) x V] row-major, row i = p_i
  const float* draft = nullptr;     // [g x V] row-major, row i - 1 = q_i
  const int32_t* tokens = nullptr;  // [g] X_1..X_g
};

struct VerifyResult {
  int32_t accepted = 0;      // tau: drafts kept
  int32_t extra_token = -1;  // the correction (tau < g) or bonus (tau = g) token
  // Diagnostics, index i = 0..g (entries above g stay 0):
  //   weight: w_i in both modes (w_0 = 1);
  //   threshold: block h_i, token-wise a_i (index 0 = 1);
  //   residual_mass: block Z_i for 1 <= i < g and Z_0 when tau = 0; token-wise Z_tau when tau < g.
  float weight[kMaxDraft + 1] = {};
  float threshold[kMaxDraft + 1] = {};
  float residual_mass[kMaxDraft + 1] = {};
};

// tau and the extra token for one step. rows.num_drafts must be in [0, kMaxDraft].
VerifyResult verify(VerifyMode mode, const VerifyRows& rows, const VerifyDraws& draws);

// norm(max(scale * p - q, 0)) drawn with u; falls back to p when that mass is 0 (or q is null).
// Exposed for the tests' deliberately broken verifiers and for the device port.
int32_t sample_residual(const float* p, const float* q, float scale, int64_t vocab, float u);

}  // namespace uf::sampling
