// sparse_attn's chunk records on the tensor cores: a decode row's scores, softmax and P.V for a
// chunk of 16 slots in ONE kernel (attn_split::launch_chunk_mma; sparse_attn's split path takes
// it unless set_sparse_attn_chunk_mma(false)).
//
// Why: the split path's CPU-order kernels (attention.cu) compute every s_j with fp32 mul / add on
// the CUDA cores in the CPU's dot8 order, then a second kernel waits for all of a row's scores to
// take the CPU's running max of each 64-slot block before it can form bf16(p_j) and P.V. At a
// TP8 rank's 8 heads of 512 dims and 640 slots that chain was ~8.5 us a layer at 1 row and ~17 at
// 7 rows (docs/perf.md, session 21's trace: scores + P.V advances). Here the products run as bf16
// mma.sync and each chunk takes its own base, so nothing waits for another chunk: one launch, the
// KV rows staged once, the merge (attention.cu) unchanged.
//
// Tile: one CTA of 8 warps per (chunk c of 16 slots, row t, group of up to 8 heads): the split
// path's grid and record layout (attention_split.cuh). A small grid (1-4 rows) takes 2 or 4 heads
// a CTA (chunk_mma_heads) and the mma's other head columns are zeros: more SMs stage the chunk.
//  1. After the PDL wait: the chunk's slot pointers (window slots, then top-k entries; empty =
//     nullptr), q's 8 heads (each thread a float4 column of every head, rotated in registers with
//     rope_kernel's operations: one (cos, sin) per pair, computed once a CTA) as bf16 hi + lo, and
//     the 16 KV rows as bf16 in shared memory (window rows converted from fp32, top-k rows copied:
//     the session's compressed KV is bf16; empty slots: zeros, so 0 * v is never NaN). All
//     loads of a phase are in flight together (q and the pointers, then the rows).
//  2. S = K Q^T: the 16 slots are the mma's M, the 8 heads its N, d its K; warp w takes the
//     k-steps w, w + 8, ... with q hi and q lo in two accumulators (hi + lo at the end), and the
//     eight warps' partial sums are added in warp order.
//  3. The chunk's softmax, thread (head h, slot j): s_j = S * scale (-inf for an empty slot),
//     m_c = max(-1e30, max_j s_j), p_j = exp(s_j - m_c), psum_c = xor-butterfly sum of the
//     unrounded p_j, bf16(p_j) into P [head][slot].
//  4. O^T = V^T P^T: d is the M (hd / 16 tiles, warp w the tiles w, w + 8, ...), the heads the N,
//     the 16 slots the K (one mma a tile); acc_c of each head stored straight from the
//     fragments (8 consecutive floats a head and row group: whole 32-byte sectors).
//  Record (m_c, psum_c, acc_c) is what the merge takes: M = max_c m_c, w_c = exp(m_c - M),
//  den = sum_c w_c psum_c + exp(sink - M), out = bf16(sum_c w_c acc_c / den), the inverse rope.
//
// Numerics against the CPU (cpu::sparse_attn_row): the model's q is bf16-valued (the projection
// and the rope round to bf16: q lo = 0) and its KV rows are FP8 / FP4 QDQ values (exact in bf16),
// so every product is exact and s_j differs from the CPU's only by the fp32 re-association of the
// dot product (~1e-6 relative; an fp32 q keeps the hi / lo split's |q - hi - lo| <= 2^-17 |q|).
// The CPU rounds p_j to bf16 against its running max after the slot's 64-slot block, this kernel
// against the chunk's own max: each is within 2^-9 of the exact p_j, so a P.V term differs by at
// most 2^-8 of p_j |v_j|. Bound per output: 1 bf16 ulp + 2^-8 * the p-weighted mean |v|
// (tests/cuda/test_ops_attention.cpp, the prefill mma kernel's bound). Every order depends on the
// slot count and hd only, never on T or on other rows: spec == plain holds between verify rows
// and plain decoding, which both run this kernel.
// Shapes: hd % 16 == 0, hd <= 512 (8 float4 KV loads a thread), any H, any slot count; the rope's
// rotated channels start at an even offset. Shared memory ~40 KB at hd 512.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/probe.cuh"
#include "cuda/ops/attention_mma_tile.cuh"
#include "cuda/ops/attention_slots.cuh"
#include "cuda/ops/attention_split.cuh"
#include "cuda/ops/elementwise_common.cuh"

