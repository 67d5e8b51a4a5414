// Speculative-decoding verification on the device (src/cuda/verify.h): the verification kernel
// (the port of src/sampling/verify.cpp, token-wise and block), the DSpark draft confidences, the
// plan and the public entry points, which dispatch each transform to the cluster kernels
// (verify_cluster.cu, the default) or the single-CTA ones (verify_transform.cu).
// Shared device pieces: verify_common.cuh (row_ops.h's lanes, inverse-CDF walk, argmax) and
// verify_select.cuh (the radix top-k / top-p selection of both transforms).
//
// verify_kernel: one 256-thread block (lane = thread); every thread follows the same control flow
// (all values it branches on are identical in every thread), thread 0 does the sequential walks.
// All float arithmetic that the CPU does in a fixed order uses the explicit _rn intrinsics so that
// no FMA contraction or fast-math flag can change a rounding.

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/kernels/verify_common.cuh"
#include "cuda/verify.h"
#include "sampling/row_ops.h"

namespace uf::cuda {

using namespace verify_detail;  // this file's kernels and launchers are built of its pieces

namespace {

using sampling::VerifyDraws;
using sampling::VerifyResult;

// verify.cpp's next_weight: min(1, w * p / q), q = 0 gives 1.
__device__ __forceinline__ float next_weight(float w, float p, float q) {
  const float num = __fmul_rn(w, p);
  return num >= q ? 1.0f : __fdiv_rn(num, q);
}

struct Residual {
  const float* p;
  const float* q;
  float scale;
  __device__ float operator()(int64_t x) const {
    const float r = __fsub_rn(__fmul_rn(scale, p[x]), q[x]);
    return r > 0.0f ? r : 0.0f;
  }
};

__device__ float residual_mass(const float* p, const float* q, float scale, int64_t v,
                               SharedRow& sh) {
  return lane_sums(Residual{p, q, scale}, v, sh.lane, sh.tree, nullptr);
}

// A draw from the residual max(scale p - q, 0) (lanes: its lane sums computed ahead, else
// summed here), else (no positive residual) from p.
__device__ int32_t sample_residual(const float* p, const float* q, float scale, int64_t v, float u,
                                   const float* lane_sum, const int* lane_last, SharedRow& sh) {
  const Residual residual{p, q, scale};
  const int32_t y = lane_sum != nullptr
                        ? pick_from_lanes(residual, v, u, load_lanes(lane_sum, lane_last, sh), sh)
                        : block_inverse_cdf_pick(residual, v, u, sh);
  if (y >= 0) return y;
  return block_inverse_cdf_pick(Plain{p}, v, u, sh);
}

// Block verification's row sums ahead of the verification (verify_lanes_kernel): the lane sums
// and last positive indices of row r's weight, r = 0 .. g: the residual max(w_r p_r - q_r, 0) for
// r < g (w_0 = 1: the draws that reject at r sample from it, and rows 1 .. g-1 give the
// thresholds' masses), the plain p_g for r = g (all drafts accepted). One warp a (row, lane):
// the lane's chunk in index order, 32 weights loaded at once (coalesced) and added by every lane
// to one running sum through shuffles, so only the adds are serial: the fp32 chain of
// chunk_sum, bitwise. (The verification block summed these rows itself, 256 threads each loading
// its chunk's weights one by one: ~300 us a step at the real vocab, g = 7.)
constexpr int kLaneWarps = 8;  // warps (row, lane pairs) a CTA
constexpr int kLaneDepth = 8;  // batches of 32 weights loaded before their adds

__global__ void __launch_bounds__(32 * kLaneWarps)
    verify_lanes_kernel(const float* p, const float* q, const int32_t* tokens, int g, int vocab,
                        float* lane_sum, int* lane_last) {
  const int item = blockIdx.x * kLaneWarps + int(threadIdx.x >> 5);  // row * kLanes + lane
  const int row = item / kLanes, ln = item % kLanes, lane = threadIdx.x & 31;
  if (row > g) return;  // the warp's whole: item is warp-uniform
  const int64_t v = vocab;
  // w_row = next_weight over drafts 1..row (verify_kernel's chain): lane i - 1 loads draft i's
  // p and q, then the chain runs on shuffles.
  float pi = 0.0f, qi = 0.0f;
  if (lane < row && row < g) {
    const int32_t x = tokens[lane];
    pi = p[lane * v + x];
    qi = q[lane * v + x];
  }
  float w = 1.0f;
  for (int i = 1; i <= row && row < g; ++i)
    w = next_weight(w, __shfl_sync(0xffffffffu, pi, i - 1), __shfl_sync(0xffffffffu, qi, i - 1));
  const Residual residual{p + row * v, row < g ? q + row * v : nullptr, w};
  const Plain plain{p + row * v};
  const bool is_plain = row == g;
  const int64_t chunk = (v + kLanes - 1) / kLanes;
  const int64_t begin = ln * chunk, end = begin + chunk < v ? begin + chunk : v;
  float sum = 0.0f;
  int last = -1;
  for (int64_t x0 = begin; x0 < end; x0 += 32 * kLaneDepth) {
    float wv[kLaneDepth];
#pragma unroll
    for (int d = 0; d < kLaneDepth; ++d) {
      const int64_t x = x0 + 32 * d + lane;
      wv[d] = x < end ? (is_plain ? plain(x) : residual(x)) : 0.0f;
    }
#pragma unroll
    for (int d = 0; d < kLaneDepth; ++d) {
      const int64_t xb = x0 + 32 * d;
      if (xb >= end) break;  // warp-uniform
      const unsigned pos = __ballot_sync(0xffffffffu, wv[d] > 0.0f);
      if (pos != 0) last = int(xb) + 31 - __clz(int(pos));
      const int n = end - xb < 32 ? int(end - xb) : 32;
#pragma unroll 8
      for (int k = 0; k < 32; ++k) {
        const float t = __shfl_sync(0xffffffffu, wv[d], k);
        if (k < n) sum = __fadd_rn(sum, t);
      }
    }
  }
  if (lane == 0) {
    lane_sum[item] = sum;
    lane_last[item] = last;
  }
}

__global__ void __launch_bounds__(kLanes)
    verify_kernel(bool block_mode, const float* p, const float* q, const int32_t* tokens, int g,
                  int vocab, const unsigned long long* seed_step, const VerifyDraws* draws_in,
                  const float* lane_sum, const int* lane_last, VerifyResult* out,
                  VerifyDraws* draws_used) {
  __shared__ SharedRow sh;
  const VerifyDraws d =
      draws_in != nullptr ? *draws_in : sampling::make_verify_draws(seed_step[0], seed_step[1]);
  const int64_t v = vocab;
  float weight[kMaxDraft + 1], threshold[kMaxDraft + 1], resid[kMaxDraft + 1];
  for (int i = 0; i <= kMaxDraft; ++i) weight[i] = threshold[i] = resid[i] = 0.0f;
  weight[0] = 1.0f;
  threshold[0] = 1.0f;
  for (int i = 1; i <= g; ++i) {
    const int32_t x = tokens[i - 1];
    weight[i] = next_weight(weight[i - 1], p[(i - 1) * v + x], q[(i - 1) * v + x]);
  }

  int tau = 0;
  int32_t extra = -1;
  if (!block_mode) {
    tau = g;
    for (int i = 1; i <= g; ++i) {
      const int32_t x = tokens[i - 1];
      threshold[i] = next_weight(1.0f, p[(i - 1) * v + x], q[(i - 1) * v + x]);
    }
    for (int i = 1; i <= g; ++i) {
      if (!(d.eta[i - 1] <= threshold[i])) {
        tau = i - 1;
        break;
      }
    }
    if (tau < g) {
      resid[tau] = residual_mass(p + tau * v, q + tau * v, 1.0f, v, sh);
      extra = sample_residual(p + tau * v, q + tau * v, 1.0f, v, d.u_extra, nullptr, nullptr, sh);
    } else {
      extra = block_inverse_cdf_pick(Plain{p + g * v}, v, d.u_extra, sh);
    }
  } else {  // block mode: row r's lane sums at lane_sum + r kLanes (verify_lanes_kernel)
    for (int i = 1; i <= g; ++i) {
      if (i < g) {
        const float z = load_lanes(lane_sum + i * kLanes, lane_last + i * kLanes, sh);
        const float den = __fadd_rn(z, __fsub_rn(1.0f, weight[i]));
        resid[i] = z;
        threshold[i] = den > 0.0f ? __fdiv_rn(z, den) : 1.0f;
      } else {
        threshold[i] = weight[i];
      }
      if (d.eta[i - 1] <= threshold[i]) tau = i;  // no break: tau is the last such i
    }
    if (tau < g) {
      if (tau == 0) resid[0] = load_lanes(lane_sum, lane_last, sh);
      extra = sample_residual(p + tau * v, q + tau * v, weight[tau], v, d.u_extra,
                              lane_sum + tau * kLanes, lane_last + tau * kLanes, sh);
    } else {
      const Plain plain{p + g * v};
      extra = pick_from_lanes(plain, v, d.u_extra,
                              load_lanes(lane_sum + g * kLanes, lane_last + g * kLanes, sh), sh);
    }
  }
  if (threadIdx.x == 0) {
    out->accepted = tau;
    out->extra_token = extra;
    for (int i = 0; i <= kMaxDraft; ++i) {
      out->weight[i] = weight[i];
      out->threshold[i] = threshold[i];
      out->residual_mass[i] = resid[i];
    }
    if (draws_used != nullptr) *draws_used = d;
  }
}

// cuda_dspark.cpp's dot8 (cpu::dot_f32's order) of proj with [x5_b, emb_b]: partial j < 8 sums
// the elements i = j (mod 8) of the full groups of 8 in index order, then tail element n8 + j;
// thread 0 combines ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)). Explicit _rn operations:
// no FMA contraction (the host build has none either). Warp j runs partial j: its lanes load and
// multiply kConfBatch x 32 consecutive terms at once, then every lane adds them to the same running
// sum in index order by shuffles, so the serial chain is the adds alone. (One thread a partial,
// each term's loads on the chain, took 146 us at the model's 4096 + 256.)
constexpr int kConfBatch = 4;
__global__ void __launch_bounds__(256)
    draft_confidence_kernel(const float* proj, const float* x5, const float* emb, int D, int R,
                            float* conf) {
  __shared__ float part[8];
  const int b = blockIdx.x, j = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = D + R, n8 = n / 8 * 8, terms = n8 / 8;  // partial j's full-group terms
  const float* xr = x5 + size_t(b) * D;
  const float* er = emb + size_t(b) * R;
  auto cat = [&](int i) { return i < D ? xr[i] : er[i - D]; };
  float s = 0.0f;
  for (int m0 = 0; m0 < terms; m0 += 32 * kConfBatch) {
    float pr[kConfBatch];
#pragma unroll
    for (int q = 0; q < kConfBatch; ++q) {
      const int m = m0 + 32 * q + lane, i = j + 8 * m;
      pr[q] = m < terms ? __fmul_rn(proj[i], cat(i)) : 0.0f;
    }
#pragma unroll
    for (int q = 0; q < kConfBatch; ++q) {
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        const float t = __shfl_sync(0xffffffffu, pr[q], k);
        if (m0 + 32 * q + k < terms) s = __fadd_rn(s, t);
      }
    }
  }
  if (n8 + j < n) s = __fadd_rn(s, __fmul_rn(proj[n8 + j], cat(n8 + j)));
  if (lane == 0) part[j] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    conf[b] = __fadd_rn(__fadd_rn(__fadd_rn(part[0], part[1]), __fadd_rn(part[2], part[3])),
                        __fadd_rn(__fadd_rn(part[4], part[5]), __fadd_rn(part[6], part[7])));
  }
}

}  // namespace

