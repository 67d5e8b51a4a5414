#pragma once
// Routed-expert MoE for decode rows (M = 1..8): MXFP4 experts, W4A8, grouped over the experts
// that the routing selected. Kernels and their reduction order: src/cuda/kernels/moe_fp4.cu.
//
// For each row t and each selected expert e (weight w):
//   g = bf16(w1_e . x), u = bf16(w3_e . x)                  (FP4 x FP8 block-scaled GEMVs)
//   u = clamp(u, -L, L); g = min(g, L)                      (L = swiglu_limit; L <= 0: no clamp)
//   h = bf16(w * silu(g) * u)                  (weight BEFORE w2: it changes h's quantisation)
//   y_e = bf16(w2_e . fp8_quant(h))
// out[t] = sum over t's experts in ascending expert id of y_e (fp32, starting from 0), as the
// reference's loop over experts. run_partial / run_experts: the same without y_e's bf16 rounding
// (tensor parallelism over the intermediate dim: the rounding follows the sum over ranks).
// Experts chosen by several rows are read once (rows become the mma columns); a row's result
// never depends on the other rows.

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

#include "cuda/gemv.h"

namespace uf::cuda {

// Experts stacked along a leading expert dimension, in checkpoint formats:
//   w1, w3 [E, I, K/2] packed E2M1 (low nibble = even element), scales [E, I, K/32] UE8M0
//   w2     [E, K, I/2],                                            scale  [E, K, I/32]
// (K = model dim, I = expert intermediate dim, possibly a tensor-parallel slice of it.)
struct Fp4ExpertsView {
  const uint8_t* w1 = nullptr;
  const uint8_t* w1_scale = nullptr;
  const uint8_t* w3 = nullptr;
  const uint8_t* w3_scale = nullptr;
  const uint8_t* w2 = nullptr;
  const uint8_t* w2_scale = nullptr;
  int num_experts = 0;
  int dim = 0;    // K
  int inter = 0;  // I
};

// One MoE shape with its workspace. Constraints: dim % 128 == 0, inter % 32 == 0, M <= 8,
// M * topk <= 64, each row's expert ids distinct; weights 16-byte aligned (w1 / w3 scales 4), the
// FP8 input codes 16-byte aligned. Default kernels: the unit kernels (moe_fp4.cu: w13 grid M * topk
// * inter / 8 CTAs of 43.5 KB of weights each at dim 5120, w2 grid M * topk * dim / 128 CTAs);
// shapes whose unit shared-memory plan exceeds the device's opt-in limit run the persistent ones.
// Construction allocates; run() does not (graph-capturable; one run at a time per object: the
// w13 group counters live in its workspace). topk_idx must be complete when the w13 kernel's
// griddepcontrol.wait returns (any chain of kernels that each wait before finishing; the w2
// kernel reads it before its own wait, moe_fp4.cu).
class MoeFp4 {
 public:
  MoeFp4(int dim, int inter, int topk, int sm_count);
  ~MoeFp4();
  MoeFp4(const MoeFp4&) = delete;
  MoeFp4& operator=(const MoeFp4&) = delete;

  // x: the FP8-quantized MoE input [m, dim]; topk_idx [m, topk] int32 expert ids (distinct per
  // row) and topk_w [m, topk] fp32 routing weights, on the device. out [m, dim] fp32.
  void run(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx, const float* topk_w,
           float swiglu_limit, float* out, cudaStream_t stream) const;
  // run() without the bf16 rounding of each expert's w2 output: out[t] = sum over t's experts in
  // ascending expert id of the fp32 w2 accumulator (from 0). With `inter` a tensor-parallel slice,
  // that rounding belongs to the whole w2 product (it can only follow the sum over ranks), so a
  // rank's split-K partial must not carry it. Same kernels, same accumulation order.
  void run_partial(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                   const float* topk_w, float swiglu_limit, float* out, cudaStream_t stream) const;
  // No combine: each (row t, k) pair's unrounded fp32 w2 accumulator goes to
  // out[t * row_stride + k * dim + n] (row_stride >= topk * dim floats), k in topk_idx order.
  // Pairs whose expert id is invalid (< 0 or >= num_experts) are not written. after_w13: as
  // run_add's.
  void run_experts(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                   const float* topk_w, float swiglu_limit, float* out, int64_t row_stride,
                   cudaStream_t stream, const std::function<void()>& after_w13 = {}) const;

