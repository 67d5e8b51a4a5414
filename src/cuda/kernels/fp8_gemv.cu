// FP8 block-scaled GEMV for decode rows, and the FP8 activation quantizer.
//
// Shapes and dtypes
//   W  [N, K]  F8_E4M3, row-major; W scale [ceil(N/32), K/32] F8_E8M0 (32x32 blocks)
//   A  [M, K]  E4M3 codes + fp32 power-of-two scales [M, K/32]: either pre-quantised by
//              act_quant_fp8_* (run), or quantised inside the GEMV from fp32 x (run_fused, below)
//   out[M, N]  fp32 (optionally bf16-rounded) and/or bf16 (RNE of the fp32 result)
//   Limits: 1 <= M <= 8, N % 16 == 0, K % 32 == 0.
//
// Two kernels, chosen per plan (Fp8Gemv ctor): the resident kernel for every weight that fits one
// wave of CTAs holding all their weight bytes in shared memory (K <= 12288 and N * K <= SMs x
// 100 KB: every decode weight of a TP8 rank but Engram's wkv), else the pipelined kernel.
// Both compute the same fragments (below) and the same reduction form, so fp8_gemm_prefill
// reproduces either from kb_per_split.
//
// Resident kernel (fp8_gemv_resident_kernel): latency-bound decode weights
//   Split plan (a function of K only): C = ceil(K / 1536) CTAs of a thread-block cluster share one
//   group of output tiles; kbps = ceil((K/32) / (8 C)) <= 6 K blocks a split, S = ceil((K/32) /
//   kbps) splits, cluster size C = ceil(S / 8). Split s belongs to warp s % 8 of cluster rank s
//   / 8. A CTA: 8 warps x R 16-row tiles (R <= 8, chosen per launch so that the launch's CTAs fit
//   one per SM where shared memory allows; R changes no arithmetic). Each warp copies the R x 16
//   rows x kbps K blocks of its split into its own shared region (cp.async 16 B, rows of kbps x 32
//   B padded to 32 mod 64 bytes: conflict-free 8-byte fragment reads) and its weight scales into
//   registers, all before griddepcontrol.wait; launch_dependents follows the issue. Shared memory
//   is 8 x (R x 16 x row + R x 8 x 4) bytes <= 100 KB and registers are capped at 104
//   (kResMaxRegs), so the next kernel's CTAs co-reside.
//   After the wait (work specialised on the warp's split length kw, a template argument, so that
//   each phase is one branch-free block): a warp loads its activations into registers, every load
//   issued before the first use (fused: lane (g, t) loads the 8 x values of token g it feeds to the
//   mma, K block bytes 8t..8t+7, and quantises them exactly as act_quant_fp8_f32: amax over the
//   block's 4 lanes, pow2_scale, e4m3(x / s), computed as x * (1 / s), the same bits since s is a
//   power of two with a normal reciprocal (pow2_scale_inv); pre-quantised: the same 8 code bytes
//   and the scales). The weight scales are staged in the warp's region as fp32. Then the warp's
//   tiles go through the mma res_mma_group(kw) at a time (<= 4, kw x tiles <= 12): all of a pass's
//   mma are independent and issue back to back, each tile's acc still runs in K order. Each 16 x 8
//   partial replaces its tile's weights in shared memory. CTA rank c finishes tiles r = c, c + C,
//   ...: per output, the S partials are added in split order 0..S-1; bf16 rounding and stores.
//   C > 1: each warp pushes its partial of tile r (st.async, 512 B) into slot [r / C][split] of
//   rank r % C's receive region, whose mbarrier counts the bytes (initialised before the PDL
//   wait; one cluster barrier, arrived at there, orders it before the first push). A CTA that
//   finishes no tile leaves after its pushes; nobody reads another CTA's memory, so there is no
//   exit barrier. C = 1 (K <= 1536): a plain launch and a block barrier; the partials are read in
//   place. No global workspace, no counters.
//   TP8 rank weights on 132 SMs (kbps / S / C / R, CTAs x shared memory): wq_a|wkv [1280|512,
//   5120] grouped 5 / 32 / 4 / 4, 112 x 81 KB; wq_b [4096, 1280] 5 / 8 / 1 / 2, 128 x 40 KB;
//   wo_b [5120, 1024] 4 / 8 / 1 / 3, 107 x 60 KB; shared w1|w3 [288|288, 5120] 5 / 32 / 4 / 2,
//   72 x 40 KB; shared w2 [5120, 288] 2 / 5 / 1 / 3, 107 x 36 KB. Fused x traffic a CTA is
//   m x K / C x 4 bytes (L2), at m = 8 up to the CTA's weight bytes (wq_b): kResKPerCta trades
//   it against cluster size.
//
// Pipelined kernel (fp8_gemv_kernel): large weights (and Fp8GemvPath::kPipelined)
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
//   pow2_scale and e4m3(x / s) (as x * (1 / s), the same bits) exactly as warp_quant_fp8_block:
//   the codes and scales are bitwise those of act_quant_fp8_f32, so run_fused == act_quant + run
//   bitwise. Tokens >= M get zero codes and scales (as run's zero fragments). Two buffers:
//   chunk c + 1 is quantised (its x loaded one chunk ahead) while chunk c's weights are consumed,
//   one __syncthreads per chunk.
//
// Reduction order (what spec == plain relies on; both kernels)
//   For each output (m, n): within a split, acc = 0; for kb in K order:
//   acc += (mma_partial(kb) * a_scale[m][kb]) * w_scale[n/32][kb] (both scales are powers of two,
//   so only the add rounds, as in the reference). Splits are then summed in split order
//   0, 1, ..., S-1: total = p0, then total = total + ps (resident: the finishing CTA of the
//   cluster; pipelined: the last block to finish, a counter, no float atomics), then the bf16
//   rounding: one launch per apply. S and the split boundaries depend on (N, K, SM count, path)
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
#include "cuda/kernels/l2_window.h"
#include "cuda/kernels/probe.cuh"

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

