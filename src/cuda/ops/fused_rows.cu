// row_chains of ops/elementwise.h: short op sequences of the decode attention block in one launch.
//
// Every launch costs ~2-3 us whatever it does; the rows here are tiny (a 512-value KV row, a few
// index query heads), so the sequences norm -> rope -> qdq -> copy each used to be 3-5 launches of
// a microsecond of work. One block per row of one chain (256 threads); the block runs the chain's
// stages in order in place on the row in global memory, with a barrier between stages
// (__syncthreads orders a block's global writes before its later reads). Each stage is the
// standalone op's arithmetic on the same elements:
//  - pool: compress_pool_kernel's per-channel formula (ops/misc.cu), then ew::round_bf16 as
//    round_bf16_kernel;
//  - scale_round: scale_round_bf16_kernel's __fmul_rn + __float2bfloat16_rn;
//  - norm: rms_norm_kernel's partition (norm_threads(n) threads, kNormVec float4 per thread, the
//    same load modes and block_sum_warps order) on the first norm_threads(n) threads;
//  - rope: ew::rope_cos_sin / ew::rope_pair, as rope_kernel;
//  - qdq: a block's amax (a max: exact in any order) then ew::qdq_scale / ew::qdq_value, as
//    qdq_kernel;
//  - copy / ring / window slots: copies and pointer arithmetic as the backend kernels.
//
// Two kernels, the same stages and the same bits. row_chains_kernel (the first version, kept for
// rows longer than kFastMaxRow and selectable with env UF_ROW_CHAINS_LEGACY=1) runs the stages in
// place on y in global memory. row_chains_fast_kernel (the default; ~9 us a call on the H200 was
// dependent global round trips, not work) keeps the row in shared memory from its first load to
// its last store: one read of y (or of the pool's rows), the stages on shared memory, one write
// of y and of the copy / ring rows. Before griddepcontrol.wait it reads what no kernel of a step
// writes: the norm weights (into the registers of the norm partition) and the rope frequencies
// (model weights), and the step block's values (positions, ring / copy destination pointers and
// row counts, the slot list's p0 / ring / positions): every caller passes those from the span or
// commit block (cuda_ring_span.cpp, cuda_dspark.cpp: a cudaMemcpyAsync of the host block at the
// head of the program, which completes before the first kernel starts; no kernel writes the
// block) or from host-uploaded pointer tables (cuda_model.cpp's pool pointers), so the rope's
// cos / sin (double sincos) are computed before the wait too. What an earlier kernel writes (the
// rows, the pool's source rows) is read after it; the stores all come after it.

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/ops/elementwise.h"
#include "cuda/ops/elementwise_common.cuh"

namespace uf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxHalf = 256;  // rope_dim <= 512, as rope()

struct ChainParams {
  RowChain c[kMaxRowChains];
  int mode[kMaxRowChains];            // the norm's load mode (ew::row_mode)
  int first[kMaxRowChains + 1] = {};  // chain k owns blocks [first[k], first[k + 1])
  int n_chains = 0;
  WindowSlotsJob slots;  // blocks [first[n_chains], first[n_chains] + slots.T)
};

// The fast kernel keeps a row of up to kFastMaxRow floats in dynamic shared memory (48 KB: no
// opt-in attribute needed); longer rows take the in-place kernel.
constexpr int kFastMaxRow = 12288;

