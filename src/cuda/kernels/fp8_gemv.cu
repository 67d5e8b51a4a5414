// FP8 block-scaled GEMV for decode rows, and the FP8 activation quantizer.
//
// Shapes and dtypes
//   W  [N, K]  F8_E4M3, row-major; W scale [ceil(N/32), K/32] F8_E8M0 (32x32 blocks)
//   A  [M, K]  E4M3 codes + fp32 power-of-two scales [M, K/32]: either pre-quantised by
//              act_quant_fp8_* (run), or quantised inside the GEMV from fp32 x (run_fused, below)
//   out[M, N]  fp32 (optionally bf16-rounded) and/or bf16 (RNE of the fp32 result)
//   Limits: 1 <= M <= 8, N % 16 == 0, K % 32 == 0.
//
// Tiling
//   One warp = one 16-row tile of W x all 8 token columns (tokens >= M are zero), one mma.sync
//   m16n8k32 (e4m3, fp32 accumulate) per 32-wide K block: weights are the A operand ("swap AB").
//   A block = 8 warps = 8 consecutive tiles (128 rows) sharing one K range. Blocks are numbered
//   linearly: block b of a weight ("job") is n-block b % n_blocks of split b / n_blocks; a grouped
//   launch (run_fused_group) concatenates the block ranges of several jobs sharing one x.
//   Weights stream through each warp's own shared memory (TileStream<32, kStages> in common.cuh):
//   stages of 16 rows x 8 K blocks (256 B a row), 16-byte cp.async pieces so that a warp
//   instruction copies 2 rows x 256 B. kStages = min(3, chunks per split): a split of one chunk
//   (every small weight) needs 36 KB of stages, so 4 fused blocks fit an SM (64 registers) and the
//   next kernel's blocks (PDL) find room to start their weight loads while this one runs, and a
//   grouped launch of small weights fits one wave; 3 stages = 108 KB, 2 blocks an SM.
//   Pipeline: the first kStages chunks are issued before the PDL wait; chunk c + kStages is issued
//   after chunk c is consumed. Fragments come from shared memory (8-byte reads, rows padded by
//   32 B: conflict free): per thread and K block, 8 weight bytes of row g and of row g+8, and 8
//   activation bytes of token g. K mapping (A and B alike): block byte 8t+j -> fragment K position
//   4t+j (j < 4) and 16+4t+(j-4) (j >= 4), t = lane % 4.
//   S: the largest split count that keeps the grid within one wave of resident 3-stage blocks,
//   with whole 8-block chunks per split.
//
// Fused activation quantisation (run_fused, run_fused_group)
//   Each block quantises the x range it consumes, chunk by chunk (8 K blocks x 8 tokens), into a
//   shared buffer laid out as the codes a warp reads: token row = 256 code bytes + 8 fp32 scales
//   (288 B, the same conflict-free stride). Warp w quantises token w; lane l the 8 elements
//   [32 (l / 4) + 8 (l % 4), +8) of the chunk: two 16-byte loads, amax over the 4 lanes of the
//   block (fmaxf, exact in any order and NaN-ignoring like act_quant's butterfly), then
//   pow2_scale and e4m3(x / s) exactly as warp_quant_fp8_block: the codes and scales are bitwise
//   those of act_quant_fp8_f32, so run_fused == act_quant + run bitwise. Tokens >= M get zero
//   codes and scales (as run's zero fragments). Two buffers: chunk c + 1 is quantised (its x
//   loaded one chunk ahead) while chunk c's weights are consumed, one __syncthreads per chunk.
//
// Reduction order (what spec == plain relies on)
//   For each output (m, n): within a split, acc = 0; for kb in K order:
//   acc += (mma_partial(kb) * a_scale[m][kb]) * w_scale[n/32][kb] (both scales are powers of two,
//   so only the add rounds, as in the reference). Splits are then summed in split order
//   0, 1, ..., S-1 by the last block to finish (a counter; no float atomics), which also applies
//   the bf16 rounding: one launch per apply. S and the split boundaries depend on (N, K, SM count)
//   only; a token's column never mixes with the others. Only the lanes holding tokens < M publish
//   and read partials (a lane holds tokens 2t, 2t+1), so decode rows move 1/4 of the bytes; the
//   last block issues up to 8 splits' loads at once and then adds them in split order.
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
constexpr int kMaxStages = 3;
template <int kStages>
using StreamT = TileStream<32, kStages>;  // FP8: 256 B of each row per stage
using Stream3 = StreamT<kMaxStages>;
constexpr int kChunkKb = Stream3::kChunkKb;
// Fused activation chunk: 8 tokens x (256 code bytes + 8 fp32 scales).
constexpr int kActRowBytes = kChunkKb * 32 + kChunkKb * 4;
constexpr int kActBufBytes = kMaxDecodeRows * kActRowBytes;
static_assert(kActRowBytes == Stream3::kRowStride, "act rows share the weights' padded stride");