// The job of this block in a grouped launch (jobs sorted by block_begin, jobs[0] at 0): constant
// indices only (a dynamically indexed kernel parameter may be copied to local memory), selects in
// registers, once per block.
template <class Job>
__device__ __forceinline__ Job block_job(const Job (&jobs)[kMaxGemvGroup], int njobs) {
  Job job = jobs[0];
#pragma unroll
  for (int i = 1; i < kMaxGemvGroup; ++i)
    if (i < njobs && int(blockIdx.x) >= jobs[i].block_begin) job = jobs[i];
  return job;
}

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
    const float inv = pow2_scale_inv(s);  // x * inv == x / s bitwise (common.cuh)
    c[0] = f32x4_to_e4m3x4(v[0], v[1], v[2], v[3], inv);
    c[1] = f32x4_to_e4m3x4(v[4], v[5], v[6], v[7], inv);
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
  const GemvJob job = block_job(p.jobs, p.njobs);
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

// ---- Resident kernel ----

constexpr int kResWarps = 8;
constexpr int kResMaxKbps = 6;     // K blocks a split (the plan rule gives <= 6)
constexpr int kResMaxTiles = 8;    // 16-row tiles a CTA
constexpr int kResMaxCluster = 8;  // portable cluster size
constexpr int kResKPerCta = 1536;  // K a CTA aims at: C = ceil(K / 1536)
constexpr int kResScaleSlots = 8;  // fp32 weight scales a tile in a warp's region (>= kbps)
constexpr size_t kResSmemBudget = 100 * 1024;
constexpr int kResPartialBytes = 16 * 8 * 4;  // a split's fp32 partial of one 16-row tile
constexpr int kResRecvHeader = 16;            // the receive mbarrier (8 B), padded
// Registers a thread (instead of __launch_bounds__(256, 2), which let ptxas take 116-128): 2 CTAs
// an SM still fit, and one CTA (the usual wave) leaves more than half of the register file to the
// next kernel's CTAs (PDL). The widest mma pass, the 6-block fused activations and the split
// loads run without spills (96 spilled a word).
constexpr int kResMaxRegs = 104;

// One weight of a resident launch.
struct ResJob {
  const uint8_t* w;
  const uint8_t* w_scale;
  float* out;
  __nv_bfloat16* out_bf16;
  int tiles;        // n / 16
  int block_begin;  // first linear block of this job (a multiple of the cluster size)
  int out_stride;
  int round_out;
};

struct ResParams {
  ResJob jobs[kMaxGemvGroup];
  int njobs;
  const uint8_t* a;
  const float* a_scale;
  const float* x;
  long long x_stride;
  int m, k;
  int kbps, splits, cluster;  // the split plan (K only)
  int tiles_per_cta;          // R
  int row_stride;             // padded shared row of a split (bytes)
  int warp_bytes;             // a warp's region: R x 16 rows + R x kResScaleSlots fp32 scales
};

