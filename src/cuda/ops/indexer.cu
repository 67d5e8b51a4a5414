// The sparse indexer on the device (ops/attention.h): index_scores, candidate_mask, mask_scores,
// topk_select, twins of cpu/indexer.cpp.
//
// index_scores: grid (ceil(max_width / 64), T), 64 threads, one thread per key entry. The block
// stages its 64 key rows in shared memory (row stride head_dim + 1: conflict-free reads); q and
// w are read through the read-only cache (every thread of a warp reads the same address). Per
// head the dot product follows cpu dot_f32 (dot8) exactly: lane L = i mod 8 partial sums in
// increasing i, combined ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)); then bf16, relu, * w_h, bf16,
// summed over heads in order, bf16. Everything uses __fmul_rn / __fadd_rn (no FMA contraction,
// as uf_cpu's -ffp-contract=off), so scores are bitwise equal to the CPU's.
//
// candidate_mask / topk_select: one block of kSelThreads threads per row; no scratch memory.
// Both select the best kk of n keys with ties broken by the lower index:
//  1. radix select (4 passes of 8 bits over an order-preserving uint32 key of the float, -0
//     folded onto +0 because the CPU compares values, not bits): finds the kk-th largest key K
//     and `need`, how many keys equal to K are taken (the lowest-indexed ones);
//  2. one ordered compaction pass in chunks of kSelThreads: a block prefix sum over (key > K,
//     key == K) gives every selected index its output slot, so the output is ascending by index.
// candidate_mask's keys are block maxima recomputed from the scores on the fly (block_size reads
// per key; 2048 x 8 at width 262144 is 32768 keys per row), the block of compress_len - 1 pinned
// to +inf. Work per row is O(width); a row never reads another row (spec == plain).

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/ops/attention.h"

namespace uf::cuda {
namespace {

constexpr int kEnt = 64;               // index_scores: entries per block
constexpr int kMaxIndexHeadDim = 160;  // 64 x (hd + 1) floats must fit the 48 KiB default
constexpr int kSelThreads = 512;
constexpr int kMaskThreads = 256;

// ---- index_scores ----

__global__ void __launch_bounds__(kEnt)
    index_scores_kernel(const float* __restrict__ q, const float* __restrict__ w, int n_heads,
                        int hd, const float* const* keys, const int32_t* __restrict__ vis,
                        const int32_t* __restrict__ width, int max_width, float* score) {
  extern __shared__ float ks[];  // [kEnt][hd + 1]
  const int t = blockIdx.y, e0 = blockIdx.x * kEnt, tid = threadIdx.x;
  const int wd = width[t];
  if (e0 >= wd) return;
  const int nv = min(vis[t], wd);
  const int n_load = max(0, min(kEnt, nv - e0));
  if (n_load > 0) {
    // Eight loads in flight before their shared-memory stores (a load per store serialises on
    // memory latency: 128 round trips per thread).
    const float* kb = keys[t] + int64_t(e0) * hd;
    const int total = n_load * hd;
    int idx = tid;
    for (; idx + 7 * kEnt < total; idx += 8 * kEnt) {
      float v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = kb[idx + u * kEnt];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int i = idx + u * kEnt, e = i / hd;
        ks[e * (hd + 1) + (i - e * hd)] = v[u];
      }
    }
    for (; idx < total; idx += kEnt) {
      const int e = idx / hd, d = idx - e * hd;
      ks[e * (hd + 1) + d] = kb[int64_t(e) * hd + d];
    }
  }
  __syncthreads();
  const int i = e0 + tid;
  float* out = score + int64_t(t) * max_width;
  if (i < nv) {
    const float* qt = q + int64_t(t) * n_heads * hd;
    const float* wt = w + int64_t(t) * n_heads;
    const float* kr = ks + tid * (hd + 1);
    float s = 0.f;
    for (int h = 0; h < n_heads; ++h) {
      const float* qh = qt + int64_t(h) * hd;
      float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int i0 = 0; i0 < hd; i0 += 8) {
#pragma unroll
        for (int L = 0; L < 8; ++L)
          if (i0 + L < hd) p[L] = __fadd_rn(p[L], __fmul_rn(__ldg(qh + i0 + L), kr[i0 + L]));
      }
      const float dot = __fadd_rn(__fadd_rn(__fadd_rn(p[0], p[1]), __fadd_rn(p[2], p[3])),
                                  __fadd_rn(__fadd_rn(p[4], p[5]), __fadd_rn(p[6], p[7])));
      const float d = detail::round_bf16(dot);
      const float r = d < 0.f ? 0.f : d;  // std::max(d, 0.0f)
      s = __fadd_rn(s, detail::round_bf16(__fmul_rn(r, __ldg(wt + h))));
    }
    out[i] = detail::round_bf16(s);
  } else if (i < wd) {
    out[i] = -INFINITY;
  }
}

