// Random fills for benchmarks: one splitmix64 hash per 8 output bytes, grid-stride, 8-byte stores.
// Shapes: any n (a scalar tail handles n % 8); no alignment needed beyond the allocation's.

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/device_fill.h"

namespace uf::cuda {
namespace {

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

enum class Mode { kRange, kE4M3 };

template <Mode kMode>
__global__ void fill_bytes_kernel(uint8_t* p, size_t n, uint64_t seed, int lo, int span) {
  const size_t words = n / 8;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words + 1;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed ^ (i * 0xD1B54A32D192ED03ull));
    uint8_t b[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint8_t v = uint8_t(h >> (8 * j));
      if constexpr (kMode == Mode::kE4M3) {
        if ((v & 0x7f) == 0x7f) v ^= 1;  // no NaN codes
      } else {
        v = uint8_t(lo + int(v) % span);
      }
      b[j] = v;
    }
    if (i < words) {
      uint64_t w = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) w |= uint64_t(b[j]) << (8 * j);
      reinterpret_cast<uint64_t*>(p)[i] = w;
    } else {
      for (size_t j = 0; j < n % 8; ++j) p[words * 8 + j] = b[j];
    }
  }
}

__global__ void fill_bf16_kernel(uint16_t* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed ^ (i * 0xD1B54A32D192ED03ull));
    const float u = float(h >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
    p[i] = uint16_t(__float_as_uint(u * scale) >> 16);
  }
}

__global__ void fill_f32_kernel(float* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed ^ (i * 0xD1B54A32D192ED03ull));
    p[i] = (float(h >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale;
  }
}

__global__ void __launch_bounds__(512) copy_kernel(uint4* dst, const uint4* src, size_t n16) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16;
       i += size_t(gridDim.x) * blockDim.x)
    dst[i] = __ldcs(src + i);
}

__global__ void __launch_bounds__(512) read_kernel(const uint4* src, size_t n16, unsigned* sink) {
  unsigned x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(src + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9E3779B9u) *sink = x;  // practically never: keeps the loads alive
}

constexpr int kGrid = 132 * 8, kBlock = 256;

}  // namespace

void fill_random_bytes(uint8_t* p, size_t n, uint64_t seed, int lo, int hi, cudaStream_t stream) {
  require(lo >= 0 && hi <= 255 && lo <= hi, "fill_random_bytes: bad range [%d, %d]", lo, hi);
  fill_bytes_kernel<Mode::kRange><<<kGrid, kBlock, 0, stream>>>(p, n, seed, lo, hi - lo + 1);
  UF_CUDA_CHECK(cudaGetLastError());
}

void fill_random_e4m3(uint8_t* p, size_t n, uint64_t seed, cudaStream_t stream) {
  fill_bytes_kernel<Mode::kE4M3><<<kGrid, kBlock, 0, stream>>>(p, n, seed, 0, 256);
  UF_CUDA_CHECK(cudaGetLastError());
}

void device_copy(void* dst, const void* src, size_t n, cudaStream_t stream) {
  require(n % 16 == 0, "device_copy: %zu bytes is not a multiple of 16", n);
  copy_kernel<<<132 * 4, 512, 0, stream>>>(static_cast<uint4*>(dst), static_cast<const uint4*>(src),
                                           n / 16);
  UF_CUDA_CHECK(cudaGetLastError());
}

void device_read(const void* src, size_t n, unsigned* sink, cudaStream_t stream) {
  require(n % 16 == 0, "device_read: %zu bytes is not a multiple of 16", n);
  read_kernel<<<132 * 4, 512, 0, stream>>>(static_cast<const uint4*>(src), n / 16, sink);
  UF_CUDA_CHECK(cudaGetLastError());
}

void fill_random_f32(float* p, size_t n, uint64_t seed, float scale, cudaStream_t stream) {
  fill_f32_kernel<<<kGrid, kBlock, 0, stream>>>(p, n, seed, scale);
  UF_CUDA_CHECK(cudaGetLastError());
}

void fill_random_bf16(uint16_t* p, size_t n, uint64_t seed, float scale, cudaStream_t stream) {
  fill_bf16_kernel<<<kGrid, kBlock, 0, stream>>>(p, n, seed, scale);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
