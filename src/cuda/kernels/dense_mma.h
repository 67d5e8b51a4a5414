#pragma once
// Tensor-core dense GEMV for decode rows (kernels/dense_mma.cu): y[t, j] = sum_k x[t, k] W[r0+j, k]
// for BF16 weights and FP8 E4M3 weights with E8M0 block (32x32) or row scales, on mma.sync
// m16n8k16 bf16 -> fp32 (16 weight rows = A, up to 8 token rows = B).
//
// The products are exact only when every x value is a bf16 value (the weight side is exact: bf16,
// or e4m3 x 2^k converted to bf16). The kernel checks this while staging x: a value that is not
// bf16-exact turns into NaN (so its token row's outputs are NaN), never silently rounded. Callers
// declare bf16-exact inputs through DeviceLinear's *Bf16X kinds (ops/linear.h).
//
// Sum order (depends on K, the row count n of the call and the SM count, never on the token count
// m, so a row's bits never depend on the other rows of the call): K is cut into S equal parts
// (S = splits(n)); within a part, acc starts at 0 and takes the part's 16-wide K slices in K order,
// one mma each (the tensor core adds the slice's 16 exact products to acc); the parts are then
// added in part order, total = ((P0 + P1) + P2) + ... in fp32. S > 1 only where the weight has few
// rows (split-K for parallelism); the head-sized weights use S = 1.
//
// Kernels (the order above in all of them; they differ in where the parts are computed and added):
// calls of m <= 8 rows take the resident kernel where its plan fits (DenseMmaPath::kAuto: one
// wave of CTAs holding all their weight bytes in shared memory, the S parts of a tile spread over
// the warps of a thread-block cluster and added through distributed shared memory); other calls
// (weights too large, or DenseMmaPath::kLegacy) the legacy full-K / split-K kernel; m > 8 the
// prefill kernel (set_dense_mma_prefill) or the legacy full-K kernel per 8-row chunk.

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_weights.h"

namespace uf::cuda {

// kAuto: the resident kernel for m <= 8 where it fits; kLegacy: never (the session-6 kernels,
// kept for benchmarks and for the tests' bitwise comparison).
enum class DenseMmaPath { kAuto, kLegacy };

// Calls of m > 8 rows: true (the default) the prefill kernel (32 token rows a CTA, each weight
// fragment converted once for all of them), false the full-K kernel per chunk of 8 rows (benchmarks
// and the tests' bitwise comparison). The same bits either way. Host-side, read at launch/capture.
void set_dense_mma_prefill(bool on);

class DenseMma {
 public:
  // Whether the MMA path takes this weight: BF16 or FP8 (block or row scales), cols % 64 == 0,
  // 256 <= cols <= kMaxCols, 16-byte aligned data.
  static constexpr int64_t kMaxCols = 6144;  // x of one 8-row chunk staged in 96 KB of smem
  static bool supports(const DeviceWeight& w);

  // The plan of weight w (rows(), cols()): kernel attributes on the current device, and the
  // split-K workspace (partials + self-resetting counters, cudaMalloc'd here) for any row range.
  // resident_cluster: 0 = the plan's choice, else force the resident kernel's cluster size (1, 2,
  // 4 or 8; calls it cannot serve take the legacy kernel): benchmarks only, no effect on the bits.
  DenseMma(const DeviceWeight& w, int sm_count, DenseMmaPath path = DenseMmaPath::kAuto,
           int resident_cluster = 0);
  ~DenseMma();
  DenseMma(const DenseMma&) = delete;
  DenseMma& operator=(const DenseMma&) = delete;

  // y[t * y_stride + j] = post(sum_k x[t * x_stride + k] * W[r0 + j, k]) for t < m, j < n; post
  // = bf16 rounding when round_bf16. Any m (chunks of 8 token rows on the grid). One launch for
  // any m; graph-capturable (no allocation, no sync). One run at a time per plan (split-K
  // workspace). x must be bf16-exact (else NaN rows, see above); x and y must not alias.
  void run(const DeviceWeight& w, int64_t r0, int64_t n, const float* x, int64_t x_stride, int m,
           float* y, int64_t y_stride, bool round_bf16, cudaStream_t stream) const;

  // The K split count S of an n-row call (the sum order above).
  int splits(int64_t n) const;
  // The resident kernel's cluster size for an n-row call of m <= 8 rows; 0: the legacy kernel.
  int resident_cluster(int64_t n) const;

 private:
  int64_t rows_ = 0, cols_ = 0;
  int sms_ = 1;
  int ctas_per_sm_ = 1;  // residency of the full-K (S = 1) configuration
  bool fp8_ = false;
  bool resident_ = true;  // DenseMmaPath::kAuto
  int cluster_pref_ = 0;
  float* partials_ = nullptr;  // [S][tiles][128] of the largest split call
  int* counters_ = nullptr;    // [tiles], zero between launches
  size_t partial_floats_ = 0;
  int64_t counter_count_ = 0;
};

}  // namespace uf::cuda
