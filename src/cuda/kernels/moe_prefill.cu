// MoeFp4Prefill (cuda/moe.h): the routed-expert MoE for prefill chunks of many rows, grouped by
// expert so that each selected expert's weights are read once per call (not once per 8 rows).
//
// Kernels:
//   0. prefill_quant_kernel: x fp32 [m, K] -> FP8 codes + scales per 32 (act_quant_fp8_f32's
//      operations, any m).
//   1. prefill_plan_kernel (one block): the P = m * topk (row, expert) pairs sorted by expert id
//      (stable: ascending pair index, i.e. ascending row, within an expert; a counting sort over
//      segments of the pairs, a warp each) into `sorted`, and a work list of items
//      (expert, first sorted position, n <= C columns): an expert with c pairs makes
//      ceil(c / C) items, C = MoeFp4Prefill::item_cols (16 or 64: kSmallCols, kCols). Invalid
//      ids (< 0, >= E) select nothing.
//   2. prefill_w13_kernel: grid (I/32, max items), 4 warps as moe_w13_kernel (w1 rows 0-15 /
//      16-31, w3 rows 0-15 / 16-31 of one 32-row group). Each K block's weight fragment is loaded
//      and decoded once and applied to all kCols / 8 column groups of the item. Then the decode
//      epilogue (SwiGLU, routing weight, FP8 quantisation of h) per column; h goes to its sorted
//      position.
//   3. prefill_w2_kernel: grid (K/16 / 8, max items), 8 warps, one 16-row output tile per warp,
//      all column groups of the item; y of pair (t, k) at y + t * y_row_stride + k * dim.
//   2b / 3b. prefill_w13_f16_kernel<C> / prefill_w2_f16_kernel<C> (MoeFp4Prefill::set_f16(true),
//      the default): the same work with the mma as f16 HMMAs and each operand converted once (see
//      "The f16 path" below), for items of C = 16 or 64 columns; 2 / 3 remain selectable
//      (set_f16(false), 64-column items), bitwise the same.
//   3c. prefill_w2_tiles_f16_kernel<C>: 3b for inter / 32 <= 16 K blocks (a TP rank's slice),
//      the activations staged once a CTA and kW2Tiles tiles a warp (the default there).
//   4. moe_combine_rows (moe_fp4.cu): out[t] = sum over t's valid experts in ascending id of y
//      (fp32, from 0).
// Every kernel is PDL-launched: it waits for its predecessor first, then lets its dependents
// launch, so a chunk's eager launches leave no launch gap between them (~3-4 us each otherwise).
//
// Activations are staged: per split of kStageKb K blocks, the CTA's threads copy the item's
// columns (FP8 codes in 16-byte pieces, and their scales) into shared memory with cp.async, two
// stages deep (the next split's land while this one computes), and the warps read their B
// fragments there. (They were read from L2 per K block and column group, one
// dependent round trip per mma: the w13 kernel ran at ~14 TFLOP/s on a 512-row chunk.) The
// weights are loaded kLoadKb K blocks ahead of their use.
//
// Numerics: per (row, expert) output bitwise the decode kernels' (moe_fp4.cu): the same
// m16n8k32 e4m3 products (an mma output depends only on its own row of A and column of B), the
// same per-K-block update acc = fmaf(d * (sa * 2^6), sw, acc), w13 in splits of kKbPerSplit K
// blocks each accumulated from 0 and summed in split order (first split's value, then += the
// next), the same epilogue expressions, w2 over all of I from 0, the same combine order.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/mma_f16.cuh"
#include "cuda/moe.h"

namespace uf::cuda {
namespace {

using namespace detail;

constexpr int kCols = 64;           // columns (pairs) per item: 8 mma column groups
constexpr int kGroups = kCols / 8;  // column groups per item
// The f16 kernels also take items of kSmallCols columns (MoeFp4Prefill::item_cols): a quarter of
// the shared memory and far fewer registers, so twice the CTAs an SM, for calls whose experts
// average at most kSmallColsMaxMean pairs (a 512-row chunk of top-6 over 384 experts: 8). An
// expert with more pairs than that is then cut into more items (its weights read once per item).
constexpr int kSmallCols = 16;
constexpr int kSmallColsMaxMean = 12;
// prefill_w13_f16_kernel<kSmallCols>: K blocks a straight run of its chunk loop and its CTAs an
// SM. 1 / 5 (no spills) measured 60.36 / 60.07 ms a 512-row chunk against 61.03 / 60.78 with 2 /
// 5 and 61.80 / 61.90 with 4 / 3 (H200, same run; the same bits: the updates' order does not
// depend on the runs). Build-time knobs for A/B tests (scripts/build-variant).
#ifndef UF_MOE_W13_SMALL_Q
#define UF_MOE_W13_SMALL_Q 1
#endif
#ifndef UF_MOE_W13_SMALL_BLOCKS
#define UF_MOE_W13_SMALL_BLOCKS 5
#endif
constexpr int kW13SmallQ = UF_MOE_W13_SMALL_Q, kW13SmallBlocks = UF_MOE_W13_SMALL_BLOCKS;
constexpr int kKbPerSplitDecode = 16;  // moe_fp4.cu kKbPerSplit (w13 split-K of the decode path)
constexpr int kPlanThreads = 1024;
constexpr int kW13Warps = 4;
constexpr int kW2Warps = 8;
// Staged activations: kStageKb K blocks (one decode split) of up to kCols columns, rows padded
// by 16 bytes (the 8 columns of a fragment read fall on different banks), then the scales.
constexpr int kStageKb = kKbPerSplitDecode;
constexpr int kStageRow = kStageKb * 32 + 16;
constexpr int kStageBytes = kCols * kStageRow + kCols * kStageKb * int(sizeof(float));

// Plan buffers (device): sorted [P], items [3 * max_items] (expert, pos0, n), n_items [1].
// The pairs are cut into kPlanSegs segments of whole 32-pair steps, one warp each: a warp counts
// its segment's pairs per expert, the counts' prefix (experts in order, then segments in order)
// gives each (segment, expert) its first sorted position, and the warp walks its segment again
// writing positions in lane order (__match_any_sync). Positions within an expert therefore
// ascend with the pair index, as one warp walking every pair in order gives (session 14's
// kernel, 96 dependent steps at P = 3072; with the one-thread scan over the experts it took
// ~40 us, on the prefill MoE's critical path since the linear layers got faster).
constexpr int kPlanSegs = 16;
static_assert(kPlanSegs <= kPlanThreads / 32, "a warp per segment");
size_t plan_smem_bytes(size_t P, int E) {
  return sizeof(int) * (P + size_t(E) + 1 + 2 * size_t(E) + size_t(kPlanSegs) * E);
}
__global__ void __launch_bounds__(kPlanThreads)
    prefill_plan_kernel(const int* topk_idx, int P, int E, int cols, int* sorted, int* items,
                        int* n_items) {
  pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  pdl_trigger();
  extern __shared__ int psm[];
  int* s_e = psm;                // [P] expert of each pair (-1: invalid)
  int* s_off = psm + P;          // [E + 1] first sorted position of each expert
  int* s_item0 = s_off + E + 1;  // [E] first item of each expert
  int* s_tot = s_item0 + E;      // [E] pairs of each expert
  int* s_seg = s_tot + E;        // [kPlanSegs][E] counts, then each segment's next position
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < P; i += blockDim.x) {
    const int e = topk_idx[i];
    s_e[i] = (e < 0 || e >= E) ? -1 : e;
  }
  for (int i = tid; i < kPlanSegs * E; i += blockDim.x) s_seg[i] = 0;
  __syncthreads();
  const int seg_len = (P + kPlanSegs * 32 - 1) / (kPlanSegs * 32) * 32;
  // f(e, peers) for each 32-pair step of this warp's segment, in order (lanes past it: e = -1).
  auto walk = [&](auto&& f) {
    const int j_end = min(P, (warp + 1) * seg_len);
    for (int j0 = warp * seg_len; j0 < j_end; j0 += 32) {
      const int j = j0 + lane;
      const int e = j < j_end ? s_e[j] : -1;
      f(j, e, __match_any_sync(0xffffffffu, e));
    }
  };
  if (warp < kPlanSegs)
    walk([&](int, int e, unsigned peers) {
      if (e >= 0 && lane == __ffs(peers) - 1) s_seg[warp * E + e] += __popc(peers);
      __syncwarp();  // the next step's leader of e reads this count
    });
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {
    int c = 0;
    for (int w = 0; w < kPlanSegs; ++w) c += s_seg[w * E + e];
    s_tot[e] = c;
  }
  __syncthreads();
  if (warp == 0) {  // exclusive prefix of pairs and of items over the experts: lane = a range
    const int per = (E + 31) / 32, e0 = min(E, lane * per), e1 = min(E, e0 + per);
    int c = 0, it = 0;
    for (int e = e0; e < e1; ++e) c += s_tot[e], it += (s_tot[e] + cols - 1) / cols;
    int ci = c, iti = it;  // inclusive scans over the lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int a = __shfl_up_sync(0xffffffffu, ci, o), b = __shfl_up_sync(0xffffffffu, iti, o);
      if (lane >= o) ci += a, iti += b;
    }
    int pos = ci - c, item = iti - it;
    for (int e = e0; e < e1; ++e) {
      s_off[e] = pos;
      s_item0[e] = item;
      pos += s_tot[e];
      item += (s_tot[e] + cols - 1) / cols;
    }
    if (lane == 31) {
      s_off[E] = ci;
      *n_items = iti;
    }
  }
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {  // each segment's first position of expert e
    int run = s_off[e];
    for (int w = 0; w < kPlanSegs; ++w) {
      const int c = s_seg[w * E + e];
      s_seg[w * E + e] = run;
      run += c;
    }
  }
  __syncthreads();
  if (warp < kPlanSegs)
    walk([&](int j, int e, unsigned peers) {
      const int pos = e >= 0 ? s_seg[warp * E + e] : 0;
      __syncwarp();  // every lane has read its position before the leaders advance it
      if (e >= 0) {
        sorted[pos + __popc(peers & ((1u << lane) - 1u))] = j;
        if (lane == __ffs(peers) - 1) s_seg[warp * E + e] = pos + __popc(peers);
      }
      __syncwarp();
    });
  for (int e = warp; e < E; e += blockDim.x / 32) {
    const int base = s_off[e], count = s_off[e + 1] - base;
    for (int q = lane; q * cols < count; q += 32) {
      int* it = items + 3 * (s_item0[e] + q);
      it[0] = e;
      it[1] = base + q * cols;
      it[2] = min(cols, count - q * cols);
    }
  }
}

