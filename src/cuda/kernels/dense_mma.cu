// Tensor-core dense GEMV for decode rows (kernels/dense_mma.h states the contract and the sum
// order).
//
// Tiling
//   One warp = one 16-row weight tile x 8 token columns (tokens >= m are zero), one mma.sync
//   m16n8k16 (bf16 x bf16 -> fp32) per 16-wide K slice: the weights are the A operand ("swap AB",
//   as Fp8Gemv). K goes in chunks of 64: per chunk a thread (g = lane / 4, tg = lane % 4) holds
//   16 weights of rows g and g + 8 in two halves of 8: BF16 elements [8 tg, +8) and
//   [32 + 8 tg, +8) (two 16-byte loads a row; a warp instruction reads 64 contiguous bytes of each
//   of 8 rows); FP8 elements [16 tg, +16) (one 16-byte load a row), converted in registers:
//   e4m3 -> f16 -> f32 (exact), times the E8M0 scale (exact: a power of two), -> bf16 (exact: 4
//   significant bits; only |w| < 2^-130 would round, which no checkpoint scale reaches).
//   K mapping (A and B alike): element i < 4 of quarter j (j = 0..3; quarters 0, 1 = half 0) of
//   the thread's 16 is mma j's fragment K position 2 tg + i (i < 2) or 8 + 2 tg + (i - 2).
//   x of the CTA's K range is staged once per CTA in shared memory as bf16, laid out as the
//   fragments read it: [chunk][half][token][tg][8 values], so a warp's 16-byte reads cover 512
//   contiguous bytes (conflict free). Staging checks that each value is bf16-exact (else NaN).
//   A warp's tiles and chunks are one flat sequence of steps (one chunk a step), loaded ahead
//   across tile boundaries:
//   BF16 (dense_mma_kernel<false, R>): a per-warp shared-memory ring of R stages (one chunk, 16
//     rows x 128 bytes = 2 KB, a stage), filled by cp.async.cg (L2 only; one warp instruction
//     copies 4 whole 128-byte row lines; rows >= n zero-filled), one commit group a step. Step s:
//     wait until chunk s landed (cp.async.wait_group R - 2, then __syncwarp for the other lanes'
//     pieces and to end every lane's reads of step s - 1's stage), issue chunk s + R - 1 into that
//     stage, compute chunk s. So R - 1 chunks are always in flight while one computes; the first
//     R - 1 go out before griddepcontrol.wait. Rows in a stage are 128 bytes with piece c of row
//     r at slot c ^ 4 (r & 1): the fragment reads (lanes of rows g, g + 1 reading pieces tg or
//     4 + tg) are bank-conflict free. R = 5: the TP8 head slice [16160, 5120] runs 127 CTAs (one
//     an SM) of 80 KB x + 8 x 10 KB rings = 160 KB, 64 KB of weights in flight an SM at all
//     times (before: 80 KB, x only, and the register double buffer, 4 to 8 KB a warp): 132 ->
//     46 us in the 7-row step on the H200 (session 9). 9 stages (224 KB) and bulk L2 prefetches
//     ahead of the ring were measured no faster in the step and were dropped.
//   FP8: 16-byte ld.global.nc (no L1 allocation), a group of 8 a thread (4 chunks, 4 KB a warp)
//     issued one group ahead of the mma work (register double buffer).
//   Either way each chunk is the same 4 mma (mma_chunk) on the same fragment values, acc from 0
//   at each part start, parts folded in part order: the loads' path does not touch the sums.
//
// Configurations (host, run()), S = splits(n) from (tiles = ceil(n / 16), K, SM count) only:
//   full K (S == 1, or any S with m > 8): CTAs of 8 warps, x [<= 8, K] staged once, each warp
//     loops over tiles blockIdx.x * 8 + warp + i * (8 * gridDim.x); the grid is capped at one
//     wave of resident CTAs; blockIdx.z = chunk of 8 token rows. With S > 1 the warp sums the
//     parts itself: acc restarts at each part boundary and total = ((P0 + P1) + ...) -- the
//     split-K order below, so rows of a > 8-row call are bitwise those of a <= 8-row call.
//   prefill (m > 8, set_dense_mma_prefill(true), the default): dense_mma_prefill_kernel, the
//     full-K work of 4 token chunks (32 rows) a CTA of 8 tiles, each weight fragment loaded and
//     converted once for all of them (bitwise the full-K kernel: see the kernel's comment).
//   split K (S > 1, m <= 8): CTAs of 2 warps, blockIdx.y = part; each warp publishes its tile's
//     fp32 part to the workspace; the last warp to finish a tile (an integer counter, no float
//     atomics) adds the S parts in part order P0 + P1 + ... and stores. S doubles while tiles x S
//     < 3 x SMs (so the router [384, 5120] and wo_a [1024, 4096] fill every SM), keeping >= 2
//     chunks a part.
//
// Resident kernel (dense_mma_resident_kernel; m <= 8 rows, DenseMmaPath::kAuto, where its plan
// fits; the same S, parts, fragments and part-order sum as above, so bitwise the legacy results):
//   Latency first. A warp owns one (tile, part): 16 rows x kp weights. A CTA holds TG tiles x PC
//   consecutive parts (TG x PC <= 8 warps); a thread-block cluster of C = S / PC CTAs holds all S
//   parts of its TG tiles. Each warp copies its whole weight slice into shared memory with
//   cp.async (16-byte pieces, kResGroups commit groups = chunk ranges in K order) and its FP8
//   scales (16 rows x kp / 32 bytes) before griddepcontrol.wait (weights never depend on the
//   previous kernel: under PDL the copies overlap its tail); launch_dependents follows. After the
//   wait the CTA stages x of its PC parts (stage_x: the legacy layout and bf16-exactness check),
//   then each warp runs its part's chunks as their groups land (mma_chunk: the legacy fragments),
//   acc from 0. The cluster's threads then finish the outputs (TG x 128 on S x TG x 32 threads:
//   4 / S a thread for S <= 4, else one on part of them): parts 0..S-1 added in part order, bf16
//   rounding. C > 1: each warp pushes its 16 x 8 part (st.async, 16 bytes a lane) into the
//   receive region of the CTA whose threads finish those outputs, where an mbarrier (initialised
//   before the PDL wait, published by a cluster barrier arrived at there and waited for before
//   the first push) counts the bytes; no barrier after, and a CTA with no outputs leaves after
//   its pushes. C = 1: a plain launch; the parts go through a shared stash and a block barrier.
//   No global workspace, no counters, no second wave.
//   Plan (res_plan, from tiles, K, S, SM count): C = the first of 8, 4, 2, 1 dividing S with
//   PC = S / C <= 8, TG = the fewest tiles a CTA that keep the grid within one CTA an SM, shared
//   memory <= 100 KB (weights rows padded to 64 mod 128 bytes: conflict-free 16-byte fragment
//   reads; x PC x kp x 16 bytes; stash 512 bytes a warp; C > 1: the receive region, S x
//   ceil(4 / S) x 4 bytes a thread) so the next kernel's CTAs co-reside.
//   TP8 rank on 132 SMs: wo_a [1024, 4096] FP8, S = 8: C = 8, PC = 1, TG = 4, 128 CTAs of 4 warps,
//   47 KB each (37 KB weights); router [384, 5120] BF16, S = 16: C = 8, PC = 2, TG = 2, 96 CTAs.
//
// Why: dense_rows (ops/linear.cu) spends 8 fp32 FMAs per weight element at 8 rows (the head
// [129280, 5120] bf16 ran at ~1.2 TB/s); here one mma covers 16 x 8 x 16 products and the
// issue slots go to the loads.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cuda/cuda_check.h"
#include "cuda/gemv.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/dense_mma.h"
#include "cuda/kernels/l2_window.h"
#include "cuda/kernels/probe.cuh"

