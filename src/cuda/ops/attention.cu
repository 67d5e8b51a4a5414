// sparse_attn: the device twin of cpu::sparse_attn_row over T rows (ops/attention.h).
//
// Two paths.
//
// Reference path (no scratch): one block of kThreads threads per (row, head); the block walks
// the row's slot list (window slots, then top-k entries) in blocks of 64 exactly as the CPU does,
// so the online softmax sees the same block boundaries (empty slots included: they keep their
// place in the list, score -inf, probability 0, and add nothing to P.V).
// Arithmetic order, chosen to reproduce the CPU bit for bit (uf_cpu builds with
// -ffp-contract=off, so every step here uses __fmul_rn / __fadd_rn to forbid FMA contraction):
//  - q.k: cpu dot_f32 = dot8: eight partial sums, lane L holding the terms i = L mod 8 in
//    increasing i, combined as ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)); one thread per (slot, lane).
//  - block max, m_new = max(m, bmax), sc = exp(m - m_new), p_j = exp(s_j - m_new) (0 if empty),
//    psum summed in slot order by one thread, sum = sum * sc + psum.
//  - P.V: one thread per output dim d: tmp = sum_j bf16(p_j) * k_j[d] in slot order, then
//    acc = acc * sc + tmp; out = bf16(acc / (sum + exp(sink - m))).
// exp: the CPU calls glibc expf (< 0.502 ulp); here exp runs in double and rounds once to fp32,
// i.e. correctly rounded, so the two agree except when the exact value is within ~0.002 ulp of a
// rounding boundary. That is the only source of difference from the CPU (tests allow 1 bf16 ulp).
//
// Fast (chunked) path (a scratch buffer given; the decode callers): the slot list is cut into
// chunks of S = 16 slots (a constant; 32 is kept for benchmarks, sparse_attn_chunk_override).
// One CTA of 256 threads per (chunk, row, group of 8 heads) stages the chunk's KV rows in
// shared memory once (16-byte cp.async) and serves all 8 heads from them, so a KV row is read
// once per call and head group instead of once per head, and a 1-row call still has
// n_slots / S CTAs (40 for 128 + 512 slots; 3 CTAs of ~66 KB shared memory fit an SM). Per CTA:
//  - q.k: thread (slots jp and jp + S/2, slice g) sums its float4 columns f = g, g + G, ...
//    (G = 512 / S) with fp32 FMAs for the 8 heads; the G slice sums are added in slice order.
//  - chunk softmax per head (one warp per head, one lane per slot): m_c = max(-1e30, max_j s_j),
//    p_j = expf(s_j - m_c), sum_c = butterfly sum of the unrounded p_j (a fixed tree), and
//    bf16(p_j) for P.V, as the CPU rounds p relative to the running max of its 64-slot block.
//    expf here is CUDA's (max 2 ulp, fp32 instructions: the double exp of the reference path
//    would put ~0.2 us of FP64 latency on this path's critical chain twice); 2 ulp is 2.4e-7
//    relative on a weight, far inside the 2^-8 of the bf16 rounding below.
//  - P.V: thread (float4 column f, slot group sg) sums bf16(p_j) * k_j over the slots
//    j = sg, sg + ng, ... with FMAs, the ng group sums added in group order.
//  The chunk's (m_c, sum_c, acc_c[hd]) per head go to the scratch; a merge kernel (4 warps per
//  (row, head, 128 columns), each summing a quarter of the chunks in chunk order, the quarters
//  added in order) combines them: M = max m_c, w_c = expf(m_c - M), den = butterfly sum of
//  w_c * sum_c + expf(sink - M), out = bf16(sum_c w_c acc_c / den).
//  Every order depends on the slot count and head_dim only, never on T or on other rows
//  (spec == plain); the result is the CPU's to fp32 order: each p is rounded to bf16 relative to
//  its chunk's max rather than the CPU's running max (a term's weight may differ by two bf16
//  roundings, 2^-8 relative) and the sums are re-associated (tests/cuda/test_ops_attention.cpp
//  states the bound). Both kernels are launched with PDL (griddepcontrol.wait before any read).
//
// A row's result depends on its own inputs only (spec == plain). No allocation, no atomics.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/ops/attention.h"

