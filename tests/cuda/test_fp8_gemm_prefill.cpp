// The prefill GEMM (kernels/fp8_gemm.cu, DeviceLinear::apply with T > 8 on FP8 32x32-block
// weights) against
//   - the decode path: the same DeviceLinear built with max_prefill_rows = 0 runs the Fp8Gemv by
//     chunks of 8 rows; the GEMM keeps the GEMV's split-K grouping and order, so every output must
//     be BITWISE equal (apply and apply_partial);
//   - the CPU (cpu::linear_quant) on a few rows of each call, within the bound test_ops_linear.cpp
//     uses for the GEMV: fp32 order only (tensor-core sum inside a K block, split grouping), so
//     |got - want| <= 2^-16 * sum|terms| + one bf16 ulp (a rounding flip);
//   - itself: row t of a 512-row call equals the same row in a 9-row call (row independence),
//     round_bf16(apply_partial) == apply, apply_group == the weights' own apply().
// Outputs are poisoned with NaN (0xFF bytes) with a guard row after the T x N output that must
// stay untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/dtypes.h"
#include "core/quant.h"
#include "cpu/linear.h"
#include "cuda/gemv.h"
#include "cuda/ops/linear.h"
#include "cuda_test_util.h"
#include "ops_test_weights.h"

namespace uf::cuda::test {
namespace {

using model::WFormat;

// First index where a and b differ bitwise (NaN == NaN only with the same bits), -1 if none.
long first_diff(const std::vector<float>& a, const std::vector<float>& b, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!bits_equal(a[i], b[i])) return long(i);
  return -1;
}

size_t count_nan(const std::vector<float>& v, size_t n) {
  size_t c = 0;
  for (size_t i = 0; i < n; ++i) c += !std::isfinite(v[i]);
  return c;
}

// The guard row after T x N must still hold the poison (0xFFFFFFFF).
bool guard_intact(const std::vector<float>& v, size_t from) {
  for (size_t i = from; i < v.size(); ++i) {
    uint32_t b;
    std::memcpy(&b, &v[i], 4);
    if (b != 0xFFFFFFFFu) return false;
  }
  return true;
}

// Runs apply (or apply_partial) into a poisoned buffer of T x N plus one guard row.
std::vector<float> run_linear(const DeviceLinear& lin, const DeviceBuffer<float>& dx, int T,
                              bool partial) {
  const size_t N = size_t(lin.rows());
  DeviceBuffer<float> dy(size_t(T + 1) * N);
  dy.poison();
  if (partial)
    lin.apply_partial(dx.get(), T, dy.get(), nullptr);
  else
    lin.apply(dx.get(), T, dy.get(), nullptr);
  sync_and_check();
  return dy.download();
}

// cpu::linear_quant on the listed rows of x, compared with got (the device's T x N output).
// Returns the number of outputs outside the bound (and prints the first).
size_t check_cpu_rows(const model::Weight& w, const std::vector<float>& x, int T,
                      const std::vector<float>& got, const std::vector<int>& rows_in,
                      const char* what) {
  const int64_t N = w.rows, K = w.cols;
  std::vector<int> rows;
  for (int r : rows_in)
    if (r >= 0 && r < T && std::find(rows.begin(), rows.end(), r) == rows.end()) rows.push_back(r);
  const size_t R = rows.size();
  // The selected rows, their CPU outputs and their fake-quantised values (what linear_quant
  // multiplies), for the term magnitudes.
  std::vector<float> xr(R * size_t(K)), xq(R * size_t(K)), want(R * size_t(N));
  std::vector<uint8_t> codes(32);
  for (size_t i = 0; i < R; ++i) {
    std::copy(x.begin() + int64_t(rows[i]) * K, x.begin() + int64_t(rows[i] + 1) * K,
              xr.begin() + int64_t(i) * K);
    for (int64_t kb = 0; kb < K / 32; ++kb) {
      const size_t o = i * size_t(K) + size_t(kb * 32);
      const float s = core::quantize_fp8_block(&xr[o], 32, codes.data());
      for (int e = 0; e < 32; ++e) xq[o + size_t(e)] = core::e4m3_to_float(codes[size_t(e)]) * s;
    }
  }
  cpu::linear_quant(w, xr.data(), int(R), want.data());
  std::vector<float> wrow(size_t(K), 0.f);
  size_t bad = 0, exact = 0, n = 0;
  float max_ulps = 0;
  for (int64_t j = 0; j < N; ++j) {
    w.row(j, wrow.data());
    for (size_t i = 0; i < R; ++i) {
      double mag = 0;
      const float* q = &xq[i * size_t(K)];
      for (int64_t k = 0; k < K; ++k) mag += std::fabs(double(q[k]) * wrow[size_t(k)]);
      const float g = got[size_t(rows[i]) * size_t(N) + size_t(j)];
      const float wv = want[i * size_t(N) + size_t(j)];
      ++n;
      if (bits_equal(g, wv)) ++exact;
      const float ulp = bf16_ulp(std::max(std::fabs(g), std::fabs(wv)));
      max_ulps = std::max(max_ulps, std::fabs(g - wv) / ulp);
      if (!(std::fabs(g - wv) <= ulp + float(0x1p-16 * mag))) {
        if (bad == 0)
          std::printf(
              "[fp8_gemm] %s: CPU mismatch row %d feature %lld: got %.9g want %.9g "
              "(mag %g)\n",
              what, rows[i], static_cast<long long>(j), double(g), double(wv), mag);
        ++bad;
      }
    }
  }
  std::printf("[fp8_gemm] %s vs CPU: %zu outputs, %zu bitwise, %zu bad, max %.3g bf16 ulps\n", what,
              n, exact, bad, double(max_ulps));
  return bad;
}

struct Shape {
  int64_t n, k;
  std::vector<int> ts;
};

class Fp8GemmPrefill : public ::testing::TestWithParam<Shape> {};

TEST_P(Fp8GemmPrefill, BitwiseDecodeAndCpu) {
  UF_REQUIRE_GPU();
  const ScopedPrefillGemm bitwise(PrefillGemm::kFp8Bitwise);  // the GEMM under test
  const Shape s = GetParam();
  std::mt19937 rng(uint32_t(s.n * 7 + s.k));
  auto hw = make_weight(WFormat::kFP8, s.n, s.k, rng, 118, 122, false, "gemm");
  DeviceArena arena;
  DeviceLinear gemm(hw->w, LinearKind::kQuant, arena);  // default prefill workspace (512 rows)
  DeviceLinear gemv(hw->w, LinearKind::kQuant, arena, /*max_prefill_rows=*/0);
  const Fp8Gemv plan(int(s.n), int(s.k), device_sm_count());
  const size_t N = size_t(s.n);
  for (int T : s.ts) {
    char what[128];
    std::snprintf(what, sizeof what, "N=%lld K=%lld T=%d (splits %d x %d K blocks)",
                  static_cast<long long>(s.n), static_cast<long long>(s.k), T, plan.splits(),
                  plan.kb_per_split());
    const std::vector<float> x = random_acts(T, s.k, rng);
    DeviceBuffer<float> dx(x);
    for (bool partial : {false, true}) {
      const std::vector<float> got = run_linear(gemm, dx, T, partial);
      const std::vector<float> ref = run_linear(gemv, dx, T, partial);
      const size_t n = size_t(T) * N;
      EXPECT_EQ(count_nan(got, n), 0u) << what << " partial=" << partial << ": NaN outputs";
      EXPECT_TRUE(guard_intact(got, n)) << what << ": wrote past T x N";
      const long d = first_diff(got, ref, n);
      size_t ndiff = 0;
      for (size_t i = 0; i < n; ++i) ndiff += !bits_equal(got[i], ref[i]);
      EXPECT_EQ(d, -1) << what << " partial=" << partial << ": " << ndiff
                       << " outputs differ from the chunked GEMV; first at token "
                       << (d < 0 ? 0 : d / long(N)) << " feature " << (d < 0 ? 0 : d % long(N))
                       << ": gemm " << (d < 0 ? 0.f : got[size_t(d)]) << " gemv "
                       << (d < 0 ? 0.f : ref[size_t(d)]);
      std::printf("[fp8_gemm] %s partial=%d: %zu of %zu differ from the GEMV\n", what, int(partial),
                  ndiff, n);
      if (!partial) {
        const std::vector<int> rows = {0, 8, T / 2, T - 1};
        EXPECT_EQ(check_cpu_rows(hw->w, x, T, got, rows, what), 0u) << what;
      } else {
        // apply == round_bf16(apply_partial) bitwise (the GEMV's round_f32).
        const std::vector<float> full = run_linear(gemm, dx, T, false);
        size_t bad = 0;
        for (size_t i = 0; i < n; ++i) bad += !bits_equal(core::round_bf16(got[i]), full[i]);
        EXPECT_EQ(bad, 0u) << what << ": round_bf16(apply_partial) != apply";
      }
    }
  }
}

// Real TP8 rank shapes (bench_cuda_decode's plan) and small odd ones: N not a multiple of 128 or
// 32, K blocks not a multiple of the 4-block stage.
INSTANTIATE_TEST_SUITE_P(
    Shapes, Fp8GemmPrefill,
    ::testing::Values(
        Shape{1280, 5120, {9, 64, 100, 512, 1000}}, Shape{4096, 1280, {9, 64, 100, 512, 1000}},
        Shape{512, 5120, {9, 64, 100, 512, 1000}}, Shape{5120, 1024, {9, 64, 100, 512, 1000}},
        Shape{576, 5120, {9, 64, 100, 512, 1000}}, Shape{25600, 6144, {64}},
        Shape{16, 32, {9, 65, 517}}, Shape{48, 96, {9, 64, 100}}, Shape{208, 288, {9, 71, 130}},
        Shape{144, 160, {10, 64, 513}}, Shape{1040, 4128, {9, 100}}),
    [](const ::testing::TestParamInfo<Shape>& i) {
      return "n" + std::to_string(i.param.n) + "_k" + std::to_string(i.param.k);
    });

// Row t of a 512-row call equals row t of a 9-row call that contains it (and rows of a tail).
TEST(Fp8GemmPrefillRows, RowIndependence) {
  UF_REQUIRE_GPU();
  const ScopedPrefillGemm bitwise(PrefillGemm::kFp8Bitwise);  // the GEMM under test
  std::mt19937 rng(77);
  const int64_t N = 1280, K = 5120;
  auto hw = make_weight(WFormat::kFP8, N, K, rng);
  DeviceArena arena;
  DeviceLinear lin(hw->w, LinearKind::kQuant, arena);
  const int T = 512;
  const std::vector<float> x = random_acts(T, K, rng);
  DeviceBuffer<float> dx(x);
  const std::vector<float> big = run_linear(lin, dx, T, false);
  for (int r0 : {0, 55, 503}) {
    DeviceBuffer<float> dxs(std::vector<float>(x.begin() + r0 * K, x.begin() + (r0 + 9) * K));
    const std::vector<float> small = run_linear(lin, dxs, 9, false);
    for (int r = 0; r < 9; ++r)
      for (int64_t j = 0; j < N; ++j)
        ASSERT_TRUE(bits_equal(small[size_t(r * N + j)], big[size_t((r0 + r) * N + j)]))
            << "row " << r0 + r << " feature " << j << ": in a 9-row call "
            << small[size_t(r * N + j)] << ", in a 512-row call " << big[size_t((r0 + r) * N + j)];
  }
}

// apply_group with T > 8: the GEMM weights share one activation quantisation per chunk of rows;
// every output bitwise its weight's own apply() / apply_partial(), including rows past the last
// whole chunk (a GEMM chunk or the GEMV tail), 9 rows (one GEMM chunk of 9) and weights whose
// GEMM chunks differ.
TEST(Fp8GemmPrefillRows, GroupMatchesOwnApply) {
  UF_REQUIRE_GPU();
  const ScopedPrefillGemm bitwise(PrefillGemm::kFp8Bitwise);  // the GEMM under test
  std::mt19937 rng(78);
  const int64_t K = 1280;
  auto h1 = make_weight(WFormat::kFP8, 512, K, rng);
  auto h2 = make_weight(WFormat::kFP8, 4096, K, rng);
  DeviceArena arena;
  // l2's GEMM takes chunks of 256 rows, l1's of the default 512: the group chunks by 256, so at
  // 264 rows l1's last 8 rows run on its GEMV in the group and on its GEMM alone.
  DeviceLinear l1(h1->w, LinearKind::kQuant, arena), l2(h2->w, LinearKind::kQuant, arena, 256);
  for (const int T : {9, 100, 264, 517, 1029}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    const std::vector<float> x = random_acts(T, K, rng);
    DeviceBuffer<float> dx(x), y1(size_t(T) * 512), y2(size_t(T) * 4096);
    y1.poison();
    y2.poison();
    const LinearCall calls[] = {{&l1, y1.get(), false}, {&l2, y2.get(), true}};
    DeviceLinear::apply_group(calls, dx.get(), T, nullptr);
    sync_and_check();
    const std::vector<float> g1 = y1.download(), g2 = y2.download();
    const std::vector<float> o1 = run_linear(l1, dx, T, false), o2 = run_linear(l2, dx, T, true);
    EXPECT_EQ(first_diff(g1, o1, g1.size()), -1) << "apply_group output 0 != apply";
    EXPECT_EQ(first_diff(g2, o2, g2.size()), -1)
        << "apply_group output 1 (partial) != apply_partial";
  }
}

// fp8_gemm_prefill with a plan's kb_per_split is bitwise Fp8Gemv::run of that plan, for the
// resident plan (kAuto) and the pipelined one (forced) of the same shape: their groupings differ,
// the GEMM follows either.
TEST(Fp8GemmPrefillRows, MatchesEachDecodePath) {
  UF_REQUIRE_GPU();
  const ScopedPrefillGemm bitwise(PrefillGemm::kFp8Bitwise);  // the GEMM under test
  std::mt19937 rng(79);
  const int sms = device_sm_count();
  for (const auto& s :
       {std::pair{5120, 1024}, std::pair{1280, 5120}, std::pair{208, 288}, std::pair{256, 8192}}) {
    const int n = s.first, k = s.second, m = 8;
    const DeviceBuffer<uint8_t> w(random_e4m3(size_t(n) * k, rng));
    const DeviceBuffer<uint8_t> ws(random_bytes(size_t((n + 31) / 32) * (k / 32), rng, 118, 122));
    const DeviceBuffer<float> x(random_acts(m, k, rng));
    DeviceBuffer<uint8_t> codes(size_t(m) * k);
    DeviceBuffer<float> scales(size_t(m) * (k / 32));
    act_quant_fp8_f32(x.get(), m, k, codes.get(), scales.get(), nullptr);
    const Fp8WeightView wv{w.get(), ws.get(), n, k};
    const QuantActView av{codes.get(), scales.get(), m, k};
    for (const Fp8GemvPath path : {Fp8GemvPath::kAuto, Fp8GemvPath::kPipelined}) {
      const Fp8Gemv plan(n, k, sms, path);
      DeviceBuffer<float> dec(size_t(m) * n), pre(size_t(m) * n);
      dec.poison();
      pre.poison();
      plan.run(wv, av, dec.get(), nullptr, nullptr);
      fp8_gemm_prefill(wv, av, plan.kb_per_split(), pre.get(), false, nullptr);
      sync_and_check();
      const std::vector<float> a = dec.download(), b = pre.download();
      const long d = first_diff(b, a, a.size());
      EXPECT_EQ(count_nan(a, a.size()), 0u);
      EXPECT_EQ(d, -1) << "n=" << n << " k=" << k << " "
                       << (plan.resident() ? "resident" : "pipelined") << " plan (" << plan.splits()
                       << " x " << plan.kb_per_split()
                       << " K blocks): prefill differs from the GEMV first at token "
                       << (d < 0 ? 0 : d / n) << " row " << (d < 0 ? 0 : d % n) << ": gemm "
                       << (d < 0 ? 0.f : b[size_t(d)]) << " gemv " << (d < 0 ? 0.f : a[size_t(d)]);
    }
  }
}

}  // namespace
}  // namespace uf::cuda::test
