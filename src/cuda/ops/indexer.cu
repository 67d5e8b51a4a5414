// The sparse indexer on the device (ops/attention.h): index_scores, candidate_mask, mask_scores,
// topk_select, twins of cpu/indexer.cpp.
//
// index_scores: per entry i and head h the dot product follows cpu dot_f32 (dot8) exactly: lane
// L = i mod 8 partial sums in increasing i, combined ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)); then
// bf16, relu, * w_h, bf16, summed over heads in order, then bf16 (round_sum; the TP partial skips
// that last rounding). Everything uses __fmul_rn / __fadd_rn (no FMA contraction, as uf_cpu's
// -ffp-contract=off), so scores are bitwise equal to the CPU's, except the head_dim-128 kernel's
// q.k products: fmaf(q, k, p), half the instructions, and the same bits whenever q * k is exact
// in fp32, which it is for the indexer's operands (FP4 QDQ values: 2 significant bits times a
// power of two; also any bf16 x bf16 product, 16 bits) unless it underflows below 2^-126
// (scales near the e8m0 floor on both sides; the model's amax clamp keeps them >= 2^-126).
// head_dim 128 runs on the tensor cores by default (ops/index_scores_mma.cu: exact for the
// model's operands); the fp32 kernel below with set_index_scores_mma(false). In fp32 the 7-row
// step at 1M tokens is bound by its instructions (L20: 1M entries x 7 rows x 4 heads).
//  - head_dim 128 (the model's): two threads per key entry, 128 entries per CTA. Thread half j
//    holds dot8 lanes 4j..4j+3, i.e. the floats 8u + 4j .. 8u + 4j + 3 of the key row: 16 float4
//    loaded straight from global memory into registers (64 KB per CTA in flight) and reused for
//    every head and every row of the CTA's row group (reloaded only when a row's key bank
//    differs). The two halves (s0+s1)+(s2+s3) and (s4+s5)+(s6+s7) meet by one shuffle; fp32
//    addition is commutative, so both threads hold the CPU's sum bit for bit. q and w of the row
//    group sit in shared memory. Grid (row groups, entry chunks): the row groups of one chunk
//    are neighbours in launch order, so a key bank shared by the rows is read from DRAM ~once.
//  - other head dims: one thread per entry, 64-entry CTAs staging the keys in shared memory.
//
// candidate_mask / topk_select: the best kk of n keys, ties broken by the lower index, with
// order-preserving uint32 keys of the floats (-0 folded onto +0: the CPU compares values).
//  Selection rounds (the fast path): a row's key list is cut into chunks of 512 x KPT keys (KPT 8,
//  16 or 32 keys a thread: the fewest whose chunk holds 4 kk), one CTA of 512 threads per chunk,
//  each thread holding KPT consecutive keys in registers. A CTA selects its chunk's best
//  min(kk, n) keys exactly (4 radix passes of 8 bits with shared-memory histograms, 2 for bf16
//  scores, then one block scan for the ordered compaction; a thread loads its selected keys'
//  indices before it stores any) and writes them, in index order, with their indices, to the
//  workspace: the union of the chunks' best kk holds the row's best kk, and the concatenated
//  candidate lists stay in index order, so the tie rule carries over.
//  The next round selects from the candidates, until one chunk holds the whole list; that round
//  writes the result. Each round is one launch. A row's chunking depends only on its own width
//  and kk (never on T or the other rows): the result is exact whatever the chunking, and rows
//  that finish early skip the later rounds.
//  candidate_mask's keys are block maxima (the block of compress_len - 1 pinned to +inf): when
//  one round suffices they are computed inside it; otherwise a block-max kernel writes them to
//  the workspace first and zeroes keep, and the last round sets the kept blocks.
//  Without a workspace where one is needed, or for k > kMaxFastK: one CTA per row (the
//  original kernels: radix select and ordered compaction reading the scores from global memory).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/gemv.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/probe.cuh"
#include "cuda/ops/attention.h"
#include "cuda/ops/index_scores_mma.h"

