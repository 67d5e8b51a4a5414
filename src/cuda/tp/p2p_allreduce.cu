// PeerAllReduce (p2p_allreduce.h): the protocol is described there; this file follows it step by
// step. Partition: a call's n elements are cut into units of 4 floats and each CTA gets the same
// contiguous run of units on every rank (it depends on n and the grid only, never on a pointer's
// alignment, so CTA b of every rank pushes and reads the same elements). buf is accessed with
// float4 when it is 16-byte aligned, element by element otherwise; the staging always is.
#include <cstdint>
#include <cstdio>
#include <set>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/ops/elementwise_common.cuh"
#include "cuda/tp/p2p_allreduce.h"

namespace uf::cuda::tp {

namespace detail {
struct P2pArgs {
  float* recv[PeerAllReduce::kMaxRanks];      // rank q's [2][N][cap] staging (device q)
  uint64_t* flags[PeerAllReduce::kMaxRanks];  // rank q's [N][G] flags (device q)
  uint64_t* epoch;                            // this rank's [G] counters
  uint4* ll[PeerAllReduce::kMaxRanks];        // rank q's [2][N][ll_lines] low-latency lines
  uint64_t* ll_epoch;                         // this rank's [G] low-latency call counters
  size_t ll_lines;
  int rank, n_ranks;
  size_t cap;
  unsigned long long timeout_ns;
};
}  // namespace detail

namespace {

using detail::P2pArgs;

constexpr int kThreads = 512;

__host__ __device__ __forceinline__ size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }
constexpr size_t kAlign = 256;

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

using uf::cuda::detail::global_timer_ns;
using uf::cuda::detail::launch_pdl;
using uf::cuda::detail::pdl_wait;

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z),
                     __fadd_rn(a.w, b.w));
}

// Steps 1-4 of the protocol for the units [u0, u1) of this CTA: push buf's elements into every
// peer's staging slot, signal, and wait until every peer's CTA b has pushed the same call.
// Returns the call's epoch; the caller reads the peers' terms from its own staging slot e & 1.
template <bool kVecBuf>
__device__ uint64_t exchange(const P2pArgs& a, const float* buf, size_t n, size_t u0, size_t u1) {
  __shared__ uint64_t s_epoch;
  const int b = int(blockIdx.x), G = int(gridDim.x), tid = int(threadIdx.x);
  const int N = a.n_ranks, r = a.rank;
  pdl_wait();  // launched with PDL allowed: nothing before the previous kernel has completed
  // 1. This CTA's epoch (only this rank's CTA b ever touches epoch[b]; calls are stream ordered).
  if (tid == 0) {
    const uint64_t e = a.epoch[b] + 1;
    a.epoch[b] = e;
    s_epoch = e;
  }
  __syncthreads();
  const uint64_t e = s_epoch;
  const size_t slot = size_t(e & 1);
  // My input inside a peer's staging: recv[q] + own_off + i.
  const size_t own_off = (slot * size_t(N) + size_t(r)) * a.cap;

  // 2. Push buf[unit range] into every peer's staging.
  for (size_t u = u0 + size_t(tid); u < u1; u += kThreads) {
    const size_t i = u * 4;
    if (i + 4 <= n) {
      float4 v;
      if (kVecBuf)
        v = *reinterpret_cast<const float4*>(buf + i);
      else
        v = make_float4(buf[i], buf[i + 1], buf[i + 2], buf[i + 3]);
      for (int q = 0; q < N; ++q)
        if (q != r) *reinterpret_cast<float4*>(a.recv[q] + own_off + i) = v;
    } else {
      for (size_t j = i; j < n; ++j) {
        const float v = buf[j];
        for (int q = 0; q < N; ++q)
          if (q != r) a.recv[q][own_off + j] = v;
      }
    }
  }
  // Every thread's remote stores are complete system-wide before the barrier; the flag stores
  // below are release stores after a fence as well (either alone is the usual idiom).
  __threadfence_system();
  __syncthreads();

  // 3. Signal: thread q tells peer q that this CTA's part of epoch e is in place.
  if (tid < N && tid != r) {
    __threadfence_system();
    st_release_sys(a.flags[tid] + size_t(r) * size_t(G) + size_t(b), e);
  }
  // 4. Wait (local memory): thread q waits for peer q's CTA b to have pushed epoch e (or later:
  // a fast peer may have finished this call and signalled the next one already).
  if (tid < N && tid != r) {
    const uint64_t* f = a.flags[r] + size_t(tid) * size_t(G) + size_t(b);
    const unsigned long long t0 = a.timeout_ns ? global_timer_ns() : 0;
    unsigned spins = 0;
    uint64_t seen;
    while ((seen = ld_acquire_sys(f)) < e) {
      if (a.timeout_ns && (++spins & 1023u) == 0 && global_timer_ns() - t0 > a.timeout_ns) {
        printf(
            "PeerAllReduce: rank %d CTA %d timed out after %.1f s waiting for rank %d's epoch "
            "%llu (its flag holds %llu; n = %llu): a rank skipped or reordered a call?\n",
            r, b, double(global_timer_ns() - t0) * 1e-9, tid, (unsigned long long)e,
            (unsigned long long)seen, (unsigned long long)n);
        __trap();
      }
    }
  }
  __syncthreads();
  return e;
}

