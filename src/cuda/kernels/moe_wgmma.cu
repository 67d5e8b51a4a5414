// Routed-expert MoE decode kernels on wgmma (sm_90a). Interface and numerics: moe_wgmma.h.
//
// Both kernels put 64 weight rows of one expert in the A operand of wgmma m64n8k32 (4 warps x 16
// rows, from registers: the MXFP4 bytes placed into e4m3 by e2m1x8_to_e4m3_scaled, as MoeFp4's
// mma.sync kernels do) and the slot's columns (the rows of the call that chose this expert, at
// most 8) in B, from shared memory (wgmma.cuh's no-swizzle K-major layout, one 256-byte block per
// K block). Absent columns (>= the slot's count) are zero in B; their results are never stored.
// K order inside a block (A and B alike; a block's sum does not depend on it): thread t's 4 bytes
// at 4t of a row's 16-byte block are elements 8t..8t+7, which e2m1x8_to_e4m3_scaled splits into
// the even ones (fragment positions 4t..4t+3) and the odd ones (16+4t..16+4t+3); so B's first
// 16-byte K half holds the block's even elements, its second half the odd ones.
//
// Kernel 1, w13 + SwiGLU: a cluster of C CTAs (C = 4, 2 or 1, the largest with K/32/C % 4 == 0:
//   a function of K only) = one unit (slot u, 32-feature group rg of I); cluster rank r holds K
//   blocks [r K/32/C, (r+1) K/32/C) of 64 rows: A rows 0-31 = w1 features rg*32.., 32-63 = w3's.
//   One warpgroup (128 threads). All of a CTA's weight bytes are in flight at once (cp.async, one
//   commit group per 8 K blocks so that compute starts on the first); meanwhile the activations
//   are loaded, deinterleaved and stored as B. Per 8 K blocks: 8 wgmmas (accumulate off: one
//   block partial each) in one commit group, then acc = fmaf(d * (sa * 2^6), sw, acc) in K order.
//   The CTA's [64][8] partial goes to shared memory; after a cluster barrier rank r sums features
//   [r 32/C, (r+1) 32/C) over the ranks in rank order (rank 0's value, then += ranks 1..C-1),
//   applies MoeFp4's SwiGLU (bf16 g / u, clamps, h = bf16(w silu(g) u)) and stores h_vals; a
//   second cluster barrier keeps each partial alive until it was read. K = 5120: C = 4, 40 K
//   blocks (43.5 KB of weights) and 65 KB of shared memory a CTA; grid P * I/32 * C (slot-major:
//   slots beyond the distinct experts exit at once).
// Kernel 2, w2: CTA = (slot u, 128 output rows) = two warpgroups of 64 rows, over all of I. The
//   plan and all weights (128 x (I/2 + I/32) bytes) are issued BEFORE griddepcontrol.wait (kernel
//   1 triggers after its own wait, so topk_idx is complete); after it, h of the slot's columns is
//   quantised per 32 (warp_quant_fp8_block: MoeFp4's codes and scales) straight into B. 4 K
//   blocks per commit group.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/moe_plan.cuh"
#include "cuda/kernels/moe_wgmma.h"
#include "cuda/kernels/wgmma.cuh"

// The kernels' bodies exist for sm_90a only (UF_HAVE_WGMMA): other device passes (sm_100a) see
// the helpers below unreferenced.
#pragma nv_diag_suppress 177

