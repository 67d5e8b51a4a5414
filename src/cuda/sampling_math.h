#pragma once
// Sampling math shared by host and device (plain C++ when not compiled by nvcc).
//
// RNG: Philox4x32-10 (Salmon et al. 2011, the Random123 constants), key = seed (lo, hi words),
// counter = {token / 4, row, step lo, step hi}; token i uses output word i % 4.
// Uniform: u = ((x >> 8) + 0.5) * 2^-24, in (0, 1) and exact in fp32.
// Gumbel: g = -log(-log(u)) (fp32 logf on the device).
// Same Philox as src/sampling/rng.h, different counter layout: word 1 is the row (< 8) here and
// purpose << 8 (>= 256) there, so this kernel and the CPU sampler/verifier never share a draw.
// The CPU plain/draft path samples by inverse CDF (src/sampling/sampler.h); porting that path and
// block verification (src/sampling/verify.h) to the device reuses this file's cluster-wide
// reductions and replaces the Gumbel-max pass.

#include <cstdint>

#if defined(__CUDACC__)
#define UF_HD __host__ __device__ __forceinline__
#else
#define UF_HD inline
#endif

namespace uf::cuda {

struct Philox4 {
  uint32_t v[4];
};

UF_HD uint32_t mulhi32(uint32_t a, uint32_t b) {
  return uint32_t((uint64_t(a) * uint64_t(b)) >> 32);
}

UF_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                            uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    const uint32_t hi0 = mulhi32(kM0, c0), lo0 = kM0 * c0;
    const uint32_t hi1 = mulhi32(kM1, c2), lo1 = kM1 * c2;
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The 4 random words for tokens 4*quad .. 4*quad+3 of (seed, step, row).
UF_HD Philox4 sampling_philox(uint64_t seed, uint64_t step, uint32_t row, uint32_t quad) {
  return philox4x32_10(quad, row, uint32_t(step), uint32_t(step >> 32), uint32_t(seed),
                       uint32_t(seed >> 32));
}

UF_HD float philox_uniform(uint32_t x) { return (float(x >> 8) + 0.5f) * (1.0f / 16777216.0f); }

// Fixed-point probability mass q = floor(e * 2^40), e in [0, 1].
UF_HD uint64_t mass_q(float e) { return uint64_t(e * 1099511627776.0f); }

}  // namespace uf::cuda

#undef UF_HD
