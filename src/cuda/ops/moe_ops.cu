// DeviceMoe (ops/moe.h): cpu::moe_forward on the device, by chunks of kMaxDecodeRows rows.
//
// Per chunk of m <= 8 rows (steps 1 and 2 are ONE launch, moe_router_kernel, on the default path
// for a BF16 gate and a 16-byte aligned x; bitwise the same scores, choice, weights and codes):
//   1. gate scores: DeviceLinear kF32 (dense_rows; the CPU's products, its own fp32 order);
//   2. route_quant_kernel (decode chunks; route_warp_kernel / route_kernel + act quant otherwise):
//      one warp per row routes (route_row: score function, selection bias, top-k with ties to
//      the lower expert id, as the CPU's partial_sort comparator, normalisation (+1e-20) and
//      route_scale, the same fp32 operations as cpu::moe_route; expf / log1pf may differ from
//      glibc by an ulp) while the other CTAs of the same launch FP8-quantise the input rows
//      (act_quant_fp8_f32's operations);
//   3. routed experts: MoeFp4 (MXFP4 W4A8; input FP8-quantised per 32 exactly as linear_quant;
//      g/u rounded to bf16, clamps, h = bf16(weight * (silu(g) * u)), w2 output rounded to bf16,
//      expert outputs summed in fp32 in ascending expert id from 0: all as cpu::expert_forward /
//      moe_forward; only the order of a block's 32 products and the K-split grouping differ);
//   4. shared expert: DeviceLinear w1, w3 (kQuant, bf16 outputs), swiglu_kernel
//      (h = bf16(silu(min(g, L)) * clamp(u, -L, L))), DeviceLinear w2 (bf16 output); on the
//      object's own stream (forked from the caller's by an event, joined back by another before
//      the combine; CUDA graph capture records the fork and the join): a decode chunk forks it
//      after the router, so it runs beside steps 2-3 (with the unit w13 kernel its launches are
//      enqueued after w13's: run_chunk says why), a prefill chunk at the start;
//   5. combine: y = bf16(routed + shared), folded into MoeFp4's combine kernel (MoeFp4::run_add,
//      and MoeFp4Prefill::run_add for prefill chunks; combine_kernel's operations).
//      set_legacy(true): the earlier order (4 after 3 on the caller's stream, a separate
//      combine_kernel) and MoeFp4's persistent kernels; bitwise the same outputs.
// T > kMaxDecodeRows (prefill): the same five steps once per chunk of up to max_prefill_rows
// rows, step 3 through MoeFp4Prefill (pairs grouped by expert over the whole chunk; bitwise
// MoeFp4's outputs), the other steps on all rows at once (each row-independent: the same bits).
// Tensor-parallel partials (ops/moe.h): apply_partial skips every rounding after a w2 product
// (MoeFp4::run_partial, DeviceLinear::apply_partial, combine without rounding);
// apply_partial_experts writes each expert's unrounded w2 output to its own slot
// (MoeFp4::run_experts) and combine_experts applies apply()'s roundings after the ranks' sum.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/gemv.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/l2_window.h"
#include "cuda/kernels/moe_plan.cuh"
#include "cuda/kernels/probe.cuh"
#include "cuda/moe.h"
#include "cuda/ops/linear_kernels.h"
#include "cuda/ops/moe.h"

namespace uf::cuda {

using model::WFormat;

namespace {

constexpr int kRouteThreads = 256;
constexpr int kMaxTopK = 8;  // MoeFp4: 8 rows * top_k <= 64
enum ScoreFunc { kSqrtSoftplus = 0, kSoftmax = 1, kSigmoid = 2 };

__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) {
  // cpu::moe_route's comparator; an unset candidate (index < 0) loses to anything.
  if (ib < 0) return ia >= 0;
  if (ia < 0) return false;
  return va > vb || (va == vb && ia < ib);
}

// One block per row: scores [m, E] (gate outputs) -> gate_i / gate_w [m, K].
__global__ void __launch_bounds__(kRouteThreads)
    route_kernel(const float* scores, const float* bias, int E, int K, int func, float gate_temp,
                 float route_scale, int32_t* gate_i, float* gate_w) {
  extern __shared__ float smem[];
  float* sc = smem;          // [E] scores after the score function
  float* biased = smem + E;  // [E] scores + bias (selection only)
  __shared__ int s_sel[kMaxTopK];
  __shared__ float s_wv[kRouteThreads / 32];
  __shared__ int s_wi[kRouteThreads / 32];
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* row = scores + size_t(t) * E;
  for (int e = tid; e < E; e += blockDim.x) {
    float v = __fdiv_rn(row[e], gate_temp);
    if (func == kSigmoid)
      v = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-v)));
    else if (func == kSqrtSoftplus)
      v = __fsqrt_rn(v > 20.f ? v : log1pf(expf(v)));
    sc[e] = v;
  }
  __syncthreads();
  if (func == kSoftmax) {
    if (tid == 0) {  // sequential, in the CPU's order
      float mx = sc[0];
      for (int e = 1; e < E; ++e) mx = fmaxf(mx, sc[e]);
      float sum = 0.f;
      for (int e = 0; e < E; ++e) {
        sc[e] = expf(__fsub_rn(sc[e], mx));
        sum = __fadd_rn(sum, sc[e]);
      }
      for (int e = 0; e < E; ++e) sc[e] = __fdiv_rn(sc[e], sum);
    }
    __syncthreads();
  }
  for (int e = tid; e < E; e += blockDim.x) biased[e] = __fadd_rn(sc[e], bias[e]);
  __syncthreads();
  for (int k = 0; k < K; ++k) {
    float bv = 0.f;
    int bi = -1;
    for (int e = tid; e < E; e += blockDim.x) {
      bool taken = false;
      for (int j = 0; j < k; ++j) taken |= s_sel[j] == e;
      if (!taken && better(biased[e], e, bv, bi)) {
        bv = biased[e];
        bi = e;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (better(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == 0) {
      s_wv[warp] = bv;
      s_wi[warp] = bi;
    }
    __syncthreads();
    if (tid == 0) {
      float v = s_wv[0];
      int i = s_wi[0];
      for (int w = 1; w < int(blockDim.x / 32); ++w)
        if (better(s_wv[w], s_wi[w], v, i)) {
          v = s_wv[w];
          i = s_wi[w];
        }
      s_sel[k] = i;
    }
    __syncthreads();
  }
  if (tid == 0) {
    float* gw = gate_w + size_t(t) * K;
    int32_t* gi = gate_i + size_t(t) * K;
    for (int k = 0; k < K; ++k) {
      gi[k] = s_sel[k];
      gw[k] = sc[s_sel[k]];
    }
    if (K > 1) {  // norm_topk_prob (always on for this model)
      float sum = 0.f;
      for (int k = 0; k < K; ++k) sum = __fadd_rn(sum, gw[k]);
      sum = __fadd_rn(sum, 1e-20f);
      for (int k = 0; k < K; ++k) gw[k] = __fdiv_rn(gw[k], sum);
    }
    for (int k = 0; k < K; ++k) gw[k] = __fmul_rn(gw[k], route_scale);
  }
}

// route_kernel on one warp per row (E <= 32 * kRoutePerLane): lane l holds experts l, l + 32, ...
// in registers, so the K selection rounds are shuffles with no block barrier. Each candidate is a
// 64-bit key (order-preserving bits of the biased score, then ~expert id: larger key = better,
// ties to the lower id, exactly route_kernel's comparator `better` for non-NaN scores; -0 counts
// as +0; a NaN score loses to every number). Each lane first sorts its best kMaxTopK keys
// (lane_top_keys); a round is then a warp max over the lanes' heads, and the winner's list
// advances by one.
// The same fp32 operations for the scores and weights as route_kernel (tests/cuda/test_ops_moe.cpp
// checks the choice and the weights against cpu::moe_route). PDL: the bias loads run before the
// wait for the gate scores.
constexpr int kRoutePerLane = 16;

__device__ __forceinline__ uint64_t route_key(float v, int e) {
  uint32_t b = __float_as_uint(__fadd_rn(v, 0.0f));  // -0 -> +0
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);    // monotone in the float order
  if (v != v) b = 0;                                 // NaN: below every number
  return (uint64_t(b) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(e));
}

// One compare-exchange of (key, score) pairs: the larger key to slot i.
__device__ __forceinline__ void route_cx(uint64_t* key, float* sc, int i, int j) {
  const bool swap = key[i] < key[j];
  const uint64_t ki = key[i], kj = key[j];
  const float si = sc[i], sj = sc[j];
  key[i] = swap ? kj : ki;
  key[j] = swap ? ki : kj;
  sc[i] = swap ? sj : si;
  sc[j] = swap ? si : sj;
}

// Sorts 8 pairs by key, largest first: the 19-comparator, depth-6 network (Knuth, TAOCP 5.3.4).
__device__ __forceinline__ void route_sort8(uint64_t* key, float* sc) {
  constexpr int kNet[19][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {0, 4}, {1, 5}, {2, 6},
                               {3, 7}, {0, 1}, {2, 3}, {4, 5}, {6, 7}, {2, 4}, {3, 5},
                               {1, 4}, {3, 6}, {1, 2}, {3, 4}, {5, 6}};
#pragma unroll
  for (int c = 0; c < 19; ++c) route_cx(key, sc, kNet[c][0], kNet[c][1]);
}

// The kMaxTopK (8) largest of a lane's kRoutePerLane (16) keys, sorted largest first, into
// key[0..7] / sc[0..7] (slots 8..15 are left unspecified). Both halves sorted; slot i keeps the
// larger of a[i] and b[7 - i], which holds the 8 largest as a bitonic sequence; three
// half-cleaner stages sort it. Every index is a compile-time constant after unrolling: the arrays
// stay in registers.
__device__ __forceinline__ void lane_top_keys(uint64_t* key, float* sc) {
  static_assert(kRoutePerLane == 16 && kMaxTopK == 8, "the network is written for 8 of 16");
  route_sort8(key, sc);
  route_sort8(key + 8, sc + 8);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const bool take = key[i] < key[15 - i];
    key[i] = take ? key[15 - i] : key[i];
    sc[i] = take ? sc[15 - i] : sc[i];
  }
#pragma unroll
  for (int h = 4; h >= 1; h >>= 1)
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if ((i & h) == 0) route_cx(key, sc, i, i + h);
}