namespace uf::cuda {
namespace {

using namespace detail;

__host__ __device__ __forceinline__ int round_up(int n, int a) { return (n + a - 1) / a * a; }

// B of one K block: [K half][column 8][16 bytes], the halves kBHalf bytes apart (the descriptor's
// LBO); block j at j * kBBlockBytes.
constexpr int kBBlockBytes = 256;
constexpr uint32_t kBHalf = 128;

// Column `col` of a B block from the column's 32 FP8 codes at src (8-byte aligned): the even
// elements to the first K half, the odd ones to the second.
__device__ __forceinline__ void store_b_column(uint8_t* blk, int col, const uint8_t* src) {
  const uint2* s = reinterpret_cast<const uint2*>(src);
  const uint2 v0 = __ldg(s), v1 = __ldg(s + 1), v2 = __ldg(s + 2), v3 = __ldg(s + 3);
  *reinterpret_cast<uint4*>(blk + col * 16) =
      make_uint4(__byte_perm(v0.x, v0.y, 0x6420), __byte_perm(v1.x, v1.y, 0x6420),
                 __byte_perm(v2.x, v2.y, 0x6420), __byte_perm(v3.x, v3.y, 0x6420));
  *reinterpret_cast<uint4*>(blk + kBHalf + col * 16) =
      make_uint4(__byte_perm(v0.x, v0.y, 0x7531), __byte_perm(v1.x, v1.y, 0x7531),
                 __byte_perm(v2.x, v2.y, 0x7531), __byte_perm(v3.x, v3.y, 0x7531));
}
__device__ __forceinline__ void zero_b_column(uint8_t* blk, int col) {
  *reinterpret_cast<uint4*>(blk + col * 16) = make_uint4(0u, 0u, 0u, 0u);
  *reinterpret_cast<uint4*>(blk + kBHalf + col * 16) = make_uint4(0u, 0u, 0u, 0u);
}

// cp.async.wait_group with a run-time count (the immediate it needs, up to 7; more waits for all).
__device__ __forceinline__ void cp_async_wait_upto(int pending) {
  switch (pending) {
    case 0:
      cp_async_wait<0>();
      break;
    case 1:
      cp_async_wait<1>();
      break;
    case 2:
      cp_async_wait<2>();
      break;
    case 3:
      cp_async_wait<3>();
      break;
    case 4:
      cp_async_wait<4>();
      break;
    case 5:
      cp_async_wait<5>();
      break;
    case 6:
      cp_async_wait<6>();
      break;
    case 7:
      cp_async_wait<7>();
      break;
    default:
      cp_async_wait<0>();
      break;
  }
}

__device__ __forceinline__ float ld_cluster_f32(uint32_t remote) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// acc (+)= K blocks [j0, j0 + nb) (nb <= kBatch, the same in the whole warpgroup) of this warp's
// 16 rows x 8 columns: per block the wgmma partial d, then acc[i] = fmaf(d[i] * sa, sw, acc[i]) in
// block order (d[0] / d[1]: row g, columns 2t / 2t + 1; d[2] / d[3]: row g + 8). wa = the warp's
// row g at block 0 with the lane's 4 t included (row g + 8 at + 8 rs); desc0 = B block 0's
// descriptor (block j: + 16 j, its address in 16-byte units). scales(j, sw0, sw1, sa0, sa1): block
// j's weight scales of rows g / g + 8 and activation scales (times 2^6) of columns 2t / 2t + 1.
template <int kBatch, typename Scales>
__device__ __forceinline__ void wg_fp4_blocks(const uint8_t* wa, int rs, uint64_t desc0, int j0,
                                              int nb, const Scales& scales, float (&acc)[4]) {
  // Every one of the kBatch wgmmas is issued (blocks past nb with A = 0 on block j0's B, their
  // partials unused): a wgmma under a condition makes ptxas serialise the batch, and the
  // accumulators are pinned (wgmma_fence_operand) outside the issue sequence for the same reason.
  uint32_t a[kBatch][4];
  float d[kBatch][4];
#pragma unroll
  for (int jj = 0; jj < kBatch; ++jj) {
    d[jj][0] = d[jj][1] = d[jj][2] = d[jj][3] = 0.f;
    a[jj][0] = a[jj][1] = a[jj][2] = a[jj][3] = 0u;
    if (jj < nb) {
      const uint8_t* w = wa + (j0 + jj) * 16;
      e2m1x8_to_e4m3_scaled(*reinterpret_cast<const uint32_t*>(w), a[jj][0], a[jj][2]);
      e2m1x8_to_e4m3_scaled(*reinterpret_cast<const uint32_t*>(w + 8 * rs), a[jj][1], a[jj][3]);
    }
    wgmma_fence_operand(d[jj]);
  }
  wgmma_fence();
#pragma unroll
  for (int jj = 0; jj < kBatch; ++jj)
    wgmma_e4m3_rs(d[jj], a[jj], desc0 + uint64_t(16 * (jj < nb ? j0 + jj : j0)), false);
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int jj = 0; jj < kBatch; ++jj) wgmma_fence_operand(d[jj]);
#pragma unroll
  for (int jj = 0; jj < kBatch; ++jj) {
    if (jj < nb) {
      float sw0, sw1, sa0, sa1;
      scales(j0 + jj, sw0, sw1, sa0, sa1);
      acc[0] = fmaf(d[jj][0] * sa0, sw0, acc[0]);
      acc[1] = fmaf(d[jj][1] * sa1, sw0, acc[1]);
      acc[2] = fmaf(d[jj][2] * sa0, sw1, acc[2]);
      acc[3] = fmaf(d[jj][3] * sa1, sw1, acc[3]);
    }
  }
}

// ---- Kernel 1: w13 + SwiGLU ----
constexpr int kW13Threads = 128;
constexpr int kW13Batch = 8;  // K blocks per commit group (and per cp.async group)

struct W13Layout {
  int C, nkbc, rs, w_off, sc_off, b_off, sa_off, part_off, total;
};
__host__ __device__ __forceinline__ W13Layout w13_layout(int dim) {
  W13Layout l;
  const int nkb = dim / 32;  // % 4 == 0
  l.C = nkb % 16 == 0 ? 4 : (nkb % 8 == 0 ? 2 : 1);
  l.nkbc = nkb / l.C;  // % 4 == 0: 4-byte scale pieces, float4 activation-scale reads
  l.rs = round_up(l.nkbc * 16 - 16, 128) + 16;  // = 16 mod 128: conflict-free fragment reads
  l.w_off = kPlanBytes;
  l.sc_off = l.w_off + 64 * l.rs;                   // [64 rows][nkbc] UE8M0
  l.b_off = round_up(l.sc_off + 64 * l.nkbc, 128);  // [nkbc][256] B blocks
  l.sa_off = l.b_off + l.nkbc * kBBlockBytes;       // [8 columns][nkbc] fp32, times 2^6
  l.part_off = l.sa_off + 8 * l.nkbc * 4;           // [64 rows][8 columns] fp32
  l.total = l.part_off + 64 * 8 * 4;
  return l;
}

struct W13Params {
  const uint8_t* w1;
  const uint8_t* w1s;
  const uint8_t* w3;
  const uint8_t* w3s;
  int E, dim, inter;
  const uint8_t* x;
  const float* xs;
  const int* topk_idx;
  const float* topk_w;
  int pairs, topk;
  float limit;
  float* h_vals;
};

__global__ void __launch_bounds__(kW13Threads, 3) moe_w13_wg_kernel(const W13Params p) {
#if UF_HAVE_WGMMA
  extern __shared__ __align__(128) uint8_t smem[];
  MoePlan& plan = *reinterpret_cast<MoePlan*>(smem);
  pdl_wait();
  pdl_trigger();  // after the wait: kernel 2 reads topk_idx before its own wait
  build_plan(p.topk_idx, p.topk_w, p.pairs, p.topk, p.E, plan);
  const W13Layout L = w13_layout(p.dim);
  const int groups = p.inter / 32;
  const int rank = int(cluster_ctarank());
  const int unit = int(blockIdx.x) / L.C;
  const int u = unit / groups, rg = unit - u * groups;
  if (u >= plan.n_unique) return;  // the whole cluster: its CTAs share the unit
  const SlotPlan& r = plan.slot[u];
  const int count = r.count;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int nkb = p.dim / 32, nkbc = L.nkbc, kb0 = rank * nkbc;
  const int nchunks = (nkbc + kW13Batch - 1) / kW13Batch;
  const size_t row_bytes = size_t(p.dim / 2);
  const size_t feat0 = size_t(r.expert) * p.inter + rg * 32;

  // The weights, chunk c = K blocks [8c, 8c + 8) of the 64 rows a commit group (a warp op copies
  // 4 rows x 128 B), the scales with chunk 0.
  for (int c = 0; c < nchunks; ++c) {
    const int nk = min(kW13Batch, nkbc - kW13Batch * c);
    for (int i = tid; i < 64 * kW13Batch; i += kW13Threads) {
      const int rr = i >> 3, cc = i & 7;
      if (cc < nk)
        moe_cp16(smem + L.w_off + rr * L.rs + (kW13Batch * c + cc) * 16,
                 (rr < 32 ? p.w1 : p.w3) + (feat0 + (rr & 31)) * row_bytes +
                     size_t(kb0 + kW13Batch * c + cc) * 16);
    }
    if (c == 0) {
      const int q = nkbc / 4;
      for (int i = tid; i < 64 * q; i += kW13Threads) {
        const int rr = i / q, cc = i - rr * q;
        moe_cp4(smem + L.sc_off + rr * nkbc + cc * 4,
                (rr < 32 ? p.w1s : p.w3s) + (feat0 + (rr & 31)) * nkb + kb0 + cc * 4);
      }
    }
    cp_async_commit();
  }
  // B and the activation scales while the weights are in flight.
  uint8_t* bsm = smem + L.b_off;
  float* sa = reinterpret_cast<float*>(smem + L.sa_off);
  for (int i = tid; i < 8 * nkbc; i += kW13Threads) {
    const int c = i & 7, j = i >> 3;
    uint8_t* blk = bsm + j * kBBlockBytes;
    if (c < count) {
      const int tok = r.tok[c];
      store_b_column(blk, c, p.x + size_t(tok) * p.dim + size_t(kb0 + j) * 32);
      sa[c * nkbc + j] = __ldg(p.xs + size_t(tok) * nkb + kb0 + j) * kE2M1ToE4M3Rescale;
    } else {
      zero_b_column(blk, c);
      sa[c * nkbc + j] = 0.f;
    }
  }
  fence_async_shared();  // B's stores before the async proxy (wgmma) reads them: the barrier below

  const int row = 16 * warp + g;
  const uint8_t* wa = smem + L.w_off + row * L.rs + 4 * t;
  const uint8_t* sc0 = smem + L.sc_off + row * nkbc;
  const uint8_t* sc1 = sc0 + 8 * nkbc;
  const float* sa0 = sa + (2 * t) * nkbc;
  const float* sa1 = sa0 + nkbc;
  const uint64_t desc0 = matrix_desc(bsm, kBHalf, kBBlockBytes);
  const auto scales = [&](int j, float& w0, float& w1, float& a0, float& a1) {
    w0 = e8m0_to_f32(sc0[j]);
    w1 = e8m0_to_f32(sc1[j]);
    a0 = sa0[j];
    a1 = sa1[j];
  };
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait_upto(nchunks - 1 - c);
    __syncthreads();  // every thread's pieces of chunk c (and, first, B) are in place
    wg_fp4_blocks<kW13Batch>(wa, L.rs, desc0, kW13Batch * c, min(kW13Batch, nkbc - kW13Batch * c),
                             scales, acc);
  }

