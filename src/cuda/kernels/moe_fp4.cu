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
// Persistent kernels (MoeKernels::kPersistent, the default where they fit; moe.h): the same
// products and reduction order as kernels 1 and 2, with a different assignment of work:
//   w13: grid = min(#SMs, P * I/32), 8 warps, one CTA per SM, walking items (distinct expert,
//     32-row group) blockIdx.x, + gridDim.x, ...; an item's 4 * S units (tile x K split) are
//     spread over the warps (5 units of 16 K blocks each at K = 5120), each unit's fragment goes
//     to a shared-memory partial buffer, and after one barrier per item warp c sums column c's
//     S partials in split order and runs the epilogue above. No global partials, no counters.
//   w2: grid = min(2 * #SMs, P * K/16), 8 warps, two CTAs per SM; every warp walks items
//     (distinct expert, 16-row tile) strided by the total warp count, one stage = a whole tile
//     (16 x I/2 bytes, contiguous) + its scales, all of I per item.
//   Both copy the plan and the activations (x rows / h rows) into shared memory once per CTA,
//   stream weights AND their UE8M0 scales through one cp.async ring per warp that runs across
//   item boundaries (no 1-byte global scale loads in the K loop), and keep the split count a
//   function of K only.
//
// Reduction order: per output, acc = 0; for kb in K order acc += (partial * a_scale) * w_scale
// (per-row weight scale); w13 splits (S from K only, never from M or the routing) summed in split
// order by the last block (counter, no float atomics); experts summed by expert id.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

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

// ---- Persistent kernels (MoeKernels::kPersistent) ----
// Same per-output arithmetic as the kernels above (fp4_mma_step's operations, K blocks in order,
// w13 splits of kb_per_split blocks summed in split order, w2 over all of I), so the outputs are
// bitwise those of the legacy path; only the assignment of work to warps and where operands are
// staged differ. Activations (x rows / h rows) and the plan are copied into shared memory once
// per CTA; weights AND their UE8M0 scales stream through one cp.async ring per warp that runs
// across work-item boundaries, so the next item's bytes are in flight during an epilogue.

constexpr int kPlanBytes = int((sizeof(MoePlan) + 15) / 16 * 16);
constexpr int kRows = 8;  // kMaxDecodeRows (usable in device code)

__device__ __forceinline__ void moe_cp16(void* dst, const void* src) {
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(uint32_t(__cvta_generic_to_shared(dst))),
      "l"(src)
      : "memory");
}
__device__ __forceinline__ void moe_cp4(void* dst, const void* src) {
  asm volatile(
      "cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(uint32_t(__cvta_generic_to_shared(dst))),
      "l"(src)
      : "memory");
}

// Copies the plan into shared memory (plain loads; the caller synchronises).
__device__ __forceinline__ void copy_plan(const MoePlan* plan, uint8_t* smem) {
  const int* src = reinterpret_cast<const int*>(plan);
  int* dst = reinterpret_cast<int*>(smem);
  for (int i = threadIdx.x; i < int(sizeof(MoePlan) / 4); i += blockDim.x) dst[i] = src[i];
}

// One K block of a 16 x 8 tile from shared memory: w = row 0 of the stage at this block's 16
// bytes with the lane's t * 4 included, rs = row stride; sw = the stage's scale bytes of rows g
// and g + 8 at this block; act_g / as0 / as1 as in fp4_mma_step (shared memory here).
__device__ __forceinline__ void fp4_mma_step_smem(const uint8_t* w, int rs, float sw0, float sw1,
                                                  const uint8_t* act_g, const float* as0,
                                                  const float* as1, int k, float (&acc)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint32_t q0 = *reinterpret_cast<const uint32_t*>(w + g * rs);
  const uint32_t q1 = *reinterpret_cast<const uint32_t*>(w + (g + 8) * rs);
  uint32_t b0 = 0, b1 = 0;
  if (act_g) {
    const uint2 v = *reinterpret_cast<const uint2*>(act_g + k * 32 + t * 8);
    b0 = __byte_perm(v.x, v.y, 0x6420);  // elements [0,2,4,6]
    b1 = __byte_perm(v.x, v.y, 0x7531);  // elements [1,3,5,7]
  }
  uint32_t a[4];
  e2m1x8_to_e4m3_scaled(q0, a[0], a[2]);
  e2m1x8_to_e4m3_scaled(q1, a[1], a[3]);
  float d[4];
  mma_e4m3_16x8x32(d, a, b0, b1);
  const float sa0 = as0 ? as0[k] * kE2M1ToE4M3Rescale : 0.f;
  const float sa1 = as1 ? as1[k] * kE2M1ToE4M3Rescale : 0.f;
  acc[0] = fmaf(d[0] * sa0, sw0, acc[0]);
  acc[1] = fmaf(d[1] * sa1, sw0, acc[1]);
  acc[2] = fmaf(d[2] * sa0, sw1, acc[2]);
  acc[3] = fmaf(d[3] * sa1, sw1, acc[3]);
}