template <int kStages>
constexpr int weight_smem_bytes() {
  return kWarpsPerBlock * StreamT<kStages>::kWarpBytes;
}

// One weight of a launch.
struct GemvJob {
  const uint8_t* w;
  const uint8_t* w_scale;
  float* out;
  __nv_bfloat16* out_bf16;
  float* partials;
  int* counters;
  int n, kb_per_split, splits, n_blocks;
  int block_begin;  // first linear block index of this job
  int out_stride;   // row stride of out / out_bf16 (elements)
  int round_out;    // out gets bf16-rounded values
};

struct GemvParams {
  GemvJob jobs[kMaxGemvGroup];
  int njobs;
  // Pre-quantised activations (run) or fp32 x (fused).
  const uint8_t* a;
  const float* a_scale;
  const float* x;
  long long x_stride;
  int m, k;
};

__device__ __forceinline__ void store_outputs(const GemvJob& j, int m, int row0, int g, int t,
                                              const float (&v)[4]) {
  const int r0 = row0 + g, r1 = row0 + g + 8;
  const int t0 = 2 * t, t1 = 2 * t + 1;
  auto put = [&](int tok, float a, float b) {
    const size_t o = size_t(tok) * j.out_stride;
    if (j.out) {
      j.out[o + r0] = j.round_out ? round_bf16(a) : a;
      j.out[o + r1] = j.round_out ? round_bf16(b) : b;
    }
    if (j.out_bf16) {
      j.out_bf16[o + r0] = __float2bfloat16_rn(a);
      j.out_bf16[o + r1] = __float2bfloat16_rn(b);
    }
  };
  if (t0 < m) put(t0, v[0], v[2]);
  if (t1 < m) put(t1, v[1], v[3]);
}

// Fused quantisation, one thread's share of a chunk: token = warp, K block kbl = lane / 4 of the
// chunk, elements 8 (lane % 4) .. + 7 of it.
struct ActLoad {
  float4 lo, hi;
};

