#pragma once
// Linear layers on the device with the reference's numerics: device twins of cpu/linear.h.
// A DeviceLinear owns one weight's device copy plus its plan (Fp8Gemv split plan where the shape
// allows it, activation-quantisation workspaces); apply() runs any number of rows. A row's result
// never depends on the other rows of the call: a decode call's (T <= 8) on how many rows it has
// (spec == plain), a prefill call's (T > 8) on its length or chunking; prefill rows are bitwise the
// decode rows, or within fp32 re-association of them (PrefillGemm below). apply() never
// allocates.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>

#include "cuda/device_weights.h"

namespace uf::cuda {

// Which of the CPU's linear functions a DeviceLinear reproduces.
enum class LinearKind {
  kAuto,     // cpu::linear: FP8/FP4 weights -> kQuant, BF16 -> kBf16Out
  kQuant,    // cpu::linear_quant: FP8 act quant per 32, block-scaled product, bf16 output
  kBf16Out,  // cpu::linear_bf16_out: dequantised weight, fp32 accumulation, bf16 output
  kF32,      // cpu::linear_f32: fp32 output, any fp32 input
  // The same two functions for a caller that guarantees every x value is a bf16 value (x is the
  // output of a bf16-rounding op: rms_norm, attention + inverse RoPE, an embedding row). BF16 and
  // FP8 weights with cols % 64 == 0, 256 <= cols <= DenseMma::kMaxCols take the tensor-core GEMV
  // (kernels/dense_mma.h: exact products, another fp32 order, split K for weights with few rows);
  // other weights take dense_rows as kBf16Out / kF32. The contract is checked on the device: an x
  // value that is not bf16-exact makes that token row's outputs NaN (never silently rounded).
  kBf16OutBf16X,  // cpu::linear_bf16_out, bf16-exact x
  kF32Bf16X,      // cpu::linear_f32, bf16-exact x
  // kF32 for decode calls (T <= 8: dense_rows, whose fp32 order the fused decode router kernels
  // repeat) and kF32Bf16X for prefill calls (T > 8: DenseMma's prefill kernel, bf16-exact x):
  // the MoE router gate, whose [384, 5120] fp32 rows on the CUDA cores advanced a 512-row
  // prefill chunk ~200 us a layer (13% of it), ~10 us on the tensor cores.
  kF32Bf16XPrefill,
  // The same for cpu::linear_bf16_out on BF16 weights (kBf16Out for T <= 8, kBf16OutBf16X for
  // T > 8): the compressor's and the indexer's bf16 projections of normed rows.
  kBf16OutBf16XPrefill,
};

class DeviceLinear;

// The kernels a DeviceLinear's prefill calls (T > 8) take on FP8 32x32-block weights, fixed when
// the DeviceLinear is built:
//   kBf16 (default): act_qdq_fp8_bf16_rows + bf16_gemm (cuda/prefill_gemm.h) on a bf16 copy of
//     the weight made once at load (2 bytes a parameter more on the device): the reference's
//     exact products summed in fp32 in another order, so prefill rows agree with decode rows
//     (the GEMV) within fp32 re-association; every row of the call takes the GEMM;
//   kFp8Bitwise: act_quant_fp8_rows + fp8_gemm_prefill, bitwise the decode GEMV (a tail of <= 8
//     rows takes the GEMV), ~4x slower at a TP8 rank's 512-row chunks.
enum class PrefillGemm { kBf16, kFp8Bitwise };
// Process-wide; DeviceLinears built afterwards take it (tests, benchmarks). Not thread-safe
// against concurrent construction.
void set_default_prefill_gemm(PrefillGemm g);
PrefillGemm default_prefill_gemm();
// The default for the DeviceLinears built during its lifetime (CudaModel's construction, tests).
class ScopedPrefillGemm {
 public:
  explicit ScopedPrefillGemm(PrefillGemm g) : prev_(default_prefill_gemm()) {
    set_default_prefill_gemm(g);
  }
  ~ScopedPrefillGemm() { set_default_prefill_gemm(prev_); }
  ScopedPrefillGemm(const ScopedPrefillGemm&) = delete;
  ScopedPrefillGemm& operator=(const ScopedPrefillGemm&) = delete;

 private:
  PrefillGemm prev_;
};

// Rows a DeviceLinear's prefill GEMM workspace holds by default (kBf16: the QDQ'd activations, 2
// bytes per input; kFp8Bitwise: codes + scales, 516 B per row per 512 inputs); longer calls run
// the GEMM in chunks of this many rows.
inline constexpr int kDefaultPrefillRows = 512;

// One weight of DeviceLinear::apply_group: y[T, rows()] as apply() (partial: as apply_partial()).
struct LinearCall {
  const DeviceLinear* linear = nullptr;
  float* y = nullptr;
  bool partial = false;
};

class DeviceLinear {
 public:
  // Out of line (linear.cu): nvcc's front end needs Plan complete for an inline default.
  DeviceLinear();
  // max_prefill_rows: rows of the prefill GEMM's activation workspace (allocated here, from the
  // arena, only for Fp8Gemv-path weights); 0 disables the GEMM (every call runs the decode GEMV
  // in chunks of 8 rows: the same bits, slower).
  DeviceLinear(const model::Weight& w, LinearKind kind, DeviceArena& arena,
               int max_prefill_rows = kDefaultPrefillRows);
  ~DeviceLinear();
  DeviceLinear(DeviceLinear&&) noexcept;
  DeviceLinear& operator=(DeviceLinear&&) noexcept;