namespace uf::cuda {
namespace {

using namespace detail;
using model::WFormat;

constexpr int kChunkK = 64;                             // K per chunk
constexpr int kFullWarps = 8;                           // warps per CTA, full-K configuration
constexpr int kSplitWarps = 2;                          // warps per CTA, split-K configuration
constexpr int kMaxSmem = int(DenseMma::kMaxCols) * 16;  // 8 token rows x K bf16
constexpr int kRows = kMaxDecodeRows;                   // token rows per mma (B columns)
// >= 4 chunks a tile: at most one tile ends inside a load group (kG <= 4 chunks), which the
// epilogue stash relies on.
constexpr int64_t kMinCols = 4 * kChunkK;
// BF16 weight ring of dense_mma_kernel<false, R>: per warp R stages of one chunk (16 rows x 128
// bytes), R - 1 chunks in flight while one computes.
constexpr int kRingStages = 5;
constexpr int kRingStageBytes = 16 * kChunkK * 2;  // 2 KB
constexpr size_t kSmemOptin = 227 * 1024;          // sm_90 / sm_100 per-CTA opt-in maximum

int ring_stages(size_t, int) { return kRingStages; }

// Dynamic shared memory of dense_mma_kernel: staged x (x_bytes: the CTA's K range x 8 rows bf16),
// then (BF16) the warps' weight rings.
size_t full_smem(size_t x_bytes, int warps, bool fp8) {
  return x_bytes +
         (fp8 ? 0 : size_t(warps) * size_t(ring_stages(x_bytes, warps)) * kRingStageBytes);
}

struct Args {
  const uint8_t* w;      // weight row r0 (row 0 of the call)
  const uint8_t* scale;  // FP8: the weight's scale array (absolute rows), else null
  int64_t r0;
  int n, K, scale_cols, row_scale;
  const float* x;
  int64_t x_stride;
  int m;  // token rows of the launch (chunks of 8 on blockIdx.z)
  float* y;
  int64_t y_stride;
  int round;
  int tiles;      // ceil(n / 16)
  int kp;         // K of one part (a multiple of 64)
  int cta_parts;  // parts one CTA covers: S (full K) or 1 (split K, part = blockIdx.y)
  int splits;     // S
  int x_vec;      // x 16-byte aligned with x_stride % 4 == 0: float4 staging loads
  float* partials;
  int* counters;
};

__device__ __forceinline__ uint4 ld_stream_u4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16 bytes global -> shared (L2 only); bytes = 0: the 16 bytes are zero-filled, nothing is read.
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

// Two e4m3 codes (low byte = lower K) times scale s, as bf16x2: exact (see the header comment).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two, float s) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  return bf16x2_bits(__floats2bfloat162_rn(__fmul_rn(f.x, s), __fmul_rn(f.y, s)));
}

// Two fp32 x values as bf16x2; a value that is not bf16-exact becomes NaN (never rounded).
__device__ __forceinline__ uint32_t pack_exact_bf16x2(float a, float b) {
  uint32_t u = bf16x2_bits(__floats2bfloat162_rn(a, b));
  if (__uint_as_float(u << 16) != a && a == a) u = (u & 0xffff0000u) | 0x7fc0u;
  if (__uint_as_float(u & 0xffff0000u) != b && b == b) u = (u & 0x0000ffffu) | 0x7fc00000u;
  return u;
}

__device__ __forceinline__ float fp8_scale(const Args& p, int row, int k) {
  const int64_t sr = p.row_scale ? p.r0 + row : (p.r0 + row) / 32;
  return e8m0_to_f32(__ldg(p.scale + sr * p.scale_cols + k / 32));
}

// Stages x[token r < m, K [kbeg, kbeg + 8 nq)] (rows >= m: zeros) as bf16 in shared memory, in
// the fragment layout [chunk][half][token][tg][8 values] (512 contiguous bytes a warp read). Item
// (token r, 8-group q); kStageBatch items a thread per round, all loads first (several L2 round
// trips in flight). A value that is not bf16-exact becomes NaN (pack_exact_bf16x2).
template <bool kFp8>
__device__ __forceinline__ void stage_x(uint8_t* xs, const float* x, int64_t x_stride, int m,
                                        int x_vec, int kbeg, int nq) {
  constexpr int kStageBatch = 4;
  const int items = kRows * nq, nt = int(blockDim.x);
  for (int i0 = int(threadIdx.x); i0 < items; i0 += kStageBatch * nt) {
    float f[kStageBatch][8];
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int i = i0 + b * nt, r = i / nq, q = i - r * nq;
      if (i < items && r < m) {
        const float* src = x + int64_t(r) * x_stride + kbeg + q * 8;
        if (x_vec) {
          const float4 a = __ldg(reinterpret_cast<const float4*>(src));
          const float4 c = __ldg(reinterpret_cast<const float4*>(src) + 1);
          f[b][0] = a.x, f[b][1] = a.y, f[b][2] = a.z, f[b][3] = a.w;
          f[b][4] = c.x, f[b][5] = c.y, f[b][6] = c.z, f[b][7] = c.w;
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) f[b][e] = __ldg(src + e);
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int i = i0 + b * nt, r = i / nq, q = i - r * nq;
      if (i < items) {
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < m)
          v = make_uint4(pack_exact_bf16x2(f[b][0], f[b][1]), pack_exact_bf16x2(f[b][2], f[b][3]),
                         pack_exact_bf16x2(f[b][4], f[b][5]), pack_exact_bf16x2(f[b][6], f[b][7]));
        // 8-group q of chunk c = q / 8 is (tg, half) = FP8: (q / 2 % 4, q % 2), elements
        // 16 tg + 8 h; BF16: (q % 4, q / 4 % 2), elements 8 tg + 32 h (the weight loads').
        const int c = q >> 3;
        const int tq = kFp8 ? (q >> 1) & 3 : q & 3, h = kFp8 ? q & 1 : (q >> 2) & 1;
        *reinterpret_cast<uint4*>(xs + ((((c * 2 + h) * kRows + r) * 4 + tq) * 16)) = v;
      }
    }
  }
}

// One 64-wide K chunk of a tile into acc: 4 mma in the fixed fragment order (the sum order of
// the header). buf: the thread's weight pieces of the chunk (FP8: row g, row g + 8, 16 codes
// each, scales sa / sb; BF16: row g at 8 tg and 32 + 8 tg, then row g + 8 the same); xv: the
// thread's two 16-byte pieces of the staged x chunk (chunk_x).
template <bool kFp8>
__device__ __forceinline__ void mma_chunk(float (&acc)[4], const uint4 (&buf)[kFp8 ? 2 : 4],
                                          float sa, float sb, const uint4 (&xv)[2]) {
  uint32_t wa[8], wb[8];
  if constexpr (kFp8) {
    const uint32_t ca[4] = {buf[0].x, buf[0].y, buf[0].z, buf[0].w};
    const uint32_t cb[4] = {buf[1].x, buf[1].y, buf[1].z, buf[1].w};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      wa[e] = e4m3x2_to_bf16x2(ca[e >> 1] >> (16 * (e & 1)), sa);
      wb[e] = e4m3x2_to_bf16x2(cb[e >> 1] >> (16 * (e & 1)), sb);
    }
  } else {
    wa[0] = buf[0].x, wa[1] = buf[0].y, wa[2] = buf[0].z, wa[3] = buf[0].w;
    wa[4] = buf[1].x, wa[5] = buf[1].y, wa[6] = buf[1].z, wa[7] = buf[1].w;
    wb[0] = buf[2].x, wb[1] = buf[2].y, wb[2] = buf[2].z, wb[3] = buf[2].w;
    wb[4] = buf[3].x, wb[5] = buf[3].y, wb[6] = buf[3].z, wb[7] = buf[3].w;
  }
  const uint32_t xw[8] = {xv[0].x, xv[0].y, xv[0].z, xv[0].w, xv[1].x, xv[1].y, xv[1].z, xv[1].w};
#pragma unroll
  for (int j = 0; j < 4; ++j)
    mma_bf16(acc, wa[2 * j], wb[2 * j], wa[2 * j + 1], wb[2 * j + 1], xw[2 * j], xw[2 * j + 1]);
}

// The B pieces of chunk cc of the staged x (xs) for lane (g, tg): half 0, then half 1.
__device__ __forceinline__ void chunk_x(uint4 (&xv)[2], const uint8_t* xs, int cc, int g, int tg) {
  const uint8_t* xp = xs + ((cc * 2 * kRows + g) * 4 + tg) * 16;
  xv[0] = *reinterpret_cast<const uint4*>(xp);
  xv[1] = *reinterpret_cast<const uint4*>(xp + kRows * 64);
}

