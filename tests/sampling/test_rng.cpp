// Philox4x32-10 against Random123's published known-answer vectors, the documented stream layout,
// and the (0, 1] float conversion; plus a uniformity check of the stream with a stated alpha.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "sampling/rng.h"
#include "stats.h"

using namespace uf::sampling;

TEST(Rng, PhiloxMatchesRandom123KnownAnswers) {
  struct Kat {
    uint32_t ctr[4], key[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       {0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    uint32_t out[4];
    philox4x32_10(k.ctr, k.key, out);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], k.out[i]) << i;
  }
}

TEST(Rng, UnitFloatIsInHalfOpenIntervalZeroExcluded) {
  EXPECT_EQ(to_unit_float(0u), 1.0f / 16777216.0f);
  EXPECT_EQ(to_unit_float(0xffffffffu), 1.0f);
  EXPECT_EQ(to_unit_float(0x000000ffu), 1.0f / 16777216.0f);  // the low 8 bits are dropped
  EXPECT_EQ(to_unit_float(0x80000000u), 0.5f + 1.0f / 16777216.0f);
}

TEST(Rng, StreamLayoutIsTheDocumentedOne) {
  const uint64_t seed = 0x0123456789abcdefull, step = 0x0000000500000007ull;
  for (uint32_t index = 0; index < 12; ++index) {
    const uint32_t ctr[4] = {index / 4, 3u << 8, 7u, 5u};
    const uint32_t key[2] = {0x89abcdefu, 0x01234567u};
    uint32_t out[4];
    philox4x32_10(ctr, key, out);
    EXPECT_EQ(stream_bits(seed, step, RngPurpose::kVerify, index), out[index % 4]) << index;
  }
  const VerifyDraws d = make_verify_draws(seed, step);
  for (int i = 0; i < kMaxDraft; ++i) {
    EXPECT_EQ(d.eta[i], stream_uniform(seed, step, RngPurpose::kVerify, uint32_t(i)));
  }
  EXPECT_EQ(d.u_extra, stream_uniform(seed, step, RngPurpose::kVerify, uint32_t(kMaxDraft)));
}

TEST(Rng, SeedStepAndPurposeSelectDistinctStreams) {
  std::set<uint32_t> seen;
  for (uint64_t seed : {0ull, 1ull, 1ull << 32})
    for (uint64_t step : {0ull, 1ull, 1ull << 32})
      for (RngPurpose p : {RngPurpose::kPlain, RngPurpose::kDraft, RngPurpose::kVerify})
        seen.insert(stream_bits(seed, step, p, 0));
  EXPECT_EQ(seen.size(), 27u);  // 32-bit collisions among 27 values: probability ~1e-7
}

// 2^16 uniforms from one stream in 64 equal bins; chi-square at alpha = 1e-4 (63 df).
TEST(Rng, StreamIsUniform) {
  std::vector<int64_t> count(64, 0);
  const int n = 1 << 16;
  for (int i = 0; i < n; ++i) {
    const float u = stream_uniform(42, 3, RngPurpose::kDraft, uint32_t(i));
    ASSERT_GT(u, 0.0f);
    ASSERT_LE(u, 1.0f);
    count[std::min(63, int(u * 64.0f))]++;  // u = 1 goes to the last bin
  }
  const auto fit = uf::sampling::testing::chi_square_fit(std::vector<double>(64, 1.0 / 64), count);
  EXPECT_FALSE(fit.rejects(1e-4)) << "chi2 " << fit.statistic << " p " << fit.p_value;
}

TEST(Stats, ChiSquareSurvivalMatchesTables) {
  using uf::sampling::testing::chi2_sf;
  EXPECT_NEAR(chi2_sf(3.841458820694124, 1), 0.05, 1e-9);
  EXPECT_NEAR(chi2_sf(21.66599433346194, 9), 0.01, 1e-9);
  EXPECT_NEAR(chi2_sf(2.0 * 2.302585092994046, 2), 0.1, 1e-12);  // df 2: exp(-x / 2)
  EXPECT_NEAR(chi2_sf(124.342, 100), 0.05, 1e-4);
}