namespace uf::cuda {
namespace {

constexpr int kEnt = 64;               // index_scores (other head dims): entries per block
constexpr int kMaxIndexHeadDim = 160;  // 64 x (hd + 1) floats must fit the 48 KiB default
constexpr int kFastHd = 128;           // index_scores fast path
constexpr int kFastThreads = 256;
constexpr int kFastEnt = kFastThreads / 2;
constexpr int kFastMaxRows = 8;
constexpr size_t kFastSmem = 40 * 1024;
constexpr int kSelThreads = 512;
constexpr int kSelWarps = kSelThreads / 32;
// Keys per thread in a selection round: the fewest of 8, 16 or 32 (from UF_SEL_KPT, a build knob
// for A/B runs) whose chunk of kSelThreads x KPT keys holds 4 x m (a round shrinks a list at least
// ~4x). A CTA's time grows with its chunk: one CTA over a row's 16,384 keys (KPT 32) took ~16 us on
// the H200, four CTAs of 4,096 and a second round over their 2,048 candidates less (docs/perf.md,
// session 25). Results are exact whatever the chunking.
#ifndef UF_SEL_KPT
#define UF_SEL_KPT 8
#endif
constexpr int kMinKpt = UF_SEL_KPT;
static_assert(kMinKpt == 8 || kMinKpt == 16 || kMinKpt == 32, "keys per thread: 8, 16 or 32");
constexpr int kMaxKpt = 32;
constexpr int kMaxFastK = kSelThreads * kMaxKpt / 4;
constexpr int kSmallKpt = 8;  // one-round lists of <= kSmallList keys
constexpr int kSmallList = kSelThreads * kSmallKpt;
constexpr int kMaxRounds = 16;
constexpr int kMaskThreads = 256;
constexpr int kBlockMaxThreads = 256;

// ---- index_scores ----

// One CTA: kFastEnt entries [blockIdx.y * kFastEnt, ...) for the rows [blockIdx.x * rows, ...).
// kList: position i of row t scores entry list[t * max_width + i] (i < list_n[t]; -1: -inf), one
// row per CTA (rows == 1: rows' lists differ, so a key load serves one row); the per-entry
// arithmetic is the same, so a listed entry's score is bitwise its score in the full row.
template <bool kRound, bool kList = false>
__global__ void __launch_bounds__(kFastThreads, 2)
    index_scores_hd128_kernel(const float* __restrict__ q, const float* __restrict__ w, int T,
                              int n_heads, int rows, const uint16_t* const* keys,
                              const int32_t* __restrict__ vis, const int32_t* __restrict__ width,
                              int max_width, float* __restrict__ score,
                              const int32_t* __restrict__ list = nullptr) {
  detail::pdl_wait();  // PDL: every input comes from an earlier kernel
  detail::pdl_trigger();
  constexpr int kU = kFastHd / 8;  // float4 per thread half
  extern __shared__ float4 smem4[];
  const int t0 = blockIdx.x * rows, nr = min(rows, T - t0);
  const int e0 = blockIdx.y * kFastEnt, tid = threadIdx.x, j = tid & 1;
  const int i = e0 + (tid >> 1);
  float* qs = reinterpret_cast<float*>(smem4);  // [nr][n_heads][128]
  float* wsm = qs + rows * n_heads * kFastHd;   // [nr][n_heads]
  {
    const float* qg = q + int64_t(t0) * n_heads * kFastHd;
    for (int x = tid; x < nr * n_heads * kFastHd; x += kFastThreads) qs[x] = __ldg(qg + x);
    const float* wg = w + int64_t(t0) * n_heads;
    for (int x = tid; x < nr * n_heads; x += kFastThreads) wsm[x] = __ldg(wg + x);
  }
  __syncthreads();
  float4 kv[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) kv[u] = make_float4(0.f, 0.f, 0.f, 0.f);
  const uint16_t* loaded = nullptr;  // the key bank kv holds entry i of
  for (int r = 0; r < nr; ++r) {
    const int t = t0 + r;
    const int wd = width[t];
    if (e0 >= wd) continue;                       // uniform over the CTA
    const int nv = kList ? wd : min(vis[t], wd);  // kList: width = vis = the list's length
    float* out = score + int64_t(t) * max_width;
    if (e0 >= nv) {  // nothing visible in the chunk (uniform)
      if (j == 0 && i < wd) out[i] = -INFINITY;
      continue;
    }
    const int ent = !kList ? i : i < nv ? __ldg(list + int64_t(t) * max_width + i) : -1;
    const bool act = i < nv && ent >= 0;
    const uint16_t* kp = keys[t];
    if (act && (kList || kp != loaded)) {
      const uint16_t* kr = kp + int64_t(ent) * kFastHd + 4 * j;
      if ((reinterpret_cast<uintptr_t>(kr) & 7u) == 0) {
        uint2 raw[kU];  // every load in flight before the first conversion
#pragma unroll
        for (int u = 0; u < kU; ++u) raw[u] = __ldg(reinterpret_cast<const uint2*>(kr + 8 * u));
#pragma unroll
        for (int u = 0; u < kU; ++u) kv[u] = detail::bf16x4_to_float4(raw[u]);
      } else {
#pragma unroll
        for (int u = 0; u < kU; ++u)
          kv[u] = make_float4(detail::bf16_at(kr + 8 * u), detail::bf16_at(kr + 8 * u + 1),
                              detail::bf16_at(kr + 8 * u + 2), detail::bf16_at(kr + 8 * u + 3));
      }
      loaded = kp;
    }
    // Every thread computes (inactive ones on stale keys, never stored) so that the pair's
    // shuffle always has both lanes.
    const float* qr = qs + r * n_heads * kFastHd + 4 * j;
    const float* wr = wsm + r * n_heads;
    float s = 0.f;
    for (int h = 0; h < n_heads; ++h) {
      const float4* qh = reinterpret_cast<const float4*>(qr + h * kFastHd);
      float p0 = 0.f, p1 = 0.f, p2 = 0.f, p3 = 0.f;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const float4 qv = qh[2 * u];
        // fmaf == __fadd_rn(__fmul_rn(q, k), p) here: every product is exact in fp32 (see the
        // file's head), so the fused add rounds the same sum once.
        p0 = fmaf(qv.x, kv[u].x, p0);
        p1 = fmaf(qv.y, kv[u].y, p1);
        p2 = fmaf(qv.z, kv[u].z, p2);
        p3 = fmaf(qv.w, kv[u].w, p3);
      }
      const float half = __fadd_rn(__fadd_rn(p0, p1), __fadd_rn(p2, p3));
      const float other = __shfl_xor_sync(0xffffffffu, half, 1);
      const float dot = __fadd_rn(half, other);  // (lanes 0-3) + (lanes 4-7), commutative
      const float d = detail::round_bf16(dot);
      const float rl = d < 0.f ? 0.f : d;  // std::max(d, 0.0f)
      s = __fadd_rn(s, detail::round_bf16(__fmul_rn(rl, wr[h])));
    }
    if (j == 0) {
      if (act)
        out[i] = kRound ? detail::round_bf16(s) : s;
      else if (i < wd)
        out[i] = -INFINITY;
    }
  }
}

template <bool kRound>
__global__ void __launch_bounds__(kEnt)
    index_scores_kernel(const float* __restrict__ q, const float* __restrict__ w, int n_heads,
                        int hd, const uint16_t* const* keys, const int32_t* __restrict__ vis,
                        const int32_t* __restrict__ width, int max_width, float* score) {
  detail::pdl_wait();  // PDL: every input comes from an earlier kernel
  detail::pdl_trigger();
  extern __shared__ float ks[];  // [kEnt][hd + 1]
  const int t = blockIdx.y, e0 = blockIdx.x * kEnt, tid = threadIdx.x;
  const int wd = width[t];
  if (e0 >= wd) return;
  const int nv = min(vis[t], wd);
  const int n_load = max(0, min(kEnt, nv - e0));
  if (n_load > 0) {
    // Eight loads in flight before their shared-memory stores (a load per store serialises on
    // memory latency: 128 round trips per thread).
    const uint16_t* kb = keys[t] + int64_t(e0) * hd;
    const int total = n_load * hd;
    int idx = tid;
    for (; idx + 7 * kEnt < total; idx += 8 * kEnt) {
      float v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = detail::bf16_at(kb + idx + u * kEnt);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int i = idx + u * kEnt, e = i / hd;
        ks[e * (hd + 1) + (i - e * hd)] = v[u];
      }
    }
    for (; idx < total; idx += kEnt) {
      const int e = idx / hd, d = idx - e * hd;
      ks[e * (hd + 1) + d] = detail::bf16_at(kb + int64_t(e) * hd + d);
    }
  }
  __syncthreads();
  const int i = e0 + tid;
  float* out = score + int64_t(t) * max_width;
  if (i < nv) {
    const float* qt = q + int64_t(t) * n_heads * hd;
    const float* wt = w + int64_t(t) * n_heads;
    const float* kr = ks + tid * (hd + 1);
    float s = 0.f;
    for (int h = 0; h < n_heads; ++h) {
      const float* qh = qt + int64_t(h) * hd;
      float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int i0 = 0; i0 < hd; i0 += 8) {
#pragma unroll
        for (int L = 0; L < 8; ++L)
          if (i0 + L < hd) p[L] = __fadd_rn(p[L], __fmul_rn(__ldg(qh + i0 + L), kr[i0 + L]));
      }
      const float dot = __fadd_rn(__fadd_rn(__fadd_rn(p[0], p[1]), __fadd_rn(p[2], p[3])),
                                  __fadd_rn(__fadd_rn(p[4], p[5]), __fadd_rn(p[6], p[7])));
      const float d = detail::round_bf16(dot);
      const float r = d < 0.f ? 0.f : d;  // std::max(d, 0.0f)
      s = __fadd_rn(s, detail::round_bf16(__fmul_rn(r, __ldg(wt + h))));
    }
    out[i] = kRound ? detail::round_bf16(s) : s;
  } else if (i < wd) {
    out[i] = -INFINITY;
  }
}

