// DeviceLinear (ops/linear.h) and the generic linear kernels (ops/linear_kernels.h).
//
// Generic kernels, bitwise equal to cpu/linear.cpp (same fp32 operations in the same order, no FMA
// contraction: every product and sum is an explicit __fmul_rn / __fadd_rn):
//   dense_rows_kernel: 8 lanes per output feature, lane j owns dot8's partial sum j (elements
//     k = j mod 8, in K order); the 8 partials are combined as ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7))
//     through width-8 shuffles. Up to 8 token rows per launch share each weight load.
//   quant_rows_kernel: one warp per output feature, lane i = element i of a 32-block; the block's
//     32 exact products are summed in dot8's order (chains j, j+8, j+16, j+24, then the pair tree),
//     then acc += (partial * a_scale) * w_scale in K order (cpu::quant_row_tile).
// The fast path of kQuant is Fp8Gemv (FP8 32x32-block weights, rows % 16 == 0): it differs from the
// CPU only in the order of a block's 32 terms (tensor core) and the K-split grouping (fp32 order).

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>

#include "cuda/cuda_check.h"
#include "cuda/gemv.h"
#include "cuda/kernels/common.cuh"
#include "cuda/ops/linear.h"
#include "cuda/ops/linear_kernels.h"
#include "cuda/ops/weight_access.cuh"

namespace uf::cuda {

using model::WFormat;

namespace ops_detail {
namespace {

constexpr int kDenseThreads = 128;  // 16 output features per block

__global__ void __launch_bounds__(kDenseThreads)
    dense_rows_kernel(WeightRef w, int64_t r0, int64_t n, const float* x, int64_t x_stride, int m,
                      float* y, int64_t y_stride, bool round) {
  const int j8 = threadIdx.x & 7;
  const int64_t j = int64_t(blockIdx.x) * (kDenseThreads / 8) + (threadIdx.x >> 3);
  const bool active = j < n;
  float s[kMaxDecodeRows];
#pragma unroll
  for (int t = 0; t < kMaxDecodeRows; ++t) s[t] = 0.f;
  if (active) {
    const int64_t r = r0 + j;
    for (int64_t k = j8; k < w.cols; k += 8) {
      const float wv = element(w, r, k);
#pragma unroll
      for (int t = 0; t < kMaxDecodeRows; ++t)
        if (t < m) s[t] = __fadd_rn(s[t], __fmul_rn(x[t * x_stride + k], wv));
    }
  }
#pragma unroll
  for (int t = 0; t < kMaxDecodeRows; ++t) {
    float v = s[t];
    v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 1, 8));
    v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 2, 8));
    v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 4, 8));
    if (active && j8 == 0 && t < m) y[t * y_stride + j] = round ? detail::round_bf16(v) : v;
  }
}

constexpr int kQuantWarps = 4;

__global__ void __launch_bounds__(kQuantWarps * 32)
    quant_rows_kernel(WeightRef w, int64_t n, const uint8_t* codes, const float* scales, int m,
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
    const float wv = raw_element(w, r, k);
    const float sw = block_scale(w, r, kb);
#pragma unroll
    for (int t = 0; t < kMaxDecodeRows; ++t) {
      if (t >= m) break;  // uniform
      const float p = __fmul_rn(e4m3_value(codes[t * K + k]), wv);
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

__global__ void round_bf16_kernel(float* y, size_t n) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = detail::round_bf16(y[i]);
}

}  // namespace

void dense_rows(const DeviceWeight& w, int64_t r0, int64_t n, const float* x, int64_t x_stride,
                int m, float* y, int64_t y_stride, bool round_bf16, cudaStream_t stream) {
  if (n <= 0 || m <= 0) return;
  const unsigned blocks = unsigned((n + kDenseThreads / 8 - 1) / (kDenseThreads / 8));
  for (int t0 = 0; t0 < m; t0 += kMaxDecodeRows) {
    const int mc = std::min(kMaxDecodeRows, m - t0);
    dense_rows_kernel<<<blocks, kDenseThreads, 0, stream>>>(weight_ref(w), r0, n, x + t0 * x_stride,
                                                            x_stride, mc, y + t0 * y_stride,
                                                            y_stride, round_bf16);
    UF_CUDA_CHECK(cudaGetLastError());
  }
}

