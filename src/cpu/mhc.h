#pragma once
// Manifold-constrained hyper-connections (mHC): the residual stream is hc parallel copies. Per
// sublayer, hc_mixes turns the flattened stream into pre (hc), post (hc) and comb (hc x hc,
// Sinkhorn-normalised) coefficients; hc_pre collapses the copies, hc_post expands a sublayer
// output back. All fp32 as the reference (hc_split_sinkhorn of kernel_cpu.py), results of
// hc_pre / hc_post rounded to bf16; the mixes' sums in the reference's orders (MixOrder).

#include "cpu/model_types.h"

namespace uf::cpu {

struct HcParams {
  int hc = 0;
  int dim = 0;
  int sinkhorn_iters = 0;
  float norm_eps = 0;  // inside the mixes' RMS normalisation
  float hc_eps = 0;
};

// One row: mixes[(2+hc)*hc] -> pre[hc], post[hc], comb[hc*hc] (comb[j*hc+k] mixes copy j into
// output copy k).
void hc_split_sinkhorn(const HcParams& p, const float* mixes, const float* scale, const float* base,
                       float* pre, float* post, float* comb);

// The summation order of the mixes' dot products: the one the reference's F.linear (MKL) used at
// that call site's shape in the golden run (mhc.cpp says what was measured). kGemm: the backbone
// (any T: a row's result never depends on T); kLanes16: the DSpark block.
enum class MixOrder { kGemm, kLanes16 };

// X: [T, hc, dim] stream. Writes pre [T, hc], post [T, hc], comb [T, hc, hc].
void hc_mixes(const HcParams& p, const Weight& fn, const Weight& scale, const Weight& base,
              const float* X, int T, float* pre, float* post, float* comb,
              MixOrder order = MixOrder::kGemm);

// y[T, dim] = bf16(sum_c pre[c] * X[c]).
void hc_pre(const HcParams& p, const float* X, const float* pre, int T, float* y);

// out[T, hc, dim] = bf16(post[k] * x + sum_j comb[j,k] * R[j]).
void hc_post(const HcParams& p, const float* x, const float* R, const float* post,
             const float* comb, int T, float* out);

}  // namespace uf::cpu
