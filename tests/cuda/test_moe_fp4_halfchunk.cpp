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
#include "moe_test_util.h"

namespace uf::cuda::test {
namespace {

void compare_half_chunks(int E, int dim, int inter, uint64_t seed) {
  std::mt19937 rng{uint32_t(seed)};
  const Experts x(E, dim, inter, seed);
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
    const Inputs in = random_inputs(m, dim, E, rng);
    for (Entry entry : {Entry::kRun, Entry::kPartial, Entry::kExperts}) {
      const auto want = call(pre, entry, x, in, m);
      EXPECT_TRUE(bitwise_equal(want, call(unit, entry, x, in, m), dim))
          << "default kernels vs prefill: dim " << dim << " inter " << inter << " m " << m << " "
          << entry_name(entry) << (unit.legacy() ? " (persistent: unit plan does not fit)" : "");
      EXPECT_TRUE(bitwise_equal(want, call(legacy, entry, x, in, m), dim))
          << "persistent kernels vs prefill: dim " << dim << " inter " << inter << " m " << m << " "
          << entry_name(entry);
      for (int f16 = 0; f16 < 2; ++f16)
        for (int set = 0; set < 2; ++set)
          EXPECT_TRUE(bitwise_equal(want, call(*paths[f16][set], entry, x, in, m), dim))
              << (set == 0
                      ? (paths[f16][set]->legacy() ? "persistent (unit plan does not fit)" : "unit")
                      : "persistent")
              << " kernels, " << (f16 ? "f16 HMMA" : "e4m3 mma") << " path, vs prefill: dim " << dim
              << " inter " << inter << " m " << m << " " << entry_name(entry);
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
