// MXFP4 routed-expert MoE for decode rows (W4A8, grouped by selected expert), and the shared
// expert's SwiGLU + FP8 quantization.
//
// Shapes and dtypes (moe.h): experts stacked [E, ...]; w1/w3 [E, I, K/2] packed E2M1 with UE8M0
// scales [E, I, K/32]; w2 [E, K, I/2] with scales [E, K, I/32]. x: FP8 codes [M, K] + scales.
// Routing: topk_idx/topk_w [M, topk] on the device. Limits: M <= 8, M * topk <= 64, K % 128 == 0,
// I % 32 == 0.
//
// Grouping: the P = M * topk (row, expert) pairs are reduced to the distinct experts, ranked by
// expert id, by a one-block plan kernel (moe_plan_kernel, O(P) per thread). Unique expert u is
// grid slot blockIdx.z of w13 (blockIdx.y of w2); its rows (ascending row index) are the
// columns of the mma B operand, so an expert picked by several rows is read once. Blocks whose
// slot exceeds the number of distinct experts exit: the grid is sized for P, so a CUDA graph
// captured for M rows is valid for any routing.
//
// Kernel 1, w13 (+ SwiGLU + quant): block = 4 warps on one 32-row group of the expert's
//   intermediate dim: warps 0/1 = w1 rows 0-15/16-31, warps 2/3 = w3 rows 0-15/16-31.
//   grid = (I/32, S, P), S = ceil(K/32 / 16) K splits. Weights stream through each warp's shared
//   memory (TileStream<16, 4>: 16 rows x 128 B stages, 4 deep, a warp instruction copies 4 rows x
//   128 B). Per thread and K block: 4 bytes (8 E2M1) of row g and of row g+8,
//   placed into e4m3 bytes holding value * 2^-6 (bit placement, ~3 ops per word; the 2^6 goes
//   into the activation scale, exactly), one m16n8k32 e4m3 mma.
//   K mapping within a block, A and B alike: thread t's 8 elements 8t..8t+7 go to fragment
//   positions {4t+j} = elements [0,2,4,6] and {16+4t+j} = elements [1,3,5,7].
//   Epilogue (last split): g = bf16(acc1), u = bf16(acc3), clamps, h = bf16(w * silu(g) * u),
//   FP8 quantization of h per 32 rows (one warp per token column, lane = row).
// Kernel 2, w2: block = 8 warps, each warp kW2TilesPerWarp 16-row tiles of the K output rows in
//   one cp.async stream, grid = (K/16 / (8 * kW2TilesPerWarp), P); K loop over all of I (no
//   split). y[pair] = bf16(acc) as fp32 (run), or acc itself (run_partial / run_experts: a
//   tensor-parallel rank's split-K partial of the expert's w2 product, rounded after the sum).
//   Pair (t, k) goes to y + t * y_row_stride + k * dim (internal y_: y_row_stride = topk * dim).
// Kernel 3, combine: out[t] = sum over t's experts in ascending expert id of y (fp32, from 0);
//   run_experts skips it.
//
// Reduction order: per output, acc = 0; for kb in K order acc += (partial * a_scale) * w_scale
// (per-row weight scale); w13 splits (S from K only, never from M or the routing) summed in split
// order by the last block (counter, no float atomics); experts summed by expert id.

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/moe.h"

