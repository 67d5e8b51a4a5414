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

// Kernels of the CUDA-graph span program (cuda_ring_span.cpp): they read what depends on the
// position and the session (positions, ring and compressed-KV base pointers, counts) from device
// memory when they run, so one captured graph serves every step of every session.

// The ring layout's window slot list (CudaModel::attention, the CPU's ring layout): row t, slot
// j < W: qpos = pos[t] - W + 1 + j; nullptr if qpos < 0, local + (qpos - *p0) * hd if qpos >= *p0
// (a row of this span), else the ring row *ring + (qpos % ring_slots) * hd. out: [T, W].
void build_window_slots(const int64_t* pos, const int64_t* p0, int T, int W,
                        const float* const* ring, int ring_slots, const float* local, int hd,
                        const float** out, cudaStream_t stream);
// A DSpark stage's slot list (CudaModel::draft), the same for each of the B block rows: with
// p = *p_ref and nring = min(W, p + 1), slot j < nring is the ring row of position
// p - ((p - j) % W), slots nring .. nring + B - 1 are the block's own rows local[0 .. B), the rest
// are empty (trailing empty slots change no attention result). out: [B, W + B].
void build_draft_slots(const int64_t* p_ref, int W, int B, const float* const* ring, int ring_slots,
                       const float* local, int hd, const float** out, cudaStream_t stream);
// DeviceRing::put for span rows: row t (of T, t >= T - ring_slots) of src [T, width] into
// *ring + (pos[t] % ring_slots) * width.
void put_ring_rows(const float* src, int T, int width, const int64_t* pos, float* const* ring,
                   int ring_slots, cudaStream_t stream);
// The first *n rows (n <= max_rows) of src [max_rows, width] to *dst (contiguous rows).
void copy_rows_to(const float* src, int max_rows, int width, const int32_t* n, float* const* dst,
                  cudaStream_t stream);

void index_scores_partial(const float* q, const float* w, int T, int n_heads, int head_dim,
                          const uint16_t* const* keys, const int32_t* vis, const int32_t* width,
                          int max_width, float* score, cudaStream_t stream);

}  // namespace uf::cuda
