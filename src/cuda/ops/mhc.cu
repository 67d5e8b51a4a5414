// hc_mixes, hc_pre and hc_post of ops/elementwise.h (cpu/mhc.cpp on the device).
//
// hc_mixes: K split in chunks of 256 stream elements, one block of 256 threads per (chunk, row)
// (a row alone used to be one block streaming the 2 MB fn: 0.8 ms at the released dims). Thread i
// accumulates its elements' (2 + hc) * hc dot products with fn's rows and the sum of squares in
// fp32; warps reduce by butterfly, the warps' partials are added in order into the chunk's
// partial; a second kernel adds the chunks' partials in chunk order, applies
// r = 1 / sqrt(sumsq / n + norm_eps) and runs hc_split_sinkhorn exactly as the CPU writes it
// (same operation order, expf for std::exp). The order depends on (hc, dim) only, never on T. The
// dot products' summation order differs from the CPU's linear_f32 and CUDA's expf may differ from
// glibc's by an ulp or two, so the mixes agree to fp32 rounding, not bitwise
// (tests/cuda/test_ops_elementwise.cpp states the bound).
//
// hc_pre, hc_post: one thread per (row, channel), the CPU's sums in the CPU's order with no
// contraction: bitwise equal to the CPU. hc_post's thread loads R[t, j, d] for every j into
// registers before writing out[t, k, d] for any k, and no other thread touches those elements,
// so out may alias R.

#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/ops/elementwise.h"
#include "cuda/ops/elementwise_common.cuh"

