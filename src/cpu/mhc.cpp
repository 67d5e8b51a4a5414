#include "cpu/mhc.h"

#include <cmath>
#include <vector>

#include "core/dtypes.h"
#include "core/error.h"
#include "cpu/linear.h"

namespace uf::cpu {

namespace {
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
}  // namespace

void hc_split_sinkhorn(const HcParams& p, const float* m, const float* scale, const float* base,
                       float* pre, float* post, float* comb) {
  const int hc = p.hc;
  const float eps = p.hc_eps;
  for (int i = 0; i < hc; ++i) pre[i] = sigmoid(m[i] * scale[0] + base[i]) + eps;
  for (int i = 0; i < hc; ++i) post[i] = 2 * sigmoid(m[hc + i] * scale[1] + base[hc + i]);
  float* c = comb;
  for (int i = 0; i < hc * hc; ++i) c[i] = m[2 * hc + i] * scale[2] + base[2 * hc + i];
  auto row_sum = [&](int j) {
    float s = 0;
    for (int k = 0; k < hc; ++k) s += c[j * hc + k];
    return s;
  };
  auto col_sum = [&](int k) {
    float s = 0;
    for (int j = 0; j < hc; ++j) s += c[j * hc + k];
    return s;
  };
  // softmax over each row, + eps
  for (int j = 0; j < hc; ++j) {
    float mx = c[j * hc];
    for (int k = 1; k < hc; ++k) mx = std::max(mx, c[j * hc + k]);
    for (int k = 0; k < hc; ++k) c[j * hc + k] = std::exp(c[j * hc + k] - mx);
    const float s = row_sum(j);
    for (int k = 0; k < hc; ++k) c[j * hc + k] = c[j * hc + k] / s + eps;
  }
  std::vector<float> sums(static_cast<size_t>(hc));
  auto norm_cols = [&] {
    for (int k = 0; k < hc; ++k) sums[size_t(k)] = col_sum(k) + eps;
    for (int j = 0; j < hc; ++j)
      for (int k = 0; k < hc; ++k) c[j * hc + k] /= sums[size_t(k)];
  };
  auto norm_rows = [&] {
    for (int j = 0; j < hc; ++j) sums[size_t(j)] = row_sum(j) + eps;
    for (int j = 0; j < hc; ++j)
      for (int k = 0; k < hc; ++k) c[j * hc + k] /= sums[size_t(j)];
  };
  norm_cols();
  for (int it = 0; it < p.sinkhorn_iters - 1; ++it) {
    norm_rows();
    norm_cols();
  }
}

void hc_mixes(const HcParams& p, const Weight& fn, const Weight& scale, const Weight& base,
              const float* X, int T, float* pre, float* post, float* comb) {
  const int hc = p.hc, n = p.hc * p.dim, mix = (2 + hc) * hc;
  UF_CHECK(fn.rows == mix && fn.cols == n, "hc_mixes: '{}' is [{}, {}], expected [{}, {}]", fn.name,
           fn.rows, fn.cols, mix, n);
  std::vector<float> mixes(size_t(T) * size_t(mix));
  linear_f32(fn, X, T, mixes.data());
  const std::vector<float> sc = scale.to_vector(), bs = base.to_vector();
  for (int t = 0; t < T; ++t) {
    const float* x = X + int64_t(t) * n;
    const float r = 1.0f / std::sqrt(dot_f32(x, x, n) / float(n) + p.norm_eps);
    float* m = mixes.data() + int64_t(t) * mix;
    for (int i = 0; i < mix; ++i) m[i] *= r;
    hc_split_sinkhorn(p, m, sc.data(), bs.data(), pre + t * hc, post + t * hc, comb + t * hc * hc);
  }
}

void hc_pre(const HcParams& p, const float* X, const float* pre, int T, float* y) {
  const int hc = p.hc, D = p.dim;
  for (int t = 0; t < T; ++t) {
    const float* x = X + int64_t(t) * hc * D;
    const float* w = pre + t * hc;
    float* out = y + int64_t(t) * D;
    for (int d = 0; d < D; ++d) {
      float s = w[0] * x[d];
      for (int c = 1; c < hc; ++c) s += w[c] * x[int64_t(c) * D + d];
      out[d] = core::round_bf16(s);
    }
  }
}

void hc_post(const HcParams& p, const float* x, const float* R, const float* post,
             const float* comb, int T, float* out) {
  const int hc = p.hc, D = p.dim;
  for (int t = 0; t < T; ++t) {
    const float* xs = x + int64_t(t) * D;
    const float* r = R + int64_t(t) * hc * D;
    const float* cb = comb + t * hc * hc;
    float* o = out + int64_t(t) * hc * D;
    for (int k = 0; k < hc; ++k) {
      const float pk = post[t * hc + k];
      for (int d = 0; d < D; ++d) {
        float s = cb[k] * r[d];
        for (int j = 1; j < hc; ++j) s += cb[j * hc + k] * r[int64_t(j) * D + d];
        o[int64_t(k) * D + d] = core::round_bf16(pk * xs[d] + s);
      }
    }
  }
}

}  // namespace uf::cpu
