// hc_mixes, hc_pre and hc_post of ops/elementwise.h (cpu/mhc.cpp on the device).
//
// hc_mixes: K split in chunks of 256 stream elements, one block of 256 threads per (chunk, row)
// (a row alone used to be one block streaming the 2 MB fn: 0.8 ms at the released dims). Thread i
// accumulates its elements' (2 + hc) * hc dot products with fn's rows and the sum of squares in
// fp32; warps reduce by butterfly, the warps' partials are added in order into the chunk's
// partial; a second kernel adds the chunks' partials in chunk order, applies
// r = 1 / sqrt(sumsq / n + norm_eps) and runs hc_split_sinkhorn exactly as the CPU writes it
// (same operation order, expf for std::exp). The order depends on (hc, dim) only, never on T. The
// dot products' summation order differs from the CPU's linear_f32 and CUDA's expf may differ from
// glibc's by an ulp or two, so the mixes agree to fp32 rounding, not bitwise
// (tests/cuda/test_ops_elementwise.cpp states the bound).
//
// Fused (the decode step's mHC glue in 2 kernels per sublayer instead of 5 nodes):
//  - hc_post_mixes: hc_post of a sublayer + the split-K partials of the next sublayer's mixes over
//    the values it writes. Grid (chunks of kMixChunk stream elements, groups of kPostRows rows):
//    80 blocks at hc 4, dim 5120, T <= 8; each reads its chunk of fn (24 x 256 values) once for
//    all its rows, R[t, :, d] of its channels and x[t, d], and writes out and the partials in
//    hc_mixes_partial_kernel's layout and order (bitwise its partials). hc_mixes_partial: the same
//    kernel reading X instead of computing hc_post (the first sublayer, after an Engram layer).
//  - hc_mix_pre_norm: grid (T, 2): block (t, 1) the mixes' finish of row t (partials in chunk
//    order, r, Sinkhorn in registers: bitwise hc_mixes_finish_kernel), block (t, 0) hc_pre of row t
//    with the previous pre and rms_norm on it, in rms_norm's partition (bitwise hc_pre + rms_norm).
//
// hc_pre, hc_post: one thread per (row, channel), the CPU's sums in the CPU's order with no
// contraction: bitwise equal to the CPU. hc_post's thread loads R[t, j, d] for every j into
// registers before writing out[t, k, d] for any k, and no other thread touches those elements,
// so out may alias R.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/cuda_check.h"
#include "cuda/ops/elementwise.h"
#include "cuda/ops/elementwise_common.cuh"

