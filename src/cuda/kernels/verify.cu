// Speculative-decoding verification on the device: the port of src/sampling/{transform,verify}.cpp
// described in src/cuda/verify.h.
//
// cluster_transform_kernel / cluster_draft_slot_kernel (the default): a row over the 16 (or 8)
// CTAs of a thread-block cluster, described at their definition; the single-CTA kernels below
// are the fallback (a vocab whose slice does not fit in shared memory) and the benchmark's
// comparison (set_single_cta_transform_for_bench).
// transform_kernel: one 1024-thread block per row. max (order-free), e = exp((l - m) / T) in
// double rounded to float; top-k: the k-th largest value by radix select over the float bits
// (counts only, exact); top-p: top_p_cut_radix below (candidates from a coarse histogram,
// radix-sorted in the plan's scratch, walked by warp 0); then the fixed-order sums of row_ops.h
// on threads 0..255 (lane = thread) and the normalisation. (The bisection + bitonic-sort top-p of
// sessions 3-5 took 32 ms on a flat row; this one 1.8 ms.)
// verify_kernel: one 256-thread block (lane = thread); every thread follows the same control flow
// (all values it branches on are identical in every thread), thread 0 does the sequential walks.
// All float arithmetic that the CPU does in a fixed order uses the explicit _rn intrinsics so that
// no FMA contraction or fast-math flag can change a rounding.

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>

#include "cuda/cuda_check.h"
#include "cuda/verify.h"
#include "sampling/row_ops.h"