namespace uf::cuda {
namespace {

using namespace detail;

constexpr int kMaxPairs = 64;
using Fp4Stream = TileStream<16, 4>;  // FP4: 128 B of each row per stage, 4 stages
constexpr int kW13Warps = 4;
constexpr int kW2Warps = 8;
constexpr int kKbPerSplit = 16;  // w13 split size: a function of K only (spec == plain)
constexpr int kW2TilesPerWarp = 1;
constexpr int kW13Smem = kW13Warps * Fp4Stream::kWarpBytes;
constexpr int kW2Smem = kW2Warps * Fp4Stream::kWarpBytes;

// The routing plan of one MoE call: the distinct experts of the P (row, expert) pairs ranked by
// expert id, each with its columns (rows in ascending order). Written by moe_plan_kernel, read by
// every w13 / w2 block (one 104-byte copy instead of recomputing it per block).
struct SlotPlan {
  int expert;
  int count;
  int pair[8];  // pair index (row * topk + k) of each column
  int tok[8];
  float weight[8];
};
struct MoePlan {
  int n_unique;
  int pad[3];
  SlotPlan slot[kMaxPairs];
};
constexpr int kSlotWords = int(sizeof(SlotPlan) / 4);

// One block of kMaxPairs threads, thread i = pair i. O(P) per thread.
__global__ void __launch_bounds__(kMaxPairs)
    moe_plan_kernel(const int* topk_idx, const float* topk_w, int P, int topk, int E,
                    MoePlan* plan) {
  __shared__ int s_e[kMaxPairs], s_first[kMaxPairs];
  pdl_trigger();
  pdl_wait();
  const int i = threadIdx.x;
  int e = -1;
  if (i < P) {
    e = topk_idx[i];
    if (e < 0 || e >= E) e = -1;  // invalid ids select nothing
  }
  s_e[i] = e;
  __syncthreads();
  int first = 0;
  if (e >= 0) {
    first = 1;
    for (int j = 0; j < i; ++j) first &= s_e[j] != e;
  }
  s_first[i] = first;
  const int n_unique = __syncthreads_count(first);
  if (e >= 0) {
    int rank = 0, col = 0, count = 0;
    for (int j = 0; j < P; ++j) {
      rank += (s_first[j] && s_e[j] < e) ? 1 : 0;
      col += (j < i && s_e[j] == e) ? 1 : 0;
      count += s_e[j] == e ? 1 : 0;
    }
    SlotPlan& sp = plan->slot[rank];
    sp.pair[col] = i;
    sp.tok[col] = i / topk;
    sp.weight[col] = topk_w[i];
    if (first) {
      sp.expert = e;
      sp.count = count;
    }
  }
  if (i == 0) plan->n_unique = n_unique;
}

// Loads slot `u` of the plan into shared memory; false (for the whole block) when u is unused.
__device__ __forceinline__ bool load_slot(const MoePlan* plan, int u, SlotPlan& r, int& s_n) {
  if (threadIdx.x < kSlotWords)
    reinterpret_cast<int*>(&r)[threadIdx.x] =
        reinterpret_cast<const int*>(&plan->slot[u])[threadIdx.x];
  if (threadIdx.x == 0) s_n = plan->n_unique;
  __syncthreads();
  return u < s_n;
}

// One K block of a warp's 16 x 8 FP4 tile: A from this warp's stage (src = row 0 of the stage at
// this block's column, lane offset t*4 included), B from the activation row of column g.
__device__ __forceinline__ void fp4_mma_step(const uint8_t* src, const uint8_t* sc0,
                                             const uint8_t* sc1, const uint8_t* act_g,
                                             const float* as0, const float* as1, int k,
                                             float (&acc)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint32_t q0 = *reinterpret_cast<const uint32_t*>(src + g * Fp4Stream::kRowStride);
  const uint32_t q1 = *reinterpret_cast<const uint32_t*>(src + (g + 8) * Fp4Stream::kRowStride);
  uint32_t b0 = 0, b1 = 0;
  if (act_g) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(act_g + k * 32 + t * 8));
    b0 = __byte_perm(v.x, v.y, 0x6420);  // elements [0,2,4,6]
    b1 = __byte_perm(v.x, v.y, 0x7531);  // elements [1,3,5,7]
  }
  uint32_t a[4];
  e2m1x8_to_e4m3_scaled(q0, a[0], a[2]);
  e2m1x8_to_e4m3_scaled(q1, a[1], a[3]);
  float d[4];
  mma_e4m3_16x8x32(d, a, b0, b1);
  const float sw0 = e8m0_to_f32(__ldg(sc0 + k));
  const float sw1 = e8m0_to_f32(__ldg(sc1 + k));
  // d holds the partial * 2^-6; (d * (sa * 2^6)) * sw is bitwise (partial * sa) * sw.
  const float sa0 = as0 ? __ldg(as0 + k) * kE2M1ToE4M3Rescale : 0.f;
  const float sa1 = as1 ? __ldg(as1 + k) * kE2M1ToE4M3Rescale : 0.f;
  acc[0] = fmaf(d[0] * sa0, sw0, acc[0]);
  acc[1] = fmaf(d[1] * sa1, sw0, acc[1]);
  acc[2] = fmaf(d[2] * sa0, sw1, acc[2]);
  acc[3] = fmaf(d[3] * sa1, sw1, acc[3]);
}