__device__ __forceinline__ void act_load(const GemvParams& p, int kbc, int kb1, int warp, int lane,
                                         ActLoad& r) {
  const int kb = kbc + (lane >> 2);
  if (warp < p.m && kb < kb1) {
    const float4* src = reinterpret_cast<const float4*>(p.x + size_t(warp) * p.x_stride +
                                                        size_t(kb) * 32 + (lane & 3) * 8);
    r.lo = __ldg(src);
    r.hi = __ldg(src + 1);
  } else {
    r.lo = r.hi = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

__device__ __forceinline__ void act_store(const GemvParams& p, const ActLoad& r, int warp, int lane,
                                          uint8_t* buf) {
  const float v[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
  float a = fabsf(v[0]);
#pragma unroll
  for (int i = 1; i < 8; ++i) a = fmaxf(a, fabsf(v[i]));
  a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
  a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
  const bool tok = warp < p.m;
  // Exactly warp_quant_fp8_block's scale and codes (amax: the same max over the same 32 values).
  const float s = tok ? pow2_scale(fmaxf(a, kActAmaxFloor), kFp8MaxInv) : 0.f;
  uint32_t c[2] = {0u, 0u};
  if (tok) {
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i >> 2] |= uint32_t(f32_to_e4m3(v[i] / s)) << (8 * (i & 3));
  }
  uint8_t* row = buf + warp * kActRowBytes;
  const int kbl = lane >> 2;
  *reinterpret_cast<uint2*>(row + kbl * 32 + (lane & 3) * 8) = make_uint2(c[0], c[1]);
  if ((lane & 3) == 0) reinterpret_cast<float*>(row + kChunkKb * 32)[kbl] = s;
}

template <int kStages, bool kFused>
// One-stage blocks (36 KB of stages) are register-bound: 4 a SM need <= 64 registers a thread
// (the fused variant spills 8 bytes there; the pre-quantised one would spill more: 3 a SM).
__global__ void __launch_bounds__(kWarpsPerBlock * 32, kStages == 1 ? (kFused ? 4 : 3) : 2)
    fp8_gemv_kernel(const GemvParams p) {
  using Stream = StreamT<kStages>;
  extern __shared__ __align__(16) uint8_t smem[];
  pdl_trigger();
  // The job of this block: constant indices only (a dynamically indexed kernel parameter may be
  // copied to local memory), selects in registers, once per block.
  GemvJob job = p.jobs[0];
#pragma unroll
  for (int i = 1; i < kMaxGemvGroup; ++i)
    if (i < p.njobs && int(blockIdx.x) >= p.jobs[i].block_begin) job = p.jobs[i];
  const int local = int(blockIdx.x) - job.block_begin;
  const int bx = local % job.n_blocks, by = local / job.n_blocks;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int tile = bx * kWarpsPerBlock + warp;
  const bool active = tile < job.n / 16;
  const int nkb = p.k / 32;
  const int kb0 = by * job.kb_per_split;
  const int kb1 = min(nkb, kb0 + job.kb_per_split);
  const int nck = (kb1 - kb0 + kChunkKb - 1) / kChunkKb;  // block-uniform
  const int nchunks = active ? nck : 0;

  uint8_t* wsm = smem + warp * Stream::kWarpBytes;
  uint8_t* abuf = smem + weight_smem_bytes<kStages>();  // fused: 1 or 2 act buffers
  const uint8_t* wtile = job.w + size_t(active ? tile * 16 : 0) * p.k;
  auto issue = [&](int c) {
    if (c < nchunks) {
      const int kb = kb0 + c * kChunkKb;
      Stream::issue(wsm + (c % kStages) * Stream::kStageBytes, wtile, size_t(p.k), kb,
                    min(kChunkKb, kb1 - kb), lane);
    }
    cp_async_commit();  // empty groups keep the group count uniform
  };
  // Weights do not depend on the previous kernel: start streaming before the PDL wait.
#pragma unroll
  for (int c = 0; c < kStages; ++c) issue(c);
  pdl_wait();

  ActLoad xr;
  if constexpr (kFused) {
    act_load(p, kb0, kb1, warp, lane, xr);
    act_store(p, xr, warp, lane, abuf);
    if (nck > 1) act_load(p, kb0 + kChunkKb, kb1, warp, lane, xr);
    __syncthreads();
  }

  const uint8_t* wsc = job.w_scale + size_t(active ? tile * 16 / 32 : 0) * nkb;
  const bool tok_ok = g < p.m;
  const int t0 = 2 * t, t1 = 2 * t + 1;
  const uint8_t* arow = nullptr;
  const float *as0 = nullptr, *as1 = nullptr;
  if constexpr (!kFused) {
    arow = p.a + size_t(tok_ok ? g : 0) * p.k + t * 8;
    as0 = p.a_scale + size_t(t0 < p.m ? t0 : 0) * nkb;
    as1 = p.a_scale + size_t(t1 < p.m ? t1 : 0) * nkb;
  }
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int c = 0; c < nck; ++c) {
    if (c < nchunks) {
      cp_async_wait<kStages - 1>();  // chunk c has landed (this lane's pieces)
      __syncwarp();                  // ... and every other lane's
      const uint8_t* src = wsm + (c % kStages) * Stream::kStageBytes + t * 8;
      const uint8_t* act = abuf + (c & 1) * kActBufBytes;
      const int kbc = kb0 + c * kChunkKb;
#pragma unroll
      for (int u = 0; u < kChunkKb; ++u) {
        const int k = kbc + u;
        if (k < kb1) {
          const uint2 wa = *reinterpret_cast<const uint2*>(src + g * Stream::kRowStride + u * 32);
          const uint2 wb =
              *reinterpret_cast<const uint2*>(src + (g + 8) * Stream::kRowStride + u * 32);
          uint2 b = make_uint2(0u, 0u);
          float sa0, sa1;
          if constexpr (kFused) {
            b = *reinterpret_cast<const uint2*>(act + g * kActRowBytes + u * 32 + t * 8);
            sa0 = reinterpret_cast<const float*>(act + t0 * kActRowBytes + kChunkKb * 32)[u];
            sa1 = reinterpret_cast<const float*>(act + t1 * kActRowBytes + kChunkKb * 32)[u];
          } else {
            if (tok_ok) b = __ldg(reinterpret_cast<const uint2*>(arow + size_t(k) * 32));
            sa0 = t0 < p.m ? __ldg(as0 + k) : 0.f;
            sa1 = t1 < p.m ? __ldg(as1 + k) : 0.f;
          }
          const float sw = e8m0_to_f32(__ldg(wsc + k));
          const uint32_t a[4] = {wa.x, wb.x, wa.y, wb.y};
          float d[4];
          mma_e4m3_16x8x32(d, a, b.x, b.y);
          acc[0] = fmaf(d[0] * sa0, sw, acc[0]);
          acc[1] = fmaf(d[1] * sa1, sw, acc[1]);
          acc[2] = fmaf(d[2] * sa0, sw, acc[2]);
          acc[3] = fmaf(d[3] * sa1, sw, acc[3]);
        }
      }
      __syncwarp();  // the buffer is refilled by the issue below
      issue(c + kStages);
    }
    if constexpr (kFused) {
      if (c + 1 < nck) {  // block-uniform
        act_store(p, xr, warp, lane, abuf + ((c + 1) & 1) * kActBufBytes);
        if (c + 2 < nck) act_load(p, kb0 + (c + 2) * kChunkKb, kb1, warp, lane, xr);
        __syncthreads();  // chunk c + 1 complete; every warp is done with chunk c's buffer
      }
    }
  }
  cp_async_wait<0>();

  if (job.splits == 1) {
    if (active) store_outputs(job, p.m, tile * 16, g, t, acc);
    return;
  }
  // Split-K: publish this split's fragment, the last block sums all splits in split order and
  // stores (rounded where asked). Lanes whose two tokens are both >= m have nothing to publish.
  const bool lane_used = active && t0 < p.m;
  const size_t frag = (size_t(bx) * kWarpsPerBlock + warp) * 128 + lane * 4;
  const size_t split_stride = size_t(job.n_blocks) * kWarpsPerBlock * 128;
  if (lane_used)
    __stcg(reinterpret_cast<float4*>(job.partials + by * split_stride + frag),
           make_float4(acc[0], acc[1], acc[2], acc[3]));
  __threadfence();
  __syncthreads();
  __shared__ int s_last;
  if (threadIdx.x == 0) s_last = atomicAdd(job.counters + bx, 1) == job.splits - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  if (lane_used) {
    const float* base = job.partials + frag;
    const float4 v0 = __ldcg(reinterpret_cast<const float4*>(base));
    float sum[4] = {v0.x, v0.y, v0.z, v0.w};
    constexpr int kBatch = 8;  // loads in flight before the in-order adds
    for (int s = 1; s < job.splits; s += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i)
        if (s + i < job.splits)
          v[i] = __ldcg(reinterpret_cast<const float4*>(base + (s + i) * split_stride));
#pragma unroll
      for (int i = 0; i < kBatch; ++i)
        if (s + i < job.splits)
          sum[0] += v[i].x, sum[1] += v[i].y, sum[2] += v[i].z, sum[3] += v[i].w;
    }
    store_outputs(job, p.m, tile * 16, g, t, sum);
  }
  if (threadIdx.x == 0) job.counters[bx] = 0;  // ready for the next launch
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

size_t smem_bytes(int stages, bool fused) {
  return size_t(kWarpsPerBlock) * size_t(stages) * Stream3::kStageBytes +
         (fused ? size_t(stages > 1 ? 2 : 1) * kActBufBytes : 0);
}

template <int kStages, bool kFused>
void setup_kernel() {
  const auto kernel = fp8_gemv_kernel<kStages, kFused>;
  UF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(smem_bytes(kStages, kFused))));
  prefer_shared_carveout(kernel);
}

