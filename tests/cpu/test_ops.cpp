// Unit tests of the CPU backend's ops against hand-computed or fp64 values.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "core/dtypes.h"
#include "core/quant.h"
#include "cpu/attention.h"
#include "cpu/compressor.h"
#include "cpu/indexer.h"
#include "cpu/linear.h"
#include "cpu/mhc.h"
#include "cpu/model_types.h"
#include "cpu/norm.h"
#include "cpu/session.h"
#include "test_util.h"

namespace uf::cpu {
namespace {

using testing::bf16_weight;
using testing::f32_weight;
using testing::fp8_weight;

// fp64 Sinkhorn with the reference's exact sequence (softmax rows + eps, column norm, then
// iters-1 x (row norm, column norm)).
void sinkhorn_f64(const std::vector<double>& m, int hc, int iters, double eps,
                  std::vector<double>& comb) {
  comb.assign(size_t(hc * hc), 0);
  for (int j = 0; j < hc; ++j) {
    double mx = -1e300, s = 0;
    for (int k = 0; k < hc; ++k) mx = std::max(mx, m[size_t(j * hc + k)]);
    for (int k = 0; k < hc; ++k) s += std::exp(m[size_t(j * hc + k)] - mx);
    for (int k = 0; k < hc; ++k)
      comb[size_t(j * hc + k)] = std::exp(m[size_t(j * hc + k)] - mx) / s + eps;
  }
  auto cols = [&] {
    for (int k = 0; k < hc; ++k) {
      double s = eps;
      for (int j = 0; j < hc; ++j) s += comb[size_t(j * hc + k)];
      for (int j = 0; j < hc; ++j) comb[size_t(j * hc + k)] /= s;
    }
  };
  auto rows = [&] {
    for (int j = 0; j < hc; ++j) {
      double s = eps;
      for (int k = 0; k < hc; ++k) s += comb[size_t(j * hc + k)];
      for (int k = 0; k < hc; ++k) comb[size_t(j * hc + k)] /= s;
    }
  };
  cols();
  for (int i = 0; i < iters - 1; ++i) {
    rows();
    cols();
  }
}

TEST(CpuMhc, SinkhornMatchesFp64AndIsDoublyStochastic) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0, 2);
  HcParams p{4, 8, 20, 1e-20f, 1e-6f};
  const int mix = (2 + p.hc) * p.hc;
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> m(static_cast<size_t>(mix)), scale = {0.7f, 1.3f, 0.9f},
                                                    base(static_cast<size_t>(mix));
    for (auto& v : m) v = nd(rng);
    for (auto& v : base) v = nd(rng) * 0.5f;
    std::vector<float> pre(4), post(4), comb(16);
    hc_split_sinkhorn(p, m.data(), scale.data(), base.data(), pre.data(), post.data(), comb.data());
    std::vector<double> logits(16), ref;
    for (int i = 0; i < 16; ++i)
      logits[size_t(i)] = double(m[size_t(8 + i)] * scale[2] + base[size_t(8 + i)]);
    sinkhorn_f64(logits, 4, 20, 1e-6, ref);
    for (int i = 0; i < 16; ++i) EXPECT_NEAR(comb[size_t(i)], ref[size_t(i)], 2e-6) << i;
    // Ends on a column normalisation: columns sum to 1 (up to eps), rows nearly so.
    for (int k = 0; k < 4; ++k) {
      double cs = 0, rs = 0;
      for (int j = 0; j < 4; ++j) cs += comb[size_t(j * 4 + k)], rs += comb[size_t(k * 4 + j)];
      EXPECT_NEAR(cs, 1.0, 1e-5);
      EXPECT_NEAR(rs, 1.0, 5e-2);  // 20 iterations leave peaked inputs slightly off
    }
    for (int i = 0; i < 4; ++i) {
      const double pr =
          1 / (1 + std::exp(-double(m[size_t(i)] * scale[0] + base[size_t(i)]))) + 1e-6;
      const double po =
          2 / (1 + std::exp(-double(m[size_t(4 + i)] * scale[1] + base[size_t(4 + i)])));
      EXPECT_NEAR(pre[size_t(i)], pr, 1e-6);
      EXPECT_NEAR(post[size_t(i)], po, 2e-6);
    }
  }
}