// ---- block-wide selection helpers ----

// Order-preserving key: larger float -> larger key; -0 and +0 map to the same key.
__device__ __forceinline__ uint32_t order_key_bits(uint32_t u) {
  if ((u << 1) == 0) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ uint32_t order_key(float f) {
  return order_key_bits(__float_as_uint(f));
}
// The low 16 bits of the order key of a bf16 value, given its high bits (order_key_bits: a
// positive float's bits with the sign set, a negative float's complemented).
__device__ __forceinline__ uint32_t bf16_low_bits(uint32_t key) {
  return (key & 0x80000000u) ? 0u : 0xffffu;
}
constexpr uint32_t kNegInfKey = ~0xff800000u;  // order_key(-inf)
constexpr uint32_t kPosInfKey = 0xff800000u;   // order_key(+inf)

// Candidate blocks of kVecBlock entries (the model's candidate_block_size) read and write a block
// with vector accesses where it is whole and aligned; any other size takes the scalar loops (the
// same values).
constexpr int kVecBlock = 8;

// The maximum of a whole block of kVecBlock values x then y, in the CPU's order (std::max from
// the left, from -inf).
__device__ __forceinline__ float vec_block_max(const float4& x, const float4& y) {
  const float v[kVecBlock] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kVecBlock; ++i) mx = mx < v[i] ? v[i] : mx;  // std::max(m, v)
  return mx;
}

// max over s[i0, i1) in the CPU's order (std::max from the left; -inf when empty).
__device__ __forceinline__ float block_max(const float* s, int i0, int i1) {
  if (i1 - i0 == kVecBlock && (reinterpret_cast<uintptr_t>(s + i0) & 15u) == 0)
    return vec_block_max(__ldg(reinterpret_cast<const float4*>(s + i0)),
                         __ldg(reinterpret_cast<const float4*>(s + i0) + 1));
  float mx = -INFINITY;
  for (int i = i0; i < i1; ++i) {
    const float v = __ldg(s + i);
    mx = mx < v ? v : mx;
  }
  return mx;
}

struct SelShared {
  uint32_t hist[256];
  uint32_t warp_sums[kSelThreads / 32];
  uint32_t bcast[2];
};

// Exclusive block prefix sum of v (all kSelThreads threads call it); *total gets the sum.
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t v, SelShared& sh,
                                                         uint32_t* total) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  constexpr int kWarps = kSelThreads / 32;
  uint32_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) sh.warp_sums[wid] = x;
  __syncthreads();
  if (wid == 0) {
    uint32_t ws = lane < kWarps ? sh.warp_sums[lane] : 0u;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t y = __shfl_up_sync(0xffffffffu, ws, o);
      if (lane >= o) ws += y;
    }
    if (lane < kWarps) sh.warp_sums[lane] = ws;  // inclusive
  }
  __syncthreads();
  const uint32_t base = wid > 0 ? sh.warp_sums[wid - 1] : 0u;
  *total = sh.warp_sums[kWarps - 1];
  __syncthreads();  // warp_sums is rewritten by the next call
  return base + x - v;
}

// The one-CTA-per-row kernels (fallback): keys read through a functor on every pass.

// The kk-th largest of key(0..n) (1 <= kk <= n): *kth = that key, *need = how many keys equal
// to it belong to the best kk (the rest of the best kk are strictly greater).
template <class Key>
__device__ void radix_select(const Key& key, int n, int kk, SelShared& sh, uint32_t* kth,
                             uint32_t* need) {
  const int tid = threadIdx.x, lane = tid & 31;
  uint32_t prefix = 0, mask = 0, rem = uint32_t(kk);
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += kSelThreads) sh.hist[b] = 0;
    __syncthreads();
    for (int i0 = 0; i0 < n; i0 += kSelThreads) {
      const int i = i0 + tid;
      uint32_t u = 0;
      bool ok = false;
      if (i < n) {
        u = key(i);
        ok = (u & mask) == prefix;
      }
      const uint32_t act = __ballot_sync(0xffffffffu, ok);
      if (ok) {
        // Aggregate equal digits within the warp: ties make many keys share one bin.
        const uint32_t bin = (u >> shift) & 255u;
        const uint32_t same = __match_any_sync(act, bin);
        if (lane == __ffs(same) - 1) atomicAdd(&sh.hist[bin], uint32_t(__popc(same)));
      }
    }
    __syncthreads();
    if (tid == 0) {
      uint32_t cum = 0;
      int digit = 0;
      for (int d = 255; d >= 0; --d) {
        const uint32_t c = sh.hist[d];
        if (cum + c >= rem) {
          digit = d;
          break;
        }
        cum += c;
      }
      sh.bcast[0] = prefix | (uint32_t(digit) << shift);
      sh.bcast[1] = rem - cum;
    }
    __syncthreads();
    prefix = sh.bcast[0];
    rem = sh.bcast[1];
    mask |= 255u << shift;
  }
  *kth = prefix;
  *need = rem;
}

// Walks key(0..n) in index order; emit(i, selected, slot, key) for every i < n, where slot is
// the output position of a selected index (ascending). Stops early once kk are out when
// stop_when_full (the rest would all be unselected).
template <class Key, class Emit>
__device__ void ordered_compact(const Key& key, int n, int kk, uint32_t kth, uint32_t need,
                                bool stop_when_full, SelShared& sh, const Emit& emit) {
  uint32_t base = 0, eq_seen = 0;
  for (int i0 = 0; i0 < n; i0 += kSelThreads) {
    if (stop_when_full && base >= uint32_t(kk)) break;
    const int i = i0 + threadIdx.x;
    const uint32_t u = i < n ? key(i) : 0u;
    const bool gt = i < n && u > kth, eq = i < n && u == kth;
    uint32_t total = 0;
    const uint32_t ex =
        block_exclusive_scan((uint32_t(gt) << 16) | uint32_t(eq), sh, &total);  // <= 512 each
    const uint32_t rem = need > eq_seen ? need - eq_seen : 0u;
    const uint32_t gt_before = ex >> 16, eq_before = ex & 0xffffu;
    const bool sel = gt || (eq && eq_before < rem);
    if (i < n) emit(i, sel, base + gt_before + min(eq_before, rem), u);
    base += (total >> 16) + min(total & 0xffffu, rem);
    eq_seen += total & 0xffffu;
  }
}

struct ScoreKey {
  const float* s;
  __device__ uint32_t operator()(int i) const { return order_key(s[i]); }
};

