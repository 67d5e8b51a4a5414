#pragma once
// Goodness-of-fit helpers for the statistical tests: the chi-square survival function (regularised
// upper incomplete gamma, series / continued fraction) and a Pearson test with pooling of small
// expected counts, so the chi-square approximation holds at the stated false-alarm rate.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace uf::sampling::testing {

// Q(a, x) = Gamma(a, x) / Gamma(a).
inline double upper_gamma_q(double a, double x) {
  if (x <= 0.0) return 1.0;
  const double log_front = -x + a * std::log(x) - std::lgamma(a);
  if (x < a + 1.0) {
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 10000; ++n) {
      term *= x / (a + n);
      sum += term;
      if (term < sum * 1e-16) break;
    }
    return 1.0 - sum * std::exp(log_front);
  }
  const double tiny = 1e-300;
  double b = x + 1.0 - a, c = 1.0 / tiny, d = 1.0 / b, h = d;
  for (int i = 1; i < 10000; ++i) {
    const double an = -i * (i - a);
    b += 2.0;
    d = an * d + b;
    if (std::fabs(d) < tiny) d = tiny;
    c = b + an / c;
    if (std::fabs(c) < tiny) c = tiny;
    d = 1.0 / d;
    const double del = d * c;
    h *= del;
    if (std::fabs(del - 1.0) < 1e-16) break;
  }
  return std::exp(log_front) * h;
}

// P(chi2_df >= x).
inline double chi2_sf(double x, double df) { return upper_gamma_q(df / 2.0, x / 2.0); }

struct FitResult {
  double statistic = 0.0;
  int df = 0;
  double p_value = 1.0;
  int64_t impossible = 0;  // observations in categories of probability 0 (each one is a failure)
  bool rejects(double alpha) const { return impossible > 0 || p_value < alpha; }
};

// Pearson chi-square of counts against probabilities. Categories with expected count < 5 are
// pooled into one bin (grown with the next smallest categories until it reaches 5).
inline FitResult chi_square_fit(const std::vector<double>& prob,
                                const std::vector<int64_t>& count) {
  FitResult r;
  const int64_t n = std::accumulate(count.begin(), count.end(), int64_t{0});
  std::vector<size_t> order;
  for (size_t i = 0; i < prob.size(); ++i) {
    if (prob[i] > 0.0) {
      order.push_back(i);
    } else {
      r.impossible += count[i];
    }
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return prob[a] < prob[b]; });
  std::vector<double> e, o;
  double pe = 0.0, po = 0.0;
  size_t k = 0;
  while (k < order.size() && (n * prob[order[k]] < 5.0 || (pe > 0.0 && pe < 5.0))) {
    pe += n * prob[order[k]];
    po += double(count[order[k]]);
    ++k;
  }
  if (pe > 0.0) {
    e.push_back(pe);
    o.push_back(po);
  }
  for (; k < order.size(); ++k) {
    e.push_back(n * prob[order[k]]);
    o.push_back(double(count[order[k]]));
  }
  for (size_t i = 0; i < e.size(); ++i) r.statistic += (o[i] - e[i]) * (o[i] - e[i]) / e[i];
  r.df = int(e.size()) - 1;
  r.p_value = r.df > 0 ? chi2_sf(r.statistic, r.df) : 1.0;
  return r;
}

}  // namespace uf::sampling::testing
