// Every code of e4m3, e8m0 and e2m1, checked against tables derived from the OCP MX spec
// (v1.0 §5.3): values are computed here from sign/exponent/mantissa fields independently of the
// implementation, and every rounding tie is checked against round-to-nearest-even.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/dtypes.h"

using namespace uf::core;

namespace {
// OCP E4M3: bias 7; exponent field 0 = subnormal (m * 2^-9); S.1111.111 = NaN; no infinity.
double ocp_e4m3(int code) {
  int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  double v = e == 0 ? m * std::pow(2.0, -9) : (8 + m) * std::pow(2.0, e - 7 - 3);
  return s ? -v : v;
}
}  // namespace

TEST(Dtypes, E4M3DecodesEveryCode) {
  for (int c = 0; c < 256; ++c) {
    double want = ocp_e4m3(c);
    float got = e4m3_to_float(uint8_t(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
    } else {
      EXPECT_EQ(double(got), want) << "code " << c;
      EXPECT_EQ(std::signbit(got), bool(c & 0x80)) << c;
    }
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
}

TEST(Dtypes, E4M3EncodeRoundTripsEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(uint8_t(c))), c) << "code " << c;
  }
}

TEST(Dtypes, E4M3RoundsTiesToEvenAndSaturates) {
  // Between two consecutive positive codes c and c+1 the midpoint goes to the even mantissa,
  // a hair above goes up and a hair below goes down.
  for (int c = 0; c < 0x7e; ++c) {
    double lo = ocp_e4m3(c), hi = ocp_e4m3(c + 1);
    float mid = float((lo + hi) / 2);
    ASSERT_EQ(double(mid), (lo + hi) / 2);  // exactly representable in fp32
    int want = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(float_to_e4m3(mid), want) << "midpoint above code " << c;
    EXPECT_EQ(float_to_e4m3(-mid), want | 0x80) << "negative midpoint above code " << c;
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, 1000.f)), c + 1);
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, -1000.f)), c);
  }
  EXPECT_EQ(float_to_e4m3(448.f), 0x7e);
  EXPECT_EQ(float_to_e4m3(464.f), 0x7e);  // would round to 480, which does not exist
  EXPECT_EQ(float_to_e4m3(1e30f), 0x7e);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(float_to_e4m3(std::nanf("")) & 0x7f, 0x7f);
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: tie to 0
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.5f, -10)), 0x01);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
}

TEST(Dtypes, E8M0EveryCode) {
  for (int c = 0; c < 255; ++c) {
    double want = std::pow(2.0, c - 127);
    EXPECT_EQ(double(e8m0_to_float(uint8_t(c))), want) << c;
    EXPECT_EQ(float_to_e8m0(float(want)), c) << c;
  }
  EXPECT_TRUE(std::isnan(e8m0_to_float(255)));
  EXPECT_EQ(float_to_e8m0(3.0f), 129);  // not a power of two: rounds up to 4
  EXPECT_EQ(float_to_e8m0(0.0f), 255);
  EXPECT_EQ(float_to_e8m0(-1.0f), 255);
}

TEST(Dtypes, E2M1EveryCodeAndTies) {
  const double mags[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    double want = (c & 8) ? -mags[c & 7] : mags[c & 7];
    EXPECT_EQ(double(e2m1_to_float(uint8_t(c))), want) << c;
    if (c != 8) {
      EXPECT_EQ(float_to_e2m1(float(want)), c) << c;
    }
  }
  EXPECT_EQ(e2m1_to_float(8), 0.0f);
  EXPECT_FALSE(std::signbit(e2m1_to_float(8)));  // code 8 decodes to +0
  // model-arch.md §3: ties at .25/1.25/2.5/5 round down, at .75/1.75/3.5 round up.
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(0.25f)), 0.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(0.75f)), 1.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(1.25f)), 1.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(1.75f)), 2.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(2.5f)), 2.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(3.5f)), 4.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(5.0f)), 4.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(-5.0f)), -4.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(5.01f)), 6.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(100.f)), 6.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(0.2f)), 0.0f);
  // Packing: the low nibble holds the even element.
  uint8_t b = pack_e2m1(0x3, 0xA);
  EXPECT_EQ(b, 0xA3);
  EXPECT_EQ(e2m1_even(b), 0x3);
  EXPECT_EQ(e2m1_odd(b), 0xA);
}

TEST(Dtypes, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3*2^-8 is between 1+2^-7 (odd) and 1+2^-6 (even): goes up.
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(-2.5f)), -2.5f);
  // Every bf16 value round-trips.
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = bf16_to_float(uint16_t(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_bf16(f), h);
  }
}

TEST(Dtypes, NamesAndSizes) {
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(*dtype_from_name("F8_E8M0"), DType::kF8E8M0);
  EXPECT_EQ(dtype_name(DType::kI8), "I8");
  EXPECT_FALSE(dtype_from_name("F4").has_value());
}
