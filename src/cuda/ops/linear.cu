// DeviceLinear (ops/linear.h) and the generic linear kernels (ops/linear_kernels.h).
//
// Generic kernels:
//   dense_rows_kernel (kBf16Out, kF32): the CPU's products, summed in another fp32 order (K split
//     over a block's warps, below); the order depends on K only, so a row's bits never depend on
//     the other rows of the call. It replaced a kernel that restated cpu::dot8's order bit for
//     bit: 8 lanes per row with strided 2-byte loads ran the released router gate [384, 5120] in
//     267 us and the head at ~550 GB/s (session 3's profile); the fp32 order is not worth that.
//   quant_rows_kernel (bitwise equal to cpu/linear.cpp): one warp per output feature, lane i =
//   element i of a 32-block; the block's
//     32 exact products are summed in dot8's order (chains j, j+8, j+16, j+24, then the pair tree),
//     then acc += (partial * a_scale) * w_scale in K order (cpu::quant_row_tile).
//   quant_rows_x_kernel: quant_rows_kernel with the FP8 act quant of x done in the warp (the same
//     warp_quant_fp8_block as act_quant_fp8_f32): one launch instead of two, same bits.
// The *Bf16X kinds (x declared bf16-exact by the caller) run DenseMma (kernels/dense_mma.h) in
// place of dense_rows where the weight is BF16 or FP8 with cols % 64 == 0: the same exact
// products on tensor cores, another fp32 order (stated there), split K for weights with few rows.
// The fast path of kQuant is Fp8Gemv (FP8 32x32-block weights, rows % 16 == 0): it differs from the
// CPU only in the order of a block's 32 terms (tensor core) and the K-split grouping (fp32 order).
// DeviceLinear uses its fused entry (run_fused: act quant, GEMV, split-K finish and bf16 rounding
// in one launch); every path is one launch per call (Fp8Gemv: per 8 rows), see linear.h.
// Launches per call before this: Fp8Gemv 3 per 8 rows (act_quant, GEMV, round; 2 for
// apply_partial), quant_rows 2 per 8 rows, dense_rows / apply_rows 1 per 8 rows.

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <type_traits>

#include "cuda/cuda_check.h"
#include "cuda/gemv.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/dense_mma.h"
#include "cuda/ops/elementwise_common.cuh"
#include "cuda/ops/linear.h"
#include "cuda/ops/linear_kernels.h"
#include "cuda/prefill_gemm.h"