// This CTA's contiguous run of 4-float units of an n-element call: the same on every rank.
__device__ __forceinline__ void unit_range(size_t n, size_t& u0, size_t& u1) {
  const size_t units = (n + 3) / 4, G = gridDim.x;
  const size_t per = (units + G - 1) / G;
  u0 = min_sz(units, size_t(blockIdx.x) * per);
  u1 = min_sz(units, u0 + per);
}

template <bool kVecBuf, bool kRound>
__global__ void __launch_bounds__(kThreads) p2p_sum_kernel(P2pArgs a, float* buf, size_t n) {
  size_t u0, u1;
  unit_range(n, u0, u1);
  const uint64_t e = exchange<kVecBuf>(a, buf, n, u0, u1);
  const int N = a.n_ranks, r = a.rank, tid = int(threadIdx.x);

  // 5. Rank-order sum: ((b0 + b1) + b2) + ..., my own term read from buf, the peers' from my
  // staging with ld.cg (from L2, where the peers' stores land: no stale L1 line of an earlier use
  // of the slot can be hit).
  const float* mine = a.recv[r] + size_t(e & 1) * size_t(N) * a.cap;  // [N][cap] of this slot
  for (size_t u = u0 + size_t(tid); u < u1; u += kThreads) {
    const size_t i = u * 4;
    if (i + 4 <= n) {
      float4 own;
      if (kVecBuf)
        own = *reinterpret_cast<const float4*>(buf + i);
      else
        own = make_float4(buf[i], buf[i + 1], buf[i + 2], buf[i + 3]);
      float4 acc =
          r == 0 ? own : __ldcg(reinterpret_cast<const float4*>(mine + i));  // rank 0's term
      for (int q = 1; q < N; ++q)
        acc = add4(
            acc,
            q == r ? own : __ldcg(reinterpret_cast<const float4*>(mine + size_t(q) * a.cap + i)));
      if (kRound)
        acc = make_float4(ew::round_bf16(acc.x), ew::round_bf16(acc.y), ew::round_bf16(acc.z),
                          ew::round_bf16(acc.w));
      if (kVecBuf) {
        *reinterpret_cast<float4*>(buf + i) = acc;
      } else {
        buf[i] = acc.x;
        buf[i + 1] = acc.y;
        buf[i + 2] = acc.z;
        buf[i + 3] = acc.w;
      }
    } else {
      for (size_t j = i; j < n; ++j) {
        const float own = buf[j];
        float acc = r == 0 ? own : __ldcg(mine + j);
        for (int q = 1; q < N; ++q)
          acc = __fadd_rn(acc, q == r ? own : __ldcg(mine + size_t(q) * a.cap + j));
        buf[j] = kRound ? ew::round_bf16(acc) : acc;
      }
    }
  }
}