// The elementwise part of a score function (sigmoid, sqrt-softplus; softmax: the division by the
// temperature only): route_kernel's / route_row's operations, one definition for both places
// route_row's input can come from.
__device__ __forceinline__ float score_elementwise(float s, int func, float gate_temp) {
  float v = __fdiv_rn(s, gate_temp);
  if (func == kSigmoid)
    v = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-v)));
  else if (func == kSqrtSoftplus)
    v = __fsqrt_rn(v > 20.f ? v : log1pf(expf(v)));
  return v;
}

// Row blockIdx.x, run by one warp (lane = threadIdx.x & 31); smem [E] for the softmax only.
// Row t (default blockIdx.x). Scores are read through L2 (__ldcg): moe_router_kernel's finishing
// CTA reads the other CTAs' scores. pre (not for softmax): `scores` already holds
// score_elementwise of the gate outputs (moe_router_kernel computes it where the scores are
// made, off its serial tail).
__device__ __forceinline__ void route_row(const float* scores, const float* bias, int E, int K,
                                          int func, float gate_temp, float route_scale,
                                          int32_t* gate_i, float* gate_w, float* smem, int t = -1,
                                          bool pre = false,
                                          [[maybe_unused]] void* probe_rec = nullptr) {
  // Probe points of the caller's record (probe builds): 2 inputs loaded, 3 keys built, 4 top-k
  // chosen, 5 stored.
  [[maybe_unused]] uf::cuda::probe::Record* probe = nullptr;
#if defined(UF_PROBE) && UF_PROBE
  if (threadIdx.x == 0) probe = static_cast<uf::cuda::probe::Record*>(probe_rec);
#endif
  detail::pdl_trigger();
  if (t < 0) t = blockIdx.x;
  const int lane = threadIdx.x & 31;
  const float* row = scores + size_t(t) * E;
  float sc[kRoutePerLane], bz[kRoutePerLane];
#pragma unroll
  for (int i = 0; i < kRoutePerLane; ++i) {
    const int e = lane + 32 * i;
    bz[i] = e < E ? __ldg(bias + e) : 0.f;
  }
  detail::pdl_wait();
#pragma unroll
  for (int i = 0; i < kRoutePerLane; ++i) {
    const int e = lane + 32 * i;
    float v = 0.f;
    if (e < E) v = pre ? __ldcg(row + e) : score_elementwise(__ldcg(row + e), func, gate_temp);
    sc[i] = v;
  }
  UF_PROBE_MARK(probe, 2);
  if (func == kSoftmax) {  // sequential, in the CPU's order
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i)
      if (lane + 32 * i < E) smem[lane + 32 * i] = sc[i];
    __syncwarp();
    if (lane == 0) {
      float mx = smem[0];
      for (int e = 1; e < E; ++e) mx = fmaxf(mx, smem[e]);
      float sum = 0.f;
      for (int e = 0; e < E; ++e) {
        smem[e] = expf(__fsub_rn(smem[e], mx));
        sum = __fadd_rn(sum, smem[e]);
      }
      for (int e = 0; e < E; ++e) smem[e] = __fdiv_rn(smem[e], sum);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i)
      if (lane + 32 * i < E) sc[i] = smem[lane + 32 * i];
  }
  uint64_t key[kRoutePerLane];
