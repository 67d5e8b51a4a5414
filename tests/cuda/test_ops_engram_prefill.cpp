// DeviceEngram on prefill-length spans: apply() runs chunks of up to 128 rows whose projection
// takes the FP8 prefill GEMM (T > 8), so every row must be bitwise what a one-row call (the
// decode GEMV) gives, and within the CPU bound of test_ops_moe.cpp's Engram test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "cpu/engram.h"
#include "cuda/ops/engram.h"
#include "cuda_test_util.h"
#include "ops_test_weights.h"

namespace uf::cuda::test {
namespace {

TEST(OpsEngram, PrefillChunksEqualOneRowCalls) {
  UF_REQUIRE_GPU();
  const ScopedPrefillGemm bitwise(PrefillGemm::kFp8Bitwise);  // bitwise one-row calls
  std::mt19937 rng(9090);
  // wkv [(hc + 1) * D, n_cols * head_dim] = [640, 512]: the FP8 GEMV / GEMM path.
  const int hc = 4, D = 128, n_cols = 4, head_dim = 128, rows = 700;
  const auto host = make_host_engram(hc, D, n_cols, head_dim, rows, rng);
  const model::EngramWeights& w = host->w;
  const EngramShape shape{hc, D, n_cols, head_dim, 1e-6f};
  const cpu::EngramParams p{hc, D, n_cols, head_dim, 1e-6f};
  DeviceArena arena;
  DeviceEngram eng(w, shape, arena);

  // 300 rows: chunks of 128, 128 and 44 (the GEMM each time).
  const int T = 300;
  std::uniform_int_distribution<int64_t> id(0, rows - 1);
  std::vector<int64_t> ids(size_t(T) * n_cols);
  for (auto& v : ids) v = id(rng);
  const std::vector<float> X = random_acts(T * hc, D, rng);
  DeviceBuffer<int64_t> dids(ids);
  DeviceBuffer<float> dX(X), dout(X.size());
  dout.poison();
  eng.apply(dids.get(), dX.get(), T, dout.get(), nullptr);
  sync_and_check();
  const std::vector<float> got = dout.download();

  // Against the CPU, within compare_engram's bound.
  std::vector<float> want(X.size());
  cpu::engram_forward(w, p, ids.data(), X.data(), T, want.data());
  const Compare cmp = compare_engram(got, want, D);
  EXPECT_EQ(cmp.nan, 0u) << cmp.report(got, want);
  EXPECT_EQ(cmp.bad, 0u) << cmp.report(got, want);
  EXPECT_GE(double(cmp.exact), 0.97 * double(cmp.n)) << cmp.report(got, want);

  // Every row bitwise a one-row call's (the GEMM's outputs are the GEMV's).
  DeviceBuffer<float> one(size_t(hc) * D);
  for (int r = 0; r < T; ++r) {
    one.poison();
    eng.apply(dids.get() + int64_t(r) * n_cols, dX.get() + int64_t(r) * hc * D, 1, one.get(),
              nullptr);
    sync_and_check();
    const std::vector<float> o = one.download();
    for (int i = 0; i < hc * D; ++i)
      ASSERT_TRUE(bits_equal(o[size_t(i)], got[size_t(r * hc * D + i)]))
          << "row " << r << " element " << i;
  }
}

}  // namespace
}  // namespace uf::cuda::test