// ---- The low-latency protocol (p2p_allreduce.h): lines {v0, e32, v1, e32} ----
// A line is accessed as two 8-byte elements (v2.u64), value in the low half, tag in the high half
// (the same bytes as {v0, e32, v1, e32}): the PTX memory model makes each naturally aligned 8-byte
// element single-copy atomic, which is what pairs a value with its tag (as .u32 elements, only each
// 4 bytes would be).

__device__ __forceinline__ void st_volatile_line(uint4* p, uint4 v) {
  const unsigned long long lo = (unsigned long long)v.y << 32 | v.x;
  const unsigned long long hi = (unsigned long long)v.w << 32 | v.z;
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(lo), "l"(hi) : "memory");
}
__device__ __forceinline__ uint4 ld_volatile_line(const uint4* p) {
  unsigned long long lo, hi;
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];"
               : "=l"(lo), "=l"(hi)
               : "l"(p)
               : "memory");
  return make_uint4(uint32_t(lo), uint32_t(lo >> 32), uint32_t(hi), uint32_t(hi >> 32));
}

// One call on rank r: every thread pushes its lines (grid-stride over the n / 2 pairs) into every
// peer's slot, then, for the same lines, polls the peers' lines of this epoch in its own memory and
// stores the rank-order sum. A thread only ever reads back the buf elements it pushed itself, so
// no barrier is needed after the epoch's.
template <bool kRound>
__global__ void __launch_bounds__(kThreads) p2p_sum_ll_kernel(P2pArgs a, float* buf, size_t n) {
  __shared__ uint32_t s_epoch, s_slot;
  const int b = int(blockIdx.x), N = a.n_ranks, r = a.rank;
  pdl_wait();  // as exchange()
  if (threadIdx.x == 0) {
    const uint64_t e = a.ll_epoch[b] + 1;
    a.ll_epoch[b] = e;
    // 1 .. 2^32 - 1, never 0: a line never written holds 0 and must never pass for this call's.
    s_epoch = uint32_t(e % 0xFFFFFFFFull) + 1u;
    s_slot = uint32_t(e & 1);  // the 64-bit count's parity: consecutive calls alternate, always
  }
  __syncthreads();
  const uint32_t e = s_epoch;
  const size_t lines = (n + 1) / 2, slot = size_t(s_slot) * size_t(N) * a.ll_lines;
  const size_t first = size_t(b) * kThreads + threadIdx.x, stride = size_t(gridDim.x) * kThreads;
  for (size_t l = first; l < lines; l += stride) {
    const size_t i = 2 * l;
    const float v1 = i + 1 < n ? buf[i + 1] : 0.0f;
    const uint4 line = make_uint4(__float_as_uint(buf[i]), e, __float_as_uint(v1), e);
    for (int q = 0; q < N; ++q)
      if (q != r) st_volatile_line(a.ll[q] + slot + size_t(r) * a.ll_lines + l, line);
  }
  const uint4* mine = a.ll[r] + slot;
  for (size_t l = first; l < lines; l += stride) {
    const size_t i = 2 * l;
    const float o0 = buf[i], o1 = i + 1 < n ? buf[i + 1] : 0.0f;
    float s0 = 0.0f, s1 = 0.0f;
    for (int q = 0; q < N; ++q) {
      float x0 = o0, x1 = o1;
      if (q != r) {
        const uint4* p = mine + size_t(q) * a.ll_lines + l;
        const unsigned long long t0 = a.timeout_ns ? global_timer_ns() : 0;
        unsigned spins = 0;
        uint4 v;
        while ((v = ld_volatile_line(p)).y != e || v.w != e) {
          if (a.timeout_ns && (++spins & 1023u) == 0 && global_timer_ns() - t0 > a.timeout_ns) {
            printf(
                "PeerAllReduce (low latency): rank %d CTA %d timed out after %.1f s waiting for "
                "rank %d's epoch %u at line %llu (it holds %u / %u; n = %llu): a rank skipped or "
                "reordered a call?\n",
                r, b, double(global_timer_ns() - t0) * 1e-9, q, e, (unsigned long long)l, v.y, v.w,
                (unsigned long long)n);
            __trap();
          }
        }
        x0 = __uint_as_float(v.x);
        x1 = __uint_as_float(v.z);
      }
      s0 = q == 0 ? x0 : __fadd_rn(s0, x0);
      s1 = q == 0 ? x1 : __fadd_rn(s1, x1);
    }
    if (kRound) {
      s0 = ew::round_bf16(s0);
      s1 = ew::round_bf16(s1);
    }
    buf[i] = s0;
    if (i + 1 < n) buf[i + 1] = s1;
  }
}