  float* part = reinterpret_cast<float*>(smem + L.part_off);
  part[row * 8 + 2 * t] = acc[0];
  part[row * 8 + 2 * t + 1] = acc[1];
  part[(row + 8) * 8 + 2 * t] = acc[2];
  part[(row + 8) * 8 + 2 * t + 1] = acc[3];
  cluster_barrier();  // every rank's partial is in its shared memory
  const int F = 32 / L.C;
  for (int i = tid; i < F * 8; i += kW13Threads) {  // F * 8 = 256 outputs at C = 1
    const int f = rank * F + i % F, c = i / F;
    if (c < count) {
      const uint32_t base = uint32_t(__cvta_generic_to_shared(part));
      float vg[4], vu[4];
#pragma unroll
      for (int s = 0; s < 4; ++s) {  // all loads in flight at once
        vg[s] = vu[s] = 0.f;
        if (s < L.C) {
          const uint32_t rb = cluster_map(base, uint32_t(s));
          vg[s] = ld_cluster_f32(rb + uint32_t(f * 8 + c) * 4);
          vu[s] = ld_cluster_f32(rb + uint32_t((32 + f) * 8 + c) * 4);
        }
      }
      float ga = vg[0], ua = vu[0];  // rank order: rank 0's value, then += the next
#pragma unroll
      for (int s = 1; s < 4; ++s) {
        if (s < L.C) {
          ga += vg[s];
          ua += vu[s];
        }
      }
      float gate = round_bf16(ga);
      float upv = round_bf16(ua);
      if (p.limit > 0.f) {
        upv = fminf(fmaxf(upv, -p.limit), p.limit);
        gate = fminf(gate, p.limit);
      }
      const float silu = gate / (1.0f + expf(-gate));
      p.h_vals[size_t(r.pair[c]) * p.inter + rg * 32 + f] = round_bf16(r.weight[c] * (silu * upv));
    }
  }
  cluster_barrier();  // no CTA leaves while the cluster reads its partial
#else
  __trap();  // built without sm_90a features: moe_wgmma_supported() keeps the host away
#endif
}

