#include "cpu/compressor.h"

#include <algorithm>
#include <cmath>

namespace uf::cpu {

void compress_pool(const float* const* kv, const float* const* score, int ratio, int hd,
                   float* out) {
  for (int c = 0; c < hd; ++c) {
    float mx = score[0][c];
    for (int t = 1; t < ratio; ++t) mx = std::max(mx, score[t][c]);
    float e[64];
    float sum = 0.f;
    for (int t = 0; t < ratio; ++t) {
      e[t] = std::exp(score[t][c] - mx);
      sum += e[t];
    }
    float acc = 0.f;
    for (int t = 0; t < ratio; ++t) acc += kv[t][c] * (e[t] / sum);
    out[c] = acc;
  }
}

}  // namespace uf::cpu
