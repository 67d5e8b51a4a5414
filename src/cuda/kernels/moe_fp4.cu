// MXFP4 routed-expert MoE for decode rows (W4A8, grouped by selected expert), and the shared
// expert's SwiGLU + FP8 quantization.
//
// Shapes and dtypes (moe.h): experts stacked [E, ...]; w1/w3 [E, I, K/2] packed E2M1 with UE8M0
// scales [E, I, K/32]; w2 [E, K, I/2] with scales [E, K, I/32]. x: FP8 codes [M, K] + scales.
// Routing: topk_idx/topk_w [M, topk] on the device. Limits: M <= 8, M * topk <= 64, K % 128 == 0,
// I % 32 == 0.
//
// Grouping (build_plan, run by every CTA of both kernels into its shared memory: no plan launch):
// the P = M * topk (row, expert) pairs are reduced to the distinct experts, ranked by expert id
// (slot u); an expert's rows (ascending row index) are the columns of the mma B operand, so an
// expert picked by several rows is read once.
//
// Two kernel sets with bitwise the same outputs (MoeFp4::set_legacy picks):
//  - the unit kernels (default; moe_w13_unit_kernel, moe_w2_unit_kernel, described at their
//    definition below): one small work unit per CTA with ALL of its weight bytes in flight at
//    once (cp.async, one group), no cross-CTA reduction (the w13 K splits are the warps of one
//    CTA, reduced through shared memory in split order), h's FP8 quantisation moved into the w2
//    kernel's prologue;
//  - the persistent kernels (legacy; below), kept for comparison and for shapes whose unit
//    shared-memory plan does not fit.
// Persistent work decomposition: both kernels are persistent grids (about one 16-warp CTA per SM
// for w13, two 8-warp CTAs per SM for w2) over a FLAT list of small work units; warp gw of W takes
// the contiguous unit range [gw * N / W, (gw + 1) * N / W), so every warp streams the same number
// of bytes (+- one unit) whatever the routing, and N (known only on the device) needs no host sync.
// Each warp streams weights AND their UE8M0 scales through its own cp.async ring that runs across
// unit boundaries (the next unit's bytes are in flight while this one finishes). The w13 CTA first
// copies the whole input (m rows of FP8 codes and scales) into its shared memory, so a chunk's
// activations are shared-memory reads; its ring is 2 chunks deep, which the weights' DRAM latency
// never waited on (ncu, session 18), and which keeps a w2 CTA's room beside it at 7 rows.
//
// Kernel 1, w13 (+ SwiGLU + quant): unit = (slot u, 32-row group grp of I, tile tau, K split s),
//   s fastest: tau 0/1 = w1 rows 0-15/16-31 of the group, tau 2/3 = w3 rows 0-15/16-31; split s
//   = K blocks [16 s, 16 s + 16) (S = ceil(K/32 / 16) splits: a function of K only). A unit is one
//   16 x 8 mma tile over its split from acc = 0 (2 stages of 8 K blocks, 4 KB of weights). Per K
//   block: 4 bytes (8 E2M1) of row g and of row g+8 placed into e4m3 bytes holding value * 2^-6
//   (bit placement; the 2^6 goes into the activation scale, exactly), one m16n8k32 e4m3 mma.
//   K mapping within a block, A and B alike: thread t's 8 elements 8t..8t+7 go to fragment
//   positions {4t+j} = elements [0,2,4,6] and {16+4t+j} = elements [1,3,5,7].
//   The unit's fragment (valid columns only) goes to a global partial buffer; a warp leaving a
//   group adds its unit count to the group's counter, and the warp that completes the group
//   (4 S units) reduces, one column at a time with lane = row: per output, split 0's value, then
//   += splits 1..S-1 in order (no float atomics), then g = bf16(sum1), u = bf16(sum3), clamps,
//   h = bf16(w * silu(g) * u), FP8 quantization of h per 32 rows, and resets the counter (graph
//   replays).
// Kernel 2, w2: unit = (slot u, 16-row output tile), one ring stage = the tile's 16 rows x I/2
//   bytes (contiguous) + its 16 x I/32 scale bytes; K loop over all of I from 0 (no split).
//   y[pair] = bf16(acc) as fp32 (run), or acc itself (run_partial / run_experts: a
//   tensor-parallel rank's split-K partial of the expert's w2 product, rounded after the sum).
//   Pair (t, k) goes to y + t * y_row_stride + k * dim (internal y_: y_row_stride = topk * dim).
//   The weights do not depend on kernel 1, so each w2 CTA builds its plan from topk_idx and
//   issues its first ring stages BEFORE griddepcontrol.wait (kernel 1 triggers its dependents
//   only after its own wait, so topk_idx is complete when kernel 2 starts); h is copied to
//   shared memory after the wait.
//   Shapes whose plan does not fit in shared memory (large I, e.g. 2304 on one GPU) run
//   moe_w2_tile_kernel instead: one 16-row tile per warp, the same products and order.
// Kernel 3, combine: out[t] = sum over t's experts in ascending expert id of y (fp32, from 0);
//   run_experts skips it.
//
// Instructions per weight byte (session 7; the e4m3 mma.sync is emulated on sm_90a: 12
// conversions + 2 HMMA + 4 FADD each, so the decode is not the main cost): the weight scales are
// converted to fp32 once per warp into shared memory (scales_to_f32) instead of in each of the 4
// lanes of a row per block; absent mma columns (g or 2t, 2t+1 >= count) are clamped onto a
// present one instead of predicating every block (a column's result depends on its own B
// column only, and absent columns are never stored); the activation scales are multiplied by
// 2^6 once where they are staged; unit positions are counted, not divided, in the persistent
// loops; the w13 chunks are fully unrolled (4 or 8 K blocks). The products and their order are
// unchanged (tests/cuda/test_moe_decode_vs_prefill.cpp, test_moe_fp4_halfchunk.cpp: bitwise
// MoeFp4Prefill's outputs).
// The mma (MoeFp4::set_f16; every kernel is instantiated for both): kF16 = true (default) issues
// the emulation's own f16 instructions (mma_e4m3_f16 below: the same F2FP conversions, HMMA
// operand positions and chain as ptxas's expansion of the e4m3 mma.sync, so the same bits) minus
// its 4 "+ 0" FADDs per mma, and the w2 kernels convert h to the f16 B operands once per CTA
// (in their prologue, into shared memory) instead of once per warp and K block (the persistent
// one only where its larger plan still fits on an SM beside a w13 CTA: up to 7 rows at dim 5120 /
// inter 288). SASS per K block of the inner loops (e4m3 -> f16): unit w13 49.3 -> 45.3, unit w2
// 52 -> 42, persistent w13 82 -> 78, persistent w2 55.3 -> 46 (51.3 without the pre-conversion).
// E2M1 is still placed into e4m3 bytes and converted by F2FP (2 values an instruction): a direct
// E2M1 -> f16 bit placement costs ~4 integer ops per f16x2 (the sign and magnitude need different
// shifts) and would change the HMMA inputs by 2^-8 (subnormal f16 for 0.5), so bitwise equality
// would rest on the HMMA's scale invariance.
//
// Reduction order (unchanged from the earlier per-tile kernels, and MoeFp4Prefill's): per output,
// acc = 0; for kb in K order acc = fmaf(partial * (sa * 2^6), sw, acc) (per-row weight scale);
// w13 splits of 16 K blocks summed in split order; w2 over all of I; experts summed by expert id.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/gemv.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/mma_f16.cuh"
#include "cuda/kernels/moe_plan.cuh"
#include "cuda/kernels/probe.cuh"
#include "cuda/moe.h"