// w13: grid = min(#SMs, P * I/32) CTAs of 8 warps, 1 per SM. Work item = (distinct expert u,
// 32-row group of I), items blockIdx.x, + gridDim.x, ... Within an item, unit q in [0, 4S) =
// (tile tau = q / S: w1 rows 0-15 / 16-31, w3 rows 0-15 / 16-31; K split s = q % S); warp w does
// units w, w + 8, ... (S = 10 at K = 5120: 5 units of 16 K blocks = 20 KB each per warp), each
// from acc = 0 over its split's K blocks in order, and stores the fragment to the item's partial
// buffer (two, alternating per item: one barrier per item). After the barrier, warp c (token
// column c) sums the S partials in split order, then SwiGLU + quantization as moe_w13_kernel.
// Stage = 8 K blocks of 16 rows (144-byte rows, conflict-free) + their 16 x 8 scale bytes.
constexpr int kPW13Warps = 8;
constexpr int kPW13Stages = 6;
constexpr int kPW13RowStride = 144;
constexpr int kPW13ScaleOff = 16 * kPW13RowStride;
constexpr int kPW13StageBytes = kPW13ScaleOff + 16 * 8;

struct PW13Layout {
  int x_stride, x_off, xs_off, part_off, part_bytes, stage_off, total;
};
__host__ __device__ __forceinline__ PW13Layout pw13_layout(int dim, int splits) {
  PW13Layout l;
  l.x_stride = dim + 32;  // rows 32 bytes apart mod 128: 8-byte B reads at most 2-way
  l.x_off = kPlanBytes;
  l.xs_off = l.x_off + kRows * l.x_stride;
  l.part_off = l.xs_off + kRows * (dim / 32) * 4;
  l.part_bytes = 4 * splits * 128 * 4;
  l.stage_off = l.part_off + 2 * l.part_bytes;
  l.total = l.stage_off + kPW13Warps * kPW13Stages * kPW13StageBytes;
  return l;
}

struct PW13Params {
  const uint8_t* w1;
  const uint8_t* w1s;
  const uint8_t* w3;
  const uint8_t* w3s;
  int dim, inter;
  const uint8_t* x;
  const float* xs;
  int m;
  const MoePlan* plan;
  float limit;
  uint8_t* h_codes;
  float* h_scales;
  int kb_per_split, splits;
};

