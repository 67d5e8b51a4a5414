// hc_mixes, hc_pre and hc_post of ops/elementwise.h (cpu/mhc.cpp on the device), and the fused
// mHC glue of the decode step (hc_post_mixes, hc_mixes_partial, hc_mix_pre_norm, hc_pre_norm).
//
// The mixes (fn . v and |v|^2 over a row's hc * dim stream values, then r and the Sinkhorn) are
// split K-wise by CHANNEL: split s owns channels d = 32 s .. 32 s + 31 of every stream, one block
// of hc warps, so there are dim / 32 = 160 blocks at dim 5120 for any row count (fn, 2 MB, read
// once per call for up to 8 rows with 16-byte loads; the old split of 256-element chunks gave 80
// blocks whose warps reduced every mix of every row by shuffles). Partial (t, m, s) = sum over the
// streams k in order of the serial sum over the block's 32 channels in order of
// fn[m, k dim + d] * v[t, k, d]; the finish adds the S = dim / 32 partials of a mix as lane l's
// serial sum over s = l, l + 32, .. and a butterfly over the lanes. Every order is a function of
// (hc, dim) only, never of T (spec == plain). The dot products' order differs from the CPU's
// linear_f32 (serial over 20480 terms) and CUDA's expf may differ from glibc's by an ulp or two,
// so the mixes agree with the CPU to fp32 rounding, not bitwise
// (tests/cuda/test_ops_elementwise.cpp states the bound).
//
// The Sinkhorn runs on one warp with one comb element per lane, in registers: each row / column
// sum gathers its hc values by shuffles and adds them in the CPU's order, each lane divides its
// own element (the CPU's operations bit for bit). The old version staged every step through
// shared memory with a lane per row / column (~2x the latency of the 39 dependent steps).
//
// Fused (the decode step's mHC glue in 2 kernels per sublayer instead of 5 nodes):
//  - hc_post_mixes: hc_post of a sublayer + the split-K partials of the next sublayer's mixes over
//    the values it writes; hc_mixes_partial: the same kernel reading X instead of computing
//    hc_post (the first sublayer, after an Engram layer). hc_mixes (unfused) is that kernel +
//    hc_mixes_finish_kernel, so its scratch is bitwise the fused partials. hc <= 4 (the model's
//    4): hc_post_mixes_rows_kernel, the rows of a block spread over 4 warp groups and fn staged in
//    shared memory by cp.async before the PDL wait; hc > 4 (tests) or set_mhc_legacy_kernels:
//    hc_post_mixes_kernel (session 6: 1 warp group, the rows one after the other). The two
//    compute every value with the same operations in the same order (bitwise the same outputs).
//  - hc_post_mixes_moe: hc_post_mixes whose x (the FFN output) is the MoE combine of
//    DeviceMoe::apply_partial_experts' slots, computed in the kernel (combine_experts_kernel's
//    operations and order, staged per block: moe_stage / moe_value) instead of read: the combine
//    kernel leaves the decode chain. The same kernels with kMoe, hc <= 4.
//  - hc_mix_pre_norm: grid (T, 2): block (t, 1) the mixes' finish of row t (mixes_finish, bitwise
//    hc_mixes'), block (t, 0) hc_pre of row t with the previous pre and rms_norm on it, in
//    rms_norm's partition (bitwise hc_pre + rms_norm). The weights (scale, base, the norm weight)
//    are loaded before the PDL wait (legacy: after it; the same values).
//
// hc_pre, hc_post: one thread per (row, channel), the CPU's sums in the CPU's order with no
// contraction: bitwise equal to the CPU. hc_post's thread loads R[t, j, d] for every j into
// registers before writing out[t, k, d] for any k, and no other thread touches those elements,
// so out may alias R.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/l2_window.h"
#include "cuda/kernels/probe.cuh"
#include "cuda/ops/elementwise.h"
#include "cuda/ops/elementwise_common.cuh"

