#pragma once
// The prefill GEMM on dequantised bf16 operands (src/cuda/kernels/bf16_gemm.cu).
//
// Why: a prefill chunk's linear layers (M = 512 rows of a TP8 rank) ran on the FP8 GEMM that
// reproduces the decode GEMV bit for bit (gemv.h, fp8_gemm_prefill): the per-32-K-block scaling
// of every partial (an FMUL + FFMA per accumulator per K block) and the e4m3 -> f16 conversions
// held it at 20-80 TFLOP/s. The model's operands are exactly bf16 values: an FP8 weight is an
// E4M3 code times a power-of-two block scale, an activation is FP8-QDQ'd per 32 with a
// power-of-two scale, and both products fit bf16's 8 significant bits and fp32's exponent range.
// So out = sum_k a[m, k] w[n, k] over the dequantised values is the reference's product, with
// exact products and fp32 sums in another order: the GEMM runs as a plain bf16 tensor-core GEMM
// (fp32 accumulation) on a bf16 copy of the weight made once at load and activations QDQ'd to
// bf16 per chunk. Prefill rows then agree with decode rows (the GEMV) to fp32 re-association
// (tests/cuda/test_bf16_gemm.cpp states the bound), not bit for bit; decode (T <= 8, spec ==
// plain) never takes this path.
//
// Row independence: a row's outputs depend on its own activations, the weight and (n, k) only:
// the K order (64-wide tiles, k16 mma steps, split-K at bf16_gemm_splits(n, k) boundaries summed
// in split order) never depends on m, so chunking a prompt differently gives the same bits.

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gemv.h"

namespace uf::cuda {

// out[m, n] (row stride ldo >= n, fp32; bf16-rounded when round) = sum over k of a[m, k] *
// w[n, k]: a [m, k] bf16 row-major, w [n, k] bf16 row-major. k % 32 == 0, n % 16 == 0, m >= 1;
// a and w 16-byte aligned, out 4-byte aligned (vector stores where out and ldo allow). splits =
// bf16_gemm_splits(n, k): the K range is cut into that many parts, one CTA of a thread-block
// cluster each, whose fp32 tiles are added in split order through distributed shared memory (no
// workspace). One launch; graph-capturable.
void bf16_gemm(const uint16_t* a, const uint16_t* w, int m, int n, int k, float* out, int ldo,
               bool round, cudaStream_t stream);
// Benchmarks and tests: 1 / 2 make every later bf16_gemm use the small / large CTA tile, 0
// restores the choice by grid size (the outputs are the same bits either way). Process-wide.
void bf16_gemm_force_tile(int tile);
// The split count bf16_gemm uses for a weight [n, k] (1..8; a function of n and k only, so of
// the weight, never of m): enough splits that a 512-row call fills the GPU when n alone would
// give few column tiles.
int bf16_gemm_splits(int n, int k);

// x fp32 [m, x_stride] -> out bf16 [m, k]: each 32-block QDQ'd to FP8 E4M3 with the activation
// quantiser's power-of-two scale (act_quant_fp8_rows' codes and scales, bitwise), stored as the
// dequantised value code * scale (exact in bf16).
void act_qdq_fp8_bf16_rows(const float* x, long long x_stride, int m, int k, uint16_t* out,
                           cudaStream_t stream);

// x fp32 [m, x_stride] whose values are bf16-exact (the *Bf16X linear kinds' inputs) -> their
// bf16 bits [m, k]; a value that is not bf16-exact becomes a NaN (its row's outputs are NaN).
void bf16_exact_rows(const float* x, long long x_stride, int m, int k, uint16_t* out,
                     cudaStream_t stream);

// An FP8 32x32-block weight [n, k] -> its dequantised values as bf16 [n, k] (model::Weight::at,
// exact in bf16 for normal products). One launch; the weight must be on the device.
void fp8_weight_to_bf16(const Fp8WeightView& w, uint16_t* out, cudaStream_t stream);

}  // namespace uf::cuda
