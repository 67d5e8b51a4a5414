// Fp8Gemv::run_fused / run_fused_group (act quant inside the GEMV, split-K finish and bf16
// rounding in the same launch) against the two-kernel path act_quant_fp8_f32 + Fp8Gemv::run, which
// test_fp8_gemv.cpp checks against core/quant.h and an fp64 reference. Everything here is bitwise:
// the fused kernel must produce the same codes and scales and feed the same mma fragments, and the
// split plan and the fp32 order are the plan's (never M's).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "cuda/gemv.h"
#include "cuda_test_util.h"

namespace uf::cuda::test {
namespace {

// fp32 activations whose 32-blocks span many magnitudes (all-zero, sub-floor, large), and values
// that are not bf16 (the fused path quantises fp32 x).
std::vector<float> fused_acts(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> e(-12.f, 8.f);
  std::uniform_int_distribution<int> kind(0, 31);
  std::vector<float> x(n);
  for (size_t b = 0; b < n; b += 32) {
    const int kd = kind(rng);
    const float s = kd == 0 ? 0.f : (kd == 1 ? 1e-6f : std::exp2(e(rng)));
    for (size_t i = b; i < std::min(n, b + 32); ++i) x[i] = nd(rng) * s * (1.0f + 1e-3f);
  }
  return x;
}

// Bitwise comparison of [m, n] outputs; NaN equals NaN (only the non-finite-input case has any).
// Returns "" or a diagnostic naming the count, the first bad (token, row) and both bit patterns.
std::string compare_bits(const std::vector<float>& got, const std::vector<float>& want, int n,
                         const char* what) {
  size_t bad = 0, nan_got = 0, nan_want = 0;
  long first = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    nan_got += std::isnan(got[i]);
    nan_want += std::isnan(want[i]);
    const bool ok =
        f32_bits(got[i]) == f32_bits(want[i]) || (std::isnan(got[i]) && std::isnan(want[i]));
    if (!ok && bad++ == 0) first = long(i);
  }
  if (bad == 0) return "";
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "%s: %zu of %zu outputs differ (NaN: got %zu, want %zu); first at token %ld row "
                "%ld: got %.9g (0x%08x) want %.9g (0x%08x)",
                what, bad, want.size(), nan_got, nan_want, first / n, first % n,
                double(got[size_t(first)]), f32_bits(got[size_t(first)]),
                double(want[size_t(first)]), f32_bits(want[size_t(first)]));
  return buf;
}

struct Weight {
  int n, k;
  DeviceBuffer<uint8_t> w, ws;
  Weight(int n_, int k_, std::mt19937& rng)
      : n(n_),
        k(k_),
        w(random_e4m3(size_t(n_) * k_, rng)),
        ws(random_bytes(size_t((n_ + 31) / 32) * (k_ / 32), rng, 114, 124)) {}
  Fp8WeightView view() const { return {w.get(), ws.get(), n, k}; }
};

// The two-kernel path: act_quant_fp8_f32 (codes to global) then run(); fp32 and bf16 outputs.
struct Outs {
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
};
Outs two_kernel(const Fp8Gemv& g, const Weight& w, const DeviceBuffer<float>& x, int m) {
  DeviceBuffer<uint8_t> codes(size_t(m) * w.k);
  DeviceBuffer<float> scales(size_t(m) * (w.k / 32));
  DeviceBuffer<float> out(size_t(m) * w.n);
  DeviceBuffer<uint16_t> out_bf16(size_t(m) * w.n);
  out.poison();
  out_bf16.poison();
  act_quant_fp8_f32(x.get(), m, w.k, codes.get(), scales.get(), nullptr);
  g.run(w.view(), QuantActView{codes.get(), scales.get(), m, w.k}, out.get(), out_bf16.get(),
        nullptr);
  sync_and_check();
  return {out.download(), out_bf16.download()};
}

// run_fused into kMaxDecodeRows poisoned rows (rows >= m must stay poisoned).
Outs fused(const Fp8Gemv& g, const Weight& w, const float* x, long long x_stride, int m,
           bool round) {
  DeviceBuffer<float> out(size_t(kMaxDecodeRows) * w.n);
  DeviceBuffer<uint16_t> out_bf16(size_t(kMaxDecodeRows) * w.n);
  out.poison();
  out_bf16.poison();
  g.run_fused(w.view(), x, x_stride, m, out.get(), round, out_bf16.get(), nullptr);
  sync_and_check();
  Outs o{out.download(), out_bf16.download()};
  size_t written = 0;
  long first = -1;
  for (size_t i = size_t(m) * w.n; i < o.f32.size(); ++i)
    if (f32_bits(o.f32[i]) != 0xFFFFFFFFu && written++ == 0) first = long(i);
  EXPECT_EQ(written, 0u) << "run_fused [" << w.n << ", " << w.k << "] m=" << m << " wrote "
                         << written << " outputs of rows >= m, first at row " << first / w.n;
  o.f32.resize(size_t(m) * w.n);
  o.bf16.resize(size_t(m) * w.n);
  return o;
}