TEST(CpuMhc, PreAndPostFollowTheReferenceFormulas) {
  HcParams p{2, 3, 1, 1e-20f, 0};
  // X = two copies of 3 channels; pre = [0.25, 0.75].
  const std::vector<float> X = {1, 2, 3, 5, 6, 7}, pre = {0.25f, 0.75f};
  std::vector<float> y(3);
  hc_pre(p, X.data(), pre.data(), 1, y.data());
  EXPECT_FLOAT_EQ(y[0], 4.0f);
  EXPECT_FLOAT_EQ(y[1], 5.0f);
  EXPECT_FLOAT_EQ(y[2], 6.0f);
  // out[k] = post[k] * x + sum_j comb[j,k] * R[j]
  const std::vector<float> x = {1, 1, 1}, post = {2, 0}, comb = {1, 0, 0.5f, 1};
  std::vector<float> out(6);
  hc_post(p, x.data(), X.data(), post.data(), comb.data(), 1, out.data());
  EXPECT_FLOAT_EQ(out[0], 2 + 1 + 0.5f * 5);   // copy 0: 2*1 + 1*R0 + 0.5*R1
  EXPECT_FLOAT_EQ(out[3], 0 + 0 * 1 + 1 * 5);  // copy 1: R1
}

// sum_squares_torch follows torch's cascade sum, not merely some accurate order: one square of
// 2^24 among ones makes every order visible, since 2^24 + 1 rounds back to 2^24 (ties to even)
// while 2^24 + 16 is exact. Expected values worked by hand from the cascade (cpu/norm.h).
TEST(CpuNorm, SumSquaresFollowsTorchCascade) {
  const float big = 16777216.0f;  // 2^24 = 4096^2
  // n = 1024: 128 vectors of 8 = 32 quads = two runs of level_step 16. Lane 0 of accumulator 0
  // holds 4096^2 in run 1 and loses its 15 other ones; run 2 restarts from 0 (16, exact), so
  // lane 0 ends 2^24 + 16 + 3 * 32, the 7 other lanes 128 each: 2^24 + 1008. (Exact sum
  // 2^24 + 1023 -> 2^24 + 1024; sequential: 2^24; 8-lane dot with a pairwise finish: 2^24 + 896.)
  std::vector<float> x(1024, 1.0f);
  x[0] = 4096.0f;
  EXPECT_EQ(sum_squares_torch(x.data(), 1024), big + 1008.0f);
  // n = 20: two vectors and a scalar tail of 4, the tail added first: 4096^2 + 1 + 1 + 1 = 2^24,
  // then the 8 lanes of 2 each: 2^24 + 16 (exact: 2^24 + 19 -> 2^24 + 20).
  std::vector<float> y(20, 1.0f);
  y[16] = 4096.0f;
  EXPECT_EQ(sum_squares_torch(y.data(), 20), big + 16.0f);
  // Small values: the plain sum.
  std::vector<float> z(37);
  std::iota(z.begin(), z.end(), 1.0f);
  EXPECT_EQ(sum_squares_torch(z.data(), 37), 37.0f * 38.0f * 75.0f / 6.0f);
}

TEST(CpuRope, YarnTableMatchesHandComputedRamp) {
  // Released values: 64 rotated channels, theta 160000, original length 65536, factor 16,
  // beta 32 / 1. corr(32) = 15.45 -> low 15; corr(1) = 24.71 -> high 25.
  Rope r(64, 160000, 65536, 16, 32, 1);
  for (int i = 0; i < 32; ++i) {
    const double base = std::pow(160000.0, -2.0 * i / 64);
    const double ramp = std::clamp((i - 15.0) / 10.0, 0.0, 1.0);
    const double want = base / 16 * ramp + base * (1 - ramp);
    EXPECT_NEAR(r.freqs()[size_t(i)], want, want * 2e-6) << i;
  }
  EXPECT_FLOAT_EQ(r.freqs()[0], 1.0f);
  Rope plain(64, 10000, 0, 16, 32, 1);
  EXPECT_NEAR(plain.freqs()[31], std::pow(10000.0, -62.0 / 64), 1e-9);
}