  // run / run_partial with an epilogue folded into the combine: out[t] = r(routed[t] + add[t])
  // where routed[t] is run()'s (partial = false) or run_partial()'s (partial = true) fp32 sum and
  // r = bf16 rounding when round_out (DeviceMoe's shared-expert add, one launch less; bitwise
  // combine_kernel's __fadd_rn then round). add [m, dim] fp32. before_combine (may be empty) is
  // called once the expert kernels are enqueued, right before the combine: the caller makes
  // `add` ready there on `stream` (enqueues its producer, or waits on its event). DeviceMoe
  // enqueues the shared expert there, so its weights stream in behind the routed experts' (PDL).
  // after_w13 (may be empty) is called once the w13 kernel is enqueued, before w2: DeviceMoe
  // enqueues its forked shared expert there for the unit kernels (uses_unit_kernels), so that a
  // captured graph places w13's CTAs before the shared GEMVs' (ops/moe_ops.cu says why).
  void run_add(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
               const float* topk_w, float swiglu_limit, bool partial, const float* add,
               bool round_out, const std::function<void()>& before_combine, float* out,
               cudaStream_t stream, const std::function<void()>& after_w13 = {}) const;

  // K splits of the w13 products (ceil(dim / 32 / 16)): a function of dim only.
  int w13_splits() const { return splits_; }
  // The kernels: false (default where the shapes fit) = the one-unit-per-CTA kernels
  // (moe_w13_unit_kernel / moe_w2_unit_kernel), true = the earlier persistent kernels. Bitwise
  // the same outputs. For benchmarks and tests.
  void set_legacy(bool on) { legacy_ = on || !unit_ok_; }
  bool legacy() const { return legacy_; }
  // The mma of both kernel sets: true (default) = the e4m3 m16n8k32 mma written as the two f16
  // HMMAs that ptxas emulates it with on sm_90a (moe_fp4.cu: the same F2FP conversions, operand
  // positions and chain, without its "+ 0" adds; the unit w2 kernel converts h to f16 once per
  // CTA instead of once per warp), false = the e4m3 mma.sync. Bitwise the same outputs
  // (tests/cuda/test_moe_fp4_halfchunk.cpp). For benchmarks and tests.
  void set_f16(bool on) { f16_ = on; }
  bool f16() const { return f16_; }
  // set_f16's value for MoeFp4 objects constructed from now on (process-wide; default true): for
  // benchmarks of objects built inside other classes (DeviceMoe). Not thread-safe.
  static void set_default_f16(bool on);
  // The unit kernels run for calls of up to this many rows (default 2, where they are faster),
  // the persistent ones above; bitwise the same outputs. Tests set 8 to cover both at every M.
  void set_unit_max_rows(int rows) { unit_max_rows_ = rows; }
  // Whether an m-row call runs the unit kernels (else the persistent ones).
  bool uses_unit_kernels(int m) const { return !legacy_ && m <= unit_max_rows_; }

 private:
  // w13 + w2 (kernels 1, 2): w2 outputs of pair (t, k) to y[t * y_row_stride + k * dim],
  // bf16-rounded when round_w2.
  void run_experts_impl(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                        const float* topk_w, float swiglu_limit, bool round_w2, float* y,
                        int64_t y_row_stride, cudaStream_t stream,
                        const std::function<void()>& after_w13 = {}) const;
  template <bool kF16>
  void launch_experts(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                      const float* topk_w, float swiglu_limit, bool round_w2, float* y,
                      int64_t y_row_stride, cudaStream_t stream,
                      const std::function<void()>& after_w13) const;
  void combine(const float* y, const int* topk_idx, int m, int num_experts, const float* add,
               bool round_out, float* out, cudaStream_t stream) const;
  int dim_, inter_, topk_, splits_, kb_per_split_;
  int sm_count_ = 0;
  bool w2_streamed_ = true;  // moe_w2_kernel fits; false: the per-tile w2 kernel (large inter)
  bool unit_ok_ = false;     // the unit kernels' shared memory fits (and splits <= 16)
  bool legacy_ = true;       // run the earlier persistent kernels
  bool f16_ = true;          // f16 HMMAs instead of the (emulated) e4m3 mma.sync
  int unit_max_rows_ = 2;    // the unit kernels up to this many rows
  // f16 persistent w2 with h pre-converted: its dynamic shared memory limit beside a w13 CTA of
  // m rows (index m), so that a w2 CTA can start during the w13 kernel's tail.
  int pre_b_max_[kMaxDecodeRows + 1] = {};
  float* h_vals_ = nullptr;     // [8 * topk pairs][inter] bf16 values of h (unit kernels)
  uint8_t* h_codes_ = nullptr;  // [8 * topk pairs][inter]
  float* h_scales_ = nullptr;   // [pairs][inter / 32]
  float* y_ = nullptr;          // [pairs][dim]
  float* partials_ = nullptr;   // [slots][inter/32 groups][4 tiles][splits][128]
  int* counters_ = nullptr;     // [slots][inter/32 groups], zero between calls
};

// The routed experts for prefill chunks of many rows (m up to max_rows, any m >= 1): the same
// inputs, outputs and per-(row, expert) arithmetic as MoeFp4, so the outputs are bitwise those
// of MoeFp4 run on the rows in chunks of 8 (a row's result never depends on the other rows).
// The (row, expert) pairs are sorted by expert on the device and each selected expert's weights
// are read once per call (per 16 or 64 of its rows: item_cols), not once per 8 rows. Kernels and
// their order: src/cuda/kernels/moe_prefill.cu. Workspace (allocated here): max_rows * topk * (dim
// * 4 + inter * 1.125) bytes (the per-pair fp32 w2 outputs dominate: 63 MB at 512 x top-6 x 5120).
// Not graph-capturable across different m (the grid depends on m); run() does not allocate.
class MoeFp4Prefill {
 public:
  MoeFp4Prefill(int dim, int inter, int topk, int num_experts, int max_rows);
  ~MoeFp4Prefill();
  MoeFp4Prefill(const MoeFp4Prefill&) = delete;
  MoeFp4Prefill& operator=(const MoeFp4Prefill&) = delete;