VerifyPlan::VerifyPlan(int max_vocab) : max_vocab_(max_vocab) {
  require(max_vocab >= 1 && max_vocab <= sampling::kTopPMaxVocab,
          "VerifyPlan: max_vocab = %d is out of range 1..%lld (the top-p masses' bound)", max_vocab,
          (long long)sampling::kTopPMaxVocab);
  UF_CUDA_CHECK(cudaMalloc(&probs_, size_t(kMaxRows) * max_vocab_ * sizeof(float)));
  UF_CUDA_CHECK(cudaMalloc(&lane_sum_, size_t(kMaxDraft + 1) * kLanes * sizeof(float)));
  UF_CUDA_CHECK(cudaMalloc(&lane_last_, size_t(kMaxDraft + 1) * kLanes * sizeof(int)));
  (void)cluster_size();  // the kernels' attributes, ahead of any graph capture
}

VerifyPlan::~VerifyPlan() {
  cudaFree(probs_);
  cudaFree(lane_sum_);
  cudaFree(lane_last_);
}

void logits_to_probs_on_device(const VerifyPlan& plan, const float* logits, int rows, int vocab,
                               const sampling::SamplingParams& params, float* probs,
                               cudaStream_t stream) {
  require(rows >= 0 && rows <= kMaxRows && vocab >= 1 && vocab <= plan.max_vocab(),
          "logits_to_probs_on_device: rows = %d must be in 0..%d and vocab = %d in 1..%d", rows,
          kMaxRows, vocab, plan.max_vocab());
  if (rows == 0) return;
  const int c = transform_cluster(vocab);
  if (c == 16 || c == 8) {
    launch_cluster_transform(c, logits, rows, vocab, params, probs, stream);
    return;
  }
  launch_single_transform(logits, rows, vocab, params, probs, stream);
}