namespace uf::cuda {
namespace {

using sampling::kLanes;
using sampling::kMaxDraft;
using sampling::VerifyDraws;
using sampling::VerifyResult;

constexpr int kTransformThreads = 1024;
constexpr int kMaxRows = 2 * kMaxDraft + 1;
static_assert(kLanes == 256, "the device lanes mirror row_ops.h's 256 lanes");

// Lane sums of row_ops.h's chunk_sums (threads 0..255) and the pairwise tree; returns the tree
// total in every thread. With `last`, s_last[lane] = the last index of the lane's chunk with a
// positive weight (-1 if none). Must be called by every thread of the block.
template <typename Weight>
__device__ float lane_sums(const Weight& weight, int64_t n, float* s_lane, float* s_tree,
                           int* s_last) {
  __syncthreads();  // the shared arrays may still be read from a previous call
  const int tid = threadIdx.x;
  if (tid < kLanes) {
    const int64_t chunk = (n + kLanes - 1) / kLanes;
    const int64_t begin = tid * chunk;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
    float s = 0.0f;
    int last = -1;
    for (int64_t x = begin; x < end; ++x) {
      const float w = weight(x);
      s = __fadd_rn(s, w);
      if (w > 0.0f) last = int(x);
    }
    s_lane[tid] = s;
    s_tree[tid] = s;
    if (s_last != nullptr) s_last[tid] = last;
  }
  __syncthreads();
  for (int stride = kLanes / 2; stride > 0; stride /= 2) {
    if (tid < stride) s_tree[tid] = __fadd_rn(s_tree[tid], s_tree[tid + stride]);
    __syncthreads();
  }
  return s_tree[0];
}

struct SharedRow {
  float lane[kLanes];
  float tree[kLanes];
  int last[kLanes];
  int pick;
  float cut;
  int count;
  float fval;
  int ival;
};

// row_ops.h's inverse_cdf_pick; the result in every thread.
template <typename Weight>
__device__ int32_t block_inverse_cdf_pick(const Weight& weight, int64_t n, float u, SharedRow& sh) {
  const float total = lane_sums(weight, n, sh.lane, sh.tree, sh.last);
  if (threadIdx.x == 0) {
    int32_t pick = -1;
    if (total > 0.0f) {
      const float target = __fmul_rn(u, total);
      const int64_t chunk = (n + kLanes - 1) / kLanes;
      float running = 0.0f;
      int32_t last_positive = -1;
      for (int lane = 0; lane < kLanes; ++lane) {
        const float s = sh.lane[lane];
        if (!(s > 0.0f)) continue;
        const int64_t begin = lane * chunk;
        const int64_t end = begin + chunk < n ? begin + chunk : n;
        if (__fadd_rn(running, s) >= target) {
          float r = running;
          for (int64_t x = begin; x < end; ++x) {
            const float w = weight(x);
            if (!(w > 0.0f)) continue;
            r = __fadd_rn(r, w);
            last_positive = int32_t(x);
            if (r >= target) break;
          }
          break;  // the walk reached the target, or rounding fell short: the last positive seen
        }
        running = __fadd_rn(running, s);
        last_positive = sh.last[lane];
      }
      pick = last_positive;
    }
    sh.pick = pick;
  }
  __syncthreads();
  return sh.pick;
}

// ---- transform -------------------------------------------------------------------------------

// exp in double rounded to float: the correctly rounded expf but for ~2^-28 of arguments.
__device__ __forceinline__ float exp_rounded(float z) { return float(exp(double(z))); }

__global__ void exp_of_bits_kernel(uint32_t first_bits, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = exp_rounded(__uint_as_float(first_bits + uint32_t(i)));
  }
}

struct ArgMax {
  float v;
  int i;
};

__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

// Block-wide argmax (lowest index on ties) / max over 1024 threads; the result in every thread.
__device__ ArgMax block_argmax(ArgMax a, ArgMax* s_warp) {
  for (int o = 16; o > 0; o >>= 1) {
    ArgMax b{__shfl_xor_sync(0xffffffffu, a.v, o), __shfl_xor_sync(0xffffffffu, a.i, o)};
    a = better(a, b);
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) s_warp[threadIdx.x >> 5] = a;
  __syncthreads();
  ArgMax r = s_warp[0];
  for (int w = 1; w < int(blockDim.x >> 5); ++w) r = better(r, s_warp[w]);
  return r;
}

// Values here are probabilities (non-negative floats, no NaN): their bit patterns order like
// their values, so selections work on the bits.

// How many of p[0..n) have bits >= t; the result in every thread.
__device__ int count_at_least(const float* p, int n, uint32_t t, SharedRow& sh) {
  __syncthreads();  // sh.count may still be read from a previous call
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  int c = 0;
  for (int x = threadIdx.x; x < n; x += blockDim.x) c += __float_as_uint(p[x]) >= t ? 1 : 0;
  atomicAdd(&sh.count, c);
  __syncthreads();
  return sh.count;
}

// ---- top-p / top-k selection (radix) ------------------------------------------------------------
//
// The fast path of the top-p cut. Exact because the walk sees the same values in the same order as
// the CPU's: any candidate set "all survivors with bits >= t" is a prefix of the descending order
// (ties included), and the walk over a prefix that reaches the limit stops where the full walk
// stops. So t only has to be small enough, and is chosen from a coarse histogram:
//   1. one pass over the row: a 2048-bin histogram of the survivors' top 12 bits (1/16 binade
//      each) and their largest bits;
//   2. t = the lower edge of the first bin (from the top) where count x lower edge (a lower bound
//      of the bin's mass) reaches 1.02 x limit. The CPU's sequential fp32 sum of c <= 2^17 values
//      is at least (1 - c 2^-24) >= 0.992 of the exact one, so its walk reaches the limit inside
//      the candidates; if it does not anyway (it cannot, but nothing depends on it), a second
//      attempt takes every survivor;
//   3. the candidates are compacted into the scratch (warp-aggregated atomics) and sorted by an
//      LSD radix sort on key = max_bits - bits (ascending key = descending value), 8-bit digits,
//      only as many passes as the key range needs (3 for a flat row), each pass stable: per-warp
//      ranking with __match_any_sync, then an exclusive scan of the per-warp digit counts;
//   4. warp 0 walks the sorted values: every lane sums all 32 values of a chunk in order
//      (shuffles), so the fp32 chain is the CPU's, with the next chunks' loads in flight.
// The sort needs a second buffer of c floats: the scratch's second half when 2c fits, else the
// probs row itself, which is recomputed afterwards (the same exp of the same logits).

constexpr int kCoarseBins = 2048;  // bits >> 19: 1/16 binade; p <= 1 uses bins <= 2032
constexpr int kRadixItems = 8;     // values per thread per tile of the radix sort

struct SortShared {
  union {
    int warp_count[32][256];  // radix sort: per-warp digit counts, then their offsets
    int coarse[kCoarseBins];  // survivors per coarse bin
  };
  int hist[256];
  int base[256];
  int count;
  unsigned umin;
  unsigned umax;
  unsigned t;
  int sel_digit;
  int sel_before;
  float cut;
  int done;
};

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// h[bin] += 1 for each lane with bin >= 0, one shared atomic per distinct bin of the warp (flat
// rows put most values in one bin: plain atomics would serialise on it). All 32 lanes must call.
__device__ __forceinline__ void warp_aggregated_increment(int* h, int bin) {
  const unsigned peers = __match_any_sync(0xffffffffu, bin);
  if (bin >= 0 && int(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&h[bin], __popc(peers));
}

// Warp 0 (all 32 lanes): bins nb-1, nb-2, ..., 0 of weight w(bin) visited from the top; returns
// the first bin at which the running total reaches target (-1 if none) and, in *before, the total
// of the bins above it. nb must be a multiple of 32. Same result in every lane.
template <typename T, typename W>
__device__ int warp_first_from_top(int nb, const W& w, T target, T* before) {
  const int lane = threadIdx.x & 31;
  const int span = nb / 32;
  T local = T(0);
  for (int i = 0; i < span; ++i) local += w(nb - 1 - (lane * span + i));
  T incl = local;
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  const unsigned hit = __ballot_sync(0xffffffffu, incl >= target);
  if (hit == 0) return -1;
  const int src = __ffs(hit) - 1;
  int bin = -1;
  T run = incl - local;  // exclusive prefix of this lane
  if (lane == src) {
    for (int i = 0; i < span; ++i) {
      const int b = nb - 1 - (lane * span + i);
      const T nxt = run + w(b);
      if (nxt >= target) {
        bin = b;
        break;
      }
      run = nxt;
    }
  }
  bin = __shfl_sync(0xffffffffu, bin, src);
  *before = __shfl_sync(0xffffffffu, run, src);
  return bin;
}

// Clamped bits: NaN counts as +inf, as the bisection over [0, 0x7F800000] did.
__device__ __forceinline__ uint32_t sel_bits(float v) {
  const uint32_t b = __float_as_uint(v);
  return b < 0x7F800000u ? b : 0x7F800000u;
}

// The bits of the k-th largest of p[0..n) (1 <= k <= n), with multiplicity: the same value as the
// bisection (the largest t with count(bits >= t) >= k), by a 4-pass radix select, 8 bits a pass.
// Must be called by the whole block.
__device__ uint32_t kth_largest_bits_radix(const float* p, int n, int k, SortShared& ss) {
  const int tid = threadIdx.x, nt = blockDim.x;
  uint32_t prefix = 0;
  int kk = k;  // rank still wanted among the values that match the prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    __syncthreads();
    for (int i = tid; i < 256; i += nt) ss.hist[i] = 0;
    __syncthreads();
    const uint32_t high_mask = shift == 24 ? 0u : ~((1u << (shift + 8)) - 1u);
    for (int x0 = 0; x0 < n; x0 += nt) {
      const int x = x0 + tid;
      int d = -1;
      if (x < n) {
        const uint32_t b = sel_bits(p[x]);
        if ((b & high_mask) == prefix) d = int((b >> shift) & 255u);
      }
      warp_aggregated_increment(ss.hist, d);
    }
    __syncthreads();
    if (tid < 32) {
      int before = 0;
      const int d = warp_first_from_top<int>(
          256, [&](int b) { return ss.hist[b]; }, kk, &before);
      if (tid == 0) {
        ss.sel_digit = d < 0 ? 0 : d;  // d >= 0 whenever 1 <= k <= n
        ss.sel_before = before;
      }
    }
    __syncthreads();
    prefix |= uint32_t(ss.sel_digit) << shift;
    kk -= ss.sel_before;
  }
  return prefix;
}

// Sorts a[0..c) descending by value, keys top - bits (which must fit in 8 * passes bits), with b
// (c floats) as the other buffer; returns the buffer holding the result. Whole block, blockDim
// a multiple of 32 up to 1024.
__device__ float* radix_sort_desc(float* a, float* b, int c, uint32_t top, int passes,
                                  SortShared& ss) {
  const int tid = threadIdx.x, nt = blockDim.x;
  const int warp = tid >> 5, lane = tid & 31, warps = nt >> 5;
  const int tile = warps * 32 * kRadixItems;
  const unsigned lt = lanemask_lt();
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = 8 * pass;
    __syncthreads();
    for (int i = tid; i < 256; i += nt) ss.hist[i] = 0;
    __syncthreads();
    for (int x0 = 0; x0 < c; x0 += nt) {
      const int x = x0 + tid;
      const int d = x < c ? int(((top - __float_as_uint(a[x])) >> shift) & 255u) : -1;
      warp_aggregated_increment(ss.hist, d);
    }
    __syncthreads();
    if (tid < 32) {  // exclusive scan of the digit counts: lane l owns digits 8l..8l+7
      int v[8], s = 0;
      for (int i = 0; i < 8; ++i) {
        v[i] = ss.hist[lane * 8 + i];
        s += v[i];
      }
      int incl = s;
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      int run = incl - s;
      for (int i = 0; i < 8; ++i) {
        ss.base[lane * 8 + i] = run;
        run += v[i];
      }
    }
    for (int t0 = 0; t0 < c; t0 += tile) {
      // Per-warp stable ranks: element order within the tile is (warp, item, lane).
      __syncthreads();  // previous tile's offsets read; base written
      for (int i = lane; i < 256; i += 32) ss.warp_count[warp][i] = 0;
      __syncwarp();
      float v[kRadixItems];
      int d[kRadixItems], r[kRadixItems];
#pragma unroll
      for (int i = 0; i < kRadixItems; ++i) {
        const int idx = t0 + (warp * kRadixItems + i) * 32 + lane;
        const bool valid = idx < c;
        v[i] = valid ? a[idx] : 0.0f;
        d[i] = valid ? int(((top - __float_as_uint(v[i])) >> shift) & 255u) : 256;
        const unsigned peers = __match_any_sync(0xffffffffu, d[i]);
        r[i] = valid ? ss.warp_count[warp][d[i]] + __popc(peers & lt) : 0;
        __syncwarp();
        if (valid && lane == __ffs(peers) - 1) ss.warp_count[warp][d[i]] += __popc(peers);
        __syncwarp();
      }
      __syncthreads();
      for (int dg = tid; dg < 256; dg += nt) {  // digit dg: offsets of each warp's run, in order
        int run = ss.base[dg];
        for (int w = 0; w < warps; ++w) {
          const int cw = ss.warp_count[w][dg];
          ss.warp_count[w][dg] = run;
          run += cw;
        }
        ss.base[dg] = run;
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kRadixItems; ++i) {
        if (d[i] < 256) b[ss.warp_count[warp][d[i]] + r[i]] = v[i];
      }
    }
    float* tmp = a;
    a = b;
    b = tmp;
  }
  __syncthreads();
  return a;
}

