// sparse_attn_mma: sparse attention for prefill spans on the tensor cores (ops/attention.h).
//
// Why: the split path (attention.cu) keeps the CPU's dot8 order with fp32 FMAs on the CUDA cores;
// for a 512-row prefill chunk of a TP8 rank (8 heads, head_dim 512, 128 + 512 slots) that is
// ~10 MFLOP a row on instructions, ~37 ms of a ~115 ms chunk (docs/perf.md, session 8). Here
// both products run as bf16 mma.sync m16n8k16 with fp32 accumulation: 802 -> 286 us a layer at
// 512 rows (session 13), the KV rows' gather (~2.3 TB/s of fp32 rows) now the bound.
//
// Tile (one CTA of 8 warps per (row t, group of 8 heads)), per 64-slot block of the row's list
// (the CPU's softmax block, cpu::sparse_attn_row):
//  1. slot pointers (window slots, then top-k entries; empty = nullptr), then the block's KV rows
//     loaded as float4 and converted (window rows, fp32) or as 4 bf16 (top-k rows: the session's
//     compressed KV is stored as bf16) into bf16 [64][hd + 8] in shared memory (empty: zeros);
//  2. S^T = K Q^T: slots are the mma's M (warp w: slots 16 (w % 4) .. + 15, d half w / 4), the
//     8 heads its N, d its K. q is staged once as hi = bf16(q), lo = bf16(q - hi), two mma per
//     k-step: the model's q (bf16 outputs, the rope rounds to bf16) has lo = 0 and its KV values
//     (FP8 / FP4 QDQ) are exact in bf16, so every product is exact; an arbitrary fp32 q keeps
//     ~16 bits more than bf16(q) alone would, for the cost of one mma a k-step (the kernel is
//     bound by its KV loads, not by the tensor cores);
//  3. the CPU's block softmax (warp h = head h): s_j = (half0 + half1) * scale (-inf empty),
//     m_new = max(m, block max), sc = exp(m - m_new), p_j = exp(s_j - m_new), l = l * sc + sum p,
//     bf16(p_j) into P [head][slot];
//  4. O^T += V^T P^T: d is the M (hd / 16 tiles over the 8 warps), heads the N, the block's 64
//     slots the K; the accumulators are scaled by sc first (acc * sc + P.V, the CPU's tmp summed
//     into the accumulator instead of apart);
//  then den = l + exp(sink - m), out = bf16(acc / den), the inverse rope on the rotated channels
//  (the split path's merge operations), stored as float2.
// Shapes: hd % 32 == 0 (two halves of whole k-steps), hd <= 512 (at most 4 output tiles a warp),
// any H (heads past H are zero q rows, never written), any slot count. Shared memory ~89 KB at
// hd 512: two CTAs an SM, so one CTA's loads overlap the other's mma.
//
// Numerics against the CPU: p_j differs by the re-associated fp32 dot product (tensor-core
// accumulation; for an arbitrary q also the split, |q - hi - lo| <= 2^-17 |q|): ~1e-6 relative,
// which flips bf16(p_j) by one ulp for a rare slot; P.V and l are re-associated fp32 sums. The
// tests bound each output by 1 bf16 ulp + 2^-8 of the p-weighted mean |v|
// (tests/cuda/test_ops_attention.cpp).
// A row's result depends on its own slots only (no other row's data, no atomics): repeatable bit
// for bit, and independent of T. It is NOT the split path's bits: CudaModel::attend uses it for
// prefill spans only (more rows than a verify step or a draft block, and enough to give every SM
// two CTAs), never for decode rows.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/ops/attention.h"
#include "cuda/ops/attention_mma_tile.cuh"
#include "cuda/ops/attention_slots.cuh"
#include "cuda/ops/elementwise_common.cuh"

