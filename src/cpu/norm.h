#pragma once
// RMSNorm as the reference computes it: fp32 mean of squares, x * rsqrt(var + eps), times the
// (bf16) weight in fp32, rounded to bf16. eps comes from the config (norm_eps).

#include "cpu/model_types.h"

namespace uf::cpu {

// x, y: [T, n] (may alias). weight: [n].
void rms_norm(const Weight& weight, float eps, const float* x, int T, int n, float* y);

}  // namespace uf::cpu
