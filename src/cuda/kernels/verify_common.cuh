#pragma once
// Internal to the verification kernels (src/cuda/verify.h): the device pieces that the
// single-CTA transform (verify_transform.cu), the cluster transform (verify_cluster.cu) and the
// verification (verify.cu) share, and the host launchers the transform files give verify.cu.
//   - row_ops.h's lanes on the device: each lane's serial chunk sum on one thread (lane_sums),
//     the pairwise tree stride 128..1 in shared memory (tree_total), the inverse-CDF walk over
//     the lane sums then inside one chunk, one fp32 chain run by a warp (warp_cdf_pick);
//   - block argmax / max (order-free), the exp of the transform (exp_rounded).
// All float arithmetic that the CPU does in a fixed order uses the explicit _rn intrinsics, so
// that no FMA contraction or fast-math flag can change a rounding.

#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>

#include "cuda/verify.h"
#include "sampling/row_ops.h"

namespace uf::cuda::verify_detail {

using sampling::kLanes;
using sampling::kMaxDraft;

constexpr int kTransformThreads = 1024;
constexpr int kMaxRows = 2 * kMaxDraft + 1;
static_assert(kLanes == 256, "the device lanes mirror row_ops.h's 256 lanes");

// ---- row_ops.h's lanes -----------------------------------------------------------------------

// The pairwise tree of row_ops.h's tree_total over tree[0..kLanes) in place (stride 128..1);
// the total in every thread. The lane sums must be in tree[] and visible (after a barrier).
__device__ __forceinline__ float tree_total(float* tree) {
  const int tid = threadIdx.x;
  for (int stride = kLanes / 2; stride > 0; stride /= 2) {
    if (tid < stride) tree[tid] = __fadd_rn(tree[tid], tree[tid + stride]);
    __syncthreads();
  }
  return tree[0];
}

// One lane's chunk [begin, end) summed in index order (row_ops.h's chunk_sums), and in *last the
// last index with a positive weight (-1 if none). kUnroll: the loop's unroll factor (the
// cluster's 8), 0 for the compiler's choice (the single-CTA kernels).
template <int kUnroll, typename Index, typename Weight>
__device__ __forceinline__ float chunk_sum(const Weight& weight, Index begin, Index end,
                                           int* last) {
  float s = 0.0f;
  int l = -1;
  if constexpr (kUnroll > 0) {
#pragma unroll kUnroll
    for (Index x = begin; x < end; ++x) {
      const float w = weight(x);
      s = __fadd_rn(s, w);
      if (w > 0.0f) l = int(x);
    }
  } else {  // the same loop without the pragma
    for (Index x = begin; x < end; ++x) {
      const float w = weight(x);
      s = __fadd_rn(s, w);
      if (w > 0.0f) l = int(x);
    }
  }
  *last = l;
  return s;
}

// row_ops.h's inverse_cdf_pick on one warp (all 32 lanes call; the result in every lane), given
// the lane sums of weight over [0, n) (a row of n; lane_last[lane]: the lane's last positive
// index) and target = u x total: walks the lane sums, then inside the chunk of the lane where the
// running sum reaches target (*in_lane, -1 if none). Returns the index at which the sum reaches
// target, else (rounding fell short) the last positive index seen, -1 if none. The walk inside
// the chunk runs only where walk_here(lane) (the cluster walks in the CTA that holds the chunk;
// the index is then only valid there). The same fp32 chain as the one-thread walk: the warp loads
// 32 values at once (coalesced) and every lane adds them to the same running sum in order by
// shuffles, so only the adds are serial (one thread loading each weight on the chain took tens of
// microseconds on a 129280 row in global memory).
template <typename Index, typename Weight, typename Here>
__device__ __forceinline__ int32_t warp_cdf_pick(const float* lane_sum, const int* lane_last,
                                                 const Weight& weight, Index n, float target,
                                                 int* in_lane, const Here& walk_here) {
  const int lane = threadIdx.x & 31;
  const Index chunk = (n + kLanes - 1) / kLanes;
  float running = 0.0f;
  int32_t last_positive = -1;
  int hit = -1;
  for (int c = 0; c < kLanes && hit < 0; c += 32) {
    const float sv = lane_sum[c + lane];
    const int lv = lane_last[c + lane];
#pragma unroll 8
    for (int k = 0; k < 32; ++k) {
      const float s = __shfl_sync(0xffffffffu, sv, k);
      const int l = __shfl_sync(0xffffffffu, lv, k);
      if (hit < 0 && s > 0.0f) {
        const float nxt = __fadd_rn(running, s);
        if (nxt >= target) {
          hit = c + k;
        } else {
          running = nxt;
          last_positive = l;
        }
      }
    }
  }
  *in_lane = hit;
  if (hit >= 0 && walk_here(hit)) {
    const Index begin = Index(hit) * chunk;
    const Index end = begin + chunk < n ? begin + chunk : n;
    constexpr int kDepth = 4;  // batches of 32 weights loaded before their adds
    float r = running;
    bool done = false;
    for (Index x0 = begin; x0 < end && !done; x0 += 32 * kDepth) {
      float wv[kDepth];
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        const Index x = x0 + 32 * d + lane;
        wv[d] = x < end ? weight(x) : 0.0f;
      }
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
#pragma unroll 8
        for (int k = 0; k < 32; ++k) {
          const float w = __shfl_sync(0xffffffffu, wv[d], k);
          if (!done && w > 0.0f) {  // past end w = 0: skipped
            r = __fadd_rn(r, w);
            last_positive = int32_t(x0 + 32 * d + k);
            done = r >= target;
          }
        }
      }
    }
  }
  return last_positive;
}

