#pragma once
// RMSNorm as the reference computes it: fp32 mean of squares, x * rsqrt(var + eps), times the
// (bf16) weight in fp32, rounded to bf16. eps comes from the config (norm_eps).

#include "cpu/model_types.h"

namespace uf::cpu {

// sum(x[i]^2) in the order of the reference's `x.square().mean(-1)` / `.sum(-1)` on a contiguous
// fp32 row: torch's cascade sum (aten/native/cpu/SumKernel.cpp vectorized_inner_sum, row_sum,
// multi_row_sum) with 8-lane vectors, as its AVX2 kernels run it. The squares are rounded first
// (x.square() is its own op); vector v (lanes = 8 consecutive elements) feeds accumulator v % 4;
// multi_row_sum sums runs of level_step = 2^max(4, ceil(log2(n / 32)) / 4) vector-quads into a
// fresh level-0 accumulator and cascades them up 4 levels; then the levels, the 4 accumulators
// and the 8 lanes are added in order, the scalar tail (n % 8) first. On tiny-a this reproduces
// the reference's ffn_in (teacher-forced) bitwise where a plain 8-lane dot product left an
// element 1 bf16 ulp off, and the mHC mixes' statistic (16-lane vectors matched less often).
float sum_squares_torch(const float* x, int n);

// x, y: [T, n] (may alias). weight: [n].
void rms_norm(const Weight& weight, float eps, const float* x, int T, int n, float* y);

}  // namespace uf::cpu