namespace uf::cuda {
namespace {

using namespace detail;

constexpr int kKbPerSplit = 16;  // w13 split size: a function of K only (spec == plain)

// ---- The m16n8k32 e4m3 mma on f16 HMMA, as ptxas emulates it on sm_90a ----
// sm_90a has no FP8 mma.sync: ptxas turns mma_e4m3_16x8x32 into 12 F2FP (e4m3x2 -> f16x2, exact)
// + 2 HMMA.16816.F32 + 4 FADD. Read from the SASS of a probe (session 7, register dataflow):
//   t = HMMA(A = {lo(a0), lo(a1), lo(a2), lo(a3)}, B = {lo(b0), lo(b1)}, C = RZ)
//   t = HMMA(A = {hi(a0), hi(a1), hi(a2), hi(a3)}, B = {hi(b0), hi(b1)}, C = t)
//   d = C + t                                  (here C = 0: the FADDs only add +0)
// lo / hi = the f16x2 of the register's low / high two e4m3 bytes (F2FP .H0 / .H1): the first
// HMMA gets the fragment's K indices = 0, 1 mod 4, the second 2, 3 mod 4, each at the f16
// fragment positions shown. mma_e4m3_f16 issues exactly these instructions (the same F2FP, the
// same operand positions, the same chain; checked in the SASS: identical instruction sequence),
// minus the "+ 0" FADDs. d differs from the emulation's only where t = -0 (0 + -0 = +0); the
// callers multiply d into acc = fmaf(d * sa, sw, acc) from acc = +0, which then agrees unless acc
// itself is -0, i.e. an earlier term underflowed to -0 (|partial * sa * sw| < 2^-150).
//
// D = A * B (C = 0): a = 4 regs of e4m3 (as mma_e4m3_16x8x32), bh = b_e4m3_to_f16x8's operands
// (kernels/mma_f16.cuh: the conversions and the HMMA chain).
__device__ __forceinline__ void mma_e4m3_f16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint4& bh) {
  mma_e4m3_f16_pre(d, a_e4m3_to_f16(a), bh);
}
// An activation element's slot in a lane's 8 f16 values of one K block laid out as bh (the B
// operand pre-converted, moe_w2_unit_kernel<true>): element j of the lane's 8 (byte j of its 8
// FP8 codes; b0 = elements [0,2,4,6], b1 = [1,3,5,7]) -> bh halves {0,2 | 1,3 | 4,6 | 5,7}.
__device__ __forceinline__ int f16_b_slot(int j) {
  return (j & 4) | ((j & 1) << 1) | ((j >> 1) & 1);
}

// One K block of a 16 x 8 tile from shared memory: w = row 0 of the stage at this block's 16
// bytes with the lane's t * 4 included, rs = row stride; sw0 / sw1 = the weight scales of rows g
// and g + 8; b = the B fragment (column g): e4m3 b0 / b1 (kF16: converted here) or, with
// kPreB, the f16 operands bh; sa0 / sa1 = activation scales of columns 2t, 2t + 1, times 2^6 (0
// for absent columns). kF16: the f16 HMMAs of mma_e4m3_f16 instead of the emulated e4m3 mma.
template <bool kF16>
__device__ __forceinline__ void fp4_mma_core(const uint8_t* w, int rs, float sw0, float sw1,
                                             uint32_t b0, uint32_t b1, const uint4* bh, float sa0,
                                             float sa1, float (&acc)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2;
  const uint32_t q0 = *reinterpret_cast<const uint32_t*>(w + g * rs);
  const uint32_t q1 = *reinterpret_cast<const uint32_t*>(w + (g + 8) * rs);
  uint32_t a[4];
  e2m1x8_to_e4m3_scaled(q0, a[0], a[2]);
  e2m1x8_to_e4m3_scaled(q1, a[1], a[3]);
  float d[4];
  if constexpr (kF16)
    mma_e4m3_f16(d, a, bh ? *bh : b_e4m3_to_f16x8(b0, b1));
  else
    mma_e4m3_16x8x32(d, a, b0, b1);
  // d holds the partial * 2^-6; (d * (sa * 2^6)) * sw is bitwise (partial * sa) * sw.
  acc[0] = fmaf(d[0] * sa0, sw0, acc[0]);
  acc[1] = fmaf(d[1] * sa1, sw0, acc[1]);
  acc[2] = fmaf(d[2] * sa0, sw1, acc[2]);
  acc[3] = fmaf(d[3] * sa1, sw1, acc[3]);
}
template <bool kF16>
__device__ __forceinline__ void fp4_mma_step(const uint8_t* w, int rs, float sw0, float sw1,
                                             uint32_t b0, uint32_t b1, float sa0, float sa1,
                                             float (&acc)[4]) {
  fp4_mma_core<kF16>(w, rs, sw0, sw1, b0, b1, nullptr, sa0, sa1, acc);
}

// fp4_mma_step with the B fragment read from shared memory: act = column g's FP8 codes at this K
// block with the lane's t * 8 included (elements [0,2,4,6] -> b0, [1,3,5,7] -> b1). Callers
// clamp absent columns (g >= count) onto a present one instead of predicating every block: an mma
// column depends on its own B column only, and absent columns' results are never stored.
template <bool kF16>
__device__ __forceinline__ void fp4_mma_block(const uint8_t* w, int rs, float sw0, float sw1,
                                              const uint8_t* act, float sa0, float sa1,
                                              float (&acc)[4]) {
  const uint2 v = *reinterpret_cast<const uint2*>(act);
  fp4_mma_step<kF16>(w, rs, sw0, sw1, __byte_perm(v.x, v.y, 0x6420), __byte_perm(v.x, v.y, 0x7531),
                     sa0, sa1, acc);
}

// A warp's 16 rows x n UE8M0 weight scales (row r at src + r * src_stride) to fp32 (e8m0_to_f32)
// at dst + r * dst_stride, lane = row (lane & 15) and every other block: the inner K loops then
// read ready floats instead of converting each byte in each of the 4 lanes of a row. The caller
// synchronises the warp before and after.
__device__ __forceinline__ void scales_to_f32(const uint8_t* src, int src_stride, int n, float* dst,
                                              int dst_stride) {
  const int lane = threadIdx.x & 31, r = lane & 15;
  for (int k = lane >> 4; k < n; k += 2)
    dst[r * dst_stride + k] = e8m0_to_f32(src[r * src_stride + k]);
}

// The w2 K loop of one 16-row tile over all of I from acc (the persistent and unit w2 kernels):
// w = the tile's row 0 in shared memory (row stride rs) with the lane's t * 4 included, swf =
// its weight scales as fp32 [16][sws], act = column g's FP8 codes with t * 8 included (kPreB:
// column g's f16 operands, 64 bytes a K block, with t * 16 included), sa0 / sa1 = columns 2t /
// 2t + 1's scales times 2^6, all in K block order.
template <bool kF16, bool kPreB = false>
__device__ __forceinline__ void w2_tile_k_loop(const uint8_t* w, int rs, const float* swf, int sws,
                                               const uint8_t* act, const float* sa0,
                                               const float* sa1, int nkb, float (&acc)[4]) {
  const int g = (threadIdx.x & 31) >> 2;
  const float* sw0 = swf + g * sws;
  const float* sw1 = sw0 + 8 * sws;
#pragma unroll 3
  for (int k = 0; k < nkb; ++k) {
    if constexpr (kPreB) {
      const uint4 bh = *reinterpret_cast<const uint4*>(act + k * 64);
      fp4_mma_core<true>(w + k * 16, rs, sw0[k], sw1[k], 0u, 0u, &bh, sa0[k], sa1[k], acc);
    } else {
      fp4_mma_block<kF16>(w + k * 16, rs, sw0[k], sw1[k], act + k * 32, sa0[k], sa1[k], acc);
    }
  }
}

// ---- Kernel 1: w13 ----
// Warps, ring depths and the shared-memory plan: moe_layout.h (kW13*, w13_smem).
constexpr int kEpiBatch = 10;  // splits loaded per round trip in the group reduction

struct W13Params {
  const uint8_t* w1;
  const uint8_t* w1s;
  const uint8_t* w3;
  const uint8_t* w3s;
  int E, dim, inter;
  const uint8_t* x;
  const float* xs;
  const int* topk_idx;
  const float* topk_w;
  int pairs, topk;
  float limit;
  uint8_t* h_codes;
  float* h_scales;
  float* partials;  // [slot][group][tau][split][column 8][row 16]
  int* counters;    // [slot][group]
  int kb_per_split, splits;
  float* h_vals;  // unit kernel: [pairs][inter] bf16 values of h (quantised by the w2 kernel)
};

// The group reduction + SwiGLU + quantization of group gq = u * groups + grp (one warp): lane =
// row within the 32-row group (rows 0-15: tiles 0 / 2, rows 16-31: tiles 1 / 3), one column at a
// time; all S split partials of a column are loaded at once (one L2 round trip per column).
__device__ __forceinline__ void w13_group_epilogue(const W13Params& p, const SlotPlan& r, int gq,
                                                   int grp) {
  const int lane = threadIdx.x & 31, half = lane >> 4, rr = lane & 15;
  const int S = p.splits;
  const float* gbase = p.partials + size_t(gq * 4 + half) * S * 128 + rr;
  const float* ubase = p.partials + size_t(gq * 4 + 2 + half) * S * 128 + rr;
  for (int c = 0; c < r.count; ++c) {
    float ga = 0.f, ua = 0.f;
    for (int s0 = 0; s0 < S; s0 += kEpiBatch) {
      float vg[kEpiBatch], vu[kEpiBatch];
#pragma unroll
      for (int b = 0; b < kEpiBatch; ++b) {
        vg[b] = vu[b] = 0.f;
        if (s0 + b < S) {
          vg[b] = __ldcg(gbase + size_t(s0 + b) * 128 + c * 16);
          vu[b] = __ldcg(ubase + size_t(s0 + b) * 128 + c * 16);
        }
      }
#pragma unroll
      for (int b = 0; b < kEpiBatch; ++b) {
        if (s0 + b >= S) continue;
        if (s0 + b == 0) {  // split order: split 0's value, then += the next
          ga = vg[b];
          ua = vu[b];
        } else {
          ga += vg[b];
          ua += vu[b];
        }
      }
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
    if (lane == 0) p.h_scales[size_t(pair) * (p.inter / 32) + grp] = sc;
  }
}

// A w13 unit's place in the flat list: n = ((u * groups + grp) * 4 + tau) * S + s. The kernel
// decomposes its first unit once and then counts (no integer division in the loops).
struct W13Cursor {
  int s, tau, grp, u;
};
__device__ __forceinline__ W13Cursor w13_cursor(int n, int S, int groups) {
  W13Cursor c;
  c.s = n % S;
  const int q = n / S;
  c.tau = q & 3;
  const int gq = q >> 2;
  c.u = gq / groups;
  c.grp = gq - c.u * groups;
  return c;
}
__device__ __forceinline__ void w13_advance(W13Cursor& c, int S, int groups) {
  if (++c.s == S) {
    c.s = 0;
    if (++c.tau == 4) {
      c.tau = 0;
      if (++c.grp == groups) {
        c.grp = 0;
        ++c.u;
      }
    }
  }
}

// 96 registers: one 16-warp CTA per SM leaves 16K registers for a w2 CTA (64), which can then
// start early and prefetch its weights during this kernel's tail.
template <bool kF16>
__global__ void __maxnreg__(96) moe_w13_kernel(const W13Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  MoePlan& plan = *reinterpret_cast<MoePlan*>(smem);
  // Probe points: 0 start, 1 PDL wait returned, 2 plan built.
  UF_PROBE_OPEN(probe, kTagMoeW13);
  UF_PROBE_MARK(probe, 0);
  pdl_wait();
  UF_PROBE_MARK(probe, 1);
  pdl_trigger();  // after the wait: kernel 2 reads topk_idx before its own wait
  build_plan(p.topk_idx, p.topk_w, p.pairs, p.topk, p.E, plan);
  UF_PROBE_MARK(probe, 2);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int S = p.splits, kbps = p.kb_per_split, nkb = p.dim / 32, groups = p.inter / 32;
  // The input into shared memory (kW13ActOff): the codes by cp.async (the oldest commit group,
  // waited for below with the ring's first chunk), the scales times 2^6 by plain loads.
  {
    const int m = p.pairs / p.topk, pieces = p.dim / 16;
    uint8_t* xa = smem + w13_codes_off(p.dim);
    for (int i = threadIdx.x; i < m * pieces; i += blockDim.x) {
      const int row = i / pieces, c = i - row * pieces;
      moe_cp16(xa + row * w13_code_stride(p.dim) + c * 16, p.x + size_t(row) * p.dim + c * 16);
    }
    cp_async_commit();
    float* xsa = reinterpret_cast<float*>(smem + kW13ActOff);
    batched_copy<4, float>(
        m * nkb, threadIdx.x, blockDim.x, [&](int i) { return __ldg(p.xs + i); },
        [&](int i, float v) {
          const int row = i / nkb;
          xsa[row * w13_scale_stride(p.dim) + (i - row * nkb)] = v * kE2M1ToE4M3Rescale;
        });
  }
  const int upg = 4 * S;  // units per group
  const int n_units = plan.n_unique * groups * upg;
  const int W = gridDim.x * kW13Warps, gw = blockIdx.x * kW13Warps + warp;
  const int lo = int(int64_t(gw) * n_units / W), hi = int(int64_t(gw + 1) * n_units / W);
  uint8_t* wsm = smem + kPlanBytes + warp * (kW13Stages * kW13StageBytes);
  float* swf = reinterpret_cast<float*>(smem + kW13SwOff + warp * kW13SwBytes);
  const size_t row_bytes = size_t(p.dim / 2);

  // Producer cursor: unit pn (at pcur), chunk pc (8 K blocks) within it. The lane's source
  // pointers for the unit's first chunk are set when the producer enters a unit.
  int pn = lo, pc = 0, issued = 0;
  W13Cursor pcur = w13_cursor(lo, S, groups);
  const uint8_t* psrc = nullptr;   // weight piece (row lane / 8, column lane % 8) of chunk 0
  const uint8_t* pssrc = nullptr;  // scale piece (row lane / 2, 4 bytes lane % 2) of chunk 0
  int pnkb = 0;                    // the unit's K blocks
  auto enter = [&]() {
    if (pn >= hi) return;
    const int kb0 = pcur.s * kbps;
    pnkb = min(nkb, kb0 + kbps) - kb0;
    const size_t row0 =
        size_t(plan.slot[pcur.u].expert) * p.inter + pcur.grp * 32 + (pcur.tau & 1) * 16;
    psrc = (pcur.tau >= 2 ? p.w3 : p.w1) + (row0 + (lane >> 3)) * row_bytes +
           size_t(kb0 + (lane & 7)) * 16;
    pssrc = (pcur.tau >= 2 ? p.w3s : p.w1s) + (row0 + (lane >> 1)) * nkb + kb0 + (lane & 1) * 4;
  };
  enter();
  auto issue = [&]() {
    if (pn < hi) {
      const int nk = min(8, pnkb - pc * 8);  // 4 or 8 (K % 128 == 0)
      uint8_t* dst = wsm + (issued % kW13Stages) * kW13StageBytes;
      if ((lane & 7) < nk) {  // 16 rows x nk 16-byte pieces; a warp op = 4 rows x 128 B
        uint8_t* d = dst + (lane >> 3) * kW13RowStride + (lane & 7) * 16;
        const uint8_t* src = psrc + pc * 128;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          moe_cp16(d + i * 4 * kW13RowStride, src + size_t(i) * 4 * row_bytes);
      }
      // 16 rows x nk scale bytes as 4-byte pieces (nk % 4 == 0)
      if ((lane & 1) * 4 < nk)
        moe_cp4(dst + kW13ScaleOff + (lane >> 1) * 8 + (lane & 1) * 4, pssrc + pc * 8);
      if ((pc + 1) * 8 >= pnkb) {
        pc = 0;
        ++pn;
        w13_advance(pcur, S, groups);
        enter();
      } else {
        ++pc;
      }
    }
    ++issued;
    cp_async_commit();
  };
#pragma unroll
  for (int c = 0; c < kW13Stages - 1; ++c) issue();
  cp_async_wait<kW13Stages - 1>();  // this thread's input pieces (the oldest group) have landed
  __syncthreads();                  // ... and every thread's, and the scales

  int consumed = 0, pending = 0;
  W13Cursor cur = w13_cursor(lo, S, groups);
  for (int n = lo; n < hi; ++n) {
    const int s = cur.s, tau = cur.tau, grp = cur.grp, gq = cur.u * groups + cur.grp;
    const SlotPlan& r = plan.slot[cur.u];
    const int count = r.count;
    // Absent columns read a present one (fp4_mma_block); only valid columns are stored.
    const uint8_t* act_g =
        smem + w13_codes_off(p.dim) + r.tok[min(g, count - 1)] * w13_code_stride(p.dim) + t * 8;
    const float* xsa = reinterpret_cast<const float*>(smem + kW13ActOff);
    const float* as0 = xsa + r.tok[min(2 * t, count - 1)] * w13_scale_stride(p.dim);
    const float* as1 = xsa + r.tok[min(2 * t + 1, count - 1)] * w13_scale_stride(p.dim);
    const int kbe = min(nkb, (s + 1) * kbps);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int kb = s * kbps; kb < kbe; kb += 8) {
      issue();
      // A chunk is 8 K blocks or, at the end of K, 4 (K % 128 == 0): two halves of 4, the second
      // skipped as a whole (a warp-uniform branch, not one per block).
      const bool full = kbe - kb >= 8;
      // This chunk's activations (shared memory), read before waiting on its weights.
      uint2 av[8];
      float sa0[8], sa1[8];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float4 q0 = make_float4(0.f, 0.f, 0.f, 0.f), q1 = q0;
        if (h == 0 || full) {
          q0 = *reinterpret_cast<const float4*>(as0 + kb + 4 * h);
          q1 = *reinterpret_cast<const float4*>(as1 + kb + 4 * h);
        }
        sa0[4 * h] = q0.x, sa0[4 * h + 1] = q0.y, sa0[4 * h + 2] = q0.z, sa0[4 * h + 3] = q0.w;
        sa1[4 * h] = q1.x, sa1[4 * h + 1] = q1.y, sa1[4 * h + 2] = q1.z, sa1[4 * h + 3] = q1.w;
      }
#pragma unroll
      for (int uu = 0; uu < 8; ++uu) {
        av[uu] = make_uint2(0u, 0u);
        if (uu < 4 || full) av[uu] = *reinterpret_cast<const uint2*>(act_g + (kb + uu) * 32);
      }
      cp_async_wait<kW13Stages - 1>();
      __syncwarp();
      const uint8_t* st = wsm + (consumed % kW13Stages) * kW13StageBytes;
      ++consumed;
      scales_to_f32(st + kW13ScaleOff, 8, 8, swf, kW13SwStride);  // a half chunk's: unused
      __syncwarp();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (h == 1 && !full) break;
        const float4 x0 = *reinterpret_cast<const float4*>(swf + g * kW13SwStride + h * 4);
        const float4 x1 = *reinterpret_cast<const float4*>(swf + (g + 8) * kW13SwStride + h * 4);
        const float sw0[4] = {x0.x, x0.y, x0.z, x0.w}, sw1[4] = {x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int uu = h * 4 + j;
          const uint32_t b0 = __byte_perm(av[uu].x, av[uu].y, 0x6420);  // elements [0,2,4,6]
          const uint32_t b1 = __byte_perm(av[uu].x, av[uu].y, 0x7531);  // elements [1,3,5,7]
          fp4_mma_step<kF16>(st + uu * 16 + t * 4, kW13RowStride, sw0[j], sw1[j], b0, b1, sa0[uu],
                             sa1[uu], acc);
        }
      }
      __syncwarp();
    }
    {  // [column][16 rows] of this unit's tile, valid columns only
      float* part = p.partials + (size_t(gq * 4 + tau) * S + s) * 128;
      if (2 * t < count) {
        __stcg(part + (2 * t) * 16 + g, acc[0]);
        __stcg(part + (2 * t) * 16 + g + 8, acc[2]);
      }
      if (2 * t + 1 < count) {
        __stcg(part + (2 * t + 1) * 16 + g, acc[1]);
        __stcg(part + (2 * t + 1) * 16 + g + 8, acc[3]);
      }
    }
    ++pending;
    // Leaving group gq (the next unit starts a group: s and tau wrap): publish this warp's units.
    if (n + 1 == hi || (s == S - 1 && tau == 3)) {
      __threadfence();
      __syncwarp();
      int old = 0;
      if (lane == 0) old = atomicAdd(p.counters + gq, pending);
      old = __shfl_sync(0xffffffffu, old, 0);
      if (old + pending == upg) {  // the group is complete: reduce it (uniform branch)
        __threadfence();
        w13_group_epilogue(p, r, gq, grp);
        if (lane == 0) p.counters[gq] = 0;  // for the next call / graph replay
      }
      pending = 0;
    }
    w13_advance(cur, S, groups);
  }
  cp_async_wait<0>();
}