template <bool kFp8, int kStages>
__global__ void __launch_bounds__(kFullWarps * 32, 2) dense_mma_kernel(const Args p) {
  static_assert(kStages >= 3, "the ring needs a stage computing and two in flight");
  constexpr int kRingWarpBytes = kStages * kRingStageBytes;
  extern __shared__ __align__(16) uint8_t xs[];
  pdl_trigger();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const int g = lane >> 2, tg = lane & 3;
  const int nckp = p.kp / kChunkK;                        // chunks per part
  const int nck = nckp * p.cta_parts;                     // chunks per tile in this CTA
  const int kbeg = int(blockIdx.y) * p.cta_parts * p.kp;  // the CTA's first K
  const int zc = int(blockIdx.z);
  const int m = min(p.m - zc * kRows, kRows);
  const float* x = p.x + int64_t(zc) * kRows * p.x_stride;
  float* y = p.y + int64_t(zc) * kRows * p.y_stride;

  // This warp's tiles: tile0, tile0 + G, ...; chunks of all its tiles are one flat sequence.
  const int G = int(gridDim.x) * nw;
  const int tile0 = int(blockIdx.x) * nw + warp;
  const int ntile = tile0 < p.tiles ? (p.tiles - 1 - tile0) / G + 1 : 0;
  const int steps = ntile * nck;

  constexpr int kG = 4;             // FP8: chunks per register load group (8 x 16-byte loads)
  constexpr int kL = kFp8 ? 2 : 4;  // 16-byte pieces a thread per chunk

  int lpos = 0, lt = tile0, lc = 0;  // load cursor
  // FP8: the next kG chunks into registers.
  auto load_group = [&](uint4(&buf)[kG][kL], float(&sc)[kG][2]) {
#pragma unroll
    for (int i = 0; i < kG; ++i) {
      if (lpos < steps) {
        const int ra = lt * 16 + g, rb = ra + 8;
        const bool va = ra < p.n, vb = rb < p.n;
        const uint4 z = make_uint4(0u, 0u, 0u, 0u);
        const int k = kbeg + lc * kChunkK + tg * 16;
        const uint8_t* pa = p.w + int64_t(ra) * p.K + k;
        buf[i][0] = va ? ld_stream_u4(pa) : z;
        buf[i][1] = vb ? ld_stream_u4(pa + 8 * int64_t(p.K)) : z;
        sc[i][0] = va ? fp8_scale(p, ra, k) : 1.f;
        sc[i][1] = vb ? fp8_scale(p, rb, k) : 1.f;
        ++lpos;
        if (++lc == nck) lc = 0, lt += G;
      }
    }
  };

  // BF16: the warp's ring (kStages stages of one chunk, 16 rows x 128 bytes, after x). Chunk
  // row r's 16-byte piece c (elements 8 c .. 8 c + 7) sits at r * 128 + (c ^ 4 (r & 1)) * 16: the
  // fragment reads (row g, piece tg or 4 + tg; 8 lanes = rows g, g + 1) hit distinct banks.
  uint8_t* ring = xs + size_t(p.cta_parts) * size_t(p.kp) * 16 + size_t(warp) * kRingWarpBytes;
  // The next chunk (lpos) into ring stage st, one commit group (empty once the chunks run out,
  // so that every step commits exactly one group). One instruction copies 4 whole 128-byte row
  // lines (lane: row 4 j + lane / 8, piece lane % 8); rows >= n are zero-filled.
  const int lrow = lane >> 3, lpiece = lane & 7;  // the lane's row (+ 4 j) and piece
  const int64_t row_bytes = int64_t(p.K) * 2;
  const uint8_t* wlane = p.w + lrow * row_bytes + int64_t(kbeg) * 2 + lpiece * 16;
  const uint32_t ring_lane =
      uint32_t(__cvta_generic_to_shared(ring)) + lrow * 128 + ((lpiece ^ ((lrow & 1) << 2)) << 4);
  auto ring_issue = [&](int st) {
    if (lpos < steps) {
      const uint8_t* src = wlane + int64_t(lt) * 16 * row_bytes + lc * (kChunkK * 2);
      const int nv = p.n - lt * 16 - lrow;  // row 4 j + lrow is valid while 4 j < nv
      const uint32_t dst = ring_lane + st * kRingStageBytes;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool v = 4 * j < nv;
        cp_async16_zfill(dst + j * 512, v ? src + 4 * j * row_bytes : p.w, v ? 16 : 0);
      }
      ++lpos;
      if (++lc == nck) lc = 0, lt += G;
    }
    cp_async_commit();
  };

  // Weights do not depend on the previous kernel: they go out before the PDL wait (FP8: the
  // first register group; BF16: the first kStages - 1 chunks).
  uint4 bufA[kG][kL], bufB[kG][kL];
  float scA[kG][2], scB[kG][2];
  if constexpr (kFp8) {
    load_group(bufA, scA);
  } else {
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) ring_issue(st);
  }
  pdl_wait();

  // Stage x[chunk rows, CTA K range] as bf16: item (token r, 8-group q) -> fragment layout.
  // kStageBatch items a thread per round, all loads first (several L2 round trips in flight;
  // BF16: 8, three rounds for 8 rows of K = 5120 instead of five).
  {
    constexpr int kStageBatch = kFp8 ? 4 : 8;
    const int nq = p.cta_parts * p.kp / 8, items = kRows * nq, nt = int(blockDim.x);
    for (int i0 = int(threadIdx.x); i0 < items; i0 += kStageBatch * nt) {
      float f[kStageBatch][8];
#pragma unroll
      for (int b = 0; b < kStageBatch; ++b) {
        const int i = i0 + b * nt, r = i / nq, q = i - r * nq;
        if (i < items && r < m) {
          const float* src = x + int64_t(r) * p.x_stride + kbeg + q * 8;
          if (p.x_vec) {
            const float4 a = __ldg(reinterpret_cast<const float4*>(src));
            const float4 c = __ldg(reinterpret_cast<const float4*>(src) + 1);
            f[b][0] = a.x, f[b][1] = a.y, f[b][2] = a.z, f[b][3] = a.w;
            f[b][4] = c.x, f[b][5] = c.y, f[b][6] = c.z, f[b][7] = c.w;
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) f[b][e] = __ldg(src + e);
          }
        }
      }
#pragma unroll
      for (int b = 0; b < kStageBatch; ++b) {
        const int i = i0 + b * nt, r = i / nq, q = i - r * nq;
        if (i < items) {
          uint4 v = make_uint4(0u, 0u, 0u, 0u);
          if (r < m)
            v = make_uint4(pack_exact_bf16x2(f[b][0], f[b][1]), pack_exact_bf16x2(f[b][2], f[b][3]),
                           pack_exact_bf16x2(f[b][4], f[b][5]),
                           pack_exact_bf16x2(f[b][6], f[b][7]));
          // 8-group q of chunk c = q / 8 is (tg, half) = FP8: (q / 2 % 4, q % 2), elements
          // 16 tg + 8 h; BF16: (q % 4, q / 4 % 2), elements 8 tg + 32 h (the weight loads').
          const int c = q >> 3;
          const int tq = kFp8 ? (q >> 1) & 3 : q & 3, h = kFp8 ? q & 1 : (q >> 2) & 1;
          *reinterpret_cast<uint4*>(xs + ((((c * 2 + h) * kRows + r) * 4 + tq) * 16)) = v;
        }
      }
    }
  }
  __syncthreads();

  auto store = [&](int tile, const float(&v)[4]) {
    const int ra = tile * 16 + g, rb = ra + 8, t0 = 2 * tg, t1 = t0 + 1;
    auto post = [&](float a) { return p.round ? round_bf16(a) : a; };
    if (t0 < m) {
      if (ra < p.n) y[int64_t(t0) * p.y_stride + ra] = post(v[0]);
      if (rb < p.n) y[int64_t(t0) * p.y_stride + rb] = post(v[2]);
    }
    if (t1 < m) {
      if (ra < p.n) y[int64_t(t1) * p.y_stride + ra] = post(v[1]);
      if (rb < p.n) y[int64_t(t1) * p.y_stride + rb] = post(v[3]);
    }
  };

  // Split K: publish this part of the tile and let the last of its S warps add the parts in
  // part order and store.
  const bool full = p.cta_parts == p.splits;
  auto finish_split = [&](int tile, const float(&v)[4]) {
    const bool used = 2 * tg < m;  // this lane holds tokens 2 tg, 2 tg + 1
    const size_t stride = size_t(p.tiles) * 128;
    const size_t frag = size_t(tile) * 128 + size_t(lane) * 4;
    if (used)
      __stcg(reinterpret_cast<float4*>(p.partials + blockIdx.y * stride + frag),
             make_float4(v[0], v[1], v[2], v[3]));
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(p.counters + tile, 1) == p.splits - 1;
    last = __shfl_sync(0xffffffffu, last, 0);
    if (!last) return;
    __threadfence();
    if (used) {
      const float4 v0 = __ldcg(reinterpret_cast<const float4*>(p.partials + frag));
      float sum[4] = {v0.x, v0.y, v0.z, v0.w};
      constexpr int kBatch = 8;  // loads in flight before the in-order adds
      for (int s = 1; s < p.splits; s += kBatch) {
        float4 q[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i)
          if (s + i < p.splits)
            q[i] = __ldcg(reinterpret_cast<const float4*>(p.partials + (s + i) * stride + frag));
#pragma unroll
        for (int i = 0; i < kBatch; ++i)
          if (s + i < p.splits) {
            sum[0] = __fadd_rn(sum[0], q[i].x);
            sum[1] = __fadd_rn(sum[1], q[i].y);
            sum[2] = __fadd_rn(sum[2], q[i].z);
            sum[3] = __fadd_rn(sum[3], q[i].w);
          }
      }
      store(tile, sum);
    }
    __syncwarp();
    if (lane == 0) p.counters[tile] = 0;  // ready for the next launch
  };

  int cpos = 0, ct = tile0, cc = 0, pc = 0;  // compute cursor; pc: chunk within the part
  bool first_part = true;
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, tot[4] = {0.f, 0.f, 0.f, 0.f}, done[4];
  int done_tile = -1;
  // One chunk (step cpos): 4 mma in the fixed fragment order into acc (mma_chunk), then the part
  // and tile bookkeeping. buf: the thread's pieces (FP8: row g, row g + 8; BF16: row g at 8 tg
  // and 32 + 8 tg, then row g + 8 the same), sa / sb: FP8 scales.
  auto consume = [&](const uint4(&buf)[kL], float sa, float sb) {
    uint4 xv[2];
    chunk_x(xv, xs, cc, g, tg);
    mma_chunk<kFp8>(acc, buf, sa, sb, xv);
    ++cpos;
    if (++pc == nckp) {  // a part is complete: fold it into the total, in part order
      pc = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        tot[e] = first_part ? acc[e] : __fadd_rn(tot[e], acc[e]);
        acc[e] = 0.f;
      }
      first_part = false;
    }
    if (++cc == nck) {  // the tile's K range is complete: finished after the group / chunk
#pragma unroll
      for (int e = 0; e < 4; ++e) done[e] = tot[e];
      done_tile = ct;
      cc = 0;
      ct += G;
      first_part = true;
    }
  };
  auto compute_group = [&](const uint4(&buf)[kG][kL], const float(&sc)[kG][2]) {
#pragma unroll
    for (int i = 0; i < kG; ++i)
      if (cpos < steps) consume(buf[i], sc[i][0], sc[i][1]);
    // Full K: at most one tile ends per group (nck >= kG): one copy of the store per group
    // instead of one per chunk. Split K: a warp has at most one tile; its epilogue runs after the
    // loop, when the weight buffers are dead (its batched partial loads need the registers).
    if (full && done_tile >= 0) {
      store(done_tile, done);
      done_tile = -1;
    }
  };

  if constexpr (kFp8) {
    while (cpos < steps) {  // warp-uniform
      load_group(bufB, scB);
      compute_group(bufA, scA);
      if (cpos >= steps) break;
      load_group(bufA, scA);
      compute_group(bufB, scB);
    }
  } else {
    // Step s: chunk s has landed (this lane's pieces: the groups of steps > s may be pending;
    // every lane's after the warp barrier, which also ends every lane's reads of step s - 1's
    // stage); chunk s + kStages - 1 goes into that stage; then chunk s computes.
    int st = 0;             // ring stage of step cpos
    while (cpos < steps) {  // warp-uniform
      cp_async_wait<kStages - 2>();
      __syncwarp();
      ring_issue(st == 0 ? kStages - 1 : st - 1);
      const uint8_t* sp = ring + st * kRingStageBytes + g * 128;
      const int c0 = (tg ^ ((g & 1) << 2)) << 4, c1 = c0 ^ 64;  // pieces tg, 4 + tg
      const uint4 buf[kL] = {*reinterpret_cast<const uint4*>(sp + c0),
                             *reinterpret_cast<const uint4*>(sp + c1),
                             *reinterpret_cast<const uint4*>(sp + 8 * 128 + c0),
                             *reinterpret_cast<const uint4*>(sp + 8 * 128 + c1)};
      consume(buf, 1.f, 1.f);
      if (full && done_tile >= 0) {
        store(done_tile, done);
        done_tile = -1;
      }
      st = st + 1 == kStages ? 0 : st + 1;
    }
  }
  if (done_tile >= 0) finish_split(done_tile, done);
}

