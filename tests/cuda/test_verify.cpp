// On-device speculative verification (src/cuda/verify.h) against the CPU path of src/sampling:
// logits_to_probs on every row, then sampling::verify with make_verify_draws(seed, step).
//
// What must be bitwise equal, and why:
//   - the device verifier on given p, q rows vs sampling::verify on the same rows: identical
//     operation order (row_ops.h lanes and tree, sequential walks), so tau, the extra token and
//     every diagnostic (weight, threshold, residual mass) must match bit for bit;
//   - the draws: integer Philox and an exact uniform conversion;
//   - the whole pipeline from logits: the CPU transform (sampling/transform.cpp) and the device
//     both compute exp in double rounded once to float, so the rows match bitwise except where
//     the two double exps straddle a float rounding midpoint (~2^-28 of arguments). The
//     "exact" cases still nudge logits whose float exp is ambiguous, so they cannot flake.
// On raw logits (no nudging) the rows are checked to 1e-6 relative, the device verification is
// checked bitwise against the CPU verification of the device's own rows, and the number of
// end-to-end disagreements (expected 0) is printed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "cuda/verify.h"
#include "cuda_test_util.h"
#include "sampling/rng.h"
#include "sampling/sampler.h"
#include "sampling/transform.h"
#include "sampling/verify.h"

