// MoeFp4's decode kernels at dims whose K block count is not a multiple of 8 or 16 (K % 256 ==
// 128): the persistent w13 kernel's half chunks (a chunk of 4 K blocks at the end of K, skipped
// as a warp-uniform half), the unit w13 kernel's splits of 4 / 12 blocks (steps of 4), and w2
// over an odd number of K blocks (the fp32 scale rows of odd stride). Both kernel sets
// (set_legacy) against MoeFp4Prefill, an independent implementation of the same operations and
// order (moe_prefill.cu): bitwise equal outputs for run / run_partial / run_experts at M = 1..8
// with few experts, so rows share experts (up to 8 mma columns; absent columns are clamped onto
// a present one in the decode kernels, never stored). No tolerance: any difference is a bug.
// Each kernel set runs with both mma paths (MoeFp4::set_f16: the f16 HMMAs that sm_90a emulates
// the e4m3 mma with, or the e4m3 mma.sync itself), and the unit kernels at every M = 1..8
// (set_unit_max_rows(8); by default they run up to 2 rows only).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/device_fill.h"
#include "cuda/gemv.h"
#include "cuda/moe.h"
#include "cuda_test_util.h"

namespace uf::cuda::test {
namespace {

constexpr float kLimit = 10.0f;
constexpr int kTopk = 6;

struct HalfChunkExperts {
  int E, dim, inter;
  DeviceBuffer<uint8_t> w1, w1s, w3, w3s, w2, w2s;
  HalfChunkExperts(int e, int d, int i, uint64_t seed)
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

struct HalfChunkInputs {
  std::vector<uint8_t> codes;
  std::vector<float> scales, wts;
  std::vector<int> idx;
};

HalfChunkInputs make_inputs(int m, int dim, int E, std::mt19937& rng) {
  HalfChunkInputs in;
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

// entry 0 = run, 1 = run_partial, 2 = run_experts (written slots only; NaN-poisoned first).
template <typename Moe>
std::vector<float> call_entry(const Moe& moe, int entry, const HalfChunkExperts& x,
                              const HalfChunkInputs& in, int m) {
  DeviceBuffer<uint8_t> a(in.codes);
  DeviceBuffer<float> as(in.scales);
  DeviceBuffer<int> di(in.idx);
  DeviceBuffer<float> dw(in.wts);
  const QuantActView act{a.get(), as.get(), m, x.dim};
  const int64_t stride = int64_t(kTopk) * x.dim;
  DeviceBuffer<float> out(entry == 2 ? size_t(m) * stride : size_t(m) * x.dim);
  out.poison();
  if (entry == 0)
    moe.run(x.view(), act, di.get(), dw.get(), kLimit, out.get(), nullptr);
  else if (entry == 1)
    moe.run_partial(x.view(), act, di.get(), dw.get(), kLimit, out.get(), nullptr);
  else
    moe.run_experts(x.view(), act, di.get(), dw.get(), kLimit, out.get(), stride, nullptr);
  sync_and_check();
  return out.download();
}

::testing::AssertionResult same_bits(const std::vector<float>& want, const std::vector<float>& got,
                                     int row_len) {
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

void compare_half_chunks(int E, int dim, int inter, uint64_t seed) {
  std::mt19937 rng{uint32_t(seed)};
  const HalfChunkExperts x(E, dim, inter, seed);
  MoeFp4 unit(dim, inter, kTopk, device_sm_count());
  MoeFp4 legacy(dim, inter, kTopk, device_sm_count());
  legacy.set_legacy(true);
  MoeFp4Prefill pre(dim, inter, kTopk, E, 8);
  // [f16][set]: set 0 = the unit kernels at every M (where their plan fits), 1 = persistent.
  MoeFp4 unit_e4m3(dim, inter, kTopk, device_sm_count());
  MoeFp4 unit_f16(dim, inter, kTopk, device_sm_count());
  MoeFp4 pers_e4m3(dim, inter, kTopk, device_sm_count());
  MoeFp4 pers_f16(dim, inter, kTopk, device_sm_count());
  MoeFp4* paths[2][2] = {{&unit_e4m3, &pers_e4m3}, {&unit_f16, &pers_f16}};
  for (int f16 = 0; f16 < 2; ++f16)
    for (int set = 0; set < 2; ++set) {
      MoeFp4& moe = *paths[f16][set];
      moe.set_f16(f16 == 1);
      moe.set_legacy(set == 1);
      moe.set_unit_max_rows(8);
    }
  for (int m = 1; m <= 8; ++m) {
    const HalfChunkInputs in = make_inputs(m, dim, E, rng);
    for (int entry = 0; entry < 3; ++entry) {
      const auto want = call_entry(pre, entry, x, in, m);
      EXPECT_TRUE(same_bits(want, call_entry(unit, entry, x, in, m), dim))
          << "default kernels vs prefill: dim " << dim << " inter " << inter << " m " << m
          << " entry " << entry << (unit.legacy() ? " (persistent: unit plan does not fit)" : "");
      EXPECT_TRUE(same_bits(want, call_entry(legacy, entry, x, in, m), dim))
          << "persistent kernels vs prefill: dim " << dim << " inter " << inter << " m " << m
          << " entry " << entry;
      for (int f16 = 0; f16 < 2; ++f16)
        for (int set = 0; set < 2; ++set)
          EXPECT_TRUE(same_bits(want, call_entry(*paths[f16][set], entry, x, in, m), dim))
              << (set == 0
                      ? (paths[f16][set]->legacy() ? "persistent (unit plan does not fit)" : "unit")
                      : "persistent")
              << " kernels, " << (f16 ? "f16 HMMA" : "e4m3 mma") << " path, vs prefill: dim " << dim
              << " inter " << inter << " m " << m << " entry " << entry;
    }
  }
}

TEST(CudaMoeFp4HalfChunk, BitwiseEqualsPrefill) {
  UF_REQUIRE_GPU();
  // dim 128: 4 K blocks (one half chunk only); 384: 12 (a chunk of 8, then 4; unit split of 12);
  // 640: 20 (splits of 16 and 4). inter 96 / 160: 3 / 5 w2 K blocks. 10 experts: rows share.
  compare_half_chunks(10, 128, 96, 301);
  compare_half_chunks(10, 384, 160, 302);
  compare_half_chunks(10, 640, 96, 303);
}

TEST(CudaMoeFp4HalfChunk, F16AndE4m3PathsBitwiseAtLargerDims) {
  UF_REQUIRE_GPU();
  // Longer K loops: dim 2048 = 4 unit w13 splits of 16 blocks; inter 288 / 256 = 9 / 8 w2 K
  // blocks (the w2 loop's unroll by 3 with and without a remainder); 16 experts.
  compare_half_chunks(16, 2048, 288, 304);
  compare_half_chunks(16, 1024, 256, 305);
}

}  // namespace
}  // namespace uf::cuda::test
