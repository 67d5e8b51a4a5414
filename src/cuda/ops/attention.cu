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
// Fast (chunked) path (a scratch buffer given; the decode callers): chunk records of 16 slots,
// then the merge (3. below). By default the records come from ONE kernel on the tensor cores
// (attention_chunk_mma.cu: bf16 mma products, each chunk's p against its own max; not the CPU's
// bits); with set_sparse_attn_chunk_mma(false), or where that kernel does not apply, from the
// CPU-order kernels 1 and 2 here. Those three PDL launches (each starts with
// griddepcontrol.wait) reproduce the CPU's p values and bf16 roundings exactly.
//  1. scores: one CTA of 128 threads per (16 slots, row, group of 8 heads; 4 while the 4-head
//     grid stays within 3 waves of the SMs, same bits) stages the slots' KV rows in shared memory
//     (16-byte cp.async; window rows fp32, top-k rows as the session's bf16 into a side buffer,
//     widened to fp32 once they land) and writes s_j = dot8(q_h, k_j) * scale for its heads (-inf
//     for empty slots) to the scratch [T, H, n_slots]: the CPU's dot8 lanes in the CPU's order with
//     __fmul_rn / __fadd_rn, so every s_j has the CPU's bits; and the max of the 16 scores per head
//     (so that kernel 2 reads 40 maxes, not 640 scores, for its base).
//  2. P.V: one CTA of 256 threads per (chunk of S = 16 slots, row, head group of 8, or of 4 on
//     the scores' rule: same bits; 32 slots is kept for benchmarks,
//     sparse_attn_chunk_override). Its slot pointers and KV rows are read BEFORE its PDL wait
//     (written by kernels that completed before kernel 1's wait returned; see the kernel). A chunk
//     lies in one 64-slot block b of the CPU loop; warp h takes the CPU's running max after that
//     block, M_b = max(-1e30, s_0 .. s_{64(b+1)-1}) (from kernel 1's 16-slot maxes; max is exact in
//     any order), then p_j = exp(s_j - M_b) with the float subtraction and a correctly rounded exp
//     (double, one rounding: ~0.1 us of FP64 latency), psum_c = butterfly sum of the unrounded p_j,
//     and bf16(p_j) for P.V over the re-staged KV rows (L2 hits, staged while kernel 1 runs):
//     thread (float4 column f, slot group sg) sums bf16(p_j) * k_j over j = sg, sg + ng, ... with
//     FMAs, the group sums added in group order. It writes (M_b, psum_c) and acc_c[hd] per head.
//  3. merge: 4 warps per (row, head, 128 columns), each summing a quarter of the chunks in
//     chunk order, the quarters added in order: M = max M_b (= the CPU's final max),
//     w_c = exp(M_b - M), den = butterfly sum of w_c * psum_c + exp(sink - M),
//     out = bf16(sum_c w_c acc_c / den), then the inverse rope with (cos, sin) computed before
//     the PDL wait. It triggers its dependents at its start, so wo_a's weight copies (before its
//     own wait) run under it; kernels 1 and 2 trigger after their waits (kernel 2 reads slot
//     pointers and KV rows before its wait; an early P.V trigger measured slower: docs/perf.md).
//  Every p_j and bf16(p_j) equals the CPU's (up to the glibc expf vs correctly rounded exp
//  difference of the reference path); only the fp32 sums are re-associated (chunk weights
//  instead of the CPU's running products exp(m - m_new), FMA P.V), which flips a bf16 output
//  rarely (tests/cuda/test_ops_attention.cpp states the bound). Every order depends on the slot
//  count and head_dim only, never on T or on other rows (spec == plain).
//
// A one-launch form (a thread-block cluster per row and head group running kernels 1-3 with the
// values in distributed shared memory, bitwise the same) was tried in session 7 and removed: one
// ~156 KB CTA fits an SM and each ran its four chunks' P.V in series, 2x slower on the H200
// (26.8 / 53.9 us against 14.1 / 21.7 at 1 / 8 rows; docs/perf.md).
//
// A row's result depends on its own inputs only (spec == plain). No allocation, no atomics.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/probe.cuh"
#include "cuda/ops/attention.h"
#include "cuda/ops/attention_slots.cuh"
#include "cuda/ops/attention_split.cuh"
#include "cuda/ops/elementwise.h"
#include "cuda/ops/elementwise_common.cuh"

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
constexpr int kScoreChunk = 16;     // slots per scores CTA (whatever the P.V chunk)
constexpr int kScoreThreads = 128;  // (slot, dot8 half, head quarter): 16 x 2 x 4
static_assert(kScoreThreads == kScoreChunk * 2 * 4, "one thread per work item");

__device__ __forceinline__ float exp_rn(float x) { return float(exp(double(x))); }

int g_chunk_override = 0;        // sparse_attn_chunk_override (benchmarks)
bool g_chunk_mma = true;         // set_sparse_attn_chunk_mma
int g_chunk_heads_override = 0;  // sparse_attn_chunk_heads_override (tests)
int fast_chunk(int n_slots) {
  (void)n_slots;  // chunks of 16: 40 CTAs a row for 128 + 512 slots
  return g_chunk_override ? g_chunk_override : 16;
}
int fast_chunks(int n_slots) { return (n_slots + fast_chunk(n_slots) - 1) / fast_chunk(n_slots); }
using attn_split::kMinChunk;  // the scratch is sized for chunks of 16 (any rule above fits)
using attn_split::scratch_cmax;
using attn_split::scratch_scores;
using attn_split::scratch_stats;
static_assert(kBlock % 32 == 0 && kBlock % kMinChunk == 0, "a chunk lies inside one 64-block");

// Row stride of the staged KV rows in float4s: odd, so that 8 lanes reading 8 different rows at
// the same column hit 8 distinct 16-byte bank groups (conflict-free).
__host__ __device__ constexpr int kv_stride4(int hd4) { return hd4 % 2 ? hd4 : hd4 + 1; }
// P.V slot groups: 256 threads over hd4 columns (2 for hd 512; 1 from hd 516 up).
__host__ __device__ constexpr int pv_groups(int hd4) {
  return hd4 >= kFastThreads ? 1 : (kFastThreads / hd4 < 4 ? kFastThreads / hd4 : 4);
}

