// Benchmark arithmetic of model/synthetic.h (no GPU): the collectives a TP step runs, the
// per-call time table, tokens per second and the prefill integration.
#include <gtest/gtest.h>

#include "core/error.h"
#include "model/synthetic.h"

namespace uf::model {
namespace {

const ModelConfig& released() {
  static const ModelConfig c = ModelConfig::deepseek_v41_flash();
  return c;
}

// Counted by hand from the call sites: wo_b and MoE on each of the 40 backbone layers, the index
// scores on the 8 index-source layers: the whole width on 2, 8, 14, 20, the candidate pool's
// list on the Reindex layers 24, 28, 32, 36 (2048 blocks of 8, or the width in whole blocks);
// widths from new_session: the ratio-1 indexers (20..36) need capacity + 1 entries per row.
TEST(TpCollectives, VerifyStepOfTheReleasedModel) {
  const auto v = tp_verify_collectives(released(), 8, 7, 8256);
  ASSERT_EQ(v.size(), 5u);
  EXPECT_EQ(v[0].calls, 40);
  EXPECT_EQ(v[0].elements, 7 * 5120);
  EXPECT_EQ(v[1].calls, 40);
  EXPECT_EQ(v[1].elements, 7 * 5120);
  EXPECT_EQ(v[2].what, "index scores");
  EXPECT_EQ(v[2].calls, 4);
  EXPECT_EQ(v[2].elements, 7 * (8256 + 1));
  EXPECT_EQ(v[3].what, "index scores (candidate pool)");
  EXPECT_EQ(v[3].calls, 4);
  EXPECT_EQ(v[3].elements, 7 * 8264);  // 8257 entries in whole blocks of 8 (under 2048 blocks)
  const auto at_1m = tp_verify_collectives(released(), 8, 7, 1000064);
  EXPECT_EQ(at_1m[2].elements, 7 * 1000065);
  EXPECT_EQ(at_1m[3].elements, 7 * 16384);  // the pool: 2048 x 8
  // The split head's logit slices: 129280 / 8 per row, gathered once.
  EXPECT_EQ(v[4].calls, 1);
  EXPECT_EQ(v[4].elements, 7 * 16160);
  EXPECT_EQ(total_calls(v), 89);
  EXPECT_DOUBLE_EQ(v[0].bytes(), 4.0 * 7 * 5120);
  EXPECT_EQ(index_score_width(released(), 1000064), 1000065);
  // The rank slice has the same layers and dims: the same collectives.
  EXPECT_EQ(total_calls(tp_verify_collectives(rank_slice_config(released(), 8), 8, 1, 100)), 89);
  // A vocab that does not divide keeps the head replicated: no gather.
  ModelConfig odd = released();
  odd.vocab_size = 129281;
  EXPECT_EQ(total_calls(tp_verify_collectives(odd, 8, 7, 8256)), 88);
  EXPECT_TRUE(tp_verify_collectives(released(), 1, 7, 8256).empty());
  EXPECT_THROW(tp_verify_collectives(released(), 8, 0, 8256), core::Error);
}

TEST(TpCollectives, DraftRound) {
  const auto d = tp_draft_collectives(released(), 8);
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(total_calls(d), 7);  // 3 DSpark stages, wo_b + MoE each, + the head's gather
  EXPECT_EQ(d[2].elements, 5 * 16160);
  EXPECT_EQ(d[0].elements, 5 * 5120);
  EXPECT_TRUE(tp_draft_collectives(released(), 1).empty());
}

TEST(CommTime, InterpolatesAndExtrapolates) {
  const std::vector<CommSample> t = {{4000, 20}, {1000, 10}, {16000, 50}};
  EXPECT_DOUBLE_EQ(comm_time_us(t, 10), 10);     // below the smallest: its time
  EXPECT_DOUBLE_EQ(comm_time_us(t, 1000), 10);   // a sample
  EXPECT_DOUBLE_EQ(comm_time_us(t, 2500), 15);   // halfway between 1000 and 4000
  EXPECT_DOUBLE_EQ(comm_time_us(t, 10000), 35);  // halfway between 4000 and 16000
  EXPECT_DOUBLE_EQ(comm_time_us(t, 28000), 80);  // slope of the last two: 30 us per 12000 B
  EXPECT_DOUBLE_EQ(comm_time_us({{100, 7}}, 1e9), 7);
  EXPECT_THROW(comm_time_us({}, 1), core::Error);
  const std::vector<CollectiveCall> calls = {{"a", 3, 250}, {"b", 2, 2500}};  // 1000 B, 10000 B
  EXPECT_DOUBLE_EQ(comm_step_us(calls, t), 3 * 10 + 2 * 35);
}

TEST(TokensPerSecond, AcceptedOverStep) {
  EXPECT_DOUBLE_EQ(tokens_per_second(5.6, 2000), 2800);
  EXPECT_DOUBLE_EQ(tokens_per_second(3.0, 1500), 2000);
  EXPECT_THROW(tokens_per_second(3.0, 0), core::Error);
}

TEST(PrefillSeconds, IntegratesPiecewiseLinear) {
  // Constant 2 us per token: 1000 tokens take 2 ms.
  EXPECT_DOUBLE_EQ(prefill_seconds({{8192, 2}}, 1000), 2e-3);
  // Linear from 1 us at 0 to 3 us at 1000: the mean is 2 us.
  EXPECT_NEAR(prefill_seconds({{0, 1}, {1000, 3}}, 1000), 2e-3, 1e-15);
  // Half way: integral of 1 + c/500 over [0, 500] = 500 + 250 = 750 us.
  EXPECT_NEAR(prefill_seconds({{1000, 3}, {0, 1}}, 500), 750e-6, 1e-15);
  // First point above 0: constant below it; beyond the last: constant.
  // [0,100]: 1 us; [100,200]: 1..2 us (150 us); [200,300]: 2 us.
  EXPECT_NEAR(prefill_seconds({{100, 1}, {200, 2}}, 300), (100 + 150 + 200) * 1e-6, 1e-15);
  // Three points, a kink at 100: [0,100] 1..3 us (200 us), [100,400] 3..6 us (1350 us).
  EXPECT_NEAR(prefill_seconds({{0, 1}, {100, 3}, {400, 6}}, 400), (200 + 1350) * 1e-6, 1e-12);
  EXPECT_DOUBLE_EQ(prefill_seconds({{0, 1}}, 0), 0);
  EXPECT_THROW(prefill_seconds({}, 10), core::Error);
  EXPECT_THROW(prefill_seconds({{0, 0}}, 10), core::Error);
}

}  // namespace
}  // namespace uf::model