// ---- Kernel 2: w2 ----
// Warps, ring depth and the shared-memory plan: moe_layout.h (kW2*, w2_layout).

// Copies 16 rows x `pieces` 16-byte pieces, contiguous at src, to rows of stride rs at dst
// (cp.async, piece i by lane i % 32): the lane's row / column are counted from its first piece
// (rr0, cc0) by steps of 32 pieces (dr rows + dc columns), so no division per piece.
struct PieceWalk {
  int rr0, cc0, dr, dc, pieces;
};
__device__ __forceinline__ PieceWalk piece_walk(int pieces) {
  const int lane = threadIdx.x & 31;
  return {lane / pieces, lane % pieces, 32 / pieces, 32 % pieces, pieces};
}
__device__ __forceinline__ void copy_rows16(uint8_t* dst, int rs, const uint8_t* src,
                                            const PieceWalk& w) {
  int rr = w.rr0, cc = w.cc0;
  for (int i = threadIdx.x & 31; i < 16 * w.pieces; i += 32) {
    moe_cp16(dst + rr * rs + cc * 16, src + size_t(i) * 16);
    rr += w.dr;
    cc += w.dc;
    if (cc >= w.pieces) {
      cc -= w.pieces;
      ++rr;
    }
  }
}

struct W2Params {
  const uint8_t* w2;
  const uint8_t* w2s;
  int E, dim, inter;
  const int* topk_idx;
  const float* topk_w;
  int pairs, topk;
  const uint8_t* h_codes;
  const float* h_scales;
  float* y;
  int64_t y_row_stride;
  bool round;
  const float* h_vals;  // unit kernel: h as moe_w13_unit_kernel wrote it
};

