// Inverse-CDF sampling: exact pick rule on hand-made rows, agreement with the float64 reference
// pick, and a chi-square check (alpha = 1e-4) of draws taken from the Philox stream.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "sampling/reference.h"
#include "sampling/rng.h"
#include "sampling/row_ops.h"
#include "sampling/sampler.h"
#include "stats.h"

using namespace uf::sampling;

TEST(Sampler, InverseCdfPickRule) {
  const std::vector<float> w = {0.0f, 0.25f, 0.0f, 0.5f, 0.25f, 0.0f};
  EXPECT_EQ(sample_from_probs(w.data(), 6, 1.0f / 16777216.0f), 1);  // smallest u: first positive
  EXPECT_EQ(sample_from_probs(w.data(), 6, 0.25f), 1);               // running sum reaches 0.25
  EXPECT_EQ(sample_from_probs(w.data(), 6, 0.2500001f), 3);
  EXPECT_EQ(sample_from_probs(w.data(), 6, 0.75f), 3);
  EXPECT_EQ(sample_from_probs(w.data(), 6, 0.76f), 4);
  EXPECT_EQ(sample_from_probs(w.data(), 6, 1.0f), 4);  // largest u: last positive, never index 5
  const std::vector<float> zero(5, 0.0f);
  EXPECT_EQ(sample_from_probs(zero.data(), 5, 0.5f), -1);
  // Unnormalised weights behave like their normalisation.
  const std::vector<float> w3 = {0.0f, 1.0f, 0.0f, 2.0f, 1.0f, 0.0f};
  EXPECT_EQ(sample_from_probs(w3.data(), 6, 0.5f), 3);
}

// Large rows cross many chunks: the float pick must be where the float64 CDF puts u, except
// within float rounding of a bucket edge (tolerance 1e-5 of the total mass).
TEST(Sampler, MatchesReferencePickOnLargeRows) {
  std::mt19937_64 rng(3);
  std::exponential_distribution<float> expo(1.0f);
  for (int64_t v : {1000, 129280}) {
    std::vector<float> w(v);
    std::vector<double> wd(v);
    for (int64_t x = 0; x < v; ++x) {
      w[x] = (x % 7 == 3) ? 0.0f : expo(rng);
      wd[x] = w[x];
    }
    double total = 0;
    for (double x : wd) total += x;
    int mismatches = 0;
    for (int i = 0; i < 2000; ++i) {
      const float u = stream_uniform(5, 0, RngPurpose::kPlain, uint32_t(i));
      const int32_t got = sample_from_probs(w.data(), v, u);
      ASSERT_GE(got, 0);
      ASSERT_GT(w[got], 0.0f);
      const int32_t want = reference_sample(wd.data(), v, u);
      if (got != want) {
        ++mismatches;
        double before = 0;
        for (int64_t x = 0; x < got; ++x) before += wd[x];
        EXPECT_LE(before, u * total + 1e-5 * total);
        EXPECT_GE(before + wd[got], u * total - 1e-5 * total);
      }
    }
    // With 129,280 entries each holds ~1e-5 of the mass, the size of float rounding of the CDF,
    // so neighbours are picked now and then; the bracket check above bounds how far.
    if (v == 1000) {
      EXPECT_LE(mismatches, 20);
    }
  }
}

TEST(Sampler, DrawsFollowTheDistribution) {
  const std::vector<float> p = {0.05f, 0.0f, 0.3f, 0.15f, 0.0f, 0.4f, 0.1f};
  std::vector<int64_t> count(p.size(), 0);
  for (uint32_t i = 0; i < 20000; ++i) {
    count[sample_from_probs(p.data(), 7, stream_uniform(9, i, RngPurpose::kPlain, 0))]++;
  }
  const auto fit =
      uf::sampling::testing::chi_square_fit(std::vector<double>(p.begin(), p.end()), count);
  EXPECT_FALSE(fit.rejects(1e-4)) << "chi2 " << fit.statistic << " p " << fit.p_value
                                  << " impossible " << fit.impossible;
  // Power: the same counts against a shifted distribution are rejected.
  const std::vector<double> wrong = {0.1, 0.0, 0.25, 0.15, 0.0, 0.4, 0.1};
  EXPECT_TRUE(uf::sampling::testing::chi_square_fit(wrong, count).rejects(1e-4));
}

TEST(Sampler, FixedOrderSumIsChunkedThenTree) {
  // 300 entries: chunk = 2, lanes 0..149 hold pairs; check against a hand evaluation of the order.
  std::vector<float> x(300);
  for (int i = 0; i < 300; ++i) x[i] = 1.0f / float(1 + i);
  float lanes[kLanes] = {};
  for (int l = 0; l < 150; ++l) lanes[l] = x[2 * l] + x[2 * l + 1];
  for (int s = kLanes / 2; s > 0; s /= 2)
    for (int i = 0; i < s; ++i) lanes[i] += lanes[i + s];
  EXPECT_EQ(fixed_order_sum([&](int64_t i) { return x[i]; }, 300), lanes[0]);
}
