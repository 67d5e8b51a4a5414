#pragma once
// The DSpark confidence schedule: how many of a round's draft slots are worth verifying.
// sigmoid(confidence logit i) estimates the conditional acceptance probability of slot i; their
// running product estimates the probability that the whole prefix survives. Drafting stops before
// the first slot whose running product falls below its threshold. In blocks of 3 or more slots the
// last two slots use half and a quarter of the threshold: a long prefix that survived that far is
// cheap to extend by one more verify row.

#include <span>

namespace uf::engine {

// Number of leading slots to verify (0..confidence_logits.size()).
int scheduled_draft_length(std::span<const float> confidence_logits, double threshold);

// The threshold slot `slot` of a block of `block` slots must clear.
double slot_threshold(int slot, int block, double threshold);

}  // namespace uf::engine