// Shared memory of the scores kernel (floats): the 16 staged KV rows, then q of the kHeads heads.
// Strides in float4s chosen for the dot loop's lanes (4 slots x 2 halves x 4 head quarters a
// warp): KV rows = 2 (mod 8) so that slots 4w .. 4w + 3 at the columns f, f + 1 hit 8 distinct
// 16-byte bank groups; q heads = 1 (mod 8) with 2 heads a thread (8 heads a CTA), 2 (mod 8) with
// one (4 heads a CTA), so that the 4 quarters' heads at f, f + 1 do too: every LDS.128 of the
// loop is 8 distinct addresses, one wavefront.
__host__ __device__ constexpr int pad4(int hd4, int r) { return hd4 + ((r - hd4) % 8 + 8) % 8; }
__host__ __device__ constexpr int score_kv_stride4(int hd4) { return pad4(hd4, 2); }
template <int kHeads>
__host__ __device__ constexpr int score_q_stride4(int hd4) {
  return pad4(hd4, kHeads == 8 ? 1 : 2);
}
__host__ __device__ inline size_t score_smem_q(int hd) {
  return size_t(kScoreChunk) * score_kv_stride4(hd / 4) * 4;
}
// (+ 2 float4s of slack: the dot loop's last prefetch reads up to 2 columns past a row), then the
// top-k rows' bf16 copies [16][hd] (score_smem_bf16: a 16-byte aligned offset).
template <int kHeads>
__host__ __device__ inline size_t score_smem_bf16(int hd) {
  return (score_smem_q(hd) + size_t(kHeads) * score_q_stride4<kHeads>(hd / 4) * 4 + 8) *
         sizeof(float);
}
template <int kHeads>
__host__ __device__ inline size_t score_smem_bytes(int hd) {
  return score_smem_bf16<kHeads>(hd) + size_t(kScoreChunk) * hd * sizeof(uint16_t);
}
// Shared memory of the P.V kernel (floats): staged KV rows, the group sums, bf16(p) [S][8].
struct PvSmem {
  size_t red, ps, total;  // offsets in floats (total: bytes)
};
__host__ __device__ inline PvSmem pv_smem(int S, int hd) {
  PvSmem m{};
  m.red = size_t(S) * kv_stride4(hd / 4) * 4;
  m.ps = m.red + size_t(pv_groups(hd / 4) - 1) * kHeadGroup * hd;
  m.total = (m.ps + size_t(S) * kHeadGroup) * sizeof(float);
  return m;
}

// The pointer of slot j of row t (nullptr: empty), for the P.V kernel BEFORE its PDL wait: the
// loads bypass L1 (ld.global.cg: L2 is the coherence point, so no line an earlier grid left in
// this SM's L1 can be read), and the values were written by kernels that completed before the
// scores kernel's wait returned (see sparse_attn_pv_kernel).
template <typename T>
__device__ __forceinline__ const T* ldcg_ptr(const T* const* p) {
  return reinterpret_cast<const T*>(__ldcg(reinterpret_cast<const unsigned long long*>(p)));
}
// Window slots point at fp32 rows, top-k slots at bf16 rows (attention_slots.cuh's KvRow).
__device__ __forceinline__ const void* slot_ptr_cg(int t, int j, const float* const* window,
                                                   int n_window, const int32_t* topk, int k,
                                                   const uint16_t* ckv,
                                                   const uint16_t* const* ckv_ref, int hd) {
  if (j < n_window) return ldcg_ptr(window + int64_t(t) * n_window + j);
  const int32_t e = __ldcg(topk + int64_t(t) * k + (j - n_window));
  if (ckv_ref) ckv = ldcg_ptr(ckv_ref);
  return e >= 0 ? ckv + int64_t(e) * hd : nullptr;
}

__device__ __forceinline__ void cp_async16(float4* dst, const float4* src) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

// Stage rows slot[0 .. nb) (present ones) at kv4 + j * st4: rows j < nfp are fp32 (window
// slots), the rest bf16 (top-k slots: the session's compressed KV), staged as bf16 at the same row
// base (a row's region holds 4 hd bytes; the bf16 row uses the first half; its readers take
// kv_bf16_row). 16-byte cp.async (all in flight at once), or plain loads for a row that is not
// 16-byte aligned. kCg: loads through L2 only (the P.V kernel's copies before its PDL wait, like
// the cp.async.cg ones). The caller commits and waits.
__device__ __forceinline__ void cp_async16_raw(void* dst, const void* src) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
template <bool kCg>
__device__ __forceinline__ void stage_rows(float4* kv4, int st4, const void* const* slot, int nfp,
                                           int nb, int hd4, int tid, int nthreads,
                                           uint16_t* bf16_rows = nullptr) {
  // Row j's bf16 destination: its own region, or bf16_rows[j] (then widen_rows converts it).
  const auto bf16_dst = [&](int j) {
    return bf16_rows ? bf16_rows + j * 4 * hd4 : reinterpret_cast<uint16_t*>(kv4 + j * st4);
  };
  for (int i = tid; i < nfp * hd4; i += nthreads) {
    const int j = i / hd4, f = i - j * hd4;
    const float* p = static_cast<const float*>(slot[j]);
    if (!p) continue;
    float4* dst = kv4 + j * st4 + f;
    if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0)
      cp_async16_raw(dst, p + 4 * f);
    else if (kCg)
      *dst = make_float4(__ldcg(p + 4 * f), __ldcg(p + 4 * f + 1), __ldcg(p + 4 * f + 2),
                         __ldcg(p + 4 * f + 3));
    else
      *dst = make_float4(p[4 * f], p[4 * f + 1], p[4 * f + 2], p[4 * f + 3]);
  }
  // bf16 rows: 16-byte pieces (8 values) when the row allows, else 2-byte copies.
  const int hd = 4 * hd4, nbf = nb - nfp;
  if (hd % 8 == 0) {
    const int hd8 = hd / 8;
    for (int i = tid; i < nbf * hd8; i += nthreads) {
      const int j = nfp + i / hd8, f = i % hd8;
      const uint16_t* p = static_cast<const uint16_t*>(slot[j]);
      if (!p) continue;
      uint4* dst = reinterpret_cast<uint4*>(bf16_dst(j)) + f;
      if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0)
        cp_async16_raw(dst, p + 8 * f);
      else
        for (int e = 0; e < 8; ++e)
          reinterpret_cast<uint16_t*>(dst)[e] = kCg ? __ldcg(p + 8 * f + e) : p[8 * f + e];
    }
  } else {
    for (int i = tid; i < nbf * hd; i += nthreads) {
      const int j = nfp + i / hd, e = i % hd;
      const uint16_t* p = static_cast<const uint16_t*>(slot[j]);
      if (p) bf16_dst(j)[e] = kCg ? __ldcg(p + e) : p[e];
    }
  }
  detail::cp_async_commit();
}

