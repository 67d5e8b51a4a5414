// MoeFp4Prefill (cuda/moe.h): the routed-expert MoE for prefill chunks of many rows, grouped by
// expert so that each selected expert's weights are read once per call (not once per 8 rows).
//
// Kernels:
//   0. prefill_quant_kernel: x fp32 [m, K] -> FP8 codes + scales per 32 (act_quant_fp8_f32's
//      operations, any m).
//   1. prefill_plan_kernel (one block): the P = m * topk (row, expert) pairs sorted by expert id
//      (stable: ascending pair index, i.e. ascending row, within an expert) into `sorted`, and a
//      work list of items (expert, first sorted position, n <= kCols columns): an expert with c
//      pairs makes ceil(c / kCols) items. Invalid ids (< 0, >= E) select nothing.
//   2. prefill_w13_kernel: grid (I/32, max items), 4 warps as moe_w13_kernel (w1 rows 0-15 /
//      16-31, w3 rows 0-15 / 16-31 of one 32-row group). Each K block's weight fragment is loaded
//      and decoded once and applied to all kCols / 8 column groups of the item. Then the decode
//      epilogue (SwiGLU, routing weight, FP8 quantisation of h) per column; h goes to its sorted
//      position.
//   3. prefill_w2_kernel: grid (K/16 / 8, max items), 8 warps, one 16-row output tile per warp,
//      all column groups of the item; y of pair (t, k) at y + t * y_row_stride + k * dim.
//   4. moe_combine_rows (moe_fp4.cu): out[t] = sum over t's valid experts in ascending id of y
//      (fp32, from 0).
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

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/moe.h"

namespace uf::cuda {
namespace {

using namespace detail;

constexpr int kCols = 64;              // columns (pairs) per item: 8 mma column groups
constexpr int kGroups = kCols / 8;     // column groups per item
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
__global__ void __launch_bounds__(kPlanThreads)
    prefill_plan_kernel(const int* topk_idx, int P, int E, int* sorted, int* items, int* n_items) {
  extern __shared__ int psm[];
  int* s_e = psm;                // [P] expert of each pair (-1: invalid)
  int* s_off = psm + P;          // [E + 1] first sorted position of each expert
  int* s_item0 = s_off + E + 1;  // [E] first item of each expert
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < P; i += blockDim.x) {
    int e = topk_idx[i];
    s_e[i] = (e < 0 || e >= E) ? -1 : e;
  }
  for (int e = tid; e <= E; e += blockDim.x) s_off[e] = 0;
  __syncthreads();
  for (int i = tid; i < P; i += blockDim.x)
    if (s_e[i] >= 0) atomicAdd(&s_off[s_e[i] + 1], 1);  // counts (integers: order-free)
  __syncthreads();
  if (tid == 0) {  // exclusive scan of counts, and of items per expert
    int items_total = 0;
    for (int e = 0; e < E; ++e) {
      const int c = s_off[e + 1];
      s_off[e + 1] += s_off[e];
      s_item0[e] = items_total;
      items_total += (c + kCols - 1) / kCols;
    }
    *n_items = items_total;
  }
  __syncthreads();
  // Stable fill: one warp per expert scans the pairs in order (ballot), so an expert's pairs keep
  // ascending pair index.
  for (int e = warp; e < E; e += blockDim.x / 32) {
    int pos = s_off[e];
    if (pos == s_off[e + 1]) continue;  // warp-uniform
    for (int j0 = 0; j0 < P; j0 += 32) {
      const int j = j0 + lane;
      const bool hit = j < P && s_e[j] == e;
      const unsigned mask = __ballot_sync(0xffffffffu, hit);
      if (hit) sorted[pos + __popc(mask & ((1u << lane) - 1u))] = j;
      pos += __popc(mask);
    }
    const int base = s_off[e], count = s_off[e + 1] - base;
    for (int q = lane; q * kCols < count; q += 32) {
      int* it = items + 3 * (s_item0[e] + q);
      it[0] = e;
      it[1] = base + q * kCols;
      it[2] = min(kCols, count - q * kCols);
    }
  }
}

// x fp32 [m, k] -> codes / scales: act_quant_kernel's operations (one warp per (row, 32-block)).
__global__ void __launch_bounds__(256)
    prefill_quant_kernel(const float* x, int m, int k, uint8_t* codes, float* scales) {
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

// Stages K blocks [kb0, kb0 + kbn) of the columns c < ncols (column c: activation row act_row(c),
// -1 = none: zeros) into stage with cp.async (one commit group; the caller waits for it and
// synchronises): codes at c * kStageRow, then the scales [kCols][kStageKb] as stored (the caller
// applies kE2M1ToE4M3Rescale, as the unstaged kernel did). A missing column is zero-filled by a
// cp.async of source size 0. All threads of the CTA.
__device__ __forceinline__ void cp_async_zfill(void* dst, const void* src, int bytes, bool valid) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
  if (bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src),
                 "r"(valid ? 4 : 0)
                 : "memory");
}

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

  // Epilogue as moe_w13_kernel's: one warp per column, lane = row within the 32-row group.
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

