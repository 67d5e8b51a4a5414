#include "cpu/engram.h"

#include <cmath>
#include <vector>

#include "core/dtypes.h"
#include "core/error.h"
#include "cpu/linear.h"

namespace uf::cpu {

void engram_forward(const EngramWeights& w, const EngramParams& p, const int64_t* ids,
                    const float* X, int T, float* out) {
  const int hc = p.hc, D = p.dim, K = p.n_cols * p.head_dim;
  std::vector<float> e(size_t(T) * size_t(K));
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < p.n_cols; ++c) {
      const int64_t row = ids[int64_t(t) * p.n_cols + c];
      UF_CHECK(row >= 0 && row < w.table.rows,
               "engram: hash id {} out of the table '{}' with {} rows", row, w.table.name,
               w.table.rows);
      float* dst = e.data() + int64_t(t) * K + int64_t(c) * p.head_dim;
      w.table.row(row, dst);
      for (int i = 0; i < p.head_dim; ++i) dst[i] = core::round_bf16(dst[i]);
    }
  const int KV = D * (hc + 1);
  std::vector<float> kv(size_t(T) * size_t(KV));
  linear(w.wkv, e.data(), T, kv.data());
  const std::vector<float> qw = w.q_weight.to_vector(), kw = w.k_weight.to_vector();
  std::vector<float> wt(size_t(hc) * size_t(D));
  for (size_t i = 0; i < wt.size(); ++i) wt[i] = qw[i] * kw[i];
  const float dim_scale = float(std::pow(double(D), -0.5));
  for (int t = 0; t < T; ++t) {
    const float* key = kv.data() + int64_t(t) * KV;
    const float* value = key + int64_t(hc) * D;
    for (int c = 0; c < hc; ++c) {
      const float* h = X + (int64_t(t) * hc + c) * D;
      const float* k = key + int64_t(c) * D;
      const float rstd = (1.0f / std::sqrt(dot_f32(h, h, D) / float(D) + p.norm_eps)) *
                         (1.0f / std::sqrt(dot_f32(k, k, D) / float(D) + p.norm_eps));
      float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int d = 0; d < D; ++d) s[d & 7] += h[d] * wt[size_t(c) * D + d] * k[d];
      const float sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
      const float dot = sum * rstd * dim_scale;
      const float mag = std::sqrt(std::max(std::fabs(dot), 1e-6f));
      const float gate = 1.0f / (1.0f + std::exp(-std::copysign(mag, dot)));
      float* o = out + (int64_t(t) * hc + c) * D;
      for (int d = 0; d < D; ++d) o[d] = core::round_bf16(h[d] + gate * value[d]);
    }
  }
}

}  // namespace uf::cpu