__global__ void __launch_bounds__(kSelThreads)
    topk_select_row_kernel(const float* __restrict__ score, int max_width,
                           const int32_t* __restrict__ width, int k,
                           const int32_t* __restrict__ vis, int32_t* __restrict__ out,
                           const int32_t* __restrict__ map, int64_t map_cap) {
  detail::pdl_wait();  // PDL: every input comes from an earlier kernel
  detail::pdl_trigger();
  __shared__ SelShared sh;
  const int t = blockIdx.x;
  const int wd = width[t], cl = vis[t];
  const int kk = min(k, wd);
  int32_t* o = out + int64_t(t) * k;
  if (kk > 0) {
    const ScoreKey key{score + int64_t(t) * max_width};
    uint32_t kth = 0, need = 0;
    radix_select(key, wd, kk, sh, &kth, &need);
    ordered_compact(key, wd, kk, kth, need, true, sh,
                    [&](int i, bool sel, uint32_t slot, uint32_t) {
                      if (sel)
                        o[slot] = i >= cl ? -1 : map ? __ldg(map + int64_t(t) * map_cap + i) : i;
                    });
  }
  for (int j = max(kk, 0) + threadIdx.x; j < k; j += kSelThreads) o[j] = -1;
}

struct BlockMaxKey {
  const float* s;
  int width, block_size, pinned;  // pinned = -1 when compress_len == 0
  __device__ uint32_t operator()(int b) const {
    if (b == pinned) return order_key(INFINITY);
    float m = -INFINITY;
    const int lo = b * block_size, hi = min(width, lo + block_size);
    for (int i = lo; i < hi; ++i) {
      const float v = s[i];
      m = m < v ? v : m;  // std::max(m, v)
    }
    return order_key(m);
  }
};

__global__ void __launch_bounds__(kSelThreads)
    candidate_mask_row_kernel(const float* __restrict__ score, int max_width,
                              const int32_t* __restrict__ width, const int32_t* __restrict__ vis,
                              int topk_blocks, int block_size, uint8_t* __restrict__ keep) {
  detail::pdl_wait();  // PDL: every input comes from an earlier kernel
  detail::pdl_trigger();
  __shared__ SelShared sh;
  const int t = blockIdx.x;
  const int wd = width[t], cl = vis[t];
  if (wd <= 0) return;
  const int nb = (wd + block_size - 1) / block_size;
  const int kk = min(topk_blocks, nb);
  const BlockMaxKey key{score + int64_t(t) * max_width, wd, block_size,
                        cl > 0 ? (cl - 1) / block_size : -1};
  uint8_t* kp = keep + int64_t(t) * max_width;
  const auto emit = [&](int b, bool sel, uint32_t, uint32_t u) {
    const uint8_t v = sel && u > kNegInfKey ? 1 : 0;  // kept only with a finite block score
    const int lo = b * block_size, hi = min(wd, lo + block_size);
    for (int i = lo; i < hi; ++i) kp[i] = v;
  };
  if (kk <= 0) {
    for (int b = threadIdx.x; b < nb; b += kSelThreads) emit(b, false, 0, 0);
    return;
  }
  uint32_t kth = 0, need = 0;
  radix_select(key, nb, kk, sh, &kth, &need);
  ordered_compact(key, nb, kk, kth, need, false, sh, emit);
}

// ---- selection rounds (the fast path) ----

// A row's list length after one round of chunks of `chunk` keys: every full chunk gives m
// candidates, the last one min(m, its length).
__host__ __device__ __forceinline__ int64_t next_len(int64_t len, int64_t m, int64_t chunk) {
  const int64_t c = (len + chunk - 1) / chunk;
  const int64_t last = len - (c - 1) * chunk;
  return (c - 1) * m + (last < m ? last : m);
}

enum class SelMode { kTopk, kMask };

struct RoundArgs {
  const float* score;
  int max_width;
  const int32_t* width;
  const int32_t* vis;
  int k;           // topk: k; mask: topk_blocks
  int block_size;  // mask
  int32_t* out;    // topk: [T, k]
  uint8_t* keep;   // mask: [T, max_width]
  // topk (optional): the final slots hold map[t * map_cap + position] instead of the position.
  const int32_t* map;
  int64_t map_cap;
  // mask (optional): the kept visible entries, ascending, into list [T, list_cap], their count
  // into list_n. Selected block number `slot` (in block order) fills list positions
  // [slot * block_size, ...): every selected block before the pinned one (the newest visible
  // entry's) is fully visible, so the kept entries are contiguous; a selected block without a
  // finite score (none in the model) leaves -1 there (index_scores_list scores it -inf).
  int32_t* list;
  int32_t* list_n;
  int64_t list_cap;
  // Round input: nullptr in round 1 of topk (the scores) and of a one-round mask (block maxima
  // computed here); in_idx nullptr: the index is the list position.
  const uint32_t* in_keys;
  const int32_t* in_idx;
  int64_t in_cap;
  uint32_t* out_keys;  // candidates of a non-final round: [T, out_cap]
  int32_t* out_idx;
  int64_t out_cap;
  int round;  // 1-based
  int chunk;  // keys per CTA (kSelThreads x the plan's keys per thread)
};

