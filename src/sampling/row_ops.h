#pragma once
// Row primitives shared by the sampler and the verifier, written in the shape of a 256-thread
// CUDA block so the device kernel can follow the same order:
//   - a row of n entries is cut into kLanes contiguous chunks of ceil(n / kLanes) entries
//     (lane l owns [l * chunk, min(n, (l + 1) * chunk))); each lane sums its chunk in index order;
//   - the kLanes partial sums are combined by a pairwise tree (stride 128, 64, ..., 1), which is
//     the shared-memory reduction of a block.
// The result is deterministic for a given input (no dependence on threads or timing).
// Inverse-CDF sampling walks the chunk sums in lane order to find the chunk holding the target,
// then walks inside that chunk in index order.
// Weights are given as a functor weight(x) -> float so that residuals such as
// max(w * p(x) - q(x), 0) need no buffer: no allocation anywhere here.
#include <cstdint>

#include "sampling/rng.h"

namespace uf::sampling {

inline constexpr int kLanes = 256;

template <typename Weight>
UF_SAMPLING_HD void chunk_sums(const Weight& weight, int64_t n, float sums[kLanes]) {
  const int64_t chunk = (n + kLanes - 1) / kLanes;
  for (int lane = 0; lane < kLanes; ++lane) {
    float s = 0.0f;
    const int64_t begin = lane * chunk;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
    for (int64_t x = begin; x < end; ++x) s += weight(x);
    sums[lane] = s;
  }
}

// Pairwise tree over the lane sums; `sums` is left untouched.
UF_SAMPLING_HD float tree_total(const float sums[kLanes]) {
  float t[kLanes];
  for (int i = 0; i < kLanes; ++i) t[i] = sums[i];
  for (int stride = kLanes / 2; stride > 0; stride /= 2) {
    for (int i = 0; i < stride; ++i) t[i] += t[i + stride];
  }
  return t[0];
}

template <typename Weight>
UF_SAMPLING_HD float fixed_order_sum(const Weight& weight, int64_t n) {
  float sums[kLanes];
  chunk_sums(weight, n, sums);
  return tree_total(sums);
}

// Inverse-CDF draw from unnormalised non-negative weights with uniform u in (0, 1]: the first x
// (index order) whose running sum reaches u * total and whose weight is positive. Zero-weight
// entries are never returned. Returns -1 only when every weight is zero (total == 0).
template <typename Weight>
UF_SAMPLING_HD int32_t inverse_cdf_pick(const Weight& weight, int64_t n, float u) {
  float sums[kLanes];
  chunk_sums(weight, n, sums);
  const float total = tree_total(sums);
  if (!(total > 0.0f)) return -1;
  const float target = u * total;
  const int64_t chunk = (n + kLanes - 1) / kLanes;
  float running = 0.0f;
  int32_t last_positive = -1;
  for (int lane = 0; lane < kLanes; ++lane) {
    if (!(sums[lane] > 0.0f)) continue;
    const int64_t begin = lane * chunk;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
    if (running + sums[lane] >= target) {
      float r = running;
      for (int64_t x = begin; x < end; ++x) {
        const float w = weight(x);
        if (!(w > 0.0f)) continue;
        r += w;
        last_positive = int32_t(x);
        if (r >= target) return int32_t(x);
      }
      // Rounding: the in-chunk walk fell just short of what the chunk sum promised.
      return last_positive;
    }
    running += sums[lane];
    for (int64_t x = end - 1; x >= begin; --x) {
      if (weight(x) > 0.0f) {
        last_positive = int32_t(x);
        break;
      }
    }
  }
  // Rounding at the very end (u == 1 and the running sum came out below the tree total).
  return last_positive;
}

// Index of the largest value; the lowest index wins ties (greedy decoding and T = 0).
UF_SAMPLING_HD int32_t argmax_row(const float* x, int64_t n) {
  int32_t best = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (x[i] > x[best]) best = int32_t(i);
  }
  return best;
}

}  // namespace uf::sampling
