// The transform of src/cuda/verify.h over a thread-block cluster (the default): a row over the
// kC = 16 (or 8) CTAs of a cluster; verify_transform.cu's single-CTA kernels stay as the fallback
// for vocabularies whose slice does not fit in shared memory, for many-row top-p launches
// (transform_cluster below), and for the benchmark's comparison.
//
// CTA r of the cluster owns lanes [r kC', (r + 1) kC') of row_ops.h (kC' = 256 / kC), i.e. the
// contiguous elements [r kC' chunk, (r + 1) kC' chunk) of the row, and keeps them in shared
// memory from the load to the final store (the row is read once and written once). Order-free
// steps (max, argmax, counts, radix histograms, min / max bits) combine the CTAs' partials
// through distributed shared memory in any order; each lane's serial sum stays in one thread of
// the CTA owning it, and every CTA gathers the 256 lane sums and runs the same pairwise tree
// (same bits everywhere, no broadcast needed). The top-p candidates are compacted by every CTA
// into the scratch (a counter in rank 0's shared memory); rank 0 alone sorts and walks them, as
// the single-CTA code does (verify_select.cuh's steps). The probs row in global memory is written
// only at the end, so the sort may use it as its second buffer without a recompute.

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>

#include "cuda/cuda_check.h"
#include "cuda/kernels/verify_common.cuh"
#include "cuda/kernels/verify_select.cuh"
#include "cuda/verify.h"