namespace uf::cuda {
namespace {

constexpr int kBlock = 64;  // cpu::kAttnBlock
constexpr int kThreads = 256;
constexpr int kMaxHeadDim = 1024;

// Fast path.
constexpr int kFastThreads = 256;
constexpr int kHeadGroup = 8;  // heads per CTA: one warp per head in the chunk softmax
static_assert(kFastThreads / 32 == kHeadGroup, "one softmax warp per head of the group");
constexpr int kMergeCols = 32 * 4;  // output columns per merge CTA (a float4 per lane)

__device__ __forceinline__ float exp_rn(float x) { return float(exp(double(x))); }

int g_chunk_override = 0;  // sparse_attn_chunk_override (benchmarks)
int fast_chunk(int n_slots) {
  (void)n_slots;  // chunks of 16: 40 CTAs a row for 128 + 512 slots, 3 resident per SM
  return g_chunk_override ? g_chunk_override : 16;
}
int fast_chunks(int n_slots) { return (n_slots + fast_chunk(n_slots) - 1) / fast_chunk(n_slots); }
constexpr int kMinChunk = 16;  // the scratch is sized for chunks of 16 (any rule above fits)

// Row stride of the staged KV rows in float4s: odd, so that the 32 lanes reading 32 different
// rows at the same column hit 8 distinct 16-byte bank groups (conflict-free).
__host__ __device__ constexpr int kv_stride4(int hd4) { return hd4 % 2 ? hd4 : hd4 + 1; }
// P.V slot groups: 256 threads over hd4 columns (2 for hd 512; 1 from hd 516 up).
__host__ __device__ constexpr int pv_groups(int hd4) {
  return hd4 >= kFastThreads ? 1 : (kFastThreads / hd4 < 4 ? kFastThreads / hd4 : 4);
}

// q.k column slices: 256 threads, each on two slots of the chunk.
__host__ __device__ constexpr int qk_slices(int S) { return 2 * kFastThreads / S; }

struct FastSmem {
  size_t kv, q, scr, sc, ps, total;  // offsets in floats (total: bytes)
};
__host__ __device__ inline FastSmem fast_smem(int S, int hd) {
  const int hd4 = hd / 4, G = qk_slices(S), ng = pv_groups(hd4);
  FastSmem m{};
  m.kv = 0;
  m.q = m.kv + size_t(S) * kv_stride4(hd4) * 4;
  m.scr = m.q + size_t(kHeadGroup) * hd;
  const size_t qk_part = size_t(G) * S * kHeadGroup, pv_part = size_t(ng - 1) * kHeadGroup * hd;
  m.sc = m.scr + (qk_part > pv_part ? qk_part : pv_part);
  m.ps = m.sc + size_t(S) * kHeadGroup;
  m.total = (m.ps + size_t(S) * kHeadGroup) * sizeof(float);
  return m;
}

// sum_j bf16(p_j[h]) * k_j[4f .. 4f + 3] over the present slots j = j_first, j_first + step, ...
// < nb, in slot order, for the 8 heads of the group.
__device__ __forceinline__ void pv_sum(float4 (&acc)[kHeadGroup], const float4* kv4, int st4,
                                       const float* ps, const float* const* slot, int f,
                                       int j_first, int step, int nb) {
#pragma unroll
  for (int h = 0; h < kHeadGroup; ++h) acc[h] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j = j_first; j < nb; j += step) {
    if (!slot[j]) continue;  // the same for every thread: empty rows were not staged
    const float4 kf = kv4[j * st4 + f];
    const float4* pj = reinterpret_cast<const float4*>(ps + j * kHeadGroup);
    const float4 pa = pj[0], pb = pj[1];
    const float pp[kHeadGroup] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
    for (int h = 0; h < kHeadGroup; ++h) {
      acc[h].x = fmaf(pp[h], kf.x, acc[h].x);
      acc[h].y = fmaf(pp[h], kf.y, acc[h].y);
      acc[h].z = fmaf(pp[h], kf.z, acc[h].z);
      acc[h].w = fmaf(pp[h], kf.w, acc[h].w);
    }
  }
}

// One CTA per (chunk, row, head group). scratch: acc [T, H, nc, hd] then stats [T, H, nc, 2].
template <int S>
__global__ void __launch_bounds__(kFastThreads)
    sparse_attn_chunk_kernel(const float* __restrict__ q, int T, int H, int hd,
                             const float* const* window, int n_window,
                             const int32_t* __restrict__ topk, int k, const float* ckv,
                             const float* const* ckv_ref, float scale,
                             float* __restrict__ scratch) {
  constexpr int G = qk_slices(S);  // q.k column slices
  extern __shared__ __align__(16) float smem[];
  __shared__ const float* slot[S];
  const int c = blockIdx.x, t = blockIdx.y, h0 = blockIdx.z * kHeadGroup, tid = threadIdx.x;
  const int nh = min(kHeadGroup, H - h0), hd4 = hd / 4, st4 = kv_stride4(hd4);
  const int n_slots = n_window + k, nc = gridDim.x, j0 = c * S, nb = min(S, n_slots - j0);
  const FastSmem L = fast_smem(S, hd);
  float4* kv4 = reinterpret_cast<float4*>(smem + L.kv);
  float4* q4 = reinterpret_cast<float4*>(smem + L.q);
  float* scr = smem + L.scr;
  float* sc = smem + L.sc;  // [S][8] scores
  float* ps = smem + L.ps;  // [S][8] bf16(p)

  // q, the window pointers, the top-k ids and the KV rows all come from earlier kernels.
  detail::pdl_wait();
  detail::pdl_trigger();
  if (ckv_ref) ckv = *ckv_ref;
  if (tid < S) {
    const float* p = nullptr;
    if (tid < nb) {
      const int j = j0 + tid;
      if (j < n_window) {
        p = window[int64_t(t) * n_window + j];
      } else {
        const int32_t e = topk[int64_t(t) * k + (j - n_window)];
        p = e >= 0 ? ckv + int64_t(e) * hd : nullptr;
      }
    }
    slot[tid] = p;
  }
  const float4* qg = reinterpret_cast<const float4*>(q + (int64_t(t) * H + h0) * hd);
  for (int i = tid; i < kHeadGroup * hd4; i += kFastThreads)
    q4[i] = i < nh * hd4 ? qg[i] : make_float4(0.f, 0.f, 0.f, 0.f);
  __syncthreads();
  // Stage the chunk's present rows: 16-byte cp.async (all in flight at once), or plain loads for
  // a row that is not 16-byte aligned.
  for (int i = tid; i < nb * hd4; i += kFastThreads) {
    const int j = i / hd4, f = i - j * hd4;
    const float* p = slot[j];
    if (!p) continue;
    float4* dst = kv4 + j * st4 + f;
    if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
      const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(p + 4 * f) : "memory");
    } else {
      *dst = make_float4(p[4 * f], p[4 * f + 1], p[4 * f + 2], p[4 * f + 3]);
    }
  }
  detail::cp_async_commit();
  detail::cp_async_wait<0>();
  __syncthreads();

  // q.k partial sums: thread (slot pair jp, slice g) over the float4 columns f = g, g + G, ...
  // for the slots jp and jp + S / 2 (two slots share each q load: as many shared-memory
  // wavefronts as FMA issue slots). A warp holds all S / 2 pairs and 32 / (S / 2) consecutive
  // slices, so its q loads touch a few adjacent addresses (one wavefront) and its KV loads
  // spread over all banks (odd row stride). Rows of empty or missing slots hold stale shared
  // memory: their sums are computed anyway (no divergence) and masked to -inf below.
  {
    constexpr int P = S / 2;
    const int lane = tid % 32, jp = lane % P, g = (tid / 32) * (32 / P) + lane / P;
    float a0[kHeadGroup], a1[kHeadGroup];
#pragma unroll
    for (int h = 0; h < kHeadGroup; ++h) a0[h] = a1[h] = 0.f;
    const float4* k0 = kv4 + jp * st4;
    const float4* k1 = kv4 + (jp + P) * st4;
    for (int f = g; f < hd4; f += G) {
      const float4 x = k0[f], y = k1[f];
#pragma unroll
      for (int h = 0; h < kHeadGroup; ++h) {
        const float4 qf = q4[h * hd4 + f];
        a0[h] = fmaf(qf.x, x.x, a0[h]);
        a0[h] = fmaf(qf.y, x.y, a0[h]);
        a0[h] = fmaf(qf.z, x.z, a0[h]);
        a0[h] = fmaf(qf.w, x.w, a0[h]);
        a1[h] = fmaf(qf.x, y.x, a1[h]);
        a1[h] = fmaf(qf.y, y.y, a1[h]);
        a1[h] = fmaf(qf.z, y.z, a1[h]);
        a1[h] = fmaf(qf.w, y.w, a1[h]);
      }
    }
    float4* d0 = reinterpret_cast<float4*>(scr + (g * S + jp) * kHeadGroup);
    float4* d1 = reinterpret_cast<float4*>(scr + (g * S + jp + P) * kHeadGroup);
    d0[0] = make_float4(a0[0], a0[1], a0[2], a0[3]);
    d0[1] = make_float4(a0[4], a0[5], a0[6], a0[7]);
    d1[0] = make_float4(a1[0], a1[1], a1[2], a1[3]);
    d1[1] = make_float4(a1[4], a1[5], a1[6], a1[7]);
  }
  __syncthreads();
  if (tid < S * kHeadGroup) {  // (slot j, head h): the slices in slice order
    const int j = tid / kHeadGroup, h = tid % kHeadGroup;
    float s = 0.f;
#pragma unroll
    for (int g = 0; g < G; ++g) s += scr[(g * S + j) * kHeadGroup + h];
    sc[tid] = j < nb && slot[j] ? __fmul_rn(s, scale) : -INFINITY;
  }
  __syncthreads();

  // Chunk softmax: warp h, lane j.
  {
    const int h = tid / 32, lane = tid % 32;
    const float s = lane < S ? sc[lane * kHeadGroup + h] : -INFINITY;
    float mx = s;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, mx, o);
      mx = mx < v ? v : mx;
    }
    const float m = -1e30f < mx ? mx : -1e30f;  // the CPU's running max starts at -1e30
    const bool present = lane < nb && slot[lane] != nullptr;
    const float p = present ? expf(s - m) : 0.f;
    float sum = p;  // xor butterfly: every lane ends with the same, fixed-order sum
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane < S) ps[lane * kHeadGroup + h] = detail::round_bf16(p);
    if (lane == 0 && h < nh) {
      float* stats = scratch + size_t(T) * H * nc * hd;
      float* rec = stats + ((int64_t(t) * H + h0 + h) * nc + c) * 2;
      rec[0] = m;
      rec[1] = sum;
    }
  }
  __syncthreads();

  // P.V: thread (column f, slot group sg) over the slots j = sg, sg + ng, ...
  const int ng = pv_groups(hd4);
  float4* accg = reinterpret_cast<float4*>(scratch);
  if (ng == 1) {
    for (int f = tid; f < hd4; f += kFastThreads) {
      float4 acc[kHeadGroup];
      pv_sum(acc, kv4, st4, ps, slot, f, 0, 1, nb);
      for (int h = 0; h < nh; ++h) accg[((int64_t(t) * H + h0 + h) * nc + c) * hd4 + f] = acc[h];
    }
    return;
  }
  // ng > 1 means hd4 * ng <= 256: at most one item per thread. Groups 1.. hand their sums to
  // group 0 through shared memory (the q.k scratch, free now), added in group order.
  const int f = tid % hd4, sg = tid / hd4;
  const bool active = tid < hd4 * ng;
  float4 acc[kHeadGroup];
  if (active) pv_sum(acc, kv4, st4, ps, slot, f, sg, ng, nb);
  float4* red = reinterpret_cast<float4*>(scr);
  if (active && sg > 0)
