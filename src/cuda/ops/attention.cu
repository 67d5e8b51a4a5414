// sparse_attn: the device twin of cpu::sparse_attn_row over T rows (ops/attention.h).
//
// Layout: one block of kThreads threads per (row, head); the block walks the row's slot list
// (window slots, then top-k entries) in blocks of 64 exactly as the CPU does, so the online
// softmax sees the same block boundaries (empty slots included: they keep their place in the
// list, score -inf, probability 0, and add nothing to P.V).
//
// Arithmetic order, chosen to reproduce the CPU bit for bit (uf_cpu builds with
// -ffp-contract=off, so every step here uses __fmul_rn / __fadd_rn to forbid FMA contraction):
//  - q.k: cpu dot_f32 = dot8: eight partial sums, lane L holding the terms i = L mod 8 in
//    increasing i, combined as ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)); one thread per (slot, lane).
//  - block max, m_new = max(m, bmax), sc = exp(m - m_new), p_j = exp(s_j - m_new) (0 if empty),
//    psum summed in slot order by one thread, sum = sum * sc + psum.
//  - P.V: one thread per output dim d: tmp = sum_j bf16(p_j) * k_j[d] in slot order, then
//    acc = acc * sc + tmp; out = bf16(acc / (sum + exp(sink - m))).
// exp: the CPU calls glibc expf (< 0.502 ulp); here exp runs in double and rounds once to fp32,
// i.e. correctly rounded, so the two agree except when the exact value is within ~0.002 ulp of a
// rounding boundary. That is the only source of difference from the CPU (tests allow 1 bf16 ulp).
//
// Split mode (a scratch buffer given): one CTA per (row, head, slot block of 64) and a merge
// kernel, for the decode shapes where T * H CTAs leave most of the GPU idle (T = 1, 8 heads of a
// TP8 rank: 8 CTAs walking 640 slots, 0.2 ms a layer). The merge re-associates the online
// softmax's sums, so split results are the CPU's to fp32 order only (a rare bf16 flip), not bit
// for bit; their order depends on the slot count only, never on T.
//
// A row's result depends on its own inputs only (spec == plain). No allocation, no atomics.

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/ops/attention.h"