namespace uf::cuda {

using model::WFormat;

namespace ops_detail {
namespace {

// Dense GEMV (every kind but kQuant): block = kDenseWarps warps on R output rows; the warps split
// K in interleaved 256-element chunks (warp w: chunks w, w + 8, ...; lane l: 8 consecutive
// elements of each), so a row's weights are read once with 16-byte loads and the x values a lane
// loads serve R rows. Per lane fp32 FMAs in K order, warps by butterfly, then the warps' sums in
// warp order: a fixed order that depends on (K) only, never on m (spec == plain).
constexpr int kDenseWarps = 8;
constexpr int kDenseChunk = 256;  // elements per warp and step (32 lanes x 8)

// Elements k .. k + 7 of weight row r (fp32 values of model::Weight::at), 16-byte (8-byte for
// FP8) loads; needs K % 8 == 0 and a BF16, F32 or FP8 weight (dense_fast()).
__device__ __forceinline__ void load8_fast(const DeviceWeight& w, int64_t r, int64_t k,
                                           float (&v)[8]) {
  if (w.format == WFormat::kBF16) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(w.data + (r * w.cols + k) * 2));
    const uint32_t u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(u[i] << 16);
      v[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
  } else if (w.format == WFormat::kFP8) {  // 8 codes share one block scale
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(w.data + r * w.cols + k));
    const float sc = ew::weight_block_scale(w, r, k / 32);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      v[i] = ew::fmul(ew::e4m3_to_f32(uint8_t(((i < 4 ? q.x : q.y) >> (8 * (i & 3))) & 0xff)), sc);
  } else {
    const float4* p = reinterpret_cast<const float4*>(w.data + (r * w.cols + k) * 4);
    const float4 a = __ldg(p), b = __ldg(p + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
}

// Any format and K, element by element (kept out of line: its registers would cost the fast
// path occupancy).
__device__ __noinline__ void load8_any(const DeviceWeight& w, int64_t r, int64_t k, float* v) {
  for (int i = 0; i < 8; ++i) v[i] = k + i < w.cols ? ew::weight_at(w, r, k + i) : 0.f;
}

// MT: token rows the registers are sized for (m <= MT); a row's arithmetic does not depend on it.
// kFast: load8_fast weights and 16-byte x loads (x 16-byte aligned, x_stride % 4 == 0).
template <int R, int MT, bool kFast>
__global__ void __launch_bounds__(kDenseWarps * 32, 2)
    dense_rows_kernel(DeviceWeight w, int64_t r0, int64_t n, const float* x, int64_t x_stride,
                      int m, float* y, int64_t y_stride, bool round) {
  __shared__ float red[kDenseWarps][R][MT];
  detail::pdl_trigger();  // launched with PDL: x comes from the previous kernel
  detail::pdl_wait();
  // Token rows [8 * blockIdx.y, + 8) of the call: one launch for any row count.
  x += int64_t(blockIdx.y) * kMaxDecodeRows * x_stride;
  y += int64_t(blockIdx.y) * kMaxDecodeRows * y_stride;
  m = min(m - int(blockIdx.y) * kMaxDecodeRows, kMaxDecodeRows);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t j0 = int64_t(blockIdx.x) * R;
  const int64_t K = w.cols;
  float acc[R][MT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t) acc[r][t] = 0.f;
  for (int64_t k = int64_t(warp) * kDenseChunk + lane * 8; k < K;
       k += int64_t(kDenseWarps) * kDenseChunk) {
    float wv[R][8];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (j0 + r < n) {
        if constexpr (kFast)
          load8_fast(w, r0 + j0 + r, k, wv[r]);
        else
          load8_any(w, r0 + j0 + r, k, wv[r]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) wv[r][i] = 0.f;
      }
    }
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      if (t >= m) break;
      float xv[8];
      if constexpr (kFast) {
        const float4* xp = reinterpret_cast<const float4*>(x + t * x_stride + k);
        const float4 a = xp[0], b = xp[1];
        xv[0] = a.x, xv[1] = a.y, xv[2] = a.z, xv[3] = a.w, xv[4] = b.x, xv[5] = b.y, xv[6] = b.z,
        xv[7] = b.w;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) xv[i] = k + i < K ? x[t * x_stride + k + i] : 0.f;
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][t] = fmaf(xv[i], wv[r][i], acc[r][t]);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      float v = acc[r][t];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
      if (lane == 0) red[warp][r][t] = v;
    }
  __syncthreads();
  for (int i = threadIdx.x; i < R * m; i += blockDim.x) {
    const int r = i / m, t = i % m;
    if (j0 + r >= n) continue;
    float v = red[0][r][t];
    for (int q = 1; q < kDenseWarps; ++q) v = __fadd_rn(v, red[q][r][t]);
    y[t * y_stride + j0 + r] = round ? detail::round_bf16(v) : v;
  }
}

constexpr int kQuantWarps = 4;

__global__ void __launch_bounds__(kQuantWarps * 32)
    quant_rows_kernel(DeviceWeight w, int64_t n, const uint8_t* codes, const float* scales, int m,
                      float* y, int64_t y_stride, bool round) {
  const int lane = threadIdx.x & 31;
  const int64_t r = int64_t(blockIdx.x) * kQuantWarps + (threadIdx.x >> 5);
  if (r >= n) return;  // warp-uniform
  const int64_t K = w.cols, KB = K / 32;
  float acc[kMaxDecodeRows];
#pragma unroll
  for (int t = 0; t < kMaxDecodeRows; ++t) acc[t] = 0.f;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int64_t k = kb * 32 + lane;
    const float wv = ew::weight_code(w, r, k);
    const float sw = ew::weight_block_scale(w, r, kb);
#pragma unroll
    for (int t = 0; t < kMaxDecodeRows; ++t) {
      if (t >= m) break;  // uniform
      const float p = __fmul_rn(ew::e4m3_to_f32(codes[t * K + k]), wv);
      // dot8 over 32 elements: chain j = ((0 + p_j) + p_{j+8}) + p_{j+16}) + p_{j+24}.
      const float q8 = __shfl_down_sync(0xffffffffu, p, 8);
      const float q16 = __shfl_down_sync(0xffffffffu, p, 16);
      const float q24 = __shfl_down_sync(0xffffffffu, p, 24);
      float v = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(0.f, p), q8), q16), q24);
      v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 1));
      v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 2));
      v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 4));
      if (lane == 0) acc[t] = __fadd_rn(acc[t], __fmul_rn(__fmul_rn(v, scales[t * KB + kb]), sw));
    }
  }
  if (lane == 0)
    for (int t = 0; t < m; ++t) y[t * y_stride + r] = round ? detail::round_bf16(acc[t]) : acc[t];
}

