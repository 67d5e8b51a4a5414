#include "core/quant.h"

#include <algorithm>
#include <cmath>

#include "core/dtypes.h"

namespace uf::core {

float pow2_scale(float amax, float max_inv) {
  const uint32_t bits = float_to_bits(amax * max_inv);
  const int exp = int((bits >> 23) & 0xff);
  const int man = int(bits & 0x7fffff);
  const int log2_ceil = exp - 127 + (man != 0 ? 1 : 0);
  return bits_to_float(uint32_t(log2_ceil + 127) << 23);
}

static float block_amax(const float* x, int n) {
  float a = 0.f;
  for (int i = 0; i < n; ++i) a = std::max(a, std::fabs(x[i]));
  return a;
}

float quantize_fp8_block(const float* x, int n, uint8_t* codes) {
  const float s = pow2_scale(std::max(block_amax(x, n), kFp8ActAmaxFloor), kFp8MaxInv);
  for (int i = 0; i < n; ++i) codes[i] = float_to_e4m3(x[i] / s);  // float_to_e4m3 saturates
  return s;
}

void fake_quant_fp8(float* x, size_t n, int block) {
  for (size_t b = 0; b < n; b += size_t(block)) {
    const float s = pow2_scale(std::max(block_amax(x + b, block), kFp8ActAmaxFloor), kFp8MaxInv);
    for (int i = 0; i < block; ++i) {
      x[b + i] = round_bf16(e4m3_to_float(float_to_e4m3(x[b + i] / s)) * s);
    }
  }
}

void fake_quant_fp4_e4m3_scale(float* x, size_t n, int block) {
  for (size_t b = 0; b < n; b += size_t(block)) {
    const float amax = std::max(block_amax(x + b, block), 6.0f * 0x1p-9f);
    const float s = round_e4m3(amax / kE2M1Max);
    for (int i = 0; i < block; ++i) {
      const float v = std::clamp(x[b + i] / s, -kE2M1Max, kE2M1Max);
      x[b + i] = round_bf16(round_e2m1(v) * s);
    }
  }
}

void fake_quant_fp4_e8m0_scale(float* x, size_t n, int block) {
  for (size_t b = 0; b < n; b += size_t(block)) {
    const float amax = std::max(block_amax(x + b, block), 6.0f * 0x1p-126f);
    const float s = pow2_scale(amax, kFp4MaxInv);
    for (int i = 0; i < block; ++i) {
      const float v = std::clamp(x[b + i] / s, -kE2M1Max, kE2M1Max);
      x[b + i] = round_bf16(round_e2m1(v) * s);
    }
  }
}

}  // namespace uf::core
