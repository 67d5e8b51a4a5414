#pragma once
// The slot list of a sparse_attn row (ops/attention.h), read on the device by the attention
// kernels (attention.cu's reference path, attention_mma.cu).
#include <cstdint>

namespace uf::cuda {

// A slot's KV row: window slots hold fp32 rows (the window ring, the span's own rows), top-k slots
// bf16 rows (the session's compressed KV). Empty: p == nullptr.
struct KvRow {  // an aggregate without initializers: it lives in __shared__ arrays
  const void* p;
  bool bf16;
  __device__ __forceinline__ explicit operator bool() const { return p != nullptr; }
  __device__ __forceinline__ float at(int i) const {
    return bf16 ? __uint_as_float(uint32_t(static_cast<const uint16_t*>(p)[i]) << 16)
                : static_cast<const float*>(p)[i];
  }
};

// Slot j of row t: window slot j < n_window (nullptr = empty), else top-k entry j - n_window of
// ckv [entries, hd] (-1 = empty).
__device__ __forceinline__ KvRow attn_slot(int t, int j, const float* const* window, int n_window,
                                           const int32_t* topk, int k, const uint16_t* ckv,
                                           int hd) {
  if (j < n_window) return {window[int64_t(t) * n_window + j], false};
  const int32_t e = topk[int64_t(t) * k + (j - n_window)];
  return {e >= 0 ? ckv + int64_t(e) * hd : nullptr, true};
}

}  // namespace uf::cuda