// One warp: acc[16 x 8] over K blocks [kb0, kb1) of a 16-row FP4 tile (rows tile + r * row_bytes)
// with per-row scales sc0 (row g) / sc1 (row g + 8), streamed through this warp's shared memory.
// act_g: this lane's B row (column g) or null; as0/as1: scales of columns 2t, 2t+1 or null.
__device__ __forceinline__ void fp4_warp_accumulate(uint8_t* wsm, const uint8_t* tile,
                                                    size_t row_bytes, const uint8_t* sc0,
                                                    const uint8_t* sc1, const uint8_t* act_g,
                                                    const float* as0, const float* as1, int kb0,
                                                    int kb1, float (&acc)[4]) {
  const int lane = threadIdx.x & 31, t = lane & 3;
  const int nchunks = (kb1 - kb0 + Fp4Stream::kChunkKb - 1) / Fp4Stream::kChunkKb;
  auto issue = [&](int c) {
    if (c < nchunks) {
      const int kb = kb0 + c * Fp4Stream::kChunkKb;
      Fp4Stream::issue(wsm + (c % Fp4Stream::kStages) * Fp4Stream::kStageBytes, tile, row_bytes, kb,
                       min(Fp4Stream::kChunkKb, kb1 - kb), lane);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int c = 0; c < Fp4Stream::kStages - 1; ++c) issue(c);
  for (int c = 0; c < nchunks; ++c) {
    issue(c + Fp4Stream::kStages - 1);
    cp_async_wait<Fp4Stream::kStages - 1>();
    __syncwarp();
    const uint8_t* src = wsm + (c % Fp4Stream::kStages) * Fp4Stream::kStageBytes + t * 4;
    const int kbc = kb0 + c * Fp4Stream::kChunkKb;
#pragma unroll
    for (int u = 0; u < Fp4Stream::kChunkKb; ++u) {
      const int k = kbc + u;
      if (k < kb1) {
        fp4_mma_step(src + u * 16, sc0, sc1, act_g, as0, as1, k, acc);
      }
    }
    __syncwarp();
  }
  cp_async_wait<0>();
}

struct W13Params {
  const uint8_t* w1;
  const uint8_t* w1s;
  const uint8_t* w3;
  const uint8_t* w3s;
  int E, dim, inter;
  const uint8_t* x;
  const float* xs;
  int m;
  const MoePlan* plan;
  float limit;
  uint8_t* h_codes;
  float* h_scales;
  float* partials;
  int* counters;
  int kb_per_split, splits;
};

__global__ void __launch_bounds__(kW13Warps * 32) moe_w13_kernel(const W13Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ SlotPlan r;
  __shared__ int s_n;
  __shared__ float s_acc[kW13Warps][128];
  __shared__ int s_last;
  pdl_trigger();
  pdl_wait();
  const int slot = blockIdx.z;
  if (!load_slot(p.plan, slot, r, s_n)) return;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int group = blockIdx.x;
  const int row = group * 32 + (warp & 1) * 16 + g;
  const bool up = warp >= 2;
  const size_t wrow = size_t(r.expert) * p.inter + row;
  const uint8_t* wm = up ? p.w3 : p.w1;
  const uint8_t* sm = up ? p.w3s : p.w1s;
  const int nkb = p.dim / 32;
  const uint8_t* wtile = wm + (wrow - g) * (p.dim / 2);
  const uint8_t* sc0 = sm + wrow * nkb;
  const uint8_t* sc1 = sc0 + size_t(8) * nkb;
  const uint8_t* act_g = g < r.count ? p.x + size_t(r.tok[g]) * p.dim : nullptr;
  const float* as0 = 2 * t < r.count ? p.xs + size_t(r.tok[2 * t]) * nkb : nullptr;
  const float* as1 = 2 * t + 1 < r.count ? p.xs + size_t(r.tok[2 * t + 1]) * nkb : nullptr;
  const int kb0 = blockIdx.y * p.kb_per_split;
  const int kb1 = min(nkb, kb0 + p.kb_per_split);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  fp4_warp_accumulate(smem + warp * Fp4Stream::kWarpBytes, wtile, size_t(p.dim / 2), sc0, sc1,
                      act_g, as0, as1, kb0, kb1, acc);

  if (p.splits > 1) {
    const int groups = p.inter / 32;
    const size_t tile = (size_t(slot) * groups + group) * (kW13Warps * 128);
    const size_t split_stride = size_t(gridDim.z) * groups * (kW13Warps * 128);
    const size_t frag = tile + warp * 128 + lane * 4;
    *reinterpret_cast<float4*>(p.partials + blockIdx.y * split_stride + frag) =
        make_float4(acc[0], acc[1], acc[2], acc[3]);
    __threadfence();
    __syncthreads();
    int* counter = p.counters + size_t(slot) * groups + group;
    if (threadIdx.x == 0) s_last = atomicAdd(counter, 1) == p.splits - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    float4 v = __ldcg(reinterpret_cast<const float4*>(p.partials + frag));
    acc[0] = v.x, acc[1] = v.y, acc[2] = v.z, acc[3] = v.w;
    for (int s = 1; s < p.splits; ++s) {
      v = __ldcg(reinterpret_cast<const float4*>(p.partials + s * split_stride + frag));
      acc[0] += v.x, acc[1] += v.y, acc[2] += v.z, acc[3] += v.w;
    }
    if (threadIdx.x == 0) *counter = 0;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) s_acc[warp][lane * 4 + i] = acc[i];
  __syncthreads();

  // Epilogue: warp w handles token columns 2w and 2w+1; lane = row within the 32-row group.
  const int rr = lane & 15, half = lane >> 4;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int c = 2 * warp + j;
    if (c >= r.count) break;  // warp-uniform
    const int idx = ((rr & 7) * 4 + (c >> 1)) * 4 + (rr >> 3) * 2 + (c & 1);
    float gate = round_bf16(s_acc[half][idx]);
    float upv = round_bf16(s_acc[2 + half][idx]);
    if (p.limit > 0.f) {
      upv = fminf(fmaxf(upv, -p.limit), p.limit);
      gate = fminf(gate, p.limit);
    }
    const float silu = gate / (1.0f + expf(-gate));
    const float h = round_bf16(r.weight[c] * (silu * upv));
    float s;
    const uint8_t code = warp_quant_fp8_block(h, &s);
    const int pair = r.pair[c];
    p.h_codes[size_t(pair) * p.inter + group * 32 + lane] = code;
    if (lane == 0) p.h_scales[size_t(pair) * (p.inter / 32) + group] = s;
  }
}