// Where column c of slot r writes output rows row0.. of its pair (t, k) = (tok, pair - tok *
// topk): y + t * y_row_stride + k * dim. The plan's row index instead of pair / topk: a runtime
// division was ~30 instructions a unit.
__device__ __forceinline__ float* w2_out(const W2Params& p, const SlotPlan& r, int c, int row0) {
  const int tok = r.tok[c], k = r.pair[c] - tok * p.topk;
  return p.y + tok * p.y_row_stride + size_t(k) * p.dim + row0;
}

// A 16-row w2 tile's fragment (lane (g, t): rows g, g + 8 of columns 2t, 2t + 1) into y at rows
// row0.., the first `count` columns of slot r only (bf16-rounded when p.round): every w2 kernel's
// store.
__device__ __forceinline__ void w2_store(const W2Params& p, const SlotPlan& r, int count, int row0,
                                         int g, int t, const float (&acc)[4]) {
  if (2 * t < count) {
    float* y = w2_out(p, r, 2 * t, row0);
    y[g] = p.round ? round_bf16(acc[0]) : acc[0];
    y[g + 8] = p.round ? round_bf16(acc[2]) : acc[2];
  }
  if (2 * t + 1 < count) {
    float* y = w2_out(p, r, 2 * t + 1, row0);
    y[g] = p.round ? round_bf16(acc[1]) : acc[1];
    y[g + 8] = p.round ? round_bf16(acc[3]) : acc[3];
  }
}

// kPreB (with kF16; where shared memory allows, MoeFp4::launch_experts): h held as the f16 B
// operands, converted once per CTA in the prologue.
template <bool kF16, bool kPreB>
__global__ void __maxnreg__(64) moe_w2_kernel(const W2Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  MoePlan& plan = *reinterpret_cast<MoePlan*>(smem);
  // Before the wait: the plan (topk_idx is complete, see the header) and the first weights.
  build_plan(p.topk_idx, p.topk_w, p.pairs, p.topk, p.E, plan);
  const W2Layout L = w2_layout(p.inter, p.pairs, kPreB);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int nkb = p.inter / 32;
  const int tiles = p.dim / 16;
  const int n_units = plan.n_unique * tiles;
  const int W = gridDim.x * kW2Warps, gw = blockIdx.x * kW2Warps + warp;
  const int lo = int(int64_t(gw) * n_units / W), hi = int(int64_t(gw + 1) * n_units / W);
  uint8_t* wsm = smem + L.stage_off + warp * (kW2Stages * L.stage_bytes);
  int pn = lo, issued = 0;
  int pu = lo / tiles, ptile = lo - pu * tiles;  // unit pn, counted
  auto issue = [&]() {
    if (pn < hi) {
      const size_t row0 = size_t(plan.slot[pu].expert) * p.dim + size_t(ptile) * 16;
      uint8_t* dst = wsm + (issued % kW2Stages) * L.stage_bytes;
      // 16 rows x I/2 bytes (I/32 pieces a row), contiguous; the walk is recomputed per unit
      // (two divisions) rather than kept in registers (64 at most here).
      copy_rows16(dst, L.rs, p.w2 + row0 * (p.inter / 2), piece_walk(nkb));
      const uint8_t* ssrc = p.w2s + row0 * nkb;  // 16 * nkb bytes, contiguous
      for (int i = lane; i < nkb; i += 32) moe_cp16(dst + L.stage_sc + i * 16, ssrc + i * 16);
      ++pn;
      if (++ptile == tiles) {
        ptile = 0;
        ++pu;
      }
    }
    ++issued;
    cp_async_commit();
  };
#pragma unroll
  for (int c = 0; c < kW2Stages - 1; ++c) issue();

  // Probe points: 0 weights issued, 1 PDL wait returned.
  UF_PROBE_OPEN(probe, kTagMoeW2);
  UF_PROBE_MARK(probe, 0);
  pdl_wait();  // h from kernel 1
  UF_PROBE_MARK(probe, 1);
  pdl_trigger();
  {  // h codes [pairs][inter] and scales [pairs][nkb] into shared memory (L2 reads)
    if constexpr (kPreB) {
      // As the f16 B operands, converted once per CTA instead of per warp: a group of 8 codes
      // (a lane's share of a K block) -> 16 bytes, b_e4m3_to_f16 of its fragment registers.
      batched_copy<8, uint2>(
          p.pairs * p.inter / 8, tid, blockDim.x,
          [&](int i) { return __ldcg(reinterpret_cast<const uint2*>(p.h_codes) + i); },
          [&](int i, uint2 v) {
            reinterpret_cast<uint4*>(smem + L.h_off)[i] =
                b_e4m3_to_f16x8(__byte_perm(v.x, v.y, 0x6420), __byte_perm(v.x, v.y, 0x7531));
          });
    } else {
      batched_copy<4, uint4>(
          p.pairs * p.inter / 16, tid, blockDim.x,
          [&](int i) { return __ldcg(reinterpret_cast<const uint4*>(p.h_codes) + i); },
          [&](int i, uint4 v) { reinterpret_cast<uint4*>(smem + L.h_off)[i] = v; });
    }
    // Scales times 2^6 (fp4_mma_step's sa): only ever used so.
    batched_copy<4, float>(
        p.pairs * nkb, tid, blockDim.x, [&](int i) { return __ldcg(p.h_scales + i); },
        [&](int i, float v) {
          reinterpret_cast<float*>(smem + L.hs_off)[i] = v * kE2M1ToE4M3Rescale;
        });
  }
  __syncthreads();

  const float* hs = reinterpret_cast<const float*>(smem + L.hs_off);
  float* swf = reinterpret_cast<float*>(smem + L.sw_off) + warp * 16 * L.sws;
  int consumed = 0;
  int u = lo / tiles, tile = lo - u * tiles;  // counted below: no division per unit
  for (int n = lo; n < hi; ++n) {
    const SlotPlan& r = plan.slot[u];
    // Absent columns read a present one (fp4_mma_block); only valid pairs are stored.
    const uint8_t* act_g = smem + L.h_off +
                           r.pair[min(g, r.count - 1)] * p.inter * (kPreB ? 2 : 1) +
                           t * (kPreB ? 16 : 8);
    const float* as0 = hs + r.pair[min(2 * t, r.count - 1)] * nkb;
    const float* as1 = hs + r.pair[min(2 * t + 1, r.count - 1)] * nkb;
    issue();
    cp_async_wait<kW2Stages - 1>();
    __syncwarp();
    const uint8_t* st = wsm + (consumed % kW2Stages) * L.stage_bytes;
    ++consumed;
    scales_to_f32(st + L.stage_sc, nkb, nkb, swf, L.sws);
    __syncwarp();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    w2_tile_k_loop<kF16, kPreB>(st + t * 4, L.rs, swf, L.sws, act_g, as0, as1, nkb, acc);
    __syncwarp();
    const int row0 = tile * 16;
    if (++tile == tiles) {
      tile = 0;
      ++u;
    }
    w2_store(p, r, r.count, row0, g, t, acc);
  }
  cp_async_wait<0>();
}

// w2 for shapes whose shared-memory plan of moe_w2_kernel does not fit (a large expert
// intermediate dim, e.g. I = 2304 on one GPU): the earlier per-tile kernel. Grid (ceil(K/16 / 8),
// P slots), 8 warps, one 16-row output tile per warp over all of I in K order from 0 (the same
// products and order as moe_w2_kernel), weights through a TileStream ring (8 K blocks a stage),
// scales and h read from global memory. Slots beyond the distinct experts exit.
using Fp4Stream = TileStream<16, 4>;  // FP4: 128 B of each row per stage, 4 stages
constexpr int kW2TileSmem = kW2Warps * Fp4Stream::kWarpBytes;

