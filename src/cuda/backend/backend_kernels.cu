// Small device helpers of the backend's orchestration (backend_kernels.h). One thread per value.
#include <cuda_bf16.h>

#include "cuda/backend/backend_kernels.h"
#include "cuda/cuda_check.h"

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

__global__ void index_scores_partial_kernel(const float* q, const float* w, int n_heads, int hd,
                                            const float* const* keys, const int32_t* vis,
                                            const int32_t* width, int max_width, float* score) {
  const int t = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int wd = width[t];
  if (i >= wd) return;
  const int nv = min(vis[t], wd);
  float* out = score + int64_t(t) * max_width;
  if (i >= nv) {
    out[i] = -INFINITY;
    return;
  }
  const float* kr = keys[t] + int64_t(i) * hd;
  const float* qt = q + int64_t(t) * n_heads * hd;
  const float* wt = w + int64_t(t) * n_heads;
  float s = 0.f;
  for (int h = 0; h < n_heads; ++h) {
    const float* qh = qt + int64_t(h) * hd;
    float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int i0 = 0; i0 < hd; i0 += 8)
      for (int L = 0; L < 8; ++L)
        if (i0 + L < hd) p[L] = __fadd_rn(p[L], __fmul_rn(qh[i0 + L], kr[i0 + L]));
    const float dot = __fadd_rn(__fadd_rn(__fadd_rn(p[0], p[1]), __fadd_rn(p[2], p[3])),
                                __fadd_rn(__fadd_rn(p[4], p[5]), __fadd_rn(p[6], p[7])));
    const float d = bf16_round(dot);
    const float r = d < 0.f ? 0.f : d;
    s = __fadd_rn(s, bf16_round(__fmul_rn(r, wt[h])));
  }
  out[i] = s;
}

__global__ void sum_ranks_kernel(const float* g, int n_ranks, int64_t n, float* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float s = g[i];
  for (int r = 1; r < n_ranks; ++r) s = __fadd_rn(s, g[int64_t(r) * n + i]);
  out[i] = bf16_round(s);
}

}  // namespace

void sum_ranks_round_bf16(const float* gathered, int n_ranks, int64_t n, float* out,
                          cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  sum_ranks_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(gathered, n_ranks, n, out);
  UF_CUDA_CHECK(cudaGetLastError());
}

void index_scores_partial(const float* q, const float* w, int T, int n_heads, int head_dim,
                          const float* const* keys, const int32_t* vis, const int32_t* width,
                          int max_width, float* score, cudaStream_t stream) {
  require(T >= 0 && T <= 65535 && n_heads > 0 && head_dim > 0 && max_width >= 0,
          "index_scores_partial: unsupported shape T=%d n_heads=%d head_dim=%d max_width=%d", T,
          n_heads, head_dim, max_width);
  if (T == 0 || max_width == 0) return;
  constexpr int kThreads = 128;
  const dim3 grid(unsigned((max_width + kThreads - 1) / kThreads), unsigned(T));
  index_scores_partial_kernel<<<grid, kThreads, 0, stream>>>(q, w, n_heads, head_dim, keys, vis,
                                                             width, max_width, score);
  UF_CUDA_CHECK(cudaGetLastError());
}

void scale_round_bf16(float* x, int64_t n, float scale, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  scale_round_bf16_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(x, n, scale);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
