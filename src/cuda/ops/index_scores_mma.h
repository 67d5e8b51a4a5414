#pragma once
// index_scores' head_dim-128 path on the tensor cores (ops/index_scores_mma.cu): bf16 mma.sync
// dot products, bitwise the CPU for the model's operands (FP4 QDQ q and keys: every dot product
// is exact in fp32, so its order does not matter; the .cu file's head says when it is not).
#include <cuda_runtime.h>

#include <cstdint>

namespace uf::cuda {

// index_scores (ops/attention.h) with head_dim 128 through the tensor-core kernel; false (nothing
// launched) where it does not apply: switched off (set_index_scores_mma), more than 64 heads, or
// more than 65535 chunks of 128 entries.
bool index_scores_mma(const float* q, const float* w, int T, int n_heads,
                      const uint16_t* const* keys, const int32_t* vis, const int32_t* width,
                      int max_width, float* score, cudaStream_t stream, bool round_sum);

// index_scores_list (ops/attention.h) with head_dim 128 through the tensor cores: a CTA per row and
// 128 list positions (the same exactness as above); false where it does not apply (switched off,
// more than 64 heads, more than 65535 chunks of 128 positions).
bool index_scores_mma_list(const float* q, const float* w, int T, int n_heads,
                           const uint16_t* const* keys, const int32_t* entries, const int32_t* n,
                           int cap, float* score, cudaStream_t stream, bool round_sum);

}  // namespace uf::cuda
