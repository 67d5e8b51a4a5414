#include "cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtypes.h"
#include "cpu/linear.h"

namespace uf::cpu {

UF_CPU_CLONES void sparse_attn_row(const float* q, int H, int hd, const float* const* kv,
                                   int n_slots, const float* sink, float scale, float* out) {
  std::vector<float> acc(static_cast<size_t>(hd)), tmp(static_cast<size_t>(hd));
  float s[kAttnBlock], p[kAttnBlock];
  for (int h = 0; h < H; ++h) {
    const float* qh = q + int64_t(h) * hd;
    float m = -1e30f, sum = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int b0 = 0; b0 < n_slots; b0 += kAttnBlock) {
      const int nb = std::min(kAttnBlock, n_slots - b0);
      float bmax = -INFINITY;
      for (int j = 0; j < nb; ++j) {
        const float* k = kv[b0 + j];
        s[j] = k ? dot_f32(qh, k, hd) * scale : -INFINITY;
        bmax = std::max(bmax, s[j]);
      }
      const float m_new = std::max(m, bmax);
      const float sc = std::exp(m - m_new);
      float psum = 0.f;
      for (int j = 0; j < nb; ++j) {
        p[j] = kv[b0 + j] ? std::exp(s[j] - m_new) : 0.f;
        psum += p[j];
      }
      sum = sum * sc + psum;
      std::fill(tmp.begin(), tmp.end(), 0.f);
      for (int j = 0; j < nb; ++j) {
        const float* k = kv[b0 + j];
        if (!k) continue;
        const float pb = core::round_bf16(p[j]);
        for (int d = 0; d < hd; ++d) tmp[size_t(d)] += pb * k[d];
      }
      for (int d = 0; d < hd; ++d) acc[size_t(d)] = acc[size_t(d)] * sc + tmp[size_t(d)];
      m = m_new;
    }
    sum = sum + std::exp(sink[h] - m);
    float* o = out + int64_t(h) * hd;
    for (int d = 0; d < hd; ++d) o[d] = core::round_bf16(acc[size_t(d)] / sum);
  }
}

}  // namespace uf::cpu
