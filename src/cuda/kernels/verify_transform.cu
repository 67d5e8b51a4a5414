// The single-CTA transform of src/cuda/verify.h (sampling/transform.cpp's logits_to_probs on
// the device): one 1024-thread block a row. The fallback where a vocab's slice does not fit in a
// cluster's shared memory, the choice for many-row top-p launches (see transform_cluster in
// verify_cluster.cu), and the benchmark's comparison (set_single_cta_transform_for_bench).
//
// transform_kernel: max (order-free), e = exp((l - m) / T) in double rounded to float; top-k: the
// k-th largest value by radix select over the float bits (counts only, exact); top-p:
// top_p_cut_radix below (verify_select.cuh's steps: candidates from a coarse histogram,
// radix-sorted in the plan's scratch, walked by warp 0); then the fixed-order sums of row_ops.h
// on threads 0..255 (lane = thread) and the normalisation.
// draft_slot_kernel: the same transform of one draft slot's logits, then the token.

#include <cuda_runtime.h>

#include <cfloat>
#include <climits>

#include "cuda/cuda_check.h"
#include "cuda/kernels/verify_common.cuh"
#include "cuda/kernels/verify_select.cuh"
#include "cuda/verify.h"

namespace uf::cuda {
namespace verify_detail {
namespace {

__global__ void exp_of_bits_kernel(uint32_t first_bits, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = exp_rounded(__uint_as_float(first_bits + uint32_t(i)));
  }
}

// How many of p[0..n) have bits >= t; the result in every thread.
__device__ int count_at_least(const float* p, int n, uint32_t t, SharedRow& sh) {
  __syncthreads();  // sh.count may still be read from a previous call
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  int c = 0;
  for (int x = threadIdx.x; x < n; x += blockDim.x) c += __float_as_uint(p[x]) >= t ? 1 : 0;
  atomicAdd(&sh.count, c);
  __syncthreads();
  return sh.count;
}

// The bits of the k-th largest of p[0..n) (1 <= k <= n), with multiplicity (verify_select.cuh).
// Must be called by the whole block.
__device__ uint32_t kth_largest_bits_radix(const float* p, int n, int k, SortShared& ss) {
  uint32_t prefix = 0;
  int kk = k;  // rank still wanted among the values that match the prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    digit_histogram(p, n, prefix, shift, ss.hist);
    __syncthreads();
    select_digit(ss.hist, shift, &ss.sel_digit, &ss.sel_before, prefix, kk);
  }
  return prefix;
}

// The top-p cut of transform.cpp (top_p_cut over the survivors p[x] >= kcut, n of them, with
// limit = top_p * zk), by verify_select.cuh's steps with the counters in this block's shared
// memory. s: scratch of cap >= n floats. May overwrite p (sets *clobbered then; the caller
// recomputes it). recompute(): rewrites p exactly (whole block).
template <typename Recompute>
__device__ float top_p_cut_radix(float* p, int vocab, float kcut, int n, float limit, float* s,
                                 int cap, SortShared& ss, bool* clobbered,
                                 const Recompute& recompute) {
  const int tid = threadIdx.x;
  const uint32_t kbits = __float_as_uint(kcut);
  coarse_histogram(p, vocab, kcut, ss, &ss.umax, [] {});
  __syncthreads();
  if (tid < 32) candidate_threshold(ss, limit, kbits, &ss.umax, &ss.t);
  __syncthreads();
  const uint32_t top = ss.umax;
  uint32_t t = ss.t;
  *clobbered = false;
  for (;;) {
    const bool final = t == kbits;
    __syncthreads();
    if (tid == 0) {
      ss.count = 0;
      ss.umin = 0xFFFFFFFFu;
    }
    __syncthreads();
    compact_candidates(p, vocab, kcut, t, s, &ss.count, &ss.umin);
    __syncthreads();
    if (sort_and_walk(s, ss.count, cap, p, top, ss.umin, n, kcut, limit, final, ss)) {
      *clobbered = true;
    }
    __syncthreads();
    if (ss.done) return ss.cut;
    t = kbits;  // take every survivor
    if (*clobbered) {
      recompute();
      *clobbered = false;
      __syncthreads();
    }
  }
}

// transform.cpp's logits_to_probs of one row l into p, by the whole block (any multiple of 32
// threads >= kLanes). s: the row's sort scratch (next_pow2(vocab) floats). Returns the greedy
// argmax (lowest index on ties) when temperature == 0, else -1.
__device__ int transform_row(const float* l, int vocab, float temperature, float top_p, int top_k,
                             float* p, float* s, int cap, SharedRow& sh, SortShared& ss,
                             ArgMax* s_warp) {
  const int tid = threadIdx.x;
  const int nt = blockDim.x;

  if (temperature == 0.0f) {  // greedy: one-hot on the argmax, lowest index on ties
    ArgMax a{-INFINITY, INT_MAX};
    for (int x = tid; x < vocab; x += nt) a = better(a, ArgMax{l[x], x});
    a = block_argmax(a, s_warp);
    const int best = a.i == INT_MAX ? 0 : a.i;  // all -inf: the CPU keeps index 0
    for (int x = tid; x < vocab; x += nt) p[x] = x == best ? 1.0f : 0.0f;
    return best;
  }

  ArgMax mx{-INFINITY, 0};
  for (int x = tid; x < vocab; x += nt) mx.v = fmaxf(mx.v, l[x]);
  const float m = block_argmax(mx, s_warp).v;
  auto prob = [=](int x) { return exp_rounded(__fdiv_rn(__fsub_rn(l[x], m), temperature)); };
  for (int x = tid; x < vocab; x += nt) p[x] = prob(x);

  const bool use_k = top_k > 0 && top_k < vocab;
  const bool use_p = top_p < 1.0f;
  float cut = 0.0f;  // survivors are the x with p[x] >= cut
  if (use_k || use_p) {
    int n = vocab;  // survivors of the top-k filter
    if (use_k) {
      cut = __uint_as_float(kth_largest_bits_radix(p, vocab, top_k, ss));
      n = count_at_least(p, vocab, __float_as_uint(cut), sh);
    }
    if (use_p) {
      const float kcut = cut;
      const float zk = lane_sums([=](int64_t x) { return p[x] >= kcut ? p[x] : 0.0f; }, vocab,
                                 sh.lane, sh.tree, nullptr);
      const float limit = __fmul_rn(top_p, zk);
      bool clobbered = false;
      cut = top_p_cut_radix(p, vocab, kcut, n, limit, s, cap, ss, &clobbered, [&] {
        for (int x = tid; x < vocab; x += nt) p[x] = prob(x);
      });
      if (clobbered) {  // the sort used the row as its second buffer: recompute it
        for (int x = tid; x < vocab; x += nt) p[x] = prob(x);
      }
    }
    for (int x = tid; x < vocab; x += nt) {
      if (!(p[x] >= cut)) p[x] = 0.0f;
    }
  }
  const float z = lane_sums([=](int64_t x) { return p[x]; }, vocab, sh.lane, sh.tree, nullptr);
  for (int x = tid; x < vocab; x += nt) p[x] = __fdiv_rn(p[x], z);
  return -1;
}

__global__ void __launch_bounds__(kTransformThreads)
    transform_kernel(const float* logits, int vocab, float temperature, float top_p, int top_k,
                     float* probs, float* sort_scratch, int sort_stride) {
  __shared__ SharedRow sh;
  __shared__ SortShared ss;
  __shared__ ArgMax s_warp[32];
  transform_row(logits + size_t(blockIdx.x) * vocab, vocab, temperature, top_p, top_k,
                probs + size_t(blockIdx.x) * vocab, sort_scratch + size_t(blockIdx.x) * sort_stride,
                sort_stride, sh, ss, s_warp);
}

// One DSpark draft slot: logits += bias (fp32, in place), q = transform(logits), token = greedy ?
// argmax : inverse-CDF pick with *u (sampler.cpp's sample_from_logits); store_draft_token.
__global__ void __launch_bounds__(kTransformThreads)
    draft_slot_kernel(float* logits, const float* bias, int vocab,
                      const DeviceSamplingParams* params, const float* u, float* probs,
                      float* sort_scratch, int32_t* token, int32_t* prev) {
  __shared__ SharedRow sh;
  __shared__ SortShared ss;
  __shared__ ArgMax s_warp[32];
  if (bias != nullptr) {
    for (int x = threadIdx.x; x < vocab; x += blockDim.x) logits[x] = __fadd_rn(logits[x], bias[x]);
  }
  __syncthreads();
  const DeviceSamplingParams prm = *params;
  const int cap = next_pow2(vocab);  // the documented scratch size
  const int best = transform_row(logits, vocab, prm.temperature, prm.top_p, prm.top_k, probs,
                                 sort_scratch, cap, sh, ss, s_warp);
  __syncthreads();
  int32_t t = best;
  if (prm.temperature != 0.0f) t = block_inverse_cdf_pick(Plain{probs}, vocab, *u, sh);
  if (threadIdx.x == 0) store_draft_token(t, vocab, token, prev);
}

}  // namespace

