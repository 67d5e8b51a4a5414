// index_scores (ops/attention.h) for head_dim 128 on the tensor cores: every (entry, row, head)
// dot product of 128 by bf16 mma.sync m16n8k16 with fp32 accumulation, then the CPU's epilogue
// (bf16, relu, * w_h, bf16, summed over heads in order with __fadd_rn, bf16 unless partial).
//
// Why it is exact: the model's operands are FP4 QDQ values (ops/attention.h; an E2M1 value times
// an E8M0 scale per 32): exact in bf16, and their products carry <= 4 significant bits. Within
// one 32-block of a head's dot product all products are integer multiples of one power of two
// (the two blocks' scales times 2^-2) and their sum is below 2^13 of it, so the whole dot product
// needs at most 15 + span bits, span = how many binades the 4 blocks' product scales cover: exact
// in fp32 while span <= 9 (tests/cpu/test_ops.cpp Fp4QdqDotProductsAreExactInFp32). An exact
// sum does not depend on the order of its additions, and the tensor core drops no bits of it (the
// tests: 0 mismatches against the CPU over 1.2M scores of FP4 QDQ operands), so the dot product is
// the CPU's dot_f32 bit for bit. Where a sum does not fit 24 bits (scales > 9 binades apart, or
// operands that are not such values) the two can differ in the dot's last bit, which the bf16
// rounding right after almost always absorbs; the fp32 kernel (indexer.cu) keeps the CPU's order
// for any bf16 operands: set_index_scores_mma(false).
//
// Tiles: a CTA = 8 warps x 16 key entries (128 entries, kEntries) x the row group's columns
// (column c = row r * n_heads + head h, up to kMaxCols = 64: rows per CTA = min(8, 64 /
// n_heads)). A warp's 16 entries x 128 dims are loaded once, first (the kernel's memory traffic:
// 8 bytes (4 bf16) per entry and k-step a thread, 16 in flight), as the mma A operand directly
// (the session stores index keys as bf16: cuda_session.h);
// the K order inside a k-step puts dims 4t..4t+3 at the fragment positions 2t, 2t+1, 2t+8, 2t+9
// of thread t, and q is staged in that order (bf16 [column][128 + 8]: conflict-free B reads) with
// w in shared memory while the keys are in flight. Per group of 4 column tiles: 8 k-steps x 4 mma;
// the dot products go through the epilogue into the warp's term buffer [16][columns + 1]; then
// lane (entry, row) sums its row's heads in order and stores. Rows of a CTA with different key
// banks run as separate runs (decode: one bank). Entries at or past a row's visible count score
// -inf (not written past its width), as the fp32 kernel.
// Prefill calls (more groups of rows than the GPU needs CTAs): index_scores_mma_span_kernel, a CTA
// per span of groups whose keys are loaded once and serve every group (a 512-row chunk at 1M
// context: 64 groups, where one CTA per group re-loaded every key for each 8 rows).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/gemv.h"
#include "cuda/kernels/common.cuh"
#include "cuda/ops/attention.h"
#include "cuda/ops/index_scores_mma.h"