namespace uf::cuda {

namespace {

constexpr int kMixThreads = 256;
constexpr int kMixWarps = kMixThreads / 32;
constexpr int kMaxHc = 8;
constexpr int kMixChunk = 256;  // stream elements per hc_mixes block (one per thread)

int mix_splits(const HcShape& p) { return (p.hc * p.dim + kMixChunk - 1) / kMixChunk; }

__device__ __forceinline__ float sigmoid(float x) {
  return ew::fdiv(1.0f, ew::fadd(1.0f, expf(-x)));
}

// cpu::hc_split_sinkhorn for one row on one warp, m: (2 + HC) * HC mixes (already multiplied by
// r), c: shared [HC * HC], sums: shared [HC]. Each sum and each element keeps the CPU's operation
// order (lane j owns row j's softmax and row sums, lane k column k's sums, lane i element i's
// divisions), so the result is the serial loop's, bit for bit, in ~1/16 of its time.
template <int HC>
__device__ void split_sinkhorn_warp(const HcShape& p, const float* m, const float* sc,
                                    const DeviceWeight& base, float* c, float* sums, float* pre,
                                    float* post, float* comb) {
  const int lane = threadIdx.x & 31;
  const float eps = p.hc_eps;
  if (lane < HC) {
    pre[lane] =
        ew::fadd(sigmoid(ew::fadd(ew::fmul(m[lane], sc[0]), ew::weight_flat(base, lane))), eps);
    post[lane] = ew::fmul(
        2.0f, sigmoid(ew::fadd(ew::fmul(m[HC + lane], sc[1]), ew::weight_flat(base, HC + lane))));
  }
  for (int i = lane; i < HC * HC; i += 32)
    c[i] = ew::fadd(ew::fmul(m[2 * HC + i], sc[2]), ew::weight_flat(base, 2 * HC + i));
  __syncwarp();
  if (lane < HC) {  // softmax over row `lane`, + eps
    float* row = c + lane * HC;
    float mx = row[0];
    for (int k = 1; k < HC; ++k) mx = ew::smax(mx, row[k]);
    for (int k = 0; k < HC; ++k) row[k] = expf(ew::fsub(row[k], mx));
    float s = 0.f;
    for (int k = 0; k < HC; ++k) s = ew::fadd(s, row[k]);
    for (int k = 0; k < HC; ++k) row[k] = ew::fadd(ew::fdiv(row[k], s), eps);
  }
  __syncwarp();
  auto norm = [&](bool cols) {
    if (lane < HC) {
      float s = 0.f;
      for (int j = 0; j < HC; ++j) s = ew::fadd(s, cols ? c[j * HC + lane] : c[lane * HC + j]);
      sums[lane] = ew::fadd(s, eps);
    }
    __syncwarp();
    for (int i = lane; i < HC * HC; i += 32) c[i] = ew::fdiv(c[i], sums[cols ? i % HC : i / HC]);
    __syncwarp();
  };
  norm(true);
  for (int it = 0; it < p.sinkhorn_iters - 1; ++it) {
    norm(false);
    norm(true);
  }
  for (int i = lane; i < HC * HC; i += 32) comb[i] = c[i];
}

// Split K: block (s, t) sums its kMixChunk elements of row t into kMix + 1 partials (the mixes'
// dot products and the sum of squares), one element per thread, then warps by
// butterfly and the 8 warps in order. partial[(t * S + s) * (kMix + 1) + m].
template <int HC>
__global__ void __launch_bounds__(kMixThreads)
    hc_mixes_partial_kernel(HcShape p, DeviceWeight fn, const float* X, float* partial) {
  constexpr int kMix = (2 + HC) * HC;
  __shared__ float red[(kMix + 1) * kMixWarps];
  const int n = HC * p.dim, s = blockIdx.x, S = gridDim.x;
  const int64_t t = blockIdx.y;
  const float* x = X + t * n;
  float acc[kMix + 1];
#pragma unroll
  for (int m = 0; m <= kMix; ++m) acc[m] = 0.f;
  const int c0 = s * kMixChunk;
  for (int c = c0 + threadIdx.x; c < min(n, c0 + kMixChunk); c += kMixThreads) {
    const float v = x[c];
    acc[kMix] = ew::fadd(acc[kMix], ew::fmul(v, v));
#pragma unroll
    for (int m = 0; m < kMix; ++m) acc[m] = ew::fadd(acc[m], ew::fmul(ew::weight_at(fn, m, c), v));
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int m = 0; m <= kMix; ++m) {
    float v = acc[m];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = ew::fadd(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) red[m * kMixWarps + warp] = v;
  }
  __syncthreads();
  for (int m = threadIdx.x; m <= kMix; m += kMixThreads) {
    float v = red[m * kMixWarps];
    for (int w = 1; w < kMixWarps; ++w) v = ew::fadd(v, red[m * kMixWarps + w]);
    partial[(t * S + s) * (kMix + 1) + m] = v;
  }
}

// One warp per row: the splits' partials in split order (lane m owns mix m), then r and the
// Sinkhorn (split_sinkhorn_warp).
template <int HC>
__global__ void hc_mixes_finish_kernel(HcShape p, DeviceWeight scale, DeviceWeight base, int S,
                                       const float* partial, float* pre, float* post, float* comb) {
  constexpr int kMix = (2 + HC) * HC;
  __shared__ float mix[kMix + 1], c[HC * HC], sums[HC];
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x;
  const int n = HC * p.dim;
  const float* pt = partial + t * S * (kMix + 1);
  for (int m = lane; m <= kMix; m += 32) {
    float v = pt[m];
    for (int s = 1; s < S; ++s) v = ew::fadd(v, pt[s * (kMix + 1) + m]);
    mix[m] = v;
  }
  __syncwarp();
  const float r = ew::fdiv(1.0f, __fsqrt_rn(ew::fadd(ew::fdiv(mix[kMix], float(n)), p.norm_eps)));
  __syncwarp();
  for (int m = lane; m < kMix; m += 32) mix[m] = ew::fmul(mix[m], r);
  __syncwarp();
  const float sc[3] = {ew::weight_flat(scale, 0), ew::weight_flat(scale, 1),
                       ew::weight_flat(scale, 2)};
  split_sinkhorn_warp<HC>(p, mix, sc, base, c, sums, pre + t * HC, post + t * HC,
                          comb + t * HC * HC);
}

template <int HC>
void launch_mixes(const HcShape& p, const DeviceWeight& fn, const DeviceWeight& scale,
                  const DeviceWeight& base, const float* X, int T, float* pre, float* post,
                  float* comb, float* scratch, cudaStream_t stream) {
  const int S = mix_splits(p);
  hc_mixes_partial_kernel<HC><<<dim3(S, T), kMixThreads, 0, stream>>>(p, fn, X, scratch);
  UF_CUDA_CHECK(cudaGetLastError());
  hc_mixes_finish_kernel<HC><<<T, 32, 0, stream>>>(p, scale, base, S, scratch, pre, post, comb);
}

constexpr int kThreads = 256;

__global__ void hc_pre_kernel(HcShape p, const float* X, const float* pre, float* y) {
  const int d = blockIdx.y * kThreads + threadIdx.x;
  if (d >= p.dim) return;
  const int64_t t = blockIdx.x;
  const int hc = p.hc, D = p.dim;
  const float* x = X + t * hc * D;
  const float* w = pre + t * hc;
  float s = ew::fmul(w[0], x[d]);
  for (int c = 1; c < hc; ++c) s = ew::fadd(s, ew::fmul(w[c], x[int64_t(c) * D + d]));
  y[t * D + d] = ew::round_bf16(s);
}

__global__ void hc_post_kernel(HcShape p, const float* x, const float* R, const float* post,
                               const float* comb, float* out) {
  const int d = blockIdx.y * kThreads + threadIdx.x;
  if (d >= p.dim) return;
  const int64_t t = blockIdx.x;
  const int hc = p.hc, D = p.dim;
  const float* r = R + t * hc * D;
  const float* cb = comb + t * hc * hc;
  float* o = out + t * hc * D;
  float rv[kMaxHc];
#pragma unroll
  for (int j = 0; j < kMaxHc; ++j)
    if (j < hc) rv[j] = r[int64_t(j) * D + d];
  const float xd = x[t * D + d];
  for (int k = 0; k < hc; ++k) {
    float s = ew::fmul(cb[k], rv[0]);
#pragma unroll
    for (int j = 1; j < kMaxHc; ++j)
      if (j < hc) s = ew::fadd(s, ew::fmul(cb[j * hc + k], rv[j]));
    o[int64_t(k) * D + d] = ew::round_bf16(ew::fadd(ew::fmul(post[t * hc + k], xd), s));
  }
}

void check_shape(const char* name, const HcShape& p) {
  require(p.hc >= 1 && p.hc <= kMaxHc && p.dim > 0,
          "%s: hc = %d, dim = %d; expected 1 <= hc <= %d and dim > 0", name, p.hc, p.dim, kMaxHc);
}

}  // namespace

size_t hc_mixes_scratch_floats(const HcShape& p, int T) {
  return size_t(std::max(T, 0)) * size_t(mix_splits(p)) * size_t((2 + p.hc) * p.hc + 1);
}

void hc_mixes(const HcShape& p, const DeviceWeight& fn, const DeviceWeight& scale,
              const DeviceWeight& base, const float* X, int T, float* pre, float* post, float* comb,
              float* scratch, cudaStream_t stream) {
  check_shape("hc_mixes", p);
  require(T <= 0 || scratch, "hc_mixes: no scratch (hc_mixes_scratch_floats(p, %d) floats)", T);
  const int mix = (2 + p.hc) * p.hc;
  require(fn.rows == mix && fn.cols == int64_t(p.hc) * p.dim,
          "hc_mixes: fn is [%lld, %lld], expected [%d, %lld]", (long long)fn.rows,
          (long long)fn.cols, mix, (long long)p.hc * p.dim);
  require(scale.rows * scale.cols >= 3 && base.rows * base.cols >= mix,
          "hc_mixes: scale has %lld values (needs 3), base %lld (needs %d)",
          (long long)(scale.rows * scale.cols), (long long)(base.rows * base.cols), mix);
  if (T <= 0) return;
  switch (p.hc) {
    case 1:
      launch_mixes<1>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    case 2:
      launch_mixes<2>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    case 3:
      launch_mixes<3>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    case 4:
      launch_mixes<4>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    case 5:
      launch_mixes<5>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    case 6:
      launch_mixes<6>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    case 7:
      launch_mixes<7>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
    default:
      launch_mixes<8>(p, fn, scale, base, X, T, pre, post, comb, scratch, stream);
      break;
  }
  UF_CUDA_CHECK(cudaGetLastError());
}

void hc_pre(const HcShape& p, const float* X, const float* pre, int T, float* y,
            cudaStream_t stream) {
  check_shape("hc_pre", p);
  if (T <= 0) return;
  const dim3 grid(T, (p.dim + kThreads - 1) / kThreads);
  hc_pre_kernel<<<grid, kThreads, 0, stream>>>(p, X, pre, y);
  UF_CUDA_CHECK(cudaGetLastError());
}

void hc_post(const HcShape& p, const float* x, const float* R, const float* post, const float* comb,
             int T, float* out, cudaStream_t stream) {
  check_shape("hc_post", p);
  if (T <= 0) return;
  const dim3 grid(T, (p.dim + kThreads - 1) / kThreads);
  hc_post_kernel<<<grid, kThreads, 0, stream>>>(p, x, R, post, comb, out);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
