// MoE routing and the SwiGLU clamps against hand-computed values.
#include <gtest/gtest.h>

#include <cmath>

#include "core/dtypes.h"
#include "cpu/moe.h"
#include "test_util.h"

namespace uf::cpu {
namespace {

using testing::bf16_weight;
using testing::f32_weight;

double sqrt_softplus(double v) { return std::sqrt(std::log1p(std::exp(v))); }

TEST(CpuMoe, BiasSelectsButDoesNotWeight) {
  // dim 2, 4 experts, top-2; x = (1, 0) so expert e's raw score is W[e][0].
  auto gate = f32_weight(4, 2, {0, 0, 1, 0, 2, 0, 3, 0});
  auto bias = f32_weight(4, 1, {10, 0, 0, 0});
  MoeWeights w;
  w.gate = gate.w;
  w.gate_bias = bias.w;
  MoeParams p;
  p.n_experts = 4;
  p.top_k = 2;
  p.score_func = "sqrtsoftplus";
  p.route_scale = 1.5f;
  const float x[2] = {1, 0};
  int32_t gi[2];
  float gw[2];
  moe_route(w, p, x, 1, gi, gw);
  // Expert 0 wins only through its bias; expert 3 has the best raw score.
  EXPECT_EQ(gi[0], 0);
  EXPECT_EQ(gi[1], 3);
  const double s0 = sqrt_softplus(0), s3 = sqrt_softplus(3);
  EXPECT_NEAR(gw[0], s0 / (s0 + s3) * 1.5, 1e-6);
  EXPECT_NEAR(gw[1], s3 / (s0 + s3) * 1.5, 1e-6);
  // top-1 skips the normalisation (the reference normalises only for top_k > 1).
  p.top_k = 1;
  moe_route(w, p, x, 1, gi, gw);
  EXPECT_EQ(gi[0], 0);
  EXPECT_NEAR(gw[0], s0 * 1.5, 1e-6);
}

TEST(CpuMoe, SwigluClampsAndWeightBeforeDown) {
  // dim 1, inter 1: gate = 20x, up = -30x, down = 1.
  auto w1 = bf16_weight(1, 1, {20}), w3 = bf16_weight(1, 1, {-30}), w2 = bf16_weight(1, 1, {1});
  ExpertWeights e{w1.w, w2.w, w3.w};
  const float x[1] = {1};
  const float rw[1] = {0.5f};
  float y[1];
  expert_forward(e, 10.0f, x, 1, 1, 1, rw, y);
  const double silu10 = 10.0 / (1 + std::exp(-10.0));
  // gate clamped to 10 (from above only), up clamped to -10; weight applied before w2.
  EXPECT_NEAR(y[0], core::round_bf16(float(0.5 * silu10 * -10)), 1e-6);
  // Without a limit nothing is clamped.
  expert_forward(e, 0.0f, x, 1, 1, 1, rw, y);
  const double silu20 = 20.0 / (1 + std::exp(-20.0));
  EXPECT_NEAR(y[0], core::round_bf16(float(0.5 * silu20 * -30)), 0.5);
  // The gate is not clamped from below: a very negative gate passes through silu.
  auto w1n = bf16_weight(1, 1, {-20});
  ExpertWeights en{w1n.w, w2.w, w3.w};
  expert_forward(en, 10.0f, x, 1, 1, 1, nullptr, y);
  EXPECT_NEAR(y[0], -20.0 / (1 + std::exp(20.0)) * -10, 1e-6);
}

}  // namespace
}  // namespace uf::cpu