TEST(CpuRope, RotationAndInverseOnTheTailOnly) {
  Rope r(4, 10000, 0, 1, 32, 1);
  std::vector<float> v = {0.5f, -1.0f, 1.0f, 0.0f, 0.0f, 2.0f};
  const auto orig = v;
  r.apply(v.data(), 6, 3);
  EXPECT_EQ(v[0], orig[0]);
  EXPECT_EQ(v[1], orig[1]);
  // pair 0 at position 3 rotates by angle 3 * 1.0
  EXPECT_NEAR(v[2], std::cos(3.0), 1e-2);
  EXPECT_NEAR(v[3], std::sin(3.0), 1e-2);
  r.apply(v.data(), 6, 3, /*inverse=*/true);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(v[size_t(i)], orig[size_t(i)], 2e-2);
}

TEST(CpuCompressor, SoftmaxPoolingHandComputed) {
  // Two tokens, two channels. Channel 0: scores (0, ln 3) -> weights (1/4, 3/4).
  const float k0[2] = {1, 10}, k1[2] = {3, 20}, s0[2] = {0, 5}, s1[2] = {std::log(3.0f), 5};
  const float* kv[2] = {k0, k1};
  const float* sc[2] = {s0, s1};
  float out[2];
  compress_pool(kv, sc, 2, 2, out);
  EXPECT_NEAR(out[0], 0.25 * 1 + 0.75 * 3, 1e-6);
  EXPECT_NEAR(out[1], 15.0, 1e-5);  // equal scores: the mean
}

TEST(CpuIndexer, TopkWithTiesPrefersLowerPositionsAndObeysTheTieRule) {
  const std::vector<float> s = {1, 3, 3, 2, 3, -INFINITY};
  int32_t out[2];
  topk_select(s.data(), 6, 2, 6, out);
  EXPECT_EQ(out[0], 1);
  EXPECT_EQ(out[1], 2);
  // {score > v} is inside the selection, the selection inside {score >= v}.
  int32_t out3[4];
  topk_select(s.data(), 6, 4, 6, out3);
  const std::vector<int32_t> want = {1, 2, 3, 4};
  EXPECT_EQ(std::vector<int32_t>(out3, out3 + 4), want);
  // Positions at or past compress_len become -1 and sort last.
  int32_t out6[6];
  topk_select(s.data(), 6, 6, 5, out6);
  EXPECT_EQ(out6[5], -1);
  EXPECT_EQ(out6[0], 0);
}

TEST(CpuIndexer, ScoresAreBf16RoundedReluWeightedSums) {
  // 2 heads x 2 dims, 3 keys; the third is not visible.
  const std::vector<float> q = {1, 2, -1, 0.5f}, w = {0.5f, 2.0f};
  const std::vector<float> keys = {1, 1, 2, -1, 0, 0};
  std::vector<float> score(3);
  index_scores_row(q.data(), w.data(), 2, 2, keys.data(), 2, 3, score.data());
  // key0: head0 3 -> 1.5; head1 -0.5 -> relu 0.  key1: head0 0 -> 0; head1 -2.5 -> 0.
  EXPECT_FLOAT_EQ(score[0], 1.5f);
  EXPECT_FLOAT_EQ(score[1], 0.0f);
  EXPECT_TRUE(std::isinf(score[2]) && score[2] < 0);
}