#pragma unroll
  for (int i = 0; i < kRoutePerLane; ++i) {
    const int e = lane + 32 * i;
    key[i] = e < E ? route_key(__fadd_rn(sc[i], bz[i]), e) : 0ull;  // 0: no candidate
  }
  // The lane's kMaxTopK best keys, sorted, with their scores: a round only has to advance the
  // winner's list by one (a rescan of 16 keys in each round was 2-2.7 us of the router's tail).
  lane_top_keys(key, sc);
  UF_PROBE_MARK(probe, 3);
  int gi[kMaxTopK];
  float gw[kMaxTopK];
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    gi[k] = -1;
    gw[k] = 0.f;
    if (k < K) {
      // The warp's largest 64-bit key in two warp reductions (redux.sync) instead of a 5-step
      // shuffle butterfly on 64-bit values: the largest high word, then the largest low word
      // among the lanes holding it. The same key, so the same expert, ties included.
      const uint64_t head = key[0];
      const uint32_t hi = uint32_t(head >> 32);
      const uint32_t best_hi = __reduce_max_sync(0xffffffffu, hi);
      const uint32_t best_lo = __reduce_max_sync(0xffffffffu, hi == best_hi ? uint32_t(head) : 0u);
      const uint64_t best = (uint64_t(best_hi) << 32) | best_lo;
      const int e = best == 0 ? -1 : int(0xFFFFFFFFu - uint32_t(best));
      gi[k] = e;
      const float w = sc[0];
      // The owner drops its head (keys are unique: only the owner's head equals best). Selects,
      // not a branch: every lane runs the same instructions, and no dynamic index puts the lists
      // in local memory.
      const bool own = best != 0 && head == best;
#pragma unroll
      for (int j = 0; j + 1 < kMaxTopK; ++j) {
        key[j] = own ? key[j + 1] : key[j];
        sc[j] = own ? sc[j + 1] : sc[j];
      }
      key[kMaxTopK - 1] = own ? 0ull : key[kMaxTopK - 1];
      gw[k] = e >= 0 ? __shfl_sync(0xffffffffu, w, e & 31) : 0.f;
    }
  }
  UF_PROBE_MARK(probe, 4);
  if (lane == 0) {
    if (K > 1) {  // norm_topk_prob (always on for this model)
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k)
        if (k < K) sum = __fadd_rn(sum, gw[k]);
      sum = __fadd_rn(sum, 1e-20f);
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k)
        if (k < K) gw[k] = __fdiv_rn(gw[k], sum);
    }
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k)
      if (k < K) {
        gate_i[size_t(t) * K + k] = gi[k];
        gate_w[size_t(t) * K + k] = __fmul_rn(gw[k], route_scale);
      }
  }
  UF_PROBE_MARK(probe, 5);
}

__global__ void __launch_bounds__(32)
    route_warp_kernel(const float* scores, const float* bias, int E, int K, int func,
                      float gate_temp, float route_scale, int32_t* gate_i, float* gate_w) {
  extern __shared__ float smem[];  // [E]: the softmax's sequential pass only
  route_row(scores, bias, E, K, func, gate_temp, route_scale, gate_i, gate_w, smem);
}

// The decode chunk's routing and FP8 input quantization in one launch (one dependency step
// less): grid (rows, 1 + ceil(D/32 / 8)), 256 threads. Column 0: warp 0 routes row blockIdx.x
// (route_row); the other columns: one warp per 32-block of the row, act_quant_fp8_f32's
// operations (warp_quant_fp8_block), so the codes and scales are bitwise the same.
__global__ void __launch_bounds__(256)
    route_quant_kernel(const float* scores, const float* bias, int E, int K, int func,
                       float gate_temp, float route_scale, int32_t* gate_i, float* gate_w,
                       const float* x, int D, uint8_t* codes, float* xscales) {
  extern __shared__ float smem[];
  if (blockIdx.y == 0) {
    if (threadIdx.x < 32)
      route_row(scores, bias, E, K, func, gate_temp, route_scale, gate_i, gate_w, smem);
    return;
  }
  detail::pdl_trigger();
  detail::pdl_wait();
  const int nkb = D / 32, kb = (blockIdx.y - 1) * 8 + (threadIdx.x >> 5);
  if (kb >= nkb) return;
  const int row = blockIdx.x, lane = threadIdx.x & 31;
  const size_t idx = size_t(row) * D + kb * 32 + lane;
  float sc;
  codes[idx] = detail::warp_quant_fp8_block(x[idx], &sc);
  if (lane == 0) xscales[size_t(row) * nkb + kb] = sc;
}

// The decode chunk's router in ONE launch (DeviceMoe's default path; the legacy path runs the
// gate through DeviceLinear kF32 = dense_rows, then route_quant_kernel): grid ceil(E / 2) CTAs
// of 8 warps, CTA b = gate rows 2b, 2b + 1 (bf16 [E, D]).
//  1. Before griddepcontrol.wait: the CTA's gate rows into shared memory (cp.async, 20 KB at
//     D = 5120; the weights never depend on the previous kernel).
//  2. The FP8 quantisation of x: the m * D/32 blocks spread over all warps of the grid
//     (warp_quant_fp8_block: route_quant_kernel's / act_quant_fp8_f32's operations, same bits).
//  3. The gate scores in dense_rows_kernel's fp32 order exactly (ops/linear.cu, kDenseWarps = 8,
//     kDenseChunk = 256: lane's running fmaf over its 8 elements per 256-element step of its
//     warp, steps in K order; xor-shuffle tree over the lanes; warps summed in warp order from
//     warp 0), so the scores are bitwise DeviceLinear kF32's (tests compare with the legacy
//     path); written to `scores` [m, E].
//  4. The last CTA to finish (global counter, reset by it for the next call / graph replay)
//     routes the m rows, one warp each (route_row: route_quant_kernel's routing). For the
//     elementwise score functions each CTA also writes score_elementwise of its own scores to
//     `probs` [m, E] before counting, so the serial tail only selects and normalises.
// One launch less and the gate's weight latency hidden behind the previous kernel; the finishing
// CTA's extra L2 round trip (~1 us) is what it costs.
constexpr int kRouterWarps = 8;     // = kDenseWarps of dense_rows_kernel (its fp32 order)
constexpr int kRouterChunk = 256;   // = kDenseChunk
constexpr int kRouterGateRows = 2;  // gate rows per CTA

