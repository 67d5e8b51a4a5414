#include "cpu/linear.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "core/dtypes.h"
#include "core/error.h"
#include "core/quant.h"

namespace uf::cpu {

namespace {
// The fixed-order dot product; every caller inlines this same body, and each machine-specific
// clone below vectorises the 8 explicit partial sums lane by lane, so results are bitwise equal
// across clones (no FMA: -ffp-contract=off).
inline float dot8(const float* a, const float* b, int n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  for (int j = 0; i < n; ++i, ++j) s[j] += a[i] * b[i];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}
}  // namespace

UF_CPU_CLONES float dot_f32(const float* a, const float* b, int n) { return dot8(a, b, n); }

namespace {

// Rows [t0, t1) of x against one dequantised weight row (FP8/FP4 path): per 32-block partial dot
// products, scaled and accumulated in K order, as the reference kernels do.
UF_CPU_CLONES void quant_row_tile(const float* wrow, const float* wsc, const float* xq,
                                  const float* xs, int64_t K, int64_t KB, int t0, int t1, float* y,
                                  int64_t y_stride) {
  for (int t = t0; t < t1; ++t) {
    const float* xt = xq + int64_t(t) * K;
    const float* st = xs + int64_t(t) * KB;
    float acc = 0.f;
    for (int64_t kb = 0; kb < KB; ++kb) {
      const float partial = dot8(xt + kb * 32, wrow + kb * 32, 32);
      acc += partial * st[kb] * wsc[kb];
    }
    y[int64_t(t) * y_stride] = core::round_bf16(acc);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// AVX2 version of quant_row_tile: eight (then four) 32-blocks at once, their partial sums reduced
// with the same pairing as dot8 (((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))) through a transposing
// horizontal add, then scaled and accumulated in K order: bitwise equal to the generic version
// (tests/cpu/test_ops.cpp checks it for 8-groups, 4-groups and the scalar tail).
// The 8 lane sums of one 32-block, accumulated in dot8's order.
__attribute__((target("avx2"))) inline __m256 block_sums_avx2(const float* x, const float* w) {
  __m256 a = _mm256_setzero_ps();
  for (int i = 0; i < 32; i += 8)
    a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i)));
  return a;
}

__attribute__((target("avx2"))) void quant_row_tile_avx2(const float* wrow, const float* wsc,
                                                         const float* xq, const float* xs,
                                                         int64_t K, int64_t KB, int t0, int t1,
                                                         float* y, int64_t y_stride) {
  for (int t = t0; t < t1; ++t) {
    const float* xt = xq + int64_t(t) * K;
    const float* st = xs + int64_t(t) * KB;
    float acc = 0.f;
    int64_t kb = 0;
    for (; kb + 8 <= KB; kb += 8) {
      __m256 sv[8];
      for (int b = 0; b < 8; ++b) sv[b] = block_sums_avx2(xt + (kb + b) * 32, wrow + (kb + b) * 32);
      const __m256 t01 = _mm256_hadd_ps(sv[0], sv[1]), t23 = _mm256_hadd_ps(sv[2], sv[3]);
      const __m256 t45 = _mm256_hadd_ps(sv[4], sv[5]), t67 = _mm256_hadd_ps(sv[6], sv[7]);
      const __m256 u03 = _mm256_hadd_ps(t01, t23), u47 = _mm256_hadd_ps(t45, t67);
      const __m256 lo = _mm256_permute2f128_ps(u03, u47, 0x20);
      const __m256 hi = _mm256_permute2f128_ps(u03, u47, 0x31);
      __m256 pv = _mm256_add_ps(lo, hi);
      pv = _mm256_mul_ps(_mm256_mul_ps(pv, _mm256_loadu_ps(st + kb)), _mm256_loadu_ps(wsc + kb));
      float p[8];
      _mm256_storeu_ps(p, pv);
      for (int b = 0; b < 8; ++b) acc += p[b];
    }
    for (; kb + 4 <= KB; kb += 4) {
      __m256 sv[4];
      for (int b = 0; b < 4; ++b) sv[b] = block_sums_avx2(xt + (kb + b) * 32, wrow + (kb + b) * 32);
      const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(sv[0], sv[1]), _mm256_hadd_ps(sv[2], sv[3]));
      __m128 pv = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
      pv = _mm_mul_ps(_mm_mul_ps(pv, _mm_loadu_ps(st + kb)), _mm_loadu_ps(wsc + kb));
      float p[4];
      _mm_storeu_ps(p, pv);
      for (int b = 0; b < 4; ++b) acc += p[b];
    }
    for (; kb < KB; ++kb) {
      const float partial = dot8(xt + kb * 32, wrow + kb * 32, 32);
      acc += partial * st[kb] * wsc[kb];
    }
    y[int64_t(t) * y_stride] = core::round_bf16(acc);
  }
}
const bool kCpuHasAvx2 = __builtin_cpu_supports("avx2");
#else
constexpr bool kCpuHasAvx2 = false;
#endif