template <bool kFused>
void launch_gemv(int stages, const GemvParams& p, int blocks, cudaStream_t stream) {
  const dim3 grid{unsigned(blocks)}, block{unsigned(kWarpsPerBlock * 32)};
  const size_t smem = smem_bytes(stages, kFused);
  if (stages == 1)
    launch_pdl(fp8_gemv_kernel<1, kFused>, grid, block, smem, stream, p);
  else if (stages == 2)
    launch_pdl(fp8_gemv_kernel<2, kFused>, grid, block, smem, stream, p);
  else
    launch_pdl(fp8_gemv_kernel<3, kFused>, grid, block, smem, stream, p);
}

// Per device (function attributes belong to the current device's context), so every plan sets
// them, as before: tensor-parallel ranks build their plans on their own devices.
void setup_kernels() {
  setup_kernel<1, false>();
  setup_kernel<2, false>();
  setup_kernel<3, false>();
  setup_kernel<1, true>();
  setup_kernel<2, true>();
  setup_kernel<3, true>();
  prefer_shared_carveout(act_quant_kernel<uint16_t>);
  prefer_shared_carveout(act_quant_kernel<float>);
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
  setup_kernels();
  // The split plan is sized by the residency of the 3-stage pre-quantised kernel (108 KB of
  // stages), whatever variant runs, so that it stays what it was before the fused variants.
  int per_sm = 0;
  UF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, fp8_gemv_kernel<3, false>, kWarpsPerBlock * 32, smem_bytes(3, false)));
  // Split K so that the grid fills the resident block slots once without spilling into a second
  // wave, with whole 8-block chunks per split. Depends on (n, k, device) only, never on m.
  const int capacity = std::max(1, per_sm) * std::max(sm_count, 1);
  const int s_max = std::max(1, capacity / n_blocks_);
  int kbps = (nkb + s_max - 1) / s_max;
  kbps = std::min(nkb, (kbps + 7) / 8 * 8);
  kb_per_split_ = kbps;
  splits_ = (nkb + kbps - 1) / kbps;
  stages_ = std::min(kMaxStages, (kbps + kChunkKb - 1) / kChunkKb);
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