  // As MoeFp4::run / run_partial / run_experts, with x.m <= max_rows().
  void run(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx, const float* topk_w,
           float swiglu_limit, float* out, cudaStream_t stream) const;
  void run_partial(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                   const float* topk_w, float swiglu_limit, float* out, cudaStream_t stream) const;
  void run_experts(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                   const float* topk_w, float swiglu_limit, float* out, int64_t row_stride,
                   cudaStream_t stream) const;
  // As MoeFp4::run_add: the combine adds `add` (the shared expert) in the same pass, bitwise
  // run / run_partial followed by combine_kernel (ops/moe_ops.cu).
  void run_add(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
               const float* topk_w, float swiglu_limit, bool partial, const float* add,
               bool round_out, const std::function<void()>& before_combine, float* out,
               cudaStream_t stream) const;
  int max_rows() const { return max_rows_; }
  // The expert kernels' mma: true (default) = the f16 HMMAs that sm_90a emulates the e4m3 mma
  // with, every operand converted once (moe_prefill.cu: prefill_w13_f16_kernel /
  // prefill_w2_f16_kernel), false = the e4m3 mma.sync per (weight, column) fragment pair. Bitwise
  // the same outputs (tests/cuda/test_moe_prefill_f16.cpp). For benchmarks and tests.
  void set_f16(bool on) { f16_ = on; }
  bool f16() const { return f16_; }
  // The columns (pairs) of a work item for a call of m rows: 16 where the experts average few
  // pairs (the f16 kernels' small tiles: more CTAs an SM), else 64 (moe_prefill.cu). Bitwise the
  // same outputs either way. set_cols(16 / 64) forces one (tests, benchmarks); 0 restores.
  int item_cols(int m) const;
  void set_cols(int cols);

 private:
  void experts_impl(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                    const float* topk_w, float swiglu_limit, bool round_w2, float* y,
                    int64_t y_row_stride, cudaStream_t stream) const;
  int dim_, inter_, topk_, experts_, max_rows_;
  int max_items_ = 0, plan_smem_ = 0;
  bool f16_ = true;             // set_f16
  int cols_ = 0;                // set_cols (0: by the call's pairs)
  int* sorted_ = nullptr;       // [max_rows * topk] pair indices sorted by expert
  int* items_ = nullptr;        // [max_items][3] (expert, first sorted position, columns)
  int* n_items_ = nullptr;      // [1]
  uint8_t* h_codes_ = nullptr;  // [max_rows * topk][inter] by sorted position
  float* h_scales_ = nullptr;   // [max_rows * topk][inter / 32]
  float* y_ = nullptr;          // [max_rows][topk][dim]
};

// out[t] = the sum over row t's valid experts (ascending expert id, fp32 from 0) of y[t, k]
// (row stride topk * dim): the combine of MoeFp4 and MoeFp4Prefill, t < m (any m).
void moe_combine_rows(const float* y, const int* topk_idx, int m, int topk, int num_experts,
                      int dim, float* out, cudaStream_t stream);
// The same sum + add[t] (__fadd_rn), then bf16 when round_out: MoeFp4::run_add's combine.
void moe_combine_add_rows(const float* y, const int* topk_idx, int m, int topk, int num_experts,
                          int dim, const float* add, bool round_out, float* out,
                          cudaStream_t stream);

// act_quant_fp8_f32 (cuda/gemv.h) for any number of rows m >= 1: the same codes and scales.
void moe_act_quant_rows(const float* x, int m, int k, uint8_t* codes, float* scales,
                        cudaStream_t stream);

// Shared-expert SwiGLU between two FP8 GEMVs: gu [m, 2 * inter] fp32 holds w1 (gate) outputs in
// columns [0, inter) and w3 (up) outputs in [inter, 2 * inter). Writes the FP8-quantized
// h = bf16(silu(min(bf16(g), L)) * clamp(bf16(u), -L, L)) as codes [m, inter] + scales.
void swiglu_quant_fp8(const float* gu, int m, int inter, float swiglu_limit, uint8_t* codes,
                      float* scales, cudaStream_t stream);

}  // namespace uf::cuda