// The receive region after the warps' regions (C > 1): an mbarrier, then [ceil(R / C)][S] tile
// partials, the tiles r = rank, rank + C, ... this CTA finishes.
__host__ __device__ constexpr int res_recv_bytes(int cluster, int splits, int tiles_per_cta) {
  return cluster > 1
             ? kResRecvHeader + (tiles_per_cta + cluster - 1) / cluster * splits * kResPartialBytes
             : 0;
}

// Activation fragments of the warp's KW K blocks (KW = kw, a template argument): codes (b0, b1)
// of token g, bytes 8t..8t+7 of each block, and the scales of tokens 2t (sa0) and 2t + 1 (sa1).
// Tokens >= m: zeros. Branch-free, so every load is issued before the first use: lanes of tokens
// >= m load row 0 (the addresses of lanes g = 0 in the same instruction: no extra traffic) and
// their codes and scales are masked to zero (their amax shuffles stay within their own 4 lanes).
template <int KW, bool kFused>
__device__ __forceinline__ void res_activations(const ResParams& p, int kb0, int g, int t,
                                                uint32_t (&b0)[kResMaxKbps],
                                                uint32_t (&b1)[kResMaxKbps],
                                                float (&sa0)[kResMaxKbps],
                                                float (&sa1)[kResMaxKbps]) {
  const bool tok = g < p.m;
  const uint32_t keep = tok ? 0xffffffffu : 0u;
  const int t0 = 2 * t, t1 = 2 * t + 1;
  if constexpr (kFused) {
    float4 xv[KW][2];
    const float* xr = p.x + size_t(tok ? g : 0) * size_t(p.x_stride) + size_t(kb0) * 32 + t * 8;
#pragma unroll
    for (int u = 0; u < KW; ++u) {
      xv[u][0] = __ldg(reinterpret_cast<const float4*>(xr + u * 32));
      xv[u][1] = __ldg(reinterpret_cast<const float4*>(xr + u * 32 + 4));
    }
#pragma unroll
    for (int u = 0; u < KW; ++u) {
      const float v[8] = {xv[u][0].x, xv[u][0].y, xv[u][0].z, xv[u][0].w,
                          xv[u][1].x, xv[u][1].y, xv[u][1].z, xv[u][1].w};
      float a = fabsf(v[0]);
#pragma unroll
      for (int i = 1; i < 8; ++i) a = fmaxf(a, fabsf(v[i]));
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
      // Exactly warp_quant_fp8_block's scale and codes (the same max over the same 32 values;
      // x * (1 / s) == x / s bitwise: pow2_scale_inv).
      const float sq = pow2_scale(fmaxf(a, kActAmaxFloor), kFp8MaxInv);
      const float inv = pow2_scale_inv(sq);
      const float s = tok ? sq : 0.f;
      b0[u] = f32x4_to_e4m3x4(v[0], v[1], v[2], v[3], inv) & keep;
      b1[u] = f32x4_to_e4m3x4(v[4], v[5], v[6], v[7], inv) & keep;
      sa0[u] = __shfl_sync(0xffffffffu, s, 8 * t);      // lane of token 2t
      sa1[u] = __shfl_sync(0xffffffffu, s, 8 * t + 4);  // lane of token 2t + 1
    }
  } else {
    const int nkb = p.k / 32;
    const uint8_t* ar = p.a + size_t(tok ? g : 0) * p.k + size_t(kb0) * 32 + t * 8;
    const float* as0 = p.a_scale + size_t(t0 < p.m ? t0 : 0) * nkb + kb0;
    const float* as1 = p.a_scale + size_t(t1 < p.m ? t1 : 0) * nkb + kb0;
#pragma unroll
    for (int u = 0; u < KW; ++u) {
      const uint2 c = __ldg(reinterpret_cast<const uint2*>(ar + u * 32));
      const float f0 = __ldg(as0 + u), f1 = __ldg(as1 + u);
      b0[u] = c.x & keep;
      b1[u] = c.y & keep;
      sa0[u] = t0 < p.m ? f0 : 0.f;
      sa1[u] = t1 < p.m ? f1 : 0.f;
    }
  }
}

