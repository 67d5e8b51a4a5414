// qdq_fp8, qdq_fp4_e4m3_scale, qdq_fp4_e8m0_scale and round_bf16 of ops/elementwise.h: the
// core/quant.h fake quantisers, bit for bit. A quantisation block on min(block, 32) lanes (amax is
// a max, exact in any order; every other step is elementwise), so the result is exactly the CPU's
// and independent of the row count.

#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/ops/elementwise.h"
#include "cuda/ops/elementwise_common.cuh"

namespace uf::cuda {

namespace {

constexpr int kThreads = 256;

using Qdq = ew::QdqFormat;

template <Qdq kKind>
__global__ void qdq_kernel(float* x, int64_t n_blocks, int block) {
  // A quantisation block on L = min(block, 32) lanes (a group of the warp), each lane holding the
  // elements lane, lane + L, ... of it; amax by a group max (exact in any order), then every
  // element the CPU's formula (ew::qdq_scale, ew::qdq_value).
  const int lane = threadIdx.x & 31, L = block < 32 ? block : 32, per_warp = 32 / L;
  const int64_t b = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32 * per_warp + lane / L;
  const bool ok = b < n_blocks;
  float* p = x + (ok ? b : 0) * block + lane % L;
  float amax = 0.f;
  if (ok)
    for (int i = 0; i < block; i += L) amax = ew::smax(amax, fabsf(p[i]));
  for (int o = L / 2; o > 0; o >>= 1)
    amax = ew::smax(amax, __shfl_xor_sync(0xffffffffu, amax, o, L));
  if (!ok) return;
  const float s = ew::qdq_scale<kKind>(amax);
  for (int i = 0; i < block; i += L) p[i] = ew::qdq_value<kKind>(p[i], s);
}

template <Qdq kKind>
void launch_qdq(const char* name, float* x, int64_t rows, int n, int block, cudaStream_t stream) {
  require(block > 0 && n % block == 0, "%s: row length %d is not a multiple of the block %d", name,
          n, block);
  const int64_t n_blocks = rows * (n / block);
  if (n_blocks <= 0) return;
  require((block < 32 && 32 % block == 0) || block % 32 == 0,
          "%s: block %d must divide 32 or be a multiple of it", name, block);
  const int64_t per_block = int64_t(kThreads / 32) * (32 / std::min(block, 32));  // per CTA
  const int64_t grid = (n_blocks + per_block - 1) / per_block;
  qdq_kernel<kKind><<<unsigned(grid), kThreads, 0, stream>>>(x, n_blocks, block);
  UF_CUDA_CHECK(cudaGetLastError());
}

__global__ void round_bf16_kernel(float* x, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads)
    x[i] = ew::round_bf16(x[i]);
}

}  // namespace

void qdq_fp8(float* x, int64_t rows, int n, int block, cudaStream_t stream) {
  launch_qdq<Qdq::kFp8>("qdq_fp8", x, rows, n, block, stream);
}
void qdq_fp4_e4m3_scale(float* x, int64_t rows, int n, int block, cudaStream_t stream) {
  launch_qdq<Qdq::kFp4E4m3>("qdq_fp4_e4m3_scale", x, rows, n, block, stream);
}
void qdq_fp4_e8m0_scale(float* x, int64_t rows, int n, int block, cudaStream_t stream) {
  launch_qdq<Qdq::kFp4E8m0>("qdq_fp4_e8m0_scale", x, rows, n, block, stream);
}

void round_bf16(float* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t grid = std::min<int64_t>((n + kThreads - 1) / kThreads, 65536);
  round_bf16_kernel<<<unsigned(grid), kThreads, 0, stream>>>(x, n);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
