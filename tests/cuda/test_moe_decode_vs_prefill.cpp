// MoeFp4's decode kernels, both the unit kernels (default: one work unit per CTA) and the
// persistent ones (set_legacy: flat work units, w13 split partials reduced by the group's last
// warp), against MoeFp4Prefill, an independent implementation of the same operations and order
// (moe_prefill.cu): bitwise equal outputs for run / run_partial / run_experts at M = 1..8, at
// small dims and at the model's TP8 rank slice (dim 5120, inter 288, 384 experts, top-6); a
// repeated call is bitwise the same (counters reset; the order never depends on scheduling); and
// row-count independence (row t of an M = 8 call equals the M = 1 call for that row). No
// tolerance anywhere: any difference is a bug. The CPU reference comparison of the numerics is
// test_moe_fp4.cpp / test_moe_partial.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/device_fill.h"
#include "cuda/gemv.h"
#include "cuda/moe.h"
#include "cuda_test_util.h"
#include "moe_test_util.h"

namespace uf::cuda::test {
namespace {

void compare_paths(int E, int dim, int inter, uint64_t seed, const std::vector<int>& ms) {
  std::mt19937 rng{uint32_t(seed)};
  const Experts x(E, dim, inter, seed);
  MoeFp4 moe(dim, inter, kTopk, device_sm_count());
  MoeFp4Prefill pre(dim, inter, kTopk, E, 8);
  MoeFp4 old(dim, inter, kTopk, device_sm_count());  // the persistent kernels
  old.set_legacy(true);
  for (int m : ms) {
    const Inputs in = random_inputs(m, dim, E, rng);
    for (Entry e : {Entry::kRun, Entry::kPartial, Entry::kExperts}) {
      const auto want = call(pre, e, x, in, m);
      const auto got = call(moe, e, x, in, m);
      EXPECT_TRUE(bitwise_equal(want, got, dim))
          << "prefill vs decode (" << (moe.legacy() ? "persistent" : "unit") << " kernels): E " << E
          << " dim " << dim << " inter " << inter << " m " << m << " " << entry_name(e);
      EXPECT_TRUE(bitwise_equal(want, call(old, e, x, in, m), dim))
          << "prefill vs decode (persistent kernels): E " << E << " dim " << dim << " inter "
          << inter << " m " << m << " " << entry_name(e);
      const auto again = call(moe, e, x, in, m);
      EXPECT_TRUE(bitwise_equal(got, again, dim))
          << "decode twice: E " << E << " dim " << dim << " inter " << inter << " m " << m << " "
          << entry_name(e);
    }
  }
}

TEST(CudaMoeDecode, BitwiseEqualsPrefillSmallDims) {
  UF_REQUIRE_GPU();
  // K splits: dim 256 -> 1 split of 8 K blocks (fewer units than warps), 1024 -> 2, 1536 -> 3
  // (a last chunk of 8 blocks). 12 experts: rows share experts (up to 8 columns).
  compare_paths(12, 256, 64, 101, {1, 3, 8});
  compare_paths(12, 1024, 96, 102, {1, 2, 5, 8});
  compare_paths(40, 1536, 128, 103, {1, 4, 7, 8});
  // inter 1152: moe_w2_kernel's shared-memory plan does not fit, the per-tile w2 kernel runs.
  compare_paths(12, 256, 1152, 107, {1, 3, 8});
}

TEST(CudaMoeDecode, BitwiseEqualsPrefillRealDims) {
  UF_REQUIRE_GPU();
  compare_paths(384, 5120, 288, 104, {1, 2, 3, 4, 5, 6, 7, 8});
}

// Row t of an M = 8 call == the M = 1 call for row t (with its top-k list reversed: the order of
// a row's experts must not matter either).
void row_independence(int E, int dim, int inter, uint64_t seed) {
  std::mt19937 rng{uint32_t(seed)};
  const Experts x(E, dim, inter, seed);
  MoeFp4 moe(dim, inter, kTopk, device_sm_count());
  const Inputs full = random_inputs(8, dim, E, rng);
  for (Entry e : {Entry::kRun, Entry::kPartial}) {
    const auto all = call(moe, e, x, full, 8);
    for (int t = 0; t < 8; ++t) {
      Inputs one;
      one.codes.assign(full.codes.begin() + size_t(t) * dim,
                       full.codes.begin() + size_t(t + 1) * dim);
      one.scales.assign(full.scales.begin() + size_t(t) * dim / 32,
                        full.scales.begin() + size_t(t + 1) * dim / 32);
      one.idx.assign(full.idx.rbegin() + (7 - t) * kTopk, full.idx.rbegin() + (8 - t) * kTopk);
      one.wts.assign(full.wts.rbegin() + (7 - t) * kTopk, full.wts.rbegin() + (8 - t) * kTopk);
      const auto got = call(moe, e, x, one, 1);
      const std::vector<float> want(all.begin() + size_t(t) * dim,
                                    all.begin() + size_t(t + 1) * dim);
      EXPECT_TRUE(bitwise_equal(want, got, dim))
          << "row " << t << " of 8 vs alone, dim " << dim << " " << entry_name(e);
    }
  }
}

TEST(CudaMoeDecode, RowIndependentOfOtherRows) {
  UF_REQUIRE_GPU();
  row_independence(12, 1024, 64, 105);  // few experts: rows share them
  row_independence(384, 5120, 288, 106);
}

}  // namespace
}  // namespace uf::cuda::test