// Tiles r .. r + NT - 1 of the warp over its KW K blocks in one branch-free pass: the NT x KW mma
// are independent (only each tile's accumulating FMAs chain, in K order as before), so their
// shared-memory reads and mma issue back to back. Each tile's 16 x 8 partial then replaces its
// weights. swf: the warp's weight scales as fp32, kResScaleSlots a tile.
template <int KW, int NT>
__device__ __forceinline__ void res_mma_tiles(uint8_t* wreg, const float* swf, int L, int r,
                                              int lane, const uint32_t (&b0)[kResMaxKbps],
                                              const uint32_t (&b1)[kResMaxKbps],
                                              const float (&sa0)[kResMaxKbps],
                                              const float (&sa1)[kResMaxKbps]) {
  static_assert(KW <= kResMaxKbps && kResMaxKbps <= kResScaleSlots, "scale slots per tile");
  const int g = lane >> 2, t = lane & 3;
  float sw[NT][8];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int h = 0; h < (KW + 3) / 4; ++h) {
      const float4 q = *reinterpret_cast<const float4*>(swf + (r + j) * kResScaleSlots + 4 * h);
      sw[j][4 * h] = q.x, sw[j][4 * h + 1] = q.y, sw[j][4 * h + 2] = q.z, sw[j][4 * h + 3] = q.w;
    }
  }
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  const uint8_t* wt = wreg + r * 16 * L + g * L + t * 8;
#pragma unroll
  for (int u = 0; u < KW; ++u) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint8_t* tb = wt + j * 16 * L + u * 32;
      const uint2 wa = *reinterpret_cast<const uint2*>(tb);
      const uint2 wb = *reinterpret_cast<const uint2*>(tb + 8 * L);
      const uint32_t af[4] = {wa.x, wb.x, wa.y, wb.y};
      float d[4];
      mma_e4m3_16x8x32(d, af, b0[u], b1[u]);
      acc[j][0] = fmaf(d[0] * sa0[u], sw[j][u], acc[j][0]);
      acc[j][1] = fmaf(d[1] * sa1[u], sw[j][u], acc[j][1]);
      acc[j][2] = fmaf(d[2] * sa0[u], sw[j][u], acc[j][2]);
      acc[j][3] = fmaf(d[3] * sa1[u], sw[j][u], acc[j][3]);
    }
  }
  __syncwarp();  // every lane is done with these tiles' weights
#pragma unroll
  for (int j = 0; j < NT; ++j)
    *reinterpret_cast<float4*>(wreg + (r + j) * 16 * L + lane * 16) =
        make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
}

// Tiles a warp runs through the mma in one pass: NT x KW <= 12 (NT <= 4), which keeps the pass's
// weight fragments, scales and accumulators within the register budget without spills.
constexpr int res_mma_group(int kw) { return kw <= 3 ? 4 : 12 / kw; }

// Tiles r .. r + nt - 1 (nt <= N) in one pass.
template <int KW, int N>
__device__ __forceinline__ void res_mma_pass(int nt, uint8_t* wreg, const float* swf, int L, int r,
                                             int lane, const uint32_t (&b0)[kResMaxKbps],
                                             const uint32_t (&b1)[kResMaxKbps],
                                             const float (&sa0)[kResMaxKbps],
                                             const float (&sa1)[kResMaxKbps]) {
  if (nt == N) {
    res_mma_tiles<KW, N>(wreg, swf, L, r, lane, b0, b1, sa0, sa1);
  } else if constexpr (N > 1) {
    res_mma_pass<KW, N - 1>(nt, wreg, swf, L, r, lane, b0, b1, sa0, sa1);
  }
}

// The warp's ntiles tiles, res_mma_group(KW) at a time.
template <int KW>
__device__ __forceinline__ void res_mma(uint8_t* wreg, const float* swf, int L, int ntiles,
                                        int lane, const uint32_t (&b0)[kResMaxKbps],
                                        const uint32_t (&b1)[kResMaxKbps],
                                        const float (&sa0)[kResMaxKbps],
                                        const float (&sa1)[kResMaxKbps]) {
  constexpr int kGroup = res_mma_group(KW);
  for (int r = 0; r < ntiles; r += kGroup)  // warp-uniform
    res_mma_pass<KW, kGroup>(min(kGroup, ntiles - r), wreg, swf, L, r, lane, b0, b1, sa0, sa1);
}

// f.template operator()<KW>() with KW = kw (warp-uniform), for kw in 1..kResMaxKbps; nothing
// for kw = 0.
template <int KW = 1, class F>
__device__ __forceinline__ void with_kw(int kw, F&& f) {
  if (kw == KW) {
    f.template operator()<KW>();
  } else if constexpr (KW < kResMaxKbps) {
    with_kw<KW + 1>(kw, f);
  }
}

