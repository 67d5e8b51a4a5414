#pragma once
// Internal to the transforms (verify_transform.cu: one block a row; verify_cluster.cu: a row over
// a thread-block cluster): the top-k and top-p selections by radix, the steps both transforms run
// (each transform keeps its own barriers and says where its counters live).
//
// Values here are probabilities (non-negative floats <= 1, or NaN, which no survivor test
// passes): their bit patterns order like their values, so selections work on the bits.
//
// top-k: the k-th largest value with multiplicity by a 4-pass radix select, 8 bits a pass
// (digit_histogram + select_digit per pass; counts only, exact): the same value as a bisection
// (the largest t with count(bits >= t) >= k).
//
// Histograms: each warp counts into its own 256 bins (the caller's WarpHists, 64 KiB of shared
// memory), then the block sums the 32 warps' bins. A warp whose lanes share one digit (a flat
// row's first passes) adds its total once; otherwise each lane adds with a shared atomic that
// only its own warp contends for. Shared atomics on bins shared by the 32 warps serialised on a
// flat row's hot bin (the 64-bit mass adds cost ~30 us a pass on a cluster's slice, ~370 us on
// one CTA's whole row); a leader per distinct digit, one after another, ~12 us a pass.
//
// top-p: the cut of transform.cpp's top_p_cut, the largest survivor value v whose survivors
// >= v have mass >= limit (sampling/top_p_mass.h: integer masses floor(p 2^42), limit =
// ceil(top_p Z_k)). Integer sums are exact in any order, so this is a radix select weighted by
// mass: 4 passes with digits of 8, 8, 8 and 6 bits from bit 29 down (p <= 1 has bits < 2^30),
// each a histogram of the survivors' masses by digit among those matching the prefix chosen so
// far (mass_histogram), then the first digit from the top at which the running mass reaches what
// is left of the limit (select_mass_digit); the first pass's masses also give Z_k (mass_limit).
// The same passes whatever the nucleus (the sort + sequential fp32 walk of sessions 6-10 took
// ~1.2 ms on a flat row of 129280; the bisection + bitonic sort before it 32 ms).

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/verify_common.cuh"
#include "sampling/top_p_mass.h"