namespace uf::cuda {

namespace {

constexpr int kMixThreads = 256;
constexpr int kMixWarps = kMixThreads / 32;
constexpr int kMaxHc = 8;
constexpr int kMixChunk = 256;  // stream elements per hc_mixes block (one per thread)

int mix_splits(const HcShape& p) { return (p.hc * p.dim + kMixChunk - 1) / kMixChunk; }

__device__ __forceinline__ float sigmoid(float x) {
  return ew::fdiv(1.0f, ew::fadd(1.0f, expf(-x)));
}

// cpu::hc_split_sinkhorn for one row on one warp, m: (2 + HC) * HC mixes (already multiplied by
// r), c: shared [HC * HC], sums: shared [HC]. Each sum and each element keeps the CPU's operation
// order (lane j owns row j's softmax and row sums, lane k column k's sums, lane i element i's
// divisions), so the result is the serial loop's, bit for bit, in ~1/16 of its time.
template <int HC>
__device__ void split_sinkhorn_warp(const HcShape& p, const float* m, const float* sc,
                                    const DeviceWeight& base, float* c, float* sums, float* pre,
                                    float* post, float* comb) {
  const int lane = threadIdx.x & 31;
  const float eps = p.hc_eps;
  if (lane < HC) {
    pre[lane] =
        ew::fadd(sigmoid(ew::fadd(ew::fmul(m[lane], sc[0]), ew::weight_flat(base, lane))), eps);
    post[lane] = ew::fmul(
        2.0f, sigmoid(ew::fadd(ew::fmul(m[HC + lane], sc[1]), ew::weight_flat(base, HC + lane))));
  }
  for (int i = lane; i < HC * HC; i += 32)
    c[i] = ew::fadd(ew::fmul(m[2 * HC + i], sc[2]), ew::weight_flat(base, 2 * HC + i));
  __syncwarp();
  if (lane < HC) {  // softmax over row `lane`, + eps
    float* row = c + lane * HC;
    float mx = row[0];
    for (int k = 1; k < HC; ++k) mx = ew::smax(mx, row[k]);
    for (int k = 0; k < HC; ++k) row[k] = expf(ew::fsub(row[k], mx));
    float s = 0.f;
    for (int k = 0; k < HC; ++k) s = ew::fadd(s, row[k]);
    for (int k = 0; k < HC; ++k) row[k] = ew::fadd(ew::fdiv(row[k], s), eps);
  }
  __syncwarp();
  auto norm = [&](bool cols) {
    if (lane < HC) {
      float s = 0.f;
      for (int j = 0; j < HC; ++j) s = ew::fadd(s, cols ? c[j * HC + lane] : c[lane * HC + j]);
      sums[lane] = ew::fadd(s, eps);
    }
    __syncwarp();
    for (int i = lane; i < HC * HC; i += 32) c[i] = ew::fdiv(c[i], sums[cols ? i % HC : i / HC]);
    __syncwarp();
  };
  norm(true);
  for (int it = 0; it < p.sinkhorn_iters - 1; ++it) {
    norm(false);
    norm(true);
  }
  for (int i = lane; i < HC * HC; i += 32) comb[i] = c[i];
}

// Split K: block (s, t) sums its kMixChunk elements of row t into kMix + 1 partials (the mixes'
// dot products and the sum of squares), one element per thread, then warps by
// butterfly and the 8 warps in order. partial[(t * S + s) * (kMix + 1) + m].
template <int HC>
__global__ void __launch_bounds__(kMixThreads)
    hc_mixes_partial_kernel(HcShape p, DeviceWeight fn, const float* X, float* partial) {
  constexpr int kMix = (2 + HC) * HC;
  __shared__ float red[(kMix + 1) * kMixWarps];
  const int n = HC * p.dim, s = blockIdx.x, S = gridDim.x;
  const int64_t t = blockIdx.y;
  const float* x = X + t * n;
  float acc[kMix + 1];
#pragma unroll
  for (int m = 0; m <= kMix; ++m) acc[m] = 0.f;
  const int c0 = s * kMixChunk;
  for (int c = c0 + threadIdx.x; c < min(n, c0 + kMixChunk); c += kMixThreads) {
    const float v = x[c];
    acc[kMix] = ew::fadd(acc[kMix], ew::fmul(v, v));
#pragma unroll
    for (int m = 0; m < kMix; ++m) acc[m] = ew::fadd(acc[m], ew::fmul(ew::weight_at(fn, m, c), v));
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int m = 0; m <= kMix; ++m) {
    float v = acc[m];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = ew::fadd(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) red[m * kMixWarps + warp] = v;
  }
  __syncthreads();
  for (int m = threadIdx.x; m <= kMix; m += kMixThreads) {
    float v = red[m * kMixWarps];
    for (int w = 1; w < kMixWarps; ++w) v = ew::fadd(v, red[m * kMixWarps + w]);
    partial[(t * S + s) * (kMix + 1) + m] = v;
  }
}

// One warp per row: the splits' partials in split order (lane m owns mix m), then r and the
// Sinkhorn (split_sinkhorn_warp).
template <int HC>
__global__ void hc_mixes_finish_kernel(HcShape p, DeviceWeight scale, DeviceWeight base, int S,
                                       const float* partial, float* pre, float* post, float* comb) {
  constexpr int kMix = (2 + HC) * HC;
  __shared__ float mix[kMix + 1], c[HC * HC], sums[HC];
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x;
  const int n = HC * p.dim;
  const float* pt = partial + t * S * (kMix + 1);
  for (int m = lane; m <= kMix; m += 32) {
    float v = pt[m];
    for (int s = 1; s < S; ++s) v = ew::fadd(v, pt[s * (kMix + 1) + m]);
    mix[m] = v;
  }
  __syncwarp();
  const float r = ew::fdiv(1.0f, __fsqrt_rn(ew::fadd(ew::fdiv(mix[kMix], float(n)), p.norm_eps)));
  __syncwarp();
  for (int m = lane; m < kMix; m += 32) mix[m] = ew::fmul(mix[m], r);
  __syncwarp();
  const float sc[3] = {ew::weight_flat(scale, 0), ew::weight_flat(scale, 1),
                       ew::weight_flat(scale, 2)};
  split_sinkhorn_warp<HC>(p, mix, sc, base, c, sums, pre + t * HC, post + t * HC,
                          comb + t * HC * HC);
}

template <int HC>
void launch_mixes(const HcShape& p, const DeviceWeight& fn, const DeviceWeight& scale,
                  const DeviceWeight& base, const float* X, int T, float* pre, float* post,
                  float* comb, float* scratch, cudaStream_t stream) {
  const int S = mix_splits(p);
  hc_mixes_partial_kernel<HC><<<dim3(S, T), kMixThreads, 0, stream>>>(p, fn, X, scratch);
  UF_CUDA_CHECK(cudaGetLastError());
  hc_mixes_finish_kernel<HC><<<T, 32, 0, stream>>>(p, scale, base, S, scratch, pre, post, comb);
}

// ---- fused kernels (hc_post_mixes, hc_mixes_partial, hc_mix_pre_norm) ----

constexpr int kPostRows = 8;       // rows per hc_post_mixes block (fn read once for them)
constexpr int kFinishSmem = 4096;  // floats of partials staged per batch in the finish
constexpr int kMixPreNormMaxThreads = 512;

// Reduce-scatter of VP values per lane (VP a multiple of 32) over a warp, with the tree of the
// xor-shuffle butterfly (distances 16, 8, 4, 2, 1; at each level lane l adds its partner's value
// to its own): at distance o the lane with bit o clear keeps the lower half of its current values
// and its partner the upper half, each receiving the other's copy of the half it keeps. Every
// value goes through exactly the additions the butterfly does on it, so the sums are bitwise the
// butterfly's, for VP * 31 / 32 shuffles instead of VP * 5. On return lane l holds the sums of
// values l * (VP / 32) + q in v[q], q < VP / 32.
// (One level per instantiation so every register index is a compile-time constant.)
template <int VP, int kStep = 0>
__device__ __forceinline__ void warp_reduce_scatter(float (&v)[VP], int lane) {
  if constexpr (kStep < 5) {
    constexpr int o = 16 >> kStep, half = VP >> (kStep + 1);
    const bool upper = (lane & o) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? v[i] : v[half + i];
      const float keep = upper ? v[half + i] : v[i];
      v[i] = ew::fadd(keep, __shfl_xor_sync(0xffffffffu, send, o));
    }
    warp_reduce_scatter<VP, kStep + 1>(v, lane);
  }
}

// Column c of fn (weight_at(fn, m, c) for every m; zeros when !on). One branch on the format
// outside the unrolled loads, so that they are all in flight at once (weight_at's switch inside
// the loop can serialise them: ~24 dependent memory round trips).
template <int N>
__device__ __forceinline__ void load_fn_column(const DeviceWeight& fn, int64_t c, bool on,
                                               float (&w)[N]) {
  if (!on) {
#pragma unroll
    for (int m = 0; m < N; ++m) w[m] = 0.f;
  } else if (fn.format == model::WFormat::kF32) {
    const float* d = reinterpret_cast<const float*>(fn.data) + c;
#pragma unroll
    for (int m = 0; m < N; ++m) w[m] = d[int64_t(m) * fn.cols];
  } else if (fn.format == model::WFormat::kBF16) {
    const uint16_t* d = reinterpret_cast<const uint16_t*>(fn.data) + c;
#pragma unroll
    for (int m = 0; m < N; ++m) w[m] = ew::bf16_to_f32(d[int64_t(m) * fn.cols]);
  } else {
#pragma unroll
    for (int m = 0; m < N; ++m) w[m] = ew::weight_at(fn, m, c);
  }
}

// hc_post (kPost) or a plain read of X (!kPost, X passed as R), then the next mixes' split-K
// partials of the values, for up to kPostRows rows per block. Block (s, g) owns the stream
// elements c = s * kMixChunk + thread of rows g * kPostRows ..: exactly hc_mixes_partial_kernel's
// chunk, thread i on element c0 + i, so each partial is the same butterfly (here as a
// reduce-scatter) and the same in-order sum of the 8 warps: bitwise its partials. The thread's
// kMix values of fn are loaded once for all the block's rows. hc_post's arithmetic is
// hc_post_kernel's. out must not alias R: a block reads R[t, :, d] of every stream while other
// blocks write their chunks.
template <int HC, bool kPost>
__global__ void __launch_bounds__(kMixThreads)
    hc_post_mixes_kernel(HcShape p, const float* x, const float* R, const float* post,
                         const float* comb, int T, float* out, DeviceWeight fn, float* partial) {
  constexpr int kMix = (2 + HC) * HC, M1 = kMix + 1, VP = (M1 + 31) / 32 * 32, Q = VP / 32;
  __shared__ float red[kPostRows * M1 * kMixWarps];
  const int D = p.dim, n = HC * D, s = blockIdx.x, S = gridDim.x;
  const int t0 = blockIdx.y * kPostRows, nt = min(kPostRows, T - t0);
  const int c = s * kMixChunk + threadIdx.x;
  const bool valid = c < n;
  const int ce = valid ? c : 0;  // in-bounds stand-in, so that every load below is unconditional
  const int k = ce / D, d = ce % D;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float w[kMix];
  load_fn_column<kMix>(fn, ce, partial && valid, w);
  // Every row's value first (rows past nt repeat the last one), all loads in flight together.
  float vals[kPostRows];
#pragma unroll
  for (int tt = 0; tt < kPostRows; ++tt) {
    const int64_t t = t0 + min(tt, nt - 1);
    if constexpr (kPost) {
      const float* r = R + t * n + d;
      float rv[HC];
#pragma unroll
      for (int j = 0; j < HC; ++j) rv[j] = r[int64_t(j) * D];
      const float* cb = comb + t * HC * HC;
      float sum = ew::fmul(cb[k], rv[0]);
#pragma unroll
      for (int j = 1; j < HC; ++j) sum = ew::fadd(sum, ew::fmul(cb[j * HC + k], rv[j]));
      vals[tt] = ew::round_bf16(ew::fadd(ew::fmul(post[t * HC + k], x[t * D + d]), sum));
    } else {
      vals[tt] = R[t * n + ce];
    }
  }
  if constexpr (kPost) {
#pragma unroll
    for (int tt = 0; tt < kPostRows; ++tt)
      if (tt < nt && valid) out[(t0 + tt) * int64_t(n) + c] = vals[tt];
  }
  if (!partial) return;
#pragma unroll
  for (int tt = 0; tt < kPostRows; ++tt) {
    if (tt >= nt) break;
    // Elements past n: hc_mixes_partial_kernel's untouched zero accumulators.
    const float v = valid ? vals[tt] : 0.f;
    float a[VP];
#pragma unroll
    for (int m = 0; m < kMix; ++m) a[m] = ew::fadd(0.f, ew::fmul(w[m], v));
    a[kMix] = ew::fadd(0.f, ew::fmul(v, v));
#pragma unroll
    for (int m = M1; m < VP; ++m) a[m] = 0.f;
    warp_reduce_scatter<VP>(a, lane);
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      const int m = lane * Q + q;
      if (m < M1) red[(tt * M1 + m) * kMixWarps + warp] = a[q];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nt * M1; i += kMixThreads) {
    const int tt = i / M1, m = i % M1;
    const float* rw = red + i * kMixWarps;
    float v = rw[0];
    for (int wi = 1; wi < kMixWarps; ++wi) v = ew::fadd(v, rw[wi]);
    partial[((t0 + tt) * int64_t(S) + s) * M1 + m] = v;
  }
}

// The mixes' finish of row t on one block: the row's partials staged through shared memory in
// batches (one memory round trip per batch instead of a dependent load per chunk), thread m adds
// mix m's partials in chunk order (hc_mixes_finish_kernel's order), then warp 0 applies r and runs
// split_sinkhorn_warp. blockDim.x >= kMix + 1.
template <int HC>
__device__ void mixes_finish(const HcShape& p, const DeviceWeight& scale, const DeviceWeight& base,
                             int S, const float* partial, int64_t t, float* sm, float* pre,
                             float* post, float* comb) {
  constexpr int kMix = (2 + HC) * HC, M1 = kMix + 1, SB = kFinishSmem / M1;
  const int B = blockDim.x, tid = threadIdx.x;
  const float* pt = partial + t * S * M1;
  float acc = 0.f;
  for (int s0 = 0; s0 < S; s0 += SB) {
    const int nb = min(SB, S - s0);
    for (int i = tid; i < nb * M1; i += B) sm[i] = pt[int64_t(s0) * M1 + i];
    __syncthreads();
    if (tid < M1) {
      int sb = 0;
      if (s0 == 0) {
        acc = sm[tid];
        sb = 1;
      }
      for (; sb < nb; ++sb) acc = ew::fadd(acc, sm[sb * M1 + tid]);
    }
    __syncthreads();
  }
  if (tid < M1) sm[tid] = acc;
  __syncthreads();
  if (tid >= 32) return;
  const int n = HC * p.dim;
  const float r = ew::fdiv(1.0f, __fsqrt_rn(ew::fadd(ew::fdiv(sm[kMix], float(n)), p.norm_eps)));
  __syncwarp();
  for (int i = tid; i < kMix; i += 32) sm[i] = ew::fmul(sm[i], r);
  __syncwarp();
  // The Sinkhorn on the warp, each division on its own lane (split_sinkhorn_warp): every lane
  // running the whole iteration in registers cost ~30 us a call on H200 (2 ms a step) for the
  // 2 * iters * HC^2 serial IEEE divisions. Same bits either way.
  const float sc[3] = {ew::weight_flat(scale, 0), ew::weight_flat(scale, 1),
                       ew::weight_flat(scale, 2)};
  float* c = sm + 96;                 // [HC * HC] (kMix + 1 <= 81 floats precede it)
  float* sums = c + kMaxHc * kMaxHc;  // [HC]
  split_sinkhorn_warp<HC>(p, sm, sc, base, c, sums, pre + t * HC, post + t * HC,
                          comb + t * HC * HC);
}

// Block (t, 0): hc_pre of row t with pre_in, then rms_norm with nw on the collapsed row in
// registers, in rms_norm_kernel's partition (the first NT = norm_threads(dim) threads, the same
// elements per thread, the same reduction): bitwise hc_pre + rms_norm. Block (t, 1) (with
// partials): the mixes' finish of row t. The two are independent (the collapse uses the previous
// sublayer's pre), so they run side by side.
template <int HC, int kMode>
__global__ void __launch_bounds__(kMixPreNormMaxThreads, 1)
    hc_mix_pre_norm_kernel(HcShape p, DeviceWeight scale, DeviceWeight base, int S,
                           const float* partial, const float* X, const float* pre_in,
                           DeviceWeight nw, float eps, float* y, float* pre, float* post,
                           float* comb, int NT) {
  __shared__ float sm[kFinishSmem];
  const int64_t t = blockIdx.x;
  if (blockIdx.y == 1) {
    mixes_finish<HC>(p, scale, base, S, partial, t, sm, pre, post, comb);
    return;
  }
  const int D = p.dim, nv = (D + 3) / 4, i = threadIdx.x;
  const float* xt = X + t * HC * D;
  float pw[HC];
#pragma unroll
  for (int c = 0; c < HC; ++c) pw[c] = pre_in[t * HC + c];
  // Clamped vector indices: every load is unconditional (all in flight together); `on` says
  // which vectors the thread owns (threads past NT, when the block is wider for the finish, none).
  float4 v[ew::kNormVec], wv[ew::kNormVec];
  bool on[ew::kNormVec];
#pragma unroll
  for (int j = 0; j < ew::kNormVec; ++j) {
    const int q = i + j * NT;
    on[j] = i < NT && q < nv;
    const int qe = min(q, nv - 1);
    float4 xs[HC];
#pragma unroll
    for (int c = 0; c < HC; ++c) xs[c] = ew::load_row4<kMode>(xt + int64_t(c) * D, 4 * qe, D);
    wv[j] = ew::load_weight4<kMode>(nw, 4 * qe, D);
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
}

// Calls f(std::integral_constant<int, hc>{}) for hc in 1..8.
template <typename F>
void dispatch_hc(int hc, F&& f) {
  switch (hc) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 5:
      return f(std::integral_constant<int, 5>{});
    case 6:
      return f(std::integral_constant<int, 6>{});
    case 7:
      return f(std::integral_constant<int, 7>{});
    default:
      return f(std::integral_constant<int, 8>{});
  }
}

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

}  // namespace

