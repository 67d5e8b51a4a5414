#pragma once
// The e4m3 m16n8k32 mma (mma_e4m3_16x8x32, common.cuh) written as the f16 instructions that
// ptxas emulates it with on sm_90a (moe_fp4.cu's comment "The m16n8k32 e4m3 mma on f16 HMMA"
// gives the SASS it was read from): per mma 12 F2FP (e4m3x2 -> f16x2, exact) + 2 HMMA.16816.F32
// chained through C + 4 FADD of a zero C. Here the operands are converted separately so that a
// kernel converts each one ONCE and reuses it:
//   t = HMMA(A = {lo(a0), lo(a1), lo(a2), lo(a3)}, B = {lo(b0), lo(b1)}, C = 0)
//   d = HMMA(A = {hi(a0), hi(a1), hi(a2), hi(a3)}, B = {hi(b0), hi(b1)}, C = t)
// lo / hi = the f16x2 of a register's low / high two e4m3 bytes. The same instructions and
// operand positions as the emulation, minus its "+ 0" FADDs: d differs only where t = -0, and a
// caller's acc = fmaf(d * sa, sw, acc) from +0 then agrees unless acc is itself -0.
// Used by the decode MoE kernels (moe_fp4.cu, whose mma_e4m3_f16 is a_e4m3_to_f16 +
// mma_e4m3_f16_pre), the MoE prefill kernels (moe_prefill.cu) and the FP8 prefill GEMM
// (fp8_gemm.cu).
#include <cstdint>

namespace uf::cuda::detail {

__device__ __forceinline__ uint32_t f16_lo_of_e4m3x4(uint32_t x) {
  uint32_t r;
  asm("{.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, l;}" : "=r"(r) : "r"(x));
  return r;
}
__device__ __forceinline__ uint32_t f16_hi_of_e4m3x4(uint32_t x) {
  uint32_t r;
  asm("{.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, h;}" : "=r"(r) : "r"(x));
  return r;
}
__device__ __forceinline__ void hmma_16x8x16_f32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1, const float (&c)[4]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}

// The B fragment (b0, b1: 4 e4m3 each, as mma_e4m3_16x8x32's) as the two HMMAs' operands:
// {lo(b0), lo(b1)} for the first, {hi(b0), hi(b1)} for the second.
__device__ __forceinline__ uint4 b_e4m3_to_f16x8(uint32_t b0, uint32_t b1) {
  return make_uint4(f16_lo_of_e4m3x4(b0), f16_lo_of_e4m3x4(b1), f16_hi_of_e4m3x4(b0),
                    f16_hi_of_e4m3x4(b1));
}

// The A fragment (4 registers of 4 e4m3, as mma_e4m3_16x8x32's) as the two HMMAs' operands.
struct AF16 {
  uint32_t lo[4], hi[4];
};
__device__ __forceinline__ AF16 a_e4m3_to_f16(const uint32_t (&a)[4]) {
  AF16 r;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    r.lo[i] = f16_lo_of_e4m3x4(a[i]);
    r.hi[i] = f16_hi_of_e4m3x4(a[i]);
  }
  return r;
}

// D = A * B (C = 0) from pre-converted operands: mma_e4m3_f16 (moe_fp4.cu) exactly.
__device__ __forceinline__ void mma_e4m3_f16_pre(float (&d)[4], const AF16& a, const uint4& bh) {
  const float zero[4] = {0.f, 0.f, 0.f, 0.f};
  float t[4];
  hmma_16x8x16_f32(t, a.lo, bh.x, bh.y, zero);
  hmma_16x8x16_f32(d, a.hi, bh.z, bh.w, t);
}

}  // namespace uf::cuda::detail