namespace {
void quant_rows_impl(const DeviceWeight& w, const uint8_t* codes, const float* scales, int m,
                     float* y, int64_t y_stride, bool round, cudaStream_t stream) {
  require(m >= 1 && m <= kMaxDecodeRows, "quant_rows: m = %d must be in 1..8", m);
  const unsigned blocks = unsigned((w.rows + kQuantWarps - 1) / kQuantWarps);
  quant_rows_kernel<<<blocks, kQuantWarps * 32, 0, stream>>>(weight_ref(w), w.rows, codes, scales,
                                                             m, y, y_stride, round);
  UF_CUDA_CHECK(cudaGetLastError());
}
}  // namespace

void quant_rows(const DeviceWeight& w, const uint8_t* codes, const float* scales, int m, float* y,
                int64_t y_stride, cudaStream_t stream) {
  quant_rows_impl(w, codes, scales, m, y, y_stride, true, stream);
}

void round_bf16_inplace(float* y, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  round_bf16_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(y, n);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ops_detail

struct DeviceLinear::Plan {
  std::unique_ptr<Fp8Gemv> gemv;  // kQuant fast path (FP8 32x32 blocks, rows % 16 == 0)
  uint8_t* codes = nullptr;       // activation quant workspace [8, cols]
  float* scales = nullptr;        // [8, cols / 32]
};

DeviceLinear::DeviceLinear(const model::Weight& w, LinearKind kind, DeviceArena& arena)
    : kind_(kind) {
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
  if (kind_ == LinearKind::kQuant && !w.empty()) {
    plan_->codes = arena.alloc<uint8_t>(size_t(kMaxDecodeRows) * size_t(w.cols));
    plan_->scales = arena.alloc<float>(size_t(kMaxDecodeRows) * size_t(w.cols / 32));
    if (w.format == WFormat::kFP8 && !w.row_scale && w.rows % 16 == 0 && w.rows < (1 << 30) &&
        w.cols < (1 << 30))
      plan_->gemv = std::make_unique<Fp8Gemv>(int(w.rows), int(w.cols), device_sm_count());
  }
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
    ops_detail::dense_rows(w_, 0, N, x, K, T, y, N, round && kind_ == LinearKind::kBf16Out, stream);
    return;
  }
  for (int t0 = 0; t0 < T; t0 += kMaxDecodeRows) {
    const int m = std::min(kMaxDecodeRows, T - t0);
    const float* xc = x + int64_t(t0) * K;
    float* yc = y + int64_t(t0) * N;
    act_quant_fp8_f32(xc, m, int(K), plan_->codes, plan_->scales, stream);
    if (plan_->gemv) {
      const Fp8WeightView wv{w_.data, w_.scale, int(N), int(K)};
      const QuantActView av{plan_->codes, plan_->scales, m, int(K)};
      plan_->gemv->run(wv, av, yc, nullptr, stream);
      if (round) ops_detail::round_bf16_inplace(yc, size_t(m) * size_t(N), stream);
    } else if (round) {
      ops_detail::quant_rows(w_, plan_->codes, plan_->scales, m, yc, N, stream);
    } else {
      ops_detail::quant_rows_impl(w_, plan_->codes, plan_->scales, m, yc, N, false, stream);
    }
  }
}

void DeviceLinear::apply_rows(int64_t r0, int64_t n, const float* x, int x_stride, int T, float* y,
                              int y_stride, cudaStream_t stream) const {
  require(!w_.empty() && r0 >= 0 && n >= 0 && r0 + n <= w_.rows,
          "DeviceLinear::apply_rows: rows [%lld, %lld) outside the weight's %lld rows",
          static_cast<long long>(r0), static_cast<long long>(r0 + n),
          static_cast<long long>(w_.rows));
  ops_detail::dense_rows(w_, r0, n, x, x_stride, T, y, y_stride, true, stream);
}

}  // namespace uf::cuda
