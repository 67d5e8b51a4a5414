// wgmma_check.h: a device self-check of kernels/wgmma.cuh's m64n8k32 E4M3 products.
#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/wgmma.cuh"
#include "cuda/kernels/wgmma_check.h"

namespace uf::cuda {
namespace {

using namespace detail;

constexpr uint32_t kLbo = 128, kSbo = 256;  // K halves 128 B apart, 8-row groups 256 B apart

__global__ void __launch_bounds__(128)
    wgmma_check_kernel(const uint8_t* a, const uint8_t* b, int order, float* d_ss, float* d_rs,
                       float* d_sync, int* ok) {
  __shared__ __align__(128) uint8_t sa[64 * 32];
  __shared__ __align__(128) uint8_t sb[8 * 32];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  for (int i = tid; i < 64 * 32; i += 128) {
    const int r = i / 32, k = i % 32;
    sa[(r / 8) * kSbo + (k / 16) * kLbo + (r % 8) * 16 + k % 16] = a[i];
  }
  for (int i = tid; i < 8 * 32; i += 128) {
    const int n = i / 32, k = i % 32;
    sb[(k / 16) * kLbo + n * 16 + k % 16] = b[i];
  }
  __syncthreads();
  fence_async_shared();
  __syncthreads();
  const uint64_t da = matrix_desc(sa, kLbo, kSbo), db = matrix_desc(sb, kLbo, kSbo);

  // The A fragment of this thread (rows 16 warp + g, + 8) and the mma.sync B fragment (column g).
  auto word = [&](const uint8_t* p) {
    return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
  };
  const uint8_t* ra = a + (16 * warp + g) * 32;
  const uint8_t* rb = ra + 8 * 32;
  uint32_t af[4] = {word(ra + 4 * t), word(rb + 4 * t), word(ra + 16 + 4 * t),
                    word(rb + 16 + 4 * t)};
  [[maybe_unused]] uint32_t ar[4] = {af[0], af[1], af[2], af[3]};
  if (order == 1) {
    ar[1] = af[2];
    ar[2] = af[1];
  }
  const uint32_t b0 = word(b + g * 32 + 4 * t), b1 = word(b + g * 32 + 16 + 4 * t);

  float dss[4] = {0.f, 0.f, 0.f, 0.f}, drs[4] = {0.f, 0.f, 0.f, 0.f}, dsy[4];
#if UF_HAVE_WGMMA
  wgmma_fence();
  wgmma_e4m3_ss(dss, da, db, false);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence();
  wgmma_e4m3_rs(drs, ar, db, false);
  wgmma_commit();
  wgmma_wait<0>();
  if (tid == 0) *ok = 1;
#endif
  mma_e4m3_16x8x32(dsy, af, b0, b1);
  const int r0 = 16 * warp + g;
  const int o[4] = {r0 * 8 + 2 * t, r0 * 8 + 2 * t + 1, (r0 + 8) * 8 + 2 * t,
                    (r0 + 8) * 8 + 2 * t + 1};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    d_ss[o[i]] = dss[i];
    d_rs[o[i]] = drs[i];
    d_sync[o[i]] = dsy[i];
  }
}

}  // namespace

bool wgmma_e4m3_check(const uint8_t* a, const uint8_t* b, int rs_a_order, float* d_ss, float* d_rs,
                      float* d_sync) {
  int dev = 0, major = 0;
  UF_CUDA_CHECK(cudaGetDevice(&dev));
  UF_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major != 9) return false;
  uint8_t *da, *db;
  float* dd;
  int* ok;
  UF_CUDA_CHECK(cudaMalloc(&da, 64 * 32));
  UF_CUDA_CHECK(cudaMalloc(&db, 8 * 32));
  UF_CUDA_CHECK(cudaMalloc(&dd, 3 * 64 * 8 * sizeof(float)));
  UF_CUDA_CHECK(cudaMalloc(&ok, sizeof(int)));
  UF_CUDA_CHECK(cudaMemset(ok, 0, sizeof(int)));
  UF_CUDA_CHECK(cudaMemcpy(da, a, 64 * 32, cudaMemcpyHostToDevice));
  UF_CUDA_CHECK(cudaMemcpy(db, b, 8 * 32, cudaMemcpyHostToDevice));
  wgmma_check_kernel<<<1, 128>>>(da, db, rs_a_order, dd, dd + 512, dd + 1024, ok);
  UF_CUDA_CHECK(cudaGetLastError());
  UF_CUDA_CHECK(cudaDeviceSynchronize());
  int h_ok = 0;
  UF_CUDA_CHECK(cudaMemcpy(&h_ok, ok, sizeof(int), cudaMemcpyDeviceToHost));
  UF_CUDA_CHECK(cudaMemcpy(d_ss, dd, 512 * sizeof(float), cudaMemcpyDeviceToHost));
  UF_CUDA_CHECK(cudaMemcpy(d_rs, dd + 512, 512 * sizeof(float), cudaMemcpyDeviceToHost));
  UF_CUDA_CHECK(cudaMemcpy(d_sync, dd + 1024, 512 * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(da);
  cudaFree(db);
  cudaFree(dd);
  cudaFree(ok);
  return h_ok == 1;
}

}  // namespace uf::cuda