struct W2Params {
  const uint8_t* w2;
  const uint8_t* w2s;
  int E, dim, inter;
  int m;
  const MoePlan* plan;
  const uint8_t* h_codes;
  const float* h_scales;
  float* y;
  int64_t y_row_stride;
  int topk;
  bool round;
};

__global__ void __launch_bounds__(kW2Warps * 32) moe_w2_kernel(const W2Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ SlotPlan r;
  __shared__ int s_n;
  pdl_trigger();
  pdl_wait();
  if (!load_slot(p.plan, blockIdx.y, r, s_n)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int nkb = p.inter / 32;
  const size_t row_bytes = p.inter / 2;
  const uint8_t* act_g = g < r.count ? p.h_codes + size_t(r.pair[g]) * p.inter : nullptr;
  const float* as0 = 2 * t < r.count ? p.h_scales + size_t(r.pair[2 * t]) * nkb : nullptr;
  const float* as1 = 2 * t + 1 < r.count ? p.h_scales + size_t(r.pair[2 * t + 1]) * nkb : nullptr;
  const uint8_t* w_e = p.w2 + size_t(r.expert) * p.dim * row_bytes;
  const uint8_t* s_e_scale = p.w2s + size_t(r.expert) * p.dim * nkb;

  // This warp's tiles: tile0, tile0 + stride, ... One cp.async stream runs across all of them
  // (chunk c = tile c / cpt, K chunk c % cpt), so the next tile loads while this one computes.
  const int tiles = p.dim / 16, tile0 = blockIdx.x * kW2Warps + warp;
  const int stride = gridDim.x * kW2Warps;
  const int my_tiles = tile0 < tiles ? (tiles - tile0 + stride - 1) / stride : 0;
  const int cpt = (nkb + Fp4Stream::kChunkKb - 1) / Fp4Stream::kChunkKb;
  const int nchunks = my_tiles * cpt;
  uint8_t* wsm = smem + warp * Fp4Stream::kWarpBytes;
  auto issue = [&](int c) {
    if (c < nchunks) {
      const int tile = tile0 + (c / cpt) * stride, kb = (c % cpt) * Fp4Stream::kChunkKb;
      Fp4Stream::issue(wsm + (c % Fp4Stream::kStages) * Fp4Stream::kStageBytes,
                       w_e + size_t(tile) * 16 * row_bytes, row_bytes, kb,
                       min(Fp4Stream::kChunkKb, nkb - kb), lane);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int c = 0; c < Fp4Stream::kStages - 1; ++c) issue(c);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int c = 0; c < nchunks; ++c) {
    issue(c + Fp4Stream::kStages - 1);
    cp_async_wait<Fp4Stream::kStages - 1>();
    __syncwarp();
    const int tile = tile0 + (c / cpt) * stride, kbc = (c % cpt) * Fp4Stream::kChunkKb;
    const uint8_t* src = wsm + (c % Fp4Stream::kStages) * Fp4Stream::kStageBytes + t * 4;
    const uint8_t* sc0 = s_e_scale + (size_t(tile) * 16 + g) * nkb;
    const uint8_t* sc1 = sc0 + size_t(8) * nkb;
#pragma unroll
    for (int u = 0; u < Fp4Stream::kChunkKb; ++u) {
      const int k = kbc + u;
      if (k < nkb) fp4_mma_step(src + u * 16, sc0, sc1, act_g, as0, as1, k, acc);
    }
    __syncwarp();
    if (c % cpt == cpt - 1) {  // tile done: bf16-rounded outputs, then a fresh accumulator
      const int row0 = tile * 16;
      const int c0 = 2 * t, c1 = 2 * t + 1;
      auto out = [&](int pair) {
        return p.y + (pair / p.topk) * p.y_row_stride + size_t(pair % p.topk) * p.dim + row0;
      };
      if (c0 < r.count) {
        float* y = out(r.pair[c0]);
        y[g] = p.round ? round_bf16(acc[0]) : acc[0];
        y[g + 8] = p.round ? round_bf16(acc[2]) : acc[2];
      }
      if (c1 < r.count) {
        float* y = out(r.pair[c1]);
        y[g] = p.round ? round_bf16(acc[1]) : acc[1];
        y[g + 8] = p.round ? round_bf16(acc[3]) : acc[3];
      }
      acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    }
  }
  cp_async_wait<0>();
}

// out[t][n] = sum over t's valid experts in ascending id of y[pair][n]. grid (dim/256, m).
__global__ void __launch_bounds__(256)
    moe_combine_kernel(const float* y, const int* topk_idx, int topk, int E, int dim, float* out) {
  __shared__ int s_pair[8];
  __shared__ int s_count;
  pdl_trigger();
  pdl_wait();
  const int row = blockIdx.y;
  if (threadIdx.x == 0) {
    // Insertion sort of this row's (<= 8) experts by id.
    int ids[8], pairs[8], n = 0;
    for (int k = 0; k < topk; ++k) {
      const int e = topk_idx[row * topk + k];
      if (e < 0 || e >= E) continue;
      int j = n++;
      while (j > 0 && ids[j - 1] > e) {
        ids[j] = ids[j - 1];
        pairs[j] = pairs[j - 1];
        --j;
      }
      ids[j] = e;
      pairs[j] = row * topk + k;
    }
    for (int j = 0; j < n; ++j) s_pair[j] = pairs[j];
    s_count = n;
  }
  __syncthreads();
  const int col = blockIdx.x * 256 + threadIdx.x;
  if (col >= dim) return;
  float sum = 0.f;
  for (int j = 0; j < s_count; ++j) sum += y[size_t(s_pair[j]) * dim + col];
  out[size_t(row) * dim + col] = sum;
}

// Shared expert: gu [m, 2I] fp32 -> h codes/scales [m, I]. One warp per (row, 32-block).
__global__ void __launch_bounds__(256)
    swiglu_quant_kernel(const float* gu, int m, int inter, float limit, uint8_t* codes,
                        float* scales) {
  pdl_trigger();
  pdl_wait();
  const int nkb = inter / 32;
  const int item = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (item >= m * nkb) return;
  const int row = item / nkb, kb = item % nkb, lane = threadIdx.x & 31;
  const int col = kb * 32 + lane;
  float gate = round_bf16(gu[size_t(row) * 2 * inter + col]);
  float upv = round_bf16(gu[size_t(row) * 2 * inter + inter + col]);
  if (limit > 0.f) {
    upv = fminf(fmaxf(upv, -limit), limit);
    gate = fminf(gate, limit);
  }
  const float h = round_bf16((gate / (1.0f + expf(-gate))) * upv);
  float s;
  codes[size_t(row) * inter + col] = warp_quant_fp8_block(h, &s);
  if (lane == 0) scales[size_t(row) * nkb + kb] = s;
}

}  // namespace