// The property the CUDA backend's tensor-core index scores rest on (ops/index_scores_mma.cu):
// a head's dot product of 128 FP4 QDQ values (E2M1 times a power-of-two scale per 32, the model's
// index q and keys) is exact in fp32 whatever the order of its additions while the products'
// scales (q's block scale times k's) span at most 9 binades: a block's sum is an integer below
// 2^13 in units of its scale / 4, so the whole sum needs at most 15 + span bits. Then dot_f32
// (the CPU's lane order) equals the exact sum. Far past that span the fp32 sums round.
TEST(CpuIndexer, Fp4QdqDotProductsAreExactInFp32) {
  static const float kE2M1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  std::mt19937 rng(77);
  std::uniform_int_distribution<int> code(0, 15);
  auto vec = [&](int spread) {  // 4 blocks of 32 E2M1 values, block b times 2^(0..spread)
    std::uniform_int_distribution<int> sh(0, spread);
    std::vector<float> v(128);
    for (int b = 0; b < 4; ++b) {
      const int e = sh(rng);
      for (int i = 0; i < 32; ++i) {
        const int c = code(rng);
        v[size_t(b * 32 + i)] = std::ldexp((c & 8) ? -kE2M1[c & 7] : kE2M1[c & 7], e);
      }
    }
    return v;
  };
  auto inexact = [&](int spread, int trials) {
    int n = 0;
    for (int k = 0; k < trials; ++k) {
      const std::vector<float> q = vec(spread), key = vec(spread);
      double exact = 0.0;  // every product and partial sum is exact in fp64 here
      for (int i = 0; i < 128; ++i) exact += double(q[size_t(i)]) * double(key[size_t(i)]);
      n += double(dot_f32(q.data(), key.data(), 128)) != exact;
    }
    return n;
  };
  EXPECT_EQ(inexact(4, 20000), 0) << "product scales within 8 binades: every fp32 dot is exact";
  EXPECT_GT(inexact(20, 2000), 0) << "product scales up to 40 binades apart: some dots round";
}

TEST(CpuIndexer, CandidateBlocksPinTheNewestBlock) {
  // 10 positions in blocks of 4 (the last block holds 2); keep 1 block + the pinned newest.
  const std::vector<float> s = {9, 0, 0, 0, 1, 1, 1, 1, 0.5f, -INFINITY};
  std::vector<uint8_t> keep(10);
  candidate_mask(s.data(), 10, 9, 1, 4, keep.data());
  // Only one block fits: the pinned newest (position 8 -> block 2) beats block 0's 9.
  const std::vector<uint8_t> want = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1};
  EXPECT_EQ(keep, want);
  candidate_mask(s.data(), 10, 9, 2, 4, keep.data());
  const std::vector<uint8_t> want2 = {1, 1, 1, 1, 0, 0, 0, 0, 1, 1};
  EXPECT_EQ(keep, want2);
}

TEST(CpuAttention, MatchesFp64SoftmaxWithSinkAcrossBlocks) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0, 1);
  const int H = 2, hd = 16, n = 150;  // 3 blocks of 64
  std::vector<float> q(size_t(H * hd)), kv(size_t(n * hd));
  for (auto& v : q) v = core::round_bf16(nd(rng));
  for (auto& v : kv) v = core::round_bf16(nd(rng));
  std::vector<const float*> slots;
  for (int i = 0; i < n; ++i) slots.push_back(i % 7 == 3 ? nullptr : kv.data() + i * hd);
  const float sink[2] = {0.3f, -1.0f};
  std::vector<float> out(size_t(H * hd));
  const float scale = 0.25f;
  sparse_attn_row(q.data(), H, hd, slots.data(), n, sink, scale, out.data());
  for (int h = 0; h < H; ++h) {
    std::vector<double> s;
    double mx = sink[h];
    for (int i = 0; i < n; ++i) {
      if (!slots[size_t(i)]) continue;
      double d = 0;
      for (int c = 0; c < hd; ++c) d += double(q[size_t(h * hd + c)]) * kv[size_t(i * hd + c)];
      s.push_back(d * scale);
      mx = std::max(mx, d * scale);
    }
    double den = std::exp(sink[h] - mx);
    for (double v : s) den += std::exp(v - mx);
    for (int c = 0; c < hd; ++c) {
      double num = 0;
      int j = 0;
      for (int i = 0; i < n; ++i)
        if (slots[size_t(i)]) num += std::exp(s[size_t(j++)] - mx) * kv[size_t(i * hd + c)];
      // bf16 probabilities and a bf16 output: about 2^-8 relative.
      EXPECT_NEAR(out[size_t(h * hd + c)], num / den, 1e-2 + 1e-2 * std::fabs(num / den));
    }
  }
  // A row with no valid slot gives exactly 0.
  std::vector<const float*> none(10, nullptr);
  sparse_attn_row(q.data(), H, hd, none.data(), 10, sink, scale, out.data());
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