namespace uf::cuda {
namespace {

using detail::pack_bf16x2;

constexpr int kHd = 128;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kEntries = kWarps * 16;
constexpr int kMaxCols = 64;
constexpr int kMaxRows = 8;
#ifndef UF_IDX_MMA_MIN_BLOCKS
#define UF_IDX_MMA_MIN_BLOCKS 3
#endif
// The decode kernel's CTAs an SM. With bf16 keys a thread's 16 key loads hold half the bytes, and
// the kernel is latency-bound (load, score, store once a CTA): 3 CTAs an SM (80 registers, no
// spill; 4 would spill) put more loads in flight. The 1M step at 1 / 7 rows: 4429 / 7265 us at 2,
// 4390 / 7157 at 3 (docs/perf.md, session 22).
constexpr int kDecodeMinBlocks = UF_IDX_MMA_MIN_BLOCKS;
constexpr int kQStride = kHd + 8;  // bf16 per q column in shared memory (272 B: 4 mod 32 words)

// Shared memory: q [kMaxCols][kQStride] bf16, w [kMaxCols] fp32, per warp terms [16][cols + 1]
// (16-byte multiple); the span kernel adds the next group's q copy, fp32 [cols][128].
__host__ __device__ constexpr size_t smem_bytes(int cols) {
  return (size_t(kMaxCols) * kQStride * 2 + size_t(kMaxCols) * 4 +
          size_t(kWarps) * 16 * size_t(cols + 1) * 4 + 15) /
         16 * 16;
}
__host__ __device__ constexpr size_t span_smem_bytes(int cols) {
  return smem_bytes(cols) + size_t(cols) * kHd * 4;
}

// The A operand's loads (the kernel's memory traffic): entries ew + g (x[.][0]) and ew + g + 8
// (x[.][1]) of the bank (bf16, as the session stores index keys), zeros at or past nv. K order
// inside a k-step (A and B alike): fragment positions 2t, 2t + 1, 2t + 8, 2t + 9 hold dims
// 16 ks + 4t + 0..3, so a thread loads 8 bytes (4 bf16) per entry and k-step: .x is the bf16x2
// of positions 2t, 2t + 1, .y that of 2t + 8, 2t + 9 (the q staging permutes q the same).
// 4 bf16 of a bank that is not 8-byte aligned (2-byte loads); aligned banks take one 8-byte load,
// the alignment tested once, outside the load loops (see index_scores_mma_kernel).
__device__ __forceinline__ uint2 load_key4_unaligned(const uint16_t* k) {
  return make_uint2(uint32_t(__ldg(k)) | uint32_t(__ldg(k + 1)) << 16,
                    uint32_t(__ldg(k + 2)) | uint32_t(__ldg(k + 3)) << 16);
}
__device__ __forceinline__ void load_keys(uint2 (&x)[8][2], const uint16_t* bank, int ew, int nv,
                                          int g, int t) {
  const int ea = ew + g, eb = ew + g + 8;
  const uint16_t* ka = bank + int64_t(ea) * kHd + 4 * t;
  const uint16_t* kb = bank + int64_t(eb) * kHd + 4 * t;
  const bool va = ea < nv, vb = eb < nv;
  const bool al = (reinterpret_cast<uintptr_t>(bank) & 7u) == 0;  // else: 2-byte loads
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    x[ks][0] = x[ks][1] = make_uint2(0u, 0u);
    if (al) {  // the test outside the loads: they all issue before the first use
      if (va) x[ks][0] = __ldg(reinterpret_cast<const uint2*>(ka + 16 * ks));
      if (vb) x[ks][1] = __ldg(reinterpret_cast<const uint2*>(kb + 16 * ks));
    } else {
      if (va) x[ks][0] = load_key4_unaligned(ka + 16 * ks);
      if (vb) x[ks][1] = load_key4_unaligned(kb + 16 * ks);
    }
  }
}

__device__ __forceinline__ void keys_to_a(uint32_t (&a)[8][4], const uint2 (&x)[8][2]) {
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    a[ks][0] = x[ks][0].x;
    a[ks][1] = x[ks][1].x;
    a[ks][2] = x[ks][0].y;
    a[ks][3] = x[ks][1].y;
  }
}

