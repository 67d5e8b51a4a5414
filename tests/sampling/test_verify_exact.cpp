// Exact-distribution tests by enumeration (no sampling noise): for tiny vocabularies, every draft
// block and every verification outcome is integrated analytically, and the law of the first L
// emitted tokens must equal the target's to 1e-12 (float64 rounding of sums of <= 3^8 products),
// for both modes, for temperature / top-k / top-p / greedy transforms of p and q, for DSpark-like
// Markov drafts, and for prefix-dependent early stop. Block E[tau] >= token-wise E[tau] exactly.
// Power: each deliberately broken verifier leaves a deviation far above the 1e-12 tolerance.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "exact_law.h"
#include "sampling/verify.h"

using namespace uf::sampling;
using namespace uf::sampling::testing;

namespace {

const SamplingParams kSettings[] = {
    {1.0f, 1.0f, 0}, {0.7f, 0.8f, 0}, {1.5f, 1.0f, 2},
    {0.5f, 0.7f, 2}, {2.0f, 0.9f, 0}, {0.0f, 1.0f, 0},  // greedy: one-hot p and q
};

std::string name(const SamplingParams& s) {
  return "T=" + std::to_string(s.temperature) + " top_p=" + std::to_string(s.top_p) +
         " top_k=" + std::to_string(s.top_k);
}

struct Case {
  int vocab, max_drafts, length;
  double draft_scale;
  bool markov;
};

const Case kCases[] = {
    {3, 3, 4, 1.5, false},  // context-dependent random target and draft
    {3, 3, 4, 1.5, true},   // DSpark-like draft: slot base + previous-token Markov bias
    {3, 3, 4, 6.0, false},  // draft much sharper than the target
    {2, 7, 8, 1.5, false},  // the longest block (7 drafts)
    {4, 2, 3, 1.5, true},   // four tokens, so top-k = 2 removes two
};

}  // namespace

TEST(VerifyExact, LosslessForEveryTransformAndBlockNeverWorse) {
  int strictly_better = 0;
  for (const Case& c : kCases) {
    for (uint64_t seed = 0; seed < 3; ++seed) {
      for (const SamplingParams& params : kSettings) {
        ToyModel target(100 + seed, c.vocab, 1.5),
            draft(200 + seed, c.vocab, c.draft_scale, c.markov);
        SpecSetup s{&target, &draft, params, c.max_drafts, c.length};
        const std::vector<double> want = target_law(s);
        const SpecLaw block = spec_law(s, reference_law(VerifyMode::kBlock, c.vocab));
        const SpecLaw token = spec_law(s, reference_law(VerifyMode::kTokenWise, c.vocab));
        const std::string where = "V=" + std::to_string(c.vocab) +
                                  " g=" + std::to_string(c.max_drafts) + " seed " +
                                  std::to_string(seed) + " " + name(params);
        EXPECT_LE(max_abs_diff(block.law, want), 1e-12) << "block " << where;
        EXPECT_LE(max_abs_diff(token.law, want), 1e-12) << "token-wise " << where;
        EXPECT_GE(block.expected_accepted, token.expected_accepted - 1e-12) << where;
        strictly_better += block.expected_accepted > token.expected_accepted + 1e-9;
      }
    }
  }
  EXPECT_GT(strictly_better, 20);  // block verification does gain, not only tie
}

// The drafter stops where a rule on the drafted prefix fires (as DSpark's confidence schedule
// does); verification then runs with g = the actual length, h_g = w_g at that position.
TEST(VerifyExact, LosslessWithPrefixDependentEarlyStop) {
  for (uint64_t seed = 0; seed < 4; ++seed) {
    for (const SamplingParams& params : {kSettings[0], kSettings[1], kSettings[3]}) {
      ToyModel target(300 + seed, 3, 1.5), draft(400 + seed, 3, 1.5, true);
      SpecSetup s{&target, &draft, params, 4, 5};
      s.stop = [](const Prefix& x) { return x.size() >= 2 && x.back() == 1; };
      const std::vector<double> want = target_law(s);
      for (VerifyMode m : {VerifyMode::kBlock, VerifyMode::kTokenWise}) {
        EXPECT_LE(max_abs_diff(spec_law(s, reference_law(m, 3)).law, want), 1e-12)
            << "seed " << seed << " " << name(params);
      }
    }
  }
}

