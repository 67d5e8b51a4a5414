#include "cpu/norm.h"

#include <cmath>
#include <vector>

#include "core/dtypes.h"
#include "cpu/linear.h"

namespace uf::cpu {

void rms_norm(const Weight& weight, float eps, const float* x, int T, int n, float* y) {
  const std::vector<float> w = weight.to_vector();
  for (int t = 0; t < T; ++t) {
    const float* xr = x + int64_t(t) * n;
    float* yr = y + int64_t(t) * n;
    const float var = dot_f32(xr, xr, n) / float(n);
    const float r = 1.0f / std::sqrt(var + eps);
    for (int i = 0; i < n; ++i) yr[i] = core::round_bf16(w[size_t(i)] * (xr[i] * r));
  }
}

}  // namespace uf::cpu