// One warp's 16 entries (ew ..) against the staged rows [r0, r0 + nr): the dot products of every
// (entry, row, head) on the tensor cores, the CPU's epilogue per term (bf16, relu, * w_h, bf16)
// into the warp's term buffer, then lane (entry, row) sums its row's heads in order and stores.
// live = false (no entry of the warp visible to any row of the run): -inf where written.
template <bool kRound>
__device__ __forceinline__ void score_rows(const uint32_t (&a)[8][4], bool live, const uint16_t* qs,
                                           const float* ws, float* term, int r0, int nr,
                                           int n_heads, int ew, int lane, const int32_t* vis,
                                           const int32_t* width, int max_width, float* score) {
  const int g = lane >> 2, t = lane & 3, cols = nr * n_heads, tiles = (cols + 7) / 8;
  if (!live) {
    for (int i = lane; i < 16 * nr; i += 32) {
      const int e = ew + (i & 15), tr = r0 + (i >> 4);
      if (e < width[tr]) score[int64_t(tr) * max_width + e] = -INFINITY;
    }
    return;
  }
  const int ts = cols + 1;  // term row stride
  for (int n0 = 0; n0 < tiles; n0 += 4) {
    float d[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (n0 + j < tiles) {
          const uint16_t* qb = qs + ((n0 + j) * 8 + g) * kQStride + 16 * ks + 2 * t;
          detail::mma_bf16(d[j], a[ks][0], a[ks][1], a[ks][2], a[ks][3],
                           *reinterpret_cast<const uint32_t*>(qb),
                           *reinterpret_cast<const uint32_t*>(qb + 8));
        }
      }
    }
    // d[j]: entries g (0, 1) and g + 8 (2, 3) x columns (n0 + j) * 8 + 2t (+1).
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int c = (n0 + j) * 8 + 2 * t + (v & 1), e = g + (v >> 1) * 8;
        if (n0 + j < tiles && c < cols) {
          const float dd = detail::round_bf16(d[j][v]);
          const float rl = dd < 0.f ? 0.f : dd;  // std::max(d, 0.0f)
          term[e * ts + c] = detail::round_bf16(__fmul_rn(rl, ws[c]));
        }
      }
    }
  }
  __syncwarp();
  for (int i = lane; i < 16 * nr; i += 32) {
    const int e = i & 15, r = i >> 4, tr = r0 + r, ent = ew + e;
    const int wd = width[tr], nv = min(vis[tr], wd);
    if (ent >= wd) continue;
    float s = 0.f;
    for (int h = 0; h < n_heads; ++h) s = __fadd_rn(s, term[e * ts + r * n_heads + h]);
    score[int64_t(tr) * max_width + ent] =
        ent < nv ? (kRound ? detail::round_bf16(s) : s) : -INFINITY;
  }
}