template <bool kFused>
__global__ void __maxnreg__(kResMaxRegs) fp8_gemv_resident_kernel(const ResParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  // Probe points: 0 start, 1 loads issued, 2 PDL wait returned, 3 activations ready, 4 weights
  // landed, 5 partials written, 6 every split's partials here (finishing CTAs), 7 outputs stored.
  UF_PROBE_OPEN(probe, kTagGemvResident);
  UF_PROBE_MARK(probe, 0);
  const ResJob job = block_job(p.jobs, p.njobs);
  const int C = p.cluster;
  const int rank = int(cluster_ctarank());
  const int tile0 = ((int(blockIdx.x) - job.block_begin) / C) * p.tiles_per_cta;
  const int ntiles = min(p.tiles_per_cta, job.tiles - tile0);  // >= 1: uniform in the cluster
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int L = p.row_stride;
  const int nkb = p.k / 32;
  const int split = rank * kResWarps + warp;
  const int kb0 = split * p.kbps;
  const int kw = split < p.splits ? min(p.kbps, nkb - kb0) : 0;  // warp-uniform, <= kResMaxKbps
  uint8_t* wreg = smem + warp * p.warp_bytes;
  float* swf = reinterpret_cast<float*>(wreg + p.tiles_per_cta * 16 * L);

  // Weights and their scales do not depend on the previous kernel: all issued before the wait.
  if (kw > 0) {
    const int ppr = 2 * kw;  // 16-byte pieces a row
    const int total = ntiles * 16 * ppr;
    const uint8_t* src0 = job.w + size_t(tile0) * 16 * p.k + size_t(kb0) * 32;
    for (int q = lane; q < total; q += 32) {
      const int row = q / ppr, col = q - row * ppr;
      const uint32_t d = uint32_t(__cvta_generic_to_shared(wreg + row * L + col * 16));
      const uint8_t* src = src0 + size_t(row) * p.k + col * 16;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
    }
  }
  cp_async_commit();
  // Scale byte (tile r, K block u) at slot r * 8 + u: lane holds slots lane and lane + 32.
  uint32_t sc[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int slot = lane + 32 * i, r = slot / kResScaleSlots, u = slot % kResScaleSlots;
    if (r < ntiles && u < kw) sc[i] = __ldg(job.w_scale + size_t((tile0 + r) >> 1) * nkb + kb0 + u);
  }
  // C > 1: the S partials of each tile this CTA finishes (r = rank, rank + C, ...) arrive by
  // st.async into its receive region; the mbarrier counts their bytes. The cluster barrier that
  // publishes its initialisation is waited for only before the first push.
  uint8_t* recv_region = smem + kResWarps * p.warp_bytes;  // mbarrier, then [owned][S] partials
  const uint32_t recv_bar = uint32_t(__cvta_generic_to_shared(recv_region));
  const int owned = rank < ntiles ? (ntiles - rank + C - 1) / C : 0;
  if (C > 1) {
    if (threadIdx.x == 0) {
      mbarrier_init_expect(recv_bar, uint32_t(owned * p.splits * kResPartialBytes));
      fence_mbarrier_init();
    }
    cluster_arrive_relaxed();
  }
  pdl_trigger();
  UF_PROBE_MARK(probe, 1);
  pdl_wait();
  UF_PROBE_MARK(probe, 2);

  uint32_t b0[kResMaxKbps], b1[kResMaxKbps];
  float sa0[kResMaxKbps], sa1[kResMaxKbps];
  // kw = 0 (no split): nothing to load.
  with_kw(kw, [&]<int KW>() { res_activations<KW, kFused>(p, kb0, g, t, b0, b1, sa0, sa1); });
  // The weight scales, as fp32 (e8m0_to_f32 once per slot instead of once per use).
#pragma unroll
  for (int i = 0; i < 2; ++i)
    if (lane + 32 * i < p.tiles_per_cta * kResScaleSlots) swf[lane + 32 * i] = e8m0_to_f32(sc[i]);
  UF_PROBE_MARK(probe, 3);
  cp_async_wait<0>();  // this lane's weight pieces have landed
  __syncwarp();        // ... and every other lane's, and the scales
  UF_PROBE_MARK(probe, 4);

  with_kw(kw, [&]<int KW>() { res_mma<KW>(wreg, swf, L, ntiles, lane, b0, b1, sa0, sa1); });
  UF_PROBE_MARK(probe, 5);

  // Output slot of thread: fragment element e of lane ln (d[e]: row g + 8 (e >> 1), token
  // 2 (ln % 4) + (e & 1)); the two halves of the block finish alternate tiles.
  const int slot = threadIdx.x & 127;
  const int ln = slot >> 2, e = slot & 3;
  const int otok = 2 * (ln & 3) + (e & 1);
  const int orow = (ln >> 2) + ((e & 2) ? 8 : 0);
  if (C > 1) {
    // Push: each warp's partial of tile r (16 B a lane, as res_mma_tiles laid it out) to slot
    // [r / C][split] of rank r % C. No barrier after: a CTA that finishes no tile leaves once its
    // stores are issued, and a finishing CTA reads only its own shared memory.
    cluster_wait();
    if (kw > 0) {
      for (int r = 0; r < ntiles; ++r) {
        const float4 v = *reinterpret_cast<const float4*>(wreg + r * 16 * L + lane * 16);
        const uint32_t o = uint32_t(r % C);
        const uint32_t dst = recv_bar + kResRecvHeader +
                             uint32_t(((r / C) * p.splits + split) * kResPartialBytes + lane * 16);
        st_async_f32x4(cluster_map(dst, o), v, cluster_map(recv_bar, o));
      }
    }
    if (owned == 0) return;
    mbarrier_wait_cluster(recv_bar, 0);
    UF_PROBE_MARK(probe, 6);
    if (otok < p.m) {
      const float* recv = reinterpret_cast<const float*>(recv_region + kResRecvHeader) + slot;
      for (int j = threadIdx.x >> 7; j < owned; j += 2) {
        const float* src = recv + j * p.splits * (kResPartialBytes / 4);
        float total = src[0];  // split order 0..S-1, as the C = 1 sum below
#pragma unroll 8
        for (int s = 1; s < p.splits; ++s) total += src[s * (kResPartialBytes / 4)];
        const int r = rank + C * j;
        const size_t o = size_t(otok) * job.out_stride + size_t(tile0 + r) * 16 + orow;
        if (job.out) job.out[o] = job.round_out ? round_bf16(total) : total;
        if (job.out_bf16) job.out_bf16[o] = __float2bfloat16_rn(total);
      }
    }
    UF_PROBE_MARK(probe, 7);
    return;
  }
  // C = 1 (K <= 1536, a plain launch): every split's partials are in this CTA's shared memory.
  __syncthreads();
  UF_PROBE_MARK(probe, 6);
  if (otok < p.m) {
    // S <= 8 splits, split s in warp s: every load issued before the first add.
    for (int r = threadIdx.x >> 7; r < ntiles; r += 2) {
      const uint8_t* at = smem + r * 16 * L + slot * 4;
      float v[kResWarps];
#pragma unroll
      for (int s = 0; s < kResWarps; ++s)
        v[s] = s < p.splits ? *reinterpret_cast<const float*>(at + s * p.warp_bytes) : 0.f;
      float total = v[0];
#pragma unroll
      for (int s = 1; s < kResWarps; ++s)
        if (s < p.splits) total += v[s];
      const size_t o = size_t(otok) * job.out_stride + size_t(tile0 + r) * 16 + orow;
      if (job.out) job.out[o] = job.round_out ? round_bf16(total) : total;
      if (job.out_bf16) job.out_bf16[o] = __float2bfloat16_rn(total);
    }
  }
  UF_PROBE_MARK(probe, 7);
}