// x fp32 [m, k] -> codes / scales: act_quant_kernel's operations (one warp per (row, 32-block)).
__global__ void __launch_bounds__(256)
    prefill_quant_kernel(const float* x, int m, int k, uint8_t* codes, float* scales) {
  pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  pdl_trigger();
  const int nkb = k / 32;
  const int64_t item = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (item >= int64_t(m) * nkb) return;
  const int row = int(item / nkb), kb = int(item % nkb), lane = threadIdx.x & 31;
  const size_t idx = size_t(row) * k + kb * 32 + lane;
  float s;
  codes[idx] = warp_quant_fp8_block(x[idx], &s);
  if (lane == 0) scales[size_t(row) * nkb + kb] = s;
}

struct PrefillW13Params {
  const uint8_t* w1;
  const uint8_t* w1s;
  const uint8_t* w3;
  const uint8_t* w3s;
  int dim, inter, topk;
  const uint8_t* x;     // [m, dim] codes
  const float* xs;      // [m, dim / 32]
  const float* topk_w;  // [m * topk]
  const int* sorted;
  const int* items;
  const int* n_items;
  float limit;
  uint8_t* h_codes;  // [P sorted positions, inter]
  float* h_scales;   // [P, inter / 32]
};

// The w13 epilogue, moe_w13_kernel's: s_acc[warp][column group][128] holds the four warps'
// accumulator tiles (w1 rows 0-15 / 16-31, w3 rows 0-15 / 16-31 of row group `group`); one warp a
// column c < n, lane = row within the group: g = bf16(w1 x), u = bf16(w3 x), the clamps,
// h = bf16(w * silu(g) * u), its FP8 code and the scale of the 32 rows, at sorted position pos0 +
// c.
template <int G>
__device__ __forceinline__ void w13_store(const PrefillW13Params& p, const float (*s_acc)[G][128],
                                          const int* s_pair, int n, int pos0, int group) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rr = lane & 15, half = lane >> 4;
  for (int c = warp; c < n; c += kW13Warps) {
    const int cg = c >> 3, cc = c & 7;
    const int idx = ((rr & 7) * 4 + (cc >> 1)) * 4 + (rr >> 3) * 2 + (cc & 1);
    float gate = round_bf16(s_acc[half][cg][idx]);
    float upv = round_bf16(s_acc[2 + half][cg][idx]);
    if (p.limit > 0.f) {
      upv = fminf(fmaxf(upv, -p.limit), p.limit);
      gate = fminf(gate, p.limit);
    }
    const float silu = gate / (1.0f + expf(-gate));
    const float h = round_bf16(p.topk_w[s_pair[c]] * (silu * upv));
    float sc;
    const uint8_t code = warp_quant_fp8_block(h, &sc);
    const size_t pos = size_t(pos0) + c;
    p.h_codes[pos * p.inter + group * 32 + lane] = code;
    if (lane == 0) p.h_scales[pos * (p.inter / 32) + group] = sc;
  }
}

// A cp.async of 16 bytes (common.cuh's cp16_zfill) or 4 to shared dst; !valid zero-fills it.
__device__ __forceinline__ void cp_async_zfill(void* dst, const void* src, int bytes, bool valid) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
  if (bytes == 16)
    cp16_zfill(d, src, valid);
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src),
                 "r"(valid ? 4 : 0)
                 : "memory");
}

// Stages K blocks [kb0, kb0 + kbn) of the columns c < ncols (column c: activation row act_row(c),
// -1 = none: zeros) into stage with cp.async (one commit group; the caller waits for it and
// synchronises): codes at c * kStageRow, then the scales [kCols][kStageKb] as stored (the caller
// applies kE2M1ToE4M3Rescale, as the unstaged kernel did). A missing column is zero-filled by a
// cp.async of source size 0. All threads of the CTA.
template <typename RowOf>
__device__ __forceinline__ void stage_act(uint8_t* stage, int ncols, RowOf act_row,
                                          const uint8_t* act, const float* act_s, int act_k,
                                          int nkb, int kb0, int kbn) {
  const int pieces = kbn * 2;  // 16-byte pieces of a column's kbn blocks
  for (int i = threadIdx.x; i < ncols * pieces; i += blockDim.x) {
    const int c = i / pieces, q = i % pieces, row = act_row(c);
    const uint8_t* src = act + size_t(row >= 0 ? row : 0) * act_k + size_t(kb0) * 32 + q * 16;
    cp_async_zfill(stage + c * kStageRow + q * 16, src, 16, row >= 0);
  }
  float* sc = reinterpret_cast<float*>(stage + kCols * kStageRow);
  for (int i = threadIdx.x; i < ncols * kbn; i += blockDim.x) {
    const int c = i / kbn, j = i % kbn, row = act_row(c);
    cp_async_zfill(sc + c * kStageKb + j, act_s + size_t(row >= 0 ? row : 0) * nkb + kb0 + j, 4,
                   row >= 0);
  }
  cp_async_commit();
}