namespace uf::cuda {

namespace {

constexpr int kMaxHc = 8;
// hc_post_mixes / hc_mixes_partial: channels per block (one per lane; warp k owns stream k's), and
// rows per block (fn is read once for them).
constexpr int kPostD = 32;
constexpr int kPostRows = 8;
// hc_post_mixes_rows_kernel: warp groups of HC warps per block (4 or 2), each owning kPostRows /
// groups of the block's rows (set_mhc_post_groups). 2 by default: bench_cuda_mhc on the H200
// (session 7), hc_post_mixes at 7 / 8 rows: 3.70 / 3.96 us with 4 groups, 3.30 / 3.51 with 2.
constexpr int kPostGroupsDefault = 2;
// The mixes' finish (mixes_finish): kMixWarps warps sum the split partials of the mixes (mix m on
// warp m % 8), one more warp those of the sum of squares; then warp 0 runs the Sinkhorn and warp 1
// writes pre / post. The legacy finish uses the first 8 warps.
constexpr int kMixWarps = 8;
constexpr int kFinishWarps = kMixWarps + 1;
constexpr int kFinishThreads = 32 * kFinishWarps;
constexpr int kMixPreNormMaxThreads = 512;
constexpr int kMaxMix1 = (2 + kMaxHc) * kMaxHc + 1;

int mix_splits(const HcShape& p) { return (p.dim + kPostD - 1) / kPostD; }

__device__ __forceinline__ float sigmoid(float x) {
  return ew::fdiv(1.0f, ew::fadd(1.0f, expf(-x)));
}

// fn[m, c0 + i] for i < kPostD (zeros for i >= nvalid, and all zeros when !on): 16-byte loads when
// the segment is whole and aligned, else scalar ones (the same values either way).
__device__ __forceinline__ void load_fn_segment(const DeviceWeight& fn, int m, int64_t c0,
                                                int nvalid, bool on, float (&w)[kPostD]) {
#pragma unroll
  for (int i = 0; i < kPostD; ++i) w[i] = 0.f;
  if (!on) return;
  const int64_t off = int64_t(m) * fn.cols + c0;
  if (fn.format == model::WFormat::kF32) {
    const float* p = reinterpret_cast<const float*>(fn.data) + off;
    if (nvalid == kPostD && reinterpret_cast<uintptr_t>(p) % 16 == 0) {
#pragma unroll
      for (int i = 0; i < kPostD / 4; ++i) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(p) + i);
        w[4 * i] = v.x;
        w[4 * i + 1] = v.y;
        w[4 * i + 2] = v.z;
        w[4 * i + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kPostD; ++i)
        if (i < nvalid) w[i] = __ldg(p + i);
    }
  } else if (fn.format == model::WFormat::kBF16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(fn.data) + off;
    if (nvalid == kPostD && reinterpret_cast<uintptr_t>(p) % 16 == 0) {
#pragma unroll
      for (int i = 0; i < kPostD / 8; ++i) {
        const uint4 u = __ldg(reinterpret_cast<const uint4*>(p) + i);
        const uint32_t q[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          w[8 * i + 2 * j] = __uint_as_float(q[j] << 16);
          w[8 * i + 2 * j + 1] = __uint_as_float(q[j] & 0xffff0000u);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kPostD; ++i)
        if (i < nvalid) w[i] = ew::bf16_to_f32(__ldg(p + i));
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPostD; ++i)
      if (i < nvalid) w[i] = ew::weight_at(fn, m, c0 + i);
  }
}

// hc_post_mixes_moe: the FFN output x[t, d] is not read but computed from the MoE's slots
// (MoeSlots, ops/elementwise.h) with DeviceMoe::combine_experts_kernel's operations in its order.
// The block stages its rows' slot values of its 32 channels and the combine order of each row in
// shared memory before its first barrier (the loads in flight with R's), and every thread then
// computes x for its (row, channel) from there, where the plain kernel reads x.
constexpr int kMoeMaxTopK = 8;
constexpr int kMoeSlots = kMoeMaxTopK + 1;  // the routed experts' slots + the shared expert's

struct MoeStage {
  float (*vals)[kMoeSlots][kPostD];  // [kPostRows]: slot k of row tt at channel d0 + i
  int (*order)[kMoeMaxTopK];         // [kPostRows]: the k of the row's j-th expert in sum order
  int* count;                        // [kPostRows]: the row's valid experts
};

// vals[tt][k][i] = slots[t0 + tt, k, d0 + i] for k <= topk, i < nvalid (16-byte cp.async where
// the source is aligned and the piece whole, else plain loads; the caller commits and waits);
// order / count: moe_combine_kernel's insertion sort of the row's valid ids (0 <= id <
// n_experts) made explicit: thread (tt, k) of a valid id computes its position, the number of
// valid (id_j, j) < (id_k, k) (the sort is stable: equal ids keep their k order), and writes k
// there. Block threads tid < NTH, loops over all of them.
template <int NTH>
__device__ __forceinline__ void moe_stage(const MoeSlots& m, int D, int t0, int nt, int d0,
                                          int nvalid, int tid, const MoeStage& st) {
  constexpr int kSeg4 = kPostD / 4;
  const int K = m.topk, KS = K + 1, E = m.n_experts;
  const bool vec = reinterpret_cast<uintptr_t>(m.slots) % 16 == 0 && D % 4 == 0;
  for (int i = tid; i < nt * KS * kSeg4; i += NTH) {
    const int j = i % kSeg4, q = i / kSeg4, k = q % KS, tt = q / KS;
    const float* src = m.slots + (int64_t(t0 + tt) * KS + k) * D + d0 + 4 * j;
    float* dst = &st.vals[tt][k][4 * j];
    if (vec && 4 * j + 4 <= nvalid) {
      const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (4 * j + e < nvalid) dst[e] = src[e];
    }
  }
  for (int i = tid; i < nt * K; i += NTH) {
    const int tt = i / K, k = i % K;
    const int32_t* id = m.ids + int64_t(t0 + tt) * K;
    const int ek = id[k];
    int pos = 0, n = 0;
#pragma unroll
    for (int j = 0; j < kMoeMaxTopK; ++j) {
      if (j >= K) break;
      const int ej = id[j];
      const bool ok = ej >= 0 && ej < E;
      n += ok ? 1 : 0;
      pos += ok && (ej < ek || (ej == ek && j < k)) ? 1 : 0;
    }
    if (ek >= 0 && ek < E) st.order[tt][pos] = k;
    if (k == 0) st.count[tt] = n;
  }
}

// x[t0 + tt, d0 + i] as DeviceMoe::combine_experts writes it: the fp32 sum from 0 over the row's
// experts in order of bf16(slot), then bf16(sum + bf16(shared slot)); detail::round_bf16 and
// __fadd_rn as that kernel (and moe_combine_kernel + combine_kernel on bf16 slots: the same bits).
__device__ __forceinline__ float moe_value(const MoeStage& st, int K, int tt, int i) {
  float sum = 0.f;
  const int n = st.count[tt];
  for (int j = 0; j < n; ++j)
    sum = __fadd_rn(sum, detail::round_bf16(st.vals[tt][st.order[tt][j]][i]));
  return detail::round_bf16(__fadd_rn(sum, detail::round_bf16(st.vals[tt][K][i])));
}

// hc_post (kPost) or a plain read of X (!kPost, X passed as R), then the split-K partials of the
// next mixes over the values (fn . v and |v|^2), for up to kPostRows rows per block.
// Block (s, g) owns channels d0 = s * kPostD .. d0 + 31 of every stream of rows g * kPostRows ..:
//  1. thread (warp k, lane) loads R[t, k, d0 + lane] (and x), shares R through shared memory,
//     computes v[t, k, d0 + lane] = hc_post (hc_post_kernel's arithmetic: bitwise the CPU), writes
//     out and shares v (channels past dim: 0). No other block touches these channels.
//  2. task (m, k) (mix m <= kMix, stream k; tid, tid + HC * 32, ..) holds fn[m, k * D + d0 ..]
//     (loaded with 16-byte loads at the start, for all rows at once) and computes for each row
//     the serial sum over the 32 channels in order of fn[m, k D + d] * v[t, k, d] (m = kMix:
//     v * v);
//  3. partial (t, m, s) = the tasks' sums added in stream order, at partial[(t * M1 + m) * S + s].
// Every order is a function of (hc, dim) only, never of T or of the other rows.
template <int HC, bool kPost, bool kMoe = false>
__global__ void __launch_bounds__(HC * 32)
    hc_post_mixes_kernel(HcShape p, const float* x, const float* R, const float* post,
                         const float* comb, int T, float* out, DeviceWeight fn, float* partial,
                         MoeSlots moe) {
  constexpr int kMix = (2 + HC) * HC, M1 = kMix + 1, HH = HC * HC, CP = HH + HC;
  constexpr int NTH = HC * 32, kTasks = M1 * HC, TPT = (kTasks + NTH - 1) / NTH;
  // comb then post (kPost); R (kPost); the values v (a stream's row padded by 4 floats, so that
  // a warp's 16-byte reads of HC rows hit different banks); the tasks' sums.
  __shared__ float cs[kPostRows][CP];
  __shared__ float rs[kPostRows][HC][kPostD];
  __shared__ __align__(16) float vs[kPostRows][HC][kPostD + 4];
  __shared__ float red[kPostRows][M1][HC];
  // kMoe: the slots and the combine order of the block's rows (moe_stage).
  __shared__ __align__(16) float mv[kMoe ? kPostRows : 1][kMoeSlots][kPostD];
  __shared__ int mo[kMoe ? kPostRows : 1][kMoeMaxTopK];
  __shared__ int mc[kMoe ? kPostRows : 1];
  const MoeStage st{mv, mo, mc};
  const int D = p.dim, s = blockIdx.x, S = gridDim.x, tid = threadIdx.x;
  const int64_t n = int64_t(HC) * D;
  const int t0 = blockIdx.y * kPostRows, nt = min(kPostRows, T - t0);
  const int k = tid >> 5, lane = tid & 31;
  const int d0 = s * kPostD, nvalid = min(kPostD, D - d0);
  const bool valid = lane < nvalid;
  const int64_t c = int64_t(k) * D + d0 + (valid ? lane : nvalid - 1);  // in bounds
  // The tasks' fn segments first: the bulk of the bytes, in flight with the rows' loads.
  float w[TPT][kPostD];
#pragma unroll
  for (int q = 0; q < TPT; ++q) {
    const int task = tid + NTH * q, m = task / HC, kk = task % HC;
    load_fn_segment(fn, m, int64_t(kk) * D + d0, nvalid, partial && task < kTasks && m < kMix,
                    w[q]);
  }
  // PDL: fn is a weight; everything below reads what earlier kernels wrote.
  detail::pdl_wait();
  detail::pdl_trigger();
  // Every row's loads (rows past nt repeat the last one), all in flight together.
  float vals[kPostRows], xv[kPostRows];
#pragma unroll
  for (int tt = 0; tt < kPostRows; ++tt) {
    const int64_t t = t0 + min(tt, nt - 1);
    vals[tt] = R[t * n + c];
    if constexpr (kPost && !kMoe) xv[tt] = x[t * D + (c - int64_t(k) * D)];
  }
  if constexpr (kPost) {
    for (int i = tid; i < nt * CP; i += NTH) {
      const int tt = i / CP, j = i % CP;
      cs[tt][j] = j < HH ? comb[int64_t(t0 + tt) * HH + j] : post[int64_t(t0 + tt) * HC + j - HH];
    }
#pragma unroll
    for (int tt = 0; tt < kPostRows; ++tt) rs[tt][k][lane] = vals[tt];
    if constexpr (kMoe) {
      moe_stage<NTH>(moe, D, t0, nt, d0, nvalid, tid, st);
      detail::cp_async_commit();
      detail::cp_async_wait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int tt = 0; tt < kPostRows; ++tt) {
      if (tt >= nt) break;
      const float* cb = cs[tt];
      float sum = ew::fmul(cb[k], rs[tt][0][lane]);
#pragma unroll
      for (int j = 1; j < HC; ++j) sum = ew::fadd(sum, ew::fmul(cb[j * HC + k], rs[tt][j][lane]));
      float xt;
      if constexpr (kMoe)
        xt = moe_value(st, moe.topk, tt, valid ? lane : nvalid - 1);
      else
        xt = xv[tt];
      vals[tt] = ew::round_bf16(ew::fadd(ew::fmul(cb[HH + k], xt), sum));
      if (valid) out[(t0 + tt) * n + c] = vals[tt];
    }
  }
  if (!partial) return;
#pragma unroll
  for (int tt = 0; tt < kPostRows; ++tt) vs[tt][k][lane] = valid ? vals[tt] : 0.f;
  __syncthreads();
#pragma unroll
  for (int q = 0; q < TPT; ++q) {
    const int task = tid + NTH * q, m = task / HC, kk = task % HC;
    if (task >= kTasks) break;
#pragma unroll
    for (int tt = 0; tt < kPostRows; ++tt) {
      if (tt >= nt) break;
      const float4* v4 = reinterpret_cast<const float4*>(vs[tt][kk]);
      float a = 0.f;
#pragma unroll
      for (int i = 0; i < kPostD / 4; ++i) {
        const float4 v = v4[i];
        const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float prod = m < kMix ? ew::fmul(w[q][4 * i + j], e[j]) : ew::fmul(e[j], e[j]);
          a = i + j == 0 ? prod : ew::fadd(a, prod);
        }
      }
      red[tt][m][kk] = a;
    }
  }
  __syncthreads();
  for (int i = tid; i < nt * M1; i += NTH) {
    const int tt = i / M1, m = i % M1;
    float v = red[tt][m][0];
#pragma unroll
    for (int j = 1; j < HC; ++j) v = ew::fadd(v, red[tt][m][j]);
    partial[((t0 + tt) * int64_t(M1) + m) * S + s] = v;
  }
}

// The fn element fn[m, col] as load_fn_segment reads it on its scalar paths (the same value its
// vector paths give).
__device__ __forceinline__ float fn_elem(const DeviceWeight& fn, int m, int64_t col) {
  const int64_t i = int64_t(m) * fn.cols + col;
  if (fn.format == model::WFormat::kF32) return __ldg(reinterpret_cast<const float*>(fn.data) + i);
  if (fn.format == model::WFormat::kBF16)
    return ew::bf16_to_f32(__ldg(reinterpret_cast<const uint16_t*>(fn.data) + i));
  return ew::weight_at(fn, m, col);
}

// hc_post_mixes_kernel's work (the same values, the same operations in the same order) with the
// rows spread over G warp groups of HC warps instead of serialised in one: the old kernel's 4
// warps ran up to 8 rows' expand and 8 x 100 32-term dot chains one row after the other (the
// 7-row call cost ~2.3x the 1-row one); here group g owns rows g, g + G, .. of the block's
// kPostRows, so a thread runs at most kPostRows / G rows (interleaved: independent chains). G = 4:
// 512 threads at hc 4, 2 rows a thread; G = 2: 256 threads (a smaller footprint beside the
// neighbouring kernels under PDL), 4 rows a thread.
// fn's slice (HC * kMix segments of 32 values, 12 KB at hc 4) is copied once into shared memory
// with 16-byte cp.async before the PDL wait (it is a weight), and each task's thread takes its
// segment from there into registers: one read of fn per block, as before.
// Block (s, y): channels d0 = s * kPostD .. d0 + 31 of rows y * kPostRows ..:
//  1. fs[task] = fn[m, kk * D + d0 ..] (zeros past dim), task = m * HC + kk, m < kMix;
//  2. thread (g, k, lane) loads R[t, k, d0 + lane] (and x) for its rows, one thread per comb /
//     post value of the block's rows; v = hc_post (hc_post_kernel's arithmetic), written to out;
//  3. thread (g, task) (task < M1 * HC) computes for each of its rows the serial sum over the 32
//     channels in order of fn[m, k D + d] * v[t, k, d] (m = kMix: v * v);
//  4. partial (t, m, s) = the tasks' sums added in stream order (one thread per (t, m)).
// Requires M1 * HC <= HC * 32 (hc <= 4) and kPostRows * (HC * HC + HC) <= the block.
template <int HC, bool kPost, int G, bool kMoe = false>
__global__ void __launch_bounds__(HC * 32 * G, 8 / G)
    hc_post_mixes_rows_kernel(HcShape p, const float* x, const float* R, const float* post,
                              const float* comb, int T, float* out, DeviceWeight fn, float* partial,
                              MoeSlots moe) {
  constexpr int kMix = (2 + HC) * HC, M1 = kMix + 1, HH = HC * HC, CP = HH + HC;
  constexpr int NTG = HC * 32, NTH = NTG * G, RPG = kPostRows / G;
  constexpr int kTasks = M1 * HC, kFnTasks = kMix * HC, kSeg4 = kPostD / 4;
  static_assert(kTasks <= NTG && kPostRows % G == 0, "hc_post_mixes_rows: shape");
  static_assert(kPostRows * CP <= NTH && kPostRows * M1 <= NTH, "hc_post_mixes_rows: shape");
  // fn segments (rows padded by 4 floats: a quarter-warp's 16-byte reads of 8 consecutive
  // segments hit different banks); comb then post; R; the values v; the tasks' sums.
  __shared__ __align__(16) float fs[kFnTasks][kPostD + 4];
  __shared__ float cs[kPostRows][CP];
  __shared__ float rs[kPostRows][HC][kPostD];
  __shared__ __align__(16) float vs[kPostRows][HC][kPostD + 4];
  __shared__ float red[kPostRows][M1][HC];
  // kMoe: the slots and the combine order of the block's rows (moe_stage).
  __shared__ __align__(16) float mv[kMoe ? kPostRows : 1][kMoeSlots][kPostD];
  __shared__ int mo[kMoe ? kPostRows : 1][kMoeMaxTopK];
  __shared__ int mc[kMoe ? kPostRows : 1];
  const MoeStage st{mv, mo, mc};
  const int D = p.dim, s = blockIdx.x, S = gridDim.x, tid = threadIdx.x;
  const int64_t n = int64_t(HC) * D;
  const int t0 = blockIdx.y * kPostRows, nt = min(kPostRows, T - t0);
  const int g = tid / NTG, gt = tid % NTG, k = gt >> 5, lane = tid & 31;
  const int d0 = s * kPostD, nvalid = min(kPostD, D - d0);
  const bool valid = lane < nvalid;
  const int64_t c = int64_t(k) * D + d0 + (valid ? lane : nvalid - 1);  // in bounds
  if (partial) {
    // 16-byte pieces of the segments: cp.async where fn is F32 with every piece aligned and the
    // piece whole, else the scalar reads of load_fn_segment (zeros past dim).
    const bool vec = fn.format == model::WFormat::kF32 &&
                     reinterpret_cast<uintptr_t>(fn.data) % 16 == 0 && D % 4 == 0;
    for (int i = tid; i < kFnTasks * kSeg4; i += NTH) {
      const int task = i / kSeg4, j = i % kSeg4, m = task / HC, kk = task % HC;
      const int64_t col = int64_t(kk) * D + d0 + 4 * j;
      float* dst = &fs[task][4 * j];
      if (vec && 4 * j + 4 <= nvalid) {
        const float* src = reinterpret_cast<const float*>(fn.data) + int64_t(m) * fn.cols + col;
        const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
      } else {
        float4 v;
        v.x = 4 * j < nvalid ? fn_elem(fn, m, col) : 0.f;
        v.y = 4 * j + 1 < nvalid ? fn_elem(fn, m, col + 1) : 0.f;
        v.z = 4 * j + 2 < nvalid ? fn_elem(fn, m, col + 2) : 0.f;
        v.w = 4 * j + 3 < nvalid ? fn_elem(fn, m, col + 3) : 0.f;
        *reinterpret_cast<float4*>(dst) = v;
      }
    }
    detail::cp_async_commit();
  }
  // PDL: fn is a weight; everything below reads what earlier kernels wrote.
  detail::pdl_wait();
  detail::pdl_trigger();
  // The group's rows (slots past nt repeat the last row: loaded, never stored) and one comb /
  // post value per thread: every load of the block in flight together.
  float vals[RPG], xv[RPG];
#pragma unroll
  for (int r = 0; r < RPG; ++r) {
    const int64_t t = t0 + min(g + G * r, nt - 1);
    vals[r] = R[t * n + c];
    if constexpr (kPost && !kMoe) xv[r] = x[t * D + (c - int64_t(k) * D)];
  }
  if constexpr (kPost) {
    if (tid < nt * CP) {
      const int tt = tid / CP, j = tid % CP;
      cs[tt][j] = j < HH ? comb[int64_t(t0 + tt) * HH + j] : post[int64_t(t0 + tt) * HC + j - HH];
    }
#pragma unroll
    for (int r = 0; r < RPG; ++r) rs[g + G * r][k][lane] = vals[r];
    if constexpr (kMoe) {  // (waits for fn's copies too: issued long before, done by now)
      moe_stage<NTH>(moe, D, t0, nt, d0, nvalid, tid, st);
      detail::cp_async_commit();
      detail::cp_async_wait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < RPG; ++r) {
      const int tt = g + G * r;
      if (tt < nt) {
        const float* cb = cs[tt];
        float sum = ew::fmul(cb[k], rs[tt][0][lane]);
#pragma unroll
        for (int j = 1; j < HC; ++j) sum = ew::fadd(sum, ew::fmul(cb[j * HC + k], rs[tt][j][lane]));
        float xt;
        if constexpr (kMoe)
          xt = moe_value(st, moe.topk, tt, valid ? lane : nvalid - 1);
        else
          xt = xv[r];
        vals[r] = ew::round_bf16(ew::fadd(ew::fmul(cb[HH + k], xt), sum));
        if (valid) out[(t0 + tt) * n + c] = vals[r];
      }
    }
  }
  if (!partial) return;
#pragma unroll
  for (int r = 0; r < RPG; ++r) vs[g + G * r][k][lane] = valid ? vals[r] : 0.f;
  detail::cp_async_wait<0>();
  __syncthreads();
  if (gt < kTasks) {
    const int m = gt / HC, kk = gt % HC;
    float w[kPostD];
    if (m < kMix) {
      const float4* f4 = reinterpret_cast<const float4*>(fs[gt]);
#pragma unroll
      for (int i = 0; i < kSeg4; ++i) {
        const float4 f = f4[i];
        w[4 * i] = f.x;
        w[4 * i + 1] = f.y;
        w[4 * i + 2] = f.z;
        w[4 * i + 3] = f.w;
      }
    }
    // kNr of the group's rows at once (independent chains); kSq: the |v|^2 task (m = kMix), a
    // branch of its own so that the chains carry no per-element select.
    auto chains = [&](auto NR, auto SQ) {
      constexpr int kNr = decltype(NR)::value;
      constexpr bool kSq = decltype(SQ)::value;
      float a[kNr];
#pragma unroll
      for (int i = 0; i < kSeg4; ++i) {
#pragma unroll
        for (int r = 0; r < kNr; ++r) {
          const float4 v = reinterpret_cast<const float4*>(vs[g + G * r][kk])[i];
          const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float prod = kSq ? ew::fmul(e[j], e[j]) : ew::fmul(w[4 * i + j], e[j]);
            a[r] = i + j == 0 ? prod : ew::fadd(a[r], prod);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kNr; ++r) red[g + G * r][m][kk] = a[r];
    };
    // The group's live rows (warp-uniform: g is the warp's); the task kind differs only within
    // one warp.
    const int live = g < nt ? min(RPG, (nt - g + G - 1) / G) : 0;
    auto rows = [&](auto SQ) {
      if (live == 1) chains(std::integral_constant<int, 1>{}, SQ);
      if (live == 2) chains(std::integral_constant<int, 2>{}, SQ);
      if constexpr (RPG >= 3)
        if (live == 3) chains(std::integral_constant<int, 3>{}, SQ);
      if constexpr (RPG >= 4)
        if (live == 4) chains(std::integral_constant<int, 4>{}, SQ);
    };
    if (m < kMix)
      rows(std::false_type{});
    else
      rows(std::true_type{});
  }
  __syncthreads();
  if (tid < nt * M1) {
    const int tt = tid / M1, m = tid % M1;
    float v = red[tt][m][0];
#pragma unroll
    for (int j = 1; j < HC; ++j) v = ew::fadd(v, red[tt][m][j]);
    partial[((t0 + tt) * int64_t(M1) + m) * S + s] = v;
  }
}

// Element idx of a matrix spread over the warp as v[e] on lane l = element l + 32 e (every lane
// must call it with its own idx).
template <int E>
__device__ __forceinline__ float warp_get(const float (&v)[E], int idx) {
  if constexpr (E == 1) return __shfl_sync(0xffffffffu, v[0], idx);  // idx < 32: no select
  float r = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float x = __shfl_sync(0xffffffffu, v[e], idx & 31);
    if ((idx >> 5) == e) r = x;
  }
  return r;
}

// The mixes' finish of row t on one block of >= kFinishThreads threads (all of them call it):
//  1. mix m = the butterfly over the lanes of lane l's serial sum of the partials s = l, l + 32,
//     .. in s order (an order fixed by S = mix_splits(dim), never by T);
//  2. r = 1 / sqrt(sumsq / n + norm_eps), m *= r, pre / post, then cpu::hc_split_sinkhorn on warp
//     0 with one comb element per lane (HC * HC <= 32; more: E per lane) in registers, the sums
//     gathered by shuffles: every sum and every element keeps the CPU's operation order, so the
//     result is the CPU's arithmetic except the mixes' summation order and CUDA's expf. (The CPU's
//     sums start with 0 + c[0]; c is never -0 here (exp >= +0 over a positive sum, + eps, then
//     divided by positive sums), so starting at c[0] gives the same bits.)
// mixes_finish (the default): kMixWarps warps sum the mixes (mix m on warp m % 8), 4 of them at a
// time in 3 shuffle rounds (warp_sum_quad), warp kMixWarps the sum of squares alone and r from
// it, before the block's one barrier; then warp 1 writes pre / post while warp 0 runs the
// Sinkhorn. mixes_finish_legacy (set_mhc_legacy_kernels; session 8): 8 warps, a 5-round butterfly
// per mix, then warp 0 computes r, pre / post, then the Sinkhorn. The same operations on the same
// operands in the same order: bitwise the same pre / post / comb (the legacy test compares them).
// sm: >= kMaxMix1 + 1 floats of shared memory. fw: load_finish_weights' (every thread calls both).
template <int HC>
struct FinishWeights {
  static constexpr int E = (HC * HC + 31) / 32;
  float sc[3] = {0.f, 0.f, 0.f}, bpre = 0.f, bpost = 0.f, bc[E] = {};
};
// The weights of warps 0 and 1 (the Sinkhorn's and pre / post's; the legacy finish does both on
// warp 0; the other warps: zeros, unused). Weights: a PDL kernel loads them before its wait.
template <int HC>
__device__ __forceinline__ FinishWeights<HC> load_finish_weights(const DeviceWeight& scale,
                                                                 const DeviceWeight& base) {
  constexpr int HH = HC * HC, E = FinishWeights<HC>::E;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  FinishWeights<HC> fw;
  if (warp < 2) {
#pragma unroll
    for (int i = 0; i < 3; ++i) fw.sc[i] = ew::weight_flat(scale, i);
    if (lane < HC) {
      fw.bpre = ew::weight_flat(base, lane);
      fw.bpost = ew::weight_flat(base, HC + lane);
    }
#pragma unroll
    for (int e = 0; e < E; ++e)
      fw.bc[e] = ew::weight_flat(base, 2 * HC + min(lane + 32 * e, HH - 1));
  }
  return fw;
}

// pre / post of row t from the mixes sm[0 .. 2 HC) and r, lane k < HC writing stream k's.
template <int HC>
__device__ __forceinline__ void write_pre_post(const HcShape& p, const FinishWeights<HC>& fw,
                                               float r, const float* sm, int64_t t, float* pre,
                                               float* post) {
  const int lane = threadIdx.x & 31;
  const float eps = p.hc_eps;
  if (lane < HC) {
    pre[t * HC + lane] =
        ew::fadd(sigmoid(ew::fadd(ew::fmul(ew::fmul(sm[lane], r), fw.sc[0]), fw.bpre)), eps);
    post[t * HC + lane] =
        ew::fmul(2.0f, sigmoid(ew::fadd(ew::fmul(ew::fmul(sm[HC + lane], r), fw.sc[1]), fw.bpost)));
  }
}

// comb of row t on one warp (every lane calls it) from the mixes sm[2 HC .. 2 HC + HH) and r: the
// softmax and the Sinkhorn in registers. mark(point): probe points 4 (the softmax done) and 5 (the
// Sinkhorn done, before the stores).
template <int HC, typename Mark>
__device__ __forceinline__ void write_comb(const HcShape& p, const FinishWeights<HC>& fw, float r,
                                           const float* sm, int64_t t, float* comb, Mark&& mark) {
  constexpr int HH = HC * HC, E = (HH + 31) / 32;
  const int lane = threadIdx.x & 31;
  const float eps = p.hc_eps;
  const float(&sc)[3] = fw.sc;
  const float(&bc)[E] = fw.bc;
  // Lane l holds elements i = l + 32 e (clamped to HH - 1 past the matrix: computed, never
  // stored) of row i / HC, column i % HC.
  int row[E], col[E];
  float c[E], ex[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int i = min(lane + 32 * e, HH - 1);
    row[e] = i / HC;
    col[e] = i % HC;
    c[e] = ew::fadd(ew::fmul(ew::fmul(sm[2 * HC + i], r), sc[2]), bc[e]);
  }
  // Softmax over each row, + eps.
  float mx[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    mx[e] = warp_get<E>(c, row[e] * HC);
#pragma unroll
    for (int k = 1; k < HC; ++k) mx[e] = ew::smax(mx[e], warp_get<E>(c, row[e] * HC + k));
  }
#pragma unroll
  for (int e = 0; e < E; ++e) ex[e] = expf(ew::fsub(c[e], mx[e]));
  float sum[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    sum[e] = warp_get<E>(ex, row[e] * HC);
#pragma unroll
    for (int k = 1; k < HC; ++k) sum[e] = ew::fadd(sum[e], warp_get<E>(ex, row[e] * HC + k));
  }
#pragma unroll
  for (int e = 0; e < E; ++e) c[e] = ew::fadd(ew::fdiv(ex[e], sum[e]), eps);
  mark(4);
  auto norm = [&](bool cols) {
    float sn[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      // cols: sum over j of c[j, col]; rows: sum over k of c[row, k]; each in index order.
      const int base_i = cols ? col[e] : row[e] * HC, step = cols ? HC : 1;
      sn[e] = warp_get<E>(c, base_i);
#pragma unroll
      for (int k = 1; k < HC; ++k) sn[e] = ew::fadd(sn[e], warp_get<E>(c, base_i + k * step));
    }
#pragma unroll
    for (int e = 0; e < E; ++e) c[e] = ew::fdiv(c[e], ew::fadd(sn[e], eps));
  };
  norm(true);
  for (int it = 0; it < p.sinkhorn_iters - 1; ++it) {
    norm(false);
    norm(true);
  }
  mark(5);
#pragma unroll
  for (int e = 0; e < E; ++e)
    if (lane + 32 * e < HH) comb[t * HH + lane + 32 * e] = c[e];
}

// r = 1 / sqrt(sumsq / n + norm_eps), n = HC * dim (model.py's rsqrt(x.square().mean(-1) + eps)).
template <int HC>
__device__ __forceinline__ float mix_rsqrt(const HcShape& p, float sumsq) {
  const int n = HC * p.dim;
  return ew::fdiv(1.0f, __fsqrt_rn(ew::fadd(ew::fdiv(sumsq, float(n)), p.norm_eps)));
}

// Lane l's serial sums acc[q] of the partials s = l, l + 32, .. < S of mix m[q] (at pt + m[q] S),
// in s order from the first (a lane with none: +0), kJ partials of each mix a pass with all of a
// pass's loads (clamped in bounds) issued before any add.
template <int Q, int kJ>
__device__ __forceinline__ void lane_sums(const float* pt, int S, const int (&m)[Q], int lane,
                                          float (&acc)[Q]) {
#pragma unroll
  for (int q = 0; q < Q; ++q) acc[q] = 0.f;
  for (int s0 = 0; s0 < S; s0 += 32 * kJ) {
    float v[Q][kJ];
#pragma unroll
    for (int q = 0; q < Q; ++q)
#pragma unroll
      for (int j = 0; j < kJ; ++j) v[q][j] = pt[int64_t(m[q]) * S + min(s0 + 32 * j + lane, S - 1)];
#pragma unroll
    for (int q = 0; q < Q; ++q)
#pragma unroll
      for (int j = 0; j < kJ; ++j)
        if (s0 + 32 * j + lane < S) acc[q] = s0 + j == 0 ? v[q][j] : ew::fadd(acc[q], v[q][j]);
  }
}

// The butterfly sum over the lanes (levels o = 16, 8, 4, 2, 1: v = v + shfl_xor(v, o), the lane's
// own value first) of 4 values per lane, x[g] of slot g, in 3 shuffle rounds (7 shuffles for the
// 4) instead of 5 rounds of 4: lane l returns the total of slot g(l) = 2 bit4(l) + bit3(l), the
// butterfly's value at lane l. Round 1 takes slot g(l) of lanes l ^ 16, l ^ 8 and l ^ 24 (each
// lane sends z[i] = x[i ^ g], the slot its partner l ^ 8 i keeps); lane l computes its own level-16
// sum, lane l ^ 8's (v[l ^ 8] + v[l ^ 24], that lane's operands in its order) and its level-8 sum
// of the two. Round 2 does the same for levels 4 and 2 (lanes l ^ 4, l ^ 2, l ^ 6 keep the same
// slot), round 3 level 1. Every add is one the butterfly performs, with the same operands in the
// same order. (The butterfly leaves the same bits on every lane: each of its adds is commutative.)
__device__ __forceinline__ float warp_sum_quad(const float (&x)[4], int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  const bool b3 = (lane & 8) != 0, b4 = (lane & 16) != 0;
  const float y0 = b3 ? x[1] : x[0], y1 = b3 ? x[0] : x[1];
  const float y2 = b3 ? x[3] : x[2], y3 = b3 ? x[2] : x[3];
  const float z0 = b4 ? y2 : y0, z1 = b4 ? y3 : y1, z2 = b4 ? y0 : y2, z3 = b4 ? y1 : y3;
  const float v16 = __shfl_xor_sync(kAll, z2, 16);
  const float v8 = __shfl_xor_sync(kAll, z1, 8);
  const float v24 = __shfl_xor_sync(kAll, z3, 24);
  const float w = ew::fadd(ew::fadd(z0, v16), ew::fadd(v8, v24));
  const float w4 = __shfl_xor_sync(kAll, w, 4);
  const float w2 = __shfl_xor_sync(kAll, w, 2);
  const float w6 = __shfl_xor_sync(kAll, w, 6);
  const float u = ew::fadd(ew::fadd(w, w4), ew::fadd(w2, w6));
  return ew::fadd(u, __shfl_xor_sync(kAll, u, 1));
}

// The default finish (see above). mark(point): probe points 3 (the mixes and r in shared memory,
// on warp 0), 4 and 5 (write_comb).
template <int HC, typename Mark>
__device__ void mixes_finish(const HcShape& p, const FinishWeights<HC>& fw, int S,
                             const float* partial, int64_t t, float* sm, float* pre, float* post,
                             float* comb, Mark&& mark) {
  constexpr int kMix = (2 + HC) * HC, M1 = kMix + 1;
  constexpr int QM = (kMix + kMixWarps - 1) / kMixWarps;  // mixes per warp
  constexpr int NQ = (QM + 3) / 4;                        // warp_sum_quad calls per warp
  constexpr int kJ = QM <= 4 ? 5 : 2;                     // partials per lane per mix per pass
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* pt = partial + t * M1 * S;
  if (warp < kMixWarps) {
    // Slot q: mix warp + 8 q (slots past the mixes: a valid mix's sums, never stored).
    int m[QM];
#pragma unroll
    for (int q = 0; q < QM; ++q) m[q] = min(warp + kMixWarps * q, kMix - 1);
    float acc[QM];
    lane_sums<QM, kJ>(pt, S, m, lane, acc);
#pragma unroll
    for (int k = 0; k < NQ; ++k) {
      float x[4];
#pragma unroll
      for (int g = 0; g < 4; ++g) x[g] = 4 * k + g < QM ? acc[4 * k + g] : 0.f;
      const float total = warp_sum_quad(x, lane);
      const int q = 4 * k + (lane >> 3), mix = warp + kMixWarps * q;
      if ((lane & 7) == 0 && q < QM && mix < kMix) sm[mix] = total;
    }
  } else if (warp == kMixWarps) {
    // The sum of squares (mix kMix), then r: off the Sinkhorn warp's path.
    const int m[1] = {kMix};
    float acc[1];
    lane_sums<1, kJ>(pt, S, m, lane, acc);
    const float x[4] = {acc[0], acc[0], acc[0], acc[0]};
    const float sumsq = warp_sum_quad(x, lane);
    if (lane == 0) sm[M1] = mix_rsqrt<HC>(p, sumsq);
  }
  __syncthreads();
  if (warp == 1) write_pre_post<HC>(p, fw, sm[M1], sm, t, pre, post);
  if (warp != 0) return;
  mark(3);
  write_comb<HC>(p, fw, sm[M1], sm, t, comb, mark);
}

// The session-8 finish (set_mhc_legacy_kernels): 8 warps (mix m on warp m % 8) reduce with a
// 5-round butterfly each, then warp 0 computes r, pre / post and the Sinkhorn.
template <int HC>
__device__ void mixes_finish_legacy(const HcShape& p, const FinishWeights<HC>& fw, int S,
                                    const float* partial, int64_t t, float* sm, float* pre,
                                    float* post, float* comb) {
  constexpr int kMix = (2 + HC) * HC, M1 = kMix + 1;
  constexpr int kWarps = 8;
  constexpr int QM = (M1 + kWarps - 1) / kWarps;  // mixes per warp
  constexpr int kJ = QM <= 4 ? 8 : 2;             // partials per lane per batch
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (warp < kWarps) {
    const float* pt = partial + t * M1 * S;
    float acc[QM];
#pragma unroll
    for (int q = 0; q < QM; ++q) acc[q] = 0.f;
    for (int s0 = 0; s0 < S; s0 += 32 * kJ) {
      float v[QM][kJ];
#pragma unroll
      for (int q = 0; q < QM; ++q)
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          const int m = warp + kWarps * q, si = s0 + 32 * j + lane;
          v[q][j] = m < M1 && si < S ? pt[int64_t(m) * S + si] : 0.f;
        }
#pragma unroll
      for (int q = 0; q < QM; ++q)
#pragma unroll
        for (int j = 0; j < kJ; ++j)
          if (s0 + 32 * j + lane < S) acc[q] = s0 + j == 0 ? v[q][j] : ew::fadd(acc[q], v[q][j]);
    }
#pragma unroll
    for (int q = 0; q < QM; ++q) {
      float v = acc[q];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v = ew::fadd(v, __shfl_xor_sync(0xffffffffu, v, o));
      const int m = warp + kWarps * q;
      if (lane == 0 && m < M1) sm[m] = v;
    }
  }
  __syncthreads();
  if (warp != 0) return;
  const float r = mix_rsqrt<HC>(p, sm[kMix]);
  write_pre_post<HC>(p, fw, r, sm, t, pre, post);
  write_comb<HC>(p, fw, r, sm, t, comb, [](int) {});
}