__global__ void __launch_bounds__(kPW13Warps * 32, 1)
    moe_w13_persistent_kernel(const PW13Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  pdl_trigger();
  pdl_wait();
  const PW13Layout L = pw13_layout(p.dim, p.splits);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int nkb = p.dim / 32, groups = p.inter / 32, S = p.splits, kbps = p.kb_per_split;
  // Activations (group 0 of every thread's cp.async queue), then the plan.
  {
    const int per_row = p.dim / 16;
    for (int i = tid; i < p.m * per_row; i += blockDim.x) {
      const int r = i / per_row, c = i - r * per_row;
      moe_cp16(smem + L.x_off + r * L.x_stride + c * 16, p.x + size_t(r) * p.dim + c * 16);
    }
    for (int i = tid; i < p.m * nkb / 4; i += blockDim.x)  // [m][nkb] floats, nkb % 4 == 0
      moe_cp16(smem + L.xs_off + i * 16, p.xs + i * 4);
    cp_async_commit();
  }
  copy_plan(p.plan, smem);
  __syncthreads();
  const MoePlan& plan = *reinterpret_cast<const MoePlan*>(smem);
  const int n_items = plan.n_unique * groups;
  const int units = 4 * S;
  uint8_t* wsm = smem + L.stage_off + warp * (kPW13Stages * kPW13StageBytes);

  // Producer cursor: (item ordinal pli, unit ordinal pj, chunk pc), the consumer's sequence.
  int pli = 0, pj = 0, pc = 0, issued = 0;
  bool pvalid = warp < units && int(blockIdx.x) < n_items;
  auto issue = [&]() {
    if (pvalid) {
      const int item = blockIdx.x + pli * gridDim.x;
      const int u = item / groups, grp = item - u * groups;
      const int q = warp + pj * kPW13Warps, tau = q / S, s = q - tau * S;
      const int kbe = min(nkb, (s + 1) * kbps);
      const int kb = s * kbps + pc * 8;
      const int nk = min(8, kbe - kb);
      const size_t row0 = size_t(plan.slot[u].expert) * p.inter + grp * 32 + (tau & 1) * 16;
      const uint8_t* wm = tau >= 2 ? p.w3 : p.w1;
      const uint8_t* sm = tau >= 2 ? p.w3s : p.w1s;
      uint8_t* dst = wsm + (issued % kPW13Stages) * kPW13StageBytes;
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // 16 rows x nk 16-byte pieces; a warp op = 4 rows x 128 B
        const int qq = lane + 32 * i, r = qq >> 3, c = qq & 7;
        if (c < nk)
          moe_cp16(dst + r * kPW13RowStride + c * 16,
                   wm + (row0 + r) * size_t(p.dim / 2) + size_t(kb + c) * 16);
      }
      {  // 16 rows x nk scale bytes as 4-byte pieces (nk % 4 == 0)
        const int r = lane >> 1, h = lane & 1;
        if (h * 4 < nk)
          moe_cp4(dst + kPW13ScaleOff + r * 8 + h * 4, sm + (row0 + r) * nkb + kb + h * 4);
      }
      if (++pc == (kbe - s * kbps + 7) / 8) {
        pc = 0;
        if (warp + (++pj) * kPW13Warps >= units) {
          pj = 0;
          ++pli;
          pvalid = int(blockIdx.x + pli * gridDim.x) < n_items;
        }
      }
    }
    ++issued;
    cp_async_commit();
  };
  for (int c = 0; c < kPW13Stages - 1; ++c) issue();
  cp_async_wait<kPW13Stages - 1>();  // the activation group has landed (this thread's part)
  __syncthreads();                   // ... and every thread's

  const float* xs_s = reinterpret_cast<const float*>(smem + L.xs_off);
  int consumed = 0;
  for (int li = 0;; ++li) {
    const int item = blockIdx.x + li * gridDim.x;
    if (item >= n_items) break;
    const int u = item / groups, grp = item - u * groups;
    const SlotPlan& r = plan.slot[u];
    const int count = r.count;
    float* part = reinterpret_cast<float*>(smem + L.part_off + (li & 1) * L.part_bytes);
    const uint8_t* act_g = g < count ? smem + L.x_off + r.tok[g] * L.x_stride : nullptr;
    const float* as0 = 2 * t < count ? xs_s + r.tok[2 * t] * nkb : nullptr;
    const float* as1 = 2 * t + 1 < count ? xs_s + r.tok[2 * t + 1] * nkb : nullptr;
    for (int q = warp; q < units; q += kPW13Warps) {
      const int tau = q / S, s = q - tau * S;
      const int kbe = min(nkb, (s + 1) * kbps);
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int kb = s * kbps; kb < kbe; kb += 8) {
        issue();
        cp_async_wait<kPW13Stages - 1>();
        __syncwarp();
        const uint8_t* st = wsm + (consumed % kPW13Stages) * kPW13StageBytes;
        ++consumed;
        const int nk = min(8, kbe - kb);
#pragma unroll
        for (int uu = 0; uu < 8; ++uu) {
          if (uu < nk) {
            const float sw0 = e8m0_to_f32(st[kPW13ScaleOff + g * 8 + uu]);
            const float sw1 = e8m0_to_f32(st[kPW13ScaleOff + (g + 8) * 8 + uu]);
            fp4_mma_step_smem(st + uu * 16 + t * 4, kPW13RowStride, sw0, sw1, act_g, as0, as1,
                              kb + uu, acc);
          }
        }
        __syncwarp();
      }
      *reinterpret_cast<float4*>(part + (tau * S + s) * 128 + lane * 4) =
          make_float4(acc[0], acc[1], acc[2], acc[3]);
    }
    __syncthreads();  // the item's partials are complete; the other buffer is free again

    // Epilogue: warp c = token column c; lane = row within the 32-row group.
    const int c = warp;
    if (c < count) {  // warp-uniform
      const int rr = lane & 15, half = lane >> 4;
      const int idx = ((rr & 7) * 4 + (c >> 1)) * 4 + (rr >> 3) * 2 + (c & 1);
      const float* pg = part + (half * S) * 128 + idx;
      const float* pu = part + ((2 + half) * S) * 128 + idx;
      float ga = pg[0], ua = pu[0];
      for (int s = 1; s < S; ++s) {  // split order, as the legacy last-block reduction
        ga += pg[s * 128];
        ua += pu[s * 128];
      }
      float gate = round_bf16(ga);
      float upv = round_bf16(ua);
      if (p.limit > 0.f) {
        upv = fminf(fmaxf(upv, -p.limit), p.limit);
        gate = fminf(gate, p.limit);
      }
      const float silu = gate / (1.0f + expf(-gate));
      const float h = round_bf16(r.weight[c] * (silu * upv));
      float sc;
      const uint8_t code = warp_quant_fp8_block(h, &sc);
      const int pair = r.pair[c];
      p.h_codes[size_t(pair) * p.inter + grp * 32 + lane] = code;
      if (lane == 0) p.h_scales[size_t(pair) * groups + grp] = sc;
    }
  }
  cp_async_wait<0>();
}