size_t hc_mixes_scratch_floats(const HcShape& p, int T) {
  return size_t(std::max(T, 0)) * size_t(mix_splits(p)) * size_t((2 + p.hc) * p.hc + 1);
}

void hc_mixes(const HcShape& p, const DeviceWeight& fn, const DeviceWeight& scale,
              const DeviceWeight& base, const float* X, int T, float* pre, float* post, float* comb,
              float* scratch, cudaStream_t stream) {
  check_shape("hc_mixes", p);
  require(T <= 0 || scratch, "hc_mixes: no scratch (hc_mixes_scratch_floats(p, %d) floats)", T);
  const int mix = (2 + p.hc) * p.hc;
  require(fn.rows == mix && fn.cols == int64_t(p.hc) * p.dim,
          "hc_mixes: fn is [%lld, %lld], expected [%d, %lld]", (long long)fn.rows,
          (long long)fn.cols, mix, (long long)p.hc * p.dim);
  require(scale.rows * scale.cols >= 3 && base.rows * base.cols >= mix,
          "hc_mixes: scale has %lld values (needs 3), base %lld (needs %d)",
          (long long)(scale.rows * scale.cols), (long long)(base.rows * base.cols), mix);
  if (T <= 0) return;
  switch (p.hc) {
    case 1:
      launch_mixes<1>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    case 2:
      launch_mixes<2>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    case 3:
      launch_mixes<3>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    case 4:
      launch_mixes<4>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    case 5:
      launch_mixes<5>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    case 6:
      launch_mixes<6>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    case 7:
      launch_mixes<7>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    default:
      launch_mixes<8>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
  }
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

namespace {

void check_fn(const char* name, const HcShape& p, const DeviceWeight& fn) {
  const int mix = (2 + p.hc) * p.hc;
  require(fn.rows == mix && fn.cols == int64_t(p.hc) * p.dim,
          "%s: fn is [%lld, %lld], expected [%d, %lld]", name, (long long)fn.rows,
          (long long)fn.cols, mix, (long long)p.hc * p.dim);
}

}  // namespace

void hc_mixes_partial(const HcShape& p, const DeviceWeight& fn, const float* X, int T,
                      float* partial, cudaStream_t stream) {
  check_shape("hc_mixes_partial", p);
  check_fn("hc_mixes_partial", p, fn);
  require(T <= 0 || partial, "hc_mixes_partial: no partials buffer (hc_mixes_scratch_floats)");
  if (T <= 0) return;
  const dim3 grid(mix_splits(p), (T + kPostRows - 1) / kPostRows);
  dispatch_hc(p.hc, [&](auto H) {
    hc_post_mixes_kernel<decltype(H)::value, false><<<grid, kMixThreads, 0, stream>>>(
        p, nullptr, X, nullptr, nullptr, T, nullptr, fn, partial);
  });
  UF_CUDA_CHECK(cudaGetLastError());
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
  const dim3 grid(mix_splits(p), (T + kPostRows - 1) / kPostRows);
  float* part = fn.empty() ? nullptr : partial;
  dispatch_hc(p.hc, [&](auto H) {
    hc_post_mixes_kernel<decltype(H)::value, true>
        <<<grid, kMixThreads, 0, stream>>>(p, x, R, post, comb, T, out, fn, part);
  });
  UF_CUDA_CHECK(cudaGetLastError());
}

void hc_mix_pre_norm(const HcShape& p, const DeviceWeight& scale, const DeviceWeight& base,
                     const float* partial, const float* X, const float* pre_in,
                     const DeviceWeight& norm, float eps, int T, float* y, float* pre, float* post,
                     float* comb, cudaStream_t stream) {
  check_shape("hc_mix_pre_norm", p);
  const int NT = ew::norm_threads(p.dim), mix = (2 + p.hc) * p.hc;
  require(NT <= kMixPreNormMaxThreads && p.dim <= ew::kNormVec * 4 * NT,
          "hc_mix_pre_norm: dim %d exceeds the fused kernel's row of %d values", p.dim,
          ew::kNormVec * 4 * kMixPreNormMaxThreads);
  require(!norm.empty() && norm.rows * norm.cols == p.dim,
          "hc_mix_pre_norm: norm weight has %lld x %lld elements, expected %d",
          (long long)norm.rows, (long long)norm.cols, p.dim);
  if (partial) {
    require(scale.rows * scale.cols >= 3 && base.rows * base.cols >= mix,
            "hc_mix_pre_norm: scale has %lld values (needs 3), base %lld (needs %d)",
            (long long)(scale.rows * scale.cols), (long long)(base.rows * base.cols), mix);
    require(pre && post && comb, "hc_mix_pre_norm: partials given without pre / post / comb");
    require(!overlaps(pre, size_t(std::max(T, 0)) * p.hc, pre_in, size_t(std::max(T, 0)) * p.hc),
            "hc_mix_pre_norm: pre (written) overlaps pre_in (read by the collapse)");
  }
  if (T <= 0) return;
  const int B = partial ? std::max(NT, (mix + 1 + 31) / 32 * 32) : NT;
  require(B <= kMixPreNormMaxThreads, "hc_mix_pre_norm: %d threads per block", B);
  const dim3 grid(T, partial ? 2 : 1);
  const int S = mix_splits(p);
  const int mode = ew::row_mode(p.dim, X, y, norm);
  dispatch_hc(p.hc, [&](auto H) {
    constexpr int HC = decltype(H)::value;
    auto launch = [&](auto kernel) {
      kernel<<<grid, B, 0, stream>>>(p, scale, base, S, partial, X, pre_in, norm, eps, y, pre, post,
                                     comb, NT);
    };
    if (mode == ew::kRowVecF32)
      launch(hc_mix_pre_norm_kernel<HC, ew::kRowVecF32>);
    else if (mode == ew::kRowVecBF16)
      launch(hc_mix_pre_norm_kernel<HC, ew::kRowVecBF16>);
    else
      launch(hc_mix_pre_norm_kernel<HC, ew::kRowScalar>);
  });
  UF_CUDA_CHECK(cudaGetLastError());
}

void hc_pre_norm(const HcShape& p, const float* X, const float* pre_in, const DeviceWeight& norm,
                 float eps, int T, float* y, cudaStream_t stream) {
  hc_mix_pre_norm(p, DeviceWeight{}, DeviceWeight{}, nullptr, X, pre_in, norm, eps, T, y, nullptr,
                  nullptr, nullptr, stream);
}

}  // namespace uf::cuda