// hc_mixes' second kernel: the finish of row blockIdx.x (kLegacy: mixes_finish_legacy).
template <int HC, bool kLegacy>
__global__ void __launch_bounds__(kFinishThreads)
    hc_mixes_finish_kernel(HcShape p, DeviceWeight scale, DeviceWeight base, int S,
                           const float* partial, float* pre, float* post, float* comb) {
  __shared__ float sm[kMaxMix1 + 1];
  const FinishWeights<HC> fw = load_finish_weights<HC>(scale, base);
  if constexpr (kLegacy)
    mixes_finish_legacy<HC>(p, fw, S, partial, blockIdx.x, sm, pre, post, comb);
  else
    mixes_finish<HC>(p, fw, S, partial, blockIdx.x, sm, pre, post, comb, [](int) {});
}

// Block (t, 0): hc_pre of row t with pre_in, then rms_norm with nw on the collapsed row in
// registers, in rms_norm_kernel's partition (the first NT = norm_threads(dim) threads, the same
// elements per thread, the same reduction): bitwise hc_pre + rms_norm. Block (t, 1) (with
// partials): the mixes' finish of row t. The two are independent (the collapse uses the previous
// sublayer's pre), so they run side by side. kEarly: the weights (scale, base; the norm weight)
// are loaded before the PDL wait, so their DRAM latency overlaps the previous kernel (the same
// values: only the load order differs) and the finish is mixes_finish; !kEarly: the session-6
// kernel (all after the wait) with mixes_finish_legacy.
template <int HC, int kMode, bool kEarly>
__global__ void __launch_bounds__(kMixPreNormMaxThreads, 1)
    hc_mix_pre_norm_kernel(HcShape p, DeviceWeight scale, DeviceWeight base, int S,
                           const float* partial, const float* X, const float* pre_in,
                           DeviceWeight nw, float eps, float* y, float* pre, float* post,
                           float* comb, int NT) {
  __shared__ float sm[kMaxMix1 + 1 > 32 ? kMaxMix1 + 1 : 32];
  const int64_t t = blockIdx.x;
  // Probe points (row 0's blocks): 0 start, 1 PDL wait returned, 2 done; the finish (kEarly) also
  // 3 its mixes and r summed, 4 its softmax done, 5 its Sinkhorn done (mixes_finish).
  if (blockIdx.y == 1) {
    UF_PROBE_OPEN_IF(probe_f, kTagMixFinish, threadIdx.x == 0 && blockIdx.x == 0);
    UF_PROBE_MARK(probe_f, 0);
    FinishWeights<HC> fw;
    if constexpr (kEarly) fw = load_finish_weights<HC>(scale, base);
    detail::pdl_wait();  // PDL: the partials come from the previous kernel
    UF_PROBE_MARK(probe_f, 1);
    detail::pdl_trigger();
    if constexpr (kEarly) {
      mixes_finish<HC>(p, fw, S, partial, t, sm, pre, post, comb,
                       [&]([[maybe_unused]] int point) { UF_PROBE_MARK(probe_f, point); });
    } else {
      fw = load_finish_weights<HC>(scale, base);
      mixes_finish_legacy<HC>(p, fw, S, partial, t, sm, pre, post, comb);
    }
    UF_PROBE_MARK(probe_f, 2);
    return;
  }
  UF_PROBE_OPEN_IF(probe, kTagMixPreNorm, threadIdx.x == 0 && blockIdx.x == 0);
  UF_PROBE_MARK(probe, 0);
  const int D = p.dim, nv = (D + 3) / 4, i = threadIdx.x;
  const float* xt = X + t * HC * D;
  // Clamped vector indices: every load is unconditional (all in flight together); `on` says
  // which vectors the thread owns (threads past NT, when the block is wider for the finish, none).
  float4 v[ew::kNormVec], wv[ew::kNormVec];
  if constexpr (kEarly) {
#pragma unroll
    for (int j = 0; j < ew::kNormVec; ++j)
      wv[j] = ew::load_weight4<kMode>(nw, 4 * min(i + j * NT, nv - 1), D);
  }
  detail::pdl_wait();  // PDL: X and pre_in come from earlier kernels
  UF_PROBE_MARK(probe, 1);
  detail::pdl_trigger();
  float pw[HC];
#pragma unroll
  for (int c = 0; c < HC; ++c) pw[c] = pre_in[t * HC + c];
  bool on[ew::kNormVec];
#pragma unroll
  for (int j = 0; j < ew::kNormVec; ++j) {
    const int q = i + j * NT;
    on[j] = i < NT && q < nv;
    const int qe = min(q, nv - 1);
    float4 xs[HC];
#pragma unroll
    for (int c = 0; c < HC; ++c) xs[c] = ew::load_row4<kMode>(xt + int64_t(c) * D, 4 * qe, D);
    if constexpr (!kEarly) wv[j] = ew::load_weight4<kMode>(nw, 4 * qe, D);
    float4 sum = make_float4(ew::fmul(pw[0], xs[0].x), ew::fmul(pw[0], xs[0].y),
                             ew::fmul(pw[0], xs[0].z), ew::fmul(pw[0], xs[0].w));
#pragma unroll
    for (int c = 1; c < HC; ++c) {
      sum.x = ew::fadd(sum.x, ew::fmul(pw[c], xs[c].x));
      sum.y = ew::fadd(sum.y, ew::fmul(pw[c], xs[c].y));
      sum.z = ew::fadd(sum.z, ew::fmul(pw[c], xs[c].z));
      sum.w = ew::fadd(sum.w, ew::fmul(pw[c], xs[c].w));
    }
    v[j] = make_float4(ew::round_bf16(sum.x), ew::round_bf16(sum.y), ew::round_bf16(sum.z),
                       ew::round_bf16(sum.w));
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < ew::kNormVec; ++j)
    if (on[j]) ss = ew::add_squares4(ss, v[j], 4 * (i + j * NT), D);
  const float r = ew::rms_factor(ew::block_sum_warps(ss, NT / 32, sm), D, eps);
  float* yt = y + t * D;
#pragma unroll
  for (int j = 0; j < ew::kNormVec; ++j) {
    if (on[j]) ew::store_row4<kMode>(yt, 4 * (i + j * NT), D, ew::norm_out4(v[j], wv[j], r));
  }
  UF_PROBE_MARK(probe, 2);
}

