#pragma once
// Device helpers of the ops (ops/*.cu): the scalar formats of core/dtypes.h and the one device
// decoder of checkpoint weight formats (weight_at: model::Weight::at and cpu weight_row bit for
// bit), exact fp32 arithmetic, and a fixed-order block reduction.
//
// Exactness: nvcc contracts a * b + c into an FMA by default (-fmad=true) while the CPU reference
// is built with -ffp-contract=off, so every product or sum whose bits matter goes through the
// explicitly rounded intrinsics below (never contracted). Subnormals are kept (no -ftz).

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/device_weights.h"

namespace uf::cuda::ew {

__device__ __forceinline__ float fmul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float fadd(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float fsub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float fdiv(float a, float b) { return __fdiv_rn(a, b); }
// std::max / std::min / std::clamp semantics (the first argument wins unless strictly beaten).
__device__ __forceinline__ float smax(float a, float b) { return a < b ? b : a; }
__device__ __forceinline__ float sclamp(float v, float lo, float hi) {
  return v < lo ? lo : (hi < v ? hi : v);
}

// core::round_bf16: round to nearest even, NaN kept quiet with the same bits.
__device__ __forceinline__ float round_bf16(float f) {
  uint32_t b = __float_as_uint(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return __uint_as_float(((b >> 16) | 0x40u) << 16);
  b += 0x7fffu + ((b >> 16) & 1u);
  return __uint_as_float(b & 0xffff0000u);
}

__device__ __forceinline__ float bf16_to_f32(uint16_t h) {
  return __uint_as_float(uint32_t(h) << 16);
}

// core::e4m3_to_float, every code bit for bit (NaN codes, either sign, give the positive quiet
// NaN): the value is assembled from the bits, no arithmetic.
__device__ __forceinline__ float e4m3_to_f32(uint32_t c) {
  const uint32_t e = (c >> 3) & 15u, m = c & 7u;
  if ((c & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u);
  const float mag = e == 0 ? float(m) * 0x1p-9f : __uint_as_float(((e + 120u) << 23) | (m << 20));
  return (c & 0x80u) ? -mag : mag;
}

// core::float_to_e4m3: saturating, round to nearest even, NaN -> 0x7f.
__device__ __forceinline__ uint8_t f32_to_e4m3(float f) {
  if (isnan(f)) return 0x7f;
  const uint8_t sign = signbit(f) ? 0x80 : 0x00;
  const float a = fabsf(f);
  if (a >= 448.0f) return sign | 0x7e;
  int e;
  frexpf(a, &e);
  int exp2 = e - 1;
  if (exp2 < -6) exp2 = -6;
  const float quantum = ldexpf(1.0f, exp2 - 3);
  const float q = rintf(fdiv(a, quantum));  // exact division by a power of two; RNE
  const float r = fmul(q, quantum);
  if (r >= 448.0f) return sign | 0x7e;
  if (r == 0.f) return sign;
  if (r < ldexpf(1.0f, -6)) return sign | uint8_t(q);
  frexpf(r, &e);
  const int ebits = (e - 1) + 7;
  const int mbits = int(fmul(ldexpf(r, -(e - 1)), 8.0f)) - 8;
  return sign | uint8_t(ebits << 3) | uint8_t(mbits);
}
__device__ __forceinline__ float round_e4m3(float f) { return e4m3_to_f32(f32_to_e4m3(f)); }

// core::e8m0_to_float: 0 -> 2^-127 (fp32 subnormal), 255 -> NaN.
__device__ __forceinline__ float e8m0_to_f32(uint8_t c) {
  if (c == 255) return __uint_as_float(0x7fc00000u);
  if (c == 0) return __uint_as_float(0x00400000u);
  return __uint_as_float(uint32_t(c) << 23);
}

// core::e2m1_to_float: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; code 8 (-0) decodes to +0, as on
// the CPU.
__device__ __forceinline__ float e2m1_to_f32(uint8_t code) {
  const int e = (code >> 1) & 3, m = code & 1;
  const float mag = e == 0 ? 0.5f * float(m) : (1.0f + 0.5f * float(m)) * float(1 << (e - 1));
  return (code & 8) && mag != 0.f ? -mag : mag;
}
// core::float_to_e2m1: midpoints, ties to the even code; saturates to 6; NaN -> 7.
__device__ __forceinline__ uint8_t f32_to_e2m1(float f) {
  if (isnan(f)) return 7;
  const float a = fabsf(f);
  const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  uint8_t code = 0;
#pragma unroll
  for (int i = 0; i < 7; ++i)
    if (a > mid[i] || (a == mid[i] && (i & 1))) code = uint8_t(i + 1);
  return code | (signbit(f) ? 8 : 0);
}
__device__ __forceinline__ float round_e2m1(float f) { return e2m1_to_f32(f32_to_e2m1(f)); }

// core::pow2_scale: 2^ceil(log2(amax * max_inv)) from the bits of the fp32 product.
__device__ __forceinline__ float pow2_scale(float amax, float max_inv) {
  const uint32_t bits = __float_as_uint(fmul(amax, max_inv));
  const int exp = int((bits >> 23) & 0xff);
  const int man = int(bits & 0x7fffff);
  const int log2_ceil = exp - 127 + (man != 0 ? 1 : 0);
  return __uint_as_float(uint32_t(log2_ceil + 127) << 23);
}

// ---- the per-element formulas of the quantisers (ops/quant.cu) and rope (ops/norm_rope.cu),
// shared with the fused row kernels (ops/fused_rows.cu) so that those are bitwise the ops ----
enum class QdqFormat { kFp8, kFp4E4m3, kFp4E8m0 };
constexpr float kFp8MaxInv = 1.0f / 448.0f;  // core::kFp8MaxInv
constexpr float kFp4MaxInv = 1.0f / 6.0f;    // core::kFp4MaxInv
constexpr float kFp8ActAmaxFloor = 1e-4f;    // core::kFp8ActAmaxFloor
// A quantisation block's scale from its amax (the max of |x|, exact in any order; NaNs never
// enter it: the running max starts at 0 and smax keeps its first argument against NaN).
template <QdqFormat kKind>
__device__ __forceinline__ float qdq_scale(float amax) {
  if constexpr (kKind == QdqFormat::kFp8)
    return pow2_scale(smax(amax, kFp8ActAmaxFloor), kFp8MaxInv);
  else if constexpr (kKind == QdqFormat::kFp4E4m3)
    return round_e4m3(fdiv(smax(amax, 6.0f * 0x1p-9f), 6.0f));
  else
    return pow2_scale(smax(amax, 6.0f * 0x1p-126f), kFp4MaxInv);
}
// One element's fake-quantised value with its block's scale s.
template <QdqFormat kKind>
__device__ __forceinline__ float qdq_value(float x, float s) {
  if constexpr (kKind == QdqFormat::kFp8) {
    return round_bf16(fmul(round_e4m3(fdiv(x, s)), s));
  } else {
    const float q = sclamp(fdiv(x, s), -6.0f, 6.0f);
    return round_bf16(fmul(round_e2m1(q), s));
  }
}
// Rope::cos_sin of one frequency: double sin/cos of the fp32 angle fp32(pos) * freq, rounded to
// fp32 (the sine negated for the inverse rotation).
__device__ __forceinline__ void rope_cos_sin(int64_t pos, float freq, bool inverse, float* c,
                                             float* s) {
  const float angle = fmul(float(pos), freq);
  double sd, cd;
  sincos(double(angle), &sd, &cd);
  *c = float(cd);
  *s = inverse ? -float(sd) : float(sd);
}
// One channel pair: bf16(a c - b s), bf16(a s + b c), the CPU's operation order.
__device__ __forceinline__ void rope_pair(float* t, float c, float s) {
  const float a = t[0], b = t[1];
  t[0] = round_bf16(fsub(fmul(a, c), fmul(b, s)));
  t[1] = round_bf16(fadd(fmul(a, s), fmul(b, c)));
}

// ---- checkpoint weight formats (model::WFormat) on a DeviceWeight ----
// FP8 / FP4 elements are a code times the E8M0 scale of their 32-block (exact in fp32); F32 /
// BF16 elements are their value.
__device__ __forceinline__ bool weight_is_scaled(const DeviceWeight& w) {
  return w.format == model::WFormat::kFP8 || w.format == model::WFormat::kFP4;
}
// Element (r, c) before its block scale: the code's value (FP8 / FP4), or the exact value.
__device__ __forceinline__ float weight_code(const DeviceWeight& w, int64_t r, int64_t c) {
  switch (w.format) {
    case model::WFormat::kF32:
      return reinterpret_cast<const float*>(w.data)[r * w.cols + c];
    case model::WFormat::kBF16:
      return bf16_to_f32(reinterpret_cast<const uint16_t*>(w.data)[r * w.cols + c]);
    case model::WFormat::kFP8:
      return e4m3_to_f32(w.data[r * w.cols + c]);
    case model::WFormat::kFP4: {
      const uint8_t byte = w.data[r * (w.cols / 2) + c / 2];  // low nibble: the even element
      return e2m1_to_f32((c & 1) ? uint8_t(byte >> 4) : uint8_t(byte & 15));
    }
  }
  return 0.f;
}
// The E8M0 scale of row r's 32-column block cb (FP8: per row or per 32x32 tile; FP4: per row).
__device__ __forceinline__ float weight_block_scale(const DeviceWeight& w, int64_t r, int64_t cb) {
  if (w.format == model::WFormat::kFP8)
    return e8m0_to_f32(w.scale[(w.row_scale ? r : r / 32) * ((w.cols + 31) / 32) + cb]);
  return e8m0_to_f32(w.scale[r * (w.cols / 32) + cb]);
}
// model::Weight::at(r, c).
__device__ __forceinline__ float weight_at(const DeviceWeight& w, int64_t r, int64_t c) {
  const float v = weight_code(w, r, c);
  return weight_is_scaled(w) ? fmul(v, weight_block_scale(w, r, c / 32)) : v;
}
// Element i of model::Weight::to_vector() (row-major; 1-D parameters are [n, 1]).
__device__ __forceinline__ float weight_flat(const DeviceWeight& w, int64_t i) {
  // Unscaled formats are contiguous: no 64-bit division (norm weights are read per element).
  if (w.format == model::WFormat::kF32) return reinterpret_cast<const float*>(w.data)[i];
  if (w.format == model::WFormat::kBF16)
    return bf16_to_f32(reinterpret_cast<const uint16_t*>(w.data)[i]);
  return weight_at(w, i / w.cols, i % w.cols);
}

// Sum of one value per thread over a block of kThreads (a multiple of 32), in a fixed order that
// depends only on kThreads: butterfly within each warp (lane 0's result), then warps in order.
// Every thread gets the same bits. smem: kThreads / 32 floats; reusable after the call.
template <int kThreads>
__device__ __forceinline__ float block_sum(float v, float* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fadd(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = smem[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) s = fadd(s, smem[w]);
  __syncthreads();
  return s;
}

// Sum of one value per thread over the first `warps` warps of the block (the other warps, if
// any, pass through the barriers with their values ignored), in a fixed order that depends only
// on `warps`: butterfly within each warp, then warps in order. Every thread gets the same bits.
// smem: 32 floats; reusable after the call. Every thread of the block must call it.
__device__ __forceinline__ float block_sum_warps(float v, int warps, float* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fadd(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0 && int(threadIdx.x >> 5) < warps) smem[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = smem[0];
  for (int w = 1; w < warps; ++w) s = fadd(s, smem[w]);
  __syncthreads();
  return s;
}

// ---- the row partition of rms_norm (ops/norm_rope.cu), shared with hc_mix_pre_norm (ops/mhc.cu)
// so that the fused kernel's norm is bitwise the standalone one's ----
// A row of n values is one block of norm_threads(n) threads; the row is cut in float4 vectors
// (the last one padded when n % 4 != 0); thread i owns vectors i + j * threads (j = 0, 1, ...)
// and sums the squares of its elements in (j, component) order; the threads' sums are added by
// block_sum_warps. The order is a function of n only (never of the row count or of alignment:
// misaligned rows load the same elements with scalar loads).
constexpr int kNormVec = 4;  // vectors per thread held in registers
__host__ __device__ inline int norm_threads(int n) {
  const int nv = (n + 3) / 4;
  int t = (nv + kNormVec - 1) / kNormVec;
  t = (t + 31) / 32 * 32;
  return t < 32 ? 32 : (t > 1024 ? 1024 : t);
}
// Load modes of the row kernels, a template parameter so that their unrolled loads are
// branch-free (all in flight at once): kRowScalar: scalar loads, any n, alignment and weight
// format; kRowVecF32 / kRowVecBF16: n % 4 == 0, 16-byte aligned rows, an F32 (16-byte aligned) /
// BF16 (8-byte aligned) weight. Every mode reads the same elements into the same places.
constexpr int kRowScalar = 0, kRowVecF32 = 1, kRowVecBF16 = 2;
inline int row_mode(int n, const void* x, const void* y, const DeviceWeight& w) {
  auto aligned = [](const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; };
  if (n % 4 != 0 || !aligned(x, 16) || !aligned(y, 16)) return kRowScalar;
  if (w.format == model::WFormat::kF32 && aligned(w.data, 16)) return kRowVecF32;
  if (w.format == model::WFormat::kBF16 && aligned(w.data, 8)) return kRowVecBF16;
  return kRowScalar;
}
// Elements i0 .. i0 + 3 of a row of n (those >= n read as 0).
template <int kMode>
__device__ __forceinline__ float4 load_row4(const float* row, int i0, int n) {
  if constexpr (kMode != kRowScalar) {
    return *reinterpret_cast<const float4*>(row + i0);
  } else {
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    if (i0 < n) r.x = row[i0];
    if (i0 + 1 < n) r.y = row[i0 + 1];
    if (i0 + 2 < n) r.z = row[i0 + 2];
    if (i0 + 3 < n) r.w = row[i0 + 3];
    return r;
  }
}
template <int kMode>
__device__ __forceinline__ void store_row4(float* row, int i0, int n, float4 v) {
  if constexpr (kMode != kRowScalar) {
    *reinterpret_cast<float4*>(row + i0) = v;
  } else {
    if (i0 < n) row[i0] = v.x;
    if (i0 + 1 < n) row[i0 + 1] = v.y;
    if (i0 + 2 < n) row[i0 + 2] = v.z;
    if (i0 + 3 < n) row[i0 + 3] = v.w;
  }
}
// Elements i0 .. i0 + 3 of a vector weight (weight_flat).
template <int kMode>
__device__ __forceinline__ float4 load_weight4(const DeviceWeight& w, int i0, int n) {
  if constexpr (kMode == kRowVecF32) {
    return *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(w.data) + i0);
  } else if constexpr (kMode == kRowVecBF16) {
    const uint2 u = *reinterpret_cast<const uint2*>(reinterpret_cast<const uint16_t*>(w.data) + i0);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
  } else {
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    if (i0 < n) r.x = weight_flat(w, i0);
    if (i0 + 1 < n) r.y = weight_flat(w, i0 + 1);
    if (i0 + 2 < n) r.z = weight_flat(w, i0 + 2);
    if (i0 + 3 < n) r.w = weight_flat(w, i0 + 3);
    return r;
  }
}
// ss + the squares of v's elements that lie in the row (i0 + k < n), in component order.
__device__ __forceinline__ float add_squares4(float ss, float4 v, int i0, int n) {
  if (i0 < n) ss = fadd(ss, fmul(v.x, v.x));
  if (i0 + 1 < n) ss = fadd(ss, fmul(v.y, v.y));
  if (i0 + 2 < n) ss = fadd(ss, fmul(v.z, v.z));
  if (i0 + 3 < n) ss = fadd(ss, fmul(v.w, v.w));
  return ss;
}
// cpu::rms_norm's factor from the row's sum of squares: 1 / sqrt(sum / n + eps).
__device__ __forceinline__ float rms_factor(float sum, int n, float eps) {
  return fdiv(1.0f, __fsqrt_rn(fadd(fdiv(sum, float(n)), eps)));
}
// bf16(w * (x * r)) per component.
__device__ __forceinline__ float4 norm_out4(float4 x, float4 w, float r) {
  return make_float4(round_bf16(fmul(w.x, fmul(x.x, r))), round_bf16(fmul(w.y, fmul(x.y, r))),
                     round_bf16(fmul(w.z, fmul(x.z, r))), round_bf16(fmul(w.w, fmul(x.w, r))));
}

// Host: calls f(std::integral_constant<int, hc>{}) for hc in 1..8 (the mHC kernels' stream count
// as a template parameter; ops/mhc.cu, ops/mhc_prefill.cu).
template <typename F>
void dispatch_hc(int hc, F&& f) {
  switch (hc) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 5:
      return f(std::integral_constant<int, 5>{});
    case 6:
      return f(std::integral_constant<int, 6>{});
    case 7:
      return f(std::integral_constant<int, 7>{});
    default:
      return f(std::integral_constant<int, 8>{});
  }
}

}  // namespace uf::cuda::ew
