#pragma once
// Comparisons shared by the CUDA backend tests: logits rows against a reference (max abs, rms-rel,
// non-finite count, first index whose bits differ), snapshot bytes, argmax.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda_test_util.h"

namespace uf::cuda::test {

struct Cmp {
  double maxabs = 0, rms_rel = 0;
  size_t nan = 0;
  int64_t first_diff = -1;  // first index whose bits differ
  std::string str() const {
    return "maxabs " + std::to_string(maxabs) + ", rms-rel " + std::to_string(rms_rel) + ", " +
           std::to_string(nan) + " non-finite, first differing index " + std::to_string(first_diff);
  }
};

inline Cmp compare(const float* a, const float* ref, size_t n) {
  Cmp c;
  double sq = 0, rr = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) ++c.nan;
    if (c.first_diff < 0 && !bits_equal(a[i], ref[i])) c.first_diff = int64_t(i);
    const double d = double(a[i]) - double(ref[i]);
    if (std::isfinite(d)) {
      c.maxabs = std::max(c.maxabs, std::fabs(d));
      sq += d * d;
    }
    rr += double(ref[i]) * double(ref[i]);
  }
  c.rms_rel = rr > 0 ? std::sqrt(sq / rr) : std::sqrt(sq);
  return c;
}

// Index of the first differing byte (-1: equal), so a failure does not print whole snapshots.
inline int64_t first_byte_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return int64_t(i);
  return a.size() == b.size() ? -1 : int64_t(n);
}

inline int argmax(const float* v, int n) { return int(std::max_element(v, v + n) - v); }

}  // namespace uf::cuda::test
