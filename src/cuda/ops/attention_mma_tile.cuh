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

// q as two bf16 operands: .x the bits of hi = bf16(x0, x1), .y those of bf16(x - hi) (x - hi is
// exact in fp32: hi is x rounded to 8 significant bits). hi + lo keeps ~16 bits of an fp32 q;
// the model's q is bf16, so lo = 0 and every product with a bf16 KV value is exact.
__device__ __forceinline__ uint2 attn_q_hi_lo(float x0, float x1) {
  const __nv_bfloat162 hi = __floats2bfloat162_rn(x0, x1);
  return make_uint2(detail::bf16x2_bits(hi),
                    detail::pack_bf16x2(x0 - __low2float(hi), x1 - __high2float(hi)));
}

}  // namespace uf::cuda