class CpuLinearK : public ::testing::TestWithParam<int> {};

// K = 512, 128, 96, 416 exercise the AVX2 kernel's 8-block groups, 4-block groups, the scalar
// tail and all three together.
TEST_P(CpuLinearK, Fp8GemmFollowsBlockAccumulationAndSimdIsBitwiseEqual) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0, 1);
  const int N = 40, K = GetParam(), T = 70;
  std::vector<float> wv(static_cast<size_t>(N * K)), x(static_cast<size_t>(T * K));
  for (auto& v : wv) v = nd(rng) * 0.05f;
  for (auto& v : x) v = core::round_bf16(nd(rng));
  auto W = fp8_weight(N, K, wv);
  std::vector<float> y(static_cast<size_t>(T * N)), y2(static_cast<size_t>(T * N));
  set_simd_kernels(true);
  linear_quant(W.w, x.data(), T, y.data());
  set_simd_kernels(false);
  linear_quant(W.w, x.data(), T, y2.data());
  set_simd_kernels(true);
  EXPECT_EQ(0, std::memcmp(y.data(), y2.data(), y.size() * 4));
  // fp64 reference of the same quantised operands.
  for (int t = 0; t < T; t += 7)
    for (int n = 0; n < N; n += 3) {
      double acc = 0;
      for (int kb = 0; kb < K / 32; ++kb) {
        uint8_t codes[32];
        const float s = core::quantize_fp8_block(x.data() + t * K + kb * 32, 32, codes);
        for (int i = 0; i < 32; ++i)
          acc += double(core::e4m3_to_float(codes[i])) * s * W.w.at(n, kb * 32 + i);
      }
      EXPECT_NEAR(y[static_cast<size_t>(t * N + n)], acc, 1e-2 * std::fabs(acc) + 1e-3);
    }
  // A row's result does not depend on how many rows are batched with it.
  std::vector<float> one(static_cast<size_t>(N));
  linear_quant(W.w, x.data() + 5 * K, 1, one.data());
  EXPECT_EQ(0, std::memcmp(one.data(), y.data() + 5 * N, static_cast<size_t>(N) * 4));
}

INSTANTIATE_TEST_SUITE_P(K, CpuLinearK, ::testing::Values(512, 128, 96, 416));

TEST(CpuLinear, Bf16AndF32Paths) {
  auto W = bf16_weight(2, 3, {1, 2, 3, -1, 0.5f, 0.25f});
  const std::vector<float> x = {1, 1, 2};
  std::vector<float> y(2);
  linear(W.w, x.data(), 1, y.data());
  EXPECT_FLOAT_EQ(y[0], 9);
  EXPECT_FLOAT_EQ(y[1], 0);
  auto F = f32_weight(1, 3, {0.1f, 0.2f, 0.3f});
  linear_f32(F.w, x.data(), 1, y.data());
  EXPECT_NEAR(y[0], 0.9f, 1e-6);
}

TEST(CpuSession, WindowRingWrapsAroundAndTagsPositions) {
  PosRing ring;
  ring.init(8 + 2, 3);  // window 8 + 2 verify rows
  for (int64_t p = 0; p < 25; ++p) {
    float* v = ring.put(p);
    for (int c = 0; c < 3; ++c) v[c] = float(p * 10 + c);
  }
  // The last 10 positions are present; older ones were overwritten by position tag.
  for (int64_t p = 15; p < 25; ++p) {
    const float* v = ring.get(p);
    ASSERT_NE(v, nullptr) << p;
    EXPECT_EQ(v[1], float(p * 10 + 1));
  }
  EXPECT_EQ(ring.get(14), nullptr);
  EXPECT_EQ(ring.get(5), nullptr);
  EXPECT_EQ(ring.get(-1), nullptr);
  // A rejected verify row writes position 25 over 15; re-writing 25 later gives the right value,
  // and 16.. (still inside a window of 8 for queries >= 24) are untouched.
  ring.put(25)[0] = -1;
  EXPECT_EQ(ring.get(15), nullptr);
  EXPECT_EQ(ring.get(16)[0], 160.0f);
}

}  // namespace
}  // namespace uf::cpu
