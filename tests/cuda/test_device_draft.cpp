// DSpark drafting on the device (CudaModel::draft_on_device, cuda/verify.h's draft kernels):
//   1. the slot sampler (sample_slot_on_device) against sampling::sample_from_logits on random
//      logits + bias, every transform setting, ties, edge uniforms;
//   2. the confidence kernel against the host's dot8;
//   3. on the tiny-a model: draft_on_device against draft() with the engine's host sampler (tokens,
//      confidences, logits and q rows);
//   4. the generation loop with device drafts against host drafts (both with device and with host
//      verification, graphs on and off): identical tokens and accepted counts; the same at TP 2
//      (rank 0 drafts on the device, rank 1 runs the stages beside it).
//
// Exactness: the device transform and draw follow the host's operation order (exp in double on both
// sides, the fixed 256-lane sums, the same inverse-CDF walk), so equal q rows and equal u give the
// same token bit for bit; there is no CDF-boundary tolerance to apply. The one documented
// difference is exp (cuda/verify.h: device exp in double differs from the host's std::exp(double)
// rounding on ~2^-28 of arguments); a row whose q differs in any entry is counted and reported, its
// token is not compared, and at most one such row is tolerated in test 1 (expected count ~1e-3).
// Confidences are compared bitwise (same dot8 order, no FMA on either side: bound 0).
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "../cpu/tiny_a.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda/verify.h"
#include "cuda_test_util.h"
#include "engine/generation_loop.h"
#include "engine/hardware_profile.h"
#include "loop_test_util.h"
#include "sampling/rng.h"
#include "sampling/sampler.h"

