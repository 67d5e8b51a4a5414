// embed_rows, tap_mean and compress_pool of ops/elementwise.h. One thread per (row, channel).
//
// embed_rows: model::Weight::at on the device (exact for every format): bitwise equal to the CPU.
// tap_mean: the CPU's sum (from 0, copies in order) and division, then bf16: bitwise equal.
// compress_pool: per channel, max, then sum of expf(score - max) in token order, then
// sum of kv * (e / sum) in token order, as cpu::compress_pool; each e is recomputed in the second
// pass (same bits) so any ratio works. CUDA's expf may differ from glibc's by an ulp or two, so
// the result agrees to fp32 rounding, not bitwise.

#include "cuda/cuda_check.h"
#include "cuda/ops/elementwise.h"
#include "cuda/ops/elementwise_common.cuh"

namespace uf::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void embed_kernel(DeviceWeight table, const int32_t* ids, int hc, float* X,
                             float* pre_mix) {
  const int64_t t = blockIdx.x;
  const int64_t D = table.cols;
  if (blockIdx.y == 0 && threadIdx.x < hc)
    pre_mix[t * hc + threadIdx.x] = threadIdx.x == 0 ? 1.f : 0.f;
  const int64_t d = int64_t(blockIdx.y) * kThreads + threadIdx.x;
  if (d >= D) return;
  const float v = ew::weight_at(table, ids[t], d);
  float* x = X + t * hc * D;
  for (int c = 0; c < hc; ++c) x[c * D + d] = v;
}

__global__ void tap_mean_kernel(const float* X, int hc, int dim, float* out, int64_t out_stride) {
  const int d = blockIdx.y * kThreads + threadIdx.x;
  if (d >= dim) return;
  const int64_t t = blockIdx.x;
  const float* x = X + t * hc * dim;
  float sum = 0.f;
  for (int c = 0; c < hc; ++c) sum = ew::fadd(sum, x[int64_t(c) * dim + d]);
  out[t * out_stride + d] = ew::round_bf16(ew::fdiv(sum, float(hc)));
}

__global__ void compress_pool_kernel(const float* const* kv, const float* const* gate, int r,
                                     int hd, float* out) {
  const int c = blockIdx.y * kThreads + threadIdx.x;
  if (c >= hd) return;
  const int64_t g = blockIdx.x;
  const float* const* k = kv + g * r;
  const float* const* s = gate + g * r;
  float mx = s[0][c];
  for (int t = 1; t < r; ++t) mx = ew::smax(mx, s[t][c]);
  float sum = 0.f;
  for (int t = 0; t < r; ++t) sum = ew::fadd(sum, expf(ew::fsub(s[t][c], mx)));
  float acc = 0.f;
  for (int t = 0; t < r; ++t)
    acc = ew::fadd(acc, ew::fmul(k[t][c], ew::fdiv(expf(ew::fsub(s[t][c], mx)), sum)));
  out[g * hd + c] = acc;
}

}  // namespace

void embed_rows(const DeviceWeight& table, const int32_t* ids, int T, int hc, float* X,
                float* pre_mix, cudaStream_t stream) {
  require(!table.empty() && hc >= 1 && hc <= kThreads, "embed_rows: empty table or hc = %d", hc);
  if (T <= 0) return;
  const dim3 grid(T, unsigned((table.cols + kThreads - 1) / kThreads));
  embed_kernel<<<grid, kThreads, 0, stream>>>(table, ids, hc, X, pre_mix);
  UF_CUDA_CHECK(cudaGetLastError());
}

void tap_mean(const float* X, int T, int hc, int dim, float* out, int64_t out_stride,
              cudaStream_t stream) {
  require(hc >= 1 && dim > 0, "tap_mean: hc = %d, dim = %d", hc, dim);
  if (T <= 0) return;
  const dim3 grid(T, (dim + kThreads - 1) / kThreads);
  tap_mean_kernel<<<grid, kThreads, 0, stream>>>(X, hc, dim, out, out_stride);
  UF_CUDA_CHECK(cudaGetLastError());
}

void compress_pool(const float* const* kv, const float* const* gate, int n_groups, int r, int hd,
                   float* out, cudaStream_t stream) {
  require(r >= 1 && hd > 0, "compress_pool: ratio %d, %d channels", r, hd);
  if (n_groups <= 0) return;
  const dim3 grid(n_groups, (hd + kThreads - 1) / kThreads);
  compress_pool_kernel<<<grid, kThreads, 0, stream>>>(kv, gate, r, hd, out);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
