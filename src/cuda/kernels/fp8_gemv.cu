// FP8 block-scaled GEMV for decode rows, and the FP8 activation quantizer.
//
// Shapes and dtypes
//   W  [N, K]  F8_E4M3, row-major; W scale [ceil(N/32), K/32] F8_E8M0 (32x32 blocks)
//   A  [M, K]  E4M3 codes + fp32 power-of-two scales [M, K/32] (act_quant_fp8_* below)
//   out[M, N]  fp32 and/or bf16 (RNE of the fp32 result)
//   Limits: 1 <= M <= 8, N % 16 == 0, K % 32 == 0.
//
// Tiling
//   One warp = one 16-row tile of W x all 8 token columns (tokens >= M are zero), one mma.sync
//   m16n8k32 (e4m3, fp32 accumulate) per 32-wide K block: weights are the A operand ("swap AB").
//   A block = 8 warps = 8 consecutive tiles (128 rows) sharing one K range, so the activation
//   bytes they load are shared through L1. grid = (ceil(N/128), S): blockIdx.y is a K split.
//   Weights stream through each warp's own shared memory (TileStream<32, 3> in common.cuh):
//   stages of 16 rows x 8 K blocks (256 B a row), 3 deep, 16-byte cp.async pieces so that a warp
//   instruction copies 2 rows x 256 B; 110.6 KB of stages per block, 2 blocks (16 warps) per SM.
//   Fragments come from shared memory (8-byte reads, rows padded by 32 B: conflict free): per
//   thread and K block, 8 weight bytes of row g and of row g+8, and 8 activation bytes of token g
//   from global/L1. K mapping (A and B alike): block byte 8t+j -> fragment K position 4t+j (j < 4)
//   and 16+4t+(j-4) (j >= 4), t = lane % 4. The first stages are issued before the PDL wait.
//   S: the largest split count that keeps the grid within one wave of resident blocks, with whole
//   8-block chunks per split.
//
// Reduction order (what spec == plain relies on)
//   For each output (m, n): within a split, acc = 0; for kb in K order:
//   acc += (mma_partial(kb) * a_scale[m][kb]) * w_scale[n/32][kb] (both scales are powers of two,
//   so only the add rounds, as in the reference). Splits are then summed in split order
//   0, 1, ..., S-1 by the last block to finish (a counter; no float atomics). S and the split
//   boundaries depend on (N, K, SM count) only; a token's column never mixes with the others.
//   Differences from the CPU reference: the order of the 32 terms inside one K block (tensor
//   core) and, when S > 1, the grouping of the K-order sum into S consecutive chunks.
//
// Why tensor cores: at M = 8 each weight byte feeds 8 FMAs; at 4.3 TB/s that is ~70 TFLOP/s of
// fp32 FMA, the whole CUDA-core budget. One m16n8k32 per 512 weight bytes leaves the issue slots
// to the loads, and M = 1..8 cost the same.

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/gemv.h"
#include "cuda/kernels/common.cuh"