std::vector<float> rounded(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = core::round_bf16(v[i]);
  return r;
}

// Rank slices of the model (wq_a 1280x5120, wq_b 4096x1280, wkv-like 512x5120, wo_b 5120x1024,
// shared expert w1+w3 576x5120), a K tail chunk (1056 = 33 blocks), a single-split wide weight and
// splits of 5 and 2 chunks (3- and 2-stage pipelines, the act double buffer), 64 splits (the
// batched split sum) and a one-tile weight.
// Resident plans: all but 32768x1280, 16384x1024 and 128x16384 (pipelined); shared w2 (K 288),
// a cluster of 6 (K 8192) and of 3 (K 4128).
const int kShapes[][2] = {{1280, 5120}, {4096, 1280},  {512, 5120},   {5120, 1024}, {576, 5120},
                          {256, 1056},  {32768, 1280}, {16384, 1024}, {128, 16384}, {16, 64},
                          {5120, 288},  {256, 8192},   {1040, 4128}};

TEST(CudaFp8GemvFused, EqualsTwoKernelPathBitwise) {
  UF_REQUIRE_GPU();
  const int sms = device_sm_count();
  std::mt19937 rng(21);
  for (const auto& s : kShapes) {
    const int n = s[0], k = s[1];
    const Weight w(n, k, rng);
    const Fp8Gemv g(n, k, sms);
    std::printf(
        "[fp8_gemv_fused] n=%d k=%d: %s splits=%d kb_per_split=%d cluster=%d stages=%d "
        "blocks/SM fused=%d two-kernel=%d\n",
        n, k, g.resident() ? "resident" : "pipelined", g.splits(), g.kb_per_split(), g.cluster(),
        g.stages(), g.blocks_per_sm(true), g.blocks_per_sm(false));
    EXPECT_GE(g.blocks_per_sm(true), 2) << "n=" << n << " k=" << k
                                        << ": the fused kernel's shared memory or registers "
                                           "leave less than the plan's 2 blocks per SM";
    for (int m = 1; m <= kMaxDecodeRows; ++m) {
      const DeviceBuffer<float> x(fused_acts(size_t(m) * k, rng));
      const Outs want = two_kernel(g, w, x, m);
      const Outs got = fused(g, w, x.get(), k, m, false);
      const std::string ctx = "n=" + std::to_string(n) + " k=" + std::to_string(k) +
                              " m=" + std::to_string(m) + " splits=" + std::to_string(g.splits());
      std::string e = compare_bits(got.f32, want.f32, n, (ctx + " fp32").c_str());
      EXPECT_TRUE(e.empty()) << e;
      EXPECT_EQ(got.bf16, want.bf16) << ctx << ": bf16 outputs differ";
      // round_f32: the apply() output, bf16 rounding inside the kernel.
      const Outs got_r = fused(g, w, x.get(), k, m, true);
      e = compare_bits(got_r.f32, rounded(want.f32), n, (ctx + " rounded fp32").c_str());
      EXPECT_TRUE(e.empty()) << e;
      for (float v : got_r.f32) {
        ASSERT_TRUE(std::isfinite(v)) << ctx << ": non-finite output from finite inputs";
      }
    }
  }
}

// x rows with a stride > k (a view into a wider buffer), and a non-finite input block: NaN and
// inf must give the same outputs (bits, or NaN for NaN) as the two-kernel path, whose act_quant
// ignores NaN in the block max and lets inf make the scale inf.
TEST(CudaFp8GemvFused, StridedAndNonFiniteInputs) {
  UF_REQUIRE_GPU();
  const int sms = device_sm_count();
  std::mt19937 rng(22);
  for (const auto& s : {std::pair{1280, 5120}, std::pair{256, 1056}}) {
    const int n = s.first, k = s.second, m = 5, stride = k + 64;
    const Weight w(n, k, rng);
    const Fp8Gemv g(n, k, sms);
    std::vector<float> xs = fused_acts(size_t(m) * stride, rng);
    std::vector<float> xd(size_t(m) * k);
    for (int t = 0; t < m; ++t)
      std::copy_n(xs.begin() + size_t(t) * stride, k, xd.begin() + size_t(t) * k);
    {
      const DeviceBuffer<float> strided(xs), dense(xd);
      const Outs want = two_kernel(g, w, dense, m);
      const Outs got = fused(g, w, strided.get(), stride, m, false);
      const std::string e = compare_bits(got.f32, want.f32, n, "strided x");
      EXPECT_TRUE(e.empty()) << "n=" << n << " k=" << k << " " << e;
    }
    // Token 1: one NaN in block 3; token 2: +inf in block 5; token 3: NaN and -inf in block 0.
    xd[size_t(1) * k + 3 * 32 + 7] = std::numeric_limits<float>::quiet_NaN();
    xd[size_t(2) * k + 5 * 32 + 1] = std::numeric_limits<float>::infinity();
    xd[size_t(3) * k + 0 * 32 + 2] = std::numeric_limits<float>::quiet_NaN();
    xd[size_t(3) * k + 0 * 32 + 9] = -std::numeric_limits<float>::infinity();
    const DeviceBuffer<float> dense(xd);
    const Outs want = two_kernel(g, w, dense, m);
    const Outs got = fused(g, w, dense.get(), k, m, false);
    const std::string e = compare_bits(got.f32, want.f32, n, "non-finite x");
    EXPECT_TRUE(e.empty()) << "n=" << n << " k=" << k << " " << e;
    // Token 0 and 4 are finite: their outputs must be finite in both paths.
    for (int t : {0, 4})
      for (int i = 0; i < n; ++i)
        ASSERT_TRUE(std::isfinite(got.f32[size_t(t) * n + i])) << "token " << t << " row " << i;
  }
}

