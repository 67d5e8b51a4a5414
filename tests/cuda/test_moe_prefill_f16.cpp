// MoeFp4Prefill's f16 kernels (set_f16(true), default: prefill_w13_f16_kernel /
// prefill_w2_f16_kernel, operands converted to the f16 HMMA form once) against its e4m3 mma
// kernels (set_f16(false)) and against MoeFp4 (the decode kernels) run on the rows in chunks of
// 8: BITWISE equal outputs of run / run_partial / run_experts, at M = 1, 7, 64, 100, 512, 2048,
// at the TP8 rank slice (dim 5120, inter 288, 384 experts, top-6) and small shapes whose K block
// counts end in half chunks (dim 384 / 640: 12 / 20 w13 K blocks; inter 96 / 1152: 3 / 36 w2 K
// blocks). The routing is random with some experts forced to 0, 1, 63, 64, 65 and 130 pairs
// (one item of 1..8 column groups, exactly 64 = one full item, 65 = a full item + a 1-column
// item, 130 = three items) and ~1/64 invalid ids. Outputs are NaN-poisoned before each call;
// run_experts' slots of invalid ids must stay poisoned, every other output finite. The f16 kernels
// run with their default item width (item_cols: 16 columns where the experts average <= 12
// pairs, else 64) and forced to each width (set_cols 16 / 64: the 130-pair expert is 9 or 3
// items). No tolerance: any difference is a bug; the first mismatch is printed with both values'
// bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/moe.h"
#include "cuda_test_util.h"
#include "moe_test_util.h"

