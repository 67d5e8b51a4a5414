#pragma once
// Mixture of experts on the device: the device twin of cpu/moe.h (Engram: ops/engram.h).
// Routing (scores, bias, top-k, weights) runs on the device; routed experts in MXFP4 run through
// MoeFp4 (cuda/moe.h, experts stacked at upload) in chunks of kMaxDecodeRows rows, or, for
// T > kMaxDecodeRows, through MoeFp4Prefill (all rows of a chunk grouped by expert, bitwise the
// same outputs), so a row's result never depends on the other rows (spec == plain). apply()
// never allocates.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "cuda/moe.h"
#include "cuda/ops/linear.h"
#include "model/weights.h"

namespace uf::cuda {

struct MoeShape {
  int dim = 0;
  int inter = 0;
  int n_experts = 0;
  int top_k = 0;
  std::string score_func;  // "sqrtsoftplus", "softmax" or "sigmoid"
  float gate_temp = 1;
  float route_scale = 1;
  float swiglu_limit = 0;  // 0 = no clamps
  // Rows per call of the prefill path (MoeFp4Prefill: the routed experts grouped over all rows of
  // a chunk, each selected expert's weights read once per chunk) used when T > kMaxDecodeRows;
  // more rows run in chunks of this many. <= kMaxDecodeRows: every call runs by chunks of 8 rows.
  // Bitwise the same outputs either way. Its workspace (~ rows * (top_k + 4) * dim * 4 bytes,
  // 90 MB at 512 rows, dim 5120, top-6) is shared by the DeviceMoes built on one DeviceArena with
  // the same shape: their apply()s must not run concurrently (a model runs its layers in order).
  int max_prefill_rows = 512;
};

// The routing step alone (DeviceMoe runs it after the gate GEMV): scores [rows, n_experts] gate
// outputs -> gate_i / gate_w [rows, top_k] as cpu::moe_route (score function, bias for the
// selection, top-k with ties to the lower id, normalisation, route_scale). bias [n_experts].
// One warp per row (n_experts <= 512), PDL-launched. For benchmarks and tests.
void moe_route(const MoeShape& shape, const float* scores, const float* bias, int rows,
               int32_t* gate_i, float* gate_w, cudaStream_t stream);

// The decode chunk's router variants, for tests and benchmarks (ops/moe_ops.cu; bitwise the same
// outputs): 0 moe_router2_kernel (the default), 1 the previous one-launch moe_router_kernel, 2 the
// legacy path (dense_rows gate GEMV + route_quant_kernel).
//  - set_moe_router_variant: DeviceMoe's router launch (0 or 1). Not thread-safe: set it between
//    runs.
//  - moe_router_run: the router alone (rows <= 8). scores / probs [8, E], counter one int, zero
//    before the first call (each launch leaves it zero), gate_i / gate_w [rows, K], codes [rows,
//    D], xscales [rows, D / 32]; gate bf16 [E, D]; x 16-byte aligned.
void set_moe_router_variant(int variant);
// Where the forked shared expert of a decode chunk starts (benchmarks; not thread-safe): true (the
// default) after the router: its stream waits for the router, so it runs beside the routed
// experts; false: beside the router, from the MoE's start. The same outputs either way. On the
// H200 (session 8) the later start made the step 340-470 us shorter (1 and 7 rows): the shared
// expert's GEMVs no longer slow the router, which every routed expert waits for.
void set_moe_shared_after_router(bool on);
void moe_router_run(int variant, const MoeShape& shape, const DeviceWeight& gate, const float* bias,
                    const float* x, int rows, float* scores, float* probs, int* counter,
                    int32_t* gate_i, float* gate_w, uint8_t* codes, float* xscales,
                    cudaStream_t stream);

class DeviceMoe {
 public:
  DeviceMoe(const model::MoeWeights& w, const MoeShape& shape, DeviceArena& arena);
  ~DeviceMoe();
  DeviceMoe(DeviceMoe&&) noexcept;
  DeviceMoe& operator=(DeviceMoe&&) noexcept;

  // cpu::moe_forward: y[T, dim] (bf16 values) = routed + shared; gate_i / gate_w [T, top_k] as
  // cpu::moe_route writes them (selection order, best first; both may be null: internal
  // workspace). x: [T, dim] bf16 values. Routed experts must be FP4 (dim % 128 == 0,
  // inter % 32 == 0, top_k <= 8: MoeFp4); the shared expert any quantised format. Uses per-object
  // workspace: one apply() at a time per DeviceMoe (one stream).
  void apply(const float* x, int T, float* y, int32_t* gate_i, float* gate_w,
             cudaStream_t stream) const;