namespace uf::cuda::attn_split {
namespace {

using detail::smem_addr;

// Where the kernel lets the merge launch (PDL; a build knob for A/B runs): 0 right after its
// wait, 1 (default) once the KV rows and q are staged, 2 after the softmax. The merge triggers at
// its start, so wo_a's CTAs launch with it and copy 4 MB of weights before their wait (and the
// kernels after them theirs): launched at 0, those copies ran under this kernel's KV loads
// (H200, session 23: 1 / 4 / 7 rows 3880 / 5149 / 5910 us a step at 0, 3808 / 5190 / 5885 at 1;
// with 4 warps a CTA the gap at 1 row was 200 us).
#ifndef UF_ATTN_CHUNK_TRIGGER
#define UF_ATTN_CHUNK_TRIGGER 1
#endif
// The CTAs a launch may take before its heads stop being split further (chunk_mma_heads), per
// SM: an A/B knob; 3 = the CTAs an SM holds (kMinBlocks), one wave.
#ifndef UF_ATTN_CHUNK_CTAS_PER_SM
#define UF_ATTN_CHUNK_CTAS_PER_SM 3
#endif
constexpr int kChunk = kChunkMmaSlots;  // slots a CTA: the M of S, the K of P.V
constexpr int kHeads = 8;               // heads a CTA: the N of both products
// 8 warps: a warp's instructions are the kernel's latency (at 1 row one CTA an SM, so the SM's
// four schedulers have few warps to switch between); with 4 warps (16 KV loads a thread)
// the staging took 8-10 us after the wait (docs/perf.md, session 23).
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// 3 CTAs an SM (<= 85 registers): a 7-row step's 280 CTAs in one wave of the H200's 132 SMs (at
// 102 registers 2 fit an SM, and 16 CTAs ran as a second wave).
constexpr int kMinBlocks = 3;
constexpr int kMaxHd = 512;
constexpr int kKvLoads = kChunk * (kMaxHd / 4) / kThreads;  // float4 KV loads a thread (8)
constexpr int kQLoads = kHeads * (kMaxHd / 4) / kThreads;   // float4 q loads a thread (4)
constexpr int kSStride = kChunk + 1;                        // floats a head row of the S partials
constexpr int kPStride = kChunk + 8;  // bf16 a head row of P (48 B: ldmatrix rows conflict-free)
constexpr int kSoftmaxThreads = kHeads * kChunk;  // one a (head, slot)
static_assert(kChunk == 16 && kSoftmaxThreads <= kThreads && kSoftmaxThreads % 32 == 0,
              "softmax: one thread a (head, slot), whole warps");

// Item i = tid + u * kThreads of a [rows][n4] grid of float4s as (row r, column c), walked
// without a division an item (the kernel's latency is its warps' instruction count): one
// division at the start, then each step adds kThreads = dr rows + dc columns.
struct GridWalk {
  int r, c, dr, dc, n4;
  __device__ GridWalk(int tid, int n)
      : r(tid / n), c(tid % n), dr(kThreads / n), dc(kThreads % n), n4(n) {}
  __device__ void next() {
    r += dr;
    c += dc;
    if (c >= n4) {
      c -= n4;
      ++r;
    }
  }
};

// Shared memory (attention_mma_tile.cuh): kv the chunk's 16 KV rows, qhi / qlo, s: the warps'
// S partials fp32 [8][8][17], p: bf16 [8][24] (3 16-byte units a row).
__host__ __device__ inline AttnMmaSmem smem_layout(int hd) {
  return attn_mma_smem(hd, kChunk, kHeads, size_t(kWarps) * kHeads * kSStride * 4,
                       size_t(kHeads) * kPStride * 2);
}
static_assert(size_t(kWarps) * kHeads * kSStride * 4 % 16 == 0, "P stays 16-byte aligned");

__global__ void __launch_bounds__(kThreads, kMinBlocks)
    sparse_attn_chunk_mma_kernel(const float* __restrict__ q, int H, int hd,
                                 const float* const* window, int n_window,
                                 const int32_t* __restrict__ topk, int k, const uint16_t* ckv,
                                 const uint16_t* const* ckv_ref, float scale, AttnRope rope,
                                 int hpc, float* __restrict__ scratch) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ const void* slot[kChunk];    // window rows fp32, top-k rows bf16 (KvRow)
  __shared__ float2 rope_cs[kMaxHd / 2];  // (cos, sin) of the row's rotated pairs (forward)
  const AttnMmaSmem L = smem_layout(hd);
  __nv_bfloat16* kv = reinterpret_cast<__nv_bfloat16*>(smem + L.kv);
  __nv_bfloat16* qhi = reinterpret_cast<__nv_bfloat16*>(smem + L.qhi);
  __nv_bfloat16* qlo = reinterpret_cast<__nv_bfloat16*>(smem + L.qlo);
  float* s_part = reinterpret_cast<float*>(smem + L.s);
  __nv_bfloat16* ps = reinterpret_cast<__nv_bfloat16*>(smem + L.p);
  const int c = blockIdx.x, t = blockIdx.y, h0 = blockIdx.z * hpc, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, cq = lane % 4;
  const int T = gridDim.y, nc = gridDim.x, nh = min(hpc, H - h0), rs = hd + 8, hd4 = hd / 4;
  // hpc < kHeads: q's rows nh .. kHeads - 1 are zeros and their records are not stored.
  const int n_slots = n_window + k, j0 = c * kChunk, nb = min(kChunk, n_slots - j0);

