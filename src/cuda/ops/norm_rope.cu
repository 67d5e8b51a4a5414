// rms_norm and rope of ops/elementwise.h.
//
// rms_norm: one block of 256 threads per row. Thread i sums x^2 over channels i, i + 256, ... in
// order; the block sum is ew::block_sum (fixed order): a different order from the CPU's dot_f32,
// so var may differ in the last bits and an output may differ by one bf16 ulp. The rest is the
// CPU's formula exactly: r = 1 / sqrt(var / n + eps) (IEEE sqrt and division), y = bf16(w * (x *
// r)). Each thread reads its x elements again after the reduction's barrier before writing them, so
// y may alias x.
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

constexpr int kNormThreads = 256;

__global__ void rms_norm_kernel(DeviceWeight w, float eps, const float* x, int n, float* y) {
  __shared__ float red[kNormThreads / 32];
  const int64_t base = int64_t(blockIdx.x) * n;
  float ss = 0.f;
  for (int i = threadIdx.x; i < n; i += kNormThreads) {
    const float v = x[base + i];
    ss = ew::fadd(ss, ew::fmul(v, v));
  }
  const float sum = ew::block_sum<kNormThreads>(ss, red);
  const float var = ew::fdiv(sum, float(n));
  const float r = ew::fdiv(1.0f, __fsqrt_rn(ew::fadd(var, eps)));
  for (int i = threadIdx.x; i < n; i += kNormThreads)
    y[base + i] = ew::round_bf16(ew::fmul(ew::weight_flat(w, i), ew::fmul(x[base + i], r)));
}

constexpr int kRopeThreads = 256;
constexpr int kRopeMaxHalf = 256;  // Rope allows rope_dim <= 512

__global__ void rope_kernel(const float* freqs, int rope_dim, float* v, int count, int n,
                            int64_t p0, int64_t stride, bool inverse, const int64_t* positions) {
  __shared__ float cs[kRopeMaxHalf], sn[kRopeMaxHalf];
  const int half = rope_dim / 2;
  const int64_t pos = positions ? positions[blockIdx.x] : p0 + int64_t(blockIdx.x) * stride;
  for (int i = threadIdx.x; i < half; i += kRopeThreads) {
    const float angle = ew::fmul(float(pos), freqs[i]);
    double s, c;
    sincos(double(angle), &s, &c);
    cs[i] = float(c);
    sn[i] = inverse ? -float(s) : float(s);
  }
  __syncthreads();
  float* row = v + int64_t(blockIdx.x) * count * n;
  const int pairs = count * half;
  for (int k = threadIdx.x; k < pairs; k += kRopeThreads) {
    const int h = k / half, i = k % half;
    float* t = row + int64_t(h) * n + (n - rope_dim) + 2 * i;
    const float a = t[0], b = t[1];
    t[0] = ew::round_bf16(ew::fsub(ew::fmul(a, cs[i]), ew::fmul(b, sn[i])));
    t[1] = ew::round_bf16(ew::fadd(ew::fmul(a, sn[i]), ew::fmul(b, cs[i])));
  }
}

}  // namespace

void rms_norm(const DeviceWeight& weight, float eps, const float* x, int T, int n, float* y,
              cudaStream_t stream) {
  require(!weight.empty() && weight.rows * weight.cols == n,
          "rms_norm: weight has %lld x %lld elements, expected %d", (long long)weight.rows,
          (long long)weight.cols, n);
  if (T <= 0) return;
  rms_norm_kernel<<<T, kNormThreads, 0, stream>>>(weight, eps, x, n, y);
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