namespace uf::cuda {
namespace {

using namespace detail;

constexpr int kWarpsPerBlock = 8;
using Stream = TileStream<32, 3>;  // FP8: 256 B of each row per stage, 3 stages
constexpr int kSmemBytes = kWarpsPerBlock * Stream::kWarpBytes;

struct GemvParams {
  const uint8_t* w;
  const uint8_t* w_scale;
  const uint8_t* a;
  const float* a_scale;
  float* out;
  __nv_bfloat16* out_bf16;
  float* partials;
  int* counters;
  int m, n, k, kb_per_split, splits;
};

__device__ __forceinline__ void store_outputs(const GemvParams& p, int row0, int g, int t,
                                              const float (&v)[4]) {
  const int r0 = row0 + g, r1 = row0 + g + 8;
  const int t0 = 2 * t, t1 = 2 * t + 1;
  if (t0 < p.m) {
    if (p.out) {
      p.out[size_t(t0) * p.n + r0] = v[0];
      p.out[size_t(t0) * p.n + r1] = v[2];
    }
    if (p.out_bf16) {
      p.out_bf16[size_t(t0) * p.n + r0] = __float2bfloat16_rn(v[0]);
      p.out_bf16[size_t(t0) * p.n + r1] = __float2bfloat16_rn(v[2]);
    }
  }
  if (t1 < p.m) {
    if (p.out) {
      p.out[size_t(t1) * p.n + r0] = v[1];
      p.out[size_t(t1) * p.n + r1] = v[3];
    }
    if (p.out_bf16) {
      p.out_bf16[size_t(t1) * p.n + r0] = __float2bfloat16_rn(v[1]);
      p.out_bf16[size_t(t1) * p.n + r1] = __float2bfloat16_rn(v[3]);
    }
  }
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) fp8_gemv_kernel(const GemvParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x * kWarpsPerBlock + warp;
  const bool active = tile < p.n / 16;
  const int nkb = p.k / 32;
  const int kb0 = blockIdx.y * p.kb_per_split;
  const int kb1 = min(nkb, kb0 + p.kb_per_split);
  const int nchunks = active ? (kb1 - kb0 + Stream::kChunkKb - 1) / Stream::kChunkKb : 0;
  pdl_trigger();

  uint8_t* wsm = smem + warp * Stream::kWarpBytes;
  const uint8_t* wtile = p.w + size_t(active ? tile * 16 : 0) * p.k;
  auto issue = [&](int c) {
    if (c < nchunks) {
      const int kb = kb0 + c * Stream::kChunkKb;
      Stream::issue(wsm + (c % Stream::kStages) * Stream::kStageBytes, wtile, size_t(p.k), kb,
                    min(Stream::kChunkKb, kb1 - kb), lane);
    }
    cp_async_commit();  // empty groups keep the group count uniform
  };
  // Weights do not depend on the previous kernel: start streaming before the PDL wait.
#pragma unroll
  for (int c = 0; c < Stream::kStages - 1; ++c) issue(c);
  pdl_wait();

  const uint8_t* wsc = p.w_scale + size_t(active ? tile * 16 / 32 : 0) * nkb;
  const bool tok_ok = g < p.m;
  const uint8_t* arow = p.a + size_t(tok_ok ? g : 0) * p.k + t * 8;
  const int t0 = 2 * t, t1 = 2 * t + 1;
  const float* as0 = p.a_scale + size_t(t0 < p.m ? t0 : 0) * nkb;
  const float* as1 = p.a_scale + size_t(t1 < p.m ? t1 : 0) * nkb;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int c = 0; c < nchunks; ++c) {
    issue(c + Stream::kStages - 1);
    cp_async_wait<Stream::kStages - 1>();  // chunk c has landed (this lane's pieces)
    __syncwarp();                          // ... and every other lane's
    const uint8_t* src = wsm + (c % Stream::kStages) * Stream::kStageBytes + t * 8;
    const int kbc = kb0 + c * Stream::kChunkKb;
#pragma unroll
    for (int u = 0; u < Stream::kChunkKb; ++u) {
      const int k = kbc + u;
      if (k < kb1) {
        const uint2 wa = *reinterpret_cast<const uint2*>(src + g * Stream::kRowStride + u * 32);
        const uint2 wb =
            *reinterpret_cast<const uint2*>(src + (g + 8) * Stream::kRowStride + u * 32);
        uint2 b = make_uint2(0u, 0u);
        if (tok_ok) b = __ldg(reinterpret_cast<const uint2*>(arow + size_t(k) * 32));
        const float sw = e8m0_to_f32(__ldg(wsc + k));
        const float sa0 = t0 < p.m ? __ldg(as0 + k) : 0.f;
        const float sa1 = t1 < p.m ? __ldg(as1 + k) : 0.f;
        const uint32_t a[4] = {wa.x, wb.x, wa.y, wb.y};
        float d[4];
        mma_e4m3_16x8x32(d, a, b.x, b.y);
        acc[0] = fmaf(d[0] * sa0, sw, acc[0]);
        acc[1] = fmaf(d[1] * sa1, sw, acc[1]);
        acc[2] = fmaf(d[2] * sa0, sw, acc[2]);
        acc[3] = fmaf(d[3] * sa1, sw, acc[3]);
      }
    }
    __syncwarp();  // the buffer is refilled by the next iteration's issue
  }
  cp_async_wait<0>();

  if (p.splits == 1) {
    if (active) store_outputs(p, tile * 16, g, t, acc);
    return;
  }
  // Split-K: publish this split's fragment, the last block sums all splits in split order.
  const size_t frag = (size_t(blockIdx.x) * kWarpsPerBlock + warp) * 128 + lane * 4;
  const size_t split_stride = size_t(gridDim.x) * kWarpsPerBlock * 128;
  *reinterpret_cast<float4*>(p.partials + blockIdx.y * split_stride + frag) =
      make_float4(acc[0], acc[1], acc[2], acc[3]);
  __threadfence();
  __syncthreads();
  __shared__ int s_last;
  if (threadIdx.x == 0) s_last = atomicAdd(p.counters + blockIdx.x, 1) == p.splits - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  float sum[4];
  {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(p.partials + frag));
    sum[0] = v.x, sum[1] = v.y, sum[2] = v.z, sum[3] = v.w;
  }
  for (int s = 1; s < p.splits; ++s) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(p.partials + s * split_stride + frag));
    sum[0] += v.x, sum[1] += v.y, sum[2] += v.z, sum[3] += v.w;
  }
  if (active) store_outputs(p, tile * 16, g, t, sum);
  if (threadIdx.x == 0) p.counters[blockIdx.x] = 0;  // ready for the next launch
}