std::atomic<bool> g_simd{true};

// Rows [t0, t1) of x against one weight row, plain fp32 dot products.
UF_CPU_CLONES void row_tile(const float* wrow, const float* x, int64_t x_stride, int64_t K, int t0,
                            int t1, float* out) {
  for (int t = t0; t < t1; ++t) out[t - t0] = dot8(x + int64_t(t) * x_stride, wrow, int(K));
}

}  // namespace

namespace {

// A parallel region costs a barrier; on a loaded machine a descheduled thread makes that barrier
// very expensive, so small products stay on the calling thread.
inline bool worth_threads(int64_t macs) { return macs >= (int64_t(1) << 22); }

// Both E2M1 values of a packed byte (low nibble = even element), branch-free: random signs
// would otherwise mispredict on every element.
struct Fp4Pairs {
  float v[256][2];
  Fp4Pairs() {
    for (int b = 0; b < 256; ++b) {
      v[b][0] = core::e2m1_to_float(core::e2m1_even(uint8_t(b)));
      v[b][1] = core::e2m1_to_float(core::e2m1_odd(uint8_t(b)));
    }
  }
};
const Fp4Pairs kFp4Pairs;

// One 32-block of weight row r, dequantised without its scale (exact FP8/FP4 values), plus the
// block's E8M0 scale.
inline float weight_block(const Weight& w, int64_t r, int64_t kb, float* out) {
  const int64_t K = w.cols;
  if (w.format == WFormat::kFP8) {
    const uint8_t* p = w.data + r * K + kb * 32;
    for (int i = 0; i < 32; ++i) out[i] = core::e4m3_to_float(p[i]);
    const int64_t sc = (K + 31) / 32;
    return core::e8m0_to_float(w.scale[(w.row_scale ? r : r / 32) * sc + kb]);
  }
  const uint8_t* p = w.data + r * (K / 2) + kb * 16;
  for (int i = 0; i < 16; ++i) {
    out[2 * i] = kFp4Pairs.v[p[i]][0];
    out[2 * i + 1] = kFp4Pairs.v[p[i]][1];
  }
  return core::e8m0_to_float(w.scale[r * (K / 32) + kb]);
}

// Row r of W as fp32 (exact for every storage format).
inline void weight_row(const Weight& w, int64_t r, float* out) {
  const int64_t K = w.cols;
  switch (w.format) {
    case WFormat::kF32: {
      const float* p = reinterpret_cast<const float*>(w.data) + r * K;
      std::copy(p, p + K, out);
      return;
    }
    case WFormat::kBF16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(w.data) + r * K;
      for (int64_t k = 0; k < K; ++k) out[k] = core::bf16_to_float(p[k]);
      return;
    }
    case WFormat::kFP8:
    case WFormat::kFP4:
      for (int64_t kb = 0; kb < K / 32; ++kb) {
        const float s = weight_block(w, r, kb, out + kb * 32);
        for (int i = 0; i < 32; ++i) out[kb * 32 + i] *= s;
      }
      return;
  }
}

// Tokens per tile: a tile of activations stays in cache while every weight row streams past it.
constexpr int kTile = 64;

