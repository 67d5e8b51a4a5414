// hc_post_mixes_mma and hc_fn_terms (ops/mhc_prefill.h): the prefill mHC expand with the next
// sublayer's mixes on the bf16 tensor cores. The header says why and what the kernel computes.
//
// post_mixes_mma_kernel<HC, TERMS>: block = kRows (64) rows x 64 channels (two 32-channel
// splits), 2 * kRows / 16 warps. Shared memory (HC 4, 3 terms, 64 rows: 81 KB, two blocks an
// SM):
//   v      [kRows][HC * 64] bf16, k = stream * 64 + channel, rows padded by 16 bytes (an
//          ldmatrix of 8 rows at one k reads 8 distinct bank groups);
//   terms  [rows of the terms][HC * 64] bf16, the same k and padding;
//   cb     [kRows][HC * HC + HC] fp32: comb then post of each row.
// Phases: cp.async of the terms (issued first: they do not depend on the rows); comb / post; v
// with thread = (row group, channel), 16 rows a thread, all their loads in flight together; then
// warp w runs split w / (kRows / 16) on rows (w % (kRows / 16)) * 16 .. + 15: 2 * HC k16 steps
// (stream s, 16 channels) x rows / 8 n tiles of mma.sync m16n8k16 bf16 -> fp32, operands by
// ldmatrix.x4.
//
// fn_terms_kernel: one thread an element of the terms; hi = round_bf16(f), mid = round_bf16(f -
// hi), lo = f - hi - mid (both differences exact in fp32); poisoned as the header states.

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/ops/elementwise_common.cuh"
#include "cuda/ops/mhc_prefill.h"

