// The entry-split indexer's small ops (ops/index_split.h): per-row bookkeeping, no arithmetic on
// scores beyond cpu::candidate_mask's block maximum. Shapes: a row's k (index_topk, 512) times the
// rank count is at most a few thousand pairs, so one CTA a row is plenty.

#include <algorithm>
#include <cmath>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/ops/index_split.h"

namespace uf::cuda {

namespace {

constexpr int kRowThreads = 256;

__device__ __forceinline__ int clamp_range(int v, int64_t begin, int64_t len) {
  return int(min(max(int64_t(v) - begin, int64_t(0)), len));
}

__global__ void range_rows_kernel(const int32_t* vis, const int32_t* width,
                                  const uint16_t* const* keys, int T, PositionRange range,
                                  int head_dim, RangeRows out) {
  detail::pdl_wait();
  detail::pdl_trigger();
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int v = vis[t], w = width[t];
  out.vis[t] = clamp_range(v, range.begin, range.len);
  out.width[t] = clamp_range(w, range.begin, range.len);
  if (out.keys != nullptr) out.keys[t] = keys[t] + range.begin * head_dim;
  if (out.block_size > 0) {
    const int bs = out.block_size;
    out.vis_blocks[t] = (v + bs - 1) / bs;
    out.width_blocks[t] = (w + bs - 1) / bs;
  }
}

__global__ void pack_selection_kernel(const int32_t* sel, int k, const float* score, int64_t stride,
                                      int64_t begin, const int32_t* map, int64_t map_cap,
                                      float* pairs) {
  detail::pdl_wait();
  detail::pdl_trigger();
  const int t = blockIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= k) return;
  const int32_t p = sel[int64_t(t) * k + j];
  float s = -INFINITY;
  int32_t e = -1;
  if (p >= 0) {
    s = score[int64_t(t) * stride + p];
    e = map != nullptr ? map[int64_t(t) * map_cap + begin + p] : int32_t(begin + p);
  }
  float2 v;
  v.x = s;
  v.y = __int_as_float(e);
  reinterpret_cast<float2*>(pairs + int64_t(t) * 2 * k)[j] = v;
}

// One CTA a row: the pairs in order, compacted by a ballot count per warp and a running offset.
__global__ void __launch_bounds__(kRowThreads)
    merge_pairs_kernel(const float* gathered, int n_ranks, int k, int64_t row_stride,
                       int64_t rank_stride, float* score, int32_t* entries, int32_t* n,
                       int64_t cap) {
  detail::pdl_wait();
  detail::pdl_trigger();
  __shared__ int warp_count[kRowThreads / 32];
  __shared__ int base;
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) base = 0;
  __syncthreads();
  const int total = n_ranks * k;
  for (int i0 = 0; i0 < total; i0 += kRowThreads) {
    const int i = i0 + tid;
    float2 v = make_float2(-INFINITY, __int_as_float(-1));
    if (i < total) {
      const int q = i / k, j = i % k;
      v = reinterpret_cast<const float2*>(gathered + int64_t(t) * row_stride +
                                          int64_t(q) * rank_stride)[j];
    }
    const int32_t e = __float_as_int(v.y);
    const bool keep = i < total && e >= 0;
    const unsigned ballot = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    int off = base;
    for (int w = 0; w < warp; ++w) off += warp_count[w];
    off += __popc(ballot & ((1u << lane) - 1u));
    if (keep) {
      score[int64_t(t) * cap + off] = v.x;
      entries[int64_t(t) * cap + off] = e;
    }
    __syncthreads();  // every thread has read base and warp_count
    if (tid == 0) {
      int sum = 0;
      for (int w = 0; w < kRowThreads / 32; ++w) sum += warp_count[w];
      base += sum;
    }
    __syncthreads();
  }
  if (tid == 0) n[t] = base;
}

__global__ void block_max_kernel(const float* score, int64_t stride, const int32_t* width, int bs,
                                 int64_t n_blocks, float* bmax) {
  detail::pdl_wait();
  detail::pdl_trigger();
  const int t = blockIdx.y;
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= n_blocks) return;
  const int64_t w = width[t];
  const float* row = score + int64_t(t) * stride;
  float m = -INFINITY;
  for (int64_t i = b * bs; i < min(w, (b + 1) * bs); ++i) m = fmaxf(m, row[i]);
  bmax[int64_t(t) * n_blocks + b] = m;
}