// ---- block-wide selection helpers ----

// Order-preserving key: larger float -> larger key; -0 and +0 map to the same key.
__device__ __forceinline__ uint32_t order_key(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u << 1) == 0) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
constexpr uint32_t kNegInfKey = ~0xff800000u;  // order_key(-inf)

struct SelShared {
  uint32_t hist[256];
  uint32_t warp_sums[kSelThreads / 32];
  uint32_t bcast[2];
};

// Exclusive block prefix sum of v (all kSelThreads threads call it); *total gets the sum.
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t v, SelShared& sh,
                                                         uint32_t* total) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  constexpr int kWarps = kSelThreads / 32;
  uint32_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) sh.warp_sums[wid] = x;
  __syncthreads();
  if (wid == 0) {
    uint32_t ws = lane < kWarps ? sh.warp_sums[lane] : 0u;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t y = __shfl_up_sync(0xffffffffu, ws, o);
      if (lane >= o) ws += y;
    }
    if (lane < kWarps) sh.warp_sums[lane] = ws;  // inclusive
  }
  __syncthreads();
  const uint32_t base = wid > 0 ? sh.warp_sums[wid - 1] : 0u;
  *total = sh.warp_sums[kWarps - 1];
  __syncthreads();  // warp_sums is rewritten by the next call
  return base + x - v;
}

// The kk-th largest of key(0..n) (1 <= kk <= n): *kth = that key, *need = how many keys equal
// to it belong to the best kk (the rest of the best kk are strictly greater).
template <class Key>
__device__ void radix_select(const Key& key, int n, int kk, SelShared& sh, uint32_t* kth,
                             uint32_t* need) {
  const int tid = threadIdx.x, lane = tid & 31;
  uint32_t prefix = 0, mask = 0, rem = uint32_t(kk);
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += kSelThreads) sh.hist[b] = 0;
    __syncthreads();
    for (int i0 = 0; i0 < n; i0 += kSelThreads) {
      const int i = i0 + tid;
      uint32_t u = 0;
      bool ok = false;
      if (i < n) {
        u = key(i);
        ok = (u & mask) == prefix;
      }
      const uint32_t act = __ballot_sync(0xffffffffu, ok);
      if (ok) {
        // Aggregate equal digits within the warp: ties make many keys share one bin.
        const uint32_t bin = (u >> shift) & 255u;
        const uint32_t same = __match_any_sync(act, bin);
        if (lane == __ffs(same) - 1) atomicAdd(&sh.hist[bin], uint32_t(__popc(same)));
      }
    }
    __syncthreads();
    if (tid == 0) {
      uint32_t cum = 0;
      int digit = 0;
      for (int d = 255; d >= 0; --d) {
        const uint32_t c = sh.hist[d];
        if (cum + c >= rem) {
          digit = d;
          break;
        }
        cum += c;
      }
      sh.bcast[0] = prefix | (uint32_t(digit) << shift);
      sh.bcast[1] = rem - cum;
    }
    __syncthreads();
    prefix = sh.bcast[0];
    rem = sh.bcast[1];
    mask |= 255u << shift;
  }
  *kth = prefix;
  *need = rem;
}