// Elements 4f .. 4f + 3 of a bf16 row staged by stage_rows at `row` (its fp32 region's base).
__device__ __forceinline__ float4 kv_bf16_col(const float4* row, int f) {
  return detail::bf16x4_to_float4(reinterpret_cast<const uint2*>(row)[f]);
}

// The bf16 rows nfp .. nb - 1 that stage_rows put at bf16_rows, as fp32 rows at kv4 + j * st4
// (after the copies landed and a barrier; the caller syncs again before reading kv4). Each value
// is converted once, not once per reading thread.
__device__ __forceinline__ void widen_rows(float4* kv4, int st4, const uint16_t* bf16_rows,
                                           const void* const* slot, int nfp, int nb, int hd4,
                                           int tid, int nthreads) {
  for (int i = tid; i < (nb - nfp) * hd4; i += nthreads) {
    const int j = nfp + i / hd4, f = i % hd4;
    if (slot[j])
      kv4[j * st4 + f] =
          detail::bf16x4_to_float4(reinterpret_cast<const uint2*>(bf16_rows + j * 4 * hd4)[f]);
  }
}

// Rotates the rotated channels [hd - rope_dim, hd) of n staged head vectors (stride hd) of row t
// forward, rope_kernel's operations; threads tid < n * rope_dim / 2 of nthreads.
__device__ __forceinline__ void rotate_staged(float* v, int n, int hd, const AttnRope& rope, int t,
                                              int tid, int nthreads) {
  const int half = rope.rope_dim / 2;
  const int64_t pos = rope.positions ? rope.positions[t] : rope.p0 + t;
  for (int k = tid; k < n * half; k += nthreads) {
    const int h = k / half, i = k % half;
    float c, s;
    ew::rope_cos_sin(pos, rope.freqs[i], false, &c, &s);
    ew::rope_pair(v + int64_t(h) * hd + (hd - rope.rope_dim) + 2 * i, c, s);
  }
}

// The scores kernel's dot loop of one thread: dot8 lanes 4hf .. 4hf + 3 of kHt heads against the
// staged fp32 row kr. The operands of column f + 2 load while column f's are multiplied (one warp
// an SM sub-partition at one row: the loads' latency is hidden by this thread's own work). The
// last prefetch reads past the row into the next one or the slack after q, and is never used.
template <int kHt>
__device__ __forceinline__ void score_dot(float (&a)[kHt][4], const float4* kr, const float4* qh,
                                          int qs4, int hf, int hd4) {
  const auto col = [kr](int f) { return kr[f]; };
  float4 x = col(hf), u[kHt];
#pragma unroll
  for (int hh = 0; hh < kHt; ++hh) u[hh] = qh[hh * qs4 + hf];
#pragma unroll 4
  for (int f = hf; f < hd4; f += 2) {
    const float4 xn = col(f + 2);
    float4 un[kHt];
#pragma unroll
    for (int hh = 0; hh < kHt; ++hh) un[hh] = qh[hh * qs4 + f + 2];
#pragma unroll
    for (int hh = 0; hh < kHt; ++hh) {
      a[hh][0] = __fadd_rn(a[hh][0], __fmul_rn(u[hh].x, x.x));
      a[hh][1] = __fadd_rn(a[hh][1], __fmul_rn(u[hh].y, x.y));
      a[hh][2] = __fadd_rn(a[hh][2], __fmul_rn(u[hh].z, x.z));
      a[hh][3] = __fadd_rn(a[hh][3], __fmul_rn(u[hh].w, x.w));
      u[hh] = un[hh];
    }
    x = xn;
  }
}