namespace uf::cuda {
namespace {

using detail::smem_addr;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kHeads = 8;   // the N of both products: heads per CTA
constexpr int kBlock = 64;  // cpu::kAttnBlock: slots per softmax block
constexpr int kMaxHd = 512;
constexpr int kMaxTilesPerWarp = kMaxHd / 16 / kWarps;  // P.V output tiles (16 dims) a warp
constexpr int kPStride = kBlock + 8;  // bf16 per head row of P (144 B: ldmatrix conflict-free)
constexpr int kSStride = kBlock + 4;  // floats per head row of the S halves (stores spread)
// float4 loads in flight a thread (4 and 16 measured the same in a prefill chunk, session 13).
constexpr int kLoadUnroll = 8;
static_assert(kWarps == kHeads, "softmax: one warp a head");
static_assert(kBlock == 4 * 16, "S: four 16-slot M tiles, two d halves over the 8 warps");

// Shared memory (attention_mma_tile.cuh): kv the block's 64 KV rows (also q's fp32 staging at
// the start and the output's at the end), qhi / qlo, s: the two d halves' S, fp32 [2][8][68],
// p: bf16 [8][72].
__host__ __device__ inline AttnMmaSmem smem_layout(int hd) {
  return attn_mma_smem(hd, kBlock, kHeads, size_t(2) * kHeads * kSStride * 4,
                       size_t(kHeads) * kPStride * 2);
}
static_assert(kBlock * (kMaxHd + 8) * 2 >= kHeads * (kMaxHd + 4) * 4,
              "the output's fp32 staging fits the KV tile");

__device__ __forceinline__ float exp_rn(float x) { return float(exp(double(x))); }

__global__ void __launch_bounds__(kThreads, 2)
    sparse_attn_mma_kernel(const float* __restrict__ q, int H, int hd, const float* const* window,
                           int n_window, const int32_t* __restrict__ topk, int k,
                           const uint16_t* ckv, const uint16_t* const* ckv_ref,
                           const float* __restrict__ sink, float scale, AttnRope rope,
                           float* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ KvRow slot[kBlock];
  __shared__ uint32_t present_sh[2];
  __shared__ float sc_sh[kHeads], den_sh[kHeads];
  __shared__ float2 rope_cs[kMaxHd / 2];  // (cos, sin) of the row's rotated pairs (forward)
  const AttnMmaSmem L = smem_layout(hd);
  __nv_bfloat16* kv = reinterpret_cast<__nv_bfloat16*>(smem + L.kv);
  __nv_bfloat16* qhi = reinterpret_cast<__nv_bfloat16*>(smem + L.qhi);
  __nv_bfloat16* qlo = reinterpret_cast<__nv_bfloat16*>(smem + L.qlo);
  float* s_half = reinterpret_cast<float*>(smem + L.s);
  __nv_bfloat16* ps = reinterpret_cast<__nv_bfloat16*>(smem + L.p);
  const int t = blockIdx.x, h0 = blockIdx.y * kHeads, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int nh = min(kHeads, H - h0), rs = hd + 8, hd4 = hd / 4;

  // q, the slot tables and the KV rows come from earlier kernels.
  detail::pdl_wait();
  detail::pdl_trigger();
  if (ckv_ref) ckv = *ckv_ref;

  // q: fp32 staging in the KV tile, the forward rope on its rotated channels (rope_kernel's
  // operations, one (cos, sin) per pair as the split path), then hi / lo bf16.
  const int half = rope.freqs ? rope.rope_dim / 2 : 0;
  const int64_t pos = rope.positions ? rope.positions[t] : rope.p0 + t;
  for (int i = tid; i < half; i += kThreads)
    ew::rope_cos_sin(pos, rope.freqs[i], false, &rope_cs[i].x, &rope_cs[i].y);
  float* qf = reinterpret_cast<float*>(smem + L.kv);
  const float4* qg = reinterpret_cast<const float4*>(q + (int64_t(t) * H + h0) * hd);
  for (int i = tid; i < kHeads * hd4; i += kThreads)
    reinterpret_cast<float4*>(qf)[i] = i / hd4 < nh ? qg[i] : make_float4(0.f, 0.f, 0.f, 0.f);
  __syncthreads();
  for (int w = tid; w < nh * half; w += kThreads) {
    const int h = w / half, i = w - h * half;
    ew::rope_pair(qf + h * hd + (hd - 2 * half) + 2 * i, rope_cs[i].x, rope_cs[i].y);
  }
  __syncthreads();
  for (int i = tid; i < kHeads * hd / 2; i += kThreads) {
    const int h = i / (hd / 2), e = 2 * (i - h * (hd / 2));
    const float x0 = qf[h * hd + e], x1 = qf[h * hd + e + 1];
    const uint2 hl = attn_q_hi_lo(x0, x1);
    *reinterpret_cast<uint32_t*>(qhi + h * rs + e) = hl.x;
    *reinterpret_cast<uint32_t*>(qlo + h * rs + e) = hl.y;
  }
  // (The barrier at the top of the block loop orders these reads before the KV stores.)

  // The softmax state of head `warp` (every lane holds the same), the CPU's initial values.
  float m_run = -1e30f, l_run = 0.f;
  // P.V accumulators: output tile i of this warp = dims 16 (warp + 8 i) .. + 15; fragment
  // (dims g, g + 8) x (heads 2c, 2c + 1).
  const int n_tiles = hd / 16;
  float acc[kMaxTilesPerWarp][4];
#pragma unroll
  for (int i = 0; i < kMaxTilesPerWarp; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  const int n_slots = n_window + k;
  for (int b0 = 0; b0 < n_slots; b0 += kBlock) {
    const int nb = min(kBlock, n_slots - b0);
    if (tid < kBlock) {
      const KvRow p = tid < nb ? attn_slot(t, b0 + tid, window, n_window, topk, k, ckv, hd)
                               : KvRow{nullptr, false};
      slot[tid] = p;
      const uint32_t bits = __ballot_sync(0xffffffffu, p.p != nullptr);
      if (lane == 0) present_sh[warp] = bits;
    }
    __syncthreads();  // slots known; the previous block's P.V (and q's staging) done with kv

    // 1. The block's KV rows as bf16 (empty slots and slots past nb: zeros, so 0 * v is never
    // NaN), kLoadUnroll loads in flight a thread before their stores: 4 values of an fp32 row
    // (window slots) converted, or of a bf16 row (top-k slots) as they are.
    const int items = kBlock * hd4;
    for (int i0 = tid; i0 < items; i0 += kThreads * kLoadUnroll) {
      float4 v[kLoadUnroll];  // an fp32 row's 4 values, or a bf16 row's 8 bytes in .x / .y
      uint32_t bf = 0;        // bit u: v[u] holds bf16 bits
#pragma unroll
      for (int u = 0; u < kLoadUnroll; ++u) {
        const int i = i0 + u * kThreads;
        v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < items) {
          const int j = i / hd4, f = i - j * hd4;
          const KvRow r = slot[j];
          attn_kv_load4(v[u], r.p, r.bf16, f);
          if (r.p && r.bf16) bf |= 1u << u;
        }
      }
#pragma unroll
      for (int u = 0; u < kLoadUnroll; ++u) {
        const int i = i0 + u * kThreads;
        if (i < items) {
          const int j = i / hd4, f = i - j * hd4;
          *reinterpret_cast<uint2*>(kv + j * rs + 4 * f) = attn_kv_bf16x4(v[u], (bf >> u) & 1u);
        }
      }
    }
    __syncthreads();

    // 2. S^T: warp = (slot tile mt, d half dh); A = K rows, B = [q hi | q lo] heads.
    {
      const int mt = warp % 4, dh = warp / 4, d0 = dh * (hd / 2);
      float sacc[4] = {0.f, 0.f, 0.f, 0.f};
      const __nv_bfloat16* arow = kv + (16 * mt + (lane & 15)) * rs + d0 + 8 * (lane >> 4);
      const __nv_bfloat16* brow =
          (lane < 16 ? qhi : qlo) + (lane & 7) * rs + d0 + 8 * ((lane >> 3) & 1);
      for (int ks = 0; ks < hd / 32; ++ks) {
        uint32_t a[4], b[4];
        detail::ldsm_x4(smem_addr(arow + 16 * ks), a);
        detail::ldsm_x4(smem_addr(brow + 16 * ks), b);
        detail::mma_bf16(sacc, a[0], a[1], a[2], a[3], b[0], b[1]);  // q hi
        detail::mma_bf16(sacc, a[0], a[1], a[2], a[3], b[2], b[3]);  // q lo
      }
      // (slots g, g + 8 of the tile) x (heads 2c, 2c + 1) into s_half[dh][head][slot].
      float* sh = s_half + dh * kHeads * kSStride;
      const int j = 16 * mt + g;
      sh[(2 * c) * kSStride + j] = sacc[0];
      sh[(2 * c + 1) * kSStride + j] = sacc[1];
      sh[(2 * c) * kSStride + j + 8] = sacc[2];
      sh[(2 * c + 1) * kSStride + j + 8] = sacc[3];
    }
    __syncthreads();

    // 3. The block softmax of head `warp`: slots lane and lane + 32.
    {
      const int h = warp;
      const uint32_t pres0 = present_sh[0], pres1 = present_sh[1];
      const bool e0 = (pres0 >> lane) & 1u, e1 = (pres1 >> lane) & 1u;
      const float* s0 = s_half + h * kSStride;
      const float* s1 = s_half + (kHeads + h) * kSStride;
      const float sa = e0 ? __fmul_rn(__fadd_rn(s0[lane], s1[lane]), scale) : -INFINITY;
      const float sb = e1 ? __fmul_rn(__fadd_rn(s0[lane + 32], s1[lane + 32]), scale) : -INFINITY;
      float bmax = fmaxf(sa, sb);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, o));
      const float m_new = m_run < bmax ? bmax : m_run;
      const float scf = exp_rn(__fadd_rn(m_run, -m_new));
      const float pa = e0 ? exp_rn(__fadd_rn(sa, -m_new)) : 0.f;
      const float pb = e1 ? exp_rn(__fadd_rn(sb, -m_new)) : 0.f;
      float psum = pa + pb;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o);
      l_run = __fadd_rn(__fmul_rn(l_run, scf), psum);
      m_run = m_new;
      ps[h * kPStride + lane] = __float2bfloat16_rn(pa);
      ps[h * kPStride + lane + 32] = __float2bfloat16_rn(pb);
      if (lane == 0) sc_sh[h] = scf;
    }
    __syncthreads();

