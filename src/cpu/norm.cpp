#include "cpu/norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtypes.h"

namespace uf::cpu {

float sum_squares_torch(const float* x, int n) {
  constexpr int VL = 8, kIlp = 4, kLevels = 4;
  const int nvec = n / VL, size_ilp = nvec / kIlp;
  int log2 = 0;
  while ((1 << log2) < size_ilp) ++log2;
  const int level_power = std::max(4, log2 / kLevels), level_step = 1 << level_power;
  const int level_mask = level_step - 1;
  float acc[kLevels][kIlp][VL] = {};
  auto sq = [&](int vec, int lane) {
    const float v = x[vec * VL + lane];
    return v * v;
  };
  int i = 0;
  while (i + level_step <= size_ilp) {
    for (int j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < VL; ++l) acc[0][k][l] += sq(kIlp * i + k, l);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < VL; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.f;
        }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < VL; ++l) acc[0][k][l] += sq(kIlp * i + k, l);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < VL; ++l) acc[0][k][l] += acc[j][k][l];
  float lanes[VL];
  for (int l = 0; l < VL; ++l) lanes[l] = acc[0][0][l];
  for (int v = size_ilp * kIlp; v < nvec; ++v)
    for (int l = 0; l < VL; ++l) lanes[l] += sq(v, l);
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < VL; ++l) lanes[l] += acc[0][k][l];
  float s = 0.f;
  for (int e = nvec * VL; e < n; ++e) s += x[e] * x[e];
  for (int l = 0; l < VL; ++l) s += lanes[l];
  return s;
}

void rms_norm(const Weight& weight, float eps, const float* x, int T, int n, float* y) {
  const std::vector<float> w = weight.to_vector();
  for (int t = 0; t < T; ++t) {
    const float* xr = x + int64_t(t) * n;
    float* yr = y + int64_t(t) * n;
    const float var = sum_squares_torch(xr, n) / float(n);
    const float r = 1.0f / std::sqrt(var + eps);
    for (int i = 0; i < n; ++i) yr[i] = core::round_bf16(w[size_t(i)] * (xr[i] * r));
  }
}

}  // namespace uf::cpu
