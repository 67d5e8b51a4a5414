// FP8 activation quantization and the FP8 block-scaled GEMV against core/quant.h and an fp64
// reference, plus the spec == plain property (a row's output does not depend on M).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "core/dtypes.h"
#include "core/quant.h"
#include "cuda/gemv.h"
#include "cuda_test_util.h"

namespace uf::cuda::test {
namespace {

// bf16 activations whose 32-blocks span many magnitudes, including all-zero and sub-floor blocks.
std::vector<float> random_activations(int m, int k, std::mt19937& rng) {
  std::normal_distribution<float> n(0.f, 1.f);
  std::uniform_real_distribution<float> e(-12.f, 6.f);
  std::uniform_int_distribution<int> kind(0, 31);
  std::vector<float> x(size_t(m) * k);
  for (size_t b = 0; b < x.size(); b += 32) {
    const int kd = kind(rng);
    const float s = kd == 0 ? 0.f : (kd == 1 ? 1e-6f : std::exp2(e(rng)));
    for (int i = 0; i < 32; ++i) x[b + i] = core::round_bf16(n(rng) * s);
  }
  return x;
}

struct Problem {
  int n, k;
  std::vector<uint8_t> w, ws;  // e4m3 [n,k], e8m0 [n/32 (ceil), k/32]
};

Problem random_problem(int n, int k, std::mt19937& rng) {
  Problem p{n, k, random_e4m3(size_t(n) * k, rng), {}};
  p.ws = random_bytes(size_t((n + 31) / 32) * (k / 32), rng, 114, 124);
  return p;
}

// Quantizes x on the CPU with core::quantize_fp8_block.
void cpu_quant(const std::vector<float>& x, int m, int k, std::vector<uint8_t>& codes,
               std::vector<float>& scales) {
  codes.assign(size_t(m) * k, 0);
  scales.assign(size_t(m) * (k / 32), 0.f);
  for (int r = 0; r < m; ++r)
    for (int kb = 0; kb < k / 32; ++kb)
      scales[size_t(r) * (k / 32) + kb] = core::quantize_fp8_block(&x[size_t(r) * k + kb * 32], 32,
                                                                   &codes[size_t(r) * k + kb * 32]);
}

TEST(CudaActQuant, MatchesCoreQuantBitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(11);
  const int m = 8, k = 8192;
  for (int pass = 0; pass < 2; ++pass) {
    auto x = random_activations(m, k, rng);
    if (pass == 1)  // fp32 inputs need not be bf16 values
      for (auto& v : x) v *= 1.0f + 1e-3f;
    std::vector<uint8_t> want_codes;
    std::vector<float> want_scales;
    cpu_quant(x, m, k, want_codes, want_scales);
    DeviceBuffer<uint8_t> codes(size_t(m) * k);
    DeviceBuffer<float> scales(size_t(m) * k / 32);
    codes.poison();
    scales.poison();
    if (pass == 0) {
      DeviceBuffer<uint16_t> xd(bf16_bits(x));  // x is bf16-exact
      act_quant_fp8_bf16(xd.get(), m, k, codes.get(), scales.get(), nullptr);
    } else {
      DeviceBuffer<float> xd(x);
      act_quant_fp8_f32(xd.get(), m, k, codes.get(), scales.get(), nullptr);
    }
    sync_and_check();
    EXPECT_EQ(codes.download(), want_codes) << "pass " << pass;
    const auto got = scales.download();
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_TRUE(bits_equal(got[i], want_scales[i]))
          << i << " " << got[i] << " " << want_scales[i];
  }
}

struct GemvRun {
  std::vector<float> out;
  std::vector<uint16_t> out_bf16;
};

GemvRun run_gemv(const Fp8Gemv& g, const DeviceBuffer<uint8_t>& w, const DeviceBuffer<uint8_t>& ws,
                 const std::vector<uint8_t>& codes, const std::vector<float>& scales, int m) {
  DeviceBuffer<uint8_t> a(codes);
  DeviceBuffer<float> as(scales);
  DeviceBuffer<float> out(size_t(m) * g.n());
  DeviceBuffer<uint16_t> out_bf16(size_t(m) * g.n());
  out.poison();
  out_bf16.poison();
  g.run(Fp8WeightView{w.get(), ws.get(), g.n(), g.k()}, QuantActView{a.get(), as.get(), m, g.k()},
        out.get(), out_bf16.get(), nullptr);
  sync_and_check();
  return {out.download(), out_bf16.download()};
}

// Both kernels (the resident one, Fp8GemvPath::kAuto where the shape allows, and the pipelined
// one, forced) against the fp64 reference on the same inputs.
TEST(CudaFp8Gemv, MatchesFp64Reference) {
  UF_REQUIRE_GPU();
  const int sms = device_sm_count();
  std::mt19937 rng(12);
  // Rank slices of the model (wq_a, wq_b, wo_b, shared w2), odd splits, a cluster of 6 (K 8192),
  // and a pipelined-only shape.
  const int shapes[][2] = {{160, 5120}, {4096, 1280}, {5120, 1024}, {256, 1056},
                           {5120, 288}, {256, 8192},  {32768, 1280}};
  for (const auto& s : shapes) {
    const int n = s[0], k = s[1], nkb = k / 32;
    const Problem p = random_problem(n, k, rng);
    DeviceBuffer<uint8_t> w(p.w), ws(p.ws);
    const Fp8Gemv auto_plan(n, k, sms), piped(n, k, sms, Fp8GemvPath::kPipelined);
    EXPECT_FALSE(piped.resident());
    for (int m : {1, 3, 8}) {
      const auto x = random_activations(m, k, rng);
      std::vector<uint8_t> codes;
      std::vector<float> scales;
      cpu_quant(x, m, k, codes, scales);
      std::vector<double> ref(size_t(m) * n), mag(size_t(m) * n);
      for (int t = 0; t < m; ++t) {
        for (int row = 0; row < n; ++row) {
          double acc = 0, am = 0;
          for (int kb = 0; kb < nkb; ++kb) {
            double part = 0;
            for (int i = 0; i < 32; ++i) {
              const size_t kk = size_t(kb) * 32 + i;
              part += double(core::e4m3_to_float(codes[size_t(t) * k + kk])) *
                      double(core::e4m3_to_float(p.w[size_t(row) * k + kk]));
            }
            const double sc = double(scales[size_t(t) * nkb + kb]) *
                              double(core::e8m0_to_float(p.ws[size_t(row / 32) * nkb + kb]));
            acc += part * sc;
            am += std::fabs(part) * sc;
          }
          ref[size_t(t) * n + row] = acc;
          mag[size_t(t) * n + row] = am;
        }
      }
      for (const Fp8Gemv* g : {&auto_plan, &piped}) {
        const GemvRun r = run_gemv(*g, w, ws, codes, scales, m);
        double err2 = 0, ref2 = 0, worst = 0;
        for (size_t i = 0; i < ref.size(); ++i) {
          const float got = r.out[i];
          ASSERT_TRUE(std::isfinite(got))
              << "unwritten or NaN output at token " << i / n << " row " << i % n
              << (g->resident() ? " (resident)" : " (pipelined)");
          ASSERT_EQ(r.out_bf16[i], core::float_to_bf16(got));
          const double e = std::fabs(double(got) - ref[i]);
          // fp32 accumulation over <= 256 K blocks plus the tensor core's sum of a block's 32
          // exact products (observed on H200: <= 2e-6 of sum|terms|, i.e. fp32-like).
          ASSERT_LE(e, 0x1p-16 * mag[i] + 1e-30)
              << "n=" << n << " k=" << k << " m=" << m << " t=" << i / n << " row=" << i % n
              << " ref=" << ref[i] << (g->resident() ? " (resident)" : " (pipelined)");
          worst = std::max(worst, mag[i] > 0 ? e / mag[i] : 0.0);
          err2 += e * e;
          ref2 += ref[i] * ref[i];
        }
        const double rel = std::sqrt(err2 / std::max(ref2, 1e-300));
        std::printf(
            "fp8_gemv n=%d k=%d m=%d %s splits=%d x %d K blocks cluster=%d: |err|/|ref| = %.3g, "
            "max err/sum|terms| = %.3g\n",
            n, k, m, g->resident() ? "resident" : "pipelined", g->splits(), g->kb_per_split(),
            g->cluster(), rel, worst);
        EXPECT_LE(rel, 1e-6);
      }
    }
  }
}

// spec == plain: the same input row gives bitwise identical outputs for M = 1..8 and in any
// column position.
TEST(CudaFp8Gemv, RowResultIndependentOfM) {
  UF_REQUIRE_GPU();
  const int sms = device_sm_count();
  std::mt19937 rng(13);
  for (const auto& s : {std::pair{5120, 1024}, std::pair{256, 8192}, std::pair{5120, 288}})
    for (const Fp8GemvPath path : {Fp8GemvPath::kAuto, Fp8GemvPath::kPipelined}) {
      const int n = s.first, k = s.second;
      const Problem p = random_problem(n, k, rng);
      DeviceBuffer<uint8_t> w(p.w), ws(p.ws);
      Fp8Gemv g(n, k, sms, path);
      SCOPED_TRACE(g.resident() ? "resident" : "pipelined");
      const auto x = random_activations(8, k, rng);
      std::vector<uint8_t> codes;
      std::vector<float> scales;
      cpu_quant(x, 8, k, codes, scales);
      const GemvRun full = run_gemv(g, w, ws, codes, scales, 8);
      for (int m = 1; m <= 8; ++m) {
        const GemvRun r = run_gemv(g, w, ws, codes, scales, m);  // the first m rows
        for (size_t i = 0; i < r.out.size(); ++i)
          ASSERT_TRUE(bits_equal(r.out[i], full.out[i])) << "m=" << m << " i=" << i;
      }
      for (int row = 0; row < 8; ++row) {  // row alone, in column 0
        std::vector<uint8_t> c1(codes.begin() + size_t(row) * k,
                                codes.begin() + size_t(row + 1) * k);
        std::vector<float> s1(scales.begin() + size_t(row) * (k / 32),
                              scales.begin() + size_t(row + 1) * (k / 32));
        const GemvRun r = run_gemv(g, w, ws, c1, s1, 1);
        for (int i = 0; i < n; ++i)
          ASSERT_TRUE(bits_equal(r.out[i], full.out[size_t(row) * n + i])) << "row=" << row;
      }
    }
}

// The plan picks the resident kernel for every decode weight of a TP8 rank (H200: 132 SMs) and
// the pipelined one for Engram's wkv and the large prefill-like shapes.
TEST(CudaFp8Gemv, ResidentPlanForDecodeShapes) {
  UF_REQUIRE_GPU();
  const int sms = device_sm_count();
  const int resident[][2] = {{1280, 5120}, {512, 5120}, {4096, 1280}, {512, 1280},
                             {5120, 1024}, {288, 5120}, {5120, 288}};
  for (const auto& s : resident) {
    const Fp8Gemv g(s[0], s[1], sms);
    std::printf("fp8_gemv plan [%d, %d]: %s, %d splits x %d K blocks, cluster %d, %d blocks/SM\n",
                s[0], s[1], g.resident() ? "resident" : "pipelined", g.splits(), g.kb_per_split(),
                g.cluster(), g.blocks_per_sm(true));
    if (sms >= 132) {
      EXPECT_TRUE(g.resident()) << "[" << s[0] << ", " << s[1] << "]";
    }
    if (g.resident()) {
      EXPECT_GE(g.blocks_per_sm(true), 2) << "[" << s[0] << ", " << s[1] << "]";
      EXPECT_LE(g.cluster(), 8);
      EXPECT_LE(g.kb_per_split(), 6);
      EXPECT_EQ(g.splits(), (s[1] / 32 + g.kb_per_split() - 1) / g.kb_per_split());
    }
  }
  for (const auto& s : {std::pair{25600, 6144}, std::pair{32768, 1280}, std::pair{128, 16384}}) {
    const Fp8Gemv g(s.first, s.second, sms);
    EXPECT_FALSE(g.resident()) << "[" << s.first << ", " << s.second << "]";
  }
}

}  // namespace
}  // namespace uf::cuda::test
