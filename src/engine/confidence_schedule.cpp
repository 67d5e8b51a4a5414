#include "engine/confidence_schedule.h"

#include <cmath>

namespace uf::engine {

double slot_threshold(int slot, int block, double threshold) {
  if (block >= 3 && slot == block - 2) return threshold * 0.5;
  if (block >= 3 && slot == block - 1) return threshold * 0.25;
  return threshold;
}

int scheduled_draft_length(std::span<const float> confidence_logits, double threshold) {
  const int block = int(confidence_logits.size());
  double survival = 1.0;
  for (int i = 0; i < block; ++i) {
    survival *= 1.0 / (1.0 + std::exp(-double(confidence_logits[size_t(i)])));
    if (survival < slot_threshold(i, block, threshold)) return i;
  }
  return block;
}

}  // namespace uf::engine