// w2: grid = min(2 * #SMs, P * K/16) CTAs of 8 warps, 2 per SM. Work item = (distinct expert u,
// 16-row output tile): a warp takes items gw, gw + (all warps), ... (gw = global warp id), one
// stage per item: the tile's 16 rows x I/2 bytes (contiguous in memory) + its 16 x I/32 scale
// bytes, so one cp.async ring per warp runs over all of its tiles. K loop over all of I in
// order from acc = 0, outputs as moe_w2_kernel.
constexpr int kPW2Warps = 8;
constexpr int kPW2Stages = 4;
constexpr int kPW2CtasPerSm = 2;

struct PW2Layout {
  int rs, stage_sc, stage_bytes, h_off, hs_off, stage_off, total;
};
__host__ __device__ __forceinline__ PW2Layout pw2_layout(int inter, int slots) {
  PW2Layout l;
  const int nkb = inter / 32;
  // Row stride = 16 mod 32 bytes: the 8 rows g of a 4-byte fragment read hit distinct banks.
  l.rs = inter / 2 + ((inter / 2) % 32 == 0 ? 16 : 0);
  l.stage_sc = 16 * l.rs;
  l.stage_bytes = l.stage_sc + 16 * nkb;
  l.h_off = kPlanBytes;
  l.hs_off = l.h_off + slots * inter;
  l.stage_off = l.hs_off + (slots * nkb * 4 + 15) / 16 * 16;
  l.total = l.stage_off + kPW2Warps * kPW2Stages * l.stage_bytes;
  return l;
}

struct PW2Params {
  const uint8_t* w2;
  const uint8_t* w2s;
  int dim, inter;
  int pairs, slots;
  const MoePlan* plan;
  const uint8_t* h_codes;
  const float* h_scales;
  float* y;
  int64_t y_row_stride;
  int topk;
  bool round;
};