__global__ void __launch_bounds__(kRouterWarps * 32)
    moe_router_kernel(const uint8_t* gate, int E, int D, const float* x, int m, float* scores,
                      float* probs, int* counter, const float* bias, int K, int func,
                      float gate_temp, float route_scale, int32_t* gate_i, float* gate_w,
                      uint8_t* codes, float* xscales) {
  extern __shared__ __align__(16) float router_smem[];  // [2][D] bf16 gate rows, softmax [m][E]
  uint8_t* smem = reinterpret_cast<uint8_t*>(router_smem);
  __shared__ float red[kRouterWarps][kRouterGateRows][kMaxDecodeRows];
  __shared__ int s_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e0 = blockIdx.x * kRouterGateRows, nr = min(kRouterGateRows, E - e0);
  {
    const int pieces = D / 8;  // 16-byte pieces per row
    for (int i = threadIdx.x; i < nr * pieces; i += blockDim.x) {
      const int r = i / pieces, c = i - r * pieces;
      const uint32_t d = uint32_t(__cvta_generic_to_shared(smem + (size_t(r) * D + c * 8) * 2));
      const uint8_t* src = gate + (size_t(e0 + r) * D + c * 8) * 2;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
    }
    detail::cp_async_commit();
  }
  detail::pdl_wait();
  detail::pdl_trigger();
  const int nkb = D / 32;
  for (int item = blockIdx.x * kRouterWarps + warp; item < m * nkb;
       item += gridDim.x * kRouterWarps) {
    const int row = item / nkb, kb = item - row * nkb;
    const size_t idx = size_t(row) * D + kb * 32 + lane;
    float sc;
    codes[idx] = detail::warp_quant_fp8_block(x[idx], &sc);
    if (lane == 0) xscales[size_t(row) * nkb + kb] = sc;
  }
  detail::cp_async_wait<0>();
  __syncthreads();
  for (int r = 0; r < nr; ++r) {
    float acc[kMaxDecodeRows];
#pragma unroll
    for (int t = 0; t < kMaxDecodeRows; ++t) acc[t] = 0.f;
    for (int k = warp * kRouterChunk + lane * 8; k < D; k += kRouterWarps * kRouterChunk) {
      const uint4 q = *reinterpret_cast<const uint4*>(smem + (size_t(r) * D + k) * 2);
      const uint32_t u[4] = {q.x, q.y, q.z, q.w};
      float wv[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        wv[2 * i] = __uint_as_float(u[i] << 16);
        wv[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
      }
#pragma unroll
      for (int t = 0; t < kMaxDecodeRows; ++t) {
        if (t >= m) break;
        const float4* xp = reinterpret_cast<const float4*>(x + size_t(t) * D + k);
        const float4 a = xp[0], b = xp[1];
        const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[t] = fmaf(xv[i], wv[i], acc[t]);
      }
    }
#pragma unroll
    for (int t = 0; t < kMaxDecodeRows; ++t) {
      float v = acc[t];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
      if (lane == 0) red[warp][r][t] = v;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nr * m; i += blockDim.x) {
    const int r = i / m, t = i - r * m;
    float v = red[0][r][t];
    for (int q = 1; q < kRouterWarps; ++q) v = __fadd_rn(v, red[q][r][t]);
    scores[size_t(t) * E + e0 + r] = v;
    if (func != kSoftmax) probs[size_t(t) * E + e0 + r] = score_elementwise(v, func, gate_temp);
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(counter, 1) == int(gridDim.x) - 1;
  __syncthreads();
  if (!s_last) return;  // uniform over the block
  __threadfence();
  if (warp < m) {
    float* soft = reinterpret_cast<float*>(smem + size_t(kRouterGateRows) * D * 2) + warp * E;
    const bool pre = func != kSoftmax;
    route_row(pre ? probs : scores, bias, E, K, func, gate_temp, route_scale, gate_i, gate_w, soft,
              warp, pre);
  }
  if (threadIdx.x == 0) *counter = 0;  // every CTA has counted: safe to reset
}

// moe_router_kernel restructured for latency (DeviceMoe's default since session 7; the kernel
// above stays selectable: set_moe_router_variant(1)). The same outputs bit for bit: the scores in
// dense_rows_kernel's fp32 order (each (gate row, x row) accumulator gets the same fmaf sequence:
// steps in K order, 8 elements in order; the same xor tree; warps summed from warp 0), the same
// probs, route_row tail and warp_quant_fp8_block codes. What changed:
//  - kRows gate rows per CTA (E / 4 = 96 CTAs at E = 384, 40 KB of gate in shared memory): each
//    x value loaded from L2 serves kRows gate rows (a quarter of the old kernel's x traffic per
//    gate row), a step's x loads for all m rows issued at once (predicated, no break: one L2
//    latency a step, 2-3 steps at D = 5120); 125 registers: 2 CTAs an SM stay possible;
//  - launch_dependents right after the gate loads are issued (before the wait), so the next
//    kernels' weight loads start while this one runs;
//  - the FP8 quantisation of x after the counter: the CTAs that are not last quantise while the
//    last one routes (the routing no longer waits behind any quantisation);
//  - no softmax scratch (func == softmax takes the previous kernel).
constexpr int kRouter2Rows = 4;

template <int kRows>
__global__ void __launch_bounds__(kRouterWarps * 32, 2)
    moe_router2_kernel(const uint8_t* gate, int E, int D, const float* x, int m, float* scores,
                       float* probs, int* counter, const float* bias, int K, int func,
                       float gate_temp, float route_scale, int32_t* gate_i, float* gate_w,
                       uint8_t* codes, float* xscales) {
  extern __shared__ __align__(16) float router_smem[];  // [kRows][D] bf16 gate rows
  const uint8_t* smem = reinterpret_cast<const uint8_t*>(router_smem);
  __shared__ float red[kRouterWarps][kRows][kMaxDecodeRows];
  __shared__ int s_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e0 = blockIdx.x * kRows, nr = min(kRows, E - e0);
  // Probe points: 0 start, 1 PDL wait returned, 2 gate landed, 3 dot products reduced, 4 ticket
  // taken; the last CTA's own record: 0 ticket, 1 routed; 5 quantised (exit).
  UF_PROBE_OPEN(probe, kTagRouter2);
  UF_PROBE_MARK(probe, 0);
  {
    const int pieces = D / 8;  // 16-byte pieces per row
    for (int i = threadIdx.x; i < nr * pieces; i += blockDim.x) {
      const int r = i / pieces, c = i - r * pieces;
      const uint32_t d = uint32_t(__cvta_generic_to_shared(smem + (size_t(r) * D + c * 8) * 2));
      const uint8_t* src = gate + (size_t(e0 + r) * D + c * 8) * 2;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
    }
    detail::cp_async_commit();
  }
  detail::pdl_trigger();
  detail::pdl_wait();
  UF_PROBE_MARK(probe, 1);
  // x [m, D] rows t < m, elements k .. k + 7 (16-byte aligned: D % 32 == 0, x 16-byte aligned).
  auto load_x = [&](int k, float(&xv)[kMaxDecodeRows][8]) {
#pragma unroll
    for (int t = 0; t < kMaxDecodeRows; ++t) {
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
      if (t < m) {
        const float4* xp = reinterpret_cast<const float4*>(x + size_t(t) * D + k);
        a = xp[0];
        b = xp[1];
      }
      xv[t][0] = a.x;
      xv[t][1] = a.y;
      xv[t][2] = a.z;
      xv[t][3] = a.w;
      xv[t][4] = b.x;
      xv[t][5] = b.y;
      xv[t][6] = b.z;
      xv[t][7] = b.w;
    }
  };
  float acc[kRows][kMaxDecodeRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int t = 0; t < kMaxDecodeRows; ++t) acc[r][t] = 0.f;
  constexpr int kStep = kRouterWarps * kRouterChunk;
  int k = warp * kRouterChunk + lane * 8;
  float xv[kMaxDecodeRows][8];
  if (k < D) load_x(k, xv);  // the first step's x in flight while the gate lands
  detail::cp_async_wait<0>();
  __syncthreads();
  UF_PROBE_MARK(probe, 2);
  for (; k < D; k += kStep) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= nr) break;
      const uint4 q = *reinterpret_cast<const uint4*>(smem + (size_t(r) * D + k) * 2);
      const uint32_t u[4] = {q.x, q.y, q.z, q.w};
      float wv[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        wv[2 * i] = __uint_as_float(u[i] << 16);
        wv[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
      }
#pragma unroll
      for (int t = 0; t < kMaxDecodeRows; ++t)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][t] = fmaf(xv[t][i], wv[i], acc[r][t]);
    }
    if (k + kStep < D) load_x(k + kStep, xv);  // the next step's, all m rows at once
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int t = 0; t < kMaxDecodeRows; ++t) {
      float v = acc[r][t];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
      if (lane == 0) red[warp][r][t] = v;
    }
  __syncthreads();
  UF_PROBE_MARK(probe, 3);
  for (int i = threadIdx.x; i < nr * m; i += blockDim.x) {
    const int r = i / m, t = i - r * m;
    float v = red[0][r][t];
    for (int q = 1; q < kRouterWarps; ++q) v = __fadd_rn(v, red[q][r][t]);
    scores[size_t(t) * E + e0 + r] = v;
    probs[size_t(t) * E + e0 + r] = score_elementwise(v, func, gate_temp);  // func != softmax
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(counter, 1) == int(gridDim.x) - 1;
  __syncthreads();
  const bool last = s_last;  // uniform over the block
  UF_PROBE_MARK(probe, 4);
  if (last) {
    UF_PROBE_OPEN_IF(probe_last, kTagRouterLast, threadIdx.x == 0);
    UF_PROBE_MARK(probe_last, 0);
    __threadfence();
    UF_PROBE_MARK(probe_last, 1);
#if defined(UF_PROBE) && UF_PROBE
    void* probe_rec = probe_last;
#else
    void* probe_rec = nullptr;
#endif
    if (warp < m)
      route_row(probs, bias, E, K, func, gate_temp, route_scale, gate_i, gate_w, nullptr, warp,
                true, probe_rec);
    if (threadIdx.x == 0) *counter = 0;  // every CTA has counted: safe to reset
    UF_PROBE_MARK(probe_last, 6);
  }
  // The FP8 quantisation of x (route_quant_kernel's items, spread over the grid's warps).
  const int nkb = D / 32;
  for (int item = blockIdx.x * kRouterWarps + warp; item < m * nkb;
       item += gridDim.x * kRouterWarps) {
    const int row = item / nkb, kb = item - row * nkb;
    const size_t idx = size_t(row) * D + kb * 32 + lane;
    float sc;
    codes[idx] = detail::warp_quant_fp8_block(x[idx], &sc);
    if (lane == 0) xscales[size_t(row) * nkb + kb] = sc;
  }
  UF_PROBE_MARK(probe, 5);
}

// Shared expert SwiGLU on bf16 g / u (cpu::expert_forward without a routing weight).
__global__ void swiglu_kernel(const float* g, const float* u, size_t n, float lim, float* h) {
  detail::pdl_trigger();  // PDL (launch_pdl): g / u come from the previous kernel
  detail::pdl_wait();
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float gv = g[i], uv = u[i];
  if (lim > 0.f) {
    uv = fminf(fmaxf(uv, -lim), lim);
    gv = fminf(gv, lim);
  }
  h[i] = detail::round_bf16(__fmul_rn(__fdiv_rn(gv, __fadd_rn(1.0f, expf(-gv))), uv));
}

__global__ void combine_kernel(const float* routed, const float* shared, size_t n, bool round,
                               float* y) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = __fadd_rn(routed[i], shared[i]);
  y[i] = round ? detail::round_bf16(v) : v;
}