// Decode (and short calls): a CTA = one group of `rows` rows x 128 entries; runs of rows reading
// one key bank each load their keys, q staged under the loads. Kept as written before the span
// kernel (session 10), not on the helpers above: the same code through them measured 40 / 110 us
// slower in the 1M decode step at 1 / 7 rows (session 13, same-run A/B). The same holds for the
// bf16 loads: with the alignment test inside the loop (once per load) the 1M step was 185 /
// 250 us slower than with it outside, as here (session 22).
template <bool kRound>
__global__ void __launch_bounds__(kThreads, kDecodeMinBlocks)
    index_scores_mma_kernel(const float* __restrict__ q, const float* __restrict__ w, int T,
                            int n_heads, int rows, const uint16_t* const* keys,
                            const int32_t* __restrict__ vis, const int32_t* __restrict__ width,
                            int max_width, float* __restrict__ score) {
  detail::pdl_wait();  // PDL: every input comes from an earlier kernel
  detail::pdl_trigger();
  extern __shared__ __align__(16) uint8_t smem[];
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem);
  float* ws = reinterpret_cast<float*>(smem + size_t(kMaxCols) * kQStride * 2);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int t0 = blockIdx.x * rows, nr = min(rows, T - t0);
  const int e0 = blockIdx.y * kEntries, ew = e0 + warp * 16;  // the warp's first entry
  float* term = reinterpret_cast<float*>(ws + kMaxCols) + warp * 16 * (rows * n_heads + 1);

  for (int r0 = 0; r0 < nr;) {
    // A run: rows [r0, r1) of one key bank.
    const uint16_t* bank = keys[t0 + r0];
    int r1 = r0 + 1, nv_max = 0;
    while (r1 < nr && keys[t0 + r1] == bank) ++r1;
    for (int r = r0; r < r1; ++r) nv_max = max(nv_max, min(vis[t0 + r], width[t0 + r]));
    const int cols = (r1 - r0) * n_heads, tiles = (cols + 7) / 8;
    // The A operand first (its loads are the kernel's memory traffic; q is staged under them):
    // entries ew + g (a[.][0], a[.][2]) and ew + g + 8 (a[.][1], a[.][3]), load_keys' K order
    // (the staging below permutes q the same).
    uint2 x[8][2];
    const bool live = ew < nv_max;  // uniform over the warp
    if (live) {
      const int ea = ew + g, eb = ew + g + 8;
      const uint16_t* ka = bank + int64_t(ea) * kHd + 4 * t;
      const uint16_t* kb = bank + int64_t(eb) * kHd + 4 * t;
      const bool va = ea < nv_max, vb = eb < nv_max;
      const bool al = (reinterpret_cast<uintptr_t>(bank) & 7u) == 0;
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        x[ks][0] = x[ks][1] = make_uint2(0u, 0u);
        if (al) {
          if (va) x[ks][0] = __ldg(reinterpret_cast<const uint2*>(ka + 16 * ks));
          if (vb) x[ks][1] = __ldg(reinterpret_cast<const uint2*>(kb + 16 * ks));
        } else {  // a bank not 8-byte aligned: 2-byte loads
          if (va) x[ks][0] = load_key4_unaligned(ka + 16 * ks);
          if (vb) x[ks][1] = load_key4_unaligned(kb + 16 * ks);
        }
      }
    }
    __syncthreads();  // the previous run's q / w / terms are read
    // q as bf16 [column][position]: position p of k-step ks holds dim 16 ks + 4 ((p & 7) >> 1) +
    // 2 (p >> 3) + (p & 1) (the A order above).
    for (int xi = threadIdx.x; xi < tiles * 8 * (kHd / 2); xi += kThreads) {
      const int c = xi / (kHd / 2), p = (xi - c * (kHd / 2)) * 2;
      const int dim = (p & ~15) + 4 * ((p & 7) >> 1) + 2 * ((p >> 3) & 1);
      uint32_t v = 0;
      if (c < cols) {
        const float* qc = q + (int64_t(t0 + r0) * n_heads + c) * kHd + dim;
        v = pack_bf16x2(__ldg(qc), __ldg(qc + 1));
      }
      *reinterpret_cast<uint32_t*>(qs + c * kQStride + p) = v;
    }
    for (int xi = threadIdx.x; xi < cols; xi += kThreads)
      ws[xi] = __ldg(w + int64_t(t0 + r0) * n_heads + xi);
    __syncthreads();
    if (!live) {  // nothing visible for this warp's entries: -inf where written
      for (int i = lane; i < 16 * (r1 - r0); i += 32) {
        const int e = ew + (i & 15), tr = t0 + r0 + (i >> 4);
        if (e < width[tr]) score[int64_t(tr) * max_width + e] = -INFINITY;
      }
      r0 = r1;
      continue;
    }
    uint32_t a[8][4];
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      a[ks][0] = x[ks][0].x;
      a[ks][1] = x[ks][1].x;
      a[ks][2] = x[ks][0].y;
      a[ks][3] = x[ks][1].y;
    }
    const int ts = cols + 1;  // term row stride
    for (int n0 = 0; n0 < tiles; n0 += 4) {
      float d[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (n0 + j < tiles) {
            const uint16_t* qb = qs + ((n0 + j) * 8 + g) * kQStride + 16 * ks + 2 * t;
            detail::mma_bf16(d[j], a[ks][0], a[ks][1], a[ks][2], a[ks][3],
                             *reinterpret_cast<const uint32_t*>(qb),
                             *reinterpret_cast<const uint32_t*>(qb + 8));
          }
        }
      }
      // d[j]: entries g (0, 1) and g + 8 (2, 3) x columns (n0 + j) * 8 + 2t (+1).
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int c = (n0 + j) * 8 + 2 * t + (v & 1), e = g + (v >> 1) * 8;
          if (n0 + j < tiles && c < cols) {
            const float dd = detail::round_bf16(d[j][v]);
            const float rl = dd < 0.f ? 0.f : dd;  // std::max(d, 0.0f)
            term[e * ts + c] = detail::round_bf16(__fmul_rn(rl, ws[c]));
          }
        }
      }
    }
    __syncwarp();
    for (int i = lane; i < 16 * (r1 - r0); i += 32) {
      const int e = i & 15, r = i >> 4, tr = t0 + r0 + r, ent = ew + e;
      const int wd = width[tr], nv = min(vis[tr], wd);
      if (ent >= wd) continue;
      float s = 0.f;
      for (int h = 0; h < n_heads; ++h) s = __fadd_rn(s, term[e * ts + r * n_heads + h]);
      score[int64_t(tr) * max_width + ent] =
          ent < nv ? (kRound ? detail::round_bf16(s) : s) : -INFINITY;
    }
    r0 = r1;
  }
}