// quant_rows_kernel on fp32 x, quantised in the warp as act_quant_fp8_f32 does (the same
// warp_quant_fp8_block on the same 32 values): bitwise act_quant + quant_rows. Every warp
// re-quantises the x it reads (a few shuffles per block and row; this is the fallback path), so the
// linear is one launch. blockIdx.y = chunk of 8 token rows.
__global__ void __launch_bounds__(kQuantWarps * 32)
    quant_rows_x_kernel(DeviceWeight w, int64_t n, const float* x, int64_t x_stride, int m,
                        float* y, int64_t y_stride, bool round) {
  const int lane = threadIdx.x & 31;
  const int64_t r = int64_t(blockIdx.x) * kQuantWarps + (threadIdx.x >> 5);
  if (r >= n) return;  // warp-uniform
  x += int64_t(blockIdx.y) * kMaxDecodeRows * x_stride;
  y += int64_t(blockIdx.y) * kMaxDecodeRows * y_stride;
  m = min(m - int(blockIdx.y) * kMaxDecodeRows, kMaxDecodeRows);
  const int64_t K = w.cols, KB = K / 32;
  float acc[kMaxDecodeRows];
#pragma unroll
  for (int t = 0; t < kMaxDecodeRows; ++t) acc[t] = 0.f;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int64_t k = kb * 32 + lane;
    const float wv = ew::weight_code(w, r, k);
    const float sw = ew::weight_block_scale(w, r, kb);
#pragma unroll
    for (int t = 0; t < kMaxDecodeRows; ++t) {
      if (t >= m) break;  // uniform
      float sa;
      const uint8_t code = detail::warp_quant_fp8_block(x[t * x_stride + k], &sa);
      const float p = __fmul_rn(ew::e4m3_to_f32(code), wv);
      // dot8 over 32 elements, as quant_rows_kernel.
      const float q8 = __shfl_down_sync(0xffffffffu, p, 8);
      const float q16 = __shfl_down_sync(0xffffffffu, p, 16);
      const float q24 = __shfl_down_sync(0xffffffffu, p, 24);
      float v = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(0.f, p), q8), q16), q24);
      v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 1));
      v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 2));
      v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 4));
      if (lane == 0) acc[t] = __fadd_rn(acc[t], __fmul_rn(__fmul_rn(v, sa), sw));
    }
  }
  if (lane == 0)
    for (int t = 0; t < m; ++t) y[t * y_stride + r] = round ? detail::round_bf16(acc[t]) : acc[t];
}

__global__ void round_bf16_kernel(float* y, size_t n) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = detail::round_bf16(y[i]);
}

}  // namespace

