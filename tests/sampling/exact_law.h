#pragma once
// Exact (enumerated, no sampling noise) law of the first L tokens emitted by one speculative step
// followed by plain sampling from the target, for toy context-dependent models over a tiny
// vocabulary: the C++ counterpart of /shared/spec/bv_exact_check.py, used by the exact tests.
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <vector>

#include "sampling/reference.h"
#include "sampling/transform.h"

namespace uf::sampling::testing {

using Prefix = std::vector<int32_t>;

// A toy language model: logits for every prefix, drawn once from a seeded generator and memoised.
// Some entries are -inf (token impossible after that prefix). `markov` builds DSpark-like draft
// logits instead: a per-position base plus a bias of the previous token only.
class ToyModel {
 public:
  ToyModel(uint64_t seed, int vocab, double scale, bool markov = false)
      : rng_(seed), vocab_(vocab), scale_(scale), markov_(markov) {
    std::normal_distribution<double> n(0.0, scale_);
    for (int i = 0; i < 16; ++i) base_.push_back(draw_row());
    for (int t = 0; t <= vocab; ++t) {
      std::vector<double> b(vocab);
      for (double& v : b) v = n(rng_);
      bias_.push_back(b);
    }
  }
  int vocab() const { return vocab_; }

  const std::vector<double>& logits(const Prefix& prefix) {
    auto it = memo_.find(prefix);
    if (it != memo_.end()) return it->second;
    std::vector<double> l;
    if (markov_) {
      const int last = prefix.empty() ? vocab_ : prefix.back();
      l = base_[prefix.size() % base_.size()];
      for (int x = 0; x < vocab_; ++x) l[x] += bias_[last][x];
    } else {
      l = draw_row();
    }
    return memo_.emplace(prefix, l).first->second;
  }

 private:
  std::vector<double> draw_row() {
    std::normal_distribution<double> n(0.0, scale_);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::vector<double> l(vocab_);
    for (double& v : l) v = n(rng_);
    if (u(rng_) < 0.3) l[std::uniform_int_distribution<int>(0, vocab_ - 1)(rng_)] = -INFINITY;
    return l;
  }

