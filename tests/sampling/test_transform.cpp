// The logits -> probabilities transform (temperature, top-k, top-p, greedy): hand-computed cases
// for the tie and boundary rules, and float32 against the float64 reference on random rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "sampling/reference.h"
#include "sampling/sampler.h"
#include "sampling/top_p_mass.h"
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

// top_p_limit(top_p, z) = ceil(top_p * z) exactly: checked by 128-bit integer arithmetic on the
// decomposition top_p = m 2^-e (from frexp, independent of the function's bit handling), over
// normal, tiny and subnormal top_p and z up to 2^63 - 1.
TEST(TopPMass, LimitIsTheExactCeiling) {
  std::mt19937_64 rng(31);
  std::vector<float> tops = {
      1.0f, 0.5f, 0.95f, 0.999f, 1e-3f, 1e-20f, 1e-38f, 1e-45f, std::nextafter(1.0f, 0.0f)};
  for (int i = 0; i < 300; ++i)
    tops.push_back(std::ldexp(float((rng() >> 40) | 1u), -24 - int(rng() % 100)));
  std::vector<uint64_t> zs = {1, 2, 3, (uint64_t(1) << 42), (uint64_t(1) << 63) - 1};
  for (int i = 0; i < 300; ++i) zs.push_back(rng() >> (1 + rng() % 62));
  for (float t : tops) {
    if (!(t > 0.0f && t <= 1.0f)) continue;
    int ex = 0;
    const double mant = std::frexp(double(t), &ex);  // t = mant 2^ex, mant in [0.5, 1)
    const auto m = static_cast<unsigned __int128>(std::ldexp(mant, 53));  // t = m 2^(ex - 53)
    const int e = 53 - ex;                                                // t = m 2^-e, e > 0
    for (uint64_t z : zs) {
      const uint64_t got = top_p_limit(t, z);
      const unsigned __int128 prod = m * z;  // < 2^116
      // got = ceil(prod / 2^e): (got - 1) 2^e < prod <= got 2^e, tested where the shifts fit.
      if (e < 64) {
        const unsigned __int128 hi = static_cast<unsigned __int128>(got) << e;
        ASSERT_GE(hi, prod) << t << " " << z;
        if (got > 0)
          ASSERT_LT(hi - (static_cast<unsigned __int128>(1) << e), prod) << t << " " << z;
        if (got == 0) ASSERT_EQ(z, 0u);
      } else {
        const unsigned __int128 q = e >= 128 ? 0 : prod >> e;
        const bool rem =
            e >= 128 ? prod != 0 : (prod & ((static_cast<unsigned __int128>(1) << e) - 1)) != 0;
        ASSERT_EQ(got, uint64_t(q) + (rem ? 1 : 0)) << t << " " << z;
      }
    }
  }
  EXPECT_EQ(top_p_limit(0.5f, 0), 0u);
  EXPECT_EQ(top_p_limit(1.0f, 12345), 12345u);
  EXPECT_EQ(top_p_mass(1.0f), uint64_t(1) << kTopPMassBits);
  EXPECT_EQ(top_p_mass(0.0f), 0u);
  EXPECT_EQ(top_p_mass(std::nanf("")), 0u);
}

// The top-p filter against its definition read literally, with exact integers: keep x iff the
// top-k survivors strictly more probable than x have mass < top_p * Z_k, i.e. mass * 2^e < m Z_k
// (top_p = m 2^-e), by an O(n^2) scan. Rows with heavy ties (few distinct values), flat rows and
// rows whose smallest values have no measurable mass.
TEST(TopPMass, TransformKeepsExactlyTheDefinedSet) {
  std::mt19937_64 rng(77);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int rep = 0; rep < 60; ++rep) {
    const int64_t v = 1 + int64_t(rng() % 400);
    std::vector<float> l(static_cast<size_t>(v));
    const int kind = rep % 4;
    for (float& x : l) {
      if (kind == 0) x = 3.0f * normal(rng);                                 // peaked
      if (kind == 1) x = 0.01f * normal(rng);                                // flat
      if (kind == 2) x = -0.25f * float(rng() % 5);                          // ties: five levels
      if (kind == 3) x = rng() % 8 == 0 ? 0.0f : -40.0f * float(rng() % 3);  // masses below 2^-42
    }
    for (const SamplingParams s : {SamplingParams{1.0f, 0.9f, 0}, SamplingParams{0.7f, 0.5f, 0},
                                   SamplingParams{1.0f, 0.3f, 7}, SamplingParams{1.5f, 0.999f, 0},
                                   SamplingParams{1.0f, 1e-6f, 0}}) {
      const auto got = transform(l, s);
      // The transform's own p (same exp), then the definition.
      std::vector<float> p(static_cast<size_t>(v));
      float mx = l[0];
      for (float x : l) mx = std::max(mx, x);
      for (int64_t x = 0; x < v; ++x)
        p[size_t(x)] = float(std::exp(double((l[size_t(x)] - mx) / s.temperature)));
      std::vector<bool> survives(static_cast<size_t>(v), true);
      if (s.top_k > 0 && s.top_k < v) {
        for (int64_t x = 0; x < v; ++x) {
          int64_t larger = 0;
          for (int64_t y = 0; y < v; ++y) larger += p[size_t(y)] > p[size_t(x)];
          survives[size_t(x)] = larger < s.top_k;
        }
      }
      unsigned __int128 zk = 0;
      for (int64_t x = 0; x < v; ++x) zk += survives[size_t(x)] ? top_p_mass(p[size_t(x)]) : 0;
      int ex = 0;
      const double mant = std::frexp(double(s.top_p), &ex);
      const auto m = static_cast<unsigned __int128>(std::ldexp(mant, 53));
      const int e = 53 - ex;  // <= 73 for these top_p: larger << e stays below 2^128
      for (int64_t x = 0; x < v; ++x) {
        unsigned __int128 larger = 0;
        for (int64_t y = 0; y < v; ++y)
          if (survives[size_t(y)] && p[size_t(y)] > p[size_t(x)])
            larger += top_p_mass(p[size_t(y)]);
        const bool keep = survives[size_t(x)] && (larger << e) < m * zk;
        ASSERT_EQ(got[size_t(x)] > 0.0f, keep && p[size_t(x)] > 0.0f)
            << "rep " << rep << " kind " << kind << " x " << x << " top_p " << s.top_p << " top_k "
            << s.top_k;
      }
    }
  }
}

// A vocabulary past the masses' 64-bit bound is refused with a clear error when top-p is on
// (and accepted without it).
TEST(TopPMass, VocabularyPastTheBoundIsRefused) {
  const int64_t v = kTopPMaxVocab + 1;
  const size_t n = static_cast<size_t>(v);
  std::vector<float> l(n, 0.0f), probs(n), scratch(n);
  EXPECT_THROW(logits_to_probs(l.data(), v, {1.0f, 0.9f, 0}, probs.data(), scratch.data()),
               uf::core::Error);
  logits_to_probs(l.data(), v, {1.0f, 1.0f, 0}, probs.data(), scratch.data());
  EXPECT_FLOAT_EQ(probs[0], 1.0f / float(v));
}