// One warp per (row, 32-block): lane i quantizes element 32kb+i.
template <typename T>
__global__ void __launch_bounds__(256)
    act_quant_kernel(const T* x, int m, int k, uint8_t* codes, float* scales) {
  pdl_trigger();
  pdl_wait();
  const int nkb = k / 32;
  const int item = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (item >= m * nkb) return;
  const int row = item / nkb, kb = item % nkb, lane = threadIdx.x & 31;
  const size_t idx = size_t(row) * k + kb * 32 + lane;
  float v;
  if constexpr (sizeof(T) == 2) {
    v = __uint_as_float(uint32_t(x[idx]) << 16);
  } else {
    v = x[idx];
  }
  float s;
  codes[idx] = warp_quant_fp8_block(v, &s);
  if (lane == 0) scales[size_t(row) * nkb + kb] = s;
}

template <typename T>
void act_quant(const T* x, int m, int k, uint8_t* codes, float* scales, cudaStream_t stream) {
  require(m >= 1 && m <= kMaxDecodeRows && k % 32 == 0,
          "act_quant_fp8: m = %d must be in 1..8 and k = %d a multiple of 32", m, k);
  const int items = m * (k / 32);
  launch_pdl(act_quant_kernel<T>, dim3((items + 7) / 8), dim3(256), 0, stream, x, m, k, codes,
             scales);
}

}  // namespace

void act_quant_fp8_bf16(const uint16_t* x, int m, int k, uint8_t* codes, float* scales,
                        cudaStream_t stream) {
  act_quant(x, m, k, codes, scales, stream);
}
void act_quant_fp8_f32(const float* x, int m, int k, uint8_t* codes, float* scales,
                       cudaStream_t stream) {
  act_quant(x, m, k, codes, scales, stream);
}

int device_sm_count() {
  int dev = 0, sms = 0;
  UF_CUDA_CHECK(cudaGetDevice(&dev));
  UF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

Fp8Gemv::Fp8Gemv(int n, int k, int sm_count) : n_(n), k_(k) {
  require(n > 0 && k > 0 && n % 16 == 0 && k % 32 == 0,
          "Fp8Gemv: shape [%d, %d] needs n %% 16 == 0 and k %% 32 == 0", n, k);
  const int nkb = k / 32;
  n_blocks_ = (n / 16 + kWarpsPerBlock - 1) / kWarpsPerBlock;
  UF_CUDA_CHECK(cudaFuncSetAttribute(fp8_gemv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     kSmemBytes));
  prefer_shared_carveout(fp8_gemv_kernel);
  prefer_shared_carveout(act_quant_kernel<uint16_t>);
  prefer_shared_carveout(act_quant_kernel<float>);
  int per_sm = 0;
  UF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fp8_gemv_kernel,
                                                              kWarpsPerBlock * 32, kSmemBytes));
  // Split K so that the grid fills the resident block slots once without spilling into a second
  // wave, with whole 8-block chunks per split. Depends on (n, k, device) only, never on m.
  const int capacity = std::max(1, per_sm) * std::max(sm_count, 1);
  const int s_max = std::max(1, capacity / n_blocks_);
  int kbps = (nkb + s_max - 1) / s_max;
  kbps = std::min(nkb, (kbps + 7) / 8 * 8);
  kb_per_split_ = kbps;
  splits_ = (nkb + kbps - 1) / kbps;
  if (splits_ > 1) {
    UF_CUDA_CHECK(
        cudaMalloc(&partials_, sizeof(float) * size_t(splits_) * n_blocks_ * kWarpsPerBlock * 128));
    UF_CUDA_CHECK(cudaMalloc(&counters_, sizeof(int) * n_blocks_));
    UF_CUDA_CHECK(cudaMemset(counters_, 0, sizeof(int) * n_blocks_));
  }
}

Fp8Gemv::~Fp8Gemv() {
  cudaFree(partials_);
  cudaFree(counters_);
}

void Fp8Gemv::run(const Fp8WeightView& w, const QuantActView& a, float* out_f32, uint16_t* out_bf16,
                  cudaStream_t stream) const {
  require(w.n == n_ && w.k == k_ && a.k == k_ && a.m >= 1 && a.m <= kMaxDecodeRows,
          "Fp8Gemv::run: weight [%d, %d] / activation [%d, %d] do not match the plan [%d, %d]", w.n,
          w.k, a.m, a.k, n_, k_);
  GemvParams p{
      w.data,    w.scale,   a.codes, a.scales, out_f32, reinterpret_cast<__nv_bfloat16*>(out_bf16),
      partials_, counters_, a.m,     n_,       k_,      kb_per_split_,
      splits_};
  launch_pdl(fp8_gemv_kernel, dim3(n_blocks_, splits_), dim3(kWarpsPerBlock * 32), kSmemBytes,
             stream, p);
}

}  // namespace uf::cuda