  // y[T, rows()] from x[T, cols()]; x and y must not alias. kQuant uses this object's
  // workspace (act quant, Fp8Gemv split counters): one apply() at a time per DeviceLinear.
  // Paths, and kernel launches per call:
  //   kQuant on FP8 32x32-block weights with rows % 16 == 0, T <= 8 (decode) -> Fp8Gemv::run_fused
  //     (act quant, GEMV, split-K finish and bf16 rounding in ONE launch; 3 if x is not 16-byte
  //     aligned: act_quant + GEMV + rounding, bitwise the same);
  //   the same weights, T > 8 (prefill) -> the PrefillGemm chosen at construction, 2 launches
  //     per max_prefill_rows rows (kBf16: act_qdq_fp8_bf16_rows + bf16_gemm; kFp8Bitwise:
  //     act_quant_fp8_rows + fp8_gemm_prefill, a tail of <= 8 rows on the GEMV, bitwise the
  //     GEMV's results); with max_prefill_rows == 0: the GEMV by chunks of 8 rows;
  //   other kQuant weights -> quant_rows_x (act quant inside), bitwise equal to cpu/linear.cpp,
  //     one launch for any T;
  //   kBf16Out / kF32 -> dense_rows, the CPU's products in another fp32 order (ops/linear.cu),
  //     one launch for any T;
  //   kBf16OutBf16X / kF32Bf16X -> DenseMma (tensor cores) where the weight allows it, else
  //     dense_rows; one launch for any T (the *Prefill kinds: DenseMma for T > 8 only). DenseMma's
  //     split-K workspace is this object's: one apply() / apply_rows() at a time per DeviceLinear.
  //     Under PrefillGemm::kBf16, prefill calls (T > 8) on BF16 / FP8 32x32-block weights with
  //     rows % 16 == 0 take bf16_exact_rows + bf16_gemm instead (2 launches per max_prefill_rows
  //     rows; FP8 weights keep a bf16 copy): exact products in another fp32 order, as DenseMma.
  void apply(const float* x, int T, float* y, cudaStream_t stream) const;
  // apply() without the final bf16 rounding of kQuant / kBf16Out (kF32: the same as apply): the
  // fp32 split-K partial of a tensor-parallel rank, to be summed over ranks and then rounded
  // once (round_bf16), so the TP result differs from apply() on the whole weight only in fp32
  // summation order.
  void apply_partial(const float* x, int T, float* y, cudaStream_t stream) const;
  // cpu::linear_bf16_out_rows: output rows [r0, r0 + n) only, strided input and output (the
  // *Bf16X kinds: DenseMma as apply()).
  void apply_rows(int64_t r0, int64_t n, const float* x, int x_stride, int T, float* y,
                  int y_stride, cudaStream_t stream) const;

  // Several linears reading the same x [T, K] (all with cols() == K), e.g. the projections of
  // one normalised hidden state: every Fp8Gemv-path weight of the list goes into ONE launch per
  // 8 rows (up to kMaxGemvGroup weights a launch; blocks of all weights side by side), each
  // output bitwise what its own apply() gives (each keeps its own split plan). Other weights
  // run their own apply(). A DeviceLinear listed twice gets a second launch (its split workspace
  // serves one launch at a time). x must be 16-byte aligned for the grouping (cudaMalloc'd
  // buffers and row offsets of them are); otherwise every weight runs its own apply().
  // T > 8: the weights with a prefill GEMM share one activation quantisation per chunk (the
  // first one's workspace) and run the GEMM each (bitwise their own apply()).
  static void apply_group(std::span<const LinearCall> calls, const float* x, int T,
                          cudaStream_t stream);

  const DeviceWeight& weight() const { return w_; }
  int64_t rows() const { return w_.rows; }
  int64_t cols() const { return w_.cols; }
  bool empty() const { return w_.empty(); }

 private:
  struct Plan;
  void run(const float* x, int T, float* y, bool round, cudaStream_t stream) const;
  // The *Bf16X kinds' prefill path (bf16_gemm); false where it does not apply (nothing run).
  bool dense_gemm(int64_t r0, int64_t n, const float* x, int64_t x_stride, int T, float* y,
                  int64_t y_stride, bool round, cudaStream_t stream) const;
  DeviceWeight w_;
  LinearKind kind_ = LinearKind::kAuto;
  std::unique_ptr<Plan> plan_;
};

}  // namespace uf::cuda
