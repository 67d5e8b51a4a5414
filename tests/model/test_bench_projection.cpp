// Benchmark arithmetic of model/synthetic.h (no GPU): the collectives a TP step runs, the
// per-call time table, tokens per second and the prefill integration.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "model/synthetic.h"

namespace uf::model {
namespace {

const ModelConfig& released() {
  static const ModelConfig c = ModelConfig::deepseek_v41_flash();
  return c;
}

// Counted by hand from the call sites: wo_b and MoE on each of the 40 backbone layers, the Engram
// row-split tables' sums on layers 1 and 14 (3 x 8 ids of 256 values a row), the index layers:
// by index heads (TpIndexSplit{false}) a sum of the scores on 2, 8, 14, 20 (the whole width) and
// on the Reindex layers 24, 28, 32, 36 (the candidate pool's list: 2048 blocks of 8, or the width
// in whole blocks); widths from new_session: the ratio-1 indexers (20..36) need capacity + 1
// entries per row. Two TP8-shaped ranks measured 91 (head split) and 83 / 92 (entry split, whole
// rows / every layer split) collective kernels in a 7-row step at 8k (docs/perf.md session 17).
TEST(TpCollectives, VerifyStepOfTheReleasedModel) {
  const TpIndexSplit heads{false};
  const auto v = tp_verify_collectives(released(), 8, 7, 8256, heads);
  ASSERT_EQ(v.size(), 6u);
  EXPECT_EQ(v[0].calls, 40);
  EXPECT_EQ(v[0].elements, 7 * 5120);
  EXPECT_EQ(v[1].calls, 40);
  EXPECT_EQ(v[1].elements, 7 * 5120);
  EXPECT_EQ(v[2].what, "Engram rows (row-split tables)");
  EXPECT_EQ(v[2].calls, 2);
  EXPECT_EQ(v[2].elements, 7 * 3 * 8 * 256);
  EXPECT_EQ(v[3].what, "index scores");
  EXPECT_EQ(v[3].calls, 4);
  EXPECT_EQ(v[3].elements, 7 * (8256 + 1));
  EXPECT_EQ(v[4].what, "index scores (candidate pool)");
  EXPECT_EQ(v[4].calls, 4);
  EXPECT_EQ(v[4].elements, 7 * 8264);  // 8257 entries in whole blocks of 8 (under 2048 blocks)
  const auto at_1m = tp_verify_collectives(released(), 8, 7, 1000064, heads);
  EXPECT_EQ(at_1m[3].elements, 7 * 1000065);
  EXPECT_EQ(at_1m[4].elements, 7 * 16384);  // the pool: 2048 x 8
  // The split head's logit slices: 129280 / 8 per row, gathered once.
  EXPECT_EQ(v[5].calls, 1);
  EXPECT_EQ(v[5].elements, 7 * 16160);
  EXPECT_EQ(total_calls(v), 91);
  EXPECT_DOUBLE_EQ(v[0].bytes(), 4.0 * 7 * 5120);
  EXPECT_EQ(index_score_width(released(), 1000064), 1000065);
  // The rank slice has the same layers and dims: the same collectives.
  EXPECT_EQ(total_calls(tp_verify_collectives(rank_slice_config(released(), 8), 8, 1, 100, heads)),
            91);
  // A vocab that does not divide keeps the head replicated: no gather.
  ModelConfig odd = released();
  odd.vocab_size = 129281;
  EXPECT_EQ(total_calls(tp_verify_collectives(odd, 8, 7, 8256, heads)), 90);
  EXPECT_TRUE(tp_verify_collectives(released(), 1, 7, 8256).empty());
  EXPECT_THROW(tp_verify_collectives(released(), 8, 0, 8256), core::Error);
}

// The indexer split by entries (the default): a call of rows x positions >= min_work gathers the
// ranks' 2 x 512 picks a row (and layer 20, the candidate source, its block maxima); below, none.
TEST(TpCollectives, EntrySplitIndexer) {
  auto calls_named = [](const std::vector<CollectiveCall>& v, const std::string& what) {
    for (const auto& c : v)
      if (c.what == what) return c;
    return CollectiveCall{what, 0, 0};
  };
  const std::string picks = "index picks (entry split, gather)";
  const std::string maxima = "candidate block maxima (entry split, gather)";
  // 8k, 7 rows: 7 x 8257 and 7 x 8264 are under 2^18: whole rows, no index collective.
  const auto at_8k = tp_verify_collectives(released(), 2, 7, 8256);
  EXPECT_EQ(total_calls(at_8k), 83);
  EXPECT_EQ(calls_named(at_8k, picks).calls, 0);
  // min_work 0: every index layer gathers its picks, the source also its maxima.
  const auto split = tp_verify_collectives(released(), 2, 7, 8256, TpIndexSplit{true, 0});
  EXPECT_EQ(total_calls(split), 92);
  EXPECT_EQ(calls_named(split, picks).calls, 8);
  EXPECT_EQ(calls_named(split, picks).elements, 7 * 2 * 512);
  EXPECT_EQ(calls_named(split, maxima).calls, 1);
  // A rank's range of 8257 entries over 2 ranks: 4129 rounded up to 32 = 4160, 520 blocks of 8.
  EXPECT_EQ(calls_named(split, maxima).elements, 7 * 520);
  // 1M, 1 row: the full-width layers (1000065 positions) split, the pool lists (16384) do not.
  const auto at_1m = tp_verify_collectives(released(), 8, 1, 1000064);
  EXPECT_EQ(calls_named(at_1m, picks).calls, 4);
  EXPECT_EQ(calls_named(at_1m, maxima).calls, 1);
  EXPECT_EQ(calls_named(at_1m, "index scores").calls, 0);
  // A 512-row prefill chunk at 8k splits every layer (512 x 8264 >= 2^18).
  EXPECT_EQ(calls_named(tp_verify_collectives(released(), 8, 512, 8256), picks).calls, 8);
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
