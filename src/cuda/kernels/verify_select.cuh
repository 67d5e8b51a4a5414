#pragma once
// Internal to the transforms (verify_transform.cu: one block a row; verify_cluster.cu: a row over
// a thread-block cluster): the top-k and top-p selections by radix, the steps both transforms run
// (each transform keeps its own barriers and says where its counters live).
//
// Values here are probabilities (non-negative floats, no NaN): their bit patterns order like
// their values, so selections work on the bits.
//
// top-k: the k-th largest value with multiplicity by a 4-pass radix select, 8 bits a pass
// (digit_histogram + select_digit per pass; counts only, exact): the same value as a bisection
// (the largest t with count(bits >= t) >= k).
//
// top-p: the cut of transform.cpp's top_p_cut. Exact because the walk sees the same values in
// the same order as the CPU's: any candidate set "all survivors with bits >= t" is a prefix of
// the descending order (ties included), and the walk over a prefix that reaches the limit stops
// where the full walk stops. So t only has to be small enough, and is chosen from a coarse
// histogram:
//   1. one pass over the row: a 2048-bin histogram of the survivors' top 12 bits (1/16 binade
//      each) and their largest bits (coarse_histogram);
//   2. t = the lower edge of the first bin (from the top) where count x lower edge (a lower bound
//      of the bin's mass) reaches 1.02 x limit (candidate_threshold). The CPU's sequential fp32
//      sum of c <= 2^17 values is at least (1 - c 2^-24) >= 0.992 of the exact one, so its walk
//      reaches the limit inside the candidates; if it does not anyway (it cannot, but nothing
//      depends on it), a second attempt takes every survivor;
//   3. the candidates are compacted into the scratch (warp-aggregated atomics;
//      compact_candidates) and sorted by an LSD radix sort on key = max_bits - bits (ascending
//      key = descending value), 8-bit digits, only as many passes as the key range needs (3 for
//      a flat row), each pass stable: per-warp ranking with __match_any_sync, then an exclusive
//      scan of the per-warp digit counts (radix_sort_desc);
//   4. warp 0 walks the sorted values: every lane sums all 32 values of a chunk in order
//      (shuffles), so the fp32 chain is the CPU's, with the next chunks' loads in flight
//      (walk_sorted). Steps 3-4 on one CTA: sort_and_walk.
// The sort needs a second buffer of c floats: the scratch's second half when 2c fits, else the
// probs row itself (the single-CTA transform recomputes it afterwards, the same exp of the same
// logits; the cluster transform writes it only at the end).
// (The bisection + bitonic-sort top-p of sessions 3-5 took 32 ms on a flat row; this one 1.8 ms.)

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/verify_common.cuh"