MoeFp4::MoeFp4(int dim, int inter, int topk, int /*sm_count*/)
    : dim_(dim), inter_(inter), topk_(topk) {
  require(dim > 0 && inter > 0 && dim % 128 == 0 && inter % 32 == 0 && topk >= 1 &&
              kMaxDecodeRows * topk <= kMaxPairs,
          "MoeFp4: dim %d must be a multiple of 128, inter %d of 32, 8 * topk (%d) <= 64", dim,
          inter, topk);
  const int nkb = dim / 32;
  kb_per_split_ = std::min(nkb, kKbPerSplit);
  splits_ = (nkb + kb_per_split_ - 1) / kb_per_split_;
  UF_CUDA_CHECK(
      cudaFuncSetAttribute(moe_w13_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kW13Smem));
  UF_CUDA_CHECK(
      cudaFuncSetAttribute(moe_w2_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kW2Smem));
  prefer_shared_carveout(moe_plan_kernel);
  prefer_shared_carveout(moe_w13_kernel);
  prefer_shared_carveout(moe_w2_kernel);
  prefer_shared_carveout(moe_combine_kernel);
  prefer_shared_carveout(swiglu_quant_kernel);
  const size_t slots = size_t(kMaxDecodeRows) * topk;
  const size_t groups = inter / 32;
  UF_CUDA_CHECK(cudaMalloc(&plan_, sizeof(MoePlan)));
  UF_CUDA_CHECK(cudaMalloc(&h_codes_, slots * inter));
  UF_CUDA_CHECK(cudaMalloc(&h_scales_, sizeof(float) * slots * groups));
  UF_CUDA_CHECK(cudaMalloc(&y_, sizeof(float) * slots * dim));
  if (splits_ > 1) {
    UF_CUDA_CHECK(
        cudaMalloc(&partials_, sizeof(float) * splits_ * slots * groups * kW13Warps * 128));
    UF_CUDA_CHECK(cudaMalloc(&counters_, sizeof(int) * slots * groups));
    UF_CUDA_CHECK(cudaMemset(counters_, 0, sizeof(int) * slots * groups));
  }
}