// ---- Kernel 2: w2 ----
constexpr int kW2Threads = 256;
constexpr int kW2Rows = 128;  // two warpgroups of 64
constexpr int kW2Batch = 4;

struct W2Layout {
  int rs, w_off, sc_off, b_off, sa_off, total;
};
__host__ __device__ __forceinline__ W2Layout w2_layout(int inter) {
  W2Layout l;
  const int nkb = inter / 32;
  // Row stride = 16 mod 32 bytes: the 8 rows g of a 4-byte fragment read hit distinct banks.
  l.rs = inter / 2 + ((inter / 2) % 32 == 0 ? 16 : 0);
  l.w_off = kPlanBytes;
  l.sc_off = l.w_off + kW2Rows * l.rs;                // [128 rows][nkb] UE8M0
  l.b_off = round_up(l.sc_off + kW2Rows * nkb, 128);  // [nkb][256] B blocks
  l.sa_off = l.b_off + nkb * kBBlockBytes;            // [8 columns][nkb] fp32, times 2^6
  l.total = l.sa_off + 8 * nkb * 4;
  return l;
}

struct W2Params {
  const uint8_t* w2;
  const uint8_t* w2s;
  int E, dim, inter;
  const int* topk_idx;
  const float* topk_w;
  int pairs, topk;
  const float* h_vals;
  float* y;
  int64_t y_row_stride;
  bool round;
};

