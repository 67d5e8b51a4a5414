#pragma once
// Host-side checkpoint-format weights for the ops tests (test_ops_linear.cpp, test_ops_moe.cpp,
// test_moe_partial.cpp):
// owned byte buffers plus a model::Weight view over them, random activations, and the comparison
// helpers (bf16 ulp, error report).

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "cuda_test_util.h"
#include "model/weights.h"

namespace uf::cuda::test {

// A weight in checkpoint format: the bytes live here, `w` views them.
struct HostWeight {
  std::vector<uint8_t> data, scale;
  model::Weight w;
};

// scale_lo..scale_hi: E8M0 codes (127 = 1.0) of the FP8 / FP4 block scales.
inline std::unique_ptr<HostWeight> make_weight(model::WFormat f, int64_t rows, int64_t cols,
                                               std::mt19937& rng, int scale_lo = 118,
                                               int scale_hi = 122, bool row_scale = false,
                                               const std::string& name = "test") {
  auto h = std::make_unique<HostWeight>();
  std::normal_distribution<float> nd(0.f, 1.f);
  const size_t n = size_t(rows) * size_t(cols);
  switch (f) {
    case model::WFormat::kF32: {
      h->data.resize(4 * n);
      float* p = reinterpret_cast<float*>(h->data.data());
      for (size_t i = 0; i < n; ++i) p[i] = nd(rng) * 0.1f;
      break;
    }
    case model::WFormat::kBF16: {
      h->data.resize(2 * n);
      uint16_t* p = reinterpret_cast<uint16_t*>(h->data.data());
      for (size_t i = 0; i < n; ++i) p[i] = core::float_to_bf16(nd(rng) * 0.1f);
      break;
    }
    case model::WFormat::kFP8: {
      h->data = random_e4m3(n, rng);
      const size_t sr = row_scale ? size_t(rows) : size_t((rows + 31) / 32);
      h->scale = random_bytes(sr * size_t((cols + 31) / 32), rng, scale_lo, scale_hi);
      break;
    }
    case model::WFormat::kFP4:
      h->data = random_bytes(n / 2, rng);
      h->scale = random_bytes(size_t(rows) * size_t(cols / 32), rng, scale_lo, scale_hi);
      break;
  }
  h->w.format = f;
  h->w.rows = rows;
  h->w.cols = cols;
  h->w.data = h->data.data();
  h->w.scale = h->scale.empty() ? nullptr : h->scale.data();
  h->w.row_scale = row_scale;
  h->w.name = name;
  return h;
}

// A MoE layer in checkpoint formats (the MoE tests): BF16 router + F32 bias, E routed experts in
// MXFP4 (w1 / w3 scales in routed_scale_lo..hi), a shared expert in FP8.
// A model weight set (model::MoeWeights, model::EngramWeights) whose host weights stay alive
// with it: add() keeps a HostWeight and returns its view.
template <class Weights>
struct HostWeightSet {
  std::vector<std::unique_ptr<HostWeight>> keep;
  Weights w;
  model::Weight add(std::unique_ptr<HostWeight> h) {
    keep.push_back(std::move(h));
    return keep.back()->w;
  }
};
using HostMoe = HostWeightSet<model::MoeWeights>;

inline std::unique_ptr<HostMoe> make_host_moe(int E, int dim, int inter, int routed_scale_lo,
                                              int routed_scale_hi, std::mt19937& rng) {
  using model::WFormat;
  auto m = std::make_unique<HostMoe>();
  m->w.gate = m->add(make_weight(WFormat::kBF16, E, dim, rng, 0, 0, false, "gate"));
  m->w.gate_bias = m->add(make_weight(WFormat::kF32, E, 1, rng, 0, 0, false, "gate.bias"));
  for (int e = 0; e < E; ++e) {
    model::ExpertWeights x;
    x.w1 = m->add(
        make_weight(WFormat::kFP4, inter, dim, rng, routed_scale_lo, routed_scale_hi, false, "w1"));
    x.w3 = m->add(
        make_weight(WFormat::kFP4, inter, dim, rng, routed_scale_lo, routed_scale_hi, false, "w3"));
    x.w2 = m->add(make_weight(WFormat::kFP4, dim, inter, rng, 118, 122, false, "w2"));
    m->w.experts.push_back(x);
  }
  m->w.shared.w1 = m->add(make_weight(WFormat::kFP8, inter, dim, rng, 118, 122, false, "s1"));
  m->w.shared.w3 = m->add(make_weight(WFormat::kFP8, inter, dim, rng, 118, 122, false, "s3"));
  m->w.shared.w2 = m->add(make_weight(WFormat::kFP8, dim, inter, rng, 116, 120, false, "s2"));
  return m;
}

// An Engram layer in checkpoint formats (the Engram tests): an FP8 table of `rows` rows with
// per-row E8M0 scales, an FP8 wkv [(hc + 1) * dim, n_cols * head_dim], BF16 q / k weights.
using HostEngram = HostWeightSet<model::EngramWeights>;

inline std::unique_ptr<HostEngram> make_host_engram(int hc, int dim, int n_cols, int head_dim,
                                                    int64_t rows, std::mt19937& rng) {
  using model::WFormat;
  auto e = std::make_unique<HostEngram>();
  e->w.table =
      e->add(make_weight(WFormat::kFP8, rows, head_dim, rng, 118, 124, true, "engram.embed"));
  e->w.wkv = e->add(make_weight(WFormat::kFP8, int64_t(hc + 1) * dim, int64_t(n_cols) * head_dim,
                                rng, 116, 120, false, "engram.wkv"));
  e->w.q_weight = e->add(make_weight(WFormat::kBF16, hc, dim, rng, 0, 0, false, "q_weight"));
  e->w.k_weight = e->add(make_weight(WFormat::kBF16, hc, dim, rng, 0, 0, false, "k_weight"));
  return e;
}

// Activations: bf16 values whose rows and 32-blocks span several magnitudes.
inline std::vector<float> random_acts(int T, int64_t K, std::mt19937& rng, float scale = 1.f,
                                      bool bf16 = true) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> mag(-3.f, 3.f);
  std::vector<float> x(size_t(T) * size_t(K));
  for (size_t b = 0; b < x.size(); b += 32) {
    const float m = scale * std::exp2(mag(rng));
    for (size_t i = b; i < std::min(x.size(), b + 32); ++i) {
      const float v = nd(rng) * m;
      x[i] = bf16 ? core::round_bf16(v) : v;
    }
  }
  return x;
}