// transform.cpp's top_p_cut walk over s[0..c) (sorted descending) by warp 0: sets ss.cut to the
// value of the group at which the fp32 running sum (in this order) reaches limit, or s[c-1] when
// it never does; ss.done = reached || final. The running sum is monotone, so the group is the
// one holding the first element after which the sum is >= limit. Every lane adds every value (the
// same chain in every lane), so no broadcast is needed; elements past c add +0, which leaves the
// (non-negative) sum unchanged.
__device__ void walk_sorted(const float* s, int c, float limit, bool final, SortShared& ss) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  float cut;
  int done;
  if (!(0.0f < limit)) {  // the CPU's walk does not start: the largest value
    cut = s[0];
    done = 1;
  } else {
    constexpr int kDepth = 4;  // chunks of 32 per step; the next step's loads are issued first
    float S = 0.0f;
    int hit = -1;
    float v[kDepth];
#pragma unroll
    for (int q = 0; q < kDepth; ++q) {
      const int i = q * 32 + lane;
      v[q] = i < c ? s[i] : 0.0f;
    }
    for (int base = 0; base < c && hit < 0; base += 32 * kDepth) {
      float nv[kDepth];
#pragma unroll
      for (int q = 0; q < kDepth; ++q) {
        const int i = base + 32 * kDepth + q * 32 + lane;
        nv[q] = i < c ? s[i] : 0.0f;
      }
#pragma unroll
      for (int q = 0; q < kDepth; ++q) {
        if (hit < 0) {
          const float s0 = S;
#pragma unroll
          for (int k = 0; k < 32; ++k) S = __fadd_rn(S, __shfl_sync(0xffffffffu, v[q], k));
          if (S >= limit) {  // reached inside this chunk: find the element
            S = s0;
            for (int k = 0; k < 32; ++k) {
              S = __fadd_rn(S, __shfl_sync(0xffffffffu, v[q], k));
              if (S >= limit) {
                hit = base + q * 32 + k;
                break;
              }
            }
          }
        }
      }
#pragma unroll
      for (int q = 0; q < kDepth; ++q) v[q] = nv[q];
    }
    if (hit >= 0) {
      cut = s[hit];
      done = 1;
    } else {
      cut = s[c - 1];
      done = final ? 1 : 0;
    }
  }
  if (lane == 0) {
    ss.cut = cut;
    ss.done = done;
  }
}

// The top-p cut of transform.cpp (top_p_cut over the survivors p[x] >= kcut, n of them, with
// limit = top_p * zk), the fast way described above. s: scratch of cap >= n floats. May overwrite
// p (returns true then; the caller recomputes it). recompute(): rewrites p exactly (whole block).
template <typename Recompute>
__device__ float top_p_cut_radix(float* p, int vocab, float kcut, int n, float limit, float* s,
                                 int cap, SortShared& ss, bool* clobbered,
                                 const Recompute& recompute) {
  const int tid = threadIdx.x, nt = blockDim.x;
  const uint32_t kbits = __float_as_uint(kcut);
  // 1. coarse histogram of the survivors and their largest bits
  __syncthreads();
  for (int i = tid; i < kCoarseBins; i += nt) ss.coarse[i] = 0;
  if (tid == 0) ss.umax = 0;
  __syncthreads();
  uint32_t mx = 0;
  for (int x0 = 0; x0 < vocab; x0 += nt) {
    const int x = x0 + tid;
    int bin = -1;
    if (x < vocab) {
      const float v = p[x];
      if (v >= kcut) {
        const uint32_t b = __float_as_uint(v);
        bin = int(min(b >> 19, uint32_t(kCoarseBins - 1)));
        mx = max(mx, b);
      }
    }
    warp_aggregated_increment(ss.coarse, bin);
  }
  mx = __reduce_max_sync(0xffffffffu, mx);
  if ((tid & 31) == 0) atomicMax(&ss.umax, mx);
  __syncthreads();
  // 2. the candidate threshold
  if (tid < 32) {
    const float target = __fmul_rn(limit, 1.02f);
    float before = 0.0f;
    const int bin = warp_first_from_top<float>(
        kCoarseBins,
        [&](int b) { return float(ss.coarse[b]) * __uint_as_float(uint32_t(b) << 19); }, target,
        &before);
    if (tid == 0) {
      uint32_t t = bin < 0 ? kbits : uint32_t(bin) << 19;
      if (!(0.0f < limit)) t = ss.umax;  // the walk takes only the largest value
      ss.t = max(t, kbits);
    }
  }
  __syncthreads();
  const uint32_t top = ss.umax;
  uint32_t t = ss.t;
  *clobbered = false;
  for (int attempt = 0;; ++attempt) {
    const bool final = t == kbits;
    // 3. compaction and sort
    __syncthreads();
    if (tid == 0) {
      ss.count = 0;
      ss.umin = 0xFFFFFFFFu;
    }
    __syncthreads();
    uint32_t mn = 0xFFFFFFFFu;
    for (int x0 = 0; x0 < vocab; x0 += nt) {
      const int x = x0 + tid;
      float v = 0.0f;
      bool keep = false;
      if (x < vocab) {
        v = p[x];
        keep = v >= kcut && __float_as_uint(v) >= t;
      }
      const unsigned ballot = __ballot_sync(0xffffffffu, keep);
      int at = 0;
      if ((tid & 31) == 0 && ballot != 0) at = atomicAdd(&ss.count, __popc(ballot));
      at = __shfl_sync(0xffffffffu, at, 0);
      if (keep) {
        s[at + __popc(ballot & lanemask_lt())] = v;
        mn = min(mn, __float_as_uint(v));
      }
    }
    mn = __reduce_min_sync(0xffffffffu, mn);
    if ((tid & 31) == 0) atomicMin(&ss.umin, mn);
    __syncthreads();
    const int c = ss.count;
    const uint32_t range = c > 0 ? top - ss.umin : 0u;
    const int passes = (32 - __clz(range) + 7) / 8;
    float* other = s + c;
    if (passes > 0 && 2 * c > cap) {
      other = p;
      *clobbered = true;
    }
    const float* sorted = c > 0 ? radix_sort_desc(s, other, c, top, passes, ss) : s;
    // 4. the walk
    if (c > 0) {
      walk_sorted(sorted, c, limit, final || c == n, ss);
    } else if (tid == 0) {
      ss.done = final ? 1 : 0;
      ss.cut = kcut;
    }
    __syncthreads();
    if (ss.done) return ss.cut;
    t = kbits;  // take every survivor
    if (*clobbered) {
      recompute();
      *clobbered = false;
      __syncthreads();
    }
  }
}

// transform.cpp's logits_to_probs of one row l into p, by the whole block (any multiple of 32
// threads >= kLanes). s: the row's sort scratch (next_pow2(vocab) floats). Returns the greedy
// argmax (lowest index on ties) when temperature == 0, else -1.
__device__ int transform_row(const float* l, int vocab, float temperature, float top_p, int top_k,
                             float* p, float* s, int cap, SharedRow& sh, SortShared& ss,
                             ArgMax* s_warp) {
  const int tid = threadIdx.x;
  const int nt = blockDim.x;

  if (temperature == 0.0f) {  // greedy: one-hot on the argmax, lowest index on ties
    ArgMax a{-INFINITY, INT_MAX};
    for (int x = tid; x < vocab; x += nt) a = better(a, ArgMax{l[x], x});
    a = block_argmax(a, s_warp);
    const int best = a.i == INT_MAX ? 0 : a.i;  // all -inf: the CPU keeps index 0
    for (int x = tid; x < vocab; x += nt) p[x] = x == best ? 1.0f : 0.0f;
    return best;
  }

  ArgMax mx{-INFINITY, 0};
  for (int x = tid; x < vocab; x += nt) mx.v = fmaxf(mx.v, l[x]);
  const float m = block_argmax(mx, s_warp).v;
  auto prob = [=](int x) { return exp_rounded(__fdiv_rn(__fsub_rn(l[x], m), temperature)); };
  for (int x = tid; x < vocab; x += nt) p[x] = prob(x);

  const bool use_k = top_k > 0 && top_k < vocab;
  const bool use_p = top_p < 1.0f;
  float cut = 0.0f;  // survivors are the x with p[x] >= cut
  if (use_k || use_p) {
    int n = vocab;  // survivors of the top-k filter
    if (use_k) {
      cut = __uint_as_float(kth_largest_bits_radix(p, vocab, top_k, ss));
      n = count_at_least(p, vocab, __float_as_uint(cut), sh);
    }
    if (use_p) {
      const float kcut = cut;
      const float zk = lane_sums([=](int64_t x) { return p[x] >= kcut ? p[x] : 0.0f; }, vocab,
                                 sh.lane, sh.tree, nullptr);
      const float limit = __fmul_rn(top_p, zk);
      bool clobbered = false;
      cut = top_p_cut_radix(p, vocab, kcut, n, limit, s, cap, ss, &clobbered, [&] {
        for (int x = tid; x < vocab; x += nt) p[x] = prob(x);
      });
      if (clobbered) {  // the sort used the row as its second buffer: recompute it
        for (int x = tid; x < vocab; x += nt) p[x] = prob(x);
      }
    }
    for (int x = tid; x < vocab; x += nt) {
      if (!(p[x] >= cut)) p[x] = 0.0f;
    }
  }
  const float z = lane_sums([=](int64_t x) { return p[x]; }, vocab, sh.lane, sh.tree, nullptr);
  for (int x = tid; x < vocab; x += nt) p[x] = __fdiv_rn(p[x], z);
  return -1;
}