__global__ void __launch_bounds__(kW2Threads, 2) moe_w2_wg_kernel(const W2Params p) {
#if UF_HAVE_WGMMA
  extern __shared__ __align__(128) uint8_t smem[];
  MoePlan& plan = *reinterpret_cast<MoePlan*>(smem);
  // Before the wait: the plan (topk_idx is complete, see the header) and all the weights.
  build_plan(p.topk_idx, p.topk_w, p.pairs, p.topk, p.E, plan);
  const int nrb = p.dim / kW2Rows;
  const int u = int(blockIdx.x) / nrb, rb = int(blockIdx.x) - u * nrb;
  if (u >= plan.n_unique) return;  // uniform over the block
  const SlotPlan& r = plan.slot[u];
  const int count = r.count;
  const W2Layout L = w2_layout(p.inter);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int nkb = p.inter / 32;
  const size_t row0 = size_t(r.expert) * p.dim + size_t(rb) * kW2Rows;
  {
    // 128 rows x I/2 bytes (nkb 16-byte pieces a row) and 128 x nkb scale bytes, contiguous.
    const uint8_t* src = p.w2 + row0 * (p.inter / 2);
    for (int i = tid; i < kW2Rows * nkb; i += kW2Threads) {
      const int rr = i / nkb, cc = i - rr * nkb;
      moe_cp16(smem + L.w_off + rr * L.rs + cc * 16, src + size_t(i) * 16);
    }
    const uint8_t* ssrc = p.w2s + row0 * nkb;
    for (int i = tid; i < kW2Rows * nkb / 16; i += kW2Threads)
      moe_cp16(smem + L.sc_off + i * 16, ssrc + size_t(i) * 16);
    cp_async_commit();
  }
  pdl_wait();  // h from kernel 1
  pdl_trigger();
  // h of the slot's columns, quantised per 32 into B (element e of a block: K half e & 1,
  // position e / 2); absent columns zero.
  uint8_t* bsm = smem + L.b_off;
  float* sa = reinterpret_cast<float*>(smem + L.sa_off);
  for (int item = warp; item < 8 * nkb; item += kW2Threads / 32) {
    const int c = item / nkb, kb = item - c * nkb;
    uint8_t* dst = bsm + kb * kBBlockBytes + (lane & 1) * kBHalf + c * 16 + (lane >> 1);
    if (c < count) {  // warp-uniform
      const float h = __ldcg(p.h_vals + size_t(r.pair[c]) * p.inter + kb * 32 + lane);
      float sc;
      *dst = warp_quant_fp8_block(h, &sc);
      if (lane == 0) sa[c * nkb + kb] = sc * kE2M1ToE4M3Rescale;
    } else {
      *dst = 0;
      if (lane == 0) sa[c * nkb + kb] = 0.f;
    }
  }
  fence_async_shared();
  cp_async_wait<0>();
  __syncthreads();

  const int row = (warp >> 2) * 64 + 16 * (warp & 3) + g;  // in the CTA's 128
  const uint8_t* wa = smem + L.w_off + row * L.rs + 4 * t;
  const uint8_t* sc0 = smem + L.sc_off + row * nkb;
  const uint8_t* sc1 = sc0 + 8 * nkb;
  const float* sa0 = sa + (2 * t) * nkb;
  const float* sa1 = sa0 + nkb;
  const uint64_t desc0 = matrix_desc(bsm, kBHalf, kBBlockBytes);
  const auto scales = [&](int j, float& w0, float& w1, float& a0, float& a1) {
    w0 = e8m0_to_f32(sc0[j]);
    w1 = e8m0_to_f32(sc1[j]);
    a0 = sa0[j];
    a1 = sa1[j];
  };
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int j0 = 0; j0 < nkb; j0 += kW2Batch)
    wg_fp4_blocks<kW2Batch>(wa, L.rs, desc0, j0, min(kW2Batch, nkb - j0), scales, acc);

  const int row_out = rb * kW2Rows + row;
  auto out = [&](int pair) {
    return p.y + (pair / p.topk) * p.y_row_stride + size_t(pair % p.topk) * p.dim + row_out;
  };
  if (2 * t < count) {
    float* y = out(r.pair[2 * t]);
    y[0] = p.round ? round_bf16(acc[0]) : acc[0];
    y[8] = p.round ? round_bf16(acc[2]) : acc[2];
  }
  if (2 * t + 1 < count) {
    float* y = out(r.pair[2 * t + 1]);
    y[0] = p.round ? round_bf16(acc[1]) : acc[1];
    y[8] = p.round ? round_bf16(acc[3]) : acc[3];
  }