// spec == plain: row t of an M = 8 fused call == the M = 1 fused call on that row, and the first
// m rows of the M = 8 input give the same bits for every m.
TEST(CudaFp8GemvFused, RowResultIndependentOfM) {
  UF_REQUIRE_GPU();
  const int sms = device_sm_count();
  std::mt19937 rng(23);
  for (const auto& s : {std::pair{1280, 5120}, std::pair{5120, 1024}, std::pair{128, 16384},
                        std::pair{5120, 288}}) {
    const int n = s.first, k = s.second;
    const Weight w(n, k, rng);
    const Fp8Gemv g(n, k, sms);
    SCOPED_TRACE(g.resident() ? "resident" : "pipelined");
    const DeviceBuffer<float> x(fused_acts(size_t(kMaxDecodeRows) * k, rng));
    const Outs full = fused(g, w, x.get(), k, kMaxDecodeRows, true);
    for (int m = 1; m < kMaxDecodeRows; ++m) {
      const Outs r = fused(g, w, x.get(), k, m, true);
      std::vector<float> head(full.f32.begin(), full.f32.begin() + size_t(m) * n);
      const std::string e = compare_bits(r.f32, head, n, "first m rows");
      ASSERT_TRUE(e.empty()) << "n=" << n << " k=" << k << " m=" << m << " " << e;
    }
    for (int t = 0; t < kMaxDecodeRows; ++t) {
      const Outs r = fused(g, w, x.get() + size_t(t) * k, k, 1, true);
      std::vector<float> row(full.f32.begin() + size_t(t) * n,
                             full.f32.begin() + size_t(t + 1) * n);
      const std::string e = compare_bits(r.f32, row, n, "row alone");
      ASSERT_TRUE(e.empty()) << "n=" << n << " k=" << k << " token " << t << " " << e;
    }
  }
}

// A grouped launch of the weights reading the normalised hidden state (K = 5120): each output is
// bitwise its own run_fused. 4096 x 5120 is pipelined (its own launch), the others resident in
// one launch whose tiles per CTA (4) differ from each weight's own launch (1..3) and whose last
// cluster of a weight holds fewer tiles: the result must not depend on either.
TEST(CudaFp8GemvFused, GroupEqualsSeparateRuns) {
  UF_REQUIRE_GPU();
  const int sms = device_sm_count();
  std::mt19937 rng(24);
  const int k = 5120;
  const int ns[] = {1280, 576, 512, 128, 4096, 16};
  std::vector<std::unique_ptr<Weight>> ws;
  std::vector<std::unique_ptr<Fp8Gemv>> gs;
  for (int n : ns) {
    ws.push_back(std::make_unique<Weight>(n, k, rng));
    gs.push_back(std::make_unique<Fp8Gemv>(n, k, sms));
  }
  for (int m : {1, 3, 8}) {
    const DeviceBuffer<float> x(fused_acts(size_t(m) * k, rng));
    std::vector<std::unique_ptr<DeviceBuffer<float>>> outs;
    std::vector<Fp8GemvCall> calls;
    for (size_t i = 0; i < ws.size(); ++i) {
      outs.push_back(std::make_unique<DeviceBuffer<float>>(size_t(m) * ws[i]->n));
      outs.back()->poison();
      calls.push_back(
          Fp8GemvCall{gs[i].get(), ws[i]->view(), outs.back()->get(), i % 2 == 0, nullptr});
    }
    Fp8Gemv::run_fused_group(calls.data(), int(calls.size()), x.get(), k, m, nullptr);
    sync_and_check();
    for (size_t i = 0; i < ws.size(); ++i) {
      const Outs want = fused(*gs[i], *ws[i], x.get(), k, m, i % 2 == 0);
      const std::string e =
          compare_bits(outs[i]->download(), want.f32, ws[i]->n, "grouped vs alone");
      EXPECT_TRUE(e.empty()) << "weight " << i << " n=" << ws[i]->n << " m=" << m << " " << e;
    }
  }
}

}  // namespace
}  // namespace uf::cuda::test
