#pragma once
// Hopper warpgroup MMA (wgmma.mma_async, sm_90a only) for FP8: the native E4M3 tensor-core path.
// sm_90a has no FP8 mma.sync (ptxas emulates mma_e4m3_16x8x32 with 12 F2FP + 2 f16 HMMA, see
// mma_f16.cuh), so a decode kernel that feeds FP8 through mma.sync spends most of its issue slots
// on conversions; wgmma takes E4M3 operands as they are. Shape used here: m64n8k32 (64 weight rows
// of a warpgroup = 4 warps x 16 rows, 8 token columns, one 32-wide K block), fp32 accumulators.
//
// Operands
//   A (weights, 64 x 32 bytes): in registers (the "RS" form; each warp its own 16 rows: 4 regs of
//   4 e4m3 a thread, the mma.sync m16n8k32 A layout, lane (g, t) = (lane / 4, lane % 4): a0 row
//   g bytes 4t..4t+3, a1 row g+8 the same, a2 row g bytes 16+4t.., a3 row g+8) or in shared
//   memory ("SS").
//   B (activations, 8 columns x 32 bytes, K-major) and an SS A: shared memory in the canonical
//   no-swizzle K-major layout: 8-row x 16-byte core matrices (128 contiguous bytes, row r of the
//   core matrix at byte 16 r); the two 16-byte K halves of a 32-byte block LBO bytes apart, the
//   8-row groups SBO bytes apart (matrix_desc).
//   D: 4 fp32 a thread, the mma.sync m16n8 layout per warp: d0 (row 16w+g, col 2t), d1 (16w+g,
//   2t+1), d2 (16w+g+8, 2t), d3 (16w+g+8, 2t+1).
// Ordering: shared-memory operands written by ordinary stores need fence_async_shared() (and a
// barrier) before the wgmma reads them; registers feeding a wgmma (A, accumulators) need
// wgmma_fence() after they were last written; results are valid after wgmma_commit() +
// wgmma_wait<0>() (or wait<N> for the N most recent groups still in flight).
// Numerics: the hardware sums the 32 exact products of a block in its own accumulator width
// (narrower than fp32: DeepSeek-V3's report measures ~14 bits kept on H800), then adds C. Not
// bitwise the mma.sync emulation; tests/cuda/test_wgmma_fp8.cpp measures both against an exact
// sum.
#include <cstdint>

namespace uf::cuda::detail {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define UF_HAVE_WGMMA 1
#else
#define UF_HAVE_WGMMA 0
#endif

// A no-swizzle K-major shared-memory matrix descriptor: start address, LBO (the two K halves of a
// 32-byte block), SBO (consecutive 8-row groups); all multiples of 16 bytes.
__device__ __forceinline__ uint64_t matrix_desc_addr(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = uint64_t((addr & 0x3FFFFu) >> 4);
  d |= uint64_t((lbo & 0x3FFFFu) >> 4) << 16;
  d |= uint64_t((sbo & 0x3FFFFu) >> 4) << 32;
  return d;  // base offset 0, swizzle mode 0 (none)
}
__device__ __forceinline__ uint64_t matrix_desc(const void* smem, uint32_t lbo, uint32_t sbo) {
  return matrix_desc_addr(uint32_t(__cvta_generic_to_shared(smem)), lbo, sbo);
}

__device__ __forceinline__ void fence_async_shared() {
#if UF_HAVE_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_fence() {
#if UF_HAVE_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if UF_HAVE_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if UF_HAVE_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}

// Pins an accumulator's registers at this point of the instruction stream: the compiler sees
// wgmma's outputs as ready when the (asynchronous) instruction is issued, so without this it may
// move their reads above wgmma_wait or their writes below the next wgmma (CUTLASS's
// warpgroup_fence_operand does the same).
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (+)= A * B, A from registers. accumulate = false: d = A * B (C ignored).
__device__ __forceinline__ void wgmma_e4m3_rs(float (&d)[4], const uint32_t (&a)[4],
                                              uint64_t desc_b, bool accumulate) {
#if UF_HAVE_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, "
      "1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)));
#endif
}

// d (+)= A * B, both from shared memory.
__device__ __forceinline__ void wgmma_e4m3_ss(float (&d)[4], uint64_t desc_a, uint64_t desc_b,
                                              bool accumulate) {
#if UF_HAVE_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, %4, %5, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)));
#endif
}

}  // namespace uf::cuda::detail