// One K block (kl: its index in the stage) of the mma for all column groups: A = this lane's
// decoded fragment, B from the staged columns. The update is fp4_mma_step's, operation for
// operation (a missing column has zero codes and a zero scale, as the unstaged kernel used).
__device__ __forceinline__ void prefill_kb(const uint32_t (&a)[4], float sw0, float sw1, int kl,
                                           int ngroups, const uint8_t* stage,
                                           float (&acc)[kGroups][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const float* sc = reinterpret_cast<const float*>(stage + kCols * kStageRow);
#pragma unroll
  for (int cg = 0; cg < kGroups; ++cg) {
    if (cg < ngroups) {
      const uint2 v =
          *reinterpret_cast<const uint2*>(stage + (cg * 8 + g) * kStageRow + kl * 32 + t * 8);
      const uint32_t b0 = __byte_perm(v.x, v.y, 0x6420);
      const uint32_t b1 = __byte_perm(v.x, v.y, 0x7531);
      float d[4];
      mma_e4m3_16x8x32(d, a, b0, b1);
      const int c0 = cg * 8 + 2 * t;
      const float sa0 = sc[c0 * kStageKb + kl] * kE2M1ToE4M3Rescale;
      const float sa1 = sc[(c0 + 1) * kStageKb + kl] * kE2M1ToE4M3Rescale;
      acc[cg][0] = fmaf(d[0] * sa0, sw0, acc[cg][0]);
      acc[cg][1] = fmaf(d[1] * sa1, sw0, acc[cg][1]);
      acc[cg][2] = fmaf(d[2] * sa0, sw1, acc[cg][2]);
      acc[cg][3] = fmaf(d[3] * sa1, sw1, acc[cg][3]);
    }
  }
}

// K blocks [k0, kb1) of one 16-row weight tile (rows r0 = g, r1 = g + 8, scales sc0 / sc1), in
// order, kLoadKb at a time: the weight words and scales of kLoadKb blocks are loaded before any
// is used (memory-level parallelism; the order of the updates is unchanged). The activations of
// those blocks are in stage (staged from K block k0).
constexpr int kLoadKb = 8;
__device__ __forceinline__ void weight_steps(const uint8_t* r0, const uint8_t* r1,
                                             const uint8_t* sc0, const uint8_t* sc1, int k0,
                                             int kb1, int ngroups, const uint8_t* stage,
                                             float (&acc)[kGroups][4]) {
  const int t = threadIdx.x & 3;
  for (int kc = k0; kc < kb1; kc += kLoadKb) {
    uint32_t q0[kLoadKb], q1[kLoadKb];
    float sw0[kLoadKb], sw1[kLoadKb];
#pragma unroll
    for (int u = 0; u < kLoadKb; ++u) {
      const int k = min(kc + u, kb1 - 1);  // past the end: a valid address, never used
      q0[u] = ld_nc_u32(r0 + k * 16 + t * 4);
      q1[u] = ld_nc_u32(r1 + k * 16 + t * 4);
      sw0[u] = e8m0_to_f32(__ldg(sc0 + k));
      sw1[u] = e8m0_to_f32(__ldg(sc1 + k));
    }
#pragma unroll
    for (int u = 0; u < kLoadKb; ++u) {
      if (kc + u < kb1) {
        uint32_t a[4];
        e2m1x8_to_e4m3_scaled(q0[u], a[0], a[2]);
        e2m1x8_to_e4m3_scaled(q1[u], a[1], a[3]);
        prefill_kb(a, sw0[u], sw1[u], kc + u - k0, ngroups, stage, acc);
      }
    }
  }
}

__global__ void __launch_bounds__(kW13Warps * 32) prefill_w13_kernel(const PrefillW13Params p) {
  pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  pdl_trigger();
  extern __shared__ __align__(16) uint8_t stage[];  // 2 x kStageBytes; then the epilogue's s_acc
  __shared__ int s_tok[kCols];
  __shared__ int s_pair[kCols];
  const int item = blockIdx.y;
  if (item >= *p.n_items) return;
  const int expert = p.items[3 * item], pos0 = p.items[3 * item + 1], n = p.items[3 * item + 2];
  for (int c = threadIdx.x; c < kCols; c += blockDim.x) {
    const int pair = c < n ? p.sorted[pos0 + c] : -1;
    s_pair[c] = pair;
    s_tok[c] = pair >= 0 ? pair / p.topk : -1;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int group = blockIdx.x;
  const int row = group * 32 + (warp & 1) * 16 + g;
  const bool up = warp >= 2;
  const int nkb = p.dim / 32;
  const size_t wrow = size_t(expert) * p.inter + row;
  const uint8_t* r0 = (up ? p.w3 : p.w1) + wrow * (p.dim / 2);
  const uint8_t* r1 = r0 + size_t(8) * (p.dim / 2);
  const uint8_t* sc0 = (up ? p.w3s : p.w1s) + wrow * nkb;
  const uint8_t* sc1 = sc0 + size_t(8) * nkb;
  const int ngroups = (n + 7) / 8;
  const auto tok = [&](int c) { return s_tok[c]; };
  float total[kGroups][4];
  const int splits = (nkb + kKbPerSplitDecode - 1) / kKbPerSplitDecode;
  // Two stages: split s + 1's activations land while split s computes.
  auto stage_of = [&](int s) { return stage + (s & 1) * kStageBytes; };
  auto issue = [&](int s) {
    const int kb0 = s * kKbPerSplitDecode;
    stage_act(stage_of(s), ngroups * 8, tok, p.x, p.xs, p.dim, nkb, kb0,
              min(nkb, kb0 + kKbPerSplitDecode) - kb0);
  };
  issue(0);
  for (int s = 0; s < splits; ++s) {
    const int kb0 = s * kKbPerSplitDecode, kb1 = min(nkb, kb0 + kKbPerSplitDecode);
    if (s + 1 < splits) {
      issue(s + 1);  // its buffer was last read in split s - 1, before the barrier below
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // split s's stage is complete for every thread
    float acc[kGroups][4];
#pragma unroll
    for (int cg = 0; cg < kGroups; ++cg) acc[cg][0] = acc[cg][1] = acc[cg][2] = acc[cg][3] = 0.f;
    weight_steps(r0, r1, sc0, sc1, kb0, kb1, ngroups, stage_of(s), acc);
    // The decode path's split sum: acc = partial[0]; acc += partial[s] in split order.
#pragma unroll
    for (int cg = 0; cg < kGroups; ++cg)
#pragma unroll
      for (int i = 0; i < 4; ++i) total[cg][i] = s == 0 ? acc[cg][i] : total[cg][i] + acc[cg][i];
    __syncthreads();  // every warp is done with stage_of(s) before split s + 2 refills it
  }
  // The stages become s_acc (the loop's last barrier: every warp is done with them).
  auto s_acc = reinterpret_cast<float(*)[kGroups][128]>(stage);
#pragma unroll
  for (int cg = 0; cg < kGroups; ++cg)
    if (cg < ngroups)
#pragma unroll
      for (int i = 0; i < 4; ++i) s_acc[warp][cg][lane * 4 + i] = total[cg][i];
  __syncthreads();

  w13_store(p, s_acc, s_pair, n, pos0, group);
}

struct PrefillW2Params {
  const uint8_t* w2;
  const uint8_t* w2s;
  int dim, inter, topk;
  const int* sorted;
  const int* items;
  const int* n_items;
  const uint8_t* h_codes;
  const float* h_scales;
  float* y;
  int64_t y_row_stride;
  bool round;
};

// The w2 epilogue of a warp's 16-row tile at rows rbase .. + 15 and its item's first ngroups
// column groups: column c (< n) is pair s_pair[c], written to y row pair / topk, slot pair % topk
// (bf16-rounded when p.round).
template <int NG>
__device__ __forceinline__ void w2_store(const PrefillW2Params& p, const int* s_pair, int n,
                                         int rbase, const float (&acc)[NG][4], int ngroups = NG) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  auto out = [&](int pair) {
    return p.y + (pair / p.topk) * p.y_row_stride + size_t(pair % p.topk) * p.dim + rbase;
  };
#pragma unroll
  for (int cg = 0; cg < NG; ++cg) {
    if (cg >= ngroups) break;
    const int c0 = cg * 8 + 2 * t, c1 = c0 + 1;
    if (c0 < n) {
      float* y = out(s_pair[c0]);
      y[g] = p.round ? round_bf16(acc[cg][0]) : acc[cg][0];
      y[g + 8] = p.round ? round_bf16(acc[cg][2]) : acc[cg][2];
    }
    if (c1 < n) {
      float* y = out(s_pair[c1]);
      y[g] = p.round ? round_bf16(acc[cg][1]) : acc[cg][1];
      y[g + 8] = p.round ? round_bf16(acc[cg][3]) : acc[cg][3];
    }
  }
}

__global__ void __launch_bounds__(kW2Warps * 32) prefill_w2_kernel(const PrefillW2Params p) {
  pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  pdl_trigger();
  extern __shared__ __align__(16) uint8_t stage[];  // 2 x kStageBytes
  __shared__ int s_pair[kCols];
  const int item = blockIdx.y;
  if (item >= *p.n_items) return;
  const int expert = p.items[3 * item], pos0 = p.items[3 * item + 1], n = p.items[3 * item + 2];
  for (int c = threadIdx.x; c < kCols; c += blockDim.x) s_pair[c] = c < n ? p.sorted[pos0 + c] : -1;
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int tile = blockIdx.x * kW2Warps + warp;
  // A warp past the last tile still helps stage (the CTA's barriers need every thread).
  const bool live = tile * 16 < p.dim;
  const int tile_c = live ? tile : 0;
  const int nkb = p.inter / 32;
  const size_t row_bytes = p.inter / 2;
  const size_t wrow = size_t(expert) * p.dim + size_t(tile_c) * 16 + g;
  const uint8_t* r0 = p.w2 + wrow * row_bytes;
  const uint8_t* r1 = r0 + 8 * row_bytes;
  const uint8_t* sc0 = p.w2s + wrow * nkb;
  const uint8_t* sc1 = sc0 + size_t(8) * nkb;
  const int ngroups = (n + 7) / 8;
  // h rows are the sorted positions pos0 + c (column c valid when c < n).
  const auto hrow = [&](int c) { return c < n ? pos0 + c : -1; };
  float acc[kGroups][4];
#pragma unroll
  for (int cg = 0; cg < kGroups; ++cg) acc[cg][0] = acc[cg][1] = acc[cg][2] = acc[cg][3] = 0.f;
  // w2 sums all of inter from 0 (no splits); staged kStageKb K blocks at a time, two stages.
  const int nst = (nkb + kStageKb - 1) / kStageKb;
  auto stage_of = [&](int s) { return stage + (s & 1) * kStageBytes; };
  auto issue = [&](int s) {
    const int kb0 = s * kStageKb;
    stage_act(stage_of(s), ngroups * 8, hrow, p.h_codes, p.h_scales, p.inter, nkb, kb0,
              min(nkb, kb0 + kStageKb) - kb0);
  };
  issue(0);
  for (int s = 0; s < nst; ++s) {
    const int kb0 = s * kStageKb, kb1 = min(nkb, kb0 + kStageKb);
    if (s + 1 < nst) {
      issue(s + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (live) weight_steps(r0, r1, sc0, sc1, kb0, kb1, ngroups, stage_of(s), acc);
    __syncthreads();
  }
  if (!live) return;
  w2_store<kGroups>(p, s_pair, n, tile * 16, acc, ngroups);
}

// ---- The f16 path (MoeFp4Prefill::set_f16(true), default) ----
// The same products, per-K-block updates, w13 splits and epilogues as the kernels above, with the
// e4m3 mma written as the two f16 HMMAs that sm_90a emulates it with (mma_f16.cuh) and every
// operand converted once instead of once per mma:
//  - activations: staged as FP8 codes (cp.async, kFChunk K blocks a chunk, two chunks deep), then
//    converted by the whole CTA into the HMMAs' f16 B operands in shared memory, [kb][column][64
//    bytes] (a lane's operands of one K block and column group: one 16-byte load; a quarter warp
//    reads 128 contiguous bytes), and their scales times 2^6 as [kb][column] (columns 2t, 2t + 1:
//    one 8-byte load);
//  - weight scales: w13 stages a chunk's UE8M0 bytes with the activations and converts them to
//    fp32 with them; w2 converts a warp's whole rows once; both as [kb][g][row g, g + 8] (one
//    8-byte load a K block);
//  - weights: decoded to e4m3 and converted to the f16 A operands once per K block and warp, then
//    only the 2 HMMAs (+ 4 FMUL + 4 FFMA of the update) per column group.
// The column-group count (1..8) is a template parameter of a CTA's main loop (with_groups):
// accumulators for those groups only, straight-line code without a branch per group.
// Shared memory (dynamic), both kernels: two raw chunks (codes [kb][column][32 bytes], scales
// [column][kb] fp32, w13 only: weight scales [64 rows][kb] bytes), then the operands of one chunk
// (f16 B operands [kb][column][64 bytes], activation scales * 2^6 [kb][column]), then the weight
// scales as fp32 (w13: [warp][kb][8][2] of the chunk; w2: [warp][nkb][8][2], all of I). Sizes,
// 64-column items: w13 74752 bytes (three CTAs an SM: 167 registers), w2 76288 at inter 288 (two
// CTAs of 8 warps an SM: 128 registers); 16-column items: w13 20992 bytes (five CTAs an SM: 96
// registers at most), w2 22528 (three CTAs: 80 registers); no spills (ptxas -v).
constexpr int kFChunk = 8;  // K blocks a chunk: half a w13 split
// C = the columns of a work item (prefill_plan_kernel's item width; 16 or 64).
template <bool kW13, int C>
struct F16Layout {
  static constexpr int kActScaleOff = kFChunk * C * 32;
  static constexpr int kWsOff = kActScaleOff + C * kFChunk * 4;
  static constexpr int kRaw = kWsOff + (kW13 ? 2 * 32 * kFChunk : 0);
  static constexpr int kOps = 2 * kRaw;
  static constexpr int kSa = kOps + kFChunk * C * 64;
  static constexpr int kSwf = kSa + kFChunk * C * 4;
  static_assert(kRaw % 16 == 0 && kSa % 16 == 0 && kSwf % 16 == 0, "16-byte layout");
};
template <int C>
constexpr int w13_f16_smem() {
  constexpr int bytes = F16Layout<true, C>::kSwf + kW13Warps * kFChunk * 16 * 4;
  static_assert(kW13Warps * (C / 8) * 128 * 4 <= bytes, "the w13 epilogue's s_acc fits");
  return bytes;
}
template <int C>
int w2_f16_smem(int inter) {
  return F16Layout<false, C>::kSwf + kW2Warps * (inter / 32) * 16 * 4;
}

// Stages K blocks [kb0, kb0 + kbn) (kbn <= kFChunk) of columns c < ncols (act_row(c) = the
// activation row, -1 = none: zero-filled) into raw (cp.async; the caller commits): codes at
// [kb][column][32], scales at [column][kb]. All threads of the CTA. (Index math by shifts: a
// column's pieces / scales are strided by the chunk maximum and the ones past kbn skipped.)
template <int C, typename RowOf>
__device__ __forceinline__ void f16_stage_act(uint8_t* raw, int ncols, RowOf act_row,
                                              const uint8_t* act, const float* act_s, int act_k,
                                              int nkb, int kb0, int kbn) {
  static_assert(kFChunk == 8, "index math: 16 pieces and 8 scales a column");
  for (int i = threadIdx.x; i < ncols * 16; i += blockDim.x) {
    const int c = i >> 4, q = i & 15, row = act_row(c);  // q: 16-byte piece (K block q / 2)
    if (q < 2 * kbn) {
      const uint8_t* src = act + size_t(row >= 0 ? row : 0) * act_k + size_t(kb0) * 32 + q * 16;
      cp_async_zfill(raw + ((q >> 1) * C + c) * 32 + (q & 1) * 16, src, 16, row >= 0);
    }
  }
  float* sc = reinterpret_cast<float*>(raw + F16Layout<true, C>::kActScaleOff);
  for (int i = threadIdx.x; i < ncols * 8; i += blockDim.x) {
    const int c = i >> 3, j = i & 7, row = act_row(c);
    if (j < kbn)
      cp_async_zfill(sc + c * kFChunk + j, act_s + size_t(row >= 0 ? row : 0) * nkb + kb0 + j, 4,
                     row >= 0);
  }
}

// Converts a landed raw chunk (kbn K blocks, ngroups * 8 columns) into the f16 B operands (the B
// fragment prefill_kb builds, b_e4m3_to_f16x8) and the scales times 2^6 (prefill_kb's sa0 / sa1).
// All threads of the CTA: one warp per (K block, column group), lane = (column g, t) as the
// reader's.
template <int C>
__device__ __forceinline__ void f16_convert_act(const uint8_t* raw, uint8_t* ops, float* sa,
                                                int ngroups, int kbn) {
  const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  for (int r = threadIdx.x >> 5; r < kbn * ngroups; r += nw) {
    const int j = r / ngroups, c = (r - j * ngroups) * 8 + (lane >> 2), t = lane & 3;
    const uint2 v = *reinterpret_cast<const uint2*>(raw + (j * C + c) * 32 + t * 8);
    *reinterpret_cast<uint4*>(ops + (j * C + c) * 64 + t * 16) =
        b_e4m3_to_f16x8(__byte_perm(v.x, v.y, 0x6420), __byte_perm(v.x, v.y, 0x7531));
  }
  const float* rs = reinterpret_cast<const float*>(raw + F16Layout<true, C>::kActScaleOff);
  const int ncols = ngroups * 8;
  for (int i = threadIdx.x; i < kbn * C; i += blockDim.x) {
    const int j = i / C, c = i % C;
    if (c < ncols) sa[j * C + c] = rs[c * kFChunk + j] * kE2M1ToE4M3Rescale;
  }
}

// One K block of a warp's 16 x (8 * NG) tile: q0 / q1 = the lane's FP4 words of rows g / g + 8,
// sw = their scales (fp32), b = the lane's f16 operands of column group 0 (group cg at + cg * 512
// bytes), sa = the lane's scale pair (columns 2t, 2t + 1) of group 0 (group cg at + cg * 8).
// prefill_kb's update, operation for operation.
template <int NG>
__device__ __forceinline__ void f16_kb(uint32_t q0, uint32_t q1, float2 sw, const uint8_t* b,
                                       const float* sa, float (&acc)[NG][4]) {
  uint32_t a[4];
  e2m1x8_to_e4m3_scaled(q0, a[0], a[2]);
  e2m1x8_to_e4m3_scaled(q1, a[1], a[3]);
  const AF16 af = a_e4m3_to_f16(a);
#pragma unroll
  for (int cg = 0; cg < NG; ++cg) {
    const uint4 bh = *reinterpret_cast<const uint4*>(b + cg * 8 * 64);
    const float2 s = *reinterpret_cast<const float2*>(sa + cg * 8);
    float d[4];
    mma_e4m3_f16_pre(d, af, bh);
    acc[cg][0] = fmaf(d[0] * s.x, sw.x, acc[cg][0]);
    acc[cg][1] = fmaf(d[1] * s.y, sw.x, acc[cg][1]);
    acc[cg][2] = fmaf(d[2] * s.x, sw.y, acc[cg][2]);
    acc[cg][3] = fmaf(d[3] * s.y, sw.y, acc[cg][3]);
  }
}

// A chunk's kbn K blocks (in order) for NG column groups; kbn is a multiple of kQ (runs of kQ
// blocks without a branch). swp = the lane's weight-scale pair of the chunk's block 0 (block kl
// at + kl * 16 floats); ops / sas = the chunk's operands and activation scales (C columns a K
// block).
template <int NG, int kQ, int C>
__device__ __forceinline__ void f16_chunk(const uint32_t (&q0)[kFChunk],
                                          const uint32_t (&q1)[kFChunk], int kbn, const float* swp,
                                          const uint8_t* ops, const float* sas,
                                          float (&acc)[NG][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint8_t* b = ops + g * 64 + t * 16;
  const float* sa = sas + 2 * t;
#pragma unroll
  for (int k0 = 0; k0 < kFChunk; k0 += kQ) {
    if (k0 >= kbn) break;
#pragma unroll
    for (int u = 0; u < kQ; ++u) {
      const int kl = k0 + u;
      f16_kb<NG>(q0[kl], q1[kl], *reinterpret_cast<const float2*>(swp + kl * 16), b + kl * C * 64,
                 sa + kl * C, acc);
    }
  }
}

// Register fits (ptxas -v, no spills; w13 within the 168 registers of three CTAs an SM, w2 the
// 128 of two): above kQBig column groups the w13 loop runs one K block at a time (a branch each),
// above kW13SplitNG in passes of kPassNG groups (f16_chunk_split); up to kPipeNG (w13) /
// kW2PipeNG (w2) groups the next chunk's weights are loaded during a chunk (16 registers more).
constexpr int kQBig = 4;
constexpr int kW13SplitNG = 6, kW2SplitNG = 8, kPassNG = 4, kPipeNG = 6, kW2PipeNG = 6;

// f16_chunk for NG column groups; above kSplitNG groups in passes over the chunk (groups
// [0, kPassNG), then the rest: the A operands decoded again), fewer operands in flight. The
// updates of each output and their order are unchanged (an output's updates are its own group's).
template <int NG, int kQ, int kSplitNG, int C>
__device__ __forceinline__ void f16_chunk_split(const uint32_t (&q0)[kFChunk],
                                                const uint32_t (&q1)[kFChunk], int kbn,
                                                const float* swp, const uint8_t* ops,
                                                const float* sas, float (&acc)[NG][4]) {
  if constexpr (NG > kSplitNG) {
    constexpr int kP = kPassNG;
    f16_chunk<kP, kQ, C>(q0, q1, kbn, swp, ops, sas, reinterpret_cast<float(&)[kP][4]>(acc[0]));
    f16_chunk_split<NG - kP, kQ, kSplitNG, C>(q0, q1, kbn, swp, ops + kP * 8 * 64, sas + kP * 8,
                                              reinterpret_cast<float(&)[NG - kP][4]>(acc[kP]));
  } else {
    f16_chunk<NG, kQ, C>(q0, q1, kbn, swp, ops, sas, acc);
  }
}

// f(std::integral_constant<int, ngroups>{}) for ngroups 1..G (warp-uniform): a CTA's main loop
// compiled for its column-group count (accumulators for those groups only, no branch per group).
template <int G, int N = 1, typename F>
__device__ __forceinline__ void with_groups(int ngroups, F&& f) {
  if (ngroups == N || N == G) {
    f(std::integral_constant<int, N>{});
  } else if constexpr (N < G) {
    with_groups<G, N + 1>(ngroups, f);
  }
}

// The lane's FP4 words of rows r0 / r0 + r1_off for K blocks [kb0, kb1) (kb1 - kb0 <= kFChunk; past
// kb1: a valid address, never used), loaded before the chunk's barriers so that they are in flight
// during them.
__device__ __forceinline__ void f16_load_weights(const uint8_t* r0, uint32_t r1_off, int kb0,
                                                 int kb1, uint32_t (&q0)[kFChunk],
                                                 uint32_t (&q1)[kFChunk]) {
  const uint8_t* w = r0 + kb0 * 16 + (threadIdx.x & 3) * 4;
  const int last = kb1 - kb0 - 1;
#pragma unroll
  for (int u = 0; u < kFChunk; ++u) {
    const int k = min(u, last);
    q0[u] = ld_nc_u32(w + k * 16);
    q1[u] = ld_nc_u32(w + r1_off + k * 16);
  }
}

template <int C>
__global__ void __launch_bounds__(kW13Warps * 32, C == kSmallCols ? kW13SmallBlocks : 3)
    prefill_w13_f16_kernel(const PrefillW13Params p) {
  pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  pdl_trigger();
  using L = F16Layout<true, C>;
  constexpr int G = C / 8;
  // K blocks a straight run of the chunk loop: 4, or kW13SmallQ for 16-column items.
  constexpr int kQSmall = C == kSmallCols ? kW13SmallQ : 4;
  extern __shared__ __align__(16) uint8_t smem[];  // w13_f16_smem<C>(); then the epilogue's s_acc
  __shared__ int s_tok[C];
  __shared__ int s_pair[C];
  const int item = blockIdx.y;
  if (item >= *p.n_items) return;
  const int expert = p.items[3 * item], pos0 = p.items[3 * item + 1], n = p.items[3 * item + 2];
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const int pair = c < n ? p.sorted[pos0 + c] : -1;
    s_pair[c] = pair;
    s_tok[c] = pair >= 0 ? pair / p.topk : -1;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int group = blockIdx.x;
  const int row = group * 32 + (warp & 1) * 16 + g;
  const bool up = warp >= 2;
  const int nkb = p.dim / 32;
  const size_t wrow = size_t(expert) * p.inter + row;
  const uint8_t* r0 = (up ? p.w3 : p.w1) + wrow * (p.dim / 2);
  const uint32_t r1_off = 8 * (p.dim / 2);  // row g + 8
  const int ngroups = (n + 7) / 8, ncols = ngroups * 8;
  const auto tok = [&](int c) { return s_tok[c]; };
  const int nch = (nkb + kFChunk - 1) / kFChunk;  // nkb % 4 == 0: chunks of 8 K blocks, or 4 last
  // Chunk j's operands into raw buffer j & 1: activations, and the UE8M0 scales of the CTA's 64
  // weight rows (R = warp * 16 + r: w1 (R < 32) or w3 row group * 32 + R % 32; 4-byte pieces:
  // nkb and kb0 are multiples of 4). Always one commit group per chunk index (empty past the
  // end), so that cp_async_wait<1> at chunk j means chunk j has landed.
  auto issue = [&](int j) {
    if (j < nch) {
      const int kb0 = j * kFChunk, kbn = min(nkb, kb0 + kFChunk) - kb0;
      uint8_t* raw = smem + (j & 1) * L::kRaw;
      f16_stage_act<C>(raw, ncols, tok, p.x, p.xs, p.dim, nkb, kb0, kbn);
      for (int i = threadIdx.x; i < 64 * 2; i += blockDim.x) {
        const int R = i >> 1, u = i & 1;
        if (u * 4 < kbn) {
          const uint8_t* src = (R >= 32 ? p.w3s : p.w1s) +
                               (size_t(expert) * p.inter + group * 32 + (R & 31)) * nkb + kb0 +
                               u * 4;
          cp_async_zfill(raw + L::kWsOff + R * kFChunk + u * 4, src, 4, true);
        }
      }
    }
    cp_async_commit();
  };
  issue(0);
  issue(1);
  uint8_t* ops = smem + L::kOps;
  float* sas = reinterpret_cast<float*>(smem + L::kSa);
  float* swf = reinterpret_cast<float*>(smem + L::kSwf);
  const float* swp = swf + warp * kFChunk * 16 + g * 2;
  auto s_acc = reinterpret_cast<float(*)[G][128]>(smem);  // after the loop
  with_groups<G>(ngroups, [&](auto ng) {
    constexpr int NG = decltype(ng)::value;
    float total[NG][4], acc[NG][4];
    // Up to kPipeNG groups the weights of chunk j + 1 are loaded before chunk j's products (their
    // latency hidden behind a chunk; 16 more registers, still no spills); above, before chunk j's
    // barriers (hidden behind the barriers and the conversion only).
    constexpr bool kPipe = NG <= kPipeNG;
    uint32_t q0[kFChunk], q1[kFChunk];
    if constexpr (kPipe) f16_load_weights(r0, r1_off, 0, min(nkb, kFChunk), q0, q1);
    for (int j = 0; j < nch; ++j) {
      const int kb0 = j * kFChunk, kb1 = min(nkb, kb0 + kFChunk), kbn = kb1 - kb0;
      if constexpr (!kPipe) f16_load_weights(r0, r1_off, kb0, kb1, q0, q1);
      cp_async_wait<1>();
      __syncthreads();  // chunk j landed for every thread; every warp is done with chunk j - 1
      const uint8_t* raw = smem + (j & 1) * L::kRaw;
      f16_convert_act<C>(raw, ops, sas, NG, kbn);
      for (int i = threadIdx.x; i < 64 * kFChunk; i += blockDim.x) {
        const int R = i / kFChunk, k = i % kFChunk;
        if (k < kbn)
          swf[(((R >> 4) * kFChunk + k) * 8 + (R & 7)) * 2 + ((R >> 3) & 1)] =
              e8m0_to_f32(raw[L::kWsOff + R * kFChunk + k]);
      }
      __syncthreads();  // chunk j's operands are ready; raw buffer j & 1 is free
      issue(j + 2);
      if (kb0 % kKbPerSplitDecode == 0) {  // a split starts: its partial from 0
#pragma unroll
        for (int cg = 0; cg < NG; ++cg) acc[cg][0] = acc[cg][1] = acc[cg][2] = acc[cg][3] = 0.f;
      }
      uint32_t n0[kFChunk], n1[kFChunk];
      if constexpr (kPipe) {  // chunk j + 1 (past the end: chunk j again, never used)
        const int kn0 = j + 1 < nch ? kb1 : kb0;
        f16_load_weights(r0, r1_off, kn0, min(nkb, kn0 + kFChunk), n0, n1);
      }
      f16_chunk_split<NG, (NG > kQBig ? 1 : kQSmall), kW13SplitNG, C>(q0, q1, kbn, swp, ops, sas,
                                                                      acc);
      if constexpr (kPipe) {
#pragma unroll
        for (int u = 0; u < kFChunk; ++u) q0[u] = n0[u], q1[u] = n1[u];
      }
      if (kb1 % kKbPerSplitDecode == 0 || kb1 == nkb) {  // a split ends
        // The decode path's split sum: total = partial[0]; total += partial[s] in split order.
        const bool first = kb0 < kKbPerSplitDecode;
#pragma unroll
        for (int cg = 0; cg < NG; ++cg)
#pragma unroll
          for (int i = 0; i < 4; ++i) total[cg][i] = first ? acc[cg][i] : total[cg][i] + acc[cg][i];
      }
    }
    cp_async_wait<0>();  // (only empty groups remain)
    __syncthreads();     // every warp is done with the operands before they become s_acc
#pragma unroll
    for (int cg = 0; cg < NG; ++cg)
#pragma unroll
      for (int i = 0; i < 4; ++i) s_acc[warp][cg][lane * 4 + i] = total[cg][i];
  });
  __syncthreads();

  w13_store(p, s_acc, s_pair, n, pos0, group);
}

// The f16 w2 kernels' work item (blockIdx.y; false past the plan's count): its expert, first
// sorted position and columns, and s_pair[c] = the pair of column c (-1 from n), c < C (read
// after the caller's next barrier).
template <int C>
__device__ __forceinline__ bool w2_item(const PrefillW2Params& p, int* s_pair, int& expert,
                                        int& pos0, int& n) {
  const int item = blockIdx.y;
  if (item >= *p.n_items) return false;
  expert = p.items[3 * item], pos0 = p.items[3 * item + 1], n = p.items[3 * item + 2];
  for (int c = threadIdx.x; c < C; c += blockDim.x) s_pair[c] = c < n ? p.sorted[pos0 + c] : -1;
  return true;
}

template <int C>
__global__ void __launch_bounds__(kW2Warps * 32, C == kSmallCols ? 3 : 2)
    prefill_w2_f16_kernel(const PrefillW2Params p) {
  pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  pdl_trigger();
  using L = F16Layout<false, C>;
  extern __shared__ __align__(16) uint8_t smem[];  // w2_f16_smem<C>(inter)
  __shared__ int s_pair[C];
  int expert, pos0, n;
  if (!w2_item<C>(p, s_pair, expert, pos0, n)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int tile = blockIdx.x * kW2Warps + warp;
  // A warp past the last tile still stages and converts (the CTA's barriers need every thread).
  const bool live = tile * 16 < p.dim;
  const int tile_c = live ? tile : 0;
  const int nkb = p.inter / 32;
  const size_t row_bytes = p.inter / 2;
  const size_t wrow = size_t(expert) * p.dim + size_t(tile_c) * 16 + g;
  const uint8_t* r0 = p.w2 + wrow * row_bytes;
  const uint32_t r1_off = uint32_t(8 * row_bytes);  // row g + 8
  // Chunk 0's weights first (in flight during the scale conversion and the staging).
  uint32_t q0[kFChunk], q1[kFChunk];
  f16_load_weights(r0, r1_off, 0, min(nkb, kFChunk), q0, q1);
  // The warp's 16 rows x nkb weight scales as fp32 [kb][g][row g, g + 8], once (read after the
  // first chunk's barriers).
  float* swf = reinterpret_cast<float*>(smem + L::kSwf) + warp * nkb * 16;
  {
    const uint8_t* sc = p.w2s + (size_t(expert) * p.dim + size_t(tile_c) * 16) * nkb;
    for (int i = lane; i < 16 * nkb; i += 32) {
      const int r = i / nkb, k = i - r * nkb;
      swf[(k * 8 + (r & 7)) * 2 + (r >> 3)] = e8m0_to_f32(__ldg(sc + i));
    }
  }
  __syncthreads();  // s_pair
  const int ngroups = (n + 7) / 8, ncols = ngroups * 8;
  // h rows are the sorted positions pos0 + c (column c valid when c < n).
  const auto hrow = [&](int c) { return c < n ? pos0 + c : -1; };
  const int nch = (nkb + kFChunk - 1) / kFChunk;
  auto issue = [&](int j) {  // one commit group per chunk index, as the w13 kernel's
    if (j < nch) {
      const int kb0 = j * kFChunk, kbn = min(nkb, kb0 + kFChunk) - kb0;
      f16_stage_act<C>(smem + (j & 1) * L::kRaw, ncols, hrow, p.h_codes, p.h_scales, p.inter, nkb,
                       kb0, kbn);
    }
    cp_async_commit();
  };
  issue(0);
  issue(1);
  uint8_t* ops = smem + L::kOps;
  float* sas = reinterpret_cast<float*>(smem + L::kSa);
  with_groups<C / 8>(ngroups, [&](auto ng) {
    constexpr int NG = decltype(ng)::value;
    float acc[NG][4];
#pragma unroll
    for (int cg = 0; cg < NG; ++cg) acc[cg][0] = acc[cg][1] = acc[cg][2] = acc[cg][3] = 0.f;
    // w2 sums all of inter from 0 (no splits).
    // As the w13 kernel's: up to kW2PipeNG groups chunk j + 1's weights load during chunk j.
    constexpr bool kPipe = NG <= kW2PipeNG;
    for (int j = 0; j < nch; ++j) {
      const int kb0 = j * kFChunk, kb1 = min(nkb, kb0 + kFChunk), kbn = kb1 - kb0;
      if (!kPipe && j > 0) f16_load_weights(r0, r1_off, kb0, kb1, q0, q1);
      cp_async_wait<1>();
      __syncthreads();  // chunk j landed for every thread; every warp is done with chunk j - 1
      f16_convert_act<C>(smem + (j & 1) * L::kRaw, ops, sas, NG, kbn);
      __syncthreads();  // chunk j's operands are ready; raw buffer j & 1 is free
      issue(j + 2);
      uint32_t n0[kFChunk], n1[kFChunk];
      if constexpr (kPipe) {  // chunk j + 1 (past the end: chunk j again, never used)
        const int kn0 = j + 1 < nch ? kb1 : kb0;
        f16_load_weights(r0, r1_off, kn0, min(nkb, kn0 + kFChunk), n0, n1);
      }
      if (live)
        f16_chunk_split<NG, 1, kW2SplitNG, C>(q0, q1, kbn, swf + kb0 * 16 + g * 2, ops, sas, acc);
      if constexpr (kPipe) {
#pragma unroll
        for (int u = 0; u < kFChunk; ++u) q0[u] = n0[u], q1[u] = n1[u];
      }
    }
    cp_async_wait<0>();  // (only empty groups remain)
    if (live) w2_store<NG>(p, s_pair, n, tile * 16, acc);
  });
}

// The w2 kernel for a rank's slice of inter (inter / 32 <= kW2TilesMaxKb K blocks: 9 at a TP8
// rank), where prefill_w2_f16_kernel's CTA (16 rows a warp, 18 KB of weights) spent most of its
// life on its prologue (pairs, the activations' staging and conversion, two barriers a chunk)
// and a 512-row chunk ran 23k such CTAs: here a CTA stages and converts the item's activations
// for all of inter once, then each warp walks kW2Tiles 16-row tiles (tile = (blockIdx.x *
// kW2Tiles + r) * kW2Warps + warp) without another CTA barrier, the next (tile, chunk)'s weight
// words and the next tile's scale bytes loaded while the current one computes. Every output's
// operations and order are prefill_w2_f16_kernel's (bitwise the same).
// 4 tiles a warp: 2 measured 61.44 / 61.52 ms a chunk against 61.03 / 60.78, 8 60.77 / 60.71
// (H200, same run). A build-time knob for A/B tests (scripts/build-variant).
#ifndef UF_MOE_W2_TILES
#define UF_MOE_W2_TILES 4
#endif
constexpr int kW2Tiles = UF_MOE_W2_TILES;
constexpr int kW2TilesMaxKb = 2 * kFChunk;
// Shared memory: two raw chunks (F16Layout<false, C>::kRaw each), the operands of all nkb K
// blocks ([kb][column][64 bytes]), their scales ([kb][column]), each warp's tile scales
// ([nkb][8][2] fp32). 16-column items at inter 288: 28.2 KB; 64: 85 KB.
template <int C>
int w2_tiles_smem(int inter) {
  const int nkb = inter / 32;
  return 2 * F16Layout<false, C>::kRaw + nkb * C * 64 + nkb * C * 4 + kW2Warps * nkb * 16 * 4;
}

template <int C>
__global__ void __launch_bounds__(kW2Warps * 32, C == kSmallCols ? 3 : 2)
    prefill_w2_tiles_f16_kernel(const PrefillW2Params p) {
  pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  pdl_trigger();
  constexpr int kRaw = F16Layout<false, C>::kRaw;
  constexpr int kSwW = kW2TilesMaxKb * 16 / 4 / 32;  // a lane's 4-byte words of a tile's scales
  extern __shared__ __align__(16) uint8_t smem[];    // w2_tiles_smem<C>(inter)
  __shared__ int s_pair[C];
  int expert, pos0, n;
  if (!w2_item<C>(p, s_pair, expert, pos0, n)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int nkb = p.inter / 32, nch = (nkb + kFChunk - 1) / kFChunk;
  const size_t row_bytes = p.inter / 2;
  const uint32_t r1_off = uint32_t(8 * row_bytes);  // row g + 8
  uint8_t* ops = smem + 2 * kRaw;
  float* sas = reinterpret_cast<float*>(ops + nkb * C * 64);
  float* swf = sas + nkb * C + warp * nkb * 16;
  const int ngroups = (n + 7) / 8, ncols = ngroups * 8;
  // h rows are the sorted positions pos0 + c (column c valid when c < n).
  const auto hrow = [&](int c) { return c < n ? pos0 + c : -1; };
  for (int j = 0; j < nch; ++j) {
    const int kb0 = j * kFChunk;
    f16_stage_act<C>(smem + j * kRaw, ncols, hrow, p.h_codes, p.h_scales, p.inter, nkb, kb0,
                     min(nkb, kb0 + kFChunk) - kb0);
  }
  cp_async_commit();
  const int ntiles = p.dim / 16, tile0 = blockIdx.x * (kW2Tiles * kW2Warps) + warp;
  int nt = 0;  // this warp's live tiles (tile0 + r * kW2Warps < ntiles for r < nt)
  while (nt < kW2Tiles && tile0 + nt * kW2Warps < ntiles) ++nt;
  const auto rows_of = [&](int r) {  // row g of tile r (past the warp's last: its last, unused)
    const int tl = tile0 + min(r, max(nt - 1, 0)) * kW2Warps;
    return p.w2 + (size_t(expert) * p.dim + size_t(min(tl, ntiles - 1)) * 16 + g) * row_bytes;
  };
  // Tile r's 16 x nkb UE8M0 bytes: contiguous and 16-byte aligned (16 rows of nkb bytes), read
  // as 4 nkb words, word w on lane w % 32.
  const auto load_sw = [&](int r, uint32_t(&b)[kSwW]) {
    const int tl = min(tile0 + min(r, max(nt - 1, 0)) * kW2Warps, ntiles - 1);
    const uint32_t* sc =
        reinterpret_cast<const uint32_t*>(p.w2s + (size_t(expert) * p.dim + size_t(tl) * 16) * nkb);
#pragma unroll
    for (int u = 0; u < kSwW; ++u) {
      const int w = lane + 32 * u;
      b[u] = w < 4 * nkb ? __ldg(sc + w) : 0u;
    }
  };
  uint32_t sw[kSwW];
  load_sw(0, sw);
  uint32_t q0[kFChunk], q1[kFChunk];
  f16_load_weights(rows_of(0), r1_off, 0, min(nkb, kFChunk), q0, q1);
  cp_async_wait<0>();
  __syncthreads();  // every chunk landed for every thread; s_pair
  for (int j = 0; j < nch; ++j) {
    const int kb0 = j * kFChunk;
    f16_convert_act<C>(smem + j * kRaw, ops + kb0 * C * 64, sas + kb0 * C, ngroups,
                       min(nkb, kb0 + kFChunk) - kb0);
  }
  __syncthreads();  // the operands of all of inter are ready
  with_groups<C / 8>(ngroups, [&](auto ng) {
    constexpr int NG = decltype(ng)::value;
    constexpr bool kPipe = NG <= kW2PipeNG;  // as prefill_w2_f16_kernel
    for (int r = 0; r < nt; ++r) {
      __syncwarp();  // the previous tile's reads of swf are done
#pragma unroll
      for (int u = 0; u < kSwW; ++u)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 4 * (lane + 32 * u) + e;  // byte i: row i / nkb, K block i % nkb
          if (i < 16 * nkb) {
            const int rr = i / nkb, k = i - rr * nkb;
            swf[(k * 8 + (rr & 7)) * 2 + (rr >> 3)] = e8m0_to_f32(uint8_t(sw[u] >> (8 * e)));
          }
        }
      if (r + 1 < nt) load_sw(r + 1, sw);
      __syncwarp();  // swf holds tile r's scales
      const uint8_t* r0 = rows_of(r);
      float acc[NG][4];
#pragma unroll
      for (int cg = 0; cg < NG; ++cg) acc[cg][0] = acc[cg][1] = acc[cg][2] = acc[cg][3] = 0.f;
      for (int j = 0; j < nch; ++j) {  // w2 sums all of inter from 0 (no splits)
        const int kb0 = j * kFChunk, kb1 = min(nkb, kb0 + kFChunk), kbn = kb1 - kb0;
        if (!kPipe && (j > 0 || r > 0)) f16_load_weights(r0, r1_off, kb0, kb1, q0, q1);
        uint32_t n0[kFChunk], n1[kFChunk];
        if constexpr (kPipe) {  // the next (tile, chunk)'s words (past the last: unused)
          const bool same = j + 1 < nch;
          const int nk0 = same ? kb1 : 0;
          f16_load_weights(same ? r0 : rows_of(r + 1), r1_off, nk0, min(nkb, nk0 + kFChunk), n0,
                           n1);
        }
        f16_chunk_split<NG, 1, kW2SplitNG, C>(q0, q1, kbn, swf + kb0 * 16 + g * 2,
                                              ops + kb0 * C * 64, sas + kb0 * C, acc);
        if constexpr (kPipe) {
#pragma unroll
          for (int u = 0; u < kFChunk; ++u) q0[u] = n0[u], q1[u] = n1[u];
        }
      }
      w2_store<NG>(p, s_pair, n, (tile0 + r * kW2Warps) * 16, acc);
    }
  });
}

}  // namespace

int MoeFp4Prefill::item_cols(int m) const {
  if (!f16_) return kCols;  // the e4m3 kernels: 64-column items only
  if (cols_ != 0) return cols_;
  return int64_t(m) * topk_ <= int64_t(kSmallColsMaxMean) * experts_ ? kSmallCols : kCols;
}

void MoeFp4Prefill::set_cols(int cols) {
  require(cols == 0 || cols == kSmallCols || cols == kCols,
          "MoeFp4Prefill::set_cols: %d (0 = by the call's pairs, %d or %d)", cols, kSmallCols,
          kCols);
  cols_ = cols;
}

MoeFp4Prefill::MoeFp4Prefill(int dim, int inter, int topk, int num_experts, int max_rows)
    : dim_(dim), inter_(inter), topk_(topk), experts_(num_experts), max_rows_(max_rows) {
  require(dim > 0 && inter > 0 && dim % 128 == 0 && inter % 32 == 0 && topk >= 1 && topk <= 8 &&
              num_experts >= 1 && max_rows >= 1,
          "MoeFp4Prefill: dim %d (multiple of 128), inter %d (of 32), topk %d (1..8), experts %d, "
          "max rows %d",
          dim, inter, topk, num_experts, max_rows);
  const size_t P = size_t(max_rows) * topk;
  max_items_ = int(std::min<size_t>(size_t(num_experts), P) + P / kSmallCols + 1);
  require(max_items_ <= 65535, "MoeFp4Prefill: %d work items exceed the grid's y limit",
          max_items_);
  plan_smem_ = int(plan_smem_bytes(P, num_experts));
  require(plan_smem_ <= 200 * 1024,
          "MoeFp4Prefill: plan of %zu pairs and %d experts needs %d bytes of shared memory", P,
          num_experts, plan_smem_);
  if (plan_smem_ > 48 * 1024)
    UF_CUDA_CHECK(cudaFuncSetAttribute(prefill_plan_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, plan_smem_));
  // Two activation stages a CTA (74 KB) exceed the 48 KB default.
  UF_CUDA_CHECK(cudaFuncSetAttribute(prefill_w13_kernel,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * kStageBytes));
  UF_CUDA_CHECK(cudaFuncSetAttribute(prefill_w2_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     2 * kStageBytes));
  require(w2_f16_smem<kCols>(inter) <= 227 * 1024,
          "MoeFp4Prefill: inter %d needs %d bytes of shared memory in the f16 w2 kernel", inter,
          w2_f16_smem<kCols>(inter));
  // The attributes belong to the kernels on this device, not to this object: raise them, never
  // lower them below another object's need (the w2 kernel's depends on inter: a tensor-parallel
  // rank's slice beside a whole-inter object on the same device).
  raise_smem(prefill_w13_f16_kernel<kSmallCols>, w13_f16_smem<kSmallCols>());
  raise_smem(prefill_w13_f16_kernel<kCols>, w13_f16_smem<kCols>());
  raise_smem(prefill_w2_f16_kernel<kSmallCols>, w2_f16_smem<kSmallCols>(inter));
  raise_smem(prefill_w2_f16_kernel<kCols>, w2_f16_smem<kCols>(inter));
  if (inter / 32 <= kW2TilesMaxKb) {
    raise_smem(prefill_w2_tiles_f16_kernel<kSmallCols>, w2_tiles_smem<kSmallCols>(inter));
    raise_smem(prefill_w2_tiles_f16_kernel<kCols>, w2_tiles_smem<kCols>(inter));
  }
  UF_CUDA_CHECK(cudaMalloc(&sorted_, sizeof(int) * P));
  UF_CUDA_CHECK(cudaMalloc(&items_, sizeof(int) * 3 * size_t(max_items_)));
  UF_CUDA_CHECK(cudaMalloc(&n_items_, sizeof(int)));
  UF_CUDA_CHECK(cudaMalloc(&h_codes_, P * inter));
  UF_CUDA_CHECK(cudaMalloc(&h_scales_, sizeof(float) * P * (inter / 32)));
  UF_CUDA_CHECK(cudaMalloc(&y_, sizeof(float) * P * dim));
}

MoeFp4Prefill::~MoeFp4Prefill() {
  cudaFree(sorted_);
  cudaFree(items_);
  cudaFree(n_items_);
  cudaFree(h_codes_);
  cudaFree(h_scales_);
  cudaFree(y_);
}

void MoeFp4Prefill::experts_impl(const Fp4ExpertsView& w, const QuantActView& x,
                                 const int* topk_idx, const float* topk_w, float swiglu_limit,
                                 bool round_w2, float* y, int64_t y_row_stride,
                                 cudaStream_t stream) const {
  require(w.dim == dim_ && w.inter == inter_ && w.num_experts == experts_ && x.k == dim_ &&
              x.m >= 1 && x.m <= max_rows_,
          "MoeFp4Prefill: experts [%d, dim %d, inter %d] / input [%d, %d] do not match the plan "
          "[%d, dim %d, inter %d, up to %d rows]",
          w.num_experts, w.dim, w.inter, x.m, x.k, experts_, dim_, inter_, max_rows_);
  require(y_row_stride >= int64_t(topk_) * dim_,
          "MoeFp4Prefill::run_experts: row stride %lld < topk %d * dim %d",
          static_cast<long long>(y_row_stride), topk_, dim_);
  const int P = x.m * topk_;
  const int cols = item_cols(x.m);
  launch_pdl(prefill_plan_kernel, dim3(1), dim3(kPlanThreads), size_t(plan_smem_), stream, topk_idx,
             P, experts_, cols, sorted_, items_, n_items_);
  UF_CUDA_CHECK(cudaGetLastError());
  // Items needed for this P (<= max_items_): the grid is sized for it, blocks past n_items exit.
  const int items = std::min(max_items_, std::min(experts_, P) + P / cols + 1);
  const PrefillW13Params a{w.w1,     w.w1_scale,   w.w3,     w.w3_scale, dim_,    inter_,
                           topk_,    x.codes,      x.scales, topk_w,     sorted_, items_,
                           n_items_, swiglu_limit, h_codes_, h_scales_};
  const dim3 w13_grid(inter_ / 32, items), w13_block(kW13Warps * 32);
  if (f16_ && cols == kSmallCols)
    launch_pdl(prefill_w13_f16_kernel<kSmallCols>, w13_grid, w13_block,
               size_t(w13_f16_smem<kSmallCols>()), stream, a);
  else if (f16_)
    launch_pdl(prefill_w13_f16_kernel<kCols>, w13_grid, w13_block, size_t(w13_f16_smem<kCols>()),
               stream, a);
  else
    launch_pdl(prefill_w13_kernel, w13_grid, w13_block, size_t(2 * kStageBytes), stream, a);
  UF_CUDA_CHECK(cudaGetLastError());
  const PrefillW2Params b{w.w2,     w.w2_scale, dim_,      inter_, topk_,        sorted_, items_,
                          n_items_, h_codes_,   h_scales_, y,      y_row_stride, round_w2};
  const int tiles = dim_ / 16;
  const dim3 w2_grid((tiles + kW2Warps - 1) / kW2Warps, items);
  const dim3 w2_tiles_grid((tiles + kW2Warps * kW2Tiles - 1) / (kW2Warps * kW2Tiles), items);
  const bool w2_tiles = inter_ / 32 <= kW2TilesMaxKb;
  const dim3 w2_block(kW2Warps * 32);
  if (f16_ && w2_tiles && cols == kSmallCols)
    launch_pdl(prefill_w2_tiles_f16_kernel<kSmallCols>, w2_tiles_grid, w2_block,
               size_t(w2_tiles_smem<kSmallCols>(inter_)), stream, b);
  else if (f16_ && w2_tiles)
    launch_pdl(prefill_w2_tiles_f16_kernel<kCols>, w2_tiles_grid, w2_block,
               size_t(w2_tiles_smem<kCols>(inter_)), stream, b);
  else if (f16_ && cols == kSmallCols)
    launch_pdl(prefill_w2_f16_kernel<kSmallCols>, w2_grid, w2_block,
               size_t(w2_f16_smem<kSmallCols>(inter_)), stream, b);
  else if (f16_)
    launch_pdl(prefill_w2_f16_kernel<kCols>, w2_grid, w2_block, size_t(w2_f16_smem<kCols>(inter_)),
               stream, b);
  else
    launch_pdl(prefill_w2_kernel, w2_grid, w2_block, size_t(2 * kStageBytes), stream, b);
  UF_CUDA_CHECK(cudaGetLastError());
}

void MoeFp4Prefill::run(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                        const float* topk_w, float swiglu_limit, float* out,
                        cudaStream_t stream) const {
  experts_impl(w, x, topk_idx, topk_w, swiglu_limit, /*round_w2=*/true, y_, int64_t(topk_) * dim_,
               stream);
  moe_combine_rows(y_, topk_idx, x.m, topk_, experts_, dim_, out, stream);
}

void MoeFp4Prefill::run_partial(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                                const float* topk_w, float swiglu_limit, float* out,
                                cudaStream_t stream) const {
  experts_impl(w, x, topk_idx, topk_w, swiglu_limit, /*round_w2=*/false, y_, int64_t(topk_) * dim_,
               stream);
  moe_combine_rows(y_, topk_idx, x.m, topk_, experts_, dim_, out, stream);
}

void MoeFp4Prefill::run_add(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                            const float* topk_w, float swiglu_limit, bool partial, const float* add,
                            bool round_out, const std::function<void()>& before_combine, float* out,
                            cudaStream_t stream) const {
  experts_impl(w, x, topk_idx, topk_w, swiglu_limit, /*round_w2=*/!partial, y_,
               int64_t(topk_) * dim_, stream);
  if (before_combine) before_combine();
  moe_combine_add_rows(y_, topk_idx, x.m, topk_, experts_, dim_, add, round_out, out, stream);
}

void MoeFp4Prefill::run_experts(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                                const float* topk_w, float swiglu_limit, float* out,
                                int64_t row_stride, cudaStream_t stream) const {
  experts_impl(w, x, topk_idx, topk_w, swiglu_limit, /*round_w2=*/false, out, row_stride, stream);
}

void moe_act_quant_rows(const float* x, int m, int k, uint8_t* codes, float* scales,
                        cudaStream_t stream) {
  require(m >= 1 && k % 32 == 0, "moe_act_quant_rows: m = %d must be >= 1, k = %d a multiple of 32",
          m, k);
  const int64_t items = int64_t(m) * (k / 32);
  launch_pdl(prefill_quant_kernel, dim3(unsigned((items + 7) / 8)), dim3(256), 0, stream, x, m, k,
             codes, scales);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