// Gather: src [n / width, width] of every rank -> dst[t * stride + q * width + j] (rank q's block
// of row t). The exchange is the sum's; step 5 copies each rank's run of the CTA's units (own from
// src) into its columns. kVec: width, stride, src and dst allow float4 everywhere.
template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    p2p_gather_kernel(P2pArgs a, const float* src, size_t n, size_t width, float* dst,
                      size_t stride) {
  const int N = a.n_ranks, r = a.rank, tid = int(threadIdx.x);
  size_t u0, u1;
  unit_range(n, u0, u1);
  const uint64_t e = exchange<kVec>(a, src, n, u0, u1);
  const float* mine = a.recv[r] + size_t(e & 1) * size_t(N) * a.cap;
  for (size_t u = u0 + size_t(tid); u < u1; u += kThreads) {
    const size_t i = u * 4;
    if (kVec) {  // width % 4 == 0: a unit never crosses a row
      const size_t t = i / width, j = i % width;
      for (int q = 0; q < N; ++q) {
        const float4 v =
            q == r ? *reinterpret_cast<const float4*>(src + i)
                   : __ldcg(reinterpret_cast<const float4*>(mine + size_t(q) * a.cap + i));
        *reinterpret_cast<float4*>(dst + t * stride + size_t(q) * width + j) = v;
      }
    } else {
      for (size_t k = i; k < min_sz(i + 4, n); ++k) {
        const size_t t = k / width, j = k % width;
        for (int q = 0; q < N; ++q)
          dst[t * stride + size_t(q) * width + j] =
              q == r ? src[k] : __ldcg(mine + size_t(q) * a.cap + k);
      }
    }
  }
}

__global__ void delay_kernel(unsigned long long ns) {
  const unsigned long long t0 = global_timer_ns();
  while (global_timer_ns() - t0 < ns) {
  }
}

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Restores the calling thread's current device on return or throw.
class DeviceGuard {
 public:
  DeviceGuard() { cudaGetDevice(&dev_); }
  ~DeviceGuard() { cudaSetDevice(dev_); }

 private:
  int dev_ = 0;
};

}  // namespace

bool PeerAllReduce::supported(const std::vector<int>& devices, std::string* why) {
  for (int a : devices)
    for (int b : devices) {
      if (a == b) continue;
      int ok = 0;
      const cudaError_t err = cudaDeviceCanAccessPeer(&ok, a, b);
      if (err != cudaSuccess || !ok) {
        cudaGetLastError();
        if (why) {
          char msg[200];
          snprintf(msg, sizeof msg, "device %d cannot access device %d's memory (%s)", a, b,
                   err != cudaSuccess ? cudaGetErrorString(err) : "cudaDeviceCanAccessPeer = 0");
          *why = msg;
        }
        return false;
      }
    }
  return true;
}

size_t PeerAllReduce::bytes_per_rank() const {
  const size_t N = devices_.size(), G = size_t(ctas_);
  return align_up(2 * N * cap_ * sizeof(float), kAlign) +
         align_up(N * G * sizeof(uint64_t), kAlign) + align_up(G * sizeof(uint64_t), kAlign) +
         align_up(2 * N * ll_lines_ * sizeof(uint4), kAlign) + G * sizeof(uint64_t);
}

