// The QAT quantizers against a direct fp64 restatement of the reference formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/dtypes.h"
#include "core/quant.h"

using namespace uf::core;

TEST(Quant, Pow2ScaleIsCeilLog2) {
  EXPECT_EQ(pow2_scale(448.f, kFp8MaxInv), 1.0f);
  EXPECT_EQ(pow2_scale(449.f, kFp8MaxInv), 2.0f);
  EXPECT_EQ(pow2_scale(6.f, kFp4MaxInv), 1.0f);
  EXPECT_EQ(pow2_scale(1e-4f, kFp8MaxInv), std::ldexp(1.0f, -22));  // 1e-4/448 = 2.23e-7 -> 2^-22
  std::mt19937 rng(1);
  std::uniform_real_distribution<double> u(-30, 30);
  for (int i = 0; i < 10000; ++i) {
    float amax = float(std::pow(2.0, u(rng)));
    float p = amax * kFp8MaxInv;
    double want = std::pow(2.0, std::ceil(std::log2(double(p))));
    ASSERT_EQ(double(pow2_scale(amax, kFp8MaxInv)), want) << amax;
  }
}

TEST(Quant, Fp8BlockFakeQuantMatchesFormula) {
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.f, 3.f);
  std::vector<float> x(32 * 8);
  for (auto& v : x) v = round_bf16(n(rng));
  std::vector<float> y = x;
  fake_quant_fp8(y.data(), y.size(), 32);
  for (size_t b = 0; b < x.size(); b += 32) {
    double amax = 1e-4;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, double(std::fabs(x[b + i])));
    double s = std::pow(2.0, std::ceil(std::log2(amax / 448.0)));
    for (int i = 0; i < 32; ++i) {
      double q = e4m3_to_float(float_to_e4m3(float(x[b + i] / s)));
      ASSERT_EQ(double(y[b + i]), q * s);
      ASSERT_LE(std::fabs(x[b + i] / s), 448.0);
    }
  }
}

TEST(Quant, Fp4ScalesAndGrid) {
  // Block of 16 with amax 6 -> e4m3 scale 1: values snap to the E2M1 grid.
  std::vector<float> x = {6, -6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 4.4, 0.1, -0.3, 1, 2, 3, -1};
  fake_quant_fp4_e4m3_scale(x.data(), x.size(), 16);
  std::vector<float> want = {6, -6, 0, 1, 1, 2, 2, 4, 4, 4, 0, -0.5, 1, 2, 3, -1};
  EXPECT_EQ(x, want);
  // An all-zero block keeps a nonzero scale and stays zero.
  std::vector<float> z(32, 0.f);
  fake_quant_fp4_e8m0_scale(z.data(), z.size(), 32);
  for (float v : z) EXPECT_EQ(v, 0.f);
  // UE8M0 block of 32: amax 12 -> scale 2, so 5 -> 2.5 -> ties down to 2 -> 4.
  std::vector<float> w(32, 0.f);
  w[0] = 12.f;
  w[1] = 5.f;
  fake_quant_fp4_e8m0_scale(w.data(), w.size(), 32);
  EXPECT_EQ(w[0], 12.f);
  EXPECT_EQ(w[1], 4.f);
}

// The header's promise that every dequantized value is exact in bf16 (e4m3: 4 significant bits
// times a power of two; E2M1 x e4m3 scale: at most 6; E2M1 x ue8m0: 2), over blocks whose
// magnitudes span 2^-60 .. 2^60 (the floors and clamps included). A KV store in bf16 rests on it.
TEST(Quant, DequantizedValuesAreBf16Exact) {
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.f, 1.f);
  std::uniform_int_distribution<int> ex(-60, 60);
  const size_t blocks = 4096;
  std::vector<float> x(blocks * 32);
  for (size_t b = 0; b < blocks; ++b) {
    const float s = std::ldexp(1.0f, ex(rng));
    for (int i = 0; i < 32; ++i) x[b * 32 + i] = (i % 11 == 5) ? 0.f : n(rng) * s;
  }
  auto check = [&](const char* what, auto&& quant) {
    std::vector<float> y = x;
    quant(y);
    for (size_t i = 0; i < y.size(); ++i) {
      ASSERT_TRUE(std::isfinite(y[i])) << what << " value " << i;
      ASSERT_EQ(round_bf16(y[i]), y[i]) << what << " value " << i << " from " << x[i];
    }
  };
  check("fp8 / 32", [](std::vector<float>& y) { fake_quant_fp8(y.data(), y.size(), 32); });
  check("fp4 e4m3 / 16",
        [](std::vector<float>& y) { fake_quant_fp4_e4m3_scale(y.data(), y.size(), 16); });
  check("fp4 ue8m0 / 32",
        [](std::vector<float>& y) { fake_quant_fp4_e8m0_scale(y.data(), y.size(), 32); });
}
