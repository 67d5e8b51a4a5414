#include "sampling/verify.h"

#include <cassert>

#include "sampling/row_ops.h"
#include "sampling/sampler.h"

namespace uf::sampling {
namespace {

// min(1, w * p / q), written so that q = 0 gives 1 and no division overflows.
float next_weight(float w, float p, float q) {
  const float num = w * p;
  return num >= q ? 1.0f : num / q;
}

float residual_mass(const float* p, const float* q, float scale, int64_t vocab) {
  return fixed_order_sum(
      [=](int64_t x) {
        const float r = scale * p[x] - q[x];
        return r > 0.0f ? r : 0.0f;
      },
      vocab);
}

}  // namespace

int32_t sample_residual(const float* p, const float* q, float scale, int64_t vocab, float u) {
  if (q != nullptr) {
    const int32_t y = inverse_cdf_pick(
        [=](int64_t x) {
          const float r = scale * p[x] - q[x];
          return r > 0.0f ? r : 0.0f;
        },
        vocab, u);
    if (y >= 0) return y;
  }
  return sample_from_probs(p, vocab, u);
}

VerifyResult verify(VerifyMode mode, const VerifyRows& rows, const VerifyDraws& draws) {
  const int32_t g = rows.num_drafts;
  assert(g >= 0 &&
         g <= kMaxDraft);  // the engine caps blocks at kMaxDraft; no throw in the hot path
  const int64_t v = rows.vocab;
  const float* p = rows.target;
  const float* q = rows.draft;
  VerifyResult res;
  res.weight[0] = 1.0f;
  res.threshold[0] = 1.0f;
  for (int32_t i = 1; i <= g; ++i) {
    const int32_t x = rows.tokens[i - 1];
    res.weight[i] = next_weight(res.weight[i - 1], p[(i - 1) * v + x], q[(i - 1) * v + x]);
  }

  int32_t tau = 0;
  if (mode == VerifyMode::kTokenWise) {
    tau = g;
    for (int32_t i = 1; i <= g; ++i) {
      const int32_t x = rows.tokens[i - 1];
      res.threshold[i] = next_weight(1.0f, p[(i - 1) * v + x], q[(i - 1) * v + x]);
    }
    for (int32_t i = 1; i <= g; ++i) {
      if (!(draws.eta[i - 1] <= res.threshold[i])) {
        tau = i - 1;
        break;
      }
    }
    if (tau < g) {
      res.residual_mass[tau] = residual_mass(p + tau * v, q + tau * v, 1.0f, v);
      res.extra_token = sample_residual(p + tau * v, q + tau * v, 1.0f, v, draws.u_extra);
    } else {
      res.extra_token = sample_from_probs(p + g * v, v, draws.u_extra);
    }
    res.accepted = tau;
    return res;
  }

  // Block verification: the residual mass at i = 0 is only needed when tau ends at 0.
  res.residual_mass[0] = 0.0f;
  for (int32_t i = 1; i <= g; ++i) {
    if (i < g) {
      const float z = residual_mass(p + i * v, q + i * v, res.weight[i], v);
      const float den = z + (1.0f - res.weight[i]);
      res.residual_mass[i] = z;
      res.threshold[i] = den > 0.0f ? z / den : 1.0f;
    } else {
      res.threshold[i] = res.weight[i];
    }
    if (draws.eta[i - 1] <= res.threshold[i]) tau = i;  // no break: tau is the last such i
  }
  if (tau < g) {
    if (tau == 0) res.residual_mass[0] = residual_mass(p, q, 1.0f, v);
    res.extra_token = sample_residual(p + tau * v, q + tau * v, res.weight[tau], v, draws.u_extra);
  } else {
    res.extra_token = sample_from_probs(p + g * v, v, draws.u_extra);
  }
  res.accepted = tau;
  return res;
}

}  // namespace uf::sampling