// slots [T, K + 1, D] -> y [T, D]: MoeFp4's combine (ascending expert id, fp32 from 0) over
// bf16-rounded slots, then combine_kernel's bf16(routed + bf16(shared)). grid (D / 256, rows).
__global__ void combine_experts_kernel(const float* slots, const int32_t* gate_i, int T, int K,
                                       int E, int D, float* y) {
  __shared__ int s_k[kMaxTopK];
  __shared__ int s_n;
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  for (int t = blockIdx.y; t < T; t += gridDim.y) {
    __syncthreads();       // s_k of the previous row is no longer read
    if (threadIdx.x < 32)  // by expert id, as moe_combine_kernel
      detail::rank_row_experts(gate_i + int64_t(t) * K, K, E, s_k, &s_n);
    __syncthreads();
    if (col < D) {
      const float* row = slots + int64_t(t) * (K + 1) * D + col;
      float sum = 0.f;
      for (int j = 0; j < s_n; ++j)
        sum = __fadd_rn(sum, detail::round_bf16(row[int64_t(s_k[j]) * D]));
      y[int64_t(t) * D + col] =
          detail::round_bf16(__fadd_rn(sum, detail::round_bf16(row[int64_t(K) * D])));
    }
  }
}

unsigned blocks_for(size_t n, int threads) { return unsigned((n + threads - 1) / threads); }

// One stacked expert matrix [E, rows, cols] (FP4) and its scales [E, rows, cols / 32].
struct Stacked {
  uint8_t* data = nullptr;
  uint8_t* scale = nullptr;
};

Stacked stack_experts(const std::vector<model::ExpertWeights>& experts,
                      model::Weight model::ExpertWeights::*which, int64_t rows, int64_t cols,
                      DeviceArena& arena) {
  const size_t E = experts.size();
  const size_t data_bytes = size_t(rows) * size_t(cols / 2),
               scale_bytes = size_t(rows) * (cols / 32);
  Stacked s;
  s.data = arena.alloc<uint8_t>(E * data_bytes);
  s.scale = arena.alloc<uint8_t>(E * scale_bytes);
  for (size_t e = 0; e < E; ++e) {
    const model::Weight& w = experts[e].*which;
    require(w.format == WFormat::kFP4 && w.rows == rows && w.cols == cols && w.data && w.scale,
            "DeviceMoe: routed expert weight '%s' must be FP4 [%lld, %lld] (MoeFp4)",
            w.name.c_str(), static_cast<long long>(rows), static_cast<long long>(cols));
    // Through the loader's UploadScope when there is one (cuda/device_weights.h), else synchronous.
    copy_to_device(s.data + e * data_bytes, w.data, data_bytes);
    copy_to_device(s.scale + e * scale_bytes, w.scale, scale_bytes);
  }
  return s;
}

// The prefill path's workspace for up to `rows` rows: shared by the DeviceMoes of one arena with
// the same shape (ops/moe.h MoeShape::max_prefill_rows), freed with the last of them.
struct PrefillWork {
  std::unique_ptr<MoeFp4Prefill> moe;
  int rows = 0;
  float* scores = nullptr;    // [rows, E]
  int32_t* gi = nullptr;      // [rows, K]
  float* gw = nullptr;        // [rows, K]
  uint8_t* xcodes = nullptr;  // [rows, dim]
  float* xscales = nullptr;   // [rows, dim / 32]
  float* routed = nullptr;    // [rows, dim]
  float* g = nullptr;         // [rows, inter] shared expert
  float* u = nullptr;
  float* h = nullptr;
  float* shared = nullptr;  // [rows, dim]
  std::vector<void*> owned;

  template <typename T>
  T* alloc(size_t n) {
    void* p = nullptr;
    UF_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    owned.push_back(p);
    return static_cast<T*>(p);
  }
  PrefillWork(int D, int I, int E, int K, int R) : rows(R) {
    moe = std::make_unique<MoeFp4Prefill>(D, I, K, E, R);
    const size_t r = size_t(R);
    scores = alloc<float>(r * E);
    gi = alloc<int32_t>(r * K);
    gw = alloc<float>(r * K);
    xcodes = alloc<uint8_t>(r * D);
    xscales = alloc<float>(r * D / 32);
    routed = alloc<float>(r * D);
    g = alloc<float>(r * I);
    u = alloc<float>(r * I);
    h = alloc<float>(r * I);
    shared = alloc<float>(r * D);
  }
  ~PrefillWork() {
    for (void* p : owned) cudaFree(p);
  }
  PrefillWork(const PrefillWork&) = delete;
  PrefillWork& operator=(const PrefillWork&) = delete;
};

std::shared_ptr<PrefillWork> prefill_work(const DeviceArena* arena, int D, int I, int E, int K,
                                          int R) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, int, int, int, int>, std::weak_ptr<PrefillWork>>
      cache;
  int device = 0;
  UF_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_tuple(static_cast<const void*>(arena), device, D, I, E, K, R);
  std::lock_guard<std::mutex> lock(mu);
  if (auto p = cache[key].lock()) return p;
  auto p = std::make_shared<PrefillWork>(D, I, E, K, R);
  cache[key] = p;
  return p;
}

}  // namespace

