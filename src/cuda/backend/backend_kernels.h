#pragma once
// Small device helpers of the CUDA backend's orchestration that no op header covers.

#include <cuda_runtime.h>

#include <cstdint>

namespace uf::cuda {

// x[i] = bf16(x[i] * scale) (one fp32 multiply, then round to nearest even): the indexer's
// weights_proj scaling (cpu::CpuModel::indexer).
void scale_round_bf16(float* x, int64_t n, float scale, cudaStream_t stream);

// Tensor parallelism: index_scores (ops/attention.h) over this rank's index heads WITHOUT the
// final bf16 rounding of the head sum: score[t, i] = sum over the rank's heads h (in order) of
// bf16(max(bf16(q_h . k_i), 0) * w_h) in fp32 (the same per-head terms and order as the op), for
// i < min(vis[t], width[t]); -inf for vis[t] <= i < width[t]; untouched beyond. The caller sums
// the ranks' partials (fp32 all-reduce) and rounds once (round_bf16), so TP differs from the
// one-GPU scores only in the fp32 order of the head sum. One thread per entry (simple, not fast).
// out[i] = bf16(((g[0][i] + g[1][i]) + g[2][i]) + ...) for the n_ranks slices g[r] = gathered +
// r * n (fp32 sums in rank order, then one rounding): the tensor-parallel sum whose order depends
// neither on n nor on NCCL's algorithm, so a row's value never depends on the other rows.
void sum_ranks_round_bf16(const float* gathered, int n_ranks, int64_t n, float* out,
                          cudaStream_t stream);

void index_scores_partial(const float* q, const float* w, int T, int n_heads, int head_dim,
                          const float* const* keys, const int32_t* vis, const int32_t* width,
                          int max_width, float* score, cudaStream_t stream);

}  // namespace uf::cuda