// Prefill (a span of many rows per CTA): the CTA's keys are loaded once per run of rows reading
// one bank (a prefill chunk: one run), then every group of `rows` rows of the span is staged and
// scored against them. The run's end and visible count are found cooperatively.
template <bool kRound>
__global__ void __launch_bounds__(kThreads, 2)
    index_scores_mma_span_kernel(const float* __restrict__ q, const float* __restrict__ w, int T,
                                 int n_heads, int rows, int span, const uint16_t* const* keys,
                                 const int32_t* __restrict__ vis, const int32_t* __restrict__ width,
                                 int max_width, float* __restrict__ score) {
  detail::pdl_wait();  // PDL: every input comes from an earlier kernel
  detail::pdl_trigger();
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int run_end, run_nv;
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem);
  float* ws = reinterpret_cast<float*>(smem + size_t(kMaxCols) * kQStride * 2);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tb = blockIdx.x * span, te = min(T, tb + span);
  const int ew = blockIdx.y * kEntries + warp * 16;  // the warp's first entry
  float* term = reinterpret_cast<float*>(ws + kMaxCols) + warp * 16 * (rows * n_heads + 1);
  float* qf = reinterpret_cast<float*>(smem + smem_bytes(rows * n_heads));  // [cols][128] fp32

  for (int r0 = tb; r0 < te;) {
    __syncthreads();  // the previous run's run_end / run_nv / q / w / terms are read
    if (threadIdx.x == 0) run_end = te, run_nv = 0;
    __syncthreads();
    const uint16_t* bank = keys[r0];
    for (int r = r0 + 1 + threadIdx.x; r < te; r += kThreads)
      if (keys[r] != bank) atomicMin(&run_end, r);
    __syncthreads();
    const int r1 = run_end;
    int nv_mine = 0;
    for (int r = r0 + threadIdx.x; r < r1; r += kThreads)
      nv_mine = max(nv_mine, min(vis[r], width[r]));
    if (nv_mine > 0) atomicMax(&run_nv, nv_mine);
    __syncthreads();
    const int nv_max = run_nv;
    const bool live = ew < nv_max;  // uniform over the warp
    uint32_t a[8][4];
    {
      uint2 x[8][2];
      if (live) load_keys(x, bank, ew, nv_max, lane >> 2, lane & 3);
      if (live) keys_to_a(a, x);
    }
    // The groups, each group's q copied (fp32, cp.async) while the previous one is scored, then
    // converted to the staged bf16 order.
    auto copy_q = [&](int g0) {
      const int cols = min(rows, r1 - g0) * n_heads;
      const float4* src = reinterpret_cast<const float4*>(q + int64_t(g0) * n_heads * kHd);
      for (int i = threadIdx.x; i < cols * (kHd / 4); i += kThreads) {
        const uint32_t d = uint32_t(__cvta_generic_to_shared(qf + 4 * i));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src + i) : "memory");
      }
      detail::cp_async_commit();
    };
    auto convert_q = [&](int g0) {
      const int cols = min(rows, r1 - g0) * n_heads, tiles = (cols + 7) / 8;
      detail::cp_async_wait<0>();
      __syncthreads();  // the copy landed; every warp is done with the previous group's q / w
      for (int xi = threadIdx.x; xi < tiles * 8 * (kHd / 2); xi += kThreads) {
        const int c = xi / (kHd / 2), p = (xi - c * (kHd / 2)) * 2;
        const int dim = (p & ~15) + 4 * ((p & 7) >> 1) + 2 * ((p >> 3) & 1);
        const uint32_t v = c < cols ? pack_bf16x2(qf[c * kHd + dim], qf[c * kHd + dim + 1]) : 0u;
        *reinterpret_cast<uint32_t*>(qs + c * kQStride + p) = v;
      }
      for (int xi = threadIdx.x; xi < cols; xi += kThreads)
        ws[xi] = __ldg(w + int64_t(g0) * n_heads + xi);
      __syncthreads();
    };
    __syncthreads();  // the previous run's last group is converted (qf is free)
    copy_q(r0);
    convert_q(r0);
    for (int g0 = r0; g0 < r1; g0 += rows) {
      const int next = g0 + rows;
      if (next < r1) copy_q(next);  // qf is free: convert_q(g0) ended with a barrier
      score_rows<kRound>(a, live, qs, ws, term, g0, min(rows, r1 - g0), n_heads, ew, lane, vis,
                         width, max_width, score);
      if (next < r1) convert_q(next);
    }
    r0 = r1;
  }
}