#pragma unroll
    for (int h = 0; h < kHeadGroup; ++h) red[((sg - 1) * kHeadGroup + h) * hd4 + f] = acc[h];
  __syncthreads();
  if (active && sg == 0)
    for (int h = 0; h < nh; ++h) {
      float4 a = acc[h];
      for (int g = 1; g < ng; ++g) {
        const float4 r = red[((g - 1) * kHeadGroup + h) * hd4 + f];
        a.x += r.x;
        a.y += r.y;
        a.z += r.z;
        a.w += r.w;
      }
      accg[((int64_t(t) * H + h0 + h) * nc + c) * hd4 + f] = a;
    }
}

// The chunks of one (row, head) merged in a fixed order; a CTA of kMergeWarps warps per (row,
// head, 128 output columns), a float4 column per lane. Warp w owns the chunks
// [w * nc / kMergeWarps, (w + 1) * nc / kMergeWarps) and sums them in chunk order (its first 16
// loads are issued before the weights are known, so the chunk records and the statistics arrive
// together); the warps' sums are then added in warp order. Every warp computes the weights
// itself (the same instructions on the same values: the same bits), so no barrier waits on them.
constexpr int kMergeWarps = 4;
constexpr int kMergePrefetch = 16;

__device__ __forceinline__ void fma_f4(float4& a, float w, const float4& v) {
  a.x = fmaf(w, v.x, a.x);
  a.y = fmaf(w, v.y, a.y);
  a.z = fmaf(w, v.z, a.z);
  a.w = fmaf(w, v.w, a.w);
}