// ---- Prefill kernel (m > 8 rows; set_dense_mma_prefill) ----
//
// The full-K configuration's work for kPreChunks chunks of 8 token rows at once: warp w of CTA
// (bx, by) owns tile bx * 8 + w and token chunks by * kPreChunks + z (z < kPreChunks). Each
// 64-wide K chunk's weight fragments are loaded and converted ONCE (the legacy code: the same
// loads, scales, e4m3 -> bf16 conversion), then applied to every token chunk z: the same 4 mma
// (the same A registers, B = chunk z's x fragment in the legacy staging layout, acc of chunk z),
// the same part boundaries (acc restarts) and the same part-order total. So every output is the
// legacy full-K kernel's (and the decode kernels') value bit for bit; only the reuse differs.
// x goes in windows of kPreWin K: the CTA's 32 rows of window w + 1 are copied raw (fp32,
// cp.async) into shared memory while window w computes; at the window's start they are packed
// into the legacy bf16 fragment layout (pack_exact_bf16x2: the same values, the same NaN rule;
// rows >= m zeros). The weights of the next K chunk are loaded (registers) while the current one
// computes, across windows.
constexpr int kPreChunks = 4;  // 8-row token chunks a CTA (32 rows)
constexpr int kPreTok = kPreChunks * kRows;
constexpr int kPreWarps = 8;  // tiles a CTA
constexpr int kPreWin = 256;  // K of one staged x window
constexpr int kPreWinChunks = kPreWin / kChunkK;
constexpr int kPreXBytes = kRows * kPreWin * 2;                   // a token chunk's bf16 window
constexpr int kPreRawBytes = kPreTok * kPreWin * 4;               // the CTA's fp32 window
constexpr int kPreSmem = kPreRawBytes + kPreChunks * kPreXBytes;  // 48 KB

__device__ __forceinline__ void pre_cp_async(void* dst, const void* src, int bytes16) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
  if (bytes16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}