// rms_norm_kernel on the first NT = norm_threads(n) threads of the block, in place on y.
template <int kMode>
__device__ void norm_stage(const DeviceWeight& w, float eps, float* y, int n, float* red) {
  const int NT = ew::norm_threads(n), i = threadIdx.x, nv = (n + 3) / 4;
  const bool active = i < NT;
  float4 v[ew::kNormVec], wv[ew::kNormVec];
  float ss = 0.f;
  if (active) {
#pragma unroll
    for (int j = 0; j < ew::kNormVec; ++j) {
      const int qe = min(i + j * NT, nv - 1);
      v[j] = ew::load_row4<kMode>(y, 4 * qe, n);
      wv[j] = ew::load_weight4<kMode>(w, 4 * qe, n);
    }
#pragma unroll
    for (int j = 0; j < ew::kNormVec; ++j) {
      const int q = i + j * NT;
      if (q < nv) ss = ew::add_squares4(ss, v[j], 4 * q, n);
    }
    for (int q = i + ew::kNormVec * NT; q < nv; q += NT)
      ss = ew::add_squares4(ss, ew::load_row4<kMode>(y, 4 * q, n), 4 * q, n);
  }
  const float r = ew::rms_factor(ew::block_sum_warps(ss, NT / 32, red), n, eps);
  if (active) {
#pragma unroll
    for (int j = 0; j < ew::kNormVec; ++j) {
      const int q = i + j * NT;
      if (q < nv) ew::store_row4<kMode>(y, 4 * q, n, ew::norm_out4(v[j], wv[j], r));
    }
    for (int q = i + ew::kNormVec * NT; q < nv; q += NT)
      ew::store_row4<kMode>(y, 4 * q, n,
                            ew::norm_out4(ew::load_row4<kMode>(y, 4 * q, n),
                                          ew::load_weight4<kMode>(w, 4 * q, n), r));
  }
}

// qdq_kernel over the row's n / block quantisation blocks: a block on L = min(block, 32) lanes of
// a warp; the loop bound is uniform over the warp (every lane reaches the shuffles).
template <ew::QdqFormat kKind>
__device__ void qdq_stage(float* y, int n, int block) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, L = block < 32 ? block : 32;
  const int per_warp = 32 / L, nb = n / block;
  for (int b0 = warp * per_warp; b0 < nb; b0 += (kThreads / 32) * per_warp) {
    const int b = b0 + lane / L;
    const bool ok = b < nb;
    float* p = y + (ok ? b : 0) * block + lane % L;
    float amax = 0.f;
    if (ok)
      for (int i = 0; i < block; i += L) amax = ew::smax(amax, fabsf(p[i]));
    for (int o = L / 2; o > 0; o >>= 1)
      amax = ew::smax(amax, __shfl_xor_sync(0xffffffffu, amax, o, L));
    if (ok) {
      const float s = ew::qdq_scale<kKind>(amax);
      for (int i = 0; i < block; i += L) p[i] = ew::qdq_value<kKind>(p[i], s);
    }
  }
}

__device__ void copy_row(float* dst, const float* src, int n) {
  for (int i = threadIdx.x; i < n; i += kThreads) dst[i] = src[i];
}
__device__ void copy_row_bf16(uint16_t* dst, const float* src, int n) {
  for (int i = threadIdx.x; i < n; i += kThreads)
    dst[i] = __bfloat16_as_ushort(__float2bfloat16_rn(src[i]));
}