int Fp8Gemv::blocks_per_sm(bool fused) const {
  int per_sm = 0;
  const size_t smem = smem_bytes(stages_, fused);
  const int threads = kWarpsPerBlock * 32;
  if (stages_ == 1)
    UF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, fused ? fp8_gemv_kernel<1, true> : fp8_gemv_kernel<1, false>, threads, smem));
  else if (stages_ == 2)
    UF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, fused ? fp8_gemv_kernel<2, true> : fp8_gemv_kernel<2, false>, threads, smem));
  else
    UF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, fused ? fp8_gemv_kernel<3, true> : fp8_gemv_kernel<3, false>, threads, smem));
  return per_sm;
}

namespace {
// The job entry of one Fp8Gemv call; block_begin is filled by the caller.
GemvJob make_job(const Fp8Gemv& g, const Fp8WeightView& w, float* partials, int* counters,
                 int n_blocks, int kbps, float* out_f32, bool round_f32, uint16_t* out_bf16) {
  GemvJob j{};
  j.w = w.data;
  j.w_scale = w.scale;
  j.out = out_f32;
  j.out_bf16 = reinterpret_cast<__nv_bfloat16*>(out_bf16);
  j.partials = partials;
  j.counters = counters;
  j.n = g.n();
  j.kb_per_split = kbps;
  j.splits = g.splits();
  j.n_blocks = n_blocks;
  j.out_stride = g.n();
  j.round_out = round_f32 ? 1 : 0;
  return j;
}
}  // namespace