// Kernel 1: s_j = dot8(q_h, k_j) * scale for 16 slots and kHeads heads (8, or 4 when the grid
// of 8-head CTAs would leave most SMs idle: more CTAs, each half the dot work; every score and
// chunk max has the same bits either way), into the scores scratch (-inf for empty slots).
// Thread (slot j, half hf, head quarter hq) computes the dot8 lanes 4hf .. 4hf + 3 of the heads
// hq * kHeads / 4 .. + kHeads / 4, i.e. the float4 columns f = hf, hf + 2, ... (element 4f + e is
// dot8 lane 4hf + e), each lane summed in increasing element order with __fmul_rn / __fadd_rn;
// the two halves meet through one shuffle as ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)). Lanes: bit 0
// hf, bits 1-2 hq, bits 3-4 the slot's low bits; warp w holds slots 4w .. 4w + 3. Each chunk max
// is taken by one thread over the 16 scores in exactly the tree of the xor butterfly (8, 4, 2, 1)
// seen from lane 0 that it replaced, so that even +-0 and NaN ties resolve as before.
template <int kHeads>
__global__ void __launch_bounds__(kScoreThreads)
    sparse_attn_scores_kernel(const float* __restrict__ q, int T, int H, int hd,
                              const float* const* window, int n_window,
                              const int32_t* __restrict__ topk, int k, const uint16_t* ckv,
                              const uint16_t* const* ckv_ref, float scale, AttnRope rope,
                              float* __restrict__ scores, float* __restrict__ cmax) {
  extern __shared__ __align__(16) float smem[];
  __shared__ const void* slot[kScoreChunk];
  __shared__ float2 rope_cs[kMaxHeadDim / 2];  // (cos, sin) of each rotated pair of row t
  __shared__ float sc[kHeads][kScoreChunk];    // the scores, for the chunk maxes
  constexpr int kHt = kHeads / 4;              // heads a thread
  static_assert(kHeads == 8 || kHeads == 4, "8 or 4 heads a CTA");
  const int c = blockIdx.x, t = blockIdx.y, h0 = blockIdx.z * kHeads, tid = threadIdx.x;
  const int nh = min(kHeads, H - h0), hd4 = hd / 4, st4 = score_kv_stride4(hd4);
  const int qs4 = score_q_stride4<kHeads>(hd4);
  const int n_slots = n_window + k, j0 = c * kScoreChunk, nb = min(kScoreChunk, n_slots - j0);
  const int nfp = max(0, min(nb, n_window - j0));  // the chunk's window slots (fp32 rows) first
  float4* kv4 = reinterpret_cast<float4*>(smem);
  float4* q4 = reinterpret_cast<float4*>(smem + score_smem_q(hd));

  // Probe points: 0 start, 1 PDL wait returned, 2 q staged (and the KV copies issued, the rope
  // angles computed), 3 q rotated (this thread's pairs), 4 KV rows landed, 5 end.
  UF_PROBE_OPEN_IF(probe, kTagAttnScores,
                   tid == 0 && blockIdx.y == 0 && blockIdx.z == 0 &&
                       (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1));
  UF_PROBE_MARK(probe, 0);
  // q, the window pointers, the top-k ids and the KV rows all come from earlier kernels.
  detail::pdl_wait();
  UF_PROBE_MARK(probe, 1);
  // After the wait, never before: sparse_attn_pv_kernel reads the top-k ids, window pointers
  // and KV rows before its own wait, which is safe only while this kernel triggers here.
  detail::pdl_trigger();
  // The KV copies wait on the slot pointers (a top-k id, then its row): their loads are issued
  // first, then the rope inputs' and q's copies, all in flight together; the values are used
  // only after the q copies were issued.
  const int js = j0 + tid;  // thread tid < nb: slot js (slot_ptr's loads, its select deferred)
  const float* wslot = nullptr;
  int32_t eid = -1;
  if (tid < nb) {
    if (js < n_window) {
      wslot = window[int64_t(t) * n_window + js];
    } else {
      eid = topk[int64_t(t) * k + (js - n_window)];
      if (ckv_ref) ckv = *ckv_ref;
    }
  }
  const int half = rope.freqs ? rope.rope_dim / 2 : 0;
  int64_t pos = 0;
  float freq0 = 0.f;  // the frequency of pair tid (the first this thread's angle loop takes)
  if (tid < half) {
    pos = rope.positions ? rope.positions[t] : rope.p0 + t;
    freq0 = rope.freqs[tid];
  }
  const float4* qg = reinterpret_cast<const float4*>(q + (int64_t(t) * H + h0) * hd);
#pragma unroll
  for (int h = 0; h < kHeads; ++h)
    for (int f = tid; f < hd4; f += kScoreThreads) {
      if (h < nh)  // q is 16-byte aligned (the host checks) and hd % 4 == 0
        cp_async16(q4 + h * qs4 + f, qg + h * hd4 + f);
      else
        q4[h * qs4 + f] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  detail::cp_async_commit();  // group 1: q
  if (tid < kScoreChunk)
    slot[tid] = js < n_window ? static_cast<const void*>(wslot)
                              : (eid >= 0 ? ckv + int64_t(eid) * hd : nullptr);
  __syncthreads();
  uint16_t* kvh = reinterpret_cast<uint16_t*>(reinterpret_cast<uint8_t*>(smem) +
                                              score_smem_bf16<kHeads>(hd));  // top-k rows (bf16)
  stage_rows<false>(kv4, st4, slot, nfp, nb, hd4, tid, kScoreThreads, kvh);  // group 2: KV rows
  // The rope angles depend on the row's position and the pair only, not on the head: each
  // (cos, sin) is computed once (rope_cos_sin, the same call on the same inputs as rope_kernel's),
  // while the copies fly.
  for (int i = tid; i < half; i += kScoreThreads)
    ew::rope_cos_sin(pos, i == tid ? freq0 : rope.freqs[i], false, &rope_cs[i].x, &rope_cs[i].y);
  detail::cp_async_wait<1>();  // this thread's q copies landed (the KV rows may still fly)
  __syncthreads();
  UF_PROBE_MARK(probe, 2);
  // q's rotary embedding on the staged copy (rope_kernel's operations), under the KV copies.
  for (int w = tid; w < nh * half; w += kScoreThreads) {
    const int h = w / half, i = w - h * half;
    ew::rope_pair(reinterpret_cast<float*>(q4 + h * qs4) + (hd - 2 * half) + 2 * i, rope_cs[i].x,
                  rope_cs[i].y);
  }
  UF_PROBE_MARK(probe, 3);
  detail::cp_async_wait<0>();
  __syncthreads();  // the KV rows and the rotated q are visible to every thread
  if (nfp < nb) {   // the top-k rows widened to fp32 once (uniform over the CTA)
    widen_rows(kv4, st4, kvh, slot, nfp, nb, hd4, tid, kScoreThreads);
    __syncthreads();
  }
  UF_PROBE_MARK(probe, 4);

  // Rows of empty or missing slots hold stale shared memory: their sums are computed anyway (no
  // divergence) and never written.
  const int hf = tid & 1, hq = (tid >> 1) & 3, j = ((tid >> 3) & 3) + 4 * (tid >> 5);
  float a[kHt][4];
#pragma unroll
  for (int hh = 0; hh < kHt; ++hh) a[hh][0] = a[hh][1] = a[hh][2] = a[hh][3] = 0.f;
  const float4* kr = kv4 + j * st4;
  const float4* qh = q4 + hq * kHt * qs4;
  score_dot<kHt>(a, kr, qh, qs4, hf, hd4);
  const bool present = j < nb && slot[j];
#pragma unroll
  for (int hh = 0; hh < kHt; ++hh) {
    const float mine = __fadd_rn(__fadd_rn(a[hh][0], a[hh][1]), __fadd_rn(a[hh][2], a[hh][3]));
    const float other = __shfl_xor_sync(0xffffffffu, mine, 1);  // the other half
    // Addition commutes bitwise: both halves hold ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)).
    const float dot = hf == 0 ? __fadd_rn(mine, other) : __fadd_rn(other, mine);
    const int h = hq * kHt + hh;
    const float sj = present ? __fmul_rn(dot, scale) : -INFINITY;
    if (hf == 0) {
      sc[h][j] = sj;
      if (h < nh && j < nb) scores[(int64_t(t) * H + h0 + h) * n_slots + j0 + j] = sj;
    }
  }
  __syncthreads();
  if (tid < nh) {  // the chunk max of head tid: lane 0's view of the butterfly, step by step
    const float* v = sc[tid];
    const auto sel = [](float m, float o) { return m < o ? o : m; };  // mine, then partner's
    float m8[8], m4[4];
#pragma unroll
    for (int l = 0; l < 8; ++l) m8[l] = sel(v[l], v[l + 8]);  // lanes 0..7 after xor 8
#pragma unroll
    for (int l = 0; l < 4; ++l) m4[l] = sel(m8[l], m8[l + 4]);     // lanes 0..3 after xor 4
    const float m2a = sel(m4[0], m4[2]), m2b = sel(m4[1], m4[3]);  // lanes 0, 1 after xor 2
    cmax[(int64_t(t) * H + h0 + tid) * gridDim.x + c] = sel(m2a, m2b);
  }
  UF_PROBE_MARK(probe, 5);
}

// sum_j bf16(p_j[h]) * k_j[4f .. 4f + 3] over the present slots j = j_first, j_first + step, ...
// < nb, in slot order, for the kH heads of the CTA (8, or 4: each head's sums are the same
// either way). present: bit j set when slot j holds a row (a register, so that the loop's
// shared-memory loads do not wait on a slot-pointer load).
template <int kH>
__device__ __forceinline__ void pv_sum(float4 (&acc)[kH], const float4* kv4, int st4,
                                       const float* ps, uint32_t present, int f, int j_first,
                                       int step, int nb, int nfp) {
#pragma unroll
  for (int h = 0; h < kH; ++h) acc[h] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 2
  for (int j = j_first; j < nb; j += step) {
    if (!((present >> j) & 1u)) continue;  // the same for every thread: empty rows were not staged
    // Slots j >= nfp hold bf16 rows (stage_rows); j is the same for every thread.
    const float4 kf = j >= nfp ? kv_bf16_col(kv4 + j * st4, f) : kv4[j * st4 + f];
    const float4* pj = reinterpret_cast<const float4*>(ps + j * kHeadGroup);
    const float4 pa = pj[0], pb = kH > 4 ? pj[1] : pa;
    const float pp[8] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
    for (int h = 0; h < kH; ++h) {
      acc[h].x = fmaf(pp[h], kf.x, acc[h].x);
      acc[h].y = fmaf(pp[h], kf.y, acc[h].y);
      acc[h].z = fmaf(pp[h], kf.z, acc[h].z);
      acc[h].w = fmaf(pp[h], kf.w, acc[h].w);
    }
  }
}

// Kernel 2: one CTA per (chunk of S slots, row, head group). The chunk lies in the CPU's 64-slot
// block b; its base is the CPU's running max after block b, M_b = max(-1e30, s_0 .. s_{64(b+1)-1})
// (warp h over the scores of head h, max is exact in any order), p_j = exp(s_j - M_b) exactly as
// the CPU (float subtraction, correctly rounded exp), psum = butterfly sum of the unrounded p_j,
// bf16(p_j) for P.V over the re-staged KV rows (copied before the PDL wait, while kernel 1 runs).
// Writes (M_b, psum) and the chunk's P.V per head. kH heads a CTA (8, or 4 where the 8-head grid
// is small): warp h < kH takes head h0 + h's softmax; every head's values and sums are the same.
template <int S, int kH>
__global__ void __launch_bounds__(kFastThreads)
    sparse_attn_pv_kernel(int T, int H, int hd, const float* const* window, int n_window,
                          const int32_t* __restrict__ topk, int k, const uint16_t* ckv,
                          const uint16_t* const* ckv_ref, float* __restrict__ scratch) {
  static_assert(S <= 32 && kBlock % S == 0, "a chunk is at most a warp and inside one block");
  static_assert(kH == kHeadGroup || kH == 4, "8 or 4 heads a CTA");
  extern __shared__ __align__(16) float smem[];
  __shared__ const void* slot[S];
  const int c = blockIdx.x, t = blockIdx.y, h0 = blockIdx.z * kH, tid = threadIdx.x;
  const int nh = min(kH, H - h0), hd4 = hd / 4, st4 = kv_stride4(hd4);
  const int n_slots = n_window + k, nc = gridDim.x, j0 = c * S, nb = min(S, n_slots - j0);
  const int nfp = max(0, min(nb, n_window - j0));  // window slots (fp32 rows), then bf16 rows
  const PvSmem L = pv_smem(S, hd);
  float4* kv4 = reinterpret_cast<float4*>(smem);
  float* ps = smem + L.ps;  // [S][8] bf16(p)

  // Probe points: 0 start, 1 PDL wait returned (the slot pointers read and the KV copies issued
  // before it), 2 the scores and chunk maxes landed (M_b reduced), 3 bf16(p) in shared memory and
  // the KV rows landed, 4 end.
  UF_PROBE_OPEN_IF(probe, kTagAttnPv,
                   tid == 0 && blockIdx.y == 0 && blockIdx.z == 0 &&
                       (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1));
  UF_PROBE_MARK(probe, 0);
  // Before the wait: the slot pointers (the window table, the top-k ids, the ckv base) and the KV
  // rows. None of them is written by the scores kernel (it writes only the scores and chunk
  // maxes), and every kernel before it had completed, its writes visible, when this grid
  // started: this grid launches only once every scores CTA has executed launch_dependents, which
  // each does after its own griddepcontrol.wait has returned, i.e. after all earlier grids
  // completed. The loads go through L2 only (ld.global.cg, cp.async.cg). Nothing is written to
  // global memory before the wait, and the scratch (the scores kernel's output) is read after it.
  if (tid < S)
    slot[tid] =
        tid < nb ? slot_ptr_cg(t, j0 + tid, window, n_window, topk, k, ckv, ckv_ref, hd) : nullptr;
  __syncthreads();
  stage_rows<true>(kv4, st4, slot, nfp, nb, hd4, tid, kFastThreads);
  const int lane = tid % 32;
  const bool present = lane < nb && slot[lane] != nullptr;  // the softmax's slot j0 + lane
  const uint32_t present_bits = __ballot_sync(0xffffffffu, present);  // slot j: bit j (S <= 32)

  detail::pdl_wait();  // the scores come from kernel 1
  UF_PROBE_MARK(probe, 1);
  detail::pdl_trigger();

  if (tid / 32 < kH) {  // warp h: head h0 + h (a head past H reads head nh - 1, writes nothing)
    const int h = tid / 32;
    const int64_t th = int64_t(t) * H + h0 + min(h, nh - 1);
    const float* srow = scratch + scratch_scores(T, H, hd, nc) + th * n_slots;
    // The 16-slot chunk maxes of kernel 1 over slots [0, 64(b + 1)): at most 40 for 640 slots.
    const int n16 = (n_slots + kScoreChunk - 1) / kScoreChunk;
    const float* crow = scratch + scratch_cmax(T, H, hd, nc, n_slots) + th * n16;
    const int end = min(n16, (j0 / kBlock + 1) * (kBlock / kScoreChunk));
    // All loaded at once: s_j and the maxes i = lane, lane + 32 (every list up to 1024 slots;
    // longer ones load the rest in the loop). The maxes are taken in the same order as the loop
    // over i = lane, lane + 32, ... from -inf (a missing i is -inf, which the select ignores:
    // the same value as not taking that step).
    const float s_j = present ? srow[j0 + lane] : 0.f;
    const float v0 = lane < end ? crow[lane] : -INFINITY;
    const float v1 = lane + 32 < end ? crow[lane + 32] : -INFINITY;
    float mx = -INFINITY;
    mx = mx < v0 ? v0 : mx;
    mx = mx < v1 ? v1 : mx;
    for (int i = lane + 64; i < end; i += 32) {
      const float v = crow[i];
      mx = mx < v ? v : mx;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, mx, o);
      mx = mx < v ? v : mx;
    }
    const float m = -1e30f < mx ? mx : -1e30f;  // the CPU's running max starts at -1e30
    UF_PROBE_MARK(probe, 2);
    const float p = present ? exp_rn(__fadd_rn(s_j, -m)) : 0.f;
    float sum = p;  // xor butterfly: every lane ends with the same, fixed-order sum
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane < S) ps[lane * kHeadGroup + h] = detail::round_bf16(p);
    if (lane == 0 && h < nh) {
      float* rec = scratch + scratch_stats(T, H, hd, nc) + ((int64_t(t) * H + h0 + h) * nc + c) * 2;
      rec[0] = m;
      rec[1] = sum;
    }
  }
  detail::cp_async_wait<0>();
  __syncthreads();
  UF_PROBE_MARK(probe, 3);

  // P.V: thread (column f, slot group sg) over the slots j = sg, sg + ng, ...
  const int ng = pv_groups(hd4);
  float4* accg = reinterpret_cast<float4*>(scratch);
  if (ng == 1) {
    for (int f = tid; f < hd4; f += kFastThreads) {
      float4 acc[kH];
      pv_sum<kH>(acc, kv4, st4, ps, present_bits, f, 0, 1, nb, nfp);
      for (int h = 0; h < nh; ++h) accg[((int64_t(t) * H + h0 + h) * nc + c) * hd4 + f] = acc[h];
    }
    UF_PROBE_MARK(probe, 4);
    return;
  }
  // ng > 1 means hd4 * ng <= 256: at most one item per thread. Groups 1.. hand their sums to
  // group 0 through shared memory, added in group order.
  const int f = tid % hd4, sg = tid / hd4;
  const bool active = tid < hd4 * ng;
  float4 acc[kH];
  if (active) pv_sum<kH>(acc, kv4, st4, ps, present_bits, f, sg, ng, nb, nfp);
  float4* red = reinterpret_cast<float4*>(smem + L.red);
  if (active && sg > 0)