namespace uf::cuda {
namespace {

using test::bits_equal;
using test::DeviceBuffer;
using uf::testing::tiny_a_dir;
using uf::testing::tiny_a_golden_i64;

std::string params_str(const sampling::SamplingParams& p) {
  return "T " + std::to_string(p.temperature) + " top_p " + std::to_string(p.top_p) + " top_k " +
         std::to_string(p.top_k);
}

// The number of entries whose bits differ and the first one (-1: none).
struct BitDiff {
  int64_t count = 0, first = -1;
};
BitDiff bit_diff(const float* a, const float* b, size_t n) {
  BitDiff d;
  for (size_t i = 0; i < n; ++i)
    if (!bits_equal(a[i], b[i])) {
      if (d.first < 0) d.first = int64_t(i);
      ++d.count;
    }
  return d;
}

std::vector<sampling::SamplingParams> param_grid() {
  std::vector<sampling::SamplingParams> out;
  auto add = [&](float t, float p, int k) {
    sampling::SamplingParams s;
    s.temperature = t;
    s.top_p = p;
    s.top_k = k;
    out.push_back(s);
  };
  add(0.0f, 1.0f, 0);   // greedy
  add(1.0f, 1.0f, 0);   // plain softmax
  add(0.8f, 0.9f, 0);   // top-p
  add(0.7f, 1.0f, 50);  // top-k
  add(1.0f, 0.9f, 50);  // both
  add(0.3f, 0.5f, 0);   // sharp, small nucleus
  add(1.5f, 0.95f, 1);  // top-k 1 (the argmax and its ties)
  return out;
}

// ---- 1. the slot sampler -------------------------------------------------------------------

TEST(CudaDeviceDraft, SlotSamplerEqualsHostSampler) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(1234);
  int rows = 0, compared = 0, q_differs = 0;
  for (int V : {1000, 129280}) {
    VerifyPlan plan(V);
    DeviceBuffer<float> d_logits(static_cast<size_t>(V)), d_bias(static_cast<size_t>(V)),
        d_probs(static_cast<size_t>(V)), d_u(1);
    DeviceBuffer<DeviceSamplingParams> d_params(1);
    DeviceBuffer<int32_t> d_token(1), d_prev(1);
    std::vector<float> logits(static_cast<size_t>(V)), bias(static_cast<size_t>(V)),
        sum(static_cast<size_t>(V)), q(static_cast<size_t>(V)), scratch(static_cast<size_t>(V));
    const std::vector<float> us = {1.0f / 16777216.0f, 0.5f, 1.0f, -1.0f, -1.0f, -1.0f};
    for (const auto& prm : param_grid()) {
      for (int trial = 0; trial < int(us.size()); ++trial) {
        // Logits: normal * 3; every third trial quantised to 1/8 so values tie often.
        std::normal_distribution<float> nd(0.0f, 3.0f);
        for (auto& x : logits) x = nd(rng);
        if (trial % 3 == 1)
          for (auto& x : logits) x = std::round(x * 8.0f) / 8.0f;
        for (auto& x : bias) x = 0.25f * nd(rng);
        const float u = us[size_t(trial)] > 0 ? us[size_t(trial)]
                                              : sampling::stream_uniform(
                                                    uint64_t(rng()), 3,
                                                    sampling::RngPurpose::kDraft, uint32_t(trial));
        for (int x = 0; x < V; ++x) sum[size_t(x)] = logits[size_t(x)] + bias[size_t(x)];
        const int32_t want =
            sampling::sample_from_logits(sum.data(), V, prm, u, q.data(), scratch.data());

        d_logits.upload(logits);
        d_bias.upload(bias);
        d_u.upload({u});
        d_params.upload({device_sampling_params(prm)});
        d_probs.poison();
        d_token.poison();
        d_prev.poison();
        sample_slot_on_device(d_logits.get(), d_bias.get(), V, d_params.get(), d_u.get(),
                              d_probs.get(), d_token.get(), d_prev.get(), nullptr);
        test::sync_and_check();
        const auto got_sum = d_logits.download();
        const auto got_q = d_probs.download();
        const int32_t got = d_token.download()[0], prev = d_prev.download()[0];
        ++rows;
        const std::string where = "V " + std::to_string(V) + ", " + params_str(prm) + ", trial " +
                                  std::to_string(trial) + ", u " + std::to_string(u);
        const BitDiff ds = bit_diff(got_sum.data(), sum.data(), size_t(V));
        ASSERT_EQ(ds.count, 0) << where << ": logits + bias differ in " << ds.count
                               << " entries, first " << ds.first;
        const BitDiff dq = bit_diff(got_q.data(), q.data(), size_t(V));
        EXPECT_EQ(prev, got) << where << ": prev must echo the token";
        if (dq.count > 0) {
          // The exp of an argument may round differently (cuda/verify.h); report it.
          ++q_differs;
          std::printf(
              "[device_draft] %s: q differs in %lld entries (first %lld: device %.9g host "
              "%.9g); tokens device %d host %d\n",
              where.c_str(), (long long)dq.count, (long long)dq.first,
              double(got_q[size_t(dq.first)]), double(q[size_t(dq.first)]), got, want);
          continue;
        }
        ++compared;
        EXPECT_EQ(got, want) << where << ": same q row, same u, different token (q[device] = "
                             << (got >= 0 && got < V ? got_q[size_t(got)] : -1.0f)
                             << ", q[host] = " << q[size_t(want)] << ")";
      }
    }
  }
  std::printf(
      "[device_draft] slot sampler: %d rows, %d compared token for token, %d with a "
      "differing q row\n",
      rows, compared, q_differs);
  EXPECT_LE(q_differs, 1) << "more q rows differ than the exp rounding difference explains";
}

// ---- 2. confidences ------------------------------------------------------------------------

float host_dot8(const float* a, const float* b, int n) {  // cuda_dspark.cpp's dot8
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  for (int j = 0; i < n; ++i, ++j) s[j] += a[i] * b[i];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

TEST(CudaDeviceDraft, ConfidenceEqualsHostDot8) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(99);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // 544 terms a partial (four batches of 128, the last short), 40, 2 + a tail of 3, 129 + 5.
  for (auto [B, D, R] : {std::tuple{5, 256, 64}, std::tuple{5, 4096, 256}, std::tuple{3, 13, 6},
                         std::tuple{2, 1000, 37}}) {
    std::vector<float> proj(size_t(D + R)), x5(size_t(B) * D), emb(size_t(B) * R);
    for (auto* v : {&proj, &x5, &emb})
      for (auto& x : *v) x = nd(rng);
    DeviceBuffer<float> dp(proj), dx(x5), de(emb), dc(static_cast<size_t>(B));
    dc.poison();
    draft_confidence_on_device(dp.get(), dx.get(), de.get(), B, D, R, dc.get(), nullptr);
    test::sync_and_check();
    const auto got = dc.download();
    std::vector<float> cat(size_t(D + R));
    for (int b = 0; b < B; ++b) {
      std::copy_n(x5.begin() + int64_t(b) * D, D, cat.begin());
      std::copy_n(emb.begin() + int64_t(b) * R, R, cat.begin() + D);
      const float want = host_dot8(proj.data(), cat.data(), D + R);
      EXPECT_TRUE(bits_equal(got[size_t(b)], want))
          << "B " << B << " D " << D << " R " << R << " row " << b << ": device " << got[size_t(b)]
          << " host " << want << " (bound 0: same order, no FMA)";
    }
  }
}

// ---- 3. one round on the model ----------------------------------------------------------------

CudaModelOptions options(bool device_verify, bool device_draft, bool graphs = true, int tp = 1) {
  CudaModelOptions o;
  o.tp = tp;
  o.device_verify = device_verify;
  o.device_draft = device_draft;
  o.cuda_graphs = graphs;
  return o;
}

std::vector<int32_t> prompt_ids() {
  const auto pi = tiny_a_golden_i64("prompt_ids");
  return {pi.begin(), pi.end()};
}

TEST(CudaDeviceDraft, RoundEqualsHostDraft) {
  UF_REQUIRE_GPU();
  CudaBackend be(tiny_a_dir(), tiny_a_golden_i64("engram_token_map"), options(true, true));
  ASSERT_TRUE(be.device_draft());
  const int V = be.config().vocab_size, B = be.config().dspark_block_size;
  const auto prompt = prompt_ids();
  auto s = be.new_session(256);
  std::vector<float> logits(static_cast<size_t>(V));
  be.prefill(*s, prompt, {}, logits);
  int rounds = 0;
  for (const auto& prm : param_grid()) {
    for (uint64_t seed : {3u, 11u}) {
      const int32_t anchor = int32_t((seed * 37 + uint64_t(rounds)) % uint64_t(V));
      const uint64_t step = 5 + uint64_t(rounds);
      const std::string where = params_str(prm) + " seed " + std::to_string(seed);
      const engine::DraftBlock dev = be.draft_on_device(*s, anchor, prm, seed, step);
      const auto dev_q = be.model().device_draft_probs(B);
      const auto dev_l = be.model().device_draft_logits(B);
      std::vector<float> host_q(size_t(B) * V), scratch(static_cast<size_t>(V));
      const engine::DraftBlock host = be.draft(*s, anchor, [&](int i, std::span<const float> l) {
        const float u =
            sampling::stream_uniform(seed, step, sampling::RngPurpose::kDraft, uint32_t(i));
        return sampling::sample_from_logits(l.data(), V, prm, u, host_q.data() + int64_t(i) * V,
                                            scratch.data());
      });
      ++rounds;
      ASSERT_EQ(dev.tokens.size(), size_t(B)) << where;
      ASSERT_EQ(dev.confidence.size(), size_t(B)) << where;
      EXPECT_TRUE(dev.logits.empty() && dev.markov_bias.empty()) << where;
      // Slot by slot: once a token differs the later slots see another Markov bias.
      for (int i = 0; i < B; ++i) {
        const BitDiff dl =
            bit_diff(dev_l.data() + int64_t(i) * V, host.logits.data() + int64_t(i) * V, size_t(V));
        const BitDiff dq =
            bit_diff(dev_q.data() + int64_t(i) * V, host_q.data() + int64_t(i) * V, size_t(V));
        EXPECT_EQ(dl.count, 0) << where << " slot " << i << ": head + Markov logits differ in "
                               << dl.count << " entries, first " << dl.first;
        EXPECT_EQ(dq.count, 0) << where << " slot " << i << ": q differs in " << dq.count
                               << " entries, first " << dq.first;
        EXPECT_TRUE(bits_equal(dev.confidence[size_t(i)], host.confidence[size_t(i)]))
            << where << " slot " << i << ": confidence device " << dev.confidence[size_t(i)]
            << " host " << host.confidence[size_t(i)];
        EXPECT_EQ(dev.tokens[size_t(i)], host.tokens[size_t(i)]) << where << " slot " << i;
        if (dev.tokens[size_t(i)] != host.tokens[size_t(i)]) break;
      }
    }
  }
  std::printf("[device_draft] %d rounds on tiny-a identical to the host sampler\n", rounds);
}

// ---- 4. the generation loop -------------------------------------------------------------------

using test::generate;
using test::LoopRun;

TEST(CudaDeviceDraft, LoopEqualsHostDrafts) {
  UF_REQUIRE_GPU();
  const auto map = tiny_a_golden_i64("engram_token_map");
  // dev: device drafts + device verify; dev_eager: the same without graphs; ref: host drafts +
  // device verify; host: host drafts + host verify.
  CudaBackend dev(tiny_a_dir(), map, options(true, true)),
      dev_eager(tiny_a_dir(), map, options(true, true, false)),
      ref(tiny_a_dir(), map, options(true, false)), host(tiny_a_dir(), map, options(false, true));
  ASSERT_TRUE(dev.device_draft());
  ASSERT_TRUE(dev_eager.device_draft());
  ASSERT_FALSE(ref.device_draft());
  ASSERT_FALSE(host.device_draft()) << "device drafting must follow device verification";
  const auto prompt = prompt_ids();
  int steps = 0, accepted = 0, drafted = 0, runs = 0;
  for (auto mode : {sampling::VerifyMode::kBlock, sampling::VerifyMode::kTokenWise})
    for (const auto& prm : param_grid())
      for (uint64_t seed : {1u, 7u, 42u}) {
        if (prm.greedy() && seed != 1u) continue;  // greedy ignores the seed
        engine::GenerationParams p;
        p.sampling = prm;
        p.seed = seed;
        p.verify = mode;
        p.max_new_tokens = 40;
        const std::string where = "mode " + std::to_string(int(mode)) + " " + params_str(prm) +
                                  " seed " + std::to_string(seed);
        const LoopRun a = generate(dev, prompt, p), b = generate(ref, prompt, p);
        EXPECT_EQ(a.tokens, b.tokens) << where << ": device drafts vs host drafts";
        EXPECT_EQ(a.accepted, b.accepted) << where;
        EXPECT_EQ(a.drafted, b.drafted) << where << " (the confidence schedule cut differently)";
        const LoopRun c = generate(dev_eager, prompt, p);
        EXPECT_EQ(a.tokens, c.tokens) << where << ": graph replay vs eager launches";
        EXPECT_EQ(a.accepted, c.accepted) << where << ": graph replay vs eager launches";
        const LoopRun d = generate(host, prompt, p);
        EXPECT_EQ(a.tokens, d.tokens) << where << ": vs host drafts + host verification";
        ++runs;
        steps += int(a.accepted.size());
        for (int n : a.accepted) accepted += n;
        for (int n : a.drafted) drafted += n;
      }
  std::printf(
      "[device_draft] %d runs, %d steps, %d drafted, %d accepted: identical to host "
      "drafting\n",
      runs, steps, drafted, accepted);
  EXPECT_GT(accepted, 0) << "no draft was ever accepted: the comparison would not cover tau > 0";
  EXPECT_GT(drafted, accepted) << "no draft was ever rejected: residual draws are not covered";
}

// TP 2: rank 0 runs the Markov loop while rank 1 runs the stages (and the split head's gather)
// beside it. Against host drafts at the same TP (the same logits: the head rows are the same
// gathered sums), tokens and counts must be identical, with graphs and without.
TEST(CudaDeviceDraft, LoopAtTp2EqualsHostDrafts) {
  UF_REQUIRE_GPU();
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2)
    GTEST_SKIP() << "TP = 2 needs 2 GPUs, " << gpus << " visible";
  const auto map = tiny_a_golden_i64("engram_token_map");
  CudaBackend dev(tiny_a_dir(), map, options(true, true, true, 2)),
      dev_eager(tiny_a_dir(), map, options(true, true, false, 2)),
      ref(tiny_a_dir(), map, options(true, false, true, 2));
  ASSERT_TRUE(dev.device_draft());
  ASSERT_FALSE(ref.device_draft());
  const auto prompt = prompt_ids();
  int runs = 0, accepted = 0;
  for (const auto& prm : param_grid())
    for (uint64_t seed : {1u, 42u}) {
      if (prm.greedy() && seed != 1u) continue;
      engine::GenerationParams p;
      p.sampling = prm;
      p.seed = seed;
      p.max_new_tokens = 32;
      const std::string where = "TP 2 " + params_str(prm) + " seed " + std::to_string(seed);
      const LoopRun a = generate(dev, prompt, p), b = generate(ref, prompt, p),
                    c = generate(dev_eager, prompt, p);
      EXPECT_EQ(a.tokens, b.tokens) << where << ": device drafts vs host drafts";
      EXPECT_EQ(a.accepted, b.accepted) << where;
      EXPECT_EQ(a.drafted, b.drafted) << where;
      EXPECT_EQ(a.tokens, c.tokens) << where << ": graph replay vs eager launches";
      ++runs;
      for (int n : a.accepted) accepted += n;
    }
  std::printf("[device_draft] TP 2: %d runs, %d accepted: identical to host drafting\n", runs,
              accepted);
  EXPECT_GT(accepted, 0);
}

}  // namespace
}  // namespace uf::cuda