// Walks key(0..n) in index order; emit(i, selected, slot, key) for every i < n, where slot is
// the output position of a selected index (ascending). Stops early once kk are out when
// stop_when_full (the rest would all be unselected).
template <class Key, class Emit>
__device__ void ordered_compact(const Key& key, int n, int kk, uint32_t kth, uint32_t need,
                                bool stop_when_full, SelShared& sh, const Emit& emit) {
  uint32_t base = 0, eq_seen = 0;
  for (int i0 = 0; i0 < n; i0 += kSelThreads) {
    if (stop_when_full && base >= uint32_t(kk)) break;
    const int i = i0 + threadIdx.x;
    const uint32_t u = i < n ? key(i) : 0u;
    const bool gt = i < n && u > kth, eq = i < n && u == kth;
    uint32_t total = 0;
    const uint32_t ex =
        block_exclusive_scan((uint32_t(gt) << 16) | uint32_t(eq), sh, &total);  // <= 512 each
    const uint32_t rem = need > eq_seen ? need - eq_seen : 0u;
    const uint32_t gt_before = ex >> 16, eq_before = ex & 0xffffu;
    const bool sel = gt || (eq && eq_before < rem);
    if (i < n) emit(i, sel, base + gt_before + min(eq_before, rem), u);
    base += (total >> 16) + min(total & 0xffffu, rem);
    eq_seen += total & 0xffffu;
  }
}

// ---- topk_select ----

struct ScoreKey {
  const float* s;
  __device__ uint32_t operator()(int i) const { return order_key(s[i]); }
};

__global__ void __launch_bounds__(kSelThreads)
    topk_select_kernel(const float* __restrict__ score, int max_width,
                       const int32_t* __restrict__ width, int k, const int32_t* __restrict__ vis,
                       int32_t* __restrict__ out) {
  __shared__ SelShared sh;
  const int t = blockIdx.x;
  const int wd = width[t], cl = vis[t];
  const int kk = min(k, wd);
  int32_t* o = out + int64_t(t) * k;
  if (kk > 0) {
    const ScoreKey key{score + int64_t(t) * max_width};
    uint32_t kth = 0, need = 0;
    radix_select(key, wd, kk, sh, &kth, &need);
    ordered_compact(key, wd, kk, kth, need, true, sh,
                    [&](int i, bool sel, uint32_t slot, uint32_t) {
                      if (sel) o[slot] = i < cl ? i : -1;
                    });
  }
  for (int j = max(kk, 0) + threadIdx.x; j < k; j += kSelThreads) o[j] = -1;
}

// ---- candidate_mask ----

struct BlockMaxKey {
  const float* s;
  int width, block_size, pinned;  // pinned = -1 when compress_len == 0
  __device__ uint32_t operator()(int b) const {
    if (b == pinned) return order_key(INFINITY);
    float m = -INFINITY;
    const int lo = b * block_size, hi = min(width, lo + block_size);
    for (int i = lo; i < hi; ++i) {
      const float v = s[i];
      m = m < v ? v : m;  // std::max(m, v)
    }
    return order_key(m);
  }
};

__global__ void __launch_bounds__(kSelThreads)
    candidate_mask_kernel(const float* __restrict__ score, int max_width,
                          const int32_t* __restrict__ width, const int32_t* __restrict__ vis,
                          int topk_blocks, int block_size, uint8_t* __restrict__ keep) {
  __shared__ SelShared sh;
  const int t = blockIdx.x;
  const int wd = width[t], cl = vis[t];
  if (wd <= 0) return;
  const int nb = (wd + block_size - 1) / block_size;
  const int kk = min(topk_blocks, nb);
  const BlockMaxKey key{score + int64_t(t) * max_width, wd, block_size,
                        cl > 0 ? (cl - 1) / block_size : -1};
  uint8_t* kp = keep + int64_t(t) * max_width;
  const auto emit = [&](int b, bool sel, uint32_t, uint32_t u) {
    const uint8_t v = sel && u > kNegInfKey ? 1 : 0;  // kept only with a finite block score
    const int lo = b * block_size, hi = min(wd, lo + block_size);
    for (int i = lo; i < hi; ++i) kp[i] = v;
  };
  if (kk <= 0) {
    for (int b = threadIdx.x; b < nb; b += kSelThreads) emit(b, false, 0, 0);
    return;
  }
  uint32_t kth = 0, need = 0;
  radix_select(key, nb, kk, sh, &kth, &need);
  ordered_compact(key, nb, kk, kth, need, false, sh, emit);
}

