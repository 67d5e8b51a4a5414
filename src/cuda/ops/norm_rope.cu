// rms_norm and rope of ops/elementwise.h.
//
// rms_norm: one block per row of norm_threads(n) threads (elementwise_common.cuh: ~4 float4
// vectors per thread, 320 threads for 5120 values), the row held in registers between the sum of
// squares and the output. The first version (256 threads, a runtime-bound scalar loop over 20
// elements each, then a second pass reloading x and decoding the weight per element) took 7.3 us
// for a 5120-value row, latency bound: few loads in flight per thread and two dependent passes over
// memory. Here every load of a thread (row and weight, 16 bytes each) is issued at once (one round
// trip), then one block reduction. The sum of squares is in another
// order than the CPU's dot_f32 (the partition's order, a function of n only), so var may differ in
// the last bits and an output may differ by one bf16 ulp. The rest is the CPU's formula exactly: r
// = 1 / sqrt(var / n + eps) (IEEE sqrt and division), y = bf16(w * (x * r)). Each thread writes
// only the elements it read before the reduction's barrier, so y may alias x.
//
// rope: one block per row; the row's cos/sin pairs are computed once into shared memory (double
// precision sin/cos of the fp32 angle fp32(pos) * freq, rounded to fp32, as Rope::cos_sin), then
// the block rotates every vector's last rope_dim channels: bf16(a c - b s), bf16(a s + b c), the
// CPU's operation order, never contracted: bitwise equal to the CPU unless a double sin/cos
// differs from glibc's by enough to change the fp32 rounding (not seen in practice).

#include "cuda/cuda_check.h"
#include "cuda/ops/elementwise.h"
#include "cuda/ops/elementwise_common.cuh"

namespace uf::cuda {

namespace {

// Rows of n <= kNormVec * 4 * 1024 values sit in registers; longer rows (not used by the model)
// take the extra vectors j >= kNormVec in a second loop that reloads them for the output.
template <int kMode>
__global__ void __launch_bounds__(1024)
    rms_norm_kernel(DeviceWeight w, float eps, const float* x, int n, float* y) {
  __shared__ float red[32];
  const int NT = blockDim.x, i = threadIdx.x, nv = (n + 3) / 4;
  const float* xr = x + int64_t(blockIdx.x) * n;
  float* yr = y + int64_t(blockIdx.x) * n;
  // Row and weight loads all issued before the reduction, unconditionally (clamped indices: all
  // in flight together; the weight's wait overlaps the reduction).
  float4 v[ew::kNormVec], wv[ew::kNormVec];
#pragma unroll
  for (int j = 0; j < ew::kNormVec; ++j) {
    const int qe = min(i + j * NT, nv - 1);
    v[j] = ew::load_row4<kMode>(xr, 4 * qe, n);
    wv[j] = ew::load_weight4<kMode>(w, 4 * qe, n);
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < ew::kNormVec; ++j) {
    const int q = i + j * NT;
    if (q < nv) ss = ew::add_squares4(ss, v[j], 4 * q, n);
  }
  for (int q = i + ew::kNormVec * NT; q < nv; q += NT)
    ss = ew::add_squares4(ss, ew::load_row4<kMode>(xr, 4 * q, n), 4 * q, n);
  const float r = ew::rms_factor(ew::block_sum_warps(ss, NT / 32, red), n, eps);
#pragma unroll
  for (int j = 0; j < ew::kNormVec; ++j) {
    const int q = i + j * NT;
    if (q < nv) ew::store_row4<kMode>(yr, 4 * q, n, ew::norm_out4(v[j], wv[j], r));
  }
  for (int q = i + ew::kNormVec * NT; q < nv; q += NT)
    ew::store_row4<kMode>(
        yr, 4 * q, n,
        ew::norm_out4(ew::load_row4<kMode>(xr, 4 * q, n), ew::load_weight4<kMode>(w, 4 * q, n), r));
}

constexpr int kRopeThreads = 256;
constexpr int kRopeMaxHalf = 256;  // Rope allows rope_dim <= 512

__global__ void rope_kernel(const float* freqs, int rope_dim, float* v, int count, int n,
                            int64_t p0, int64_t stride, bool inverse, const int64_t* positions) {
  __shared__ float cs[kRopeMaxHalf], sn[kRopeMaxHalf];
  const int half = rope_dim / 2;
  const int64_t pos = positions ? positions[blockIdx.x] : p0 + int64_t(blockIdx.x) * stride;
  for (int i = threadIdx.x; i < half; i += kRopeThreads) {
    ew::rope_cos_sin(pos, freqs[i], inverse, &cs[i], &sn[i]);
  }
  __syncthreads();
  float* row = v + int64_t(blockIdx.x) * count * n;
  const int pairs = count * half;
  for (int k = threadIdx.x; k < pairs; k += kRopeThreads) {
    const int h = k / half, i = k % half;
    ew::rope_pair(row + int64_t(h) * n + (n - rope_dim) + 2 * i, cs[i], sn[i]);
  }
}

}  // namespace

void rms_norm(const DeviceWeight& weight, float eps, const float* x, int T, int n, float* y,
              cudaStream_t stream) {
  require(!weight.empty() && weight.rows * weight.cols == n,
          "rms_norm: weight has %lld x %lld elements, expected %d", (long long)weight.rows,
          (long long)weight.cols, n);
  if (T <= 0) return;
  const int NT = ew::norm_threads(n);
  switch (ew::row_mode(n, x, y, weight)) {
    case ew::kRowVecF32:
      rms_norm_kernel<ew::kRowVecF32><<<T, NT, 0, stream>>>(weight, eps, x, n, y);
      break;
    case ew::kRowVecBF16:
      rms_norm_kernel<ew::kRowVecBF16><<<T, NT, 0, stream>>>(weight, eps, x, n, y);
      break;
    default:
      rms_norm_kernel<ew::kRowScalar><<<T, NT, 0, stream>>>(weight, eps, x, n, y);
      break;
  }
  UF_CUDA_CHECK(cudaGetLastError());
}

void rope(const float* freqs, int rope_dim, float* v, int T, int count, int n, int64_t p0,
          int64_t stride, bool inverse, cudaStream_t stream, const int64_t* positions) {
  require(rope_dim > 0 && rope_dim % 2 == 0 && rope_dim <= 2 * kRopeMaxHalf && rope_dim <= n,
          "rope: %d rotated channels of %d; expected an even count up to min(512, n)", rope_dim, n);
  if (T <= 0 || count <= 0) return;
  rope_kernel<<<T, kRopeThreads, 0, stream>>>(freqs, rope_dim, v, count, n, p0, stride, inverse,
                                              positions);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