template <bool kF16>
__global__ void __launch_bounds__(kW2Warps * 32) moe_w2_tile_kernel(const W2Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ MoePlan plan;
  pdl_wait();
  pdl_trigger();
  build_plan(p.topk_idx, p.topk_w, p.pairs, p.topk, p.E, plan);
  if (int(blockIdx.y) >= plan.n_unique) return;  // uniform over the block
  const SlotPlan& r = plan.slot[blockIdx.y];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x * kW2Warps + warp;
  if (tile >= p.dim / 16) return;
  const int nkb = p.inter / 32;
  const size_t row_bytes = p.inter / 2;
  const uint8_t* act_g = g < r.count ? p.h_codes + size_t(r.pair[g]) * p.inter : nullptr;
  const float* as0 = 2 * t < r.count ? p.h_scales + size_t(r.pair[2 * t]) * nkb : nullptr;
  const float* as1 = 2 * t + 1 < r.count ? p.h_scales + size_t(r.pair[2 * t + 1]) * nkb : nullptr;
  const size_t row0 = size_t(r.expert) * p.dim + size_t(tile) * 16;
  const uint8_t* wtile = p.w2 + row0 * row_bytes;
  const uint8_t* sc0 = p.w2s + (row0 + g) * nkb;
  const uint8_t* sc1 = sc0 + size_t(8) * nkb;
  uint8_t* wsm = smem + warp * Fp4Stream::kWarpBytes;
  const int nchunks = (nkb + Fp4Stream::kChunkKb - 1) / Fp4Stream::kChunkKb;
  auto issue = [&](int c) {
    if (c < nchunks) {
      const int kb = c * Fp4Stream::kChunkKb;
      Fp4Stream::issue(wsm + (c % Fp4Stream::kStages) * Fp4Stream::kStageBytes, wtile, row_bytes,
                       kb, min(Fp4Stream::kChunkKb, nkb - kb), lane);
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
    const uint8_t* st = wsm + (c % Fp4Stream::kStages) * Fp4Stream::kStageBytes + t * 4;
#pragma unroll
    for (int u = 0; u < Fp4Stream::kChunkKb; ++u) {
      const int k = c * Fp4Stream::kChunkKb + u;
      if (k < nkb) {
        uint32_t b0 = 0, b1 = 0;
        if (act_g) {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(act_g + k * 32 + t * 8));
          b0 = __byte_perm(v.x, v.y, 0x6420);  // elements [0,2,4,6]
          b1 = __byte_perm(v.x, v.y, 0x7531);  // elements [1,3,5,7]
        }
        const float sa0 = as0 ? __ldg(as0 + k) * kE2M1ToE4M3Rescale : 0.f;
        const float sa1 = as1 ? __ldg(as1 + k) * kE2M1ToE4M3Rescale : 0.f;
        fp4_mma_step<kF16>(st + u * 16, Fp4Stream::kRowStride, e8m0_to_f32(__ldg(sc0 + k)),
                           e8m0_to_f32(__ldg(sc1 + k)), b0, b1, sa0, sa1, acc);
      }
    }
    __syncwarp();
  }
  cp_async_wait<0>();
  w2_store(p, r, r.count, tile * 16, g, t, acc);
}

// ---- Unit kernels (the default): one work unit per CTA, all of its bytes in flight at once ----
// moe_w13_unit_kernel: grid P * (I / 8) CTAs, CTA = (slot u = blockIdx.x / (I/8), 8-row group rg
//   of I); slots beyond the distinct experts exit at once (slot-major order: the real units are
//   scheduled first). One 16-row mma tile: A rows 0-7 = w1 rows rg*8..+7, rows 8-15 = w3 rows
//   rg*8..+7 (so a thread's d[0]/d[2] are the gate / up of the same feature; an output's
//   arithmetic does not depend on its row position). max(2, min(S, 16)) warps; warp w owns the
//   K splits s = w, w + warps, ... (S = ceil(K/32 / 16) as the persistent kernel) and issues, in
//   one cp.async group, each split's 16 rows x 256 B of weights + 16 x 16 scale bytes and the
//   split's slice of the slot's activation columns (8-byte pieces: the FP8 input need only be
//   8-byte aligned) and scales; it waits for its own group only (no CTA barrier before the math).
//   Per split from acc = 0 over its K blocks in order (the persistent kernel's products), the
//   split's [16][8] partial overwrites its weight area; then one barrier and thread (row, column)
//   sums the splits in split order (split 0's value, then += 1..S-1), rounds g / u to bf16,
//   clamps, h = bf16(w * silu(g) * u): the persistent kernel's group epilogue exactly, minus the
//   FP8 quantisation (a block of 32 features spans 4 CTAs), which moe_w2_unit_kernel does.
//   Shared memory: plan + m columns x (K + 32) activation bytes + m x K/32 scales + S x 5.5 KB
//   (K = 5120: 67 KB at m = 1, 107 KB at m = 8). Bytes per CTA: 16 x (K/2 + K/32) = 43.5 KB at
//   K = 5120: 216 CTAs at 1 row (6 experts, one wave), ~1450 at 7 rows (~40 experts; 2-3 CTAs
//   resident per SM, so 87-130 KB in flight per SM, the next CTAs' loads start as CTAs retire).
// moe_w2_unit_kernel: grid P * (K / 128), CTA = (slot u, 128 output rows), 8 warps x one 16-row
//   tile over all of I (the persistent kernel's products and order). The plan and all weights
//   (128 x (I/2 + I/32) bytes, 19.6 KB at I = 288) are issued BEFORE griddepcontrol.wait; after
//   it, the CTA quantises h of its slot's columns per 32 (warp_quant_fp8_block: the persistent
//   w13 epilogue's codes and scales, bitwise) into shared memory, then computes. 240 CTAs at
//   1 row, ~1600 at 7 rows (up to 8 resident per SM).
constexpr int kUnitMaxWarps = 16;
constexpr int kUnitRowStride = 272;  // 16 K blocks x 16 B + 16: conflict-free fragment reads
constexpr int kUnitScaleOff = 16 * kUnitRowStride;
constexpr int kUnitSwOff = kUnitScaleOff + 16 * 16;  // + 16 rows x 16 scale bytes
constexpr int kUnitSwStride = 16;  // fp32 scales [16 rows][16]: LDS.128, conflict-free per phase
constexpr int kUnitSplitBytes = kUnitSwOff + 16 * kUnitSwStride * 4;

__host__ __device__ __forceinline__ int round16(int n) { return (n + 15) / 16 * 16; }

struct W13UnitLayout {
  int xs_stride, x_off, xsc_off, split_off, total;
};
__host__ __device__ __forceinline__ W13UnitLayout w13_unit_layout(int dim, int cols, int splits) {
  W13UnitLayout l;
  l.xs_stride = w13_code_stride(dim);  // the persistent kernel's input rows: conflict-free
  l.x_off = kPlanBytes;
  l.xsc_off = l.x_off + cols * l.xs_stride;
  l.split_off = l.xsc_off + round16(cols * (dim / 32) * 4);
  l.total = l.split_off + splits * kUnitSplitBytes;
  return l;
}
__host__ __device__ __forceinline__ int w13_unit_warps(int splits) {
  return splits < 2 ? 2 : (splits > kUnitMaxWarps ? kUnitMaxWarps : splits);
}