#pragma unroll
    for (int h = 0; h < kH; ++h) red[((sg - 1) * kHeadGroup + h) * hd4 + f] = acc[h];
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
  UF_PROBE_MARK(probe, 4);
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
                             const float* __restrict__ sink, AttnRope rope,
                             float* __restrict__ out) {
  extern __shared__ float wsh_all[];  // [kMergeWarps][nc] chunk weights, one copy per warp
  __shared__ float4 red[kMergeWarps][32];
  __shared__ float2 rcs[2][32];  // the inverse rope's (cos, sin) of pairs 2f, 2f + 1 (rotated)
  const int th = blockIdx.y, h = th % H, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hd4 = hd / 4, f = blockIdx.x * 32 + lane;
  const bool col = f < hd4;
  // Probe points: 0 start, 1 PDL wait returned (sink and the inverse rope's cos / sin ready
  // before it), 2 the chunk statistics landed (M reduced), 3 den and the weights known, 4 end.
  UF_PROBE_OPEN_IF(
      probe, kTagAttnMerge,
      threadIdx.x == 0 && blockIdx.x == 0 && (blockIdx.y == 0 || blockIdx.y == gridDim.y - 1));
  UF_PROBE_MARK(probe, 0);
  // Before the wait: what no kernel of this call writes. sink and the rope frequencies are model
  // weights; the positions are the step block's (uploaded before the step's first kernel) and,
  // whoever wrote them, were complete when this grid started: it launches only once every P.V
  // CTA has executed launch_dependents, after its wait, i.e. after the scores kernel completed,
  // which in turn had waited for every earlier grid (or, on the tensor-core records, once every
  // attention_chunk_mma CTA has passed its own wait, which returns after every earlier grid). So
  // the inverse rope's (cos, sin) of the output's two pairs per float4 column (rope_cos_sin: the
  // same call on the same inputs as after the wait) are computed here, off the chain: lane (warp w
  // < 2, column f) that of pair w, into rcs[w] (one call a thread: no value lives across the double
  // sincos's slow-path call), read by warp 0 after the barrier before the final sum. ld.global.cg:
  // no line an earlier grid left in L1 is read. The next kernel may launch now (session 20: wo_a's
  // 4 MB of weights then land while this runs, not after: 7-row step -75 us, 1 row -60, 4 rows
  // +40): whatever follows reads before its wait only weights (wo_a, DenseMma), or nothing (the
  // next row chunk's scores kernel).
  detail::pdl_trigger();
  const float sink_h = __ldcg(sink + h);
  const int r0 = hd - rope.rope_dim;
  const bool rot = rope.freqs && col && 4 * f >= r0;  // this column holds rotated channels
  if (rot && warp < 2) {
    const int t = th / H, i = (4 * f - r0) / 2 + warp;
    const int64_t pos = rope.positions ? __ldcg(rope.positions + t) : rope.p0 + t;
    float c, s;
    ew::rope_cos_sin(pos, __ldcg(rope.freqs + i), true, &c, &s);
    rcs[warp][lane] = make_float2(c, s);
  }

  detail::pdl_wait();
  UF_PROBE_MARK(probe, 1);
  const int c0 = warp * nc / kMergeWarps, c1 = (warp + 1) * nc / kMergeWarps;
  // The (M_b, psum) pairs of chunks lane and lane + 32 load first (the max waits on them), then the
  // chunk records (64-bit loads: the pair is 8-byte aligned); longer lists load the rest in the
  // loops. The max and den take the chunks c = lane, lane + 32, ... in that order as before; a
  // missing chunk is -inf for the max (the select ignores it: the same value as not taking the
  // step) and skipped for den.
  const float2* st =
      reinterpret_cast<const float2*>(scratch + size_t(T) * H * nc * hd) + int64_t(th) * nc;
  float* wsh = wsh_all + warp * nc;
  const bool has0 = lane < nc, has1 = lane + 32 < nc;
  const float2 s0 = has0 ? st[lane] : make_float2(-INFINITY, 0.f);
  const float2 s1 = has1 ? st[lane + 32] : make_float2(-INFINITY, 0.f);
  const float4* acc =
      reinterpret_cast<const float4*>(scratch) + int64_t(th) * nc * hd4 + (col ? f : 0);
  float4 v[kMergePrefetch];
#pragma unroll
  for (int u = 0; u < kMergePrefetch; ++u)
    v[u] = c0 + u < c1 ? acc[int64_t(c0 + u) * hd4] : make_float4(0.f, 0.f, 0.f, 0.f);

  float mx = -INFINITY;
  mx = mx < s0.x ? s0.x : mx;
  mx = mx < s1.x ? s1.x : mx;
  for (int c = lane + 64; c < nc; c += 32) mx = mx < st[c].x ? st[c].x : mx;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float x = __shfl_xor_sync(0xffffffffu, mx, o);
    mx = mx < x ? x : mx;
  }
  UF_PROBE_MARK(probe, 2);
  // The three exps are independent and unconditional (no divergent branch: one FP64 latency,
  // not three); a missing chunk's w is never used. den adds in the same order.
  const float e_sink = exp_rn(__fadd_rn(sink_h, -mx));
  const float w0 = exp_rn(__fadd_rn(s0.x, -mx)), w1 = exp_rn(__fadd_rn(s1.x, -mx));
  float den = 0.f;
  if (has0) {
    wsh[lane] = w0;
    den = fmaf(s0.y, w0, den);
  }
  if (has1) {
    wsh[lane + 32] = w1;
    den = fmaf(s1.y, w1, den);
  }
  for (int c = lane + 64; c < nc; c += 32) {
    const float2 sc = st[c];
    const float w = exp_rn(__fadd_rn(sc.x, -mx));
    wsh[c] = w;
    den = fmaf(sc.y, w, den);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
  den += e_sink;
  __syncwarp();
  UF_PROBE_MARK(probe, 3);

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
  // The inverse rope on the rotated channels [hd - rope_dim, hd): this float4 holds two whole
  // pairs (the host checks (hd - rope_dim) % 4 == 0); rope_kernel's operations on them, with the
  // (cos, sin) computed before the wait.
  if (rot) {
    const float2 cs0 = rcs[0][lane], cs1 = rcs[1][lane];
    float pr[2];
    pr[0] = o.x, pr[1] = o.y;
    ew::rope_pair(pr, cs0.x, cs0.y);
    o.x = pr[0], o.y = pr[1];
    pr[0] = o.z, pr[1] = o.w;
    ew::rope_pair(pr, cs1.x, cs1.y);
    o.z = pr[0], o.w = pr[1];
  }
  reinterpret_cast<float4*>(out + int64_t(th) * hd)[f] = o;
  UF_PROBE_MARK(probe, 4);
}