__global__ void __launch_bounds__(kThreads)
    row_chains_kernel(const __grid_constant__ ChainParams p) {
  __shared__ float red[32];
  __shared__ float cs[kMaxHalf], sn[kMaxHalf];
  // Every input (rows, positions, pointers in the span block) may come from earlier kernels.
  detail::pdl_wait();
  detail::pdl_trigger();
  const int b = blockIdx.x, tid = threadIdx.x;
  if (b >= p.first[p.n_chains]) {  // build_window_slots, row t
    const WindowSlotsJob& s = p.slots;
    const int t = b - p.first[p.n_chains];
    const int64_t p0 = *s.p0;
    const float* ring = *s.ring;
    for (int j = tid; j < s.W; j += kThreads) {
      const int64_t qpos = s.pos[t] - s.W + 1 + j;
      const float* v = nullptr;
      if (qpos >= p0)
        v = s.local + (qpos - p0) * s.hd;
      else if (qpos >= 0)
        v = ring + (qpos % s.ring_slots) * s.hd;
      s.out[int64_t(t) * s.W + j] = v;
    }
    return;
  }
  int k = 0;
  while (b >= p.first[k + 1]) ++k;
  const RowChain& c = p.c[k];
  const int row = b - p.first[k], n = c.n;
  float* y = c.y + int64_t(row) * n;

  if (c.pool_kv) {
    const float* const* kr = c.pool_kv + int64_t(row) * c.pool_r;
    const float* const* gr = c.pool_gate + int64_t(row) * c.pool_r;
    for (int ch = tid; ch < n; ch += kThreads) {
      float mx = gr[0][ch];
      for (int t = 1; t < c.pool_r; ++t) mx = ew::smax(mx, gr[t][ch]);
      float sum = 0.f;
      for (int t = 0; t < c.pool_r; ++t) sum = ew::fadd(sum, expf(ew::fsub(gr[t][ch], mx)));
      float acc = 0.f;
      for (int t = 0; t < c.pool_r; ++t)
        acc = ew::fadd(acc, ew::fmul(kr[t][ch], ew::fdiv(expf(ew::fsub(gr[t][ch], mx)), sum)));
      y[ch] = c.pool_round ? ew::round_bf16(acc) : acc;
    }
    __syncthreads();
  }
  if (c.scale_round) {
    for (int i = tid; i < n; i += kThreads)
      y[i] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(y[i], c.scale)));
    __syncthreads();
  }
  if (c.norm.data) {
    switch (p.mode[k]) {
      case ew::kRowVecF32:
        norm_stage<ew::kRowVecF32>(c.norm, c.eps, y, n, red);
        break;
      case ew::kRowVecBF16:
        norm_stage<ew::kRowVecBF16>(c.norm, c.eps, y, n, red);
        break;
      default:
        norm_stage<ew::kRowScalar>(c.norm, c.eps, y, n, red);
        break;
    }
    __syncthreads();
  }
  if (c.freqs) {
    const int half = c.rope_dim / 2, vn = n / c.count;
    const int64_t pos = c.positions ? c.positions[row] : c.p0 + int64_t(row) * c.stride;
    for (int i = tid; i < half; i += kThreads)
      ew::rope_cos_sin(pos, c.freqs[i], c.inverse, &cs[i], &sn[i]);
    __syncthreads();
    for (int q = tid; q < c.count * half; q += kThreads) {
      const int h = q / half, i = q % half;
      ew::rope_pair(y + int64_t(h) * vn + (vn - c.rope_dim) + 2 * i, cs[i], sn[i]);
    }
    __syncthreads();
  }
  switch (c.qdq) {
    case QdqKind::kFp8:
      qdq_stage<ew::QdqFormat::kFp8>(y, n, c.qdq_block);
      break;
    case QdqKind::kFp4E4m3:
      qdq_stage<ew::QdqFormat::kFp4E4m3>(y, n, c.qdq_block);
      break;
    case QdqKind::kFp4E8m0:
      qdq_stage<ew::QdqFormat::kFp4E8m0>(y, n, c.qdq_block);
      break;
    default:
      break;
  }
  __syncthreads();
  if (c.copy_dst && row < *c.copy_n) copy_row(*c.copy_dst + int64_t(row) * n, y, n);
  if (c.copy_dst_bf16 && row < *c.copy_n) copy_row_bf16(*c.copy_dst_bf16 + int64_t(row) * n, y, n);
  if (c.ring && row >= c.rows - c.ring_slots)  // a later row of the chain takes the same slot
    copy_row(*c.ring + (c.ring_pos[row] % c.ring_slots) * n, y, n);
  if (c.y_bf16) copy_row_bf16(c.y_bf16 + int64_t(row) * n, y, n);
}

// ---- row_chains_fast_kernel ----

// The row's n floats between global memory and shared memory (16-byte pieces where both ends
// allow: the same values either way).
__device__ __forceinline__ void row_to_smem(float* s, const float* g, int n) {
  if ((n & 3) == 0 && (reinterpret_cast<uintptr_t>(g) & 15) == 0) {
    for (int i = threadIdx.x; i < n / 4; i += kThreads)
      reinterpret_cast<float4*>(s)[i] = reinterpret_cast<const float4*>(g)[i];
  } else {
    for (int i = threadIdx.x; i < n; i += kThreads) s[i] = g[i];
  }
}
__device__ __forceinline__ void row_from_smem(float* g, const float* s, int n) {
  if ((n & 3) == 0 && (reinterpret_cast<uintptr_t>(g) & 15) == 0) {
    for (int i = threadIdx.x; i < n / 4; i += kThreads)
      reinterpret_cast<float4*>(g)[i] = reinterpret_cast<const float4*>(s)[i];
  } else {
    for (int i = threadIdx.x; i < n; i += kThreads) g[i] = s[i];
  }
}