using ew::dispatch_hc;

bool overlaps(const float* a, size_t na, const float* b, size_t nb) {
  return a < b + nb && b < a + na;
}

constexpr int kThreads = 256;

__global__ void hc_pre_kernel(HcShape p, const float* X, const float* pre, float* y) {
  const int d = blockIdx.y * kThreads + threadIdx.x;
  if (d >= p.dim) return;
  const int64_t t = blockIdx.x;
  const int hc = p.hc, D = p.dim;
  const float* x = X + t * hc * D;
  const float* w = pre + t * hc;
  float s = ew::fmul(w[0], x[d]);
  for (int c = 1; c < hc; ++c) s = ew::fadd(s, ew::fmul(w[c], x[int64_t(c) * D + d]));
  y[t * D + d] = ew::round_bf16(s);
}

__global__ void hc_post_kernel(HcShape p, const float* x, const float* R, const float* post,
                               const float* comb, float* out) {
  const int d = blockIdx.y * kThreads + threadIdx.x;
  if (d >= p.dim) return;
  const int64_t t = blockIdx.x;
  const int hc = p.hc, D = p.dim;
  const float* r = R + t * hc * D;
  const float* cb = comb + t * hc * hc;
  float* o = out + t * hc * D;
  float rv[kMaxHc];
#pragma unroll
  for (int j = 0; j < kMaxHc; ++j)
    if (j < hc) rv[j] = r[int64_t(j) * D + d];
  const float xd = x[t * D + d];
  for (int k = 0; k < hc; ++k) {
    float s = ew::fmul(cb[k], rv[0]);
#pragma unroll
    for (int j = 1; j < kMaxHc; ++j)
      if (j < hc) s = ew::fadd(s, ew::fmul(cb[j * hc + k], rv[j]));
    o[int64_t(k) * D + d] = ew::round_bf16(ew::fadd(ew::fmul(post[t * hc + k], xd), s));
  }
}