template <bool kF16>
__global__ void __launch_bounds__(kUnitMaxWarps * 32, 2)
    moe_w13_unit_kernel(const W13Params p, int cols_cap) {
  extern __shared__ __align__(128) uint8_t smem[];
  MoePlan& plan = *reinterpret_cast<MoePlan*>(smem);
  // Probe points: 0 start, 1 PDL wait returned, 2 plan built.
  UF_PROBE_OPEN(probe, kTagW13Unit);
  UF_PROBE_MARK(probe, 0);
  pdl_wait();
  UF_PROBE_MARK(probe, 1);
  pdl_trigger();  // after the wait: kernel 2 reads topk_idx before its own wait
  build_plan(p.topk_idx, p.topk_w, p.pairs, p.topk, p.E, plan);
  UF_PROBE_MARK(probe, 2);
  const int nrg = p.inter / 8;
  const int u = blockIdx.x / nrg, rg = blockIdx.x - u * nrg;
  if (u >= plan.n_unique) return;  // uniform over the block
  const SlotPlan& r = plan.slot[u];
  const int count = min(r.count, cols_cap);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int NW = blockDim.x >> 5, S = p.splits, kbps = p.kb_per_split, nkb = p.dim / 32;
  const W13UnitLayout L = w13_unit_layout(p.dim, cols_cap, S);
  uint8_t* xsm = smem + L.x_off;
  float* xsc = reinterpret_cast<float*>(smem + L.xsc_off);
  const size_t row_bytes = size_t(p.dim / 2);
  const size_t erow = size_t(r.expert) * p.inter + rg * 8;
  for (int s = warp; s < S; s += NW) {
    uint8_t* dst = smem + L.split_off + s * kUnitSplitBytes;
    const int kb0 = s * kbps, nk = min(kbps, nkb - kb0);  // nk % 4 == 0 (K % 128 == 0)
    for (int i = lane; i < 256; i += 32) {  // 16 rows x 16 pieces: 2 rows x 256 B a warp op
      const int rr = i >> 4, cc = i & 15;
      if (cc < nk)
        moe_cp16(dst + rr * kUnitRowStride + cc * 16,
                 (rr < 8 ? p.w1 : p.w3) + (erow + (rr & 7)) * row_bytes + size_t(kb0 + cc) * 16);
    }
    for (int i = lane; i < 64; i += 32) {  // 16 rows x nk scale bytes as 4-byte pieces
      const int rr = i >> 2, cc = i & 3;
      if (cc * 4 < nk)
        moe_cp4(dst + kUnitScaleOff + rr * 16 + cc * 4,
                (rr < 8 ? p.w1s : p.w3s) + (erow + (rr & 7)) * nkb + kb0 + cc * 4);
    }
    for (int i = lane; i < count * 64; i += 32) {  // columns x 64 8-byte pieces of 16 K blocks
      const int c = i >> 6, q = i & 63;
      if (q * 8 < nk * 32)
        moe_cp8(xsm + c * L.xs_stride + kb0 * 32 + q * 8,
                p.x + size_t(r.tok[c]) * p.dim + kb0 * 32 + q * 8);
    }
    for (int i = lane; i < count * 16; i += 32) {
      const int c = i >> 4, q = i & 15;
      if (q < nk) moe_cp4(xsc + c * nkb + kb0 + q, p.xs + size_t(r.tok[c]) * nkb + kb0 + q);
    }
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncwarp();
  // Absent columns read a present one (fp4_mma_block); only valid columns are stored.
  const int cg = min(g, count - 1), c0 = min(2 * t, count - 1), c1 = min(2 * t + 1, count - 1);
  for (int s = warp; s < S; s += NW) {
    uint8_t* st = smem + L.split_off + s * kUnitSplitBytes;
    float* swf = reinterpret_cast<float*>(st + kUnitSwOff);
    const int kb0 = s * kbps, nk = min(kbps, nkb - kb0);
    // The split's weight scales to fp32 and its activation scales times 2^6 (fp4_mma_step's sa),
    // in place: this warp copied them and only this warp reads them.
    scales_to_f32(st + kUnitScaleOff, 16, nk, swf, kUnitSwStride);
    for (int i = lane; i < count * 16; i += 32) {
      const int c = i >> 4, q = i & 15;
      if (q < nk) xsc[c * nkb + kb0 + q] *= kE2M1ToE4M3Rescale;
    }
    __syncwarp();
    const uint8_t* act = xsm + cg * L.xs_stride + kb0 * 32 + t * 8;
    const float* sa0 = xsc + c0 * nkb + kb0;  // nkb, kb0 % 4 == 0: 16-byte aligned
    const float* sa1 = xsc + c1 * nkb + kb0;
    const float* sw0 = swf + g * kUnitSwStride;
    const float* sw1 = swf + (g + 8) * kUnitSwStride;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int kk = 0; kk < nk; kk += 4) {  // nk % 4 == 0 (K % 128 == 0)
      const float4 w0 = *reinterpret_cast<const float4*>(sw0 + kk);
      const float4 w1 = *reinterpret_cast<const float4*>(sw1 + kk);
      const float4 a0 = *reinterpret_cast<const float4*>(sa0 + kk);
      const float4 a1 = *reinterpret_cast<const float4*>(sa1 + kk);
      const uint8_t* w = st + kk * 16 + t * 4;
      const uint8_t* x = act + kk * 32;
      fp4_mma_block<kF16>(w, kUnitRowStride, w0.x, w1.x, x, a0.x, a1.x, acc);
      fp4_mma_block<kF16>(w + 16, kUnitRowStride, w0.y, w1.y, x + 32, a0.y, a1.y, acc);
      fp4_mma_block<kF16>(w + 32, kUnitRowStride, w0.z, w1.z, x + 64, a0.z, a1.z, acc);
      fp4_mma_block<kF16>(w + 48, kUnitRowStride, w0.w, w1.w, x + 96, a0.w, a1.w, acc);
    }
    __syncwarp();                                // every lane is done with the split's weights
    float* part = reinterpret_cast<float*>(st);  // [16 rows][8 columns]
    part[g * 8 + 2 * t] = acc[0];
    part[g * 8 + 2 * t + 1] = acc[1];
    part[(g + 8) * 8 + 2 * t] = acc[2];
    part[(g + 8) * 8 + 2 * t + 1] = acc[3];
  }
  __syncthreads();
  const int i = threadIdx.x;
  if (i < count * 8) {
    const int rr = i & 7, c = i >> 3;
    float ga = 0.f, ua = 0.f;
    for (int s = 0; s < S; ++s) {  // split order: split 0's value, then += the next
      const float* part = reinterpret_cast<const float*>(smem + L.split_off + s * kUnitSplitBytes);
      const float vg = part[rr * 8 + c], vu = part[(rr + 8) * 8 + c];
      if (s == 0) {
        ga = vg;
        ua = vu;
      } else {
        ga += vg;
        ua += vu;
      }
    }
    float gate = round_bf16(ga);
    float upv = round_bf16(ua);
    if (p.limit > 0.f) {
      upv = fminf(fmaxf(upv, -p.limit), p.limit);
      gate = fminf(gate, p.limit);
    }
    const float silu = gate / (1.0f + expf(-gate));
    const float h = round_bf16(r.weight[c] * (silu * upv));
    p.h_vals[size_t(r.pair[c]) * p.inter + rg * 8 + rr] = h;
  }
}

constexpr int kW2UnitWarps = 8;
constexpr int kW2UnitRows = kW2UnitWarps * 16;

struct W2UnitLayout {
  int rs, sc_off, sws, sw_off, warp_bytes, hcs, h_off, hs_off, w_off, total;
};
// f16 (moe_w2_unit_kernel<true>): h is held as the mma's f16 B operands (2 bytes an element).
__host__ __device__ __forceinline__ W2UnitLayout w2_unit_layout(int inter, int cols, bool f16) {
  W2UnitLayout l;
  const int nkb = inter / 32;
  // Row stride = 16 mod 32 bytes: the 8 rows g of a 4-byte fragment read hit distinct banks.
  l.rs = inter / 2 + ((inter / 2) % 32 == 0 ? 16 : 0);
  l.sc_off = 16 * l.rs;
  l.sws = nkb | 1;  // fp32 scales [16 rows][sws], odd: the 8 rows g of a read hit distinct banks
  l.sw_off = round16(l.sc_off + 16 * nkb);
  l.warp_bytes = l.sw_off + round16(16 * l.sws * 4);
  // Column stride >= the column's bytes, = 32 mod 128 (8-byte B reads) or, f16, 64 mod 128
  // (16-byte reads, a quarter warp = columns g, g + 1): conflict-free B reads.
  l.hcs = f16 ? (2 * inter - 64 + 127) / 128 * 128 + 64 : (inter - 32 + 127) / 128 * 128 + 32;
  l.h_off = kPlanBytes;
  l.hs_off = l.h_off + round16(cols * l.hcs);
  l.w_off = l.hs_off + round16(cols * nkb * 4);
  l.total = l.w_off + kW2UnitWarps * l.warp_bytes;
  return l;
}

template <bool kF16>
__global__ void __launch_bounds__(kW2UnitWarps * 32, 4)
    moe_w2_unit_kernel(const W2Params p, int cols_cap) {
  extern __shared__ __align__(128) uint8_t smem[];
  MoePlan& plan = *reinterpret_cast<MoePlan*>(smem);
  // Before the wait: the plan (topk_idx is complete, see the header) and all the weights.
  build_plan(p.topk_idx, p.topk_w, p.pairs, p.topk, p.E, plan);
  const int nrb = p.dim / kW2UnitRows;
  const int u = blockIdx.x / nrb, rb = blockIdx.x - u * nrb;
  if (u >= plan.n_unique) return;  // uniform over the block
  const SlotPlan& r = plan.slot[u];
  const int count = min(r.count, cols_cap);
  const W2UnitLayout L = w2_unit_layout(p.inter, cols_cap, kF16);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int nkb = p.inter / 32;
  const int row_out = rb * kW2UnitRows + warp * 16;
  const size_t row0 = size_t(r.expert) * p.dim + row_out;
  uint8_t* wsm = smem + L.w_off + warp * L.warp_bytes;
  {
    // 16 rows x I/2 bytes, contiguous
    copy_rows16(wsm, L.rs, p.w2 + row0 * (p.inter / 2), piece_walk(nkb));
    const uint8_t* ssrc = p.w2s + row0 * nkb;  // 16 * nkb bytes, contiguous
    for (int i = lane; i < nkb; i += 32) moe_cp16(wsm + L.sc_off + i * 16, ssrc + i * 16);
    cp_async_commit();
  }
  // Probe points: 0 weights issued, 1 PDL wait returned.
  UF_PROBE_OPEN(probe, kTagW2Unit);
  UF_PROBE_MARK(probe, 0);
  pdl_wait();  // h from kernel 1
  UF_PROBE_MARK(probe, 1);
  pdl_trigger();
  uint8_t* hq = smem + L.h_off;
  float* hs = reinterpret_cast<float*>(smem + L.hs_off);
  for (int item = warp; item < count * nkb; item += kW2UnitWarps) {
    const int c = item / nkb, kb = item - c * nkb;
    const float h = __ldcg(p.h_vals + size_t(r.pair[c]) * p.inter + kb * 32 + lane);
    float sc;
    const uint8_t code = warp_quant_fp8_block(h, &sc);
    if constexpr (kF16) {  // as the f16 B operands (f16_b_slot): converted once, not per warp
      uint8_t* blk = hq + c * L.hcs + kb * 64 + (lane >> 3) * 16;
      reinterpret_cast<uint16_t*>(blk)[f16_b_slot(lane & 7)] = uint16_t(f16_lo_of_e4m3x4(code));
    } else {
      hq[c * L.hcs + kb * 32 + lane] = code;
    }
    if (lane == 0) hs[c * nkb + kb] = sc * kE2M1ToE4M3Rescale;  // only used as fp4_mma_step's sa
  }
  cp_async_wait<0>();
  __syncthreads();
  float* swf = reinterpret_cast<float*>(wsm + L.sw_off);
  scales_to_f32(wsm + L.sc_off, nkb, nkb, swf, L.sws);
  __syncwarp();
  // Absent columns read a present one (fp4_mma_block); only valid columns are stored.
  const uint8_t* act_g = hq + min(g, count - 1) * L.hcs + t * (kF16 ? 16 : 8);
  const float* as0 = hs + min(2 * t, count - 1) * nkb;
  const float* as1 = hs + min(2 * t + 1, count - 1) * nkb;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  w2_tile_k_loop<kF16, kF16>(wsm + t * 4, L.rs, swf, L.sws, act_g, as0, as1, nkb, acc);
  w2_store(p, r, count, row_out, g, t, acc);
}