// One row of chain c (block-uniform), every stage on the row in shared memory `srow` (16-byte
// aligned). kMode: the norm's load mode (kRowScalar when there is no norm).
template <int kMode>
__device__ void fast_chain(const RowChain& c, int row, float* srow, float* red, float* cs,
                           float* sn) {
  const int tid = threadIdx.x, n = c.n;
  float* y = c.y + int64_t(row) * n;
  // Before the wait (see the file comment): the norm weights of this thread's vectors, the rope's
  // cos / sin, the copy / ring destinations.
  const int NT = ew::norm_threads(n), nv = (n + 3) / 4;
  const bool norm = c.norm.data != nullptr, active = norm && tid < NT;
  float4 wv[ew::kNormVec];
#pragma unroll
  for (int j = 0; j < ew::kNormVec; ++j) {
    wv[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (active) wv[j] = ew::load_weight4<kMode>(c.norm, 4 * min(tid + j * NT, nv - 1), n);
  }
  float* ring_dst = nullptr;
  if (c.ring && row >= c.rows - c.ring_slots)  // a later row of the chain takes the same slot
    ring_dst = *c.ring + (c.ring_pos[row] % c.ring_slots) * n;
  float* copy_dst = nullptr;
  if (c.copy_dst && row < *c.copy_n) copy_dst = *c.copy_dst + int64_t(row) * n;
  uint16_t* copy_bf16 = c.y_bf16 ? c.y_bf16 + int64_t(row) * n : nullptr;
  if (c.copy_dst_bf16 && row < *c.copy_n) copy_bf16 = *c.copy_dst_bf16 + int64_t(row) * n;
  const int half = c.rope_dim / 2;
  if (c.freqs) {
    const int64_t pos = c.positions ? c.positions[row] : c.p0 + int64_t(row) * c.stride;
    for (int i = tid; i < half; i += kThreads)
      ew::rope_cos_sin(pos, c.freqs[i], c.inverse, &cs[i], &sn[i]);
  }
  detail::pdl_trigger();
  detail::pdl_wait();

  // 1. The row into shared memory: pooled, or y's values.
  if (c.pool_kv) {
    const float* const* kr = c.pool_kv + int64_t(row) * c.pool_r;
    const float* const* gr = c.pool_gate + int64_t(row) * c.pool_r;
    for (int ch = tid; ch < n; ch += kThreads) {
      float mx = gr[0][ch];
      for (int t = 1; t < c.pool_r; ++t) mx = ew::smax(mx, gr[t][ch]);
      float sum = 0.f;
      for (int t = 0; t < c.pool_r; ++t) sum = ew::fadd(sum, expf(ew::fsub(gr[t][ch], mx)));
      float acc = 0.f;
      for (int t = 0; t < c.pool_r; ++t)
        acc = ew::fadd(acc, ew::fmul(kr[t][ch], ew::fdiv(expf(ew::fsub(gr[t][ch], mx)), sum)));
      srow[ch] = c.pool_round ? ew::round_bf16(acc) : acc;
    }
  } else {
    row_to_smem(srow, y, n);
  }
  __syncthreads();
  // 2. scale_round.
  if (c.scale_round) {
    for (int i = tid; i < n; i += kThreads)
      srow[i] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(srow[i], c.scale)));
    __syncthreads();
  }
  // 3. rms_norm_kernel's partition, weights already in registers.
  if (norm) {
    float4 v[ew::kNormVec];
    float ss = 0.f;
    if (active) {
#pragma unroll
      for (int j = 0; j < ew::kNormVec; ++j)
        v[j] = ew::load_row4<kMode>(srow, 4 * min(tid + j * NT, nv - 1), n);
#pragma unroll
      for (int j = 0; j < ew::kNormVec; ++j) {
        const int q = tid + j * NT;
        if (q < nv) ss = ew::add_squares4(ss, v[j], 4 * q, n);
      }
      for (int q = tid + ew::kNormVec * NT; q < nv; q += NT)
        ss = ew::add_squares4(ss, ew::load_row4<kMode>(srow, 4 * q, n), 4 * q, n);
    }
    // Its barriers also order every thread's reads of srow above before the stores below.
    const float r = ew::rms_factor(ew::block_sum_warps(ss, NT / 32, red), n, c.eps);
    if (active) {
#pragma unroll
      for (int j = 0; j < ew::kNormVec; ++j) {
        const int q = tid + j * NT;
        if (q < nv) ew::store_row4<kMode>(srow, 4 * q, n, ew::norm_out4(v[j], wv[j], r));
      }
      for (int q = tid + ew::kNormVec * NT; q < nv; q += NT)
        ew::store_row4<kMode>(srow, 4 * q, n,
                              ew::norm_out4(ew::load_row4<kMode>(srow, 4 * q, n),
                                            ew::load_weight4<kMode>(c.norm, 4 * q, n), r));
    }
    __syncthreads();
  }
  // 4. rope (cs / sn were written before the barriers above).
  if (c.freqs) {
    const int vn = n / c.count;
    for (int q = tid; q < c.count * half; q += kThreads) {
      const int h = q / half, i = q % half;
      ew::rope_pair(srow + int64_t(h) * vn + (vn - c.rope_dim) + 2 * i, cs[i], sn[i]);
    }
    __syncthreads();
  }
  // 5. qdq.
  if (c.qdq != QdqKind::kNone) {
    switch (c.qdq) {
      case QdqKind::kFp8:
        qdq_stage<ew::QdqFormat::kFp8>(srow, n, c.qdq_block);
        break;
      case QdqKind::kFp4E4m3:
        qdq_stage<ew::QdqFormat::kFp4E4m3>(srow, n, c.qdq_block);
        break;
      default:
        qdq_stage<ew::QdqFormat::kFp4E8m0>(srow, n, c.qdq_block);
        break;
    }
    __syncthreads();
  }
  // 6, 7, 8. The row's one write, its copy and its ring slot; its bf16 copy.
  row_from_smem(y, srow, n);
  if (copy_dst) row_from_smem(copy_dst, srow, n);
  if (ring_dst) row_from_smem(ring_dst, srow, n);
  if (copy_bf16) copy_row_bf16(copy_bf16, srow, n);
}

