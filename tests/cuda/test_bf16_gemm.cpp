// The prefill GEMM on bf16 operands (cuda/prefill_gemm.h, kernels/bf16_gemm.cu) and
// DeviceLinear's kBf16 prefill path, against
//   - an fp64 reference of the same products: the GEMM sums exact bf16 x bf16 products in fp32
//     (the tensor core's sum of 16 products into the accumulator per k16 step, then the splits
//     in order), so |got - exact| <= (k / 16 + splits) * 2^-22 * sum|a w| (two fp32 ulps of the
//     largest partial per accumulation step; the partials never exceed sum|a w|);
//   - itself: rows of a 512-row call bitwise those of a 9-row call (row independence: nothing
//     depends on m), round = bf16 of the unrounded output bit for bit, outputs poisoned with NaN
//     beforehand and a guard row after them untouched;
//   - act_qdq_fp8_bf16_rows: bitwise core::quantize_fp8_block's codes times scales;
//   - fp8_weight_to_bf16: bitwise model::Weight::at;
//   - DeviceLinear (kBf16 built, T > 8) against cpu::linear_quant within test_ops_linear.cpp's
//     bound (2^-16 * sum|terms| + one bf16 ulp), apply_group == own apply, every row of a
//     prefill call on the GEMM (the last 8 of a 520-row call equal a 16-row call's, bitwise).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "core/dtypes.h"
#include "core/quant.h"
#include "cpu/linear.h"
#include "cuda/ops/linear.h"
#include "cuda/prefill_gemm.h"
#include "cuda_test_util.h"
#include "ops_test_weights.h"

namespace uf::cuda::test {
namespace {

using model::WFormat;

std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = core::float_to_bf16(nd(rng));
  return v;
}

struct GemmShape {
  int m, n, k;
};

TEST(Bf16Gemm, MatchesFp64AndIsRowIndependent) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(777);
  // The model's prefill shapes at a TP8 rank (wq_a, wkv, the shared expert's w1 / w2, wq_b, wo_b)
  // and odd ones: m not a multiple of 64, n not of 128, k not of 64; splits 1..8.
  const GemmShape shapes[] = {{512, 1280, 5120}, {512, 512, 5120},  {512, 288, 5120},
                              {512, 5120, 288},  {100, 4096, 1280}, {9, 1024, 1024},
                              {130, 144, 96},    {1, 16, 32},       {70, 112, 4096}};
  for (const GemmShape& s : shapes) {
    SCOPED_TRACE("m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) +
                 " k=" + std::to_string(s.k));
    const int splits = bf16_gemm_splits(s.n, s.k);
    ASSERT_GE(splits, 1);
    ASSERT_LE(splits, 8);
    const auto a = random_bf16(size_t(s.m) * s.k, rng, 1.f);
    const auto w = random_bf16(size_t(s.n) * s.k, rng, 0.05f);
    DeviceBuffer<uint16_t> da(a), dw(w);
    DeviceBuffer<float> out(size_t(s.m + 1) * s.n), outr(size_t(s.m + 1) * s.n);
    out.poison();
    outr.poison();
    bf16_gemm(da.get(), dw.get(), s.m, s.n, s.k, out.get(), s.n, false, nullptr);
    bf16_gemm(da.get(), dw.get(), s.m, s.n, s.k, outr.get(), s.n, true, nullptr);
    sync_and_check();
    const auto got = out.download(), gotr = outr.download();
    size_t bad = 0, nan = 0;
    double worst = 0;
    const double eps = std::ldexp(1.0, -22) * (s.k / 16 + splits);
    // The fp64 reference on every row for small calls, a sample of rows for large ones.
    for (int r = 0; r < s.m; r += (s.m > 64 ? 7 : 1)) {
      for (int c = 0; c < s.n; ++c) {
        double exact = 0, mag = 0;
        for (int k = 0; k < s.k; ++k) {
          const double p = double(core::bf16_to_float(a[size_t(r) * s.k + k])) *
                           double(core::bf16_to_float(w[size_t(c) * s.k + k]));
          exact += p;
          mag += std::fabs(p);
        }
        const float g = got[size_t(r) * s.n + c];
        if (!std::isfinite(g)) {
          ++nan;
          continue;
        }
        const double err = std::fabs(double(g) - exact);
        worst = std::max(worst, err / std::max(mag, 1e-30));
        if (err > eps * mag) {
          if (bad++ == 0)
            ADD_FAILURE() << "row " << r << " col " << c << ": " << g << " vs " << exact
                          << " (sum|terms| " << mag << ")";
        }
      }
    }
    EXPECT_EQ(nan, 0u);
    EXPECT_EQ(bad, 0u);
    std::printf(
        "[bf16_gemm] m=%d n=%d k=%d splits=%d: max |err| / sum|terms| = %.3g (bound %.3g)\n", s.m,
        s.n, s.k, splits, worst, eps);
    // Both CTA tiles: the same bits (an output's operations do not depend on the tile).
    for (int tile : {1, 2}) {
      DeviceBuffer<float> o2(size_t(s.m) * s.n);
      o2.poison();
      bf16_gemm_force_tile(tile);
      bf16_gemm(da.get(), dw.get(), s.m, s.n, s.k, o2.get(), s.n, false, nullptr);
      bf16_gemm_force_tile(0);
      sync_and_check();
      const auto g2 = o2.download();
      for (size_t i = 0; i < g2.size(); ++i)
        ASSERT_TRUE(bits_equal(g2[i], got[i])) << "tile " << tile << " differs at " << i;
    }
    // round: bf16 of the unrounded value; the guard row untouched.
    for (size_t i = 0; i < size_t(s.m) * s.n; ++i)
      ASSERT_TRUE(bits_equal(gotr[i], core::round_bf16(got[i]))) << "rounded output " << i;
    for (size_t i = size_t(s.m) * s.n; i < got.size(); ++i)
      ASSERT_EQ(f32_bits(got[i]), 0xFFFFFFFFu) << "guard row written at " << i;
    // Row independence: rows [r0, r0 + 9) alone give the same bits.
    if (s.m >= 9) {
      const int r0 = s.m - 9;
      DeviceBuffer<float> part(size_t(9) * s.n);
      part.poison();
      bf16_gemm(da.get() + size_t(r0) * s.k, dw.get(), 9, s.n, s.k, part.get(), s.n, false,
                nullptr);
      sync_and_check();
      const auto p = part.download();
      for (size_t i = 0; i < p.size(); ++i)
        ASSERT_TRUE(bits_equal(p[i], got[size_t(r0) * s.n + i]))
            << "row " << r0 + int(i / s.n) << " col " << i % s.n << ": alone in a 9-row call "
            << p[i] << ", in the " << s.m << "-row call " << got[size_t(r0) * s.n + i];
    }
  }
}