__global__ void __launch_bounds__(kThreads)
    sparse_attn_kernel(const float* __restrict__ q, int H, int hd, const float* const* window,
                       int n_window, const int32_t* __restrict__ topk, int k, const uint16_t* ckv,
                       const uint16_t* const* ckv_ref, const float* __restrict__ sink, float scale,
                       AttnRope rope, float* __restrict__ out) {
  if (ckv_ref) ckv = *ckv_ref;
  extern __shared__ float smem[];
  float* qs = smem;        // [hd]
  float* acc = smem + hd;  // [hd]
  __shared__ KvRow slot[kBlock];
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
  if (rope.freqs) {
    rotate_staged(qs, 1, hd, rope, t, tid, kThreads);
    __syncthreads();
  }
  const int n_slots = n_window + k;
  for (int b0 = 0; b0 < n_slots; b0 += kBlock) {
    const int nb = min(kBlock, n_slots - b0);
    if (tid < nb) slot[tid] = attn_slot(t, b0 + tid, window, n_window, topk, k, ckv, hd);
    __syncthreads();
    // Partial dot products: work item w = (slot j, lane L).
    for (int w = tid; w < nb * 8; w += kThreads) {
      const int j = w >> 3, lane = w & 7;
      const KvRow kp = slot[j];
      float a = 0.f;
      if (kp)
        for (int i = lane; i < hd; i += 8) a = __fadd_rn(a, __fmul_rn(qs[i], kp.at(i)));
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
        const KvRow kp = slot[j];
        if (kp) tmp = __fadd_rn(tmp, __fmul_rn(pb[j], kp.at(d)));
      }
      acc[d] = __fadd_rn(__fmul_rn(acc[d], sc), tmp);
    }
    __syncthreads();  // slot / part / pb are rewritten by the next block
  }
  const float sum = __fadd_rn(sum_sh, exp_rn(__fadd_rn(sink[h], -m_sh)));
  float* o = out + (int64_t(t) * H + h) * hd;
  for (int d = tid; d < hd; d += kThreads) o[d] = detail::round_bf16(__fdiv_rn(acc[d], sum));
}

