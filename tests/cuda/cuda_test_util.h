#pragma once
// Helpers for the GPU tests: device buffers, NaN poisoning, random checkpoint-format data, bits.

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "core/dtypes.h"
#include "core/quant.h"
#include "cuda/cuda_check.h"
#include "cuda/ops/linear.h"

namespace uf::cuda::test {

// CUDA devices visible (0 when there is no driver or device).
inline int gpu_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
inline bool have_gpu() { return gpu_count() > 0; }

#define UF_REQUIRE_GPU() \
  if (!::uf::cuda::test::have_gpu()) GTEST_SKIP() << "no CUDA device"

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n = 0) : n_(n) {
    if (n) UF_CUDA_CHECK(cudaMalloc(&p_, n * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& v) : DeviceBuffer(v.size()) { upload(v); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return p_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& v) {
    UF_CUDA_CHECK(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    UF_CUDA_CHECK(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  // 0xFF bytes: NaN for fp32 and bf16, so unwritten outputs fail the finiteness checks.
  void poison() { UF_CUDA_CHECK(cudaMemset(p_, 0xFF, n_ * sizeof(T))); }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

inline void sync_and_check() {
  UF_CUDA_CHECK(cudaGetLastError());
  UF_CUDA_CHECK(cudaDeviceSynchronize());
}

// Random E4M3 codes, never NaN (0x7f / 0xff).
inline std::vector<uint8_t> random_e4m3(size_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> d(0, 255);
  std::vector<uint8_t> v(n);
  for (auto& c : v) {
    do c = uint8_t(d(rng));
    while ((c & 0x7f) == 0x7f);
  }
  return v;
}
inline std::vector<uint8_t> random_bytes(size_t n, std::mt19937& rng, int lo = 0, int hi = 255) {
  std::uniform_int_distribution<int> d(lo, hi);
  std::vector<uint8_t> v(n);
  for (auto& c : v) c = uint8_t(d(rng));
  return v;
}

// The float's IEEE bits.
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline bool bits_equal(float a, float b) { return f32_bits(a) == f32_bits(b); }

// n bf16-exact values drawn from N(0, sd) (rounded to bf16).
inline std::vector<float> normal_bf16(size_t n, std::mt19937& rng, float sd) {
  std::normal_distribution<float> d(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = core::round_bf16(d(rng));
  return v;
}

// The indexer's operand class: FP4 E2M1 values with a UE8M0 scale per 32 (the model's index q and
// keys, core::fake_quant_fp4_e8m0_scale), from `offset` on in whole blocks. index_scores' tensor-
// core kernel is bitwise the CPU on these (ops/index_scores_mma.cu), not on arbitrary bf16 values.
inline std::vector<float> fp4_qdq(std::vector<float> v, size_t offset = 0) {
  core::fake_quant_fp4_e8m0_scale(v.data() + offset, (v.size() - offset) / 32 * 32, 32);
  return v;
}

// bf16 bits as fp32 values (exact).
inline std::vector<float> bf16_values(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = core::bf16_to_float(v[i]);
  return out;
}

// bf16-exact fp32 values as the bf16 bits the session stores index keys in (cuda_session.h);
// a value bf16 cannot hold is a broken test input.
inline std::vector<uint16_t> bf16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = core::float_to_bf16(v[i]);
    if (core::bf16_to_float(out[i]) != v[i])
      throw std::runtime_error("bf16_bits: test value not exact in bf16");
  }
  return out;
}

}  // namespace uf::cuda::test
