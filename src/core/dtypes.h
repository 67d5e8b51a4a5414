#pragma once
// Scalar formats of the checkpoint and of the model's QAT numerics.
//
//  bf16      1-8-7, round-to-nearest-even from fp32, NaN kept quiet.
//  fp8 e4m3  OCP "fn" variant: bias 7, no infinities, S.1111.111 is NaN, max finite 448.
//            Encoding saturates to +-448 (CUDA satfinite) and rounds to nearest even.
//  e8m0      UE8M0 power-of-two scale: value = 2^(code - 127); code 255 is NaN.
//  fp4 e2m1  OCP MXFP4 element: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 = sign.
//            Code 8 (-0) decodes to 0. Two codes per byte, the low nibble holds the even element.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>

namespace uf::core {

// Tensor element types as safetensors names them.
enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kF8E4M3,
  kF8E8M0,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool
};

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);  // "F32", "BF16", "F8_E4M3", "F8_E8M0", "I8", ...
std::optional<DType> dtype_from_name(std::string_view name);

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// ---- bf16 ----
inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }
inline uint16_t float_to_bf16(float f) {
  uint32_t b = float_to_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x40);  // quiet NaN
  b += 0x7fffu + ((b >> 16) & 1u);                                         // RNE
  return uint16_t(b >> 16);
}
inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// ---- fp8 e4m3 (fn) ----
// Decodes one code from its fields: bias 7, 3 mantissa bits, subnormals m/8 * 2^-6.
constexpr float decode_e4m3_fields(uint8_t c) {
  const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return std::numeric_limits<float>::quiet_NaN();
  const float mag = e == 0 ? float(m) / 512.0f
                           : (1.0f + float(m) / 8.0f) *
                                 (e >= 7 ? float(1 << (e - 7)) : 1.0f / float(1 << (7 - e)));
  return s ? -mag : mag;
}
constexpr std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) t[c] = decode_e4m3_fields(uint8_t(c));
  return t;
}
inline constexpr std::array<float, 256> kE4M3Table = make_e4m3_table();
inline float e4m3_to_float(uint8_t code) { return kE4M3Table[code]; }
uint8_t float_to_e4m3(float f);  // saturating, RNE; NaN -> 0x7f
inline float round_e4m3(float f) { return e4m3_to_float(float_to_e4m3(f)); }
constexpr float kE4M3Max = 448.0f;

// ---- e8m0 ----
inline float e8m0_to_float(uint8_t code) {
  if (code == 255) return bits_to_float(0x7fc00000u);
  if (code == 0) return bits_to_float(0x00400000u);  // 2^-127 is an fp32 subnormal
  return bits_to_float(uint32_t(code) << 23);
}
// Exact for powers of two in [2^-127, 2^127]; other values round up to the next power of two
// (the scales of this model are always 2^ceil(log2(.))). NaN, <= 0 and overflow give 255.
uint8_t float_to_e8m0(float f);

// ---- fp4 e2m1 ----
constexpr float kE2M1Max = 6.0f;
inline float e2m1_to_float(uint8_t code) {
  static constexpr float kMag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  float m = kMag[code & 7];
  return (code & 8) && m != 0.f ? -m : m;
}
uint8_t float_to_e2m1(float f);  // RNE on the E2M1 grid, saturating to +-6; NaN -> 7 (+6)
inline float round_e2m1(float f) { return e2m1_to_float(float_to_e2m1(f)); }
inline uint8_t pack_e2m1(uint8_t even, uint8_t odd) { return uint8_t((even & 15) | (odd << 4)); }
inline uint8_t e2m1_even(uint8_t byte) { return byte & 15; }
inline uint8_t e2m1_odd(uint8_t byte) { return byte >> 4; }

}  // namespace uf::core