void check_shape(const char* name, const HcShape& p) {
  require(p.hc >= 1 && p.hc <= kMaxHc && p.dim > 0,
          "%s: hc = %d, dim = %d; expected 1 <= hc <= %d and dim > 0", name, p.hc, p.dim, kMaxHc);
}

void check_fn(const char* name, const HcShape& p, const DeviceWeight& fn) {
  const int mix = (2 + p.hc) * p.hc;
  require(fn.rows == mix && fn.cols == int64_t(p.hc) * p.dim,
          "%s: fn is [%lld, %lld], expected [%d, %lld]", name, (long long)fn.rows,
          (long long)fn.cols, mix, (long long)p.hc * p.dim);
}

void check_mix_weights(const char* name, const HcShape& p, const DeviceWeight& scale,
                       const DeviceWeight& base) {
  const int mix = (2 + p.hc) * p.hc;
  require(scale.rows * scale.cols >= 3 && base.rows * base.cols >= mix,
          "%s: scale has %lld values (needs 3), base %lld (needs %d)", name,
          (long long)(scale.rows * scale.cols), (long long)(base.rows * base.cols), mix);
}

// set_mhc_legacy_kernels: the session-6 kernels instead of the new ones (bench and tests);
// set_mhc_post_groups: the row groups of hc_post_mixes_rows_kernel.
std::atomic<bool> g_legacy{false};
std::atomic<int> g_post_groups{kPostGroupsDefault};