void verify_probs_on_device(const VerifyPlan& plan, sampling::VerifyMode mode, const float* target,
                            const float* draft, const int32_t* tokens, int g, int vocab,
                            const unsigned long long* seed_step, const VerifyDraws* draws,
                            VerifyResult* out, VerifyDraws* draws_used, cudaStream_t stream) {
  require(g >= 0 && g <= kMaxDraft && vocab >= 1,
          "verify_probs_on_device: g = %d must be in 0..%d and vocab = %d >= 1", g, kMaxDraft,
          vocab);
  require(draws != nullptr || seed_step != nullptr,
          "verify_probs_on_device: needs either explicit draws or {seed, step}");
  require(g == 0 || (draft != nullptr && tokens != nullptr),
          "verify_probs_on_device: g = %d drafts need draft rows and tokens", g);
  const bool block = mode == sampling::VerifyMode::kBlock;
  if (block) {  // the rows' lane sums on (g + 1) x kLanes warps
    const int ctas = ((g + 1) * kLanes + kLaneWarps - 1) / kLaneWarps;
    verify_lanes_kernel<<<ctas, 32 * kLaneWarps, 0, stream>>>(target, draft, tokens, g, vocab,
                                                              plan.lane_sums(), plan.lane_last());
    UF_CUDA_CHECK(cudaGetLastError());
  }
  verify_kernel<<<1, kLanes, 0, stream>>>(block, target, draft, tokens, g, vocab, seed_step, draws,
                                          block ? plan.lane_sums() : nullptr,
                                          block ? plan.lane_last() : nullptr, out, draws_used);
  UF_CUDA_CHECK(cudaGetLastError());
}