namespace uf::cuda::verify_detail {

constexpr int kCoarseBins = 2048;  // bits >> 19: 1/16 binade; p <= 1 uses bins <= 2032
constexpr int kRadixItems = 8;     // values per thread per tile of the radix sort

// A CTA's selection state (both transforms; the cluster keeps its cross-CTA counters elsewhere).
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

// ---- top-k: radix select ------------------------------------------------------------------------

// Clamped bits: NaN counts as +inf, as the bisection over [0, 0x7F800000] did.
__device__ __forceinline__ uint32_t sel_bits(float v) {
  const uint32_t b = __float_as_uint(v);
  return b < 0x7F800000u ? b : 0x7F800000u;
}

// One pass of the radix select over v[0..len) (whole block): hist (256 ints, zeroed here) counts
// the digits at `shift` of the values whose higher bits equal prefix. The caller makes the counts
// visible (a barrier) before select_digit reads them.
__device__ __forceinline__ void digit_histogram(const float* v, int len, uint32_t prefix, int shift,
                                                int* hist) {
  const int tid = threadIdx.x, nt = blockDim.x;
  __syncthreads();
  for (int i = tid; i < 256; i += nt) hist[i] = 0;
  __syncthreads();
  const uint32_t high_mask = shift == 24 ? 0u : ~((1u << (shift + 8)) - 1u);
  for (int x0 = 0; x0 < len; x0 += nt) {
    const int x = x0 + tid;
    int d = -1;
    if (x < len) {
      const uint32_t b = sel_bits(v[x]);
      if ((b & high_mask) == prefix) d = int((b >> shift) & 255u);
    }
    warp_aggregated_increment(hist, d);
  }
}

// The digit of the kk-th largest from the row's digit counts hist (whole block; warp 0 finds it,
// *sel_digit / *sel_before carry it to every thread): prefix gains the digit, kk drops the count
// of the values above it.
__device__ __forceinline__ void select_digit(const int* hist, int shift, int* sel_digit,
                                             int* sel_before, uint32_t& prefix, int& kk) {
  if (threadIdx.x < 32) {
    int before = 0;
    const int d = warp_first_from_top<int>(
        256, [&](int b) { return hist[b]; }, kk, &before);
    if (threadIdx.x == 0) {
      *sel_digit = d < 0 ? 0 : d;  // d >= 0 whenever 1 <= k <= n
      *sel_before = before;
    }
  }
  __syncthreads();
  prefix |= uint32_t(*sel_digit) << shift;
  kk -= *sel_before;
}

// ---- top-p: steps 1-4 ---------------------------------------------------------------------------

// Step 1 over v[0..len) (whole block): ss.coarse = the histogram of the survivors (v >= kcut) by
// bits >> 19, and *umax (a shared word) >= their largest bits (atomicMax of the warps' maxima).
// Zeroes ss.coarse and *umax first; zero_more() runs on thread 0 with that zeroing (the caller's
// other counters). The caller makes the counts visible (a barrier) before reading them.
template <typename ZeroMore>
__device__ __forceinline__ void coarse_histogram(const float* v, int len, float kcut,
                                                 SortShared& ss, unsigned* umax,
                                                 const ZeroMore& zero_more) {
  const int tid = threadIdx.x, nt = blockDim.x;
  __syncthreads();
  for (int i = tid; i < kCoarseBins; i += nt) ss.coarse[i] = 0;
  if (tid == 0) {
    *umax = 0;
    zero_more();
  }
  __syncthreads();
  uint32_t mx = 0;
  for (int x0 = 0; x0 < len; x0 += nt) {
    const int x = x0 + tid;
    int bin = -1;
    if (x < len) {
      const float v_x = v[x];
      if (v_x >= kcut) {
        const uint32_t b = __float_as_uint(v_x);
        bin = int(min(b >> 19, uint32_t(kCoarseBins - 1)));
        mx = max(mx, b);
      }
    }
    warp_aggregated_increment(ss.coarse, bin);
  }
  mx = __reduce_max_sync(0xffffffffu, mx);
  if ((tid & 31) == 0) atomicMax(umax, mx);
}

// Step 2, by warp 0 once ss.coarse holds the row's histogram: thread 0 stores the candidate
// threshold in *t (at least kbits; *top, the row's largest survivor bits, when limit <= 0: the
// walk then takes only the largest value).
__device__ __forceinline__ void candidate_threshold(const SortShared& ss, float limit,
                                                    uint32_t kbits, const unsigned* top,
                                                    unsigned* t) {
  const float target = __fmul_rn(limit, 1.02f);
  float before = 0.0f;
  const int bin = warp_first_from_top<float>(
      kCoarseBins, [&](int b) { return float(ss.coarse[b]) * __uint_as_float(uint32_t(b) << 19); },
      target, &before);
  if (threadIdx.x == 0) {
    uint32_t tt = bin < 0 ? kbits : uint32_t(bin) << 19;
    if (!(0.0f < limit)) tt = *top;
    *t = max(tt, kbits);
  }
}

// Step 3's compaction over v[0..len) (whole block): the survivors with bits >= t are appended to
// s at *counter (shared or distributed shared; any order: equal values are interchangeable), and
// *umin (likewise) takes the minimum of their bits.
__device__ __forceinline__ void compact_candidates(const float* v, int len, float kcut, uint32_t t,
                                                   float* s, int* counter, unsigned* umin) {
  const int tid = threadIdx.x, nt = blockDim.x;
  uint32_t mn = 0xFFFFFFFFu;
  for (int x0 = 0; x0 < len; x0 += nt) {
    const int x = x0 + tid;
    float v_x = 0.0f;
    bool keep = false;
    if (x < len) {
      v_x = v[x];
      keep = v_x >= kcut && __float_as_uint(v_x) >= t;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, keep);
    int at = 0;
    if ((tid & 31) == 0 && ballot != 0) at = atomicAdd(counter, __popc(ballot));
    at = __shfl_sync(0xffffffffu, at, 0);
    if (keep) {
      s[at + __popc(ballot & lanemask_lt())] = v_x;
      mn = min(mn, __float_as_uint(v_x));
    }
  }
  mn = __reduce_min_sync(0xffffffffu, mn);
  if ((tid & 31) == 0 && mn != 0xFFFFFFFFu) atomicMin(umin, mn);  // a warp without candidates
}

// Sorts a[0..c) descending by value, keys top - bits (which must fit in 8 * passes bits), with b
// (c floats) as the other buffer; returns the buffer holding the result. Whole block, blockDim
// a multiple of 32 up to 1024.
__device__ inline float* radix_sort_desc(float* a, float* b, int c, uint32_t top, int passes,
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
__device__ inline void walk_sorted(const float* s, int c, float limit, bool final, SortShared& ss) {
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

// Steps 3 (the sort) and 4 by one CTA over the c candidates in s[0..c) (bits in [umin, top]; n
// survivors in all): ss.cut / ss.done as walk_sorted sets them (no candidates: kcut, final),
// visible after the caller's barrier. The sort's second buffer is s + c when 2c <= cap, else
// `row`; returns true when the sort wrote to `row`.
__device__ __forceinline__ bool sort_and_walk(float* s, int c, int cap, float* row, uint32_t top,
                                              uint32_t umin, int n, float kcut, float limit,
                                              bool final, SortShared& ss) {
  const uint32_t range = c > 0 ? top - umin : 0u;
  const int passes = (32 - __clz(range) + 7) / 8;
  const bool uses_row = passes > 0 && 2 * c > cap;
  const float* sorted = c > 0 ? radix_sort_desc(s, uses_row ? row : s + c, c, top, passes, ss) : s;
  if (c > 0) {
    walk_sorted(sorted, c, limit, final || c == n, ss);
  } else if (threadIdx.x == 0) {
    ss.done = final ? 1 : 0;
    ss.cut = kcut;
  }
  return uses_row;
}

}  // namespace uf::cuda::verify_detail
