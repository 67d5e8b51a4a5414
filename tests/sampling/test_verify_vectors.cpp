// The worked test vectors of serving-anchors.md §B.6 (Sun et al. 2024, §2 toy example):
// vocabulary {0, 1}, context-free M_b = p = [1/3, 2/3], M_s = q = [2/3, 1/3], g = 2.
// Token-wise E[tau] = 10/9, block E[tau] = 11/9, and the per-draft table. Checked on the float64
// reference (to 1e-15) and on the float32 implementation's diagnostics (to 1e-7: float rounding
// of 1/3, 2/3 is 3e-8), plus hand-traced outcomes for chosen eta, and the guard cases.
#include <gtest/gtest.h>

#include <vector>

#include "sampling/reference.h"
#include "sampling/verify.h"

using namespace uf::sampling;

namespace {

struct Row {
  int x1, x2;
  double prob;                // q(X)
  double w1, w2, z1, h1, h2;  // block weights and thresholds
  double tau[3];              // block P(tau = 0, 1, 2)
  double token_e, block_e;    // per-draft expected tau
};

const Row kTable[] = {
    {0, 0, 4.0 / 9, 0.5, 0.25, 0.0, 0.0, 0.25, {0.75, 0.0, 0.25}, 0.75, 0.5},
    {0, 1, 2.0 / 9, 0.5, 1.0, 0.0, 0.0, 1.0, {0.0, 0.0, 1.0}, 1.0, 2.0},
    {1, 0, 2.0 / 9, 1.0, 0.5, 1.0 / 3, 1.0, 0.5, {0.0, 0.5, 0.5}, 1.5, 1.5},
    {1, 1, 1.0 / 9, 1.0, 1.0, 1.0 / 3, 1.0, 1.0, {0.0, 0.0, 1.0}, 2.0, 2.0},
};

const double kP[] = {1.0 / 3, 2.0 / 3, 1.0 / 3, 2.0 / 3, 1.0 / 3, 2.0 / 3};  // p_0, p_1, p_2
const double kQ[] = {2.0 / 3, 1.0 / 3, 2.0 / 3, 1.0 / 3};                    // q_1, q_2
const float kPf[] = {1.0f / 3, 2.0f / 3, 1.0f / 3, 2.0f / 3, 1.0f / 3, 2.0f / 3};
const float kQf[] = {2.0f / 3, 1.0f / 3, 2.0f / 3, 1.0f / 3};

VerifyResult run(VerifyMode mode, const int32_t* x, float eta1, float eta2, float u) {
  VerifyRows rows;
  rows.num_drafts = 2;
  rows.vocab = 2;
  rows.target = kPf;
  rows.draft = kQf;
  rows.tokens = x;
  VerifyDraws d{};
  d.eta[0] = eta1;
  d.eta[1] = eta2;
  d.u_extra = u;
  return verify(mode, rows, d);
}

}  // namespace

TEST(VerifyVectors, ReferenceReproducesTheTable) {
  double token_e = 0, block_e = 0;
  for (const Row& r : kTable) {
    const int32_t x[2] = {r.x1, r.x2};
    const ReferenceStepLaw block = reference_step_law(VerifyMode::kBlock, 2, 2, kP, kQ, x);
    const ReferenceStepLaw token = reference_step_law(VerifyMode::kTokenWise, 2, 2, kP, kQ, x);
    const double eta[2] = {0.5, 0.5};
    const ReferenceVerifyResult diag =
        reference_verify(VerifyMode::kBlock, 2, 2, kP, kQ, x, eta, 0.5);
    EXPECT_NEAR(diag.weight[1], r.w1, 1e-15);
    EXPECT_NEAR(diag.weight[2], r.w2, 1e-15);
    EXPECT_NEAR(diag.residual_mass[1], r.z1, 1e-15);
    EXPECT_NEAR(diag.threshold[1], r.h1, 1e-15);
    EXPECT_NEAR(diag.threshold[2], r.h2, 1e-15);
    for (int t = 0; t < 3; ++t) EXPECT_NEAR(block.prob_accepted[t], r.tau[t], 1e-15) << t;
    EXPECT_NEAR(block.expected_accepted, r.block_e, 1e-15);
    EXPECT_NEAR(token.expected_accepted, r.token_e, 1e-15);
    // Wherever the block step can stop short, the residual forces Y = 1 (the table's last column).
    for (int t = 0; t < 2; ++t) {
      if (block.prob_accepted[t] > 0) {
        EXPECT_NEAR(block.extra[t][1], 1.0, 1e-15);
      }
    }
    token_e += r.prob * token.expected_accepted;
    block_e += r.prob * block.expected_accepted;
  }
  EXPECT_NEAR(token_e, 10.0 / 9, 1e-15);
  EXPECT_NEAR(block_e, 11.0 / 9, 1e-15);
}

