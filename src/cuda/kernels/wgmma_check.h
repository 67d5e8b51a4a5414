#pragma once
// One m64n8k32 E4M3 product on the device, three ways (kernels/wgmma.cuh): wgmma with A from
// shared memory, wgmma with A from registers, and the mma.sync m16n8k32 path of the decode
// kernels (4 warps x 16 rows). For tests/cuda/test_wgmma_fp8.cpp: the layouts and the numerics.
#include <cstdint>

namespace uf::cuda {

// a: 64 x 32 E4M3 row-major, b: 8 x 32 E4M3 (column n's 32 K bytes contiguous); outputs d_* [64][8]
// fp32 (host memory). rs_a_order: the register A fragment's order (0: a0 row g / K 4t, a1 row
// g+8 / K 4t, a2 row g / K 16+4t, a3 row g+8 / K 16+4t, the mma.sync layout; 1: a1 and a2
// swapped), to tell the right one on the device. Returns false (nothing run) where wgmma is not
// available (not an sm_90 device, or a build without sm_90a).
bool wgmma_e4m3_check(const uint8_t* a, const uint8_t* b, int rs_a_order, float* d_ss, float* d_rs,
                      float* d_sync);

}  // namespace uf::cuda
