#pragma once
// Mixture of experts and Engram on the device: device twins of cpu/moe.h and cpu/engram.h.
// Routing (scores, bias, top-k, weights) runs on the device; routed experts in MXFP4 run through
// MoeFp4 (cuda/moe.h, experts stacked at upload) in chunks of kMaxDecodeRows rows, so a row's
// result never depends on the other rows (spec == plain). apply() never allocates.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

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
};

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

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct EngramShape {
  int hc = 0;
  int dim = 0;
  int n_cols = 0;    // table rows per position for this layer
  int head_dim = 0;  // table row width
  float norm_eps = 0;
};

class DeviceEngram {
 public:
  DeviceEngram(const model::EngramWeights& w, const EngramShape& shape, DeviceArena& arena);
  ~DeviceEngram();
  DeviceEngram(DeviceEngram&&) noexcept;
  DeviceEngram& operator=(DeviceEngram&&) noexcept;

  // cpu::engram_forward: ids [T, n_cols] (device int64 table rows), X [T, hc, dim]; out may alias
  // X. The table lives in device memory. An id outside the table yields NaN outputs for that row
  // (the CPU throws; a kernel cannot).
  void apply(const int64_t* ids, const float* X, int T, float* out, cudaStream_t stream) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace uf::cuda