template <typename Post>
void gemm_rows(const Weight& w, int64_t r0, int64_t n, const float* x, int x_stride, int T,
               float* y, int y_stride, Post post) {
  const int64_t K = w.cols;
  const int tiles = (T + kTile - 1) / kTile;
#pragma omp parallel if (worth_threads(n * K * T))
  {
    std::vector<float> row(static_cast<size_t>(K));
#pragma omp for collapse(2) schedule(static)
    for (int tile = 0; tile < tiles; ++tile)
      for (int64_t j = 0; j < n; ++j) {
        weight_row(w, r0 + j, row.data());
        const int t0 = tile * kTile, t1 = std::min(T, (tile + 1) * kTile);
        float out[kTile];
        row_tile(row.data(), x, x_stride, K, t0, t1, out);
        for (int t = t0; t < t1; ++t) y[int64_t(t) * y_stride + j] = post(out[t - t0]);
      }
  }
}

}  // namespace

void linear_quant(const Weight& w, const float* x, int T, float* y) {
  UF_CHECK(w.format == WFormat::kFP8 || w.format == WFormat::kFP4,
           "linear_quant: weight '{}' is not FP8/FP4", w.name);
  const int64_t K = w.cols, N = w.rows, KB = K / 32;
  UF_CHECK(K % 32 == 0, "linear_quant: weight '{}' has {} inputs, not a multiple of 32", w.name, K);
  // Activation fake-quant: exact e4m3 values and their power-of-two block scales.
  std::vector<float> xq(size_t(T) * size_t(K)), xs(size_t(T) * size_t(KB));
  std::vector<uint8_t> codes(32);
  for (int t = 0; t < T; ++t)
    for (int64_t kb = 0; kb < KB; ++kb) {
      const float* src = x + int64_t(t) * K + kb * 32;
      xs[size_t(t * KB + kb)] = core::quantize_fp8_block(src, 32, codes.data());
      for (int i = 0; i < 32; ++i)
        xq[size_t(t * K + kb * 32 + i)] = core::e4m3_to_float(codes[size_t(i)]);
    }
  const int tiles = (T + kTile - 1) / kTile;
  const bool simd = kCpuHasAvx2 && g_simd.load(std::memory_order_relaxed);
#pragma omp parallel if (worth_threads(N * K * T))
  {
    std::vector<float> wrow(static_cast<size_t>(K)), wsc(static_cast<size_t>(KB));
#pragma omp for collapse(2) schedule(static)
    for (int tile = 0; tile < tiles; ++tile)
      for (int64_t r = 0; r < N; ++r) {
        for (int64_t kb = 0; kb < KB; ++kb)
          wsc[size_t(kb)] = weight_block(w, r, kb, wrow.data() + kb * 32);
        if (simd)
          quant_row_tile_avx2(wrow.data(), wsc.data(), xq.data(), xs.data(), K, KB, tile * kTile,
                              std::min(T, (tile + 1) * kTile), y + r, N);
        else
          quant_row_tile(wrow.data(), wsc.data(), xq.data(), xs.data(), K, KB, tile * kTile,
                         std::min(T, (tile + 1) * kTile), y + r, N);
      }
  }
}

void set_simd_kernels(bool enabled) { g_simd.store(enabled); }

void linear_bf16_out(const Weight& w, const float* x, int T, float* y) {
  gemm_rows(w, 0, w.rows, x, int(w.cols), T, y, int(w.rows),
            [](float v) { return core::round_bf16(v); });
}

void linear_bf16_out_rows(const Weight& w, int64_t r0, int64_t n, const float* x, int x_stride,
                          int T, float* y, int y_stride) {
  gemm_rows(w, r0, n, x, x_stride, T, y, y_stride, [](float v) { return core::round_bf16(v); });
}

void linear_f32(const Weight& w, const float* x, int T, float* y) {
  gemm_rows(w, 0, w.rows, x, int(w.cols), T, y, int(w.rows), [](float v) { return v; });
}

void linear(const Weight& w, const float* x, int T, float* y) {
  if (w.format == WFormat::kFP8 || w.format == WFormat::kFP4)
    linear_quant(w, x, T, y);
  else
    linear_bf16_out(w, x, T, y);
}

}  // namespace uf::cpu