// The resident split plan of K (numerics: kbps and splits; the cluster follows).
struct ResPlan {
  int kbps, splits, cluster, row_stride;
};
ResPlan res_plan(int k) {
  const int nkb = k / 32;
  const int c0 = std::max(1, (k + kResKPerCta - 1) / kResKPerCta);
  ResPlan r{};
  r.kbps = (nkb + kResWarps * c0 - 1) / (kResWarps * c0);
  r.splits = (nkb + r.kbps - 1) / r.kbps;
  r.cluster = (r.splits + kResWarps - 1) / kResWarps;
  // Rows of kbps x 32 bytes padded to 32 mod 64: the 8-byte fragment reads of rows g = 0..3
  // (one half-warp phase) fall in distinct 32-byte bank groups.
  r.row_stride = r.kbps * 32 + (r.kbps % 2 == 0 ? 32 : 0);
  return r;
}
int res_warp_bytes(const ResPlan& r, int tiles_per_cta) {
  return (tiles_per_cta * 16 * r.row_stride + tiles_per_cta * kResScaleSlots * 4 + 15) / 16 * 16;
}
size_t res_smem_bytes(const ResPlan& r, int tiles_per_cta) {
  return size_t(kResWarps) * size_t(res_warp_bytes(r, tiles_per_cta)) +
         size_t(res_recv_bytes(r.cluster, r.splits, tiles_per_cta));
}
// Tiles a CTA for a launch of jobs with these tile counts: the smallest R whose grid fits one CTA
// per SM, within the shared-memory budget (else the largest R the budget allows).
int res_tiles_per_cta(const ResPlan& r, const int* tiles, int njobs, int sms) {
  int best = 1;
  for (int R = 1; R <= kResMaxTiles; ++R) {
    if (res_smem_bytes(r, R) > kResSmemBudget) break;
    best = R;
    long long ctas = 0;
    for (int j = 0; j < njobs; ++j) ctas += (tiles[j] + R - 1) / R * r.cluster;
    if (ctas <= sms) break;
  }
  return best;
}