template <bool kFp8>
__global__ void __launch_bounds__(kPreWarps * 32, 2) dense_mma_prefill_kernel(const Args p) {
  extern __shared__ __align__(16) uint8_t psm[];
  float* raw = reinterpret_cast<float*>(psm);  // [kPreTok][kPreWin] fp32
  uint8_t* xsb = psm + kPreRawBytes;           // [kPreChunks][kPreXBytes] bf16 fragments
  pdl_trigger();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
  const int nt = int(blockDim.x);
  const int g = lane >> 2, tg = lane & 3;
  const int nckp = p.kp / kChunkK, nck = p.K / kChunkK;
  const int tile = int(blockIdx.x) * kPreWarps + warp;  // warp-uniform; >= tiles: zeros, no store
  const int ra = tile * 16 + g, rb = ra + 8;
  const bool va = ra < p.n, vb = rb < p.n;
  const int zc0 = int(blockIdx.y) * kPreChunks;       // the CTA's first 8-row token chunk
  const int mrows = min(p.m - zc0 * kRows, kPreTok);  // the CTA's valid token rows (> 0)
  const float* xb = p.x + int64_t(zc0) * kRows * p.x_stride;
  constexpr int kL = kFp8 ? 2 : 4;  // 16-byte loads per chunk

  // Raw copy of window [kbeg, kbeg + kPreWin) of the CTA's valid rows (one commit group).
  auto prefetch = [&](int kbeg) {
    const int nk = min(kPreWin, p.K - kbeg);
    const int vw = p.x_vec ? 4 : 1, per = nk / vw, items = mrows * per;
    for (int i = tid; i < items; i += nt) {
      const int r = i / per, q = (i - r * per) * vw;
      pre_cp_async(raw + r * kPreWin + q, xb + int64_t(r) * p.x_stride + kbeg + q, p.x_vec);
    }
    cp_async_commit();
  };
  // The landed window into the fragment layout of each token chunk (stage_x's layout and values).
  auto convert = [&](int nq) {
    const int items = kPreTok * nq;
    for (int i = tid; i < items; i += nt) {
      const int r = i / nq, q = i - r * nq;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (r < mrows) {
        const float4 a = *reinterpret_cast<const float4*>(raw + r * kPreWin + q * 8);
        const float4 c = *reinterpret_cast<const float4*>(raw + r * kPreWin + q * 8 + 4);
        v = make_uint4(pack_exact_bf16x2(a.x, a.y), pack_exact_bf16x2(a.z, a.w),
                       pack_exact_bf16x2(c.x, c.y), pack_exact_bf16x2(c.z, c.w));
      }
      const int c = q >> 3, z = r >> 3, rr = r & 7;
      const int tq = kFp8 ? (q >> 1) & 3 : q & 3, h = kFp8 ? q & 1 : (q >> 2) & 1;
      *reinterpret_cast<uint4*>(xsb + z * kPreXBytes + (((c * 2 + h) * kRows + rr) * 4 + tq) * 16) =
          v;
    }
  };

  auto load = [&](int kc, uint4(&buf)[kL], float(&sc)[2]) {
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    if constexpr (kFp8) {
      const int k = kc * kChunkK + tg * 16;
      const uint8_t* pa = p.w + int64_t(ra) * p.K + k;
      buf[0] = va ? ld_stream_u4(pa) : z;
      buf[1] = vb ? ld_stream_u4(pa + 8 * int64_t(p.K)) : z;
      sc[0] = va ? fp8_scale(p, ra, k) : 1.f;
      sc[1] = vb ? fp8_scale(p, rb, k) : 1.f;
    } else {
      const int k = kc * kChunkK + tg * 8;
      const uint8_t* pa = p.w + (int64_t(ra) * p.K + k) * 2;
      const uint8_t* pb = pa + 16 * int64_t(p.K);
      buf[0] = va ? ld_stream_u4(pa) : z;
      buf[1] = va ? ld_stream_u4(pa + 64) : z;
      buf[2] = vb ? ld_stream_u4(pb) : z;
      buf[3] = vb ? ld_stream_u4(pb + 64) : z;
      sc[0] = sc[1] = 1.f;
    }
  };

  uint4 cur[kL], nxt[kL];
  float scc[2], scn[2];
  load(0, cur, scc);
  pdl_wait();
  prefetch(0);

  float acc[kPreChunks][4], tot[kPreChunks][4];
#pragma unroll
  for (int z = 0; z < kPreChunks; ++z)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[z][e] = 0.f, tot[z][e] = 0.f;

  for (int kc = 0; kc < nck; ++kc) {
    const int wc = kc % kPreWinChunks;  // chunk within the window
    if (wc == 0) {  // the window's x: landed raw -> fragments; the next window's copy out
      cp_async_wait<0>();
      __syncthreads();  // every thread's copies landed; the previous window's reads are done
      convert(min(kPreWin, p.K - kc * kChunkK) / 8);
      __syncthreads();  // fragments ready; raw free
      if (kc + kPreWinChunks < nck) prefetch((kc + kPreWinChunks) * kChunkK);
    }
    if (kc + 1 < nck) load(kc + 1, nxt, scn);
    uint32_t wa[8], wb[8];
    if constexpr (kFp8) {
      const uint32_t ca[4] = {cur[0].x, cur[0].y, cur[0].z, cur[0].w};
      const uint32_t cb[4] = {cur[1].x, cur[1].y, cur[1].z, cur[1].w};
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        wa[e] = e4m3x2_to_bf16x2(ca[e >> 1] >> (16 * (e & 1)), scc[0]);
        wb[e] = e4m3x2_to_bf16x2(cb[e >> 1] >> (16 * (e & 1)), scc[1]);
      }
    } else {
      wa[0] = cur[0].x, wa[1] = cur[0].y, wa[2] = cur[0].z, wa[3] = cur[0].w;
      wa[4] = cur[1].x, wa[5] = cur[1].y, wa[6] = cur[1].z, wa[7] = cur[1].w;
      wb[0] = cur[2].x, wb[1] = cur[2].y, wb[2] = cur[2].z, wb[3] = cur[2].w;
      wb[4] = cur[3].x, wb[5] = cur[3].y, wb[6] = cur[3].z, wb[7] = cur[3].w;
    }
#pragma unroll
    for (int z = 0; z < kPreChunks; ++z) {
      const uint8_t* xp = xsb + z * kPreXBytes + ((wc * 2 * kRows + g) * 4 + tg) * 16;
      const uint4 x0 = *reinterpret_cast<const uint4*>(xp);
      const uint4 x1 = *reinterpret_cast<const uint4*>(xp + kRows * 64);
      const uint32_t xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        mma_bf16(acc[z], wa[2 * j], wb[2 * j], wa[2 * j + 1], wb[2 * j + 1], xw[2 * j],
                 xw[2 * j + 1]);
    }
    if ((kc + 1) % nckp == 0) {  // a part is complete: fold it into the total, in part order
      const bool first = kc + 1 == nckp;
#pragma unroll
      for (int z = 0; z < kPreChunks; ++z)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          tot[z][e] = first ? acc[z][e] : __fadd_rn(tot[z][e], acc[z][e]);
          acc[z][e] = 0.f;
        }
    }
#pragma unroll
    for (int i = 0; i < kL; ++i) cur[i] = nxt[i];
    scc[0] = scn[0], scc[1] = scn[1];
  }

  if (tile >= p.tiles) return;
  auto post = [&](float a) { return p.round ? round_bf16(a) : a; };
#pragma unroll
  for (int z = 0; z < kPreChunks; ++z) {
    const int t0 = (zc0 + z) * kRows + 2 * tg, t1 = t0 + 1;
    if (t0 < p.m) {
      if (va) p.y[int64_t(t0) * p.y_stride + ra] = post(tot[z][0]);
      if (vb) p.y[int64_t(t0) * p.y_stride + rb] = post(tot[z][2]);
    }
    if (t1 < p.m) {
      if (va) p.y[int64_t(t1) * p.y_stride + ra] = post(tot[z][1]);
      if (vb) p.y[int64_t(t1) * p.y_stride + rb] = post(tot[z][3]);
    }
  }
}

// ---- Resident kernel (m <= 8 rows; kernel comment at the top of the file) ----

constexpr int kResMaxWarps = 8;
constexpr int kResMaxCluster = 8;              // portable cluster size
constexpr size_t kResSmemBudget = 100 * 1024;  // 2 CTAs an SM: the next kernel's CTAs co-reside
constexpr int kResGroups = 4;                  // cp.async groups a warp (chunk ranges, in order)
constexpr int kResBatch = 8;                   // scale-byte loads in flight before the wait
constexpr int kResOuts = 4;         // outputs a thread at most: TG x 128 over S x TG x 32 threads
constexpr int kResRecvHeader = 16;  // the receive mbarrier (8 B), padded

// Outputs a thread finishes (TG x 128 outputs over S x TG x 32 threads: ceil(4 / S)).
__host__ __device__ constexpr int res_outs(int splits) { return (4 + splits - 1) / splits; }
// The receive region after the stash (C > 1): an mbarrier, then [S][outs][threads] fp32 parts of
// the outputs this CTA's threads finish.
__host__ __device__ constexpr int res_recv_bytes(int cluster, int splits, int threads) {
  return cluster > 1 ? kResRecvHeader + splits * res_outs(splits) * threads * 4 : 0;
}