__global__ void __launch_bounds__(kTransformThreads)
    transform_kernel(const float* logits, int vocab, float temperature, float top_p, int top_k,
                     float* probs, float* sort_scratch, int sort_stride) {
  __shared__ SharedRow sh;
  __shared__ SortShared ss;
  __shared__ ArgMax s_warp[32];
  transform_row(logits + size_t(blockIdx.x) * vocab, vocab, temperature, top_p, top_k,
                probs + size_t(blockIdx.x) * vocab, sort_scratch + size_t(blockIdx.x) * sort_stride,
                sort_stride, sh, ss, s_warp);
}

// ---- transform over a thread-block cluster ------------------------------------------------------
//
// The same transform with a row spread over the kC CTAs of a cluster (the single-CTA code above
// stays as the fallback for vocabularies whose slice does not fit in shared memory, and for the
// benchmark's comparison). CTA r of the cluster owns lanes [r kC', (r + 1) kC') of row_ops.h
// (kC' = 256 / kC), i.e. the contiguous elements [r kC' chunk, (r + 1) kC' chunk) of the row, and
// keeps them in shared memory from the load to the final store (the row is read once and written
// once). Order-free steps (max, argmax, counts, radix histograms, min / max bits) combine the
// CTAs' partials through distributed shared memory in any order; each lane's serial sum stays in
// one thread of the CTA owning it, and every CTA gathers the 256 lane sums and runs the same
// pairwise tree (same bits everywhere, no broadcast needed). The top-p candidates are compacted
// by every CTA into the scratch (a counter in rank 0's shared memory); rank 0 alone sorts and
// walks them, as the single-CTA code does. The probs row in global memory is written only at the
// end, so the sort may use it as its second buffer without a recompute.

template <int kC>
struct ClusterShared {
  static constexpr int kCL = kLanes / kC;  // lanes per CTA
  float lsum[3][kCL];                      // this CTA's lane sums (one slot per use)
  int llast[3][kCL];                       // and the last positive index of each lane
  float lane_all[kLanes];                  // the gathered lane sums
  int last_all[kLanes];
  float tree[kLanes];
  int hist[2][256];  // radix select: this CTA's digit counts (double-buffered by pass)
  int hist_all[256];
  ArgMax am;
  float fmax;
  int count;         // survivors of top-k in this CTA
  int ccount[2];     // rank 0: top-p candidates compacted (per attempt)
  unsigned umin[2];  // rank 0: smallest candidate bits (per attempt)
  unsigned umax;     // this CTA's largest survivor bits
  unsigned t;        // rank 0: the candidate threshold
  unsigned top;      // rank 0: the largest survivor bits of the row
  float cut;         // rank 0: the walk's result
  int done;
  int sel_digit;
  int sel_before;
};

// Pairwise tree of row_ops.h over lane sums lsum[slot] of every CTA (whole cluster; returns the
// same total in every thread of every CTA). weight(i) is the weight of local element i (the
// CTA's slice starts at lane rank kCL). With `last`, last_all[] receives each lane's last
// positive index (-1 if none).
template <int kC, typename Weight>
__device__ float cluster_lane_total(const Weight& weight, int vocab, int rank, int lo, int slot,
                                    ClusterShared<kC>& sh) {
  namespace cg = cooperative_groups;
  constexpr int kCL = ClusterShared<kC>::kCL;
  const int tid = threadIdx.x;
  const int chunk = (vocab + kLanes - 1) / kLanes;
  if (tid < kCL) {
    const int lane = rank * kCL + tid;
    const int begin = lane * chunk;
    const int end = begin + chunk < vocab ? begin + chunk : vocab;
    float s = 0.0f;
    int last = -1;
#pragma unroll 8
    for (int x = begin; x < end; ++x) {
      const float w = weight(x - lo);
      s = __fadd_rn(s, w);
      if (w > 0.0f) last = x;
    }
    sh.lsum[slot][tid] = s;
    sh.llast[slot][tid] = last;
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every CTA's lane sums are in its shared memory
  if (tid < kLanes) {
    const int r = tid / kCL, i = tid % kCL;
    const float s = cluster.map_shared_rank(&sh.lsum[slot][0], r)[i];
    sh.lane_all[tid] = s;
    sh.tree[tid] = s;
    sh.last_all[tid] = cluster.map_shared_rank(&sh.llast[slot][0], r)[i];
  }
  __syncthreads();
  for (int stride = kLanes / 2; stride > 0; stride /= 2) {
    if (tid < stride) sh.tree[tid] = __fadd_rn(sh.tree[tid], sh.tree[tid + stride]);
    __syncthreads();
  }
  return sh.tree[0];
}

// The k-th largest bits of the row (kth_largest_bits_radix, the histograms summed over the
// cluster). e: this CTA's slice of len values.
template <int kC>
__device__ uint32_t cluster_kth_largest_bits(const float* e, int len, int k,
                                             ClusterShared<kC>& sh) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, nt = blockDim.x;
  uint32_t prefix = 0;
  int kk = k;
  int buf = 0;
  for (int shift = 24; shift >= 0; shift -= 8, buf ^= 1) {
    __syncthreads();
    for (int i = tid; i < 256; i += nt) sh.hist[buf][i] = 0;
    __syncthreads();
    const uint32_t high_mask = shift == 24 ? 0u : ~((1u << (shift + 8)) - 1u);
    for (int x0 = 0; x0 < len; x0 += nt) {
      const int x = x0 + tid;
      int d = -1;
      if (x < len) {
        const uint32_t b = sel_bits(e[x]);
        if ((b & high_mask) == prefix) d = int((b >> shift) & 255u);
      }
      warp_aggregated_increment(sh.hist[buf], d);
    }
    // The other buffer was last read before this barrier's previous instance: safe to reuse
    // next pass.
    cluster.sync();
    for (int i = tid; i < 256; i += nt) {
      int h = 0;
      for (int r = 0; r < kC; ++r) h += cluster.map_shared_rank(&sh.hist[buf][0], r)[i];
      sh.hist_all[i] = h;
    }
    __syncthreads();
    if (tid < 32) {
      int before = 0;
      const int d = warp_first_from_top<int>(
          256, [&](int b) { return sh.hist_all[b]; }, kk, &before);
      if (tid == 0) {
        sh.sel_digit = d < 0 ? 0 : d;
        sh.sel_before = before;
      }
    }
    __syncthreads();
    prefix |= uint32_t(sh.sel_digit) << shift;
    kk -= sh.sel_before;
  }
  return prefix;
}