template <bool kFused>
void launch_resident(const ResParams& p, int blocks, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(blocks));
  cfg.blockDim = dim3(kResWarps * 32);
  cfg.dynamicSmemBytes = size_t(kResWarps) * size_t(p.warp_bytes) +
                         size_t(res_recv_bytes(p.cluster, p.splits, p.tiles_per_cta));
  cfg.stream = stream;
  cudaLaunchAttribute attr[3];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = unsigned(p.cluster);
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.cluster > 1 ? 2 : 1;  // C = 1: a plain launch (cluster_ctarank() is 0)
  const uint8_t *lo = p.jobs[0].w, *hi = lo;
  for (int i = 0; i < p.njobs; ++i) {
    lo = std::min(lo, p.jobs[i].w);
    hi = std::max(hi, p.jobs[i].w + size_t(p.jobs[i].tiles) * 16 * size_t(p.k));
  }
  if (l2_streaming_window(lo, hi, attr[cfg.numAttrs])) ++cfg.numAttrs;
  UF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, fp8_gemv_resident_kernel<kFused>, p));
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
  for (auto kernel : {fp8_gemv_resident_kernel<false>, fp8_gemv_resident_kernel<true>}) {
    UF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(kResSmemBudget)));
    prefer_shared_carveout(kernel);
  }
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

Fp8Gemv::Fp8Gemv(int n, int k, int sm_count, Fp8GemvPath path)
    : n_(n), k_(k), sms_(std::max(sm_count, 1)) {
  require(n > 0 && k > 0 && n % 16 == 0 && k % 32 == 0,
          "Fp8Gemv: shape [%d, %d] needs n %% 16 == 0 and k %% 32 == 0", n, k);
  const int nkb = k / 32;
  n_blocks_ = (n / 16 + kWarpsPerBlock - 1) / kWarpsPerBlock;
  setup_kernels();
  // Resident where one wave of CTAs holding all their weights fits: K split over at most 8
  // clustered CTAs, and the weight within SMs x the per-CTA budget.
  const ResPlan rp = res_plan(k);
  resident_ = path == Fp8GemvPath::kAuto && rp.cluster <= kResMaxCluster &&
              double(n) * double(k) <= double(sms_) * double(kResSmemBudget);
  if (resident_) {
    kb_per_split_ = rp.kbps;
    splits_ = rp.splits;
    cluster_ = rp.cluster;
    stages_ = 1;
    return;
  }
  // Pipelined: the split plan is sized by the residency of the 3-stage pre-quantised kernel
  // (108 KB of stages), whatever variant runs, so that it stays what it was before the fused
  // variants.
  int per_sm = 0;
  UF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, fp8_gemv_kernel<3, false>, kWarpsPerBlock * 32, smem_bytes(3, false)));
  // Split K so that the grid fills the resident block slots once without spilling into a second
  // wave, with whole 8-block chunks per split. Depends on (n, k, device) only, never on m.
  const int capacity = std::max(1, per_sm) * sms_;
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
  const int threads = kWarpsPerBlock * 32;
  if (resident_) {
    const ResPlan rp = res_plan(k_);
    const int tiles = n_ / 16;
    const size_t smem = res_smem_bytes(rp, res_tiles_per_cta(rp, &tiles, 1, sms_));
    UF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, fused ? fp8_gemv_resident_kernel<true> : fp8_gemv_resident_kernel<false>, threads,
        smem));
    return per_sm;
  }
  const size_t smem = smem_bytes(stages_, fused);
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
// The job entry of one pipelined Fp8Gemv call; block_begin is filled by the caller.
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

