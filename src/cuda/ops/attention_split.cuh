#pragma once
// The split (chunked) path of sparse_attn (ops/attention.h), shared by its two producers of chunk
// records, attention.cu's scores + P.V kernels (the CPU's s_j and bf16(p_j) bits) and
// attention_chunk_mma.cu's one kernel on the tensor cores, and by the merge that reads them.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/ops/attention.h"

namespace uf::cuda::attn_split {

// Chunks are at least this many slots (the scratch is sized for it).
constexpr int kMinChunk = 16;

// The scratch: acc [T, H, nc, hd] (chunk c's unnormalised P.V of head h), stats [T, H, nc, 2]
// (m_c, psum_c: the base its p were taken against and their sum), then, for the scores kernel
// only, the scores [T, H, n_slots] and the max of each 16-slot chunk [T, H, n16].
__host__ __device__ inline size_t scratch_stats(int T, int H, int hd, int nc) {
  return size_t(T) * H * nc * hd;
}
__host__ __device__ inline size_t scratch_scores(int T, int H, int hd, int nc) {
  return size_t(T) * H * nc * (hd + 2);
}
__host__ __device__ inline size_t scratch_cmax(int T, int H, int hd, int nc, int n_slots) {
  return scratch_scores(T, H, hd, nc) + size_t(T) * H * n_slots;
}

// The chunk records of chunks of 16 slots (nc = ceil((n_window + k) / 16)) on the tensor cores,
// one kernel (attention_chunk_mma.cu), heads_per_cta (1, 2, 4 or 8) heads a CTA. Returns false,
// launching nothing, where it does not apply (hd % 16 != 0, hd > 512, q not 16-byte aligned, a
// rope with an odd offset); the caller then runs the scores + P.V kernels. The merge follows
// either.
bool launch_chunk_mma(const float* q, int T, int H, int hd, const float* const* window,
                      int n_window, const int32_t* topk, int k, const uint16_t* ckv,
                      const uint16_t* const* ckv_ref, float scale, const AttnRope& rope,
                      int heads_per_cta, float* scratch, cudaStream_t stream);
// The heads a chunk-mma CTA takes for T rows of H heads and nc chunks on `sms` SMs: the fewest of
// 2, 4, 8 whose grid fits the CTAs the SMs hold at once, else 8. Each CTA stages its chunk's
// 16 KV rows, so fewer heads a CTA repeat the staging on more SMs; the records of a head have the
// same bits whatever the split (its q column, slots and orders are its own).
int chunk_mma_heads(int T, int H, int nc, int sms);
constexpr int kChunkMmaSlots = 16;

}  // namespace uf::cuda::attn_split