struct ResArgs {
  const uint8_t* w;      // weight row r0 (row 0 of the call)
  const uint8_t* scale;  // FP8: the weight's scale array (absolute rows), else null
  int64_t r0;
  int n, K, scale_cols, row_scale;
  const float* x;
  int64_t x_stride;
  int m;
  float* y;
  int64_t y_stride;
  int round;
  int tiles, kp, splits, x_vec;
  int cluster, tg, pc;  // C CTAs a cluster, TG tiles and PC parts a CTA (warps = TG x PC)
  int row_bytes;        // a warp's shared row (kp weights, padded to 64 mod 128 bytes)
  int warp_bytes;       // 16 rows + FP8 scale bytes [16][kp / 32]
  int x_bytes;          // staged x of the CTA's PC parts: PC x kp x 8 tokens x 2 bytes
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
// Waits for cp.async group j of kResGroups (issued in order): at most kResGroups - 1 - j pending.
__device__ __forceinline__ void wait_group_in_order(int j) {
  static_assert(kResGroups == 4, "the switch below lists the pending counts");
  switch (j) {
    case 0:
      cp_async_wait<3>();
      break;
    case 1:
      cp_async_wait<2>();
      break;
    case 2:
      cp_async_wait<1>();
      break;
    default:
      cp_async_wait<0>();
      break;
  }
}

template <bool kFp8>
__global__ void __launch_bounds__(kResMaxWarps * 32, 2) dense_mma_resident_kernel(const ResArgs p) {
  extern __shared__ __align__(16) uint8_t smem[];
  // Probe points: 0 start, 1 PDL wait returned, 2 x staged, 3 parts pushed (C > 1) or in the
  // stash, 4 every part of this CTA's outputs here, 5 outputs stored.
  UF_PROBE_OPEN(probe, kTagDenseMmaResident);
  UF_PROBE_MARK(probe, 0);
  constexpr int kEb = kFp8 ? 1 : 2;  // bytes a weight
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const int g = lane >> 2, tg = lane & 3;
  const int rank = int(cluster_ctarank());
  const int group = int(blockIdx.x) / p.cluster;
  const int tl = warp % p.tg, pl = warp / p.tg;  // the warp's tile and part within the CTA
  const int tile = group * p.tg + tl, part = rank * p.pc + pl;
  const bool active = tile < p.tiles;  // warp-uniform
  const int row0 = tile * 16;
  const int kw = part * p.kp;  // the warp's first K
  const int nckp = p.kp / kChunkK, nkbp = p.kp / 32;
  const int R = p.row_bytes;
  uint8_t* wreg = smem + warp * p.warp_bytes;
  uint8_t* sreg = wreg + 16 * R;  // FP8: scale byte of (tile row, K block of the part)
  uint8_t* xs = smem + nw * p.warp_bytes;
  float* stash = reinterpret_cast<float*>(xs + p.x_bytes);  // [warp][lane][4] partials (C = 1)
  // C > 1: the S parts of the outputs this CTA's threads finish arrive by st.async (below).
  const int C = p.cluster, bd = int(blockDim.x), step = C * bd, outs = res_outs(p.splits);
  float* recv_region = stash + nw * 128;  // mbarrier, then [S][outs][bd] parts
  const uint32_t recv_bar = uint32_t(__cvta_generic_to_shared(recv_region));
  const float* recv = recv_region + kResRecvHeader / 4;
  const int act = min(p.tg, p.tiles - group * p.tg) * 128;  // outputs of the group's active tiles
  const int f0 = rank * bd + int(threadIdx.x);  // this thread's first output (then + o x step)

  // The warp's 16 rows x kp weights, in kResGroups chunk ranges (one commit group each), and the
  // FP8 scales: none depend on the previous kernel, so all are issued before the PDL wait.
  if (active) {
    const uint8_t* src0 = p.w + (int64_t(row0) * p.K + kw) * kEb;
    for (int j = 0; j < kResGroups; ++j) {
      const int c0 = j * nckp / kResGroups, c1 = (j + 1) * nckp / kResGroups;
      const int q0 = c0 * kChunkK * kEb / 16, per = (c1 - c0) * kChunkK * kEb / 16;
      for (int q = lane; q < 16 * per; q += 32) {
        const int row = q / per, col = q0 + q - row * per;
        if (row0 + row < p.n)
          cp_async16(wreg + row * R + col * 16, src0 + int64_t(row) * p.K * kEb + col * 16);
      }
      cp_async_commit();
    }
  }
  if (C > 1) {
    // The receive mbarrier counts the bytes of this CTA's outputs in active tiles (a prefix of
    // the group's TG): S parts of 4 bytes each. Published by a cluster barrier that every CTA
    // waits for before its first push.
    if (threadIdx.x == 0) {
      int n = 0;
      for (int o = 0; o < outs; ++o) {
        const int lo = o * step + rank * bd;
        n += max(0, min(lo + bd, act) - lo);
      }
      mbarrier_init_expect(recv_bar, uint32_t(n * p.splits * 4));
      fence_mbarrier_init();
    }
    cluster_arrive_relaxed();
  }
  pdl_trigger();  // before the scale loads: their stores wait for the loads
  if (active) {
    if constexpr (kFp8) {
      const int items = 16 * nkbp;
      for (int q0 = lane; q0 < items; q0 += 32 * kResBatch) {
        uint32_t v[kResBatch];
#pragma unroll
        for (int b = 0; b < kResBatch; ++b) {
          const int q = q0 + 32 * b, row = q / nkbp, kb = q - row * nkbp;
          const int64_t ar = p.r0 + row0 + row;  // absolute weight row
          v[b] = 127u;                           // 1.0 for rows >= n (their weights read as zeros)
          if (q < items && row0 + row < p.n)
            v[b] = __ldg(p.scale + (p.row_scale ? ar : ar / 32) * p.scale_cols + kw / 32 + kb);
        }
#pragma unroll
        for (int b = 0; b < kResBatch; ++b)
          if (q0 + 32 * b < items) sreg[q0 + 32 * b] = uint8_t(v[b]);
      }
    }
  }
  pdl_wait();
  UF_PROBE_MARK(probe, 1);

  stage_x<kFp8>(xs, p.x, p.x_stride, p.m, p.x_vec, rank * p.pc * p.kp, p.pc * p.kp / 8);
  __syncthreads();
  UF_PROBE_MARK(probe, 2);

  // The warp's part: acc from 0, chunks in K order (each group's as it lands), one mma a 16-wide
  // slice: exactly the legacy kernels' part sum. Within a group the next chunk's shared-memory
  // operands (weights, FP8 scales, x) are read before the current chunk's conversions and mma, so
  // their latency hides behind that work; the values and the mma order are unchanged.
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (active) {
    const bool va = row0 + g < p.n, vb = row0 + g + 8 < p.n;
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    const uint8_t* ra = wreg + g * R;
    const uint8_t* rb = ra + 8 * R;
    constexpr int kL = kFp8 ? 2 : 4;  // 16-byte pieces a chunk
    struct Ops {
      uint4 w[kL], x[2];
      float sa, sb;
    };
    auto read_ops = [&](int c) {
      Ops o;
      chunk_x(o.x, xs, pl * nckp + c, g, tg);
      if constexpr (kFp8) {
        const int off = c * kChunkK + tg * 16;
        o.w[0] = va ? *reinterpret_cast<const uint4*>(ra + off) : z;
        o.w[1] = vb ? *reinterpret_cast<const uint4*>(rb + off) : z;
        const int kb = 2 * c + (tg >> 1);
        o.sa = va ? e8m0_to_f32(sreg[g * nkbp + kb]) : 1.f;
        o.sb = vb ? e8m0_to_f32(sreg[(g + 8) * nkbp + kb]) : 1.f;
      } else {
        const int off = c * kChunkK * 2 + tg * 16;
        o.w[0] = va ? *reinterpret_cast<const uint4*>(ra + off) : z;
        o.w[1] = va ? *reinterpret_cast<const uint4*>(ra + off + 64) : z;
        o.w[2] = vb ? *reinterpret_cast<const uint4*>(rb + off) : z;
        o.w[3] = vb ? *reinterpret_cast<const uint4*>(rb + off + 64) : z;
        o.sa = o.sb = 1.f;
      }
      return o;
    };
    for (int j = 0; j < kResGroups; ++j) {
      wait_group_in_order(j);
      __syncwarp();  // every lane's pieces (and, the first time, the scale bytes)
      const int c0 = j * nckp / kResGroups, c1 = (j + 1) * nckp / kResGroups;
      if (c0 == c1) continue;  // nckp < kResGroups: an empty group
      Ops cur = read_ops(c0);
      for (int c = c0; c < c1; ++c) {
        Ops nxt = cur;
        if (c + 1 < c1) nxt = read_ops(c + 1);
        mma_chunk<kFp8>(acc, cur.w, cur.sa, cur.sb, cur.x);
        cur = nxt;
      }
    }
    if (C == 1 && 2 * tg < p.m)  // this lane holds tokens 2 tg, 2 tg + 1
      reinterpret_cast<float4*>(stash)[warp * 32 + lane] =
          make_float4(acc[0], acc[1], acc[2], acc[3]);
  }

  // Finish: output f = (tile tl2, fragment slot) of the cluster, f = f0 + o x step (o < outs):
  // the S parts added in part order P0 + P1 + ..., then rounded and stored.
  int64_t dst[kResOuts];  // y offset of output o, -1: none
#pragma unroll
  for (int o = 0; o < kResOuts; ++o) {
    const int f = f0 + o * step;
    const int tl2 = f >> 7, slot = f & 127, ln = slot >> 2, e = slot & 3;
    const int tok = 2 * (ln & 3) + (e & 1);
    const int row = (group * p.tg + tl2) * 16 + (ln >> 2) + ((e & 2) ? 8 : 0);
    dst[o] =
        o < outs && f < p.tg * 128 && tok < p.m && row < p.n ? int64_t(tok) * p.y_stride + row : -1;
  }
  if (C > 1) {
    // Push: lane ln's 4 values are outputs f .. f + 3 of tile tl (f = 128 tl + 4 ln), finished by
    // rank q = (f mod step) / bd, thread t = f mod bd, as its output o = f / step: slot
    // [part][o][t .. t + 3] of q's receive region. No barrier after: a CTA with no outputs leaves
    // after its pushes, and a finishing CTA reads only its own shared memory.
    cluster_wait();
    if (active) {
      const int f = tl * 128 + lane * 4;
      const int o = f / step, rem = f - o * step, q = rem / bd, t = rem - q * bd;
      const uint32_t at = recv_bar + kResRecvHeader + uint32_t(((part * outs + o) * bd + t) * 4);
      st_async_f32x4(cluster_map(at, uint32_t(q)), make_float4(acc[0], acc[1], acc[2], acc[3]),
                     cluster_map(recv_bar, uint32_t(q)));
    }
    UF_PROBE_MARK(probe, 3);
    if (rank * bd >= act) return;  // no outputs here
    mbarrier_wait_cluster(recv_bar, 0);
    UF_PROBE_MARK(probe, 4);
#pragma unroll
    for (int o = 0; o < kResOuts; ++o) {
      if (dst[o] < 0) continue;
      const float* v = recv + o * bd + int(threadIdx.x);
      float total = v[0];
      for (int s2 = 1; s2 < p.splits; ++s2) total = __fadd_rn(total, v[s2 * outs * bd]);
      p.y[dst[o]] = p.round ? round_bf16(total) : total;
    }
    UF_PROBE_MARK(probe, 5);
    return;
  }

  // C = 1 (a plain launch; PC = S parts a CTA): the CTA's own stash after a block barrier, part s
  // of tile tl2 in warp s x TG + tl2.
  UF_PROBE_MARK(probe, 3);
  __syncthreads();
  UF_PROBE_MARK(probe, 4);
#pragma unroll
  for (int o = 0; o < kResOuts; ++o) {
    if (dst[o] < 0) continue;
    const int f = f0 + o * step, tl2 = f >> 7, slot = f & 127;
    float total = stash[tl2 * 128 + slot];
    for (int s2 = 1; s2 < p.splits; ++s2)
      total = __fadd_rn(total, stash[(s2 * p.tg + tl2) * 128 + slot]);
    p.y[dst[o]] = p.round ? round_bf16(total) : total;
  }
  UF_PROBE_MARK(probe, 5);
}

// The resident configuration of an n-row call: the first cluster size C (cluster_pref, else 8, 4,
// 2, 1) dividing S with PC = S / C <= 8 parts a CTA, and the fewest tiles TG a CTA (TG x PC <= 8
// warps) that fit the grid in one CTA an SM within the shared-memory budget. C = 0: none fits.
// Numerics: none (every configuration computes the same parts and adds them in part order).
struct ResPlan {
  int cluster = 0, tg = 0, pc = 0, row_bytes = 0, warp_bytes = 0, x_bytes = 0;
  size_t smem = 0;
  int64_t ctas = 0;
};
ResPlan res_plan(int64_t tiles, int64_t cols, int S, int sms, bool fp8, int cluster_pref) {
  ResPlan r;
  const int kp = int(cols / S), eb = fp8 ? 1 : 2;
  // 16-byte fragment reads of rows g, g + 1 (one 8-lane phase) in distinct bank halves.
  const int row_bytes = kp * eb % 128 == 0 ? kp * eb + 64 : kp * eb;
  const int warp_bytes = (16 * row_bytes + (fp8 ? 16 * (kp / 32) : 0) + 15) / 16 * 16;
  for (int C : {cluster_pref, 8, 4, 2, 1}) {
    if (C <= 0 || C > kResMaxCluster || S % C != 0 || S / C > kResMaxWarps) continue;
    if (cluster_pref > 0 && C != cluster_pref) continue;
    const int pc = S / C;
    for (int tg = 1; tg * pc <= kResMaxWarps; ++tg) {
      const int warps = tg * pc;
      const size_t smem = size_t(warps) * size_t(warp_bytes) + size_t(pc) * size_t(kp) * 16 +
                          size_t(warps) * 512 + size_t(res_recv_bytes(C, S, warps * 32));
      if (smem > kResSmemBudget) break;
      const int64_t ctas = (tiles + tg - 1) / tg * C;
      if (ctas > sms) continue;
      r.cluster = C, r.tg = tg, r.pc = pc, r.row_bytes = row_bytes, r.warp_bytes = warp_bytes;
      r.x_bytes = pc * kp * 16;
      r.smem = smem;
      r.ctas = ctas;
      return r;
    }
  }
  return r;
}

template <bool kFp8>
void launch_resident(const ResArgs& a, const ResPlan& r, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(r.ctas));
  cfg.blockDim = dim3(unsigned(r.tg * r.pc * 32));
  cfg.dynamicSmemBytes = r.smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[3];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = unsigned(r.cluster);
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = r.cluster > 1 ? 2 : 1;  // C = 1: a plain launch (cluster_ctarank() is 0)
  const size_t wbytes = size_t(a.n) * size_t(a.K) * (kFp8 ? 1 : 2);
  if (l2_streaming_window(a.w, a.w + wbytes, attr[cfg.numAttrs])) ++cfg.numAttrs;
  UF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, dense_mma_resident_kernel<kFp8>, a));
}

