#pragma once
// Linear layers with the reference's numerics. x is [T, K] row-major (values exactly bf16 unless
// said otherwise), y is [T, N]. Every output row is computed by the same code in the same order
// whatever T is, so a row's result never depends on how many rows are batched ("spec == plain").
// OpenMP splits the output features across threads.

#include "cpu/model_types.h"

// Hot kernels are compiled for AVX2 and for baseline x86-64 and picked at load time; both clones
// compute the same fixed-order arithmetic (see linear.cpp), so results do not depend on the pick.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define UF_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define UF_CPU_CLONES
#endif

namespace uf::cpu {

// FP8/FP4 weight: the input is fake-quantised to FP8 E4M3 in blocks of 32 along K (UE8M0 scale),
// each 32-block product is summed in fp32 and added, scaled, to an fp32 accumulator in K order
// (the reference kernels' fp8_gemm / fp4_gemm); the output is rounded to bf16.
void linear_quant(const Weight& w, const float* x, int T, float* y);

// Plain GEMM with fp32 accumulation: out = bf16(x @ W^T) (a bf16 F.linear; wo_a, ratio-1
// compressor, indexer wk / weights_proj). W may be stored as BF16, F32 or FP8 (dequantised, exact).
void linear_bf16_out(const Weight& w, const float* x, int T, float* y);

// fp32 GEMM, fp32 output: gate, head, ratio-2 compressor, mHC mixes, Markov head, confidence.
// x may hold any fp32 values.
void linear_f32(const Weight& w, const float* x, int T, float* y);

// Rows [r0, r0 + n) of W only (grouped wo_a): y[T, n] = bf16(x[T, K] @ W[r0:r0+n]^T).
void linear_bf16_out_rows(const Weight& w, int64_t r0, int64_t n, const float* x, int x_stride,
                          int T, float* y, int y_stride);

// The dispatch the reference's `linear()` does: quantised weights take linear_quant, BF16 weights
// linear_bf16_out.
void linear(const Weight& w, const float* x, int T, float* y);

// Tests only: turn the hand-written AVX2 kernel off (the generic code must give identical bits).
void set_simd_kernels(bool enabled);

// fp32 dot product with a fixed reduction order (8 interleaved partial sums).
float dot_f32(const float* a, const float* b, int n);

}  // namespace uf::cpu
