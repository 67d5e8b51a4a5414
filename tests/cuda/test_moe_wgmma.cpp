// MoeFp4's wgmma kernels (kernels/moe_wgmma.cu, the default on sm_90) against its mma.sync
// kernels, which are bitwise MoeFp4Prefill's and checked against the CPU reference
// (test_moe_decode_vs_prefill.cpp, test_moe_fp4.cpp):
//  - close: run / run_partial / run_experts at M = 1..8, at shapes covering every w13 cluster
//    size (K = 128: 1 rank, 256: 2, 1536 and 5120: 4) and K-chunk tails (12 and 40 K blocks a
//    rank), w2 over an odd number of K blocks (I = 288: 9), few experts so that rows share them
//    (up to 8 columns) and the model's 384; outputs NaN-poisoned first, so every written element
//    must be finite;
//  - deterministic: a second call gives the same bits (no split order depends on scheduling);
//  - spec == plain (row t of an 8-row call == the 1-row call) is test_moe_decode_vs_prefill.cpp's
//    row_independence, which runs both kernel sets.
// Tolerance: rms(wgmma - mma.sync) / rms(mma.sync) <= 1e-2 over a call, and every element within
// 25% of its row's rms. wgmma sums a block's 32 products at ~11-12 bits (test_wgmma_fp8.cpp), so
// g / u move by ~1e-4 of their magnitude; that flips some bf16 roundings of g / u / h and through
// them some FP8 codes of h (one e4m3 step of one of I terms of a w2 output). A wrong K order,
// block, scale or column moves outputs by O(1) of the row's rms.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/gemv.h"
#include "cuda/moe.h"
#include "cuda_test_util.h"
#include "moe_test_util.h"

namespace uf::cuda::test {
namespace {

void compare_kernels(int E, int dim, int inter, uint64_t seed, const std::vector<int>& ms) {
  std::mt19937 rng{uint32_t(seed)};
  const Experts x(E, dim, inter, seed);
  MoeFp4 wg(dim, inter, kTopk, device_sm_count());
  MoeFp4 ref(dim, inter, kTopk, device_sm_count());
  ref.set_wgmma(false);
  if (!wg.wgmma()) GTEST_SKIP() << "the wgmma kernels need an sm_90 device";
  for (int m : ms) {
    const Inputs in = random_inputs(m, dim, E, rng);
    for (Entry e : {Entry::kRun, Entry::kPartial, Entry::kExperts}) {
      const auto want = call(ref, e, x, in, m);
      const auto got = call(wg, e, x, in, m);
      ASSERT_EQ(want.size(), got.size());
      const size_t rows = got.size() / size_t(dim);  // run_experts: one row per (t, k)
      double se = 0, s2 = 0, worst = 0;
      size_t nonfinite = 0, exact = 0;
      for (size_t r = 0; r < rows; ++r) {
        double rs2 = 0;
        for (int n = 0; n < dim; ++n) rs2 += double(want[r * dim + n]) * want[r * dim + n];
        const double rrms = std::sqrt(rs2 / dim);
        for (int n = 0; n < dim; ++n) {
          const float a = got[r * dim + n], b = want[r * dim + n];
          if (!std::isfinite(a)) {
            ++nonfinite;
            continue;
          }
          const double d = double(a) - b;
          se += d * d;
          exact += bits_equal(a, b);
          if (rrms > 0) worst = std::max(worst, std::fabs(d) / rrms);
        }
        s2 += rs2;
      }
      const double rel = s2 > 0 ? std::sqrt(se / s2) : 0.0;
      std::printf(
          "[moe_wgmma] E=%d dim=%d inter=%d m=%d %s: rms rel %.3g, worst / row rms %.3g, "
          "bitwise %zu/%zu\n",
          E, dim, inter, m, entry_name(e), rel, worst, exact, got.size());
      EXPECT_EQ(nonfinite, 0u) << "dim " << dim << " m " << m << " " << entry_name(e)
                               << ": unwritten (NaN) or non-finite outputs";
      EXPECT_LE(rel, 1e-2) << "dim " << dim << " m " << m << " " << entry_name(e);
      EXPECT_LE(worst, 0.25) << "dim " << dim << " m " << m << " " << entry_name(e);
      EXPECT_TRUE(bitwise_equal(got, call(wg, e, x, in, m), dim))
          << "wgmma twice: dim " << dim << " m " << m << " " << entry_name(e);
    }
  }
}

TEST(CudaMoeWgmma, CloseToMmaSyncSmallDims) {
  UF_REQUIRE_GPU();
  compare_kernels(12, 128, 64, 201, {1, 3, 8});       // 4 K blocks: 1 rank
  compare_kernels(12, 256, 64, 202, {1, 5, 8});       // 8: 2 ranks of 4
  compare_kernels(40, 1536, 288, 203, {1, 4, 7, 8});  // 48: 4 ranks of 12 (8 + 4), w2 9 blocks
}

TEST(CudaMoeWgmma, CloseToMmaSyncRealDims) {
  UF_REQUIRE_GPU();
  compare_kernels(384, 5120, 288, 204, {1, 2, 3, 4, 5, 6, 7, 8});  // 160: 4 ranks of 40
}

}  // namespace
}  // namespace uf::cuda::test
