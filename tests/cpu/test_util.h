#pragma once
// Small in-memory weights for the CPU op tests.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/dtypes.h"
#include "cpu/model_types.h"

namespace uf::cpu::testing {

// Owns its bytes; `w` points into them.
struct OwnedWeight {
  std::vector<uint8_t> bytes, scale;
  Weight w;
};

inline OwnedWeight f32_weight(int64_t rows, int64_t cols, const std::vector<float>& v) {
  OwnedWeight o;
  o.bytes.resize(v.size() * 4);
  std::memcpy(o.bytes.data(), v.data(), o.bytes.size());
  o.w.format = WFormat::kF32;
  o.w.rows = rows;
  o.w.cols = cols;
  o.w.data = o.bytes.data();
  o.w.name = "test";
  return o;
}

inline OwnedWeight bf16_weight(int64_t rows, int64_t cols, const std::vector<float>& v) {
  OwnedWeight o;
  o.bytes.resize(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t h = core::float_to_bf16(v[i]);
    std::memcpy(o.bytes.data() + 2 * i, &h, 2);
  }
  o.w.format = WFormat::kBF16;
  o.w.rows = rows;
  o.w.cols = cols;
  o.w.data = o.bytes.data();
  o.w.name = "test";
  return o;
}

// FP8 E4M3 with 32x32 E8M0 block scales, quantised from v the way the checkpoint is.
inline OwnedWeight fp8_weight(int64_t rows, int64_t cols, const std::vector<float>& v) {
  OwnedWeight o;
  const int64_t sr = (rows + 31) / 32, sc = (cols + 31) / 32;
  o.bytes.resize(size_t(rows * cols));
  o.scale.resize(size_t(sr * sc));
  for (int64_t br = 0; br < sr; ++br)
    for (int64_t bc = 0; bc < sc; ++bc) {
      float amax = 0;
      for (int64_t r = br * 32; r < std::min(rows, br * 32 + 32); ++r)
        for (int64_t c = bc * 32; c < std::min(cols, bc * 32 + 32); ++c)
          amax = std::max(amax, std::fabs(v[size_t(r * cols + c)]));
      const float s = std::exp2(std::ceil(std::log2(std::max(amax, 1e-30f) / 448.f)));
      o.scale[size_t(br * sc + bc)] = core::float_to_e8m0(s);
      for (int64_t r = br * 32; r < std::min(rows, br * 32 + 32); ++r)
        for (int64_t c = bc * 32; c < std::min(cols, bc * 32 + 32); ++c)
          o.bytes[size_t(r * cols + c)] = core::float_to_e4m3(v[size_t(r * cols + c)] / s);
    }
  o.w.format = WFormat::kFP8;
  o.w.rows = rows;
  o.w.cols = cols;
  o.w.data = o.bytes.data();
  o.w.scale = o.scale.data();
  o.w.name = "test";
  return o;
}

}  // namespace uf::cpu::testing
