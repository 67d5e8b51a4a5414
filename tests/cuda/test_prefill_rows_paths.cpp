// The prefill path of DenseMma (kernels/dense_mma.cu: dense_mma_prefill_kernel for m > 8,
// set_dense_mma_prefill) against (a) the old prefill path (the switch off) and (b) the same rows
// run 8 at a time (the decode configuration: a T <= 8 call per 8-row chunk), at the real shapes
// (wo_a [1024, 4096] FP8 and a BF16 weight of that shape; a ragged FP8 row range with row scales
// and strided x / y) for T = 9, 64, 100, 512, 2048.
// Claim: BITWISE equal, every output element (the new path computes each value with the same
// operations in the same order; only the grouping of rows into blocks and the reuse of loaded
// weights change). Outputs are NaN-poisoned (0xFF bytes) before each run: the written elements
// must be non-NaN and the unwritten ones (y columns >= n) must keep the poison. Failures print the
// count of mismatches and the first one as hex.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda/device_memory.h"
#include "cuda/device_weights.h"
#include "cuda/gemv.h"
#include "cuda/kernels/dense_mma.h"
#include "cuda_test_util.h"
#include "ops_test_weights.h"

namespace uf::cuda::test {
namespace {

using model::WFormat;

const int kTs[] = {9, 64, 100, 512, 2048};

// a == b bitwise everywhere; `valid(i)`: element i is written (must not be NaN), else it must
// hold the poison. Prints the mismatch count and the first mismatch in hex.
template <class Valid>
void expect_bitwise(const char* what, int T, const std::vector<float>& a,
                    const std::vector<float>& b, Valid valid) {
  ASSERT_EQ(a.size(), b.size()) << what << " T=" << T;
  size_t bad = 0, nan = 0, unpoisoned = 0, first = a.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (f32_bits(a[i]) != f32_bits(b[i])) {
      if (first == a.size()) first = i;
      ++bad;
    }
    if (valid(i)) {
      if (std::isnan(a[i])) ++nan;
    } else if (f32_bits(a[i]) != 0xFFFFFFFFu) {
      ++unpoisoned;
    }
  }
  if (bad) {
    std::printf("[prefill_rows] %s T=%d: %zu of %zu differ; first at %zu: %08x vs %08x\n", what, T,
                bad, a.size(), first, f32_bits(a[first]), f32_bits(b[first]));
  }
  EXPECT_EQ(bad, 0u) << what << " T=" << T << " first mismatch index " << first;
  EXPECT_EQ(nan, 0u) << what << " T=" << T << ": NaN in written outputs";
  EXPECT_EQ(unpoisoned, 0u) << what << " T=" << T << ": elements outside the output written";
}

struct DenseCase {
  const char* name;
  WFormat format;
  int64_t rows, cols, r0, n;
  int x_pad, y_pad;
  bool round, row_scale;
};

TEST(CudaPrefillRows, DenseMmaPrefillBitwise) {
  UF_REQUIRE_GPU();
  const DenseCase cases[] = {
      {"wo_a FP8 [1024, 4096]", WFormat::kFP8, 1024, 4096, 0, 1024, 0, 0, true, false},
      {"BF16 [1024, 4096] strided", WFormat::kBF16, 1024, 4096, 0, 1024, 4, 3, true, false},
      {"FP8 row-scale rows [16, 1016) fp32 out", WFormat::kFP8, 1024, 4096, 16, 1000, 1, 5, false,
       true},
  };
  const int sms = device_sm_count();
  for (const DenseCase& c : cases) {
    std::mt19937 rng(9203);
    auto hw = make_weight(c.format, c.rows, c.cols, rng, 116, 122, c.row_scale, c.name);
    DeviceArena arena;
    const DeviceWeight dw = upload_weight(hw->w, arena);
    ASSERT_TRUE(DenseMma::supports(dw)) << c.name;
    const DenseMma mma(dw, sms);
    const int64_t K = c.cols, n = c.n;
    const int xs = int(K) + c.x_pad, ys = int(n) + c.y_pad;
    std::printf("[prefill_rows] %s: S=%d\n", c.name, mma.splits(n));
    for (const int T : kTs) {
      const DeviceBuffer<float> x(normal_bf16(size_t(T) * xs, rng, 1.f));
      auto run = [&](int how) {  // 0: new, 1: old prefill path, 2: 8 rows at a time
        DeviceBuffer<float> y(size_t(T) * ys);
        y.poison();
        set_dense_mma_prefill(how != 1);
        for (int t0 = 0; t0 < T; t0 += (how == 2 ? 8 : T))
          mma.run(dw, c.r0, n, x.get() + int64_t(t0) * xs, xs, how == 2 ? std::min(8, T - t0) : T,
                  y.get() + int64_t(t0) * ys, ys, c.round, nullptr);
        sync_and_check();
        set_dense_mma_prefill(true);
        return y.download();
      };
      const std::vector<float> a = run(0), b = run(1), d = run(2);
      const auto written = [&](size_t i) { return int64_t(i % size_t(ys)) < n; };
      const std::string w(c.name);
      expect_bitwise((w + " new vs old").c_str(), T, a, b, written);
      expect_bitwise((w + " new vs 8-row calls").c_str(), T, a, d, written);
    }
  }
}

}  // namespace
}  // namespace uf::cuda::test