// Warps a split plan aims at, in units of the SM count (a build-time knob for benchmarks; it sets
// the split count, so the sum's grouping, never per call). 6 (wo_a [1024, 4096]: S 8 -> 16, CTAs
// of 8 warps) made the 8k step 20-50 us slower at 1 / 7 rows (session 18, H200).
#ifndef UF_DENSE_SPLIT_WAVES
#define UF_DENSE_SPLIT_WAVES 3
#endif
// S: doubles while the grid has fewer than UF_DENSE_SPLIT_WAVES warps' tiles per SM, with whole
// chunks per part and at least 2 chunks a part. Depends on (tiles, K, SM count) only.
int split_count(int64_t tiles, int64_t cols, int sms) {
  const int64_t nck = cols / kChunkK;
  int s = 1;
  while (tiles * s < int64_t(UF_DENSE_SPLIT_WAVES) * sms && nck % (2 * s) == 0 &&
         nck / (2 * s) >= 2)
    s *= 2;
  return s;
}

// f(the full-K / split-K kernel of the format).
template <typename F>
void with_full_kernel(bool fp8, int, F&& f) {
  if (fp8)
    f(dense_mma_kernel<true, kRingStages>);  // no ring (register loads)
  else
    f(dense_mma_kernel<false, kRingStages>);
}

template <bool kFp8>
void setup_kernel() {
  for (int R : {kRingStages})
    with_full_kernel(kFp8, R, [&](auto kernel) {
      const size_t most = kMaxSmem + (kFp8 ? 0 : size_t(kFullWarps) * size_t(R) * kRingStageBytes);
      UF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(std::min(most, kSmemOptin))));
      prefer_shared_carveout(kernel);
    });
  UF_CUDA_CHECK(cudaFuncSetAttribute(dense_mma_resident_kernel<kFp8>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(kResSmemBudget)));
  prefer_shared_carveout(dense_mma_resident_kernel<kFp8>);
}

std::atomic<bool> g_prefill{true};  // set_dense_mma_prefill

}  // namespace

void set_dense_mma_prefill(bool on) { g_prefill.store(on, std::memory_order_relaxed); }

