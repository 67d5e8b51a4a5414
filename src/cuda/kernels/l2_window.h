#pragma once
// An L2 access-policy window for a kernel launch that streams a weight once: its lines are
// marked streaming (evicted first), so that the step's weight traffic (60-140 MB a layer against a
// 50 MB L2) stops pushing out what the step reuses: the kernels' code, activations, small weights.
// Build knob UF_L2_STREAM_WEIGHTS (default 1; 0: no attribute, the A/B of docs/perf.md session 28).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"

namespace uf::cuda::detail {

#ifndef UF_L2_STREAM_WEIGHTS
#define UF_L2_STREAM_WEIGHTS 1
#endif

// Fills attr with a streaming window over [lo, hi) when the knob is on and the range fits the
// device's largest window; returns whether it did.
inline bool l2_streaming_window(const void* lo, const void* hi, cudaLaunchAttribute& attr) {
  if (!UF_L2_STREAM_WEIGHTS || !lo || hi <= lo) return false;
  static thread_local int max_bytes = -1, dev_of = -1;
  int dev = 0;
  UF_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev != dev_of) {
    UF_CUDA_CHECK(cudaDeviceGetAttribute(&max_bytes, cudaDevAttrMaxAccessPolicyWindowSize, dev));
    dev_of = dev;
  }
  const size_t bytes = size_t(static_cast<const uint8_t*>(hi) - static_cast<const uint8_t*>(lo));
  if (max_bytes <= 0 || bytes > size_t(max_bytes)) return false;
  attr.id = cudaLaunchAttributeAccessPolicyWindow;
  attr.val.accessPolicyWindow.base_ptr = const_cast<void*>(lo);
  attr.val.accessPolicyWindow.num_bytes = bytes;
  attr.val.accessPolicyWindow.hitRatio = 1.0f;
  attr.val.accessPolicyWindow.hitProp = cudaAccessPropertyStreaming;
  attr.val.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
  return true;
}

// launch_pdl (common.cuh) with l2_streaming_window over [lo, hi) where it applies.
template <typename Kernel, typename... Args>
void launch_pdl_streaming(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          const void* lo, const void* hi, Args... args) {
  cudaLaunchAttribute window;
  const bool on = l2_streaming_window(lo, hi, window);
  launch_pdl_with(on ? &window : nullptr, kernel, grid, block, smem, stream, args...);
}

}  // namespace uf::cuda::detail
