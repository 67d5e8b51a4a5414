#pragma once
// Device-side element access to a DeviceWeight in its checkpoint format, dequantised exactly as
// model::Weight::row / cpu weight_row do (E4M3 / E2M1 value times the E8M0 block scale in fp32).
// Shared by the ops kernels (linear.cu, engram.cu).

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_weights.h"
#include "cuda/kernels/common.cuh"

namespace uf::cuda::ops_detail {

using model::WFormat;

__device__ __forceinline__ float e4m3_value(uint32_t c) {
  const uint32_t e = (c >> 3) & 15u, m = c & 7u;
  float v;
  if ((c & 0x7fu) == 0x7fu)
    v = __uint_as_float(0x7fc00000u);
  else if (e == 0)
    v = float(m) * 0x1p-9f;
  else
    v = __uint_as_float(((e + 120u) << 23) | (m << 20));
  return (c & 0x80u) ? -v : v;
}

__device__ __forceinline__ float e2m1_value(uint32_t c) {
  const float kMag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  const float v = kMag[c & 7u];
  return (c & 8u) ? -v : v;
}

struct WeightRef {
  const uint8_t* data;
  const uint8_t* scale;
  int64_t cols;
  int format;  // model::WFormat
  bool row_scale;
};

// Element (r, k) without its block scale (FP8 / FP4), or its exact value (BF16 / F32).
__device__ __forceinline__ float raw_element(const WeightRef& w, int64_t r, int64_t k) {
  switch (w.format) {
    case int(WFormat::kF32):
      return reinterpret_cast<const float*>(w.data)[r * w.cols + k];
    case int(WFormat::kBF16):
      return __uint_as_float(uint32_t(reinterpret_cast<const uint16_t*>(w.data)[r * w.cols + k])
                             << 16);
    case int(WFormat::kFP8):
      return e4m3_value(w.data[r * w.cols + k]);
    default: {
      const uint32_t byte = w.data[r * (w.cols / 2) + k / 2];
      return e2m1_value((k & 1) ? (byte >> 4) : (byte & 15u));
    }
  }
}

// The E8M0 scale of the 32-block holding (r, k) (FP8 / FP4 only).
__device__ __forceinline__ float block_scale(const WeightRef& w, int64_t r, int64_t kb) {
  const int64_t sc = (w.cols + 31) / 32;
  if (w.format == int(WFormat::kFP8))
    return detail::e8m0_to_f32(w.scale[(w.row_scale ? r : r / 32) * sc + kb]);
  return detail::e8m0_to_f32(w.scale[r * (w.cols / 32) + kb]);
}

// Element (r, k) dequantised exactly as cpu weight_row (value * scale in fp32).
__device__ __forceinline__ float element(const WeightRef& w, int64_t r, int64_t k) {
  const float v = raw_element(w, r, k);
  if (w.format == int(WFormat::kF32) || w.format == int(WFormat::kBF16)) return v;
  return __fmul_rn(v, block_scale(w, r, k / 32));
}

inline WeightRef weight_ref(const DeviceWeight& w) {
  return WeightRef{w.data, w.scale, w.cols, int(w.format), w.row_scale};
}

}  // namespace uf::cuda::ops_detail