__global__ void __launch_bounds__(kMergeWarps * 32)
    sparse_attn_merge_kernel(const float* __restrict__ scratch, int T, int H, int hd, int nc,
                             const float* __restrict__ sink, float* __restrict__ out) {
  extern __shared__ float wsh_all[];  // [kMergeWarps][nc] chunk weights, one copy per warp
  __shared__ float4 red[kMergeWarps][32];
  detail::pdl_wait();
  detail::pdl_trigger();
  const int th = blockIdx.y, h = th % H, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hd4 = hd / 4, f = blockIdx.x * 32 + lane;
  const bool col = f < hd4;
  const int c0 = warp * nc / kMergeWarps, c1 = (warp + 1) * nc / kMergeWarps;
  const float4* acc =
      reinterpret_cast<const float4*>(scratch) + int64_t(th) * nc * hd4 + (col ? f : 0);
  float4 v[kMergePrefetch];
#pragma unroll
  for (int u = 0; u < kMergePrefetch; ++u)
    v[u] = c0 + u < c1 ? acc[int64_t(c0 + u) * hd4] : make_float4(0.f, 0.f, 0.f, 0.f);

  const float* st = scratch + size_t(T) * H * nc * hd + int64_t(th) * nc * 2;
  float* wsh = wsh_all + warp * nc;
  float mx = -INFINITY;
  for (int c = lane; c < nc; c += 32) mx = mx < st[2 * c] ? st[2 * c] : mx;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float x = __shfl_xor_sync(0xffffffffu, mx, o);
    mx = mx < x ? x : mx;
  }
  float den = 0.f;
  for (int c = lane; c < nc; c += 32) {
    const float w = expf(st[2 * c] - mx);
    wsh[c] = w;
    den = fmaf(st[2 * c + 1], w, den);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
  den += expf(sink[h] - mx);
  __syncwarp();

  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int u = 0; u < kMergePrefetch; ++u)
    if (c0 + u < c1) fma_f4(a, wsh[c0 + u], v[u]);
  int c = c0 + kMergePrefetch;
  for (; c + 4 <= c1; c += 4) {  // long lists only (more than 64 chunks)
    float4 b[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) b[u] = acc[int64_t(c + u) * hd4];
#pragma unroll
    for (int u = 0; u < 4; ++u) fma_f4(a, wsh[c + u], b[u]);
  }
  for (; c < c1; ++c) fma_f4(a, wsh[c], acc[int64_t(c) * hd4]);
  red[warp][lane] = a;
  __syncthreads();
  if (warp != 0 || !col) return;
  float4 r = red[0][lane];