namespace uf::cuda {
namespace {

using namespace detail;

constexpr int kSplitChannels = 32;  // the channels of one mixes split (ops/mhc.cu kPostD)
// Rows a block: a warp per (split, 16 rows) in the mma phase. 64 (8 warps, 81 KB: two blocks an
// SM) measured 61.07 / 61.60 ms a 512-row chunk against 61.66 / 61.89 with 32 (H200, same run;
// the outputs are the same bits). A build-time knob for A/B tests (scripts/build-variant).
#ifndef UF_MHC_MMA_ROWS
#define UF_MHC_MMA_ROWS 64
#endif
constexpr int kRows = UF_MHC_MMA_ROWS;
constexpr int kChannels = 2 * kSplitChannels;
constexpr int kThreads = 2 * (kRows / 16) * 32;
constexpr int kRowGroups = kThreads / kChannels;  // rows the v phase's threads cover at once
constexpr int kUnroll = kRows / kRowGroups;  // a thread's rows: all its loads in flight together
static_assert(kRows % 16 == 0 && kThreads % kChannels == 0, "block shape");

constexpr int mix_count(int hc) { return (2 + hc) * hc; }
constexpr int mix_stride(int hc) { return (mix_count(hc) + 7) / 8 * 8; }
constexpr int terms_rows(int terms, int hc) { return (terms * mix_stride(hc) + 15) / 16 * 16; }

template <int HC, int TERMS>
struct Layout {
  static constexpr int kMix = mix_count(HC), kStride = mix_stride(HC);
  static constexpr int kTermRows = terms_rows(TERMS, HC);
  static constexpr int kNt = kTermRows / 8;               // mma n tiles
  static constexpr int kPitch = HC * kChannels * 2 + 16;  // bytes a shared row
  static constexpr int kV = 0;
  static constexpr int kFn = kRows * kPitch;
  static constexpr int kCb = kFn + kTermRows * kPitch;
  static constexpr int kCp = HC * HC + HC;
  static constexpr int kBytes = kCb + kRows * kCp * 4;
  static_assert(kNt % 2 == 0 && kPitch % 16 == 0 && kFn % 16 == 0, "layout");
};

__device__ __forceinline__ bool zero_or_normal(float v) {
  const uint32_t e = (__float_as_uint(v) >> 23) & 0xffu;
  return (__float_as_uint(v) & 0x7fffffffu) == 0 || (e != 0 && e != 0xffu);
}

__global__ void fn_terms_kernel(DeviceWeight fn, int mix, int stride, int terms, int rows,
                                uint16_t* out) {
  const int64_t n = fn.cols, i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(rows) * n) return;
  const int r = int(i / n);
  const int64_t c = i % n;
  const int j = r / stride, m = r % stride;  // term j of mix m
  if (j >= terms || m >= mix) {
    out[i] = 0;
    return;
  }
  const int64_t src = int64_t(m) * n + c;
  const float f = fn.format == model::WFormat::kF32
                      ? reinterpret_cast<const float*>(fn.data)[src]
                      : ew::bf16_to_f32(reinterpret_cast<const uint16_t*>(fn.data)[src]);
  const float hi = ew::round_bf16(f);
  const float r1 = ew::fsub(f, hi);
  const float mid = ew::round_bf16(r1);
  const float lo = ew::fsub(r1, mid);
  const bool exact = terms == 3 ? ew::round_bf16(lo) == lo : r1 == 0.f;
  const bool ok = exact && zero_or_normal(hi) && zero_or_normal(mid) && zero_or_normal(lo);
  const float t = j == 0 ? (ok ? hi : __uint_as_float(0x7fc00000u)) : (j == 1 ? mid : lo);
  out[i] = uint16_t(__float_as_uint(t) >> 16);
}

template <int HC, int TERMS>
__global__ void __launch_bounds__(kThreads)
    post_mixes_mma_kernel(int T, int D, const float* x, const float* R, const float* post,
                          const float* comb, float* out, const uint16_t* fnw, float* partial) {
  detail::pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  detail::pdl_trigger();
  using L = Layout<HC, TERMS>;
  constexpr int HH = HC * HC, CP = L::kCp, kMix = L::kMix, M1 = kMix + 1;
  extern __shared__ __align__(16) uint8_t sm[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int d0 = blockIdx.x * kChannels, t0 = blockIdx.y * kRows;
  const int S = (D + kSplitChannels - 1) / kSplitChannels;
  const int64_t n = int64_t(HC) * D;
  const uint32_t sbase = uint32_t(__cvta_generic_to_shared(sm));

  // 1. The terms of channels [d0, d0 + 64) of every stream, 16-byte pieces of 8 channels (dim % 8
  // == 0: a piece is whole or past dim, zero-filled).
  constexpr int kPiecesRow = kChannels / 8;
  for (int i = tid; i < L::kTermRows * HC * kPiecesRow; i += kThreads) {
    const int p = i % kPiecesRow, k = (i / kPiecesRow) % HC, r = i / (kPiecesRow * HC);
    const int d = d0 + 8 * p;
    const bool valid = d < D;
    const uint16_t* src = fnw + int64_t(r) * n + int64_t(k) * D + (valid ? d : 0);
    cp16_zfill(sbase + L::kFn + r * L::kPitch + (k * kChannels + 8 * p) * 2, src, valid);
  }
  cp_async_commit();
  float* cb = reinterpret_cast<float*>(sm + L::kCb);
  for (int i = tid; i < kRows * CP; i += kThreads) {
    const int r = i / CP, j = i % CP, t = t0 + r;
    cb[i] = t < T ? (j < HH ? comb[int64_t(t) * HH + j] : post[int64_t(t) * HC + j - HH]) : 0.f;
  }
  __syncthreads();

  // 2. v = hc_post_mixes_rows_kernel's expression (comb[t, j, k] at cb[j * HC + k], post[t, k]
  // at cb[HH + k]), out, v as bf16, |v|^2 of the warp's split.
  uint16_t* vs = reinterpret_cast<uint16_t*>(sm + L::kV);
  const int c = tid & (kChannels - 1), rh = tid / kChannels, d = d0 + c;
  const int s_warp = (d0 + (c & ~(kSplitChannels - 1))) / kSplitChannels;
  for (int r0 = 0; r0 < kRows; r0 += kRowGroups * kUnroll) {
    float rv[kUnroll][HC], xv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = t0 + r0 + kRowGroups * u + rh;
      const bool ok = d < D && t < T;
#pragma unroll
      for (int k = 0; k < HC; ++k) rv[u][k] = ok ? R[int64_t(t) * n + int64_t(k) * D + d] : 0.f;
      xv[u] = ok ? x[int64_t(t) * D + d] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int r = r0 + kRowGroups * u + rh, t = t0 + r;
      const bool ok = d < D && t < T;
      const float* cbr = cb + r * CP;
      float sq = 0.f;
#pragma unroll
      for (int k = 0; k < HC; ++k) {
        float sum = ew::fmul(cbr[k], rv[u][0]);
#pragma unroll
        for (int j = 1; j < HC; ++j) sum = ew::fadd(sum, ew::fmul(cbr[j * HC + k], rv[u][j]));
        float v = ew::round_bf16(ew::fadd(ew::fmul(cbr[HH + k], xv[u]), sum));
        if (ok)
          out[int64_t(t) * n + int64_t(k) * D + d] = v;
        else
          v = 0.f;
        vs[r * (L::kPitch / 2) + k * kChannels + c] = uint16_t(__float_as_uint(v) >> 16);
        sq = k == 0 ? ew::fmul(v, v) : ew::fadd(sq, ew::fmul(v, v));
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sq = ew::fadd(sq, __shfl_xor_sync(0xffffffffu, sq, o));
      if (lane == 0 && t < T && s_warp < S) partial[(int64_t(t) * M1 + kMix) * S + s_warp] = sq;
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // 3. Warp w: split q = w / (kRows / 16) of the block, rows mt * 16 .. + 15.
  const int q = warp / (kRows / 16), mt = warp % (kRows / 16), s = blockIdx.x * 2 + q;
  float acc[L::kNt][4];
#pragma unroll
  for (int j = 0; j < L::kNt; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  const uint32_t a_row = sbase + L::kV + uint32_t((mt * 16 + (lane & 15)) * L::kPitch);
  const int a_k = (lane >> 4) * 8;
  const uint32_t b_row = sbase + L::kFn + uint32_t(((lane & 7) + ((lane >> 4) << 3)) * L::kPitch);
  const int b_k = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int i = 0; i < 2 * HC; ++i) {
    const int kb = (i >> 1) * kChannels + q * kSplitChannels + (i & 1) * 16;
    uint32_t a[4];
    ldsm_x4(a_row + uint32_t((kb + a_k) * 2), a);
#pragma unroll
    for (int np = 0; np < L::kNt / 2; ++np) {
      uint32_t b[4];
      ldsm_x4(b_row + uint32_t(np * 16 * L::kPitch + (kb + b_k) * 2), b);
      mma_bf16(acc[2 * np], a[0], a[1], a[2], a[3], b[0], b[1]);
      mma_bf16(acc[2 * np + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
    }
  }
  if (s >= S) return;  // the block's second split lies past dim
  // Accumulator (row g + 8 h, column 2 tq + e) of n tile j: term j / (stride / 8) of mix
  // (j % (stride / 8)) * 8 + 2 tq + e; a mix's terms are in the same thread.
  constexpr int NT = L::kStride / 8;
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = t0 + mt * 16 + g + 8 * h;
    if (t >= T) continue;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = j * 8 + 2 * tq + e;
        if (m >= kMix) continue;
        float v = acc[j][2 * h + e];
#pragma unroll
        for (int term = 1; term < TERMS; ++term) v = ew::fadd(v, acc[term * NT + j][2 * h + e]);
        partial[(int64_t(t) * M1 + m) * S + s] = v;
      }
  }
}

template <int HC, int TERMS>
void launch(const HcShape& p, const float* x, const float* R, const float* post, const float* comb,
            int T, float* out, const HcFnTerms& fn, float* partial, cudaStream_t stream) {
  using L = Layout<HC, TERMS>;
  const auto kernel = post_mixes_mma_kernel<HC, TERMS>;
  static PerDeviceOnce once;
  once([&] { raise_smem(kernel, L::kBytes); });
  const dim3 grid(unsigned((p.dim + kChannels - 1) / kChannels), unsigned((T + kRows - 1) / kRows));
  detail::launch_pdl(kernel, grid, dim3(kThreads), size_t(L::kBytes), stream, T, p.dim, x, R, post,
                     comb, out, fn.w, partial);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool hc_post_mixes_mma_supported(const HcShape& p, const DeviceWeight& fn) {
  return p.hc >= 1 && p.hc <= 4 && p.dim > 0 && p.dim % 8 == 0 && !fn.empty() &&
         (fn.format == model::WFormat::kF32 || fn.format == model::WFormat::kBF16) &&
         fn.rows == mix_count(p.hc) && fn.cols == int64_t(p.hc) * p.dim;
}

HcFnTerms hc_fn_terms(const HcShape& p, const DeviceWeight& fn, DeviceArena& arena) {
  if (!hc_post_mixes_mma_supported(p, fn)) return HcFnTerms{};
  HcFnTerms t;
  t.terms = fn.format == model::WFormat::kF32 ? 3 : 1;
  t.stride = mix_stride(p.hc);
  t.rows = terms_rows(t.terms, p.hc);
  uint16_t* dst = arena.alloc<uint16_t>(size_t(t.rows) * size_t(fn.cols));
  t.w = dst;
  const int mix = mix_count(p.hc), stride = t.stride, terms = t.terms, rows = t.rows;
  UploadScope::after_upload([fn, mix, stride, terms, rows, dst] {
    const int64_t n = int64_t(rows) * fn.cols;
    fn_terms_kernel<<<unsigned((n + 255) / 256), 256>>>(fn, mix, stride, terms, rows, dst);
    UF_CUDA_CHECK(cudaGetLastError());
  });
  return t;
}

void hc_post_mixes_mma(const HcShape& p, const float* x, const float* R, const float* post,
                       const float* comb, int T, float* out, const HcFnTerms& fn, float* partial,
                       cudaStream_t stream) {
  require(p.hc >= 1 && p.hc <= 4 && p.dim > 0 && p.dim % 8 == 0,
          "hc_post_mixes_mma: hc = %d (1..4), dim = %d (a multiple of 8)", p.hc, p.dim);
  require(!fn.empty() && (fn.terms == 1 || fn.terms == 3) && fn.stride == mix_stride(p.hc) &&
              fn.rows == terms_rows(fn.terms, p.hc),
          "hc_post_mixes_mma: fn terms (%d terms, stride %d, %d rows) are not hc_fn_terms' for "
          "hc = %d",
          fn.terms, fn.stride, fn.rows, p.hc);
  if (T <= 0) return;
  require(x && R && post && comb && out && partial, "hc_post_mixes_mma: a null input or output");
  const size_t n = size_t(T) * size_t(p.hc) * size_t(p.dim);
  require(out + n <= R || R + n <= out, "hc_post_mixes_mma: out overlaps R (T = %d)", T);
  ew::dispatch_hc(p.hc, [&](auto H) {
    constexpr int HC = decltype(H)::value;
    if constexpr (HC <= 4) {  // hc_post_mixes_mma_supported's range (required above)
      if (fn.terms == 3)
        launch<HC, 3>(p, x, R, post, comb, T, out, fn, partial, stream);
      else
        launch<HC, 1>(p, x, R, post, comb, T, out, fn, partial, stream);
    }
  });
}

}  // namespace uf::cuda