void launch_single_transform(const float* logits, int rows, int vocab,
                             const sampling::SamplingParams& params, float* probs,
                             float* sort_scratch, int sort_stride, cudaStream_t stream) {
  transform_kernel<<<rows, kTransformThreads, 0, stream>>>(logits, vocab, params.temperature,
                                                           params.top_p, params.top_k, probs,
                                                           sort_scratch, sort_stride);
  UF_CUDA_CHECK(cudaGetLastError());
}

void launch_single_draft_slot(float* logits, const float* bias, int vocab,
                              const DeviceSamplingParams* params, const float* u, float* probs,
                              float* sort_scratch, int32_t* token, int32_t* prev,
                              cudaStream_t stream) {
  draft_slot_kernel<<<1, kTransformThreads, 0, stream>>>(logits, bias, vocab, params, u, probs,
                                                         sort_scratch, token, prev);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace verify_detail

void exp_of_bits_on_device(uint32_t first_bits, int64_t n, float* out, cudaStream_t stream) {
  require(n >= 0 && uint64_t(first_bits) + uint64_t(n) <= (uint64_t(1) << 32),
          "exp_of_bits_on_device: %lld values from 0x%08x run past 2^32", (long long)n, first_bits);
  if (n == 0) return;
  verify_detail::exp_of_bits_kernel<<<1024, 256, 0, stream>>>(first_bits, n, out);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
