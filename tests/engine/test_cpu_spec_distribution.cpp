// End to end on the tiny-a model (CPU backend): the first two tokens generated with speculative
// decoding (DSpark drafts, block verification) follow the law of plain sampling. The exact law is
// computed by forwarding: P(y1) from the prompt's logits, P(y2 | y1) from one decode step per
// likely y1. A broken verifier (one that accepts every draft) must be rejected by the same test:
// that is the test's power.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <vector>

#include "../cpu/tiny_a.h"
#include "../sampling/stats.h"
#include "cpu/cpu_backend.h"
#include "engine/generation_loop.h"
#include "model/checkpoint.h"
#include "sampling/transform.h"

using namespace uf;

namespace {

using uf::testing::tiny_a_dir;
using uf::testing::tiny_a_golden_i64;

// Delegates everything; when `verify_against_draft`, the verify rows that judge the drafts get the
// drafts' own logits instead of the target's, so every draft is accepted: a broken verifier. The
// generated law then follows the draft, not the model, and the test must reject it.
class TamperingBackend : public engine::Backend {
 public:
  explicit TamperingBackend(engine::Backend& inner) : inner_(inner) {}
  bool verify_against_draft = false;
  const model::ModelConfig& config() const override { return inner_.config(); }
  std::string name() const override { return inner_.name(); }
  int max_rows() const override { return inner_.max_rows(); }
  std::unique_ptr<engine::SessionState> new_session(int64_t n) override {
    return inner_.new_session(n);
  }
  void prefill(engine::SessionState& s, std::span<const int32_t> t, const engine::PrefillOptions& o,
               std::span<float> l) override {
    inner_.prefill(s, t, o, l);
  }
  void decode_rows(engine::SessionState& s, std::span<const int32_t> t,
                   std::span<float> l) override {
    inner_.decode_rows(s, t, l);
    if (!verify_against_draft) return;
    const size_t V = size_t(config().vocab_size);
    for (size_t i = 0; i + 1 < t.size() && (i + 1) * V <= last_draft_.size(); ++i) {
      std::copy(last_draft_.begin() + long(i * V), last_draft_.begin() + long((i + 1) * V),
                l.begin() + long(i * V));
    }
  }
  void commit(engine::SessionState& s, int n) override { inner_.commit(s, n); }
  engine::DraftBlock draft(engine::SessionState& s, int32_t anchor,
                           const engine::DraftSampler& sampler) override {
    auto b = inner_.draft(s, anchor, sampler);
    last_draft_ = b.logits;
    return b;
  }
  std::vector<uint8_t> snapshot(const engine::SessionState& s) const override {
    return inner_.snapshot(s);
  }
  void restore(engine::SessionState& s, std::span<const uint8_t> b) const override {
    inner_.restore(s, b);
  }