// Lists (index_scores_list: the candidate pool's entries of each row; prefill calls): a CTA = one
// row x 128 list positions. A warp gathers its 16 entries' keys (4 bf16 per entry and k-step,
// load_keys' order) and scores them against the row's heads through score_rows (columns = the
// heads); a gap (entry -1) scores -inf, as the fp32 kernel. Rows have no keys in common (each its
// own pool), so nothing is shared across rows.
__device__ __forceinline__ void load_list_keys(uint2 (&x)[8][2], const uint16_t* bank,
                                               const int32_t* row, int ew, int n, int g, int t) {
  const int pa = ew + g, pb = ew + g + 8;
  const int ea = pa < n ? row[pa] : -1, eb = pb < n ? row[pb] : -1;
  const uint16_t* ka = bank + int64_t(max(ea, 0)) * kHd + 4 * t;
  const uint16_t* kb = bank + int64_t(max(eb, 0)) * kHd + 4 * t;
  const bool al = (reinterpret_cast<uintptr_t>(bank) & 7u) == 0;
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    x[ks][0] = x[ks][1] = make_uint2(0u, 0u);
    if (al) {
      if (ea >= 0) x[ks][0] = __ldg(reinterpret_cast<const uint2*>(ka + 16 * ks));
      if (eb >= 0) x[ks][1] = __ldg(reinterpret_cast<const uint2*>(kb + 16 * ks));
    } else {
      if (ea >= 0) x[ks][0] = load_key4_unaligned(ka + 16 * ks);
      if (eb >= 0) x[ks][1] = load_key4_unaligned(kb + 16 * ks);
    }
  }
}

template <bool kRound>
__global__ void __launch_bounds__(kThreads, 2)
    index_scores_mma_list_kernel(const float* __restrict__ q, const float* __restrict__ w,
                                 int n_heads, const uint16_t* const* keys,
                                 const int32_t* __restrict__ entries, const int32_t* __restrict__ n,
                                 int cap, float* __restrict__ score) {
  detail::pdl_wait();  // PDL: every input comes from an earlier kernel
  detail::pdl_trigger();
  extern __shared__ __align__(16) uint8_t smem[];
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem);
  float* ws = reinterpret_cast<float*>(smem + size_t(kMaxCols) * kQStride * 2);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x, nt = n[t], j0 = blockIdx.y * kEntries;
  if (j0 >= nt) return;  // the whole CTA: past the row's list
  const int ew = j0 + warp * 16, cols = n_heads, tiles = (cols + 7) / 8;
  const int32_t* row = entries + int64_t(t) * cap;
  float* term = reinterpret_cast<float*>(ws + kMaxCols) + warp * 16 * (cols + 1);
  const bool live = ew < nt;  // uniform over the warp
  uint32_t a[8][4];
  {
    uint2 x[8][2];
    if (live) load_list_keys(x, keys[t], row, ew, nt, lane >> 2, lane & 3);
    if (live) keys_to_a(a, x);
  }
  // The row's q as bf16 in the A order (index_scores_mma_kernel's staging), and w.
  for (int xi = threadIdx.x; xi < tiles * 8 * (kHd / 2); xi += kThreads) {
    const int c = xi / (kHd / 2), p = (xi - c * (kHd / 2)) * 2;
    const int dim = (p & ~15) + 4 * ((p & 7) >> 1) + 2 * ((p >> 3) & 1);
    uint32_t v = 0;
    if (c < cols) {
      const float* qc = q + (int64_t(t) * n_heads + c) * kHd + dim;
      v = pack_bf16x2(__ldg(qc), __ldg(qc + 1));
    }
    *reinterpret_cast<uint32_t*>(qs + c * kQStride + p) = v;
  }
  for (int xi = threadIdx.x; xi < cols; xi += kThreads) ws[xi] = __ldg(w + int64_t(t) * cols + xi);
  __syncthreads();
  if (!live) return;
  score_rows<kRound>(a, true, qs, ws, term, t, 1, n_heads, ew, lane, n, n, cap, score);
  // (score_rows' lane e < 16 stored position ew + e; the same lane marks a gap.)
  if (lane < 16) {
    const int j = ew + lane;
    if (j < nt && row[j] < 0) score[int64_t(t) * cap + j] = -INFINITY;
  }
}

bool g_index_scores_mma = true;

}  // namespace

void set_index_scores_mma(bool on) { g_index_scores_mma = on; }