__global__ void __launch_bounds__(kW2Warps * 32) prefill_w2_kernel(const PrefillW2Params p) {
  extern __shared__ __align__(16) uint8_t stage[];  // 2 x kStageBytes
  __shared__ int s_pair[kCols];
  const int item = blockIdx.y;
  if (item >= *p.n_items) return;
  const int expert = p.items[3 * item], pos0 = p.items[3 * item + 1], n = p.items[3 * item + 2];
  for (int c = threadIdx.x; c < kCols; c += blockDim.x) s_pair[c] = c < n ? p.sorted[pos0 + c] : -1;
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
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
  const int rbase = tile * 16;
  auto out = [&](int pair) {
    return p.y + (pair / p.topk) * p.y_row_stride + size_t(pair % p.topk) * p.dim + rbase;
  };
#pragma unroll
  for (int cg = 0; cg < kGroups; ++cg) {
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

}  // namespace

MoeFp4Prefill::MoeFp4Prefill(int dim, int inter, int topk, int num_experts, int max_rows)
    : dim_(dim), inter_(inter), topk_(topk), experts_(num_experts), max_rows_(max_rows) {
  require(dim > 0 && inter > 0 && dim % 128 == 0 && inter % 32 == 0 && topk >= 1 && topk <= 8 &&
              num_experts >= 1 && max_rows >= 1,
          "MoeFp4Prefill: dim %d (multiple of 128), inter %d (of 32), topk %d (1..8), experts %d, "
          "max rows %d",
          dim, inter, topk, num_experts, max_rows);
  const size_t P = size_t(max_rows) * topk;
  max_items_ = int(std::min<size_t>(size_t(num_experts), P) + P / kCols + 1);
  require(max_items_ <= 65535, "MoeFp4Prefill: %d work items exceed the grid's y limit",
          max_items_);
  plan_smem_ = int(sizeof(int) * (P + 2 * size_t(num_experts) + 1));
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
  prefill_plan_kernel<<<1, kPlanThreads, size_t(plan_smem_), stream>>>(topk_idx, P, experts_,
                                                                       sorted_, items_, n_items_);
  UF_CUDA_CHECK(cudaGetLastError());
  // Items needed for this P (<= max_items_): the grid is sized for it, blocks past n_items exit.
  const int items = std::min(max_items_, std::min(experts_, P) + P / kCols + 1);
  const PrefillW13Params a{w.w1,     w.w1_scale,   w.w3,     w.w3_scale, dim_,    inter_,
                           topk_,    x.codes,      x.scales, topk_w,     sorted_, items_,
                           n_items_, swiglu_limit, h_codes_, h_scales_};
  prefill_w13_kernel<<<dim3(inter_ / 32, items), kW13Warps * 32, 2 * kStageBytes, stream>>>(a);
  UF_CUDA_CHECK(cudaGetLastError());
  const PrefillW2Params b{w.w2,     w.w2_scale, dim_,      inter_, topk_,        sorted_, items_,
                          n_items_, h_codes_,   h_scales_, y,      y_row_stride, round_w2};
  const int tiles = dim_ / 16;
  prefill_w2_kernel<<<dim3((tiles + kW2Warps - 1) / kW2Warps, items), kW2Warps * 32,
                      2 * kStageBytes, stream>>>(b);
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
  prefill_quant_kernel<<<unsigned((items + 7) / 8), 256, 0, stream>>>(x, m, k, codes, scales);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
