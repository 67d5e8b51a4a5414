#pragma once
// Linear layers on the device with the reference's numerics: device twins of cpu/linear.h.
// A DeviceLinear owns one weight's device copy plus its plan (Fp8Gemv split plan where the shape
// allows it, activation-quantisation workspace); apply() runs any number of rows by chunks of
// kMaxDecodeRows through the same kernels, so a row's result never depends on how many rows are
// in the call (spec == plain) and prefill uses the decode numerics. apply() never allocates.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "cuda/device_weights.h"

namespace uf::cuda {

// Which of the CPU's linear functions a DeviceLinear reproduces.
enum class LinearKind {
  kAuto,     // cpu::linear: FP8/FP4 weights -> kQuant, BF16 -> kBf16Out
  kQuant,    // cpu::linear_quant: FP8 act quant per 32, block-scaled product, bf16 output
  kBf16Out,  // cpu::linear_bf16_out: dequantised weight, fp32 accumulation, bf16 output
  kF32,      // cpu::linear_f32: fp32 output, any fp32 input
};

class DeviceLinear {
 public:
  // Out of line (linear.cu): nvcc's front end needs Plan complete for an inline default.
  DeviceLinear();
  DeviceLinear(const model::Weight& w, LinearKind kind, DeviceArena& arena);
  ~DeviceLinear();
  DeviceLinear(DeviceLinear&&) noexcept;
  DeviceLinear& operator=(DeviceLinear&&) noexcept;

  // y[T, rows()] from x[T, cols()]; x and y must not alias. kQuant uses this object's
  // workspace (act quant, Fp8Gemv split counters): one apply() at a time per DeviceLinear.
  // Paths: kQuant on FP8 32x32-block weights with rows % 16 == 0 -> Fp8Gemv (+ bf16 rounding);
  // other kQuant weights -> quant_rows, bitwise equal to cpu/linear.cpp; kBf16Out / kF32 ->
  // dense_rows, the CPU's products in another fp32 order (ops/linear.cu).
  void apply(const float* x, int T, float* y, cudaStream_t stream) const;
  // apply() without the final bf16 rounding of kQuant / kBf16Out (kF32: the same as apply): the
  // fp32 split-K partial of a tensor-parallel rank, to be summed over ranks and then rounded
  // once (round_bf16), so the TP result differs from apply() on the whole weight only in fp32
  // summation order.
  void apply_partial(const float* x, int T, float* y, cudaStream_t stream) const;
  // cpu::linear_bf16_out_rows: output rows [r0, r0 + n) only, strided input and output.
  void apply_rows(int64_t r0, int64_t n, const float* x, int x_stride, int T, float* y,
                  int y_stride, cudaStream_t stream) const;

  const DeviceWeight& weight() const { return w_; }
  int64_t rows() const { return w_.rows; }
  int64_t cols() const { return w_.cols; }
  bool empty() const { return w_.empty(); }

 private:
  struct Plan;
  void run(const float* x, int T, float* y, bool round, cudaStream_t stream) const;
  DeviceWeight w_;
  LinearKind kind_ = LinearKind::kAuto;
  std::unique_ptr<Plan> plan_;
};

}  // namespace uf::cuda