  // Probe points: 0 start, 1 PDL wait returned, 2 q staged and the KV rows landed, 3 S, 4 the
  // softmax, 5 end.
  UF_PROBE_OPEN_IF(probe, kTagAttnChunk,
                   tid == 0 && blockIdx.y == 0 && blockIdx.z == 0 &&
                       (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1));
  UF_PROBE_MARK(probe, 0);
  // q, the window pointers, the top-k ids and the KV rows all come from earlier kernels.
  detail::pdl_wait();
  UF_PROBE_MARK(probe, 1);
  // Every trigger point is after the wait: the merge reads the rope inputs before its own wait,
  // which is safe only once every earlier grid has completed (the merge's comment).
  if (UF_ATTN_CHUNK_TRIGGER == 0) detail::pdl_trigger();

  // Phase 1: warp 1 loads the slot pointers (lane j < nb: slot j0 + j), every thread q's
  // float4s; warp 0 first computes the rope's (cos, sin) of the row's rotated pairs (a double
  // sincos each, with a slow-path call: whatever a thread has in flight must land before a call,
  // so the warp that makes it holds no loads yet).
  const void* my_slot = nullptr;
  if (warp == 1 && lane < nb) {
    const uint16_t* base = ckv;
    if (ckv_ref && j0 + lane >= n_window) base = *ckv_ref;
    my_slot = attn_slot(t, j0 + lane, window, n_window, topk, k, base, hd).p;
  }
  const int half = rope.freqs ? rope.rope_dim / 2 : 0;
  if (warp == 0 && half) {
    const int64_t pos = rope.positions ? rope.positions[t] : rope.p0 + t;
    for (int i = lane; i < half; i += 32)
      ew::rope_cos_sin(pos, rope.freqs[i], false, &rope_cs[i].x, &rope_cs[i].y);
  }
  const float4* qg = reinterpret_cast<const float4*>(q + (int64_t(t) * H + h0) * hd);
  float4 qv[kQLoads];
  {
    GridWalk w(tid, hd4);  // (head, column)
#pragma unroll
    for (int u = 0; u < kQLoads; ++u, w.next())
      qv[u] = w.r < nh ? __ldcg(qg + w.r * hd4 + w.c) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (warp == 1 && lane < kChunk) slot[lane] = my_slot;
  __syncthreads();

  // Phase 2: the KV rows (kKvLoads loads a thread in flight); under them q's rope and split. An
  // item is 4 values of a row: a float4 of a window row (fp32, converted when stored), or 8 bytes
  // of a top-k row (the session's compressed KV, bf16: stored as they are). Slots j0 + r <
  // n_window are the window's.
  float4 kvv[kKvLoads];  // an fp32 row's 4 values, or a bf16 row's 8 bytes in .x / .y
  {
    GridWalk w(tid, hd4);  // (slot, column)
#pragma unroll
    for (int u = 0; u < kKvLoads; ++u, w.next()) {
      kvv[u] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (w.r < kChunk) {
        const int f = w.c;
        attn_kv_load4(kvv[u], slot[w.r], j0 + w.r >= n_window, f);
      }
    }
  }
  const int r0 = hd - 2 * half;  // the first rotated channel (even)
  GridWalk wq(tid, hd4);         // (head, column): q's items again
#pragma unroll
  for (int u = 0; u < kQLoads; ++u, wq.next()) {
    if (wq.r >= kHeads) break;
    const int h = wq.r, e = 4 * wq.c;
    float x[4] = {qv[u].x, qv[u].y, qv[u].z, qv[u].w};
#pragma unroll
    for (int pr = 0; pr < 2; ++pr)
      if (half && e + 2 * pr >= r0) {
        const float2 cs = rope_cs[(e + 2 * pr - r0) / 2];
        ew::rope_pair(x + 2 * pr, cs.x, cs.y);
      }
    const uint2 a = attn_q_hi_lo(x[0], x[1]), b = attn_q_hi_lo(x[2], x[3]);
    *reinterpret_cast<uint2*>(qhi + h * rs + e) = make_uint2(a.x, b.x);
    *reinterpret_cast<uint2*>(qlo + h * rs + e) = make_uint2(a.y, b.y);
  }
  GridWalk wk(tid, hd4);  // (slot, column): the KV items again
#pragma unroll
  for (int u = 0; u < kKvLoads; ++u, wk.next())
    if (wk.r < kChunk)
      *reinterpret_cast<uint2*>(kv + wk.r * rs + 4 * wk.c) =
          attn_kv_bf16x4(kvv[u], j0 + wk.r >= n_window);
  __syncthreads();
  UF_PROBE_MARK(probe, 2);
  if (UF_ATTN_CHUNK_TRIGGER == 1) detail::pdl_trigger();

  // 2. S: A = the KV rows (16 slots x 16 dims a k-step), B = q hi | q lo (8 heads).
  {
    float shi[4] = {0.f, 0.f, 0.f, 0.f}, slo[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t arow = smem_addr(kv + (lane & 15) * rs + 8 * (lane >> 4));
    const uint32_t brow =
        smem_addr((lane < 16 ? qhi : qlo) + (lane & 7) * rs + 8 * ((lane >> 3) & 1));
    for (int ks = warp; ks < hd / 16; ks += kWarps) {
      uint32_t a[4], b[4];
      detail::ldsm_x4(arow + uint32_t(32 * ks), a);
      detail::ldsm_x4(brow + uint32_t(32 * ks), b);
      detail::mma_bf16(shi, a[0], a[1], a[2], a[3], b[0], b[1]);
      detail::mma_bf16(slo, a[0], a[1], a[2], a[3], b[2], b[3]);
    }
    // (slots g, g + 8) x (heads 2 cq, 2 cq + 1) into s_part[warp][head][slot].
    float* sp = s_part + warp * kHeads * kSStride;
    sp[(2 * cq) * kSStride + g] = shi[0] + slo[0];
    sp[(2 * cq + 1) * kSStride + g] = shi[1] + slo[1];
    sp[(2 * cq) * kSStride + g + 8] = shi[2] + slo[2];
    sp[(2 * cq + 1) * kSStride + g + 8] = shi[3] + slo[3];
  }
  __syncthreads();
  UF_PROBE_MARK(probe, 3);

  // 3. The chunk's softmax: thread (head h, slot j) of the first 4 warps; a head's 16 slots
  // are a half-warp.
  if (tid < kSoftmaxThreads) {
    const int h = tid / kChunk, j = tid % kChunk;
    const bool present = slot[j] != nullptr;  // (slots past nb are nullptr)
    float s = s_part[h * kSStride + j];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) s += s_part[(w * kHeads + h) * kSStride + j];
    s = present ? s * scale : -INFINITY;
    float mx = s;
#pragma unroll
    for (int o = kChunk / 2; o > 0; o >>= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, mx, o);
      mx = mx < v ? v : mx;
    }
    const float m = -1e30f < mx ? mx : -1e30f;  // an all-empty chunk: p = 0, weight 0
    const float p = present ? expf(s - m) : 0.f;
    float sum = p;  // xor butterfly: every lane of the half-warp ends with the same bits
#pragma unroll
    for (int o = kChunk / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    ps[h * kPStride + j] = __float2bfloat16_rn(p);
    if (j == 0 && h < nh) {
      float* rec = scratch + scratch_stats(T, H, hd, nc) + ((int64_t(t) * H + h0 + h) * nc + c) * 2;
      rec[0] = m;
      rec[1] = sum;
    }
  }
  __syncthreads();
  UF_PROBE_MARK(probe, 4);
  if (UF_ATTN_CHUNK_TRIGGER == 2) detail::pdl_trigger();

  // 4. O^T = V^T P^T: A = V^T (ldmatrix.trans of the KV rows), B = P^T (P's head rows).
  {
    uint32_t b[2];
    detail::ldsm_x2(smem_addr(ps + (lane & 7) * kPStride + 8 * ((lane >> 3) & 1)), b);
    const uint32_t vrow =
        smem_addr(kv + ((lane & 7) + 8 * (lane >> 4)) * rs + 8 * ((lane >> 3) & 1));
    const int64_t hstride = int64_t(nc) * hd;  // between the heads' records
    float* acc = scratch + ((int64_t(t) * H + h0) * nc + c) * hd;
    const bool h_lo = 2 * cq < nh, h_hi = 2 * cq + 1 < nh;
    for (int tile = warp; tile < hd / 16; tile += kWarps) {
      uint32_t a[4];
      detail::ldsm_x4_trans(vrow + uint32_t(32 * tile), a);
      float o[4] = {0.f, 0.f, 0.f, 0.f};
      detail::mma_bf16(o, a[0], a[1], a[2], a[3], b[0], b[1]);
      // (dims d, d + 8) x (heads 2 cq, 2 cq + 1).
      const int d = 16 * tile + g;
      if (h_lo) {
        acc[2 * cq * hstride + d] = o[0];
        acc[2 * cq * hstride + d + 8] = o[2];
      }
      if (h_hi) {
        acc[(2 * cq + 1) * hstride + d] = o[1];
        acc[(2 * cq + 1) * hstride + d + 8] = o[3];
      }
    }
  }
  UF_PROBE_MARK(probe, 5);
}

}  // namespace

// H200, a TP8 rank's 8 heads at 640 slots (docs/perf.md, session 24): 2 / 4 rows take 2 / 4 heads
// a CTA (320 CTAs): -150 / -140 us a step against 8-head CTAs, 1 row (160 CTAs) -30; 1 head a
// CTA at 1 row (320 CTAs) gained nothing over 2 and is 1.5 us slower alone (bench_cuda_attention),
// so the rule stops at 2 (1 stays for the tests: sparse_attn_chunk_heads_override).
int chunk_mma_heads(int T, int H, int nc, int sms) {
  for (int hpc = 2; hpc < kHeads; hpc *= 2)
    if (int64_t(nc) * T * ((H + hpc - 1) / hpc) <= int64_t(UF_ATTN_CHUNK_CTAS_PER_SM) * sms)
      return hpc;
  return kHeads;
}

bool launch_chunk_mma(const float* q, int T, int H, int hd, const float* const* window,
                      int n_window, const int32_t* topk, int k, const uint16_t* ckv,
                      const uint16_t* const* ckv_ref, float scale, const AttnRope& rope,
                      int heads_per_cta, float* scratch, cudaStream_t stream) {
  const int n_slots = n_window + k;
  const bool rope_ok =
      !rope.freqs || (rope.rope_dim > 0 && rope.rope_dim <= hd && (hd - rope.rope_dim) % 2 == 0);
  if (hd % 16 != 0 || hd > kMaxHd || (reinterpret_cast<uintptr_t>(q) & 15u) != 0 || !rope_ok ||
      n_slots <= 0 || H > 65535 || T > 65535 || heads_per_cta < 1 || heads_per_cta > kHeads)
    return false;
  if (T == 0) return true;
  static detail::PerDeviceOnce once;
  once([&] {
    UF_CUDA_CHECK(cudaFuncSetAttribute(sparse_attn_chunk_mma_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(smem_layout(kMaxHd).total)));
    detail::prefer_shared_carveout(sparse_attn_chunk_mma_kernel);
  });
  const int hpc = heads_per_cta;
  const dim3 grid(unsigned((n_slots + kChunk - 1) / kChunk), unsigned(T),
                  unsigned((H + hpc - 1) / hpc));
  detail::launch_pdl(sparse_attn_chunk_mma_kernel, grid, dim3(kThreads), smem_layout(hd).total,
                     stream, q, H, hd, window, n_window, topk, k, ckv, ckv_ref, scale, rope, hpc,
                     scratch);
  return true;
}

}  // namespace uf::cuda::attn_split