bool DenseMma::supports(const DeviceWeight& w) {
  return !w.empty() && (w.format == WFormat::kBF16 || w.format == WFormat::kFP8) &&
         w.cols % kChunkK == 0 && w.cols >= kMinCols && w.cols <= kMaxCols &&
         w.rows < (int64_t(1) << 30) && reinterpret_cast<uintptr_t>(w.data) % 16 == 0 &&
         (w.format != WFormat::kFP8 || w.scale != nullptr);
}

DenseMma::DenseMma(const DeviceWeight& w, int sm_count, DenseMmaPath path, int resident_cluster)
    : rows_(w.rows),
      cols_(w.cols),
      sms_(std::max(1, sm_count)),
      fp8_(w.format == WFormat::kFP8),
      resident_(path == DenseMmaPath::kAuto),
      cluster_pref_(resident_cluster) {
  require(resident_cluster == 0 || resident_cluster == 1 || resident_cluster == 2 ||
              resident_cluster == 4 || resident_cluster == 8,
          "DenseMma: resident cluster size %d must be 0 (automatic), 1, 2, 4 or 8",
          resident_cluster);
  require(supports(w),
          "DenseMma: weight [%lld, %lld] (format %d) is not a BF16/FP8 weight with cols %% 64 == 0 "
          "and cols <= %lld",
          static_cast<long long>(w.rows), static_cast<long long>(w.cols), int(w.format),
          static_cast<long long>(kMaxCols));
  setup_kernel<false>();
  setup_kernel<true>();
  int occ = 0;
  const size_t xb = size_t(cols_) * 16, smem = full_smem(xb, kFullWarps, fp8_);
  with_full_kernel(fp8_, ring_stages(xb, kFullWarps), [&](auto kernel) {
    UF_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kFullWarps * 32, smem));
  });
  ctas_per_sm_ = std::max(1, occ);
  // The split workspace for the largest split call over every row count n <= rows.
  const int64_t max_tiles = (rows_ + 15) / 16;
  for (int64_t t = 1; t <= max_tiles; ++t) {
    const int s = split_count(t, cols_, sms_);
    if (s == 1) continue;
    partial_floats_ = std::max(partial_floats_, size_t(s) * size_t(t) * 128);
    counter_count_ = std::max(counter_count_, t);
  }
  if (partial_floats_ > 0) {
    UF_CUDA_CHECK(cudaMalloc(&partials_, partial_floats_ * sizeof(float)));
    UF_CUDA_CHECK(cudaMalloc(&counters_, size_t(counter_count_) * sizeof(int)));
    UF_CUDA_CHECK(cudaMemset(counters_, 0, size_t(counter_count_) * sizeof(int)));
  }
}

DenseMma::~DenseMma() {
  cudaFree(partials_);
  cudaFree(counters_);
}

int DenseMma::splits(int64_t n) const { return split_count((n + 15) / 16, cols_, sms_); }

int DenseMma::resident_cluster(int64_t n) const {
  if (!resident_ || n <= 0) return 0;
  const int64_t tiles = (n + 15) / 16;
  return res_plan(tiles, cols_, split_count(tiles, cols_, sms_), sms_, fp8_, cluster_pref_).cluster;
}

void DenseMma::run(const DeviceWeight& w, int64_t r0, int64_t n, const float* x, int64_t x_stride,
                   int m, float* y, int64_t y_stride, bool round_bf16, cudaStream_t stream) const {
  if (n <= 0 || m <= 0) return;
  require(w.cols == cols_ && w.rows == rows_ && (w.format == WFormat::kFP8) == fp8_ && r0 >= 0 &&
              r0 + n <= rows_,
          "DenseMma::run: weight [%lld, %lld] rows [%lld, %lld) do not match the plan [%lld, %lld]",
          static_cast<long long>(w.rows), static_cast<long long>(w.cols),
          static_cast<long long>(r0), static_cast<long long>(r0 + n), static_cast<long long>(rows_),
          static_cast<long long>(cols_));
  const int64_t chunks = (int64_t(m) + kRows - 1) / kRows;
  require(chunks <= 65535, "DenseMma::run: %d rows exceed one launch's 65535 chunks of 8", m);
  const int64_t tiles = (n + 15) / 16;
  const int S = split_count(tiles, cols_, sms_);
  Args a{};
  a.w = w.data + r0 * cols_ * (fp8_ ? 1 : 2);
  a.scale = w.scale;
  a.r0 = r0;
  a.n = int(n);
  a.K = int(cols_);
  a.scale_cols = int((cols_ + 31) / 32);
  a.row_scale = w.row_scale ? 1 : 0;
  a.x = x;
  a.x_stride = x_stride;
  a.m = m;
  a.y = y;
  a.y_stride = y_stride;
  a.round = round_bf16 ? 1 : 0;
  a.tiles = int(tiles);
  a.kp = int(cols_ / S);
  a.splits = S;
  a.x_vec = reinterpret_cast<uintptr_t>(x) % 16 == 0 && x_stride % 4 == 0 ? 1 : 0;
  a.partials = partials_;
  a.counters = counters_;
  if (chunks == 1 && resident_) {  // decode rows: the resident kernel where the plan fits
    const ResPlan r = res_plan(tiles, cols_, S, sms_, fp8_, cluster_pref_);
    if (r.cluster > 0) {
      ResArgs b{};
      b.w = a.w;
      b.scale = a.scale;
      b.r0 = a.r0;
      b.n = a.n;
      b.K = a.K;
      b.scale_cols = a.scale_cols;
      b.row_scale = a.row_scale;
      b.x = x;
      b.x_stride = x_stride;
      b.m = m;
      b.y = y;
      b.y_stride = y_stride;
      b.round = a.round;
      b.tiles = a.tiles;
      b.kp = a.kp;
      b.splits = S;
      b.x_vec = a.x_vec;
      b.cluster = r.cluster;
      b.tg = r.tg;
      b.pc = r.pc;
      require((r.pc & (r.pc - 1)) == 0, "DenseMma::run: resident parts a CTA %d not a power of two",
              r.pc);  // the kernel's finish addresses parts with shifts
      b.row_bytes = r.row_bytes;
      b.warp_bytes = r.warp_bytes;
      b.x_bytes = r.x_bytes;
      if (fp8_)
        launch_resident<true>(b, r, stream);
      else
        launch_resident<false>(b, r, stream);
      return;
    }
  }
  if (chunks > 1 && g_prefill.load(std::memory_order_relaxed)) {  // prefill rows
    const dim3 pgrid(unsigned((tiles + kPreWarps - 1) / kPreWarps),
                     unsigned((chunks + kPreChunks - 1) / kPreChunks));
    if (fp8_)
      launch_pdl(dense_mma_prefill_kernel<true>, pgrid, dim3(kPreWarps * 32), kPreSmem, stream, a);
    else
      launch_pdl(dense_mma_prefill_kernel<false>, pgrid, dim3(kPreWarps * 32), kPreSmem, stream, a);
    return;
  }
  dim3 grid, block;
  size_t smem, xb;
  if (S > 1 && chunks == 1) {  // split K: one part per CTA
    require(size_t(S) * size_t(tiles) * 128 <= partial_floats_ && tiles <= counter_count_,
            "DenseMma::run: the split workspace is smaller than the call's %d x %lld tiles", S,
            static_cast<long long>(tiles));
    a.cta_parts = 1;
    grid = dim3(unsigned((tiles + kSplitWarps - 1) / kSplitWarps), unsigned(S), 1);
    block = dim3(kSplitWarps * 32);
    xb = size_t(a.kp) * 16;
    smem = full_smem(xb, kSplitWarps, fp8_);
  } else {  // full K per CTA (the parts summed in the warp), one wave at most
    a.cta_parts = S;
    const int64_t ctas =
        std::min<int64_t>((tiles + kFullWarps - 1) / kFullWarps, int64_t(ctas_per_sm_) * sms_);
    grid = dim3(unsigned(ctas), 1, unsigned(chunks));
    block = dim3(kFullWarps * 32);
    xb = size_t(cols_) * 16;
    smem = full_smem(xb, kFullWarps, fp8_);
  }
  with_full_kernel(fp8_, ring_stages(xb, int(block.x / 32)),
                   [&](auto kernel) { launch_pdl(kernel, grid, block, smem, stream, a); });
}

}  // namespace uf::cuda
