// The Hopper wgmma E4M3 product (kernels/wgmma.cuh) against an exact sum, with its operand
// layouts: A from shared memory and from registers, B from shared memory (no swizzle, K-major).
// Also reports how often it equals the mma.sync path of the decode kernels bit for bit (printed,
// not asserted: the two sum a block's 32 products in different hardware).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "core/dtypes.h"
#include "cuda/kernels/wgmma_check.h"
#include "cuda_test_util.h"

namespace uf::cuda {
namespace {

struct Errors {
  double max_rel = 0;  // |d - exact| / sum |a b| over the 512 outputs
  int nonfinite = 0;
  int bitwise_sync = 0;  // outputs equal to the mma.sync path's bits
};

Errors compare(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b,
               const std::vector<float>& d, const std::vector<float>& sync) {
  Errors e;
  for (int r = 0; r < 64; ++r)
    for (int n = 0; n < 8; ++n) {
      double exact = 0, mag = 0;
      for (int k = 0; k < 32; ++k) {
        const double p = double(core::e4m3_to_float(a[size_t(r) * 32 + k])) *
                         double(core::e4m3_to_float(b[size_t(n) * 32 + k]));
        exact += p;
        mag += std::fabs(p);
      }
      const float v = d[size_t(r) * 8 + n];
      if (!std::isfinite(v)) {
        ++e.nonfinite;
        continue;
      }
      e.max_rel = std::max(e.max_rel, std::fabs(double(v) - exact) / std::max(mag, 1e-30));
      if (test::f32_bits(v) == test::f32_bits(sync[size_t(r) * 8 + n])) ++e.bitwise_sync;
    }
  return e;
}

TEST(WgmmaFp8, ProductsMatchAnExactSum) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(90);
  for (int rep = 0; rep < 4; ++rep) {
    const auto a = test::random_e4m3(64 * 32, rng);
    const auto b = test::random_e4m3(8 * 32, rng);
    std::vector<float> ss(512), sync(512), rs0(512), rs1(512);
    if (!wgmma_e4m3_check(a.data(), b.data(), 0, ss.data(), rs0.data(), sync.data()))
      GTEST_SKIP() << "wgmma needs an sm_90 device and an sm_90a build";
    ASSERT_TRUE(wgmma_e4m3_check(a.data(), b.data(), 1, ss.data(), rs1.data(), sync.data()));
    const Errors es = compare(a, b, ss, sync), e0 = compare(a, b, rs0, sync),
                 e1 = compare(a, b, rs1, sync), ey = compare(a, b, sync, sync);
    std::printf(
        "rep %d: max |d - exact| / sum|ab|: ss %.3g, rs(order 0) %.3g, rs(order 1) %.3g, mma.sync "
        "%.3g; bitwise equal to mma.sync: ss %d, rs0 %d of 512\n",
        rep, es.max_rel, e0.max_rel, e1.max_rel, ey.max_rel, es.bitwise_sync, e0.bitwise_sync);
    // The hardware keeps at least ~13 bits of a block's sum (DeepSeek-V3 reports ~14 on H800);
    // a layout error moves whole products and lands near 1.
    EXPECT_EQ(es.nonfinite + e0.nonfinite + ey.nonfinite, 0);
    EXPECT_LT(es.max_rel, 1.0 / 1024) << "wgmma with A in shared memory";
    EXPECT_LT(e0.max_rel, 1.0 / 1024) << "wgmma with A in registers (the mma.sync fragment order)";
    EXPECT_LT(ey.max_rel, 1.0 / 1024) << "the mma.sync path";
  }
}

}  // namespace
}  // namespace uf::cuda