// ---- mask_scores ----

__global__ void mask_scores_kernel(float* score, const uint8_t* __restrict__ keep, int max_width,
                                   const int32_t* __restrict__ width) {
  const int t = blockIdx.y;
  const int i = blockIdx.x * kMaskThreads + threadIdx.x;
  if (i >= width[t]) return;
  const int64_t o = int64_t(t) * max_width + i;
  if (!keep[o]) score[o] = -INFINITY;
}

}  // namespace

void index_scores(const float* q, const float* w, int T, int n_heads, int head_dim,
                  const float* const* keys, const int32_t* vis, const int32_t* width, int max_width,
                  float* score, cudaStream_t stream) {
  require(T >= 0 && T <= 65535 && n_heads > 0 && head_dim > 0 && head_dim <= kMaxIndexHeadDim &&
              max_width >= 0,
          "index_scores: unsupported shape T=%d n_heads=%d head_dim=%d max_width=%d "
          "(T <= 65535, head_dim <= %d)",
          T, n_heads, head_dim, max_width, kMaxIndexHeadDim);
  if (T == 0 || max_width == 0) return;
  const dim3 grid(unsigned((max_width + kEnt - 1) / kEnt), unsigned(T));
  const size_t smem = size_t(kEnt) * size_t(head_dim + 1) * sizeof(float);
  index_scores_kernel<<<grid, kEnt, smem, stream>>>(q, w, n_heads, head_dim, keys, vis, width,
                                                    max_width, score);
  UF_CUDA_CHECK(cudaGetLastError());
}

void candidate_mask(const float* score, int T, int max_width, const int32_t* width,
                    const int32_t* vis, int topk_blocks, int block_size, uint8_t* keep,
                    cudaStream_t stream) {
  require(T >= 0 && max_width >= 0 && block_size > 0,
          "candidate_mask: unsupported T=%d max_width=%d block_size=%d", T, max_width, block_size);
  if (T == 0 || max_width == 0) return;
  candidate_mask_kernel<<<unsigned(T), kSelThreads, 0, stream>>>(score, max_width, width, vis,
                                                                 topk_blocks, block_size, keep);
  UF_CUDA_CHECK(cudaGetLastError());
}

void mask_scores(float* score, const uint8_t* keep, int T, int max_width, const int32_t* width,
                 cudaStream_t stream) {
  require(T >= 0 && T <= 65535 && max_width >= 0,
          "mask_scores: unsupported T=%d max_width=%d (T <= 65535)", T, max_width);
  if (T == 0 || max_width == 0) return;
  const dim3 grid(unsigned((max_width + kMaskThreads - 1) / kMaskThreads), unsigned(T));
  mask_scores_kernel<<<grid, kMaskThreads, 0, stream>>>(score, keep, max_width, width);
  UF_CUDA_CHECK(cudaGetLastError());
}

void topk_select(const float* score, int T, int max_width, const int32_t* width, int k,
                 const int32_t* vis, int32_t* out, cudaStream_t stream) {
  require(T >= 0 && max_width >= 0 && k >= 0, "topk_select: unsupported T=%d max_width=%d k=%d", T,
          max_width, k);
  if (T == 0 || k == 0) return;
  topk_select_kernel<<<unsigned(T), kSelThreads, 0, stream>>>(score, max_width, width, k, vis, out);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
