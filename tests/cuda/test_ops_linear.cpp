// DeviceLinear (cuda/ops/linear.h) against cpu/linear.h: every kind and weight format, rows
// 1, 3, 8, 20 (chunks of 8), outputs poisoned with NaN, spec == plain bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/quant.h"
#include "cpu/linear.h"
#include "cuda/ops/linear.h"
#include "cuda_test_util.h"
#include "ops_test_weights.h"

namespace uf::cuda::test {
namespace {

using model::WFormat;

struct LinCase {
  const char* name;
  WFormat format;
  int64_t rows, cols;
  LinearKind kind;
  bool row_scale;
  // true: quant_rows, which restates the CPU's fp32 operations in order (ops/linear.cu), so the
  // outputs must be bitwise equal. false: Fp8Gemv or DenseMma (tensor cores) or dense_rows (another
  // fp32 order): see the tolerance below.
  bool exact;
  bool any_x;  // fp32 inputs that are not bf16 values (linear_f32)
};

void cpu_linear(const model::Weight& w, LinearKind kind, const std::vector<float>& x, int T,
                std::vector<float>& y) {
  y.assign(size_t(T) * size_t(w.rows), 0.f);
  switch (kind) {
    case LinearKind::kAuto:
      cpu::linear(w, x.data(), T, y.data());
      break;
    case LinearKind::kQuant:
      cpu::linear_quant(w, x.data(), T, y.data());
      break;
    case LinearKind::kBf16Out:
    case LinearKind::kBf16OutBf16X:
    case LinearKind::kBf16OutBf16XPrefill:
      cpu::linear_bf16_out(w, x.data(), T, y.data());
      break;
    case LinearKind::kF32:
    case LinearKind::kF32Bf16X:
    case LinearKind::kF32Bf16XPrefill:
      cpu::linear_f32(w, x.data(), T, y.data());
      break;
  }
}

// sum_k |xq[t,k] * w[n,k]| in double, with x fake-quantised as linear_quant does when `quantised`
// (the size of the terms whose fp32 summation order differs between the device and the CPU).
std::vector<double> term_magnitudes(const model::Weight& w, const std::vector<float>& x, int T,
                                    bool quantised = true) {
  const int64_t K = w.cols, N = w.rows;
  std::vector<float> xq(x.size());
  std::vector<uint8_t> codes(32);
  for (int t = 0; t < T; ++t)
    for (int64_t kb = 0; kb < K / 32; ++kb) {
      const float s = core::quantize_fp8_block(&x[size_t(t * K + kb * 32)], 32, codes.data());
      for (int i = 0; i < 32; ++i)
        xq[size_t(t * K + kb * 32 + i)] = core::e4m3_to_float(codes[size_t(i)]) * s;
    }
  if (!quantised) xq = x;
  std::vector<double> mag(size_t(T) * size_t(N), 0.0);
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t n = 0; n < N; ++n) {
    w.row(n, row.data());
    for (int t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        mag[size_t(t * N + n)] += std::fabs(double(xq[size_t(t * K + k)]) * row[size_t(k)]);
  }
  return mag;
}

// The kind DeviceLinear resolves kAuto to, and what follows from it.
LinearKind resolved(const LinCase& c) {
  if (c.kind != LinearKind::kAuto) return c.kind;
  return c.format == WFormat::kFP8 || c.format == WFormat::kFP4 ? LinearKind::kQuant
                                                                : LinearKind::kBf16Out;
}
bool quantised(const LinCase& c) { return resolved(c) == LinearKind::kQuant; }
bool rounded(const LinCase& c) {
  return resolved(c) != LinearKind::kF32 && resolved(c) != LinearKind::kF32Bf16X;
}

class OpsLinear : public ::testing::TestWithParam<LinCase> {};

TEST_P(OpsLinear, MatchesCpuAndSpecEqualsPlain) {
  UF_REQUIRE_GPU();
  const ScopedPrefillGemm bitwise(PrefillGemm::kFp8Bitwise);  // T = 20 rows alone: bitwise
  const LinCase c = GetParam();
  std::mt19937 rng(1234);
  auto hw = make_weight(c.format, c.rows, c.cols, rng, 118, 122, c.row_scale, c.name);
  DeviceArena arena;
  DeviceLinear lin(hw->w, c.kind, arena);
  ASSERT_EQ(lin.rows(), c.rows);
  ASSERT_EQ(lin.cols(), c.cols);
  const int64_t N = c.rows, K = c.cols;
  size_t total_exact = 0, total_n = 0;
  for (int T : {1, 3, 8, 20}) {
    const std::vector<float> x = random_acts(T, K, rng, 1.f, !c.any_x);
    std::vector<float> want;
    cpu_linear(hw->w, c.kind, x, T, want);
    DeviceBuffer<float> dx(x), dy(size_t(T) * size_t(N));
    dy.poison();
    lin.apply(dx.get(), T, dy.get(), nullptr);
    sync_and_check();
    const std::vector<float> got = dy.download();
    std::vector<double> mag;
    if (!c.exact) mag = term_magnitudes(hw->w, x, T, quantised(c));
    // Fp8Gemv: a block's 32 exact products are summed by the tensor core and the K sum may be
    // split; dense_rows: the exact products summed in another order. fp32 order only: the fp32
    // results differ by <= 2^-16 of sum|terms| (the bound test_fp8_gemv.cpp uses), and a bf16
    // rounding may then flip by one ulp, rarely.
    const Compare cmp(got, want, [&](size_t i) {
      if (c.exact) return bits_equal(got[i], want[i]);
      const float ulp =
          rounded(c) ? bf16_ulp(std::max(std::fabs(got[i]), std::fabs(want[i]))) : 0.f;
      return std::fabs(got[i] - want[i]) <= ulp + float(0x1p-16 * mag[i]);
    });
    EXPECT_EQ(cmp.nan, 0u) << c.name << " T=" << T << " " << cmp.report(got, want);
    EXPECT_EQ(cmp.bad, 0u) << c.name << " T=" << T << " " << cmp.report(got, want);
    total_exact += cmp.exact;
    total_n += cmp.n;
    std::printf("[ops_linear] %s T=%d: %s\n", c.name, T, cmp.report(got, want).c_str());

    // spec == plain: each row alone gives the bits it got inside the T-row call.
    if (T == 20) {
      DeviceBuffer<float> one(static_cast<size_t>(N));
      for (int r = 0; r < T; ++r) {
        one.poison();
        lin.apply(dx.get() + int64_t(r) * K, 1, one.get(), nullptr);
        sync_and_check();
        const std::vector<float> o = one.download();
        for (int64_t n = 0; n < N; ++n)
          ASSERT_TRUE(bits_equal(o[size_t(n)], got[size_t(r * N + n)]))
              << c.name << " row " << r << " feature " << n << ": alone " << o[size_t(n)]
              << ", in a 20-row call " << got[size_t(r * N + n)];
      }
    }
  }
  // bf16 outputs: a flip needs the fp32 value within ~2^-16 of a rounding midpoint, so flips are
  // rare and independent: >= 99% bitwise over all the case's outputs (fp32 outputs differ in
  // their low bits, so no such count for them).
  if (!c.exact && rounded(c)) {
    EXPECT_GE(double(total_exact), 0.99 * double(total_n))
        << c.name << ": " << total_exact << " of " << total_n << " outputs bitwise equal";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, OpsLinear,
    ::testing::Values(
        LinCase{"fp8_gemv", WFormat::kFP8, 256, 512, LinearKind::kQuant, false, false, false},
        LinCase{"fp8_gemv_auto", WFormat::kFP8, 64, 256, LinearKind::kAuto, false, false, false},
        LinCase{"fp8_generic_rows", WFormat::kFP8, 200, 256, LinearKind::kQuant, false, true,
                false},
        LinCase{"fp8_row_scale", WFormat::kFP8, 100, 64, LinearKind::kQuant, true, true, false},
        LinCase{"fp4_quant", WFormat::kFP4, 128, 256, LinearKind::kAuto, false, true, false},
        LinCase{"bf16_out", WFormat::kBF16, 96, 256, LinearKind::kAuto, false, false, false},
        LinCase{"fp8_bf16_out", WFormat::kFP8, 64, 128, LinearKind::kBf16Out, false, false, false},
        LinCase{"f32_f32_tail", WFormat::kF32, 40, 100, LinearKind::kF32, false, false, true},
        LinCase{"bf16_f32_head", WFormat::kBF16, 1024, 256, LinearKind::kF32, false, false, true},
        // >= 4096 rows: four rows per block; K > 2048: several chunks per warp.
        LinCase{"bf16_f32_wide", WFormat::kBF16, 4096, 2560, LinearKind::kF32, false, false, true},
        LinCase{"fp4_f32", WFormat::kFP4, 48, 64, LinearKind::kF32, false, false, true},
        // Declared bf16-exact x: DenseMma (tensor cores; tests/cuda/test_dense_mma.cpp) for BF16
        // and FP8 weights with K % 64 == 0, dense_rows for the rest (FP4, K = 100).
        LinCase{"bf16_mma_f32", WFormat::kBF16, 1024, 256, LinearKind::kF32Bf16X, false, false,
                false},
        LinCase{"bf16_mma_split", WFormat::kBF16, 96, 2048, LinearKind::kF32Bf16X, false, false,
                false},
        LinCase{"fp8_mma_bf16_out", WFormat::kFP8, 64, 512, LinearKind::kBf16OutBf16X, false, false,
                false},
        LinCase{"fp8_mma_row_scale", WFormat::kFP8, 100, 256, LinearKind::kBf16OutBf16X, true,
                false, false},
        LinCase{"fp4_bf16x_fallback", WFormat::kFP4, 48, 64, LinearKind::kF32Bf16X, false, false,
                false}),
    [](const ::testing::TestParamInfo<LinCase>& i) { return std::string(i.param.name); });

// apply_rows (cpu::linear_bf16_out_rows): a row range with strided input and output, within the
// dense_rows tolerance above (fp32 order, then a rare bf16 flip); nothing outside the range
// written.
TEST(OpsLinearRows, MatchesCpuStrided) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(99);
  for (WFormat f : {WFormat::kBF16, WFormat::kFP8}) {
    auto hw = make_weight(f, 128, 64, rng);
    DeviceArena arena;
    DeviceLinear lin(hw->w, LinearKind::kAuto, arena);
    const int64_t r0 = 32, n = 48;
    const int xs = 80, ys = 70;
    for (int T : {1, 3, 20}) {
      const std::vector<float> x = random_acts(T, xs, rng);
      std::vector<float> want(size_t(T) * ys, 0.f);
      cpu::linear_bf16_out_rows(hw->w, r0, n, x.data(), xs, T, want.data(), ys);
      DeviceBuffer<float> dx(x), dy(size_t(T) * ys);
      dy.poison();
      lin.apply_rows(r0, n, dx.get(), xs, T, dy.get(), ys, nullptr);
      sync_and_check();
      const std::vector<float> got = dy.download();
      std::vector<float> row(64);
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < ys; ++j) {
          const float g = got[size_t(t * ys + j)];
          if (j < n) {
            hw->w.row(r0 + j, row.data());
            double mag = 0;
            for (int k = 0; k < 64; ++k) mag += std::fabs(double(x[size_t(t * xs + k)]) * row[k]);
            const float w = want[size_t(t * ys + j)];
            const float tol = bf16_ulp(std::max(std::fabs(g), std::fabs(w))) + float(0x1p-16 * mag);
            ASSERT_LE(std::fabs(g - w), tol) << "format " << int(f) << " T=" << T << " t=" << t
                                             << " j=" << j << ": got " << g << " want " << w;
          } else
            ASSERT_TRUE(std::isnan(g)) << "written outside the row range at t=" << t << " j=" << j;
        }
    }
  }
}

}  // namespace
}  // namespace uf::cuda::test