__global__ void expand_blocks_kernel(const int32_t* blocks, const int32_t* n_blocks,
                                     int64_t block_cap, int bs, const int32_t* vis,
                                     int32_t* entries, int32_t* n, int64_t cap) {
  detail::pdl_wait();
  detail::pdl_trigger();
  const int t = blockIdx.x;
  const int nb = n_blocks[t], v = vis[t];
  const int32_t* row = blocks + int64_t(t) * block_cap;
  int32_t* out = entries + int64_t(t) * cap;
  for (int i = threadIdx.x; i < nb * bs; i += blockDim.x) {
    const int32_t b = row[i / bs];
    const int64_t e = int64_t(b) * bs + i % bs;
    out[i] = b >= 0 && e < v ? int32_t(e) : -1;
  }
  if (threadIdx.x == 0) n[t] = nb > 0 ? (nb - 1) * bs + (v - row[nb - 1] * bs) : 0;
}

}  // namespace

void index_range_rows(const int32_t* vis, const int32_t* width, const uint16_t* const* keys, int T,
                      PositionRange range, int head_dim, const RangeRows& out,
                      cudaStream_t stream) {
  require(out.vis && out.width && (out.block_size == 0 || (out.vis_blocks && out.width_blocks)),
          "index_range_rows: missing outputs");
  require(out.keys == nullptr || keys != nullptr, "index_range_rows: keys_l without keys");
  if (T <= 0) return;
  detail::launch_pdl(range_rows_kernel, dim3(unsigned((T + 127) / 128)), dim3(128), 0, stream, vis,
                     width, keys, T, range, head_dim, out);
  UF_CUDA_CHECK(cudaGetLastError());
}

void index_pack_selection(const int32_t* sel, int T, int k, const float* score, int64_t stride,
                          int64_t begin, const int32_t* map, int64_t map_cap, float* pairs,
                          cudaStream_t stream) {
  require(T >= 0 && T <= 65535 && k >= 0, "index_pack_selection: T=%d k=%d", T, k);
  if (T == 0 || k == 0) return;
  detail::launch_pdl(pack_selection_kernel, dim3(unsigned((k + 127) / 128), unsigned(T)), dim3(128),
                     0, stream, sel, k, score, stride, begin, map, map_cap, pairs);
  UF_CUDA_CHECK(cudaGetLastError());
}

void index_merge_pairs(const float* gathered, int T, int n_ranks, int k, int64_t row_stride,
                       int64_t rank_stride, float* score, int32_t* entries, int32_t* n, int64_t cap,
                       cudaStream_t stream) {
  require(T >= 0 && n_ranks >= 1 && k >= 0 && cap >= int64_t(n_ranks) * k && row_stride % 2 == 0 &&
              rank_stride % 2 == 0,
          "index_merge_pairs: T=%d ranks=%d k=%d cap=%lld", T, n_ranks, k, (long long)cap);
  if (T == 0) return;
  detail::launch_pdl(merge_pairs_kernel, dim3(unsigned(T)), dim3(kRowThreads), 0, stream, gathered,
                     n_ranks, k, row_stride, rank_stride, score, entries, n, cap);
  UF_CUDA_CHECK(cudaGetLastError());
}

void index_block_max(const float* score, int T, int64_t stride, const int32_t* width,
                     int block_size, int64_t n_blocks, float* bmax, cudaStream_t stream) {
  require(T >= 0 && T <= 65535 && block_size >= 1 && n_blocks >= 0,
          "index_block_max: T=%d block_size=%d", T, block_size);
  if (T == 0 || n_blocks == 0) return;
  const dim3 grid(unsigned((n_blocks + kRowThreads - 1) / kRowThreads), unsigned(T));
  detail::launch_pdl(block_max_kernel, grid, dim3(kRowThreads), 0, stream, score, stride, width,
                     block_size, n_blocks, bmax);
  UF_CUDA_CHECK(cudaGetLastError());
}

void index_expand_blocks(const int32_t* blocks, const int32_t* n_blocks, int64_t block_cap, int T,
                         int block_size, const int32_t* vis, int32_t* entries, int32_t* n,
                         int64_t cap, cudaStream_t stream) {
  // (The caller's cap holds every row's blocks: candidate_mask's own list needs the same.)
  require(T >= 0 && block_size >= 1 && block_cap >= 1 && cap >= block_size,
          "index_expand_blocks: T=%d block_size=%d block_cap=%lld cap=%lld", T, block_size,
          (long long)block_cap, (long long)cap);
  if (T == 0) return;
  detail::launch_pdl(expand_blocks_kernel, dim3(unsigned(T)), dim3(kRowThreads), 0, stream, blocks,
                     n_blocks, block_cap, block_size, vis, entries, n, cap);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