// The single-CTA blocks' lane state (verify_kernel, transform_kernel, draft_slot_kernel).
struct SharedRow {
  float lane[kLanes];
  float tree[kLanes];
  int last[kLanes];
  int pick;
};

// Lane sums of row_ops.h's chunk_sums (threads 0..255) and the pairwise tree; returns the tree
// total in every thread. With `last`, s_last[lane] = the last index of the lane's chunk with a
// positive weight (-1 if none). Must be called by every thread of the block.
template <typename Weight>
__device__ float lane_sums(const Weight& weight, int64_t n, float* s_lane, float* s_tree,
                           int* s_last) {
  __syncthreads();  // the shared arrays may still be read from a previous call
  const int tid = threadIdx.x;
  if (tid < kLanes) {
    const int64_t chunk = (n + kLanes - 1) / kLanes;
    const int64_t begin = tid * chunk;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
    int last;
    const float s = chunk_sum<0>(weight, begin, end, &last);
    s_lane[tid] = s;
    s_tree[tid] = s;
    if (s_last != nullptr) s_last[tid] = last;
  }
  __syncthreads();
  return tree_total(s_tree);
}

// row_ops.h's inverse_cdf_pick by one block once the lane sums of weight are in sh.lane /
// sh.last and their tree total is `total`; the result in every thread.
template <typename Weight>
__device__ int32_t pick_from_lanes(const Weight& weight, int64_t n, float u, float total,
                                   SharedRow& sh) {
  if (threadIdx.x < 32) {
    int32_t pick = -1;
    if (total > 0.0f) {
      int in_lane;
      pick = warp_cdf_pick(sh.lane, sh.last, weight, n, __fmul_rn(u, total), &in_lane,
                           [](int) { return true; });
    }
    if (threadIdx.x == 0) sh.pick = pick;
  }
  __syncthreads();
  return sh.pick;
}

// row_ops.h's inverse_cdf_pick by one block; the result in every thread.
template <typename Weight>
__device__ int32_t block_inverse_cdf_pick(const Weight& weight, int64_t n, float u, SharedRow& sh) {
  const float total = lane_sums(weight, n, sh.lane, sh.tree, sh.last);
  return pick_from_lanes(weight, n, u, total, sh);
}