template <int S, int kH>
void launch_pv(int T, int H, int hd, const float* const* window, int n_window, const int32_t* topk,
               int k, const uint16_t* ckv, const uint16_t* const* ckv_ref, float* scratch,
               cudaStream_t stream) {
  const auto kernel = sparse_attn_pv_kernel<S, kH>;
  static detail::PerDeviceOnce once;
  once([&] {
    UF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(pv_smem(S, kMaxHeadDim).total)));
    detail::prefer_shared_carveout(kernel);
  });
  const int n_slots = n_window + k;
  const dim3 grid(unsigned((n_slots + S - 1) / S), unsigned(T), unsigned((H + kH - 1) / kH));
  detail::launch_pdl(kernel, grid, dim3(kFastThreads), pv_smem(S, hd).total, stream, T, H, hd,
                     window, n_window, topk, k, ckv, ckv_ref, scratch);
}

template <int kHeads>
void launch_scores(unsigned n16, const float* q, int T, int H, int hd, const float* const* window,
                   int n_window, const int32_t* topk, int k, const uint16_t* ckv,
                   const uint16_t* const* ckv_ref, float scale, const AttnRope& rope, float* scores,
                   float* cmax, cudaStream_t stream) {
  const auto kernel = sparse_attn_scores_kernel<kHeads>;
  static detail::PerDeviceOnce once;
  once([&] {
    UF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(score_smem_bytes<kHeads>(kMaxHeadDim))));
    detail::prefer_shared_carveout(kernel);
  });
  const dim3 grid(n16, unsigned(T), unsigned((H + kHeads - 1) / kHeads));
  detail::launch_pdl(kernel, grid, dim3(kScoreThreads), score_smem_bytes<kHeads>(hd), stream, q, T,
                     H, hd, window, n_window, topk, k, ckv, ckv_ref, scale, rope, scores, cmax);
}