struct DeviceMoe::Impl {
  MoeShape s;
  int func = kSqrtSoftplus;
  DeviceLinear gate;
  float* bias = nullptr;  // [E]
  Stacked w1, w3, w2;
  std::unique_ptr<MoeFp4> moe;
  DeviceLinear sw1, sw3, sw2;
  // Workspace for one chunk of kMaxDecodeRows rows.
  float* scores = nullptr;    // [8, E]
  float* probs = nullptr;     // [8, E] moe_router_kernel: the scores after the score function
  int32_t* gi = nullptr;      // [8, K] (when the caller passes no gate_i / gate_w)
  float* gw = nullptr;        // [8, K]
  uint8_t* xcodes = nullptr;  // [8, dim]
  float* xscales = nullptr;   // [8, dim / 32]
  float* routed = nullptr;    // [8, dim]
  float* g = nullptr;         // [8, inter] shared expert
  float* u = nullptr;
  float* h = nullptr;
  float* shared = nullptr;          // [8, dim]
  std::shared_ptr<PrefillWork> pf;  // null: max_prefill_rows <= kMaxDecodeRows
  bool pf_on = false;
  // The shared expert runs on its own stream (forked from the caller's stream by fork, joined
  // back by join before the combine; capture-safe: CUDA graphs record the fork and the join).
  bool legacy = false;
  bool fork_shared = false;
  int* router_counter = nullptr;  // moe_router_kernel's finishing counter (zero between calls)
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    if (fork) cudaEventDestroy(fork);
    if (join) cudaEventDestroy(join);
    if (side) cudaStreamDestroy(side);
  }
};

DeviceMoe::DeviceMoe(const model::MoeWeights& w, const MoeShape& shape, DeviceArena& arena)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.s = shape;
  const int E = shape.n_experts, K = shape.top_k, D = shape.dim, I = shape.inter;
  require(E > 0 && K >= 1 && K <= kMaxTopK && K <= E && int(w.experts.size()) == E,
          "DeviceMoe: %d experts (weights for %zu), top-%d: need 1 <= top_k <= min(8, experts)", E,
          w.experts.size(), K);
  require(w.gate.rows == E && w.gate.cols == D,
          "DeviceMoe: gate '%s' is [%lld, %lld], expected [%d, %d]", w.gate.name.c_str(),
          static_cast<long long>(w.gate.rows), static_cast<long long>(w.gate.cols), E, D);
  require(!w.shared.w1.empty() && !w.shared.w2.empty() && !w.shared.w3.empty(),
          "DeviceMoe: the shared expert is missing");
  m.func = shape.score_func == "softmax"   ? kSoftmax
           : shape.score_func == "sigmoid" ? kSigmoid
                                           : kSqrtSoftplus;
  // Decode rows: dense_rows, not the tensor-core path: on the H200 the router [384, 5120] took
  // 3.9 / 7.7 us at 1 / 7 rows there against 7.3 / 7.8 us through dense_mma's split-K
  // (bench_cuda_dense, session 5): too few weight rows for the MMA kernel's parallelism; the
  // fused decode routers repeat dense_rows' order. Prefill rows: DenseMma's prefill kernel
  // (another fp32 order of the same exact products, so a prefill row's routing equals a decode
  // row's except at fp32 near-ties; a 512-row call's advance of the chain ~200 -> ~10 us,
  // docs/perf.md session 13).
  m.gate = DeviceLinear(w.gate, LinearKind::kF32Bf16XPrefill, arena);
  std::vector<float> bias(size_t(E), 0.f);
  if (!w.gate_bias.empty()) {
    bias = w.gate_bias.to_vector();
    require(int64_t(bias.size()) == E, "DeviceMoe: gate bias '%s' has %zu values, expected %d",
            w.gate_bias.name.c_str(), bias.size(), E);
  }
  m.bias = arena.upload(bias);
  m.w1 = stack_experts(w.experts, &model::ExpertWeights::w1, I, D, arena);
  m.w3 = stack_experts(w.experts, &model::ExpertWeights::w3, I, D, arena);
  m.w2 = stack_experts(w.experts, &model::ExpertWeights::w2, D, I, arena);
  m.moe = std::make_unique<MoeFp4>(D, I, K, device_sm_count());
  m.sw1 = DeviceLinear(w.shared.w1, LinearKind::kAuto, arena);
  m.sw3 = DeviceLinear(w.shared.w3, LinearKind::kAuto, arena);
  m.sw2 = DeviceLinear(w.shared.w2, LinearKind::kAuto, arena);
  require(m.sw1.rows() == I && m.sw1.cols() == D && m.sw3.rows() == I && m.sw3.cols() == D &&
              m.sw2.rows() == D && m.sw2.cols() == I,
          "DeviceMoe: shared expert shapes do not match dim %d / inter %d", D, I);
  const size_t R = kMaxDecodeRows;
  m.scores = arena.alloc<float>(R * E);
  m.probs = arena.alloc<float>(R * E);
  m.gi = arena.alloc<int32_t>(R * K);
  m.gw = arena.alloc<float>(R * K);
  m.xcodes = arena.alloc<uint8_t>(R * D);
  m.xscales = arena.alloc<float>(R * D / 32);
  m.routed = arena.alloc<float>(R * D);
  m.g = arena.alloc<float>(R * I);
  m.u = arena.alloc<float>(R * I);
  m.h = arena.alloc<float>(R * I);
  m.shared = arena.alloc<float>(R * D);
  if (shape.max_prefill_rows > kMaxDecodeRows) {
    m.pf = prefill_work(&arena, D, I, E, K, shape.max_prefill_rows);
    m.pf_on = true;
  }
  m.router_counter = arena.alloc<int>(1);  // zero-filled
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&m.side, cudaStreamNonBlocking));
  UF_CUDA_CHECK(cudaEventCreateWithFlags(&m.fork, cudaEventDisableTiming));
  UF_CUDA_CHECK(cudaEventCreateWithFlags(&m.join, cudaEventDisableTiming));
}

DeviceMoe::~DeviceMoe() = default;
DeviceMoe::DeviceMoe(DeviceMoe&&) noexcept = default;
DeviceMoe& DeviceMoe::operator=(DeviceMoe&&) noexcept = default;

void DeviceMoe::apply(const float* x, int T, float* y, int32_t* gate_i, float* gate_w,
                      cudaStream_t stream) const {
  run(x, T, Out::kRounded, y, gate_i, gate_w, stream);
}

void DeviceMoe::apply_partial(const float* x, int T, float* y, int32_t* gate_i, float* gate_w,
                              cudaStream_t stream) const {
  run(x, T, Out::kPartialSum, y, gate_i, gate_w, stream);
}

void DeviceMoe::apply_partial_experts(const float* x, int T, float* slots, int32_t* gate_i,
                                      float* gate_w, cudaStream_t stream) const {
  require(gate_i != nullptr,
          "DeviceMoe::apply_partial_experts: gate_i must be given (combine_experts reads it)");
  run(x, T, Out::kPartialSlots, slots, gate_i, gate_w, stream);
}

void DeviceMoe::combine_experts(const float* slots, const int32_t* gate_i, int T, float* y,
                                cudaStream_t stream) const {
  if (T <= 0) return;
  const Impl& m = *impl_;
  const int D = m.s.dim;
  const dim3 grid(blocks_for(size_t(D), 256), unsigned(std::min(T, 65535)));
  combine_experts_kernel<<<grid, 256, 0, stream>>>(slots, gate_i, T, m.s.top_k, m.s.n_experts, D,
                                                   y);
  UF_CUDA_CHECK(cudaGetLastError());
}

int DeviceMoe::top_k() const { return impl_->s.top_k; }