#pragma unroll
  for (int w = 1; w < kMergeWarps; ++w) {
    const float4 x = red[w][lane];
    r.x += x.x;
    r.y += x.y;
    r.z += x.z;
    r.w += x.w;
  }
  float4 o;
  o.x = detail::round_bf16(__fdiv_rn(r.x, den));
  o.y = detail::round_bf16(__fdiv_rn(r.y, den));
  o.z = detail::round_bf16(__fdiv_rn(r.z, den));
  o.w = detail::round_bf16(__fdiv_rn(r.w, den));
  reinterpret_cast<float4*>(out + int64_t(th) * hd)[f] = o;
}

__global__ void __launch_bounds__(kThreads)
    sparse_attn_kernel(const float* __restrict__ q, int H, int hd, const float* const* window,
                       int n_window, const int32_t* __restrict__ topk, int k, const float* ckv,
                       const float* const* ckv_ref, const float* __restrict__ sink, float scale,
                       float* __restrict__ out) {
  if (ckv_ref) ckv = *ckv_ref;
  extern __shared__ float smem[];
  float* qs = smem;        // [hd]
  float* acc = smem + hd;  // [hd]
  __shared__ const float* slot[kBlock];
  __shared__ float part[kBlock * 8];
  __shared__ float s[kBlock];
  __shared__ float pb[kBlock];
  __shared__ float m_sh, sum_sh, sc_sh, mnew_sh;

  const int t = blockIdx.x / H, h = blockIdx.x % H, tid = threadIdx.x;
  const float* qh = q + (int64_t(t) * H + h) * hd;
  for (int d = tid; d < hd; d += kThreads) {
    qs[d] = qh[d];
    acc[d] = 0.f;
  }
  if (tid == 0) {
    m_sh = -1e30f;
    sum_sh = 0.f;
  }
  __syncthreads();
  const int n_slots = n_window + k;
  for (int b0 = 0; b0 < n_slots; b0 += kBlock) {
    const int nb = min(kBlock, n_slots - b0);
    if (tid < nb) {
      const int j = b0 + tid;
      const float* p = nullptr;
      if (j < n_window) {
        p = window[int64_t(t) * n_window + j];
      } else {
        const int32_t e = topk[int64_t(t) * k + (j - n_window)];
        p = e >= 0 ? ckv + int64_t(e) * hd : nullptr;
      }
      slot[tid] = p;
    }
    __syncthreads();
    // Partial dot products: work item w = (slot j, lane L).
    for (int w = tid; w < nb * 8; w += kThreads) {
      const int j = w >> 3, lane = w & 7;
      const float* kp = slot[j];
      float a = 0.f;
      if (kp)
        for (int i = lane; i < hd; i += 8) a = __fadd_rn(a, __fmul_rn(qs[i], kp[i]));
      part[w] = a;
    }
    __syncthreads();
    if (tid < nb) {
      const float* pp = part + tid * 8;
      const float dot = __fadd_rn(__fadd_rn(__fadd_rn(pp[0], pp[1]), __fadd_rn(pp[2], pp[3])),
                                  __fadd_rn(__fadd_rn(pp[4], pp[5]), __fadd_rn(pp[6], pp[7])));
      s[tid] = slot[tid] ? __fmul_rn(dot, scale) : -INFINITY;
    }
    __syncthreads();
    if (tid == 0) {
      float bmax = -INFINITY;
      for (int j = 0; j < nb; ++j) bmax = bmax < s[j] ? s[j] : bmax;  // std::max(bmax, s[j])
      const float m = m_sh;
      mnew_sh = m < bmax ? bmax : m;  // std::max(m, bmax)
    }
    __syncthreads();
    const float m_new = mnew_sh;
    if (tid < nb) pb[tid] = slot[tid] ? exp_rn(__fadd_rn(s[tid], -m_new)) : 0.f;
    __syncthreads();
    if (tid == 0) {
      const float sc = exp_rn(__fadd_rn(m_sh, -m_new));
      float psum = 0.f;
      for (int j = 0; j < nb; ++j) psum = __fadd_rn(psum, pb[j]);
      sum_sh = __fadd_rn(__fmul_rn(sum_sh, sc), psum);
      sc_sh = sc;
      m_sh = m_new;
    }
    __syncthreads();
    if (tid < nb) pb[tid] = detail::round_bf16(pb[tid]);
    __syncthreads();
    const float sc = sc_sh;
    for (int d = tid; d < hd; d += kThreads) {
      float tmp = 0.f;
      for (int j = 0; j < nb; ++j) {
        const float* kp = slot[j];
        if (kp) tmp = __fadd_rn(tmp, __fmul_rn(pb[j], kp[d]));
      }
      acc[d] = __fadd_rn(__fmul_rn(acc[d], sc), tmp);
    }
    __syncthreads();  // slot / part / pb are rewritten by the next block
  }
  const float sum = __fadd_rn(sum_sh, exp_rn(__fadd_rn(sink[h], -m_sh)));
  float* o = out + (int64_t(t) * H + h) * hd;
  for (int d = tid; d < hd; d += kThreads) o[d] = detail::round_bf16(__fdiv_rn(acc[d], sum));
}