  std::mt19937_64 rng_;
  int vocab_;
  double scale_;
  bool markov_;
  std::vector<std::vector<double>> base_, bias_;
  std::map<Prefix, std::vector<double>> memo_;
};

// Deliberately broken verifiers, to show that the tests have power.
enum class Broken { kNone, kAcceptAll, kCorrectionFromTarget, kUnscaledResidual };

// One step's law for fixed rows and drafts: P(tau = i) and the extra-token law given tau.
using StepLawFn = std::function<ReferenceStepLaw(int32_t g, const std::vector<double>& p,
                                                 const std::vector<double>& q, const Prefix& x)>;

inline std::vector<double> normalised_residual(const double* p, const double* q, double scale,
                                               int vocab) {
  std::vector<double> r(vocab);
  double z = 0;
  for (int x = 0; x < vocab; ++x) z += r[x] = std::max(scale * p[x] - q[x], 0.0);
  if (!(z > 0)) {
    r.assign(p, p + vocab);
    z = 1.0;
  }
  for (double& v : r) v /= z;
  return r;
}

inline StepLawFn reference_law(VerifyMode mode, int vocab, Broken broken = Broken::kNone) {
  return
      [=](int32_t g, const std::vector<double>& p, const std::vector<double>& q, const Prefix& x) {
        ReferenceStepLaw law = reference_step_law(mode, g, vocab, p.data(), q.data(), x.data());
        const double* pg = p.data() + int64_t(g) * vocab;
        if (broken == Broken::kAcceptAll) {
          law.prob_accepted.assign(g + 1, 0.0);
          law.prob_accepted[g] = 1.0;
          law.extra.assign(g + 1, {});
          law.extra[g].assign(pg, pg + vocab);
        }
        for (int32_t t = 0; t < g; ++t) {
          if (law.prob_accepted[t] == 0.0) continue;
          const double* pt = p.data() + int64_t(t) * vocab;
          if (broken == Broken::kCorrectionFromTarget) law.extra[t].assign(pt, pt + vocab);
          if (broken == Broken::kUnscaledResidual) {
            law.extra[t] = normalised_residual(pt, q.data() + int64_t(t) * vocab, 1.0, vocab);
          }
        }
        return law;
      };
}

struct SpecSetup {
  ToyModel* target;
  ToyModel* draft;
  SamplingParams params;
  int32_t max_drafts;
  int32_t length;  // L: tokens of output whose law is computed
  std::function<bool(const Prefix&)> stop = [](const Prefix&) { return false; };
};

inline std::vector<double> dist(ToyModel& m, const Prefix& prefix, const SamplingParams& params) {
  const std::vector<double>& l = m.logits(prefix);
  return reference_transform(l.data(), int64_t(l.size()), params);
}

inline int64_t sequence_index(const Prefix& s, int vocab) {
  int64_t k = 0;
  for (int32_t t : s) k = k * vocab + t;
  return k;
}

// The target's own law of the first L tokens (indexed by sequence_index).
inline std::vector<double> target_law(SpecSetup& s) {
  const int v = s.target->vocab();
  std::vector<double> out(int64_t(std::pow(v, s.length)), 0.0);
  std::function<void(Prefix&, double)> rec = [&](Prefix& pre, double pr) {
    if (int(pre.size()) == s.length) {
      out[sequence_index(pre, v)] += pr;
      return;
    }
    const std::vector<double> p = dist(*s.target, pre, s.params);
    for (int x = 0; x < v; ++x) {
      if (p[x] == 0.0) continue;
      pre.push_back(x);
      rec(pre, pr * p[x]);
      pre.pop_back();
    }
  };
  Prefix pre;
  rec(pre, 1.0);
  return out;
}

struct SpecLaw {
  std::vector<double> law;       // of the first L emitted tokens
  double expected_accepted = 0;  // E[tau] of the step
};

// Enumerates every draft block (each slot drawn from the transformed draft row, stopping where
// `stop` fires or at max_drafts), integrates the verifier's step law, then continues with the
// target until L tokens.
inline SpecLaw spec_law(SpecSetup& s, const StepLawFn& step_law) {
  const int v = s.target->vocab();
  SpecLaw res;
  res.law.assign(int64_t(std::pow(v, s.length)), 0.0);
  std::function<void(Prefix&, double)> finish = [&](Prefix& pre, double pr) {
    if (int(pre.size()) >= s.length) {
      Prefix head(pre.begin(), pre.begin() + s.length);
      res.law[sequence_index(head, v)] += pr;
      return;
    }
    const std::vector<double> p = dist(*s.target, pre, s.params);
    for (int x = 0; x < v; ++x) {
      if (p[x] == 0.0) continue;
      pre.push_back(x);
      finish(pre, pr * p[x]);
      pre.pop_back();
    }
  };
  std::function<void(Prefix&, double)> drafts = [&](Prefix& x, double px) {
    const int32_t g = int32_t(x.size());
    if (g == s.max_drafts || (g > 0 && s.stop(x))) {
      std::vector<double> p, q;
      for (int32_t i = 0; i <= g; ++i) {
        const auto row = dist(*s.target, Prefix(x.begin(), x.begin() + i), s.params);
        p.insert(p.end(), row.begin(), row.end());
      }
      for (int32_t i = 0; i < g; ++i) {
        const auto row = dist(*s.draft, Prefix(x.begin(), x.begin() + i), s.params);
        q.insert(q.end(), row.begin(), row.end());
      }
      const ReferenceStepLaw law = step_law(g, p, q, x);
      for (int32_t t = 0; t <= g; ++t) {
        const double pt = law.prob_accepted[t];
        if (pt == 0.0) continue;
        res.expected_accepted += px * pt * t;
        for (int y = 0; y < v; ++y) {
          if (law.extra[t][y] == 0.0) continue;
          Prefix out(x.begin(), x.begin() + t);
          out.push_back(y);
          finish(out, px * pt * law.extra[t][y]);
        }
      }
      return;
    }
    const std::vector<double> q = dist(*s.draft, x, s.params);
    for (int t = 0; t < v; ++t) {
      if (q[t] == 0.0) continue;
      x.push_back(t);
      drafts(x, px * q[t]);
      x.pop_back();
    }
  };
  Prefix x;
  drafts(x, 1.0);
  return res;
}

inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

}  // namespace uf::sampling::testing