 private:
  engine::Backend& inner_;
  std::vector<float> last_draft_;
};

struct Fixture {
  Fixture()
      : cpu(tiny_a_dir(), tiny_a_golden_i64("engram_token_map")),
        V(size_t(cpu.config().vocab_size)) {
    const auto p = tiny_a_golden_i64("prompt_ids");
    prompt.assign(p.begin(), p.end());
    auto s = cpu.new_session(96);
    std::vector<float> lg(V);
    cpu.prefill(*s, std::span<const int32_t>(prompt.data(), prompt.size() - 1), {}, lg);
    head_snapshot = cpu.snapshot(*s);  // all but the last prompt token
  }
  // Exact law of (y1, y2) as a map code -> probability, with y1 restricted to tokens of
  // probability >= 1e-5 (the rest, and everything after them, is lumped into code -1).
  std::map<int64_t, double> exact_law(const sampling::SamplingParams& sp) {
    std::map<int64_t, double> law;
    auto s = cpu.new_session(96);
    cpu.restore(*s, head_snapshot);
    std::vector<float> lg(V), p1(V), p2(V), scratch(V);
    cpu.prefill(*s, std::span<const int32_t>(&prompt.back(), 1), {}, lg);
    sampling::logits_to_probs(lg.data(), int64_t(V), sp, p1.data(), scratch.data());
    const auto snap = cpu.snapshot(*s);
    double lumped = 0;
    for (size_t y1 = 0; y1 < V; ++y1) {
      if (p1[y1] < 1e-5) {
        lumped += p1[y1];
        continue;
      }
      auto t = cpu.new_session(96);
      cpu.restore(*t, snap);
      const int32_t tok = int32_t(y1);
      cpu.decode_rows(*t, std::span<const int32_t>(&tok, 1), lg);
      sampling::logits_to_probs(lg.data(), int64_t(V), sp, p2.data(), scratch.data());
      for (size_t y2 = 0; y2 < V; ++y2) {
        if (p2[y2] > 0) law[int64_t(y1 * V + y2)] = double(p1[y1]) * p2[y2];
      }
    }
    law[-1] = lumped;
    return law;
  }
  // Counts of (y1, y2) over `trials` seeded speculative runs.
  std::map<int64_t, int64_t> sample(engine::Backend& be, const sampling::SamplingParams& sp,
                                    int trials) {
    auto profile = engine::resolve_hardware_profile({"cpu", "", 0}, 5);
    profile.confidence_threshold = 0.0;  // verify every draft: the most verification per step
    engine::GenerationLoop loop(be, profile);
    std::map<int64_t, int64_t> counts;
    for (int t = 0; t < trials; ++t) {
      engine::GenerationParams gp;
      gp.sampling = sp;
      gp.seed = 1000003ull * uint64_t(t + 1);
      gp.max_new_tokens = 3;  // the step after y1 verifies one draft (y2), then y3 is dropped
      auto s = be.new_session(96);
      be.restore(*s, head_snapshot);
      auto r = loop.run(*s, std::span<const int32_t>(&prompt.back(), 1), gp,
                        [](auto, const auto&) { return true; });
      counts[int64_t(r.tokens[0]) * int64_t(V) + r.tokens[1]] += 1;
      drafted += r.drafted;
    }
    return counts;
  }
  cpu::CpuBackend cpu;
  size_t V;
  std::vector<int32_t> prompt;
  std::vector<uint8_t> head_snapshot;
  int64_t drafted = 0;  // drafts verified over all sampled runs
};

uf::sampling::testing::FitResult fit(const std::map<int64_t, double>& law,
                                     const std::map<int64_t, int64_t>& counts, size_t V,
                                     const std::map<int64_t, double>& y1_lumped) {
  std::vector<double> prob;
  std::vector<int64_t> count;
  std::map<int64_t, size_t> index;
  for (const auto& [code, pr] : law) {
    index[code] = prob.size();
    prob.push_back(pr);
    count.push_back(0);
  }
  for (const auto& [code, n] : counts) {
    const int64_t y1 = code / int64_t(V);
    auto it = index.find(y1_lumped.count(y1) ? -1 : code);
    if (it == index.end()) {
      prob.push_back(0.0);  // a pair the model gives probability 0: always a failure
      count.push_back(n);
    } else {
      count[it->second] += n;
    }
  }
  return uf::sampling::testing::chi_square_fit(prob, count);
}

std::map<int64_t, double> lumped_y1(Fixture& f, const sampling::SamplingParams& sp) {
  auto s = f.cpu.new_session(96);
  f.cpu.restore(*s, f.head_snapshot);
  std::vector<float> lg(f.V), p1(f.V), scratch(f.V);
  f.cpu.prefill(*s, std::span<const int32_t>(&f.prompt.back(), 1), {}, lg);
  sampling::logits_to_probs(lg.data(), int64_t(f.V), sp, p1.data(), scratch.data());
  std::map<int64_t, double> out;
  for (size_t y = 0; y < f.V; ++y) {
    if (p1[y] < 1e-5) out[int64_t(y)] = p1[y];
  }
  return out;
}

int trials() { return std::getenv("UF_SLOW_REDUCED") ? 500 : 3000; }

}  // namespace

TEST(CpuSpecDistribution, SpeculativeFirstTokensFollowPlainLaw) {
  Fixture f;
  sampling::SamplingParams sp;
  sp.temperature = 0.3f;  // peaked: few (y1, y2) pairs carry the mass, so the test has power
  const auto law = f.exact_law(sp);
  const auto lumped = lumped_y1(f, sp);
  TamperingBackend honest(f.cpu);
  const auto good = fit(law, f.sample(honest, sp, trials()), f.V, lumped);
  EXPECT_GE(f.drafted, trials() / 2) << "drafts were not verified: the test would test nothing";
  EXPECT_GE(good.df, 3) << "too few categories with expected counts >= 5: the test has no power";
  EXPECT_FALSE(good.rejects(1e-4)) << "chi2 " << good.statistic << " df " << good.df << " p "
                                   << good.p_value << " impossible " << good.impossible;
  // Power: a verifier that accepts every draft breaks the law, and the test sees it.
  TamperingBackend broken(f.cpu);
  broken.verify_against_draft = true;
  const auto bad = fit(law, f.sample(broken, sp, trials()), f.V, lumped);
  std::printf("honest: chi2 %.1f df %d p %.3g; broken verifier: chi2 %.1f df %d p %.3g\n",
              good.statistic, good.df, good.p_value, bad.statistic, bad.df, bad.p_value);
  EXPECT_TRUE(bad.rejects(1e-4)) << "the broken verifier went undetected: chi2 " << bad.statistic
                                 << " df " << bad.df << " p " << bad.p_value;
}