// KPT consecutive values from src (cnt of them valid; the rest 0), 16-byte loads when aligned.
template <int KPT>
__device__ __forceinline__ void load_run(const uint32_t* src, int cnt, uint32_t (&v)[KPT]) {
  if (cnt >= KPT && (reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
#pragma unroll
    for (int q = 0; q < KPT / 4; ++q) {
      const uint4 x = __ldg(reinterpret_cast<const uint4*>(src) + q);
      v[4 * q] = x.x;
      v[4 * q + 1] = x.y;
      v[4 * q + 2] = x.z;
      v[4 * q + 3] = x.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < KPT; ++j) v[j] = j < cnt ? __ldg(src + j) : 0u;
  }
}

// Cooperative fill of p[0, n) with v (all threads of the block).
__device__ __forceinline__ void block_fill(uint8_t* p, int64_t n, uint8_t v, int nthreads) {
  for (int64_t i = threadIdx.x; i < n; i += nthreads) p[i] = v;
}

// One round for one chunk (blockIdx.x, a.chunk keys) of one row (blockIdx.y). KPT: keys per
// thread, the plan's (a.chunk / kSelThreads), or kSmallKpt for a one-round list of <= kSmallList
// keys whatever the chunk (every warp then takes part). The ordered compaction scans the threads
// in order over consecutive positions either way, so the result does not depend on KPT.
template <SelMode kMode, int KPT>
__global__ void __launch_bounds__(kSelThreads, 1) select_round_kernel(RoundArgs a) {
  // Probe points (each row's first and last chunk; block = row * 1000 + chunk): 0 start, 1 PDL wait
  // returned, 2 keys loaded, 3 / 4 radix passes 1 / 2 done, 5 the compaction's scan done, 6 exit;
  // 7 the keys built (mask: block maxima and keep zeroed), 8 the selected indices loaded.
  UF_PROBE_OPEN_TAG_IF(
      probe,
      kMode == SelMode::kTopk ? uf::cuda::probe::kTagSelectRound : uf::cuda::probe::kTagSelectMask,
      threadIdx.x == 0 && (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1));
#if defined(UF_PROBE) && UF_PROBE
  if (probe) probe->block = blockIdx.y * 1000 + blockIdx.x;  // row * 1000 + chunk
#endif
  UF_PROBE_MARK(probe, 0);
  detail::pdl_wait();  // PDL: every input comes from an earlier kernel
  detail::pdl_trigger();
  UF_PROBE_MARK(probe, 1);
  __shared__ SelShared sh;
  const int t = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
  const int wd = a.width[t];
  if (wd <= 0) {
    if (kMode == SelMode::kTopk && a.round == 1 && c == 0)
      for (int s = tid; s < a.k; s += kSelThreads) a.out[int64_t(t) * a.k + s] = -1;
    if (kMode == SelMode::kMask && a.list != nullptr && a.round == 1 && c == 0 && tid == 0)
      a.list_n[t] = 0;
    return;
  }
  const int bs = a.block_size;
  const int64_t n1 = kMode == SelMode::kTopk ? int64_t(wd) : (int64_t(wd) + bs - 1) / bs;
  const int64_t m = min(int64_t(a.k), n1);  // >= 1: the host runs rounds only for k >= 1
  int64_t len = n1;
  const int64_t chunk = a.chunk;
  for (int r = 1; r < a.round; ++r) {
    if (len <= chunk) return;  // the row finished in an earlier round
    len = next_len(len, m, chunk);
  }
  const bool last = len <= chunk;
  const int64_t lo = int64_t(c) * chunk;
  if (lo >= len) return;
  const int n = int(min(chunk, len - lo));
  const int kk = last ? int(m) : int(min(m, int64_t(n)));
  const int cl = a.vis[t];
  const int p0 = tid * KPT;  // chunk position of key[0]
  // The list's count: 0 unless the pinned block's writer (after the barriers below) sets it.
  if (kMode == SelMode::kMask && last && a.list != nullptr && tid == 0) a.list_n[t] = 0;

  uint32_t key[KPT];
  if (a.in_keys != nullptr) {
    load_run(a.in_keys + int64_t(t) * a.in_cap + lo + p0, n - p0, key);
  } else if (kMode == SelMode::kTopk) {
    load_run(reinterpret_cast<const uint32_t*>(a.score + int64_t(t) * a.max_width + lo + p0),
             n - p0, key);
#pragma unroll
    for (int j = 0; j < KPT; ++j) key[j] = order_key_bits(key[j]);
  } else {
    // One-round mask: the block maxima here (the list is the whole row: lo == 0), keep zeroed.
    const float* s = a.score + int64_t(t) * a.max_width;
    const int pinned = cl > 0 ? (cl - 1) / bs : -1;
    float mx[KPT];
    if (KPT <= 8 && bs == kVecBlock && (p0 + KPT) * bs <= wd &&
        (reinterpret_cast<uintptr_t>(s + p0 * bs) & 15u) == 0) {
      // The thread's KPT whole blocks: every load issued before the first compare.
      float4 v[2 * KPT];
#pragma unroll
      for (int q = 0; q < 2 * KPT; ++q)
        v[q] = __ldg(reinterpret_cast<const float4*>(s + p0 * bs) + q);
#pragma unroll
      for (int j = 0; j < KPT; ++j) mx[j] = vec_block_max(v[2 * j], v[2 * j + 1]);
    } else {
#pragma unroll
      for (int j = 0; j < KPT; ++j) {
        const int b = p0 + j;
        mx[j] = b < n ? block_max(s, b * bs, min(wd, b * bs + bs)) : -INFINITY;
      }
    }
#pragma unroll
    for (int j = 0; j < KPT; ++j) key[j] = p0 + j == pinned ? kPosInfKey : order_key(mx[j]);
    block_fill(a.keep + int64_t(t) * a.max_width, wd, 0, kSelThreads);
    __syncthreads();  // the zeros land before this block's ones
  }
  UF_PROBE_MARK(probe, 7);
  const uint32_t full = KPT == 32 ? 0xffffffffu : (1u << (KPT & 31)) - 1u;
  const uint32_t valid = p0 >= n ? 0u : (n - p0 >= KPT ? full : (1u << (n - p0)) - 1u);

  // The kk-th largest key (kth) and how many keys equal to it are taken (need).
  uint32_t kth = 0, need = 0;
  const bool all = kk >= n;
  if (!all) {
    __shared__ uint32_t wh[kSelWarps * 256];
    // bf16 scores (the model's: index scores, their TP sums and block maxima are all rounded to
    // bf16) have order keys whose low 16 bits follow from the sign bit (0x0000 for a positive
    // float, 0xffff for a negative one): two radix passes then determine the key. Checked over
    // the chunk (any other float runs all four passes); the selection is the same either way.
    bool bf16 = true;
#pragma unroll
    for (int j = 0; j < KPT; ++j)
      bf16 &= !((valid >> j) & 1u) || (key[j] & 0xffffu) == bf16_low_bits(key[j]);
    const int last_shift = __syncthreads_and(bf16) ? 16 : 0;
    UF_PROBE_MARK(probe, 2);
    uint32_t prefix = 0, mask = 0, rem = uint32_t(kk);
    for (int shift = 24; shift >= last_shift; shift -= 8) {
      // Per-warp digit counts (shared-memory atomics; lanes of one warp that hit one bin are
      // serialised by the hardware, cheaper than aggregating them with __match_any_sync first),
      // summed over the warps below: the same counts.
      for (int i = tid; i < kSelWarps * 256; i += kSelThreads) wh[i] = 0;
      __syncthreads();
      uint32_t* my = wh + (tid >> 5) * 256;
#pragma unroll
      for (int j = 0; j < KPT; ++j) {
        const bool ok = ((valid >> j) & 1u) && (key[j] & mask) == prefix;
        if (__ballot_sync(0xffffffffu, ok) == 0) continue;  // warp-uniform
        if (ok) atomicAdd(my + ((key[j] >> shift) & 255u), 1u);
      }
      __syncthreads();
      // Thread d' holds digit 255 - d': the exclusive scan is the count of larger digits.
      uint32_t cnt = 0;
      if (tid < 256)
#pragma unroll
        for (int w = 0; w < kSelWarps; ++w) cnt += wh[w * 256 + 255 - tid];
      uint32_t total = 0;
      const uint32_t before = block_exclusive_scan(cnt, sh, &total);
      if (cnt > 0 && before < rem && before + cnt >= rem) {
        sh.bcast[0] = prefix | (uint32_t(255 - tid) << shift);
        sh.bcast[1] = rem - before;
      }
      __syncthreads();
      prefix = sh.bcast[0];
      rem = sh.bcast[1];
      mask |= 255u << shift;
      UF_PROBE_MARK(probe, shift == 24 ? 3 : 4);
      // hist and bcast are rewritten only after the next pass's first barriers.
    }
    kth = last_shift == 16 ? prefix | bf16_low_bits(prefix) : prefix;
    need = rem;
  }

  // Ordered compaction: one scan of the (greater, equal) counts gives every thread the output
  // slot of its first selected key; equal keys are taken in index order up to need.
  uint32_t gtm = 0, eqm = 0;
#pragma unroll
  for (int j = 0; j < KPT; ++j) {
    const bool v = (valid >> j) & 1u;
    gtm |= uint32_t(v && (all || key[j] > kth)) << j;
    eqm |= uint32_t(v && !all && key[j] == kth) << j;
  }
  uint32_t total = 0;
  const uint32_t ex =
      block_exclusive_scan((uint32_t(__popc(gtm)) << 16) | uint32_t(__popc(eqm)), sh, &total);
  UF_PROBE_MARK(probe, 5);
  const uint32_t gt_before = ex >> 16, eq_before = ex & 0xffffu;
  const uint32_t take_eq = need > eq_before ? min(uint32_t(__popc(eqm)), need - eq_before) : 0u;
  // The thread's selected keys: every greater one and its first take_eq equal ones.
  uint32_t selm = gtm;
  for (uint32_t e = eqm, q = 0; q < take_eq; ++q, e &= e - 1) selm |= e & (0u - e);
  // Their indices (and the final map lookups) loaded before any store: the loads of a thread's
  // keys overlap (one or two L2 round trips, not one a selected key).
  int32_t idx[KPT];
  const int32_t* idx_src = a.in_idx != nullptr ? a.in_idx + int64_t(t) * a.in_cap + lo : nullptr;
#pragma unroll
  for (int j = 0; j < KPT; ++j)
    idx[j] =
        idx_src != nullptr && ((selm >> j) & 1u) ? __ldg(idx_src + p0 + j) : int32_t(lo + p0 + j);
  if (kMode == SelMode::kTopk && last) {
    const int32_t* mp = a.map != nullptr ? a.map + int64_t(t) * a.map_cap : nullptr;
#pragma unroll
    for (int j = 0; j < KPT; ++j)
      idx[j] = idx[j] >= cl                          ? -1
               : mp != nullptr && ((selm >> j) & 1u) ? __ldg(mp + idx[j])
                                                     : idx[j];
  }
  UF_PROBE_MARK(probe, 8);
  uint32_t slot = gt_before + min(eq_before, need);
  int32_t* o = kMode == SelMode::kTopk ? a.out + int64_t(t) * a.k : nullptr;
  uint8_t* kp = kMode == SelMode::kMask ? a.keep + int64_t(t) * a.max_width : nullptr;
#pragma unroll
  for (int j = 0; j < KPT; ++j) {
    if (!((selm >> j) & 1u)) continue;
    if (!last) {
      const int64_t o2 = int64_t(t) * a.out_cap + int64_t(c) * m + slot;
      a.out_keys[o2] = key[j];
      a.out_idx[o2] = idx[j];
    } else if (kMode == SelMode::kTopk) {
      o[slot] = idx[j];  // the map's entry, or -1 past the visible entries
    } else {
      const int i0 = idx[j] * bs, i1 = min(wd, i0 + bs);
      const bool kept = key[j] > kNegInfKey;  // kept only with a finite block score
      int32_t* lo_out =
          a.list != nullptr ? a.list + int64_t(t) * a.list_cap + int64_t(slot) * bs : nullptr;
      if (bs == kVecBlock && i1 - i0 == kVecBlock &&
          (reinterpret_cast<uintptr_t>(kp + i0) & 7u) == 0 &&
          (reinterpret_cast<uintptr_t>(lo_out) & 15u) == 0) {
        if (kept) *reinterpret_cast<uint2*>(kp + i0) = make_uint2(0x01010101u, 0x01010101u);
        if (lo_out != nullptr) {
          int32_t v[kVecBlock];
#pragma unroll
          for (int i = 0; i < kVecBlock; ++i) v[i] = kept && i0 + i < cl ? i0 + i : -1;
          reinterpret_cast<int4*>(lo_out)[0] = make_int4(v[0], v[1], v[2], v[3]);
          reinterpret_cast<int4*>(lo_out)[1] = make_int4(v[4], v[5], v[6], v[7]);
        }
      } else {
        if (kept)
          for (int i = i0; i < i1; ++i) kp[i] = 1;
        if (lo_out != nullptr)
          for (int i = i0; i < i0 + bs; ++i) lo_out[i - i0] = kept && i < min(i1, cl) ? i : -1;
      }
      if (lo_out != nullptr && kept && i0 <= cl - 1 && cl - 1 < i0 + bs)
        a.list_n[t] = int(slot) * bs + (cl - i0);
    }
    ++slot;
  }
  if (kMode == SelMode::kTopk && last)
    for (int s = int(m) + tid; s < a.k; s += kSelThreads) o[s] = -1;
  UF_PROBE_MARK(probe, 6);
}

// Block maxima of the mask's rows as keys (the pinned block +inf) into keys [T, cap], and keep
// zeroed over the row's width: the rounds then read the keys like candidate lists.
__global__ void __launch_bounds__(kBlockMaxThreads)
    block_max_kernel(const float* __restrict__ score, int max_width,
                     const int32_t* __restrict__ width, const int32_t* __restrict__ vis,
                     int block_size, uint32_t* __restrict__ keys, int64_t cap,
                     uint8_t* __restrict__ keep) {
  detail::pdl_wait();  // PDL: every input comes from an earlier kernel
  detail::pdl_trigger();
  const int t = blockIdx.y, tid = threadIdx.x;
  const int wd = width[t], cl = vis[t];
  if (wd <= 0) return;
  const int nb = (wd + block_size - 1) / block_size;
  const int b0 = blockIdx.x * kBlockMaxThreads;
  if (b0 >= nb) return;
  const float* s = score + int64_t(t) * max_width;
  const int b = b0 + tid;
  if (b < nb) {
    const float mx = block_max(s, b * block_size, min(wd, b * block_size + block_size));
    const int pinned = cl > 0 ? (cl - 1) / block_size : -1;
    keys[int64_t(t) * cap + b] = b == pinned ? kPosInfKey : order_key(mx);
  }
  const int64_t e0 = int64_t(b0) * block_size;
  const int64_t e1 = min(int64_t(wd), (int64_t(b0) + kBlockMaxThreads) * block_size);
  block_fill(keep + int64_t(t) * max_width + e0, e1 - e0, 0, kBlockMaxThreads);
}

// ---- mask_scores ----

__global__ void mask_scores_kernel(float* score, const uint8_t* __restrict__ keep, int max_width,
                                   const int32_t* __restrict__ width) {
  detail::pdl_wait();  // PDL: every input comes from an earlier kernel
  detail::pdl_trigger();
  const int t = blockIdx.y;
  const int i = blockIdx.x * kMaskThreads + threadIdx.x;
  if (i >= width[t]) return;
  const int64_t o = int64_t(t) * max_width + i;
  if (!keep[o]) score[o] = -INFINITY;
}

// ---- host planning ----

// The rounds for lists of at most n keys selecting m: rounds, chunks per round (the grid), the
// largest candidate list (elements per row).
struct SelPlan {
  int kpt = kMinKpt;  // keys per thread
  int rounds = 1;
  int64_t chunks[kMaxRounds] = {};
  int64_t cap = 0;
  int64_t chunk() const { return int64_t(kSelThreads) * kpt; }  // keys per CTA
};

// m <= kMaxFastK (the callers check): keys per thread, the fewest from kMinKpt whose chunk holds
// 4 m.
SelPlan plan_select(int64_t n, int64_t m) {
  SelPlan p;
  while (m > p.chunk() / 4) p.kpt *= 2;
  require(p.kpt <= kMaxKpt, "indexer selection: k = %lld above the rounds' %d", (long long)m,
          kMaxFastK);
  const int64_t chunk = p.chunk();
  int64_t len = n;
  p.chunks[0] = std::max<int64_t>(1, (len + chunk - 1) / chunk);
  while (len > chunk) {
    len = next_len(len, m, chunk);
    p.cap = std::max(p.cap, len);
    require(p.rounds < kMaxRounds, "indexer selection: %lld keys need too many rounds",
            (long long)n);
    p.chunks[p.rounds++] = (len + chunk - 1) / chunk;
  }
  return p;
}

constexpr size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Workspace layout: [block-max keys (mask with more than one round)] [list A keys, idx]
// [list B keys, idx] (B only with three rounds or more). Round r writes list A when r is odd.
struct WsLayout {
  SelPlan plan;
  int64_t pcap = 0, cap = 0;  // elements per row
  size_t p_off = 0, a_keys = 0, a_idx = 0, b_keys = 0, b_idx = 0, total = 0;
};

WsLayout ws_layout(int T, int64_t n, int64_t m, bool block_keys) {
  WsLayout w;
  w.plan = plan_select(n, m);
  if (w.plan.rounds == 1) return w;
  w.cap = int64_t(align_up(size_t(w.plan.cap), 64));
  const size_t list = align_up(size_t(T) * size_t(w.cap) * 4, 256);
  size_t off = 0;
  if (block_keys) {
    w.pcap = int64_t(align_up(size_t(n), 64));
    w.p_off = off;
    off += align_up(size_t(T) * size_t(w.pcap) * 4, 256);
  }
  w.a_keys = off;
  w.a_idx = off + list;
  off += 2 * list;
  if (w.plan.rounds >= 3) {
    w.b_keys = off;
    w.b_idx = off + list;
    off += 2 * list;
  }
  w.total = off;
  return w;
}

// Whether the rounds serve this call (else: one CTA per row).
bool fast_select(int T, int64_t m, const WsLayout& w, const void* workspace) {
  return T <= 65535 && m <= kMaxFastK && (w.total == 0 || workspace != nullptr);
}

// list_len: the longest first-round list of a row (topk: max_width; mask: its blocks).
template <SelMode kMode>
void run_rounds(RoundArgs a, int T, const WsLayout& w, int64_t list_len, void* workspace,
                cudaStream_t stream) {
  auto* base = static_cast<uint8_t*>(workspace);
  auto list_keys = [&](int r) {
    return reinterpret_cast<uint32_t*>(base + (r % 2 == 1 ? w.a_keys : w.b_keys));
  };
  auto list_idx = [&](int r) {
    return reinterpret_cast<int32_t*>(base + (r % 2 == 1 ? w.a_idx : w.b_idx));
  };
  for (int r = 1; r <= w.plan.rounds; ++r) {
    if (r == 1) {
      a.in_keys = kMode == SelMode::kMask && w.plan.rounds > 1
                      ? reinterpret_cast<const uint32_t*>(base + w.p_off)
                      : nullptr;
      a.in_idx = nullptr;
      a.in_cap = w.pcap;
    } else {
      a.in_keys = list_keys(r - 1);
      a.in_idx = list_idx(r - 1);
      a.in_cap = w.cap;
    }
    const bool last = r == w.plan.rounds;
    a.out_keys = last ? nullptr : list_keys(r);
    a.out_idx = last ? nullptr : list_idx(r);
    a.out_cap = w.cap;
    a.round = r;
    a.chunk = int(w.plan.chunk());
    const dim3 grid(unsigned(w.plan.chunks[r - 1]), unsigned(T));
    const int kpt = w.plan.rounds == 1 && list_len <= kSmallList ? kSmallKpt : w.plan.kpt;
    if (kpt == 8)
      detail::launch_pdl(select_round_kernel<kMode, 8>, grid, dim3(kSelThreads), 0, stream, a);
    else if (kpt == 16)
      detail::launch_pdl(select_round_kernel<kMode, 16>, grid, dim3(kSelThreads), 0, stream, a);
    else
      detail::launch_pdl(select_round_kernel<kMode, 32>, grid, dim3(kSelThreads), 0, stream, a);
    UF_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

void index_scores(const float* q, const float* w, int T, int n_heads, int head_dim,
                  const uint16_t* const* keys, const int32_t* vis, const int32_t* width,
                  int max_width, float* score, cudaStream_t stream, bool round_sum) {
  require(T >= 0 && T <= 65535 && n_heads > 0 && head_dim > 0 && head_dim <= kMaxIndexHeadDim &&
              max_width >= 0,
          "index_scores: unsupported shape T=%d n_heads=%d head_dim=%d max_width=%d "
          "(T <= 65535, head_dim <= %d)",
          T, n_heads, head_dim, max_width, kMaxIndexHeadDim);
  if (T == 0 || max_width == 0) return;
  const size_t row_smem = size_t(n_heads) * (kFastHd + 1) * sizeof(float);
  const int64_t chunks = (int64_t(max_width) + kFastEnt - 1) / kFastEnt;
  if (head_dim == kFastHd &&
      index_scores_mma(q, w, T, n_heads, keys, vis, width, max_width, score, stream, round_sum))
    return;
  if (head_dim == kFastHd && row_smem <= kFastSmem && chunks <= 65535) {
    // Rows per CTA: up to 8 (one key load serves them all), fewer when that would leave the
    // GPU short of CTAs (about 4 per SM at 132 SMs). The result of a row never depends on it.
    const int64_t want = (int64_t(T) * chunks) / 528;
    const int rows = int(std::max<int64_t>(
        1, std::min<int64_t>({int64_t(T), kFastMaxRows, int64_t(kFastSmem / row_smem), want})));
    const dim3 grid(unsigned((T + rows - 1) / rows), unsigned(chunks));
    const size_t smem = size_t(rows) * row_smem;
    if (round_sum)
      detail::launch_pdl(index_scores_hd128_kernel<true>, grid, dim3(kFastThreads), smem, stream, q,
                         w, T, n_heads, rows, keys, vis, width, max_width, score,
                         static_cast<const int32_t*>(nullptr));
    else
      detail::launch_pdl(index_scores_hd128_kernel<false>, grid, dim3(kFastThreads), smem, stream,
                         q, w, T, n_heads, rows, keys, vis, width, max_width, score,
                         static_cast<const int32_t*>(nullptr));
  } else {
    const dim3 grid(unsigned((max_width + kEnt - 1) / kEnt), unsigned(T));
    const size_t smem = size_t(kEnt) * size_t(head_dim + 1) * sizeof(float);
    if (round_sum)
      index_scores_kernel<true><<<grid, kEnt, smem, stream>>>(q, w, n_heads, head_dim, keys, vis,
                                                              width, max_width, score);
    else
      index_scores_kernel<false><<<grid, kEnt, smem, stream>>>(q, w, n_heads, head_dim, keys, vis,
                                                               width, max_width, score);
  }
  UF_CUDA_CHECK(cudaGetLastError());
}

void index_scores_list(const float* q, const float* w, int T, int n_heads, int head_dim,
                       const uint16_t* const* keys, const EntryList& list, float* score,
                       cudaStream_t stream, bool round_sum) {
  const size_t row_smem = size_t(n_heads) * (kFastHd + 1) * sizeof(float);
  const int64_t chunks = (list.cap + kFastEnt - 1) / kFastEnt;
  require(T >= 0 && T <= 65535 && head_dim == kFastHd && row_smem <= kFastSmem && list.cap >= 0 &&
              list.cap <= INT32_MAX && chunks <= 65535,
          "index_scores_list: unsupported shape T=%d n_heads=%d head_dim=%d cap=%lld (T <= "
          "65535, head_dim %d)",
          T, n_heads, head_dim, (long long)list.cap, kFastHd);
  if (T == 0 || list.cap == 0) return;
  const int cap = int(list.cap);
  // Prefill calls on the tensor cores (the same bits for the model's operands; decode rows keep
  // this file's kernel, whose timing the decode step was measured with).
  if (T > kMaxDecodeRows && index_scores_mma_list(q, w, T, n_heads, keys, list.entries, list.n, cap,
                                                  score, stream, round_sum))
    return;
  // One row per CTA; the list's length is the row's width and its visible count.
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(chunks));
  if (round_sum)
    detail::launch_pdl(index_scores_hd128_kernel<true, true>, grid, dim3(kFastThreads), row_smem,
                       stream, q, w, T, n_heads, 1, keys, list.n, list.n, cap, score, list.entries);
  else
    detail::launch_pdl(index_scores_hd128_kernel<false, true>, grid, dim3(kFastThreads), row_smem,
                       stream, q, w, T, n_heads, 1, keys, list.n, list.n, cap, score, list.entries);
  UF_CUDA_CHECK(cudaGetLastError());
}

size_t candidate_mask_workspace_bytes(int T, int max_width, int topk_blocks, int block_size) {
  if (T <= 0 || max_width <= 0 || block_size <= 0 || topk_blocks <= 0) return 0;
  const int64_t nb = (int64_t(max_width) + block_size - 1) / block_size;
  const int64_t m = std::min<int64_t>(topk_blocks, nb);
  if (m > kMaxFastK) return 0;
  return ws_layout(T, nb, m, true).total;
}

bool candidate_mask(const float* score, int T, int max_width, const int32_t* width,
                    const int32_t* vis, int topk_blocks, int block_size, uint8_t* keep,
                    cudaStream_t stream, void* workspace, const EntryListOut* list) {
  require(T >= 0 && max_width >= 0 && block_size > 0,
          "candidate_mask: unsupported T=%d max_width=%d block_size=%d", T, max_width, block_size);
  if (T == 0 || max_width == 0) return false;
  const int64_t nb = (int64_t(max_width) + block_size - 1) / block_size;
  const int64_t m = std::min<int64_t>(topk_blocks, nb);
  const WsLayout w = m >= 1 && m <= kMaxFastK ? ws_layout(T, nb, m, true) : WsLayout{};
  if (m < 1 || !fast_select(T, m, w, workspace)) {
    candidate_mask_row_kernel<<<unsigned(T), kSelThreads, 0, stream>>>(
        score, max_width, width, vis, topk_blocks, block_size, keep);
    UF_CUDA_CHECK(cudaGetLastError());
    return false;
  }
  if (list != nullptr)
    require(list->entries != nullptr && list->n != nullptr && list->cap >= m * block_size,
            "candidate_mask: a list of %lld entries a row cannot take %lld blocks of %d",
            (long long)list->cap, (long long)m, block_size);
  if (w.plan.rounds > 1) {
    const dim3 grid(unsigned((nb + kBlockMaxThreads - 1) / kBlockMaxThreads), unsigned(T));
    detail::launch_pdl(block_max_kernel, grid, dim3(kBlockMaxThreads), 0, stream, score, max_width,
                       width, vis, block_size,
                       reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(workspace) + w.p_off),
                       w.pcap, keep);
    UF_CUDA_CHECK(cudaGetLastError());
  }
  RoundArgs a{};
  a.score = score;
  a.max_width = max_width;
  a.width = width;
  a.vis = vis;
  a.k = topk_blocks;
  a.block_size = block_size;
  a.keep = keep;
  if (list != nullptr) {
    a.list = list->entries;
    a.list_n = list->n;
    a.list_cap = list->cap;
  }
  run_rounds<SelMode::kMask>(a, T, w, nb, workspace, stream);
  return list != nullptr;
}

void mask_scores(float* score, const uint8_t* keep, int T, int max_width, const int32_t* width,
                 cudaStream_t stream) {
  require(T >= 0 && T <= 65535 && max_width >= 0,
          "mask_scores: unsupported T=%d max_width=%d (T <= 65535)", T, max_width);
  if (T == 0 || max_width == 0) return;
  const dim3 grid(unsigned((max_width + kMaskThreads - 1) / kMaskThreads), unsigned(T));
  detail::launch_pdl(mask_scores_kernel, grid, dim3(kMaskThreads), 0, stream, score, keep,
                     max_width, width);
  UF_CUDA_CHECK(cudaGetLastError());
}

size_t topk_select_workspace_bytes(int T, int max_width, int k) {
  if (T <= 0 || max_width <= 0 || k <= 0) return 0;
  const int64_t m = std::min<int64_t>(k, max_width);
  if (m > kMaxFastK) return 0;
  return ws_layout(T, max_width, m, false).total;
}

void topk_select(const float* score, int T, int max_width, const int32_t* width, int k,
                 const int32_t* vis, int32_t* out, cudaStream_t stream, void* workspace,
                 const int32_t* index_map, int64_t map_cap) {
  require(T >= 0 && max_width >= 0 && k >= 0, "topk_select: unsupported T=%d max_width=%d k=%d", T,
          max_width, k);
  if (T == 0 || k == 0) return;
  const int64_t m = std::min<int64_t>(k, max_width);
  const WsLayout w = m >= 1 && m <= kMaxFastK ? ws_layout(T, max_width, m, false) : WsLayout{};
  if (m < 1 || !fast_select(T, m, w, workspace)) {
    topk_select_row_kernel<<<unsigned(T), kSelThreads, 0, stream>>>(score, max_width, width, k, vis,
                                                                    out, index_map, map_cap);
    UF_CUDA_CHECK(cudaGetLastError());
    return;
  }
  RoundArgs a{};
  a.score = score;
  a.max_width = max_width;
  a.width = width;
  a.vis = vis;
  a.k = k;
  a.out = out;
  a.map = index_map;
  a.map_cap = map_cap;
  run_rounds<SelMode::kTopk>(a, T, w, max_width, workspace, stream);
}

}  // namespace uf::cuda
