#include "cpu/session.h"

#include <algorithm>

namespace uf::cpu {

void PosRing::init(int n_slots, int w) {
  slots = n_slots;
  width = w;
  data.assign(size_t(n_slots) * size_t(w), 0.f);
  pos.assign(size_t(n_slots), -1);
}

float* PosRing::put(int64_t p) {
  const size_t s = size_t(p % slots);
  pos[s] = p;
  return data.data() + s * size_t(width);
}

const float* PosRing::get(int64_t p) const {
  if (p < 0 || slots == 0) return nullptr;
  const size_t s = size_t(p % slots);
  return pos[s] == p ? data.data() + s * size_t(width) : nullptr;
}

}  // namespace uf::cpu
