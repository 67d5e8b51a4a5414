#pragma once
// Generic linear kernels shared by the ops (ops/linear.cu, ops/moe_ops.cu, ops/engram.cu), used
// where the fast kernels (Fp8Gemv, MoeFp4) do not fit the shape or the format. quant_rows
// reproduces cpu/linear.cpp bit for bit (per-32-block partial products scaled and added in K
// order); dense_rows computes the same products in another fp32 order (ops/linear.cu says why).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/device_weights.h"

namespace uf::cuda::ops_detail {

// y[t * y_stride + j] = post(x[t * x_stride, :K] . W[r0 + j, :]) for t < m, j < n, fp32 (the
// order of cpu::gemm_rows' dot8 is not kept); post is bf16 rounding when round_bf16, else
// identity. Any format, any m (one launch: chunks of 8 rows on the grid's y). DeviceLinear's
// *Bf16X kinds use DenseMma (kernels/dense_mma.h, tensor cores) instead where the weight allows.
void dense_rows(const DeviceWeight& w, int64_t r0, int64_t n, const float* x, int64_t x_stride,
                int m, float* y, int64_t y_stride, bool round_bf16, cudaStream_t stream);

// cpu::linear_quant on pre-quantised activations (codes [m, K] E4M3, scales [m, K/32]): FP8 (block
// or row scales) and FP4 weights. y [m, y_stride], bf16 values.
void quant_rows(const DeviceWeight& w, const uint8_t* codes, const float* scales, int m, float* y,
                int64_t y_stride, cudaStream_t stream);

// quant_rows on fp32 x [m, K] (row stride x_stride, any m), quantised inside the kernel exactly as
// act_quant_fp8_f32 does: bitwise act_quant + quant_rows in one launch. round_bf16: bf16 outputs
// (cpu::linear_quant), else the fp32 sums (a tensor-parallel partial).
void quant_rows_x(const DeviceWeight& w, const float* x, int64_t x_stride, int m, float* y,
                  int64_t y_stride, bool round_bf16, cudaStream_t stream);

// In place: y[i] = bf16(y[i]) for i < n.
void round_bf16_inplace(float* y, size_t n, cudaStream_t stream);

}  // namespace uf::cuda::ops_detail
