#pragma once
// The routed experts of a decode call (MoeFp4, cuda/moe.h) on Hopper's native E4M3 tensor-core
// product (wgmma, sm_90a): kernels/moe_wgmma.cu. The same inputs, outputs and per-(row, expert)
// arithmetic steps as MoeFp4's mma.sync kernels (per 32-wide K block a partial, scaled by the
// activation and weight scales into an fp32 sum in K order; SwiGLU; FP8 quantisation of h; w2),
// but each block's partial is summed inside the tensor core (about 11-12 bits kept, see
// wgmma.cuh), and the w13 K splits differ: the outputs are close to, not bitwise, the mma.sync
// kernels'. A row's result never depends on the other rows of the call (spec == plain).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gemv.h"
#include "cuda/moe.h"

namespace uf::cuda::detail {

// Whether the wgmma kernels run this shape on the current device: an sm_90 device, dim % 128 ==
// 0, inter % 32 == 0, and their shared-memory plans within the device's opt-in limit.
bool moe_wgmma_supported(int dim, int inter);

// Raises the kernels' dynamic shared-memory limits for this shape (call once per shape, at
// construction: not during graph capture).
void moe_wgmma_prepare(int dim, int inter);

// w13 + SwiGLU into h_vals [m * topk][inter] (fp32 holding bf16 values), then w2: pair (t, k)'s
// output at y + t * y_row_stride + k * dim, bf16-rounded when round_w2. Two PDL launches; topk_idx
// must be complete when the first kernel's griddepcontrol.wait returns (as MoeFp4::run).
void moe_wgmma_experts(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                       const float* topk_w, int topk, float swiglu_limit, float* h_vals,
                       bool round_w2, float* y, int64_t y_row_stride, cudaStream_t stream);

}  // namespace uf::cuda::detail