namespace uf::cuda::verify_detail {
namespace {

namespace cg = cooperative_groups;

template <int kC>
struct ClusterShared {
  static constexpr int kCL = kLanes / kC;  // lanes per CTA
  float lsum[3][kCL];                      // this CTA's lane sums (one slot per use)
  int llast[3][kCL];                       // and the last positive index of each lane
  float lane_all[kLanes];                  // the gathered lane sums
  int last_all[kLanes];
  float tree[kLanes];
  int hist[2][256];  // radix select: this CTA's digit counts (double-buffered by pass)
  int hist_all[256];
  ArgMax am;
  float fmax;
  int count;         // survivors of top-k in this CTA
  int ccount[2];     // rank 0: top-p candidates compacted (per attempt)
  unsigned umin[2];  // rank 0: smallest candidate bits (per attempt)
  unsigned umax;     // this CTA's largest survivor bits
  unsigned t;        // rank 0: the candidate threshold
  unsigned top;      // rank 0: the largest survivor bits of the row
  float cut;         // rank 0: the walk's result
  int done;
  int sel_digit;
  int sel_before;
};

// The first element of rank's slice of the row (clamped to vocab).
template <int kC>
__device__ __forceinline__ int slice_begin(int vocab, int rank) {
  const int chunk = (vocab + kLanes - 1) / kLanes;
  return min(vocab, rank * ClusterShared<kC>::kCL * chunk);
}

// Pairwise tree of row_ops.h over lane sums lsum[slot] of every CTA (whole cluster; returns the
// same total in every thread of every CTA). weight(i) is the weight of local element i (the
// CTA's slice starts at lane rank kCL). lane_all[] / last_all[] receive each lane's sum and last
// positive index (-1 if none).
template <int kC, typename Weight>
__device__ float cluster_lane_total(const Weight& weight, int vocab, int rank, int lo, int slot,
                                    ClusterShared<kC>& sh) {
  constexpr int kCL = ClusterShared<kC>::kCL;
  const int tid = threadIdx.x;
  const int chunk = (vocab + kLanes - 1) / kLanes;
  if (tid < kCL) {
    const int lane = rank * kCL + tid;
    const int begin = lane * chunk;
    const int end = begin + chunk < vocab ? begin + chunk : vocab;
    int last;
    const float s = chunk_sum<8>([&](int x) { return weight(x - lo); }, begin, end, &last);
    sh.lsum[slot][tid] = s;
    sh.llast[slot][tid] = last;
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every CTA's lane sums are in its shared memory
  if (tid < kLanes) {
    const int r = tid / kCL, i = tid % kCL;
    const float s = cluster.map_shared_rank(&sh.lsum[slot][0], r)[i];
    sh.lane_all[tid] = s;
    sh.tree[tid] = s;
    sh.last_all[tid] = cluster.map_shared_rank(&sh.llast[slot][0], r)[i];
  }
  __syncthreads();
  return tree_total(sh.tree);
}

// The k-th largest bits of the row (verify_select.cuh's radix select, the histograms summed over
// the cluster). e: this CTA's slice of len values.
template <int kC>
__device__ uint32_t cluster_kth_largest_bits(const float* e, int len, int k,
                                             ClusterShared<kC>& sh) {
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, nt = blockDim.x;
  uint32_t prefix = 0;
  int kk = k;
  int buf = 0;
  for (int shift = 24; shift >= 0; shift -= 8, buf ^= 1) {
    digit_histogram(e, len, prefix, shift, sh.hist[buf]);
    // The other buffer was last read before this barrier's previous instance: safe to reuse
    // next pass.
    cluster.sync();
    for (int i = tid; i < 256; i += nt) {
      int h = 0;
      for (int r = 0; r < kC; ++r) h += cluster.map_shared_rank(&sh.hist[buf][0], r)[i];
      sh.hist_all[i] = h;
    }
    __syncthreads();
    select_digit(sh.hist_all, shift, &sh.sel_digit, &sh.sel_before, prefix, kk);
  }
  return prefix;
}

// The top-p cut over the cluster (verify_select.cuh's steps): the coarse histogram and the
// compaction by every CTA (counters in rank 0's shared memory, one set per attempt), the sort
// and the walk by rank 0. p: the global probs row (free: only the sort's second buffer).
template <int kC>
__device__ float cluster_top_p_cut(const float* e, int len, int rank, float* p, float kcut, int n,
                                   float limit, float* s, int cap, ClusterShared<kC>& sh,
                                   SortShared& ss) {
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, nt = blockDim.x;
  const uint32_t kbits = __float_as_uint(kcut);
  coarse_histogram(e, len, kcut, ss, &sh.umax, [&] {
    sh.ccount[0] = sh.ccount[1] = 0;
    sh.umin[0] = sh.umin[1] = 0xFFFFFFFFu;
  });
  cluster.sync();  // A: every CTA's histogram and umax are ready; rank 0's counters are zeroed
  // The candidate threshold, by rank 0 (others' ss.coarse is only read until barrier B).
  if (rank == 0) {
    for (int i = tid; i < kCoarseBins; i += nt) {
      int h = ss.coarse[i];
      for (int r = 1; r < kC; ++r) h += cluster.map_shared_rank(&ss.coarse[0], r)[i];
      ss.coarse[i] = h;
    }
    if (tid == 0) {
      unsigned u = 0;
      for (int r = 0; r < kC; ++r) u = max(u, *cluster.map_shared_rank(&sh.umax, r));
      sh.top = u;
    }
    __syncthreads();
    if (tid < 32) candidate_threshold(ss, limit, kbits, &sh.top, &sh.t);
  }
  cluster.sync();  // B: the threshold is in rank 0
  uint32_t t = *cluster.map_shared_rank(&sh.t, 0);
  int* counter = cluster.map_shared_rank(&sh.ccount[0], 0);
  unsigned* umin = cluster.map_shared_rank(&sh.umin[0], 0);
  for (int attempt = 0;; ++attempt) {
    const bool final = t == kbits;
    compact_candidates(e, len, kcut, t, s, &counter[attempt], &umin[attempt]);
    cluster.sync();  // C: the candidates are in s (release / acquire at cluster scope)
    if (rank == 0) {
      (void)sort_and_walk(s, sh.ccount[attempt], cap, p, sh.top, sh.umin[attempt], n, kcut, limit,
                          final, ss);
      __syncthreads();
      if (tid == 0) {
        sh.cut = ss.cut;
        sh.done = ss.done;
      }
    }
    cluster.sync();  // D: the walk's result is in rank 0
    const float cut = *cluster.map_shared_rank(&sh.cut, 0);
    const int done = *cluster.map_shared_rank(&sh.done, 0);
    if (done || attempt == 1) return cut;
    t = kbits;  // take every survivor
  }
}

// transform_row (verify_transform.cu) over the cluster of the calling CTA. e: this CTA's slice
// in shared memory (kCL * ceil(vocab / 256) floats). bias (may be null): added to the logits,
// which are written back (the draft slot). Writes p[] for this CTA's slice and leaves the final
// values in e. Returns the greedy argmax when temperature == 0, else -1.
template <int kC>
__device__ int cluster_transform_row(float* l, const float* bias, int vocab, float temperature,
                                     float top_p, int top_k, float* p, float* s, int cap, float* e,
                                     ClusterShared<kC>& sh, SortShared& ss, ArgMax* s_warp) {
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, nt = blockDim.x;
  const int rank = int(cluster.block_rank());
  const int lo = slice_begin<kC>(vocab, rank);
  const int hi = slice_begin<kC>(vocab, rank + 1);
  const int len = hi - lo;

  for (int i = tid; i < len; i += nt) {
    float v = l[lo + i];
    if (bias != nullptr) {
      v = __fadd_rn(v, bias[lo + i]);
      l[lo + i] = v;
    }
    e[i] = v;
  }
  // (block_argmax starts with a __syncthreads: e is complete before it is read below)

  if (temperature == 0.0f) {  // greedy: one-hot on the argmax, lowest index on ties
    __syncthreads();
    ArgMax a{-INFINITY, INT_MAX};
    for (int i = tid; i < len; i += nt) a = better(a, ArgMax{e[i], lo + i});
    a = block_argmax(a, s_warp);
    if (tid == 0) sh.am = a;
    cluster.sync();
    // One remote load a lane (lane r reads rank r), then the warp's reduction.
    ArgMax b{-INFINITY, INT_MAX};
    if ((tid & 31) < kC) b = *cluster.map_shared_rank(&sh.am, tid & 31);
    b = warp_argmax(b);
    const int best = b.i == INT_MAX ? 0 : b.i;  // all -inf: the CPU keeps index 0
    for (int i = tid; i < len; i += nt) {
      e[i] = lo + i == best ? 1.0f : 0.0f;
      p[lo + i] = e[i];
    }
    return best;
  }

  __syncthreads();
  ArgMax mx{-INFINITY, 0};
  for (int i = tid; i < len; i += nt) mx.v = fmaxf(mx.v, e[i]);
  mx = block_argmax(mx, s_warp);
  if (tid == 0) sh.fmax = mx.v;
  cluster.sync();
  float m = (tid & 31) < kC ? *cluster.map_shared_rank(&sh.fmax, tid & 31) : -INFINITY;
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  for (int i = tid; i < len; i += nt)
    e[i] = exp_rounded(__fdiv_rn(__fsub_rn(e[i], m), temperature));
  __syncthreads();

  const bool use_k = top_k > 0 && top_k < vocab;
  const bool use_p = top_p < 1.0f;
  if (use_k || use_p) {
    float cut = 0.0f;
    int n = vocab;
    if (use_k) {
      cut = __uint_as_float(cluster_kth_largest_bits<kC>(e, len, top_k, sh));
      if (use_p) {
        const uint32_t cb = __float_as_uint(cut);
        int c = 0;
        for (int i = tid; i < len; i += nt) c += __float_as_uint(e[i]) >= cb ? 1 : 0;
        c = __reduce_add_sync(0xffffffffu, c);
        if (tid == 0) sh.count = 0;
        __syncthreads();
        if ((tid & 31) == 0) atomicAdd(&sh.count, c);
        cluster.sync();
        n = __reduce_add_sync(0xffffffffu,
                              (tid & 31) < kC ? *cluster.map_shared_rank(&sh.count, tid & 31) : 0);
      }
    }
    if (use_p) {
      const float kcut = cut;
      const float zk = cluster_lane_total<kC>([=](int i) { return e[i] >= kcut ? e[i] : 0.0f; },
                                              vocab, rank, lo, 0, sh);
      const float limit = __fmul_rn(top_p, zk);
      cut = cluster_top_p_cut<kC>(e, len, rank, p, kcut, n, limit, s, cap, sh, ss);
    }
    for (int i = tid; i < len; i += nt) {
      if (!(e[i] >= cut)) e[i] = 0.0f;
    }
    __syncthreads();
  }
  const float z = cluster_lane_total<kC>([=](int i) { return e[i]; }, vocab, rank, lo, 1, sh);
  for (int i = tid; i < len; i += nt) {
    const float v = __fdiv_rn(e[i], z);
    e[i] = v;
    p[lo + i] = v;
  }
  return -1;
}

template <int kC>
__global__ void __launch_bounds__(kTransformThreads)
    cluster_transform_kernel(const float* logits, int vocab, float temperature, float top_p,
                             int top_k, float* probs, float* sort_scratch, int sort_stride) {
  __shared__ ClusterShared<kC> sh;
  __shared__ SortShared ss;
  __shared__ ArgMax s_warp[32];
  extern __shared__ float e_slice[];
  const size_t row = blockIdx.x / kC;
  cluster_transform_row<kC>(const_cast<float*>(logits) + row * vocab, nullptr, vocab, temperature,
                            top_p, top_k, probs + row * vocab, sort_scratch + row * sort_stride,
                            sort_stride, e_slice, sh, ss, s_warp);
  cg::this_cluster().sync();  // no CTA leaves while others read its shared memory
}

// draft_slot_kernel over a cluster: the pick walks the gathered lane sums in every CTA (same
// data, same result); the CTA owning the chunk that holds the target walks inside it and writes
// the token.
template <int kC>
__global__ void __launch_bounds__(kTransformThreads)
    cluster_draft_slot_kernel(float* logits, const float* bias, int vocab,
                              const DeviceSamplingParams* params, const float* u, float* probs,
                              float* sort_scratch, int cap, int32_t* token, int32_t* prev) {
  __shared__ ClusterShared<kC> sh;
  __shared__ SortShared ss;
  __shared__ ArgMax s_warp[32];
  __shared__ int s_pick;
  extern __shared__ float e_slice[];
  constexpr int kCL = ClusterShared<kC>::kCL;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const DeviceSamplingParams prm = *params;
  const int best =
      cluster_transform_row<kC>(logits, bias, vocab, prm.temperature, prm.top_p, prm.top_k, probs,
                                sort_scratch, cap, e_slice, sh, ss, s_warp);
  __syncthreads();
  const int lo = slice_begin<kC>(vocab, rank);
  int writer = 0;  // the rank that writes the token
  int32_t t = best;
  if (prm.temperature != 0.0f) {
    const float total =
        cluster_lane_total<kC>([=](int i) { return e_slice[i]; }, vocab, rank, lo, 2, sh);
    if (threadIdx.x == 0) {
      // row_ops.h's inverse_cdf_pick over the gathered lane sums (block_inverse_cdf_pick's walk)
      int32_t pick = -1;
      if (total > 0.0f) {
        int in_lane;
        pick = cdf_pick(
            sh.lane_all, sh.last_all, [&](int x) { return e_slice[x - lo]; }, vocab,
            __fmul_rn(*u, total), &in_lane, [&](int lane) { return lane / kCL == rank; });
        if (in_lane >= 0) writer = in_lane / kCL;
      }
      s_pick = pick;
      sh.sel_digit = writer;
    }
    __syncthreads();
    t = s_pick;
    writer = sh.sel_digit;
  }
  if (threadIdx.x == 0 && rank == writer) store_draft_token(t, vocab, token, prev);
  cluster.sync();  // no CTA leaves while others read its shared memory
}

bool g_single_cta = false;  // set_single_cta_transform_for_bench

// The cluster kernels keep a row's slice (kLanes / kC lanes of ceil(vocab / 256) values) in
// dynamic shared memory; beyond this the single-CTA kernels run.
constexpr int kMaxSliceBytes = 160 * 1024;
constexpr int kMaxDevices = 64;
int g_cluster_size[kMaxDevices] = {};  // per device: 16 or 8 once set up, 0 before

size_t slice_bytes(int cluster, int vocab) {
  return size_t(kLanes / cluster) * size_t((vocab + kLanes - 1) / kLanes) * sizeof(float);
}

template <int kC>
void set_cluster_attributes() {
  for (const void* k : {reinterpret_cast<const void*>(cluster_transform_kernel<kC>),
                        reinterpret_cast<const void*>(cluster_draft_slot_kernel<kC>)}) {
    UF_CUDA_CHECK(
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSliceBytes));
    if (kC > 8)
      UF_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
}

// A launch of `rows` clusters of `cluster` CTAs (kTransformThreads each); attr: its storage.
cudaLaunchConfig_t cluster_config(int cluster, int rows, size_t smem, cudaStream_t stream,
                                  cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(rows * cluster));
  cfg.blockDim = dim3(kTransformThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

template <typename Kernel, typename... Args>
void launch_cluster(Kernel kernel, int cluster, int rows, size_t smem, cudaStream_t stream,
                    Args... args) {
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = cluster_config(cluster, rows, smem, stream, attr);
  UF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

}  // namespace

// 16 CTAs when a cluster of 16 such CTAs can be resident (H100 / H200: yes), else the portable 8.
// Host-side queries only (no stream work), so it may run during a graph capture; VerifyPlan's
// constructor runs it ahead.
int cluster_size() {
  int dev = 0;
  UF_CUDA_CHECK(cudaGetDevice(&dev));
  require(dev >= 0 && dev < kMaxDevices, "verify: device %d out of range", dev);
  if (g_cluster_size[dev] != 0) return g_cluster_size[dev];
  set_cluster_attributes<8>();
  set_cluster_attributes<16>();
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = cluster_config(16, 1, kMaxSliceBytes, nullptr, attr);
  int clusters = 0;
  const cudaError_t err =
      cudaOccupancyMaxActiveClusters(&clusters, cluster_transform_kernel<16>, &cfg);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: the portable size is used
    clusters = 0;
  }
  g_cluster_size[dev] = clusters >= 1 ? 16 : 8;
  return g_cluster_size[dev];
}

// A top-p cut sorts and walks on one CTA of each cluster while the others wait, so when the
// clusters take more than one wave of SMs the single-CTA kernels win (H200, bench_cuda_verify,
// 15 rows of 129280 at top-p 0.95: 4.6 ms in clusters of 16, 1.8 ms single); without a cut, or
// within a wave, the clusters win (1 row, top-p 0.95: 1.56 against 1.80 ms; 15 rows, no cut: 48
// against 111 us).
int transform_cluster(int vocab, int rows, bool top_p_cut) {
  if (g_single_cta) return 0;
  const int c = cluster_size();
  if (slice_bytes(c, vocab) > size_t(kMaxSliceBytes)) return 0;
  int dev = 0, sms = 0;
  UF_CUDA_CHECK(cudaGetDevice(&dev));
  UF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (top_p_cut && rows * c > sms) return 0;
  return c;
}

void launch_cluster_transform(int cluster, const float* logits, int rows, int vocab,
                              const sampling::SamplingParams& params, float* probs,
                              float* sort_scratch, int sort_stride, cudaStream_t stream) {
  const auto kernel = cluster == 16 ? cluster_transform_kernel<16> : cluster_transform_kernel<8>;
  launch_cluster(kernel, cluster, rows, slice_bytes(cluster, vocab), stream, logits, vocab,
                 params.temperature, params.top_p, int(params.top_k), probs, sort_scratch,
                 sort_stride);
}

void launch_cluster_draft_slot(int cluster, float* logits, const float* bias, int vocab,
                               const DeviceSamplingParams* params, const float* u, float* probs,
                               float* sort_scratch, int32_t* token, int32_t* prev,
                               cudaStream_t stream) {
  const auto kernel = cluster == 16 ? cluster_draft_slot_kernel<16> : cluster_draft_slot_kernel<8>;
  launch_cluster(kernel, cluster, 1, slice_bytes(cluster, vocab), stream, logits, bias, vocab,
                 params, u, probs, sort_scratch, next_pow2(vocab), token, prev);
}

}  // namespace uf::cuda::verify_detail

namespace uf::cuda {

void set_single_cta_transform_for_bench(bool single) { verify_detail::g_single_cta = single; }

}  // namespace uf::cuda