TEST(Bf16Gemm, ActivationQdqIsTheQuantisersValues) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(778);
  // The 4-blocks-a-warp kernel (k % 128 == 0, aligned rows), then the one-block kernel (k = 288;
  // a row stride of 642 floats: rows not 16-byte aligned).
  for (const auto& [m, k, stride] :
       {std::tuple{37, 640, 704}, std::tuple{19, 288, 300}, std::tuple{11, 640, 642}}) {
    SCOPED_TRACE("k=" + std::to_string(k) + " stride=" + std::to_string(stride));
    std::vector<float> x(size_t(m) * stride);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (size_t i = 0; i < x.size(); ++i) x[i] = nd(rng) * (i % 97 == 0 ? 300.f : 1.f);
    for (int i = 0; i < 32; ++i) x[size_t(5) * stride + i] = 0.f;  // an all-zero block: the floor
    DeviceBuffer<float> dx(x);
    DeviceBuffer<uint16_t> out(size_t(m) * k);
    out.poison();
    act_qdq_fp8_bf16_rows(dx.get(), stride, m, k, out.get(), nullptr);
    sync_and_check();
    const auto got = out.download();
    std::vector<uint8_t> codes(32);
    for (int r = 0; r < m; ++r)
      for (int b = 0; b < k / 32; ++b) {
        const float s = core::quantize_fp8_block(&x[size_t(r) * stride + b * 32], 32, codes.data());
        for (int i = 0; i < 32; ++i) {
          const float want = core::e4m3_to_float(codes[size_t(i)]) * s;
          ASSERT_EQ(got[size_t(r) * k + b * 32 + i], core::float_to_bf16(want))
              << "row " << r << " element " << b * 32 + i;
          ASSERT_EQ(core::round_bf16(want), want) << "the QDQ value is not bf16-exact";
        }
      }
  }
}