void Fp8Gemv::run(const Fp8WeightView& w, const QuantActView& a, float* out_f32, uint16_t* out_bf16,
                  cudaStream_t stream) const {
  require(w.n == n_ && w.k == k_ && a.k == k_ && a.m >= 1 && a.m <= kMaxDecodeRows,
          "Fp8Gemv::run: weight [%d, %d] / activation [%d, %d] do not match the plan [%d, %d]", w.n,
          w.k, a.m, a.k, n_, k_);
  GemvParams p{};
  p.jobs[0] =
      make_job(*this, w, partials_, counters_, n_blocks_, kb_per_split_, out_f32, false, out_bf16);
  p.njobs = 1;
  p.a = a.codes;
  p.a_scale = a.scales;
  p.m = a.m;
  p.k = k_;
  launch_gemv<false>(stages_, p, n_blocks_ * splits_, stream);
}

bool Fp8Gemv::fused_input_ok(const float* x, long long x_stride) {
  return reinterpret_cast<uintptr_t>(x) % 16 == 0 && x_stride % 4 == 0;
}

void Fp8Gemv::run_fused(const Fp8WeightView& w, const float* x, long long x_stride, int m,
                        float* out_f32, bool round_f32, uint16_t* out_bf16,
                        cudaStream_t stream) const {
  const Fp8GemvCall call{this, w, out_f32, round_f32, out_bf16};
  run_fused_group(&call, 1, x, x_stride, m, stream);
}

void Fp8Gemv::run_fused_group(const Fp8GemvCall* calls, int n_calls, const float* x,
                              long long x_stride, int m, cudaStream_t stream) {
  require(n_calls >= 1 && n_calls <= kMaxGemvGroup,
          "Fp8Gemv::run_fused_group: %d weights, must be 1..%d", n_calls, kMaxGemvGroup);
  require(m >= 1 && m <= kMaxDecodeRows, "Fp8Gemv::run_fused: m = %d must be in 1..8", m);
  require(fused_input_ok(x, x_stride),
          "Fp8Gemv::run_fused: x must be 16-byte aligned with a row stride %% 4 == 0 (stride %lld)",
          x_stride);
  GemvParams p{};
  p.njobs = n_calls;
  p.x = x;
  p.x_stride = x_stride;
  p.m = m;
  p.k = calls[0].gemv->k_;
  int blocks = 0, stages = 1;
  for (int i = 0; i < n_calls; ++i) {
    const Fp8Gemv& g = *calls[i].gemv;
    const Fp8WeightView& w = calls[i].w;
    require(w.n == g.n_ && w.k == g.k_ && g.k_ == p.k,
            "Fp8Gemv::run_fused_group: weight %d [%d, %d] does not match its plan [%d, %d] or the "
            "shared K %d",
            i, w.n, w.k, g.n_, g.k_, p.k);
    for (int j = 0; j < i; ++j)
      require(
          calls[j].gemv != &g,
          "Fp8Gemv::run_fused_group: calls %d and %d share a plan (its split counters serve one "
          "launch at a time)",
          j, i);
    p.jobs[i] = make_job(g, w, g.partials_, g.counters_, g.n_blocks_, g.kb_per_split_,
                         calls[i].out_f32, calls[i].round_f32, calls[i].out_bf16);
    p.jobs[i].block_begin = blocks;
    blocks += g.n_blocks_ * g.splits_;
    stages = std::max(stages, g.stages_);  // pipeline depth only: no effect on the numerics
  }
  launch_gemv<true>(stages, p, blocks, stream);
}

}  // namespace uf::cuda