namespace uf::cuda::test {
namespace {

using sampling::kMaxDraft;
using sampling::SamplingParams;
using sampling::VerifyDraws;
using sampling::VerifyMode;
using sampling::VerifyResult;

constexpr int kRealVocab = 129280;

template <typename T>
std::vector<T> download(const T* device, size_t n) {
  std::vector<T> v(n);
  if (n) UF_CUDA_CHECK(cudaMemcpy(v.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

const char* mode_name(VerifyMode m) { return m == VerifyMode::kBlock ? "block" : "token-wise"; }

std::string params_name(const SamplingParams& p) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "T=%g top_p=%g top_k=%d", double(p.temperature), double(p.top_p),
                p.top_k);
  return buf;
}

// Empty when equal (bitwise for the floats), else the first difference.
std::string diff_results(const VerifyResult& dev, const VerifyResult& cpu) {
  char buf[256];
  if (dev.accepted != cpu.accepted || dev.extra_token != cpu.extra_token) {
    std::snprintf(buf, sizeof(buf), "tau/extra device %d/%d cpu %d/%d", dev.accepted,
                  dev.extra_token, cpu.accepted, cpu.extra_token);
    return buf;
  }
  for (int i = 0; i <= kMaxDraft; ++i) {
    const float* d[3] = {dev.weight, dev.threshold, dev.residual_mass};
    const float* c[3] = {cpu.weight, cpu.threshold, cpu.residual_mass};
    const char* names[3] = {"weight", "threshold", "residual_mass"};
    for (int k = 0; k < 3; ++k) {
      if (!bits_equal(d[k][i], c[k][i])) {
        std::snprintf(buf, sizeof(buf), "%s[%d] device %.9g cpu %.9g (diff %.3g)", names[k], i,
                      double(d[k][i]), double(c[k][i]), double(d[k][i]) - double(c[k][i]));
        return buf;
      }
    }
  }
  return "";
}

// True when exp(z) rounds to the same float whatever accurate method computes it: glibc's expf
// (the CPU transform) agrees with float(exp(double(z))), and the double result lies more than 4
// double ulps from a float rounding midpoint, so the device's double exp (within 1 ulp) rounds
// the same way too.
bool exp_is_unambiguous(float z) {
  const double y = std::exp(double(z));
  const float f = float(y);
  if (std::exp(z) != f) return false;
  const double up = double(std::nextafter(f, INFINITY));
  const double down = double(std::nextafter(f, -INFINITY));
  const double ulp = std::nextafter(y, INFINITY) - y;
  const double mid_hi = (double(f) + up) / 2, mid_lo = (double(f) + down) / 2;
  return std::fabs(y - mid_hi) > 4 * ulp && std::fabs(y - mid_lo) > 4 * ulp;
}

// Lowers, by one ulp at a time, every logit whose argument (l - m) / T is not unambiguous (about
// 6e-4 of them; the maximum has argument 0 and stays), so that the CPU's exp equals the device's.
void nudge_for_exact_exp(float* l, int vocab, float temperature) {
  float m = l[0];
  for (int x = 1; x < vocab; ++x) m = std::max(m, l[x]);
  for (int x = 0; x < vocab; ++x) {
    if (l[x] == m) continue;
    while (!exp_is_unambiguous((l[x] - m) / temperature)) l[x] = std::nextafter(l[x], -INFINITY);
  }
}

struct CaseInput {
  int vocab = 0, g = 0;
  uint64_t seed = 0, step = 0;
  SamplingParams params;
  std::vector<float> target_logits, draft_logits;  // [(g + 1), V], [g, V]
  std::vector<float> p, q;                         // CPU transforms
  std::vector<int32_t> tokens;                     // X_i sampled from q_i as the engine does
};

// Target and draft logits share a base row so that acceptance is neither ~0 nor ~1.
CaseInput make_case(int vocab, int g, uint64_t seed, uint64_t step, const SamplingParams& params,
                    bool exact_exp) {
  CaseInput c;
  c.vocab = vocab;
  c.g = g;
  c.seed = seed;
  c.step = step;
  c.params = params;
  std::mt19937 rng(uint32_t(seed * 7919 + step * 131 + uint64_t(vocab) + uint64_t(g) * 17));
  std::normal_distribution<float> base_d(0.0f, 2.0f), noise(0.0f, 0.6f);
  std::vector<float> base(vocab);
  for (float& b : base) b = base_d(rng);
  const size_t V = size_t(vocab);
  c.target_logits.resize(size_t(g + 1) * V);
  c.draft_logits.resize(size_t(g) * V);
  for (size_t i = 0; i < c.target_logits.size(); ++i) c.target_logits[i] = base[i % V] + noise(rng);
  for (size_t i = 0; i < c.draft_logits.size(); ++i) c.draft_logits[i] = base[i % V] + noise(rng);
  if (exact_exp && !params.greedy()) {
    for (int r = 0; r <= g; ++r)
      nudge_for_exact_exp(&c.target_logits[r * V], vocab, params.temperature);
    for (int r = 0; r < g; ++r)
      nudge_for_exact_exp(&c.draft_logits[r * V], vocab, params.temperature);
  }
  std::vector<float> scratch(V);
  c.p.resize(c.target_logits.size());
  c.q.resize(c.draft_logits.size());
  for (int r = 0; r <= g; ++r) {
    sampling::logits_to_probs(&c.target_logits[r * V], vocab, params, &c.p[r * V], scratch.data());
  }
  for (int r = 0; r < g; ++r) {
    sampling::logits_to_probs(&c.draft_logits[r * V], vocab, params, &c.q[r * V], scratch.data());
    const float u = sampling::stream_uniform(seed, step, sampling::RngPurpose::kDraft, uint32_t(r));
    c.tokens.push_back(sampling::sample_from_probs(&c.q[r * V], vocab, u));
  }
  return c;
}

VerifyResult cpu_verify(VerifyMode mode, const CaseInput& c, const float* p, const float* q) {
  sampling::VerifyRows rows;
  rows.num_drafts = c.g;
  rows.vocab = c.vocab;
  rows.target = p;
  rows.draft = q;
  rows.tokens = c.tokens.data();
  return sampling::verify(mode, rows, sampling::make_verify_draws(c.seed, c.step));
}

struct RowDiff {
  size_t bit_diffs = 0, support_diffs = 0, first = size_t(-1);
  double max_rel = 0;
  size_t nan = 0;
};

RowDiff compare_rows(const std::vector<float>& dev, const std::vector<float>& cpu) {
  RowDiff d;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (std::isnan(dev[i])) ++d.nan;
    if (bits_equal(dev[i], cpu[i])) continue;
    if (d.first == size_t(-1)) d.first = i;
    ++d.bit_diffs;
    if ((dev[i] > 0) != (cpu[i] > 0)) ++d.support_diffs;
    const double rel = std::fabs(double(dev[i]) - double(cpu[i])) / std::max(double(cpu[i]), 1e-30);
    d.max_rel = std::max(d.max_rel, rel);
  }
  return d;
}

struct Counters {
  int cases = 0, end_to_end_mismatch = 0;
};

// Runs one case on the device in both modes and checks it; exact = the rows must be bitwise equal.
void run_case(const VerifyPlan& plan, const CaseInput& c, bool exact, Counters& counters) {
  const size_t V = size_t(c.vocab);
  DeviceBuffer<float> tl(c.target_logits);
  DeviceBuffer<float> dl(std::max<size_t>(c.draft_logits.size(), 1));
  if (!c.draft_logits.empty()) dl.upload(c.draft_logits);
  DeviceBuffer<int32_t> tokens(std::max<size_t>(c.tokens.size(), 1));
  if (!c.tokens.empty()) tokens.upload(c.tokens);
  DeviceBuffer<unsigned long long> seed_step(std::vector<unsigned long long>{c.seed, c.step});
  DeviceBuffer<VerifyResult> out(1);
  const std::string what = "V=" + std::to_string(c.vocab) + " g=" + std::to_string(c.g) +
                           " seed=" + std::to_string(c.seed) + " step=" + std::to_string(c.step) +
                           " " + params_name(c.params);
  for (VerifyMode mode : {VerifyMode::kTokenWise, VerifyMode::kBlock}) {
    UF_CUDA_CHECK(cudaMemset(plan.target_probs(), 0xFF, size_t(kMaxDraft + 1) * V * sizeof(float)));
    UF_CUDA_CHECK(cudaMemset(plan.draft_probs(), 0xFF, size_t(kMaxDraft) * V * sizeof(float)));
    out.poison();
    verify_on_device(plan, mode, tl.get(), dl.get(), tokens.get(), c.g, c.vocab, c.params,
                     seed_step.get(), out.get(), nullptr);
    sync_and_check();
    const VerifyResult dev = out.download()[0];
    const std::vector<float> p_dev = download(plan.target_probs(), size_t(c.g + 1) * V);
    const std::vector<float> q_dev = download(plan.draft_probs(), size_t(c.g) * V);
    const RowDiff dp = compare_rows(p_dev, c.p), dq = compare_rows(q_dev, c.q);
    ++counters.cases;
    const std::string where = what + " " + mode_name(mode);

    ASSERT_EQ(dp.nan + dq.nan, 0u) << where << ": NaN in the device rows";
    if (exact) {
      EXPECT_EQ(dp.bit_diffs + dq.bit_diffs, 0u)
          << where << ": device rows differ from logits_to_probs; first p index " << dp.first
          << (dp.first != size_t(-1) ? " device " + std::to_string(p_dev[dp.first]) + " cpu " +
                                           std::to_string(c.p[dp.first])
                                     : std::string())
          << ", first q index " << dq.first << ", max rel " << std::max(dp.max_rel, dq.max_rel);
    } else {
      // 1 ulp in exp (glibc's expf misrounding) plus the normaliser's rounding: a few ulp
      // (~2e-7 relative); 1e-6 leaves margin. The survivor set may differ only if a top-p cut
      // sits within that rounding of the limit, which these random rows make very unlikely.
      EXPECT_LE(std::max(dp.max_rel, dq.max_rel), 1e-6) << where;
      EXPECT_EQ(dp.support_diffs + dq.support_diffs, 0u) << where << ": survivor sets differ";
    }
    // The verifier itself: bitwise the CPU's on the rows the device produced.
    const VerifyResult cpu_on_dev_rows = cpu_verify(mode, c, p_dev.data(), q_dev.data());
    const std::string d1 = diff_results(dev, cpu_on_dev_rows);
    EXPECT_TRUE(d1.empty()) << where << ": device verify != CPU verify on the device rows: " << d1;
    // End to end: the CPU path from the logits.
    const VerifyResult cpu = cpu_verify(mode, c, c.p.data(), c.q.data());
    const std::string d2 = diff_results(dev, cpu);
    if (!d2.empty()) {
      ++counters.end_to_end_mismatch;
      if (exact) {
        ADD_FAILURE() << where << ": device != CPU path from logits: " << d2;
      } else {
        std::printf(
            "[info] %s: end-to-end differs through 1-ulp row differences (%zu p, %zu q "
            "entries): %s\n",
            where.c_str(), dp.bit_diffs, dq.bit_diffs, d2.c_str());
      }
    }
  }
}

const SamplingParams kParams[] = {
    {0.0f, 1.0f, 0},    // greedy
    {0.7f, 0.9f, 0},    // temperature + top-p
    {1.0f, 1.0f, 50},   // top-k
    {1.0f, 1.0f, 0},    // plain softmax
    {1.3f, 0.95f, 20},  // both filters
};

void run_sweep(int vocab, const std::vector<int>& gs, const std::vector<uint64_t>& seeds,
               bool exact_exp) {
  VerifyPlan plan(vocab);
  Counters counters;
  for (const SamplingParams& params : kParams) {
    for (int g : gs) {
      for (uint64_t seed : seeds) {
        const uint64_t step = seed * 3 + uint64_t(g);
        const CaseInput c = make_case(vocab, g, seed, step, params, exact_exp);
        run_case(plan, c, exact_exp || params.greedy(), counters);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
  std::printf("[info] V=%d: %d cases, %d end-to-end disagreements%s\n", vocab, counters.cases,
              counters.end_to_end_mismatch, exact_exp ? "" : " (raw logits, 1-ulp exp rows)");
}

TEST(CudaVerify, ExactFromLogitsSmallVocab) {
  UF_REQUIRE_GPU();
  run_sweep(1000, {0, 1, 2, 3, 4, 5, 6, 7}, {1, 2, 0x9E3779B97F4A7C15ull}, true);
}

TEST(CudaVerify, ExactFromLogitsRealVocab) {
  UF_REQUIRE_GPU();
  run_sweep(kRealVocab, {0, 1, 3, 7}, {5, 0xFFFFFFFFFFFFFFFFull}, true);
}

TEST(CudaVerify, RawLogitsRealVocab) {
  UF_REQUIRE_GPU();
  run_sweep(kRealVocab, {2, 7}, {11, 12}, false);
}

TEST(CudaVerify, RawLogitsSmallVocab) {
  UF_REQUIRE_GPU();
  run_sweep(1000, {0, 3, 7}, {21, 22, 23}, false);
}

// The draws: make_verify_draws(seed, step) on the device, bitwise (integer Philox, exact uniform).
TEST(CudaVerify, DrawsMatchCpuStreams) {
  UF_REQUIRE_GPU();
  const std::vector<float> p = {0.25f, 0.75f};
  DeviceBuffer<float> dp(p);
  DeviceBuffer<VerifyResult> out(1);
  DeviceBuffer<VerifyDraws> used(1);
  DeviceBuffer<unsigned long long> ss(2);
  const VerifyPlan plan(2);
  for (uint64_t seed : {0ull, 1ull, 0xDEADBEEFCAFEBABEull, ~0ull}) {
    for (uint64_t step : {0ull, 1ull, 5ull, (1ull << 32) | 7ull, ~0ull}) {
      ss.upload({seed, step});
      used.poison();
      verify_probs_on_device(plan, VerifyMode::kBlock, dp.get(), nullptr, nullptr, 0, 2, ss.get(),
                             nullptr, out.get(), used.get(), nullptr);
      sync_and_check();
      const VerifyDraws d = used.download()[0];
      const VerifyDraws h = sampling::make_verify_draws(seed, step);
      for (int i = 0; i < kMaxDraft; ++i) {
        EXPECT_TRUE(bits_equal(d.eta[i], h.eta[i]))
            << "seed " << seed << " step " << step << " eta[" << i << "] device " << d.eta[i]
            << " cpu " << h.eta[i];
      }
      EXPECT_TRUE(bits_equal(d.u_extra, h.u_extra))
          << "seed " << seed << " step " << step << " u_extra device " << d.u_extra << " cpu "
          << h.u_extra;
      // g = 0 is plain sampling from p_0 with u_extra.
      EXPECT_EQ(out.download()[0].extra_token, h.u_extra <= 0.25f ? 0 : 1);
    }
  }
}

// serving-anchors.md §B.6 (tests/sampling/test_verify_vectors.cpp): V = 2, p = [1/3, 2/3],
// q = [2/3, 1/3], g = 2, every draft pair and a grid of explicit draws, plus the guard cases;
// the device must equal sampling::verify bitwise, and the hand-traced outcomes.
VerifyResult device_verify_explicit(VerifyMode mode, const std::vector<float>& p,
                                    const std::vector<float>& q, const std::vector<int32_t>& x,
                                    int vocab, const VerifyDraws& d) {
  DeviceBuffer<float> dp(p), dq(std::max<size_t>(q.size(), 1));
  if (!q.empty()) dq.upload(q);
  DeviceBuffer<int32_t> dx(std::max<size_t>(x.size(), 1));
  if (!x.empty()) dx.upload(x);
  DeviceBuffer<VerifyDraws> dd(std::vector<VerifyDraws>{d});
  DeviceBuffer<VerifyResult> out(1);
  out.poison();
  const VerifyPlan plan(vocab);
  verify_probs_on_device(plan, mode, dp.get(), q.empty() ? nullptr : dq.get(),
                         x.empty() ? nullptr : dx.get(), int(x.size()), vocab, nullptr, dd.get(),
                         out.get(), nullptr, nullptr);
  sync_and_check();
  return out.download()[0];
}

VerifyResult cpu_verify_explicit(VerifyMode mode, const std::vector<float>& p,
                                 const std::vector<float>& q, const std::vector<int32_t>& x,
                                 int vocab, const VerifyDraws& d) {
  sampling::VerifyRows rows;
  rows.num_drafts = int32_t(x.size());
  rows.vocab = vocab;
  rows.target = p.data();
  rows.draft = q.empty() ? nullptr : q.data();
  rows.tokens = x.empty() ? nullptr : x.data();
  return sampling::verify(mode, rows, d);
}

TEST(CudaVerify, ServingAnchorVectors) {
  UF_REQUIRE_GPU();
  const std::vector<float> p = {1.0f / 3, 2.0f / 3, 1.0f / 3, 2.0f / 3, 1.0f / 3, 2.0f / 3};
  const std::vector<float> q = {2.0f / 3, 1.0f / 3, 2.0f / 3, 1.0f / 3};
  const float grid[] = {0.01f, 0.2f, 1.0f / 3, 0.5f, 0.6f, 0.9f, 0.99f, 1.0f};
  for (int x1 : {0, 1}) {
    for (int x2 : {0, 1}) {
      for (float e1 : grid) {
        for (float e2 : grid) {
          for (float u : {0.2f, 0.5f, 0.9f}) {
            VerifyDraws d{};
            d.eta[0] = e1;
            d.eta[1] = e2;
            d.u_extra = u;
            for (VerifyMode mode : {VerifyMode::kTokenWise, VerifyMode::kBlock}) {
              const std::vector<int32_t> x = {x1, x2};
              const VerifyResult dev = device_verify_explicit(mode, p, q, x, 2, d);
              const VerifyResult cpu = cpu_verify_explicit(mode, p, q, x, 2, d);
              const std::string diff = diff_results(dev, cpu);
              ASSERT_TRUE(diff.empty()) << mode_name(mode) << " X=(" << x1 << "," << x2 << ") eta=("
                                        << e1 << "," << e2 << ") u=" << u << ": " << diff;
            }
          }
        }
      }
    }
  }
  // Hand-traced outcomes of test_verify_vectors.cpp.
  auto run = [&](VerifyMode m, int x1, int x2, float e1, float e2, float u) {
    VerifyDraws d{};
    d.eta[0] = e1;
    d.eta[1] = e2;
    d.u_extra = u;
    return device_verify_explicit(m, p, q, {x1, x2}, 2, d);
  };
  VerifyResult r = run(VerifyMode::kTokenWise, 0, 1, 0.9f, 0.99f, 0.2f);
  EXPECT_EQ(r.accepted, 0);
  EXPECT_EQ(r.extra_token, 1);
  r = run(VerifyMode::kBlock, 0, 1, 0.9f, 0.99f, 0.2f);
  EXPECT_EQ(r.accepted, 2);
  EXPECT_EQ(r.extra_token, 0);
  r = run(VerifyMode::kBlock, 0, 0, 0.1f, 0.3f, 0.2f);
  EXPECT_EQ(r.accepted, 0);
  EXPECT_EQ(r.extra_token, 1);
  r = run(VerifyMode::kBlock, 0, 0, 0.5f, 0.5f, 0.5f);  // table row (0, 0): w = 1/2, 1/4
  EXPECT_NEAR(r.weight[1], 0.5, 1e-7);
  EXPECT_NEAR(r.weight[2], 0.25, 1e-7);
  EXPECT_NEAR(r.threshold[2], 0.25, 1e-7);
  r = run(VerifyMode::kBlock, 1, 0, 0.5f, 0.5f, 0.5f);  // table row (1, 0): Z_1 = 1/3, h_1 = 1
  EXPECT_NEAR(r.residual_mass[1], 1.0 / 3, 1e-7);
  EXPECT_NEAR(r.threshold[1], 1.0, 1e-7);
  r = run(VerifyMode::kBlock, 0, 1, 1.0f, 1.0f, 0.9f);  // no early break
  EXPECT_EQ(r.accepted, 2);
}

TEST(CudaVerify, GuardCases) {
  UF_REQUIRE_GPU();
  const std::vector<float> p = {0.2f, 0.5f, 0.3f, 0.2f, 0.5f, 0.3f, 0.2f, 0.5f, 0.3f};
  VerifyDraws d{};
  d.eta[0] = d.eta[1] = 1.0f;
  d.u_extra = 0.1f;
  struct G {
    std::vector<float> p, q;
    std::vector<int32_t> x;
  };
  const G cases[] = {
      {p, std::vector<float>(p.begin(), p.begin() + 6), {1, 2}},        // p == q: h = 0/0 := 1
      {p, {0.0f, 0.5f, 0.5f, 0.0f, 0.5f, 0.5f}, {0, 0}},                // q(X) = 0: weight 1
      {std::vector<float>(p.begin(), p.begin() + 3), {}, {}},           // g = 0
      {{0.0f, 0.0f, 1.0f, 0.0f, 0.0f, 1.0f}, {0.0f, 0.0f, 1.0f}, {2}},  // one-hot (greedy) rows
  };
  for (const G& c : cases) {
    for (float u : {0.1f, 0.6f, 1.0f}) {
      d.u_extra = u;
      for (VerifyMode mode : {VerifyMode::kTokenWise, VerifyMode::kBlock}) {
        const VerifyResult dev = device_verify_explicit(mode, c.p, c.q, c.x, 3, d);
        const VerifyResult cpu = cpu_verify_explicit(mode, c.p, c.q, c.x, 3, d);
        EXPECT_TRUE(diff_results(dev, cpu).empty()) << mode_name(mode) << " g=" << c.x.size()
                                                    << " u=" << u << ": " << diff_results(dev, cpu);
      }
    }
  }
}

// The device's exp (double exp rounded to float) against the host's float(std::exp(double(z)))
// on every argument the transform can see: all floats in [-104, -0] (below -104 both give 0).
// The two can differ only where CUDA's and glibc's double exp (each within 1 double ulp) fall on
// different sides of a float rounding midpoint: ~2^-28 of arguments, a handful of the 1.1e9. The
// bound 1000 (1e-6) catches a wrong exp (a single-precision or fast-math exp differs in ~10% of
// arguments) without failing on those few; the count and the first argument are printed. Also
// printed: how many arguments glibc's expf (the CPU transform today) rounds differently, the
// source of the 1-ulp row differences in the raw-logits tests.
TEST(CudaVerify, DeviceExpMatchesHostDoubleExp) {
  UF_REQUIRE_GPU();
  const uint64_t first = 0x80000000ull, last = 0xC2D00000ull;
  const int64_t chunk = int64_t(1) << 24;
  DeviceBuffer<float> d{size_t(chunk)};
  const int workers = int(std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  uint64_t mismatches = 0, glibc_diffs = 0;
  uint32_t first_bad = 0;
  for (uint64_t b = first; b <= last; b += uint64_t(chunk)) {
    const int64_t n = int64_t(std::min<uint64_t>(uint64_t(chunk), last - b + 1));
    exp_of_bits_on_device(uint32_t(b), n, d.get(), nullptr);
    sync_and_check();
    const std::vector<float> dev = download(d.get(), size_t(n));
    std::vector<uint64_t> bad(workers, 0), gd(workers, 0);
    std::vector<uint32_t> fb(workers, 0);
    std::vector<std::thread> ts;
    for (int w = 0; w < workers; ++w) {
      ts.emplace_back([&, w] {
        for (int64_t i = w; i < n; i += workers) {
          const uint32_t bits = uint32_t(b + uint64_t(i));
          float z;
          std::memcpy(&z, &bits, 4);
          const float h = float(std::exp(double(z)));
          if (!bits_equal(dev[size_t(i)], h)) {
            if (bad[w]++ == 0) fb[w] = bits;
          }
          if (std::exp(z) != h) ++gd[w];
        }
      });
    }
    for (auto& t : ts) t.join();
    for (int w = 0; w < workers; ++w) {
      if (bad[w] && !mismatches) first_bad = fb[w];
      mismatches += bad[w];
      glibc_diffs += gd[w];
    }
  }
  float fz;
  std::memcpy(&fz, &first_bad, 4);
  std::printf(
      "[info] exp over [-104, 0]: device vs host double exp: %llu differ; glibc expf vs "
      "host double exp: %llu differ\n",
      (unsigned long long)mismatches, (unsigned long long)glibc_diffs);
  EXPECT_LE(mismatches, 1000u) << "first argument " << fz << " (bits 0x" << std::hex << first_bad
                               << ")";
}

// Graph capture: one captured verify_on_device, replayed for new steps by rewriting {seed, step}.
TEST(CudaVerify, GraphReplayFollowsSeedStep) {
  UF_REQUIRE_GPU();
  const int vocab = 1000, g = 3;
  const SamplingParams params{0.7f, 0.9f, 0};
  VerifyPlan plan(vocab);
  CaseInput c = make_case(vocab, g, 77, 0, params, true);
  DeviceBuffer<float> tl(c.target_logits), dl(c.draft_logits);
  DeviceBuffer<int32_t> tokens(c.tokens);
  DeviceBuffer<unsigned long long> ss(std::vector<unsigned long long>{c.seed, 0});
  DeviceBuffer<VerifyResult> out(1);
  cudaStream_t stream;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  UF_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  verify_on_device(plan, VerifyMode::kBlock, tl.get(), dl.get(), tokens.get(), g, vocab, params,
                   ss.get(), out.get(), stream);
  UF_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  UF_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  // The tokens stay those of step 0's drafts; only the verify draws change with the step.
  for (uint64_t step : {0ull, 1ull, 2ull, 1000ull}) {
    ss.upload({c.seed, step});
    out.poison();
    // The uploads run on the legacy stream, which does not order a non-blocking stream.
    UF_CUDA_CHECK(cudaDeviceSynchronize());
    UF_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    UF_CUDA_CHECK(cudaStreamSynchronize(stream));
    c.step = step;
    const VerifyResult cpu = cpu_verify(VerifyMode::kBlock, c, c.p.data(), c.q.data());
    const std::string diff = diff_results(out.download()[0], cpu);
    EXPECT_TRUE(diff.empty()) << "graph replay, step " << step << ": " << diff;
  }
  UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
  UF_CUDA_CHECK(cudaGraphDestroy(graph));
  UF_CUDA_CHECK(cudaStreamDestroy(stream));
}

// ---- the top-p cut on hard rows
// ------------------------------------------------------------------ The top-p cut by mass
// (cuda/kernels/verify_select.cuh) against transform.cpp, bitwise, on the rows that stress it: flat
// logits (a nucleus of ~95% of the vocab: most of a warp in one digit), peaked and Zipf-like rows
// (typical nuclei; many distinct digits a warp), quantised rows (long runs of equal values), a
// flat cluster under one dominant token (the cut's digits far below the top value's) and an
// all-equal row. Exact-exp logits (nudged) so that any difference is the cut's; no tolerance.

enum class RowKind { kFlat, kPeaked, kZipf, kTies, kOutlier, kEqual, kOneFinite };

const char* kind_name(RowKind k) {
  switch (k) {
    case RowKind::kFlat:
      return "flat";
    case RowKind::kPeaked:
      return "peaked";
    case RowKind::kZipf:
      return "zipf";
    case RowKind::kTies:
      return "ties";
    case RowKind::kOutlier:
      return "outlier";
    case RowKind::kEqual:
      return "equal";
    case RowKind::kOneFinite:
      return "one-finite";
  }
  return "?";
}

std::vector<float> make_row(RowKind kind, int vocab, std::mt19937& rng) {
  std::vector<float> l(static_cast<size_t>(vocab));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  switch (kind) {
    case RowKind::kFlat:
      for (float& x : l) x = 0.01f * nd(rng);
      break;
    case RowKind::kPeaked:
      for (float& x : l) x = 3.0f * nd(rng);
      break;
    case RowKind::kZipf: {  // logit = -1.1 log(rank + 1) + small noise, ranks shuffled
      std::vector<int> rank(static_cast<size_t>(vocab));
      for (int i = 0; i < vocab; ++i) rank[size_t(i)] = i;
      std::shuffle(rank.begin(), rank.end(), rng);
      for (int i = 0; i < vocab; ++i)
        l[size_t(i)] = -1.1f * std::log(float(rank[size_t(i)]) + 1.0f) + 0.05f * nd(rng);
      break;
    }
    case RowKind::kTies: {  // a few levels, most of the mass in the flat top ones
      const float levels[] = {0.0f, -0.01f, -0.02f, -0.5f, -3.0f};
      std::uniform_int_distribution<int> pick(0, 4);
      for (float& x : l) x = levels[pick(rng)];
      break;
    }
    case RowKind::kOutlier:  // one dominant token over a very tight flat cluster
      for (float& x : l) x = 0.0005f * nd(rng);
      l[size_t(rng() % uint32_t(vocab))] = 6.0f;
      break;
    case RowKind::kEqual:
      for (float& x : l) x = 0.25f;
      break;
    case RowKind::kOneFinite:  // -inf everywhere but one token: a one-hot row
      for (float& x : l) x = -INFINITY;
      l[size_t(rng() % uint32_t(vocab))] = 0.3f;
      break;
  }
  return l;
}

struct TopPSetup {
  int vocab;
  SamplingParams params;
};

// Runs rows through logits_to_probs_on_device and checks them. single: the single-CTA kernels
// instead of the cluster ones.
void check_top_p_rows(int vocab, const SamplingParams& params, const std::vector<RowKind>& kinds,
                      uint32_t seed, bool single = false) {
  const int rows = int(kinds.size());
  const size_t V = size_t(vocab);
  std::mt19937 rng(seed);
  std::vector<float> logits(size_t(rows) * V), want(size_t(rows) * V), scratch(V);
  for (int r = 0; r < rows; ++r) {
    std::vector<float> l = make_row(kinds[size_t(r)], vocab, rng);
    nudge_for_exact_exp(l.data(), vocab, params.temperature);
    std::copy(l.begin(), l.end(), logits.begin() + ptrdiff_t(r * V));
    sampling::logits_to_probs(&logits[r * V], vocab, params, &want[r * V], scratch.data());
  }
  VerifyPlan plan(vocab);
  DeviceBuffer<float> d_logits(logits), d_probs(logits.size());
  d_probs.poison();
  set_single_cta_transform_for_bench(single);
  logits_to_probs_on_device(plan, d_logits.get(), rows, vocab, params, d_probs.get(), nullptr);
  set_single_cta_transform_for_bench(false);
  sync_and_check();
  const std::vector<float> got = d_probs.download();
  for (int r = 0; r < rows; ++r) {
    const std::vector<float> g(got.begin() + ptrdiff_t(r * V),
                               got.begin() + ptrdiff_t((r + 1) * V));
    const std::vector<float> w(want.begin() + ptrdiff_t(r * V),
                               want.begin() + ptrdiff_t((r + 1) * V));
    const RowDiff d = compare_rows(g, w);
    size_t nucleus_dev = 0, nucleus_cpu = 0;
    for (size_t i = 0; i < V; ++i) {
      nucleus_dev += g[i] > 0.0f;
      nucleus_cpu += w[i] > 0.0f;
    }
    const std::string where = "V=" + std::to_string(vocab) + " " + params_name(params) + " row " +
                              std::to_string(r) + " (" + kind_name(kinds[size_t(r)]) + ")" +
                              (single ? " single-cta" : "");
    ASSERT_EQ(d.nan, 0u) << where << ": NaN in the device row";
    EXPECT_EQ(d.bit_diffs, 0u) << where << ": first diff at " << d.first << " (device "
                               << (d.first < V ? g[d.first] : 0.0f) << " cpu "
                               << (d.first < V ? w[d.first] : 0.0f) << "), " << d.support_diffs
                               << " support diffs, nucleus device " << nucleus_dev << " cpu "
                               << nucleus_cpu << ", max rel " << d.max_rel;
    if (r == 0 || d.bit_diffs != 0)
      std::printf("[top-p] %s: nucleus %zu of %d\n", where.c_str(), nucleus_cpu, vocab);
  }
}

TEST(CudaVerify, TopPCutMatchesCpuOnHardRowsRealVocab) {
  UF_REQUIRE_GPU();
  const std::vector<RowKind> kinds = {
      RowKind::kFlat, RowKind::kFlat,    RowKind::kPeaked, RowKind::kPeaked,  RowKind::kZipf,
      RowKind::kZipf, RowKind::kTies,    RowKind::kTies,   RowKind::kOutlier, RowKind::kEqual,
      RowKind::kFlat, RowKind::kOutlier, RowKind::kZipf,   RowKind::kTies,    RowKind::kPeaked};
  const SamplingParams setups[] = {{1.0f, 0.95f, 0},     {1.0f, 0.5f, 0},  {1.0f, 0.95f, 50},
                                   {1.0f, 0.999f, 0},    {0.7f, 0.05f, 0}, {1.0f, 0.9f, 5000},
                                   {1.3f, 0.99f, 70000}, {1.0f, 1.0f, 50}};
  uint32_t seed = 100;
  for (const SamplingParams& p : setups) {
    check_top_p_rows(kRealVocab, p, kinds, seed++);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(CudaVerify, TopPCutMatchesCpuOnHardRowsSmallVocabs) {
  UF_REQUIRE_GPU();
  const std::vector<RowKind> kinds = {RowKind::kFlat, RowKind::kPeaked,  RowKind::kZipf,
                                      RowKind::kTies, RowKind::kOutlier, RowKind::kEqual,
                                      RowKind::kFlat, RowKind::kTies};
  uint32_t seed = 500;
  for (int vocab : {1, 2, 33, 257, 1000, 8193, 40000}) {
    for (const SamplingParams& p :
         {SamplingParams{1.0f, 0.95f, 0}, SamplingParams{1.0f, 0.5f, 0},
          SamplingParams{1.0f, 0.9f, 7}, SamplingParams{0.5f, 0.999f, 0}}) {
      check_top_p_rows(vocab, p, kinds, seed++);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// The single-CTA kernels (the fallback of vocabs too large for a cluster's shared memory) give
// the same rows at the real vocab.
TEST(CudaVerify, SingleCtaTopPCutMatchesCpu) {
  UF_REQUIRE_GPU();
  check_top_p_rows(kRealVocab, {1.0f, 0.95f, 0},
                   {RowKind::kFlat, RowKind::kZipf, RowKind::kTies, RowKind::kPeaked}, 900, true);
  check_top_p_rows(1000, {1.0f, 0.5f, 50}, {RowKind::kFlat, RowKind::kZipf, RowKind::kTies}, 901,
                   true);
}

// The draft slot path (sample_slot_on_device) on flat and hard rows at the real vocab, both
// kernels (the cluster one and the single-CTA fallback).
TEST(CudaVerify, DraftSlotTopPMatchesCpuOnFlatRows) {
  UF_REQUIRE_GPU();
  const int V = kRealVocab;
  std::mt19937 rng(4242);
  DeviceBuffer<float> d_logits{size_t(V)}, d_probs{size_t(V)}, d_u{1};
  DeviceBuffer<DeviceSamplingParams> d_params(1);
  DeviceBuffer<int32_t> d_token(1), d_prev(1);
  std::vector<float> q(static_cast<size_t>(V)), scratch(static_cast<size_t>(V));
  for (const bool single : {false, true})
    for (RowKind kind : {RowKind::kFlat, RowKind::kTies, RowKind::kOutlier, RowKind::kZipf}) {
      for (float top_p : {0.95f, 0.5f}) {
        SamplingParams prm{1.0f, top_p, 0};
        std::vector<float> l = make_row(kind, V, rng);
        nudge_for_exact_exp(l.data(), V, prm.temperature);
        const float u = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
        std::vector<float> l_cpu = l;
        const int32_t want =
            sampling::sample_from_logits(l_cpu.data(), V, prm, u, q.data(), scratch.data());
        d_logits.upload(l);
        d_u.upload({u});
        d_params.upload({device_sampling_params(prm)});
        d_probs.poison();
        d_token.poison();
        set_single_cta_transform_for_bench(single);
        sample_slot_on_device(d_logits.get(), nullptr, V, d_params.get(), d_u.get(), d_probs.get(),
                              d_token.get(), d_prev.get(), nullptr);
        set_single_cta_transform_for_bench(false);
        sync_and_check();
        const RowDiff d = compare_rows(d_probs.download(), q);
        const std::string where = std::string(kind_name(kind)) + " top_p " + std::to_string(top_p) +
                                  (single ? " single-cta" : "");
        EXPECT_EQ(d.nan, 0u) << where << ": NaN in the device row";
        EXPECT_EQ(d.bit_diffs, 0u) << where << ": first diff at " << d.first << ", "
                                   << d.support_diffs << " support diffs";
        EXPECT_EQ(d_token.download()[0], want) << where << ": token";
      }
    }
}

// ------------------------------------------------------------------ The cluster transform
// (a row over the CTAs of a thread-block cluster, cuda/kernels/verify_cluster.cu) where the split
// changes the control flow: vocabularies below 256 (empty lanes and empty CTAs), not divisible by
// 256 or by the cluster size (a short last lane / CTA), exactly 256 and powers of two, the real
// vocab and one past it, and a vocab too large for the shared-memory slice (the single-CTA
// fallback); rows that are all equal (every lane sum equal, no radix pass), -inf but one token (a
// one-hot row, zero lane sums), flat / peaked / tied rows; greedy, no cut, top-k (k = 1 and ties),
// top-p, both. Every row bitwise against transform.cpp (exact-exp logits: no tolerance), outputs
// NaN-poisoned first; the single-CTA kernels on the same rows too.
TEST(CudaVerify, ClusterTransformMatchesCpuAtSplitEdges) {
  UF_REQUIRE_GPU();
  const std::vector<RowKind> kinds = {RowKind::kFlat,      RowKind::kPeaked, RowKind::kEqual,
                                      RowKind::kOneFinite, RowKind::kTies,   RowKind::kZipf};
  const SamplingParams setups[] = {{1.0f, 1.0f, 0}, {0.8f, 1.0f, 0},  {0.0f, 1.0f, 0},
                                   {1.0f, 1.0f, 1}, {1.0f, 1.0f, 5},  {1.0f, 0.9f, 0},
                                   {2.0f, 0.3f, 3}, {1.0f, 0.95f, 50}};
  uint32_t seed = 2000;
  for (int vocab :
       {1, 2, 3, 15, 31, 200, 255, 256, 257, 511, 4095, 4096, 4097, 8200, 129280, 129281}) {
    for (const SamplingParams& p : setups) {
      check_top_p_rows(vocab, p, kinds, seed);
      if (::testing::Test::HasFatalFailure()) return;
      check_top_p_rows(vocab, p, kinds, seed++, true);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// A vocab whose slice does not fit in shared memory (the single-CTA fallback) and 15 rows of the
// real vocab in one launch (15 clusters).
TEST(CudaVerify, ClusterTransformFallbackAndManyRows) {
  UF_REQUIRE_GPU();
  check_top_p_rows(700000, {1.0f, 1.0f, 0}, {RowKind::kPeaked, RowKind::kEqual}, 3000);
  check_top_p_rows(700000, {1.0f, 0.9f, 20}, {RowKind::kZipf}, 3001);
  const std::vector<RowKind> fifteen = {
      RowKind::kFlat,  RowKind::kPeaked,    RowKind::kZipf,  RowKind::kTies,      RowKind::kOutlier,
      RowKind::kEqual, RowKind::kOneFinite, RowKind::kFlat,  RowKind::kPeaked,    RowKind::kZipf,
      RowKind::kTies,  RowKind::kOutlier,   RowKind::kEqual, RowKind::kOneFinite, RowKind::kZipf};
  for (const SamplingParams& p : {SamplingParams{1.0f, 1.0f, 0}, SamplingParams{1.0f, 0.95f, 0},
                                  SamplingParams{1.0f, 1.0f, 50}, SamplingParams{0.0f, 1.0f, 0}}) {
    check_top_p_rows(kRealVocab, p, fifteen, 3100);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// The draft slot over a cluster at the split edges: logits + bias written back, the probs row
// and the token (the pick walks the gathered lane sums, the CTA owning the chunk walks inside it)
// bitwise the CPU's sample_from_logits; u near 0 and 1 (first and last positive token); an
// all-NaN row gives token -1 and prev 0.
TEST(CudaVerify, ClusterDraftSlotMatchesCpuAtSplitEdges) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(777);
  for (int V : {1, 7, 255, 257, 4097, kRealVocab}) {
    DeviceBuffer<float> d_logits{size_t(V)}, d_bias{size_t(V)}, d_probs{size_t(V)}, d_u{1};
    DeviceBuffer<DeviceSamplingParams> d_params(1);
    DeviceBuffer<int32_t> d_token(1), d_prev(1);
    std::vector<float> q(static_cast<size_t>(V)), scratch(static_cast<size_t>(V)),
        bias(static_cast<size_t>(V));
    std::normal_distribution<float> nd(0.0f, 0.5f);
    for (RowKind kind : {RowKind::kPeaked, RowKind::kEqual, RowKind::kOneFinite, RowKind::kTies}) {
      for (const SamplingParams& prm :
           {SamplingParams{1.0f, 1.0f, 0}, SamplingParams{0.0f, 1.0f, 0},
            SamplingParams{1.0f, 0.9f, 0}, SamplingParams{1.0f, 1.0f, 3}}) {
        for (float u : {1.0f / 16777216.0f, 0.37f, 1.0f}) {
          // The summed logits are drawn (and nudged for an exact exp); the bias is random and
          // the logits are sum - bias, with the bias zeroed where fl(fl(sum - b) + b) != sum, so
          // the device's in-place fp32 add reproduces the drawn sums exactly.
          std::vector<float> sum = make_row(kind, V, rng);
          if (prm.temperature > 0.0f) nudge_for_exact_exp(sum.data(), V, prm.temperature);
          std::vector<float> l(static_cast<size_t>(V));
          for (int x = 0; x < V; ++x) {
            const float s = sum[size_t(x)];
            float b = kind == RowKind::kEqual || !std::isfinite(s) ? 0.0f : nd(rng);
            if ((s - b) + b != s) b = 0.0f;
            bias[size_t(x)] = b;
            l[size_t(x)] = s - b;
          }
          std::vector<float> sum_cpu = sum;
          const int32_t want =
              sampling::sample_from_logits(sum_cpu.data(), V, prm, u, q.data(), scratch.data());
          d_logits.upload(l);
          d_bias.upload(bias);
          d_u.upload({u});
          d_params.upload({device_sampling_params(prm)});
          d_probs.poison();
          d_token.poison();
          d_prev.poison();
          sample_slot_on_device(d_logits.get(), d_bias.get(), V, d_params.get(), d_u.get(),
                                d_probs.get(), d_token.get(), d_prev.get(), nullptr);
          sync_and_check();
          const std::string where = "V=" + std::to_string(V) + " " + kind_name(kind) + " " +
                                    params_name(prm) + " u=" + std::to_string(u);
          const RowDiff dl = compare_rows(d_logits.download(), sum);
          EXPECT_EQ(dl.bit_diffs, 0u) << where << ": logits + bias, first diff at " << dl.first;
          const std::vector<float> got = d_probs.download();
          const RowDiff d = compare_rows(got, q);
          EXPECT_EQ(d.nan, 0u) << where << ": NaN in the device row";
          EXPECT_EQ(d.bit_diffs, 0u) << where << ": first diff at " << d.first << " (device "
                                     << (d.first < got.size() ? got[d.first] : 0.0f) << " cpu "
                                     << (d.first < q.size() ? q[d.first] : 0.0f) << "), "
                                     << d.support_diffs << " support diffs";
          EXPECT_EQ(d_token.download()[0], want) << where << ": token";
          EXPECT_EQ(d_prev.download()[0], want >= 0 ? want : 0) << where << ": prev";
        }
      }
    }
    // All-NaN logits: no positive weight, token -1, prev 0 (the rows themselves are NaN); with
    // top-p the row has no measurable mass, so the filter leaves it as it is.
    DeviceBuffer<float> d_nobias{size_t(V)};
    d_nobias.upload(std::vector<float>(size_t(V), 0.0f));
    d_u.upload({0.5f});
    for (const float top_p : {1.0f, 0.9f}) {
      d_logits.upload(std::vector<float>(size_t(V), NAN));
      d_params.upload({device_sampling_params(SamplingParams{1.0f, top_p, 0})});
      d_token.poison();
      d_prev.poison();
      sample_slot_on_device(d_logits.get(), d_nobias.get(), V, d_params.get(), d_u.get(),
                            d_probs.get(), d_token.get(), d_prev.get(), nullptr);
      sync_and_check();
      EXPECT_EQ(d_token.download()[0], -1) << "V=" << V << " all-NaN row, top_p " << top_p;
      EXPECT_EQ(d_prev.download()[0], 0) << "V=" << V << " all-NaN row, top_p " << top_p;
    }
  }
}

}  // namespace
}  // namespace uf::cuda::test
