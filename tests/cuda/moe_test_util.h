#pragma once
// Shared by the MoeFp4 decode tests (test_moe_decode_vs_prefill.cpp, test_moe_fp4_halfchunk.cpp):
// random MXFP4 experts filled on the device, random FP8 inputs and routing, one call through any
// of the three entry points of MoeFp4 / MoeFp4Prefill, and a bitwise comparison with diagnostics.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/device_fill.h"
#include "cuda/gemv.h"
#include "cuda/moe.h"
#include "cuda_test_util.h"

namespace uf::cuda::test {

inline constexpr float kLimit = 10.0f;
inline constexpr int kTopk = 6;

// Experts filled on the device (fast at 384 experts): FP4 bytes uniform, scales in a range that
// puts gate / up around the clamp limit (as test_moe_fp4.cpp).
struct Experts {
  int E, dim, inter;
  DeviceBuffer<uint8_t> w1, w1s, w3, w3s, w2, w2s;
  Experts(int e, int d, int i, uint64_t seed)
      : E(e),
        dim(d),
        inter(i),
        w1(size_t(e) * i * d / 2),
        w1s(size_t(e) * i * d / 32),
        w3(size_t(e) * i * d / 2),
        w3s(size_t(e) * i * d / 32),
        w2(size_t(e) * d * i / 2),
        w2s(size_t(e) * d * i / 32) {
    fill_random_bytes(w1.get(), w1.size(), seed + 1, 0, 255, nullptr);
    fill_random_bytes(w3.get(), w3.size(), seed + 2, 0, 255, nullptr);
    fill_random_bytes(w2.get(), w2.size(), seed + 3, 0, 255, nullptr);
    fill_random_bytes(w1s.get(), w1s.size(), seed + 4, 119, 123, nullptr);
    fill_random_bytes(w3s.get(), w3s.size(), seed + 5, 119, 123, nullptr);
    fill_random_bytes(w2s.get(), w2s.size(), seed + 6, 118, 124, nullptr);
    sync_and_check();
  }
  Fp4ExpertsView view() const {
    return {w1.get(), w1s.get(), w3.get(), w3s.get(), w2.get(), w2s.get(), E, dim, inter};
  }
};

struct Inputs {
  std::vector<uint8_t> codes;
  std::vector<float> scales, wts;
  std::vector<int> idx;
};

inline Inputs random_inputs(int m, int dim, int E, std::mt19937& rng) {
  Inputs in;
  in.codes = random_e4m3(size_t(m) * dim, rng);
  std::uniform_int_distribution<int> ex(118, 124);  // power-of-two activation scales
  for (int i = 0; i < m * dim / 32; ++i) in.scales.push_back(std::ldexp(1.0f, ex(rng) - 127));
  std::uniform_real_distribution<float> ud(0.05f, 0.6f);
  for (int t = 0; t < m; ++t) {
    std::vector<int> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int k = 0; k < kTopk; ++k) {
      in.idx.push_back(perm[k]);
      in.wts.push_back(ud(rng));
    }
  }
  return in;
}

enum class Entry { kRun, kPartial, kExperts };
inline const char* entry_name(Entry e) {
  return e == Entry::kRun ? "run" : e == Entry::kPartial ? "run_partial" : "run_experts";
}

// One call through `entry` of MoeFp4 or MoeFp4Prefill; returns the output (NaN-poisoned first).
template <typename Moe>
std::vector<float> call(const Moe& moe, Entry entry, const Experts& x, const Inputs& in, int m) {
  DeviceBuffer<uint8_t> a(in.codes);
  DeviceBuffer<float> as(in.scales);
  DeviceBuffer<int> di(in.idx);
  DeviceBuffer<float> dw(in.wts);
  const QuantActView act{a.get(), as.get(), m, x.dim};
  const int64_t stride = int64_t(kTopk) * x.dim + 64;  // a row stride wider than topk * dim
  DeviceBuffer<float> out(entry == Entry::kExperts ? size_t(m) * stride : size_t(m) * x.dim);
  out.poison();
  if (entry == Entry::kRun)
    moe.run(x.view(), act, di.get(), dw.get(), kLimit, out.get(), nullptr);
  else if (entry == Entry::kPartial)
    moe.run_partial(x.view(), act, di.get(), dw.get(), kLimit, out.get(), nullptr);
  else
    moe.run_experts(x.view(), act, di.get(), dw.get(), kLimit, out.get(), stride, nullptr);
  sync_and_check();
  auto v = out.download();
  if (entry == Entry::kExperts) {  // keep the written slots only (the gap stays poisoned)
    std::vector<float> w;
    for (int t = 0; t < m; ++t)
      w.insert(w.end(), v.begin() + t * stride, v.begin() + t * stride + int64_t(kTopk) * x.dim);
    v.swap(w);
  }
  return v;
}

// Bitwise comparison with diagnostics: mismatch count, first mismatch (index, row, column),
// max abs difference, NaN counts on each side.
inline ::testing::AssertionResult bitwise_equal(const std::vector<float>& want,
                                                const std::vector<float>& got, int row_len) {
  if (want.size() != got.size())
    return ::testing::AssertionFailure() << "sizes " << want.size() << " vs " << got.size();
  size_t bad = 0, first = size_t(-1), nan_w = 0, nan_g = 0;
  double max_abs = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    nan_w += std::isnan(want[i]);
    nan_g += std::isnan(got[i]);
    if (!bits_equal(want[i], got[i])) {
      if (first == size_t(-1)) first = i;
      ++bad;
      if (std::isfinite(want[i]) && std::isfinite(got[i]))
        max_abs = std::max(max_abs, std::fabs(double(want[i]) - got[i]));
    }
  }
  if (bad == 0 && nan_w == 0) return ::testing::AssertionSuccess();
  auto r = ::testing::AssertionFailure();
  r << bad << "/" << want.size() << " differ, NaN want " << nan_w << " got " << nan_g
    << ", max |diff| (finite) " << max_abs;
  if (first != size_t(-1))
    r << ", first at " << first << " (row " << first / row_len << ", col " << first % row_len
      << "): want " << want[first] << " got " << got[first];
  return r;
}

}  // namespace uf::cuda::test