// top_p_cut_radix over the cluster: the coarse histogram and the compaction by every CTA, the
// sort and the walk by rank 0. p: the global probs row (free: only the sort's second buffer).
template <int kC>
__device__ float cluster_top_p_cut(const float* e, int len, int rank, float* p, float kcut, int n,
                                   float limit, float* s, int cap, ClusterShared<kC>& sh,
                                   SortShared& ss) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, nt = blockDim.x;
  const uint32_t kbits = __float_as_uint(kcut);
  // 1. coarse histogram of this CTA's survivors and their largest bits
  __syncthreads();
  for (int i = tid; i < kCoarseBins; i += nt) ss.coarse[i] = 0;
  if (tid == 0) {
    sh.umax = 0;
    sh.ccount[0] = sh.ccount[1] = 0;
    sh.umin[0] = sh.umin[1] = 0xFFFFFFFFu;
  }
  __syncthreads();
  uint32_t mx = 0;
  for (int x0 = 0; x0 < len; x0 += nt) {
    const int x = x0 + tid;
    int bin = -1;
    if (x < len) {
      const float v = e[x];
      if (v >= kcut) {
        const uint32_t b = __float_as_uint(v);
        bin = int(min(b >> 19, uint32_t(kCoarseBins - 1)));
        mx = max(mx, b);
      }
    }
    warp_aggregated_increment(ss.coarse, bin);
  }
  mx = __reduce_max_sync(0xffffffffu, mx);
  if ((tid & 31) == 0) atomicMax(&sh.umax, mx);
  cluster.sync();  // A: every CTA's histogram and umax are ready; rank 0's counters are zeroed
  // 2. the candidate threshold, by rank 0 (others' ss.coarse is only read until barrier B)
  if (rank == 0) {
    for (int i = tid; i < kCoarseBins; i += nt) {
      int h = ss.coarse[i];
      for (int r = 1; r < kC; ++r) h += cluster.map_shared_rank(&ss.coarse[0], r)[i];
      ss.coarse[i] = h;
    }
    if (tid == 0) {
      unsigned u = 0;
      for (int r = 0; r < kC; ++r) u = max(u, *cluster.map_shared_rank(&sh.umax, r));
      sh.top = u;
    }
    __syncthreads();
    if (tid < 32) {
      const float target = __fmul_rn(limit, 1.02f);
      float before = 0.0f;
      const int bin = warp_first_from_top<float>(
          kCoarseBins,
          [&](int b) { return float(ss.coarse[b]) * __uint_as_float(uint32_t(b) << 19); }, target,
          &before);
      if (tid == 0) {
        uint32_t t = bin < 0 ? kbits : uint32_t(bin) << 19;
        if (!(0.0f < limit)) t = sh.top;  // the walk takes only the largest value
        sh.t = max(t, kbits);
      }
    }
  }
  cluster.sync();  // B: the threshold is in rank 0
  uint32_t t = *cluster.map_shared_rank(&sh.t, 0);
  int* counter = cluster.map_shared_rank(&sh.ccount[0], 0);
  unsigned* umin = cluster.map_shared_rank(&sh.umin[0], 0);
  for (int attempt = 0;; ++attempt) {
    const bool final = t == kbits;
    // 3. compaction into s (any order: equal values are interchangeable)
    uint32_t mn = 0xFFFFFFFFu;
    for (int x0 = 0; x0 < len; x0 += nt) {
      const int x = x0 + tid;
      float v = 0.0f;
      bool keep = false;
      if (x < len) {
        v = e[x];
        keep = v >= kcut && __float_as_uint(v) >= t;
      }
      const unsigned ballot = __ballot_sync(0xffffffffu, keep);
      int at = 0;
      if ((tid & 31) == 0 && ballot != 0) at = atomicAdd(&counter[attempt], __popc(ballot));
      at = __shfl_sync(0xffffffffu, at, 0);
      if (keep) {
        s[at + __popc(ballot & lanemask_lt())] = v;
        mn = min(mn, __float_as_uint(v));
      }
    }
    mn = __reduce_min_sync(0xffffffffu, mn);
    if ((tid & 31) == 0 && mn != 0xFFFFFFFFu) atomicMin(&umin[attempt], mn);
    cluster.sync();  // C: the candidates are in s (release / acquire at cluster scope)
    if (rank == 0) {
      const int c = sh.ccount[attempt];
      const uint32_t top = sh.top;
      const uint32_t range = c > 0 ? top - sh.umin[attempt] : 0u;
      const int passes = (32 - __clz(range) + 7) / 8;
      float* other = 2 * c > cap ? p : s + c;
      const float* sorted = c > 0 ? radix_sort_desc(s, other, c, top, passes, ss) : s;
      if (c > 0) {
        walk_sorted(sorted, c, limit, final || c == n, ss);
      } else if (tid == 0) {
        ss.done = final ? 1 : 0;
        ss.cut = kcut;
      }
      __syncthreads();
      if (tid == 0) {
        sh.cut = ss.cut;
        sh.done = ss.done;
      }
    }
    cluster.sync();  // D: the walk's result is in rank 0
    const float cut = *cluster.map_shared_rank(&sh.cut, 0);
    const int done = *cluster.map_shared_rank(&sh.done, 0);
    if (done || attempt == 1) return cut;
    t = kbits;  // take every survivor
  }
}

// transform_row over the cluster of the calling CTA. e: this CTA's slice in shared memory
// (kCL * ceil(vocab / 256) floats). bias (may be null): added to the logits, which are written
// back (the draft slot). Writes p[] for this CTA's slice and leaves the final values in e.
// Returns the greedy argmax when temperature == 0, else -1.
template <int kC>
__device__ int cluster_transform_row(float* l, const float* bias, int vocab, float temperature,
                                     float top_p, int top_k, float* p, float* s, int cap, float* e,
                                     ClusterShared<kC>& sh, SortShared& ss, ArgMax* s_warp) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  constexpr int kCL = ClusterShared<kC>::kCL;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int rank = int(cluster.block_rank());
  const int chunk = (vocab + kLanes - 1) / kLanes;
  const int lo = min(vocab, rank * kCL * chunk);
  const int hi = min(vocab, (rank + 1) * kCL * chunk);
  const int len = hi - lo;

  for (int i = tid; i < len; i += nt) {
    float v = l[lo + i];
    if (bias != nullptr) {
      v = __fadd_rn(v, bias[lo + i]);
      l[lo + i] = v;
    }
    e[i] = v;
  }
  // (block_argmax starts with a __syncthreads: e is complete before it is read below)

  if (temperature == 0.0f) {  // greedy: one-hot on the argmax, lowest index on ties
    __syncthreads();
    ArgMax a{-INFINITY, INT_MAX};
    for (int i = tid; i < len; i += nt) a = better(a, ArgMax{e[i], lo + i});
    a = block_argmax(a, s_warp);
    if (tid == 0) sh.am = a;
    cluster.sync();
    // One remote load a lane (lane r reads rank r), then the warp's reduction.
    ArgMax b{-INFINITY, INT_MAX};
    if ((tid & 31) < kC) b = *cluster.map_shared_rank(&sh.am, tid & 31);
    for (int o = 16; o > 0; o >>= 1) {
      const ArgMax y{__shfl_xor_sync(0xffffffffu, b.v, o), __shfl_xor_sync(0xffffffffu, b.i, o)};
      b = better(b, y);
    }
    const int best = b.i == INT_MAX ? 0 : b.i;  // all -inf: the CPU keeps index 0
    for (int i = tid; i < len; i += nt) {
      e[i] = lo + i == best ? 1.0f : 0.0f;
      p[lo + i] = e[i];
    }
    return best;
  }

  __syncthreads();
  ArgMax mx{-INFINITY, 0};
  for (int i = tid; i < len; i += nt) mx.v = fmaxf(mx.v, e[i]);
  mx = block_argmax(mx, s_warp);
  if (tid == 0) sh.fmax = mx.v;
  cluster.sync();
  float m = (tid & 31) < kC ? *cluster.map_shared_rank(&sh.fmax, tid & 31) : -INFINITY;
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  for (int i = tid; i < len; i += nt)
    e[i] = exp_rounded(__fdiv_rn(__fsub_rn(e[i], m), temperature));
  __syncthreads();

  const bool use_k = top_k > 0 && top_k < vocab;
  const bool use_p = top_p < 1.0f;
  if (use_k || use_p) {
    float cut = 0.0f;
    int n = vocab;
    if (use_k) {
      cut = __uint_as_float(cluster_kth_largest_bits<kC>(e, len, top_k, sh));
      if (use_p) {
        const uint32_t cb = __float_as_uint(cut);
        int c = 0;
        for (int i = tid; i < len; i += nt) c += __float_as_uint(e[i]) >= cb ? 1 : 0;
        c = __reduce_add_sync(0xffffffffu, c);
        if (tid == 0) sh.count = 0;
        __syncthreads();
        if ((tid & 31) == 0) atomicAdd(&sh.count, c);
        cluster.sync();
        n = __reduce_add_sync(0xffffffffu,
                              (tid & 31) < kC ? *cluster.map_shared_rank(&sh.count, tid & 31) : 0);
      }
    }
    if (use_p) {
      const float kcut = cut;
      const float zk = cluster_lane_total<kC>([=](int i) { return e[i] >= kcut ? e[i] : 0.0f; },
                                              vocab, rank, lo, 0, sh);
      const float limit = __fmul_rn(top_p, zk);
      cut = cluster_top_p_cut<kC>(e, len, rank, p, kcut, n, limit, s, cap, sh, ss);
    }
    for (int i = tid; i < len; i += nt) {
      if (!(e[i] >= cut)) e[i] = 0.0f;
    }
    __syncthreads();
  }
  const float z = cluster_lane_total<kC>([=](int i) { return e[i]; }, vocab, rank, lo, 1, sh);
  for (int i = tid; i < len; i += nt) {
    const float v = __fdiv_rn(e[i], z);
    e[i] = v;
    p[lo + i] = v;
  }
  return -1;
}