PeerAllReduce::PeerAllReduce(std::vector<int> devices, size_t max_elems, int ctas, double timeout_s,
                             size_t low_latency_elems)
    : devices_(std::move(devices)) {
  const int N = int(devices_.size());
  require(N >= 2 && N <= kMaxRanks, "PeerAllReduce: %d ranks; need 2..%d", N, kMaxRanks);
  require(max_elems > 0, "PeerAllReduce: the capacity must be at least one element");
  require(ctas >= 1 && ctas <= 1024, "PeerAllReduce: %d CTAs; need 1..1024", ctas);
  require(timeout_s >= 0, "PeerAllReduce: negative timeout %g s", timeout_s);
  std::set<int> seen;
  for (int d : devices_)
    require(seen.insert(d).second, "PeerAllReduce: device %d is given twice", d);
  cap_ = align_up(max_elems, 4);
  ll_lines_ = (low_latency_elems + 1) / 2;
  ctas_ = ctas;
  timeout_ns_ = (unsigned long long)(timeout_s * 1e9);
  std::string why;
  require(supported(devices_, &why),
          "PeerAllReduce: %s: the one-shot all-reduce needs peer access between every pair of "
          "GPUs (use NCCL: --no-p2p-allreduce / CudaModelOptions::tp_p2p_allreduce = false)",
          why.c_str());
  DeviceGuard guard;
  try {
    for (int i = 0; i < N; ++i) {
      const int d = devices_[size_t(i)];
      UF_CUDA_CHECK(cudaSetDevice(d));
      int sms = 0;
      UF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d));
      // One CTA per SM at most, so that all of them run at once next to nothing else (a CTA
      // waits for the other ranks' CTAs, which never wait for a CTA that is not running).
      require(ctas <= sms, "PeerAllReduce: %d CTAs exceed device %d's %d SMs", ctas, d, sms);
      for (int j = 0; j < N; ++j) {
        if (j == i) continue;
        const cudaError_t err = cudaDeviceEnablePeerAccess(devices_[size_t(j)], 0);
        if (err == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();  // NCCL (or another group) enabled it: fine
          continue;
        }
        require(err == cudaSuccess,
                "PeerAllReduce: cudaDeviceEnablePeerAccess from device %d to device %d failed: %s",
                d, devices_[size_t(j)], cudaGetErrorString(err));
      }
      void* p = nullptr;
      UF_CUDA_CHECK(cudaMalloc(&p, bytes_per_rank()));
      allocations_.push_back(p);
      UF_CUDA_CHECK(cudaMemset(p, 0, bytes_per_rank()));
      auto* base = static_cast<uint8_t*>(p);
      recv_.push_back(reinterpret_cast<float*>(base));
      base += align_up(2 * size_t(N) * cap_ * sizeof(float), kAlign);
      flags_.push_back(reinterpret_cast<uint64_t*>(base));
      base += align_up(size_t(N) * size_t(ctas_) * sizeof(uint64_t), kAlign);
      epochs_.push_back(reinterpret_cast<uint64_t*>(base));
      base += align_up(size_t(ctas_) * sizeof(uint64_t), kAlign);
      ll_.push_back(base);
      base += align_up(2 * size_t(N) * ll_lines_ * sizeof(uint4), kAlign);
      ll_epochs_.push_back(reinterpret_cast<uint64_t*>(base));
    }
    for (int d : devices_) {
      UF_CUDA_CHECK(cudaSetDevice(d));
      UF_CUDA_CHECK(cudaDeviceSynchronize());  // zeroed before any kernel can look
    }
  } catch (...) {
    for (size_t i = 0; i < allocations_.size(); ++i) {
      cudaSetDevice(devices_[i]);
      cudaFree(allocations_[i]);
    }
    throw;
  }
}

PeerAllReduce::~PeerAllReduce() {
  DeviceGuard guard;
  for (size_t i = 0; i < allocations_.size(); ++i) {
    cudaSetDevice(devices_[i]);
    cudaFree(allocations_[i]);  // no throw from a destructor
  }
}

detail::P2pArgs PeerAllReduce::args(int rank) const {
  P2pArgs a{};
  for (int q = 0; q < size(); ++q) {
    a.recv[q] = recv_[size_t(q)];
    a.flags[q] = flags_[size_t(q)];
  }
  a.epoch = epochs_[size_t(rank)];
  for (int q = 0; q < size(); ++q) a.ll[q] = static_cast<uint4*>(ll_[size_t(q)]);
  a.ll_epoch = ll_epochs_[size_t(rank)];
  a.ll_lines = ll_lines_;
  a.rank = rank;
  a.n_ranks = size();
  a.cap = cap_;
  a.timeout_ns = timeout_ns_;
  return a;
}

