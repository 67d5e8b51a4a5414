#include "cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/dtypes.h"
#include "core/error.h"
#include "cpu/linear.h"

namespace uf::cpu {

void moe_route(const MoeWeights& w, const MoeParams& p, const float* x, int T, int32_t* gate_i,
               float* gate_w) {
  const int E = p.n_experts, K = p.top_k;
  std::vector<float> s(size_t(T) * size_t(E));
  linear_f32(w.gate, x, T, s.data());
  const std::vector<float> bias = w.gate_bias.to_vector();
  std::vector<float> biased(static_cast<size_t>(E));
  std::vector<int> order(static_cast<size_t>(E));
  for (int t = 0; t < T; ++t) {
    float* sc = s.data() + int64_t(t) * E;
    for (int e = 0; e < E; ++e) sc[e] = sc[e] / p.gate_temp;
    if (p.score_func == "softmax") {
      float mx = sc[0];
      for (int e = 1; e < E; ++e) mx = std::max(mx, sc[e]);
      float sum = 0;
      for (int e = 0; e < E; ++e) sum += (sc[e] = std::exp(sc[e] - mx));
      for (int e = 0; e < E; ++e) sc[e] /= sum;
    } else if (p.score_func == "sigmoid") {
      for (int e = 0; e < E; ++e) sc[e] = 1.0f / (1.0f + std::exp(-sc[e]));
    } else {  // sqrtsoftplus; torch's softplus returns x itself above the threshold 20
      for (int e = 0; e < E; ++e)
        sc[e] = std::sqrt(sc[e] > 20.f ? sc[e] : std::log1p(std::exp(sc[e])));
    }
    for (int e = 0; e < E; ++e) biased[size_t(e)] = sc[e] + bias[size_t(e)];
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int a, int b) {
      return biased[size_t(a)] > biased[size_t(b)] ||
             (biased[size_t(a)] == biased[size_t(b)] && a < b);
    });
    float* gw = gate_w + int64_t(t) * K;
    int32_t* gi = gate_i + int64_t(t) * K;
    for (int k = 0; k < K; ++k) {
      gi[k] = order[size_t(k)];
      gw[k] = sc[order[size_t(k)]];
    }
    if (p.norm_topk_prob && K > 1) {
      float sum = 0;
      for (int k = 0; k < K; ++k) sum += gw[k];
      sum += 1e-20f;
      for (int k = 0; k < K; ++k) gw[k] /= sum;
    }
    for (int k = 0; k < K; ++k) gw[k] *= p.route_scale;
  }
}

void expert_forward(const ExpertWeights& e, float lim, const float* x, int n, int dim, int inter,
                    const float* row_weight, float* y) {
  std::vector<float> g(size_t(n) * size_t(inter)), u(size_t(n) * size_t(inter));
  linear(e.w1, x, n, g.data());
  linear(e.w3, x, n, u.data());
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < inter; ++i) {
      const size_t k = size_t(r) * size_t(inter) + size_t(i);
      float gv = g[k], uv = u[k];
      if (lim > 0) {
        uv = std::min(std::max(uv, -lim), lim);
        gv = std::min(gv, lim);
      }
      float h = gv / (1.0f + std::exp(-gv)) * uv;
      if (row_weight) h = row_weight[r] * h;
      g[k] = core::round_bf16(h);
    }
  linear(e.w2, g.data(), n, y);
  (void)dim;
}

void moe_forward(const MoeWeights& w, const MoeParams& p, const float* x, int T, int dim, int inter,
                 float* y, int32_t* gate_i, float* gate_w) {
  const int K = p.top_k;
  moe_route(w, p, x, T, gate_i, gate_w);
  std::vector<float> acc(size_t(T) * size_t(dim), 0.f);
  std::vector<float> xe, we, ye;
  std::vector<int> rows;
  for (int e = 0; e < p.n_experts; ++e) {
    rows.clear();
    we.clear();
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k)
        if (gate_i[t * K + k] == e) {
          rows.push_back(t);
          we.push_back(gate_w[t * K + k]);
        }
    if (rows.empty()) continue;
    const int n = int(rows.size());
    xe.resize(size_t(n) * size_t(dim));
    ye.resize(size_t(n) * size_t(dim));
    for (int r = 0; r < n; ++r)
      std::copy(x + int64_t(rows[size_t(r)]) * dim, x + int64_t(rows[size_t(r)] + 1) * dim,
                xe.begin() + int64_t(r) * dim);
    expert_forward(w.experts[size_t(e)], p.swiglu_limit, xe.data(), n, dim, inter, we.data(),
                   ye.data());
    for (int r = 0; r < n; ++r) {
      float* a = acc.data() + int64_t(rows[size_t(r)]) * dim;
      const float* b = ye.data() + int64_t(r) * dim;
      for (int d = 0; d < dim; ++d) a[d] += b[d];
    }
  }
  ye.resize(size_t(T) * size_t(dim));
  expert_forward(w.shared, p.swiglu_limit, x, T, dim, inter, nullptr, ye.data());
  for (size_t i = 0; i < size_t(T) * size_t(dim); ++i) y[i] = core::round_bf16(acc[i] + ye[i]);
}

}  // namespace uf::cpu
