#pragma once
// The top-p filter's arithmetic, shared by the CPU transform (transform.cpp) and the device
// transforms (src/cuda/kernels/verify_select.cuh), host and device.
//
// Masses are fixed point: mass(p) = floor(p * 2^42) for a probability p in [0, 1] (the transform's
// p = exp((l - max) / T) <= 1). Integer sums are exact in any order, so a GPU can build the top-p
// cut from order-free histograms (a few passes over the row, no sort, no sequential walk) and
// still agree with the CPU bit for bit. mass(p) is exact for p >= 2^-19 (a float's 24 bits stay
// above 2^-42); smaller p lose their low bits, less than 2^-42 each: for the model's 129280
// tokens < 2^-25 of a row's mass (which is >= 1: the top token has p = 1), below a float sum's
// rounding over the row. A row of at most kTopPMaxVocab entries sums to < 2^63.
//
// The limit: survivors (top-k) of total mass Z keep x iff the survivors strictly more probable
// than x have mass < top_p * Z. With integer masses that is mass < ceil(top_p * Z) =
// top_p_limit(top_p, Z), computed exactly (top_p = M 2^-E with a 24-bit M; the product M Z < 2^87
// in 128 bits).

#include <bit>
#include <cstdint>

#include "sampling/rng.h"  // UF_SAMPLING_HD

namespace uf::sampling {

inline constexpr int kTopPMassBits = 42;
inline constexpr int64_t kTopPMaxVocab = int64_t(1) << 21;  // vocab * 2^42 <= 2^63

// floor(p * 2^42) for p in [0, 1]; 0 for p <= 0 or NaN.
UF_SAMPLING_HD uint64_t top_p_mass(float p) {
  return p > 0.0f ? uint64_t(p * 4398046511104.0f) : 0u;  // 2^42: the scaling is exact
}

// The high 64 bits of a * b.
UF_SAMPLING_HD uint64_t mul64_hi(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return uint64_t((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

// ceil(top_p * z) exactly, for top_p in (0, 1] (a normal or subnormal float) and z < 2^63.
UF_SAMPLING_HD uint64_t top_p_limit(float top_p, uint64_t z) {
  if (!(top_p > 0.0f) || z == 0) return 0;
    // top_p = m * 2^-e: m the 24-bit significand (implicit bit included), e >= 23 since top_p <= 1.
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(top_p);
#else
  const uint32_t bits = std::bit_cast<uint32_t>(top_p);
#endif
  const uint32_t biased = bits >> 23;
  const uint64_t m = biased == 0 ? (bits & 0x7FFFFFu) : ((bits & 0x7FFFFFu) | 0x800000u);
  const int e = biased == 0 ? 149 : 150 - int(biased);
  const uint64_t lo = m * z, hi = mul64_hi(m, z);  // the product in 128 bits
  uint64_t q;
  bool rem;
  if (e < 64) {  // e >= 23 > 0
    q = (hi << (64 - e)) | (lo >> e);
    rem = (lo & ((uint64_t(1) << e) - 1)) != 0;
  } else if (e < 128) {
    q = e == 64 ? hi : hi >> (e - 64);
    rem = lo != 0 || (e > 64 && (hi & ((uint64_t(1) << (e - 64)) - 1)) != 0);
  } else {
    q = 0;
    rem = lo != 0 || hi != 0;
  }
  return q + (rem ? 1u : 0u);
}

}  // namespace uf::sampling