template <int HC, bool kPost, int G, bool kMoe>
void launch_rows_kernel(dim3 grid, const HcShape& p, const float* x, const float* R,
                        const float* post, const float* comb, int T, float* out,
                        const DeviceWeight& fn, float* partial, const MoeSlots& moe,
                        cudaStream_t stream) {
  const auto kernel = hc_post_mixes_rows_kernel<HC, kPost, G, kMoe>;
  static detail::PerDeviceOnce once;
  once([&] { detail::prefer_shared_carveout(kernel); });
  const size_t fn_bytes = partial ? weight_data_bytes(fn) : 0;
  detail::launch_pdl_streaming(kernel, grid, dim3(HC * 32 * G), 0, stream, fn.data,
                               fn.data + fn_bytes, p, x, R, post, comb, T, out, fn, partial, moe);
}

// hc_post_mixes_kernel (legacy, or hc > 4) or hc_post_mixes_rows_kernel: the same outputs.
// kMoe (x from the MoE slots, hc <= 4 only: the slot staging does not fit beside hc 8's arrays).
template <int HC, bool kPost, bool kMoe = false>
void launch_post_mixes(const HcShape& p, const float* x, const float* R, const float* post,
                       const float* comb, int T, float* out, const DeviceWeight& fn, float* partial,
                       cudaStream_t stream, const MoeSlots& moe = MoeSlots{}) {
  static_assert(!kMoe || (kPost && HC <= 4), "hc_post_mixes_moe: hc <= 4");
  const dim3 grid(mix_splits(p), (T + kPostRows - 1) / kPostRows);
  if constexpr (HC <= 4) {
    if (!g_legacy.load(std::memory_order_relaxed)) {
      if (g_post_groups.load(std::memory_order_relaxed) == 2)
        launch_rows_kernel<HC, kPost, 2, kMoe>(grid, p, x, R, post, comb, T, out, fn, partial, moe,
                                               stream);
      else
        launch_rows_kernel<HC, kPost, 4, kMoe>(grid, p, x, R, post, comb, T, out, fn, partial, moe,
                                               stream);
      return;
    }
  }
  detail::launch_pdl(hc_post_mixes_kernel<HC, kPost, kMoe>, grid, dim3(HC * 32), 0, stream, p, x, R,
                     post, comb, T, out, fn, partial, moe);
}