void moe_route(const MoeShape& shape, const float* scores, const float* bias, int rows,
               int32_t* gate_i, float* gate_w, cudaStream_t stream) {
  const int E = shape.n_experts, K = shape.top_k;
  require(rows >= 1 && rows <= 65535 && K >= 1 && K <= kMaxTopK && K <= E,
          "moe_route: %d rows, %d experts, top-%d", rows, E, K);
  const int func = shape.score_func == "softmax"   ? kSoftmax
                   : shape.score_func == "sigmoid" ? kSigmoid
                                                   : kSqrtSoftplus;
  if (E <= 32 * kRoutePerLane) {
    detail::launch_pdl(route_warp_kernel, dim3(rows), dim3(32),
                       func == kSoftmax ? sizeof(float) * E : 0, stream, scores, bias, E, K, func,
                       shape.gate_temp, shape.route_scale, gate_i, gate_w);
  } else {
    route_kernel<<<rows, kRouteThreads, 2 * sizeof(float) * E, stream>>>(
        scores, bias, E, K, func, shape.gate_temp, shape.route_scale, gate_i, gate_w);
    UF_CUDA_CHECK(cudaGetLastError());
  }
}

void DeviceMoe::set_prefill_enabled(bool on) { impl_->pf_on = on && impl_->pf != nullptr; }

void DeviceMoe::set_legacy(bool on) {
  impl_->legacy = on;
  impl_->moe->set_legacy(on);
}

bool DeviceMoe::legacy() const { return impl_->legacy; }

void DeviceMoe::set_fork_shared(bool on) { impl_->fork_shared = on; }

bool DeviceMoe::prefill_enabled() const { return impl_->pf_on; }

int64_t DeviceMoe::slot_floats_per_row() const {
  return int64_t(impl_->s.top_k + 1) * impl_->s.dim;
}

void DeviceMoe::run(const float* x, int T, Out mode, float* out, int32_t* gate_i, float* gate_w,
                    cudaStream_t stream) const {
  const Impl& m = *impl_;
  const int pf_rows = m.pf_on ? m.pf->rows : 0;
  for (int t0 = 0; t0 < T;) {
    const int left = T - t0;
    const int rows = left > kMaxDecodeRows && pf_rows > kMaxDecodeRows
                         ? std::min(left, pf_rows)
                         : std::min(left, kMaxDecodeRows);
    run_chunk(x, t0, rows, mode, out, gate_i, gate_w, stream);
    t0 += rows;
  }
}

namespace {

int g_router_variant = 0;           // set_moe_router_variant
bool g_shared_after_router = true;  // set_moe_shared_after_router

// The decode chunk's one-launch router (rows <= kMaxDecodeRows): variant 0 moe_router2_kernel
// where it serves (not softmax), else moe_router_kernel; 1 moe_router_kernel. false: neither
// serves the shape (the caller runs the gate GEMV and route_quant_kernel).
bool launch_router(int variant, const DeviceWeight& gw8, int func, const MoeShape& sh,
                   const float* bias, const float* xc, int rows, float* scores, float* probs,
                   int* counter, int32_t* gi, float* gw, uint8_t* xcodes, float* xscales,
                   cudaStream_t stream) {
  const int E = sh.n_experts, K = sh.top_k, D = sh.dim;
  const bool shape_ok = rows >= 1 && rows <= kMaxDecodeRows && E <= 32 * kRoutePerLane &&
                        D % 32 == 0 && gw8.format == WFormat::kBF16 && gw8.rows == E &&
                        gw8.cols == D && reinterpret_cast<uintptr_t>(xc) % 16 == 0;
  if (!shape_ok) return false;
  const size_t smem2 = size_t(kRouter2Rows) * D * 2;
  if (variant == 0 && func != kSoftmax && smem2 <= 48 * 1024) {
    detail::launch_pdl_streaming(
        moe_router2_kernel<kRouter2Rows>, dim3((E + kRouter2Rows - 1) / kRouter2Rows),
        dim3(kRouterWarps * 32), smem2, stream, gw8.data, gw8.data + weight_data_bytes(gw8),
        gw8.data, E, D, xc, rows, scores, probs, counter, bias, K, func, sh.gate_temp,
        sh.route_scale, gi, gw, xcodes, xscales);
    return true;
  }
  const size_t smem =
      size_t(kRouterGateRows) * D * 2 + (func == kSoftmax ? sizeof(float) * size_t(rows) * E : 0);
  if (smem > 48 * 1024) return false;
  detail::launch_pdl(moe_router_kernel, dim3((E + kRouterGateRows - 1) / kRouterGateRows),
                     dim3(kRouterWarps * 32), smem, stream, gw8.data, E, D, xc, rows, scores, probs,
                     counter, bias, K, func, sh.gate_temp, sh.route_scale, gi, gw, xcodes, xscales);
  return true;
}

int score_func_of(const MoeShape& sh) {
  return sh.score_func == "softmax"   ? kSoftmax
         : sh.score_func == "sigmoid" ? kSigmoid
                                      : kSqrtSoftplus;
}

}  // namespace

// Router hooks for tests and benchmarks (declared in ops/moe.h).
void set_moe_router_variant(int variant) { g_router_variant = variant; }
void set_moe_shared_after_router(bool on) { g_shared_after_router = on; }

void moe_router_run(int variant, const MoeShape& shape, const DeviceWeight& gate, const float* bias,
                    const float* x, int rows, float* scores, float* probs, int* counter,
                    int32_t* gate_i, float* gate_w, uint8_t* codes, float* xscales,
                    cudaStream_t stream) {
  const int func = score_func_of(shape), E = shape.n_experts, D = shape.dim;
  require(rows >= 1 && rows <= kMaxDecodeRows && shape.top_k >= 1 && shape.top_k <= kMaxTopK,
          "moe_router_run: %d rows (1..%d), top-%d", rows, kMaxDecodeRows, shape.top_k);
  if (variant != 2 && launch_router(variant, gate, func, shape, bias, x, rows, scores, probs,
                                    counter, gate_i, gate_w, codes, xscales, stream))
    return;
  require(E <= 32 * kRoutePerLane && D % 32 == 0,
          "moe_router_run: %d experts, dim %d (need <= %d experts, dim %% 32 == 0)", E, D,
          32 * kRoutePerLane);
  ops_detail::dense_rows(gate, 0, E, x, D, rows, scores, E, false, stream);
  detail::launch_pdl(route_quant_kernel, dim3(rows, 1 + (D / 32 + 7) / 8), dim3(256),
                     func == kSoftmax ? sizeof(float) * E : 0, stream, scores, bias, E, shape.top_k,
                     func, shape.gate_temp, shape.route_scale, gate_i, gate_w, x, D, codes,
                     xscales);
}