// out[t][n] = sum over t's valid experts in ascending id of y[pair][n]. grid (dim/256, m).
// Warp 0 ranks the row's experts (rank_row_experts); every thread then issues all of its loads
// before the first add (a decode step runs this once a layer, on the chain).
constexpr int kCombineMaxK = kMaxPairs / kMaxDecodeRows;  // top-k <= 8: the MoeFp4 ctors' check
__global__ void __launch_bounds__(256)
    moe_combine_kernel(const float* y, const int* topk_idx, int topk, int E, int dim,
                       const float* add, bool round_out, float* out) {
  __shared__ int s_k[kCombineMaxK];
  __shared__ int s_count;
  pdl_trigger();
  pdl_wait();
  const int row = blockIdx.y;
  if (threadIdx.x < 32) rank_row_experts(topk_idx + row * topk, topk, E, s_k, &s_count);
  __syncthreads();
  const int col = blockIdx.x * 256 + threadIdx.x;
  if (col >= dim) return;
  const int n = s_count;
  float v[kCombineMaxK];
#pragma unroll
  for (int j = 0; j < kCombineMaxK; ++j)
    v[j] = j < n ? y[size_t(row * topk + s_k[j]) * dim + col] : 0.f;
  const float a = add ? add[size_t(row) * dim + col] : 0.f;
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kCombineMaxK; ++j)
    if (j < n) sum += v[j];
  if (add) {  // DeviceMoe's combine_kernel: bf16(routed + shared), or unrounded
    const float s2 = __fadd_rn(sum, a);
    sum = round_out ? round_bf16(s2) : s2;
  }
  out[size_t(row) * dim + col] = sum;
}

// moe_combine_kernel for prefill rows: 4 columns a thread (float4, the same per-column sum and
// add, so the same bits), the row's ids loaded by topk threads at once and sorted from shared
// memory. grid (dim / 1024, m); dim % 4 == 0 and 16-byte aligned rows (the caller checks). Decode
// rows keep the kernel above (the step was measured with it).
__global__ void __launch_bounds__(256)
    moe_combine_vec_kernel(const float* y, const int* topk_idx, int topk, int E, int dim,
                           const float* add, bool round_out, float* out) {
  __shared__ int s_k[kCombineMaxK];
  __shared__ int s_count;
  pdl_trigger();
  pdl_wait();
  const int row = blockIdx.y;
  if (threadIdx.x < 32) rank_row_experts(topk_idx + row * topk, topk, E, s_k, &s_count);
  __syncthreads();
  const int col = (blockIdx.x * 256 + threadIdx.x) * 4;
  if (col >= dim) return;
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j = 0; j < s_count; ++j) {
    const float4 v = *reinterpret_cast<const float4*>(y + size_t(row * topk + s_k[j]) * dim + col);
    sum.x += v.x;
    sum.y += v.y;
    sum.z += v.z;
    sum.w += v.w;
  }
  if (add) {
    const float4 a = *reinterpret_cast<const float4*>(add + size_t(row) * dim + col);
    float4 v = make_float4(__fadd_rn(sum.x, a.x), __fadd_rn(sum.y, a.y), __fadd_rn(sum.z, a.z),
                           __fadd_rn(sum.w, a.w));
    if (round_out)
      v = make_float4(round_bf16(v.x), round_bf16(v.y), round_bf16(v.z), round_bf16(v.w));
    sum = v;
  }
  *reinterpret_cast<float4*>(out + size_t(row) * dim + col) = sum;
}

// The combine of m rows: the vector kernel for prefill rows where the shapes allow it.
void launch_combine(const float* y, const int* topk_idx, int m, int topk, int E, int dim,
                    const float* add, bool round_out, float* out, cudaStream_t stream) {
  const bool vec = m > kMaxDecodeRows && dim % 4 == 0 &&
                   ((reinterpret_cast<uintptr_t>(y) | reinterpret_cast<uintptr_t>(out) |
                     reinterpret_cast<uintptr_t>(add)) %
                    16) == 0;
  if (vec)
    launch_pdl(moe_combine_vec_kernel, dim3((dim / 4 + 255) / 256, m), dim3(256), 0, stream, y,
               topk_idx, topk, E, dim, add, round_out, out);
  else
    launch_pdl(moe_combine_kernel, dim3((dim + 255) / 256, m), dim3(256), 0, stream, y, topk_idx,
               topk, E, dim, add, round_out, out);
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

// fn(std::false_type{}) and fn(std::true_type{}): the e4m3-mma and f16-HMMA kernel instances.
template <typename Fn>
void for_both_paths(Fn&& fn) {
  fn(std::false_type{});
  fn(std::true_type{});
}

}  // namespace

// The unit kernels up to this many rows, the persistent ones above (bitwise the same). Alone
// (bench_cuda_moe, H200, session 18) the persistent kernels are faster at every row count (1 / 2
// rows 18.6 / 25.6 us against 21.2 / 28.3), but in the decode step the unit kernels win up to 2
// rows: their weights load before the PDL wait (8k step, 1 / 2 rows: 4062-4096 / 4606-4631 us
// with 2 here, 4212-4216 / 4693-4709 with 0).
#ifndef UF_MOE_UNIT_MAX_ROWS  // benchmarks may override it (bitwise the same outputs either way)
#define UF_MOE_UNIT_MAX_ROWS 2
#endif
constexpr int kUnitMaxRowsFaster = UF_MOE_UNIT_MAX_ROWS;

namespace {
bool g_default_f16 = true;  // MoeFp4::set_default_f16
}  // namespace
void MoeFp4::set_default_f16(bool on) { g_default_f16 = on; }

