#include "sampling/reference.h"

#include <algorithm>
#include <cmath>

namespace uf::sampling {
namespace {

double ratio_weight(double w, double p, double q) {
  if (q <= 0.0) return 1.0;
  return std::min(1.0, w * p / q);
}

std::vector<double> residual(const double* p, const double* q, double scale, int64_t vocab) {
  std::vector<double> r(vocab);
  for (int64_t x = 0; x < vocab; ++x) r[x] = std::max(scale * p[x] - q[x], 0.0);
  return r;
}

double total(const std::vector<double>& r) {
  double s = 0.0;
  for (double v : r) s += v;
  return s;
}

// The law of the extra token given tau (block: scale = w_tau; token-wise: scale = 1).
std::vector<double> extra_law(int32_t tau, int32_t g, int64_t vocab, const double* p,
                              const double* q, double scale) {
  const double* pt = p + tau * vocab;
  std::vector<double> d(pt, pt + vocab);
  if (tau < g) {
    std::vector<double> r = residual(pt, q + tau * vocab, scale, vocab);
    const double z = total(r);
    if (z > 0.0) d = r;
  }
  const double z = total(d);
  for (double& v : d) v /= z;
  return d;
}

struct Thresholds {
  std::array<double, kMaxDraft + 1> w{}, h{}, z{};
};

Thresholds thresholds(VerifyMode mode, int32_t g, int64_t vocab, const double* p, const double* q,
                      const int32_t* tokens) {
  Thresholds t;
  t.w[0] = 1.0;
  t.h[0] = 1.0;
  for (int32_t i = 1; i <= g; ++i) {
    const int32_t x = tokens[i - 1];
    const double pi = p[(i - 1) * vocab + x], qi = q[(i - 1) * vocab + x];
    t.w[i] = ratio_weight(t.w[i - 1], pi, qi);
    if (mode == VerifyMode::kTokenWise) t.h[i] = ratio_weight(1.0, pi, qi);
  }
  for (int32_t i = 0; i < g; ++i) {
    const double scale = mode == VerifyMode::kBlock ? t.w[i] : 1.0;
    t.z[i] = total(residual(p + i * vocab, q + i * vocab, scale, vocab));
  }
  if (mode == VerifyMode::kBlock) {
    for (int32_t i = 1; i <= g; ++i) {
      if (i == g) {
        t.h[i] = t.w[i];
      } else {
        const double den = t.z[i] + (1.0 - t.w[i]);  // keeps den >= z, so h <= 1
        t.h[i] = den > 0.0 ? t.z[i] / den : 1.0;
      }
    }
  }
  return t;
}

}  // namespace

std::vector<double> reference_transform(const double* logits, int64_t vocab,
                                        const SamplingParams& params) {
  std::vector<double> p(vocab, 0.0);
  if (params.greedy()) {
    int64_t best = 0;
    for (int64_t x = 1; x < vocab; ++x) {
      if (logits[x] > logits[best]) best = x;
    }
    p[best] = 1.0;
    return p;
  }
  const double m = *std::max_element(logits, logits + vocab);
  const double t = params.temperature;
  for (int64_t x = 0; x < vocab; ++x) p[x] = std::exp((logits[x] - m) / t);
  std::vector<bool> keep(vocab, true);
  if (params.top_k > 0 && params.top_k < vocab) {
    for (int64_t x = 0; x < vocab; ++x) {
      int64_t larger = 0;
      for (int64_t y = 0; y < vocab; ++y) larger += p[y] > p[x];
      keep[x] = larger < params.top_k;
    }
  }
  if (params.top_p < 1.0f) {
    double zk = 0.0;
    for (int64_t x = 0; x < vocab; ++x) zk += keep[x] ? p[x] : 0.0;
    std::vector<bool> keep_p(vocab, false);
    for (int64_t x = 0; x < vocab; ++x) {
      if (!keep[x]) continue;
      double larger = 0.0;
      for (int64_t y = 0; y < vocab; ++y) larger += (keep[y] && p[y] > p[x]) ? p[y] : 0.0;
      keep_p[x] = larger < double(params.top_p) * zk;
    }
    keep = keep_p;
  }
  double z = 0.0;
  for (int64_t x = 0; x < vocab; ++x) {
    if (!keep[x]) p[x] = 0.0;
    z += p[x];
  }
  for (double& v : p) v /= z;
  return p;
}

int32_t reference_sample(const double* weights, int64_t vocab, double u) {
  double z = 0.0;
  for (int64_t x = 0; x < vocab; ++x) z += weights[x];
  if (!(z > 0.0)) return -1;
  const double target = u * z;
  double run = 0.0;
  int32_t last = -1;
  for (int64_t x = 0; x < vocab; ++x) {
    if (!(weights[x] > 0.0)) continue;
    run += weights[x];
    last = int32_t(x);
    if (run >= target) return last;
  }
  return last;
}

ReferenceVerifyResult reference_verify(VerifyMode mode, int32_t g, int64_t vocab, const double* p,
                                       const double* q, const int32_t* tokens, const double* eta,
                                       double u_extra) {
  const Thresholds t = thresholds(mode, g, vocab, p, q, tokens);
  ReferenceVerifyResult res;
  res.weight = t.w;
  res.threshold = t.h;
  res.residual_mass = t.z;
  int32_t tau = 0;
  if (mode == VerifyMode::kTokenWise) {
    while (tau < g && eta[tau] <= t.h[tau + 1]) ++tau;
  } else {
    for (int32_t i = 1; i <= g; ++i) {
      if (eta[i - 1] <= t.h[i]) tau = i;
    }
  }
  res.accepted = tau;
  const double scale = mode == VerifyMode::kBlock ? t.w[tau] : 1.0;
  const double* pt = p + tau * vocab;
  if (tau < g) {
    std::vector<double> r = residual(pt, q + tau * vocab, scale, vocab);
    res.extra_token = reference_sample(r.data(), vocab, u_extra);
  }
  if (res.extra_token < 0) res.extra_token = reference_sample(pt, vocab, u_extra);
  return res;
}

ReferenceStepLaw reference_step_law(VerifyMode mode, int32_t g, int64_t vocab, const double* p,
                                    const double* q, const int32_t* tokens) {
  const Thresholds t = thresholds(mode, g, vocab, p, q, tokens);
  ReferenceStepLaw law;
  law.prob_accepted.assign(g + 1, 0.0);
  law.extra.resize(g + 1);
  if (mode == VerifyMode::kTokenWise) {
    double run = 1.0;  // P(the first i drafts are accepted)
    for (int32_t i = 0; i <= g; ++i) {
      law.prob_accepted[i] = i < g ? run * (1.0 - t.h[i + 1]) : run;
      if (i < g) run *= t.h[i + 1];
    }
  } else {
    // tau = i iff eta_i <= h_i and eta_j > h_j for every j > i (h_0 = 1).
    for (int32_t i = 0; i <= g; ++i) {
      double pr = t.h[i];
      for (int32_t j = i + 1; j <= g; ++j) pr *= 1.0 - t.h[j];
      law.prob_accepted[i] = pr;
    }
  }
  for (int32_t i = 0; i <= g; ++i) {
    law.expected_accepted += i * law.prob_accepted[i];
    if (law.prob_accepted[i] > 0.0) {
      const double scale = mode == VerifyMode::kBlock ? t.w[i] : 1.0;
      law.extra[i] = extra_law(i, g, vocab, p, q, scale);
    }
  }
  return law;
}

}  // namespace uf::sampling