#else
  __trap();  // built without sm_90a features: moe_wgmma_supported() keeps the host away
#endif
}

}  // namespace

namespace detail {

bool moe_wgmma_supported(int dim, int inter) {
  if (dim <= 0 || inter <= 0 || dim % 128 != 0 || inter % 32 != 0) return false;
  int device = 0, major = 0, optin = 0;
  UF_CUDA_CHECK(cudaGetDevice(&device));
  UF_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  UF_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return major == 9 && w13_layout(dim).total <= optin && w2_layout(inter).total <= optin;
}

void moe_wgmma_prepare(int dim, int inter) {
  raise_smem(moe_w13_wg_kernel, w13_layout(dim).total);
  raise_smem(moe_w2_wg_kernel, w2_layout(inter).total);
  prefer_shared_carveout(moe_w13_wg_kernel);
  prefer_shared_carveout(moe_w2_wg_kernel);
}

void moe_wgmma_experts(const Fp4ExpertsView& w, const QuantActView& x, const int* topk_idx,
                       const float* topk_w, int topk, float swiglu_limit, float* h_vals,
                       bool round_w2, float* y, int64_t y_row_stride, cudaStream_t stream) {
  const int P = x.m * topk;
  const W13Layout L1 = w13_layout(w.dim);
  const W13Params a{w.w1,   w.w1_scale, w.w3,    w.w3_scale,   w.num_experts,
                    w.dim,  w.inter,    x.codes, x.scales,     topk_idx,
                    topk_w, P,          topk,    swiglu_limit, h_vals};
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(P * (w.inter / 32) * L1.C));
  cfg.blockDim = dim3(kW13Threads);
  cfg.dynamicSmemBytes = size_t(L1.total);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = unsigned(L1.C);
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 2;
  UF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_w13_wg_kernel, a));
  const W2Params b{w.w2, w.w2_scale, w.num_experts, w.dim, w.inter,      topk_idx, topk_w,
                   P,    topk,       h_vals,        y,     y_row_stride, round_w2};
  launch_pdl(moe_w2_wg_kernel, dim3(P * (w.dim / kW2Rows)), dim3(kW2Threads),
             size_t(w2_layout(w.inter).total), stream, b);
}

}  // namespace detail
}  // namespace uf::cuda