template <int kC>
__global__ void __launch_bounds__(kTransformThreads)
    cluster_transform_kernel(const float* logits, int vocab, float temperature, float top_p,
                             int top_k, float* probs, float* sort_scratch, int sort_stride) {
  __shared__ ClusterShared<kC> sh;
  __shared__ SortShared ss;
  __shared__ ArgMax s_warp[32];
  extern __shared__ float e_slice[];
  const size_t row = blockIdx.x / kC;
  cluster_transform_row<kC>(const_cast<float*>(logits) + row * vocab, nullptr, vocab, temperature,
                            top_p, top_k, probs + row * vocab, sort_scratch + row * sort_stride,
                            sort_stride, e_slice, sh, ss, s_warp);
  cooperative_groups::this_cluster().sync();  // no CTA leaves while others read its shared memory
}

// draft_slot_kernel over a cluster: the pick walks the gathered lane sums in every CTA (same
// data, same result); the CTA owning the chunk that holds the target walks inside it.
template <int kC>
__global__ void __launch_bounds__(kTransformThreads)
    cluster_draft_slot_kernel(float* logits, const float* bias, int vocab,
                              const DeviceSamplingParams* params, const float* u, float* probs,
                              float* sort_scratch, int cap, int32_t* token, int32_t* prev) {
  namespace cg = cooperative_groups;
  __shared__ ClusterShared<kC> sh;
  __shared__ SortShared ss;
  __shared__ ArgMax s_warp[32];
  __shared__ int s_pick;
  extern __shared__ float e_slice[];
  constexpr int kCL = ClusterShared<kC>::kCL;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const DeviceSamplingParams prm = *params;
  const int best =
      cluster_transform_row<kC>(logits, bias, vocab, prm.temperature, prm.top_p, prm.top_k, probs,
                                sort_scratch, cap, e_slice, sh, ss, s_warp);
  __syncthreads();
  const int chunk = (vocab + kLanes - 1) / kLanes;
  const int lo = min(vocab, rank * kCL * chunk);
  int writer = 0;  // the rank that writes the token
  int32_t t = best;
  if (prm.temperature != 0.0f) {
    const float total =
        cluster_lane_total<kC>([=](int i) { return e_slice[i]; }, vocab, rank, lo, 2, sh);
    if (threadIdx.x == 0) {
      // row_ops.h's inverse_cdf_pick over the gathered lane sums (block_inverse_cdf_pick's walk)
      int32_t pick = -1;
      int in_lane = -1;
      float running = 0.0f;
      if (total > 0.0f) {
        const float target = __fmul_rn(*u, total);
        int32_t last_positive = -1;
        for (int lane = 0; lane < kLanes; ++lane) {
          const float sl = sh.lane_all[lane];
          if (!(sl > 0.0f)) continue;
          if (__fadd_rn(running, sl) >= target) {
            in_lane = lane;
            break;
          }
          running = __fadd_rn(running, sl);
          last_positive = sh.last_all[lane];
        }
        pick = last_positive;
        if (in_lane >= 0) {
          writer = in_lane / kCL;
          if (writer == rank) {
            const int begin = in_lane * chunk;
            const int end = begin + chunk < vocab ? begin + chunk : vocab;
            float r = running;
            for (int x = begin; x < end; ++x) {
              const float w = e_slice[x - lo];
              if (!(w > 0.0f)) continue;
              r = __fadd_rn(r, w);
              pick = int32_t(x);
              if (r >= target) break;
            }
          }
        }
      }
      s_pick = pick;
      sh.sel_digit = writer;
    }
    __syncthreads();
    t = s_pick;
    writer = sh.sel_digit;
  }
  if (threadIdx.x == 0 && rank == writer) {
    *token = t;
    *prev = (t >= 0 && t < vocab) ? t : 0;
  }
  cluster.sync();  // no CTA leaves while others read its shared memory
}

// ---- verification ----------------------------------------------------------------------------

// verify.cpp's next_weight: min(1, w * p / q), q = 0 gives 1.
__device__ __forceinline__ float next_weight(float w, float p, float q) {
  const float num = __fmul_rn(w, p);
  return num >= q ? 1.0f : __fdiv_rn(num, q);
}

struct Residual {
  const float* p;
  const float* q;
  float scale;
  __device__ float operator()(int64_t x) const {
    const float r = __fsub_rn(__fmul_rn(scale, p[x]), q[x]);
    return r > 0.0f ? r : 0.0f;
  }
};

struct Plain {
  const float* p;
  __device__ float operator()(int64_t x) const { return p[x]; }
};

__device__ float residual_mass(const float* p, const float* q, float scale, int64_t v,
                               SharedRow& sh) {
  return lane_sums(Residual{p, q, scale}, v, sh.lane, sh.tree, nullptr);
}

__device__ int32_t sample_residual(const float* p, const float* q, float scale, int64_t v, float u,
                                   SharedRow& sh) {
  const int32_t y = block_inverse_cdf_pick(Residual{p, q, scale}, v, u, sh);
  if (y >= 0) return y;
  return block_inverse_cdf_pick(Plain{p}, v, u, sh);
}