MoeFp4::~MoeFp4() {
  cudaFree(plan_);
  cudaFree(h_codes_);
  cudaFree(h_scales_);
  cudaFree(y_);
  cudaFree(partials_);
  cudaFree(counters_);
}

void MoeFp4::run_experts_impl(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                              const float* topk_w, float swiglu_limit, bool round_w2, float* y,
                              int64_t y_row_stride, cudaStream_t stream) const {
  require(w.dim == dim_ && w.inter == inter_ && x.k == dim_ && x.m >= 1 && x.m <= kMaxDecodeRows,
          "MoeFp4::run: experts [dim %d, inter %d] / input [%d, %d] do not match the plan "
          "[dim %d, inter %d]",
          w.dim, w.inter, x.m, x.k, dim_, inter_);
  require(y_row_stride >= int64_t(topk_) * dim_,
          "MoeFp4::run_experts: row stride %lld < topk %d * dim %d",
          static_cast<long long>(y_row_stride), topk_, dim_);
  const int P = x.m * topk_;
  launch_pdl(moe_plan_kernel, dim3(1), dim3(kMaxPairs), 0, stream, topk_idx, topk_w, P, topk_,
             w.num_experts, static_cast<MoePlan*>(plan_));
  const MoePlan* plan = static_cast<const MoePlan*>(plan_);
  W13Params a{w.w1,     w.w1_scale, w.w3,      w.w3_scale, w.num_experts, dim_,
              inter_,   x.codes,    x.scales,  x.m,        plan,          swiglu_limit,
              h_codes_, h_scales_,  partials_, counters_,  kb_per_split_, splits_};
  launch_pdl(moe_w13_kernel, dim3(inter_ / 32, splits_, P), dim3(kW13Warps * 32), kW13Smem, stream,
             a);
  W2Params b{w.w2,      w.w2_scale, w.num_experts, dim_,  inter_,  x.m, plan, h_codes_,
             h_scales_, y,          y_row_stride,  topk_, round_w2};
  const int w2_blocks = (dim_ / 16 + kW2Warps * kW2TilesPerWarp - 1) / (kW2Warps * kW2TilesPerWarp);
  launch_pdl(moe_w2_kernel, dim3(w2_blocks, P), dim3(kW2Warps * 32), kW2Smem, stream, b);
}

