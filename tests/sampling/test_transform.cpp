// The logits -> probabilities transform (temperature, top-k, top-p, greedy): hand-computed cases
// for the tie and boundary rules, and float32 against the float64 reference on random rows.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "sampling/reference.h"
#include "sampling/sampler.h"
#include "sampling/transform.h"

using namespace uf::sampling;

namespace {

std::vector<float> transform(const std::vector<float>& logits, SamplingParams params) {
  std::vector<float> probs(logits.size()), scratch(logits.size());
  logits_to_probs(logits.data(), int64_t(logits.size()), params, probs.data(), scratch.data());
  return probs;
}

std::vector<float> log_of(const std::vector<double>& p) {
  std::vector<float> l;
  for (double v : p) l.push_back(v > 0 ? float(std::log(v)) : -INFINITY);
  return l;
}

}  // namespace

TEST(Transform, ValidateRejectsOutOfRangeFieldsByName) {
  validate({0.0f, 1.0f, 0});
  validate({2.0f, 0.01f, 5});
  auto message = [](SamplingParams p) {
    try {
      validate(p);
    } catch (const uf::core::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({2.5f, 1.0f, 0}).find("temperature"), std::string::npos);
  EXPECT_NE(message({-0.1f, 1.0f, 0}).find("temperature"), std::string::npos);
  EXPECT_NE(message({NAN, 1.0f, 0}).find("temperature"), std::string::npos);
  EXPECT_NE(message({1.0f, 0.0f, 0}).find("top_p"), std::string::npos);
  EXPECT_NE(message({1.0f, 1.5f, 0}).find("top_p"), std::string::npos);
  EXPECT_NE(message({1.0f, 1.0f, -1}).find("top_k"), std::string::npos);
}

TEST(Transform, TemperatureScalesLogits) {
  const std::vector<double> p = {0.1, 0.2, 0.3, 0.4};
  const auto t1 = transform(log_of(p), {1.0f, 1.0f, 0});
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(t1[i], p[i], 1e-7);
  // T = 2: p^(1/2) renormalised; T = 0.5: p^2 renormalised.
  const auto t2 = transform(log_of(p), {2.0f, 1.0f, 0});
  const auto th = transform(log_of(p), {0.5f, 1.0f, 0});
  double s2 = 0, sh = 0;
  for (double v : p) s2 += std::sqrt(v), sh += v * v;
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(t2[i], std::sqrt(p[i]) / s2, 1e-7);
    EXPECT_NEAR(th[i], p[i] * p[i] / sh, 1e-7);
  }
}

TEST(Transform, GreedyIsOneHotOnLowestArgmax) {
  const auto g = transform({0.5f, 2.0f, -1.0f, 2.0f}, {0.0f, 0.3f, 1});
  EXPECT_EQ(g, (std::vector<float>{0, 1, 0, 0}));
  std::vector<float> probs(4), scratch(4);
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(
      sample_from_logits(logits.data(), 4, {0.0f, 1.0f, 0}, 0.999f, probs.data(), scratch.data()),
      1);
}

TEST(Transform, TopKKeepsTiesAtTheBoundary) {
  // Values 0.4, 0.2, 0.2, 0.2: top_k = 2 keeps all three tied 0.2s (fewer than 2 are larger).
  const auto t = transform(log_of({0.4, 0.2, 0.2, 0.2}), {1.0f, 1.0f, 2});
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(t[i], i == 0 ? 0.4 : 0.2, 1e-7);
  const auto k1 = transform(log_of({0.1, 0.5, 0.3, 0.1}), {1.0f, 1.0f, 1});
  EXPECT_EQ(k1, (std::vector<float>{0, 1, 0, 0}));
  const auto k2 = transform(log_of({0.1, 0.5, 0.3, 0.1}), {1.0f, 1.0f, 2});
  EXPECT_NEAR(k2[1], 0.625, 1e-7);
  EXPECT_NEAR(k2[2], 0.375, 1e-7);
  EXPECT_EQ(k2[0] + k2[3], 0.0f);
}