TEST(Bf16Gemm, WeightCopyIsWeightAt) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(779);
  auto hw = make_weight(WFormat::kFP8, 96, 320, rng, 110, 126);
  DeviceArena arena;
  const DeviceWeight dw = upload_weight(hw->w, arena);
  DeviceBuffer<uint16_t> out(size_t(96) * 320);
  out.poison();
  fp8_weight_to_bf16(Fp8WeightView{dw.data, dw.scale, 96, 320}, out.get(), nullptr);
  sync_and_check();
  const auto got = out.download();
  for (int64_t r = 0; r < 96; ++r)
    for (int64_t c = 0; c < 320; ++c) {
      const float want = hw->w.at(r, c);
      ASSERT_EQ(core::bf16_to_float(got[size_t(r * 320 + c)]), want) << r << ", " << c;
    }
}

// DeviceLinear built with kBf16 (the default): prefill calls against the CPU, the group path and
// the row independence of prefill calls of any length.
TEST(Bf16Gemm, DeviceLinearPrefillMatchesCpu) {
  UF_REQUIRE_GPU();
  ASSERT_EQ(default_prefill_gemm(), PrefillGemm::kBf16);
  std::mt19937 rng(780);
  const int64_t K = 1024;
  const int64_t Ns[] = {288, 512};
  DeviceArena arena;
  std::vector<std::unique_ptr<HostWeight>> hws;
  std::vector<DeviceLinear> lins;
  for (int64_t N : Ns) {
    hws.push_back(make_weight(WFormat::kFP8, N, K, rng, 116, 122));
    lins.emplace_back(hws.back()->w, LinearKind::kQuant, arena);
  }
  const int T = 520;  // one 512-row chunk and 8 rows more: both on the GEMM
  const std::vector<float> x = random_acts(T, K, rng);
  DeviceBuffer<float> dx(x);
  for (size_t i = 0; i < lins.size(); ++i) {
    const int64_t N = Ns[i];
    SCOPED_TRACE("N=" + std::to_string(N));
    DeviceBuffer<float> y(size_t(T) * N), yg(size_t(T) * N), y16(size_t(16) * N);
    y.poison();
    yg.poison();
    y16.poison();
    lins[i].apply(dx.get(), T, y.get(), nullptr);
    const LinearCall call{&lins[i], yg.get(), false};
    DeviceLinear::apply_group(std::span<const LinearCall>(&call, 1), dx.get(), T, nullptr);
    lins[i].apply(dx.get() + (T - 16) * K, 16, y16.get(), nullptr);
    sync_and_check();
    const auto got = y.download(), gotg = yg.download(), got16 = y16.download();
    for (size_t j = 0; j < got.size(); ++j)
      ASSERT_TRUE(bits_equal(got[j], gotg[j])) << "apply_group differs at " << j;
    for (size_t j = 0; j < got16.size(); ++j)
      ASSERT_TRUE(bits_equal(got16[j], got[size_t(T - 16) * N + j]))
          << "row " << T - 16 + int(j / N) << ": a 16-row call differs from the 520-row call";
    // The CPU on a sample of rows (the chunk's first and last, the tail).
    const int rows[] = {0, 1, 255, 511, 512, 519};
    size_t bad = 0;
    for (int r : rows) {
      std::vector<float> want(static_cast<size_t>(N));
      cpu::linear_quant(hws[i]->w, &x[size_t(r) * K], 1, want.data());
      std::vector<uint8_t> codes(static_cast<size_t>(K));
      std::vector<float> xq(static_cast<size_t>(K));
      for (int64_t b = 0; b < K / 32; ++b) {
        const float s = core::quantize_fp8_block(&x[size_t(r) * K + b * 32], 32, &codes[b * 32]);
        for (int j = 0; j < 32; ++j) xq[b * 32 + j] = core::e4m3_to_float(codes[b * 32 + j]) * s;
      }
      for (int64_t n = 0; n < N; ++n) {
        double mag = 0;
        for (int64_t k = 0; k < K; ++k) mag += std::fabs(double(xq[k]) * hws[i]->w.at(n, k));
        const float g = got[size_t(r) * N + n], wv = want[size_t(n)];
        ASSERT_TRUE(std::isfinite(g)) << "row " << r << " NaN";
        const float u = bf16_ulp(std::max(std::fabs(g), std::fabs(wv)));
        if (std::fabs(g - wv) > u + float(0x1p-16 * mag) && bad++ == 0)
          ADD_FAILURE() << "row " << r << " feature " << n << ": " << g << " vs CPU " << wv;
      }
    }
    EXPECT_EQ(bad, 0u);
  }
}

}  // namespace
}  // namespace uf::cuda::test