void dense_rows(const DeviceWeight& w, int64_t r0, int64_t n, const float* x, int64_t x_stride,
                int m, float* y, int64_t y_stride, bool round_bf16, cudaStream_t stream) {
  if (n <= 0 || m <= 0) return;
  // Four weight rows per block where there are blocks enough to fill the GPU (the x values a
  // lane loads then serve four weight rows): wide weights, or prefill calls of 4+ chunks of 8
  // token rows (the router's [384, 5120] gate at 512 rows: 96 x 64 blocks); one weight row a
  // block otherwise, for parallelism. A row's fp32 order does not depend on R.
  const int64_t chunks = (m + kMaxDecodeRows - 1) / kMaxDecodeRows;
  const bool wide = n >= 4096 || chunks >= 4;
  const bool fast =
      (w.format == WFormat::kBF16 || w.format == WFormat::kF32 || w.format == WFormat::kFP8) &&
      w.cols % 8 == 0 && x_stride % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  // One launch: blockIdx.y = chunk of 8 token rows. The registers are sized for the largest
  // chunk; a row's arithmetic does not depend on MT.
  require(chunks <= 65535, "dense_rows: %d rows exceed one launch's 65535 chunks of 8", m);
  const int mc = std::min(kMaxDecodeRows, m);
  auto launch = [&](auto r_rows, auto m_rows) {
    constexpr int R = decltype(r_rows)::value, MT = decltype(m_rows)::value;
    const dim3 grid{unsigned((n + R - 1) / R), unsigned(chunks)};
    if (fast)
      detail::launch_pdl(dense_rows_kernel<R, MT, true>, grid, dim3(kDenseWarps * 32), 0, stream, w,
                         r0, n, x, x_stride, m, y, y_stride, round_bf16);
    else
      detail::launch_pdl(dense_rows_kernel<R, MT, false>, grid, dim3(kDenseWarps * 32), 0, stream,
                         w, r0, n, x, x_stride, m, y, y_stride, round_bf16);
  };
  // Registers for 1, 2, 4 or 8 token rows: fewer registers, more warps in flight at small m.
  auto by_rows = [&](auto r_rows) {
    if (mc == 1)
      launch(r_rows, std::integral_constant<int, 1>{});
    else if (mc <= 2)
      launch(r_rows, std::integral_constant<int, 2>{});
    else if (mc <= 4)
      launch(r_rows, std::integral_constant<int, 4>{});
    else
      launch(r_rows, std::integral_constant<int, kMaxDecodeRows>{});
  };
  if (wide)
    by_rows(std::integral_constant<int, 4>{});
  else
    by_rows(std::integral_constant<int, 1>{});
  UF_CUDA_CHECK(cudaGetLastError());
}

namespace {
void quant_rows_impl(const DeviceWeight& w, const uint8_t* codes, const float* scales, int m,
                     float* y, int64_t y_stride, bool round, cudaStream_t stream) {
  require(m >= 1 && m <= kMaxDecodeRows, "quant_rows: m = %d must be in 1..8", m);
  const unsigned blocks = unsigned((w.rows + kQuantWarps - 1) / kQuantWarps);
  quant_rows_kernel<<<blocks, kQuantWarps * 32, 0, stream>>>(w, w.rows, codes, scales, m, y,
                                                             y_stride, round);
  UF_CUDA_CHECK(cudaGetLastError());
}
}  // namespace

void quant_rows(const DeviceWeight& w, const uint8_t* codes, const float* scales, int m, float* y,
                int64_t y_stride, cudaStream_t stream) {
  quant_rows_impl(w, codes, scales, m, y, y_stride, true, stream);
}

void quant_rows_x(const DeviceWeight& w, const float* x, int64_t x_stride, int m, float* y,
                  int64_t y_stride, bool round_bf16, cudaStream_t stream) {
  if (m <= 0) return;
  const int64_t chunks = (m + kMaxDecodeRows - 1) / kMaxDecodeRows;
  require(chunks <= 65535, "quant_rows_x: %d rows exceed one launch's 65535 chunks of 8", m);
  const dim3 grid{unsigned((w.rows + kQuantWarps - 1) / kQuantWarps), unsigned(chunks)};
  quant_rows_x_kernel<<<grid, kQuantWarps * 32, 0, stream>>>(w, w.rows, x, x_stride, m, y, y_stride,
                                                             round_bf16);
  UF_CUDA_CHECK(cudaGetLastError());
}