    // 4. O^T = O^T * sc + V^T P^T: A = V^T (ldmatrix.trans of the KV rows), B = P^T.
    {
      uint32_t bp[2][4];  // P^T fragments of the 4 k-steps (16 slots each), two a load
      const __nv_bfloat16* prow = ps + (lane & 7) * kPStride + 8 * (lane >> 3);
      detail::ldsm_x4(smem_addr(prow), bp[0]);
      detail::ldsm_x4(smem_addr(prow + 32), bp[1]);
      const float sc0 = sc_sh[2 * c], sc1 = sc_sh[2 * c + 1];
      const __nv_bfloat16* vrow = kv + ((lane & 7) + 8 * (lane >> 4)) * rs + 8 * ((lane >> 3) & 1);
#pragma unroll
      for (int i = 0; i < kMaxTilesPerWarp; ++i) {
        const int tile = warp + kWarps * i;
        if (tile >= n_tiles) break;
        acc[i][0] *= sc0;
        acc[i][1] *= sc1;
        acc[i][2] *= sc0;
        acc[i][3] *= sc1;
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          uint32_t a[4];
          detail::ldsm_x4_trans(smem_addr(vrow + (16 * ks) * rs + 16 * tile), a);
          detail::mma_bf16(acc[i], a[0], a[1], a[2], a[3], bp[ks / 2][2 * (ks % 2)],
                           bp[ks / 2][2 * (ks % 2) + 1]);
        }
      }
    }
  }

  // den per head, then the output through shared memory (fp32 [8][hd + 4] in the KV tile) so
  // that each rotated pair is in one thread for the inverse rope and the stores are coalesced.
  if (lane == 0 && warp < nh)
    den_sh[warp] = __fadd_rn(l_run, exp_rn(__fadd_rn(sink[h0 + warp], -m_run)));
  __syncthreads();  // den known; every warp's P.V done with the KV tile
  const int os = hd + 4;
  float* of = reinterpret_cast<float*>(smem + L.kv);
  {
    const float dn0 = 2 * c < nh ? den_sh[2 * c] : 1.f;
    const float dn1 = 2 * c + 1 < nh ? den_sh[2 * c + 1] : 1.f;
#pragma unroll
    for (int i = 0; i < kMaxTilesPerWarp; ++i) {
      const int tile = warp + kWarps * i;
      if (tile >= n_tiles) break;
      const int d = 16 * tile + g;
      of[(2 * c) * os + d] = detail::round_bf16(__fdiv_rn(acc[i][0], dn0));
      of[(2 * c + 1) * os + d] = detail::round_bf16(__fdiv_rn(acc[i][1], dn1));
      of[(2 * c) * os + d + 8] = detail::round_bf16(__fdiv_rn(acc[i][2], dn0));
      of[(2 * c + 1) * os + d + 8] = detail::round_bf16(__fdiv_rn(acc[i][3], dn1));
    }
  }
  __syncthreads();
  const int r0 = hd - 2 * half;
  for (int i = tid; i < nh * (hd / 2); i += kThreads) {
    const int h = i / (hd / 2), e = 2 * (i - h * (hd / 2));
    float pr[2] = {of[h * os + e], of[h * os + e + 1]};
    if (e >= r0) {
      float cs, sn;
      ew::rope_cos_sin(pos, rope.freqs[(e - r0) / 2], true, &cs, &sn);
      ew::rope_pair(pr, cs, sn);
    }
    *reinterpret_cast<float2*>(out + (int64_t(t) * H + h0 + h) * hd + e) =
        make_float2(pr[0], pr[1]);
  }
}

}  // namespace

