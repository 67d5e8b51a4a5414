#pragma once
// The mHC expand of a prefill chunk with the next sublayer's mixes on the bf16 tensor cores
// (ops/mhc_prefill.cu). Decode rows never take it (hc_post_mixes, ops/elementwise.h).
//
// Why: hc_post_mixes computes a row's (2 + hc) * hc mixes and |v|^2 as serial fp32 chains on the
// CUDA cores (25 x hc * dim = 512k multiply-adds a row at hc 4, dim 5120) in an order that is the
// same for every row count (spec == plain). At a 512-row prefill chunk that kernel took 104-108 us
// a call (H200, 80 calls a chunk: 8.6 ms of a TP8 rank's 65 ms chunk), bound by its issue rate.
// Prefill rows may be summed in another fp32 order (as the linear layers' bf16 GEMM,
// cuda/prefill_gemm.h), and the operands are exact bf16 sums: v = round_bf16(hc_post(...)) is a
// bf16 value, and an fp32 fn is exactly hi + mid + lo with three bf16 terms (8 significant bits
// each; a bf16 fn is one term). So the mixes of a 32-channel split are products summed in fp32
// by the tensor cores: one kernel, a block = 64 rows x 64 channels (two splits):
//   1. its fn terms for those channels staged by cp.async (they do not depend on the rows);
//   2. v of its rows and channels with hc_post_mixes' expression, operation for operation (out is
//      bitwise hc_post_mixes' out), written to out and, as bf16, to shared memory; |v|^2 of each
//      (row, split) by a warp's butterfly;
//   3. per split, v [64 rows, hc * 32] x terms^T on mma.sync m16n8k16 (a warp a split and 16 rows),
//      each mix's terms added (hi + mid, then + lo) in registers, written as the split's partial
//      in hc_mixes_scratch_floats' layout.
// hc_mix_pre_norm's finish then adds the splits as always. A row's values never depend on T or
// on the other rows; the mixes agree with hc_post_mixes' to fp32 re-association
// (tests/cuda/test_mhc_prefill.cpp states the bound). Measured on the H200 (bench_cuda_mhc
// "prefill expand") against hc_post_mixes at 16 / 64 / 512 / 2048 rows: docs/perf.md.

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_memory.h"
#include "cuda/device_weights.h"
#include "cuda/ops/elementwise.h"

namespace uf::cuda {

// fn [mix, hc * dim] as bf16 terms [rows, hc * dim]: row j * stride + m holds term j of mix m
// (stride = mix rounded up to 8, so that a term's mixes start an mma column group; other rows are
// zeros; rows = terms * stride rounded up to 16).
struct HcFnTerms {
  const uint16_t* w = nullptr;
  int terms = 0;  // 1 (a BF16 fn) or 3 (F32)
  int stride = 0;
  int rows = 0;
  bool empty() const { return w == nullptr; }
};

// Whether hc_post_mixes_mma takes this shape and fn: hc <= 4, dim % 8 == 0, fn F32 or BF16
// [mix, hc * dim].
bool hc_post_mixes_mma_supported(const HcShape& p, const DeviceWeight& fn);

// fn's terms in arena memory, written once the load's uploads have put fn on the device
// (UploadScope::after_upload; at once without a scope). An fp32 element that three bf16 terms
// cannot hold exactly, or whose terms are not zero or normal (|fn| below ~2^-110; tensor cores
// may flush subnormals), or a NaN, makes its hi term a NaN: that mix is NaN for every row, never
// silently off. Empty when !hc_post_mixes_mma_supported(p, fn).
HcFnTerms hc_fn_terms(const HcShape& p, const DeviceWeight& fn, DeviceArena& arena);

// hc_post_mixes (ops/elementwise.h) for prefill rows: the same out (bitwise) and the partials of
// the next sublayer's mixes in hc_mixes_scratch_floats' layout, ready for hc_mix_pre_norm.
// x [T, dim], R / out [T, hc, dim] (out must not overlap R), post [T, hc], comb [T, hc, hc];
// fn = hc_fn_terms(p, the next sublayer's fn). One launch; graph-capturable.
void hc_post_mixes_mma(const HcShape& p, const float* x, const float* R, const float* post,
                       const float* comb, int T, float* out, const HcFnTerms& fn, float* partial,
                       cudaStream_t stream);

}  // namespace uf::cuda