// Lane sums computed ahead (sum[kLanes], last[kLanes]) into sh.lane / sh.last, and their tree
// total (lane_sums' result for the same row), in every thread. Whole block.
__device__ __forceinline__ float load_lanes(const float* sum, const int* last, SharedRow& sh) {
  __syncthreads();  // the shared arrays may still be read from a previous call
  const int tid = threadIdx.x;
  if (tid < kLanes) {
    sh.lane[tid] = sum[tid];
    sh.tree[tid] = sum[tid];
    sh.last[tid] = last[tid];
  }
  __syncthreads();
  return tree_total(sh.tree);
}

struct Plain {
  const float* p;
  __device__ float operator()(int64_t x) const { return p[x]; }
};

// A draft slot's token (thread 0 of the writing CTA): prev = the token, or 0 when none was drawn
// (token -1: an all-zero or NaN row), so the next slot's Markov gather stays inside the table.
__device__ __forceinline__ void store_draft_token(int32_t t, int vocab, int32_t* token,
                                                  int32_t* prev) {
  *token = t;
  *prev = (t >= 0 && t < vocab) ? t : 0;
}

// ---- transform pieces ---------------------------------------------------------------------------

// exp in double rounded to float: the correctly rounded expf but for ~2^-28 of arguments.
__device__ __forceinline__ float exp_rounded(float z) { return float(exp(double(z))); }

struct ArgMax {
  float v;
  int i;
};

__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

// Warp-wide argmax (lowest index on ties); the result in every lane.
__device__ __forceinline__ ArgMax warp_argmax(ArgMax a) {
  for (int o = 16; o > 0; o >>= 1) {
    const ArgMax b{__shfl_xor_sync(0xffffffffu, a.v, o), __shfl_xor_sync(0xffffffffu, a.i, o)};
    a = better(a, b);
  }
  return a;
}

// Block-wide argmax (lowest index on ties) / max over 1024 threads; the result in every thread.
__device__ __forceinline__ ArgMax block_argmax(ArgMax a, ArgMax* s_warp) {
  a = warp_argmax(a);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) s_warp[threadIdx.x >> 5] = a;
  __syncthreads();
  ArgMax r = s_warp[0];
  for (int w = 1; w < int(blockDim.x >> 5); ++w) r = better(r, s_warp[w]);
  return r;
}

// ---- host side: the transform launchers verify.cu dispatches to --------------------------------

// verify_cluster.cu. The cluster size of the current device (16, or 8 where a cluster of 16
// cannot be resident), its kernels' attributes set on the first call: host queries only.
int cluster_size();
// The cluster size to use for rows of this vocab, or 0 for the single-CTA kernels.
int transform_cluster(int vocab);
// cluster_transform_kernel / cluster_draft_slot_kernel with `cluster` = transform_cluster(...).
void launch_cluster_transform(int cluster, const float* logits, int rows, int vocab,
                              const sampling::SamplingParams& params, float* probs,
                              cudaStream_t stream);
void launch_cluster_draft_slot(int cluster, float* logits, const float* bias, int vocab,
                               const DeviceSamplingParams* params, const float* u, float* probs,
                               int32_t* token, int32_t* prev, cudaStream_t stream);

// verify_transform.cu: transform_kernel / draft_slot_kernel (one 1024-thread block a row);
// their attributes (dynamic shared memory), set with the cluster kernels' by cluster_size().
void set_single_transform_attributes();
void launch_single_transform(const float* logits, int rows, int vocab,
                             const sampling::SamplingParams& params, float* probs,
                             cudaStream_t stream);
void launch_single_draft_slot(float* logits, const float* bias, int vocab,
                              const DeviceSamplingParams* params, const float* u, float* probs,
                              int32_t* token, int32_t* prev, cudaStream_t stream);

}  // namespace uf::cuda::verify_detail
