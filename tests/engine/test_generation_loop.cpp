// The generation loop on a Markov-chain backend whose output law is known exactly: speculative
// decoding (block and token-wise verification) must sample the first tokens from exactly the law of
// plain decoding, under several temperature/top-p/top-k settings; a backend that commits rejected
// rows must be caught (the test's power); seeded runs reproduce; stop tokens, max tokens and
// cancellation end generation where they should.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "../sampling/stats.h"
#include "engine/generation_loop.h"
#include "markov_backend.h"
#include "sampling/reference.h"

using namespace uf::engine;
using uf::engine::testing::MarkovBackend;
using uf::sampling::testing::chi_square_fit;

namespace {

constexpr int kV = 3;
constexpr int kLen = 4;  // tokens whose joint law is checked (spans several verify steps)
const std::vector<int32_t> kPrompt = {0, 2, 1};

// Target chain: two position parities, deliberately different; draft chain: close but not equal.
std::vector<float> target_logits() {
  return {// parity 0, rows = previous token
          1.2f, 0.1f, -0.8f, -0.3f, 0.9f, 0.4f, 0.5f, 0.5f, -1.0f,
          // parity 1
          -0.5f, 1.1f, 0.2f, 0.8f, -0.6f, 0.7f, 0.0f, 1.3f, -0.4f};
}
std::vector<float> draft_logits() {
  return {1.0f, 0.4f, -0.5f, -0.1f, 0.6f, 0.9f, 0.9f, 0.2f, -0.6f};
}

std::vector<double> transformed(const float* logits, const uf::sampling::SamplingParams& sp) {
  double l[kV];
  for (int i = 0; i < kV; ++i) l[i] = logits[i];
  return uf::sampling::reference_transform(l, kV, sp);
}

// Exact law of the first kLen generated tokens under plain sampling.
std::vector<double> exact_law(const uf::sampling::SamplingParams& sp) {
  const auto T = target_logits();
  std::vector<double> law(size_t(std::pow(kV, kLen)), 0.0);
  for (size_t code = 0; code < law.size(); ++code) {
    double pr = 1.0;
    int64_t pos = int64_t(kPrompt.size()) - 1;
    int32_t prev = kPrompt.back();
    size_t c = code;
    for (int k = 0; k < kLen; ++k) {
      const int32_t tok = int32_t(c % kV);
      c /= kV;
      const auto p = transformed(T.data() + (size_t(pos % 2) * kV + size_t(prev)) * kV, sp);
      pr *= p[size_t(tok)];
      prev = tok;
      ++pos;
    }
    law[code] = pr;
  }
  return law;
}

size_t encode(const std::vector<int32_t>& toks) {
  size_t code = 0, mul = 1;
  for (int k = 0; k < kLen; ++k) {
    code += size_t(toks[size_t(k)]) * mul;
    mul *= kV;
  }
  return code;
}

struct Counts {
  std::vector<int64_t> count;
  double mean_accept = 0;
};

Counts run_many(MarkovBackend& backend, const GenerationParams& base, int trials) {
  HardwareProfile prof = resolve_hardware_profile({"cpu", "", 0}, 3);
  prof.confidence_threshold = 0.0;
  GenerationLoop loop(backend, prof);
  Counts out;
  out.count.assign(size_t(std::pow(kV, kLen)), 0);
  double accept = 0;
  for (int t = 0; t < trials; ++t) {
    GenerationParams p = base;
    p.seed = 0x9e3779b97f4a7c15ull * uint64_t(t + 1);
    p.max_new_tokens = kLen;
    auto s = backend.new_session(64);
    auto r = loop.run(*s, kPrompt, p, [](auto, const auto&) { return true; });
    EXPECT_EQ(int(r.tokens.size()), kLen);
    out.count[encode(r.tokens)] += 1;
    accept += r.average_accept_length();
  }
  out.mean_accept = accept / trials;
  return out;
}

int trials() { return std::getenv("UF_SLOW_REDUCED") ? 6000 : 20000; }

}  // namespace

class LoopLaw : public ::testing::TestWithParam<std::tuple<float, float, int>> {};