TEST(VerifyExact, BrokenVerifiersAreDetected) {
  ToyModel target(101, 3, 1.5), draft(201, 3, 1.5);
  SpecSetup s{&target, &draft, kSettings[0], 3, 4};
  const std::vector<double> want = target_law(s);
  struct Probe {
    VerifyMode mode;
    Broken broken;
    const char* what;
  };
  const Probe probes[] = {
      {VerifyMode::kBlock, Broken::kAcceptAll, "accept always"},
      {VerifyMode::kTokenWise, Broken::kAcceptAll, "accept always (token-wise)"},
      {VerifyMode::kBlock, Broken::kCorrectionFromTarget, "correction from p"},
      {VerifyMode::kTokenWise, Broken::kCorrectionFromTarget, "correction from p (token-wise)"},
      {VerifyMode::kBlock, Broken::kUnscaledResidual, "block residual without w_tau"},
  };
  for (const Probe& pr : probes) {
    const double dev = max_abs_diff(spec_law(s, reference_law(pr.mode, 3, pr.broken)).law, want);
    EXPECT_GT(dev, 1e-4) << pr.what;  // 8 orders of magnitude above the pass tolerance
  }
}

// The float32 implementation's own weights and thresholds (with its residual scale) give a step
// law whose output law matches the target to 1e-5: float rows carry ~1e-7 relative error and a
// law of 4 tokens multiplies a handful of them.
TEST(VerifyExact, Float32ImplementationLawIsLossless) {
  for (VerifyMode mode : {VerifyMode::kBlock, VerifyMode::kTokenWise}) {
    for (const SamplingParams& params : kSettings) {
      ToyModel target(500, 3, 1.5), draft(600, 3, 1.5, true);
      SpecSetup s{&target, &draft, params, 3, 4};
      StepLawFn impl_law = [mode](int32_t g, const std::vector<double>& p,
                                  const std::vector<double>& q, const Prefix& x) {
        const int v = 3;
        std::vector<float> pf(p.begin(), p.end()), qf(q.begin(), q.end());
        VerifyRows rows{g, v, pf.data(), qf.data(), x.data()};
        const VerifyResult r = verify(mode, rows, VerifyDraws{});
        ReferenceStepLaw law;
        law.prob_accepted.assign(g + 1, 0.0);
        law.extra.resize(g + 1);
        double run = 1.0;
        for (int32_t i = 0; i <= g; ++i) {
          if (mode == VerifyMode::kTokenWise) {
            law.prob_accepted[i] = i < g ? run * (1.0 - r.threshold[i + 1]) : run;
            if (i < g) run *= r.threshold[i + 1];
          } else {
            double pr = i == 0 ? 1.0 : r.threshold[i];
            for (int32_t j = i + 1; j <= g; ++j) pr *= 1.0 - r.threshold[j];
            law.prob_accepted[i] = pr;
          }
          std::vector<double> pd(pf.begin() + i * v, pf.begin() + (i + 1) * v);
          if (i < g) {
            std::vector<double> qd(qf.begin() + i * v, qf.begin() + (i + 1) * v);
            const double scale = mode == VerifyMode::kBlock ? r.weight[i] : 1.0;
            law.extra[i] = normalised_residual(pd.data(), qd.data(), scale, v);
          } else {
            law.extra[i] = pd;
            double z = 0;
            for (double e : pd) z += e;
            for (double& e : law.extra[i]) e /= z;
          }
        }
        return law;
      };
      EXPECT_LE(max_abs_diff(spec_law(s, impl_law).law, target_law(s)), 1e-5) << name(params);
    }
  }
}