// One resident launch of calls[0..n) (all resident, the same k): pre-quantised activations a
// (x null) or fp32 x.
void run_resident(const Fp8GemvCall* calls, int n, const QuantActView* a, const float* x,
                  long long x_stride, int m, int sms, cudaStream_t stream) {
  const int k = calls[0].gemv->k();
  const ResPlan rp = res_plan(k);
  int tiles[kMaxGemvGroup];
  for (int i = 0; i < n; ++i) tiles[i] = calls[i].gemv->n() / 16;
  const int R = res_tiles_per_cta(rp, tiles, n, sms);
  ResParams p{};
  p.njobs = n;
  p.a = a ? a->codes : nullptr;
  p.a_scale = a ? a->scales : nullptr;
  p.x = x;
  p.x_stride = x_stride;
  p.m = m;
  p.k = k;
  p.kbps = rp.kbps;
  p.splits = rp.splits;
  p.cluster = rp.cluster;
  p.tiles_per_cta = R;
  p.row_stride = rp.row_stride;
  p.warp_bytes = res_warp_bytes(rp, R);
  int blocks = 0;
  for (int i = 0; i < n; ++i) {
    ResJob& j = p.jobs[i];
    j.w = calls[i].w.data;
    j.w_scale = calls[i].w.scale;
    j.out = calls[i].out_f32;
    j.out_bf16 = reinterpret_cast<__nv_bfloat16*>(calls[i].out_bf16);
    j.tiles = tiles[i];
    j.block_begin = blocks;
    j.out_stride = calls[i].gemv->n();
    j.round_out = calls[i].round_f32 ? 1 : 0;
    blocks += (tiles[i] + R - 1) / R * rp.cluster;
  }
  if (a)
    launch_resident<false>(p, blocks, stream);
  else
    launch_resident<true>(p, blocks, stream);
}
}  // namespace

void Fp8Gemv::run(const Fp8WeightView& w, const QuantActView& a, float* out_f32, uint16_t* out_bf16,
                  cudaStream_t stream) const {
  require(w.n == n_ && w.k == k_ && a.k == k_ && a.m >= 1 && a.m <= kMaxDecodeRows,
          "Fp8Gemv::run: weight [%d, %d] / activation [%d, %d] do not match the plan [%d, %d]", w.n,
          w.k, a.m, a.k, n_, k_);
  if (resident_) {
    const Fp8GemvCall call{this, w, out_f32, false, out_bf16};
    run_resident(&call, 1, &a, nullptr, 0, a.m, sms_, stream);
    return;
  }
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
  const int k = calls[0].gemv->k_;
  for (int i = 0; i < n_calls; ++i) {
    const Fp8Gemv& g = *calls[i].gemv;
    const Fp8WeightView& w = calls[i].w;
    require(w.n == g.n_ && w.k == g.k_ && g.k_ == k,
            "Fp8Gemv::run_fused_group: weight %d [%d, %d] does not match its plan [%d, %d] or the "
            "shared K %d",
            i, w.n, w.k, g.n_, g.k_, k);
    for (int j = 0; j < i; ++j)
      require(
          calls[j].gemv != &g,
          "Fp8Gemv::run_fused_group: calls %d and %d share a plan (its split counters serve one "
          "launch at a time)",
          j, i);
  }
  // Resident plans in one launch, pipelined plans in another (a group normally has one kind).
  Fp8GemvCall res[kMaxGemvGroup];
  int n_res = 0;
  GemvParams p{};
  p.x = x;
  p.x_stride = x_stride;
  p.m = m;
  p.k = k;
  int blocks = 0, stages = 1;
  for (int i = 0; i < n_calls; ++i) {
    const Fp8Gemv& g = *calls[i].gemv;
    if (g.resident_) {
      res[n_res++] = calls[i];
      continue;
    }
    GemvJob& j = p.jobs[p.njobs++];
    j = make_job(g, calls[i].w, g.partials_, g.counters_, g.n_blocks_, g.kb_per_split_,
                 calls[i].out_f32, calls[i].round_f32, calls[i].out_bf16);
    j.block_begin = blocks;
    blocks += g.n_blocks_ * g.splits_;
    stages = std::max(stages, g.stages_);  // pipeline depth only: no effect on the numerics
  }
  if (n_res > 0) run_resident(res, n_res, nullptr, x, x_stride, m, res[0].gemv->sms_, stream);
  if (p.njobs > 0) launch_gemv<true>(stages, p, blocks, stream);
}

}  // namespace uf::cuda
