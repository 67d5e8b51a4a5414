#pragma once
// The slot list of a sparse_attn row (ops/attention.h), read on the device by the attention
// kernels (attention.cu's reference path, attention_mma.cu).
#include <cstdint>

namespace uf::cuda {

// Slot j of row t: window slot j < n_window (nullptr = empty), else top-k entry j - n_window of
// ckv [entries, hd] (-1 = empty, nullptr).
__device__ __forceinline__ const float* attn_slot(int t, int j, const float* const* window,
                                                  int n_window, const int32_t* topk, int k,
                                                  const float* ckv, int hd) {
  if (j < n_window) return window[int64_t(t) * n_window + j];
  const int32_t e = topk[int64_t(t) * k + (j - n_window)];
  return e >= 0 ? ckv + int64_t(e) * hd : nullptr;
}

}  // namespace uf::cuda