  // Tensor parallelism over the expert intermediate dim (this object holds the rank's slice of
  // every expert's w1 / w3 rows and w2 columns). SwiGLU, its clamps, the routing weight and h's
  // bf16 rounding and FP8 quantisation are per intermediate feature (quantisation per 32: the
  // split keeps those blocks whole), so each rank computes them exactly as one GPU would. What a
  // rank cannot do is any rounding of a w2 output: w2 is a split-K product over the ranks.
  // apply() rounds three kinds of w2-side values: each routed expert's output (bf16, the
  // reference's Expert returns bf16), the shared expert's output (bf16), and the final sum.
  //
  // apply_partial: y[T, dim] fp32 = (sum over the row's experts in ascending id, from 0, of the
  // UNROUNDED w2 accumulator) + the UNROUNDED shared w2 output: no rounding after w2 at all.
  // TP sum: round_bf16(sum over ranks). Differs from apply() even at one rank: the per-expert
  // and shared bf16 roundings are gone (each up to 2^-8 |y_e|, so up to 2^-8 * (sum |y_e| +
  // |shared|) in all), i.e. tp = 1 is NOT bitwise apply(); it is closer to exact arithmetic.
  // Cheap: the all-reduce stays [T, dim].
  void apply_partial(const float* x, int T, float* y, int32_t* gate_i, float* gate_w,
                     cudaStream_t stream) const;

  // The exact variant. slots [T, top_k + 1, dim] fp32: slot k < top_k = the UNROUNDED w2 output
  // (routing weight included) of expert gate_i[t, k], slot top_k = the UNROUNDED shared expert
  // output. gate_i must not be null (combine_experts reads it). TP sum: sum the slots over ranks
  // (optionally rounding to bf16: combine rounds each slot anyway, and bf16 rounding is
  // idempotent), then combine_experts.
  void apply_partial_experts(const float* x, int T, float* slots, int32_t* gate_i, float* gate_w,
                             cudaStream_t stream) const;
  // y[t] = bf16(sum over k in ascending gate_i[t, k] (from 0) of bf16(slots[t, k]) +
  // bf16(slots[t, top_k])): apply()'s roundings and order, so at tp = 1
  // combine_experts(apply_partial_experts(x)) == apply(x) bitwise, and at tp > 1 the result
  // differs from one GPU only in the fp32 order inside each w2 product (an occasional bf16 flip
  // of one expert's output). Invalid expert ids (< 0, >= n_experts) are skipped. y may not alias
  // slots.
  void combine_experts(const float* slots, const int32_t* gate_i, int T, float* y,
                       cudaStream_t stream) const;
  // Floats per row of apply_partial_experts' slots: (top_k + 1) * dim.
  int64_t slot_floats_per_row() const;
  int top_k() const;
  // Whether T > kMaxDecodeRows uses the prefill path (default: on when max_prefill_rows > 8); off:
  // chunks of 8 rows through the decode kernels. For tests and benchmarks (bitwise the same).
  void set_prefill_enabled(bool on);
  bool prefill_enabled() const;
  // true: the earlier path (gate GEMV + route_quant_kernel, MoeFp4's persistent kernels, the
  // shared expert on the caller's stream after the routed experts, a separate combine launch).
  // Default false: one router launch (gate + routing + act quant), MoeFp4's unit kernels (up to 4
  // rows), the shared expert's add folded into MoeFp4's combine (and, with set_fork_shared, the
  // shared expert on the object's own stream). Bitwise the same outputs. For tests and benchmarks.
  void set_legacy(bool on);
  bool legacy() const;
  // The shared expert on the object's side stream, joined before the combine, or in line on the
  // caller's stream (the default; CudaModelOptions::graph_branches). The same bits either way.
  void set_fork_shared(bool on);

 private:
  struct Impl;
  enum class Out { kRounded, kPartialSum, kPartialSlots };
  void run(const float* x, int T, Out mode, float* out, int32_t* gate_i, float* gate_w,
           cudaStream_t stream) const;
  // One chunk of rows: <= kMaxDecodeRows through MoeFp4, more through MoeFp4Prefill.
  void run_chunk(const float* x, int t0, int rows, Out mode, float* out, int32_t* gate_i,
                 float* gate_w, cudaStream_t stream) const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace uf::cuda