TEST(VerifyVectors, ImplementationDiagnosticsMatchTheTable) {
  for (const Row& r : kTable) {
    const int32_t x[2] = {r.x1, r.x2};
    const VerifyResult b = run(VerifyMode::kBlock, x, 0.5f, 0.5f, 0.5f);
    EXPECT_NEAR(b.weight[0], 1.0, 0);
    EXPECT_NEAR(b.weight[1], r.w1, 1e-7);
    EXPECT_NEAR(b.weight[2], r.w2, 1e-7);
    EXPECT_NEAR(b.residual_mass[1], r.z1, 1e-7);
    EXPECT_NEAR(b.threshold[1], r.h1, 1e-7);
    EXPECT_NEAR(b.threshold[2], r.h2, 1e-7);
    const VerifyResult t = run(VerifyMode::kTokenWise, x, 0.5f, 0.5f, 0.5f);
    EXPECT_NEAR(t.threshold[1], r.x1 == 0 ? 0.5 : 1.0, 1e-7);
    EXPECT_NEAR(t.threshold[2], r.x2 == 0 ? 0.5 : 1.0, 1e-7);
  }
}

// Hand-traced steps with chosen eta (the "rescue" of §B.6: X_2's surplus lifts w_2 back to 1).
TEST(VerifyVectors, HandTracedOutcomes) {
  const int32_t x01[2] = {0, 1}, x00[2] = {0, 0}, x10[2] = {1, 0};
  // (0,1), eta = (0.9, 0.99): token-wise rejects X_1 (0.9 > 1/2), residual [0, 1/3] gives Y = 1;
  // block keeps both (h_2 = w_2 = 1) and draws the bonus from p_2 (u = 0.2 <= 1/3 gives 0).
  VerifyResult r = run(VerifyMode::kTokenWise, x01, 0.9f, 0.99f, 0.2f);
  EXPECT_EQ(r.accepted, 0);
  EXPECT_EQ(r.extra_token, 1);
  r = run(VerifyMode::kBlock, x01, 0.9f, 0.99f, 0.2f);
  EXPECT_EQ(r.accepted, 2);
  EXPECT_EQ(r.extra_token, 0);
  // (0,0), eta = (0.1, 0.3): token-wise accepts both (0.1, 0.3 <= 1/2); block has h_1 = 0 and
  // h_2 = 1/4 < 0.3, so tau = 0 and Y = 1 from the residual.
  r = run(VerifyMode::kTokenWise, x00, 0.1f, 0.3f, 0.9f);
  EXPECT_EQ(r.accepted, 2);
  EXPECT_EQ(r.extra_token, 1);
  r = run(VerifyMode::kBlock, x00, 0.1f, 0.3f, 0.2f);
  EXPECT_EQ(r.accepted, 0);
  EXPECT_EQ(r.extra_token, 1);
  // (1,0), eta = (0.5, 0.6): both modes keep X_1 only and draw Y = 1.
  for (VerifyMode m : {VerifyMode::kTokenWise, VerifyMode::kBlock}) {
    r = run(m, x10, 0.5f, 0.6f, 0.01f);
    EXPECT_EQ(r.accepted, 1);
    EXPECT_EQ(r.extra_token, 1);
  }
  // No early break: eta_1 fails (h_1 = 0 for (0,1)) yet tau = 2.
  r = run(VerifyMode::kBlock, x01, 1.0f, 1.0f, 0.9f);
  EXPECT_EQ(r.accepted, 2);
}

TEST(VerifyVectors, GuardCases) {
  // Identical p and q: w = 1, Z = 0, so h_i = Z / (Z + 1 - w) is 0/0 and is defined as 1.
  const float p[] = {0.2f, 0.5f, 0.3f, 0.2f, 0.5f, 0.3f, 0.2f, 0.5f, 0.3f};
  const int32_t x[2] = {1, 2};
  VerifyRows rows{2, 3, p, p, x};
  VerifyDraws d{};
  d.eta[0] = d.eta[1] = 1.0f;
  d.u_extra = 0.1f;
  VerifyResult r = verify(VerifyMode::kBlock, rows, d);
  EXPECT_EQ(r.threshold[1], 1.0f);
  EXPECT_EQ(r.threshold[2], 1.0f);
  EXPECT_EQ(r.accepted, 2);
  EXPECT_EQ(r.extra_token, 0);
  // A zero residual mass falls back to the target row.
  EXPECT_EQ(sample_residual(p, p, 1.0f, 3, 0.9f), 2);
  // q(X) = 0 (cannot be sampled) is treated as ratio +inf: weight 1.
  const float q0[] = {0.0f, 0.5f, 0.5f, 0.0f, 0.5f, 0.5f};
  const int32_t x0[2] = {0, 0};
  VerifyRows rows0{2, 3, p, q0, x0};
  r = verify(VerifyMode::kBlock, rows0, d);
  EXPECT_EQ(r.weight[1], 1.0f);
  // g = 0: plain sampling from p_0.
  VerifyRows rows_empty{0, 3, p, nullptr, nullptr};
  d.u_extra = 0.6f;
  for (VerifyMode m : {VerifyMode::kTokenWise, VerifyMode::kBlock}) {
    r = verify(m, rows_empty, d);
    EXPECT_EQ(r.accepted, 0);
    EXPECT_EQ(r.extra_token, 1);
  }
}