bool index_scores_mma(const float* q, const float* w, int T, int n_heads,
                      const uint16_t* const* keys, const int32_t* vis, const int32_t* width,
                      int max_width, float* score, cudaStream_t stream, bool round_sum) {
  if (!g_index_scores_mma || n_heads < 1 || n_heads > kMaxCols) return false;
  const int64_t chunks = (int64_t(max_width) + kEntries - 1) / kEntries;
  if (chunks > 65535) return false;
  // Rows per group: as many as the columns allow (one staged q tile serves them all), fewer when
  // that would leave the GPU short of CTAs (about 4 per SM). A row's result never depends on it.
  const int64_t want = std::max<int64_t>(1, (int64_t(T) * chunks) / 528);
  const int rows = int(std::max<int64_t>(
      1, std::min<int64_t>({int64_t(T), kMaxRows, int64_t(kMaxCols / n_heads), want})));
  const size_t smem = smem_bytes(rows * n_heads);
  static detail::PerDeviceOnce once;
  once([] {  // the largest plan, once per device (thread-safe)
    detail::raise_smem(index_scores_mma_kernel<true>, int(smem_bytes(kMaxCols)));
    detail::raise_smem(index_scores_mma_kernel<false>, int(smem_bytes(kMaxCols)));
    detail::raise_smem(index_scores_mma_span_kernel<true>, int(span_smem_bytes(kMaxCols)));
    detail::raise_smem(index_scores_mma_span_kernel<false>, int(span_smem_bytes(kMaxCols)));
  });
  // Groups per CTA (its span): as many as keep about two CTAs an SM, so that a CTA's keys,
  // loaded once, serve every group of its span (a 512-row prefill chunk at 1M tokens: all 64
  // groups, where one CTA per group re-loaded every key 64 times). A row's result never
  // depends on it either.
  const int64_t groups = (T + rows - 1) / rows;
  const int64_t spans = std::min<int64_t>(
      groups, std::max<int64_t>(1, (2 * int64_t(device_sm_count()) + chunks - 1) / chunks));
  const int span = int((groups + spans - 1) / spans) * rows;
  if (span > rows && reinterpret_cast<uintptr_t>(q) % 16 == 0) {  // (its q copies: 16 bytes)
    const dim3 grid(unsigned((T + span - 1) / span), unsigned(chunks));
    const auto kernel =
        round_sum ? index_scores_mma_span_kernel<true> : index_scores_mma_span_kernel<false>;
    detail::launch_pdl(kernel, grid, dim3(kThreads), span_smem_bytes(rows * n_heads), stream, q, w,
                       T, n_heads, rows, span, keys, vis, width, max_width, score);
  } else {
    const dim3 grid(unsigned((T + rows - 1) / rows), unsigned(chunks));
    const auto kernel = round_sum ? index_scores_mma_kernel<true> : index_scores_mma_kernel<false>;
    detail::launch_pdl(kernel, grid, dim3(kThreads), smem, stream, q, w, T, n_heads, rows, keys,
                       vis, width, max_width, score);
  }
  UF_CUDA_CHECK(cudaGetLastError());
  return true;
}

bool index_scores_mma_list(const float* q, const float* w, int T, int n_heads,
                           const uint16_t* const* keys, const int32_t* entries, const int32_t* n,
                           int cap, float* score, cudaStream_t stream, bool round_sum) {
  if (!g_index_scores_mma || n_heads < 1 || n_heads > kMaxCols) return false;
  const int64_t chunks = (int64_t(cap) + kEntries - 1) / kEntries;
  if (chunks > 65535 || T < 1) return false;
  static detail::PerDeviceOnce once;
  once([] {
    detail::raise_smem(index_scores_mma_list_kernel<true>, int(smem_bytes(kMaxCols)));
    detail::raise_smem(index_scores_mma_list_kernel<false>, int(smem_bytes(kMaxCols)));
  });
  const dim3 grid{unsigned(T), unsigned(chunks)};
  const auto kernel =
      round_sum ? index_scores_mma_list_kernel<true> : index_scores_mma_list_kernel<false>;
  detail::launch_pdl(kernel, grid, dim3(kThreads), smem_bytes(n_heads), stream, q, w, n_heads, keys,
                     entries, n, cap, score);
  UF_CUDA_CHECK(cudaGetLastError());
  return true;
}

}  // namespace uf::cuda
