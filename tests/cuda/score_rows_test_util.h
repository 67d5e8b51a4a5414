#pragma once
// Score rows for the top-k and candidate-pool tests (test_ops_attention.cpp,
// test_ops_indexer_long.cpp): bf16 values as the indexer makes them, with the cases that break
// selections: heavy ties, all equal, all -inf, signed zeros, -inf holes and -inf past vis.
#include <cmath>
#include <random>
#include <vector>

#include "core/dtypes.h"

namespace uf::cuda::test {

// kNormalF32: full fp32 values (the other kinds are bf16 values, as the model's scores; the
// selection rounds take a shorter radix path for those).
enum class RowKind { kNormal, kFewValues, kAllEqual, kAllNegInf, kSignedZeros, kNormalF32 };

// One row of `width` scores; entries at i >= vis and (except kAllEqual) one in ten at random
// are -inf.
inline std::vector<float> make_score_row(RowKind kind, int width, int vis, std::mt19937& rng) {
  std::vector<float> s(static_cast<size_t>(width));
  std::normal_distribution<float> nd(0.f, 3.f);
  std::uniform_int_distribution<int> few(0, 5), hole(0, 9);
  for (int i = 0; i < width; ++i) {
    float v = 0.f;
    switch (kind) {
      case RowKind::kNormal:
        v = core::round_bf16(nd(rng));
        break;
      case RowKind::kNormalF32:
        v = nd(rng);
        break;
      case RowKind::kFewValues:
        v = 0.5f * float(few(rng));  // six levels: ties everywhere, also at the threshold
        break;
      case RowKind::kAllEqual:
        v = 1.25f;
        break;
      case RowKind::kAllNegInf:
        v = -INFINITY;
        break;
      case RowKind::kSignedZeros: {
        const int x = few(rng);
        v = x == 0 ? -0.f : (x == 1 ? 0.f : -0.5f * float(x));
        break;
      }
    }
    if (kind != RowKind::kAllEqual && hole(rng) == 0) v = -INFINITY;
    if (i >= vis) v = -INFINITY;
    s[size_t(i)] = v;
  }
  return s;
}

}  // namespace uf::cuda::test
