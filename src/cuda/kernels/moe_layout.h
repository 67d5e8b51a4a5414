#pragma once
// The decode MoE's persistent kernels' shared-memory plans (kernels/moe_fp4.cu), in plain C++:
// the kernels, MoeFp4's launch code and a host test (tests/cuda/host/test_moe_layout.cpp) read
// the same numbers. What the test guards: at 7 rows (a DSpark verify step) a w2 CTA with h
// pre-converted fits on an SM beside a w13 CTA, so it starts during the w13 kernel's tail and
// prefetches its weights (~100 us a step on the H200 when it did not: docs/perf.md sessions 10
// and 18), with a few hundred bytes to spare at the real dimensions.
//
// Build-time knobs (benchmarks; the outputs never depend on them): UF_MOE_W13_WARPS,
// UF_MOE_W13_STAGES, UF_MOE_W2_STAGES (scripts/build-variant).
#include <algorithm>
#include <cstdint>

#include "cuda/gemv.h"  // kMaxDecodeRows

#if defined(__CUDACC__)
#define UF_MOE_HD __host__ __device__
#else
#define UF_MOE_HD
#endif

namespace uf::cuda::detail {

constexpr int kMaxPairs = 64;

// The routing plan of one MoE call: the distinct experts of the P (row, expert) pairs ranked by
// expert id, each with its columns (rows in ascending order). moe_plan.cuh builds it.
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
constexpr int kPlanBytes = int((sizeof(MoePlan) + 127) / 128 * 128);
// Static shared memory of the kernels that build the plan (build_plan's two int arrays).
constexpr int kBuildPlanStaticBytes = 2 * kMaxPairs * 4;

// ---- the persistent w13 kernel ----
#ifndef UF_MOE_W13_WARPS
#define UF_MOE_W13_WARPS 16
#endif
constexpr int kW13Warps = UF_MOE_W13_WARPS;
static_assert(kW13Warps >= 2 && 16 % kW13Warps == 0, "w13 CTAs of 2, 4, 8 or 16 warps");
constexpr int kW13CtasPerSm = 16 / kW13Warps;  // the grid: 16 warps an SM
// Ring depths (chunks a warp has in flight). w13: 2 since its input moved to shared memory
// (session 18, 7-row step at 8k: 6638-6652 us before, 6427-6459 with 2, 6547-6550 with 3, whose
// CTA leaves no room for a w2 CTA).
#ifndef UF_MOE_W13_STAGES
#define UF_MOE_W13_STAGES 2
#endif
#ifndef UF_MOE_W2_STAGES
#define UF_MOE_W2_STAGES 3
#endif
constexpr int kW13Stages = UF_MOE_W13_STAGES;
constexpr int kW13RowStride = 144;  // 128 B of a row + 16: conflict-free 4-byte fragment reads
constexpr int kW13ScaleOff = 16 * kW13RowStride;
constexpr int kW13StageBytes = kW13ScaleOff + 16 * 8;
// A chunk's weight scales as fp32 [16 rows][8] per warp (LDS.128 reads: a quarter warp = rows g,
// g + 1, distinct banks).
constexpr int kW13SwStride = 8;
constexpr int kW13SwBytes = 16 * kW13SwStride * 4;
constexpr int kW13SwOff = kPlanBytes + kW13Warps * kW13Stages * kW13StageBytes;
// The CTA's copy of the input (after the warps' regions): the scales times 2^6 [8][dim / 32 + 4]
// fp32 (room for 8 rows, so the codes' offset depends on dim only; rows 16 bytes apart mod 128:
// the 16-byte reads of 4 tokens in a quarter-warp hit distinct banks), then the FP8 codes
// [m][dim + 32] (rows 32 bytes apart mod 128: the 8-byte fragment reads of 4 tokens x 4 lanes in a
// half-warp hit distinct banks). A chunk's activations are then shared-memory reads: read from
// global memory, their L2 latency was the kernel's largest stall (ncu source counters, session
// 18: ~13% of the warps' samples on the first use of a scale).
constexpr int kW13ActOff = kW13SwOff + kW13Warps * kW13SwBytes;
UF_MOE_HD constexpr int w13_code_stride(int dim) { return dim + 32; }
UF_MOE_HD constexpr int w13_scale_stride(int dim) { return dim / 32 + 4; }
UF_MOE_HD constexpr int w13_codes_off(int dim) {
  return kW13ActOff + kMaxDecodeRows * w13_scale_stride(dim) * 4;
}
// The persistent w13 kernel's dynamic shared memory for m input rows.
UF_MOE_HD constexpr int w13_smem(int m, int dim) {
  return w13_codes_off(dim) + m * w13_code_stride(dim);
}

// ---- the persistent w2 kernel ----
constexpr int kW2Warps = 8;
constexpr int kW2Stages = UF_MOE_W2_STAGES;
constexpr int kW2CtasPerSm = 2;

struct W2Layout {
  int rs, stage_sc, stage_bytes, h_off, hs_off, stage_off, sws, sw_off, total;
};
// f16 (moe_w2_kernel<true, true>): h is held as the mma's f16 B operands (2 bytes an element).
UF_MOE_HD constexpr W2Layout w2_layout(int inter, int pairs, bool f16) {
  W2Layout l{};
  const int nkb = inter / 32;
  // Row stride = 16 mod 32 bytes: the 8 rows g of a 4-byte fragment read hit distinct banks.
  l.rs = inter / 2 + ((inter / 2) % 32 == 0 ? 16 : 0);
  l.stage_sc = 16 * l.rs;
  l.stage_bytes = (l.stage_sc + 16 * nkb + 15) / 16 * 16;
  l.h_off = kPlanBytes;
  l.hs_off = l.h_off + (pairs * inter * (f16 ? 2 : 1) + 15) / 16 * 16;
  l.stage_off = l.hs_off + (pairs * nkb * 4 + 15) / 16 * 16;
  l.sws = nkb | 1;  // odd: the 8 rows g of a scale read hit distinct banks
  l.sw_off = l.stage_off + kW2Warps * kW2Stages * l.stage_bytes;
  l.total = l.sw_off + kW2Warps * 16 * l.sws * 4;  // + per warp: the unit's fp32 weight scales
  return l;
}

// ---- the two side by side ----
// An SM's shared memory as the device reports it (cudaDevAttrMaxSharedMemoryPerMultiprocessor,
// ReservedSharedMemoryPerBlock, MaxSharedMemoryPerBlockOptin).
struct SmShared {
  int per_sm, reserved_per_block, optin;
};
// What a CTA takes of the SM: dynamic + static + the per-block reservation, in 128-byte units.
constexpr int cta_shared_bytes(int dyn, int stat, int reserved) {
  return (dyn + stat + reserved + 127) / 128 * 128;
}
// The most dynamic shared memory a w2 CTA (static w2_static bytes) may take and still fit on an
// SM beside a w13 CTA of m rows (static w13_static bytes); <= 0: none fits.
constexpr int w2_beside_w13(int m, int dim, const SmShared& sm, int w13_static, int w2_static) {
  return std::min(
      sm.optin, sm.per_sm - cta_shared_bytes(w13_smem(m, dim), w13_static, sm.reserved_per_block) -
                    w2_static - sm.reserved_per_block - 127);
}

}  // namespace uf::cuda::detail