void MoeFp4::run(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                 const float* topk_w, float swiglu_limit, float* out, cudaStream_t stream) const {
  run_experts_impl(w, x, topk_idx, topk_w, swiglu_limit, /*round_w2=*/true, y_,
                   int64_t(topk_) * dim_, stream);
  launch_pdl(moe_combine_kernel, dim3((dim_ + 255) / 256, x.m), dim3(256), 0, stream,
             static_cast<const float*>(y_), topk_idx, topk_, w.num_experts, dim_, out);
}

void MoeFp4::run_partial(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                         const float* topk_w, float swiglu_limit, float* out,
                         cudaStream_t stream) const {
  run_experts_impl(w, x, topk_idx, topk_w, swiglu_limit, /*round_w2=*/false, y_,
                   int64_t(topk_) * dim_, stream);
  launch_pdl(moe_combine_kernel, dim3((dim_ + 255) / 256, x.m), dim3(256), 0, stream,
             static_cast<const float*>(y_), topk_idx, topk_, w.num_experts, dim_, out);
}

void MoeFp4::run_experts(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                         const float* topk_w, float swiglu_limit, float* out, int64_t row_stride,
                         cudaStream_t stream) const {
  run_experts_impl(w, x, topk_idx, topk_w, swiglu_limit, /*round_w2=*/false, out, row_stride,
                   stream);
}

void swiglu_quant_fp8(const float* gu, int m, int inter, float swiglu_limit, uint8_t* codes,
                      float* scales, cudaStream_t stream) {
  require(m >= 1 && m <= kMaxDecodeRows && inter % 32 == 0,
          "swiglu_quant_fp8: m = %d must be in 1..8 and inter = %d a multiple of 32", m, inter);
  const int items = m * (inter / 32);
  launch_pdl(swiglu_quant_kernel, dim3((items + 7) / 8), dim3(256), 0, stream, gu, m, inter,
             swiglu_limit, codes, scales);
}

}  // namespace uf::cuda