template <int S>
void launch_chunked(const float* q, int T, int H, int hd, const float* const* window, int n_window,
                    const int32_t* topk, int k, const float* ckv, const float* const* ckv_ref,
                    float scale, float* scratch, cudaStream_t stream) {
  const auto kernel = sparse_attn_chunk_kernel<S>;
  static const bool configured = [&] {
    UF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(fast_smem(S, kMaxHeadDim).total)));
    detail::prefer_shared_carveout(kernel);
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(fast_chunks(n_window + k)), unsigned(T),
                  unsigned((H + kHeadGroup - 1) / kHeadGroup));
  detail::launch_pdl(kernel, grid, dim3(kFastThreads), fast_smem(S, hd).total, stream, q, T, H, hd,
                     window, n_window, topk, k, ckv, ckv_ref, scale, scratch);
}

}  // namespace

void sparse_attn(const float* q, int T, int H, int hd, const float* const* window, int n_window,
                 const int32_t* topk, int k, const float* ckv, const float* sink, float scale,
                 float* out, cudaStream_t stream, const float* const* ckv_ref,
                 float* split_scratch) {
  require(T >= 0 && H > 0 && hd > 0 && hd <= kMaxHeadDim && n_window >= 0 && k >= 0,
          "sparse_attn: unsupported shape T=%d H=%d hd=%d n_window=%d k=%d (hd <= %d)", T, H, hd,
          n_window, k, kMaxHeadDim);
  require(n_window == 0 || window, "sparse_attn: n_window=%d but no window slot array", n_window);
  require(k == 0 || (topk && (ckv || ckv_ref)), "sparse_attn: k=%d but topk or ckv is null", k);
  if (T == 0) return;
  const int n_slots = n_window + k;
  // The chunked path needs whole float4 columns (16-byte aligned q, out, scratch) and a slot;
  // anything else (odd head_dim, an empty list, huge T or slot lists) takes the reference path.
  const bool aligned = ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(out) |
                         reinterpret_cast<uintptr_t>(split_scratch)) &
                        15u) == 0;
  if (split_scratch && hd % 4 == 0 && n_slots > 0 && int64_t(T) * H <= 65535 && aligned &&
      fast_chunks(n_slots) <= 2048) {
    const int nc = fast_chunks(n_slots);
    if (fast_chunk(n_slots) == 16)
      launch_chunked<16>(q, T, H, hd, window, n_window, topk, k, ckv, ckv_ref, scale, split_scratch,
                         stream);
    else
      launch_chunked<32>(q, T, H, hd, window, n_window, topk, k, ckv, ckv_ref, scale, split_scratch,
                         stream);
    const dim3 grid(unsigned((hd + kMergeCols - 1) / kMergeCols), unsigned(T * H));
    detail::launch_pdl(sparse_attn_merge_kernel, grid, dim3(kMergeWarps * 32),
                       size_t(kMergeWarps) * size_t(nc) * sizeof(float), stream,
                       static_cast<const float*>(split_scratch), T, H, hd, nc, sink, out);
    return;
  }
  const int64_t blocks = int64_t(T) * H;
  require(blocks < (int64_t(1) << 31), "sparse_attn: T*H=%lld blocks is too many",
          static_cast<long long>(blocks));
  const size_t smem = size_t(2) * size_t(hd) * sizeof(float);
  sparse_attn_kernel<<<unsigned(blocks), kThreads, smem, stream>>>(
      q, H, hd, window, n_window, topk, k, ckv, ckv_ref, sink, scale, out);
  UF_CUDA_CHECK(cudaGetLastError());
}

size_t sparse_attn_scratch_floats(int T, int H, int hd, int n_slots) {
  const size_t chunks = size_t((std::max(n_slots, 1) + kMinChunk - 1) / kMinChunk);
  return size_t(std::max(T, 0)) * size_t(H) * chunks * size_t(hd + 2);
}

void sparse_attn_chunk_override(int slots) {
  require(slots == 0 || slots == 16 || slots == 32,
          "sparse_attn_chunk_override: %d slots (0, 16 or 32)", slots);
  g_chunk_override = slots;
}

}  // namespace uf::cuda