__global__ void __launch_bounds__(kThreads)
    row_chains_fast_kernel(const __grid_constant__ ChainParams p) {
  extern __shared__ __align__(16) float srow[];  // [max n]
  __shared__ float red[32];
  __shared__ float cs[kMaxHalf], sn[kMaxHalf];
  const int b = blockIdx.x, tid = threadIdx.x;
  if (b >= p.first[p.n_chains]) {  // build_window_slots, row t: its inputs before the wait
    const WindowSlotsJob& s = p.slots;
    const int t = b - p.first[p.n_chains];
    const int64_t p0 = *s.p0, pt = s.pos[t];
    const float* ring = *s.ring;
    detail::pdl_trigger();
    detail::pdl_wait();  // the previous kernels may still read the slot list
    for (int j = tid; j < s.W; j += kThreads) {
      const int64_t qpos = pt - s.W + 1 + j;
      const float* v = nullptr;
      if (qpos >= p0)
        v = s.local + (qpos - p0) * s.hd;
      else if (qpos >= 0)
        v = ring + (qpos % s.ring_slots) * s.hd;
      s.out[int64_t(t) * s.W + j] = v;
    }
    return;
  }
  int k = 0;
  while (b >= p.first[k + 1]) ++k;
  const int row = b - p.first[k];
  switch (p.mode[k]) {
    case ew::kRowVecF32:
      fast_chain<ew::kRowVecF32>(p.c[k], row, srow, red, cs, sn);
      break;
    case ew::kRowVecBF16:
      fast_chain<ew::kRowVecBF16>(p.c[k], row, srow, red, cs, sn);
      break;
    default:
      fast_chain<ew::kRowScalar>(p.c[k], row, srow, red, cs, sn);
      break;
  }
}

}  // namespace