__global__ void __launch_bounds__(kLanes)
    verify_kernel(bool block_mode, const float* p, const float* q, const int32_t* tokens, int g,
                  int vocab, const unsigned long long* seed_step, const VerifyDraws* draws_in,
                  VerifyResult* out, VerifyDraws* draws_used) {
  __shared__ SharedRow sh;
  const VerifyDraws d =
      draws_in != nullptr ? *draws_in : sampling::make_verify_draws(seed_step[0], seed_step[1]);
  const int64_t v = vocab;
  float weight[kMaxDraft + 1], threshold[kMaxDraft + 1], resid[kMaxDraft + 1];
  for (int i = 0; i <= kMaxDraft; ++i) weight[i] = threshold[i] = resid[i] = 0.0f;
  weight[0] = 1.0f;
  threshold[0] = 1.0f;
  for (int i = 1; i <= g; ++i) {
    const int32_t x = tokens[i - 1];
    weight[i] = next_weight(weight[i - 1], p[(i - 1) * v + x], q[(i - 1) * v + x]);
  }

  int tau = 0;
  int32_t extra = -1;
  if (!block_mode) {
    tau = g;
    for (int i = 1; i <= g; ++i) {
      const int32_t x = tokens[i - 1];
      threshold[i] = next_weight(1.0f, p[(i - 1) * v + x], q[(i - 1) * v + x]);
    }
    for (int i = 1; i <= g; ++i) {
      if (!(d.eta[i - 1] <= threshold[i])) {
        tau = i - 1;
        break;
      }
    }
    if (tau < g) {
      resid[tau] = residual_mass(p + tau * v, q + tau * v, 1.0f, v, sh);
      extra = sample_residual(p + tau * v, q + tau * v, 1.0f, v, d.u_extra, sh);
    } else {
      extra = block_inverse_cdf_pick(Plain{p + g * v}, v, d.u_extra, sh);
    }
  } else {
    for (int i = 1; i <= g; ++i) {
      if (i < g) {
        const float z = residual_mass(p + i * v, q + i * v, weight[i], v, sh);
        const float den = __fadd_rn(z, __fsub_rn(1.0f, weight[i]));
        resid[i] = z;
        threshold[i] = den > 0.0f ? __fdiv_rn(z, den) : 1.0f;
      } else {
        threshold[i] = weight[i];
      }
      if (d.eta[i - 1] <= threshold[i]) tau = i;  // no break: tau is the last such i
    }
    if (tau < g) {
      if (tau == 0) resid[0] = residual_mass(p, q, 1.0f, v, sh);
      extra = sample_residual(p + tau * v, q + tau * v, weight[tau], v, d.u_extra, sh);
    } else {
      extra = block_inverse_cdf_pick(Plain{p + g * v}, v, d.u_extra, sh);
    }
  }
  if (threadIdx.x == 0) {
    out->accepted = tau;
    out->extra_token = extra;
    for (int i = 0; i <= kMaxDraft; ++i) {
      out->weight[i] = weight[i];
      out->threshold[i] = threshold[i];
      out->residual_mass[i] = resid[i];
    }
    if (draws_used != nullptr) *draws_used = d;
  }
}

// ---- draft sampling (CudaModel::draft_on_device) ----------------------------------------------

// One DSpark draft slot: logits += bias (fp32, in place), q = transform(logits), token = greedy ?
// argmax : inverse-CDF pick with *u (sampler.cpp's sample_from_logits). prev = the token, or 0
// when none was drawn (token -1: an all-zero or NaN row), so the next slot's Markov gather stays
// inside the table; the host reports the -1.
__global__ void __launch_bounds__(kTransformThreads)
    draft_slot_kernel(float* logits, const float* bias, int vocab,
                      const DeviceSamplingParams* params, const float* u, float* probs,
                      float* sort_scratch, int32_t* token, int32_t* prev) {
  __shared__ SharedRow sh;
  __shared__ SortShared ss;
  __shared__ ArgMax s_warp[32];
  if (bias != nullptr) {
    for (int x = threadIdx.x; x < vocab; x += blockDim.x) logits[x] = __fadd_rn(logits[x], bias[x]);
  }
  __syncthreads();
  const DeviceSamplingParams prm = *params;
  int cap = 1;  // the documented scratch size: next_pow2(vocab)
  while (cap < vocab) cap <<= 1;
  const int best = transform_row(logits, vocab, prm.temperature, prm.top_p, prm.top_k, probs,
                                 sort_scratch, cap, sh, ss, s_warp);
  __syncthreads();
  int32_t t = best;
  if (prm.temperature != 0.0f) t = block_inverse_cdf_pick(Plain{probs}, vocab, *u, sh);
  if (threadIdx.x == 0) {
    *token = t;
    *prev = (t >= 0 && t < vocab) ? t : 0;
  }
}

// cuda_dspark.cpp's dot8 (cpu::dot_f32's order) of proj with [x5_b, emb_b]: thread j < 8 sums
// the elements i = j (mod 8) of the full groups of 8 in index order, then tail element
// n8 + j; thread 0 combines ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)). Explicit _rn
// operations: no FMA contraction (the host build has none either).
__global__ void draft_confidence_kernel(const float* proj, const float* x5, const float* emb, int D,
                                        int R, float* conf) {
  __shared__ float part[8];
  const int b = blockIdx.x, j = threadIdx.x, n = D + R, n8 = n / 8 * 8;
  const float* xr = x5 + size_t(b) * D;
  const float* er = emb + size_t(b) * R;
  auto cat = [&](int i) { return i < D ? xr[i] : er[i - D]; };
  float s = 0.0f;
  for (int i = j; i < n8; i += 8) s = __fadd_rn(s, __fmul_rn(proj[i], cat(i)));
  if (n8 + j < n) s = __fadd_rn(s, __fmul_rn(proj[n8 + j], cat(n8 + j)));
  part[j] = s;
  __syncthreads();
  if (j == 0) {
    conf[b] = __fadd_rn(__fadd_rn(__fadd_rn(part[0], part[1]), __fadd_rn(part[2], part[3])),
                        __fadd_rn(__fadd_rn(part[4], part[5]), __fadd_rn(part[6], part[7])));
  }
}

bool g_single_cta = false;  // set_single_cta_transform_for_bench

// The cluster kernels keep a row's slice (kLanes / kC lanes of ceil(vocab / 256) values) in
// dynamic shared memory; beyond this the single-CTA kernels run.
constexpr int kMaxSliceBytes = 160 * 1024;
constexpr int kMaxDevices = 64;
int g_cluster_size[kMaxDevices] = {};  // per device: 16 or 8 once set up, 0 before

size_t slice_bytes(int cluster, int vocab) {
  return size_t(kLanes / cluster) * size_t((vocab + kLanes - 1) / kLanes) * sizeof(float);
}

template <int kC>
void set_cluster_attributes() {
  for (const void* k : {reinterpret_cast<const void*>(cluster_transform_kernel<kC>),
                        reinterpret_cast<const void*>(cluster_draft_slot_kernel<kC>)}) {
    UF_CUDA_CHECK(
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSliceBytes));
    if (kC > 8)
      UF_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
}

// The cluster size of the current device: 16 CTAs when a cluster of 16 such CTAs can be resident
// (H100 / H200: yes), else the portable 8. Host-side queries only (no stream work), so it may
// run during a graph capture; VerifyPlan's constructor runs it ahead.
int cluster_size() {
  int dev = 0;
  UF_CUDA_CHECK(cudaGetDevice(&dev));
  require(dev >= 0 && dev < kMaxDevices, "verify: device %d out of range", dev);
  if (g_cluster_size[dev] != 0) return g_cluster_size[dev];
  set_cluster_attributes<8>();
  set_cluster_attributes<16>();
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cfg.gridDim = dim3(16);
  cfg.blockDim = dim3(kTransformThreads);
  cfg.dynamicSmemBytes = kMaxSliceBytes;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 16;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  const cudaError_t err =
      cudaOccupancyMaxActiveClusters(&clusters, cluster_transform_kernel<16>, &cfg);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: the portable size is used
    clusters = 0;
  }
  g_cluster_size[dev] = clusters >= 1 ? 16 : 8;
  return g_cluster_size[dev];
}

