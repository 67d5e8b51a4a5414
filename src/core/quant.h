#pragma once
// The model's quantize-dequantize numerics (QAT semantics), shared by the weight generator, the
// CPU reference backend and the GPU tests. Each function mirrors the reference kernel bit for bit:
//  - scales are 2^ceil(log2(amax * max_inv)) computed from fp32 bits (exponent + "mantissa != 0");
//  - values are divided by the scale in fp32, clamped, and rounded to nearest even;
//  - dequantized results are exactly representable in bf16.

#include <cstddef>
#include <cstdint>

namespace uf::core {

// The reference multiplies by these fp32 reciprocals rather than dividing by 448 or 6.
inline constexpr float kFp8MaxInv = 1.0f / 448.0f;
inline constexpr float kFp4MaxInv = 1.0f / 6.0f;
inline constexpr float kFp8ActAmaxFloor = 1e-4f;  // act_quant's clamp_min

// 2^ceil(log2(amax * max_inv)), via the bits of the fp32 product.
float pow2_scale(float amax, float max_inv);

// FP8 E4M3 activation block (act_quant, ue8m0): amax floored at 1e-4. Writes n codes; returns the
// power-of-two scale. value[i] = e4m3(codes[i]) * scale.
float quantize_fp8_block(const float* x, int n, uint8_t* codes);

// In place: x = dequant(quant(x)) per consecutive block of `block` values (n % block == 0).
void fake_quant_fp8(float* x, size_t n, int block);
// FP4 E2M1 with an E4M3 scale = e4m3(amax / 6), amax >= 6 * 2^-9 (compressed KV, block 16).
void fake_quant_fp4_e4m3_scale(float* x, size_t n, int block);
// FP4 E2M1 with a UE8M0 scale = pow2_scale(amax, 1/6), amax >= 6 * 2^-126 (indexer q/k, block 32).
void fake_quant_fp4_e8m0_scale(float* x, size_t n, int block);

}  // namespace uf::core
