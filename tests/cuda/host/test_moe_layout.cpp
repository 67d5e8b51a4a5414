// The decode MoE's persistent kernels' shared-memory plans (kernels/moe_layout.h), on the host:
// the properties the kernels' speed rests on, checked in CI where no GPU runs them.
#include <gtest/gtest.h>

#include "cuda/kernels/moe_layout.h"

namespace uf::cuda::detail {
namespace {

// An H200 (sm_90): 228 KiB of shared memory an SM, 1 KiB reserved a block, 227 KiB a block.
constexpr SmShared kH200{233472, 1024, 232448};
// One rank of the TP8 model: dim 5120, expert intermediate slice 288, top-6 routing.
constexpr int kDim = 5120, kInter = 288, kTopk = 6;

// A DSpark verify step (7 rows, 42 (row, expert) pairs) must keep the w2 CTA with h pre-converted
// beside the w13 CTA: it then starts during the w13 kernel's tail and prefetches its weights.
// Deeper rings or wider padding that break this cost ~100 us a 7-row step on the H200.
TEST(MoeLayout, W2CtaFitsBesideW13AtSevenRows) {
  const int room = w2_beside_w13(7, kDim, kH200, kBuildPlanStaticBytes, kBuildPlanStaticBytes);
  const int need = w2_layout(kInter, 7 * kTopk, true).total;
  EXPECT_LE(need, room) << "w2 needs " << need << " B, " << room << " B left beside w13";
  // Fewer rows leave more room, and smaller w2 plans: 1..7 rows all fit.
  for (int m = 1; m < 7; ++m)
    EXPECT_LE(w2_layout(kInter, m * kTopk, true).total,
              w2_beside_w13(m, kDim, kH200, kBuildPlanStaticBytes, kBuildPlanStaticBytes))
        << m << " rows";
}

TEST(MoeLayout, W13PlanFitsABlockAtEveryRowCount) {
  for (int dim : {1024, 5120, 7168})
    for (int m = 1; m <= kMaxDecodeRows; ++m)
      EXPECT_LE(w13_smem(m, dim), kH200.optin) << "dim " << dim << ", " << m << " rows";
}

// The input copy's reads: codes 8 bytes a lane from rows 32 bytes apart mod 128 (4 tokens x 4
// lanes of a half-warp on distinct banks), scales 16 bytes a lane from rows 16 bytes apart mod 128
// (4 tokens of a quarter-warp), and 16-byte alignment for cp.async and the vector reads.
TEST(MoeLayout, W13InputCopyIsConflictFreeAndAligned) {
  for (int dim : {1024, 5120, 7168}) {
    EXPECT_EQ(w13_code_stride(dim) % 128, 32) << dim;
    EXPECT_EQ(w13_scale_stride(dim) * 4 % 128, 16) << dim;
    EXPECT_EQ(kW13ActOff % 16, 0);
    EXPECT_EQ(w13_codes_off(dim) % 16, 0) << dim;
    EXPECT_GE(w13_codes_off(dim) - kW13ActOff, kMaxDecodeRows * w13_scale_stride(dim) * 4);
  }
}

TEST(MoeLayout, CtaSharedBytesRoundUpWithTheReservation) {
  EXPECT_EQ(cta_shared_bytes(0, 0, 1024), 1024);
  EXPECT_EQ(cta_shared_bytes(1, 0, 1024), 1152);
  EXPECT_EQ(cta_shared_bytes(134112, 512, 1024), 135680);
}

}  // namespace
}  // namespace uf::cuda::detail