int sm_count() {
  static const int n = [] {
    int dev = 0, sms = 0;
    UF_CUDA_CHECK(cudaGetDevice(&dev));
    UF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    return sms;
  }();
  return n;
}

}  // namespace

void sparse_attn(const float* q, int T, int H, int hd, const float* const* window, int n_window,
                 const int32_t* topk, int k, const uint16_t* ckv, const float* sink, float scale,
                 float* out, cudaStream_t stream, const uint16_t* const* ckv_ref,
                 float* split_scratch, const AttnRope& rope) {
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
  if (rope.freqs)
    require(rope.rope_dim > 0 && rope.rope_dim % 2 == 0 && rope.rope_dim <= hd,
            "sparse_attn: rope of %d channels of %d", rope.rope_dim, hd);
  // The merge rotates whole float4s of pairs.
  const bool merge_rope = !rope.freqs || (hd - rope.rope_dim) % 4 == 0;
  if (split_scratch && hd % 4 == 0 && n_slots > 0 && int64_t(T) * H <= 65535 && aligned &&
      fast_chunks(n_slots) <= 2048 && merge_rope) {
    const int nc = fast_chunks(n_slots);
    const auto merge = [&] {
      const dim3 grid(unsigned((hd + kMergeCols - 1) / kMergeCols), unsigned(T * H));
      detail::launch_pdl(sparse_attn_merge_kernel, grid, dim3(kMergeWarps * 32),
                         size_t(kMergeWarps) * size_t(nc) * sizeof(float), stream,
                         static_cast<const float*>(split_scratch), T, H, hd, nc, sink, rope, out);
    };
    // The chunk records on the tensor cores (attention_chunk_mma.cu), where they apply.
    static_assert(attn_split::kChunkMmaSlots == 16, "the records of chunks of fast_chunk's 16");
    if (g_chunk_mma && fast_chunk(n_slots) == attn_split::kChunkMmaSlots &&
        attn_split::launch_chunk_mma(
            q, T, H, hd, window, n_window, topk, k, ckv, ckv_ref, scale, rope,
            g_chunk_heads_override ? g_chunk_heads_override
                                   : attn_split::chunk_mma_heads(T, H, nc, sm_count()),
            split_scratch, stream)) {
      merge();
      return;
    }
    const unsigned n16 = unsigned((n_slots + kScoreChunk - 1) / kScoreChunk);
    // CTAs of 4 heads (each half the dot products, more CTAs) while their grid stays within 3
    // waves of the SMs: 1-4 rows of 640 slots at a TP8 rank's 8 heads (80-320 CTAs on 132 SMs);
    // from 5 rows the 8-head CTAs, whose staged KV rows serve twice the heads. Same bits either
    // way. Measured with P.V on the same rule (docs/perf.md, session 21): 2 rows -200 us a step,
    // 4 rows -40, 7 rows +250 on 4-head CTAs; the old rule (twice the 8-head grid within one
    // wave) took them at 1 row only.
    const int64_t max_4head_ctas = 3 * int64_t(sm_count()), heads4 = (H + 3) / 4;
    const bool four = int64_t(n16) * T * heads4 <= max_4head_ctas;
    float* scores = split_scratch + scratch_scores(T, H, hd, nc);
    float* cmax = split_scratch + scratch_cmax(T, H, hd, nc, n_slots);
    if (four)
      launch_scores<4>(n16, q, T, H, hd, window, n_window, topk, k, ckv, ckv_ref, scale, rope,
                       scores, cmax, stream);
    else
      launch_scores<8>(n16, q, T, H, hd, window, n_window, topk, k, ckv, ckv_ref, scale, rope,
                       scores, cmax, stream);
    // P.V CTAs of 4 heads on the same rule (1 row: 80 CTAs, not 40): each thread's P.V sums are
    // half as many, each head's the same bits (its own p, slots and order either way).
    const bool pv4 = int64_t(nc) * T * heads4 <= max_4head_ctas;
    const auto pv = fast_chunk(n_slots) == 16 ? (pv4 ? launch_pv<16, 4> : launch_pv<16, 8>)
                                              : (pv4 ? launch_pv<32, 4> : launch_pv<32, 8>);
    pv(T, H, hd, window, n_window, topk, k, ckv, ckv_ref, split_scratch, stream);
    merge();
    return;
  }
  const int64_t blocks = int64_t(T) * H;
  require(blocks < (int64_t(1) << 31), "sparse_attn: T*H=%lld blocks is too many",
          static_cast<long long>(blocks));
  const size_t smem = size_t(2) * size_t(hd) * sizeof(float);
  sparse_attn_kernel<<<unsigned(blocks), kThreads, smem, stream>>>(
      q, H, hd, window, n_window, topk, k, ckv, ckv_ref, sink, scale, rope, out);
  UF_CUDA_CHECK(cudaGetLastError());
  if (rope.freqs)
    uf::cuda::rope(rope.freqs, rope.rope_dim, out, T, H, hd, rope.p0, 1, /*inverse=*/true, stream,
                   rope.positions);
}

size_t sparse_attn_scratch_floats(int T, int H, int hd, int n_slots) {
  const size_t chunks = size_t((std::max(n_slots, 1) + kMinChunk - 1) / kMinChunk);
  // acc and stats per chunk of 16 (chunks of 32 need half), the scores (<= 16 a chunk), the
  // chunk maxes (one a chunk of 16).
  return size_t(std::max(T, 0)) * size_t(H) * chunks * size_t(hd + 2 + kMinChunk + 1);
}

void set_sparse_attn_chunk_mma(bool on) { g_chunk_mma = on; }

void sparse_attn_chunk_heads_override(int heads) {
  require(heads == 0 || heads == 1 || heads == 2 || heads == 4 || heads == 8,
          "sparse_attn_chunk_heads_override: %d heads (0, 1, 2, 4 or 8)", heads);
  g_chunk_heads_override = heads;
}

void sparse_attn_chunk_override(int slots) {
  require(slots == 0 || slots == 16 || slots == 32,
          "sparse_attn_chunk_override: %d slots (0, 16 or 32)", slots);
  g_chunk_override = slots;
}

}  // namespace uf::cuda