namespace uf::cuda::verify_detail {

constexpr int kBins = 256;         // both selections: 8-bit digits (the last mass digit: 6 bits)
constexpr int kMassPasses = 4;     // mass digits at bits [22, 30), [14, 22), [6, 14), [0, 6)
constexpr int kLoadsInFlight = 4;  // values a thread loads before its warp combines them

// The lowest bit of mass pass `pass`'s digit, and the bit above its highest.
__device__ __forceinline__ int mass_shift(int pass) { return pass < 3 ? 22 - 8 * pass : 0; }
__device__ __forceinline__ int mass_top(int pass) { return pass == 0 ? 30 : mass_shift(pass - 1); }

// Per-warp histograms in shared memory: 32 warps x kBins 64-bit words (the counts use the first
// half as 32-bit words). The transforms put it in their dynamic shared memory.
constexpr size_t kWarpHistBytes = size_t(32) * kBins * sizeof(unsigned long long);
using WarpHists = unsigned long long*;

// A CTA's selection state (both transforms; the cluster keeps its per-CTA partials elsewhere).
struct SelectShared {
  int hist[kBins];                 // top-k: the row's digit counts
  unsigned long long mass[kBins];  // top-p: the row's digit masses
  unsigned long long limit;        // mass_limit
  unsigned long long mass_before;  // select_mass_digit: the mass above the chosen digit
  int sel_digit;
  int sel_before;
};

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

// The sum of w over the lanes with `valid`, in every lane: 32-bit counts directly; masses (w <=
// 2^42) as their low 22 and high 21 bits, so 32 lanes fit in the 32-bit warp reductions.
__device__ __forceinline__ int warp_total(bool valid, int w) {
  return int(__reduce_add_sync(0xffffffffu, valid ? unsigned(w) : 0u));
}
__device__ __forceinline__ unsigned long long warp_total(bool valid, unsigned long long w) {
  const unsigned lo = __reduce_add_sync(0xffffffffu, valid ? unsigned(w & 0x3FFFFFu) : 0u);
  const unsigned hi = __reduce_add_sync(0xffffffffu, valid ? unsigned(w >> 22) : 0u);
  return (static_cast<unsigned long long>(hi) << 22) + lo;
}

// mine[d] += w over the lanes with `valid` (mine: this warp's bins; exact in any order). When
// every valid lane has the same digit (a flat row's first passes) one lane adds the warp's total;
// otherwise (later passes spread a warp over many digits) each lane adds its own with a shared
// atomic on the warp's bins, contended only by its own warp. All 32 lanes must call.
template <typename T>
__device__ __forceinline__ void warp_bin_add(T* mine, bool valid, int d, T w) {
  const unsigned act = __ballot_sync(0xffffffffu, valid);
  if (act != 0) {
    const int first = __ffs(act) - 1;
    const int d0 = __shfl_sync(0xffffffffu, d, first);
    if (__ballot_sync(0xffffffffu, valid && d != d0) == 0) {
      const T total = warp_total(valid, w);
      if (int(threadIdx.x & 31) == first) mine[d0] += total;
    } else if (valid) {
      atomicAdd(&mine[d], w);
    }
  }
  __syncwarp();  // the warp's next update of these bins follows this one
}

// ---- top-k: radix select ------------------------------------------------------------------------

// Clamped bits: NaN counts as +inf, as the bisection over [0, 0x7F800000] did.
__device__ __forceinline__ uint32_t sel_bits(float v) {
  const uint32_t b = __float_as_uint(v);
  return b < 0x7F800000u ? b : 0x7F800000u;
}

// One pass of the radix select over v[0..len) (whole block): hist (kBins ints) = the counts of
// the digits at `shift` of the values whose higher bits equal prefix, through the per-warp bins
// wh. The caller makes hist visible (a barrier) before select_digit reads it.
__device__ __forceinline__ void digit_histogram(const float* v, int len, uint32_t prefix, int shift,
                                                WarpHists wh, int* hist) {
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warps = nt >> 5;
  int* all = reinterpret_cast<int*>(wh);
  int* mine = all + (tid >> 5) * kBins;
  __syncthreads();  // the previous pass's sums have read every warp's bins
  for (int i = lane; i < kBins; i += 32) mine[i] = 0;
  __syncwarp();
  const uint32_t high_mask = shift == 24 ? 0u : ~((1u << (shift + 8)) - 1u);
  for (int x0 = 0; x0 < len; x0 += kLoadsInFlight * nt) {
    float val[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int x = x0 + u * nt + tid;
      val[u] = x < len ? v[x] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const uint32_t b = sel_bits(val[u]);
      const bool in = x0 + u * nt + tid < len && (b & high_mask) == prefix;
      warp_bin_add(mine, in, int((b >> shift) & 255u), 1);
    }
  }
  __syncthreads();
  for (int i = tid; i < kBins; i += nt) {
    int c = 0;
    for (int w = 0; w < warps; ++w) c += all[w * kBins + i];
    hist[i] = c;
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
        kBins, [&](int b) { return hist[b]; }, kk, &before);
    if (threadIdx.x == 0) {
      *sel_digit = d < 0 ? 0 : d;  // d >= 0 whenever 1 <= k <= n
      *sel_before = before;
    }
  }
  __syncthreads();
  prefix |= uint32_t(*sel_digit) << shift;
  kk -= *sel_before;
}