void PeerAllReduce::sum_rank(int rank, float* buf, size_t n, cudaStream_t stream, bool round_bf16) {
  require(rank >= 0 && rank < size(), "PeerAllReduce::sum_rank: rank %d outside 0..%d", rank,
          size() - 1);
  if (n == 0) return;  // every rank passes the same n: every rank skips
  require(buf != nullptr, "PeerAllReduce::sum_rank: rank %d passed a null buffer for %zu values",
          rank, n);
  DeviceGuard guard;
  UF_CUDA_CHECK(cudaSetDevice(devices_[size_t(rank)]));
  const P2pArgs a = args(rank);
  // cap_ is a multiple of 4, so every chunk starts as aligned as buf.
  const bool vec = reinterpret_cast<uintptr_t>(buf) % 16 == 0;
  for (size_t off = 0; off < n; off += cap_) {
    const size_t m = min_sz(cap_, n - off);
    const dim3 grid{unsigned(ctas_)};
    if (m <= 2 * ll_lines_ && round_bf16)
      launch_pdl(p2p_sum_ll_kernel<true>, grid, dim3(kThreads), 0, stream, a, buf + off, m);
    else if (m <= 2 * ll_lines_)
      launch_pdl(p2p_sum_ll_kernel<false>, grid, dim3(kThreads), 0, stream, a, buf + off, m);
    else if (vec && round_bf16)
      launch_pdl(p2p_sum_kernel<true, true>, grid, dim3(kThreads), 0, stream, a, buf + off, m);
    else if (vec)
      launch_pdl(p2p_sum_kernel<true, false>, grid, dim3(kThreads), 0, stream, a, buf + off, m);
    else if (round_bf16)
      launch_pdl(p2p_sum_kernel<false, true>, grid, dim3(kThreads), 0, stream, a, buf + off, m);
    else
      launch_pdl(p2p_sum_kernel<false, false>, grid, dim3(kThreads), 0, stream, a, buf + off, m);
    UF_CUDA_CHECK(cudaGetLastError());
  }
}

void PeerAllReduce::gather_rank(int rank, const float* src, size_t rows, size_t width, float* dst,
                                size_t dst_stride, cudaStream_t stream) {
  require(rank >= 0 && rank < size(), "PeerAllReduce::gather_rank: rank %d outside 0..%d", rank,
          size() - 1);
  if (rows == 0 || width == 0) return;  // every rank passes the same shape: every rank skips
  require(src && dst, "PeerAllReduce::gather_rank: rank %d passed a null buffer", rank);
  require(width <= cap_,
          "PeerAllReduce::gather_rank: a row of %zu values exceeds the staging capacity of %zu",
          width, cap_);
  require(dst_stride >= size_t(size()) * width,
          "PeerAllReduce::gather_rank: destination stride %zu < %d ranks x %zu columns", dst_stride,
          size(), width);
  DeviceGuard guard;
  UF_CUDA_CHECK(cudaSetDevice(devices_[size_t(rank)]));
  const P2pArgs a = args(rank);
  const bool vec =
      width % 4 == 0 && dst_stride % 4 == 0 &&
      ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16) == 0;
  // Whole rows per kernel, as many as the staging holds.
  const size_t rows_per_call = cap_ / width;
  for (size_t t0 = 0; t0 < rows; t0 += rows_per_call) {
    const size_t m = min_sz(rows_per_call, rows - t0);
    const float* s = src + t0 * width;
    float* d = dst + t0 * dst_stride;
    if (vec)
      launch_pdl(p2p_gather_kernel<true>, dim3(unsigned(ctas_)), dim3(kThreads), 0, stream, a, s,
                 m * width, width, d, dst_stride);
    else
      launch_pdl(p2p_gather_kernel<false>, dim3(unsigned(ctas_)), dim3(kThreads), 0, stream, a, s,
                 m * width, width, d, dst_stride);
    UF_CUDA_CHECK(cudaGetLastError());
  }
}

void delay_stream_ns(cudaStream_t stream, unsigned long long ns) {
  delay_kernel<<<1, 1, 0, stream>>>(ns);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda::tp
