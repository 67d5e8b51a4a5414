// Small device helpers of the backend's orchestration (backend_kernels.h). One thread per value.
#include <cuda_bf16.h>

#include <algorithm>

#include "cuda/backend/backend_kernels.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/ops/attention.h"

namespace uf::cuda {

namespace {

__global__ void scale_round_bf16_kernel(float* x, int64_t n, float scale) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = __fmul_rn(x[i], scale);  // no contraction: exactly the CPU's product
  x[i] = __bfloat162float(__float2bfloat16_rn(v));
}

__device__ __forceinline__ float bf16_round(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

__global__ void sum_ranks_kernel(const float* g, int n_ranks, int64_t n, float* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float s = g[i];
  for (int r = 1; r < n_ranks; ++r) s = __fadd_rn(s, g[int64_t(r) * n + i]);
  out[i] = bf16_round(s);
}

__global__ void window_slots_kernel(const int64_t* pos, const int64_t* p0_ref, int W,
                                    const float* const* ring_ref, int ring_slots,
                                    const float* local, int hd, const float** out) {
  detail::pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  detail::pdl_trigger();
  const int t = blockIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= W) return;
  const int64_t p0 = *p0_ref;
  const int64_t qpos = pos[t] - W + 1 + j;
  const float* v = nullptr;
  if (qpos >= p0)
    v = local + (qpos - p0) * hd;
  else if (qpos >= 0)
    v = *ring_ref + (qpos % ring_slots) * hd;
  out[int64_t(t) * W + j] = v;
}

__global__ void draft_slots_kernel(const int64_t* p_ref, int W, int B, const float* const* ring_ref,
                                   int ring_slots, const float* local, int hd, const float** out) {
  detail::pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  detail::pdl_trigger();
  const int row = blockIdx.y, n = W + B;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int64_t p = *p_ref;
  const int nring = int(p + 1 < W ? p + 1 : W);
  const float* v = nullptr;
  if (j < nring) {
    const int64_t qpos = p - ((p - j) % W);
    v = *ring_ref + (qpos % ring_slots) * hd;
  } else if (j < nring + B) {
    v = local + int64_t(j - nring) * hd;
  }
  out[int64_t(row) * n + j] = v;
}

__global__ void put_ring_rows_kernel(const float* src, int T, int width, const int64_t* pos,
                                     float* const* ring_ref, int ring_slots) {
  detail::pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  detail::pdl_trigger();
  const int t = blockIdx.y;
  if (t < T - ring_slots) return;  // a later row of the span takes the same slot
  float* dst = *ring_ref + (pos[t] % ring_slots) * width;
  const float* row = src + int64_t(t) * width;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x)
    dst[i] = row[i];
}

__global__ void copy_rows_to_kernel(const float* src, int width, const int32_t* n,
                                    float* const* dst_ref) {
  const int r = blockIdx.y;
  if (r >= *n) return;
  float* dst = *dst_ref + int64_t(r) * width;
  const float* row = src + int64_t(r) * width;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x)
    dst[i] = row[i];
}

}  // namespace

void build_window_slots(const int64_t* pos, const int64_t* p0, int T, int W,
                        const float* const* ring, int ring_slots, const float* local, int hd,
                        const float** out, cudaStream_t stream) {
  if (T <= 0 || W <= 0) return;
  constexpr int kThreads = 128;
  const dim3 grid(unsigned((W + kThreads - 1) / kThreads), unsigned(T));
  detail::launch_pdl(window_slots_kernel, grid, dim3(kThreads), 0, stream, pos, p0, W, ring,
                     ring_slots, local, hd, out);
  UF_CUDA_CHECK(cudaGetLastError());
}

void build_draft_slots(const int64_t* p_ref, int W, int B, const float* const* ring, int ring_slots,
                       const float* local, int hd, const float** out, cudaStream_t stream) {
  if (B <= 0) return;
  constexpr int kThreads = 128;
  const dim3 grid(unsigned((W + B + kThreads - 1) / kThreads), unsigned(B));
  detail::launch_pdl(draft_slots_kernel, grid, dim3(kThreads), 0, stream, p_ref, W, B, ring,
                     ring_slots, local, hd, out);
  UF_CUDA_CHECK(cudaGetLastError());
}

void put_ring_rows(const float* src, int T, int width, const int64_t* pos, float* const* ring,
                   int ring_slots, cudaStream_t stream) {
  if (T <= 0 || width <= 0) return;
  constexpr int kThreads = 256;
  const dim3 grid(unsigned(std::min(8, (width + kThreads - 1) / kThreads)), unsigned(T));
  detail::launch_pdl(put_ring_rows_kernel, grid, dim3(kThreads), 0, stream, src, T, width, pos,
                     ring, ring_slots);
  UF_CUDA_CHECK(cudaGetLastError());
}

void copy_rows_to(const float* src, int max_rows, int width, const int32_t* n, float* const* dst,
                  cudaStream_t stream) {
  if (max_rows <= 0 || width <= 0) return;
  constexpr int kThreads = 256;
  const dim3 grid(unsigned(std::min(8, (width + kThreads - 1) / kThreads)), unsigned(max_rows));
  copy_rows_to_kernel<<<grid, kThreads, 0, stream>>>(src, width, n, dst);
  UF_CUDA_CHECK(cudaGetLastError());
}

void sum_ranks_round_bf16(const float* gathered, int n_ranks, int64_t n, float* out,
                          cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  sum_ranks_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(gathered, n_ranks, n, out);
  UF_CUDA_CHECK(cudaGetLastError());
}

void index_scores_partial(const float* q, const float* w, int T, int n_heads, int head_dim,
                          const uint16_t* const* keys, const int32_t* vis, const int32_t* width,
                          int max_width, float* score, cudaStream_t stream) {
  // The op's kernels (ops/indexer.cu) without the final rounding of the head sum.
  index_scores(q, w, T, n_heads, head_dim, keys, vis, width, max_width, score, stream,
               /*round_sum=*/false);
}

void scale_round_bf16(float* x, int64_t n, float scale, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  scale_round_bf16_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(x, n, scale);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