TEST(Transform, TopPKeepsTokensWhoseLargerMassIsBelowTopP) {
  const std::vector<double> p = {0.15, 0.5, 0.3, 0.05};
  // Larger masses: token 1: 0, token 2: 0.5, token 0: 0.8, token 3: 0.95.
  auto kept = [&](float top_p, int top_k = 0) {
    const auto t = transform(log_of(p), {1.0f, top_p, top_k});
    std::vector<int> k;
    for (int i = 0; i < 4; ++i)
      if (t[i] > 0) k.push_back(i);
    return k;
  };
  EXPECT_EQ(kept(0.3f), (std::vector<int>{1}));
  EXPECT_EQ(kept(0.51f), (std::vector<int>{1, 2}));
  EXPECT_EQ(kept(0.81f), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(kept(0.96f), (std::vector<int>{0, 1, 2, 3}));
  // top_k = 3 first (mass 0.95), then top_p relative to it: 0.5 / 0.95 = 0.526 < 0.6 keeps 2.
  EXPECT_EQ(kept(0.6f, 3), (std::vector<int>{1, 2}));
  EXPECT_EQ(kept(0.52f, 3), (std::vector<int>{1}));
  // Ties at the top-p boundary are all kept.
  const auto t = transform(log_of({0.4, 0.3, 0.3}), {1.0f, 0.5f, 0});
  EXPECT_NEAR(t[0], 0.4, 1e-7);
  EXPECT_NEAR(t[1], 0.3, 1e-7);
  EXPECT_NEAR(t[2], 0.3, 1e-7);
}

// Float32 against the float64 reference on random rows. Tolerance 2e-6 absolute: softmax in float
// has relative error of a few ulp (2^-24 ~ 6e-8) per entry plus the normaliser's rounding; random
// logits keep cut decisions far from float rounding.
TEST(Transform, MatchesFloat64Reference) {
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal(0.0, 2.0);
  const SamplingParams settings[] = {{1.0f, 1.0f, 0},   {0.7f, 1.0f, 0}, {1.3f, 0.9f, 0},
                                     {1.0f, 1.0f, 5},   {0.5f, 0.8f, 7}, {2.0f, 0.3f, 0},
                                     {1.0f, 0.95f, 40}, {0.0f, 1.0f, 0}};
  for (int rep = 0; rep < 20; ++rep) {
    const int64_t v = 50 + rep * 7;
    std::vector<double> ld(v);
    std::vector<float> lf(v);
    for (int64_t x = 0; x < v; ++x) lf[x] = float(normal(rng)), ld[x] = lf[x];
    for (const SamplingParams& s : settings) {
      const auto got = transform(lf, s);
      const auto want = reference_transform(ld.data(), v, s);
      for (int64_t x = 0; x < v; ++x) {
        ASSERT_NEAR(got[x], want[x], 2e-6) << "rep " << rep << " x " << x << " T " << s.temperature
                                           << " top_p " << s.top_p << " top_k " << s.top_k;
        ASSERT_EQ(got[x] > 0, want[x] > 0) << "kept sets differ at x " << x;
      }
    }
  }
}

// A full-size row (V = 129,280): the float sums over the whole vocabulary still normalise to 1.
TEST(Transform, FullVocabularyRowNormalises) {
  const int64_t v = 129280;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(v);
  for (float& l : logits) l = normal(rng);
  for (SamplingParams s : {SamplingParams{1.0f, 1.0f, 0}, SamplingParams{0.8f, 0.9f, 0},
                           SamplingParams{1.0f, 1.0f, 50}}) {
    const auto p = transform(logits, s);
    double sum = 0;
    int64_t kept = 0;
    for (float x : p) sum += x, kept += x > 0;
    EXPECT_NEAR(sum, 1.0, 1e-5);
    if (s.top_k == 50) {
      EXPECT_EQ(kept, 50);
    }
    if (s.top_p < 1) {
      EXPECT_LT(kept, v);
    }
  }
}

// Rows wider than the first sorted prefix of the top-p walk (1,024 values): the cut needs the
// prefix to grow (to 4,096, then the whole row) and must still match the float64 definition.
TEST(Transform, TopPBeyondTheFirstSortedPrefix) {
  const int64_t v = 5000;
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal(0.0, 0.5);
  std::vector<double> ld(v);
  std::vector<float> lf(v);
  for (int64_t x = 0; x < v; ++x) lf[x] = float(normal(rng)), ld[x] = lf[x];
  for (float top_p : {0.1f, 0.5f, 0.9f, 0.999f}) {
    const auto got = transform(lf, {1.0f, top_p, 0});
    const auto want = reference_transform(ld.data(), v, {1.0f, top_p, 0});
    int64_t kept = 0, mismatched = 0;
    for (int64_t x = 0; x < v; ++x) {
      kept += got[x] > 0;
      mismatched += (got[x] > 0) != (want[x] > 0);
      EXPECT_NEAR(got[x], want[x], 1e-6);
    }
    // Float sums over thousands of values may move the cut by one value at most.
    EXPECT_LE(mismatched, 1) << "top_p " << top_p;
    if (top_p > 0.5f) {
      EXPECT_GT(kept, 1024) << "the case must exercise prefix growth";
    }
  }
}