// The split-K partials of fn . X (the post-mixes kernels without the expand).
void launch_partials(const HcShape& p, const DeviceWeight& fn, const float* X, int T,
                     float* partial, cudaStream_t stream) {
  dispatch_hc(p.hc, [&](auto H) {
    launch_post_mixes<decltype(H)::value, false>(p, nullptr, X, nullptr, nullptr, T, nullptr, fn,
                                                 partial, stream);
  });
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void set_mhc_legacy_kernels(bool on) { g_legacy.store(on, std::memory_order_relaxed); }

void set_mhc_post_groups(int groups) {
  require(groups == 2 || groups == 4, "set_mhc_post_groups: %d groups (2 or 4)", groups);
  g_post_groups.store(groups, std::memory_order_relaxed);
}

size_t hc_mixes_scratch_floats(const HcShape& p, int T) {
  return size_t(std::max(T, 0)) * size_t(mix_splits(p)) * size_t((2 + p.hc) * p.hc + 1);
}

void hc_mixes(const HcShape& p, const DeviceWeight& fn, const DeviceWeight& scale,
              const DeviceWeight& base, const float* X, int T, float* pre, float* post, float* comb,
              float* scratch, cudaStream_t stream) {
  check_shape("hc_mixes", p);
  require(T <= 0 || scratch, "hc_mixes: no scratch (hc_mixes_scratch_floats(p, %d) floats)", T);
  check_fn("hc_mixes", p, fn);
  check_mix_weights("hc_mixes", p, scale, base);
  if (T <= 0) return;
  launch_partials(p, fn, X, T, scratch, stream);
  hc_mixes_finish(p, scale, base, scratch, T, pre, post, comb, stream);
}

void hc_mixes_finish(const HcShape& p, const DeviceWeight& scale, const DeviceWeight& base,
                     const float* partial, int T, float* pre, float* post, float* comb,
                     cudaStream_t stream) {
  check_shape("hc_mixes_finish", p);
  check_mix_weights("hc_mixes_finish", p, scale, base);
  require(T <= 0 || (partial && pre && post && comb),
          "hc_mixes_finish: null partials or pre / post / comb (T = %d)", T);
  if (T <= 0) return;
  const int S = mix_splits(p);
  const bool legacy = g_legacy.load(std::memory_order_relaxed);
  dispatch_hc(p.hc, [&](auto H) {
    constexpr int HC = decltype(H)::value;
    const auto kernel =
        legacy ? hc_mixes_finish_kernel<HC, true> : hc_mixes_finish_kernel<HC, false>;
    kernel<<<T, kFinishThreads, 0, stream>>>(p, scale, base, S, partial, pre, post, comb);
  });
  UF_CUDA_CHECK(cudaGetLastError());
}

void hc_pre(const HcShape& p, const float* X, const float* pre, int T, float* y,
            cudaStream_t stream) {
  check_shape("hc_pre", p);
  if (T <= 0) return;
  const dim3 grid(T, (p.dim + kThreads - 1) / kThreads);
  hc_pre_kernel<<<grid, kThreads, 0, stream>>>(p, X, pre, y);
  UF_CUDA_CHECK(cudaGetLastError());
}

void hc_post(const HcShape& p, const float* x, const float* R, const float* post, const float* comb,
             int T, float* out, cudaStream_t stream) {
  check_shape("hc_post", p);
  if (T <= 0) return;
  const dim3 grid(T, (p.dim + kThreads - 1) / kThreads);
  hc_post_kernel<<<grid, kThreads, 0, stream>>>(p, x, R, post, comb, out);
  UF_CUDA_CHECK(cudaGetLastError());
}

void hc_mixes_partial(const HcShape& p, const DeviceWeight& fn, const float* X, int T,
                      float* partial, cudaStream_t stream) {
  check_shape("hc_mixes_partial", p);
  check_fn("hc_mixes_partial", p, fn);
  require(T <= 0 || partial, "hc_mixes_partial: no partials buffer (hc_mixes_scratch_floats)");
  if (T <= 0) return;
  launch_partials(p, fn, X, T, partial, stream);
}

void hc_post_mixes(const HcShape& p, const float* x, const float* R, const float* post,
                   const float* comb, int T, float* out, const DeviceWeight& fn, float* partial,
                   cudaStream_t stream) {
  check_shape("hc_post_mixes", p);
  if (T <= 0) return;
  const size_t n = size_t(T) * size_t(p.hc) * size_t(p.dim);
  require(!overlaps(out, n, R, n), "hc_post_mixes: out overlaps R (T = %d); use hc_post in place",
          T);
  if (!fn.empty()) {
    check_fn("hc_post_mixes", p, fn);
    require(partial, "hc_post_mixes: no partials buffer (hc_mixes_scratch_floats)");
  }
  float* part = fn.empty() ? nullptr : partial;
  dispatch_hc(p.hc, [&](auto H) {
    launch_post_mixes<decltype(H)::value, true>(p, x, R, post, comb, T, out, fn, part, stream);
  });
  UF_CUDA_CHECK(cudaGetLastError());
}

void hc_post_mixes_moe(const HcShape& p, const MoeSlots& moe, const float* R, const float* post,
                       const float* comb, int T, float* out, const DeviceWeight& fn, float* partial,
                       cudaStream_t stream) {
  check_shape("hc_post_mixes_moe", p);
  require(p.hc <= 4, "hc_post_mixes_moe: hc = %d; the MoE-fused expand needs hc <= 4", p.hc);
  if (T <= 0) return;
  require(moe.slots && moe.ids && moe.topk >= 1 && moe.topk <= kMoeMaxTopK && moe.n_experts >= 1,
          "hc_post_mixes_moe: slots %p, ids %p, top-%d of %d experts (need both, top-1..%d)",
          static_cast<const void*>(moe.slots), static_cast<const void*>(moe.ids), moe.topk,
          moe.n_experts, kMoeMaxTopK);
  const size_t n = size_t(T) * size_t(p.hc) * size_t(p.dim);
  const size_t ns = size_t(T) * size_t(moe.topk + 1) * size_t(p.dim);
  require(!overlaps(out, n, R, n) && !overlaps(out, n, moe.slots, ns),
          "hc_post_mixes_moe: out overlaps R or the MoE slots (T = %d)", T);
  if (!fn.empty()) {
    check_fn("hc_post_mixes_moe", p, fn);
    require(partial, "hc_post_mixes_moe: no partials buffer (hc_mixes_scratch_floats)");
  }
  float* part = fn.empty() ? nullptr : partial;
  dispatch_hc(p.hc, [&](auto H) {
    constexpr int HC = decltype(H)::value;
    if constexpr (HC <= 4)
      launch_post_mixes<HC, true, true>(p, nullptr, R, post, comb, T, out, fn, part, stream, moe);
  });
  UF_CUDA_CHECK(cudaGetLastError());
}

void hc_mix_pre_norm(const HcShape& p, const DeviceWeight& scale, const DeviceWeight& base,
                     const float* partial, const float* X, const float* pre_in,
                     const DeviceWeight& norm, float eps, int T, float* y, float* pre, float* post,
                     float* comb, cudaStream_t stream) {
  check_shape("hc_mix_pre_norm", p);
  const int NT = ew::norm_threads(p.dim);
  require(NT <= kMixPreNormMaxThreads && p.dim <= ew::kNormVec * 4 * NT,
          "hc_mix_pre_norm: dim %d exceeds the fused kernel's row of %d values", p.dim,
          ew::kNormVec * 4 * kMixPreNormMaxThreads);
  require(!norm.empty() && norm.rows * norm.cols == p.dim,
          "hc_mix_pre_norm: norm weight has %lld x %lld elements, expected %d",
          (long long)norm.rows, (long long)norm.cols, p.dim);
  if (partial) {
    check_mix_weights("hc_mix_pre_norm", p, scale, base);
    require(pre && post && comb, "hc_mix_pre_norm: partials given without pre / post / comb");
    require(!overlaps(pre, size_t(std::max(T, 0)) * p.hc, pre_in, size_t(std::max(T, 0)) * p.hc),
            "hc_mix_pre_norm: pre (written) overlaps pre_in (read by the collapse)");
  }
  if (T <= 0) return;
  // The finish needs kFinishThreads; the collapse uses the first NT threads of its blocks.
  const int B = partial ? std::max(NT, kFinishThreads) : NT;
  require(B <= kMixPreNormMaxThreads, "hc_mix_pre_norm: %d threads per block", B);
  const dim3 grid(T, partial ? 2 : 1);
  const int S = mix_splits(p);
  const int mode = ew::row_mode(p.dim, X, y, norm);
  const bool legacy = g_legacy.load(std::memory_order_relaxed);
  dispatch_hc(p.hc, [&](auto H) {
    constexpr int HC = decltype(H)::value;
    auto launch = [&](auto kernel) {
      detail::launch_pdl(kernel, grid, dim3(B), 0, stream, p, scale, base, S, partial, X, pre_in,
                         norm, eps, y, pre, post, comb, NT);
    };
    auto launch_mode = [&](auto E) {
      constexpr bool kEarly = decltype(E)::value;
      if (mode == ew::kRowVecF32)
        launch(hc_mix_pre_norm_kernel<HC, ew::kRowVecF32, kEarly>);
      else if (mode == ew::kRowVecBF16)
        launch(hc_mix_pre_norm_kernel<HC, ew::kRowVecBF16, kEarly>);
      else
        launch(hc_mix_pre_norm_kernel<HC, ew::kRowScalar, kEarly>);
    };
    if (legacy)
      launch_mode(std::false_type{});
    else
      launch_mode(std::true_type{});
  });
  UF_CUDA_CHECK(cudaGetLastError());
}

void hc_pre_norm(const HcShape& p, const float* X, const float* pre_in, const DeviceWeight& norm,
                 float eps, int T, float* y, cudaStream_t stream) {
  hc_mix_pre_norm(p, DeviceWeight{}, DeviceWeight{}, nullptr, X, pre_in, norm, eps, T, y, nullptr,
                  nullptr, nullptr, stream);
}

}  // namespace uf::cuda