__global__ void __launch_bounds__(kPW2Warps * 32, kPW2CtasPerSm)
    moe_w2_persistent_kernel(const PW2Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  pdl_trigger();
  pdl_wait();
  const PW2Layout L = pw2_layout(p.inter, p.slots);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int nkb = p.inter / 32;
  {
    const int pieces = p.pairs * p.inter / 16;  // [pairs][inter] codes, contiguous
    for (int i = tid; i < pieces; i += blockDim.x)
      moe_cp16(smem + L.h_off + i * 16, p.h_codes + size_t(i) * 16);
    for (int i = tid; i < p.pairs * nkb; i += blockDim.x)
      moe_cp4(smem + L.hs_off + i * 4, p.h_scales + i);
    cp_async_commit();
  }
  copy_plan(p.plan, smem);
  __syncthreads();
  const MoePlan& plan = *reinterpret_cast<const MoePlan*>(smem);
  const int tiles = p.dim / 16;
  const int n_items = plan.n_unique * tiles;
  const int gw = blockIdx.x * kPW2Warps + warp, stride = gridDim.x * kPW2Warps;
  const int tile_bytes = 8 * p.inter;  // 16 rows x inter / 2
  const int per_row = nkb;             // 16-byte pieces per row (inter / 2 / 16)
  uint8_t* wsm = smem + L.stage_off + warp * (kPW2Stages * L.stage_bytes);
  int next = gw, issued = 0;
  auto issue = [&]() {
    if (next < n_items) {
      const int u = next / tiles, tile = next - u * tiles;
      const size_t row0 = size_t(plan.slot[u].expert) * p.dim + size_t(tile) * 16;
      const uint8_t* src = p.w2 + row0 * (p.inter / 2);
      uint8_t* dst = wsm + (issued % kPW2Stages) * L.stage_bytes;
      for (int i = lane; i < tile_bytes / 16; i += 32) {
        const int r = i / per_row, c = i - r * per_row;
        moe_cp16(dst + r * L.rs + c * 16, src + size_t(i) * 16);
      }
      const uint8_t* ssrc = p.w2s + row0 * nkb;  // 16 * nkb bytes, contiguous
      for (int i = lane; i < nkb; i += 32) moe_cp16(dst + L.stage_sc + i * 16, ssrc + i * 16);
      next += stride;
    }
    ++issued;
    cp_async_commit();
  };
  for (int c = 0; c < kPW2Stages - 1; ++c) issue();
  cp_async_wait<kPW2Stages - 1>();  // the h group has landed
  __syncthreads();

  const float* hs = reinterpret_cast<const float*>(smem + L.hs_off);
  int consumed = 0;
  int cur_u = -1;
  const uint8_t* act_g = nullptr;
  const float *as0 = nullptr, *as1 = nullptr;
  int pair0 = -1, pair1 = -1;
  for (int q = gw; q < n_items; q += stride) {
    const int u = q / tiles, tile = q - u * tiles;
    if (u != cur_u) {
      cur_u = u;
      const SlotPlan& r = plan.slot[u];
      act_g = g < r.count ? smem + L.h_off + r.pair[g] * p.inter : nullptr;
      as0 = 2 * t < r.count ? hs + r.pair[2 * t] * nkb : nullptr;
      as1 = 2 * t + 1 < r.count ? hs + r.pair[2 * t + 1] * nkb : nullptr;
      pair0 = 2 * t < r.count ? r.pair[2 * t] : -1;
      pair1 = 2 * t + 1 < r.count ? r.pair[2 * t + 1] : -1;
    }
    issue();
    cp_async_wait<kPW2Stages - 1>();
    __syncwarp();
    const uint8_t* st = wsm + (consumed % kPW2Stages) * L.stage_bytes;
    ++consumed;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < nkb; ++k) {
      const float sw0 = e8m0_to_f32(st[L.stage_sc + g * nkb + k]);
      const float sw1 = e8m0_to_f32(st[L.stage_sc + (g + 8) * nkb + k]);
      fp4_mma_step_smem(st + k * 16 + t * 4, L.rs, sw0, sw1, act_g, as0, as1, k, acc);
    }
    __syncwarp();
    const int row0 = tile * 16;
    auto out = [&](int pair) {
      return p.y + (pair / p.topk) * p.y_row_stride + size_t(pair % p.topk) * p.dim + row0;
    };
    if (pair0 >= 0) {
      float* y = out(pair0);
      y[g] = p.round ? round_bf16(acc[0]) : acc[0];
      y[g + 8] = p.round ? round_bf16(acc[2]) : acc[2];
    }
    if (pair1 >= 0) {
      float* y = out(pair1);
      y[g] = p.round ? round_bf16(acc[1]) : acc[1];
      y[g + 8] = p.round ? round_bf16(acc[3]) : acc[3];
    }
  }
  cp_async_wait<0>();
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

