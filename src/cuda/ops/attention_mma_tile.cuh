#pragma once
// What the two tensor-core attention kernels share: attention_mma.cu (prefill spans, 64-slot
// blocks) and attention_chunk_mma.cu (decode chunks of 16 slots) stage the same tile.
#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include "cuda/kernels/common.cuh"

namespace uf::cuda {

// Shared memory (bytes): the KV rows and q's hi / lo rows as bf16 [rows][hd + 8] (with
// hd % 16 == 0 a row is an odd number of 16-byte units, so the 8 rows of an ldmatrix hit distinct
// banks), then the kernel's S staging (s_bytes, a multiple of 16) and P (bf16).
struct AttnMmaSmem {
  size_t kv, qhi, qlo, s, p, total;
};
__host__ __device__ inline AttnMmaSmem attn_mma_smem(int hd, int kv_rows, int heads, size_t s_bytes,
                                                     size_t p_bytes) {
  AttnMmaSmem m{};
  const size_t row = size_t(hd + 8) * 2;
  m.kv = 0;
  m.qhi = m.kv + size_t(kv_rows) * row;
  m.qlo = m.qhi + size_t(heads) * row;
  m.s = m.qlo + size_t(heads) * row;
  m.p = m.s + s_bytes;
  m.total = m.p + p_bytes;
  return m;
}

// Values 4f .. 4f + 3 of a slot's KV row into v (zeros before: an empty slot, row == nullptr,
// keeps them), loaded through L2, for attn_kv_bf16x4 once every load of a phase is in flight: a
// bf16 row's 8 bytes as they are in v.x / v.y (the session's compressed KV), an fp32 row's 4
// values (window rows). Scalar loads where the row is not aligned for the vector load.
__device__ __forceinline__ void attn_kv_load4(float4& v, const void* row, bool bf16, int f) {
  if (row && bf16) {
    const uint16_t* p = static_cast<const uint16_t*>(row) + 4 * f;
    uint2 b;
    if ((reinterpret_cast<uintptr_t>(p) & 7u) == 0)
      b = __ldcg(reinterpret_cast<const uint2*>(p));
    else
      b = make_uint2(uint32_t(__ldcg(p)) | uint32_t(__ldcg(p + 1)) << 16,
                     uint32_t(__ldcg(p + 2)) | uint32_t(__ldcg(p + 3)) << 16);
    v.x = __uint_as_float(b.x);
    v.y = __uint_as_float(b.y);
  } else if (row) {
    const float* p = static_cast<const float*>(row);
    if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0)
      v = __ldcg(reinterpret_cast<const float4*>(p) + f);
    else
      v = make_float4(__ldcg(p + 4 * f), __ldcg(p + 4 * f + 1), __ldcg(p + 4 * f + 2),
                      __ldcg(p + 4 * f + 3));
  }
}
// attn_kv_load4's 4 values as the tile's bf16: a bf16 row's bits, an fp32 row rounded (exact for
// the model's FP8 QDQ window values). A zero float4 (an empty slot) gives zeros either way.
__device__ __forceinline__ uint2 attn_kv_bf16x4(const float4& v, bool bf16) {
  return bf16 ? make_uint2(__float_as_uint(v.x), __float_as_uint(v.y))
              : make_uint2(detail::pack_bf16x2(v.x, v.y), detail::pack_bf16x2(v.z, v.w));
}

// q as two bf16 operands: .x the bits of hi = bf16(x0, x1), .y those of bf16(x - hi) (x - hi is
// exact in fp32: hi is x rounded to 8 significant bits). hi + lo keeps ~16 bits of an fp32 q;
// the model's q is bf16, so lo = 0 and every product with a bf16 KV value is exact.
__device__ __forceinline__ uint2 attn_q_hi_lo(float x0, float x1) {
  const __nv_bfloat162 hi = __floats2bfloat162_rn(x0, x1);
  return make_uint2(detail::bf16x2_bits(hi),
                    detail::pack_bf16x2(x0 - __low2float(hi), x1 - __high2float(hi)));
}

}  // namespace uf::cuda