// One bf16 ulp at |v| (the spacing of bf16 values there).
inline float bf16_ulp(float v) {
  const float a = std::fabs(v);
  if (!(a > 0x1p-126f)) return 0x1p-133f;
  return std::exp2(std::floor(std::log2(a)) - 7.f);
}

// Error summary of got vs want; `ok(i)` says whether element i is within its tolerance.
struct Compare {
  size_t n = 0, exact = 0, bad = 0, nan = 0;
  long first_bad = -1;
  float max_abs = 0, max_ulps = 0;
  template <typename Ok>
  Compare(const std::vector<float>& got, const std::vector<float>& want, Ok ok) {
    n = want.size();
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(got[i])) {
        ++nan;
        if (first_bad < 0) first_bad = long(i);
        continue;
      }
      if (bits_equal(got[i], want[i])) ++exact;
      const float d = std::fabs(got[i] - want[i]);
      max_abs = std::max(max_abs, d);
      max_ulps = std::max(max_ulps, d / bf16_ulp(std::max(std::fabs(want[i]), std::fabs(got[i]))));
      if (!ok(i)) {
        ++bad;
        if (first_bad < 0) first_bad = long(i);
      }
    }
  }
  std::string report(const std::vector<float>& got, const std::vector<float>& want) const {
    char buf[400];
    std::snprintf(buf, sizeof buf,
                  "n=%zu exact=%zu bad=%zu nan=%zu max_abs=%g max_bf16_ulps=%g first_bad=%ld "
                  "(got %g want %g)",
                  n, exact, bad, nan, double(max_abs), double(max_ulps), first_bad,
                  first_bad >= 0 ? double(got[size_t(first_bad)]) : 0.0,
                  first_bad >= 0 ? double(want[size_t(first_bad)]) : 0.0);
    return buf;
  }
};

// Engram outputs against cpu::engram_forward, per copy of dim values: wkv runs on Fp8Gemv (the
// fp32 order of a block's products differs, so a bf16 rounding of a key or value may flip,
// rarely); the gate's fp32 arithmetic is the CPU's, expf up to an ulp apart. A flipped key moves
// its copy's gate slightly (a few of that copy's outputs flip by an ulp). So every output within
// 2 bf16 ulps + 2^-7 of its copy's largest output.
inline Compare compare_engram(const std::vector<float>& got, const std::vector<float>& want,
                              int dim) {
  std::vector<float> copy_max(want.size() / size_t(dim), 0.f);
  for (size_t i = 0; i < want.size(); ++i)
    copy_max[i / dim] = std::max(copy_max[i / dim], std::fabs(want[i]));
  return Compare(got, want, [&](size_t i) {
    const float u = bf16_ulp(std::max(std::fabs(got[i]), std::fabs(want[i])));
    return std::fabs(got[i] - want[i]) <= 2 * u + 0x1p-7f * copy_max[i / dim];
  });
}

}  // namespace uf::cuda::test