MoeFp4::MoeFp4(int dim, int inter, int topk, int sm_count)
    : dim_(dim), inter_(inter), topk_(topk), sm_count_(sm_count) {
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
  {  // Persistent kernels: only where their shared-memory plan fits one block's opt-in limit.
    int device = 0, optin = 0;
    UF_CUDA_CHECK(cudaGetDevice(&device));
    UF_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (sm_count_ <= 0)
      UF_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device));
    const int w13 = pw13_layout(dim, splits_).total;
    const int w2 = pw2_layout(inter, int(slots)).total;
    // At the TP8 slice (dim 5120, inter 288, top-6): w13 206 KB (one CTA per SM), w2 98 KB (two).
    if (w13 <= optin && w2 <= optin) {
      w13_smem_ = w13;
      w2_smem_ = w2;
      // The attribute belongs to the kernel, not to this plan: only ever raise it, or a plan
      // with a smaller layout (a DSpark stage's MoE, another TP split) would make the launches of
      // an earlier, larger one invalid.
      auto raise_smem = [](auto kernel, int bytes) {
        cudaFuncAttributes fa{};
        UF_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
        if (fa.maxDynamicSharedSizeBytes < bytes)
          UF_CUDA_CHECK(
              cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
      };
      raise_smem(moe_w13_persistent_kernel, w13);
      raise_smem(moe_w2_persistent_kernel, w2);
      prefer_shared_carveout(moe_w13_persistent_kernel);
      prefer_shared_carveout(moe_w2_persistent_kernel);
    }
  }
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
  auto aligned = [](const void* ptr, uintptr_t a) {
    return reinterpret_cast<uintptr_t>(ptr) % a == 0;
  };
  const bool persistent = kernels_ == MoeKernels::kPersistent && persistent_supported() &&
                          aligned(w.w1, 16) && aligned(w.w3, 16) && aligned(w.w2, 16) &&
                          aligned(w.w1_scale, 4) && aligned(w.w3_scale, 4) &&
                          aligned(w.w2_scale, 16) && aligned(x.codes, 16) && aligned(x.scales, 16);
  if (persistent) {
    const int groups = inter_ / 32;
    PW13Params a{w.w1,         w.w1_scale, w.w3,      w.w3_scale,    dim_,
                 inter_,       x.codes,    x.scales,  x.m,           plan,
                 swiglu_limit, h_codes_,   h_scales_, kb_per_split_, splits_};
    launch_pdl(moe_w13_persistent_kernel, dim3(std::min(sm_count_, P * groups)),
               dim3(kPW13Warps * 32), size_t(w13_smem_), stream, a);
    const int slots = kMaxDecodeRows * topk_;
    PW2Params b{w.w2,     w.w2_scale, dim_, inter_,       P,     slots,   plan,
                h_codes_, h_scales_,  y,    y_row_stride, topk_, round_w2};
    launch_pdl(moe_w2_persistent_kernel, dim3(std::min(kPW2CtasPerSm * sm_count_, P * (dim_ / 16))),
               dim3(kPW2Warps * 32), size_t(w2_smem_), stream, b);
    return;
  }
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
  moe_combine_rows(y_, topk_idx, x.m, topk_, w.num_experts, dim_, out, stream);
}

void moe_combine_rows(const float* y, const int* topk_idx, int m, int topk, int num_experts,
                      int dim, float* out, cudaStream_t stream) {
  require(m >= 1 && m <= 65535 && topk <= 8, "moe_combine_rows: %d rows, top-%d", m, topk);
  launch_pdl(moe_combine_kernel, dim3((dim + 255) / 256, m), dim3(256), 0, stream, y, topk_idx,
             topk, num_experts, dim, out);
}

void MoeFp4::run_partial(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                         const float* topk_w, float swiglu_limit, float* out,
                         cudaStream_t stream) const {
  run_experts_impl(w, x, topk_idx, topk_w, swiglu_limit, /*round_w2=*/false, y_,
                   int64_t(topk_) * dim_, stream);
  moe_combine_rows(y_, topk_idx, x.m, topk_, w.num_experts, dim_, out, stream);
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
