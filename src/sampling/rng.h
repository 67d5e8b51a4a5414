#pragma once
// Counter-based random numbers for sampling and verification: Philox4x32-10 (Salmon et al.,
// "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the generator behind Random123 and
// cuRAND's Philox). Counter-based so that the CUDA sampling kernel can reproduce every draw of the
// CPU path from (seed, step, purpose, index) alone, with no generator state to carry between steps.
//
// Stream layout (version 1; changing it changes every seeded output):
//   key     = {seed & 0xffffffff, seed >> 32}                  (64-bit request seed)
//   counter = {index / 4, purpose << 8, step & 0xffffffff, step >> 32}
//   uniform(seed, step, purpose, index) = to_unit(word index % 4 of Philox(counter, key))
//   to_unit(x) = ((x >> 8) + 1) * 2^-24, a float in (0, 1] with 24 random bits.
// Purposes are 1, 2, 3, so counter word 1 is >= 256: the Gumbel-max decode kernel of
// src/cuda/sampling (its own layout, counter word 1 = row < 8) never draws the same words.
// (0, 1] rather than [0, 1) so that "eta <= h" is never true for h = 0 and always true for h = 1,
// and so that inverse-CDF sampling (target = u * total > 0) never picks a zero-weight token.
//
// `step` is the request's iteration counter (0 for the first token sampled after prefill, +1 per
// decode or draft/verify iteration). Purposes and indices within one step:
//   kPlain : index 0          = the uniform of the one token sampled by plain decoding
//   kDraft : index i - 1      = the uniform that samples draft slot i (i = 1..7)
//   kVerify: index i - 1      = eta_i of block/token-wise verification (i = 1..7)
//            index kMaxDraft  = the uniform that samples the extra (correction/bonus) token
#include <cstdint>

#if defined(__CUDACC__)
#define UF_SAMPLING_HD __host__ __device__ __forceinline__
#else
#define UF_SAMPLING_HD inline
#endif

namespace uf::sampling {

inline constexpr int kMaxDraft = 7;  // drafts per verify step (8 verify rows)

enum class RngPurpose : uint32_t { kPlain = 1, kDraft = 2, kVerify = 3 };

// One Philox4x32-10 block: 10 rounds of two 32x32->64 multiplies with a Weyl-sequence key bump.
UF_SAMPLING_HD void philox4x32_10(const uint32_t counter[4], const uint32_t key[2],
                                  uint32_t out[4]) {
  uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{0xD2511F53u} * c0;
    const uint64_t p1 = uint64_t{0xCD9E8D57u} * c2;
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0);
    const uint32_t hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// 24 random bits to a float in (0, 1]; exact (every value is a multiple of 2^-24).
UF_SAMPLING_HD float to_unit_float(uint32_t bits) {
  return float((bits >> 8) + 1u) * (1.0f / 16777216.0f);
}

// The raw 32-bit word `index` of stream (seed, step, purpose).
UF_SAMPLING_HD uint32_t stream_bits(uint64_t seed, uint64_t step, RngPurpose purpose,
                                    uint32_t index) {
  const uint32_t counter[4] = {index / 4u, uint32_t(purpose) << 8, uint32_t(step),
                               uint32_t(step >> 32)};
  const uint32_t key[2] = {uint32_t(seed), uint32_t(seed >> 32)};
  uint32_t out[4];
  philox4x32_10(counter, key, out);
  return out[index % 4u];
}

UF_SAMPLING_HD float stream_uniform(uint64_t seed, uint64_t step, RngPurpose purpose,
                                    uint32_t index) {
  return to_unit_float(stream_bits(seed, step, purpose, index));
}

// The explicit draws of one verify step (see the layout above).
struct VerifyDraws {
  float eta[kMaxDraft];  // eta[i - 1] = eta_i
  float u_extra;         // samples the extra token
};

UF_SAMPLING_HD VerifyDraws make_verify_draws(uint64_t seed, uint64_t step) {
  VerifyDraws d;
  for (int i = 0; i < kMaxDraft; ++i) {
    d.eta[i] = stream_uniform(seed, step, RngPurpose::kVerify, uint32_t(i));
  }
  d.u_extra = stream_uniform(seed, step, RngPurpose::kVerify, uint32_t(kMaxDraft));
  return d;
}

}  // namespace uf::sampling