// The cluster size to use for `rows` rows of this vocab, or 0 for the single-CTA kernels. A top-p
// cut sorts and walks on one CTA of each cluster while the others wait, so when the clusters
// take more than one wave of SMs the single-CTA kernels win (H200, bench_cuda_verify, 15 rows of
// 129280 at top-p 0.95: 4.6 ms in clusters of 16, 1.8 ms single); without a cut, or within a
// wave, the clusters win (1 row, top-p 0.95: 1.56 against 1.80 ms; 15 rows, no cut: 48 against
// 111 us).
int transform_cluster(int vocab, int rows, bool top_p_cut) {
  if (g_single_cta) return 0;
  const int c = cluster_size();
  if (slice_bytes(c, vocab) > size_t(kMaxSliceBytes)) return 0;
  int dev = 0, sms = 0;
  UF_CUDA_CHECK(cudaGetDevice(&dev));
  UF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (top_p_cut && rows * c > sms) return 0;
  return c;
}

template <typename Kernel, typename... Args>
void launch_cluster(Kernel kernel, int cluster, int rows, size_t smem, cudaStream_t stream,
                    Args... args) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cfg.gridDim = dim3(unsigned(rows * cluster));
  cfg.blockDim = dim3(kTransformThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  UF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

int next_pow2(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

VerifyPlan::VerifyPlan(int max_vocab) : max_vocab_(max_vocab), sort_stride_(next_pow2(max_vocab)) {
  require(max_vocab >= 1 && max_vocab <= (1 << 30), "VerifyPlan: max_vocab = %d is out of range",
          max_vocab);
  UF_CUDA_CHECK(cudaMalloc(&probs_, size_t(kMaxRows) * max_vocab_ * sizeof(float)));
  UF_CUDA_CHECK(cudaMalloc(&sort_, size_t(kMaxRows) * sort_stride_ * sizeof(float)));
  (void)cluster_size();  // the kernels' attributes, ahead of any graph capture
}

VerifyPlan::~VerifyPlan() {
  cudaFree(probs_);
  cudaFree(sort_);
}

void logits_to_probs_on_device(const VerifyPlan& plan, const float* logits, int rows, int vocab,
                               const sampling::SamplingParams& params, float* probs,
                               cudaStream_t stream) {
  require(rows >= 0 && rows <= kMaxRows && vocab >= 1 && vocab <= plan.max_vocab(),
          "logits_to_probs_on_device: rows = %d must be in 0..%d and vocab = %d in 1..%d", rows,
          kMaxRows, vocab, plan.max_vocab());
  if (rows == 0) return;
  const int c = transform_cluster(vocab, rows, params.top_p < 1.0f);
  if (c == 16 || c == 8) {
    const auto kernel = c == 16 ? cluster_transform_kernel<16> : cluster_transform_kernel<8>;
    launch_cluster(kernel, c, rows, slice_bytes(c, vocab), stream, logits, vocab,
                   params.temperature, params.top_p, int(params.top_k), probs, plan.sort_scratch(),
                   plan.sort_stride());
    return;
  }
  transform_kernel<<<rows, kTransformThreads, 0, stream>>>(logits, vocab, params.temperature,
                                                           params.top_p, params.top_k, probs,
                                                           plan.sort_scratch(), plan.sort_stride());
  UF_CUDA_CHECK(cudaGetLastError());
}

void set_single_cta_transform_for_bench(bool single) { g_single_cta = single; }

void exp_of_bits_on_device(uint32_t first_bits, int64_t n, float* out, cudaStream_t stream) {
  require(n >= 0 && uint64_t(first_bits) + uint64_t(n) <= (uint64_t(1) << 32),
          "exp_of_bits_on_device: %lld values from 0x%08x run past 2^32", (long long)n, first_bits);
  if (n == 0) return;
  exp_of_bits_kernel<<<1024, 256, 0, stream>>>(first_bits, n, out);
  UF_CUDA_CHECK(cudaGetLastError());
}

void verify_probs_on_device(sampling::VerifyMode mode, const float* target, const float* draft,
                            const int32_t* tokens, int g, int vocab,
                            const unsigned long long* seed_step, const VerifyDraws* draws,
                            VerifyResult* out, VerifyDraws* draws_used, cudaStream_t stream) {
  require(g >= 0 && g <= kMaxDraft && vocab >= 1,
          "verify_probs_on_device: g = %d must be in 0..%d and vocab = %d >= 1", g, kMaxDraft,
          vocab);
  require(draws != nullptr || seed_step != nullptr,
          "verify_probs_on_device: needs either explicit draws or {seed, step}");
  require(g == 0 || (draft != nullptr && tokens != nullptr),
          "verify_probs_on_device: g = %d drafts need draft rows and tokens", g);
  verify_kernel<<<1, kLanes, 0, stream>>>(mode == sampling::VerifyMode::kBlock, target, draft,
                                          tokens, g, vocab, seed_step, draws, out, draws_used);
  UF_CUDA_CHECK(cudaGetLastError());
}

void verify_on_device(const VerifyPlan& plan, sampling::VerifyMode mode, const float* target_logits,
                      const float* draft_logits, const int32_t* tokens, int g, int vocab,
                      const sampling::SamplingParams& params, const unsigned long long* seed_step,
                      VerifyResult* out, cudaStream_t stream) {
  require(g >= 0 && g <= kMaxDraft && vocab >= 1 && vocab <= plan.max_vocab(),
          "verify_on_device: g = %d must be in 0..%d and vocab = %d in 1..%d", g, kMaxDraft, vocab,
          plan.max_vocab());
  require(seed_step != nullptr, "verify_on_device: seed_step (device {seed, step}) is null");
  // Two launches (target rows, draft rows): they live in separate caller buffers. Both reuse the
  // sort scratch from row 0, which is safe because launches on one stream run in order.
  logits_to_probs_on_device(plan, target_logits, g + 1, vocab, params, plan.target_probs(), stream);
  if (g > 0) {
    logits_to_probs_on_device(plan, draft_logits, g, vocab, params, plan.draft_probs(), stream);
  }
  verify_probs_on_device(mode, plan.target_probs(), plan.draft_probs(), tokens, g, vocab, seed_step,
                         nullptr, out, nullptr, stream);
}

}  // namespace uf::cuda

namespace uf::cuda {

DeviceSamplingParams device_sampling_params(const sampling::SamplingParams& p) {
  DeviceSamplingParams d;
  d.temperature = p.temperature;
  d.top_p = p.top_p;
  d.top_k = p.top_k;
  return d;
}

void sample_slot_on_device(float* logits, const float* bias, int vocab,
                           const DeviceSamplingParams* params, const float* u, float* probs,
                           float* sort_scratch, int32_t* token, int32_t* prev,
                           cudaStream_t stream) {
  require(vocab >= 1 && logits != nullptr && params != nullptr && u != nullptr &&
              probs != nullptr && sort_scratch != nullptr && token != nullptr && prev != nullptr,
          "sample_slot_on_device: vocab = %d, or a null buffer", vocab);
  const int c = transform_cluster(vocab, 1, false);  // one row: always within a wave
  if (c == 16 || c == 8) {
    const auto kernel = c == 16 ? cluster_draft_slot_kernel<16> : cluster_draft_slot_kernel<8>;
    launch_cluster(kernel, c, 1, slice_bytes(c, vocab), stream, logits, bias, vocab, params, u,
                   probs, sort_scratch, next_pow2(vocab), token, prev);
    return;
  }
  draft_slot_kernel<<<1, kTransformThreads, 0, stream>>>(logits, bias, vocab, params, u, probs,
                                                         sort_scratch, token, prev);
  UF_CUDA_CHECK(cudaGetLastError());
}

void draft_confidence_on_device(const float* proj, const float* x5, const float* emb, int rows,
                                int dim, int rank, float* conf, cudaStream_t stream) {
  require(rows >= 1 && dim >= 0 && rank >= 0 && dim + rank >= 1,
          "draft_confidence_on_device: rows = %d, dim = %d, rank = %d", rows, dim, rank);
  draft_confidence_kernel<<<rows, 8, 0, stream>>>(proj, x5, emb, dim, rank, conf);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
