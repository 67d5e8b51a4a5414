// Confidence schedule and hardware profiles.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "engine/confidence_schedule.h"
#include "engine/hardware_profile.h"

using namespace uf::engine;

namespace {
float logit(double p) { return float(std::log(p / (1 - p))); }
}  // namespace

TEST(ConfidenceSchedule, StopsBeforeTheSlotBelowThreshold) {
  // Survival: .9, .81, .729, .6561, .59. Threshold .75: slot 2 (.729 < .75) stops: 2 drafts.
  // Threshold .7: slots 0-2 clear .7, slot 3 needs .35 and slot 4 .175: all 5.
  std::vector<float> c(5, logit(0.9));
  EXPECT_EQ(scheduled_draft_length(c, 0.75), 2);
  EXPECT_EQ(scheduled_draft_length(c, 0.7), 5);
  // Threshold .3: every slot clears it (last two need .15 / .075).
  EXPECT_EQ(scheduled_draft_length(c, 0.3), 5);
  // A first slot below threshold verifies nothing (a plain decoding step).
  std::vector<float> low = {logit(0.1), logit(0.99)};
  EXPECT_EQ(scheduled_draft_length(low, 0.2), 0);
}

TEST(ConfidenceSchedule, LastTwoSlotsUseHalfAndQuarter) {
  // Block of 5 at threshold .4: slots 0-2 need .4, slot 3 needs .2, slot 4 needs .1.
  EXPECT_DOUBLE_EQ(slot_threshold(2, 5, 0.4), 0.4);
  EXPECT_DOUBLE_EQ(slot_threshold(3, 5, 0.4), 0.2);
  EXPECT_DOUBLE_EQ(slot_threshold(4, 5, 0.4), 0.1);
  // p = .75: survival .75, .5625, .4219, .3164, .2373
  std::vector<float> c(5, logit(0.75));
  EXPECT_EQ(scheduled_draft_length(c, 0.4), 5);   // .3164 >= .2, .2373 >= .1
  EXPECT_EQ(scheduled_draft_length(c, 0.45), 2);  // .4219 < .45 at slot 2
  // Blocks of 2 keep the full threshold on both slots.
  EXPECT_DOUBLE_EQ(slot_threshold(1, 2, 0.4), 0.4);
  std::vector<float> two = {logit(0.75), logit(0.75)};
  EXPECT_EQ(scheduled_draft_length(two, 0.6), 1);
}

TEST(HardwareProfile, ResolvesMostSpecificAndValidates) {
  auto h8 = resolve_hardware_profile({"cuda", "sm90", 8}, 5);
  EXPECT_EQ(h8.draft_tokens, 5);
  EXPECT_DOUBLE_EQ(h8.confidence_threshold, 0.2);
  auto h4 = resolve_hardware_profile({"cuda", "sm90", 4}, 5);
  EXPECT_DOUBLE_EQ(h4.confidence_threshold, 0.3);
  auto h2 = resolve_hardware_profile({"cuda", "sm90", 2}, 5);  // falls back to the arch default
  EXPECT_EQ(h2.draft_tokens, 5);
  auto b8 = resolve_hardware_profile({"cuda", "sm100", 8}, 5);
  EXPECT_EQ(b8.draft_tokens, 7);
  auto cpu = resolve_hardware_profile({"cpu", "", 0}, 4);
  EXPECT_EQ(cpu.draft_tokens, 4);  // the config's block size
  EXPECT_THROW(resolve_hardware_profile({"cpu", "", 0}, 9), uf::core::Error);
  EXPECT_THROW(validate_draft_tokens(0), uf::core::Error);
  EXPECT_THROW(validate_draft_tokens(8), uf::core::Error);
  EXPECT_NO_THROW(validate_draft_tokens(7));
  EXPECT_THROW(resolve_hardware_profile({"tpu", "", 0}, 5), uf::core::Error);
}
