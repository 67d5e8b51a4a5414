#include "core/dtypes.h"

#include <array>
#include <cmath>

namespace uf::core {

namespace {
struct DTypeInfo {
  DType type;
  std::string_view name;
  size_t size;
};
constexpr std::array<DTypeInfo, 12> kInfos = {{{DType::kF64, "F64", 8},
                                               {DType::kF32, "F32", 4},
                                               {DType::kF16, "F16", 2},
                                               {DType::kBF16, "BF16", 2},
                                               {DType::kF8E4M3, "F8_E4M3", 1},
                                               {DType::kF8E8M0, "F8_E8M0", 1},
                                               {DType::kI64, "I64", 8},
                                               {DType::kI32, "I32", 4},
                                               {DType::kI16, "I16", 2},
                                               {DType::kI8, "I8", 1},
                                               {DType::kU8, "U8", 1},
                                               {DType::kBool, "BOOL", 1}}};

}  // namespace

size_t dtype_size(DType t) {
  for (const auto& i : kInfos)
    if (i.type == t) return i.size;
  return 0;
}
std::string_view dtype_name(DType t) {
  for (const auto& i : kInfos)
    if (i.type == t) return i.name;
  return "?";
}
std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& i : kInfos)
    if (i.name == name) return i.type;
  return std::nullopt;
}

uint8_t float_to_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  float a = std::fabs(f);
  if (a >= kE4M3Max) return sign | 0x7e;  // satfinite
  // Quantum of the binade (subnormal binade below 2^-6 has quantum 2^-9).
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exp2 = e - 1;   // a in [2^exp2, 2^(exp2+1))
  if (exp2 < -6) exp2 = -6;
  const float quantum = std::ldexp(1.0f, exp2 - 3);
  const float q = std::nearbyint(a / quantum);  // exact division by a power of two; RNE
  const float r = q * quantum;
  if (r >= kE4M3Max) return sign | 0x7e;
  if (r == 0.f) return sign;
  if (r < std::ldexp(1.0f, -6)) return sign | uint8_t(q);  // subnormal: mantissa = r / 2^-9
  std::frexp(r, &e);
  const int ebits = (e - 1) + 7;
  const int mbits = int(std::ldexp(r, -(e - 1)) * 8.0f) - 8;
  return sign | uint8_t(ebits << 3) | uint8_t(mbits);
}

uint8_t float_to_e8m0(float f) {
  if (!(f > 0.f) || std::isinf(f)) return 255;
  int e;
  const float m = std::frexp(f, &e);   // f = m * 2^e
  int exp2 = (m == 0.5f) ? e - 1 : e;  // ceil(log2 f)
  if (exp2 < -127) exp2 = -127;
  if (exp2 > 127) return 255;
  return uint8_t(exp2 + 127);
}

uint8_t float_to_e2m1(float f) {
  // Midpoints between consecutive magnitudes; at a tie the even code wins, which is the upper
  // code for the midpoints .75, 1.75 and 3.5 and the lower one for .25, 1.25, 2.5 and 5.
  static constexpr float kMid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  if (std::isnan(f)) return 7;
  const float a = std::fabs(f);
  uint8_t code = 0;
  for (int i = 0; i < 7; ++i) {
    if (a > kMid[i] || (a == kMid[i] && (i & 1))) code = uint8_t(i + 1);
  }
  return code | (std::signbit(f) ? 8 : 0);
}

}  // namespace uf::core