namespace uf::cuda::test {
namespace {

constexpr int kMaxRows = 2048;

// Random routing [m, kTopk]: experts 0..5 forced to min(count, m) pairs {0, 1, 63, 64, 65, 130}
// (on random rows), the other slots distinct random experts from [6, E), ~1/64 of those replaced
// by an invalid id (-1 or >= E); each row's list shuffled.
void make_routing(int m, int E, std::mt19937& rng, std::vector<int>& idx, std::vector<float>& wts) {
  const int forced[6] = {0, 1, 63, 64, 65, 130};
  std::vector<std::vector<int>> rows(static_cast<size_t>(m));
  std::vector<int> order(static_cast<size_t>(m));
  std::iota(order.begin(), order.end(), 0);
  for (int e = 0; e < 6; ++e) {
    std::shuffle(order.begin(), order.end(), rng);
    for (int i = 0; i < std::min(forced[e], m); ++i) rows[size_t(order[size_t(i)])].push_back(e);
  }
  std::vector<int> pool(static_cast<size_t>(E - 6));
  std::uniform_real_distribution<float> wd(0.05f, 0.6f);
  idx.clear();
  wts.clear();
  for (auto& r : rows) {
    std::iota(pool.begin(), pool.end(), 6);
    for (size_t k = 0; r.size() < size_t(kTopk); ++k) {
      std::uniform_int_distribution<size_t> d(k, pool.size() - 1);
      std::swap(pool[k], pool[d(rng)]);
      int e = pool[k];
      if (rng() % 64 == 0) e = (rng() % 2) ? -1 : E + int(rng() % 3);
      r.push_back(e);
    }
    std::shuffle(r.begin(), r.end(), rng);
    for (int e : r) {
      idx.push_back(e);
      wts.push_back(wd(rng));
    }
  }
}

struct DevInputs {
  DeviceBuffer<uint8_t> codes;
  DeviceBuffer<float> scales, wts;
  DeviceBuffer<int> idx;
  explicit DevInputs(const Inputs& in)
      : codes(in.codes), scales(in.scales), wts(in.wts), idx(in.idx) {}
};

int64_t experts_stride(int dim) { return int64_t(kTopk) * dim + 64; }

// One call through `entry`; rows [0, m) in one call (prefill) or in chunks of 8 (decode).
template <typename Moe>
std::vector<float> run_entry(const Moe& moe, Entry entry, const Experts& x, const DevInputs& in,
                             int m, bool chunks_of_8) {
  const int64_t stride = experts_stride(x.dim);
  const size_t row_len = entry == Entry::kExperts ? size_t(stride) : size_t(x.dim);
  DeviceBuffer<float> out(size_t(m) * row_len);
  out.poison();
  const int step = chunks_of_8 ? 8 : m;
  for (int t0 = 0; t0 < m; t0 += step) {
    const int rows = std::min(step, m - t0);
    const QuantActView act{in.codes.get() + size_t(t0) * x.dim,
                           in.scales.get() + size_t(t0) * (x.dim / 32), rows, x.dim};
    const int* idx = in.idx.get() + t0 * kTopk;
    const float* w = in.wts.get() + t0 * kTopk;
    float* o = out.get() + size_t(t0) * row_len;
    if (entry == Entry::kRun)
      moe.run(x.view(), act, idx, w, kLimit, o, nullptr);
    else if (entry == Entry::kPartial)
      moe.run_partial(x.view(), act, idx, w, kLimit, o, nullptr);
    else
      moe.run_experts(x.view(), act, idx, w, kLimit, o, stride, nullptr);
  }
  sync_and_check();
  return out.download();
}

uint32_t bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}

// Bitwise equality; run_experts: the slots of invalid ids (and the stride's gap) must hold the
// poison in both, every other output must be finite. Diagnostics: mismatch count, the first
// mismatch (index, row, column, both values with their bits), non-finite counts.
::testing::AssertionResult same_bits(const std::vector<float>& want, const std::vector<float>& got,
                                     Entry entry, int dim, const std::vector<int>& idx, int E) {
  if (want.size() != got.size())
    return ::testing::AssertionFailure() << "sizes " << want.size() << " vs " << got.size();
  const size_t row_len = entry == Entry::kExperts ? size_t(experts_stride(dim)) : size_t(dim);
  size_t bad = 0, first = size_t(-1), nonfinite = 0, nonzero = 0, checked = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    bool written = true;
    if (entry == Entry::kExperts) {
      const size_t row = i / row_len, col = i % row_len, k = col / size_t(dim);
      written = k < size_t(kTopk) && idx[row * kTopk + k] >= 0 && idx[row * kTopk + k] < E;
    }
    const bool ok = written ? (std::isfinite(got[i]) && bits(want[i]) == bits(got[i]))
                            : (bits(want[i]) == 0xFFFFFFFFu && bits(got[i]) == 0xFFFFFFFFu);
    if (written) {
      ++checked;
      nonfinite += std::isfinite(want[i]) && std::isfinite(got[i]) ? 0 : 1;
      nonzero += got[i] != 0.f ? 1 : 0;
    }
    if (!ok) {
      if (first == size_t(-1)) first = i;
      ++bad;
    }
  }
  if (bad == 0 && nonzero > checked / 2) return ::testing::AssertionSuccess();
  auto r = ::testing::AssertionFailure();
  r << bad << "/" << want.size() << " differ, " << nonfinite << " non-finite and " << nonzero
    << " nonzero of " << checked << " written outputs";
  if (first != size_t(-1)) {
    char buf[160];
    std::snprintf(buf, sizeof(buf),
                  ", first at %zu (row %zu, col %zu): want %.9g (0x%08x) got %.9g (0x%08x)", first,
                  first / row_len, first % row_len, double(want[first]), bits(want[first]),
                  double(got[first]), bits(got[first]));
    r << buf;
  }
  return r;
}