void DeviceMoe::run_chunk(const float* x, int t0, int rows, Out mode, float* out, int32_t* gate_i,
                          float* gate_w, cudaStream_t stream) const {
  const Impl& m = *impl_;
  const int E = m.s.n_experts, K = m.s.top_k, D = m.s.dim, I = m.s.inter;
  const Fp4ExpertsView experts{m.w1.data,  m.w1.scale, m.w3.data, m.w3.scale, m.w2.data,
                               m.w2.scale, E,          D,         I};
  const bool pf = rows > kMaxDecodeRows;  // run() only makes such chunks with m.pf
  const PrefillWork* w = pf ? m.pf.get() : nullptr;
  float* scores = pf ? w->scores : m.scores;
  uint8_t* xcodes = pf ? w->xcodes : m.xcodes;
  float* xscales = pf ? w->xscales : m.xscales;
  float* routed = pf ? w->routed : m.routed;
  float* g = pf ? w->g : m.g;
  float* u = pf ? w->u : m.u;
  float* h = pf ? w->h : m.h;
  float* shared = pf ? w->shared : m.shared;
  const float* xc = x + int64_t(t0) * D;
  int32_t* gi = gate_i ? gate_i + int64_t(t0) * K : (pf ? w->gi : m.gi);
  float* gw = gate_w ? gate_w + int64_t(t0) * K : (pf ? w->gw : m.gw);
  // The shared expert (independent of the routing) on the forked stream unless legacy: w1 and w3
  // read the same rows (one launch, each output as its own apply()), SwiGLU, w2. A decode chunk
  // forks it after the router (set_moe_shared_after_router: beside the router its GEMVs slowed
  // the router, which every routed expert waits for); a prefill chunk at the MoE's start.
  const bool fork = !m.legacy && m.fork_shared;
  cudaStream_t ss = fork ? m.side : stream;
  // With the unit w13 kernel (1-2 rows) the fork still follows the router, but its kernels are
  // enqueued once w13 is (MoeFp4::run_add's after_w13): the captured graph then places w13's
  // CTAs, which copy their weights before their PDL wait, ahead of the shared GEMVs' CTAs that
  // became ready with them (session 20, H200: 1 / 2 rows -106 / -35 us a step). Not for the
  // persistent w13 (3+ rows): the GEMVs then find no room until w13's CTAs leave and meet its w2
  // instead (+70 / +260 us at 4 / 7 rows).
  enum class SharedAt { kInline, kStart, kAfterRouter, kAfterW13 };
  const SharedAt at = !fork                            ? SharedAt::kInline
                      : pf || !g_shared_after_router   ? SharedAt::kStart
                      : m.moe->uses_unit_kernels(rows) ? SharedAt::kAfterW13
                                                       : SharedAt::kAfterRouter;
  auto fork_here = [&] {
    UF_CUDA_CHECK(cudaEventRecord(m.fork, stream));
    UF_CUDA_CHECK(cudaStreamWaitEvent(ss, m.fork, 0));
  };
  const int64_t slot_row = int64_t(K + 1) * D;  // kPartialSlots: floats per row of `out`
  auto shared_expert = [&] {
    const LinearCall gate_up[] = {{&m.sw1, g}, {&m.sw3, u}};
    DeviceLinear::apply_group(gate_up, xc, rows, ss);
    const size_t nh = size_t(rows) * I;
    // PDL, like its neighbours: a plain launch waited for the gate/up GEMV to drain and made the
    // w2 GEMV wait for it in turn (6.4 us of chain a layer at 1 row, session 9's trace).
    detail::launch_pdl(swiglu_kernel, dim3(blocks_for(nh, 256)), dim3(256), 0, ss,
                       static_cast<const float*>(g), static_cast<const float*>(u), nh,
                       m.s.swiglu_limit, h);
    UF_CUDA_CHECK(cudaGetLastError());
    if (mode == Out::kRounded)
      m.sw2.apply(h, rows, shared, ss);
    else
      m.sw2.apply_partial(h, rows, shared, ss);
    if (mode == Out::kPartialSlots)  // the shared expert into slot K of each row
      UF_CUDA_CHECK(cudaMemcpy2DAsync(out + t0 * slot_row + int64_t(K) * D,
                                      size_t(slot_row) * sizeof(float), shared,
                                      size_t(D) * sizeof(float), size_t(D) * sizeof(float),
                                      size_t(rows), cudaMemcpyDeviceToDevice, ss));
    if (fork) UF_CUDA_CHECK(cudaEventRecord(m.join, ss));
  };
  // Forked: on the side stream, joined before the combine. In line: after the
  // routed experts, right before the combine (MoeFp4::run_add's hook, or join() below), so that
  // its weights stream in behind theirs under PDL.
  const bool combine_adds = !m.legacy && mode != Out::kPartialSlots;
  auto join = [&] {
    if (fork)
      UF_CUDA_CHECK(cudaStreamWaitEvent(stream, m.join, 0));
    else
      shared_expert();
  };
  if (at == SharedAt::kStart) {
    fork_here();
    shared_expert();
  }

  // The routed experts.
  const bool router =
      !pf && !m.legacy &&
      launch_router(g_router_variant, m.gate.weight(), m.func, m.s, m.bias, xc, rows, scores,
                    m.probs, m.router_counter, gi, gw, xcodes, xscales, stream);
  // After the router: the side stream waits for it; its launches now, or once w13 is enqueued.
  if (at == SharedAt::kAfterRouter || at == SharedAt::kAfterW13) fork_here();
  if (at == SharedAt::kAfterRouter) shared_expert();
  const std::function<void()> after_w13 =
      at == SharedAt::kAfterW13 ? std::function<void()>(shared_expert) : std::function<void()>();
  if (router) {
    // gate, routing and act quant: one launch
  } else if (!pf && E <= 32 * kRoutePerLane && D % 32 == 0) {
    m.gate.apply(xc, rows, scores, stream);
    detail::launch_pdl(route_quant_kernel, dim3(rows, 1 + (D / 32 + 7) / 8), dim3(256),
                       m.func == kSoftmax ? sizeof(float) * E : 0, stream, scores,
                       static_cast<const float*>(m.bias), E, K, m.func, m.s.gate_temp,
                       m.s.route_scale, gi, gw, xc, D, xcodes, xscales);
  } else {
    m.gate.apply(xc, rows, scores, stream);
    moe_route(m.s, scores, m.bias, rows, gi, gw, stream);
    if (pf)
      moe_act_quant_rows(xc, rows, D, xcodes, xscales, stream);
    else
      act_quant_fp8_f32(xc, rows, D, xcodes, xscales, stream);
  }
  const QuantActView act{xcodes, xscales, rows, D};
  if (mode == Out::kPartialSlots) {
    if (pf)
      w->moe->run_experts(experts, act, gi, gw, m.s.swiglu_limit, out + t0 * slot_row, slot_row,
                          stream);
    else
      m.moe->run_experts(experts, act, gi, gw, m.s.swiglu_limit, out + t0 * slot_row, slot_row,
                         stream, after_w13);
    join();
    return;
  }
  if (combine_adds) {  // the combine adds the shared expert (combine_kernel's operations)
    const bool partial = mode == Out::kPartialSum, round_out = mode == Out::kRounded;
    if (pf)
      w->moe->run_add(experts, act, gi, gw, m.s.swiglu_limit, partial, shared, round_out, join,
                      out + int64_t(t0) * D, stream);
    else
      m.moe->run_add(experts, act, gi, gw, m.s.swiglu_limit, partial, shared, round_out, join,
                     out + int64_t(t0) * D, stream, after_w13);
    return;
  }
  if (pf) {
    if (mode == Out::kRounded)
      w->moe->run(experts, act, gi, gw, m.s.swiglu_limit, routed, stream);
    else
      w->moe->run_partial(experts, act, gi, gw, m.s.swiglu_limit, routed, stream);
  } else {
    if (mode == Out::kRounded)
      m.moe->run(experts, act, gi, gw, m.s.swiglu_limit, routed, stream);
    else
      m.moe->run_partial(experts, act, gi, gw, m.s.swiglu_limit, routed, stream);
  }
  join();
  const size_t ny = size_t(rows) * D;
  combine_kernel<<<blocks_for(ny, 256), 256, 0, stream>>>(routed, shared, ny, mode == Out::kRounded,
                                                          out + int64_t(t0) * D);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