MoeFp4::MoeFp4(int dim, int inter, int topk, int sm_count)
    : dim_(dim), inter_(inter), topk_(topk), sm_count_(sm_count) {
  unit_max_rows_ = kUnitMaxRowsFaster;
  f16_ = g_default_f16;
  require(dim > 0 && inter > 0 && dim % 128 == 0 && inter % 32 == 0 && topk >= 1 &&
              kMaxDecodeRows * topk <= kMaxPairs,
          "MoeFp4: dim %d must be a multiple of 128, inter %d of 32, 8 * topk (%d) <= 64", dim,
          inter, topk);
  const int nkb = dim / 32;
  kb_per_split_ = std::min(nkb, kKbPerSplit);
  splits_ = (nkb + kb_per_split_ - 1) / kb_per_split_;
  int device = 0, optin = 0;
  UF_CUDA_CHECK(cudaGetDevice(&device));
  UF_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (sm_count_ <= 0)
    UF_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device));
  const int slots = kMaxDecodeRows * topk;
  const int w2_max = w2_layout(inter, slots, false).total;
  const int w13_max = w13_smem(kMaxDecodeRows, dim);
  require(w13_max <= optin && kW2TileSmem <= optin,
          "MoeFp4: shared memory plan (w13 %d B) exceeds the device's %d B", w13_max, optin);
  w2_streamed_ = w2_max <= optin;  // else the per-tile w2 kernel (large inter)
  const int w13_unit_max = w13_unit_layout(dim, kMaxDecodeRows, splits_).total;
  const int w2_unit_max = std::max(w2_unit_layout(inter, kMaxDecodeRows, false).total,
                                   w2_unit_layout(inter, kMaxDecodeRows, true).total);
  unit_ok_ = splits_ <= 4 * kUnitMaxWarps && w13_unit_max <= optin && w2_unit_max <= optin &&
             dim % kW2UnitRows == 0;
  legacy_ = !unit_ok_;
  if (unit_ok_) {
    for_both_paths([&](auto f16) {
      raise_smem(moe_w13_unit_kernel<f16>, w13_unit_max);
      raise_smem(moe_w2_unit_kernel<f16>, w2_unit_layout(inter, kMaxDecodeRows, f16).total);
      prefer_shared_carveout(moe_w13_unit_kernel<f16>);
      prefer_shared_carveout(moe_w2_unit_kernel<f16>);
    });
  }
  // The f16 w2 kernel with h pre-converted (kPreB): only where its plan and a w13 CTA fit on one
  // SM together (launch_experts), so a w2 CTA can still start during the w13 kernel's tail.
  {
    SmShared sm{0, 0, optin};
    UF_CUDA_CHECK(
        cudaDeviceGetAttribute(&sm.per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    UF_CUDA_CHECK(cudaDeviceGetAttribute(&sm.reserved_per_block,
                                         cudaDevAttrReservedSharedMemoryPerBlock, device));
    cudaFuncAttributes f13{}, f2{};
    UF_CUDA_CHECK(cudaFuncGetAttributes(&f13, moe_w13_kernel<true>));
    UF_CUDA_CHECK(cudaFuncGetAttributes(&f2, moe_w2_kernel<true, true>));
    int raise = 0;
    for (int m = 1; m <= kMaxDecodeRows; ++m) {
      pre_b_max_[m] = w2_beside_w13(m, dim, sm, int(f13.sharedSizeBytes), int(f2.sharedSizeBytes));
      raise = std::max(raise, pre_b_max_[m]);
    }
    if (raise > 0) {
      raise_smem(moe_w2_kernel<true, true>, raise);
      prefer_shared_carveout(moe_w2_kernel<true, true>);
    }
  }
  for_both_paths([&](auto f16) {
    raise_smem(moe_w13_kernel<f16>, w13_max);
    if (w2_streamed_) raise_smem(moe_w2_kernel<f16, false>, w2_max);
    raise_smem(moe_w2_tile_kernel<f16>, kW2TileSmem);
    prefer_shared_carveout(moe_w13_kernel<f16>);
    prefer_shared_carveout(moe_w2_kernel<f16, false>);
    prefer_shared_carveout(moe_w2_tile_kernel<f16>);
  });
  prefer_shared_carveout(moe_combine_kernel);
  prefer_shared_carveout(swiglu_quant_kernel);
  const size_t groups = inter / 32;
  UF_CUDA_CHECK(cudaMalloc(&h_codes_, size_t(slots) * inter));
  UF_CUDA_CHECK(cudaMalloc(&h_scales_, sizeof(float) * slots * groups));
  UF_CUDA_CHECK(cudaMalloc(&h_vals_, sizeof(float) * slots * inter));
  UF_CUDA_CHECK(cudaMalloc(&y_, sizeof(float) * slots * dim));
  UF_CUDA_CHECK(cudaMalloc(&partials_, sizeof(float) * slots * groups * 4 * splits_ * 128));
  UF_CUDA_CHECK(cudaMalloc(&counters_, sizeof(int) * slots * groups));
  UF_CUDA_CHECK(cudaMemset(counters_, 0, sizeof(int) * slots * groups));
}

MoeFp4::~MoeFp4() {
  cudaFree(h_codes_);
  cudaFree(h_scales_);
  cudaFree(h_vals_);
  cudaFree(y_);
  cudaFree(partials_);
  cudaFree(counters_);
}

void MoeFp4::run_experts_impl(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                              const float* topk_w, float swiglu_limit, bool round_w2, float* y,
                              int64_t y_row_stride, cudaStream_t stream,
                              const std::function<void()>& after_w13) const {
  require(w.dim == dim_ && w.inter == inter_ && x.k == dim_ && x.m >= 1 && x.m <= kMaxDecodeRows,
          "MoeFp4::run: experts [dim %d, inter %d] / input [%d, %d] do not match the plan "
          "[dim %d, inter %d]",
          w.dim, w.inter, x.m, x.k, dim_, inter_);
  require(y_row_stride >= int64_t(topk_) * dim_,
          "MoeFp4::run_experts: row stride %lld < topk %d * dim %d",
          static_cast<long long>(y_row_stride), topk_, dim_);
  auto aligned = [](const void* ptr, uintptr_t a) {
    return reinterpret_cast<uintptr_t>(ptr) % a == 0;
  };
  require(aligned(w.w1, 16) && aligned(w.w3, 16) && aligned(w.w2, 16) && aligned(w.w1_scale, 4) &&
              aligned(w.w3_scale, 4) && aligned(w.w2_scale, 16) && aligned(x.codes, 16) &&
              aligned(x.scales, 4),
          "MoeFp4::run: weights must be 16-byte aligned (w1 / w3 scales 4, w2 scales 16) and the "
          "FP8 input codes 16-byte aligned (cp.async and vector loads)");
  // Grids: enough CTAs for the largest unit count of this M (P distinct experts), at most the
  // resident ones. The unit split inside depends on the routing; the arithmetic never does.
  // The unit kernels up to unit_max_rows_ (kUnitMaxRowsFaster says why), the persistent ones
  // above. Bitwise the same outputs either way.
  if (f16_)
    launch_experts<true>(w, x, topk_idx, topk_w, swiglu_limit, round_w2, y, y_row_stride, stream,
                         after_w13);
  else
    launch_experts<false>(w, x, topk_idx, topk_w, swiglu_limit, round_w2, y, y_row_stride, stream,
                          after_w13);
}

template <bool kF16>
void MoeFp4::launch_experts(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                            const float* topk_w, float swiglu_limit, bool round_w2, float* y,
                            int64_t y_row_stride, cudaStream_t stream,
                            const std::function<void()>& after_w13) const {
  const int P = x.m * topk_;
  const auto w13_enqueued = [&] {
    if (after_w13) after_w13();
  };
  const int groups = inter_ / 32;
  if (uses_unit_kernels(x.m)) {
    W13Params a{w.w1,          w.w1_scale,   w.w3,     w.w3_scale, w.num_experts, dim_,
                inter_,        x.codes,      x.scales, topk_idx,   topk_w,        P,
                topk_,         swiglu_limit, nullptr,  nullptr,    nullptr,       nullptr,
                kb_per_split_, splits_,      h_vals_};
    launch_pdl(moe_w13_unit_kernel<kF16>, dim3(P * (inter_ / 8)),
               dim3(w13_unit_warps(splits_) * 32),
               size_t(w13_unit_layout(dim_, x.m, splits_).total), stream, a, x.m);
    w13_enqueued();
    W2Params b{w.w2,  w.w2_scale, w.num_experts, dim_, inter_,       topk_idx, topk_w, P,
               topk_, nullptr,    nullptr,       y,    y_row_stride, round_w2, h_vals_};
    launch_pdl(moe_w2_unit_kernel<kF16>, dim3(P * (dim_ / kW2UnitRows)), dim3(kW2UnitWarps * 32),
               size_t(w2_unit_layout(inter_, x.m, kF16).total), stream, b, x.m);
    return;
  }
  const int w13_units = P * groups * 4 * splits_;
  const int w13_grid =
      std::max(1, std::min(kW13CtasPerSm * sm_count_, (w13_units + kW13Warps - 1) / kW13Warps));
  W13Params a{w.w1,          w.w1_scale,   w.w3,     w.w3_scale, w.num_experts, dim_,
              inter_,        x.codes,      x.scales, topk_idx,   topk_w,        P,
              topk_,         swiglu_limit, h_codes_, h_scales_,  partials_,     counters_,
              kb_per_split_, splits_,      nullptr};
  launch_pdl(moe_w13_kernel<kF16>, dim3(w13_grid), dim3(kW13Warps * 32),
             size_t(w13_smem(x.m, dim_)), stream, a);
  w13_enqueued();
  W2Params b{w.w2,  w.w2_scale, w.num_experts, dim_, inter_,       topk_idx, topk_w, P,
             topk_, h_codes_,   h_scales_,     y,    y_row_stride, round_w2, nullptr};
  if (!w2_streamed_) {
    launch_pdl(moe_w2_tile_kernel<kF16>, dim3((dim_ / 16 + kW2Warps - 1) / kW2Warps, P),
               dim3(kW2Warps * 32), size_t(kW2TileSmem), stream, b);
    return;
  }
  const int w2_units = P * (dim_ / 16);
  const int w2_grid =
      std::max(1, std::min(kW2CtasPerSm * sm_count_, (w2_units + kW2Warps - 1) / kW2Warps));
  const int pre_b_bytes = w2_layout(inter_, P, true).total;
  if (kF16 && pre_b_bytes <= pre_b_max_[x.m])
    launch_pdl(moe_w2_kernel<true, true>, dim3(w2_grid), dim3(kW2Warps * 32), size_t(pre_b_bytes),
               stream, b);
  else
    launch_pdl(moe_w2_kernel<kF16, false>, dim3(w2_grid), dim3(kW2Warps * 32),
               size_t(w2_layout(inter_, P, false).total), stream, b);
}

void MoeFp4::run(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                 const float* topk_w, float swiglu_limit, float* out, cudaStream_t stream) const {
  run_experts_impl(w, x, topk_idx, topk_w, swiglu_limit, /*round_w2=*/true, y_,
                   int64_t(topk_) * dim_, stream);
  moe_combine_rows(y_, topk_idx, x.m, topk_, w.num_experts, dim_, out, stream);
}

void MoeFp4::run_add(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                     const float* topk_w, float swiglu_limit, bool partial, const float* add,
                     bool round_out, const std::function<void()>& before_combine, float* out,
                     cudaStream_t stream, const std::function<void()>& after_w13) const {
  require(add != nullptr, "MoeFp4::run_add: no addend");
  run_experts_impl(w, x, topk_idx, topk_w, swiglu_limit, /*round_w2=*/!partial, y_,
                   int64_t(topk_) * dim_, stream, after_w13);
  if (before_combine) before_combine();
  combine(y_, topk_idx, x.m, w.num_experts, add, round_out, out, stream);
}

void MoeFp4::combine(const float* y, const int* topk_idx, int m, int num_experts, const float* add,
                     bool round_out, float* out, cudaStream_t stream) const {
  launch_combine(y, topk_idx, m, topk_, num_experts, dim_, add, round_out, out, stream);
}

void moe_combine_rows(const float* y, const int* topk_idx, int m, int topk, int num_experts,
                      int dim, float* out, cudaStream_t stream) {
  require(m >= 1 && m <= 65535 && topk <= 8, "moe_combine_rows: %d rows, top-%d", m, topk);
  launch_combine(y, topk_idx, m, topk, num_experts, dim, nullptr, false, out, stream);
}

void moe_combine_add_rows(const float* y, const int* topk_idx, int m, int topk, int num_experts,
                          int dim, const float* add, bool round_out, float* out,
                          cudaStream_t stream) {
  require(m >= 1 && m <= 65535 && topk <= 8 && add != nullptr,
          "moe_combine_add_rows: %d rows, top-%d, addend %p", m, topk, (const void*)add);
  launch_combine(y, topk_idx, m, topk, num_experts, dim, add, round_out, out, stream);
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
                         cudaStream_t stream, const std::function<void()>& after_w13) const {
  run_experts_impl(w, x, topk_idx, topk_w, swiglu_limit, /*round_w2=*/false, out, row_stride,
                   stream, after_w13);
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