namespace uf::cuda {
namespace {

constexpr int kBlock = 64;  // cpu::kAttnBlock
constexpr int kThreads = 256;
constexpr int kMaxHeadDim = 1024;

__device__ __forceinline__ float exp_rn(float x) { return float(exp(double(x))); }

__global__ void __launch_bounds__(kThreads)
    sparse_attn_kernel(const float* __restrict__ q, int H, int hd, const float* const* window,
                       int n_window, const int32_t* __restrict__ topk, int k, const float* ckv,
                       const float* const* ckv_ref, const float* __restrict__ sink, float scale,
                       float* __restrict__ out, float* __restrict__ partial) {
  if (ckv_ref) ckv = *ckv_ref;
  extern __shared__ float smem[];
  float* qs = smem;        // [hd]
  float* acc = smem + hd;  // [hd]
  __shared__ const float* slot[kBlock];
  __shared__ float part[kBlock * 8];
  __shared__ float s[kBlock];
  __shared__ float pb[kBlock];
  __shared__ float m_sh, sum_sh, sc_sh, mnew_sh;

  const int t = blockIdx.x / H, h = blockIdx.x % H, tid = threadIdx.x;
  const float* qh = q + (int64_t(t) * H + h) * hd;
  for (int d = tid; d < hd; d += kThreads) {
    qs[d] = qh[d];
    acc[d] = 0.f;
  }
  if (tid == 0) {
    m_sh = -1e30f;
    sum_sh = 0.f;
  }
  __syncthreads();
  const int n_slots = n_window + k;
  // Split mode (partial != null): this CTA walks the slot block blockIdx.y only.
  const int b_begin = partial ? int(blockIdx.y) * kBlock : 0;
  const int b_end = partial ? min(n_slots, b_begin + kBlock) : n_slots;
  for (int b0 = b_begin; b0 < b_end; b0 += kBlock) {
    const int nb = min(kBlock, n_slots - b0);
    if (tid < nb) {
      const int j = b0 + tid;
      const float* p = nullptr;
      if (j < n_window) {
        p = window[int64_t(t) * n_window + j];
      } else {
        const int32_t e = topk[int64_t(t) * k + (j - n_window)];
        p = e >= 0 ? ckv + int64_t(e) * hd : nullptr;
      }
      slot[tid] = p;
    }
    __syncthreads();
    // Partial dot products: work item w = (slot j, lane L).
    for (int w = tid; w < nb * 8; w += kThreads) {
      const int j = w >> 3, lane = w & 7;
      const float* kp = slot[j];
      float a = 0.f;
      if (kp)
        for (int i = lane; i < hd; i += 8) a = __fadd_rn(a, __fmul_rn(qs[i], kp[i]));
      part[w] = a;
    }
    __syncthreads();
    if (tid < nb) {
      const float* pp = part + tid * 8;
      const float dot = __fadd_rn(__fadd_rn(__fadd_rn(pp[0], pp[1]), __fadd_rn(pp[2], pp[3])),
                                  __fadd_rn(__fadd_rn(pp[4], pp[5]), __fadd_rn(pp[6], pp[7])));
      s[tid] = slot[tid] ? __fmul_rn(dot, scale) : -INFINITY;
    }
    __syncthreads();
    if (tid == 0) {
      float bmax = -INFINITY;
      for (int j = 0; j < nb; ++j) bmax = bmax < s[j] ? s[j] : bmax;  // std::max(bmax, s[j])
      const float m = m_sh;
      mnew_sh = m < bmax ? bmax : m;  // std::max(m, bmax)
    }
    __syncthreads();
    const float m_new = mnew_sh;
    if (tid < nb) pb[tid] = slot[tid] ? exp_rn(__fadd_rn(s[tid], -m_new)) : 0.f;
    __syncthreads();
    if (tid == 0) {
      const float sc = exp_rn(__fadd_rn(m_sh, -m_new));
      float psum = 0.f;
      for (int j = 0; j < nb; ++j) psum = __fadd_rn(psum, pb[j]);
      sum_sh = __fadd_rn(__fmul_rn(sum_sh, sc), psum);
      sc_sh = sc;
      m_sh = m_new;
    }
    __syncthreads();
    if (tid < nb) pb[tid] = detail::round_bf16(pb[tid]);
    __syncthreads();
    const float sc = sc_sh;
    for (int d = tid; d < hd; d += kThreads) {
      float tmp = 0.f;
      for (int j = 0; j < nb; ++j) {
        const float* kp = slot[j];
        if (kp) tmp = __fadd_rn(tmp, __fmul_rn(pb[j], kp[d]));
      }
      acc[d] = __fadd_rn(__fmul_rn(acc[d], sc), tmp);
    }
    __syncthreads();  // slot / part / pb are rewritten by the next block
  }
  if (partial) {  // (m, sum, acc[hd]) of this slot block, merged by sparse_attn_merge_kernel
    float* rec = partial + (int64_t(blockIdx.x) * gridDim.y + blockIdx.y) * (hd + 2);
    if (tid == 0) {
      rec[0] = m_sh;
      rec[1] = sum_sh;
    }
    for (int d = tid; d < hd; d += kThreads) rec[2 + d] = acc[d];
    return;
  }
  const float sum = __fadd_rn(sum_sh, exp_rn(__fadd_rn(sink[h], -m_sh)));
  float* o = out + (int64_t(t) * H + h) * hd;
  for (int d = tid; d < hd; d += kThreads) o[d] = detail::round_bf16(__fdiv_rn(acc[d], sum));
}

// Split mode: the slot blocks' states of one (row, head) merged in block order, as the online
// softmax merges two states: m = max m_s, sum = sum_s sum_s * exp(m_s - m), acc likewise; then the
// sink and the division as the single-CTA path. With one block it is that path, bit for bit.
__global__ void __launch_bounds__(kThreads)
    sparse_attn_merge_kernel(const float* __restrict__ partial, int n_split, int H, int hd,
                             const float* __restrict__ sink, float* __restrict__ out) {
  const int th = blockIdx.x, h = th % H, tid = threadIdx.x;
  const float* rec = partial + int64_t(th) * n_split * (hd + 2);
  float m = -INFINITY;
  for (int s = 0; s < n_split; ++s) m = m < rec[s * (hd + 2)] ? rec[s * (hd + 2)] : m;
  float sum = 0.f;
  for (int s = 0; s < n_split; ++s)
    sum =
        __fadd_rn(sum, __fmul_rn(rec[s * (hd + 2) + 1], exp_rn(__fadd_rn(rec[s * (hd + 2)], -m))));
  sum = __fadd_rn(sum, exp_rn(__fadd_rn(sink[h], -m)));
  float* o = out + int64_t(th) * hd;
  for (int d = tid; d < hd; d += kThreads) {
    float a = 0.f;
    for (int s = 0; s < n_split; ++s)
      a = __fadd_rn(a,
                    __fmul_rn(rec[s * (hd + 2) + 2 + d], exp_rn(__fadd_rn(rec[s * (hd + 2)], -m))));
    o[d] = detail::round_bf16(__fdiv_rn(a, sum));
  }
}

}  // namespace

void sparse_attn(const float* q, int T, int H, int hd, const float* const* window, int n_window,
                 const int32_t* topk, int k, const float* ckv, const float* sink, float scale,
                 float* out, cudaStream_t stream, const float* const* ckv_ref,
                 float* split_scratch) {
  require(T >= 0 && H > 0 && hd > 0 && hd <= kMaxHeadDim && n_window >= 0 && k >= 0,
          "sparse_attn: unsupported shape T=%d H=%d hd=%d n_window=%d k=%d (hd <= %d)", T, H, hd,
          n_window, k, kMaxHeadDim);
  require(n_window == 0 || window, "sparse_attn: n_window=%d but no window slot array", n_window);
  require(k == 0 || (topk && (ckv || ckv_ref)), "sparse_attn: k=%d but topk or ckv is null", k);
  if (T == 0) return;
  const int64_t blocks = int64_t(T) * H;
  require(blocks < (int64_t(1) << 31), "sparse_attn: T*H=%lld blocks is too many",
          static_cast<long long>(blocks));
  const size_t smem = size_t(2) * size_t(hd) * sizeof(float);
  const int n_split = split_scratch ? std::max(1, (n_window + k + kBlock - 1) / kBlock) : 1;
  sparse_attn_kernel<<<dim3(unsigned(blocks), unsigned(n_split)), kThreads, smem, stream>>>(
      q, H, hd, window, n_window, topk, k, ckv, ckv_ref, sink, scale, out, split_scratch);
  UF_CUDA_CHECK(cudaGetLastError());
  if (split_scratch) {
    sparse_attn_merge_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(split_scratch, n_split, H,
                                                                        hd, sink, out);
    UF_CUDA_CHECK(cudaGetLastError());
  }
}

size_t sparse_attn_scratch_floats(int T, int H, int hd, int n_slots) {
  const int n_split = std::max(1, (n_slots + kBlock - 1) / kBlock);
  return size_t(std::max(T, 0)) * size_t(H) * size_t(n_split) * size_t(hd + 2);
}

}  // namespace uf::cuda