TEST_P(LoopLaw, SpeculativeEqualsPlainLaw) {
  auto [temp, top_p, top_k] = GetParam();
  GenerationParams p;
  p.sampling.temperature = temp;
  p.sampling.top_p = top_p;
  p.sampling.top_k = top_k;
  const auto law = exact_law(p.sampling);
  const double kAlpha = 1e-4;  // false-alarm rate of each chi-square test
  for (auto mode : {DecodeMode::kPlain, DecodeMode::kSpeculative}) {
    for (auto vm : {uf::sampling::VerifyMode::kBlock, uf::sampling::VerifyMode::kTokenWise}) {
      if (mode == DecodeMode::kPlain && vm == uf::sampling::VerifyMode::kTokenWise) continue;
      MarkovBackend backend(kV, target_logits(), draft_logits(), {3.f, 3.f, 3.f});
      p.mode = mode;
      p.verify = vm;
      auto c = run_many(backend, p, trials());
      auto fit = chi_square_fit(law, c.count);
      EXPECT_FALSE(fit.rejects(kAlpha))
          << "mode " << int(mode) << " verify " << int(vm) << ": chi2 " << fit.statistic << " df "
          << fit.df << " p " << fit.p_value << " impossible " << fit.impossible;
      if (mode == DecodeMode::kSpeculative) {
        EXPECT_GT(c.mean_accept, 1.0);  // drafts are accepted at all
        EXPECT_GT(backend.drafts_called, 0);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Settings, LoopLaw,
                         ::testing::Values(std::make_tuple(1.0f, 1.0f, 0),
                                           std::make_tuple(0.7f, 0.9f, 0),
                                           std::make_tuple(1.3f, 1.0f, 2)));

TEST(GenerationLoop, BrokenCommitIsCaught) {
  // Power: committing rejected rows shifts positions and histories; the same test must reject.
  GenerationParams p;
  const auto law = exact_law(p.sampling);
  MarkovBackend backend(kV, target_logits(), draft_logits(), {3.f, 3.f, 3.f});
  backend.commit_bug = true;
  auto c = run_many(backend, p, trials());
  EXPECT_TRUE(chi_square_fit(law, c.count).rejects(1e-4));
}

TEST(GenerationLoop, GreedySpeculativeEqualsGreedyPlain) {
  GenerationParams p;
  p.sampling.temperature = 0.0f;
  p.max_new_tokens = 12;
  std::vector<int32_t> plain, spec;
  for (auto mode : {DecodeMode::kPlain, DecodeMode::kSpeculative}) {
    MarkovBackend backend(kV, target_logits(), draft_logits(), {3.f, 3.f, 3.f});
    GenerationLoop loop(backend, resolve_hardware_profile({"cpu", "", 0}, 3));
    p.mode = mode;
    auto s = backend.new_session(64);
    auto r = loop.run(*s, kPrompt, p, [](auto, const auto&) { return true; });
    (mode == DecodeMode::kPlain ? plain : spec) = r.tokens;
  }
  EXPECT_EQ(plain, spec);
  EXPECT_EQ(plain.size(), 12u);
}

TEST(GenerationLoop, SeededRunsReproduceAndStopConditionsHold) {
  MarkovBackend backend(kV, target_logits(), draft_logits(), {3.f, 3.f, 3.f});
  GenerationLoop loop(backend, resolve_hardware_profile({"cpu", "", 0}, 3));
  GenerationParams p;
  p.seed = 42;
  p.max_new_tokens = 20;
  auto run = [&](const GenerationParams& params, int stop_after_calls = -1) {
    auto s = backend.new_session(64);
    int calls = 0;
    return loop.run(*s, kPrompt, params,
                    [&](auto, const auto&) { return ++calls != stop_after_calls; });
  };
  auto a = run(p), b = run(p);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.tokens.size(), 20u);
  EXPECT_EQ(a.finish, FinishReason::kLength);
  // Committed state holds the prompt and every emitted token but the last.
  // Stop token: generation ends right after emitting it.
  GenerationParams ps = p;
  ps.stop_token_ids = {a.tokens[5]};
  auto st = run(ps);
  EXPECT_EQ(st.finish, FinishReason::kStop);
  EXPECT_EQ(st.tokens.back(), a.tokens[5]);
  EXPECT_LE(st.tokens.size(), 6u);
  // The callback stops generation.
  auto c = run(p, 2);
  EXPECT_EQ(c.finish, FinishReason::kCancelled);
  // Cancellation flag.
  std::atomic<bool> cancel{true};
  auto s = backend.new_session(64);
  auto d = loop.run(
      *s, kPrompt, p, [](auto, const auto&) { return true; }, &cancel);
  EXPECT_EQ(d.finish, FinishReason::kCancelled);
  EXPECT_EQ(d.tokens.size(), 1u);
  // Session capacity bounds generation.
  auto small = backend.new_session(8);
  auto e = loop.run(*small, kPrompt, p, [](auto, const auto&) { return true; });
  EXPECT_EQ(e.finish, FinishReason::kLength);
  EXPECT_LE(small->length(), 8);
}

TEST(GenerationLoop, CommittedStateIsPromptPlusEmittedButLast) {
  MarkovBackend backend(kV, target_logits(), draft_logits(), {3.f, 3.f, 3.f});
  GenerationLoop loop(backend, resolve_hardware_profile({"cpu", "", 0}, 3));
  GenerationParams p;
  p.seed = 7;
  p.max_new_tokens = 15;
  auto s = backend.new_session(64);
  auto r = loop.run(*s, kPrompt, p, [](auto, const auto&) { return true; });
  std::vector<int32_t> want = kPrompt;
  want.insert(want.end(), r.tokens.begin(), r.tokens.end() - 1);
  EXPECT_EQ(s->tokens(), want);
  EXPECT_GE(r.average_accept_length(), 1.0);
}