void compare_f16(int E, int dim, int inter, uint64_t seed, const std::vector<int>& ms) {
  std::mt19937 rng{uint32_t(seed)};
  const Experts x(E, dim, inter, seed);
  MoeFp4Prefill f16(dim, inter, kTopk, E, kMaxRows);
  MoeFp4Prefill e4m3(dim, inter, kTopk, E, kMaxRows);
  MoeFp4Prefill f16_16(dim, inter, kTopk, E, kMaxRows), f16_64(dim, inter, kTopk, E, kMaxRows);
  f16.set_f16(true);
  e4m3.set_f16(false);
  f16_16.set_cols(16);
  f16_64.set_cols(64);
  MoeFp4 decode(dim, inter, kTopk, device_sm_count());
  for (int m : ms) {
    Inputs in = random_inputs(m, dim, E, rng);
    make_routing(m, E, rng, in.idx, in.wts);
    const DevInputs din(in);
    for (Entry e : {Entry::kRun, Entry::kPartial, Entry::kExperts}) {
      const std::string tag = "E " + std::to_string(E) + " dim " + std::to_string(dim) + " inter " +
                              std::to_string(inter) + " m " + std::to_string(m) + " " +
                              entry_name(e);
      const auto got = run_entry(f16, e, x, din, m, false);
      const auto old = run_entry(e4m3, e, x, din, m, false);
      EXPECT_TRUE(same_bits(old, got, e, dim, in.idx, E)) << "f16 vs e4m3 prefill kernels: " << tag;
      const auto dec = run_entry(decode, e, x, din, m, true);
      EXPECT_TRUE(same_bits(dec, got, e, dim, in.idx, E))
          << "f16 prefill vs decode kernels (chunks of 8 rows): " << tag;
      const auto again = run_entry(f16, e, x, din, m, false);
      EXPECT_TRUE(same_bits(got, again, e, dim, in.idx, E)) << "f16 prefill twice: " << tag;
      for (MoeFp4Prefill* forced : {&f16_16, &f16_64}) {
        const int cols = forced->item_cols(m);
        const auto f = run_entry(*forced, e, x, din, m, false);
        EXPECT_TRUE(same_bits(got, f, e, dim, in.idx, E))
            << "f16 prefill, " << cols << "-column items vs the default (" << f16.item_cols(m)
            << "): " << tag;
      }
    }
  }
}

const std::vector<int> kRows = {1, 7, 64, 100, 512, 2048};

TEST(CudaMoePrefillF16, BitwiseSmallShapes) {
  UF_REQUIRE_GPU();
  // dim 640: 20 w13 K blocks (chunks 8, 8, 4; splits 16 + 4); inter 96: 3 w2 K blocks.
  compare_f16(16, 640, 96, 401, kRows);
  // dim 384: 12 K blocks (chunks 8 + 4, one split of 12); inter 1152: 36 w2 K blocks (5 chunks).
  compare_f16(16, 384, 1152, 402, kRows);
}

TEST(CudaMoePrefillF16, BitwiseRealShape) {
  UF_REQUIRE_GPU();
  compare_f16(384, 5120, 288, 403, kRows);
}

// The default is the f16 path; the setter switches. Item widths: 16 columns up to a mean of 12
// pairs an expert (a TP8 rank's 512-row chunk: 3072 pairs over 384 experts), 64 above (2048
// rows) and for the e4m3 kernels; set_cols forces, 0 restores, other widths are refused.
TEST(CudaMoePrefillF16, DefaultAndSetter) {
  UF_REQUIRE_GPU();
  MoeFp4Prefill p(256, 64, kTopk, 12, 16);
  EXPECT_TRUE(p.f16());
  EXPECT_EQ(p.item_cols(16), 16);  // 96 pairs over 12 experts: a mean of 8
  p.set_f16(false);
  EXPECT_FALSE(p.f16());
  EXPECT_EQ(p.item_cols(16), 64);
  MoeFp4Prefill q(5120, 288, kTopk, 384, 2048);
  EXPECT_EQ(q.item_cols(512), 16);
  EXPECT_EQ(q.item_cols(768), 16);  // a mean of 12
  EXPECT_EQ(q.item_cols(769), 64);
  EXPECT_EQ(q.item_cols(2048), 64);
  q.set_cols(64);
  EXPECT_EQ(q.item_cols(512), 64);
  q.set_cols(16);
  EXPECT_EQ(q.item_cols(2048), 16);
  q.set_cols(0);
  EXPECT_EQ(q.item_cols(512), 16);
  EXPECT_THROW(q.set_cols(32), std::exception);
}

}  // namespace
}  // namespace uf::cuda::test
