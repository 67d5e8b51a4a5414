#pragma once
// The routing plan of the decode MoE kernels (moe_fp4.cu): the P = M * topk (row, expert) pairs
// reduced to the distinct experts, ranked by expert id (slot u); an expert's rows (ascending row
// index) are the columns of the mma B operand, so an expert picked by several rows is read once.
// Every CTA builds it into its own shared memory (no plan launch), and the cp.async helpers the
// kernels stream weights with.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/moe_layout.h"

namespace uf::cuda::detail {

// kMaxPairs, SlotPlan, MoePlan, kPlanBytes: moe_layout.h.

// The order in which the combine kernels sum a row's experts: ascending expert id, equal ids in
// k order (a stable insertion sort's order), ids outside [0, E) skipped. Run by one whole warp:
// lane k < K loads id k and takes its position by shuffles; order[pos] = k, *count = the valid
// ids (K <= 32). One thread's insertion sort indexed its arrays dynamically (local memory): ~2 us
// of a decode step's combine (docs/perf.md, session 24).
__device__ __forceinline__ void rank_row_experts(const int32_t* ids, int K, int E, int* order,
                                                 int* count) {
  const int lane = threadIdx.x & 31;
  const int e = lane < K ? ids[lane] : -1;
  const bool valid = lane < K && e >= 0 && e < E;
  const unsigned vmask = __ballot_sync(0xffffffffu, valid);
  int pos = 0;
  for (int j = 0; j < K; ++j) {  // warp-uniform trip count
    const int ej = __shfl_sync(0xffffffffu, e, j);
    pos += ((vmask >> j) & 1u) && (ej < e || (ej == e && j < lane));
  }
  if (valid) order[pos] = lane;
  if (lane == 0) *count = __popc(vmask);
}

__device__ __forceinline__ void moe_cp16(void* dst, const void* src) {
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(uint32_t(__cvta_generic_to_shared(dst))),
      "l"(src)
      : "memory");
}
__device__ __forceinline__ void moe_cp8(void* dst, const void* src) {
  asm volatile(
      "cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(uint32_t(__cvta_generic_to_shared(dst))),
      "l"(src)
      : "memory");
}
__device__ __forceinline__ void moe_cp4(void* dst, const void* src) {
  asm volatile(
      "cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(uint32_t(__cvta_generic_to_shared(dst))),
      "l"(src)
      : "memory");
}

// Builds the plan in shared memory (every thread of the block calls it; blockDim >= kMaxPairs).
// Thread i = pair i, O(P) each. topk reads through L2 (__ldcg): kernel 2 runs this before its
// griddepcontrol.wait. Ends with a barrier.
__device__ __forceinline__ void build_plan(const int* topk_idx, const float* topk_w, int P,
                                           int topk, int E, MoePlan& plan) {
  __shared__ int s_e[kMaxPairs], s_first[kMaxPairs];
  const int i = threadIdx.x;
  int e = -1;
  float w = 0.f;
  if (i < P) {  // both loads in flight together: one L2 round trip, not two
    e = __ldcg(topk_idx + i);
    w = __ldcg(topk_w + i);
    if (e < 0 || e >= E) e = -1;  // invalid ids select nothing
  }
  if (i < kMaxPairs) s_e[i] = e;
  __syncthreads();
  int first = 0;
  if (e >= 0) {
    first = 1;
    for (int j = 0; j < i; ++j) first &= s_e[j] != e;
  }
  if (i < kMaxPairs) s_first[i] = first;
  const int n_unique = __syncthreads_count(first);
  if (e >= 0) {
    int rank = 0, col = 0, count = 0;
    for (int j = 0; j < P; ++j) {
      rank += (s_first[j] && s_e[j] < e) ? 1 : 0;
      col += (j < i && s_e[j] == e) ? 1 : 0;
      count += s_e[j] == e ? 1 : 0;
    }
    SlotPlan& sp = plan.slot[rank];
    sp.pair[col] = i;
    sp.tok[col] = i / topk;
    sp.weight[col] = w;
    if (first) {
      sp.expert = e;
      sp.count = count;
    }
  }
  if (i == 0) plan.n_unique = n_unique;
  __syncthreads();
}

}  // namespace uf::cuda::detail