namespace uf::cuda::test {
namespace {

// The *Bf16X kinds' prefill path (bf16_exact_rows + bf16_gemm): a row holding a value that is not
// bf16-exact (or a NaN) gets NaN outputs, the other rows the clean call's bits (DenseMma's
// contract, tests/cuda/test_dense_mma.cpp), for BF16 and FP8 weights, apply and apply_rows.
TEST(Bf16Gemm, DenseKindsPoisonNonBf16Rows) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(781);
  for (const auto& [f, rows] :
       {std::pair{WFormat::kBF16, int64_t(384)}, std::pair{WFormat::kFP8, int64_t(1024)}}) {
    const int64_t K = 1024;
    const int T = 13;
    auto hw = make_weight(f, rows, K, rng);
    DeviceArena arena;
    const DeviceLinear lin(hw->w, LinearKind::kBf16OutBf16X, arena);
    auto run = [&](const std::vector<float>& xv, bool use_rows) {
      const DeviceBuffer<float> dx(xv);
      DeviceBuffer<float> dy(size_t(T) * size_t(rows));
      dy.poison();
      if (use_rows)
        lin.apply_rows(0, rows, dx.get(), int(K), T, dy.get(), int(rows), nullptr);
      else
        lin.apply(dx.get(), T, dy.get(), nullptr);
      sync_and_check();
      return dy.download();
    };
    const std::vector<float> x = random_acts(T, K, rng);
    std::vector<float> bad = x;
    bad[size_t(2 * K + 700)] = 1.0f + 0x1p-12f;  // needs 13 significand bits
    bad[size_t(9 * K + 3)] = NAN;
    for (bool use_rows : {false, true}) {
      const std::vector<float> clean = run(x, use_rows), y = run(bad, use_rows);
      for (int t = 0; t < T; ++t)
        for (int64_t j = 0; j < rows; ++j) {
          const float v = y[size_t(t * rows + j)], w = clean[size_t(t * rows + j)];
          if (t == 2 || t == 9)
            ASSERT_TRUE(std::isnan(v)) << "rows " << rows << " t=" << t << " j=" << j;
          else
            ASSERT_TRUE(bits_equal(v, w) && std::isfinite(v))
                << "rows " << rows << " t=" << t << " j=" << j << ": " << v << " vs " << w;
        }
    }
  }
}

}  // namespace
}  // namespace uf::cuda::test

namespace uf::cuda::test {
namespace {

// bf16_exact_rows on both kernels (4 values a thread: k % 4 == 0 and aligned rows; else one):
// a bf16-exact value gives its bits, any other a NaN, a NaN a NaN.
TEST(Bf16Gemm, ExactRowsKeepBf16ValuesAndPoisonOthers) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(782);
  for (const auto& [m, k, stride] :
       {std::tuple{7, 1024, 1056}, std::tuple{5, 96, 101}, std::tuple{3, 30, 30}}) {
    SCOPED_TRACE("k=" + std::to_string(k) + " stride=" + std::to_string(stride));
    std::vector<float> x = random_acts(m, stride, rng);
    x[size_t(1) * stride + 5] = 1.0f + 0x1p-12f;  // not bf16-exact
    x[size_t(2) * stride + 7] = NAN;
    const DeviceBuffer<float> dx(x);
    DeviceBuffer<uint16_t> out(size_t(m) * k);
    out.poison();
    bf16_exact_rows(dx.get(), stride, m, k, out.get(), nullptr);
    sync_and_check();
    const auto got = out.download();
    for (int r = 0; r < m; ++r)
      for (int c = 0; c < k; ++c) {
        const float v = x[size_t(r) * stride + c];
        const uint16_t g = got[size_t(r) * k + c];
        const bool nan = (g & 0x7f80) == 0x7f80 && (g & 0x7f) != 0;
        if (std::isnan(v) || core::round_bf16(v) != v)
          ASSERT_TRUE(nan) << r << ", " << c << ": " << v << " -> 0x" << std::hex << g;
        else
          ASSERT_EQ(g, core::float_to_bf16(v)) << r << ", " << c;
      }
  }
}

}  // namespace
}  // namespace uf::cuda::test