void round_bf16_inplace(float* y, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  round_bf16_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(y, n);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ops_detail

namespace {
std::atomic<PrefillGemm> g_prefill_gemm{PrefillGemm::kBf16};
// The kinds whose bf16-exact-x contract holds for prefill calls only (decode calls: dense_rows).
bool prefill_only_bf16x(LinearKind k) {
  return k == LinearKind::kF32Bf16XPrefill || k == LinearKind::kBf16OutBf16XPrefill;
}

// A bf16 copy of an FP8 32x32-block weight (its exact values), made once the load's uploads
// have put the weight on the device (UploadScope::after_upload; at once without a scope).
const uint16_t* bf16_copy(const DeviceWeight& w, DeviceArena& arena) {
  uint16_t* dst = arena.alloc<uint16_t>(size_t(w.rows) * size_t(w.cols));
  const Fp8WeightView wv{w.data, w.scale, int(w.rows), int(w.cols)};
  UploadScope::after_upload([wv, dst] { fp8_weight_to_bf16(wv, dst, nullptr); });
  return dst;
}
}  // namespace

void set_default_prefill_gemm(PrefillGemm g) { g_prefill_gemm.store(g); }
PrefillGemm default_prefill_gemm() { return g_prefill_gemm.load(); }

struct DeviceLinear::Plan {
  std::unique_ptr<Fp8Gemv> gemv;  // kQuant fast path (FP8 32x32 blocks, rows % 16 == 0)
  std::unique_ptr<DenseMma> mma;  // *Bf16X kinds on BF16 / FP8 weights (DenseMma::supports)
  uint8_t* codes = nullptr;       // act quant workspace [8, cols] of the misaligned-x fallback
  float* scales = nullptr;        // [8, cols / 32]
  // Prefill GEMM (pf_rows == 0: none, the decode GEMV by chunks of 8 rows). kFp8Bitwise:
  // activation codes [pf_rows, cols] and scales [pf_rows, cols / 32]; kBf16: the QDQ'd
  // activations [pf_rows, cols] and the weight's bf16 copy [rows, cols].
  int pf_rows = 0;
  PrefillGemm pf_gemm = PrefillGemm::kBf16;
  uint8_t* pf_codes = nullptr;
  float* pf_scales = nullptr;
  uint16_t* pf_act = nullptr;
  const uint16_t* w_bf16 = nullptr;
  // The *Bf16X kinds at prefill (kBf16, pf_rows > 0): bf16_gemm on the weight's bf16 values (a
  // copy for FP8 weights: w_bf16; BF16 weights are read in place) and x's bf16 bits (pf_x
  // [pf_rows, cols]: bf16_exact_rows, a value that is not bf16-exact poisons its row as DenseMma
  // does). Null: DenseMma / dense_rows as decode calls.
  const uint16_t* dense_w = nullptr;
  uint16_t* pf_x = nullptr;

  // One chunk of m <= pf_rows prefill rows whose activations are already in this plan's
  // workspace (ws: the plan that quantised them, this one or a group's first).
  void gemm(const DeviceWeight& w, const Plan& ws, int m, float* y, bool round,
            cudaStream_t stream) const {
    const int N = int(w.rows), K = int(w.cols);
    if (pf_gemm == PrefillGemm::kBf16) {
      bf16_gemm(ws.pf_act, w_bf16, m, N, K, y, N, round, stream);
    } else {
      const QuantActView av{ws.pf_codes, ws.pf_scales, m, K};
      fp8_gemm_prefill(Fp8WeightView{w.data, w.scale, N, K}, av, gemv->kb_per_split(), y, round,
                       stream);
    }
  }
  void quantise(const float* x, int64_t x_stride, int m, int K, cudaStream_t stream) const {
    if (pf_gemm == PrefillGemm::kBf16)
      act_qdq_fp8_bf16_rows(x, x_stride, m, K, pf_act, stream);
    else
      act_quant_fp8_rows(x, x_stride, m, K, pf_codes, pf_scales, stream);
  }
  // Rows of a T-row call that a GEMM of chunks of `chunk` rows takes: all of them for kBf16 (a
  // prefill row's bits do not depend on the call's length), all but a last chunk of <= 8 for
  // kFp8Bitwise (those take the GEMV: the same bits).
  static int gemm_rows(PrefillGemm kind, int chunk, int T) {
    if (chunk == 0 || T <= kMaxDecodeRows) return 0;
    const int tail = T % chunk;
    return kind == PrefillGemm::kBf16 || tail == 0 || tail > kMaxDecodeRows ? T : T - tail;
  }
};

DeviceLinear::DeviceLinear(const model::Weight& w, LinearKind kind, DeviceArena& arena,
                           int max_prefill_rows)
    : kind_(kind) {
  require(max_prefill_rows >= 0, "DeviceLinear: max_prefill_rows = %d must be >= 0",
          max_prefill_rows);
  const bool quantised = w.format == WFormat::kFP8 || w.format == WFormat::kFP4;
  if (kind_ == LinearKind::kAuto) kind_ = quantised ? LinearKind::kQuant : LinearKind::kBf16Out;
  require(kind_ != LinearKind::kQuant || quantised,
          "DeviceLinear: weight '%s' is not FP8/FP4, so it cannot take the quantised path",
          w.name.c_str());
  require(!quantised || w.cols % 32 == 0,
          "DeviceLinear: weight '%s' has %lld inputs, not a multiple of 32", w.name.c_str(),
          static_cast<long long>(w.cols));
  w_ = upload_weight(w, arena);
  plan_ = std::make_unique<Plan>();
  if (kind_ == LinearKind::kQuant && !w.empty() && w.format == WFormat::kFP8 && !w.row_scale &&
      w.rows % 16 == 0 && w.rows < (1 << 30) && w.cols < (1 << 30)) {
    plan_->gemv = std::make_unique<Fp8Gemv>(int(w.rows), int(w.cols), device_sm_count());
    // Only the misaligned-x fallback (act_quant + run) uses these; quant_rows_x needs none.
    plan_->codes = arena.alloc<uint8_t>(size_t(kMaxDecodeRows) * size_t(w.cols));
    plan_->scales = arena.alloc<float>(size_t(kMaxDecodeRows) * size_t(w.cols / 32));
    if (max_prefill_rows > kMaxDecodeRows) {
      Plan& pl = *plan_;
      pl.pf_rows = max_prefill_rows;
      pl.pf_gemm = default_prefill_gemm();
      if (pl.pf_gemm == PrefillGemm::kBf16) {
        pl.pf_act = arena.alloc<uint16_t>(size_t(max_prefill_rows) * size_t(w.cols));
        pl.w_bf16 = bf16_copy(w_, arena);
      } else {
        pl.pf_codes = arena.alloc<uint8_t>(size_t(max_prefill_rows) * size_t(w.cols));
        pl.pf_scales = arena.alloc<float>(size_t(max_prefill_rows) * size_t(w.cols / 32));
      }
    }
  }
  const bool bf16x = kind_ == LinearKind::kBf16OutBf16X || kind_ == LinearKind::kF32Bf16X ||
                     prefill_only_bf16x(kind_);
  if (bf16x && DenseMma::supports(w_))
    plan_->mma = std::make_unique<DenseMma>(w_, device_sm_count());
  if (bf16x && !w.empty() && max_prefill_rows > kMaxDecodeRows &&
      default_prefill_gemm() == PrefillGemm::kBf16 && w.rows % 16 == 0 && w.cols % 32 == 0 &&
      w.rows < (1 << 30) && w.cols < (1 << 30) &&
      (w.format == WFormat::kBF16 || (w.format == WFormat::kFP8 && !w.row_scale))) {
    Plan& pl = *plan_;
    pl.pf_rows = max_prefill_rows;
    pl.pf_x = arena.alloc<uint16_t>(size_t(max_prefill_rows) * size_t(w.cols));
    pl.dense_w = w.format == WFormat::kBF16 ? reinterpret_cast<const uint16_t*>(w_.data)
                                            : bf16_copy(w_, arena);
  }
}

// The *Bf16X kinds' prefill path (Plan::dense_w): output rows [r0, r0 + n) by chunks of pf_rows.
bool DeviceLinear::dense_gemm(int64_t r0, int64_t n, const float* x, int64_t x_stride, int T,
                              float* y, int64_t y_stride, bool round, cudaStream_t stream) const {
  const Plan& pl = *plan_;
  const int64_t K = w_.cols;
  if (!pl.dense_w || T <= kMaxDecodeRows || n % 16 != 0 || (r0 * K) % 8 != 0 ||
      y_stride > (int64_t(1) << 30) || reinterpret_cast<uintptr_t>(y) % 4 != 0)
    return false;
  for (int t0 = 0; t0 < T; t0 += pl.pf_rows) {
    const int m = std::min(pl.pf_rows, T - t0);
    bf16_exact_rows(x + int64_t(t0) * x_stride, x_stride, m, int(K), pl.pf_x, stream);
    bf16_gemm(pl.pf_x, pl.dense_w + r0 * K, m, int(n), int(K), y + int64_t(t0) * y_stride,
              int(y_stride), round, stream);
  }
  return true;
}

DeviceLinear::DeviceLinear() = default;
DeviceLinear::~DeviceLinear() = default;
DeviceLinear::DeviceLinear(DeviceLinear&&) noexcept = default;
DeviceLinear& DeviceLinear::operator=(DeviceLinear&&) noexcept = default;

void DeviceLinear::apply(const float* x, int T, float* y, cudaStream_t stream) const {
  run(x, T, y, /*round=*/true, stream);
}

void DeviceLinear::apply_partial(const float* x, int T, float* y, cudaStream_t stream) const {
  run(x, T, y, /*round=*/false, stream);
}

void DeviceLinear::run(const float* x, int T, float* y, bool round, cudaStream_t stream) const {
  require(!w_.empty(), "DeviceLinear::apply: the weight is empty");
  if (T <= 0) return;
  const int64_t K = w_.cols, N = w_.rows;
  if (kind_ != LinearKind::kQuant) {
    const bool bf16_out = kind_ == LinearKind::kBf16Out || kind_ == LinearKind::kBf16OutBf16X ||
                          kind_ == LinearKind::kBf16OutBf16XPrefill;
    if (dense_gemm(0, N, x, K, T, y, N, round && bf16_out, stream)) return;
    const bool mma = plan_->mma && (!prefill_only_bf16x(kind_) || T > kMaxDecodeRows);
    if (mma)
      plan_->mma->run(w_, 0, N, x, K, T, y, N, round && bf16_out, stream);
    else
      ops_detail::dense_rows(w_, 0, N, x, K, T, y, N, round && bf16_out, stream);
    return;
  }
  if (!plan_->gemv) {  // quant_rows with the act quant in the kernel: one launch
    ops_detail::quant_rows_x(w_, x, K, T, y, N, round, stream);
    return;
  }
  const Fp8WeightView wv{w_.data, w_.scale, int(N), int(K)};
  int t0 = 0;
  // Prefill: the GEMM by chunks of pf_rows (PrefillGemm); the rows it leaves (kFp8Bitwise's tail
  // of <= 8) go to the GEMV below.
  for (const int rows = Plan::gemm_rows(plan_->pf_gemm, plan_->pf_rows, T); t0 < rows;) {
    const int m = std::min(plan_->pf_rows, rows - t0);
    plan_->quantise(x + int64_t(t0) * K, K, m, int(K), stream);
    plan_->gemm(w_, *plan_, m, y + int64_t(t0) * N, round, stream);
    t0 += m;
  }
  const bool fused = Fp8Gemv::fused_input_ok(x, K);
  for (; t0 < T; t0 += kMaxDecodeRows) {
    const int m = std::min(kMaxDecodeRows, T - t0);
    const float* xc = x + int64_t(t0) * K;
    float* yc = y + int64_t(t0) * N;
    if (fused) {  // one launch: act quant, GEMV, split-K finish and rounding
      plan_->gemv->run_fused(wv, xc, K, m, yc, round, nullptr, stream);
      continue;
    }
    // x not 16-byte aligned: the two-kernel path (bitwise the same results).
    act_quant_fp8_f32(xc, m, int(K), plan_->codes, plan_->scales, stream);
    const QuantActView av{plan_->codes, plan_->scales, m, int(K)};
    plan_->gemv->run(wv, av, yc, nullptr, stream);
    if (round) ops_detail::round_bf16_inplace(yc, size_t(m) * size_t(N), stream);
  }
}

void DeviceLinear::apply_group(std::span<const LinearCall> calls, const float* x, int T,
                               cudaStream_t stream) {
  if (calls.empty() || T <= 0) return;
  const int64_t K = calls[0].linear->cols();
  const bool aligned = Fp8Gemv::fused_input_ok(x, K);
  // T > 8: the weights with a prefill GEMM run it, on one activation quantisation per chunk of
  // rows for all of them (their own apply() quantises x once each: the same codes).
  auto prefill_gemm = [&](const DeviceLinear& l) {
    return T > kMaxDecodeRows && l.kind_ == LinearKind::kQuant && l.plan_->gemv != nullptr &&
           l.plan_->pf_rows > 0;
  };
  auto groupable = [&](const DeviceLinear& l) {
    return aligned && l.kind_ == LinearKind::kQuant && l.plan_->gemv != nullptr && !prefill_gemm(l);
  };
  const LinearCall* gemm[kMaxGemvGroup];
  int n_gemm = 0, gemm_rows = 0;
  for (const LinearCall& c : calls) {
    const DeviceLinear& l = *c.linear;
    require(!l.empty() && l.cols() == K && c.y != nullptr,
            "DeviceLinear::apply_group: every call needs a weight with the group's %lld inputs and "
            "an output (this one has %lld inputs)",
            static_cast<long long>(K), static_cast<long long>(l.cols()));
    // The GEMM weights share the first one's workspace, so they must share its PrefillGemm.
    if (prefill_gemm(l) && n_gemm < kMaxGemvGroup &&
        (n_gemm == 0 || l.plan_->pf_gemm == gemm[0]->linear->plan_->pf_gemm)) {
      gemm[n_gemm++] = &c;
      gemm_rows = n_gemm == 1 ? l.plan_->pf_rows : std::min(gemm_rows, l.plan_->pf_rows);
    } else if (!groupable(l)) {
      l.run(x, T, c.y, !c.partial, stream);  // its own launch
    }
  }
  if (n_gemm > 0) {
    // The first weight's workspace holds the shared activations (every GEMM of a chunk reads
    // them before the next chunk's quantisation, in stream order). A row's GEMM result does not
    // depend on the chunking (the smallest pf_rows), and the kFp8Bitwise GEMM is the GEMV's bits,
    // so where its GEMV tail starts changes nothing either.
    const Plan& ws = *gemm[0]->linear->plan_;
    const int rows = Plan::gemm_rows(ws.pf_gemm, gemm_rows, T);
    int t0 = 0;
    while (t0 < rows) {
      const int m = std::min(gemm_rows, rows - t0);
      ws.quantise(x + int64_t(t0) * K, K, m, int(K), stream);
      for (int i = 0; i < n_gemm; ++i) {
        const DeviceLinear& l = *gemm[i]->linear;
        l.plan_->gemm(l.w_, ws, m, gemm[i]->y + int64_t(t0) * l.rows(), !gemm[i]->partial, stream);
      }
      t0 += m;
    }
    if (t0 < T)  // <= 8 rows: each weight's GEMV
      for (int i = 0; i < n_gemm; ++i)
        gemm[i]->linear->run(x + int64_t(t0) * K, T - t0,
                             gemm[i]->y + int64_t(t0) * gemm[i]->linear->rows(), !gemm[i]->partial,
                             stream);
  }
  // The FP8 Fp8Gemv weights: one launch per 8 token rows and 8 weights (no heap: a fixed list).
  for (int t0 = 0; t0 < T; t0 += kMaxDecodeRows) {
    const int m = std::min(kMaxDecodeRows, T - t0);
    Fp8GemvCall list[kMaxGemvGroup];
    int n = 0;
    auto flush = [&] {
      if (n > 0) Fp8Gemv::run_fused_group(list, n, x + int64_t(t0) * K, K, m, stream);
      n = 0;
    };
    for (const LinearCall& c : calls) {
      const DeviceLinear& l = *c.linear;
      if (!groupable(l)) continue;
      for (int i = 0; i < n; ++i)  // a plan's workspace serves one launch at a time
        if (list[i].gemv == l.plan_->gemv.get()) flush();
      list[n++] = Fp8GemvCall{l.plan_->gemv.get(),
                              Fp8WeightView{l.w_.data, l.w_.scale, int(l.rows()), int(K)},
                              c.y + int64_t(t0) * l.rows(), !c.partial, nullptr};
      if (n == kMaxGemvGroup) flush();
    }
    flush();
  }
}

void DeviceLinear::apply_rows(int64_t r0, int64_t n, const float* x, int x_stride, int T, float* y,
                              int y_stride, cudaStream_t stream) const {
  require(!w_.empty() && r0 >= 0 && n >= 0 && r0 + n <= w_.rows,
          "DeviceLinear::apply_rows: rows [%lld, %lld) outside the weight's %lld rows",
          static_cast<long long>(r0), static_cast<long long>(r0 + n),
          static_cast<long long>(w_.rows));
  if (dense_gemm(r0, n, x, x_stride, T, y, y_stride, true, stream)) return;
  if (plan_->mma && (!prefill_only_bf16x(kind_) || T > kMaxDecodeRows))
    plan_->mma->run(w_, r0, n, x, x_stride, T, y, y_stride, true, stream);
  else
    ops_detail::dense_rows(w_, r0, n, x, x_stride, T, y, y_stride, true, stream);
}

}  // namespace uf::cuda
