#include "cpu/indexer.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/dtypes.h"
#include "cpu/linear.h"

namespace uf::cpu {

UF_CPU_CLONES void index_scores_row(const float* q, const float* w, int n_heads, int head_dim,
                                    const float* keys, int n_visible, int width, float* score) {
  for (int t = 0; t < n_visible; ++t) {
    const float* k = keys + int64_t(t) * head_dim;
    float s = 0.f;
    for (int h = 0; h < n_heads; ++h) {
      const float d = core::round_bf16(dot_f32(q + int64_t(h) * head_dim, k, head_dim));
      s += core::round_bf16(std::max(d, 0.0f) * w[h]);
    }
    score[t] = core::round_bf16(s);
  }
  for (int t = n_visible; t < width; ++t) score[t] = -INFINITY;
}

void candidate_mask(const float* score, int width, int compress_len, int topk_blocks,
                    int block_size, uint8_t* keep) {
  const int nb = (width + block_size - 1) / block_size;
  std::vector<float> bs(size_t(nb), -INFINITY);
  for (int t = 0; t < width; ++t)
    bs[size_t(t / block_size)] = std::max(bs[size_t(t / block_size)], score[t]);
  // (compress_len - 1) // block_size with floor division: no block is pinned when nothing is
  // visible
  if (compress_len > 0) bs[size_t((compress_len - 1) / block_size)] = INFINITY;
  std::vector<int> order(static_cast<size_t>(nb));
  std::iota(order.begin(), order.end(), 0);
  const int k = std::min(topk_blocks, nb);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
    return bs[size_t(a)] > bs[size_t(b)] || (bs[size_t(a)] == bs[size_t(b)] && a < b);
  });
  std::fill(keep, keep + width, uint8_t(0));
  for (int i = 0; i < k; ++i) {
    const int b = order[size_t(i)];
    if (!(bs[size_t(b)] > -INFINITY)) continue;
    for (int t = b * block_size; t < std::min(width, (b + 1) * block_size); ++t) keep[t] = 1;
  }
}

void topk_select(const float* score, int width, int k, int compress_len, int32_t* out) {
  if (k <= 0) return;
  std::vector<int32_t> order(static_cast<size_t>(width));
  std::iota(order.begin(), order.end(), 0);
  auto better = [&](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  };
  if (k < width) std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), better);
  std::sort(order.begin(), order.begin() + k);
  for (int i = 0; i < k; ++i) out[i] = order[size_t(i)] < compress_len ? order[size_t(i)] : -1;
}

}  // namespace uf::cpu
