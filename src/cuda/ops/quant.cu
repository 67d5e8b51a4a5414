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
constexpr float kFp8MaxInv = 1.0f / 448.0f;  // core::kFp8MaxInv
constexpr float kFp4MaxInv = 1.0f / 6.0f;    // core::kFp4MaxInv
constexpr float kFp8ActAmaxFloor = 1e-4f;    // core::kFp8ActAmaxFloor

enum class Qdq { kFp8, kFp4E4m3, kFp4E8m0 };

template <Qdq kKind>
__global__ void qdq_kernel(float* x, int64_t n_blocks, int block) {
  // A quantisation block on L = min(block, 32) lanes (a group of the warp), each lane holding the
  // elements lane, lane + L, ... of it; amax by a group max (exact in any order), then every
  // element the CPU's formula.
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
  if constexpr (kKind == Qdq::kFp8) {
    const float s = ew::pow2_scale(ew::smax(amax, kFp8ActAmaxFloor), kFp8MaxInv);
    for (int i = 0; i < block; i += L)
      p[i] = ew::round_bf16(ew::fmul(ew::round_e4m3(ew::fdiv(p[i], s)), s));
  } else {
    float s;
    if constexpr (kKind == Qdq::kFp4E4m3)
      s = ew::round_e4m3(ew::fdiv(ew::smax(amax, 6.0f * 0x1p-9f), 6.0f));
    else
      s = ew::pow2_scale(ew::smax(amax, 6.0f * 0x1p-126f), kFp4MaxInv);
    for (int i = 0; i < block; i += L) {
      const float q = ew::sclamp(ew::fdiv(p[i], s), -6.0f, 6.0f);
      p[i] = ew::round_bf16(ew::fmul(ew::round_e2m1(q), s));
    }
  }
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