bool sparse_attn_mma(const float* q, int T, int H, int hd, const float* const* window, int n_window,
                     const int32_t* topk, int k, const uint16_t* ckv, const float* sink,
                     float scale, float* out, cudaStream_t stream, const uint16_t* const* ckv_ref,
                     const AttnRope& rope) {
  require(T >= 0 && H > 0 && hd > 0 && n_window >= 0 && k >= 0,
          "sparse_attn_mma: bad shape T=%d H=%d hd=%d n_window=%d k=%d", T, H, hd, n_window, k);
  require(n_window == 0 || window, "sparse_attn_mma: n_window=%d but no window slot array",
          n_window);
  require(k == 0 || (topk && (ckv || ckv_ref)), "sparse_attn_mma: k=%d but topk or ckv is null", k);
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(out)) & 15u) == 0;
  const bool rope_ok = !rope.freqs || (rope.rope_dim > 0 && rope.rope_dim % 2 == 0 &&
                                       rope.rope_dim <= hd && (hd - rope.rope_dim) % 2 == 0);
  if (hd % 32 != 0 || hd > kMaxHd || !aligned || !rope_ok || (H + kHeads - 1) / kHeads > 65535 ||
      n_window + k == 0)
    return false;
  if (T == 0) return true;
  const AttnMmaSmem L = smem_layout(hd);
  static detail::PerDeviceOnce once;
  once([&] {
    UF_CUDA_CHECK(cudaFuncSetAttribute(sparse_attn_mma_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(smem_layout(kMaxHd).total)));
    detail::prefer_shared_carveout(sparse_attn_mma_kernel);
  });
  const dim3 grid(unsigned(T), unsigned((H + kHeads - 1) / kHeads));
  detail::launch_pdl(sparse_attn_mma_kernel, grid, dim3(kThreads), L.total, stream, q, H, hd,
                     window, n_window, topk, k, ckv, ckv_ref, sink, scale, rope, out);
  return true;
}

}  // namespace uf::cuda