// ---- top-p: a radix select weighted by mass -----------------------------------------------------

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Mass pass `pass` over v[0..len) (whole block): h (kBins) = the masses of the survivors (v >=
// kcut, positive mass) whose bits above mass_top(pass) equal prefix, by their digit at
// mass_shift(pass), through the per-warp bins wh. The caller makes h visible (a barrier) before
// reading it.
__device__ __forceinline__ void mass_histogram(const float* v, int len, float kcut, uint32_t prefix,
                                               int pass, WarpHists wh, unsigned long long* h) {
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warps = nt >> 5;
  unsigned long long* mine = wh + (tid >> 5) * kBins;
  __syncthreads();  // the previous pass's sums have read every warp's bins
  for (int i = lane; i < kBins; i += 32) mine[i] = 0;
  __syncwarp();
  const int shift = mass_shift(pass), top = mass_top(pass);
  const uint32_t high_mask = ~((1u << top) - 1u);  // top <= 30
  const uint32_t digit_mask = (1u << (top - shift)) - 1u;
  for (int x0 = 0; x0 < len; x0 += kLoadsInFlight * nt) {
    float val[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int x = x0 + u * nt + tid;
      val[u] = x < len ? v[x] : -1.0f;  // fails v >= kcut (kcut >= 0)
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const uint32_t b = __float_as_uint(val[u]);
      const bool in = val[u] >= kcut && (b & high_mask) == prefix;
      const unsigned long long w = in ? sampling::top_p_mass(val[u]) : 0ull;
      warp_bin_add(mine, w != 0, int((b >> shift) & digit_mask), w);
    }
  }
  __syncthreads();
  for (int i = tid; i < kBins; i += nt) {
    unsigned long long m = 0;
    for (int w = 0; w < warps; ++w) m += wh[w * kBins + i];
    h[i] = m;
  }
}

// The digit of the cut from the row's digit masses h (whole block; warp 0 finds it, ss carries
// it to every thread): the first digit from the top at which the running mass reaches `target`
// (the limit less the mass above the prefix); prefix gains the digit, target drops the mass of
// the digits above it. The digit always exists (the prefix's digits hold >= target by
// construction); if it did not, digit 0 is taken (deterministic on every backend).
__device__ __forceinline__ void select_mass_digit(const unsigned long long* h, int shift,
                                                  SelectShared& ss, uint32_t& prefix,
                                                  unsigned long long& target) {
  if (threadIdx.x < 32) {
    unsigned long long before = 0;
    const int d = warp_first_from_top<unsigned long long>(
        kBins, [&](int b) { return h[b]; }, target, &before);
    if (threadIdx.x == 0) {
      ss.sel_digit = d < 0 ? 0 : d;
      ss.mass_before = d < 0 ? 0 : before;
    }
  }
  __syncthreads();
  prefix |= uint32_t(ss.sel_digit) << shift;
  target -= ss.mass_before;
}

// ceil(top_p Z) for the survivors' total mass Z, the sum of the first pass's digit masses h
// (every survivor has bits < 2^30, so pass 0 holds them all and no pass of its own is needed); 0
// when the row has no measurable mass. The same in every thread (whole block).
__device__ __forceinline__ unsigned long long mass_limit(const unsigned long long* h, float top_p,
                                                         SelectShared& ss) {
  if (threadIdx.x < 32) {
    unsigned long long z = 0;
    for (int i = threadIdx.x; i < kBins; i += 32) z += h[i];
    z = warp_sum_u64(z);
    if (threadIdx.x == 0) ss.limit = sampling::top_p_limit(top_p, z);
  }
  __syncthreads();
  return ss.limit;
}

// The top-p cut of one row held by this block (v[0..len) = the whole row, survivors v >= kcut):
// the bits of the largest survivor value whose survivors >= it have mass >= ceil(top_p Z); kcut
// when the row has no measurable mass (the filter then keeps the survivors as they are). Whole
// block.
__device__ __forceinline__ float top_p_cut_mass(const float* v, int len, float kcut, float top_p,
                                                WarpHists wh, SelectShared& ss) {
  uint32_t prefix = 0;
  unsigned long long target = 0;
  for (int pass = 0; pass < kMassPasses; ++pass) {
    mass_histogram(v, len, kcut, prefix, pass, wh, ss.mass);
    __syncthreads();
    if (pass == 0 && (target = mass_limit(ss.mass, top_p, ss)) == 0) return kcut;
    select_mass_digit(ss.mass, mass_shift(pass), ss, prefix, target);
  }
  return __uint_as_float(prefix);
}

}  // namespace uf::cuda::verify_detail
