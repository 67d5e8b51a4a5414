// The single-CTA transform of src/cuda/verify.h (sampling/transform.cpp's logits_to_probs on
// the device): one 1024-thread block a row. The fallback where a vocab's slice does not fit in a
// cluster's shared memory, the choice for many-row top-p launches (see transform_cluster in
// verify_cluster.cu), and the benchmark's comparison (set_single_cta_transform_for_bench).
//
// transform_kernel: max (order-free), e = exp((l - m) / T) in double rounded to float; top-k: the
// k-th largest value by radix select over the float bits (counts only, exact); top-p:
// verify_select.cuh's radix select weighted by integer mass (exact in any order); then the
// fixed-order sums of row_ops.h on threads 0..255 (lane = thread) and the normalisation.
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

// The bits of the k-th largest of p[0..n) (1 <= k <= n), with multiplicity (verify_select.cuh).
// Must be called by the whole block.
__device__ uint32_t kth_largest_bits_radix(const float* p, int n, int k, WarpHists wh,
                                           SelectShared& ss) {
  uint32_t prefix = 0;
  int kk = k;  // rank still wanted among the values that match the prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    digit_histogram(p, n, prefix, shift, wh, ss.hist);
    __syncthreads();
    select_digit(ss.hist, shift, &ss.sel_digit, &ss.sel_before, prefix, kk);
  }
  return prefix;
}

// transform.cpp's logits_to_probs of one row l into p, by the whole block (any multiple of 32
// threads >= kLanes; wh: kWarpHistBytes of shared memory). Returns the greedy argmax (lowest index
// on ties) when temperature == 0, else -1.
__device__ int transform_row(const float* l, int vocab, float temperature, float top_p, int top_k,
                             float* p, SharedRow& sh, SelectShared& ss, ArgMax* s_warp,
                             WarpHists wh) {
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
    if (use_k) cut = __uint_as_float(kth_largest_bits_radix(p, vocab, top_k, wh, ss));
    if (use_p) cut = top_p_cut_mass(p, vocab, cut, top_p, wh, ss);
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
                     float* probs) {
  __shared__ SharedRow sh;
  __shared__ SelectShared ss;
  __shared__ ArgMax s_warp[32];
  extern __shared__ unsigned long long s_warp_hists[];  // kWarpHistBytes
  transform_row(logits + size_t(blockIdx.x) * vocab, vocab, temperature, top_p, top_k,
                probs + size_t(blockIdx.x) * vocab, sh, ss, s_warp, s_warp_hists);
}

// One DSpark draft slot: logits += bias (fp32, in place), q = transform(logits), token = greedy ?
// argmax : inverse-CDF pick with *u (sampler.cpp's sample_from_logits); store_draft_token.
__global__ void __launch_bounds__(kTransformThreads)
    draft_slot_kernel(float* logits, const float* bias, int vocab,
                      const DeviceSamplingParams* params, const float* u, float* probs,
                      int32_t* token, int32_t* prev) {
  __shared__ SharedRow sh;
  __shared__ SelectShared ss;
  __shared__ ArgMax s_warp[32];
  extern __shared__ unsigned long long s_warp_hists[];  // kWarpHistBytes
  if (bias != nullptr) {
    for (int x = threadIdx.x; x < vocab; x += blockDim.x) logits[x] = __fadd_rn(logits[x], bias[x]);
  }
  __syncthreads();
  const DeviceSamplingParams prm = *params;
  const int best = transform_row(logits, vocab, prm.temperature, prm.top_p, prm.top_k, probs, sh,
                                 ss, s_warp, s_warp_hists);
  __syncthreads();
  int32_t t = best;
  if (prm.temperature != 0.0f) t = block_inverse_cdf_pick(Plain{probs}, vocab, *u, sh);
  if (threadIdx.x == 0) store_draft_token(t, vocab, token, prev);
}

}  // namespace

void set_single_transform_attributes() {
  for (const void* k : {reinterpret_cast<const void*>(transform_kernel),
                        reinterpret_cast<const void*>(draft_slot_kernel)}) {
    UF_CUDA_CHECK(
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kWarpHistBytes)));
  }
}

void launch_single_transform(const float* logits, int rows, int vocab,
                             const sampling::SamplingParams& params, float* probs,
                             cudaStream_t stream) {
  transform_kernel<<<rows, kTransformThreads, kWarpHistBytes, stream>>>(
      logits, vocab, params.temperature, params.top_p, params.top_k, probs);
  UF_CUDA_CHECK(cudaGetLastError());
}

void launch_single_draft_slot(float* logits, const float* bias, int vocab,
                              const DeviceSamplingParams* params, const float* u, float* probs,
                              int32_t* token, int32_t* prev, cudaStream_t stream) {
  draft_slot_kernel<<<1, kTransformThreads, kWarpHistBytes, stream>>>(logits, bias, vocab, params,
                                                                      u, probs, token, prev);
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