void verify_on_device(const VerifyPlan& plan, sampling::VerifyMode mode, const float* target_logits,
                      const float* draft_logits, const int32_t* tokens, int g, int vocab,
                      const sampling::SamplingParams& params, const unsigned long long* seed_step,
                      VerifyResult* out, cudaStream_t stream) {
  require(g >= 0 && g <= kMaxDraft && vocab >= 1 && vocab <= plan.max_vocab(),
          "verify_on_device: g = %d must be in 0..%d and vocab = %d in 1..%d", g, kMaxDraft, vocab,
          plan.max_vocab());
  require(seed_step != nullptr, "verify_on_device: seed_step (device {seed, step}) is null");
  // Two launches (target rows, draft rows): they live in separate caller buffers.
  logits_to_probs_on_device(plan, target_logits, g + 1, vocab, params, plan.target_probs(), stream);
  if (g > 0) {
    logits_to_probs_on_device(plan, draft_logits, g, vocab, params, plan.draft_probs(), stream);
  }
  verify_probs_on_device(plan, mode, plan.target_probs(), plan.draft_probs(), tokens, g, vocab,
                         seed_step, nullptr, out, nullptr, stream);
}

DeviceSamplingParams device_sampling_params(const sampling::SamplingParams& p) {
  DeviceSamplingParams d;
  d.temperature = p.temperature;
  d.top_p = p.top_p;
  d.top_k = p.top_k;
  return d;
}

void sample_slot_on_device(float* logits, const float* bias, int vocab,
                           const DeviceSamplingParams* params, const float* u, float* probs,
                           int32_t* token, int32_t* prev, cudaStream_t stream) {
  require(vocab >= 1 && vocab <= sampling::kTopPMaxVocab && logits != nullptr &&
              params != nullptr && u != nullptr && probs != nullptr && token != nullptr &&
              prev != nullptr,
          "sample_slot_on_device: vocab = %d, or a null buffer", vocab);
  const int c = transform_cluster(vocab);
  if (c == 16 || c == 8) {
    launch_cluster_draft_slot(c, logits, bias, vocab, params, u, probs, token, prev, stream);
    return;
  }
  launch_single_draft_slot(logits, bias, vocab, params, u, probs, token, prev, stream);
}

void draft_confidence_on_device(const float* proj, const float* x5, const float* emb, int rows,
                                int dim, int rank, float* conf, cudaStream_t stream) {
  require(rows >= 1 && dim >= 0 && rank >= 0 && dim + rank >= 1,
          "draft_confidence_on_device: rows = %d, dim = %d, rank = %d", rows, dim, rank);
  draft_confidence_kernel<<<rows, 256, 0, stream>>>(proj, x5, emb, dim, rank, conf);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