void row_chains(const RowChain* chains, int n_chains, const WindowSlotsJob* slots,
                cudaStream_t stream) {
  require(n_chains >= 0 && n_chains <= kMaxRowChains, "row_chains: %d chains (at most %d)",
          n_chains, kMaxRowChains);
  ChainParams p;
  p.n_chains = n_chains;
  for (int k = 0; k < n_chains; ++k) {
    const RowChain& c = chains[k];
    require(c.rows >= 0 && c.n > 0 && c.y, "row_chains: chain %d has %d rows of %d at %p", k,
            c.rows, c.n, static_cast<const void*>(c.y));
    if (c.pool_kv)
      require(c.pool_gate && c.pool_r >= 1, "row_chains: chain %d pools ratio %d", k, c.pool_r);
    if (!c.norm.empty()) {
      require(c.norm.rows * c.norm.cols == c.n,
              "row_chains: chain %d's norm weight has %lld x %lld elements, expected %d", k,
              (long long)c.norm.rows, (long long)c.norm.cols, c.n);
      require(c.n <= kRowChainMaxNorm && ew::norm_threads(c.n) <= kThreads,
              "row_chains: chain %d's norm of %d values needs more than %d threads", k, c.n,
              kThreads);
    }
    if (c.freqs)
      require(c.count >= 1 && c.n % c.count == 0 && c.rope_dim > 0 && c.rope_dim % 2 == 0 &&
                  c.rope_dim <= 2 * kMaxHalf && c.rope_dim <= c.n / c.count,
              "row_chains: chain %d rotates %d channels of %d vectors of a %d-value row", k,
              c.rope_dim, c.count, c.n);
    if (c.qdq != QdqKind::kNone)
      require(c.qdq_block > 0 && c.n % c.qdq_block == 0 &&
                  ((c.qdq_block < 32 && 32 % c.qdq_block == 0) || c.qdq_block % 32 == 0),
              "row_chains: chain %d quantises blocks of %d in rows of %d", k, c.qdq_block, c.n);
    if (c.copy_dst || c.copy_dst_bf16)
      require(c.copy_n, "row_chains: chain %d copies without a row count", k);
    require(!(c.copy_dst_bf16 && c.y_bf16),
            "row_chains: chain %d has both a bf16 copy and a bf16 row output", k);
    if (c.ring)
      require(c.ring_pos && c.ring_slots > 0, "row_chains: chain %d puts into a ring of %d slots",
              k, c.ring_slots);
    p.c[k] = c;
    p.mode[k] = c.norm.empty() ? ew::kRowScalar : ew::row_mode(c.n, c.y, c.y, c.norm);
    p.first[k + 1] = p.first[k] + c.rows;
  }
  int blocks = p.first[n_chains];
  if (slots && slots->T > 0 && slots->W > 0) {
    p.slots = *slots;
    blocks += slots->T;
  }
  if (blocks == 0) return;
  int max_n = 0;
  for (int k = 0; k < n_chains; ++k) max_n = std::max(max_n, chains[k].n);
  const char* legacy = std::getenv("UF_ROW_CHAINS_LEGACY");
  if (max_n <= kFastMaxRow && !(legacy && legacy[0] == '1'))
    detail::launch_pdl(row_chains_fast_kernel, dim3(unsigned(blocks)), dim3(kThreads),
                       size_t(std::max(max_n, 4)) * sizeof(float), stream, p);
  else
    detail::launch_pdl(row_chains_kernel, dim3(unsigned(blocks)), dim3(kThreads), 0, stream, p);
}

}  // namespace uf::cuda
