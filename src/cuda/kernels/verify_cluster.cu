// The transform of src/cuda/verify.h over a thread-block cluster (the default): a row over the
// kC = 16 (or 8) CTAs of a cluster; verify_transform.cu's single-CTA kernels stay as the fallback
// for vocabularies whose slice does not fit in shared memory (transform_cluster below) and for the
// benchmark's comparison.
//
// CTA r of the cluster owns lanes [r kC', (r + 1) kC') of row_ops.h (kC' = 256 / kC), i.e. the
// contiguous elements [r kC' chunk, (r + 1) kC' chunk) of the row, and keeps them in shared
// memory from the load to the final store (the row is read once and written once). Order-free
// steps (max, argmax, counts, radix histograms, min / max bits) combine the CTAs' partials
// through distributed shared memory in any order; each lane's serial sum stays in one thread of
// the CTA owning it, and every CTA gathers the 256 lane sums and runs the same pairwise tree
// (same bits everywhere, no broadcast needed). The top-p cut is verify_select.cuh's radix select
// weighted by integer mass, each CTA's digit masses summed over the cluster (exact in any order)
// and the digit chosen by every CTA alike.

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
  int hist[2][256];  // top-k: this CTA's digit counts (double-buffered by pass)
  int hist_all[256];
  unsigned long long mass[2][kBins];  // top-p: this CTA's digit masses (likewise)
  ArgMax am;
  float fmax;
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
__device__ uint32_t cluster_kth_largest_bits(const float* e, int len, int k, WarpHists wh,
                                             ClusterShared<kC>& sh) {
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, nt = blockDim.x;
  uint32_t prefix = 0;
  int kk = k;
  int buf = 0;
  for (int shift = 24; shift >= 0; shift -= 8, buf ^= 1) {
    digit_histogram(e, len, prefix, shift, wh, sh.hist[buf]);
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

// The top-p cut over the cluster: verify_select.cuh's top_p_cut_mass with each pass's digit
// masses summed over the CTAs (every CTA gathers them and chooses the same digit; pass 0's give
// the limit). e: this CTA's slice of len values.
template <int kC>
__device__ float cluster_top_p_cut(const float* e, int len, float kcut, float top_p, WarpHists wh,
                                   ClusterShared<kC>& sh, SelectShared& ss) {
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, nt = blockDim.x;
  uint32_t prefix = 0;
  unsigned long long target = 0;
  for (int pass = 0, buf = 0; pass < kMassPasses; ++pass, buf ^= 1) {
    mass_histogram(e, len, kcut, prefix, pass, wh, sh.mass[buf]);
    // The other buffer was last read before this barrier's previous instance: safe to reuse
    // next pass.
    cluster.sync();
    for (int i = tid; i < kBins; i += nt) {
      unsigned long long m = 0;
      for (int r = 0; r < kC; ++r) m += cluster.map_shared_rank(&sh.mass[buf][0], r)[i];
      ss.mass[i] = m;
    }
    __syncthreads();
    if (pass == 0 && (target = mass_limit(ss.mass, top_p, ss)) == 0) return kcut;
    select_mass_digit(ss.mass, mass_shift(pass), ss, prefix, target);
  }
  return __uint_as_float(prefix);
}

// transform_row (verify_transform.cu) over the cluster of the calling CTA. e: this CTA's slice
// in shared memory (kCL * ceil(vocab / 256) floats); wh: the per-warp histograms
// (kWarpHistBytes). bias (may be null): added to the logits, which are written back (the draft
// slot). Writes p[] for this CTA's slice and leaves the final values in e. Returns the greedy
// argmax when temperature == 0, else -1.
template <int kC>
__device__ int cluster_transform_row(float* l, const float* bias, int vocab, float temperature,
                                     float top_p, int top_k, float* p, float* e, WarpHists wh,
                                     ClusterShared<kC>& sh, SelectShared& ss, ArgMax* s_warp) {
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
    if (use_k) cut = __uint_as_float(cluster_kth_largest_bits<kC>(e, len, top_k, wh, sh));
    if (use_p) cut = cluster_top_p_cut<kC>(e, len, cut, top_p, wh, sh, ss);
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
                             int top_k, float* probs) {
  __shared__ ClusterShared<kC> sh;
  __shared__ SelectShared ss;
  __shared__ ArgMax s_warp[32];
  extern __shared__ unsigned long long dyn[];  // kWarpHistBytes of per-warp bins, then the slice
  float* e_slice = reinterpret_cast<float*>(reinterpret_cast<char*>(dyn) + kWarpHistBytes);
  const size_t row = blockIdx.x / kC;
  cluster_transform_row<kC>(const_cast<float*>(logits) + row * vocab, nullptr, vocab, temperature,
                            top_p, top_k, probs + row * vocab, e_slice, dyn, sh, ss, s_warp);
  cg::this_cluster().sync();  // no CTA leaves while others read its shared memory
}

// draft_slot_kernel over a cluster: the pick walks the gathered lane sums in every CTA (same
// data, same result); the CTA owning the chunk that holds the target walks inside it and writes
// the token.
template <int kC>
__global__ void __launch_bounds__(kTransformThreads)
    cluster_draft_slot_kernel(float* logits, const float* bias, int vocab,
                              const DeviceSamplingParams* params, const float* u, float* probs,
                              int32_t* token, int32_t* prev) {
  __shared__ ClusterShared<kC> sh;
  __shared__ SelectShared ss;
  __shared__ ArgMax s_warp[32];
  __shared__ int s_pick;
  extern __shared__ unsigned long long dyn[];  // kWarpHistBytes of per-warp bins, then the slice
  float* e_slice = reinterpret_cast<float*>(reinterpret_cast<char*>(dyn) + kWarpHistBytes);
  constexpr int kCL = ClusterShared<kC>::kCL;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const DeviceSamplingParams prm = *params;
  const int best = cluster_transform_row<kC>(logits, bias, vocab, prm.temperature, prm.top_p,
                                             prm.top_k, probs, e_slice, dyn, sh, ss, s_warp);
  __syncthreads();
  const int lo = slice_begin<kC>(vocab, rank);
  int writer = 0;  // the rank that writes the token
  int32_t t = best;
  if (prm.temperature != 0.0f) {
    const float total =
        cluster_lane_total<kC>([=](int i) { return e_slice[i]; }, vocab, rank, lo, 2, sh);
    if (threadIdx.x < 32) {
      // row_ops.h's inverse_cdf_pick over the gathered lane sums (block_inverse_cdf_pick's walk)
      int32_t pick = -1;
      if (total > 0.0f) {
        int in_lane;
        pick = warp_cdf_pick(
            sh.lane_all, sh.last_all, [&](int x) { return e_slice[x - lo]; }, vocab,
            __fmul_rn(*u, total), &in_lane, [&](int lane) { return lane / kCL == rank; });
        if (in_lane >= 0) writer = in_lane / kCL;
      }
      if (threadIdx.x == 0) {
        s_pick = pick;
        sh.sel_digit = writer;
      }
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
// dynamic shared memory after the per-warp histograms; beyond this the single-CTA kernels run.
constexpr int kMaxSliceBytes = 128 * 1024;
constexpr int kMaxClusterSmem = kMaxSliceBytes + int(kWarpHistBytes);
constexpr int kMaxDevices = 64;
int g_cluster_size[kMaxDevices] = {};  // per device: 16 or 8 once set up, 0 before

size_t slice_bytes(int cluster, int vocab) {
  return size_t(kLanes / cluster) * size_t((vocab + kLanes - 1) / kLanes) * sizeof(float);
}

// A launch's dynamic shared memory: the per-warp histograms and the slice.
size_t cluster_smem(int cluster, int vocab) { return kWarpHistBytes + slice_bytes(cluster, vocab); }

template <int kC>
void set_cluster_attributes() {
  for (const void* k : {reinterpret_cast<const void*>(cluster_transform_kernel<kC>),
                        reinterpret_cast<const void*>(cluster_draft_slot_kernel<kC>)}) {
    UF_CUDA_CHECK(
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxClusterSmem));
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
  set_single_transform_attributes();
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = cluster_config(16, 1, kMaxClusterSmem, nullptr, attr);
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

// The clusters win over the single-CTA kernels for every row count (H200, bench_cuda_verify, 15
// rows of 129280: 48 against 111 us without a cut; the top-p cut is a few passes over each CTA's
// slice either way), so they run wherever a slice fits.
int transform_cluster(int vocab) {
  if (g_single_cta) return 0;
  const int c = cluster_size();
  return slice_bytes(c, vocab) > size_t(kMaxSliceBytes) ? 0 : c;
}

void launch_cluster_transform(int cluster, const float* logits, int rows, int vocab,
                              const sampling::SamplingParams& params, float* probs,
                              cudaStream_t stream) {
  const auto kernel = cluster == 16 ? cluster_transform_kernel<16> : cluster_transform_kernel<8>;
  launch_cluster(kernel, cluster, rows, cluster_smem(cluster, vocab), stream, logits, vocab,
                 params.temperature, params.top_p, int(params.top_k), probs);
}

void launch_cluster_draft_slot(int cluster, float* logits, const float* bias, int vocab,
                               const DeviceSamplingParams* params, const float* u, float* probs,
                               int32_t* token, int32_t* prev, cudaStream_t stream) {
  const auto kernel = cluster == 16 ? cluster_draft_slot_kernel<16> : cluster_draft_slot_kernel<8>;
  launch_cluster(kernel, cluster, 1, cluster_smem(cluster, vocab), stream, logits, bias, vocab,
                 params, u, probs, token, prev);
}

}  // namespace uf::cuda::verify_detail

namespace uf::cuda {

void set_single_cta_transform_for_bench(bool single) { verify_detail::g_single_cta = single; }

}  // namespace uf::cuda
